/* Weight-only quantized matrix products for pdflow's engine: y = x @ W.T with W in int8 or int4
 * groups of 32 inputs, x and y in fp32, for the few rows of a decode step.
 *
 * Each output row n reads its weights once and shares them across the rows of x: with one row, a
 * group of 32 weights is unpacked and scaled into registers and multiplied straight in; with
 * more, the output row's weights are unpacked once into an fp32 buffer (in L1) and multiplied
 * into tiles of 4 rows of x. Threads split the output rows. Built at first use with -O3
 * -march=native (pdflow/kernels); the callers keep rows <= MAX_ROWS and k <= 8192.
 *
 * Layouts (row-major, n = output row, g = group of 32 inputs):
 *   int8: q8[n][g][32] signed; scale[n][g]; w = q * scale                  (GGUF Q8_0's rule)
 *   int4: q4[n][g][16] bytes, input i < 16 in the low nibble of byte i and input 16 + i in its
 *         high nibble; scale[n][g], low[n][g]; w = q * scale + low          (GGUF Q4_1's rule)
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define MAX_ROWS 64

static inline float sum32(const float *a) {
    float s = 0.0f;
    for (int i = 0; i < GROUP; i++) s += a[i];
    return s;
}

/* AVX2 + FMA (x86-64 since 2013): a group's 32 weights become four 8-lane vectors in registers,
 * scaled once, then multiplied into every row's four accumulators */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float reduce8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline __m256 bytes_to_floats(__m128i bytes8, int is_signed, __m256 scale) {
    __m256i wide = is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), scale);
}

/* group g of row n as four 8-lane vectors: w = q * scale (+ low for int4) */
static inline void dequant8(const int8_t *qg, float s, __m256 w[4]) {
    const __m256 sv = _mm256_set1_ps(s);
    const __m128i b0 = _mm_loadu_si128((const __m128i *)qg), b1 = _mm_loadu_si128((const __m128i *)(qg + 16));
    w[0] = bytes_to_floats(b0, 1, sv);
    w[1] = bytes_to_floats(_mm_srli_si128(b0, 8), 1, sv);
    w[2] = bytes_to_floats(b1, 1, sv);
    w[3] = bytes_to_floats(_mm_srli_si128(b1, 8), 1, sv);
}

static inline void dequant4(const uint8_t *qg, float s, __m256 w[4]) {
    const __m256 sv = _mm256_set1_ps(s);
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i b = _mm_loadu_si128((const __m128i *)qg);
    const __m128i lo = _mm_and_si128(b, nibble), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
    w[0] = bytes_to_floats(lo, 0, sv);
    w[1] = bytes_to_floats(_mm_srli_si128(lo, 8), 0, sv);
    w[2] = bytes_to_floats(hi, 0, sv);
    w[3] = bytes_to_floats(_mm_srli_si128(hi, 8), 0, sv);
}

/* several rows of x against one dequantized weight row (in L1): tiles of 4 rows, 2 chains each */
static void rows_dot(const float *w, const float *x, int64_t rows, int64_t k, float *y, int64_t stride) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) {
        __m256 a[4][2];
        for (int t = 0; t < 4; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 16) {
            const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
            for (int t = 0; t < 4; t++) {
                a[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (m + t) * k + i), a[t][0]);
                a[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + (m + t) * k + i + 8), a[t][1]);
            }
        }
        for (int t = 0; t < 4; t++) y[(m + t) * stride] = reduce8(_mm256_add_ps(a[t][0], a[t][1]));
    }
    for (; m < rows; m++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + m * k + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + m * k + i + 8), a1);
        }
        y[m * stride] = reduce8(_mm256_add_ps(a0, a1));
    }
}

void pdflow_q8_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale,
                    int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const int8_t *qn = q + n * k;
        const float *sn = scale + n * groups;
        __m256 w[4];
        if (rows == 1) {  /* one pass, accumulators in registers */
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t g = 0; g < groups; g++) {
                dequant8(qn + g * GROUP, sn[g], w);
                for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + g * GROUP + 8 * j), a[j]);
            }
            y[n] = reduce8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
            continue;
        }
        float row[8192] __attribute__((aligned(32)));
        for (int64_t g = 0; g < groups; g++) {
            dequant8(qn + g * GROUP, sn[g], w);
            for (int j = 0; j < 4; j++) _mm256_store_ps(row + g * GROUP + 8 * j, w[j]);
        }
        rows_dot(row, x, rows, k, y + n, n_out);
    }
}

void pdflow_q4_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale,
                    const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    float xsum[256];  /* one row's sum of each group of inputs, for the low term; k <= 8192 */
    if (rows == 1)
        for (int64_t g = 0; g < groups; g++) xsum[g] = sum32(x + g * GROUP);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *qn = q + n * (k / 2);
        const float *sn = scale + n * groups, *ln = low + n * groups;
        __m256 w[4];
        if (rows == 1) {
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            float base = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                dequant4(qn + g * (GROUP / 2), sn[g], w);
                for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + g * GROUP + 8 * j), a[j]);
                base += ln[g] * xsum[g];
            }
            y[n] = reduce8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))) + base;
            continue;
        }
        float row[8192] __attribute__((aligned(32)));
        for (int64_t g = 0; g < groups; g++) {
            dequant4(qn + g * (GROUP / 2), sn[g], w);
            const __m256 l = _mm256_set1_ps(ln[g]);
            for (int j = 0; j < 4; j++) _mm256_store_ps(row + g * GROUP + 8 * j, _mm256_add_ps(w[j], l));
        }
        rows_dot(row, x, rows, k, y + n, n_out);
    }
}

#else  /* portable C: the same loops, left to the compiler's vectorizer */

