/* Shared between the float-weight kernel (fused_matmul.c) and the quantized one (quant_matmul.c):
 * the prologues that run before a matmul, computed identically for both. */
#ifndef QD_KERNELS_H
#define QD_KERNELS_H
#include <stdint.h>

/* The gated ones read x = [gate | up] and give act(gate) * up: SiLU, GELU (tanh form), GELU (erf);
 * or gpt-oss's clamped SwiGLU, (clamp(up, -7, 7) + 1) * g sigmoid(1.702 g) with g = min(gate, 7). */
enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SWIGLU = 2, PRO_GEGLU_TANH = 3, PRO_GEGLU_ERF = 4, PRO_SWIGLU_OAI = 5 };
#define QD_GATED(prologue) ((prologue) >= PRO_SWIGLU)

/* h[m] = x[m] / sqrt(mean(x[m]^2) + eps) * g */
void qd_rmsnorm_rows(const float *x, const float *g, float eps, float *h, int64_t M, int64_t K);
/* h[m, k] = silu(x[m, k]) * x[m, K + k]: x holds gate | up side by side. */
void qd_swiglu_rows(const float *x, float *h, int64_t M, int64_t K);
/* the same with gelu(x[m, k]): its tanh form (exact = 0) or erf's (exact = 1) */
void qd_geglu_rows(const float *x, float *h, int64_t M, int64_t K, int exact);
/* x itself, or the prologue's output written into scratch. */
const float *qd_prologue(const float *x, int prologue, const float *g, float eps, float *scratch,
                         int64_t M, int64_t K);

/* The most indices qd_topk_rows (argmax.c) keeps per row. */
#define QD_TOPK_MAX 32

/* A layer's K/V cache as the attention kernel reads it: cache row r's slot j of kv head g lies at
 * k + tables[r * width + (j >> shift)] * block_stride + g * head_stride + (j & (2^shift - 1)) * D
 * (and the same in v): rows are tables of blocks of 2^shift slots in one pool. shift = -1: one block
 * per row (width 1) of any length, slot j at j * D in it. */
typedef struct {
    float *k, *v;
    const int32_t *tables;  /* [rows, width] block ids in slot order */
    int64_t width, shift, block_stride, head_stride;
} QDPages;

/* fn(ctx, t) for t in [0, tasks) on up to `threads` threads, the caller among them (pool.c). */
void qd_parallel(void (*fn)(void *ctx, int64_t task), void *ctx, int64_t tasks, int threads);

#endif
