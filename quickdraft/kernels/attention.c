/* Attention of each query over the cached keys it may see, computed the same way whatever else
 * is in the batch: one query at a time, dot products in 8 fixed lanes over the head dimension,
 * the softmax and the weighted sum of values in key order. So a token's attention output (and
 * everything after it) is bitwise the same in a decode step, a verification pass of k+1 tokens,
 * a prefill, or a batch of other requests: what exactness needs once activations are quantized
 * to int8, where a difference of one float ulp upstream can move a value to the next step.
 */
#include <immintrin.h>
#include <math.h>
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

/* One query's attention: scores s over the visible keys, softmax, weighted sum of values into o. */
static void attend(const float *qv, const float *kb, const float *vb, const uint8_t *vis, float *o, float *s,
                   int64_t D, int64_t kv_len, float scale) {
    float m = -INFINITY;
    for (int64_t j = 0; j < kv_len; j++) {
        if (vis && !vis[j]) { s[j] = -INFINITY; continue; }
        s[j] = dot(qv, kb + j * D, D) * scale;
        m = s[j] > m ? s[j] : m;
    }
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

typedef struct {
    const float *q, *k, *v;
    const uint8_t *visible;
    float *out;
    int64_t T, Hq, Hkv, D, kv_len, kv_batch, kv_head;
    float scale;
} AttentionJob;

static void attention_task(void *ctx, int64_t task) {
    const AttentionJob *j = ctx;
    float scores[j->kv_len];  /* on the stack: at most 128 KB for a 32k context (threads have MBs) */
    const int64_t b = task / (j->T * j->Hq), t = task / j->Hq % j->T, h = task % j->Hq, g = h / (j->Hq / j->Hkv);
    attend(j->q + task * j->D, j->k + b * j->kv_batch + g * j->kv_head, j->v + b * j->kv_batch + g * j->kv_head,
           j->visible ? j->visible + (b * j->T + t) * j->kv_len : 0, j->out + task * j->D, scores, j->D, j->kv_len,
           j->scale);
}

/* q: [B, T, Hq, D]; k, v: rows of D floats, key j of kv head g of batch row b at
 * b * kv_batch + g * kv_head + j * D; visible: [B, T, kv_len] (1 = may attend) or NULL (every key
 * < kv_len); out: [B, T, Hq, D]. */
static void attention(const float *q, const float *k, const float *v, const uint8_t *visible, float *out,
                      int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_len,
                      int64_t kv_batch, int64_t kv_head, float scale, int threads) {
    AttentionJob job = {q, k, v, visible, out, T, Hq, Hkv, D, kv_len, kv_batch, kv_head, scale};
    qd_parallel(attention_task, &job, B * T * Hq, threads);
}

/* The attention half of a layer after its q|k|v matmul, in one call: rotary embedding of q and k
 * (Hugging Face's rotate-half form; cos/sin [B, T, D] hold each half twice), k and v written to the
 * cache at their positions, then every query attends as qd_attention does. qkv: [B, T, (Hq + 2Hkv)
 * * D]; positions: [B, T]; k, v: the layer's cache buffers (strides as in qd_attention, slot p of a
 * head at p * D); scratch: B * T * Hq * D floats (the rotated queries). */
void qd_rope_attention(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                       float *k, float *v, const uint8_t *visible, float *out, int64_t B, int64_t T,
                       int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_len, int64_t kv_batch, int64_t kv_head,
                       float scale, float *scratch, int threads) {
    const int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
    float *q = scratch;
    for (int64_t bt = 0; bt < B * T; bt++) {
        const int64_t b = bt / T, pos = positions[bt];
        const float *row = qkv + bt * width, *c = cos + bt * D, *sn = sin + bt * D;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            const float *x = row + h * D;
            float *dst = h < Hq ? q + (bt * Hq + h) * D : k + b * kv_batch + (h - Hq) * kv_head + pos * D;
            for (int64_t i = 0; i < half; i++) {
                dst[i] = x[i] * c[i] - x[i + half] * sn[i];
                dst[i + half] = x[i + half] * c[i + half] + x[i] * sn[i + half];
            }
        }
        for (int64_t h = 0; h < Hkv; h++) {
            const float *x = row + (Hq + Hkv + h) * D;
            float *dst = v + b * kv_batch + h * kv_head + pos * D;
            for (int64_t d = 0; d < D; d++) dst[d] = x[d];
        }
    }
    attention(q, k, v, visible, out, B, T, Hq, Hkv, D, kv_len, kv_batch, kv_head, scale, threads);
}
