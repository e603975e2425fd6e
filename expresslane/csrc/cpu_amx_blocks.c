/* GGUF's blocks through AMX-INT8 tiles, for a prompt's chunks (EL_PROMPT): el_matmul_amx's tile
   of rows for Q8_0 (int8 values with an f16 scale d per 32, stored planar: quant.py), for the
   nibble formats with a scale per 32 values (below), and for those with an int8 scale per 16
   (el_amx_half_tile, at the end: the scale goes into the weight). For the blocks of 32
   (cpu_nibble.c decodes 16 rows of them into their values q less the format's centre c, a
   signed byte each, block by block in x's nibble order, and each block's scale d_b; where the
   offset is - c d_b sum x, q - c has it, and Q4_1, Q5_1, Q4_K and Q5_K add their mins' offsets
   from x's block sums, as their kernels do).

   Each block's integer dot is needed apart, to scale it by its own d. So a tile product here
   takes one block (16 rows x 32 values) for every token of a tile: x in 16-bit fixed point
   (cpu_activations.c's two bytes), its hi and lo parts summed exactly into two int32 tiles of
   16 rows x Tw tokens, then sum = 256 hi + lo (exact: |sum| < 2^28) goes to fp32 and is added to
   the row's and token's sum with its d:

       acc[r, t] = fma(float(sum), d[r, block], acc[r, t])    block by block, K in order
       y[t, r]   = fma(acc[r, t], sx[t], off[r, t])          (x's scale; nibbles' offsets)

   Each (row, token) takes the same operations in the same order whatever the tile's width or
   the other tokens in it. They are not cpu_matmul.c's vpdpbusd kernels' bits, which sum 16
   lanes per row, so only a prompt's chunks of enough tokens (cpu_amx.c's prompt_min; exact x)
   come here: decode and verify steps keep those kernels, whose bits they share, and a prompt's
   cache is then as near the forward's as theirs, not the same bits (as with the layers' GEMMs
   for longer prompts).

   Why: those kernels' work per token (two dot products and the scaling per 64 bytes of a row)
   bounds a prompt's chunk; a tile product does 16 rows x 32 values x Tw tokens at once
   (BENCHMARKS.md, "Q8_0 prompts in AMX tiles": 0.43x the time at 40 tokens, but 1.5-1.7x at
   one, which is why a decode step stays there; "The nibble formats' prompts in AMX tiles too":
   0.55x for Q4_0 and IQ4_XS, 0.75x for Q4_K). */

#include <stdlib.h>

#include "cpu_amx.h"

#ifdef EL_AMX
/* Q8_0's 16 rows' block scales as fp32, row-major (sc[r nblk + b]), zeros past the last row */
T_AMX static void row_scales(const uint16_t *d, int64_t nblk, int rows, float *sc) {
    for (int r = 0; r < 16; r++)
        for (int64_t b = 0; b < nblk; b += 16) {
            const __mmask16 m = r < rows ? MASK(nblk, b) : 0;
            const __m256i h = _mm256_maskz_loadu_epi16(m, d + r * nblk + b);
            _mm512_mask_storeu_ps(sc + r * nblk + b, MASK(nblk, b), _mm512_cvtph_ps(h));
        }
}

/* one block's sums of token block J into tiles CH and CL, then to memory: the weights signed,
   x's hi part signed, its lo part unsigned (Q8_0's split) or signed (the nibbles') */
#define BLOCK_DOTS(J, CH, CL, BL)                                                            \
    do {                                                                                     \
        const char *xk = xl + (int64_t)(J) * 2 * PB + kb * 8 * Tw * 4;                         \
        TILE_ZERO(CH);                                                                       \
        TILE_ZERO(CL);                                                                       \
        TILE_LOADD(7, xk, 4 * Tw);                                                           \
        TILE_DPBSSD(CH, 6, 7);                                                               \
        TILE_LOADD(BL, xk + PB, 4 * Tw);                                                     \
        if (LO_SIGNED)                                                                       \
            TILE_DPBSSD(CL, 6, BL);                                                          \
        else                                                                                 \
            TILE_DPBSUD(CL, 6, BL);                                                          \
        TILE_STORED(CH, ci + (J) * 32 * Tw, 4 * Tw);                                         \
        TILE_STORED(CL, ci + (J) * 32 * Tw + 16 * Tw, 4 * Tw);                               \
    } while (0)