void pdflow_q8_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale,
                    int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        float acc[MAX_ROWS][GROUP];
        memset(acc, 0, sizeof(float) * GROUP * rows);
        for (int64_t g = 0; g < groups; g++) {
            float w[GROUP];
            const float s = scale[n * groups + g];
            const int8_t *qg = q + n * k + g * GROUP;
            for (int i = 0; i < GROUP; i++) w[i] = (float)qg[i] * s;
            for (int64_t m = 0; m < rows; m++) {
                const float *xg = x + m * k + g * GROUP;
                for (int i = 0; i < GROUP; i++) acc[m][i] += w[i] * xg[i];
            }
        }
        for (int64_t m = 0; m < rows; m++) y[m * n_out + n] = sum32(acc[m]);
    }
}

void pdflow_q4_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale,
                    const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    float xsum[MAX_ROWS * 256];
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < groups; g++) xsum[m * groups + g] = sum32(x + m * k + g * GROUP);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        float acc[MAX_ROWS][GROUP];
        float base[MAX_ROWS];
        memset(acc, 0, sizeof(float) * GROUP * rows);
        memset(base, 0, sizeof(float) * rows);
        for (int64_t g = 0; g < groups; g++) {
            float w[GROUP];
            const float s = scale[n * groups + g], l = low[n * groups + g];
            const uint8_t *qg = q + n * (k / 2) + g * (GROUP / 2);
            for (int i = 0; i < GROUP / 2; i++) w[i] = (float)(qg[i] & 15) * s;
            for (int i = 0; i < GROUP / 2; i++) w[i + GROUP / 2] = (float)(qg[i] >> 4) * s;
            for (int64_t m = 0; m < rows; m++) {
                const float *xg = x + m * k + g * GROUP;
                for (int i = 0; i < GROUP; i++) acc[m][i] += w[i] * xg[i];
                base[m] += l * xsum[m * groups + g];
            }
        }
        for (int64_t m = 0; m < rows; m++) y[m * n_out + n] = sum32(acc[m]) + base[m];
    }
}

#endif

/* fp32 copies of the weights, for products with many rows (prefill), which go to sgemm */
void pdflow_q8_dequantize(const int8_t *q, const float *scale, int64_t n_out, int64_t k, float *w, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++)
        for (int64_t g = 0; g < groups; g++)
            for (int i = 0; i < GROUP; i++)
                w[n * k + g * GROUP + i] = (float)q[n * k + g * GROUP + i] * scale[n * groups + g];
}

void pdflow_q4_dequantize(const uint8_t *q, const float *scale, const float *low, int64_t n_out, int64_t k,
                          float *w, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *qg = q + n * (k / 2) + g * (GROUP / 2);
            const float s = scale[n * groups + g], l = low[n * groups + g];
            float *wg = w + n * k + g * GROUP;
            for (int i = 0; i < GROUP / 2; i++) {
                wg[i] = (float)(qg[i] & 15) * s + l;
                wg[i + GROUP / 2] = (float)(qg[i] >> 4) * s + l;
            }
        }
}

/* ---- products with int8 activations (formats int8-a8 and int4-a8): each row of x is quantized
 * per group of 32 inputs, as GGUF's Q8_0 does for llama.cpp's dot products (xs = the group's
 * largest magnitude / 127, xq = round(x / xs)), and each group's dot product is computed in
 * integers: sum(w * x) ≈ sw * xs * sum(qw * xq) (+ low * xs * sum(xq) for int4: the sum of the
 * quantized x, so that the error is sum(w * (xq * xs - x)) as for int8, not sum((w - low) * ...)).
 * Four times the multiplies per instruction of fp32, and no weight unpacking to floats.
 * The x buffers: xq[rows][k] int8, xs[rows][groups], xsum[rows][groups] floats. ---- */

#if defined(__AVX2__) && defined(__FMA__)

/* The quantized-activation products fetch each output row's weights (and scales) this far ahead
 * of the row that reads them: each row prefetches the span it covers, ``ahead`` bytes on. The
 * hardware's own prefetchers keep too few lines in flight when this VM's memory is slow: with it
 * the model's 30 decode layers took 1.19-1.31x less time from memory at 256-2,048 tokens
 * (1.06x at batch 8) and the int8 lm_head 1.5-1.6x, at a cost of 3-4% with the weights in cache
 * (scripts/compare_kernel_builds.py; 2,048 to 8,192 bytes ahead measured alike; docs/benchmarks.md).
 * Prefetches never fault, so the last rows' run past the matrix harmlessly. */
#define WEIGHT_PREFETCH_BYTES 4096

static inline void prefetch_ahead(const void *row, int64_t bytes, int64_t ahead) {
    const char *at = (const char *)row + ahead;
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
}

static void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *xq, float *xs, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
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
            xs[at] = top / 127.0f;
            const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
            __m256i i[4];
            for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  /* nearest, ties to even */
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
            _mm256_storeu_si256((__m256i *)(xq + m * k + g * GROUP), _mm256_permutevar8x32_epi32(packed, order));
            const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            xsum[at] = xs[at] * reduce8(_mm256_cvtepi32_ps(sums));
        }
}

/* 32 unsigned bytes times 32 signed bytes: 8 sums of 4 products, as floats (|pair| <= 2 * 255 * 127
 * would saturate 16 bits, so callers keep the unsigned side <= 127: int4 codes, or |int8 weights|) */
static inline __m256 dot_us8(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* an int4 group's 16 bytes -> its 32 codes in input order */
static inline __m256i unpack4(const uint8_t *qg) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qg), nibble = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), nibble), _mm_and_si128(b, nibble));
}

/* y[m][n] for one output row n whose 32-byte groups are w (codes, unsigned side: wu; their signs
 * applied to x: negative for int8 weights) against every row of quantized x */
