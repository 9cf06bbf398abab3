/* Weight-only quantized matrix products with int16 activations (formats int8-a16 and int4-a16),
 * the weights in products_fp32.c's layouts: x per group of 32 as xs = the group's largest
 * magnitude / 32767 and xq = round(x / xs), about 1e-5 of the group's largest value lost instead
 * of 1e-2 (int8 activations: products_a8.c, whose integer rule this shares); products with
 * _mm256_madd_epi16 (16 multiplies an instruction, twice fp32's). pdflow_quantize16 is the
 * quantization q4blocked.c's products use too. */
#include <stdint.h>
#include <stdlib.h>

#include "pdflow_kernels.h"
#include "helpers.h"

#if defined(__AVX2__) && defined(__FMA__)

static void quantize_rows16(const float *x, int64_t rows, int64_t k, int16_t *xq, float *xs, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < k / GROUP; g++) {
            const float *xg = x + m * k + g * GROUP;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xg + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float top = _mm_cvtss_f32(h);
            const int64_t at = m * (k / GROUP) + g;
            xs[at] = top / 32767.0f;
            const __m256 inv = _mm256_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
            __m256i sums = _mm256_setzero_si256();
            for (int j = 0; j < 4; j += 2) {  /* packs_epi32 interleaves 128-bit lanes: undo it */
                const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
                const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv));
                _mm256_storeu_si256((__m256i *)(xq + m * k + g * GROUP + 8 * j),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
                sums = _mm256_add_epi32(sums, _mm256_add_epi32(a, b));
            }
            xsum[at] = xs[at] * reduce8(_mm256_cvtepi32_ps(sums));
        }
}

/* 32 int16 weights (two vectors) times 32 int16 activations: 8 sums of 4 products, as floats */
static inline __m256 dot_i16(__m256i w0, __m256i w1, const int16_t *x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)  /* the same integer sum, one instruction fewer */
    const __m256i s = _mm256_dpwssd_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)), w1,
                                          _mm256_loadu_si256((const __m256i *)(x + 16)));
#else
    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                                       _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
#endif
    return _mm256_cvtepi32_ps(s);
}

/* one output row's weights as int16 (w), its group scales sw, against every row of x */
static void a16_rows(const int16_t *w, const float *sw, const int16_t *xq, const float *xs, int64_t rows, int64_t k,
                     float *y, int64_t stride) {
    const int64_t groups = k / GROUP;
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t g = 0; g < groups; g++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(w + g * GROUP));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(w + g * GROUP + 16));
            for (int t = 0; t < 4; t++)
                a[t] = _mm256_fmadd_ps(dot_i16(w0, w1, xq + (m + t) * k + g * GROUP),
                                       _mm256_set1_ps(sw[g] * xs[(m + t) * groups + g]), a[t]);
        }
        for (int t = 0; t < 4; t++) y[(m + t) * stride] = reduce8(a[t]);
    }
    for (; m < rows; m++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(w + g * GROUP));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(w + g * GROUP + 16));
            const __m256 d = _mm256_fmadd_ps(dot_i16(w0, w1, xq + m * k + g * GROUP), _mm256_set1_ps(sw[g] * xs[m * groups + g]), a0);
            a0 = a1;
            a1 = d;
        }
        y[m * stride] = reduce8(_mm256_add_ps(a0, a1));
    }
}

/* One row of x against int4 weights two groups (32 bytes) at a time, with no shuffle: the 16 int16
 * lanes of 32 weight bytes hold four nibbles each, taken out by shifts and masks (low nibble of the
 * lane's first byte, its high nibble, then the second byte's), so lanes 0-7 are the first group's
 * and 8-15 the second's in each of the four vectors; xp holds x's int16 activations in that order
 * (pair_order16). The two groups' sums land in the two 128-bit halves and are scaled by one vector:
 * x's scales laid out per pair once per product, the row's two weight scales in one 8-byte load
 * spread over the halves (no scalar arithmetic per group); the low term is a vector dot of the
 * row's lows with x's group sums after the loop. */
