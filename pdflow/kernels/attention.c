/* Decode attention, read in place from paged blocks.
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pdflow_kernels.h"
#include "helpers.h"

#define MAX_RUN 256
#define MAX_SHARED 8
#define MAX_HEAD_DIM 512

#if defined(__AVX2__) && defined(__FMA__)
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
