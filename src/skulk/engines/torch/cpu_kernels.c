/* Matrix-vector kernels for decode steps on x86 CPUs with AVX2, FMA and F16C (engines/torch/cpu_kernels.py
 * compiles and loads this file; it is plain C with no Python or torch headers, so it builds in about a second).
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
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { T_F32 = 0, T_F16 = 1, T_BF16 = 2 };
#define BLOCK_N 32    /* weight rows per unit of parallel work */
#define HALF_TILE 8   /* activation rows per pass over a weight row, float kernels */
#define QUANT_TILE 4  /* the same for quantized kernels (two accumulators per row must stay in registers) */
#define QACC(R) ((R) <= 2 ? 2 : 1)
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 2
#endif

static __thread void *scratch_buf;
static __thread size_t scratch_len;

static void *scratch(size_t bytes) {
    if (bytes > scratch_len) {
        free(scratch_buf);
        scratch_len = (bytes + 4095) & ~(size_t)4095;
        scratch_buf = aligned_alloc(64, scratch_len);
    }
    return scratch_buf;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static void row_to_f32(const void *x, int type, int n, float *out) {
    int k = 0;
    if (type == T_F32) {
        memcpy(out, x, (size_t)n * 4);
    } else if (type == T_F16) {
        const uint16_t *h = x;
        for (; k + 8 <= n; k += 8) _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + k))));
        for (; k < n; k++) out[k] = _cvtsh_ss(h[k]);
    } else {
        const uint16_t *h = x;
        for (; k + 8 <= n; k += 8)
            _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + k))), 16)));
        for (; k < n; k++) out[k] = bf16_to_f32(h[k]);
    }
}

static inline void store(void *y, int type, size_t at, float v) {
    if (type == T_F32) ((float *)y)[at] = v;
    else if (type == T_F16) ((uint16_t *)y)[at] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    else ((uint16_t *)y)[at] = f32_to_bf16(v);
}

/* 8 floats rounded to the type's precision (bf16: to nearest even, as f32_to_bf16), and stored in it */
static inline __m256i bf16_bits8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
}

static inline __m256 round8(__m256 v, int type) {
    if (type == T_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    if (type == T_BF16) return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits8(v), _mm256_set1_epi32((int)0xffff0000u)));
    return v;
}

static inline void store8(void *y, int type, size_t at, __m256 v) {
    if (type == T_F32) {
        _mm256_storeu_ps((float *)y + at, v);
    } else if (type == T_F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)y + at), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else {
        __m256i b = _mm256_srli_epi32(bf16_bits8(v), 16);
        _mm_storeu_si128((__m128i *)((uint16_t *)y + at), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
}

static inline float round_to(float v, int type);

/* v[0..n) stored at y[at..] in the type */
static void store_row(const float *v, void *y, int type, size_t at, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) store8(y, type, at + i, _mm256_loadu_ps(v + i));
    for (; i < n; i++) store(y, type, at + i, v[i]);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

static inline size_t type_size(int type) { return type == T_F32 ? 4 : 2; }

static void finish(float *acc, int rows, int n, const float *bias, void *y, int ytype) {
    for (int r = 0; r < rows; r++) {
        float *row = acc + (size_t)r * n;
        if (bias)
            for (int i = 0; i < n; i++) row[i] += bias[i];
        store_row(row, y, ytype, (size_t)r * n, n);
    }
}

/* ---- f16 / bf16 weights ------------------------------------------------------------------------------------- */
static inline __m256 load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* R rows of x against weight rows [n0, n1); U independent accumulators per row keep the FMA pipes busy when R is
 * small. Instantiated per (R, U, dtype) so every loop below unrolls into registers. */
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

/* ---- RMSNorm ------------------------------------------------------------------------------------------------ */
static inline float round_to(float v, int type) {
    if (type == T_F16) return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
    if (type == T_BF16) return bf16_to_f32(f32_to_bf16(v));
    return v;
}

/* v = rms_norm(v) in place with the torch path's roundings (see skulk_rms_norm) */
static void norm_in_place(float *v, int n, const float *w, float eps, int unit_offset, int type) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(v + i), _mm256_loadu_ps(v + i), acc);
    float ss = hsum(acc);
    for (; i < n; i++) ss += v[i] * v[i];
    const float inv = 1.0f / __builtin_sqrtf(ss / (float)n + eps);
    const __m256 vinv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f);
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(v + i), vinv), wv = _mm256_loadu_ps(w + i);
        x = unit_offset ? _mm256_mul_ps(x, _mm256_add_ps(one, wv)) : _mm256_mul_ps(wv, round8(x, type));
        _mm256_storeu_ps(v + i, round8(x, type));
    }
    for (; i < n; i++)
        v[i] = unit_offset ? round_to(v[i] * inv * (1.0f + w[i]), type) : round_to(w[i] * round_to(v[i] * inv, type), type);
}

