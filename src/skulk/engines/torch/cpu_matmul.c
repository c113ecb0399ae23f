/* Matrix-vector kernels for decode steps on x86 CPUs with AVX2, FMA and F16C (engines/torch/cpu_kernels.py
 * compiles this file and cpu_step.c into one library and loads it; plain C with no Python or torch headers, so it
 * builds in about two seconds).
 *
 * y[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]) for a few rows r of activations x and a weight matrix w
 * stored [N, K] as the checkpoint has it:
 *   skulk_half_mv   w in f16 or bf16, widened to f32 as it streams past and multiplied with f32 activations;
 *   skulk_quant_mv  w in MLX's affine layout (4 or 8 bits per value, one f16 scale and bias per group of
 *                   `group` columns: w = scale * q + bias). Each activation row is quantized to int8 per group
 *                   (symmetric, one f32 scale), the group's dot product runs in integers (maddubs), and
 *                   scale * x_scale * dot(q, x_q) + bias * x_scale * sum(x_q) gives the group's contribution.
 * Activations (xtype) and outputs (ytype) are f32, f16 or bf16, converted at the edges so the caller allocates
 * nothing. Every weight byte is read once per call however many rows there are (rows are tiled inside a
 * block of weight rows), which is what makes a batched decode step cost about what a single one does.
 * Work is split across output rows with OpenMP; loaded into a process that has torch, this shares torch's
 * OpenMP runtime (same soname), so torch.set_num_threads governs it too.
 */
#include "cpu_kernels.h"

#define BLOCK_N 32    /* weight rows per unit of parallel work */
#define HALF_TILE 8   /* activation rows per pass over a weight row, float kernels */
#define QUANT_TILE 4  /* the same for quantized kernels (two accumulators per row must stay in registers) */
#define QACC(R) ((R) <= 2 ? 2 : 1)
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 2
#endif

/* ---- f16 / bf16 weights ------------------------------------------------------------------------------------- */
#define HALF_KERNEL(NAME, LOAD, R, U)                                                                            \
    static void NAME(const uint16_t *w, int n0, int n1, int K, int N, const float *x, float *out) {             \
        for (int n = n0; n < n1; n++) {                                                                        \
            const uint16_t *wr = w + (size_t)n * K;                                                            \
            for (int at = 0; at < K; at += 32) /* the row PREFETCH_ROWS ahead, to keep DRAM busy */             \
                _mm_prefetch((const char *)(wr + (size_t)PREFETCH_ROWS * K + at), _MM_HINT_T0);                \
            __m256 acc[R][U];                                                                                  \
            for (int r = 0; r < R; r++)                                                                        \
                for (int u = 0; u < U; u++) acc[r][u] = _mm256_setzero_ps();                                   \
            int k = 0;                                                                                         \
            for (; k + 8 * U <= K; k += 8 * U)                                                                 \
                for (int u = 0; u < U; u++) {                                                                  \
                    __m256 wv = LOAD(wr + k + 8 * u);                                                          \
                    for (int r = 0; r < R; r++)                                                                \
                        acc[r][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)r * K + k + 8 * u), acc[r][u]); \
                }                                                                                              \
            for (; k + 8 <= K; k += 8) {                                                                       \
                __m256 wv = LOAD(wr + k);                                                                      \
                for (int r = 0; r < R; r++)                                                                    \
                    acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)r * K + k), acc[r][0]);        \
            }                                                                                                  \
            for (int r = 0; r < R; r++) {                                                                      \
                for (int u = 1; u < U; u++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][u]);                   \
                float s = hsum(acc[r][0]);                                                                     \
                for (int j = k; j < K; j++) s += x[(size_t)r * K + j] * (LOAD == load_f16 ? _cvtsh_ss(wr[j]) : bf16_to_f32(wr[j])); \
                out[(size_t)r * N + n] = s;                                                                    \
            }                                                                                                  \
        }                                                                                                      \
    }