static void a8_rows(const uint8_t *wu, const int8_t *wsign, const float *sw, const int8_t *xq, const float *xs,
                    int64_t rows, int64_t k, float *y, int64_t stride) {
    const int64_t groups = k / GROUP;
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t g = 0; g < groups; g++) {
            const __m256i u = _mm256_load_si256((const __m256i *)(wu + g * GROUP));
            const __m256i sg = wsign ? _mm256_load_si256((const __m256i *)(wsign + g * GROUP)) : u;
            for (int t = 0; t < 4; t++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (m + t) * k + g * GROUP));
                if (wsign) xv = _mm256_sign_epi8(xv, sg);
                a[t] = _mm256_fmadd_ps(dot_us8(u, xv), _mm256_set1_ps(sw[g] * xs[(m + t) * groups + g]), a[t]);
            }
        }
        for (int t = 0; t < 4; t++) y[(m + t) * stride] = reduce8(a[t]);
    }
    for (; m < rows; m++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const __m256i u = _mm256_load_si256((const __m256i *)(wu + g * GROUP));
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * k + g * GROUP));
            if (wsign) xv = _mm256_sign_epi8(xv, _mm256_load_si256((const __m256i *)(wsign + g * GROUP)));
            const __m256 d = _mm256_fmadd_ps(dot_us8(u, xv), _mm256_set1_ps(sw[g] * xs[m * groups + g]), a0);
            a0 = a1;
            a1 = d;
        }
        y[m * stride] = reduce8(_mm256_add_ps(a0, a1));
    }
}

static void q4a8_product(const int8_t *xq, const float *xs, const float *xsum, int64_t rows, int64_t k,
                         const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *qn = q + n * (k / 2);
        const float *sn = scale + n * groups, *ln = low + n * groups;
        prefetch_ahead(qn, k / 2, WEIGHT_PREFETCH_BYTES);
        prefetch_ahead(sn, groups * sizeof(float), WEIGHT_PREFETCH_BYTES / 4);
        prefetch_ahead(ln, groups * sizeof(float), WEIGHT_PREFETCH_BYTES / 4);
        if (rows == 1) {  /* codes unpacked into registers and used once */
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            float base = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + g * GROUP));
                const __m256 d = _mm256_fmadd_ps(dot_us8(unpack4(qn + g * (GROUP / 2)), xv), _mm256_set1_ps(sn[g] * xs[g]), a0);
                a0 = a1;
                a1 = d;
                base += ln[g] * xsum[g];
            }
            y[n] = reduce8(_mm256_add_ps(a0, a1)) + base;
            continue;
        }
        uint8_t codes[8192] __attribute__((aligned(32)));  /* the row's codes, unpacked once (L1) */
        for (int64_t g = 0; g < groups; g++) _mm256_store_si256((__m256i *)(codes + g * GROUP), unpack4(qn + g * (GROUP / 2)));
        a8_rows(codes, NULL, sn, xq, xs, rows, k, y + n, n_out);
        for (int64_t m = 0; m < rows; m++) {
            float base = 0.0f;
            for (int64_t g = 0; g < groups; g++) base += ln[g] * xsum[m * groups + g];
            y[m * n_out + n] += base;
        }
    }
}

static void q8a8_product(const int8_t *xq, const float *xs, int64_t rows, int64_t k, const int8_t *q,
                         const float *scale, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const int8_t *qn = q + n * k;
        const float *sn = scale + n * groups;
        prefetch_ahead(qn, k, WEIGHT_PREFETCH_BYTES);
        prefetch_ahead(sn, groups * sizeof(float), WEIGHT_PREFETCH_BYTES / 8);
        if (rows == 1) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(qn + g * GROUP));
                const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + g * GROUP)), w);
                const __m256 d = _mm256_fmadd_ps(dot_us8(_mm256_sign_epi8(w, w), xv), _mm256_set1_ps(sn[g] * xs[g]), a0);
                a0 = a1;
                a1 = d;
            }
            y[n] = reduce8(_mm256_add_ps(a0, a1));
            continue;
        }
        uint8_t magnitude[8192] __attribute__((aligned(32)));
        int8_t sign[8192] __attribute__((aligned(32)));
        for (int64_t g = 0; g < groups; g++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(qn + g * GROUP));
            _mm256_store_si256((__m256i *)(magnitude + g * GROUP), _mm256_sign_epi8(w, w));
            _mm256_store_si256((__m256i *)(sign + g * GROUP), w);
        }
        a8_rows(magnitude, sign, sn, xq, xs, rows, k, y + n, n_out);
    }
}


/* int16 activations (formats int8-a16 and int4-a16): x per group of 32 as xs = the group's largest
 * magnitude / 32767 and xq = round(x / xs), about 1e-5 of the group's largest value lost instead
 * of 1e-2; products with _mm256_madd_epi16 (16 multiplies an instruction, twice fp32's) */
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

#else  /* portable C: one version for 8- and 16-bit activations (xq int8 or int16 by bits) */

static inline int32_t x_at(const void *xq, int bits, int64_t i) {
    return bits == 8 ? ((const int8_t *)xq)[i] : ((const int16_t *)xq)[i];
}

static void quantize_any(const float *x, int64_t rows, int64_t k, void *xq, int bits, float *xs, float *xsum) {
    const float top_code = bits == 8 ? 127.0f : 32767.0f;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < k / GROUP; g++) {
            const float *xg = x + m * k + g * GROUP;
            float top = 0.0f;
            for (int i = 0; i < GROUP; i++) top = fabsf(xg[i]) > top ? fabsf(xg[i]) : top;
            const int64_t at = m * (k / GROUP) + g;
            xs[at] = top / top_code;
            const float inv = top > 0.0f ? top_code / top : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < GROUP; i++) {
                const float v = nearbyintf(xg[i] * inv);
                const int64_t j = m * k + g * GROUP + i;
                if (bits == 8) ((int8_t *)xq)[j] = (int8_t)v;
                else ((int16_t *)xq)[j] = (int16_t)v;
                sum += (int32_t)v;
            }
            xsum[at] = xs[at] * (float)sum;
        }
}

