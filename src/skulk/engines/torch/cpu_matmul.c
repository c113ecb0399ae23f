/* Matrix-vector kernels for decode steps on x86 CPUs with AVX2, FMA and F16C (engines/torch/cpu_kernels.py
 * compiles this file and cpu_step.c into one library and loads it; plain C with no Python or torch headers, so it
 * builds in a few seconds).
 *
 * y[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]) for a few rows r of activations x and a weight matrix w:
 *   skulk_half_mv   w [N, K] in f16, bf16 or f32 as the checkpoint has it, widened to f32 as it streams past
 *                   and multiplied with f32 activations;
 *   skulk_quant_mv  w in MLX's affine groups (4 or 8 bits per value, one f16 scale and bias per group of `group`
 *                   columns: w = scale * q + bias), interleaved in blocks of 8 output rows (see below). Each
 *                   activation row is quantized to int8 per group, and the groups' dot products run in integers
 *                   (maddubs, or vpdpbusd where the CPU has VNNI), 8 output rows per vector.
 * Activations (xtype) and outputs (ytype) are f32, f16 or bf16, converted at the edges so the caller allocates
 * nothing. Every weight byte is read once per call however many rows there are (rows are tiled inside a
 * block of weight rows), which is what makes a batched decode step cost about what a single one does.
 * Work is split across output rows with OpenMP; loaded into a process that has torch, this shares torch's
 * OpenMP runtime (same soname), so torch.set_num_threads governs it too.
 */
#include "cpu_kernels.h"

#define BLOCK_N 32    /* weight rows per unit of parallel work */
#ifdef __AVX512VL__
#define HALF_TILE 8   /* activation rows per pass over the weights, float kernels: 16 sums in AVX-512's 32 registers */
#else
#define HALF_TILE 4   /* activation rows per pass over the weights, float kernels */
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QUANT_TILE 8  /* the same for quantized kernels: two int32 sums and a float total per row in 32 registers */
#else
#define QUANT_TILE 4  /* the same for quantized kernels (an int16 and an int32 sum and a float total per row) */
#endif
/* Weights are prefetched ahead of the loads (PREFETCH_HINT, PREFETCH_BYTES: cpu_kernels.h), spread through the
 * loops, a line per line consumed: issued as a burst of a whole row at its start, they stalled the loop behind
 * them. 8 rows of f16 against DRAM-resident weights ran 45 -> 75 GMAC/s (2 threads), bf16 x bf16 50 -> 100, f32
 * 31 -> 48, 8-bit 170 -> 215; one row 10-20 % faster. */
#define PREFETCH_ROWS 4      /* float kernels: this many weight rows ahead */
/* Prefetch the weight bytes `ahead` past p, spread through the loop: a line each time this stream of weights,
 * `step` bytes an iteration, enters a new one. */
#define SPREAD_PREFETCH(p, ahead, step)                                                                          \
    do {                                                                                                       \
        const char *at_ = (const char *)(p) + (ahead);                                                         \
        if ((step) >= 64)                                                                                      \
            for (int b_ = 0; b_ < (step); b_ += 64) _mm_prefetch(at_ + b_, PREFETCH_HINT);                      \
        else if (((uintptr_t)(p) & 63) < (step))                                                               \
            _mm_prefetch(at_, PREFETCH_HINT);                                                                  \
    } while (0)

/* PIN keeps a value in a register at this point. A running sum: without it gcc reassociates a fully unrolled chain
 * of adds into all products first, spills them to the stack and adds them up afterwards, which halved the kernels'
 * speed. A loaded activation vector: without it gcc folds the load into each FMA that uses it, loading it once per
 * weight row, and a batched step ran out of load ports before FMA units. */
#define PIN(v) __asm__("" : "+x"(v))

/* ---- f16 / bf16 weights ------------------------------------------------------------------------------------- */
#define HALF_KERNEL(NAME, T, LOAD, SCALAR, R, U)                                                                            \
    static void NAME(const void *w_, int n0, int n1, int K, int N, const float *x, float *out) {               \
        const T *w = w_;                                                                                       \
        for (int n = n0; n < n1; n++) {                                                                        \
            const T *wr = w + (size_t)n * K;                                                            \
            __m256 acc[R][U];                                                                                  \
            for (int r = 0; r < R; r++)                                                                        \
                for (int u = 0; u < U; u++) acc[r][u] = _mm256_setzero_ps();                                   \
            int k = 0;                                                                                         \
            for (; k + 8 * U <= K; k += 8 * U) {                                                               \
                SPREAD_PREFETCH(wr + k, (size_t)PREFETCH_ROWS * K * sizeof(T), 8 * U * (int)sizeof(T));          \
                for (int u = 0; u < U; u++) {                                                                  \
                    __m256 wv = LOAD(wr + k + 8 * u);                                                          \
                    for (int r = 0; r < R; r++)                                                                \
                        acc[r][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)r * K + k + 8 * u), acc[r][u]); \
                }                                                                                              \
            }                                                                                                  \
            for (; k + 8 <= K; k += 8) {                                                                       \
                __m256 wv = LOAD(wr + k);                                                                      \
                for (int r = 0; r < R; r++)                                                                    \
                    acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)r * K + k), acc[r][0]);        \
            }                                                                                                  \
            for (int r = 0; r < R; r++) {                                                                      \
                for (int u = 1; u < U; u++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][u]);                   \
                float s = hsum(acc[r][0]);                                                                     \
                for (int j = k; j < K; j++) s += x[(size_t)r * K + j] * SCALAR(wr[j]);                         \
                out[(size_t)r * N + n] = s;                                                                    \
            }                                                                                                  \
        }                                                                                                      \
    }

