/* Weight-only quantized matrix products with int8 activations (formats int8-a8 and int4-a8), the
 * weights in products_fp32.c's layouts: each row of x is quantized
 * per group of 32 inputs, as GGUF's Q8_0 does for llama.cpp's dot products (xs = the group's
 * largest magnitude / 127, xq = round(x / xs)), and each group's dot product is computed in
 * integers: sum(w * x) ≈ sw * xs * sum(qw * xq) (+ low * xs * sum(xq) for int4: the sum of the
 * quantized x, so that the error is sum(w * (xq * xs - x)) as for int8, not sum((w - low) * ...)).
 * Four times the multiplies per instruction of fp32, and no weight unpacking to floats.
 * The x buffers: xq[rows][k] int8, xs[rows][groups], xsum[rows][groups] floats. */
#include <stdint.h>
#include <stdlib.h>

#include "pdflow_kernels.h"
#include "helpers.h"

#if defined(__AVX2__) && defined(__FMA__)

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

#else  /* portable C: one version for 8- and 16-bit activations (portable_products.h) */
#include "portable_products.h"

static void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *xq, float *xs, float *xsum) {
    quantize_any(x, rows, k, xq, 8, xs, xsum);
}
static void q4a8_product(const int8_t *xq, const float *xs, const float *xsum, int64_t rows, int64_t k,
                         const uint8_t *q, const float *scale, const float *low, int64_t n_out, float *y, int threads) {
    q4_any(xq, 8, xs, xsum, rows, k, q, scale, low, n_out, y, threads);
}
static void q8a8_product(const int8_t *xq, const float *xs, int64_t rows, int64_t k, const int8_t *q,
                         const float *scale, int64_t n_out, float *y, int threads) {
    q8_any(xq, 8, xs, rows, k, q, scale, n_out, y, threads);
}
#endif

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
