/* The quantized matmul (skulk_quant_mv, cpu_matmul.c) on AMX tiles, for steps of many activation rows on CPUs with
 * AMX-INT8 (Sapphire Rapids and later). engines/torch/cpu_kernels.py builds it with -mamx-tile -mamx-int8 where
 * the CPU has them, asks Linux for the tile state once per process (skulk_amx_enable), and leaves it off where that
 * is refused; without those flags this file defines only skulk_amx_rows (0: off).
 *
 * Why: from about 8 rows the VNNI kernels are bound by their multiply-adds (one vpdpbusd per 4 columns x 16 weight
 * rows x 1 activation row); one tdpbsud does 64 columns x 16 weight rows x 16 activation rows.
 *
 * Tiles. C[m][n] += sum_k A[m][k] * B[k][n], A signed bytes, B unsigned ones, B stored 4 consecutive k per dword
 * ("VNNI layout": tile row k/4 holds, for each n, k..k+3). Our interleaved weights (cpu_matmul.c) are already that
 * layout for 8 output rows: per 4 columns, 8 rows x 4 bytes. Two blocks side by side (32 + 32 bytes) make a B tile
 * row of 16 output rows, 4-bit values unpacked to bytes (low nibbles: columns c..c+3; high: c+4..c+7) and 8-bit
 * ones flipped back to q = stored + 128, exactly as the VNNI kernels feed vpdpbusd. A is the int8 activations as
 * quantize_row wrote them, rows K bytes apart: no repacking. One quantization group's integer sums are exact
 * whatever the order, and the float epilogue per group (scale * xs * dot + bias * xsum) is the VNNI kernels' own
 * operations per output in the same order, so the outputs are bit-identical to theirs.
 *
 * A pass is 16 activation rows x one pair of blocks (16 outputs) x a span of columns: A tiles tmm0/1, B tmm2/3
 * (alternating by group), products tmm4-7 (in rotation); k per tile 64 (32 for groups of 32). Measured (1 thread,
 * 100M int4 shapes, groups of 64, weights from DRAM): 1.45-1.6x the VNNI kernels at 32 rows, 1.25-1.35x at 16,
 * about even at 8, slower below (cpu_kernels.AMX_ROWS). What remains per 16 x 16 tile is its store and the float
 * epilogue, whose operations the VNNI kernels do too. */
#include "cpu_kernels.h"

int skulk_amx_rows = 0; /* the fewest activation rows that take the AMX kernel; 0: off */

#ifdef SKULK_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask Linux for the tile data state (once per process; threads and forked children share it) and, where it is
 * granted, turn the AMX kernel on from `rows` rows. Returns 1 when granted. */
int skulk_amx_enable(int rows) {
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) != 0 || !(mask & (1ul << XFEATURE_XTILEDATA))) return 0;
    skulk_amx_rows = rows;
    return 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The calling thread's tiles for one call's group size (tile state is per thread: each OpenMP thread loads it) */
void skulk_amx_begin(int group) {
    _Alignas(64) tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    const int kc = group < 64 ? group : 64;
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)kc;      /* A: 16 rows x kc bytes */
    for (int t = 2; t < 4; t++) cfg.rows[t] = (uint8_t)(kc / 4), cfg.colsb[t] = 64; /* B: kc/4 rows x 16 dwords */
    for (int t = 4; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;                /* C: 16 x 16 int32 */
    /* not _tile_loadconfig: gcc 12's asm for it names only the first 8 bytes as read, and drops the stores above */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

void skulk_amx_end(void) { _tile_release(); }

/* The B tiles of output blocks wa and wb (NULL where there is none: zeros) for all K columns: a row of 64 bytes per 4
 * columns, wa's 8 rows x 4 bytes then wb's. */
static void pack_tiles(const uint8_t *wa, const uint8_t *wb, int bits, int K, size_t ahead, int8_t *tiles) {
    const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(-128);
    __m512i *row = (__m512i *)tiles; /* tile t (kc / 4 rows of 64 bytes) at t * kc * 16 bytes: column c's row at c * 16 */
    for (int c = 0; c < K; c += 8, row += 2) {
        const size_t at = (size_t)c * (size_t)bits; /* 8 columns of 8 rows: 4 * bits bytes */
        if (bits == 8 || !(at & 63)) { /* weights stream from DRAM: prefetch a line a line */
            _mm_prefetch((const char *)(wa + at + ahead), PREFETCH_HINT);
            if (wb) _mm_prefetch((const char *)(wb + at + ahead), PREFETCH_HINT);
        }
        if (bits == 4) {
            __m512i v = wb ? pair_load(wa + at, wb + at)
                           : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(wa + at)));
            _mm512_store_si512(row, _mm512_and_si512(v, low));
            _mm512_store_si512(row + 1, _mm512_and_si512(_mm512_srli_epi32(v, 4), low));
        } else {
            for (int h = 0; h < 2; h++) {
                __m512i v = wb ? pair_load(wa + at + 32 * h, wb + at + 32 * h)
                               : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(wa + at + 32 * h)));
                _mm512_store_si512(row + h, _mm512_xor_si512(v, flip)); /* zeros flip to 128 x no row: unused */
            }
        }
    }
}