/* 4 activation rows x 2 weight rows at a time: 6 loads per 8 FMAs where 8 rows x 1 weight row take 9, which made
 * batched steps load-bound (a tail row goes through the 4 x 1 kernel) */
#define HALF_PAIR_KERNEL(NAME, T, LOAD, SCALAR, R)                                                                          \
    static void NAME(const void *w_, int n0, int n1, int K, int N, const float *x, float *out) {               \
        const T *w = w_;                                                                                       \
        int n = n0;                                                                                            \
        for (; n + 2 <= n1; n += 2) {                                                                          \
            const T *wr = w + (size_t)n * K;                                                            \
            __m256 acc[R][2];                                                                                  \
            for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                          \
            int k = 0;                                                                                         \
            for (; k + 8 <= K; k += 8) {                                                                       \
                SPREAD_PREFETCH(wr + k, (size_t)PREFETCH_ROWS * K * sizeof(T), 8 * (int)sizeof(T));              \
                SPREAD_PREFETCH(wr + K + k, (size_t)PREFETCH_ROWS * K * sizeof(T), 8 * (int)sizeof(T));          \
                __m256 w0 = LOAD(wr + k), w1 = LOAD(wr + K + k);                                               \
                for (int r = 0; r < R; r++) {                                                                  \
                    __m256 xv = _mm256_loadu_ps(x + (size_t)r * K + k);                                        \
                    PIN(xv);                                                                                   \
                    acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);                                            \
                    acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);                                            \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < R; r++)                                                                        \
                for (int u = 0; u < 2; u++) {                                                                  \
                    float s = hsum(acc[r][u]);                                                                 \
                    for (int j = k; j < K; j++) s += x[(size_t)r * K + j] * SCALAR(wr[u * K + j]);             \
                    out[(size_t)r * N + n + u] = s;                                                            \
                }                                                                                              \
        }                                                                                                      \
        if (n < n1) NAME##_tail(w, n, n1, K, N, x, out);                                                       \
    }

