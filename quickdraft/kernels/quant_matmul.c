/* y[m, n] = r[m, n] + b[n] + sum_k h[m, k] * W[n, k] with W in GGUF block formats, read as stored
 * (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), for few rows m: decode and verification.
 *
 * Integer dot products: each row of h is quantized to int16 in blocks of 256 (one float scale per
 * block, |values| <= 8191, round to nearest even: 64 times finer than the int8 of llama.cpp's CPU
 * path, whose error showed as KL 0.013 against float32 on SmolLM2), and each 32-weight unit of W is
 * unpacked ONCE into 16-bit integers that every row then multiplies (s16 x s16 pairs -> int32:
 * AVX2's vpmaddwd, VNNI's vpdpwssd). So verifying k+1 tokens reads and unpacks the weights once, as
 * decoding one does. Each row is computed by the same instruction sequence whatever M is: results
 * are bitwise independent of the batch shape.
 *
 * Per unit u of 32 weights: value = d_u * q + m_u. K-quants carry d_u as an integer sub-scale times
 * the superblock's float d: the sub-scale is multiplied into the 16-bit weights (|q * sc| <= 4096)
 * so a superblock sums in int32 (|sum| < 8 units * 32 * 4096 * 8191 < 2^31) and converts once.
 * The others have a float d_u per unit. The offset m_u (Q4_1, Q5_1, Q4_K, Q5_K) meets the row's
 * sum over the unit. Scales are formed as the GGUF reference forms them (d * sc in float32).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* ggml's type ids */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
#define XB 256      /* weights per activation block: one scale per row per block */
#define X_MAX 8191  /* activations as int16 in [-X_MAX, X_MAX] */
#define UNITS 8     /* 32-weight units per activation block */
#define M_CHUNK 64  /* rows per call of the row loop (their outputs live on the stack) */
#ifdef QD_VNNI
#define MB_MAX 8    /* rows whose accumulators stay in registers: 32 of them with AVX512VL */
#else
#define MB_MAX 4    /* 16 registers with AVX2 */
#endif
#define PREFETCH_AHEAD 2048
#define CHAINS_MAX 8 /* int32 accumulators per row when it is alone */
#define INLINE static inline __attribute__((always_inline))

/* Bytes of one block and weights it holds, per type; 0 for unsupported types. */
int qd_quant_block(int type, int *weights) {
    switch (type) {
        case Q4_0: *weights = 32; return 18;
        case Q4_1: *weights = 32; return 20;
        case Q5_0: *weights = 32; return 22;
        case Q5_1: *weights = 32; return 24;
        case Q8_0: *weights = 32; return 34;
        case Q4_K: *weights = 256; return 144;
        case Q5_K: *weights = 256; return 176;
        case Q6_K: *weights = 256; return 210;
        default: *weights = 0; return 0;
    }
}

INLINE float f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

/* Byte j = 0x10 where bit j of the 32 bits at p is set (the fifth bit of Q5_0/Q5_1). */
INLINE __m256i fifth_bits(const uint8_t *p) {
    uint32_t bits; memcpy(&bits, p, 4);
#ifdef QD_VNNI
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));  /* the bits are a byte mask */
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

/* What one activation block of a weight row shares across its units (K-quants: the superblock). */
typedef struct {
    const uint8_t *b;     /* the superblock (K-quants) or the first 32-weight block (others) */
    float d;              /* K-quants: the superblock's scale */
    __m256 dv;            /* Q4_0/Q5_0: lane u, the scale of unit u (their offsets need all 8 converted
                           * anyway; a conversion per unit cost ~10% of a one-row pass) */
    __m256 m[2];          /* lane g: the offset of the weights in 16-value group g */
    __m256i qh;           /* Q5_K: the fifth bits of the superblock */
    __m256i sc_bytes;     /* K-quants: the sub-scales as bytes in each 128-bit lane, for vpshufb
                           * (Q4_K/Q5_K: the 6-bit scale of unit s in byte s) */
} Prep;

