/* The products with quantized activations in plain C, for CPUs without AVX2 + FMA: one version
 * for 8- and 16-bit activations (xq int8 or int16 by bits), which products_a8.c and
 * products_a16.c wrap. Private; each of the two files uses all three functions. */
#ifndef PDFLOW_KERNELS_PORTABLE_PRODUCTS_H
#define PDFLOW_KERNELS_PORTABLE_PRODUCTS_H

#include <math.h>
#include <stdint.h>

#include "helpers.h"

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

#endif
