/* The rest of a decode step on the CPU, beside cpu_matmul.c's matrix kernels: RMSNorm, residual add + norm,
 * act(gate) * up, q/k norms + rope + KV-cache write, decode attention, and a whole dense decoder layer in one call.
 * Each reproduces the torch path's roundings to the activations' dtype (engines/torch/layers.py). */
#include "cpu_kernels.h"

/* ---- RMSNorm ------------------------------------------------------------------------------------------------ */

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
static inline __m256 load8(const void *base, int type, size_t at) {
    if (type == T_F32) return _mm256_loadu_ps((const float *)base + at);
    if (type == T_F16) return load_f16((const uint16_t *)base + at);
    return load_bf16((const uint16_t *)base + at);
}

/* Grouped-query heads that share a kv head are computed together: each key and value is read from memory and
 * widened once for the whole group (at long contexts, or many rows, attention is bound by reading the cache), and
 * multiplied into the heads' sums held in registers, HEAD_TILE heads at a time. Widening a key once per head
 * instead made 8 rows' attention compute-bound at about half the bandwidth the cache streams at. */
#ifdef __AVX512VL__
#define HEAD_TILE 4 /* 4 heads x 4 keys of sums in AVX-512's 32 registers */
#else
#define HEAD_TILE 2
#endif
#define VALUE_AHEAD 16 /* value rows prefetched this many keys ahead */

/* the 4 dot products in a[0..3] (8 lanes each) summed into one 4-lane vector, times scale */
static inline __m128 sum4(const __m256 *a, __m128 scale) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)), scale);
}

/* scores[h][i] = scale * q[h] . key[start + i] for heads h0..h0+g of one kv head and keys i0..i0+4 */
static inline __attribute__((always_inline)) void scores_block(const float *qf, int h0, int g, const void *keys,
                                                               int type, size_t row, int D, int ld, int i0,
                                                               __m128 scale, float *scores) {
    __m256 a[HEAD_TILE][4];
    for (int h = 0; h < g; h++)
        for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 k[4];
        for (int j = 0; j < 4; j++) k[j] = load8(keys, type, row + (size_t)j * D + d);
        for (int h = 0; h < g; h++) {
            const __m256 qv = _mm256_loadu_ps(qf + (size_t)(h0 + h) * D + d);
            for (int j = 0; j < 4; j++) a[h][j] = _mm256_fmadd_ps(qv, k[j], a[h][j]);
        }
    }
    for (int h = 0; h < g; h++) _mm_storeu_ps(scores + (size_t)(h0 + h) * ld + i0, sum4(a[h], scale));
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
/* the same for bf16 queries and keys with vdpbf16ps, 16 pairs per op and no widening (the products of two bf16
 * values are exact in f32, as in the bf16 matmul kernel); D a multiple of 16 */
static inline __attribute__((always_inline)) void scores_block_bf16(const uint16_t *q, int h0, int g,
                                                                    const uint16_t *keys, size_t row, int D, int ld,
                                                                    int i0, __m128 scale, float *scores) {
    __m256 a[HEAD_TILE][4];
    for (int h = 0; h < g; h++)
        for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m256bh k[4];
        for (int j = 0; j < 4; j++)
            k[j] = (__m256bh)_mm256_loadu_si256((const __m256i *)(keys + row + (size_t)j * D + d));
        for (int h = 0; h < g; h++) {
            const __m256bh qv = (__m256bh)_mm256_loadu_si256((const __m256i *)(q + (size_t)(h0 + h) * D + d));
            for (int j = 0; j < 4; j++) a[h][j] = _mm256_dpbf16_ps(a[h][j], qv, k[j]);
        }
    }
    for (int h = 0; h < g; h++) _mm_storeu_ps(scores + (size_t)(h0 + h) * ld + i0, sum4(a[h], scale));
}
#endif

/* scores for the keys i..i+4 and heads h0..h0+g, g a constant where this is inlined */
static inline __attribute__((always_inline)) void scores_heads(const float *qf, const void *qb, int h0, int g,
                                                               const void *keys, int type, size_t row, int D, int ld,
                                                               int i, __m128 sc, float *scores) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if (type == T_BF16 && D % 16 == 0) {
        scores_block_bf16(qb, h0, g, keys, row, D, ld, i, sc, scores);
        return;
    }
#endif
    (void)qb;
    scores_block(qf, h0, g, keys, type, row, D, ld, i, sc, scores);
}

/* scores [G][ld] (columns 0..n) for the G heads of one kv head against keys start..start+n of one block, 4 keys and
 * HEAD_TILE heads at a time; qb: the heads' queries as the step has them (qf: widened to f32) */