#define K_QUANT(type) ((type) == Q4_K || (type) == Q5_K || (type) == Q6_K)
#define HAS_OFFSET(type) ((type) != Q8_0)
#define BLOCK_BYTES(type) ((type) == Q4_0 ? 18 : (type) == Q4_1 ? 20 : (type) == Q5_0 ? 22 : (type) == Q5_1 ? 24 \
                           : (type) == Q8_0 ? 34 : (type) == Q4_K ? 144 : (type) == Q5_K ? 176 : 210)

INLINE uint16_t u16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h; }

/* 8 per-unit values -> 16 per-group lanes (each unit is two groups of 16). */
INLINE void per_group(__m256 unit_values, __m256 m[2]) {
    m[0] = _mm256_permutevar8x32_ps(unit_values, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    m[1] = _mm256_permutevar8x32_ps(unit_values, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}

INLINE __m256 f16x8(const uint8_t *b, int stride, int offset, int n) {
    uint16_t h[UNITS] = {0};
    for (int s = 0; s < n; s++) h[s] = u16(b + s * stride + offset);
    return _mm256_cvtph_ps(_mm_set_epi16((short)h[7], (short)h[6], (short)h[5], (short)h[4], (short)h[3],
                                         (short)h[2], (short)h[1], (short)h[0]));
}

INLINE void prepare(const uint8_t *row, int64_t xb, int nu, const int type, Prep *p) {
    p->b = row + xb * (K_QUANT(type) ? 1 : UNITS) * BLOCK_BYTES(type);
    if (type == Q4_K || type == Q5_K) {
        /* the 6-bit scales and mins of ggml's 12 packed bytes, as its get_scale_min_k4 reads them:
         * scales to bytes 0..7, mins to bytes 8..15 */
        uint32_t u[4];
        memcpy(u, p->b + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = mins_lo;
        u[0] &= 0x3f3f3f3f;
        p->sc_bytes = _mm256_set1_epi64x((long long)((uint64_t)u[0] | (uint64_t)u[1] << 32));
        p->d = f16(p->b);
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)u[3], (int)u[2])));
        per_group(_mm256_mul_ps(mins, _mm256_set1_ps(-f16(p->b + 2))), p->m);  /* as ggml: d*sc*q - dmin*m */
        if (type == Q5_K) p->qh = _mm256_loadu_si256((const __m256i *)(p->b + 16));
    } else if (type == Q6_K) {  /* d * sc * (q - 32): the -32 is an offset of -32 * d * sc per group */
        p->d = f16(p->b + 208);
        const __m128i sc = _mm_loadu_si128((const __m128i *)(p->b + 192));
        p->sc_bytes = _mm256_broadcastsi128_si256(sc);
        const __m256 k = _mm256_set1_ps(-32.0f * p->d);
        p->m[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), k);
        p->m[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), k);
    } else if (type == Q4_1 || type == Q5_1) {
        per_group(f16x8(p->b, BLOCK_BYTES(type), 2, nu), p->m);
    } else if (type == Q4_0 || type == Q5_0) {  /* (q - 8) * d, (q - 16) * d */
        p->dv = f16x8(p->b, BLOCK_BYTES(type), 0, nu);
        per_group(_mm256_mul_ps(p->dv, _mm256_set1_ps(type == Q4_0 ? -8.0f : -16.0f)), p->m);
    }
}

/* Unit s (32 weights, unsigned q in natural order, or signed for Q8_0) as int16 times its integer
 * scale (1 outside K-quants), split as the activations are stored: w[0] the even weights, w[1]
 * the odd. One vpmaddubsw each: q times a scale in every other byte (no product exceeds 63 * 128). */
INLINE void split(__m256i q, __m256i scale_even, const int is_signed, __m256i w[2]) {
    const __m256i scale_odd = _mm256_slli_epi16(scale_even, 8);
    if (is_signed) {
        w[0] = _mm256_maddubs_epi16(scale_even, q);
        w[1] = _mm256_maddubs_epi16(scale_odd, q);
    } else {
        w[0] = _mm256_maddubs_epi16(q, scale_even);
        w[1] = _mm256_maddubs_epi16(q, scale_odd);
    }
}