#define HALF_FAMILY(T, LOAD)                                                                                     \
    HALF_KERNEL(half_##T##_1, LOAD, 1, 4)                                                                      \
    HALF_KERNEL(half_##T##_2, LOAD, 2, 2)                                                                      \
    HALF_KERNEL(half_##T##_3, LOAD, 3, 2)                                                                      \
    HALF_KERNEL(half_##T##_4, LOAD, 4, 1)                                                                      \
    HALF_KERNEL(half_##T##_5, LOAD, 5, 1)                                                                      \
    HALF_KERNEL(half_##T##_6, LOAD, 6, 1)                                                                      \
    HALF_KERNEL(half_##T##_7, LOAD, 7, 1)                                                                      \
    HALF_KERNEL(half_##T##_8, LOAD, 8, 1)                                                                      \
    static void (*const half_##T[HALF_TILE + 1])(const uint16_t *, int, int, int, int, const float *, float *) = { \
        0, half_##T##_1, half_##T##_2, half_##T##_3, half_##T##_4, half_##T##_5, half_##T##_6, half_##T##_7, half_##T##_8};

HALF_FAMILY(f16, load_f16)
HALF_FAMILY(bf16, load_bf16)

void skulk_half_mv(const uint16_t *w, int wtype, int N, int K, const void *x, int xtype, int R, const float *bias,
                   void *y, int ytype) {
    float *xf = scratch(((size_t)R * K + (size_t)R * N) * sizeof(float));
    float *acc = xf + (size_t)R * K;
    for (int r = 0; r < R; r++) row_to_f32((const char *)x + (size_t)r * K * type_size(xtype), xtype, K, xf + (size_t)r * K);
    void (*const *family)(const uint16_t *, int, int, int, int, const float *, float *) = wtype == T_F16 ? half_f16 : half_bf16;
    int blocks = (N + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel for schedule(static) if ((size_t)N * K >= (1u << 18))
    for (int b = 0; b < blocks; b++) {
        int n0 = b * BLOCK_N, n1 = n0 + BLOCK_N < N ? n0 + BLOCK_N : N;
        for (int r0 = 0; r0 < R; r0 += HALF_TILE) {
            int rows = R - r0 < HALF_TILE ? R - r0 : HALF_TILE;
            family[rows](w, n0, n1, K, N, xf + (size_t)r0 * K, acc + (size_t)r0 * N);
        }
    }
    finish(acc, R, N, bias, y, ytype);
}

/* ---- MLX affine 4- and 8-bit weights ------------------------------------------------------------------------ */
/* Each row of x becomes int8 values (xq), one scale (xs) and the sum of its quantized values (xsum) per group. For 4 bits the
 * values of each block of 64 columns (32 when the group is 32) are stored evens first, then odds: a weight byte
 * holds columns 2j (low nibble) and 2j+1 (high), so the low nibbles of 32 bytes (16) line up with the first
 * half and the high ones with the second, and the weights need no reordering. */
static inline __m256i pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    /* 4 x 8 int32 (each within int8) -> 32 int8 in order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 32 floats from v (stride 1, or 2 for every other value) times inv, rounded to nearest (even) int8; adds them to
 * *sum */
static inline void quantize32(const float *v, int stride, __m256 inv, int8_t *q, __m256i *sum) {
    __m256i i[4];
    for (int j = 0; j < 4; j++) {
        __m256 x;
        if (stride == 1) {
            x = _mm256_loadu_ps(v + 8 * j);
        } else { /* v[0], v[2], ..., v[14] of 16 floats: even lanes of two vectors, in order */
            __m256 a = _mm256_loadu_ps(v + 16 * j), b = _mm256_loadu_ps(v + 16 * j + 8);
            x = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
        }
        i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv));
        *sum = _mm256_add_epi32(*sum, i[j]);
    }
    _mm256_storeu_si256((__m256i *)q, pack_i8(i[0], i[1], i[2], i[3]));
}

static void quantize_rows(const float *xf, int R, int K, int group, int bits, int8_t *xq, float *xs, float *xsum) {
    const int groups = K / group, span = group % 64 == 0 ? 64 : 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < groups; g++) {
            const float *v = xf + (size_t)r * K + (size_t)g * group;
            __m256 mx = _mm256_setzero_ps();
            for (int i = 0; i < group; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            const float d = _mm_cvtss_f32(m4) / 127.0f;
            const __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
            int8_t *q = xq + (size_t)r * K + (size_t)g * group;
            __m256i sum = _mm256_setzero_si256();
            for (int block = 0; block < group; block += span) {
                if (bits == 8) { /* natural order */
                    for (int i = 0; i < span; i += 32) quantize32(v + block + i, 1, inv, q + block + i, &sum);
                } else if (span == 64) { /* evens of the block, then odds (see above) */
                    quantize32(v + block, 2, inv, q + block, &sum);
                    quantize32(v + block + 1, 2, inv, q + block + 32, &sum);
                } else { /* groups of 32: the same order over 32 columns, one value at a time */
                    __m256i one = _mm256_setzero_si256();
                    int total = 0;
                    for (int i = 0; i < 32; i++) {
                        int8_t value = (int8_t)__builtin_lrintf(v[block + i] * _mm256_cvtss_f32(inv));
                        q[block + (i & 1) * 16 + (i >> 1)] = value;
                        total += value;
                    }
                    sum = _mm256_add_epi32(sum, _mm256_insert_epi32(one, total, 0));
                }
            }
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            xs[(size_t)r * groups + g] = d;
            xsum[(size_t)r * groups + g] = d * (float)_mm_cvtsi128_si32(s4); /* of the quantized values, so the
                                    rounding error meets w = scale * q + bias, not scale * q alone */
        }
}

#define QUANT_KERNEL(NAME, R, BITS)                                                                              \
    static void NAME(const uint8_t *w, const uint16_t *scales, const uint16_t *biases, int group, int n0, int n1, \
                     int K, int N, const int8_t *xq, const float *xs, const float *xsum, float *out) {             \
        const int groups = K / group, chunks = group / 32;                                                     \
        const size_t row_bytes = (size_t)K * BITS / 8;                                                         \
        const __m256i ones = _mm256_set1_epi16(1);                                                             \
        const __m128i low = _mm_set1_epi8(0x0f);                                                               \
        const __m256i low256 = _mm256_set1_epi8(0x0f);                                                         \
        for (int n = n0; n < n1; n++) {                                                                        \
            const uint8_t *wr = w + (size_t)n * row_bytes;                                                     \
            for (size_t at = 0; at < row_bytes; at += 64) /* the row PREFETCH_ROWS ahead, to keep DRAM busy */ \
                _mm_prefetch((const char *)(wr + PREFETCH_ROWS * row_bytes + at), _MM_HINT_T0);                \
            __m256 acc[R][QACC(R)]; /* two chains per row when registers allow: an FMA's latency is 4 cycles */ \
            for (int r = 0; r < R; r++)                                                                        \
                for (int u = 0; u < QACC(R); u++) acc[r][u] = _mm256_setzero_ps();                            \
            for (int g = 0; g < groups; g++) {                                                                 \
                __m256i dot[R];                                                                                \
                for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();                                   \
                if (BITS == 4 && group % 64 == 0) {                                                            \
                    for (int c = 0; c < group / 64; c++) { /* 64 columns per 32-byte load */                   \
                        const size_t col = (size_t)g * group + (size_t)c * 64;                                \
                        __m256i b = _mm256_loadu_si256((const __m256i *)(wr + col / 2));                       \
                        __m256i lo = _mm256_and_si256(b, low256), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low256); \
                        for (int r = 0; r < R; r++) {                                                          \
                            const int8_t *xr = xq + (size_t)r * K + col;                                       \
                            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)), \
                                                         _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32)))); \
                            dot[r] = _mm256_add_epi16(dot[r], p);                                              \
                        }                                                                                      \
                    }                                                                                          \
                } else                                                                                         \
                for (int c = 0; c < chunks; c++) {                                                             \
                    const size_t col = (size_t)g * group + (size_t)c * 32;                                     \
                    if (BITS == 4) {                                                                           \
                        __m128i b = _mm_loadu_si128((const __m128i *)(wr + col / 2));                          \
                        __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low)); \
                        for (int r = 0; r < R; r++) /* 15 * 127 * 2 per lane, 8 chunks at most: fits int16 */   \
                            dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(wv, _mm256_loadu_si256((const __m256i *)(xq + (size_t)r * K + col)))); \
                    } else {                                                                                   \
                        __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + col));                          \
                        __m256i aw = _mm256_abs_epi8(wv);                                                      \
                        for (int r = 0; r < R; r++) {                                                          \
                            __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + (size_t)r * K + col)), wv); \
                            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones)); \
                        }                                                                                      \
                    }                                                                                          \
                }                                                                                              \
                const float sc = _cvtsh_ss(scales[(size_t)n * groups + g]);                                    \
                for (int r = 0; r < R; r++) {                                                                  \
                    __m256i d32 = BITS == 4 ? _mm256_madd_epi16(dot[r], ones) : dot[r];                        \
                    __m256 *a = &acc[r][g & (QACC(R) - 1)];                                                    \
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32), _mm256_set1_ps(sc * xs[(size_t)r * groups + g]), *a); \
                }                                                                                              \
            }                                                                                                  \
            /* the biases' share, sum over groups of bias * x_scale * sum(x_q), eight groups at a time */     \
            const uint16_t *br = biases + (size_t)n * groups;                                                  \
            __m256 bacc[R];                                                                                    \
            for (int r = 0; r < R; r++) bacc[r] = acc[r][0];                                                   \
            for (int r = 0; r < R; r++)                                                                        \
                for (int u = 1; u < QACC(R); u++) bacc[r] = _mm256_add_ps(bacc[r], acc[r][u]);                 \
            int g = 0;                                                                                         \
            for (; g + 8 <= groups; g += 8) {                                                                  \
                __m256 bv = load_f16(br + g);                                                                  \
                for (int r = 0; r < R; r++)                                                                    \
                    bacc[r] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xsum + (size_t)r * groups + g), bacc[r]);    \
            }                                                                                                  \
            for (int r = 0; r < R; r++) {                                                                      \
                float total = hsum(bacc[r]);                                                                   \
                for (int j = g; j < groups; j++) total += _cvtsh_ss(br[j]) * xsum[(size_t)r * groups + j];     \
                out[(size_t)r * N + n] = total;                                                                \
            }                                                                                                  \
        }                                                                                                      \
    }

