/* y[m, n] = r[m, n] + b[n] + sum_k h[m, k] * W[n, k] with W in GGUF block formats (Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4), repacked at load without loss (repack.h), for few rows m:
 * decode and verification, and prefill in chunks.
 *
 * Integer dot products, with the activations in one of two precisions, a property of the weight
 * (chosen per model from its measured quality: weights/activations.py, bench/quality.py):
 * - int16 (act8 = 0): each row of h is quantized in groups of 256 (one float scale per group,
 *   |values| <= 8191, round to nearest even: 64 times finer than llama.cpp's int8), and each of a
 *   group's 8 byte vectors of W is widened ONCE to 16-bit integers that every row then multiplies
 *   (s16 x s16 pairs -> int32: AVX2's vpmaddwd, VNNI's vpdpwssd). SmolLM2-135M needs it: int8
 *   measured top-1 agreement 0.979 against float32 there, short of the 0.99 asked.
 * - int8 (act8 = 1): each 32-weight unit of a row gets its own scale (|values| <= 127), and the
 *   weights' unsigned bytes multiply it as they are (u8 x s8 pairs: AVX2's vpmaddubsw, summed in
 *   int16 over as many byte vectors as cannot overflow, then widened once; VNNI's vpdpbusd): half
 *   the multiply instructions per row of int16, which is what bounds a pass over several rows
 *   (verification, prefill) where one row waits on memory. Q8_0's signed bytes multiply as |w|
 *   times x with w's sign; Q6_K's unsigned q meets its -32 through the row's sums over half units.
 * Either way verifying k+1 tokens reads and unpacks the weights once, as decoding one does. The
 * repacked layout puts unit l (32 weights with one scale) in int32 lane l of every product, so a
 * group sums in int32 and its 8 unit scales (K-quants: d times the 6-bit sub-scale) multiply the 8
 * lanes once: no per-unit scaling or reduction. Each row is computed by the same instruction
 * sequence whatever M is: results are bitwise independent of the batch shape, and the same in both
 * builds.
 *
 * MXFP4's 4-bit codes become signed bytes by a table (twice their E2M1 values: 0, 1, 2, 3, 4, 6, 8,
 * 12 and their negatives, as ggml's kvalues_mxfp4) and then multiply as Q8_0's; its E8M0 scale
 * byte e is the float 2^(e - 128) (ggml's e8m0_to_fp32_half), exact (times an activation scale it
 * can go subnormal for e below ~20, where no trained weight's scale lies).
 * Per unit: value = d_u * q + m_u. The offset m_u (Q4_0/Q5_0: -8 d, -16 d; Q4_1, Q5_1, Q4_K, Q5_K:
 * the file's min) meets the row's sum over the unit; Q6_K's -32 is taken from q before widening
 * (int16), or meets the row's sums over half units (int8).
 * Scales are formed as the GGUF reference forms them (d * sc in float32).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "repack.h"

#define X_MAX 8191  /* activations as int16 in [-X_MAX, X_MAX] */
#define X8_MAX 127  /* as int8 */
#define M_CHUNK 64  /* rows per call of the row loop (their outputs live on the stack) */
/* Rows that share one pass over a weight row, their int32 accumulators in registers and their
 * float totals spilling once per group where they do not fit: AVX2's 16 registers take 8 (10-15%
 * faster at 5-9 rows than 4 at a time, in cache, for Q4_K and Q6_K); AVX512VL's 32 take 12 (on the
 * 1.5B, 2 threads, t(9)/t(1) 2.16 -> 1.82 and t(12)/t(1) 2.57 -> 2.36 against 8, where 9 rows ran
 * as 5 + 4, two passes; 16 spilled and was no faster). */
#ifdef QD_VNNI
#define MB_MAX 12
#else
#define MB_MAX 8
#endif
#define PREFETCH_AHEAD 2048
#define CHAINS_MAX 4 /* int32 accumulators per row when it is alone */
/* Independent int32 sums per row: a row's 16 multiply-adds per group in one chain waited on their
 * latency (~5 cycles each) whenever fewer than ~10 chains ran in all. How many registers allow. */