/* out = weight * round(x * rsqrt(mean(x^2) + eps)) as transformers' Llama computes it (normalise in f32, round to
 * the activations' dtype, then multiply), or with unit_offset Gemma's round(x * rsqrt(...) * (1 + weight)). */
void skulk_rms_norm(const void *x, int xtype, int rows, int n, const void *weight, int wtype, float eps,
                    int unit_offset, void *out) {
    float *buf = scratch((size_t)2 * n * sizeof(float));
    float *w = buf + n;
    row_to_f32(weight, wtype, n, w);
    for (int r = 0; r < rows; r++) {
        row_to_f32((const char *)x + (size_t)r * n * type_size(xtype), xtype, n, buf);
        norm_in_place(buf, n, w, eps, unit_offset, xtype);
        store_row(buf, out, xtype, (size_t)r * n, n);
    }
}

/* ---- decode attention --------------------------------------------------------------------------------------- */
/* exp for the softmax, 8 lanes: 2^(x log2 e) split into an integer power (exponent bits) and a degree-6
 * polynomial of the remainder; relative error about 2e-7 over the range softmax feeds it (x <= 0). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 fi = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, fi);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 load8(const void *base, int type, size_t at) {
    if (type == T_F32) return _mm256_loadu_ps((const float *)base + at);
    if (type == T_F16) return load_f16((const uint16_t *)base + at);
    return load_bf16((const uint16_t *)base + at);
}

/* One query per row (a decode step) against the cache: q [B, H, D], keys/values laid out [B, Hkv, max_seq, D]
 * from the step's first slot, row b attending its positions [positions[b] + 1 - window, positions[b]] (window 0:
 * all from 0). Grouped-query heads share their kv head (h / (H / Hkv)). Scores, softmax and the weighted sum run
 * in f32; out [B, H, D] in q's dtype. D must be a multiple of 8. */
void skulk_decode_attention(const void *q, const void *keys, const void *values, int type, int B, int H, int Hkv,
                            int D, int max_seq, const int64_t *positions, int window, float scale, void *out) {
    const int group = H / Hkv;
#pragma omp parallel for collapse(2) schedule(static) if (B * H >= 8 && positions[0] >= 256)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int len = (int)positions[b] + 1, start = window > 0 && len > window ? len - window : 0;
            const size_t kv = ((size_t)b * Hkv + (size_t)(h / group)) * max_seq * D;
            float *buf = scratch(((size_t)(len - start) + 2 * (size_t)D + 8) * sizeof(float));
            float *qf = buf, *acc = buf + D, *scores = buf + 2 * D;
            row_to_f32((const char *)q + ((size_t)b * H + h) * D * type_size(type), type, D, qf);
            float best = -3.0e38f;
            for (int s = start; s < len; s++) {
                __m256 dot = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8)
                    dot = _mm256_fmadd_ps(_mm256_loadu_ps(qf + d), load8(keys, type, kv + (size_t)s * D + d), dot);
                float v = hsum(dot) * scale;
                scores[s - start] = v;
                best = v > best ? v : best;
            }
            const int n = len - start;
            __m256 total = _mm256_setzero_ps();
            int i = 0;
            for (; i + 8 <= n; i += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), _mm256_set1_ps(best)));
                _mm256_storeu_ps(scores + i, e);
                total = _mm256_add_ps(total, e);
            }
            float sum = hsum(total);
            for (; i < n; i++) {
                float e[8] = {scores[i] - best};
                _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(e)));
                scores[i] = e[0];
                sum += e[0];
            }
            for (int d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_setzero_ps());
            for (int s = start; s < len; s++) {
                __m256 p = _mm256_set1_ps(scores[s - start]);
                for (int d = 0; d < D; d += 8)
                    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p, load8(values, type, kv + (size_t)s * D + d), _mm256_loadu_ps(acc + d)));
            }
            const float inv = 1.0f / sum;
            for (int d = 0; d < D; d++) acc[d] *= inv;
            store_row(acc, out, type, ((size_t)b * H + h) * D, D);
        }
}

