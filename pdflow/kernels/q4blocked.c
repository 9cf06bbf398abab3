/* int4 weights in blocks of 16 outputs, times int16 activations: the products of the
 * "int4-a16-blocked" weight format (pdflow/engine/weights/formats.py), and int8 weights in the
 * same blocks for its output projection (further down).
 *
 * Why another layout: the row-major int4 products (products_a16.c) sum each output horizontally (a
 * group's products in four int32 lanes, converted, scaled, and the lanes reduced once per output)
 * so that a row's result does not depend on the rows beside it. For SmolLM2's 576 inputs that
 * per-output finishing costs about what the loop does, and it caps a verify pass's extra rows at
 * ~0.4 of a step (docs/design.md, "Speculative decoding"). Here 16 outputs are the 16 lanes of a
 * vector (or the 16 columns of an AMX tile), the activations are broadcast, and nothing is
 * reduced across lanes: every output is summed group by group, in the same order, by every path.
 *
 * Layout. Outputs in blocks of 16 (block b: outputs 16b .. 16b + 15), inputs in groups of 32.
 * For block b and group g, 256 bytes at q + (b * groups + g) * 256 hold the 512 codes (0..15)
 * B[r * 64 + c * 4 + i] = code of output 16b + c, input 32g + 4r + i (r 0..7, c 0..15, i 0..3):
 * byte j's low nibble is B[j] and its high nibble B[256 + j]. That is an AMX B tile (8 rows of 64
 * bytes) and, row by row, the second operand of VPDPBUSD for 16 outputs. Scales and minimums
 * are (blocks, groups, 16) floats.
 *
 * Arithmetic, identical on every path (AMX tiles, AVX-512 VNNI, AVX2, plain C), for output n and row m
 * with x quantized to int16 per group (xq, scale xs, xsum = xs * sum of xq: pdflow_quantize16):
 *     D = sum over the group's 32 inputs of xq * code             (exact in int32)
 *     acc = fma(float(D) * xs[m][g], scale[n][g], acc)
 *     lows = fma(low[n][g], xsum[m][g], lows)                     (g ascending)
 *     y = acc + lows
 * xq is split into bytes, xq = 256 * hi + lo (hi signed, lo unsigned), so that the integer dot
 * products are byte products (TDPBUSD / TDPBSSD, VPDPBUSD) and D = 256 * D_hi + D_lo exactly.
 * So a row's outputs are bit for bit the same whichever path and however many rows share the call
 * (what keeps speculative decoding's greedy outputs identical to plain decoding's). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdflow_kernels.h"

#define Q4B_GROUP 32
#define Q4B_BLOCK 16
#define Q4B_BYTES 256  /* of one block's group */
#define Q8B_BYTES 512  /* of one block's group of int8 weights */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4B_VNNI 1
#include <immintrin.h>
#else
#define Q4B_VNNI 0
#endif
#if !Q4B_VNNI && defined(__AVX2__) && defined(__FMA__)
#define Q4B_AVX2 1
#include <immintrin.h>
#else
#define Q4B_AVX2 0
#endif
#if Q4B_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define Q4B_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define Q4B_AMX 0
#endif

enum { PATH_AUTO = 0, PATH_PLAIN = 1, PATH_VNNI = 2, PATH_AMX = 3, PATH_AVX2 = 4 };
/* Rows from which the AMX path is taken: a group's tile chain (tile loads, two products, tile
 * stores, then the float steps) costs about the same whatever the rows, so below this VNNI is
 * faster (SmolLM2's products, each block's codes unpacked once for all rows: 4 rows 0.8-0.9x
 * VNNI's speed, 8 rows 1.0-1.2x, 12 rows 1.1-1.3x; its int8 head 1.4x at 8; docs/benchmarks.md,
 * "Engine"). Prefill's many rows take AMX too (formats.py). */
#define AMX_ROWS 8