/* vector v of a 16 x Tw tile (row-major): lane i is row (16 v + i) / Tw, so pick[16 v + i] */
T_AMX INLINE void tile_pick(int32_t *pick, int Tw) {
    for (int i = 0; i < 16 * Tw; i++) pick[i] = i / Tw;
}

/* token block j's vector v of a tile's sums (acc: 16 x Tw a block, row-major) += sum d, d the
   16 rows' scales spread over the vector's lanes by pick (tile_pick) */
T_AMX INLINE void add_scaled(float *acc, int j, int v, int Tw, __m512 sum, __m512 d,
                             const int32_t *pick) {
    const __m512 dv = Tw == 1 ? d : _mm512_permutexvar_ps(_mm512_loadu_si512(pick + 16 * v), d);
    float *a = acc + (j * Tw + v) * 16;
    _mm512_storeu_ps(a, _mm512_fmadd_ps(sum, dv, _mm512_loadu_ps(a)));
}

/* the outputs of a tile of rows: acc (nb blocks of 16 rows x Tw tokens, row-major) times x's
   scales sx (vector s L + l), plus the rows' offsets off (16 x S, or NULL), to y as el_matmul's */
T_AMX INLINE void put_tile(const float *acc, int Tw, int rows, const float *sx, const float *off,
                           int64_t S, int64_t L, int64_t l, float *y, int64_t ldy, int64_t n0) {
    const __mmask16 keep = rows == 16 ? (__mmask16)0xFFFF : MASK16(rows);
    const __m512i col = row_starts(Tw), orow = row_starts(S);
    for (int64_t s = 0; s < S; s++) { /* block s / Tw, its column s % Tw */
        const __m512 a = _mm512_i32gather_ps(col, acc + (s / Tw) * 16 * Tw + s % Tw, 4);
        const __m512 o = off ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, orow,
                                                        off + s, 4)
                             : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(y + (s * L + l) * ldy + n0, keep,
                              _mm512_fmadd_ps(a, _mm512_set1_ps(sx[s * L + l]), o));
    }
}

/* one tile of 16 rows (w: its first, rows rs bytes apart; `rows` of them real) with their
   blocks' scales sc (16 x K / 32) for nb blocks of Tw tokens, x's words at xl (each token block
   a hi then a lo plane of PB bytes), x's scales sx (vector s L + l), the rows' offsets off (16
   x S, or NULL); y as el_matmul's */
T_AMX INLINE void block_tile(const char *w, int64_t rs, int rows, const float *sc, int64_t K,
                             const char *xl, int64_t PB, int Tw, int nb, const float *sx,
                             const float *off, int64_t S, int64_t L, int64_t l, float *y,
                             int64_t ldy, int64_t n0, const int LO_SIGNED) {
    const int64_t nblk = K / 32;
    float acc[AMX_BLOCKS * 16 * AMX_TOKENS];
    int32_t ci[2 * AMX_BLOCKS * 16 * AMX_TOKENS];
    char buf[16 * 64];
    int32_t pick[AMX_TOKENS * 16];
    tile_pick(pick, Tw);
    memset(acc, 0, sizeof(float) * (size_t)(nb * 16 * Tw));
    const __m512i at = row_starts(nblk);
    for (int64_t kb = 0; kb < nblk; kb++) {
        PREFETCH_NEXT(w, rs, kb, 8);
        int64_t stride; /* set by weight_tile, before the load reads it */
        const char *wt = weight_tile(w, rs, rows, kb * 32, 32, buf, &stride);
        TILE_LOADD(6, wt, stride);
        if (nb == 1) {
            BLOCK_DOTS(0, 0, 1, 4);
        } else if (nb == 2) {
            BLOCK_DOTS(0, 0, 1, 4);
            BLOCK_DOTS(1, 2, 3, 4);
        } else {
            BLOCK_DOTS(0, 0, 1, 7);
            BLOCK_DOTS(1, 2, 3, 7);
            BLOCK_DOTS(2, 4, 5, 7);
        }
        const __m512 d = _mm512_i32gather_ps(at, sc + kb, 4); /* the 16 rows' d */
        for (int j = 0; j < nb; j++)
            for (int v = 0; v < Tw; v++) {
                const int32_t *c = ci + j * 32 * Tw + 16 * v;
                const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(c), 8),
                                                   _mm512_loadu_si512(c + 16 * Tw));
                add_scaled(acc, j, v, Tw, _mm512_cvtepi32_ps(s), d, pick);
            }
    }
    put_tile(acc, Tw, rows, sx, off, S, L, l, y, ldy, n0);
}

