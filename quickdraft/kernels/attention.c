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

/* One kv head's slots of one cache row (K or V), read through the row's table of blocks: what a
 * key's address changes to; every sum below is taken by the key's logical slot j, so the bits do not
 * depend on where its block lies (batch invariance, whatever rows shared the pool before). */
typedef struct {
    const float *base;    /* the head's start in block 0 of the pool (shift < 0: in the row's block) */
    const int32_t *table; /* the row's block ids */
    int64_t shift, stride, D;
} Slots;

INLINE const float *slot(const Slots *s, int64_t j) {
    return s->shift < 0 ? s->base + j * s->D
                        : s->base + s->table[j >> s->shift] * s->stride + (j & (((int64_t)1 << s->shift) - 1)) * s->D;
}

INLINE Slots row_slots(const QDPages *pg, const float *pool, int64_t row, int64_t head, int64_t D) {
    const int32_t *table = pg->tables + row * pg->width;
    const float *base = pool + head * pg->head_stride + (pg->shift < 0 ? table[0] * pg->block_stride : 0);
    return (Slots){base, table, pg->shift, pg->block_stride, D};
}

/* row_slots for reading slots 0..n-1: where the row's blocks holding them are consecutive ids of a
 * pool whose consecutive blocks of a head are adjacent (the pool hands a row its ids in order), the
 * row is read as one contiguous stretch, with no table lookup per group of keys and no break at each
 * block in the weighted sums: ~4% of a 3,000-token prefill's attention. Same slots, same addresses. */
INLINE Slots span_slots(const QDPages *pg, const float *pool, int64_t row, int64_t head, int64_t D, int64_t n) {
    Slots s = row_slots(pg, pool, row, head, D);
    if (s.shift < 0 || pg->block_stride != ((int64_t)1 << s.shift) * D) return s;
    const int64_t blocks = (n + ((int64_t)1 << s.shift) - 1) >> s.shift;
    for (int64_t i = 1; i < blocks; i++)
        if (s.table[i] != s.table[0] + i) return s;
    return (Slots){s.base + s.table[0] * s.stride, s.table, -1, s.stride, D};
}

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

/* The dot products of q with the 8 keys from `group` on (those past the first `valid` are the
 * row's last key, `last`: their values are not used), reduced in one fixed order for every key, whichever block of 8 it falls
 * in: 8 FMA lanes over the head dimension, then pairs of lanes (hadd), then the two halves. A key's
 * score is then the same whatever kv_len is (a decode step and a verification pass see different
 * kv_len), and a block costs 9 reduction ops instead of 8 x 5. D a multiple of 8. */