typedef void (*half_fn)(const void *, int, int, int, int, const float *, float *);
/* R activation rows against pairs of weight rows, a last odd weight row through the R x 1 kernel */
#define HALF_PAIRED(NAME, T, LOAD, SCALAR, R)                                                                    \
    HALF_KERNEL(half_##NAME##_##R##_tail, T, LOAD, SCALAR, R, 1) HALF_PAIR_KERNEL(half_##NAME##_##R, T, LOAD, SCALAR, R)
#if HALF_TILE == 8
#define HALF_WIDE(NAME, T, LOAD, SCALAR)                                                                         \
    HALF_PAIRED(NAME, T, LOAD, SCALAR, 5) HALF_PAIRED(NAME, T, LOAD, SCALAR, 6)                                \
    HALF_PAIRED(NAME, T, LOAD, SCALAR, 7) HALF_PAIRED(NAME, T, LOAD, SCALAR, 8)
#define HALF_WIDE_FNS(NAME) , half_##NAME##_5, half_##NAME##_6, half_##NAME##_7, half_##NAME##_8
#else
#define HALF_WIDE(NAME, T, LOAD, SCALAR)
#define HALF_WIDE_FNS(NAME)
#endif
#define HALF_FAMILY(NAME, T, LOAD, SCALAR)                                                                       \
    HALF_KERNEL(half_##NAME##_1, T, LOAD, SCALAR, 1, 4)                                                        \
    HALF_KERNEL(half_##NAME##_2, T, LOAD, SCALAR, 2, 2)                                                        \
    HALF_KERNEL(half_##NAME##_3, T, LOAD, SCALAR, 3, 2)                                                        \
    HALF_PAIRED(NAME, T, LOAD, SCALAR, 4)                                                                      \
    HALF_WIDE(NAME, T, LOAD, SCALAR)                                                                           \
    static const half_fn half_##NAME[HALF_TILE + 1] = {0, half_##NAME##_1, half_##NAME##_2, half_##NAME##_3,     \
                                                       half_##NAME##_4 HALF_WIDE_FNS(NAME)};

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline float f32_scalar(float v) { return v; }
HALF_FAMILY(f16, uint16_t, load_f16, _cvtsh_ss)
HALF_FAMILY(bf16, uint16_t, load_bf16, bf16_to_f32)
HALF_FAMILY(f32, float, load_f32, f32_scalar)

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
/* bf16 weights against bf16 activations where the CPU has AVX-512 BF16 (Zen 4, Cooper Lake and later): vdpbf16ps
 * multiplies 16 pairs and adds them into 8 f32 lanes in one op, where widening both to f32 took 3 ops per 8 (2 to
 * widen, 1 FMA). The products of two bf16 values are exact in f32, so only the order of the f32 additions differs
 * from the widening kernels. 2 weight rows at a time keep at least 4 independent sums in flight against the op's
 * latency. */
#define BF16_TILE 8
#define UNROLL _Pragma("GCC unroll 8") /* wholly, so the sums stay in registers: gcc stopped short at 8 rows */
#define BF16_KERNEL(NAME, R, U)                                                                                  \
    static void NAME(const uint16_t *w, int n, int K, int N, const uint16_t *x, float *out) {                 \
        const uint16_t *wr = w + (size_t)n * K;                                                                \
        __m256 acc[R][U];                                                                                      \
        for (int r = 0; r < R; r++)                                                                            \
            for (int u = 0; u < U; u++) acc[r][u] = _mm256_setzero_ps();                                       \
        int k = 0;                                                                                             \
        for (; k + 16 <= K; k += 16) {                                                                         \
            __m256bh wv[U];                                                                                    \
            UNROLL for (int u = 0; u < U; u++) {                                                               \
                SPREAD_PREFETCH(wr + (size_t)u * K + k, (size_t)PREFETCH_ROWS * K * 2, 32);                    \
                wv[u] = (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + (size_t)u * K + k));              \
            }                                                                                                  \
            UNROLL for (int r = 0; r < R; r++) {                                                               \
                __m256bh xv = (__m256bh)_mm256_loadu_si256((const __m256i *)(x + (size_t)r * K + k));         \
                UNROLL for (int u = 0; u < U; u++) acc[r][u] = _mm256_dpbf16_ps(acc[r][u], wv[u], xv);        \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < R; r++)                                                                            \
            for (int u = 0; u < U; u++) {                                                                      \
                float s = hsum(acc[r][u]);                                                                     \
                for (int j = k; j < K; j++) s += bf16_to_f32(x[(size_t)r * K + j]) * bf16_to_f32(wr[(size_t)u * K + j]); \
                out[(size_t)r * N + n + u] = s;                                                                \
            }                                                                                                  \
    }
/* one activation row (a tile's last): a weight row at a time, 2 sums along it, a cache line a step (4 rows side by
 * side, or 4 sums a step of 2 lines, ran as fast in cache and 25 % slower from DRAM). A call of one row takes the
 * widening kernel instead: in the 500M model's decode it ran 10-15 % faster than this with the old prefetch
 * (512-bit loads or 4 sums did not close that); with the spread prefetch the two run alike. */
static void bf16dot_1(const uint16_t *w, int n, int K, int N, const uint16_t *x, float *out) {
    (void)N;
    const uint16_t *wr = w + (size_t)n * K;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        SPREAD_PREFETCH(wr + k, (size_t)PREFETCH_ROWS * K * 2, 64);
        UNROLL for (int u = 0; u < 2; u++)
            acc[u] = _mm256_dpbf16_ps(acc[u], (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + k + 16 * u)),
                                      (__m256bh)_mm256_loadu_si256((const __m256i *)(x + k + 16 * u)));
    }
    for (; k + 16 <= K; k += 16)
        acc[0] = _mm256_dpbf16_ps(acc[0], (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + k)),
                                  (__m256bh)_mm256_loadu_si256((const __m256i *)(x + k)));
    float s = hsum(_mm256_add_ps(acc[0], acc[1]));
    for (; k < K; k++) s += bf16_to_f32(x[k]) * bf16_to_f32(wr[k]);
    out[n] = s;
}
typedef void (*bf16_fn)(const uint16_t *, int, int, int, const uint16_t *, float *);
#define BF16_ROWS(R, U) BF16_KERNEL(bf16dot_##R, R, U) BF16_KERNEL(bf16dot_##R##_tail, R, 1)
BF16_ROWS(2, 2) BF16_ROWS(3, 2) BF16_ROWS(4, 2) BF16_ROWS(5, 2) BF16_ROWS(6, 2) BF16_ROWS(7, 2) BF16_ROWS(8, 2)
static const struct { bf16_fn run, tail; int weight_rows; } bf16dot[BF16_TILE + 1] = {
    {0, 0, 0}, {bf16dot_1, bf16dot_1, 1}, {bf16dot_2, bf16dot_2_tail, 2}, {bf16dot_3, bf16dot_3_tail, 2},
    {bf16dot_4, bf16dot_4_tail, 2}, {bf16dot_5, bf16dot_5_tail, 2}, {bf16dot_6, bf16dot_6_tail, 2},
    {bf16dot_7, bf16dot_7_tail, 2}, {bf16dot_8, bf16dot_8_tail, 2}};

/* skulk_half_mv for bf16 weights and activations: the activations are read as they are, no f32 copy */
static void bf16_mv(const uint16_t *w, int N, int K, const uint16_t *x, int R, const float *bias, void *y, int ytype) {
    float *acc = scratch((size_t)R * N * sizeof(float));
    const int blocks = (N + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel for schedule(static) if ((size_t)N * K >= (1u << 18))
    for (int b = 0; b < blocks; b++) {
        int n0 = b * BLOCK_N, n1 = n0 + BLOCK_N < N ? n0 + BLOCK_N : N;
        for (int r0 = 0; r0 < R; r0 += BF16_TILE) {
            int rows = R - r0 < BF16_TILE ? R - r0 : BF16_TILE, step = bf16dot[rows].weight_rows, n = n0;
            for (; n + step <= n1; n += step) bf16dot[rows].run(w, n, K, N, x + (size_t)r0 * K, acc + (size_t)r0 * N);
            for (; n < n1; n++) bf16dot[rows].tail(w, n, K, N, x + (size_t)r0 * K, acc + (size_t)r0 * N);
        }
        finish(acc, N, R, n0, n1, N, bias, y, ytype);
    }
}
#endif

/* Rows are widened (and, for quantized weights, quantized) inside the parallel region, a row per thread, and each
 * unit of work finishes its own outputs: done serially around the region, that work left the other thread idle. */
void skulk_half_mv(const void *w, int wtype, int N, int K, const void *x, int xtype, int R, const float *bias,
                   void *y, int ytype) {
#ifdef BF16_TILE
    if (wtype == T_BF16 && xtype == T_BF16 && R > 1) { /* see bf16dot_1 for why one row stays below */
        bf16_mv(w, N, K, x, R, bias, y, ytype);
        return;
    }
#endif
    float *xf = scratch(((size_t)R * K + (size_t)R * N) * sizeof(float));
    float *acc = xf + (size_t)R * K;
    const half_fn *family = wtype == T_F16 ? half_f16 : wtype == T_BF16 ? half_bf16 : half_f32;
    const int blocks = (N + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel if ((size_t)N * K >= (1u << 18))
    {
#pragma omp for schedule(static)
        for (int r = 0; r < R; r++)
            row_to_f32((const char *)x + (size_t)r * K * type_size(xtype), xtype, K, xf + (size_t)r * K);
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++) {
            int n0 = b * BLOCK_N, n1 = n0 + BLOCK_N < N ? n0 + BLOCK_N : N;
            for (int r0 = 0; r0 < R; r0 += HALF_TILE) {
                int rows = R - r0 < HALF_TILE ? R - r0 : HALF_TILE;
                family[rows](w, n0, n1, K, N, xf + (size_t)r0 * K, acc + (size_t)r0 * N);
            }
            finish(acc, N, R, n0, n1, N, bias, y, ytype);
        }
    }
}

/* ---- MLX affine 4- and 8-bit weights ------------------------------------------------------------------------ */
/* Weights are interleaved in blocks of 8 output rows (quant.py's interleave8 writes this layout once at load), so
 * one pass computes 8 outputs, one per 32-bit lane, in row order, and the per-group scaling is one vector op for 8
 * rows. Per block and 8 columns c..c+7:
 *   4 bits: 32 bytes; byte 4n + j holds row n's column c+j in its low nibble and column c+4+j in its high one;
 *   8 bits: 64 bytes; row n's columns c..c+3 at bytes 4n.., its columns c+4..c+7 at 32 + 4n.. (values q - 128);
 *   scales and biases: per block, [group][8 rows] f16.
 * Multiplying either half by its 4 activation values broadcast to every lane (maddubs) and adding lane pairs
 * (madd) leaves one sum per row. Each activation row is quantized to int8 per group (symmetric, one f32 scale xs;
 * xsum = xs * the sum of its quantized values), and a group adds scale * xs * dot(q, x_q) + bias * xsum, all 8
 * rows at once. */
/* one activation row xf [K] to int8 xq [K] with a scale xs and xsum per group */
static void quantize_row(const float *xf, int K, int group, int8_t *xq, float *xs, float *xsum) {
    const int groups = K / group;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < groups; g++) {
        const float *v = xf + (size_t)g * group;
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < group; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
        const float d = hmax(mx) / 127.0f;
        const __m256 inv = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
        int8_t *q = xq + (size_t)g * group;
        __m256i sum = _mm256_setzero_si256();
        for (int i = 0; i < group; i += 32) {
            __m256i v32[4];
            for (int j = 0; j < 4; j++) {
                v32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * j), inv));
                sum = _mm256_add_epi32(sum, v32[j]);
            }
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v32[0], v32[1]), _mm256_packs_epi32(v32[2], v32[3]));
            _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        xs[g] = d;
        xsum[g] = d * (float)hsum_epi32(sum); /* of the quantized values, so the rounding error meets
                                                 w = scale * q + bias, not scale * q alone */
    }
}