/* off[i S + s] = sum_j mt[16 j + i] (x's sum over group j: its blocks' sums from `at` on in
   P->xs, 0, or its half-blocks' from Kp / 32) for the 16 rows and each token s */
T_AMX static void min_offsets(const float *mt, int64_t groups, int64_t at, const xparts_t *P,
                              int64_t S, int64_t L, int64_t l, float *off) {
    const int64_t Kp = P->Kp;
    for (int64_t s = 0; s < S; s++) {
        const float *xs = P->xs + (s * L + l) * (Kp / 32 + Kp / 16) + at;
        __m512 o = _mm512_setzero_ps();
        for (int64_t j = 0; j < groups; j++)
            o = _mm512_fmadd_ps(_mm512_loadu_ps(mt + 16 * j), _mm512_set1_ps(xs[j]), o);
        float lanes[16];
        _mm512_storeu_ps(lanes, o);
        for (int i = 0; i < 16; i++) off[i * S + s] = lanes[i];
    }
}

T_AMX void el_amx_q8_0_tile(const qmat_t *m, const char *w, int64_t K, int rows, int64_t g,
                            const char *xl, int64_t PB, int Tw, int nb, const float *sx,
                            int64_t S, int64_t L, int64_t l, float *y, int64_t ldy, int64_t n0) {
    float sc[16 * AMX_Q8_BLOCKS];
    row_scales((const uint16_t *)m->scale + g * (K / 32), K / 32, rows, sc);
    block_tile(w, K, rows, sc, K, xl, PB, Tw, nb, sx, NULL, S, L, l, y, ldy, n0, 0);
}

T_AMX void el_amx_nibble_tile(const qmat_t *m, int64_t g, int64_t K, int rows,
                              const xparts_t *P, const char *xl, int64_t PB, int Tw, int nb,
                              int64_t S, int64_t L, int64_t l, float *y, int64_t ldy, int64_t n0,
                              char *work) {
    int8_t *q = (int8_t *)work; /* 16 rows of K bytes, their scales, offsets, then mins */
    float *sc = (float *)(work + 16 * K), *off = sc + 16 * (K / 32);
    const int centred = el_nibble_center((int)m->fmt) != 0;
    el_nibble_decode_tile(m, g, rows, K, q, sc);
    if (!centred) { /* mins of their own: off[i S + s] = sum_b m_b (x's sum over block b) */
        float *mt = off + 16 * S;
        el_nibble_tile_mins(m, g, rows, K, mt);
        min_offsets(mt, K / 32, 0, P, S, L, l, off);
    }
    block_tile((const char *)q, K, rows, sc, K, xl, PB, Tw, nb, P->sx, centred ? NULL : off, S,
               L, l, y, ldy, n0, 1);
}

/* A superblock's w x for a tile of 16 rows and one block of Tw tokens: w = 256 wh + wl (wl
   unsigned) and x = 256 a + b (both signed), four products a 64-byte step into three int32
   tiles: 0 sum wh a, 1 sum (wh b + wl a), 2 sum wl b; exact (|sum| < 2^24 over 256 values) */