/* `split` with a scale of 1 (the 32-weight types): bytes to int16 by shifts, no multiply. */
INLINE void widen(__m256i q, const int is_signed, __m256i w[2]) {
    if (is_signed) {
        w[0] = _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 8);
        w[1] = _mm256_srai_epi16(q, 8);
    } else {
        w[0] = _mm256_and_si256(q, _mm256_set1_epi16(0x00FF));
        w[1] = _mm256_srli_epi16(q, 8);
    }
}

/* K-quant unit s's sub-scale in the even bytes of every 16-bit lane (what `split` takes): one
 * vpshufb of the superblock's scale bytes (a scalar extraction and broadcast per unit cost ~6% of
 * a one-row pass). Q6_K's unit has two: scale 2s for weights 0-15 (lane 0), 2s + 1 for 16-31. */
INLINE __m256i sub_scale(const Prep *p, int s, const int type) {
    const __m256i odd_bytes = _mm256_set1_epi64x((long long)0x8000800080008000);  /* vpshufb's zero */
    const __m256i pick = type == Q6_K
        ? _mm256_add_epi8(_mm256_set1_epi8((char)(2 * s)), _mm256_set_epi64x(0x0101010101010101, 0x0101010101010101, 0, 0))
        : _mm256_set1_epi8((char)s);
    return _mm256_shuffle_epi8(p->sc_bytes, _mm256_or_si256(odd_bytes, pick));
}

INLINE void unit(const Prep *p, int s, const int type, __m256i w[2], __m256 *d) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    if (type == Q4_K || type == Q5_K) {
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(p->b + (type == Q4_K ? 16 : 48) + 32 * (s / 2)));
        __m256i q = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(packed, 4) : packed, lo4);
        if (type == Q5_K)
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(p->qh, s), _mm256_set1_epi8(1)), 4));
        split(q, sub_scale(p, s, type), 0, w);
        return;
    }
    if (type == Q6_K) {
        const int h = s / 4, t = s % 4;
        const __m256i src = _mm256_loadu_si256((const __m256i *)(p->b + 64 * h + 32 * (t & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p->b + 128 + 32 * h));
        const __m256i low = _mm256_and_si256(t & 2 ? _mm256_srli_epi16(src, 4) : src, lo4);
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3)), 4);
        split(_mm256_or_si256(low, high), sub_scale(p, s, type), 0, w);
        return;
    }
    const uint8_t *b = p->b + s * BLOCK_BYTES(type);
    *d = type == Q4_0 || type == Q5_0 ? _mm256_permutevar8x32_ps(p->dv, _mm256_set1_epi32(s)) : _mm256_set1_ps(f16(b));
    if (type == Q8_0) {
        widen(_mm256_loadu_si256((const __m256i *)(b + 2)), 1, w);
        return;
    }
    /* Q4_x/Q5_x: byte j holds weight j in its low nibble and weight j + 16 in its high one */
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8)));
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)), _mm_and_si128(q, _mm_set1_epi8(0x0F)));
    if (type == Q5_0 || type == Q5_1) v = _mm256_or_si256(v, fifth_bits(b + (type == Q5_0 ? 2 : 4)));
    widen(v, 0, w);
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows of h quantized: x [M, K] int16, each 32-value unit stored even values first, then odd (as
 * `split` orders the weights); dx [M, nxb] the block scales; xs [M, nxb * GROUPS] the sums of each
 * 16-value group of the quantized row (dx * sum of x: what a group's offset multiplies). */
#define GROUPS (2 * UNITS)
typedef struct { int16_t *x; float *dx, *xs; int64_t nxb; } QRows;

static void quantize_row(const float *h, int64_t i, int64_t K, QRows *q) {
    for (int64_t xb = 0; xb < q->nxb; xb++) {
        const int64_t k0 = xb * XB, n = K - k0 < XB ? K - k0 : XB;
        const float *src = h + k0;
        int16_t *dst = q->x + i * K + k0;
        float amax = 0.0f;
        for (int64_t k = 0; k < n; k++) amax = amax > fabsf(src[k]) ? amax : fabsf(src[k]);
        const float iscale = amax > 0.0f ? (float)X_MAX / amax : 0.0f, dx = amax / (float)X_MAX;
        q->dx[i * q->nxb + xb] = dx;
        float *xs = q->xs + (i * q->nxb + xb) * GROUPS;
        for (int g = 0; g < GROUPS; g++) xs[g] = 0.0f;
        for (int64_t k = 0; k < n; k++) {
            const int v = _mm_cvtss_si32(_mm_set_ss(src[k] * iscale));  /* |v| <= X_MAX by construction */
            const int64_t unit = k / 32, j = k % 32;
            dst[unit * 32 + (j % 2) * 16 + j / 2] = (int16_t)v;
            xs[k / 16] += (float)v;  /* exact: integers below 2^24 */
        }
        for (int g = 0; g < GROUPS; g++) xs[g] *= dx;
    }
}

/* Row i of the matmul's input: its prologue (into row i of scratch), then quantize_row. */
typedef struct {
    const float *x, *g;
    int prologue;
    float eps;
    float *scratch;
    int64_t K;
    QRows *q;
} RowPrep;

static void row_prep_task(void *ctx, int64_t i) {
    const RowPrep *r = ctx;
    const int64_t width = r->prologue == PRO_SWIGLU ? 2 * r->K : r->K;  /* SwiGLU reads gate | up */
    const float *h = qd_prologue(r->x + i * width, r->prologue, r->g, r->eps, r->scratch ? r->scratch + i * r->K : 0,
                                 1, r->K);
    quantize_row(h, i, r->K, r->q);
}

/* 16 int16 weight-activation products, in pairs, added into 8 int32 lanes. */
INLINE __m256i madd_acc(__m256i acc, __m256i w, const int16_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
#ifdef QD_VNNI
    return _mm256_dpwssd_epi32(acc, w, xv);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, xv));