/* s: int16 sums (two lanes per row) over 8 columns of one activation row; 4 chunks of 4 bits fit in int16 */
#define Q4_CHUNK(R)                                                                                              \
    __m256i v = _mm256_loadu_si256((const __m256i *)(wb + col * 4));                                          \
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);               \
    for (int r = 0; r < R; r++) {                                                                              \
        const int8_t *xr = xq + (size_t)r * K + col;                                                           \
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(*(const int32_t *)xr)));       \
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(*(const int32_t *)(xr + 4)))); \
        PIN(s[r]);                                                                                             \
    }

/* 8 bits: maddubs takes one unsigned operand, so it gets |w| and x takes w's sign; its pair sums use all of int16 */
#define Q8_CHUNK(R)                                                                                              \
    __m256i va = _mm256_loadu_si256((const __m256i *)(wb + col * 8)),                                         \
            vb = _mm256_loadu_si256((const __m256i *)(wb + col * 8 + 32));                                    \
    __m256i aa = _mm256_abs_epi8(va), ab = _mm256_abs_epi8(vb);                                               \
    for (int r = 0; r < R; r++) {                                                                              \
        const int8_t *xr = xq + (size_t)r * K + col;                                                           \
        __m256i pa = _mm256_maddubs_epi16(aa, _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)xr), va));  \
        __m256i pb = _mm256_maddubs_epi16(ab, _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)(xr + 4)), vb)); \
        d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(pa, ones));                                            \
        d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(pb, ones));                                            \
        PIN(d[r]);                                                                                             \
    }

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#ifdef DPBUSD
/* With VNNI (cpu_kernels.py adds the flags where the CPU has it) one vpdpbusd multiplies 4 unsigned weight bytes by
 * 4 signed activation bytes and adds them into the row's int32 lane: no int16 sums to widen, half the vector ops of
 * maddubs + add, which is what bounds a step of several rows. Two sums per row (low and high half) keep the
 * dependency chains short. 8-bit values are stored q - 128, so flipping the sign bit gives q >= 0 back; the
 * kernel subtracts the 128 again per group (BIAS below). */
