/* GGUF blocks -> the kernel's layout (repack.h), once per weight at load: the same numbers, moved so
 * that the kernel's int32 lane l is unit l (sub-scales then apply per lane after a superblock, with
 * no multiply per unit). Plain byte moves over each row; rows run on the kernel's threads. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "repack.h"

static int block_weights(int type) { return K_QUANT(type) ? 256 : 32; }

static int block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        case MXFP4: return 17;
        default: return 0;
    }
}

int64_t qd_packed_row_bytes(int type, int64_t K) {
    return GROUP_BYTES(type) * ((K + GROUP - 1) / GROUP);
}

/* The group's byte vectors from its weights in natural order: byte 4l + t of U[i] is weight
 * 32l + 4i + t, so as 4-byte words U is the transpose of the 8 x 8 words of the group. */
static void byte_vectors(const uint8_t w[GROUP], uint8_t u[UNITS][32]) {
    for (int l = 0; l < UNITS; l++)
        for (int i = 0; i < UNITS; i++) memcpy(&u[i][4 * l], w + 32 * l + 4 * i, 4);
}

/* The group's weights in natural order: q their low bits (Q8_0: the signed byte), hi the bits above
 * (Q5: the fifth as 0/1; Q6_K: the top two); weights of missing blocks stay 0. */
static void natural(int type, const uint8_t *b, int nb, uint8_t q[GROUP], uint8_t hi[GROUP]) {
    memset(q, 0, GROUP);
    memset(hi, 0, GROUP);
    if (type == Q4_K || type == Q5_K) {
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48), *qh = b + 16;
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 32; j++) {
                q[64 * c + j] = qs[32 * c + j] & 15;
                q[64 * c + 32 + j] = qs[32 * c + j] >> 4;
                if (type == Q5_K) {
                    hi[64 * c + j] = qh[j] >> (2 * c) & 1;
                    hi[64 * c + 32 + j] = qh[j] >> (2 * c + 1) & 1;
                }
            }
    } else if (type == Q6_K) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int j = 0; j < 32; j++)
                for (int s = 0; s < 4; s++) {  /* unit 4h + s: ggml's order */
                    const uint8_t low = ql[32 * (s & 1) + j];
                    q[128 * h + 32 * s + j] = s & 2 ? low >> 4 : low & 15;
                    hi[128 * h + 32 * s + j] = qh[j] >> (2 * s) & 3;
                }
        }
    } else {
        for (int u = 0; u < nb; u++) {
            const uint8_t *blk = b + u * block_bytes(type);
            if (type == Q8_0) {
                memcpy(q + 32 * u, blk + 2, 32);
                continue;
            }
            const int off = type == Q5_0 ? 6 : 8;  /* Q5_0, Q5_1 (Q4_0, Q4_1: pack_low_high_nibbles) */
            uint32_t qh = 0;
            if (type == Q5_0 || type == Q5_1) memcpy(&qh, blk + (type == Q5_0 ? 2 : 4), 4);
            for (int j = 0; j < 16; j++) {
                q[32 * u + j] = blk[off + j] & 15;
                q[32 * u + 16 + j] = blk[off + j] >> 4;
                hi[32 * u + j] = qh >> j & 1;
                hi[32 * u + 16 + j] = qh >> (j + 16) & 1;
            }
        }
    }
}

/* The nibbles of a group of 32-weight blocks whose block holds weight j in the low nibble of byte j
 * and weight j + 16 in the high one (Q4_0, Q4_1, MXFP4; `off`: where the 16 bytes start), straight
 * into the packed vectors: byte 4l + t of vector v is U[2v] | U[2v + 1] << 4, weights 32l + 8v + t and
 * 32l + 8v + 4 + t. The general path below gives the same bytes through the weights in natural
 * order, ~4x slower (gpt-oss-20b's 10 GB of MXFP4 experts took ~30 s to load that way). */
static void pack_low_high_nibbles(const uint8_t *b, int nb, int bytes, int off, uint8_t *out) {
    memset(out, 0, 128);
    for (int l = 0; l < nb; l++) {
        uint8_t c[32];
        const uint8_t *qs = b + l * bytes + off;
        for (int j = 0; j < 16; j++) {
            c[j] = qs[j] & 15;
            c[j + 16] = qs[j] >> 4;
        }
        for (int v = 0; v < 4; v++)
            for (int t = 0; t < 4; t++) out[32 * v + 4 * l + t] = (uint8_t)(c[8 * v + t] | c[8 * v + 4 + t] << 4);
    }
}