INLINE __m256 dot8(const float *qv, const float *group, const float *last, int64_t D, int64_t valid) {
    const float *key[8];
    __m256 acc[8];
    for (int i = 0; i < 8; i++) {
        key[i] = i < valid ? group + i * D : last;
        acc[i] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 q = _mm256_loadu_ps(qv + d);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(q, _mm256_loadu_ps(key[i] + d), acc[i]);
    }
    const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* keys 0-3 | 4-7, per half */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* exp(x) for x <= 0, 8 at a time (the softmax's exponent: expf one key at a time was ~15% of a
 * SmolLM2 verification pass): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by its
 * degree-6 Taylor polynomial (relative error ~2e-7 before rounding), times 2^n built in the
 * exponent bits; below -87 (e^x < 2^-126) it is 0. */
INLINE __m256 exp_neg(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
    return _mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

/* o[0..D) += sum_j p[j] v_j over keys j0..j1-1, in key order, with o in registers when the head is
 * 64 or 128 wide (a load and a store of o per key had waited on store forwarding). o is loaded
 * and stored exactly: summing a query's keys in spans, as attend_group does, gives the bits of one
 * pass over them all. */
INLINE void weighted_span(const float *p, const Slots *vb, float *o, int64_t D, int64_t j0, int64_t j1, const int W) {
    __m256 acc[16];
    for (int i = 0; i < W; i++) acc[i] = _mm256_loadu_ps(o + 8 * i);
    /* block by block (a block's slots are consecutive rows): a test per key for the next block cost
     * prefill's attention a few percent over one contiguous row */
    for (int64_t b0 = j0; b0 < j1;) {
        int64_t b1 = vb->shift < 0 ? j1 : ((b0 >> vb->shift) + 1) << vb->shift;
        b1 = b1 < j1 ? b1 : j1;
        const float *vj = slot(vb, b0);
        for (int64_t j = b0; j < b1; j++, vj += D) {
            if (p[j] == 0.0f) continue;
            const __m256 pv = _mm256_set1_ps(p[j]);
            for (int i = 0; i < W; i++) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 8 * i), acc[i]);
        }
        b0 = b1;
    }
    for (int i = 0; i < W; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

/* s[0..kv_len) (scores, -inf for hidden keys) becomes p = exp(s - m); returns their sum, taken in 8
 * lanes in key order (with a mask: in the order of the visible keys, below). */
static float softmax_in_place(float *s, const uint8_t *vis, int64_t kv_len, float m) {
    __m256 lanes = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= kv_len; j += 8) {
        const __m256 p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + j, p);
        if (!vis) lanes = _mm256_add_ps(lanes, p);
    }
    if (j < kv_len) {
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = j + i < kv_len ? s[j + i] : -INFINITY;
        const __m256 p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(tail), _mm256_set1_ps(m)));
        _mm256_storeu_ps(tail, p);
        for (int i = 0; j + i < kv_len; i++) s[j + i] = tail[i];
        if (!vis) lanes = _mm256_add_ps(lanes, p);
    }
    if (vis) {
        /* A tree's query sees its ancestors among masked siblings: its visible keys have gaps, and
         * summing by key index would put them in other lanes than a decode step of the same path
         * does (there they are contiguous), so the sum would round differently. The n-th visible
         * key goes to lane n % 8, as in that decode step (a hidden key's p is 0 and adds nothing). */
        float packed[8];
        int n = 0;
        for (int64_t k = 0; k < kv_len; k++) {
            if (!vis[k]) continue;
            packed[n++] = s[k];
            if (n == 8) {
                lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(packed));
                n = 0;
            }
        }
        if (n) {
            for (int i = n; i < 8; i++) packed[i] = 0.0f;
            lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(packed));
        }
    }
    return hsum8(lanes);
}

/* A score soft-capped (Gemma 2): c tanh(x / c), as transformers' eager attention; c <= 0: x. */
INLINE float soft_cap(float x, float c) { return c > 0.0f ? c * tanhf(x / c) : x; }

#define KEY_SPAN 32  /* keys whose K or V rows (8-16 KB) one query uses before the next query of its group */

/* The attention of n queries that share a kv head and a view of the keys (the query heads of one
 * GQA group at one token: q at qv + i * D, output at o + i * D), each computed exactly as one
 * query alone: its scores, softmax and weighted sum take the same operations in the same order.
 * Only the loops are interleaved: a span of keys is read from memory once and used by every query
 * of the group from L1, where each query had read every key again (Hq / Hkv times the K/V traffic).
 * Blocks of 8 keys before the first visible one (a sliding window's past) and after the last (the
 * rest of a prefill chunk) are not scored: their p is 0 either way, and a key's score does not
 * depend on its block, so the bits are the same. s: n * kv_len floats of scratch. */