/* ---- fused decode-step elementwise work --------------------------------------------------------------------- */
/* Each of these does what a handful of torch ops do, with the same roundings to the activations' dtype between
 * steps, so results match the torch path (and transformers) as those ops would compute them. */


static void rotate(float *v, int D, const float *cos, const float *sin, int type) {
    /* x * cos + roll(x, D/2) * sin with sin's first half negated (layers._rotate), each product rounded */
    const int half = D / 2;
    if (half % 8 == 0) {
        for (int i = 0; i < half; i += 8) {
            __m256 lo = _mm256_loadu_ps(v + i), hi = _mm256_loadu_ps(v + half + i);
            __m256 a = _mm256_add_ps(round8(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)), type),
                                     round8(_mm256_mul_ps(hi, _mm256_loadu_ps(sin + i)), type));
            __m256 b = _mm256_add_ps(round8(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)), type),
                                     round8(_mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i)), type));
            _mm256_storeu_ps(v + i, round8(a, type));
            _mm256_storeu_ps(v + half + i, round8(b, type));
        }
        return;
    }
    float rolled[512];
    for (int i = 0; i < D; i++) rolled[i] = v[i < D / 2 ? i + D / 2 : i - D / 2];
    for (int i = 0; i < D; i++) v[i] = round_to(round_to(v[i] * cos[i], type) + round_to(rolled[i] * sin[i], type), type);
}

/* One decode step's q/k/v for B rows (T = 1): qkv [B, (H + 2 Hkv) D] as the stacked projection wrote it; per head
 * the optional q/k RMSNorm (weights [D]), then rope with cos/sin [B, D] (sin sign-folded); k and v stored at each
 * row's position in the cache (laid out [B, Hkv, max_seq, D] from the step's first slot); rotated q out [B, H, D].
 * D <= 512. */
void skulk_qkv_rope(const void *qkv, int type, int B, int H, int Hkv, int D, const void *cos, const void *sin,
                    const void *qnorm, const void *knorm, float eps, int unit_offset, const int64_t *positions,
                    void *kcache, void *vcache, int max_seq, void *q_out) {
    const size_t width = (size_t)(H + 2 * Hkv) * D, es = type_size(type);
    float *buf = scratch((size_t)(width + 4 * D) * sizeof(float));
    float *c = buf + width, *s = c + D, *qn = s + D, *kn = qn + D;
    if (qnorm) row_to_f32(qnorm, type, D, qn);
    if (knorm) row_to_f32(knorm, type, D, kn);
    for (int b = 0; b < B; b++) {
        row_to_f32((const char *)qkv + b * width * es, type, (int)width, buf);
        row_to_f32((const char *)cos + (size_t)b * D * es, type, D, c);
        row_to_f32((const char *)sin + (size_t)b * D * es, type, D, s);
        for (int h = 0; h < H + Hkv; h++) {
            float *v = buf + (size_t)h * D;
            const float *w = h < H ? (qnorm ? qn : NULL) : (knorm ? kn : NULL);
            if (w) norm_in_place(v, D, w, eps, unit_offset, type);
            rotate(v, D, c, s, type);
        }
        store_row(buf, q_out, type, (size_t)b * H * D, H * D);
        for (int h = 0; h < Hkv; h++) {
            const size_t at = (((size_t)b * Hkv + h) * max_seq + (size_t)positions[b]) * D;
            store_row(buf + (size_t)(H + h) * D, kcache, type, at, D);
            store_row(buf + (size_t)(H + Hkv + h) * D, vcache, type, at, D);
        }
    }
}