static void q4_any(const void *xq, int bits, const float *xs, const float *xsum, int64_t rows, int64_t k,
                   const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++)
        for (int64_t m = 0; m < rows; m++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *qg = q + n * (k / 2) + g * (GROUP / 2);
                const int64_t at = m * k + g * GROUP;
                int32_t dot = 0;
                for (int i = 0; i < GROUP / 2; i++)
                    dot += (qg[i] & 15) * x_at(xq, bits, at + i) + (qg[i] >> 4) * x_at(xq, bits, at + i + GROUP / 2);
                acc += scale[n * groups + g] * xs[m * groups + g] * (float)dot + low[n * groups + g] * xsum[m * groups + g];
            }
            y[m * n_out + n] = acc;
        }
}

static void q8_any(const void *xq, int bits, const float *xs, int64_t rows, int64_t k, const int8_t *q,
                   const float *scale, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++)
        for (int64_t m = 0; m < rows; m++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t dot = 0;
                for (int i = 0; i < GROUP; i++) dot += q[n * k + g * GROUP + i] * x_at(xq, bits, m * k + g * GROUP + i);
                acc += scale[n * groups + g] * xs[m * groups + g] * (float)dot;
            }
            y[m * n_out + n] = acc;
        }
}

static void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *xq, float *xs, float *xsum) {
    quantize_any(x, rows, k, xq, 8, xs, xsum);
}
static void quantize_rows16(const float *x, int64_t rows, int64_t k, int16_t *xq, float *xs, float *xsum) {
    quantize_any(x, rows, k, xq, 16, xs, xsum);
}
static void q4a8_product(const int8_t *xq, const float *xs, const float *xsum, int64_t rows, int64_t k,
                         const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    q4_any(xq, 8, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
}
static void q4a16_product(const int16_t *xq, const float *xs, const float *xsum, int64_t rows, int64_t k,
                          const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    q4_any(xq, 16, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
}
static void q8a8_product(const int8_t *xq, const float *xs, int64_t rows, int64_t k, const int8_t *q,
                         const float *scale, int64_t n_out, float *y, int threads) {
    q8_any(xq, 8, xs, rows, k, q, scale, n_out, y, threads);
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

/* the entry points: quantize x's rows once (a small buffer), then the product */
void pdflow_q4a8_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale,
                      const float *low, int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    int8_t *xq = aligned_alloc(32, (size_t)(rows * k + 31) / 32 * 32);
    float *xs = malloc(sizeof(float) * 2 * rows * groups), *xsum = xs + rows * groups;
    quantize_rows(x, rows, k, xq, xs, xsum);
    q4a8_product(xq, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
    free(xq);
    free(xs);
}

void pdflow_q8a8_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale,
                      int64_t n_out, float *y, int threads) {
    const int64_t groups = k / GROUP;
    int8_t *xq = aligned_alloc(32, (size_t)(rows * k + 31) / 32 * 32);
    float *xs = malloc(sizeof(float) * 2 * rows * groups), *xsum = xs + rows * groups;
    quantize_rows(x, rows, k, xq, xs, xsum);
    q8a8_product(xq, xs, rows, k, q, scale, n_out, y, threads);
    free(xq);
    free(xs);
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

/* ---- the small fused steps of a layer, for few rows (decode): one call each instead of 4–8
 * PyTorch operations, whose dispatch costs more than their arithmetic at this size ---- */

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps), as transformers' LlamaRMSNorm in fp32 */
void pdflow_rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] = w[i] * (xr[i] * inv);
    }
}

/* rotary embedding of the query and key heads of a fused projection row (heads + 2 * kv_heads
 * heads of head_dim, queries first): q_out[r] (heads, head_dim), k_out[r] (kv_heads, head_dim),
 * x * cos + rotate_half(x) * sin with cos/sin[r] of the row's position */
void pdflow_rope(const float *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 const float *cos, const float *sin, float *q_out, float *k_out) {
    const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const float *x = qkv + r * width + h * head_dim;
            float *o = h < heads ? q_out + (r * heads + h) * head_dim : k_out + (r * kv_heads + h - heads) * head_dim;
            for (int64_t i = 0; i < half; i++) {
                o[i] = x[i] * c[i] + (-x[i + half]) * s[i];
                o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
            }
        }
    }
}

/* out[r] = the index of row r's largest value, the first where several are equal, or of its first
 * NaN if it has one (torch.argmax's answer; its own loop is scalar and takes ~50 us over a 49,152-
 * token vocabulary, a percent of a decode step). Two passes over the row: the maximum (and
 * whether a NaN is there), then its first place. */
void pdflow_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        float best = -INFINITY;
        int nan = 0;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)  /* where immintrin.h is included */
        __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 a = _mm256_loadu_ps(v + i);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, a);
        }
        nan = _mm256_movemask_ps(unordered) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
#endif
        for (; i < n; i++) {
            if (v[i] != v[i]) nan = 1;
            else if (v[i] > best) best = v[i];
        }
        int64_t at = 0;
        if (nan) {
            while (v[at] == v[at]) at++;
        } else {
            i = 0;
#if defined(__AVX2__) && defined(__FMA__)
            const __m256 b = _mm256_set1_ps(best);
            for (; i + 8 <= n; i += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), b, _CMP_EQ_OQ));
                if (hit) break;
            }
#endif
            while (i < n && v[i] != best) i++;
            at = i < n ? i : 0;
        }
        out[r] = at;
    }
}