#define VNNI_ROWS(R, A, B)                                                                                       \
    for (int r = 0; r < R; r++) {                                                                              \
        const int8_t *xr = xq + (size_t)r * K + col;                                                           \
        d[r] = DPBUSD(d[r], A, _mm256_set1_epi32(*(const int32_t *)xr));                                       \
        e[r] = DPBUSD(e[r], B, _mm256_set1_epi32(*(const int32_t *)(xr + 4)));                                 \
        PIN(d[r]);                                                                                             \
        PIN(e[r]);                                                                                             \
    }
#define Q4_CHUNK_VNNI(R)                                                                                         \
    __m256i v = _mm256_loadu_si256((const __m256i *)(wb + col * 4));                                          \
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);               \
    VNNI_ROWS(R, lo, hi)
#define Q8_CHUNK_VNNI(R)                                                                                         \
    __m256i ua = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + col * 8)), flip),                 \
            ub = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + col * 8 + 32)), flip);            \
    VNNI_ROWS(R, ua, ub)
#endif

/* d[r]: one group's int32 dot products of activation row r with the block's 8 weight rows, one lane per row */
#ifdef DPBUSD
#define GROUP_DOTS(R, BITS)                                                                                      \
    __m256i d[R], e[R];                                                                                        \
    for (int r = 0; r < R; r++) d[r] = e[r] = _mm256_setzero_si256();                                         \
    for (int c = 0; c < group; c += 8) {                                                                       \
        const size_t col = (size_t)g * group + c;                                                              \
        if (BITS == 4) {                                                                                       \
            Q4_CHUNK_VNNI(R)                                                                                   \
        } else {                                                                                               \
            Q8_CHUNK_VNNI(R)                                                                                   \
        }                                                                                                      \
    }                                                                                                          \
    for (int r = 0; r < R; r++) d[r] = _mm256_add_epi32(d[r], e[r]);
/* the 8-bit dot was of q, not of the stored q - 128: take 128 * sum(x) back out through the bias term */
#define BIAS(bv, sv, BITS) ((BITS) == 8 ? _mm256_fnmadd_ps(sv, _mm256_set1_ps(128.0f), bv) : (bv))
#else
#define GROUP_DOTS(R, BITS)                                                                                      \
    __m256i d[R];                                                                                              \
    for (int r = 0; r < R; r++) d[r] = _mm256_setzero_si256();                                                 \
    for (int c0 = 0; c0 < group; c0 += 32) {                                                                   \
        if (BITS == 4) {                                                                                       \
            __m256i s[R];                                                                                      \
            for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();                                         \
            for (int c = c0; c < c0 + 32; c += 8) {                                                            \
                const size_t col = (size_t)g * group + c;                                                      \
                Q4_CHUNK(R)                                                                                    \
            }                                                                                                  \
            for (int r = 0; r < R; r++) d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(s[r], ones));         \
        } else                                                                                                 \
            for (int c = c0; c < c0 + 32; c += 8) {                                                            \
                const size_t col = (size_t)g * group + c;                                                      \
                Q8_CHUNK(R)                                                                                    \
            }                                                                                                  \
    }
#define BIAS(bv, sv, BITS) (bv)
#endif