/* ---- plain C: the reference every other path matches bit for bit (low NULL: int8) ---- */
static void q4b_plain(const int16_t *xq, const float *xs, const float *xsum, int64_t rows, int64_t k,
                      const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / Q4B_GROUP, blocks = n_out / Q4B_BLOCK, bytes = low ? Q4B_BYTES : Q8B_BYTES;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m = 0; m < rows; m++)
            for (int c = 0; c < Q4B_BLOCK; c++) {
                float acc = 0.0f, lows = 0.0f;
                for (int64_t g = 0; g < groups; g++) {
                    const uint8_t *qg = q + (b * groups + g) * bytes;
                    const int16_t *xg = xq + m * k + g * Q4B_GROUP;
                    int32_t dot = 0;
                    for (int r = 0; r < 8; r++)
                        for (int i = 0; i < 4; i++) {
                            const int j = r * 64 + c * 4 + i;
                            const int code = !low ? (int8_t)qg[j] : j < Q4B_BYTES ? qg[j] & 15 : qg[j - Q4B_BYTES] >> 4;
                            dot += code * xg[4 * r + i];
                        }
                    const int64_t at = (b * groups + g) * Q4B_BLOCK + c;
                    const float t = (float)dot * xs[m * groups + g];
                    acc = fmaf(t, scale[at], acc);
                    if (low) lows = fmaf(low[at], xsum[m * groups + g], lows);
                }
                y[m * n_out + b * Q4B_BLOCK + c] = low ? acc + lows : acc;
            }
}

/* int8 weights in the same blocks ("int4-a16-blocked"'s output projection): per block and
 * group, 512 bytes hold the weights themselves (signed), in the same order B[r * 64 + c * 4 + i];
 * scales (blocks, groups, 16); no minimum (low NULL), so y = acc. VNNI multiplies unsigned by
 * signed bytes, so the high bytes' products are taken against w + 128 (w ^ 0x80) and 128 * the
 * group's sum of high bytes taken off: exactly D_hi. No AVX2 path: VPMADDUBSW's pairs of
 * 255 * 127 saturate (a CPU without AVX-512 VNNI keeps the row-major int8 product: formats.py). */

#if Q4B_VNNI
/* one block's group: the 8 B rows (codes as bytes) from its 256 packed bytes */
static inline void q4b_unpack(const uint8_t *qg, __m512i w[8]) {
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(qg + 64 * j);
        w[j] = _mm512_and_si512(v, nibble);
        w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
}

/* A block's codes, scales and minimums are three streams read once, in order, by each thread:
 * fetch each ahead (as helpers.h's prefetch_ahead does for its rows: the hardware prefetchers of
 * this VM keep too few lines in flight for them). Prefetches never fault past the end. */
#define Q4B_PREFETCH_BYTES 4096
static inline void q4b_prefetch(const uint8_t *qg, const float *sg, const float *lg) {
    for (int line = 0; line < Q4B_BYTES; line += 64) _mm_prefetch((const char *)qg + Q4B_PREFETCH_BYTES + line, _MM_HINT_T0);
    _mm_prefetch((const char *)sg + Q4B_PREFETCH_BYTES / 4, _MM_HINT_T0);
    _mm_prefetch((const char *)lg + Q4B_PREFETCH_BYTES / 4, _MM_HINT_T0);
}

/* acc/lows of one row after a group's int32 dot products d (16 outputs) */
static inline void q4b_scale(__m512i d, float xs, float xsum, __m512 sw, __m512 lw, __m512 *acc, __m512 *lows) {
    *acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(xs)), sw, *acc);
    *lows = _mm512_fmadd_ps(lw, _mm512_set1_ps(xsum), *lows);
}

/* R (1..4) rows against one block: each group's codes (int4: unpacked; int8: as they lie) loaded
 * once for the R rows. eight: int8 weights (no minimum; hsum the rows' high-byte sums per group). */