/* ---- decode attention, read in place from blocks ----
 * One new query token per sequence against that sequence's cached keys and values, which stay
 * where they are: token t of sequence b is row t % block_tokens of slot table[b][t / block_tokens];
 * its key for kv head h is at keys + slot * slot_stride + row * token_stride + h * head_stride
 * (values alike). The same call reads a head-major batch buffer (one slot per sequence) or
 * token-major store blocks, by the strides. Softmax is computed online, run by run of at most
 * MAX_RUN tokens within a block (flash-decoding), so no score buffer grows with the context. The
 * query heads that share a key/value head are computed together (up to MAX_SHARED at a time), so
 * each cached key and value is read once for all of them. q and out: (batch, heads, head_dim).
 * First the step's own keys and values (new_k/new_v: row b, kv head h at b * new_stride + h *
 * head_dim) are written at position lengths[b] - 1, where they belong.
 * kv_keep (NULL: every head) marks the kv heads attended with: a pruned head's query heads put out
 * zeros, and the step's keys and values for it are written as zeros (as a pruning codec decodes
 * the prompt's), so what the cache holds for it stays zero.
 */
#define MAX_RUN 256
#define MAX_SHARED 8
#define MAX_HEAD_DIM 512

#if defined(__AVX2__) && defined(__FMA__)
/* e^x for x <= 0 (scores minus their running maximum), within 2 ulp of expf; 0 below -87.3 */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 floor = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
    x = _mm256_max_ps(x, floor);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* x - n ln 2, ln 2 in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);  /* e^r - 1 - r = r^2 P(r) on |r| <= ln 2 / 2 */
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

static inline float dot_vec(const float *a, const float *b, int64_t n) {  /* n a multiple of 8 */
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    if (i < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return reduce8(_mm256_add_ps(s0, s1));
}

/* p[i] = exp(s[i] - max), returns their sum */
static inline float exp_shifted(float *s, int64_t n, float max) {
    const __m256 m = _mm256_set1_ps(max);
    __m256 total = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, p);
        total = _mm256_add_ps(total, p);
    }
    float sum = reduce8(total);
    for (; i < n; i++) sum += (s[i] = expf(s[i] - max));
    return sum;
}
#define VECTOR_ATTENTION 1
#else
#define VECTOR_ATTENTION 0
#endif

/* out[r] = silu(gate_up[r][:inter]) * gate_up[r][inter:]; silu(g) = g * sigmoid(g), sigmoid from
 * e = exp(-|g|) (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below */
void pdflow_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)  /* exp_nonpositive's condition */
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));  /* exp(-|x|) */
            const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
            const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
            _mm256_storeu_ps(out + r * inter + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) out[r * inter + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static inline float dot_any(const float *a, const float *b, int64_t n) {
#if VECTOR_ATTENTION
    if (n % 8 == 0) return dot_vec(a, b, n);
#endif
    float dot = 0.0f;
    for (int64_t d = 0; d < n; d++) dot += a[d] * b[d];
    return dot;
}

static inline float exp_any(float *s, int64_t n, float max) {
#if VECTOR_ATTENTION
    return exp_shifted(s, n, max);
#else
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += (s[i] = expf(s[i] - max));
    return sum;
#endif
}

#if defined(__AVX512F__)
/* AVX-512: the query heads that share a kv head (up to 16 vectors of 16 lanes: 4 heads of 64
 * dimensions, 2 of 128) keep their queries and their output sums in registers for a whole run of
 * tokens, and each key and value slice of the kv head is loaded once for all of them. A run's
 * scores, its online-softmax step and its value sums are computed as by the 256-bit path (the
 * same running maximum, total and unnormalized output, summed in another order). */
#define VECTOR_ATTENTION_512 1
#define MAX_VECTORS_512 16
#define PREFETCH_TOKENS 8  /* how far ahead the first pass fetches keys (8: the best of 0-64 measured) */

static inline __m512 exp_nonpositive512(__m512 x) {  /* exp_nonpositive's polynomial, 16 lanes */
    const __m512 floor = _mm512_set1_ps(-87.3f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ);
    x = _mm512_max_ps(x, floor);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_mul_ps(p, _mm512_castsi512_ps(two_n)));
}

/* C query heads (queries q: C x head_dim, V = head_dim / 16 vectors each) against n tokens of one
 * kv head (k, v: the first token's slice; rows token_stride apart): scores (C x MAX_RUN) scratch,
 * running_max / total / acc (C x head_dim) the online softmax's state, updated.
 * fetch_k / fetch_v (the run's first whole rows; NULL: none): the first kv head's pass prefetches
 * every line of each key row PREFETCH_TOKENS ahead and of each value row, so the later kv heads'
 * passes over the same rows find them in cache. Without it, each kv head's pass is a strided read
 * of the block (one slice of every row), which the hardware prefetchers serve badly: the layers
 * at a 1,024-token context took 5.27 against 4.81 ms with it (a C harness, not shipped). */
