/* y[m, n] = r[m, n] + b[n] + sum_k h[m, k] * w[n, k] for few rows m: the decode and verification
 * matmuls, with the step before them fused in (h = x, RMSNorm(x) * g, or silu(gate) * up).
 *
 * Memory-bound: each weight row is read once and used for every x row, so verifying k+1 tokens
 * costs about what decoding one does. Every output is reduced in the same order whatever M is
 * (8 lanes over k, then a fixed lane sum), so results are bitwise independent of the batch shape.
 * Weights are float32, bfloat16 or float16; x, b and y are float32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2 };
#define M_BLOCK 6
/* How far ahead in the weights to prefetch: the hardware prefetcher alone left the FMAs of a
 * several-row pass waiting on memory (t(9)/t(1) 1.81 -> 1.45 in float32 with it, 2048 measured
 * best of 1024/2048/4096 on the project's EPYC). */
#define PREFETCH_BYTES 2048
#define INLINE static inline __attribute__((always_inline))

INLINE __m256 load_w(const void *w, int64_t i, int wtype) {
    if (wtype == W_F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (wtype == W_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

INLINE float w_scalar(const void *w, int64_t i, int wtype) {
    if (wtype == W_F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    if (wtype == W_BF16) { uint32_t u = (uint32_t)h << 16; float f; __builtin_memcpy(&f, &u, 4); return f; }
    return _cvtsh_ss(h);
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One weight row against up to M_BLOCK x rows. Called with constant mb and wtype so the compiler
 * keeps the accumulators in registers. Two accumulators per row (even and odd 8-lane blocks) hide
 * the FMA latency; their order is fixed, so every output is reduced the same way for every M. */
INLINE void row_block(const float *x, const void *w, const float *b, const float *r, float *y,
                      int64_t n, int64_t N, int64_t K, const int wtype, const int mb) {
    const int64_t row = n * K, wbytes = wtype == W_F32 ? 4 : 2;
    __m256 a0[M_BLOCK], a1[M_BLOCK];
    for (int j = 0; j < mb; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        _mm_prefetch((const char *)w + (row + k) * wbytes + PREFETCH_BYTES, _MM_HINT_T0);
        const __m256 w0 = load_w(w, row + k, wtype), w1 = load_w(w, row + k + 8, wtype);
        for (int j = 0; j < mb; j++) {
            a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j * K + k), w0, a0[j]);
            a1[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j * K + k + 8), w1, a1[j]);
        }
    }
    if (k + 8 <= K) {
        const __m256 w0 = load_w(w, row + k, wtype);
        for (int j = 0; j < mb; j++) a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j * K + k), w0, a0[j]);
        k += 8;
    }
    for (int j = 0; j < mb; j++) {
        float s = hsum(_mm256_add_ps(a0[j], a1[j]));
        for (int64_t t = k; t < K; t++) s += x[j * K + t] * w_scalar(w, row + t, wtype);
        if (b) s += b[n];
        y[j * N + n] = r ? r[j * N + n] + s : s;
    }
}

#define TASK_BYTES (512 << 10)  /* a thread's run through the weights, at least (quant_matmul.c) */
typedef struct { const float *x; const void *w; const float *b, *r; float *y; int64_t M, N, K, task_rows; int wtype; } MatmulJob;

INLINE void matmul_rows(const MatmulJob *j, int64_t n0, int64_t n1, const int wtype) {
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t m0 = 0; m0 < j->M; m0 += M_BLOCK) {
            const float *xm = j->x + m0 * j->K, *rm = j->r ? j->r + m0 * j->N : 0;
            float *ym = j->y + m0 * j->N;
            const int64_t N = j->N, K = j->K;
            switch (j->M - m0 < M_BLOCK ? j->M - m0 : M_BLOCK) {
                case 1: row_block(xm, j->w, j->b, rm, ym, n, N, K, wtype, 1); break;
                case 2: row_block(xm, j->w, j->b, rm, ym, n, N, K, wtype, 2); break;
                case 3: row_block(xm, j->w, j->b, rm, ym, n, N, K, wtype, 3); break;
                case 4: row_block(xm, j->w, j->b, rm, ym, n, N, K, wtype, 4); break;
                case 5: row_block(xm, j->w, j->b, rm, ym, n, N, K, wtype, 5); break;
                default: row_block(xm, j->w, j->b, rm, ym, n, N, K, wtype, 6); break;
            }
        }
    }
}

static void matmul_task(void *ctx, int64_t task) {
    const MatmulJob *j = ctx;
    const int64_t n0 = task * j->task_rows, n1 = n0 + j->task_rows < j->N ? n0 + j->task_rows : j->N;
    switch (j->wtype) {
        case W_F32: matmul_rows(j, n0, n1, W_F32); break;
        case W_BF16: matmul_rows(j, n0, n1, W_BF16); break;
        default: matmul_rows(j, n0, n1, W_F16); break;
    }
}

/* h[m] = x[m] / sqrt(mean(x[m]^2) + eps) * g, summing squares in 8 lanes in a fixed order. */
void qd_rmsnorm_rows(const float *x, const float *g, float eps, float *h, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        __m256 acc = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) { __m256 v = _mm256_loadu_ps(xm + k); acc = _mm256_fmadd_ps(v, v, acc); }
        float ss = hsum(acc);
        for (; k < K; k++) ss += xm[k] * xm[k];
        const float inv = 1.0f / sqrtf(ss / (float)K + eps);
        for (k = 0; k < K; k++) h[m * K + k] = g[k] * (xm[k] * inv);
    }
}