static inline void q4b_vnni_tile(const uint8_t *lo, const int8_t *hi, const int32_t *hsum, const float *xs,
                                 const float *xsum, const int R, const int eight, int64_t k, const uint8_t *qb,
                                 const float *sb, const float *lb, float *y, int64_t n_out) {
    const int64_t groups = k / Q4B_GROUP;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4], lows[4];
    for (int t = 0; t < R; t++) acc[t] = lows[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i w[8], u[8];  /* w: the codes (signed as VPDPBUSD's second operand); u: as its unsigned first */
        if (eight) {
            const uint8_t *qg = qb + g * Q8B_BYTES;
            for (int r = 0; r < 8; r++) {
                _mm_prefetch((const char *)qg + Q4B_PREFETCH_BYTES + 64 * r, _MM_HINT_T0);
                w[r] = _mm512_loadu_si512(qg + 64 * r);
                u[r] = _mm512_xor_si512(w[r], flip);  /* w + 128 */
            }
            _mm_prefetch((const char *)(sb + g * Q4B_BLOCK) + Q4B_PREFETCH_BYTES / 4, _MM_HINT_T0);
        } else {
            q4b_prefetch(qb + g * Q4B_BYTES, sb + g * Q4B_BLOCK, lb + g * Q4B_BLOCK);
            q4b_unpack(qb + g * Q4B_BYTES, w);
            for (int r = 0; r < 8; r++) u[r] = w[r];  /* codes 0..15: the same bytes either way */
        }
        const __m512 sw = _mm512_loadu_ps(sb + g * Q4B_BLOCK);
        const __m512 lw = eight ? _mm512_setzero_ps() : _mm512_loadu_ps(lb + g * Q4B_BLOCK);
        for (int t = 0; t < R; t++) {
            const uint8_t *xl = lo + t * k + g * Q4B_GROUP;
            const int8_t *xh = hi + t * k + g * Q4B_GROUP;
            __m512i dl = _mm512_setzero_si512(), dh = _mm512_setzero_si512();
            for (int r = 0; r < 8; r++) {
                int32_t l4, h4;
                memcpy(&l4, xl + 4 * r, 4);
                memcpy(&h4, xh + 4 * r, 4);
                dl = _mm512_dpbusd_epi32(dl, _mm512_set1_epi32(l4), w[r]);  /* lo (unsigned) x codes */
                dh = _mm512_dpbusd_epi32(dh, u[r], _mm512_set1_epi32(h4));  /* codes (unsigned) x hi (signed) */
            }
            if (eight) dh = _mm512_sub_epi32(dh, _mm512_set1_epi32(128 * hsum[t * groups + g]));
            q4b_scale(_mm512_add_epi32(dl, _mm512_slli_epi32(dh, 8)), xs[t * groups + g],
                      eight ? 0.0f : xsum[t * groups + g], sw, lw, &acc[t], &lows[t]);
        }
    }
    for (int t = 0; t < R; t++) _mm512_storeu_ps(y + t * n_out, eight ? acc[t] : _mm512_add_ps(acc[t], lows[t]));
}

static void q4b_vnni(const uint8_t *lo, const int8_t *hi, const int32_t *hsum, const float *xs, const float *xsum,
                     int64_t rows, int64_t k, const uint8_t *q, const float *scale, const float *low, int64_t n_out,
                     float *y, int threads) {
    const int64_t groups = k / Q4B_GROUP, blocks = n_out / Q4B_BLOCK, bytes = low ? Q4B_BYTES : Q8B_BYTES;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = q + b * groups * bytes;
        const float *sb = scale + b * groups * Q4B_BLOCK, *lb = low ? low + b * groups * Q4B_BLOCK : NULL;
        for (int64_t m = 0; m < rows; m += 4) {
            const int R = rows - m < 4 ? (int)(rows - m) : 4;
            const uint8_t *l = lo + m * k;
            const int8_t *h = hi + m * k;
            const int32_t *hs = low ? NULL : hsum + m * groups;
            const float *s = xs + m * groups, *u = low ? xsum + m * groups : NULL;
            float *out = y + m * n_out + b * Q4B_BLOCK;
#define Q4B_TILE(R_, EIGHT_) q4b_vnni_tile(l, h, hs, s, u, R_, EIGHT_, k, qb, sb, lb, out, n_out)
            switch (R + 4 * !low) {  /* a constant R and kind each: the tile's loops unrolled */
                case 1: Q4B_TILE(1, 0); break;
                case 2: Q4B_TILE(2, 0); break;
                case 3: Q4B_TILE(3, 0); break;
                case 4: Q4B_TILE(4, 0); break;
                case 5: Q4B_TILE(1, 1); break;
                case 6: Q4B_TILE(2, 1); break;
                case 7: Q4B_TILE(3, 1); break;
                default: Q4B_TILE(4, 1); break;
            }
#undef Q4B_TILE
        }
    }
}
#endif

#if Q4B_AVX2
/* CPUs with AVX2 but not AVX-512 VNNI: the same integer sums from byte products summed in pairs
 * (VPMADDUBSW: at most 255 * 15 * 2, no saturation) and then in fours (VPMADDWD by ones), 8
 * outputs a vector, the block's two halves side by side; the same float steps lane for lane. */