static __thread void *amx_buf;
static __thread size_t amx_len;

/* this thread's own buffer (skulk_quant_mv's scratch holds the calling thread's activations) */
static void *amx_scratch(size_t bytes) {
    if (bytes > amx_len) {
        free(amx_buf);
        amx_len = (bytes + 4095) & ~(size_t)4095;
        amx_buf = aligned_alloc(64, amx_len);
    }
    return amx_buf;
}

/* One pair of blocks' scales and biases per group as f32 (16 lanes; the upper 8 zero for an odd last block), for 8
 * bits with the 128 the dot products added taken back out through the bias, as the VNNI kernels do it */
static void widen_params(const uint16_t *sa, const uint16_t *ba, int both, int groups, int bits, float *params) {
    for (int g = 0; g < groups; g++) {
        __m512 sv, bv;
        if (both) {
            sv = pair_f16(sa + (size_t)g * 8, sa + (size_t)(groups + g) * 8);
            bv = pair_f16(ba + (size_t)g * 8, ba + (size_t)(groups + g) * 8);
        } else {
            sv = _mm512_zextps256_ps512(load_f16(sa + (size_t)g * 8));
            bv = _mm512_zextps256_ps512(load_f16(ba + (size_t)g * 8));
        }
        if (bits == 8) bv = _mm512_fnmadd_ps(sv, _mm512_set1_ps(128.0f), bv);
        _mm512_store_ps(params + (size_t)g * 32, sv);
        _mm512_store_ps(params + (size_t)g * 32 + 16, bv);
    }
}

/* Groups [0, n) of a span's share of the float sums of `rows` (at most 16) activation rows x 16 outputs (8 where
 * lanes is 0xff: an odd last block), from their int32 sums (group g's row r at c + (g * 16 + r) * 16), with the
 * operations of QUANT_KERNEL512 (QUANT_KERNEL) per output in the same order: bit-identical. The running sums start
 * at +0 (`first` span) as theirs do, or continue from out, where the span before left them. xs, xsum and params
 * start at the span's first group; xs rows are `groups` apart. N rows at once: N independent chains of fmas. */
#define EPILOGUE_ROWS(N)                                                                                         \
    static void epilogue_##N(const int32_t *c, const float *params, int n, int groups, const float *xs,          \
                             const float *xsum, int first, float *out, int stride, __mmask16 lanes) {           \
        __m512 acc[N];                                                                                         \
        for (int i = 0; i < N; i++)                                                                            \
            acc[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lanes, out + (size_t)i * stride);     \
        for (int g = 0; g < n; g++) {                                                                          \
            const __m512 sv = _mm512_load_ps(params + (size_t)g * 32), bv = _mm512_load_ps(params + (size_t)g * 32 + 16); \
            for (int i = 0; i < N; i++) {                                                                      \
                const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(c + ((size_t)g * 16 + i) * 16));          \
                acc[i] = _mm512_fmadd_ps(d, _mm512_mul_ps(sv, _mm512_set1_ps(xs[(size_t)i * groups + g])), acc[i]); \
                acc[i] = _mm512_fmadd_ps(bv, _mm512_set1_ps(xsum[(size_t)i * groups + g]), acc[i]);            \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < N; i++) _mm512_mask_storeu_ps(out + (size_t)i * stride, lanes, acc[i]);           \
    }
EPILOGUE_ROWS(1)
EPILOGUE_ROWS(4)

static void epilogue(const int32_t *c, const float *params, int rows, int n, int groups, const float *xs,
                     const float *xsum, int first, float *out, int stride, __mmask16 lanes) {
    int r = 0;
    for (; r + 4 <= rows; r += 4)
        epilogue_4(c + (size_t)r * 16, params, n, groups, xs + (size_t)r * groups, xsum + (size_t)r * groups, first,
                   out + (size_t)r * stride, stride, lanes);
    for (; r < rows; r++)
        epilogue_1(c + (size_t)r * 16, params, n, groups, xs + (size_t)r * groups, xsum + (size_t)r * groups, first,
                   out + (size_t)r * stride, stride, lanes);
}