/* h = x + delta (rounded), out = rms_norm(h) (as skulk_rms_norm): the residual add and the next norm of a layer. */
void skulk_add_rms_norm(const void *x, const void *delta, int type, int rows, int n, const void *weight, int wtype,
                        float eps, int unit_offset, void *h_out, void *out) {
    float *buf = scratch((size_t)3 * n * sizeof(float));
    float *w = buf + n, *d = w + n;
    row_to_f32(weight, wtype, n, w);
    for (int r = 0; r < rows; r++) {
        const size_t at = (size_t)r * n;
        row_to_f32((const char *)x + at * type_size(type), type, n, buf);
        row_to_f32((const char *)delta + at * type_size(type), type, n, d);
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(buf + i, round8(_mm256_add_ps(_mm256_loadu_ps(buf + i), _mm256_loadu_ps(d + i)), type));
        for (; i < n; i++) buf[i] = round_to(buf[i] + d[i], type);
        store_row(buf, h_out, type, at, n);
        norm_in_place(buf, n, w, eps, unit_offset, type);
        store_row(buf, out, type, at, n);
    }
}

/* out = act(gate) * up for gate_up [rows, 2 I] (gate first): act SiLU, or GELU with the tanh approximation (gelu=1),
 * rounded after the activation and after the product as F.silu(gate) * up rounds them. */
void skulk_act_mul(const void *gate_up, int type, int rows, int I, int gelu, void *out) {
    float *buf = scratch((size_t)2 * I * sizeof(float));
    for (int r = 0; r < rows; r++) {
        row_to_f32((const char *)gate_up + (size_t)r * 2 * I * type_size(type), type, 2 * I, buf);
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 g = _mm256_loadu_ps(buf + i), a;
            if (gelu) { /* 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (1 + exp(2u)), u = sqrt(2/pi) (g + 0.044715 g^3) */
                __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                         _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
                __m256 e = exp8(_mm256_min_ps(_mm256_mul_ps(u, _mm256_set1_ps(2.0f)), _mm256_set1_ps(80.0f)));
                __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
                a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
            } else {
                __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(80.0f)));
                a = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            }
            _mm256_storeu_ps(buf + i, a);
        }
        for (; i < I; i++) {
            float g = buf[i], e[8] = {gelu ? 0.0f : -g};
            if (gelu) {
                float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
                e[0] = 2.0f * u < 80.0f ? 2.0f * u : 80.0f;
                _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(e)));
                buf[i] = 0.5f * g * (2.0f - 2.0f / (1.0f + e[0]));
            } else {
                e[0] = e[0] < 80.0f ? e[0] : 80.0f;
                _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(e)));
                buf[i] = g / (1.0f + e[0]);
            }
        }
        for (i = 0; i + 8 <= I; i += 8)
            _mm256_storeu_ps(buf + i, _mm256_mul_ps(round8(_mm256_loadu_ps(buf + i), type), _mm256_loadu_ps(buf + I + i)));
        for (; i < I; i++) buf[i] = round_to(buf[i], type) * buf[I + i];
        store_row(buf, out, type, (size_t)r * I, I);
    }
}

/* ---- a whole decoder layer for a decode step ---------------------------------------------------------------- */
/* layers.DecoderLayer (Llama, Qwen2/3, Mistral: pre-norm attention then a dense MLP, one tensor-parallel rank) for
 * B rows of one token each, as one call: the same kernels as the torch path's calls, in the same order, with the
 * same roundings, but no Python between them. The layer and its matrices are described once (cpu_kernels.py). */