static inline void run512(const int C, const int V, const float *q, const float *k, const float *v, int64_t n,
                          int64_t token_stride, float scale, float *scores, float *running_max, float *total,
                          float *acc, const float *fetch_k, const float *fetch_v, int64_t fetch_lines) {
    __m512 qv[MAX_VECTORS_512], av[MAX_VECTORS_512];
    for (int c = 0; c < C; c++)
        for (int i = 0; i < V; i++) qv[c * V + i] = _mm512_loadu_ps(q + c * V * 16 + i * 16);
    for (int64_t t = 0; t < n; t++) {
        const float *kt = k + t * token_stride;
        if (fetch_k) {
            for (int64_t line = 0; line < fetch_lines; line++) {
                _mm_prefetch((const char *)(fetch_k + (t + PREFETCH_TOKENS) * token_stride + line * 16), _MM_HINT_T0);
                _mm_prefetch((const char *)(fetch_v + t * token_stride + line * 16), _MM_HINT_T0);
            }
        }
        __m512 kv[MAX_VECTORS_512];
        for (int i = 0; i < V; i++) kv[i] = _mm512_loadu_ps(kt + i * 16);
        for (int c = 0; c < C; c++) {
            __m512 s0 = _mm512_mul_ps(qv[c * V], kv[0]), s1 = _mm512_setzero_ps();
            for (int i = 1; i < V; i++) {
                if (i & 1) s1 = _mm512_fmadd_ps(qv[c * V + i], kv[i], s1);
                else s0 = _mm512_fmadd_ps(qv[c * V + i], kv[i], s0);
            }
            scores[c * MAX_RUN + t] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * scale;
        }
    }
    for (int c = 0; c < C; c++) {
        float *s = scores + c * MAX_RUN;
        __m512 top = _mm512_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
        float block_max = _mm512_reduce_max_ps(top);
        for (; t < n; t++) block_max = s[t] > block_max ? s[t] : block_max;
        const float new_max = block_max > running_max[c] ? block_max : running_max[c];
        const float rescale = expf(running_max[c] - new_max);  /* 0 on the first run */
        const __m512 m = _mm512_set1_ps(new_max);
        __m512 sum = _mm512_setzero_ps();
        for (t = 0; t + 16 <= n; t += 16) {
            const __m512 p = exp_nonpositive512(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
            _mm512_storeu_ps(s + t, p);
            sum = _mm512_add_ps(sum, p);
        }
        float part = _mm512_reduce_add_ps(sum);
        for (; t < n; t++) part += (s[t] = expf(s[t] - new_max));
        total[c] = total[c] * rescale + part;
        running_max[c] = new_max;
        const __m512 r = _mm512_set1_ps(rescale);
        for (int i = 0; i < V; i++) av[c * V + i] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * V * 16 + i * 16), r);
    }
    for (int64_t t = 0; t < n; t++) {
        const float *vt = v + t * token_stride;
        __m512 vv[MAX_VECTORS_512];
        for (int i = 0; i < V; i++) vv[i] = _mm512_loadu_ps(vt + i * 16);
        for (int c = 0; c < C; c++) {
            const __m512 p = _mm512_set1_ps(scores[c * MAX_RUN + t]);
            for (int i = 0; i < V; i++) av[c * V + i] = _mm512_fmadd_ps(p, vv[i], av[c * V + i]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int i = 0; i < V; i++) _mm512_storeu_ps(acc + c * V * 16 + i * 16, av[c * V + i]);
}

/* run512 with C and V constants (its loops unrolled, its vectors in registers), for the shapes
 * heads_512 allows */
static void run512_cases(int C, int V, const float *q, const float *k, const float *v, int64_t n,
                        int64_t token_stride, float scale, float *scores, float *running_max, float *total,
                        float *acc, const float *fetch_k, const float *fetch_v, int64_t fetch_lines) {
#define RUN512(c_, v_) \
    case (c_) * 32 + (v_): run512(c_, v_, q, k, v, n, token_stride, scale, scores, running_max, total, acc, fetch_k, fetch_v, fetch_lines); return;
    switch (C * 32 + V) {
        RUN512(1, 1) RUN512(2, 1) RUN512(3, 1) RUN512(4, 1)
        RUN512(1, 2) RUN512(2, 2) RUN512(3, 2) RUN512(4, 2)
        RUN512(1, 4) RUN512(2, 4) RUN512(3, 4) RUN512(4, 4)
        RUN512(1, 8) RUN512(2, 8)
    }
#undef RUN512
}

/* the largest number of query heads run512_cases takes at once for this head_dim (0: it has no
 * case for it: head_dim 16, 32, 64 or 128 only) */
static inline int64_t heads_512(int64_t head_dim) {
    switch (head_dim) {
        case 16: case 32: case 64: return 4;
        case 128: return 2;
        default: return 0;
    }
}
#else
#define VECTOR_ATTENTION_512 0
#endif

/* The output of every query head whose kv head is pruned: zero. */
static void zero_pruned(float *out, int64_t batch, int64_t heads, int64_t group, int64_t head_dim,
                        const uint8_t *kv_keep) {
    if (!kv_keep) return;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++)
            if (!kv_keep[h / group]) memset(out + (b * heads + h) * head_dim, 0, head_dim * sizeof(float));
}

