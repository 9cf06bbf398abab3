/* The static inline helpers that several of the kernels' C files share (private: Python never
 * sees them). Static inline so that each file compiles and inlines its own copy, as when the
 * files were one (qgemm.c; its split was checked to leave every function's instructions and every
 * output float as they were: experiments/compare_kernel_outputs.py). */
#ifndef PDFLOW_KERNELS_HELPERS_H
#define PDFLOW_KERNELS_HELPERS_H

#include <stdint.h>

#define GROUP 32  /* inputs that share one scale (and int4's minimum) in the row-major layouts */

/* AVX2 + FMA (x86-64 since 2013) */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float reduce8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

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

/* The quantized-activation products fetch each output row's weights (and scales) this far ahead
 * of the row that reads them: each row prefetches the span it covers, ``ahead`` bytes on. The
 * hardware's own prefetchers keep too few lines in flight when this VM's memory is slow: with it
 * the model's 30 decode layers took 1.19-1.31x less time from memory at 256-2,048 tokens
 * (1.06x at batch 8) and the int8 lm_head 1.5-1.6x, at a cost of 3-4% with the weights in cache
 * (experiments/compare_kernel_builds.py; 2,048 to 8,192 bytes ahead measured alike; docs/benchmarks.md).
 * Prefetches never fault, so the last rows' run past the matrix harmlessly. */
#define WEIGHT_PREFETCH_BYTES 4096

static inline void prefetch_ahead(const void *row, int64_t bytes, int64_t ahead) {
    const char *at = (const char *)row + ahead;
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
}

#endif

#endif