#ifdef QD_VNNI
#define CHAINS(mb) ((mb) <= 3 ? CHAINS_MAX : (mb) <= 6 ? 2 : 1)
#else
#define CHAINS(mb) ((mb) == 1 ? CHAINS_MAX : (mb) == 2 ? 2 : 1)
#endif
#define INLINE static inline __attribute__((always_inline))

#define SIGNED(type) ((type) == Q8_0 || (type) == Q6_K || (type) == MXFP4)
#define SIGNED_BYTES(type) ((type) == Q8_0 || (type) == MXFP4)  /* signed byte vectors at either precision */
#define HAS_OFFSET(type) ((type) != Q8_0 && (type) != Q6_K && (type) != MXFP4)
/* where a group's nibbles (Q8_0: its bytes) start; Q5's fifth bits are the 32 bytes before */
#define BODY(type) ((type) == MXFP4 ? 8 : (type) == Q4_0 || (type) == Q4_K || (type) == Q8_0 ? 16 : (type) == Q4_1 ? 32 \
                    : (type) == Q5_0 || (type) == Q5_K ? 48 : (type) == Q5_1 ? 64 : 82)

INLINE float f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }

/* Byte j = 0x10 where bit j of `bits` is set (a fifth bit). */
INLINE __m256i fifth_bits(uint32_t bits) {
#ifdef QD_VNNI
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));  /* the bits are a byte mask */
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

/* What a group of a weight row shares across its byte vectors. */
typedef struct {
    const uint8_t *g;
    __m256 d[2];  /* lane l: the scale of unit l (Q6_K: d[0] for its first 16 weights, d[1] the last 16) */
    __m256 m;     /* lane l: the offset of unit l's weights */
} Prep;

INLINE void prepare(const uint8_t *g, const int type, Prep *p) {
    p->g = g;
    if (type == Q4_K || type == Q5_K) {
        /* d, dmin and ggml's 12 packed bytes of 6-bit scales and mins (as its get_scale_min_k4 reads
         * them), decoded in one vector: scales to bytes 0..7, mins to bytes 8..15 */
        const __m128i raw = _mm_loadu_si128((const __m128i *)g);  /* q[i] is byte 4 + i */
        /* low bits: q0..q3 & 63 | q8..q11 & 15 (scales); q4..q7 & 63 | q8..q11 >> 4 (mins) */
        const __m128i lo = _mm_shuffle_epi8(raw, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
        /* high bits of scales and mins 4..7: the top 2 bits of q0..q3 and q4..q7 */
        const __m128i hi = _mm_shuffle_epi8(raw, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
        const __m128i sm = _mm_or_si128(
            _mm_or_si128(_mm_and_si128(lo, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
                         _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15))),
            _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)));
        const __m128 dd = _mm_cvtph_ps(raw);  /* d, dmin */
        p->d[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)), _mm256_broadcastss_ps(dd));
        /* as ggml: d * sc * q - dmin * m */
        p->m = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))),
                             _mm256_broadcastss_ps(_mm_xor_ps(_mm_movehdup_ps(dd), _mm_set1_ps(-0.0f))));
    } else if (type == Q6_K) {
        const __m256 d = _mm256_set1_ps(f16(g));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(g + 2));
        p->d[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
        p->d[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
    } else if (type == MXFP4) {
        /* 2^(e - 128) in float bits: (e - 1) << 23, and for e = 0, 1 the denormals 2^-128, 2^-127 */
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)g));
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        p->d[0] = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
    } else {
        p->d[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        if (type == Q4_1 || type == Q5_1) p->m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
        if (type == Q4_0 || type == Q5_0)  /* (q - 8) * d, (q - 16) * d */
            p->m = _mm256_mul_ps(p->d[0], _mm256_set1_ps(type == Q4_0 ? -8.0f : -16.0f));
    }
}

/* Byte vector U[i] of the group (repack.h): unsigned q, or signed for Q8_0, and for Q6_K (q - 32)
 * when `centered` (int16 activations; int8 ones take its unsigned q). */