void pdflow_decode_attention(const float *q, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             const int64_t *lengths, const int64_t *table, int64_t table_width,
                             int64_t block_tokens, const float *keys, const float *values, int64_t slot_stride,
                             int64_t token_stride, int64_t head_stride, const float *new_k, const float *new_v,
                             int64_t new_k_stride, int64_t new_v_stride, float scale, const uint8_t *kv_keep,
                             float *out, int threads) {
    const int64_t group = heads / kv_heads, chunks = (group + MAX_SHARED - 1) / MAX_SHARED;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t t = lengths[b] - 1;
        const int64_t at = table[b * table_width + t / block_tokens] * slot_stride + (t % block_tokens) * token_stride;
        for (int64_t h = 0; h < kv_heads; h++) {
            if (kv_keep && !kv_keep[h]) {
                memset((float *)keys + at + h * head_stride, 0, head_dim * sizeof(float));
                memset((float *)values + at + h * head_stride, 0, head_dim * sizeof(float));
                continue;
            }
            memcpy((float *)keys + at + h * head_stride, new_k + b * new_k_stride + h * head_dim, head_dim * sizeof(float));
            memcpy((float *)values + at + h * head_stride, new_v + b * new_v_stride + h * head_dim, head_dim * sizeof(float));
        }
    }
    /* Token-major blocks (every kv head of a token side by side, as the store's): one task per
     * sequence reads each token's row whole, front to back, instead of one kv head's slice of it
     * per task (three strided passes over the same memory, which the prefetchers serve badly). */
    const int whole_rows = kv_heads > 1 && head_stride * kv_heads <= token_stride;
    /* Each sequence's tokens are split into `parts` ranges (one per thread), each range's softmax
     * computed on its own and the parts merged after (flash-decoding's split): with fewer rows than
     * threads every thread works, and the split is the same however many rows share the call, so a
     * row's result does not depend on the others (a speculative verify pass gives a plain step's). */
    const int64_t parts = whole_rows ? threads : 1;
    const int64_t tasks = whole_rows ? batch * parts : batch * kv_heads * chunks;
    float *partial = parts > 1 ? malloc(sizeof(float) * batch * parts * heads * (head_dim + 2)) : NULL;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b, first, shared, part = 0;  /* this task's query heads: first .. first + shared */
        if (whole_rows) {
            b = task / parts, part = task % parts, first = 0, shared = heads;
        } else {
            b = task / (kv_heads * chunks);
            const int64_t kvh = task / chunks % kv_heads, chunk = task % chunks;
            first = kvh * group + chunk * MAX_SHARED;
            shared = group - chunk * MAX_SHARED < MAX_SHARED ? group - chunk * MAX_SHARED : MAX_SHARED;
        }
        float stack_scratch[MAX_SHARED * (MAX_RUN + MAX_HEAD_DIM + 2)];
        float *scratch = shared <= MAX_SHARED ? stack_scratch
                                              : malloc(sizeof(float) * shared * (MAX_RUN + head_dim + 2));
        float *scores = scratch, *acc = scores + shared * MAX_RUN, *running_max = acc + shared * head_dim,
              *total = running_max + shared;
        int64_t offset[shared];  /* query head j reads kv head (first + j) / group */
        for (int64_t j = 0; j < shared; j++) {
            for (int64_t d = 0; d < head_dim; d++) acc[j * head_dim + d] = 0.0f;
            running_max[j] = -INFINITY;
            total[j] = 0.0f;
            offset[j] = (first + j) / group * head_stride;
        }
        const float *qb = q + (b * heads + first) * head_dim;
        const int64_t length = lengths[b] * (part + 1) / parts;  /* this task's tokens: start .. length */
#if VECTOR_ATTENTION_512
        const int64_t at_once = heads_512(head_dim);
#endif
        for (int64_t start = lengths[b] * part / parts; start < length;) {
            const int64_t slot = table[b * table_width + start / block_tokens], row = start % block_tokens;
            int64_t n = block_tokens - row;
            if (n > length - start) n = length - start;
            if (n > MAX_RUN) n = MAX_RUN;
            const float *kb = keys + slot * slot_stride + row * token_stride;
            const float *vb = values + slot * slot_stride + row * token_stride;
#if VECTOR_ATTENTION_512
            if (at_once) {  /* the query heads of each kv head together, in registers */
                for (int64_t j = 0; j < shared;) {
                    int64_t c = 1;  /* heads j .. j + c: one kv head's */
                    while (c < at_once && j + c < shared && offset[j + c] == offset[j]) c++;
                    run512_cases((int)c, (int)(head_dim / 16), qb + j * head_dim, kb + offset[j], vb + offset[j], n,
                                 token_stride, scale, scores, running_max + j, total + j, acc + j * head_dim,
                                 j == 0 ? kb : NULL, vb, token_stride / 16);
                    j += c;
                }
                start += n;
                continue;
            }
#endif
            for (int64_t t = 0; t < n; t++)
                for (int64_t j = 0; j < shared; j++)
                    scores[j * MAX_RUN + t] = dot_any(qb + j * head_dim, kb + t * token_stride + offset[j], head_dim) * scale;
            for (int64_t j = 0; j < shared; j++) {
                float *s = scores + j * MAX_RUN, block_max = -INFINITY;
                for (int64_t t = 0; t < n; t++) block_max = s[t] > block_max ? s[t] : block_max;
                const float new_max = block_max > running_max[j] ? block_max : running_max[j];
                const float rescale = expf(running_max[j] - new_max);  /* 0 on the first run */
                total[j] = total[j] * rescale + exp_any(s, n, new_max);
                for (int64_t d = 0; d < head_dim; d++) acc[j * head_dim + d] *= rescale;
                running_max[j] = new_max;
            }
            for (int64_t t = 0; t < n; t++) {
                const float *vt = vb + t * token_stride;
                for (int64_t j = 0; j < shared; j++) {
                    const float p = scores[j * MAX_RUN + t], *v = vt + offset[j];
                    float *a = acc + j * head_dim;
                    #pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
                }
            }
            start += n;
        }
        for (int64_t j = 0; j < shared; j++) {
            if (parts > 1) {  /* this part's running maximum, sum and unnormalized output, merged below */
                float *p = partial + ((b * parts + part) * heads + first + j) * (head_dim + 2);
                p[0] = running_max[j], p[1] = total[j];
                for (int64_t d = 0; d < head_dim; d++) p[2 + d] = acc[j * head_dim + d];
                continue;
            }
            float *o = out + (b * heads + first + j) * head_dim;
            const float inv = 1.0f / total[j];
            for (int64_t d = 0; d < head_dim; d++) o[d] = acc[j * head_dim + d] * inv;
        }
        if (scratch != stack_scratch) free(scratch);
    }
    if (parts == 1) {
        zero_pruned(out, batch, heads, group, head_dim, kv_keep);
        return;
    }
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++) {
            float top = -INFINITY, sum = 0.0f, *o = out + (b * heads + h) * head_dim;
            for (int64_t part = 0; part < parts; part++) {
                const float m = partial[((b * parts + part) * heads + h) * (head_dim + 2)];
                top = m > top ? m : top;
            }
            for (int64_t d = 0; d < head_dim; d++) o[d] = 0.0f;
            for (int64_t part = 0; part < parts; part++) {
                const float *p = partial + ((b * parts + part) * heads + h) * (head_dim + 2);
                if (p[1] == 0.0f) continue;  /* a part without tokens */
                const float w = expf(p[0] - top);
                sum += p[1] * w;
                for (int64_t d = 0; d < head_dim; d++) o[d] += p[2 + d] * w;
            }
            for (int64_t d = 0; d < head_dim; d++) o[d] /= sum;
        }
    free(partial);
    zero_pruned(out, batch, heads, group, head_dim, kv_keep);
}