static void attend_group(const float *qv, const Slots *kb, const Slots *vb, const uint8_t *vis, float *o, float *s,
                         int n, int64_t D, int64_t kv_len, float scale, float softcap, const float *sink) {
    int64_t first = 0, last = kv_len;
    if (vis) {
        while (first < kv_len && !vis[first]) first++;
        while (last > first && !vis[last - 1]) last--;
    }
    const int64_t start = first & ~(int64_t)7;
    float m[n];
    for (int i = 0; i < n; i++) {
        m[i] = -INFINITY;
        for (int64_t j = 0; j < kv_len; j++) s[i * kv_len + j] = -INFINITY;
    }
    /* key addresses once per 8 keys, not per query of the group (a block table lookup each) */
    const float *last_key = slot(kb, kv_len - 1);
    for (int64_t j0 = start; j0 < last; j0 += 8) {
        const float *group = slot(kb, j0);  /* keys j0..j0+7 lie in one block (a block is a multiple of 8 keys) */
        for (int i = 0; i < n; i++) {
            float block[8], *si = s + i * kv_len;
            const float *q = qv + i * D;
            if (D % 8 == 0) _mm256_storeu_ps(block, dot8(q, group, last_key, D, kv_len - j0));
            else for (int r = 0; r < 8 && j0 + r < kv_len; r++) block[r] = dot(q, slot(kb, j0 + r), D);
            for (int64_t j = j0; j < j0 + 8 && j < kv_len; j++) {
                si[j] = vis && !vis[j] ? -INFINITY : soft_cap(block[j - j0] * scale, softcap);
                m[i] = si[j] > m[i] ? si[j] : m[i];
            }
        }
    }
    float sum[n];
    for (int i = 0; i < n; i++) {
        /* a sink (gpt-oss: a learned logit per query head) joins the softmax's denominator only: the
         * max over the scores and it, its exponent added after the keys' (a fixed place in the sum) */
        if (sink) m[i] = sink[i] > m[i] ? sink[i] : m[i];
        sum[i] = softmax_in_place(s + i * kv_len, vis, kv_len, m[i]);
        if (sink) sum[i] += expf(sink[i] - m[i]);
    }
    for (int i = 0; i < n * D; i++) o[i] = 0.0f;
    if (D == 64 || D == 128) {
        for (int64_t j0 = start; j0 < last; j0 += KEY_SPAN) {
            const int64_t j1 = j0 + KEY_SPAN < last ? j0 + KEY_SPAN : last;
            for (int i = 0; i < n; i++) {  /* W a constant: o's 8 or 16 vectors stay in registers */
                if (D == 64) weighted_span(s + i * kv_len, vb, o + i * D, D, j0, j1, 8);
                else weighted_span(s + i * kv_len, vb, o + i * D, D, j0, j1, 16);
            }
        }
    } else {
        for (int i = 0; i < n; i++)
            for (int64_t k = 0; k < kv_len; k++)
                for (int64_t d = 0; d < D; d++) o[i * D + d] += s[i * kv_len + k] * slot(vb, k)[d];
    }
    for (int i = 0; i < n; i++) {
        const float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
        for (int64_t d = 0; d < D; d++) o[i * D + d] *= inv;
    }
}

typedef struct {
    const float *q;
    const QDPages *pages;
    const int64_t *rows;  /* each token's cache row, or NULL: token bt's is bt / T */
    const int64_t *slots; /* each token's cache slot: without `visible`, it sees keys 0..slot */
    const uint8_t *visible;
    float *out;
    int64_t T, Hq, Hkv, D, kv_len;
    int64_t parts;  /* each GQA group's query heads split into this many tasks (parallelism for decode) */
    float scale, softcap;
    const float *sinks;  /* [Hq] each query head's sink logit, or NULL */
} AttentionJob;

static void attention_task(void *ctx, int64_t task) {
    const AttentionJob *j = ctx;
    const int64_t group = j->Hq / j->Hkv, part = task % j->parts, bt = task / j->parts / j->Hkv;
    const int64_t g = task / j->parts % j->Hkv, b = j->rows ? j->rows[bt] : bt / j->T;
    const int64_t h0 = g * group + part * group / j->parts, h1 = g * group + (part + 1) * group / j->parts;
    if (h1 == h0) return;
    /* causal (no mask): the keys up to the query's own slot, a kv_len of its own; the same bits as a
     * mask that shows exactly those (a key's score and its lane in the sums do not depend on kv_len) */
    const int64_t kv_len = j->visible ? j->kv_len : j->slots[bt] + 1;
    float *scores = malloc((size_t)((h1 - h0) * kv_len) * sizeof(float));
    if (!scores) abort();  /* a few MB at most: a 32k context and a group of 8 heads */
    const Slots keys = span_slots(j->pages, j->pages->k, b, g, j->D, kv_len),
                values = span_slots(j->pages, j->pages->v, b, g, j->D, kv_len);
    attend_group(j->q + (bt * j->Hq + h0) * j->D, &keys, &values, j->visible ? j->visible + bt * j->kv_len : 0,
                 j->out + (bt * j->Hq + h0) * j->D, scores, (int)(h1 - h0), j->D, kv_len, j->scale, j->softcap,
                 j->sinks ? j->sinks + h0 : 0);
    free(scores);
}

