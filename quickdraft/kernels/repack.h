/* The layout the quantized kernel reads (repack.c writes it, quant_matmul.c reads it): a weight
 * row is cut into groups of 256 weights (a K-quant superblock, or 8 consecutive 32-weight blocks,
 * the last group of a row padded with zero blocks), and each group holds the same numbers as the
 * file, exactly, rearranged so that int32 lane l of every integer product is 32-weight unit l.
 *
 * The weights of a group as 8 "byte vectors" U[0..7] of 32 bytes: byte 4l + t of U[i] is weight
 * 32l + 4i + t (l = unit 0..7, t = 0..3). Four bits of each are stored as nibbles: 4 vectors of 32
 * bytes, vector v holding U[2v] in its low nibbles and U[2v + 1] in its high ones. Group bytes:
 *   Q4_0 [8 x f16 d][nibbles]                         Q4_1 [8 x f16 d][8 x f16 m][nibbles]
 *   Q5_0 [8 x f16 d][8 x u32 fifth bits][nibbles]     Q5_1 [d][m][fifth bits][nibbles]
 *   Q8_0 [8 x f16 d][U[0..7] as signed bytes]
 *   Q4_K [f16 d, f16 dmin, 12 scale bytes as in the file][nibbles]
 *   Q5_K [the same 16 bytes][8 x u32 fifth bits][nibbles]
 *   Q6_K [f16 d][16 scales: the even groups of 16 weights, then the odd][2 x 32 bytes: the top two
 *        bits of U[4w + k] in bits 2k, 2k + 1 of vector w][nibbles]
 *   MXFP4 [8 x E8M0 scale bytes][nibbles: E2M1 codes, the kernel's table gives 2 x their value]
 * where u32 i has bit b set when weight byte b of U[i] has its fifth bit (value 16). A group is the
 * file's bytes in number, except a padded tail. */
#ifndef QD_REPACK_H
#define QD_REPACK_H
#include <stdint.h>

/* ggml's type ids */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };
#define GROUP 256    /* weights per group: one activation scale per row per group */
#define UNITS 8      /* 32-weight units per group: the int32 lanes */

#define K_QUANT(type) ((type) == Q4_K || (type) == Q5_K || (type) == Q6_K)
/* bytes of one group, per type; 0 for types the kernel does not take */
#define GROUP_BYTES(type) ((type) == Q4_0 ? 144 : (type) == Q4_1 ? 160 : (type) == Q5_0 ? 176 : (type) == Q5_1 ? 192 \
                           : (type) == Q8_0 ? 272 : (type) == Q4_K ? 144 : (type) == Q5_K ? 176 : (type) == Q6_K ? 210 \
                           : (type) == MXFP4 ? 136 : 0)

/* Bytes of one repacked row of K weights (0 if the type is not taken). */
int64_t qd_packed_row_bytes(int type, int64_t K);

#endif
