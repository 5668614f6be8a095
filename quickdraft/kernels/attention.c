/* Attention of each query over the cached keys it may see, computed the same way whatever else
 * is in the batch: one query at a time, dot products in 8 fixed lanes over the head dimension,
 * the softmax and the weighted sum of values in key order. So a token's attention output (and
 * everything after it) is bitwise the same in a decode step, a verification pass of k+1 tokens,
 * a prefill, or a batch of other requests: what exactness needs once activations are quantized
 * to int8, where a difference of one float ulp upstream can move a value to the next step.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    float s = hsum8(acc);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* q: [B, T, Hq, D]; k, v: rows of D floats, key j of kv head g of batch row b at
 * b * kv_batch + g * kv_head + j * D; visible: [B, T, kv_len] (1 = may attend) or NULL (every key
 * < kv_len); out: [B, T, Hq, D]. scratch: threads * kv_len floats. */
void qd_attention(const float *q, const float *k, const float *v, const uint8_t *visible, float *out,
                  int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_len,
                  int64_t kv_batch, int64_t kv_head, float scale, float *scratch, int threads) {
    const int64_t group = Hq / Hkv;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < B * T * Hq; task++) {
        const int64_t b = task / (T * Hq), t = task / Hq % T, h = task % Hq;
        float *s = scratch + (int64_t)omp_get_thread_num() * kv_len;
        const float *qv = q + task * D;
        const float *kb = k + b * kv_batch + (h / group) * kv_head, *vb = v + b * kv_batch + (h / group) * kv_head;
        const uint8_t *vis = visible ? visible + (b * T + t) * kv_len : 0;
        float m = -INFINITY;
        for (int64_t j = 0; j < kv_len; j++) {
            if (vis && !vis[j]) { s[j] = -INFINITY; continue; }
            s[j] = dot(qv, kb + j * D, D) * scale;
            m = s[j] > m ? s[j] : m;
        }
        float *o = out + task * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        float sum = 0.0f;
        for (int64_t j = 0; j < kv_len; j++) {
            if (s[j] == -INFINITY) continue;
            const float p = expf(s[j] - m);
            sum += p;
            const __m256 pv = _mm256_set1_ps(p);
            const float *vj = vb + j * D;
            int64_t d = 0;
            for (; d + 8 <= D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + d), _mm256_loadu_ps(o + d)));
            for (; d < D; d++) o[d] += p * vj[d];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}
