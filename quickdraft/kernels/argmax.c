/* The index of each row's largest value, as torch.argmax gives it (the first of equal maxima; the
 * first NaN if a row has one). Greedy verification asks it of [k+1, V] logits every step, where
 * torch's reduction took 5-20 ms for 5 rows of Qwen's 151,936 (its threads waking for each call,
 * after the kernels' pool had the cores); here a row is two passes over data in L2, ~0.1 ms. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"

typedef struct { const float *x; int64_t n; int64_t *out; } Rows;

static int64_t argmax_row(const float *x, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        best = _mm256_max_ps(best, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best);
    float top = lanes[0];
    for (int l = 1; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t t = k; t < n; t++) {
        any_nan |= isnan(x[t]);
        top = x[t] > top ? x[t] : top;
    }
    /* second pass: the first index holding the maximum (or a NaN) */
    const __m256 want = _mm256_set1_ps(top);
    for (k = 0; k + 8 <= n; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        const int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
        if (hit) return k + __builtin_ctz((unsigned)hit);
    }
    for (; k < n; k++)
        if (any_nan ? isnan(x[k]) : x[k] == top) return k;
    return 0;  /* n == 0, or a row of -inf only: index 0, as torch */
}

static void rows_task(void *ctx, int64_t i) {
    const Rows *r = ctx;
    r->out[i] = argmax_row(r->x + i * r->n, r->n);
}

/* x [rows, n] float32 -> out [rows]. */
void qd_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int threads) {
    Rows r = {x, n, out};
    qd_parallel(rows_task, &r, rows, rows >= 4 ? threads : 1);
}

/* The k largest values' indices of each row, largest first, the lower index first among equals;
 * NaNs are never taken (a row with fewer than k other values ends in -1s). Token recycling asks it
 * of [k+1, V] logits every step, where torch.topk took ~0.3 ms for 9 rows of SmolLM2's 49,152: one
 * pass here compares 8 values at a time against the k-th best so far and inserts the few above it. */
static void topk_row(const float *x, int64_t n, int k, int64_t *out) {
    float best[QD_TOPK_MAX];
    int filled = 0;
    for (int j = 0; j < k; j++) { best[j] = -INFINITY; out[j] = -1; }
    int64_t t = 0;
    for (; t < n && filled < k; t++) {  /* the first k values that are not NaN, sorted */
        if (isnan(x[t])) continue;
        int j = filled++;
        for (; j > 0 && best[j - 1] < x[t]; j--) { best[j] = best[j - 1]; out[j] = out[j - 1]; }
        best[j] = x[t]; out[j] = t;
    }
    for (; t < n; t++) {
        if (t % 8 == 0 && t + 8 <= n) {  /* skip 8 at a time while none beats the k-th best */
            const __m256 v = _mm256_loadu_ps(x + t);
            if (!_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(best[k - 1]), _CMP_GT_OQ))) { t += 7; continue; }
        }
        if (!(x[t] > best[k - 1])) continue;  /* false for NaN */
        int j = k - 1;
        for (; j > 0 && best[j - 1] < x[t]; j--) { best[j] = best[j - 1]; out[j] = out[j - 1]; }
        best[j] = x[t]; out[j] = t;
    }
}

typedef struct { const float *x; int64_t n; int k; int64_t *out; } TopRows;

static void topk_task(void *ctx, int64_t i) {
    const TopRows *r = ctx;
    topk_row(r->x + i * r->n, r->n, r->k, r->out + i * r->k);
}

/* x [rows, n] float32 -> out [rows, k], 1 <= k <= QD_TOPK_MAX. */
void qd_topk_rows(const float *x, int64_t rows, int64_t n, int k, int64_t *out, int threads) {
    TopRows r = {x, n, k, out};
    qd_parallel(topk_task, &r, rows, rows >= 4 ? threads : 1);
}