INLINE __m256i byte_vector(const Prep *p, int i, const int type, const int centered) {
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(p->g + BODY(type) + 32 * i));
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(p->g + BODY(type) + 32 * (i / 2)));
    __m256i u = _mm256_and_si256(i & 1 ? _mm256_srli_epi16(packed, 4) : packed, _mm256_set1_epi8(0x0F));
    if (type == MXFP4)
        return _mm256_shuffle_epi8(_mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                                    0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), u);
    if (type == Q5_0 || type == Q5_1 || type == Q5_K) {
        uint32_t bits;
        memcpy(&bits, p->g + BODY(type) - 32 + 4 * i, 4);
        u = _mm256_or_si256(u, fifth_bits(bits));
    }
    if (type == Q6_K) {
        const __m256i top = _mm256_loadu_si256((const __m256i *)(p->g + 18 + 32 * (i / 4)));
        /* bits 2(i % 4) and 2(i % 4) + 1 of each top byte, as bits 4 and 5: one shift within the
         * byte (none for i % 4 == 2) and a mask */
        const int up = 4 - 2 * (i % 4);
        const __m256i moved = up > 0 ? _mm256_slli_epi16(top, up) : up < 0 ? _mm256_srli_epi16(top, -up) : top;
        u = _mm256_or_si256(u, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
        if (centered) u = _mm256_sub_epi8(u, _mm256_set1_epi8(32));
    }
    return u;
}

/* Bytes to int16 as the activations are stored: w[0] the even bytes, w[1] the odd (shifts, no
 * multiply). */
INLINE void widen(__m256i u, const int is_signed, __m256i w[2]) {
    if (is_signed) {
        w[0] = _mm256_srai_epi16(_mm256_slli_epi16(u, 8), 8);
        w[1] = _mm256_srai_epi16(u, 8);
    } else {
        w[0] = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF));
        w[1] = _mm256_srli_epi16(u, 8);
    }
}

/* acc + pairs of int16 products of w and the 16 activations at x, in int32 lanes. */
INLINE __m256i dot2(__m256i acc, __m256i w, const int16_t *x) {
    const __m256i xv = _mm256_load_si256((const __m256i *)x);
#ifdef QD_VNNI
    return _mm256_dpwssd_epi32(acc, w, xv);
#else
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, xv));
    /* the sum in its register, in order: GCC otherwise reassociates a group's adds into trees of
     * products, which for 2-4 rows held 32-64 products at once and spilled them to the stack */
    __asm__("" : "+x"(acc));
    return acc;
#endif
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows of h quantized: x [M, Kp] (K padded to whole groups with zeros), int16 or int8;
 * dx [M, nxb * UNITS] the scale of each unit (int16: its group's, in all 8 lanes); xs [M, nxb *
 * UNITS] dx times the sum of each unit's quantized values (what a unit's offset multiplies); xh
 * [M, nxb * 2 * UNITS] (int8 only) 32 times the sums over the first and the last 16 values of each
 * unit (Q6_K's -32 offsets, whose scales differ between the halves).
 * int16: each group as 16 vectors of 16 matching the weights' byte vectors: vector 2i holds the
 * activations of U[i]'s even bytes, 2i + 1 of its odd ones (weight 32l + 4i + t sits in vector
 * 2i + t % 2, lane 2l + t / 2). int8: each group as 8 vectors of 32 bytes, byte 4l + t of vector i
 * matching byte 4l + t of U[i] (weight 32l + 4i + t). */
typedef struct { void *x; float *dx, *xs; int32_t *xh; int64_t nxb; int act8; } QRows;

/* max |h[k]| over k in [0, n), n a multiple of 8 */
INLINE float abs_max(const float *h, int64_t n) {
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k += 8)
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(h + k)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* v[k] = h[k] * iscale rounded to nearest even, k in [0, n), n a multiple of 8 (vectorized: a value
 * at a time took ~3 ns, a fifth of a 5-row pass in cache) */
