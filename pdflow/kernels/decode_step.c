/* A decode step's layers in one call.
 * For a few rows (one new token per sequence), every layer of a Llama-family model in C: RMSNorm,
 * the fused QKV product, rotary embedding, attention over the batch's cached keys and values (the
 * step's own written in place first), the output product and residual, RMSNorm, the fused
 * gate/up product, SiLU-gated product, the down product and residual. Between PyTorch calls these
 * are ~20 dispatches a layer, which at a decode step's size cost more than the arithmetic.
 * hidden (rows, dim) is updated in place. Matrices are described by pdflow_matrix (the packed
 * formats' own buffers); keys[l] / values[l] are layer l's cache, addressed as in
 * pdflow_decode_attention; kv_keep (NULL: all) is (n_layers, kv_heads), as there per layer. */
#include <stdint.h>
#include <stdlib.h>

#include "pdflow_kernels.h"

/* y = x @ w.T (+ bias), by the product of w's weight and activation formats */
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
