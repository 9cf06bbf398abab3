/* pdflow's CPU kernels: what Python calls (through ctypes, pdflow/kernels/__init__.py, whose
 * declarations are read from this file's prototypes) and what one C file calls in another.
 * Every C file of the library includes it; none declares another file's function itself.
 *
 * Prototypes are one per statement, of the types pdflow/kernels/header.py reads: void, int,
 * int32_t, int64_t, float, pointers (const or not) and `const pdflow_layer *`. Matrices are
 * row-major and contiguous; `threads` is the OpenMP team size of a call.
 *
 * Files: products_fp32.c, products_a8.c, products_a16.c (row-major int8/int4 weights, groups of
 * 32 inputs), q4blocked.c (int4/int8 weights in blocks of 16 outputs), layer_ops.c (a layer's
 * small fused steps), attention.c (decode attention over paged blocks), decode_step.c (a decode
 * step's layers in one call), kvquant.c (the integer KV codecs).
 */
#ifndef PDFLOW_KERNELS_H
#define PDFLOW_KERNELS_H

#include <stdint.h>

/* A packed weight as the products read it (pdflow.kernels.Matrix): y = x @ W.T, W (n_out, k). */
typedef struct {
    int32_t bits;             /* 8: int8 weights; 4: int4 weights (with low); 5: int4 in blocks of 16 outputs
                               * (q4blocked.c; int16 activations) */
    int32_t activation_bits;  /* 32: fp32 activations; 16 or 8: quantized per group at each product */
    int64_t n_out;
    int64_t k;
    const void *q;
    const float *scale;
    const float *low;         /* int4's minimums; NULL for int8 */
    const float *bias;        /* may be NULL */
} pdflow_matrix;

/* One decoder layer's norm weights and packed matrices (pdflow.kernels.Layer). */
typedef struct {
    const float *input_norm;
    const float *post_norm;
    pdflow_matrix qkv;
    pdflow_matrix o;
    pdflow_matrix gate_up;
    pdflow_matrix down;
} pdflow_layer;

/* ---- products with row-major weights (products_*.c): y (rows, n_out) = x (rows, k) @ W.T,
 * rows <= 64 and k <= 8192, k a multiple of 32; int4 takes low, int8 does not ---- */

/* fp32 activations (products_fp32.c) */
void pdflow_q8_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale,
                    int64_t n_out, float *y, int threads);
void pdflow_q4_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale,
                    const float *low, int64_t n_out, float *y, int threads);
/* w (n_out, k): the weights in fp32, for products of many rows (prefill's, by sgemm) */
void pdflow_q8_dequantize(const int8_t *q, const float *scale, int64_t n_out, int64_t k, float *w, int threads);
void pdflow_q4_dequantize(const uint8_t *q, const float *scale, const float *low, int64_t n_out, int64_t k,
                          float *w, int threads);

/* int8 activations, quantized per group of 32 at each call (products_a8.c) */
void pdflow_q4a8_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale,
                      const float *low, int64_t n_out, float *y, int threads);
void pdflow_q8a8_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale,
                      int64_t n_out, float *y, int threads);

/* int16 activations, quantized per group of 32 at each call (products_a16.c) */
void pdflow_q4a16_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale,
                       const float *low, int64_t n_out, float *y, int threads);
void pdflow_q8a16_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale,
                       int64_t n_out, float *y, int threads);
/* x's rows quantized to int16 per group of 32: xq (rows, k), scales xs and xs * sum(xq) xsum
 * (rows, k / 32); the rule every int16-activation product shares (q4blocked.c calls it) */
void pdflow_quantize16(const float *x, int64_t rows, int64_t k, int16_t *xq, float *xs, float *xsum);

/* ---- weights in blocks of 16 outputs, int16 activations (q4blocked.c): n_out a multiple of 16;
 * path 0 the fastest this CPU has, else one of pdflow_q4b_paths()'s; returns 0, or -1 where
 * the path asked for cannot run here ---- */
int pdflow_q4b_gemm(const float *x, int64_t rows, int64_t k, const uint8_t *q, const float *scale, const float *low,
                    int64_t n_out, float *y, int threads, int path);
int pdflow_q8b_gemm(const float *x, int64_t rows, int64_t k, const int8_t *q, const float *scale, int64_t n_out,
                    float *y, int threads, int path);
/* the paths this build and CPU can run, as a bit mask of 1 << path */
int pdflow_q4b_paths(void);
void pdflow_q4b_dequantize(const uint8_t *q, const float *scale, const float *low, int64_t n_out, int64_t k, float *w,
                           int threads);
void pdflow_q8b_dequantize(const int8_t *q, const float *scale, int64_t n_out, int64_t k, float *w, int threads);

/* ---- a layer's small fused steps (layer_ops.c) ---- */
void pdflow_rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *out);
void pdflow_rope(const float *qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 const float *cos, const float *sin, float *q_out, float *k_out);
void pdflow_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out);
void pdflow_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out);

/* ---- decode attention over paged KV blocks (attention.c; the addressing is described there) ---- */
void pdflow_decode_attention(const float *q, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             const int64_t *lengths, const int64_t *table, int64_t table_width,
                             int64_t block_tokens, const float *keys, const float *values, int64_t slot_stride,
                             int64_t token_stride, int64_t head_stride, const float *new_k, const float *new_v,
                             int64_t new_k_stride, int64_t new_v_stride, float scale, const uint8_t *kv_keep,
                             float *out, int threads);

/* ---- a decode step's layers in one call (decode_step.c) ---- */
void pdflow_decode_layers(const pdflow_layer *layers, int64_t n_layers, float *hidden, int64_t rows, int64_t dim,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, float eps,
                          const int64_t *positions, const float *cos_table, const float *sin_table,
                          const int64_t *lengths, const int64_t *table, int64_t table_width, int64_t block_tokens,
                          float *const *keys, float *const *values, int64_t slot_stride, int64_t token_stride,
                          int64_t head_stride, float scale, const uint8_t *kv_keep, int threads);

/* ---- the integer KV codecs (kvquant.c): encode returns 0, or -1 where the values held a NaN or
 * a scale is not finite in float16 ---- */
int pdflow_kv_encode(const float *x, int64_t n, int64_t tokens, int64_t channels, int keys, int64_t group, int bits,
                     int symmetric, uint8_t *out, int64_t stride);
void pdflow_kv_decode(const uint8_t *data, int64_t stride, int64_t n, int64_t tokens, int64_t channels, int keys,
                      int64_t group, int bits, int symmetric, float *out);

#endif