static inline void q4b_avx2_tile(const uint8_t *lo, const int8_t *hi, const float *xs, const float *xsum, const int R,
                                 int64_t k, const uint8_t *qb, const float *sb, const float *lb, float *y,
                                 int64_t n_out) {
    const int64_t groups = k / Q4B_GROUP;
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[2][2], lows[2][2];
    for (int t = 0; t < R; t++)
        for (int h = 0; h < 2; h++) acc[t][h] = lows[t][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *qg = qb + g * Q4B_BYTES;
        for (int h = 0; h < 2; h++) {  /* outputs 8h .. 8h + 7: bytes 32h .. 32h + 31 of each B row */
            __m256i w[8];
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qg + 64 * j + 32 * h));
                w[j] = _mm256_and_si256(v, nibble);
                w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            }
            const __m256 sw = _mm256_loadu_ps(sb + g * Q4B_BLOCK + 8 * h), lw = _mm256_loadu_ps(lb + g * Q4B_BLOCK + 8 * h);
            for (int t = 0; t < R; t++) {
                const uint8_t *xl = lo + t * k + g * Q4B_GROUP;
                const int8_t *xh = hi + t * k + g * Q4B_GROUP;
                __m256i dl = _mm256_setzero_si256(), dh = _mm256_setzero_si256();
                for (int r = 0; r < 8; r++) {
                    int32_t l4, h4;
                    memcpy(&l4, xl + 4 * r, 4);
                    memcpy(&h4, xh + 4 * r, 4);
                    dl = _mm256_add_epi32(dl, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(l4), w[r]), ones));
                    dh = _mm256_add_epi32(dh, _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], _mm256_set1_epi32(h4)), ones));
                }
                const __m256 d = _mm256_cvtepi32_ps(_mm256_add_epi32(dl, _mm256_slli_epi32(dh, 8)));
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[t * groups + g])), sw, acc[t][h]);
                lows[t][h] = _mm256_fmadd_ps(lw, _mm256_set1_ps(xsum[t * groups + g]), lows[t][h]);
            }
        }
    }
    for (int t = 0; t < R; t++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + t * n_out + 8 * h, _mm256_add_ps(acc[t][h], lows[t][h]));
}

static void q4b_avx2(const uint8_t *lo, const int8_t *hi, const float *xs, const float *xsum, int64_t rows, int64_t k,
                     const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / Q4B_GROUP, blocks = n_out / Q4B_BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t m = 0; m < rows; m += 2) {
            const int64_t at = b * groups;
            float *out = y + m * n_out + b * Q4B_BLOCK;
            if (rows - m >= 2)
                q4b_avx2_tile(lo + m * k, hi + m * k, xs + m * groups, xsum + m * groups, 2, k, q + at * Q4B_BYTES,
                              scale + at * Q4B_BLOCK, low + at * Q4B_BLOCK, out, n_out);
            else
                q4b_avx2_tile(lo + m * k, hi + m * k, xs + m * groups, xsum + m * groups, 1, k, q + at * Q4B_BYTES,
                              scale + at * Q4B_BLOCK, low + at * Q4B_BLOCK, out, n_out);
        }
}
#endif

#if Q4B_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} q4b_tile_config;

static int amx_permitted = 0;  /* 0: not asked yet; 1: granted; -1: refused */

static int q4b_amx_ready(void) {
    if (amx_permitted == 0)  /* process-wide; asking twice is harmless */
        amx_permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return amx_permitted == 1;
}

/* tiles: 0, 1 the low and high bytes' int32 sums (M x 16); 2, 3 their activations (M x 32
 * bytes); 4 the block's codes (8 x 64 bytes). The configuration is static (thread-local): a
 * stack copy of it was seen optimized into an invalid one at -O2 (experiments/probe_amx.py). */
static __thread q4b_tile_config tile_config __attribute__((aligned(64)));

static void q4b_configure(int M) {
    memset(&tile_config, 0, sizeof tile_config);
    tile_config.palette = 1;
    for (int i = 0; i < 2; i++) tile_config.colsb[i] = 64, tile_config.rows[i] = (uint8_t)M;
    for (int i = 2; i < 4; i++) tile_config.colsb[i] = Q4B_GROUP, tile_config.rows[i] = (uint8_t)M;
    tile_config.colsb[4] = 64, tile_config.rows[4] = 8;
    _tile_loadconfig(&tile_config);
}

/* M (1..16) rows against one block whose codes are unpacked (codes: groups x 512 bytes, each
 * group an AMX B tile). The minimum's term is summed after the groups, in the same group order. */