INLINE void round_scaled(const float *h, int64_t n, float iscale, int32_t *v) {
    for (int64_t k = 0; k < n; k += 8)
        _mm256_store_si256((__m256i *)(v + k), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(h + k),
                                                                                _mm256_set1_ps(iscale))));
}

INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

static void quantize_row16(const float *h, int64_t i, int64_t K, QRows *q) {
    const int64_t Kp = q->nxb * GROUP;
    for (int64_t xb = 0; xb < q->nxb; xb++) {
        const int64_t k0 = xb * GROUP, n = K - k0 < GROUP ? K - k0 : GROUP;  /* n: whole units of 32 */
        const float amax = abs_max(h + k0, n);
        const float iscale = amax > 0.0f ? (float)X_MAX / amax : 0.0f, dx = amax / (float)X_MAX;
        int32_t v[GROUP] __attribute__((aligned(32))) = {0};
        round_scaled(h + k0, n, iscale, v);  /* |v| <= X_MAX by construction */
        int16_t *dst = (int16_t *)q->x + i * Kp + k0;
        float *xs = q->xs + (i * q->nxb + xb) * UNITS;
        for (int l = 0; l < UNITS; l++) {
            const int32_t *u = v + 32 * l;
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(_mm256_load_si256((const __m256i *)u),
                                                            _mm256_load_si256((const __m256i *)(u + 8))),
                                           _mm256_add_epi32(_mm256_load_si256((const __m256i *)(u + 16)),
                                                            _mm256_load_si256((const __m256i *)(u + 24))));
            q->dx[(i * q->nxb + xb) * UNITS + l] = dx;
            xs[l] = (float)hsum_epi32(sum) * dx;  /* an exact sum: below 2^24 */
            for (int b = 0; b < 32; b++) dst[(2 * (b / 4) + b % 2) * 16 + 2 * l + b % 4 / 2] = (int16_t)u[b];
        }
    }
}

static void quantize_row8(const float *h, int64_t i, int64_t K, QRows *q) {
    const int64_t Kp = q->nxb * GROUP;
    for (int64_t xb = 0; xb < q->nxb; xb++) {
        const int64_t k0 = xb * GROUP, at = i * q->nxb + xb;
        /* unit l's 32 values as bytes in order, 4 at a time: chunk c = values 4c..4c+3, which
         * belong to byte vector c (weights 32l + 4c + t) */
        uint32_t chunk[UNITS][8] __attribute__((aligned(32)));
        for (int l = 0; l < UNITS; l++) {
            const float amax = k0 + 32 * l < K ? abs_max(h + k0 + 32 * l, 32) : 0.0f;  /* K: whole units */
            const float iscale = amax > 0.0f ? (float)X8_MAX / amax : 0.0f, dx = amax / (float)X8_MAX;
            __m256i v[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256()};
            for (int c = 0; amax > 0.0f && c < 4; c++)  /* |v| <= X8_MAX: no saturation below */
                v[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(h + k0 + 32 * l + 8 * c), _mm256_set1_ps(iscale)));
            /* packs interleave 128-bit lanes: bytes come out as 4-value chunks 0, 2, 4, 6, 1, 3, 5, 7 */
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_store_si256((__m256i *)chunk[l], _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            const int32_t first = hsum_epi32(_mm256_add_epi32(v[0], v[1])), last = hsum_epi32(_mm256_add_epi32(v[2], v[3]));
            q->dx[at * UNITS + l] = dx;
            q->xs[at * UNITS + l] = (float)(first + last) * dx;
            q->xh[at * 2 * UNITS + l] = 32 * first;
            q->xh[at * 2 * UNITS + UNITS + l] = 32 * last;
        }
        uint32_t *dst = (uint32_t *)((int8_t *)q->x + i * Kp + k0);  /* vector c, unit l: 4 bytes */
        for (int c = 0; c < 8; c++)
            for (int l = 0; l < UNITS; l++) dst[8 * c + l] = chunk[l][c];
    }
}