#endif
}

/* One activation block (nu units) of weight row `row` against rows [0, mb) of q, added to tot[j]
 * and its offsets to tot[MB_MAX + j] (a second sum keeps them off the first one's FMA chain: ~6%)
 * (mb and, for whole blocks, nu constant after inlining: the unit loop unrolls and accumulators stay
 * in registers while each unit, unpacked once, meets every row). The order of every float sum is
 * fixed, so each row's result is the same for any M. K-quants sum a superblock in int32 and convert
 * once; the others scale each 32-weight block in float (two accumulators per row hide the FMA
 * latency). */
INLINE void block_dot(const uint8_t *row, const QRows *q, int64_t K, int64_t xb, const int type, const int mb,
                      const int nu, __m256 tot[2 * MB_MAX]) {
    /* K-quants' integer sums run in several independent chains per row (few rows would otherwise
     * wait on the multiply-add latency); integer addition makes their order irrelevant to the result */
    const int chains = mb == 1 ? CHAINS_MAX : mb == 2 ? CHAINS_MAX / 2 : 2;
    Prep p;
    prepare(row, xb, nu, type, &p);
    /* the row's bytes 2 KB ahead: with two threads streaming, the hardware prefetcher alone left
     * them waiting on memory (~10% at one row) */
    for (int o = 0; o < BLOCK_BYTES(type) * (K_QUANT(type) ? 1 : UNITS); o += 64)
        _mm_prefetch((const char *)p.b + PREFETCH_AHEAD + o, _MM_HINT_T0);
    __m256 a0[MB_MAX], a1[MB_MAX];
    __m256i isum[MB_MAX][CHAINS_MAX];
    for (int j = 0; j < mb; j++) {
        a0[j] = a1[j] = _mm256_setzero_ps();
        for (int c = 0; c < chains; c++) isum[j][c] = _mm256_setzero_si256();
    }
#pragma GCC unroll 8
    for (int s = 0; s < nu; s++) {
        __m256i w[2];
        __m256 d = _mm256_setzero_ps();
        unit(&p, s, type, w, &d);
        for (int j = 0; j < mb; j++) {
            const int16_t *x = q->x + j * K + xb * XB + 32 * s;
            if (K_QUANT(type)) {
                isum[j][(2 * s) % chains] = madd_acc(isum[j][(2 * s) % chains], w[0], x);
                isum[j][(2 * s + 1) % chains] = madd_acc(isum[j][(2 * s + 1) % chains], w[1], x + 16);
            } else {
                const __m256 v = _mm256_cvtepi32_ps(madd_acc(madd_acc(_mm256_setzero_si256(), w[0], x), w[1], x + 16));
                if (s & 1) a1[j] = _mm256_fmadd_ps(v, d, a1[j]);
                else a0[j] = _mm256_fmadd_ps(v, d, a0[j]);
            }
        }
    }
    for (int j = 0; j < mb; j++) {
        const float dx = q->dx[j * q->nxb + xb];
        if (K_QUANT(type)) {
            __m256i sum = isum[j][0];
            for (int c = 1; c < chains; c++) sum = _mm256_add_epi32(sum, isum[j][c]);
            tot[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(p.d * dx), tot[j]);
        } else {
            tot[j] = _mm256_fmadd_ps(_mm256_add_ps(a0[j], a1[j]), _mm256_set1_ps(dx), tot[j]);
        }
        if (HAS_OFFSET(type)) {
            const float *xs = q->xs + (j * q->nxb + xb) * GROUPS;
            const __m256 offsets = _mm256_fmadd_ps(p.m[1], _mm256_loadu_ps(xs + 8), _mm256_mul_ps(p.m[0], _mm256_loadu_ps(xs)));
            tot[MB_MAX + j] = _mm256_add_ps(tot[MB_MAX + j], offsets);
        }
    }
}