/* Group g's products of 16 activation rows (a) with one pair's 16 outputs into tile C. Tiles are not renamed, and a
 * tile store waits for the multiply before it: consecutive groups take different A, B and C tiles (A: 0/1, B: 2/3,
 * C: 4-7), and a group's store is issued two groups later (AMX_STORE), behind their multiplies. */
#define AMX_GROUP(A, B, C)                                                                                       \
    do {                                                                                                       \
        _tile_zero(C);                                                                                         \
        for (int t = g * chunks; t < (g + 1) * chunks; t++) {                                                  \
            _tile_loadd(B, tiles + (size_t)t * kc * 16, 64);                                                   \
            _tile_loadd(A, a + (size_t)t * kc, K);                                                             \
            _tile_dpbsud(C, A, B);                                                                             \
        }                                                                                                      \
    } while (0)
#define AMX_STORE(C, G) _tile_stored(C, c + (size_t)(G) * 256, 64)
/* one step of the pipeline: group g's multiplies and group g - 2's store (tile numbers are literals: the
 * intrinsics paste them into the instruction) */
#define AMX_PHASE(A, B, C, C_STORE)                                                                              \
    do {                                                                                                       \
        if (g < n) AMX_GROUP(A, B, C);                                                                         \
        if (g >= 2 && g - 2 < n) AMX_STORE(C_STORE, g - 2);                                                    \
        g++;                                                                                                   \
    } while (0)

/* pack_tiles prefetches this many blocks ahead: the next unit's (PREFETCH_BYTES, 2.7 blocks of K = 768 int4,
 * ran 1.40-1.45x the VNNI kernels at 32 rows, this 1.46-1.54x) */
#define AHEAD 4
#define SPAN 512 /* columns per pass: its B tiles (16 bytes a column) and int32 sums (16 per column) stay in L1 */

/* Blocks b0..b1 (at most 4: BLOCK_N weight rows) against all R activation rows: float sums into out (stride floats
 * a row), as the VNNI kernels leave them. xq's rows past R up to a multiple of 16 must be readable (their products
 * are computed and dropped). The calling thread has run skulk_amx_begin(group). Per pair of blocks and span of
 * columns: its weights unpacked into B tiles (a tile load of bytes just stored waits for them), then per 16
 * activation rows every group's int32 products stored, then the float epilogue over them (vector loads of a tile
 * just stored wait for it: reading each group's right after its store took 40 % of the time). */
void skulk_amx_quant(const uint8_t *w, const uint16_t *scales, const uint16_t *biases, int bits, int group, int b0,
                     int b1, int K, int stride, int R, const int8_t *xq, const float *xs, const float *xsum,
                     float *out) {
    const int groups = K / group, kc = group < 64 ? group : 64, chunks = group / kc;
    const int span = group < SPAN ? SPAN / group * group : group, span_groups = span / group;
    const size_t block_bytes = (size_t)K * bits;
    int8_t *tiles = amx_scratch((size_t)span * 16 + (size_t)span_groups * 256 * sizeof(int32_t) +
                                (size_t)groups * 32 * sizeof(float));
    int32_t *c = (int32_t *)(tiles + (size_t)span * 16); /* [group][16 rows][16 outputs] */
    float *params = (float *)(c + (size_t)span_groups * 256); /* [group][scales 16, biases 16] */
    for (int b = b0; b < b1; b += 2) {
        const int both = b + 1 < b1;
        const uint8_t *wa = w + (size_t)b * block_bytes;
        widen_params(scales + (size_t)b * 8 * groups, biases + (size_t)b * 8 * groups, both, groups, bits, params);
        for (int k0 = 0; k0 < K; k0 += span) {
            const int g0 = k0 / group, n = (K - k0 < span ? K - k0 : span) / group;
            pack_tiles(wa + (size_t)k0 * bits, both ? wa + block_bytes + (size_t)k0 * bits : NULL, bits, n * group,
                       AHEAD * block_bytes, tiles);
            for (int r0 = 0; r0 < R; r0 += 16) {
                const int8_t *a = xq + (size_t)r0 * K + k0;
                for (int g = 0; g < n + 2;) {
                    AMX_PHASE(0, 2, 4, 6);
                    AMX_PHASE(1, 3, 5, 7);
                    AMX_PHASE(0, 2, 6, 4);
                    AMX_PHASE(1, 3, 7, 5);
                }
                epilogue(c, params + (size_t)g0 * 32, R - r0 < 16 ? R - r0 : 16, n, groups,
                         xs + (size_t)r0 * groups + g0, xsum + (size_t)r0 * groups + g0, k0 == 0,
                         out + (size_t)r0 * stride + (size_t)b * 8, stride, both ? 0xffff : 0x00ff);
            }
        }
    }
}
#endif