/* Row i of the matmul's input: its prologue (into row i of scratch), then its quantization. */
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
    const int64_t width = QD_GATED(r->prologue) ? 2 * r->K : r->K;  /* a gated prologue reads gate | up */
    const float *h = qd_prologue(r->x + i * width, r->prologue, r->g, r->eps, r->scratch ? r->scratch + i * r->K : 0,
                                 1, r->K);
    (r->q->act8 ? quantize_row8 : quantize_row16)(h, i, r->K, r->q);
}

/* int16 activations: the unit sums of byte vectors [i0, i1) of the group against rows [0, mb) of q,
 * into sum[j] (int32 lane l: unit l). */
INLINE void unit_sums16(const Prep *p, const QRows *q, int64_t xb, int i0, int i1, const int type, const int mb,
                        __m256i sum[MB_MAX]) {
    const int chains = CHAINS(mb);
    const int64_t Kp = q->nxb * GROUP;
    __m256i acc[MB_MAX][CHAINS_MAX];
    for (int j = 0; j < mb; j++)
        for (int c = 0; c < chains; c++) acc[j][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int i = i0; i < i1; i++) {
        __m256i w[2];
        widen(byte_vector(p, i, type, 1), SIGNED(type), w);
        const int ce = 2 * i % chains, co = (2 * i + 1) % chains;  /* the even and odd bytes: two chains */
        for (int j = 0; j < mb; j++) {
            const int16_t *x = (const int16_t *)q->x + j * Kp + xb * GROUP + 32 * i;
            acc[j][ce] = dot2(acc[j][ce], w[0], x);
            acc[j][co] = dot2(acc[j][co], w[1], x + 16);
        }
    }
    for (int j = 0; j < mb; j++) {
        sum[j] = acc[j][0];
        for (int c = 1; c < chains; c++) sum[j] = _mm256_add_epi32(sum[j], acc[j][c]);
    }
}

/* int8 activations: as unit_sums16. Signed bytes (Q8_0, MXFP4) multiply as |w| times x with w's sign. */
INLINE void unit_sums8(const Prep *p, const QRows *q, int64_t xb, int i0, int i1, const int type, const int mb,
                       __m256i sum[MB_MAX]) {
    const int64_t Kp = q->nxb * GROUP;
    for (int j = 0; j < mb; j++) sum[j] = _mm256_setzero_si256();
#ifdef QD_VNNI
    const int run = i1 - i0;  /* int32 sums throughout */
#else
    /* byte vectors whose u8 x s8 pair sums add up in int16 without overflow: each pair is at most
     * 2 * 127 * max|q| (Q4: 15, MXFP4: 12, Q5: 31, Q6_K: 63, Q8_0: 128); then one vpmaddwd widens them */
    const int run = type == Q8_0 ? 1 : type == Q6_K ? 2 : type == Q5_0 || type == Q5_1 || type == Q5_K ? 4 : 8;
#endif
    for (int r = i0; r < i1; r += run) {
        __m256i acc[MB_MAX];
#pragma GCC unroll 8
        for (int i = r; i < r + run; i++) {
            const __m256i u = byte_vector(p, i, type, 0);
            const __m256i a = SIGNED_BYTES(type) ? _mm256_abs_epi8(u) : u;
            for (int j = 0; j < mb; j++) {
                __m256i x = _mm256_load_si256((const __m256i *)((const int8_t *)q->x + j * Kp + xb * GROUP + 32 * i));
                if (SIGNED_BYTES(type)) x = _mm256_sign_epi8(x, u);
#ifdef QD_VNNI
                sum[j] = _mm256_dpbusd_epi32(sum[j], a, x);
#else
                const __m256i prod = _mm256_maddubs_epi16(a, x);
                acc[j] = i == r ? prod : _mm256_add_epi16(acc[j], prod);
                __asm__("" : "+x"(acc[j]));  /* in order, in its register (see dot2) */
#endif
            }
        }
#ifndef QD_VNNI
        for (int j = 0; j < mb; j++) sum[j] = _mm256_add_epi32(sum[j], _mm256_madd_epi16(acc[j], _mm256_set1_epi16(1)));
#else
        (void)acc;
#endif
    }
}