/* One part of W against the rows of q: tasks of ROWS_PER_TASK weight rows each. */
#define ROWS_PER_TASK 64  /* long runs: with 16, two threads' interleaved tasks hopped through the
                            * rows and read no faster than one thread */
typedef struct {
    const QRows *q;
    const uint8_t *w;
    int type;
    int64_t row_bytes, M, n0, rows, N, K;
    const float *b, *r;
    float *y;
} PartJob;

/* Weight rows [n0, n1) of the part against rows [0, mb) of q, into out[n - n0][j]: each weight
 * row in one sequential run over K (runs hopping between rows defeat the hardware prefetcher; the
 * activations stay in L2 either way). */
INLINE void rows_dot(const PartJob *job, const QRows *q, int64_t n0, int64_t n1, const int type, const int mb,
                     float out[][MB_MAX]) {
    const int64_t K = job->K, whole = K / XB;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = job->w + n * job->row_bytes;
        __m256 tot[2 * MB_MAX];
        for (int j = 0; j < mb; j++) tot[j] = tot[MB_MAX + j] = _mm256_setzero_ps();
        for (int64_t xb = 0; xb < whole; xb++) block_dot(row, q, K, xb, type, mb, UNITS, tot);
        if (whole < q->nxb) block_dot(row, q, K, whole, type, mb, (int)(K % XB / 32), tot);  /* 32-weight types */
        for (int j = 0; j < mb; j++) out[n - n0][j] = hsum(_mm256_add_ps(tot[j], tot[MB_MAX + j]));
    }
}

/* rows_dot over the rows of q in groups of at most MB_MAX, as even as can be (9 rows: 5 + 4, not
 * 8 + 1, whose lone row runs at one-row speed); mb is a constant in each copy. */
INLINE void task_dot(const PartJob *job, int64_t n0, int64_t n1, const int type, float *y) {
    const int64_t groups = (job->M + MB_MAX - 1) / MB_MAX;
    for (int64_t g = 0, i = 0; g < groups; g++) {
        const QRows qi = {job->q->x + i * job->K, job->q->dx + i * job->q->nxb,
                          job->q->xs + i * job->q->nxb * GROUPS, job->q->nxb};
        float out[ROWS_PER_TASK][MB_MAX];
        const int mb = (int)((job->M - i + (groups - g) - 1) / (groups - g));
        switch (mb) {
            case 1: rows_dot(job, &qi, n0, n1, type, 1, out); break;
            case 2: rows_dot(job, &qi, n0, n1, type, 2, out); break;
            case 3: rows_dot(job, &qi, n0, n1, type, 3, out); break;
#if MB_MAX > 4
            case 4: rows_dot(job, &qi, n0, n1, type, 4, out); break;
            case 5: rows_dot(job, &qi, n0, n1, type, 5, out); break;
            case 6: rows_dot(job, &qi, n0, n1, type, 6, out); break;
            case 7: rows_dot(job, &qi, n0, n1, type, 7, out); break;
#endif
            default: rows_dot(job, &qi, n0, n1, type, MB_MAX, out); break;
        }
        for (int64_t n = n0; n < n1; n++) {
            const int64_t col = job->n0 + n;
            for (int j = 0; j < mb; j++) {
                float v = out[n - n0][j];
                if (job->b) v += job->b[col];
                y[(i + j) * job->N + col] = job->r ? job->r[(i + j) * job->N + col] + v : v;
            }
        }
        i += mb;
    }
}