static void pair_order16(const int16_t *xq, int64_t k, int16_t *xp) {
    for (int64_t c = 0; c < k; c += 2 * GROUP)
        for (int v = 0; v < 4; v++)
            for (int j = 0; j < 16; j++) {
                const int byte = 2 * j + (v >> 1);  /* of the 32 */
                xp[c + v * 16 + j] = xq[c + (byte / 16) * GROUP + byte % 16 + 16 * (v & 1)];
            }
}

/* x's group scales of one row in pairs: (xs[g] x4, xs[g+1] x4) per pair of groups, as the sums land */
static void scale_pairs(const float *xs, int64_t groups, float *xs_pairs) {
    for (int64_t g = 0; g < groups; g += 2)
        _mm256_store_ps(xs_pairs + 4 * g, _mm256_set_m128(_mm_set1_ps(xs[g + 1]), _mm_set1_ps(xs[g])));
}

/* int32 sums of 32 weight bytes (four nibble vectors) times 64 pair-ordered activations */
static inline __m256i nibble_dots(const __m256i v[4], const int16_t *x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i s = _mm256_madd_epi16(v[0], _mm256_loadu_si256((const __m256i *)x));
    s = _mm256_dpwssd_epi32(s, v[1], _mm256_loadu_si256((const __m256i *)(x + 16)));
    s = _mm256_dpwssd_epi32(s, v[2], _mm256_loadu_si256((const __m256i *)(x + 32)));
    return _mm256_dpwssd_epi32(s, v[3], _mm256_loadu_si256((const __m256i *)(x + 48)));
#else
    __m256i s = _mm256_madd_epi16(v[0], _mm256_loadu_si256((const __m256i *)x));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(v[1], _mm256_loadu_si256((const __m256i *)(x + 16))));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(v[2], _mm256_loadu_si256((const __m256i *)(x + 32))));
    return _mm256_add_epi32(s, _mm256_madd_epi16(v[3], _mm256_loadu_si256((const __m256i *)(x + 48))));
#endif
}

/* One pair of groups (32 weight bytes, from g) for R rows: out[t] = acc[t] + the pair's products
 * of row t, scaled (out and acc may be the same array) */
static inline void q4a16_pair(const int16_t *xp, const float *xs_pairs, const int R, int64_t k, const uint8_t *qn,
                              const float *sn, int64_t g, const __m256 *acc, __m256 *out) {
    const int64_t groups = k / GROUP;
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), nibble = _mm256_set1_epi16(15);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(qn + g * (GROUP / 2)));
    const __m256i v[4] = {_mm256_and_si256(b, nibble), _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble),
                          _mm256_and_si256(_mm256_srli_epi16(b, 8), nibble), _mm256_srli_epi16(b, 12)};
    const __m256 sw = _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd((const double *)(sn + g))), halves);
    for (int t = 0; t < R; t++) {
        const __m256i s = nibble_dots(v, xp + t * k + g * GROUP);
        out[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_load_ps(xs_pairs + t * 4 * groups + 4 * g)),
                                 sw, acc[t]);
    }
}

/* The R rows' results: the two accumulators' lanes, plus the low term (the row's minimums times
 * x's group sums) */
static inline void q4a16_finish(const __m256 *a0, const __m256 *a1, const float *xsum, const int R, int64_t groups,
                                const float *ln, float *y, int64_t y_stride) {
    for (int t = 0; t < R; t++) {
        const float *xsum_t = xsum + t * groups;
        __m256 lb = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= groups; g += 8) lb = _mm256_fmadd_ps(_mm256_loadu_ps(ln + g), _mm256_loadu_ps(xsum_t + g), lb);
        float base = 0.0f;
        for (; g < groups; g++) base += ln[g] * xsum_t[g];
        y[t * y_stride] = reduce8(_mm256_add_ps(_mm256_add_ps(a0[t], a1[t]), lb)) + base;
    }
}

/* R (1..4) rows of x against one output row's int4 weights, each row summed in exactly the order
 * one row alone is (so a row's result does not depend on how many rows share the call): the
 * weight bytes are loaded and their nibbles taken out once for all R rows; pairs of groups go
 * alternately into two accumulators. */