#define QUANT_KERNEL(NAME, R, BITS, FIXED)                                                                       \
    static void NAME(const uint8_t *w, const uint16_t *scales, const uint16_t *biases, int group_, int b0, int b1, \
                     int K, int stride, const int8_t *xq, const float *xs, const float *xsum, float *out) {        \
        const int group = FIXED ? FIXED : group_, groups = K / group;                                          \
        const size_t block_bytes = (size_t)K * BITS; /* 8 rows of K * BITS / 8 bytes */                        \
        const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(-128); \
        (void)ones, (void)low, (void)flip;                                                                     \
        for (int b = b0; b < b1; b++) {                                                                        \
            const uint8_t *wb = w + (size_t)b * block_bytes;                                                   \
            const uint16_t *sb = scales + (size_t)b * 8 * groups, *bb = biases + (size_t)b * 8 * groups;       \
            __m256 acc[R];                                                                                     \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                          \
            for (int g = 0; g < groups; g++) {                                                                 \
                for (size_t at = (size_t)g * group * BITS; at < (size_t)(g + 1) * group * BITS; at += 64)      \
                    _mm_prefetch((const char *)(wb + at + PREFETCH_BYTES), PREFETCH_HINT); /* keep DRAM busy */   \
                GROUP_DOTS(R, BITS)                                                                            \
                const __m256 sv = load_f16(sb + (size_t)g * 8), bv = BIAS(load_f16(bb + (size_t)g * 8), sv, BITS); \
                for (int r = 0; r < R; r++) {                                                                  \
                    __m256 sx = _mm256_mul_ps(sv, _mm256_broadcast_ss(xs + (size_t)r * groups + g));           \
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), sx, acc[r]);                            \
                    acc[r] = _mm256_fmadd_ps(bv, _mm256_broadcast_ss(xsum + (size_t)r * groups + g), acc[r]);   \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < R; r++) _mm256_storeu_ps(out + (size_t)r * stride + (size_t)b * 8, acc[r]);   \
        }                                                                                                      \
    }

typedef void (*quant_fn)(const uint8_t *, const uint16_t *, const uint16_t *, int, int, int, int, int, const int8_t *,
                         const float *, const float *, float *);