static void part_task(void *ctx, int64_t task) {
    const PartJob *j = ctx;
    const int64_t n0 = task * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < j->rows ? n0 + ROWS_PER_TASK : j->rows;
    switch (j->type) {
        case Q4_0: task_dot(j, n0, n1, Q4_0, j->y); break;
        case Q4_1: task_dot(j, n0, n1, Q4_1, j->y); break;
        case Q5_0: task_dot(j, n0, n1, Q5_0, j->y); break;
        case Q5_1: task_dot(j, n0, n1, Q5_1, j->y); break;
        case Q8_0: task_dot(j, n0, n1, Q8_0, j->y); break;
        case Q4_K: task_dot(j, n0, n1, Q4_K, j->y); break;
        case Q5_K: task_dot(j, n0, n1, Q5_K, j->y); break;
        default: task_dot(j, n0, n1, Q6_K, j->y); break;
    }
}

/* x: [M, K] (or [M, 2K] for SwiGLU); W: nparts row ranges of N in total, part p with rows[p] rows
 * of type types[p] at data[p]; scratch: [M, K] or NULL (allocated here). Returns 0, or -1 if memory
 * ran out. */
int qd_quant_matmul(const float *x, int nparts, const int *types, const int64_t *rows,
                    const void *const *data, const float *b, const float *r, float *y, int prologue,
                    const float *g, float eps, float *scratch, int64_t M, int64_t N, int64_t K, int threads) {
    float *own = 0;
    if (prologue != PRO_NONE && !scratch) {  /* the prologue's output: the caller's buffer, or ours */
        scratch = own = malloc(sizeof(float) * (size_t)(M * K));
        if (!own) return -1;
    }
    QRows q;
    q.nxb = (K + XB - 1) / XB;
    /* 64-byte aligned: each unit of a row is one cache line, and a split load costs two */
    q.x = aligned_alloc(64, (sizeof(int16_t) * (size_t)(M * K) + 63) / 64 * 64);
    q.dx = malloc(sizeof(float) * (size_t)(M * q.nxb));
    q.xs = malloc(sizeof(float) * (size_t)(M * q.nxb * GROUPS));
    if (!q.x || !q.dx || !q.xs) { free(q.x); free(q.dx); free(q.xs); free(own); return -1; }
    /* rows on all threads when there are several (a 64-row prefill chunk's SwiGLU and rounding
     * were ~8% of its down projection on one thread); each row's result is the same either way */
    RowPrep prep = {x, g, prologue, eps, scratch, K, &q};
    qd_parallel(row_prep_task, &prep, M, M >= 4 ? threads : 1);
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t mc = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
        QRows qc = {q.x + m0 * K, q.dx + m0 * q.nxb, q.xs + m0 * q.nxb * GROUPS, q.nxb};
        int64_t n0 = 0;
        for (int p = 0; p < nparts; p++) {
            int per_block;
            const int64_t row_bytes = qd_quant_block(types[p], &per_block) * (K / per_block);
            PartJob job = {&qc, data[p], types[p], row_bytes, mc, n0, rows[p], N, K, b, r ? r + m0 * N : 0, y + m0 * N};
            qd_parallel(part_task, &job, (rows[p] + ROWS_PER_TASK - 1) / ROWS_PER_TASK, threads);
            n0 += rows[p];
        }
    }
    free(q.x); free(q.dx); free(q.xs); free(own);
    return 0;
}

#ifdef QD_VNNI
#define QD_ISA "avx512vnni"
#else
#define QD_ISA "avx2"
#endif
const char *qd_isa(void) { return QD_ISA; }
/* Asked of the AVX2 build, which runs everywhere the project's kernels do. */
int qd_cpu_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512bw");
}
