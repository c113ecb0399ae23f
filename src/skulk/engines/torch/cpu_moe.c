/* A sparse mixture-of-experts block for a few rows (a decode step, or a short chunk) in one call: moe.SparseMoe's
 * softmax router and its experts' SiLU-gated MLPs, each picked expert once over the rows that picked it, with the
 * torch path's roundings (engines/torch/moe.py). From Python that path paid a dozen torch ops and three kernel calls
 * per picked expert; here an expert costs its two matmuls, and a whole MoE layer can sit inside skulk_decode_layer
 * (cpu_step.c), so a MoE model's decode step is one call as a dense one's is. */
#include "cpu_kernels.h"
#include <omp.h>
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

static inline size_t up64(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

/* Whether matrix m runs on this file's one-thread path (skulk_quant_rows) for c rows: our quantized layout, below
 * the rows that take skulk_quant_mv's AMX kernel. Else the expert's matrix goes through mv, whose parallel region is
 * inactive inside this file's (one thread, the same outputs). */
static int serial(const matrix_t *m, int c) {
#ifdef SKULK_AMX
    if (skulk_amx_rows > 0 && c >= skulk_amx_rows) return 0;
#endif
    (void)c;
    return m->kind == 1;
}

/* y [c, out] (type) = m applied to c rows; the rows are rows[i] (each m->k values of `type`) */
static void expert_matmul(const matrix_t *m, const char *const *rows, int c, int type, char *work, void *y) {
    const int K = m->k;
    const size_t es = type_size(type);
    if (serial(m, c)) {
        const int groups = K / m->group, stride = (m->n + 7) & ~7;
        float *xf = (float *)work, *acc = xf + K, *xs = acc + (size_t)c * stride, *xsum = xs + (size_t)c * groups;
        int8_t *xq = (int8_t *)(xsum + (size_t)c * groups);
        for (int i = 0; i < c; i++)
            skulk_quantize_row(rows[i], type, K, m->group, xf, xq + (size_t)i * K, xs + (size_t)i * groups,
                               xsum + (size_t)i * groups);
        skulk_quant_rows(m, c, xq, xs, xsum, acc, y, type);
        return;
    }
    char *gathered = work;
    for (int i = 0; i < c; i++) memcpy(gathered + (size_t)i * K * es, rows[i], (size_t)K * es);
    mv(m, gathered, type, c, y);
}

/* expert e for its c rows (rows[i]: x's row), its outputs y [c, hidden] in `type`. work: expert_bytes of room. */
static void run_expert(const moe_t *M, int e, const char *const *rows, int c, int type, char *work, char *y) {
    const int I = M->inter;
    const size_t es = type_size(type);
    char *gu = work, *act = gu + up64((size_t)c * 2 * I * es), *rest = act + up64((size_t)c * I * es);
    const char *act_rows[c > 0 ? c : 1];
    expert_matmul(&M->gate_up[e], rows, c, type, rest, gu);
    for (int i = 0; i < c; i++) {
        act_rows[i] = act + (size_t)i * I * es;
        skulk_act_row(gu + (size_t)i * 2 * I * es, type, I, 0, (float *)rest, act + (size_t)i * I * es);
    }
    expert_matmul(&M->down[e], act_rows, c, type, rest, y);
}

/* run_expert's room for up to c rows: its gate/up and act rows, and expert_matmul's (the larger matrix's) */
static size_t expert_bytes(const moe_t *M, int c, int type) {
    const size_t H = M->hidden, I = M->inter, es = type_size(type), widest = 2 * I > H ? 2 * I : H;
    const size_t K = H > I ? H : I, floats = K + c * (widest + 8) + 2 * (size_t)c * K / 32 + 2 * I;
    return up64((size_t)c * 2 * I * es) + up64((size_t)c * I * es) + floats * 4 + (size_t)c * K * es + 256;
}

static __thread void *work_buf;
static __thread size_t work_len;

/* out [R, hidden] = for each row, the sum over its k picks (ids [R, k], weights [R, k] as f32) of weight x
 * expert(row), as SparseMoe.mix computes it: the picks sorted by expert (stably, so rows stay in order), each expert
 * run once over its rows, each product rounded to `type` and added to the row's sum in ascending expert order,
 * rounded after every add (index_add_ on the activations' dtype).
 * The experts run independently (each on one thread, its matrices through skulk_quant_rows: no parallel region per
 * matrix, whose ~2 us each cost a decode step's ~18 picked experts a layer more than their one or two rows' work),
 * spread over the threads a few at a time; their outputs are summed afterwards, in expert order, so the result is
 * the same on any number of threads. */
void skulk_moe_mix(const moe_t *M, const void *x, int type, int R, const int32_t *ids, const float *weights,
                   void *out) {
    const int E = M->experts, k = M->top_k, H = M->hidden, picks = R * k;
    const size_t es = type_size(type);
    const size_t ints = 3 * (size_t)E + 1 + (size_t)picks, floats = (size_t)R * H + H;
    int32_t *start = moe_arena(ints * 4 + floats * 4 + up64((size_t)picks * H * es) + (size_t)picks * sizeof(void *) + 256);
    int32_t *order = start + E + 1, *fill = order + picks, *active = fill + E;
    float *sum = (float *)(active + E), *y32 = sum + (size_t)R * H;
    char *ys = (char *)(y32 + H);
    const char **rows = (const char **)(ys + up64((size_t)picks * H * es));
    memset(start, 0, (size_t)(E + 1) * 4);
    for (int p = 0; p < picks; p++) start[ids[p] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, (size_t)E * 4);
    for (int p = 0; p < picks; p++) order[fill[ids[p]]++] = p; /* counting sort: stable */
    int n = 0, most = 0;
    for (int e = 0; e < E; e++) {
        const int c = start[e + 1] - start[e];
        if (c) active[n++] = e;
        most = c > most ? c : most;
    }
    for (int p = 0; p < picks; p++) rows[p] = (const char *)x + (size_t)(order[p] / k) * H * es;
    const size_t room = expert_bytes(M, most, type);
#pragma omp parallel if (n > 1 && !omp_in_parallel() && omp_get_max_threads() > 1)
    {
        if (room > work_len) {
            free(work_buf);
            work_len = (room + 4095) & ~(size_t)4095;
            work_buf = aligned_alloc(64, work_len);
        }
#pragma omp for schedule(dynamic, 1)
        for (int a = 0; a < n; a++) {
            const int e = active[a], at = start[e];
            run_expert(M, e, rows + at, start[e + 1] - at, type, work_buf, ys + (size_t)at * H * es);
        }
    }
    memset(sum, 0, (size_t)R * H * 4);
    for (int p = 0; p < picks; p++) {
        float *row = sum + (size_t)(order[p] / k) * H;
        const float weight = weights[order[p]];
        const __m256 w = _mm256_set1_ps(weight);
        row_to_f32(ys + (size_t)p * H * es, type, H, y32);
        int j = 0;
        for (; j + 8 <= H; j += 8) {
            const __m256 product = round8(_mm256_mul_ps(_mm256_loadu_ps(y32 + j), w), type);
            _mm256_storeu_ps(row + j, round8(_mm256_add_ps(_mm256_loadu_ps(row + j), product), type));
        }
        for (; j < H; j++) row[j] = round_to(row[j] + round_to(y32[j] * weight, type), type);
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