/* q: [B, T, Hq, D]; pages: the layer's K/V, key j of kv head g of cache row b as QDPages says,
 * where b is the token's batch row, or rows[token] (a ragged pass: tokens of several cache rows fed
 * as one sequence); visible: [B, T, kv_len] (1 = may
 * attend) or NULL (causal: a token sees the keys at slots 0..slots[token] of its row); out:
 * [B, T, Hq, D]. One task per (token, kv head), its group's query heads split in
 * parts only where there would be fewer than two tasks a thread (a decode step of few kv heads). */
static void attention(const float *q, const QDPages *pages, const int64_t *rows, const int64_t *slots,
                      const uint8_t *visible, float *out, int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                      int64_t kv_len, float scale, float softcap, const float *sinks, int threads) {
    const int64_t groups = B * T * Hkv, group = Hq / Hkv;
    int64_t parts = 1;
    while (groups * parts < 2 * (int64_t)threads && parts < group) parts++;
    AttentionJob job = {q, pages, rows, slots, visible, out, T, Hq, Hkv, D, kv_len, parts, scale, softcap, sinks};
    qd_parallel(attention_task, &job, groups * parts, threads);
}

/* The attention half of a layer after its q|k|v matmul, in one call: rotary embedding of q and k
 * (Hugging Face's rotate-half form; cos/sin [B, T, D] hold each half twice), k and v written to the
 * cache at their positions, then every query attends as qd_attention does. qkv: [B, T, (Hq + 2Hkv)
 * * D]; positions: [B, T]; rows: [B * T] each token's cache row, or NULL (its batch row); pages: the
 * layer's cache (QDPages); scratch: B * T * Hq * D floats (the rotated queries); softcap: scores capped at
 * softcap tanh(score / softcap) before the softmax (0: none); sinks: [Hq] a logit per query head that
 * joins each softmax's denominator and nothing else (gpt-oss), or NULL. */
void qd_rope_attention(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                       const int64_t *rows, const QDPages *pages, const uint8_t *visible, float *out, int64_t B,
                       int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_len, float scale, float softcap,
                       const float *sinks, float *scratch, int threads) {
    const int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
    float *q = scratch;
    for (int64_t bt = 0; bt < B * T; bt++) {
        const int64_t b = rows ? rows[bt] : bt / T, pos = positions[bt];
        const float *row = qkv + bt * width, *c = cos + bt * D, *sn = sin + bt * D;
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            const float *x = row + h * D;
            const Slots keys = row_slots(pages, pages->k, b, h < Hq ? 0 : h - Hq, D);
            float *dst = h < Hq ? q + (bt * Hq + h) * D : (float *)slot(&keys, pos);
            for (int64_t i = 0; i < half; i++) {
                dst[i] = x[i] * c[i] - x[i + half] * sn[i];
                dst[i + half] = x[i + half] * c[i + half] + x[i] * sn[i + half];
            }
        }
        for (int64_t h = 0; h < Hkv; h++) {
            const float *x = row + (Hq + Hkv + h) * D;
            const Slots values = row_slots(pages, pages->v, b, h, D);
            float *dst = (float *)slot(&values, pos);
            for (int64_t d = 0; d < D; d++) dst[d] = x[d];
        }
    }
    attention(q, pages, rows, positions, visible, out, B, T, Hq, Hkv, D, kv_len, scale, softcap, sinks, threads);
}
