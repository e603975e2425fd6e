/* What the AMX tile kernels share (cpu_amx.c: the driver, bf16 and int8; cpu_amx_blocks.c:
   Q8_0 and the nibble formats, a prompt's chunks):
   the target attribute, the tile configuration record, the weight tile loader and the
   prefetch of the next tile; the tile instructions themselves, or their emulation, come from
   cpu_amx_emulate.h. EL_AMX where the compiler knows the AMX intrinsics. */
#ifndef EXPRESSLANE_CPU_AMX_H
#define EXPRESSLANE_CPU_AMX_H
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "simd.h"

#if defined(EL_X86) && (defined(__clang__) || __GNUC__ >= 11) && !defined(EL_AVX2)
#define EL_AMX 1
#include "cpu_amx_emulate.h"
#define T_AMX                                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16,amx-tile,"   \
                          "amx-bf16,amx-int8")))
#define AMX_TOKENS 16 /* a tile's rows of 64 bytes: at most 16 tokens a block */
#define AMX_BLOCKS 3  /* blocks of one call: 40 tokens (cpu_matmul.c's bound) in 3 */
#define AMX_Q8_BLOCKS 512 /* Q8_0: a tile's scales on the stack, rows of K <= 16,384 */

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* 16 weight rows' `width` (<= 64) bytes from byte `at` where the tile lies whole in the matrix
   (rows of rb bytes), else a copy with zeros past the row and past the last row (no read past
   the matrix's end) */
INLINE const char *weight_tile(const char *w, int64_t rb, int rows, int64_t at, int width,
                               char *buf, int64_t *stride) {
    if (rows == 16 && at + width <= rb) return *stride = rb, w + at;
    memset(buf, 0, 16 * 64);
    const int64_t n = rb - at < width ? rb - at : width;
    for (int r = 0; r < rows; r++) memcpy(buf + 64 * r, w + r * rb + at, (size_t)n);
    return *stride = 64, buf;
}

/* 16 lanes 0, n, 2n, ...: where each of 16 rows of n entries starts */
T_AMX INLINE __m512i row_starts(int64_t n) {
    return _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)n));
}

/* The next tile's bytes (rows follow rows) into L2 while this one runs, `lines` a step of
   `width` bytes a row (16 x width / 64): per row read ahead (the rows' own streams) or not at
   all was slower (BENCHMARKS.md, "bf16 and int8 products in AMX tiles"). */
#define PREFETCH_NEXT(w, rb, kb, lines)                                                       \
    for (int i_ = 0; i_ < (lines); i_++)                                                      \
    _mm_prefetch((w) + 16 * (rb) + ((kb) * (lines) + i_) * 64, _MM_HINT_T1)

/* cpu_amx_blocks.c, Q8_0: one tile of `rows` <= 16 rows (w: its first; row g of the matrix)
   for nb blocks of Tw tokens, x's words at xl (each block a signed hi then an unsigned lo plane
   of PB bytes) and scales sx (vector s L + l); y as el_matmul's */
void el_amx_q8_0_tile(const qmat_t *m, const char *w, int64_t K, int rows, int64_t g,
                      const char *xl, int64_t PB, int Tw, int nb, const float *sx, int64_t S,
                      int64_t L, int64_t l, float *y, int64_t ldy, int64_t n0);
/* the same for a nibble format (el_nibble_tiles), x's words from its nibble order (P: its
   scales and block sums), work: AMX_NIBBLE_WORK(K, S) bytes of the calling thread's */
#define AMX_NIBBLE_WORK(K, S) (16 * (K) + 2 * 16 * ((K) / 32) * 4 + 16 * (S) * 4 + 64)
void el_amx_nibble_tile(const qmat_t *m, int64_t g, int64_t K, int rows, const xparts_t *P,
                        const char *xl, int64_t PB, int Tw, int nb, int64_t S, int64_t L,
                        int64_t l, float *y, int64_t ldy, int64_t n0, char *work);
/* the same for a format with an int8 scale per 16 values (IS_HALF16), work: AMX_HALF_WORK(K, S) */
#define AMX_HALF_WORK(K, S) (32 * (K) + 4 * (16 * ((K) / 256) + (K) + 16 * (S)) + 64)
void el_amx_half_tile(const qmat_t *m, int64_t g, int64_t K, int rows, const xparts_t *P,
                      const char *xl, int64_t PB, int Tw, int nb, int64_t S, int64_t L, int64_t l,
                      float *y, int64_t ldy, int64_t n0, char *work);
#endif
#endif
