/* Shared by cpu_matmul.c and cpu_step.c (engines/torch/cpu_kernels.py builds both into one library): dtype
 * codes, per-thread scratch, conversions between f32 and the activations' dtypes, and the public entry points. */
#ifndef SKULK_CPU_KERNELS_H
#define SKULK_CPU_KERNELS_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { T_F32 = 0, T_F16 = 1, T_BF16 = 2 };

static __thread void *scratch_buf;
static __thread size_t scratch_len;

static inline void *scratch(size_t bytes) {
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

static inline void row_to_f32(const void *x, int type, int n, float *out) {
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


/* v[0..n) stored at y[at..] in the type */
static inline void store_row(const float *v, void *y, int type, size_t at, int n) {
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

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

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

static inline size_t type_size(int type) { return type == T_F32 ? 4 : 2; }

/* Columns n0..n1 of every row's f32 sums (stride floats apart), plus bias, stored to y [rows, n] in ytype. Each
 * unit of parallel work finishes its own columns, so no serial pass over the outputs follows the kernels. */
static inline void finish(float *acc, int stride, int rows, int n0, int n1, int n, const float *bias, void *y,
                          int ytype) {
    for (int r = 0; r < rows; r++) {
        float *row = acc + (size_t)r * stride;
        if (bias)
            for (int i = n0; i < n1; i++) row[i] += bias[i];
        store_row(row + n0, y, ytype, (size_t)r * n + n0, n1 - n0);
    }
}

static inline __m256 load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* R rows of x against weight rows [n0, n1); U independent accumulators per row keep the FMA pipes busy when R is
 * small. Instantiated per (R, U, dtype) so every loop below unrolls into registers. */

static inline float round_to(float v, int type) {
    if (type == T_F16) return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
    if (type == T_BF16) return bf16_to_f32(f32_to_bf16(v));
    return v;
}

/* weights are prefetched into L2 (T2: into L1 they took fill buffers the loads needed), this many bytes of the
 * quantized kernels' interleaved blocks ahead (cpu_matmul.c says what it gained) */
#define PREFETCH_HINT _MM_HINT_T2
#define PREFETCH_BYTES 8192

#ifdef __AVX512F__
/* two blocks of 8 weight rows side by side in one 512-bit vector: their 32-byte chunks, and their 8 f16 scales */
static inline __m512i pair_load(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline __m512 pair_f16(const uint16_t *a, const uint16_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#define SKULK_AMX 1 /* cpu_amx.c: the quantized matmul on AMX tiles */
void skulk_amx_begin(int group);
void skulk_amx_end(void);
void skulk_amx_quant(const uint8_t *w, const uint16_t *scales, const uint16_t *biases, int bits, int group, int b0,
                     int b1, int K, int stride, int R, const int8_t *xq, const float *xs, const float *xsum,
                     float *out);
#endif
extern int skulk_amx_rows;

void skulk_half_mv(const void *w, int wtype, int N, int K, const void *x, int xtype, int R, const float *bias,
                   void *y, int ytype);
void skulk_quant_mv(const uint8_t *w, const uint16_t *scales, const uint16_t *biases, int bits, int group, int N, int K,
                    const void *x, int xtype, int R, const float *bias, void *y, int ytype);
/* A matrix as the layer and MoE kernels read it (cpu_kernels.MatrixDesc): f16/bf16/f32 weights, or our quantized
 * layout (quant.interleave8). */
typedef struct {
    int kind; /* 0: f16/bf16/f32 weights, 1: our quantized layout */
    int wtype, bits, group, n, k;
    const void *w;
    const uint16_t *scales, *biases;
    const float *bias;
} matrix_t;

/* y [R, n] = x [R, k] @ m.T (+ bias), x and y in `type` */
static inline void mv(const matrix_t *m, const void *x, int type, int R, void *y) {
    if (m->kind == 0) skulk_half_mv(m->w, m->wtype, m->n, m->k, x, type, R, m->bias, y, type);
    else skulk_quant_mv(m->w, m->scales, m->biases, m->bits, m->group, m->n, m->k, x, type, R, m->bias, y, type);
}

void skulk_quantize_row(const void *x, int xtype, int K, int group, float *xf, int8_t *xq, float *xs, float *xsum);
void skulk_quant_rows(const matrix_t *m, int R, const int8_t *xq, const float *xs, const float *xsum, float *acc,
                      void *y, int ytype);
void skulk_act_row(const void *gate_up, int type, int I, int gelu, float *buf, void *out);

/* A sparse MoE block (moe.SparseMoe, cpu_moe.c): a softmax router and per expert its stacked gate/up [2 inter,
 * hidden] and down [hidden, inter], SiLU-gated (cpu_kernels.MoeDesc). */
typedef struct {
    matrix_t router;
    const matrix_t *gate_up, *down;
    int experts, top_k, inter, hidden, normalize;
} moe_t;

void skulk_act_mul(const void *gate_up, int type, int rows, int I, int gelu, void *out);
void skulk_moe_mix(const moe_t *M, const void *x, int type, int R, const int32_t *ids, const float *weights, void *out);
void skulk_moe(const moe_t *M, const void *x, int type, int R, void *out);
#endif