static void attention_scores(const float *qf, const void *qb, int G, const void *keys, int type, size_t kv, int start,
                             int n, int ld, int D, float scale, float *scores) {
    const __m128 sc = _mm_set1_ps(scale);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        const size_t row = kv + (size_t)(start + i) * D;
        for (int h0 = 0; h0 < G; h0 += HEAD_TILE) {
            switch (G - h0 < HEAD_TILE ? G - h0 : HEAD_TILE) {
            case 1: scores_heads(qf, qb, h0, 1, keys, type, row, D, ld, i, sc, scores); break;
            case 2: scores_heads(qf, qb, h0, 2, keys, type, row, D, ld, i, sc, scores); break;
#if HEAD_TILE == 4
            case 3: scores_heads(qf, qb, h0, 3, keys, type, row, D, ld, i, sc, scores); break;
            case 4: scores_heads(qf, qb, h0, 4, keys, type, row, D, ld, i, sc, scores); break;
#endif
            }
        }
    }
    for (; i < n; i++)
        for (int h = 0; h < G; h++) {
            __m256 dot = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8)
                dot = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (size_t)h * D + d),
                                      load8(keys, type, kv + (size_t)(start + i) * D + d), dot);
            scores[(size_t)h * ld + i] = hsum(dot) * scale;
        }
}

/* scores[0..n) <- exp(score - max), returning their sum */
static float softmax_numerators(float *scores, int n) {
    __m256 mx = _mm256_set1_ps(-3.0e38f);
    int i = 0;
    for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(scores + i));
    float best = hmax(mx);
    for (; i < n; i++) best = scores[i] > best ? scores[i] : best;
    __m256 total = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
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
    return sum;
}

/* out[h][d0 .. d0 + 8W) = sum over the keys of p[h][i] * value[start + i] for heads h0..h0+g: each value vector
 * widened once and multiplied into every head's sums. `first`: the first pass over these keys, which reads a part
 * of each value row, so it fetches whole rows ahead of itself (without, it waited on memory at every row). */
static inline __attribute__((always_inline)) void value_cols(const float *probs, int h0, int g, const void *values,
                                                             int type, size_t kv, int start, int n, int ld, int D,
                                                             int d0, int W, int first, int add, size_t next,
                                                             float *outs) {
    const size_t es = type_size(type);
    __m256 acc[HEAD_TILE][4];
    for (int h = 0; h < g; h++)
        for (int j = 0; j < W; j++)
            acc[h][j] = add ? _mm256_loadu_ps(outs + (size_t)(h0 + h) * D + d0 + 8 * j) : _mm256_setzero_ps();
    for (int i = 0; i < n; i++) {
        const size_t row = kv + (size_t)(start + i) * D;
        if (first) { /* the row VALUE_AHEAD keys on: in this block, or the next block's rows (next) */
            const size_t ahead = i + VALUE_AHEAD < n ? row + (size_t)VALUE_AHEAD * D
                                 : next + (size_t)(i + VALUE_AHEAD - n) * D;
            if (i + VALUE_AHEAD < n || next != (size_t)-1)
                for (size_t b = 0; b < (size_t)D * es; b += 64)
                    _mm_prefetch((const char *)values + ahead * es + b, _MM_HINT_T0);
        }
        __m256 pv[HEAD_TILE];
        for (int h = 0; h < g; h++) pv[h] = _mm256_set1_ps(probs[(size_t)(h0 + h) * ld + i]);
        for (int j = 0; j < W; j++) {
            const __m256 v = load8(values, type, row + d0 + 8 * j);
            for (int h = 0; h < g; h++) acc[h][j] = _mm256_fmadd_ps(pv[h], v, acc[h][j]);
        }
    }
    for (int h = 0; h < g; h++)
        for (int j = 0; j < W; j++) _mm256_storeu_ps(outs + (size_t)(h0 + h) * D + d0 + 8 * j, acc[h][j]);
}

/* heads h0..h0+g, every column: 32 at a time (a cache line of bf16 values), then 8 */
static inline __attribute__((always_inline)) void value_heads(const float *probs, int h0, int g, const void *values,
                                                              int type, size_t kv, int start, int n, int ld, int D,
                                                              int add, size_t next, float *outs) {
    int d0 = 0, first = h0 == 0;
    for (; d0 + 32 <= D; d0 += 32, first = 0)
        value_cols(probs, h0, g, values, type, kv, start, n, ld, D, d0, 4, first, add, next, outs);
    for (; d0 < D; d0 += 8, first = 0)
        value_cols(probs, h0, g, values, type, kv, start, n, ld, D, d0, 1, first, add, next, outs);
}

/* outs[h] (+)= sum_i p[h][i] * value[start + i] over n keys of one block (probs [G][ld]; add: onto the earlier
 * blocks' sums) for the G heads, HEAD_TILE at a time (each count of heads compiled on its own, so the sums stay in
 * registers) */