static void q4b_amx_rows(const uint8_t *lo, const int8_t *hi, const float *xs, const float *xsum, int M, int64_t k,
                         const uint8_t *codes, const float *sb, const float *lb, float *y, int64_t n_out) {
    const int64_t groups = k / Q4B_GROUP;
    __m512 acc[16];
    int32_t sums[2][16 * 16] __attribute__((aligned(64)));
    for (int t = 0; t < M; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        _tile_loadd(4, codes + g * 512, 64);
        _tile_loadd(2, lo + g * Q4B_GROUP, k);
        _tile_loadd(3, hi + g * Q4B_GROUP, k);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbusd(0, 2, 4);  /* lo (unsigned) x codes */
        _tile_dpbssd(1, 3, 4);  /* hi (signed) x codes */
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        const __m512 sw = _mm512_loadu_ps(sb + g * Q4B_BLOCK);
        for (int t = 0; t < M; t++) {
            const __m512i d = _mm512_add_epi32(_mm512_load_si512(sums[0] + 16 * t),
                                               _mm512_slli_epi32(_mm512_load_si512(sums[1] + 16 * t), 8));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(xs[t * groups + g])), sw, acc[t]);
        }
    }
    for (int t = 0; t < M; t++) {
        __m512 lows = _mm512_setzero_ps();
        if (lb)
            for (int64_t g = 0; g < groups; g++)
                lows = _mm512_fmadd_ps(_mm512_loadu_ps(lb + g * Q4B_BLOCK), _mm512_set1_ps(xsum[t * groups + g]), lows);
        _mm512_storeu_ps(y + t * n_out, lb ? _mm512_add_ps(acc[t], lows) : acc[t]);
    }
}

/* Any rows against the blocked weights (int4 with low, int8 without): each block's codes are
 * unpacked once (int4) into a per-thread buffer of B tiles, then taken by every 16 rows. */
static void q4b_amx(const uint8_t *lo, const int8_t *hi, const float *xs, const float *xsum, int64_t rows, int64_t k,
                    const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / Q4B_GROUP, blocks = n_out / Q4B_BLOCK;
    const int64_t bytes = low ? Q4B_BYTES : Q8B_BYTES;
    #pragma omp parallel num_threads(threads)
    {
        int configured = 0;
        uint8_t *codes = low ? aligned_alloc(64, (size_t)groups * 512) : NULL;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *qb = q + b * groups * bytes;
            const float *sb = scale + b * groups * Q4B_BLOCK, *lb = low ? low + b * groups * Q4B_BLOCK : NULL;
            if (low)
                for (int64_t g = 0; g < groups; g++) {
                    __m512i w[8];
                    q4b_prefetch(qb + g * Q4B_BYTES, sb + g * Q4B_BLOCK, lb + g * Q4B_BLOCK);
                    q4b_unpack(qb + g * Q4B_BYTES, w);
                    for (int r = 0; r < 8; r++) _mm512_store_si512(codes + g * 512 + 64 * r, w[r]);
                }
            for (int64_t m = 0; m < rows; m += 16) {
                const int M = rows - m < 16 ? (int)(rows - m) : 16;
                if (M != configured) {
                    q4b_configure(M);
                    configured = M;
                }
                q4b_amx_rows(lo + m * k, hi + m * k, xs + m * groups, xsum ? xsum + m * groups : NULL, M, k,
                             low ? codes : qb, sb, lb, y + m * n_out + b * Q4B_BLOCK, n_out);
            }
        }
        if (configured) _tile_release();
        free(codes);
    }
}
#endif

int pdflow_q4b_paths(void) {
    int paths = 1 << PATH_PLAIN;
#if Q4B_VNNI
    paths |= 1 << PATH_VNNI;
#endif
#if Q4B_AVX2
    paths |= 1 << PATH_AVX2;
#endif
#if Q4B_AMX
    if (q4b_amx_ready()) paths |= 1 << PATH_AMX;
#endif
    return paths;
}

/* y (rows, n_out) = x (rows, k) times blocked weights, int4 (low given) or int8 (low NULL); path:
 * PATH_AUTO (the fastest this CPU has for the rows) or one of the others (tests compare them).
 * n_out a multiple of 16, k of 32. Returns 0, or -1 if the path asked for cannot run here. */
