/* Weight-only quantized matrix products for pdflow's engine: y = x @ W.T with W in int8 or int4
 * groups of 32 inputs, x and y in fp32, for the few rows of a decode step; and the weights
 * dequantized to fp32 for products of many rows. (x quantized per group: products_a8.c, products_a16.c.)
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

#include "pdflow_kernels.h"
#include "helpers.h"

#define MAX_ROWS 64

static inline float sum32(const float *a) {
    float s = 0.0f;
    for (int i = 0; i < GROUP; i++) s += a[i];
    return s;
}

/* AVX2 + FMA (x86-64 since 2013): a group's 32 weights become four 8-lane vectors in registers,
 * scaled once, then multiplied into every row's four accumulators */
#if defined(__AVX2__) && defined(__FMA__)

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
