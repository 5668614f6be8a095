/* A whole decoder layer over GGUF-block weights in one call: a decode step of SmolLM2 made ~150
 * kernel calls from Python, each costing ~15 us around the C (a third of the step); this makes it
 * 30. The math is the same calls the Python composition makes (model/llama.py's Block): RMSNorm +
 * q|k|v, RoPE + cache + attention, o + residual, RMSNorm + gate|up, SwiGLU + down + residual. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

typedef struct {
    int nparts;
    const int *types;
    const int64_t *rows;
    const void *const *data;
    int act8;  /* int8 activations (else int16): the weight's, quant_matmul.c */
    int64_t N, K;
    const float *bias;
} QDLinear;

typedef struct {
    QDLinear qkv, wo, gate_up, down;
    const float *attn_norm, *mlp_norm;
    float eps, scale;
    int64_t n_q, n_kv, head_dim;
} QDLayer;

int qd_quant_matmul(const float *x, int nparts, const int *types, const int64_t *rows, const void *const *data,
                    int act8, const float *b, const float *r, float *y, int prologue, const float *g, float eps,
                    float *scratch, int64_t M, int64_t N, int64_t K, int threads);
void qd_rope_attention(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                       float *k, float *v, const uint8_t *visible, float *out, int64_t B, int64_t T,
                       int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_len, int64_t kv_batch, int64_t kv_head,
                       float scale, float *scratch, int threads);

static int linear(const QDLinear *w, const float *x, const float *r, float *y, int prologue, const float *g,
                  float eps, int64_t M, int threads) {
    return qd_quant_matmul(x, w->nparts, w->types, w->rows, w->data, w->act8, w->bias, r, y, prologue, g, eps, 0, M, w->N,
                           w->K, threads);
}

/* x: [B * T, hidden], updated in place; the rest as qd_rope_attention takes them. 0, or -1 when
 * memory ran out (x is then unspecified). */
int qd_layer(float *x, const QDLayer *L, const float *cos, const float *sin, const int64_t *positions,
             float *k_cache, float *v_cache, int64_t kv_batch, int64_t kv_head, const uint8_t *visible,
             int64_t B, int64_t T, int64_t kv_len, int threads) {
    const int64_t M = B * T, att = L->n_q * L->head_dim;
    float *qkv = malloc(sizeof(float) * (size_t)(M * L->qkv.N)), *q = malloc(sizeof(float) * (size_t)(M * att));
    float *a = malloc(sizeof(float) * (size_t)(M * att)), *h = malloc(sizeof(float) * (size_t)(M * L->gate_up.N));
    int status = qkv && q && a && h ? 0 : -1;
    if (status == 0) status = linear(&L->qkv, x, 0, qkv, PRO_RMSNORM, L->attn_norm, L->eps, M, threads);
    if (status == 0) {
        qd_rope_attention(qkv, cos, sin, positions, k_cache, v_cache, visible, a, B, T, L->n_q, L->n_kv, L->head_dim,
                          kv_len, kv_batch, kv_head, L->scale, q, threads);
        status = linear(&L->wo, a, x, x, PRO_NONE, 0, 0.0f, M, threads);  /* residual in place */
    }
    if (status == 0) status = linear(&L->gate_up, x, 0, h, PRO_RMSNORM, L->mlp_norm, L->eps, M, threads);
    if (status == 0) status = linear(&L->down, h, x, x, PRO_SWIGLU, 0, 0.0f, M, threads);
    free(qkv); free(q); free(a); free(h);
    return status;
}
