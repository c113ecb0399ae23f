/* A sparse mixture-of-experts block for a few rows (a decode step, or a short chunk) in one call: moe.SparseMoe's
 * softmax router and its experts' SiLU-gated MLPs, each picked expert once over the rows that picked it, with the
 * torch path's roundings (engines/torch/moe.py). From Python that path paid a dozen torch ops and three kernel calls
 * per picked expert; here an expert costs its two matmuls, and a whole MoE layer can sit inside skulk_decode_layer
 * (cpu_step.c), so a MoE model's decode step is one call as a dense one's is. */
#include "cpu_kernels.h"
/* each product rounded, then added: torch's separate mul and add (f32 too), never one fused multiply-add */
#pragma GCC optimize("fp-contract=off")

static __thread void *moe_buf;
static __thread size_t moe_len;

/* this file's own per-thread buffer: the matmul and activation kernels it calls use their own scratch */
static void *moe_arena(size_t bytes) {
    if (bytes > moe_len) {
        free(moe_buf);
        moe_len = (bytes + 4095) & ~(size_t)4095;
        moe_buf = aligned_alloc(64, moe_len);
    }
    return moe_buf;
}

/* One row's routing as SparseMoe.route computes it: softmax of the logits (already rounded to the activations'
 * dtype, taken in f32), the top k probabilities, optionally divided by their sum, rounded to `type`. probs: E floats
 * of room. The ids come out in descending probability; skulk_moe_mix orders them. */
static void route_row(float *probs, int E, int k, int normalize, int type, int32_t *ids, float *weights) {
    float best = probs[0], sum = 0.0f;
    for (int e = 1; e < E; e++) best = probs[e] > best ? probs[e] : best;
    int e = 0;
    __m256 total = _mm256_setzero_ps();
    for (; e + 8 <= E; e += 8) {
        __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(probs + e), _mm256_set1_ps(best)));
        _mm256_storeu_ps(probs + e, v);
        total = _mm256_add_ps(total, v);
    }
    sum = hsum(total);
    for (; e < E; e++) {
        float one[8] = {probs[e] - best};
        _mm256_storeu_ps(one, exp8(_mm256_loadu_ps(one)));
        probs[e] = one[0];
        sum += one[0];
    }
    const float inv = 1.0f / sum;
    for (e = 0; e < E; e++) probs[e] *= inv;
    float picked = 0.0f;
    for (int j = 0; j < k; j++) { /* selection: k is small */
        int at = -1;
        for (e = 0; e < E; e++)
            if (probs[e] >= 0.0f && (at < 0 || probs[e] > probs[at])) at = e;
        ids[j] = at;
        weights[j] = probs[at];
        picked += probs[at];
        probs[at] = -1.0f;
    }
    for (int j = 0; j < k; j++) weights[j] = round_to(normalize ? weights[j] / picked : weights[j], type);
}

/* out [R, hidden] = for each row, the sum over its k picks (ids [R, k], weights [R, k] as f32) of weight x
 * expert(row), as SparseMoe.mix computes it: the picks sorted by expert (stably, so rows stay in order), each expert
 * run once over its rows (gathered), each product rounded to `type` and added to the row's sum in ascending expert
 * order, rounded after every add (index_add_ on the activations' dtype). */
void skulk_moe_mix(const moe_t *M, const void *x, int type, int R, const int32_t *ids, const float *weights,
                   void *out) {
    const int E = M->experts, k = M->top_k, H = M->hidden, I = M->inter, picks = R * k;
    const size_t es = type_size(type);
    const size_t ints = (size_t)E + 1 + 2 * (size_t)picks, floats = (size_t)R * H + picks + H;
    const size_t rows_bytes = (size_t)R * (2 * H + 3 * I) * es;
    int32_t *start = moe_arena(ints * 4 + floats * 4 + rows_bytes + 256);
    int32_t *order = start + E + 1, *fill = order + picks;
    float *sum = (float *)(fill + picks), *weight = sum + (size_t)R * H, *y32 = weight + picks;
    char *xg = (char *)(y32 + H), *gu = xg + (size_t)R * H * es, *act = gu + (size_t)R * 2 * I * es;
    char *y = act + (size_t)R * I * es;
    memset(start, 0, (size_t)(E + 1) * 4);
    for (int p = 0; p < picks; p++) start[ids[p] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, (size_t)E * 4);
    for (int p = 0; p < picks; p++) order[fill[ids[p]]++] = p; /* counting sort: stable */
    memset(sum, 0, (size_t)R * H * 4);
    for (int e = 0; e < E; e++) {
        const int c = start[e + 1] - start[e];
        if (!c) continue;
        for (int i = 0; i < c; i++) {
            const int p = order[start[e] + i];
            memcpy(xg + (size_t)i * H * es, (const char *)x + (size_t)(p / k) * H * es, (size_t)H * es);
            weight[i] = weights[p];
        }
        mv(&M->gate_up[e], xg, type, c, gu);
        skulk_act_mul(gu, type, c, I, 0, act);
        mv(&M->down[e], act, type, c, y);
        for (int i = 0; i < c; i++) {
            float *row = sum + (size_t)(order[start[e] + i] / k) * H;
            const __m256 w = _mm256_set1_ps(weight[i]);
            row_to_f32(y + (size_t)i * H * es, type, H, y32);
            int j = 0;
            for (; j + 8 <= H; j += 8) {
                const __m256 product = round8(_mm256_mul_ps(_mm256_loadu_ps(y32 + j), w), type);
                _mm256_storeu_ps(row + j, round8(_mm256_add_ps(_mm256_loadu_ps(row + j), product), type));
            }
            for (; j < H; j++) row[j] = round_to(row[j] + round_to(y32[j] * weight[i], type), type);
        }
    }
    store_row(sum, out, type, 0, R * H);
}

/* out [R, hidden] = the whole block for x [R, hidden]: router logits (rounded to `type`, as the router's linear
 * returns them), each row's routing (route_row), then skulk_moe_mix. */
void skulk_moe(const moe_t *M, const void *x, int type, int R, void *out) {
    const int E = M->experts, k = M->top_k;
    const size_t es = type_size(type);
    char *buf = malloc((size_t)R * E * es + (size_t)E * 4 + (size_t)R * k * 8 + 64);
    float *probs = (float *)(buf + (((size_t)R * E * es + 31) & ~(size_t)31)), *weights = probs + E;
    int32_t *ids = (int32_t *)(weights + (size_t)R * k);
    mv(&M->router, x, type, R, buf);
    for (int r = 0; r < R; r++) {
        row_to_f32(buf + (size_t)r * E * es, type, E, probs);
        route_row(probs, E, k, M->normalize, type, ids + (size_t)r * k, weights + (size_t)r * k);
    }
    skulk_moe_mix(M, x, type, R, ids, weights, out);
    free(buf);
}
