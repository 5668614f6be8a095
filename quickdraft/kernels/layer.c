/* A whole decoder layer over GGUF-block weights in one call: a decode step of SmolLM2 made ~150
 * kernel calls from Python, each costing ~15 us around the C (a third of the step); this makes it
 * 30. The math is the same calls the Python composition makes (model/llama.py's Block): RMSNorm +
 * q|k|v, RoPE + cache + attention, o + residual, RMSNorm + gate|up, SwiGLU + down + residual; with
 * the family's variations: GELU for SiLU, QK-norm (per head or over a whole projection) before
 * RoPE, post-norms (OLMo 2: no pre-norm, the sublayer's output normalized before the residual add).
 * A layer whose MLP is a mixture of experts runs its attention half here (gate_up with no parts)
 * and its experts in experts.c. Every step is per row, so a row's result does not depend on the
 * others in the pass. */
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
    const float *attn_norm, *mlp_norm;            /* pre-norm gains, or NULL (a post-norm family) */
    const float *attn_post_norm, *mlp_post_norm;  /* post-norm gains, or NULL */
    const float *q_norm, *k_norm;                 /* QK-norm gains, or NULL */
    float eps, scale;
    int64_t n_q, n_kv, head_dim;
    int64_t q_norm_len, k_norm_len;               /* values one QK-norm spans: head_dim or a projection */
    int64_t glu;                                  /* the down matmul's gated prologue (PRO_SWIGLU ...) */
    float softcap;                                /* attention scores' soft-cap (Gemma 2), 0: none */
    const float *sinks;                           /* [n_q] attention sinks (gpt-oss), or NULL */
} QDLayer;

int qd_quant_matmul(const float *x, int nparts, const int *types, const int64_t *rows, const void *const *data,
                    int act8, const float *b, const float *r, float *y, int prologue, const float *g, float eps,
                    float *scratch, int64_t M, int64_t N, int64_t K, int threads);
void qd_rope_attention(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                       const int64_t *rows, const QDPages *pages, const uint8_t *visible, float *out, int64_t B,
                       int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_len, float scale, float softcap,
                       const float *sinks, float *scratch, int threads);

static int linear(const QDLinear *w, const float *x, const float *r, float *y, int prologue, const float *g,
                  float eps, int64_t M, int threads) {
    return qd_quant_matmul(x, w->nparts, w->types, w->rows, w->data, w->act8, w->bias, r, y, prologue, g, eps, 0, M, w->N,
                           w->K, threads);
}

/* q and k of each row of qkv [M, (n_q + 2 n_kv) * head_dim] normalized in place, in spans of
 * q_norm_len / k_norm_len values. */
static void qk_norm(const QDLayer *L, float *qkv, int64_t M) {
    const int64_t q_len = L->n_q * L->head_dim, k_len = L->n_kv * L->head_dim;
    for (int64_t m = 0; m < M; m++) {
        float *q = qkv + m * L->qkv.N, *k = q + q_len;
        qd_rmsnorm_rows(q, L->q_norm, L->eps, q, q_len / L->q_norm_len, L->q_norm_len);
        qd_rmsnorm_rows(k, L->k_norm, L->eps, k, k_len / L->k_norm_len, L->k_norm_len);
    }
}

/* x[m] += g * RMSNorm(y[m]) for each of M rows of D values (y normalized in place). */
static void add_normed(float *x, float *y, const float *g, float eps, int64_t M, int64_t D) {
    qd_rmsnorm_rows(y, g, eps, y, M, D);
    for (int64_t i = 0; i < M * D; i++) x[i] += y[i];
}

/* Rows the MLP half takes at a time. Its hidden activations for a whole prompt were one buffer of
 * M x gate_up.N floats (39 MB for SmolLM2's 3,000 tokens, 290 MB for the 1.5B's 4,000) which glibc
 * maps afresh and zeroes page by page at every layer (a 3,000-token prefill took ~450k page faults,
 * ~10% of its time); 256 rows a time need 3-18 MB, reused. Each row's result is its own, so the
 * bits are the same. */
#define MLP_ROWS 256

/* x: [B * T, hidden], updated in place; the rest as qd_rope_attention takes them. 0, or -1 when
 * memory ran out (x is then unspecified). */
int qd_layer(float *x, const QDLayer *L, const float *cos, const float *sin, const int64_t *positions,
             const int64_t *rows, const QDPages *pages, const uint8_t *visible,
             int64_t B, int64_t T, int64_t kv_len, int threads) {
    const int64_t M = B * T, att = L->n_q * L->head_dim, D = L->wo.N;
    const int pre = L->attn_norm != 0, post = L->attn_post_norm != 0;
    float *qkv = malloc(sizeof(float) * (size_t)(M * L->qkv.N)), *q = malloc(sizeof(float) * (size_t)(M * att));
    const int mlp = L->gate_up.nparts > 0;  /* none: the attention half alone (a mixture of experts follows) */
    float *a = malloc(sizeof(float) * (size_t)(M * att));
    const int64_t R = M < MLP_ROWS ? M : MLP_ROWS;
    float *h = mlp ? malloc(sizeof(float) * (size_t)(R * L->gate_up.N)) : 0;
    float *y = post ? malloc(sizeof(float) * (size_t)(M * D)) : 0;  /* a sublayer's output before its post-norm */
    int status = qkv && q && a && (h || !mlp) && (y || !post) ? 0 : -1;
    if (status == 0)
        status = linear(&L->qkv, x, 0, qkv, pre ? PRO_RMSNORM : PRO_NONE, L->attn_norm, L->eps, M, threads);
    if (status == 0) {
        if (L->q_norm) qk_norm(L, qkv, M);
        qd_rope_attention(qkv, cos, sin, positions, rows, pages, visible, a, B, T, L->n_q, L->n_kv, L->head_dim, kv_len,
                          L->scale, L->softcap, L->sinks, q, threads);
        status = post ? linear(&L->wo, a, 0, y, PRO_NONE, 0, 0.0f, M, threads)
                      : linear(&L->wo, a, x, x, PRO_NONE, 0, 0.0f, M, threads);  /* residual in place */
        if (status == 0 && post) add_normed(x, y, L->attn_post_norm, L->eps, M, D);
    }
    for (int64_t r0 = 0; mlp && status == 0 && r0 < M; r0 += R) {
        const int64_t n = M - r0 < R ? M - r0 : R;
        float *xr = x + r0 * D, *yr = post ? y + r0 * D : 0;
        status = linear(&L->gate_up, xr, 0, h, pre ? PRO_RMSNORM : PRO_NONE, L->mlp_norm, L->eps, n, threads);
        if (status == 0)
            status = post ? linear(&L->down, h, 0, yr, (int)L->glu, 0, 0.0f, n, threads)
                          : linear(&L->down, h, xr, xr, (int)L->glu, 0, 0.0f, n, threads);
        if (status == 0 && post) add_normed(xr, yr, L->mlp_post_norm, L->eps, n, D);
    }
    free(qkv); free(q); free(a); free(h); free(y);
    return status;
}