static inline void q4a16_tile(const int16_t *xp, const float *xs_pairs, const float *xsum, const int R, int64_t k,
                              const uint8_t *qn, const float *sn, const float *ln, float *y, int64_t y_stride) {
    const int64_t groups = k / GROUP;
    __m256 a0[4], a1[4], d[4];
    for (int t = 0; t < R; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g += 2) {
        q4a16_pair(xp, xs_pairs, R, k, qn, sn, g, a0, d);
        for (int t = 0; t < R; t++) {
            a0[t] = a1[t];
            a1[t] = d[t];
        }
    }
    q4a16_finish(a0, a1, xsum, R, groups, ln, y, y_stride);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define PDFLOW_Q4_WIDE 1
/* The same product four groups (64 bytes) at a time in 512-bit registers, for CPUs with AVX-512
 * VNNI: half the instructions per weight of the 256-bit tile. Bit for bit the 256-bit tile's
 * result: the low 256 bits of a vector hold an even pair of groups and the high 256 an odd pair,
 * laid out lane for lane as the 256-bit tile's two alternating accumulators (a0, a1) are, and the
 * integer dot products are exact in any order. xp is in quad order (quad_order16): per 128
 * inputs, each nibble vector's 32 activations are the two pairs' 16 (pair order) side by side; a
 * last odd pair of groups stays in pair order and goes through the 256-bit step. */
static void quad_order16(const int16_t *xq, int64_t k, int16_t *xp) {
    int64_t c = 0;
    for (; c + 4 * GROUP <= k; c += 4 * GROUP)
        for (int v = 0; v < 4; v++)
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 16; j++) {
                    const int byte = 2 * j + (v >> 1);
                    xp[c + v * 32 + h * 16 + j] = xq[c + h * 2 * GROUP + (byte / 16) * GROUP + byte % 16 + 16 * (v & 1)];
                }
    if (c < k) pair_order16(xq + c, k - c, xp + c);
}

static inline __m512i nibble_dots512(const __m512i v[4], const int16_t *x) {
    const __m512i s = _mm512_dpwssd_epi32(_mm512_madd_epi16(v[0], _mm512_loadu_si512(x)), v[1],
                                          _mm512_loadu_si512(x + 32));
    const __m512i t = _mm512_dpwssd_epi32(_mm512_madd_epi16(v[2], _mm512_loadu_si512(x + 64)), v[3],
                                          _mm512_loadu_si512(x + 96));
    return _mm512_add_epi32(s, t);
}

static inline void q4a16_tile512(const int16_t *xp, const float *xs_pairs, const float *xsum, const int R, int64_t k,
                                 const uint8_t *qn, const float *sn, const float *ln, float *y, int64_t y_stride) {
    const int64_t groups = k / GROUP;
    const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i nibble = _mm512_set1_epi16(15);
    __m512 acc[4];
    for (int t = 0; t < R; t++) acc[t] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {
        const __m512i b = _mm512_loadu_si512(qn + g * (GROUP / 2));
        const __m512i v[4] = {_mm512_and_si512(b, nibble), _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble),
                              _mm512_and_si512(_mm512_srli_epi16(b, 8), nibble), _mm512_srli_epi16(b, 12)};
        const __m512 sw = _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(_mm_loadu_ps(sn + g)));
        for (int t = 0; t < R; t++) {
            const __m512i s = nibble_dots512(v, xp + t * k + g * GROUP);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(xs_pairs + t * 4 * groups + 4 * g)),
                                     sw, acc[t]);
        }
    }
    __m256 a0[4], a1[4];
    for (int t = 0; t < R; t++) {
        a0[t] = _mm512_castps512_ps256(acc[t]);
        a1[t] = _mm512_extractf32x8_ps(acc[t], 1);
    }
    if (g < groups)  /* a last pair of groups: an even pair, into the low half's chain */
        q4a16_pair(xp, xs_pairs, R, k, qn, sn, g, a0, a0);
    q4a16_finish(a0, a1, xsum, R, groups, ln, y, y_stride);
}
#define Q4A16_TILE q4a16_tile512
#define Q4A16_ORDER quad_order16
#else
#define Q4A16_TILE q4a16_tile
#define Q4A16_ORDER pair_order16
#endif