static void attention_values(const float *probs, int G, const void *values, int type, size_t kv, int start, int n,
                             int ld, int D, int add, size_t next, float *outs) {
    for (int h0 = 0; h0 < G; h0 += HEAD_TILE) {
        switch (G - h0 < HEAD_TILE ? G - h0 : HEAD_TILE) {
        case 1: value_heads(probs, h0, 1, values, type, kv, start, n, ld, D, add, next, outs); break;
        case 2: value_heads(probs, h0, 2, values, type, kv, start, n, ld, D, add, next, outs); break;
#if HEAD_TILE == 4
        case 3: value_heads(probs, h0, 3, values, type, kv, start, n, ld, D, add, next, outs); break;
        case 4: value_heads(probs, h0, 4, values, type, kv, start, n, ld, D, add, next, outs); break;
#endif
        }
    }
}

/* Where position pos of a request sits in a layer's paged cache ([block, Hkv, block_size, D]): kv head h of its
 * table's block pos / block_size, row pos % block_size; table: the request's block table (int32). */
static inline size_t paged_row(const int32_t *table, int Hkv, int h, int bs, int64_t pos, int D) {
    return (((size_t)table[pos / bs] * Hkv + (size_t)h) * bs + (size_t)(pos % bs)) * D;
}

/* One query per row (a decode step) against the paged cache: q [B, H, D]; keys/values [block, Hkv, bs, D]; row b
 * reads through its block table tables + b * stride and attends its positions [positions[b] + 1 - window,
 * positions[b]] (window 0: all from 0), block by block (scores land side by side, one softmax over them all).
 * Grouped-query heads share their kv head (h / (H / Hkv)). Scores, softmax and the weighted sum run in f32; out
 * [B, H, D] in q's dtype. D must be a multiple of 8. */