typedef struct {
    int kind; /* 0: f16/bf16 weights, 1: our quantized layout */
    int wtype, bits, group, n, k;
    const void *w;
    const uint16_t *scales, *biases;
    const float *bias;
} matrix_t;

typedef struct {
    matrix_t qkv, o, gate_up, down;
    const void *in_norm, *post_norm, *q_norm, *k_norm; /* q/k norms NULL when the model has none */
    int norm_type, heads, kv_heads, head_dim, hidden, inter, gelu, unit_offset;
    float eps, qk_eps, scale;
} layer_t;

static __thread void *arena_buf;
static __thread size_t arena_len;

static void mv(const matrix_t *m, const void *x, int type, int R, void *y) {
    if (m->kind == 0) skulk_half_mv(m->w, m->wtype, m->n, m->k, x, type, R, m->bias, y, type);
    else skulk_quant_mv(m->w, m->scales, m->biases, m->bits, m->group, m->n, m->k, x, type, R, m->bias, y, type);
}

/* out = the layer applied to x ([B, hidden] in `type`); keys/values: this layer's cache from the step's first slot
 * ([B, Hkv, max_seq, D]); cos/sin [B, D]; positions [B]. */
void skulk_decode_layer(const layer_t *L, const void *x, void *out, int type, int B, const int64_t *positions,
                        const void *cos, const void *sin, int window, void *keys, void *values, int max_seq) {
    const size_t es = type_size(type), hidden = (size_t)L->hidden * B * es;
    const size_t qkv = (size_t)(L->heads + 2 * L->kv_heads) * L->head_dim * B * es;
    const size_t q = (size_t)L->heads * L->head_dim * B * es, inter = (size_t)L->inter * B * es;
    const size_t need = hidden * 2 + qkv + 2 * q + 3 * inter + 256;
    if (need > arena_len) {
        free(arena_buf);
        arena_len = (need + 4095) & ~(size_t)4095;
        arena_buf = aligned_alloc(64, arena_len);
    }
    char *normed = arena_buf, *delta = normed + hidden, *qkv_out = delta + hidden, *q_rot = qkv_out + qkv;
    char *attn = q_rot + q, *gate_up = attn + q, *act = gate_up + 2 * inter;
    skulk_rms_norm(x, type, B, L->hidden, L->in_norm, L->norm_type, L->eps, L->unit_offset, normed);
    mv(&L->qkv, normed, type, B, qkv_out);
    skulk_qkv_rope(qkv_out, type, B, L->heads, L->kv_heads, L->head_dim, cos, sin, L->q_norm, L->k_norm, L->qk_eps,
                   L->unit_offset, positions, keys, values, max_seq, q_rot);
    skulk_decode_attention(q_rot, keys, values, type, B, L->heads, L->kv_heads, L->head_dim, max_seq, positions, window,
                           L->scale, attn);
    mv(&L->o, attn, type, B, delta);
    skulk_add_rms_norm(x, delta, type, B, L->hidden, L->post_norm, L->norm_type, L->eps, L->unit_offset, out, normed);
    mv(&L->gate_up, normed, type, B, gate_up);
    skulk_act_mul(gate_up, type, B, L->inter, L->gelu, act);
    mv(&L->down, act, type, B, delta);
    float *row = scratch((size_t)2 * L->hidden * sizeof(float)), *d = row + L->hidden;
    for (int r = 0; r < B; r++) { /* h + mlp(h), rounded as torch's add rounds */
        const size_t at = (size_t)r * L->hidden;
        row_to_f32((char *)out + at * es, type, L->hidden, row);
        row_to_f32(delta + at * es, type, L->hidden, d);
        for (int i = 0; i < L->hidden; i++) row[i] += d[i];
        store_row(row, out, type, at, L->hidden);
    }
}
