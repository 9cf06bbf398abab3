/* Weight-only quantized matrix products for pdflow's engine: y = x @ W.T with W in int8 or int4
 * groups of 32 inputs, x and y in fp32, for the few rows of a decode step.
 *
 * Each output row n reads its weights once and shares them across the rows of x: with one row, a
 * group of 32 weights is unpacked and scaled into registers and multiplied straight in; with
 * more, the output row's weights are unpacked once into an fp32 buffer (in L1) and multiplied
 * into tiles of 4 rows of x. Threads split the output rows. Built at first use with -O3
 * -march=native (pdflow/engine/kernels); the callers keep rows <= MAX_ROWS and k <= 8192.
 *
 * Layouts (row-major, n = output row, g = group of 32 inputs):
 *   int8: q8[n][g][32] signed; scale[n][g]; w = q * scale                  (GGUF Q8_0's rule)
 *   int4: q4[n][g][16] bytes, input i < 16 in the low nibble of byte i and input 16 + i in its
 *         high nibble; scale[n][g], low[n][g]; w = q * scale + low          (GGUF Q4_1's rule)
 */
#include <stdint.h>
#include <math.h>
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

/* out[r] = silu(gate_up[r][:inter]) * gate_up[r][inter:] */
void pdflow_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i++) out[r * inter + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
/* ---- decode attention, read in place from blocks ----
 * One new query token per sequence against that sequence's cached keys and values, which stay
 * where they are: token t of sequence b is row t % block_tokens of slot table[b][t / block_tokens];
 * its key for kv head h is at keys + slot * slot_stride + row * token_stride + h * head_stride
 * (values alike). The same call reads a head-major batch buffer (one slot per sequence) or
 * token-major store blocks, by the strides. Softmax is computed online, block by block
 * (flash-decoding), so no score buffer grows with the context. q and out: (batch, heads, head_dim).
 * First the step's own keys and values (new_k/new_v: row b, kv head h at b * new_stride + h *
 * head_dim) are written at position lengths[b] - 1, where they belong.
 */
#define MAX_BLOCK 1024
#define MAX_HEAD_DIM 512

void pdflow_decode_attention(const float *q, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             const int64_t *lengths, const int64_t *table, int64_t table_width,
                             int64_t block_tokens, const float *keys, const float *values, int64_t slot_stride,
                             int64_t token_stride, int64_t head_stride, const float *new_k, const float *new_v,
                             int64_t new_k_stride, int64_t new_v_stride, float scale, float *out, int threads) {
    const int64_t group = heads / kv_heads;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t t = lengths[b] - 1;
        const int64_t at = table[b * table_width + t / block_tokens] * slot_stride + (t % block_tokens) * token_stride;
        for (int64_t h = 0; h < kv_heads; h++) {
            memcpy((float *)keys + at + h * head_stride, new_k + b * new_k_stride + h * head_dim, head_dim * sizeof(float));
            memcpy((float *)values + at + h * head_stride, new_v + b * new_v_stride + h * head_dim, head_dim * sizeof(float));
        }
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < batch * heads; task++) {
        const int64_t b = task / heads, h = task % heads, kvh = h / group;
        const float *qv = q + (b * heads + h) * head_dim;
        float acc[MAX_HEAD_DIM], scores[MAX_BLOCK];
        for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.0f;
        float running_max = -INFINITY, total = 0.0f;
        const int64_t length = lengths[b];
        for (int64_t start = 0; start < length;) {  /* a run of at most MAX_BLOCK tokens within one block */
            const int64_t slot = table[b * table_width + start / block_tokens], row = start % block_tokens;
            int64_t n = block_tokens - row;
            if (n > length - start) n = length - start;
            if (n > MAX_BLOCK) n = MAX_BLOCK;
            const float *kb = keys + slot * slot_stride + row * token_stride + kvh * head_stride;
            const float *vb = values + slot * slot_stride + row * token_stride + kvh * head_stride;
            float block_max = -INFINITY;
            for (int64_t t = 0; t < n; t++) {
                const float *kt = kb + t * token_stride;
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qv[d] * kt[d];
                scores[t] = dot * scale;
                if (scores[t] > block_max) block_max = scores[t];
            }
            const float new_max = block_max > running_max ? block_max : running_max;
            const float rescale = expf(running_max - new_max);  /* 0 on the first block */
            total *= rescale;
            for (int64_t d = 0; d < head_dim; d++) acc[d] *= rescale;
            for (int64_t t = 0; t < n; t++) {
                const float p = expf(scores[t] - new_max);
                total += p;
                const float *vt = vb + t * token_stride;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[d] += p * vt[d];
            }
            running_max = new_max;
            start += n;
        }
        float *o = out + (b * heads + h) * head_dim;
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < head_dim; d++) o[d] = acc[d] * inv;
    }
}