/* The scales of a group of nb 32-weight blocks: each block's d (f16; MXFP4: its E8M0 byte), then
 * (Q4_1, Q5_1) each block's m, missing blocks' zero. Returns the bytes written. */
static int block_scales(int type, const uint8_t *b, int nb, uint8_t *out) {
    const int size = type == MXFP4 ? 1 : 2, parts = type == Q4_1 || type == Q5_1 ? 2 : 1;
    memset(out, 0, (size_t)(8 * size * parts));
    for (int p = 0; p < parts; p++)
        for (int l = 0; l < nb; l++) memcpy(out + 8 * size * p + size * l, b + l * block_bytes(type) + 2 * p, (size_t)size);
    return 8 * size * parts;
}

/* One group from nb file blocks (K-quants: one superblock) into out (GROUP_BYTES). */
static void repack_group(int type, const uint8_t *b, int nb, uint8_t *out) {
    uint8_t q[GROUP], hi[GROUP], u[UNITS][32], h[UNITS][32];
    if (type == Q4_0 || type == Q4_1 || type == MXFP4) {  /* the scales, then the nibbles */
        const int scales = block_scales(type, b, nb, out);
        pack_low_high_nibbles(b, nb, block_bytes(type), block_bytes(type) - 16, out + scales);
        return;
    }
    natural(type, b, nb, q, hi);
    byte_vectors(q, u);
    byte_vectors(hi, h);
    if (K_QUANT(type)) {
        if (type == Q6_K) {
            memcpy(out, b + 208, 2);
            for (int g = 0; g < 8; g++) {
                out[2 + g] = b[192 + 2 * g];
                out[10 + g] = b[192 + 2 * g + 1];
            }
            out += 18;
            for (int w = 0; w < 2; w++)
                for (int c = 0; c < 32; c++) {
                    uint8_t v = 0;
                    for (int k = 0; k < 4; k++) v |= (uint8_t)(h[4 * w + k][c] << (2 * k));
                    out[32 * w + c] = v;
                }
            out += 64;
        } else {
            memcpy(out, b, 16);
            out += 16;
        }
    } else {
        out += block_scales(type, b, nb, out);
    }
    if (type == Q5_0 || type == Q5_1 || type == Q5_K) {
        for (int i = 0; i < 8; i++) {
            uint32_t mask = 0;
            for (int c = 0; c < 32; c++) mask |= (uint32_t)h[i][c] << c;
            memcpy(out + 4 * i, &mask, 4);
        }
        out += 32;
    }
    if (type == Q8_0) {
        memcpy(out, u, sizeof u);
        return;
    }
    for (int v = 0; v < 4; v++)
        for (int c = 0; c < 32; c++) out[32 * v + c] = (uint8_t)(u[2 * v][c] | u[2 * v + 1][c] << 4);
}

typedef struct { int type; const uint8_t *src; int64_t K; uint8_t *dst; } RepackJob;

static void repack_row(void *ctx, int64_t n) {
    const RepackJob *j = ctx;
    const int per = block_weights(j->type), blocks = (int)(j->K / per), in_group = GROUP / per;
    const uint8_t *row = j->src + n * (int64_t)blocks * block_bytes(j->type);
    uint8_t *out = j->dst + n * qd_packed_row_bytes(j->type, j->K);
    for (int first = 0; first < blocks; first += in_group) {
        const int nb = blocks - first < in_group ? blocks - first : in_group;
        repack_group(j->type, row + (int64_t)first * block_bytes(j->type), nb, out);
        out += GROUP_BYTES(j->type);
    }
}

/* rows x K weights of `type` as the file stores them (src) -> dst (rows x qd_packed_row_bytes).
 * 0, or -1 for a type the kernel does not take or a K that is not whole blocks. */
int qd_repack(int type, const void *src, int64_t rows, int64_t K, void *dst, int threads) {
    if (!GROUP_BYTES(type) || K % block_weights(type)) return -1;
    RepackJob job = {type, src, K, dst};
    qd_parallel(repack_row, &job, rows, threads);
    return 0;
}