typedef void (*quant_fn)(const uint8_t *, const uint16_t *, const uint16_t *, int, int, int, int, int, const int8_t *,
                         const float *, const float *, float *);
QUANT_KERNEL(q4_1, 1, 4)
QUANT_KERNEL(q4_2, 2, 4)
QUANT_KERNEL(q4_3, 3, 4)
QUANT_KERNEL(q4_4, 4, 4)
QUANT_KERNEL(q8_1, 1, 8)
QUANT_KERNEL(q8_2, 2, 8)
QUANT_KERNEL(q8_3, 3, 8)
QUANT_KERNEL(q8_4, 4, 8)
static const quant_fn q4[QUANT_TILE + 1] = {0, q4_1, q4_2, q4_3, q4_4};
static const quant_fn q8[QUANT_TILE + 1] = {0, q8_1, q8_2, q8_3, q8_4};

/* bits 4: w holds K/2 bytes per row, low nibble first; bits 8: K signed bytes per row (q - 128, the caller folds
 * the 128 into biases). K must be a multiple of group, group a multiple of 32 and at most 256. */
void skulk_quant_mv(const uint8_t *w, const uint16_t *scales, const uint16_t *biases, int bits, int group, int N, int K,
                    const void *x, int xtype, int R, const float *bias, void *y, int ytype) {
    const int groups = K / group;
    size_t floats = (size_t)R * K + (size_t)R * N + 2 * (size_t)R * groups;
    float *xf = scratch(floats * sizeof(float) + (size_t)R * K + 64);
    float *acc = xf + (size_t)R * K, *xs = acc + (size_t)R * N, *xsum = xs + (size_t)R * groups;
    int8_t *xq = (int8_t *)(xsum + (size_t)R * groups);
    for (int r = 0; r < R; r++) row_to_f32((const char *)x + (size_t)r * K * type_size(xtype), xtype, K, xf + (size_t)r * K);
    quantize_rows(xf, R, K, group, bits, xq, xs, xsum);
    const quant_fn *family = bits == 4 ? q4 : q8;
    int blocks = (N + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel for schedule(static) if ((size_t)N * K >= (1u << 18))
    for (int b = 0; b < blocks; b++) {
        int n0 = b * BLOCK_N, n1 = n0 + BLOCK_N < N ? n0 + BLOCK_N : N;
        for (int r0 = 0; r0 < R; r0 += QUANT_TILE) {
            int rows = R - r0 < QUANT_TILE ? R - r0 : QUANT_TILE;
            family[rows](w, scales, biases, group, n0, n1, K, N, xq + (size_t)r0 * K, xs + (size_t)r0 * groups,
                         xsum + (size_t)r0 * groups, acc + (size_t)r0 * N);
        }
    }
    finish(acc, R, N, bias, y, ytype);
}