static int blocked_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale, const float *low,
                        int64_t n_out, float *y, int threads, int path) {
    const int paths = pdflow_q4b_paths() & (low ? ~0 : ~(1 << PATH_AVX2));
    if (path == PATH_AUTO)
        path = (paths & (1 << PATH_AMX)) && rows >= AMX_ROWS ? PATH_AMX
               : (paths & (1 << PATH_VNNI)) ? PATH_VNNI : (paths & (1 << PATH_AVX2)) ? PATH_AVX2 : PATH_PLAIN;
    if (!(paths & (1 << path))) return -1;
    const int64_t groups = k / Q4B_GROUP;
    int16_t *xq = aligned_alloc(64, (size_t)(rows * k * 2 + 63) / 64 * 64);
    float *xs = malloc(sizeof(float) * 2 * rows * groups), *xsum = xs + rows * groups;
    pdflow_quantize16(x, rows, k, xq, xs, xsum);
    if (path == PATH_PLAIN) {
        q4b_plain(xq, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
    } else {
        uint8_t *lo = aligned_alloc(64, (size_t)(2 * rows * k + 63) / 64 * 64);
        int8_t *hi = (int8_t *)lo + rows * k;
        int32_t *hsum = low ? NULL : malloc(sizeof(int32_t) * rows * groups);  /* int8's VNNI term, per row and group */
        for (int64_t m = 0; m < rows; m++)
            for (int64_t g = 0; g < groups; g++) {
                int32_t sum = 0;
                for (int64_t i = m * k + g * Q4B_GROUP; i < m * k + (g + 1) * Q4B_GROUP; i++) {
                    lo[i] = (uint8_t)(xq[i] & 0xFF);
                    hi[i] = (int8_t)(xq[i] >> 8);  /* arithmetic: xq = 256 * hi + lo */
                    sum += hi[i];
                }
                if (hsum) hsum[m * groups + g] = sum;
            }
#if Q4B_AMX
        if (path == PATH_AMX) q4b_amx(lo, hi, xs, low ? xsum : NULL, rows, k, q, scale, low, n_out, y, threads);
#endif
#if Q4B_VNNI
        if (path == PATH_VNNI) q4b_vnni(lo, hi, hsum, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
#endif
#if Q4B_AVX2
        if (path == PATH_AVX2) q4b_avx2(lo, hi, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
#endif
        free(hsum);
        free(lo);
    }
    free(xq);
    free(xs);
    return 0;
}

int pdflow_q4b_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale, const float *low,
                    int64_t n_out, float *y, int threads, int path) {
    return blocked_gemm(x, rows, k, q, scale, low, n_out, y, threads, path);
}

int pdflow_q8b_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale, int64_t n_out,
                    float *y, int threads, int path) {
    return blocked_gemm(x, rows, k, (const uint8_t *)q, scale, NULL, n_out, y, threads, path);
}

/* w (n_out, k) in fp32: code * scale + low (int8: w * scale), for products of more rows than a
 * decode step's where there is no AMX; each output's 32 inputs of a group written in order */
void pdflow_q4b_dequantize(const uint8_t *q, const float *scale, const float *low, int64_t n_out, int64_t k, float *w,
                           int threads) {
    const int64_t groups = k / Q4B_GROUP, blocks = n_out / Q4B_BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int c = 0; c < Q4B_BLOCK; c++)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t at = (b * groups + g) * Q4B_BLOCK + c;
                const float s = scale[at];
                float *out = w + (b * Q4B_BLOCK + c) * k + g * Q4B_GROUP;
                if (!low) {
                    const int8_t *qg = (const int8_t *)q + (b * groups + g) * Q8B_BYTES;
                    for (int r = 0; r < 8; r++)
                        for (int i = 0; i < 4; i++) out[4 * r + i] = (float)qg[r * 64 + c * 4 + i] * s;
                    continue;
                }
                const uint8_t *qg = q + (b * groups + g) * Q4B_BYTES;
                const float l = low[at];
                for (int r = 0; r < 4; r++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t byte = qg[r * 64 + c * 4 + i];
                        out[4 * r + i] = (float)(byte & 15) * s + l;
                        out[16 + 4 * r + i] = (float)(byte >> 4) * s + l;
                    }
            }
}

void pdflow_q8b_dequantize(const int8_t *q, const float *scale, int64_t n_out, int64_t k, float *w, int threads) {
    pdflow_q4b_dequantize((const uint8_t *)q, scale, NULL, n_out, k, w, threads);
}
