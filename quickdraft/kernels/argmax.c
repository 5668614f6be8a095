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