/* Rows of x against int4 weights two groups (32 bytes) at a time, with no shuffle: the 16 int16
 * lanes of 32 weight bytes hold four nibbles each, taken out by shifts and masks (low nibble of the
 * lane's first byte, its high nibble, then the second byte's), so lanes 0-7 are the first group's
 * and 8-15 the second's in each of the four vectors; xp holds x's int16 activations in that order
 * (pair_order16, row after row). The two groups' sums land in the two 128-bit halves and are
 * scaled by one vector: x's scales laid out per pair once per product, the row's two weight
 * scales in one 8-byte load spread over the halves (no scalar arithmetic per group); the low
 * term is a vector dot of the row's lows with x's group sums after the loop. Rows go in tiles of
 * 4 that share each weight load; a row's sum is the same whatever the tile. */
static void q4a16_rows(const int16_t *xp, const float *xs, const float *xsum, int64_t rows, int64_t k,
                       const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    float *xs_pairs = aligned_alloc(32, sizeof(float) * 4 * groups * rows);
    for (int64_t m = 0; m < rows; m++) scale_pairs(xs + m * groups, groups, xs_pairs + m * 4 * groups);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *qn = q + n * (k / 2);
        const float *sn = scale + n * groups, *ln = low + n * groups;
        prefetch_ahead(qn, k / 2, WEIGHT_PREFETCH_BYTES);
        prefetch_ahead(sn, groups * sizeof(float), WEIGHT_PREFETCH_BYTES / 4);
        prefetch_ahead(ln, groups * sizeof(float), WEIGHT_PREFETCH_BYTES / 4);
        for (int64_t m = 0; m < rows; m += 4) {
            const int64_t R = rows - m < 4 ? rows - m : 4;
            const int16_t *x = xp + m * k;
            const float *p = xs_pairs + m * 4 * groups, *sums = xsum + m * groups;
            float *out = y + m * n_out + n;
            switch (R) {  /* a constant R each: the tile's loops unrolled */
                case 1: Q4A16_TILE(x, p, sums, 1, k, qn, sn, ln, out, n_out); break;
                case 2: Q4A16_TILE(x, p, sums, 2, k, qn, sn, ln, out, n_out); break;
                case 3: Q4A16_TILE(x, p, sums, 3, k, qn, sn, ln, out, n_out); break;
                default: Q4A16_TILE(x, p, sums, 4, k, qn, sn, ln, out, n_out); break;
            }
        }
    }
    free(xs_pairs);
}

static void q4a16_product(const int16_t *xq, const float *xs, const float *xsum, int64_t rows, int64_t k,
                          const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *qn = q + n * (k / 2);
        const float *sn = scale + n * groups, *ln = low + n * groups;
        const __m128i nibble = _mm_set1_epi8(15);
        if (rows == 1) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            float base = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(qn + g * (GROUP / 2)));
                const __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, nibble));
                const __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), nibble));
                const __m256 d = _mm256_fmadd_ps(dot_i16(w0, w1, xq + g * GROUP), _mm256_set1_ps(sn[g] * xs[g]), a0);
                a0 = a1;
                a1 = d;
                base += ln[g] * xsum[g];
            }
            y[n] = reduce8(_mm256_add_ps(a0, a1)) + base;
            continue;
        }
        int16_t codes[8192] __attribute__((aligned(32)));
        for (int64_t g = 0; g < groups; g++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(qn + g * (GROUP / 2)));
            _mm256_store_si256((__m256i *)(codes + g * GROUP), _mm256_cvtepu8_epi16(_mm_and_si128(b, nibble)));
            _mm256_store_si256((__m256i *)(codes + g * GROUP + 16),
                               _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), nibble)));
        }
        a16_rows(codes, sn, xq, xs, rows, k, y + n, n_out);
        for (int64_t m = 0; m < rows; m++) {
            float base = 0.0f;
            for (int64_t g = 0; g < groups; g++) base += ln[g] * xsum[m * groups + g];
            y[m * n_out + n] += base;
        }
    }
}

/* R (1..4) rows of x against one output row's int8 weights, each row summed in exactly the order
 * one row alone is; each group's weights widened to int16 once for all R rows. */
