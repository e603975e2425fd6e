/* Q8_0 weights through AMX-INT8 tiles: el_matmul_amx's tile of rows for GGUF Q8_0 (blocks of 32
   int8 values with an f16 scale d each, stored planar: quant.py).

   A Q8_0 product needs each block's integer dot apart, to scale it by its d. So a tile product
   here takes one block (16 rows x 32 values) for every token of a tile: x in 16-bit fixed point
   (cpu_activations.c's two bytes, q = 256 a + b, the hi byte signed here), its hi and lo parts
   summed exactly into two int32 tiles of 16 rows x Tw tokens, then sum = 256 hi + lo (exact:
   |sum| < 2^28) goes to fp32 and is added to the row's and token's sum with its d:

       acc[r, t] = fma(float(sum), d[r, block], acc[r, t])    block by block, K in order
       y[t, r]   = acc[r, t] * sx[t]                          (x's scale)

   Each (row, token) takes the same operations in the same order whatever the tile's width or
   the other tokens in it, so a row's bits do not depend on S (tests/test_packed_verify.py).
   They are not cpu_matmul.c's vpdpbusd kernel's bits, which sum 16 lanes per row, so only a
   prompt's chunks of at least AMX_Q8_PROMPT_MIN tokens come here (EL_PROMPT, exact x): decode
   and verify steps keep that kernel, whose bits they share, and a prompt's cache is then as
   near the forward's as the vpdpbusd kernel's, not the same bits (as with the layers' GEMMs
   for longer prompts).

   Why: the vpdpbusd kernel's work per token (two dot products and the scaling per 64 bytes of
   a row) bounds a prompt's chunk; a tile product does 16 rows x 32 values x Tw tokens at once
   (BENCHMARKS.md, "bf16 and int8 products in AMX tiles": 0.43x the time at 40 tokens, but
   1.5-1.7x at one, which is why a decode step stays there). */

#include "cpu_amx.h"

#ifdef EL_AMX
/* the 16 rows' block scales as fp32, row-major (sc[r nblk + b]), zeros past the last row */
T_AMX static void row_scales(const uint16_t *d, int64_t nblk, int rows, float *sc) {
    for (int r = 0; r < 16; r++)
        for (int64_t b = 0; b < nblk; b += 16) {
            const __mmask16 m = r < rows ? MASK(nblk, b) : 0;
            const __m256i h = _mm256_maskz_loadu_epi16(m, d + r * nblk + b);
            _mm512_mask_storeu_ps(sc + r * nblk + b, MASK(nblk, b), _mm512_cvtph_ps(h));
        }
}

/* one block's sums of token block J into tiles CH and CL (x's hi part signed, lo unsigned),
   then to memory */
#define Q8_DOTS(J, CH, CL, BL)                                                               \
    do {                                                                                     \
        const char *xk = xl + (int64_t)(J) * 2 * PB + kb * 8 * Tw * 4;                         \
        _tile_zero(CH);                                                                      \
        _tile_zero(CL);                                                                      \
        _tile_loadd(7, xk, 4 * Tw);                                                          \
        _tile_dpbssd(CH, 6, 7);                                                              \
        _tile_loadd(BL, xk + PB, 4 * Tw);                                                    \
        _tile_dpbsud(CL, 6, BL);                                                             \
        _tile_stored(CH, ci + (J) * 32 * Tw, 4 * Tw);                                        \
        _tile_stored(CL, ci + (J) * 32 * Tw + 16 * Tw, 4 * Tw);                              \
    } while (0)

T_AMX void el_amx_q8_0_tile(const qmat_t *m, const char *w, int64_t K, int rows, int64_t g,
                            const char *xl, int64_t PB, int Tw, int nb, const float *sx,
                            int64_t S, int64_t L, int64_t l, float *y, int64_t ldy, int64_t n0) {
    const int64_t nblk = K / 32;
    float sc[16 * AMX_Q8_BLOCKS], acc[AMX_BLOCKS * 16 * AMX_TOKENS];
    int32_t ci[2 * AMX_BLOCKS * 16 * AMX_TOKENS];
    char buf[16 * 64];
    int32_t pick[AMX_TOKENS * 16]; /* vector v of a 16 x Tw tile: lane i is row (16 v + i) / Tw */
    for (int i = 0; i < 16 * Tw; i++) pick[i] = i / Tw;
    memset(acc, 0, sizeof(float) * (size_t)(nb * 16 * Tw));
    row_scales((const uint16_t *)m->scale + g * nblk, nblk, rows, sc);
    const __m512i at = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)nblk));
    for (int64_t kb = 0; kb < nblk; kb++) {
        PREFETCH_NEXT(w, K, kb, 8);
        int64_t stride;
        _tile_loadd(6, weight_tile(w, K, rows, kb * 32, 32, buf, &stride), stride);
        if (nb == 1) {
            Q8_DOTS(0, 0, 1, 4);
        } else if (nb == 2) {
            Q8_DOTS(0, 0, 1, 4);
            Q8_DOTS(1, 2, 3, 4);
        } else {
            Q8_DOTS(0, 0, 1, 7);
            Q8_DOTS(1, 2, 3, 7);
            Q8_DOTS(2, 4, 5, 7);
        }
        const __m512 d = _mm512_i32gather_ps(at, sc + kb, 4); /* the 16 rows' d */
        for (int j = 0; j < nb; j++)
            for (int v = 0; v < Tw; v++) {
                const int32_t *c = ci + j * 32 * Tw + 16 * v;
                const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(c), 8),
                                                   _mm512_loadu_si512(c + 16 * Tw));
                const __m512 dv =
                    Tw == 1 ? d : _mm512_permutexvar_ps(_mm512_loadu_si512(pick + 16 * v), d);
                float *a = acc + (j * Tw + v) * 16;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dv,
                                                    _mm512_loadu_ps(a)));
            }
    }
    const __mmask16 keep = rows == 16 ? (__mmask16)0xFFFF : MASK16(rows);
    const __m512i col = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(Tw));
    for (int64_t s = 0; s < S; s++) { /* block s / Tw, its column s % Tw */
        const __m512 a = _mm512_i32gather_ps(col, acc + (s / Tw) * 16 * Tw + s % Tw, 4);
        _mm512_mask_storeu_ps(y + (s * L + l) * ldy + n0, keep,
                              _mm512_mul_ps(a, _mm512_set1_ps(sx[s * L + l])));
    }
}
#endif