/* ---- a decode step's layers in one call ----
 * For a few rows (one new token per sequence), every layer of a Llama-family model in C: RMSNorm,
 * the fused QKV product, rotary embedding, attention over the batch's cached keys and values (the
 * step's own written in place first), the output product and residual, RMSNorm, the fused
 * gate/up product, SiLU-gated product, the down product and residual. Between PyTorch calls these
 * are ~20 dispatches a layer, which at a decode step's size cost more than the arithmetic.
 * hidden (rows, dim) is updated in place. Matrices are described by pdflow_matrix (the packed
 * formats' own buffers); keys[l] / values[l] are layer l's cache, addressed as in
 * pdflow_decode_attention; kv_keep (NULL: all) is (n_layers, kv_heads), as there per layer. */
typedef struct {
    int32_t bits;             /* 8: int8 weights; 4: int4 weights (with low); 5: int4 in blocks of 16 outputs
                               * (q4blocked.c; int16 activations) */
    int32_t activation_bits;  /* 32: fp32 activations; 16 or 8: quantized per group at each product */
    int64_t n_out, k;
    const void *q;
    const float *scale, *low, *bias;  /* bias may be NULL */
} pdflow_matrix;

typedef struct {
    const float *input_norm, *post_norm;
    pdflow_matrix qkv, o, gate_up, down;
} pdflow_layer;

int pdflow_q4b_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale, const float *low,
                    int64_t n_out, float *y, int threads, int path) __attribute__((weak));  /* q4blocked.c */

static void matrix_product(const pdflow_matrix *w, const float *x, int64_t rows, float *y, int threads) {
    if (w->bits == 5) {
        pdflow_q4b_gemm(x, rows, w->k, w->q, w->scale, w->low, w->n_out, y, threads, 0);
    } else if (w->bits == 4) {
        if (w->activation_bits == 8) pdflow_q4a8_gemm(x, rows, w->k, w->q, w->scale, w->low, w->n_out, y, threads);
        else if (w->activation_bits == 16) pdflow_q4a16_gemm(x, rows, w->k, w->q, w->scale, w->low, w->n_out, y, threads);
        else pdflow_q4_gemm(x, rows, w->k, w->q, w->scale, w->low, w->n_out, y, threads);
    } else {
        if (w->activation_bits == 8) pdflow_q8a8_gemm(x, rows, w->k, w->q, w->scale, w->n_out, y, threads);
        else if (w->activation_bits == 16) pdflow_q8a16_gemm(x, rows, w->k, w->q, w->scale, w->n_out, y, threads);
        else pdflow_q8_gemm(x, rows, w->k, w->q, w->scale, w->n_out, y, threads);
    }
    if (w->bias)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t n = 0; n < w->n_out; n++) y[m * w->n_out + n] += w->bias[n];
}

void pdflow_decode_layers(const pdflow_layer *layers, int64_t n_layers, float *hidden, int64_t rows, int64_t dim,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, float eps,
                          const int64_t *positions, const float *cos_table, const float *sin_table,
                          const int64_t *lengths, const int64_t *table, int64_t table_width, int64_t block_tokens,
                          float *const *keys, float *const *values, int64_t slot_stride, int64_t token_stride,
                          int64_t head_stride, float scale, const uint8_t *kv_keep, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * head_dim;
    float *scratch = malloc(sizeof(float) * rows * (dim + width + 2 * heads * head_dim + kv_heads * head_dim
                                                    + 2 * inter + inter + dim));
    float *normed = scratch, *qkv = normed + rows * dim, *q = qkv + rows * width;
    float *attn = q + rows * heads * head_dim, *k = attn + rows * heads * head_dim;
    float *gate_up = k + rows * kv_heads * head_dim, *act = gate_up + rows * 2 * inter, *delta = act + rows * inter;
    for (int64_t l = 0; l < n_layers; l++) {
        const pdflow_layer *layer = layers + l;
        pdflow_rms_norm(hidden, layer->input_norm, rows, dim, eps, normed);
        matrix_product(&layer->qkv, normed, rows, qkv, threads);
        for (int64_t r = 0; r < rows; r++)
            pdflow_rope(qkv + r * width, 1, heads, kv_heads, head_dim, cos_table + positions[r] * head_dim,
                        sin_table + positions[r] * head_dim, q + r * heads * head_dim, k + r * kv_heads * head_dim);
        pdflow_decode_attention(q, rows, heads, kv_heads, head_dim, lengths, table, table_width, block_tokens,
                                keys[l], values[l], slot_stride, token_stride, head_stride, k, qkv + (heads + kv_heads) * head_dim,
                                kv_heads * head_dim, width, scale, kv_keep ? kv_keep + l * kv_heads : NULL, attn,
                                threads);
        matrix_product(&layer->o, attn, rows, delta, threads);
        for (int64_t i = 0; i < rows * dim; i++) hidden[i] += delta[i];
        pdflow_rms_norm(hidden, layer->post_norm, rows, dim, eps, normed);
        matrix_product(&layer->gate_up, normed, rows, gate_up, threads);
        pdflow_silu_mul(gate_up, rows, inter, act);
        matrix_product(&layer->down, act, rows, delta, threads);
        for (int64_t i = 0; i < rows * dim; i++) hidden[i] += delta[i];
    }
    free(scratch);
}