/* Group xb of weight row `row` against rows [0, mb) of q, added to tot[j], its offsets to
 * tot[MB_MAX + j] (a second sum keeps them off the first one's FMA chain). mb and act8 are
 * constants after inlining: the loop over byte vectors unrolls and the accumulators stay in
 * registers while each vector, unpacked once, meets every row. A row's integer sums, however
 * many chains hold them, are exact; its float sums run in a fixed order: the same result for any M. */
INLINE void group_dot(const uint8_t *row, const QRows *q, int64_t xb, const int type, const int mb, const int act8,
                      __m256 tot[2 * MB_MAX]) {
    /* Q6_K: the first and the last 16 weights of each unit have their own scales, so its byte
     * vectors 0-3 and 4-7 sum apart, each set finished before the next starts (one set's
     * accumulators live at a time) */
    const int sets = type == Q6_K ? 2 : 1;
    Prep p;
    prepare(row + xb * GROUP_BYTES(type), type, &p);
    /* the row's bytes 2 KB ahead: with two threads streaming, the hardware prefetcher alone left
     * them waiting on memory (~10% at one row) */
    for (int o = 0; o < GROUP_BYTES(type); o += 64) _mm_prefetch((const char *)p.g + PREFETCH_AHEAD + o, _MM_HINT_T0);
#pragma GCC unroll 2
    for (int set = 0; set < sets; set++) {
        const int i0 = set * UNITS / sets, i1 = (set + 1) * UNITS / sets;
        __m256i sum[MB_MAX];
        if (act8) unit_sums8(&p, q, xb, i0, i1, type, mb, sum);
        else unit_sums16(&p, q, xb, i0, i1, type, mb, sum);
        for (int j = 0; j < mb; j++) {
            const int64_t at = j * q->nxb + xb;
            if (act8 && type == Q6_K)  /* unsigned q: minus 32 times each half unit's sum */
                sum[j] = _mm256_sub_epi32(sum[j], _mm256_loadu_si256((const __m256i *)(q->xh + (at * 2 + set) * UNITS)));
            const __m256 dx = _mm256_loadu_ps(q->dx + at * UNITS);
            tot[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[j]), _mm256_mul_ps(p.d[set], dx), tot[j]);
        }
    }
    if (HAS_OFFSET(type))
        for (int j = 0; j < mb; j++)
            tot[MB_MAX + j] = _mm256_fmadd_ps(p.m, _mm256_loadu_ps(q->xs + (j * q->nxb + xb) * UNITS), tot[MB_MAX + j]);
}

/* One part of W against the rows of q: tasks of task_rows weight rows, in blocks of BLOCK_ROWS
 * (their outputs live on the stack). */
#define BLOCK_ROWS 64
#define TASK_BYTES (512 << 10)  /* a thread's run through the weights, at least: two threads
                                 * claiming tasks of 64 rows (55 KB of the 1.5B's gate|up) hopped
                                 * through memory and read it at 17.5 GB/s at one row; in runs of
                                 * 512 KB, 23.5 (its LM head: 23.6 -> 29.7) */
typedef struct {
    const QRows *q;
    const uint8_t *w;
    int type;
    int64_t row_bytes, M, n0, rows, N, K, task_rows;
    const float *b, *r;
    float *y;
} PartJob;

/* Weight rows [n0, n1) of the part against rows [0, mb) of q, into out[n - n0][j]: each weight
 * row in one sequential run over K (runs hopping between rows defeat the hardware prefetcher; the
 * activations stay in L2 either way). */
INLINE void rows_dot(const PartJob *job, const QRows *q, int64_t n0, int64_t n1, const int type, const int mb,
                     const int act8, float out[][MB_MAX]) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = job->w + n * job->row_bytes;
        __m256 tot[2 * MB_MAX];
        for (int j = 0; j < mb; j++) tot[j] = tot[MB_MAX + j] = _mm256_setzero_ps();
        for (int64_t xb = 0; xb < q->nxb; xb++) group_dot(row, q, xb, type, mb, act8, tot);
        for (int j = 0; j < mb; j++) out[n - n0][j] = hsum(_mm256_add_ps(tot[j], tot[MB_MAX + j]));
    }
}