#define SUPER_DOTS(XJ)                                                                       \
    do {                                                                                     \
        TILE_ZERO(0);                                                                        \
        TILE_ZERO(1);                                                                        \
        TILE_ZERO(2);                                                                        \
        for (int64_t k = sb * 256; k < sb * 256 + 256; k += 64) {                            \
            TILE_LOADD(3, wl + k, K);                                                        \
            TILE_LOADD(4, wh + k, K);                                                        \
            TILE_LOADD(5, (XJ) + k / 4 * Tw * 4, 4 * Tw);                                    \
            TILE_LOADD(6, (XJ) + PB + k / 4 * Tw * 4, 4 * Tw);                               \
            TILE_DPBSSD(0, 4, 5);                                                            \
            TILE_DPBSSD(1, 4, 6);                                                            \
            TILE_DPBUSD(1, 3, 5);                                                            \
            TILE_DPBUSD(2, 3, 6);                                                            \
        }                                                                                    \
        TILE_STORED(0, ci, 4 * Tw);                                                          \
        TILE_STORED(1, ci + 16 * Tw, 4 * Tw);                                                \
        TILE_STORED(2, ci + 32 * Tw, 4 * Tw);                                                \
    } while (0)

/* The formats with an int8 scale per 16 values (Q6_K, Q3_K, Q2_K, IQ2_XS, IQ2_S, IQ1_M): those
   scales cannot wait for a block's dot as Q8_0's d does, 16 values being a quarter of a tile
   product's depth. So the scale goes into the weight, w = (q - c) s exact in int16 (at most
   4,096), and a tile product takes its two bytes as two planes; a superblock of 256 values,
   under one d, sums to

       w x = 65536 (sum wh a) + 256 (sum wh b + sum wl a) + sum wl b    (exact in double)

   rounded once to fp32 and added to the (row, token) sum with d. Q2_K adds its mins' offsets
   from x's half-block sums. Twice a block format's products, but a superblock's three sums are
   stored and scaled once where Q8_0 stores two per 32 values. */
T_AMX void el_amx_half_tile(const qmat_t *m, int64_t g, int64_t K, int rows, const xparts_t *P,
                            const char *xl, int64_t PB, int Tw, int nb, int64_t S, int64_t L,
                            int64_t l, float *y, int64_t ldy, int64_t n0, char *work) {
    const int64_t nsb = K / 256;
    uint8_t *wl = (uint8_t *)work; /* 16 rows of K low bytes, of K high ones, the d's, ... */
    int8_t *wh = (int8_t *)work + 16 * K;
    float *dsb = (float *)(work + 32 * K), *mt = dsb + 16 * nsb, *off = mt + K;
    const int mins = m->fmt == FMT_Q2_K;
    el_nibble_decode_half(m, g, rows, K, wl, wh, dsb, mins ? mt : NULL);
    if (mins) min_offsets(mt, K / 16, P->Kp / 32, P, S, L, l, off);
    float acc[AMX_BLOCKS * 16 * AMX_TOKENS];
    int32_t ci[3 * 16 * AMX_TOKENS];
    int32_t pick[AMX_TOKENS * 16];
    tile_pick(pick, Tw);
    memset(acc, 0, sizeof(float) * (size_t)(nb * 16 * Tw));
    const __m512i at = row_starts(nsb);
    const __m512d k8 = _mm512_set1_pd(256.0);
    for (int j = 0; j < nb; j++) /* a block of tokens at a time: three sums take tiles 0-2 */
        for (int64_t sb = 0; sb < nsb; sb++) {
            SUPER_DOTS(xl + (int64_t)j * 2 * PB);
            const __m512 d = _mm512_i32gather_ps(at, dsb + sb, 4); /* the 16 rows' d */
            for (int v = 0; v < Tw; v++) {
                const int32_t *c = ci + 16 * v;
                const __m512i t1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(c), 8),
                                                    _mm512_loadu_si512(c + 16 * Tw));
                const __m512i t2 = _mm512_loadu_si512(c + 32 * Tw);
                const __m512d lo = _mm512_fmadd_pd(
                    _mm512_cvtepi32_pd(_mm512_castsi512_si256(t1)), k8,
                    _mm512_cvtepi32_pd(_mm512_castsi512_si256(t2)));
                const __m512d hi = _mm512_fmadd_pd(
                    _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(t1, 1)), k8,
                    _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(t2, 1)));
                const __m512 sum = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo)),
                                                      _mm512_cvtpd_ps(hi), 1);
                add_scaled(acc, j, v, Tw, sum, d, pick);
            }
        }
    put_tile(acc, Tw, rows, P->sx, mins ? off : NULL, S, L, l, y, ldy, n0);
}
#endif