#if QUANT_TILE == 8
#define QUANT_WIDE(NAME, BITS, FIXED)                                                                            \
    QUANT_KERNEL(NAME##_5, 5, BITS, FIXED) QUANT_KERNEL(NAME##_6, 6, BITS, FIXED)                              \
    QUANT_KERNEL(NAME##_7, 7, BITS, FIXED) QUANT_KERNEL(NAME##_8, 8, BITS, FIXED)
#define QUANT_WIDE_FNS(NAME) , NAME##_5, NAME##_6, NAME##_7, NAME##_8
#else
#define QUANT_WIDE(NAME, BITS, FIXED)
#define QUANT_WIDE_FNS(NAME)
#endif
#define QUANT_FAMILY(NAME, BITS, FIXED)                                                                          \
    QUANT_KERNEL(NAME##_1, 1, BITS, FIXED)                                                                     \
    QUANT_KERNEL(NAME##_2, 2, BITS, FIXED)                                                                     \
    QUANT_KERNEL(NAME##_3, 3, BITS, FIXED)                                                                     \
    QUANT_KERNEL(NAME##_4, 4, BITS, FIXED)                                                                     \
    QUANT_WIDE(NAME, BITS, FIXED)                                                                              \
    static const quant_fn NAME[QUANT_TILE + 1] = {0, NAME##_1, NAME##_2, NAME##_3, NAME##_4 QUANT_WIDE_FNS(NAME)};
QUANT_FAMILY(q4, 4, 0)
QUANT_FAMILY(q4_64, 4, 64)
QUANT_FAMILY(q8, 8, 0)
QUANT_FAMILY(q8_64, 8, 64)

#if defined(__AVX512VNNI__) && defined(DPBUSD)
/* AVX-512 (Sapphire Rapids, Zen 4): two blocks of 8 weight rows side by side in one 512-bit vector, 16 outputs per
 * vpdpbusd. A step of several rows is bound by these multiply-adds (measured: 8+ rows at ~0.9 ms a row on the 100M
 * int4 model, 1 thread, against 2.6 ms for one row's weight reads), and the 512-bit form does twice the work per
 * instruction at about the same rate (~1.8x the multiply-adds a second, measured on the 2-core Xeon). The same
 * integer sums and the same float operations per lane, in the same order, as the 256-bit kernel: bit-identical
 * outputs. A unit's odd last block goes through the 256-bit kernel. */
#define PIN512(v) __asm__("" : "+v"(v))
#define VNNI512_ROWS(R, A, B)                                                                                    \
    for (int r = 0; r < R; r++) {                                                                              \
        const int8_t *xr = xq + (size_t)r * K + col;                                                           \
        d[r] = _mm512_dpbusd_epi32(d[r], A, _mm512_set1_epi32(*(const int32_t *)xr));                          \
        e[r] = _mm512_dpbusd_epi32(e[r], B, _mm512_set1_epi32(*(const int32_t *)(xr + 4)));                    \
        PIN512(d[r]);                                                                                          \
        PIN512(e[r]);                                                                                          \
    }
#define QUANT_KERNEL512(NAME, R, BITS, FIXED, NARROW)                                                            \
    static void NAME(const uint8_t *w, const uint16_t *scales, const uint16_t *biases, int group_, int b0, int b1, \
                     int K, int stride, const int8_t *xq, const float *xs, const float *xsum, float *out) {        \
        const int group = FIXED ? FIXED : group_, groups = K / group;                                          \
        const size_t block_bytes = (size_t)K * BITS;                                                           \
        const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(-128);                             \
        (void)low, (void)flip;                                                                                 \
        int b = b0;                                                                                            \
        for (; b + 1 < b1; b += 2) {                                                                           \
            const uint8_t *wa = w + (size_t)b * block_bytes, *wb = wa + block_bytes;                           \
            const uint16_t *sa = scales + (size_t)b * 8 * groups, *ba = biases + (size_t)b * 8 * groups;       \
            const uint16_t *sb = sa + (size_t)8 * groups, *bb = ba + (size_t)8 * groups;                       \
            __m512 acc[R];                                                                                     \
            for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                          \
            for (int g = 0; g < groups; g++) {                                                                 \
                for (size_t at = (size_t)g * group * BITS; at < (size_t)(g + 1) * group * BITS; at += 64) {    \
                    _mm_prefetch((const char *)(wa + at + PREFETCH_BYTES), PREFETCH_HINT);                     \
                    _mm_prefetch((const char *)(wb + at + PREFETCH_BYTES), PREFETCH_HINT);                     \
                }                                                                                              \
                __m512i d[R], e[R];                                                                            \
                for (int r = 0; r < R; r++) d[r] = e[r] = _mm512_setzero_si512();                              \
                for (int c = 0; c < group; c += 8) {                                                           \
                    const size_t col = (size_t)g * group + c;                                                  \
                    if (BITS == 4) {                                                                           \
                        __m512i v = pair_load(wa + col * 4, wb + col * 4);                                     \
                        __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low); \
                        VNNI512_ROWS(R, lo, hi)                                                                \
                    } else {                                                                                   \
                        __m512i ua = _mm512_xor_si512(pair_load(wa + col * 8, wb + col * 8), flip),            \
                                ub = _mm512_xor_si512(pair_load(wa + col * 8 + 32, wb + col * 8 + 32), flip);  \
                        VNNI512_ROWS(R, ua, ub)                                                                \
                    }                                                                                          \
                }                                                                                              \
                const __m512 sv = pair_f16(sa + (size_t)g * 8, sb + (size_t)g * 8);                            \
                __m512 bv = pair_f16(ba + (size_t)g * 8, bb + (size_t)g * 8);                                  \
                if (BITS == 8) bv = _mm512_fnmadd_ps(sv, _mm512_set1_ps(128.0f), bv);                          \
                for (int r = 0; r < R; r++) {                                                                  \
                    __m512i dr = _mm512_add_epi32(d[r], e[r]);                                                 \
                    __m512 sx = _mm512_mul_ps(sv, _mm512_set1_ps(xs[(size_t)r * groups + g]));                 \
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dr), sx, acc[r]);                              \
                    acc[r] = _mm512_fmadd_ps(bv, _mm512_set1_ps(xsum[(size_t)r * groups + g]), acc[r]);        \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (size_t)r * stride + (size_t)b * 8, acc[r]);   \
        }                                                                                                      \
        if (b < b1) NARROW(w, scales, biases, group_, b, b1, K, stride, xq, xs, xsum, out);                    \
    }
#define QUANT_FAMILY512(NAME, BITS, FIXED)                                                                       \
    QUANT_KERNEL512(NAME##_w1, 1, BITS, FIXED, NAME##_1) QUANT_KERNEL512(NAME##_w2, 2, BITS, FIXED, NAME##_2)     \
    QUANT_KERNEL512(NAME##_w3, 3, BITS, FIXED, NAME##_3) QUANT_KERNEL512(NAME##_w4, 4, BITS, FIXED, NAME##_4)     \
    QUANT_KERNEL512(NAME##_w5, 5, BITS, FIXED, NAME##_5) QUANT_KERNEL512(NAME##_w6, 6, BITS, FIXED, NAME##_6)     \
    QUANT_KERNEL512(NAME##_w7, 7, BITS, FIXED, NAME##_7) QUANT_KERNEL512(NAME##_w8, 8, BITS, FIXED, NAME##_8)
#define WIDE_FNS(NAME) {0, NAME##_w1, NAME##_w2, NAME##_w3, NAME##_w4, NAME##_w5, NAME##_w6, NAME##_w7, NAME##_w8}
QUANT_FAMILY512(q4, 4, 0)
QUANT_FAMILY512(q4_64, 4, 64)
QUANT_FAMILY512(q8, 8, 0)
QUANT_FAMILY512(q8_64, 8, 64)
static const quant_fn q4_wide[] = WIDE_FNS(q4), q4_64_wide[] = WIDE_FNS(q4_64), q8_wide[] = WIDE_FNS(q8),
                      q8_64_wide[] = WIDE_FNS(q8_64);
#define QUANT_512 1
/* the fewest activation rows that take the 512-bit kernels (one row is bound by reading the weights, not by
 * multiplying them: the 256-bit kernel is as fast); a variable so bench/paged.py can time both in one run */
int skulk_quant_wide_rows = 2;
#else
#define QUANT_512 0
#endif


/* the kernels for R activation rows of these weights */
static const quant_fn *quant_family(int bits, int group, int R) {
#if QUANT_512
    if (R >= skulk_quant_wide_rows)
        return bits == 4 ? (group == 64 ? q4_64_wide : q4_wide) : (group == 64 ? q8_64_wide : q8_wide);
#endif
    (void)R;
    return bits == 4 ? (group == 64 ? q4_64 : q4) : (group == 64 ? q8_64 : q8);
}

/* one activation row x [K] (xtype) as the quantized kernels read it: int8 xq [K], xs and xsum [K / group];
 * xf: K floats of room */
void skulk_quantize_row(const void *x, int xtype, int K, int group, float *xf, int8_t *xq, float *xs, float *xsum) {
    row_to_f32(x, xtype, K, xf);
    quantize_row(xf, K, group, xq, xs, xsum);
}

/* y [R, N] (ytype) = R activation rows already quantized (skulk_quantize_row, rows K apart) against w, every block on
 * the calling thread: skulk_quant_mv's kernels, tiles and finish without its parallel region, for a caller that runs
 * many small matrices a thread each (cpu_moe.c's experts: a region costs about 2 us, an expert's matrices for one row
 * 10-30). The same outputs as skulk_quant_mv's, bit for bit, but for its AMX kernel (SKULK_AMX, 16+ rows), which
 * matches the VNNI kernels this uses. acc: R x (N rounded up to 8) floats of room. */
void skulk_quant_rows(const matrix_t *m, int R, const int8_t *xq, const float *xs, const float *xsum, float *acc,
                      void *y, int ytype) {
    const int K = m->k, N = m->n, groups = K / m->group, blocks = (N + 7) / 8, stride = blocks * 8;
    const quant_fn *family = quant_family(m->bits, m->group, R);
    const int per_unit = BLOCK_N / 8;
    for (int b0 = 0; b0 < blocks; b0 += per_unit) { /* a unit's weights stay in L1 for the next tile of rows */
        const int b1 = b0 + per_unit < blocks ? b0 + per_unit : blocks;
        for (int r0 = 0; r0 < R; r0 += QUANT_TILE) {
            int rows = R - r0 < QUANT_TILE ? R - r0 : QUANT_TILE;
            family[rows](m->w, m->scales, m->biases, m->group, b0, b1, K, stride, xq + (size_t)r0 * K,
                         xs + (size_t)r0 * groups, xsum + (size_t)r0 * groups, acc + (size_t)r0 * stride);
        }
    }
    finish(acc, stride, R, 0, N, N, m->bias, y, ytype);
}

/* w: the interleaved layout above, ceil(N / 8) blocks (rows past N are zero); K a multiple of group, group a
 * multiple of 32 and at most 256. */
void skulk_quant_mv(const uint8_t *w, const uint16_t *scales, const uint16_t *biases, int bits, int group, int N, int K,
                    const void *x, int xtype, int R, const float *bias, void *y, int ytype) {
    const int groups = K / group, blocks = (N + 7) / 8, stride = blocks * 8;
    size_t floats = (size_t)R * K + (size_t)R * stride + 2 * (size_t)R * groups;
    /* xq's rows padded to a multiple of 16: the AMX kernel's tiles read (and drop) rows past R */
    float *xf = scratch(floats * sizeof(float) + (size_t)((R + 15) & ~15) * K + 64);
    float *acc = xf + (size_t)R * K, *xs = acc + (size_t)R * stride, *xsum = xs + (size_t)R * groups;
    int8_t *xq = (int8_t *)(xsum + (size_t)R * groups);
    const quant_fn *family = quant_family(bits, group, R);
    const int per_unit = BLOCK_N / 8, units = (blocks + per_unit - 1) / per_unit;
#ifdef SKULK_AMX
    const int amx = skulk_amx_rows > 0 && R >= skulk_amx_rows;
#else
    const int amx = 0;
#endif
#pragma omp parallel if ((size_t)N * K >= (1u << 18))
    {
#ifdef SKULK_AMX
        if (amx) skulk_amx_begin(group);
#endif
#pragma omp for schedule(static)
        for (int r = 0; r < R; r++) {
            row_to_f32((const char *)x + (size_t)r * K * type_size(xtype), xtype, K, xf + (size_t)r * K);
            quantize_row(xf + (size_t)r * K, K, group, xq + (size_t)r * K, xs + (size_t)r * groups,
                         xsum + (size_t)r * groups);
        }
#pragma omp for schedule(static)
        for (int u = 0; u < units; u++) {
            int b0 = u * per_unit, b1 = b0 + per_unit < blocks ? b0 + per_unit : blocks;
#ifdef SKULK_AMX
            if (amx)
                skulk_amx_quant(w, scales, biases, bits, group, b0, b1, K, stride, R, xq, xs, xsum, acc);
            else
#endif
                for (int r0 = 0; r0 < R; r0 += QUANT_TILE) {
                    int rows = R - r0 < QUANT_TILE ? R - r0 : QUANT_TILE;
                    family[rows](w, scales, biases, group, b0, b1, K, stride, xq + (size_t)r0 * K,
                                 xs + (size_t)r0 * groups, xsum + (size_t)r0 * groups, acc + (size_t)r0 * stride);
                }
            finish(acc, stride, R, b0 * 8, b1 * 8 < N ? b1 * 8 : N, N, bias, y, ytype);
        }
#ifdef SKULK_AMX
        if (amx) skulk_amx_end();
#endif
    }
    (void)amx;
}