/* rows_dot over the rows of q in groups of at most MB_MAX, as even as can be (9 rows with AVX2:
 * 5 + 4, not 8 + 1, whose lone row runs at one-row speed); mb and act8 are constants in each copy. */
INLINE void task_dot(const PartJob *job, int64_t n0, int64_t n1, const int type, const int act8, float *y) {
    const int64_t groups = (job->M + MB_MAX - 1) / MB_MAX, nxb = job->q->nxb;
    for (int64_t g = 0, i = 0; g < groups; g++) {
        const QRows qi = {(char *)job->q->x + i * nxb * GROUP * (act8 ? 1 : 2), job->q->dx + i * nxb * UNITS,
                          job->q->xs + i * nxb * UNITS, job->q->xh ? job->q->xh + i * nxb * 2 * UNITS : 0, nxb, act8};
        float out[BLOCK_ROWS][MB_MAX];
        const int mb = (int)((job->M - i + (groups - g) - 1) / (groups - g));
        switch (mb) {
            case 1: rows_dot(job, &qi, n0, n1, type, 1, act8, out); break;
            case 2: rows_dot(job, &qi, n0, n1, type, 2, act8, out); break;
            case 3: rows_dot(job, &qi, n0, n1, type, 3, act8, out); break;
            case 4: rows_dot(job, &qi, n0, n1, type, 4, act8, out); break;
            case 5: rows_dot(job, &qi, n0, n1, type, 5, act8, out); break;
            case 6: rows_dot(job, &qi, n0, n1, type, 6, act8, out); break;
            case 7: rows_dot(job, &qi, n0, n1, type, 7, act8, out); break;
#if MB_MAX > 8
            case 8: rows_dot(job, &qi, n0, n1, type, 8, act8, out); break;
            case 9: rows_dot(job, &qi, n0, n1, type, 9, act8, out); break;
            case 10: rows_dot(job, &qi, n0, n1, type, 10, act8, out); break;
            case 11: rows_dot(job, &qi, n0, n1, type, 11, act8, out); break;
#endif
            default: rows_dot(job, &qi, n0, n1, type, MB_MAX, act8, out); break;
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

/* The parts of one matrix as one parallel job (q|k|v is three parts, gate|up two): one wake-up of
 * the workers per matmul, and a part of 4 tasks no longer waits alone for its slowest one. */
#define PARTS_MAX 8
typedef struct {
    PartJob part[PARTS_MAX];
    int64_t first[PARTS_MAX + 1];  /* the job's task index of each part's first task */
    int nparts;
} MatJob;

#define TYPE_CASES(act8)                                                \
    switch (j->type) {                                                  \
        case Q4_0: task_dot(j, n0, n1, Q4_0, act8, j->y); break;       \
        case Q4_1: task_dot(j, n0, n1, Q4_1, act8, j->y); break;       \
        case Q5_0: task_dot(j, n0, n1, Q5_0, act8, j->y); break;       \
        case Q5_1: task_dot(j, n0, n1, Q5_1, act8, j->y); break;       \
        case Q8_0: task_dot(j, n0, n1, Q8_0, act8, j->y); break;       \
        case Q4_K: task_dot(j, n0, n1, Q4_K, act8, j->y); break;       \
        case Q5_K: task_dot(j, n0, n1, Q5_K, act8, j->y); break;       \
        case MXFP4: task_dot(j, n0, n1, MXFP4, act8, j->y); break;     \
        default: task_dot(j, n0, n1, Q6_K, act8, j->y); break;         \
    }

static void part_task(void *ctx, int64_t task) {
    const MatJob *m = ctx;
    int p = 0;
    while (task >= m->first[p + 1]) p++;
    const PartJob *j = &m->part[p];
    task -= m->first[p];
    const int64_t end = (task + 1) * j->task_rows < j->rows ? (task + 1) * j->task_rows : j->rows;
    for (int64_t n0 = task * j->task_rows; n0 < end; n0 += BLOCK_ROWS) {
        const int64_t n1 = n0 + BLOCK_ROWS < end ? n0 + BLOCK_ROWS : end;
        if (j->q->act8) TYPE_CASES(1) else TYPE_CASES(0)
    }
}

/* Rows per task: runs of TASK_BYTES, but at least 4 tasks per thread where the part has the rows
 * (a thread that finishes early waits for the others' last task). */
static int64_t task_rows(int64_t rows, int64_t row_bytes, int threads) {
    const int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int64_t per = (TASK_BYTES + BLOCK_ROWS * row_bytes - 1) / (BLOCK_ROWS * row_bytes);
    const int64_t most = blocks / (4 * (threads > 1 ? threads : 1));
    if (per > most) per = most;
    return (per > 1 ? per : 1) * BLOCK_ROWS;
}

/* x: [M, K] (or [M, 2K] for SwiGLU); W: nparts row ranges of N in total, part p with rows[p] rows
 * of type types[p] at data[p], repacked by qd_repack; act8: int8 activations (else int16); scratch:
 * [M, K] or NULL (allocated here). Returns 0, or -1 if memory ran out. */
int qd_quant_matmul(const float *x, int nparts, const int *types, const int64_t *rows,
                    const void *const *data, int act8, const float *b, const float *r, float *y, int prologue,
                    const float *g, float eps, float *scratch, int64_t M, int64_t N, int64_t K, int threads) {
    float *own = 0;
    if (prologue != PRO_NONE && !scratch) {  /* the prologue's output: the caller's buffer, or ours */
        scratch = own = malloc(sizeof(float) * (size_t)(M * K));
        if (!own) return -1;
    }
    QRows q = {.nxb = (K + GROUP - 1) / GROUP, .act8 = act8 != 0};
    const int64_t Kp = q.nxb * GROUP;
    /* 64-byte aligned: each byte vector's activations are one cache line (int16), and a split load
     * costs two */
    q.x = aligned_alloc(64, (size_t)(M * Kp) * (q.act8 ? 1 : 2));
    q.dx = malloc(sizeof(float) * (size_t)(M * q.nxb * UNITS));
    q.xs = malloc(sizeof(float) * (size_t)(M * q.nxb * UNITS));
    q.xh = q.act8 ? malloc(sizeof(int32_t) * (size_t)(M * q.nxb * 2 * UNITS)) : 0;
    if (!q.x || !q.dx || !q.xs || (q.act8 && !q.xh)) {
        free(q.x); free(q.dx); free(q.xs); free(q.xh); free(own);
        return -1;
    }
    /* rows on all threads when there are several (a 64-row prefill chunk's SwiGLU and rounding
     * were ~8% of its down projection on one thread); each row's result is the same either way */
    RowPrep prep = {x, g, prologue, eps, scratch, K, &q};
    qd_parallel(row_prep_task, &prep, M, M >= 4 ? threads : 1);
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t mc = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
        QRows qc = {(char *)q.x + m0 * Kp * (q.act8 ? 1 : 2), q.dx + m0 * q.nxb * UNITS, q.xs + m0 * q.nxb * UNITS,
                    q.xh ? q.xh + m0 * q.nxb * 2 * UNITS : 0, q.nxb, q.act8};
        int64_t n0 = 0;
        for (int p0 = 0; p0 < nparts; p0 += PARTS_MAX) {
            MatJob job = {.nparts = nparts - p0 < PARTS_MAX ? nparts - p0 : PARTS_MAX};
            for (int p = 0; p < job.nparts; p++) {
                const int64_t at = p0 + p;
                const int64_t row_bytes = qd_packed_row_bytes(types[at], K), per = task_rows(rows[at], row_bytes, threads);
                job.part[p] = (PartJob){&qc, data[at], types[at], row_bytes, mc, n0, rows[at], N, K, per, b,
                                        r ? r + m0 * N : 0, y + m0 * N};
                job.first[p + 1] = job.first[p] + (rows[at] + per - 1) / per;
                n0 += rows[at];
            }
            qd_parallel(part_task, &job, job.first[job.nparts], threads);
        }
    }
    free(q.x); free(q.dx); free(q.xs); free(q.xh); free(own);
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
