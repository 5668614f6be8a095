/* A mixture of experts in a layer's MLP place, over GGUF blocks (model/experts.py says the math):
 * every expert the pass chose runs its gate|up matmul (the sublayer's RMSNorm as its prologue) and
 * its down matmul (the gate's activation as its prologue) over the rows that chose it, in ascending
 * expert index, and each row adds its experts' weighted outputs in that order. A row's result does
 * not depend on the other rows of the pass (quant_matmul.c computes each row alone). One call a
 * layer: the torch loop it replaces made ~8 small torch calls an expert (a decode step of
 * Qwen3-30B-A3B's shape runs 8 experts in each of 48 layers). */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

int qd_quant_matmul(const float *x, int nparts, const int *types, const int64_t *rows, const void *const *data,
                    int act8, const float *b, const float *r, float *y, int prologue, const float *g, float eps,
                    float *scratch, int64_t M, int64_t N, int64_t K, int threads);

/* One matrix of each expert: expert e's parts are first[e] .. first[e + 1] - 1 of types, rows, data
 * (a fused gate|up may be stored in two types); bias[e] its bias (gpt-oss), or bias NULL: none. */
typedef struct {
    const int *first, *types;
    const int64_t *rows;
    const void *const *data;
    const float *const *bias;
} QDExpertMatrix;

static int expert_matmul(const QDExpertMatrix *w, int64_t e, const float *x, float *y, int prologue,
                         const float *g, float eps, int act8, int64_t M, int64_t N, int64_t K, int threads) {
    const int at = w->first[e], nparts = w->first[e + 1] - at;
    return qd_quant_matmul(x, nparts, w->types + at, w->rows + at, w->data + at, act8, w->bias ? w->bias[e] : 0, 0, y,
                           prologue, g, eps, 0, M, N, K, threads);
}

/* o += v * w, the product rounded before the sum as torch's y * w then index_put_ (model/experts.py):
 * a contracted fused multiply-add would round once, and the two paths would differ in the last bit. */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#else
__attribute__((optimize("fp-contract=off")))
#endif
static void add_weighted(float *o, const float *v, float w, int64_t K) {
    for (int64_t d = 0; d < K; d++) o[d] += v[d] * w;
}

/* x: [M, K]; g: the RMSNorm gain fused before each gate|up matmul (NULL: none); chosen, weights:
 * [M, k] each row's experts and their weights; gate_up [2F, K] and down [K, F] of each of E
 * experts; glu: the down matmul's gated prologue (PRO_SWIGLU ...); out: [M, K], written.
 * Returns 0, -1 when memory ran out, -2 for an expert index outside 0..E-1. */
int qd_experts(const float *x, const float *g, float eps, int64_t M, int64_t K, int64_t F, int64_t k,
               const int64_t *chosen, const float *weights, int64_t E, const QDExpertMatrix *gate_up,
               const QDExpertMatrix *down, int act8, int glu, float *out, int threads) {
    if (M == 0 || k == 0) {  /* nothing to run (malloc(0) may be NULL: not a lack of memory) */
        memset(out, 0, sizeof(float) * (size_t)(M * K));
        return 0;
    }
    for (int64_t i = 0; i < M * k; i++)
        if (chosen[i] < 0 || chosen[i] >= E) return -2;
    /* a counting sort of the (row, slot) pairs by expert, rows ascending within each expert */
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * (size_t)(M * k));
    int64_t most = 0;  /* an expert's rows: M from a router (distinct experts a row), up to M k from a caller */
    if (start && order) {
        for (int64_t i = 0; i < M * k; i++) start[chosen[i] + 1]++;
        for (int64_t e = 1; e <= E; e++) most = start[e] > most ? start[e] : most;
    }
    float *xe = malloc(sizeof(float) * (size_t)(most * K)), *h = malloc(sizeof(float) * (size_t)(most * 2 * F));
    float *y = malloc(sizeof(float) * (size_t)(most * K));
    int status = (!start || !order || !xe || !h || !y) ? -1 : 0;
    if (status == 0) {
        for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
        for (int64_t i = 0; i < M * k; i++) order[start[chosen[i]]++] = i;
        for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];  /* back to each expert's first */
        start[0] = 0;
        memset(out, 0, sizeof(float) * (size_t)(M * K));
    }
    for (int64_t e = 0; e < E && status == 0; e++) {
        const int64_t s = start[e], n = start[e + 1] - s;
        if (!n) continue;
        for (int64_t j = 0; j < n; j++) memcpy(xe + j * K, x + order[s + j] / k * K, sizeof(float) * (size_t)K);
        status = expert_matmul(gate_up, e, xe, h, g ? PRO_RMSNORM : PRO_NONE, g, eps, act8, n, 2 * F, K, threads);
        if (status == 0) status = expert_matmul(down, e, h, y, glu, 0, 0.0f, act8, n, K, F, threads);
        for (int64_t j = 0; j < n && status == 0; j++) {
            const int64_t i = order[s + j];
            add_weighted(out + i / k * K, y + j * K, weights[i], K);
        }
    }
    free(start); free(order); free(xe); free(h); free(y);
    return status;
}