void skulk_decode_attention(const void *q, const void *keys, const void *values, int type, int B, int H, int Hkv,
                            int D, const int64_t *positions, const int32_t *tables, int stride, int bs, int window,
                            float scale, void *out) {
    const int G = H / Hkv;
    size_t keys_read = 0; /* threads pay off from about 128 positions of one row, or 8 rows of 16 */
    for (int b = 0; b < B; b++) keys_read += (size_t)positions[b] + 1;
#pragma omp parallel for collapse(2) schedule(static) if (B * Hkv >= 4 && keys_read * H * D >= (1u << 17))
    for (int b = 0; b < B; b++)
        for (int g = 0; g < Hkv; g++) {
            const int len = (int)positions[b] + 1, start = window > 0 && len > window ? len - window : 0;
            const int n = len - start, h0 = g * G;
            const int32_t *table = tables + (size_t)b * stride;
            float *qf = scratch(((size_t)G * (2 * (size_t)D + n) + 8) * sizeof(float));
            float *acc = qf + (size_t)G * D, *scores = acc + (size_t)G * D;
            const void *qb = (const char *)q + ((size_t)b * H + h0) * D * type_size(type);
            for (int h = 0; h < G; h++)
                row_to_f32((const char *)qb + (size_t)h * D * type_size(type), type, D, qf + (size_t)h * D);
            for (int p = start; p < len;) { /* one block's keys at a time */
                const int end = (p / bs + 1) * bs < len ? (p / bs + 1) * bs : len;
                attention_scores(qf, qb, G, keys, type, paged_row(table, Hkv, g, bs, p, D), 0, end - p, n, D, scale,
                                 scores + (p - start));
                p = end;
            }
            for (int h = 0; h < G; h++) qf[h] = 1.0f / softmax_numerators(scores + (size_t)h * n, n); /* q is done */
            for (int p = start; p < len;) {
                const int end = (p / bs + 1) * bs < len ? (p / bs + 1) * bs : len;
                const size_t next = end < len ? paged_row(table, Hkv, g, bs, end, D) : (size_t)-1;
                attention_values(scores + (p - start), G, values, type, paged_row(table, Hkv, g, bs, p, D), 0, end - p,
                                 n, D, p > start, next, acc);
                p = end;
            }
            for (int h = 0; h < G; h++)
                for (int d = 0; d < D; d++) acc[(size_t)h * D + d] *= qf[h];
            store_row(acc, out, type, ((size_t)b * H + h0) * D, G * D);
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
 * row's position in the paged cache ([block, Hkv, bs, D], row b through its block table tables + b * stride), in
 * row order, so a later row's write to the same place wins; rotated q out [B, H, D]. D <= 512. */
void skulk_qkv_rope(const void *qkv, int type, int B, int H, int Hkv, int D, const void *cos, const void *sin,
                    const void *qnorm, const void *knorm, float eps, int unit_offset, const int64_t *positions,
                    const int32_t *tables, int stride, int bs, void *kcache, void *vcache, void *q_out) {
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
            const size_t at = paged_row(tables + (size_t)b * stride, Hkv, h, bs, positions[b], D);
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
#pragma omp parallel for schedule(static) if (rows >= 2 && (size_t)rows * I >= (1u << 14))
    for (int r = 0; r < rows; r++)
        skulk_act_row((const char *)gate_up + (size_t)r * 2 * I * type_size(type), type, I, gelu,
                      scratch((size_t)2 * I * sizeof(float)), (char *)out + (size_t)r * I * type_size(type));
}

/* One row of skulk_act_mul on the calling thread: gate_up [2 I] to out [I]; buf: 2 I floats of room. */
void skulk_act_row(const void *gate_up, int type, int I, int gelu, float *buf, void *out) {
    row_to_f32(gate_up, type, 2 * I, buf);
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
    store_row(buf, out, type, 0, I);
}

/* ---- a whole decoder layer for a decode step ---------------------------------------------------------------- */
/* layers.DecoderLayer (Llama, Qwen2/3, Mistral: pre-norm attention then a dense MLP, or Qwen3-MoE's sparse block
 * through cpu_moe.c's skulk_moe, one tensor-parallel rank) for
 * B rows of one token each, as one call: the same kernels as the torch path's calls, in the same order, with the
 * same roundings, but no Python between them. The layer and its matrices are described once (cpu_kernels.py). */
typedef struct {
    matrix_t qkv, o, gate_up, down;
    const void *in_norm, *post_norm, *q_norm, *k_norm; /* q/k norms NULL when the model has none */
    int norm_type, heads, kv_heads, head_dim, hidden, inter, gelu, unit_offset;
    float eps, qk_eps, scale;
    const moe_t *moe; /* a sparse MoE block in place of the dense MLP (gate_up, down, inter unused), or NULL */
} layer_t;

static __thread void *arena_buf;
static __thread size_t arena_len;

/* out = the layer applied to x ([B, hidden] in `type`): B rows of one token, row b at positions[b] through block
 * table tables + b * stride. Rows of one request at consecutive positions are a prefill chunk: every row's k/v is
 * stored before any row attends, so each sees the chunk's earlier tokens. keys/values: this layer's paged cache
 * ([block, Hkv, bs, D]); cos/sin [B, D]. */
void skulk_decode_layer(const layer_t *L, const void *x, void *out, int type, int B, const int64_t *positions,
                        const int32_t *tables, int stride, int bs, const void *cos, const void *sin, int window,
                        void *keys, void *values) {
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
                   L->unit_offset, positions, tables, stride, bs, keys, values, q_rot);
    skulk_decode_attention(q_rot, keys, values, type, B, L->heads, L->kv_heads, L->head_dim, positions, tables, stride,
                           bs, window, L->scale, attn);
    mv(&L->o, attn, type, B, delta);
    skulk_add_rms_norm(x, delta, type, B, L->hidden, L->post_norm, L->norm_type, L->eps, L->unit_offset, out, normed);
    if (L->moe) {
        skulk_moe(L->moe, normed, type, B, delta);
    } else {
        mv(&L->gate_up, normed, type, B, gate_up);
        skulk_act_mul(gate_up, type, B, L->inter, L->gelu, act);
        mv(&L->down, act, type, B, delta);
    }
    float *row = scratch((size_t)2 * L->hidden * sizeof(float)), *d = row + L->hidden;
    for (int r = 0; r < B; r++) { /* h + mlp(h), rounded as torch's add rounds */
        const size_t at = (size_t)r * L->hidden;
        row_to_f32((char *)out + at * es, type, L->hidden, row);
        row_to_f32(delta + at * es, type, L->hidden, d);
        for (int i = 0; i < L->hidden; i++) row[i] += d[i];
        store_row(row, out, type, at, L->hidden);
    }
}

/* The decode step through n layers in one call (the model's whole layer stack when every layer is a
 * skulk_decode_layer one): layer l reads its paged cache at keys[l] / values[l] through the rows' block tables,
 * with sliding window windows[l]. x is read, out gets the result; tmp (x's size) holds every other layer's. */
void skulk_decode_layers(const layer_t *layers, int n, const void *x, void *out, void *tmp, int type, int B,
                         const int64_t *positions, const int32_t *tables, int stride, int bs, const void *cos,
                         const void *sin, const int *windows, char *const *keys, char *const *values) {
    const void *in = x;
    for (int l = 0; l < n; l++) {
        void *dst = (n - 1 - l) % 2 == 0 ? out : tmp; /* the last layer writes out */
        skulk_decode_layer(&layers[l], in, dst, type, B, positions, tables, stride, bs, cos, sin, windows[l], keys[l],
                           values[l]);
        in = dst;
    }
}