/* e^x for 8 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial (the classic
 * Cephes coefficients, ~1 ulp), 2^n built in the exponent bits. Scalar expf per element made the
 * SwiGLU prologue cost as much as a fifth of a verification pass. */
INLINE __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                     _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* h[m, k] = silu(x[m, k]) * x[m, K + k]: x holds gate | up side by side. */
void qd_swiglu_rows(const float *x, float *h, int64_t M, int64_t K) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t m = 0; m < M; m++) {
        const float *gate = x + m * 2 * K, *up = gate + K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 g = _mm256_loadu_ps(gate + k);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(zero, g))));
            _mm256_storeu_ps(h + m * K + k, _mm256_mul_ps(silu, _mm256_loadu_ps(up + k)));
        }
        for (; k < K; k++) h[m * K + k] = gate[k] / (1.0f + expf(-gate[k])) * up[k];
    }
}

/* gelu(g) = g / (1 + e^(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3): 0.5 g (1 + tanh(u)) written with
 * the exponent SwiGLU uses (transformers' gelu_pytorch_tanh and gelu_new). The erf form
 * 0.5 g (1 + erf(g / sqrt 2)) (transformers' gelu) takes libm's erff, one value at a time. */
void qd_geglu_rows(const float *x, float *h, int64_t M, int64_t K, int exact) {
    const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(-2.0f * 0.7978845608028654f);
    const __m256 c3 = _mm256_set1_ps(0.044715f);
    for (int64_t m = 0; m < M; m++) {
        const float *gate = x + m * 2 * K, *up = gate + K;
        int64_t k = 0;
        if (exact) {
            for (; k < K; k++) h[m * K + k] = 0.5f * gate[k] * (1.0f + erff(gate[k] * 0.70710678118654752f)) * up[k];
            continue;
        }
        for (; k + 8 <= K; k += 8) {
            const __m256 g = _mm256_loadu_ps(gate + k);
            const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(c3, g), _mm256_mul_ps(g, g), g);  /* g + 0.044715 g^3 */
            const __m256 gelu = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_mul_ps(c, inner))));
            _mm256_storeu_ps(h + m * K + k, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + k)));
        }
        for (; k < K; k++) {
            const float inner = gate[k] + 0.044715f * gate[k] * gate[k] * gate[k];
            h[m * K + k] = gate[k] / (1.0f + expf(-2.0f * 0.7978845608028654f * inner)) * up[k];
        }
    }
}

/* gpt-oss's experts: g = min(gate, 7), u = clamp(up, -7, 7), h = (u + 1) g sigmoid(1.702 g), as
 * transformers' GptOssExperts (alpha and limit are every gpt-oss checkpoint's; others are refused). */
static void swiglu_oai_rows(const float *x, float *h, int64_t M, int64_t K) {
    const float alpha = 1.702f, limit = 7.0f;
    const __m256 one = _mm256_set1_ps(1.0f), lim = _mm256_set1_ps(limit), a = _mm256_set1_ps(-alpha);
    for (int64_t m = 0; m < M; m++) {
        const float *gate = x + m * 2 * K, *up = gate + K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 g = _mm256_min_ps(_mm256_loadu_ps(gate + k), lim);
            const __m256 u = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(up + k), lim), _mm256_set1_ps(-limit));
            const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_mul_ps(a, g))));
            _mm256_storeu_ps(h + m * K + k, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
        }
        for (; k < K; k++) {
            const float g = gate[k] < limit ? gate[k] : limit;
            const float u = up[k] < -limit ? -limit : up[k] > limit ? limit : up[k];
            h[m * K + k] = (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
        }
    }
}

const float *qd_prologue(const float *x, int prologue, const float *g, float eps, float *scratch,
                         int64_t M, int64_t K) {
    if (prologue == PRO_RMSNORM) { qd_rmsnorm_rows(x, g, eps, scratch, M, K); return scratch; }
    if (prologue == PRO_SWIGLU) { qd_swiglu_rows(x, scratch, M, K); return scratch; }
    if (prologue == PRO_SWIGLU_OAI) { swiglu_oai_rows(x, scratch, M, K); return scratch; }
    if (QD_GATED(prologue)) { qd_geglu_rows(x, scratch, M, K, prologue == PRO_GEGLU_ERF); return scratch; }
    return x;
}

/* x: [M, K] (or [M, 2K] for a gated prologue); scratch: [M, K] for the prologue's output. */
void qd_fused_matmul(const float *x, const void *w, const float *b, const float *r, float *y,
                     int prologue, const float *g, float eps, float *scratch,
                     int64_t M, int64_t N, int64_t K, int wtype, int threads) {
    x = qd_prologue(x, prologue, g, eps, scratch, M, K);
    /* rows of TASK_BYTES, but at least 4 tasks per thread where there are the rows */
    const int64_t row_bytes = K * (wtype == W_F32 ? 4 : 2), most = N / (4 * (threads > 1 ? threads : 1));
    int64_t per = (TASK_BYTES + row_bytes - 1) / row_bytes;
    per = per < most ? per : most;
    per = per > 1 ? per : 1;
    MatmulJob job = {x, w, b, r, y, M, N, K, per, wtype};
    qd_parallel(matmul_task, &job, (N + per - 1) / per, threads);
}