static inline void q8a16_tile(const int16_t *xq, const float *xs, const int R, int64_t k, const int8_t *qn,
                              const float *sn, float *y, int64_t y_stride) {
    const int64_t groups = k / GROUP;
    __m256 a0[4], a1[4];
    for (int t = 0; t < R; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qn + g * GROUP)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qn + g * GROUP + 16)));
        for (int t = 0; t < R; t++) {
            const __m256 d = _mm256_fmadd_ps(dot_i16(w0, w1, xq + t * k + g * GROUP),
                                             _mm256_set1_ps(sn[g] * xs[t * groups + g]), a0[t]);
            a0[t] = a1[t];
            a1[t] = d;
        }
    }
    for (int t = 0; t < R; t++) y[t * y_stride] = reduce8(_mm256_add_ps(a0[t], a1[t]));
}

static void q8a16_product(const int16_t *xq, const float *xs, int64_t rows, int64_t k, const int8_t *q,
                          const float *scale, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const int8_t *qn = q + n * k;
        const float *sn = scale + n * groups;
        prefetch_ahead(qn, k, WEIGHT_PREFETCH_BYTES);
        prefetch_ahead(sn, groups * sizeof(float), WEIGHT_PREFETCH_BYTES / 8);
        for (int64_t m = 0; m < rows; m += 4) {
            const int16_t *x = xq + m * k;
            const float *s = xs + m * groups;
            float *out = y + m * n_out + n;
            switch (rows - m < 4 ? rows - m : 4) {  /* a constant R each: the tile's loops unrolled */
                case 1: q8a16_tile(x, s, 1, k, qn, sn, out, n_out); break;
                case 2: q8a16_tile(x, s, 2, k, qn, sn, out, n_out); break;
                case 3: q8a16_tile(x, s, 3, k, qn, sn, out, n_out); break;
                default: q8a16_tile(x, s, 4, k, qn, sn, out, n_out); break;
            }
        }
    }
}

#else  /* portable C: one version for 8- and 16-bit activations (portable_products.h) */
#include "portable_products.h"

static void quantize_rows16(const float *x, int64_t rows, int64_t k, int16_t *xq, float *xs, float *xsum) {
    quantize_any(x, rows, k, xq, 16, xs, xsum);
}
static void q4a16_product(const int16_t *xq, const float *xs, const float *xsum, int64_t rows, int64_t k,
                          const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    q4_any(xq, 16, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
}
static void q8a16_product(const int16_t *xq, const float *xs, int64_t rows, int64_t k, const int8_t *q,
                          const float *scale, int64_t n_out, float *y, int threads) {
    q8_any(xq, 16, xs, rows, k, q, scale, n_out, y, threads);
}

#endif

/* x's rows quantized to int16 per group (q4blocked.c's products share the rule) */
void pdflow_quantize16(const float *x, int64_t rows, int64_t k, int16_t *xq, float *xs, float *xsum) {
    quantize_rows16(x, rows, k, xq, xs, xsum);
}

/* int16 activations (the low term of int4 from the quantized x's sums, as for int8) */
void pdflow_q4a16_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale,
                       const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    int16_t *xq = aligned_alloc(32, (size_t)(rows * k * 2 + 31) / 32 * 32);
    float *xs = malloc(sizeof(float) * 2 * rows * groups), *xsum = xs + rows * groups;
    quantize_rows16(x, rows, k, xq, xs, xsum);
#if defined(__AVX2__) && defined(__FMA__)
    if (k % (2 * GROUP) == 0) {  /* two groups at a time, activations reordered */
        int16_t *xp = aligned_alloc(32, (size_t)(rows * k * 2 + 31) / 32 * 32);
        for (int64_t m = 0; m < rows; m++) Q4A16_ORDER(xq + m * k, k, xp + m * k);
        q4a16_rows(xp, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
        free(xp);
    } else
#endif
    q4a16_product(xq, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
    free(xq);
    free(xs);
}

void pdflow_q8a16_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale,
                       int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    int16_t *xq = aligned_alloc(32, (size_t)(rows * k * 2 + 31) / 32 * 32);
    float *xs = malloc(sizeof(float) * 2 * rows * groups), *xsum = xs + rows * groups;
    quantize_rows16(x, rows, k, xq, xs, xsum);
    q8a16_product(xq, xs, rows, k, q, scale, n_out, y, threads);
    free(xq);
    free(xs);
}
