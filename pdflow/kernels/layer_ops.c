/* The small fused steps of a decoder layer, for few rows (decode): one call each instead of 4–8
 * PyTorch operations, whose dispatch costs more than their arithmetic at this size; and greedy
 * decoding's argmax over the logits. */
#include <math.h>
#include <stdint.h>

#include "pdflow_kernels.h"
#include "helpers.h"

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
#if defined(__AVX2__) && defined(__FMA__)  /* where helpers.h includes immintrin.h */
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
