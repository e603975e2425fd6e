/* The products of GGUF's 1- to 6-bit formats, read as stored (re-laid at load by
   expresslane/weights/gguf_blocks.py for 64-byte loads; never dequantized): for a block of T
   tokens, one weight row at a time, each group of 128 values (four 32-value blocks) split into its
   values and scales once and used for every token of the block.

   Every value is q = (4 low bits, or 2 for the crumb formats) + 4 (bit 2: q3_K) + 16 (bit 4) +
   32 (bit 5), unsigned (the grid formats: u, the grid value of a 4-bit index plus 128), in a
   block with a scale and an offset, w = d_b q + m_b:

     q4_0   d f16, m = -8 d              q4_1   d, m f16
     q5_0   d f16, m = -16 d             q5_1   d, m f16
     q1_0   d f16 per 128, m = -d, q = 2 bit (its bits as q5's masks, no nibbles)
     q4_K   per 256: d, dmin f16, per 32 a 6-bit scale s and min m: w = (d s) q - (dmin m)
     q5_K   as q4_K, one more bit
     q6_K   per 256: d f16, per 16 an int8 scale s: w = (d s) (q - 32)
     q3_K   per 256: d f16, per 16 an int8 scale s: w = (d s) (q - 4), q of 3 bits
     q2_K   per 256: d, dmin f16, per 16 a 4-bit scale s and min m: w = (d s) q - (dmin m)
     iq4_NL d f16, q an index into a grid of 16 (weights/blocks.py): w = d (u - 128)
     mxfp4  as iq4_NL on MXFP4's grid, d = 2^(e - 128) (an f16 at load)
     nvfp4  as mxfp4 with a d per 16 values (half NVFP4's UE4M3 scale, an f16 at load), its
            blocks with their middle quarters swapped as stored
     iq4_XS per 256: d f16, per 32 an int8 scale s: w = (d s) (u - 128)
     codebooks  GGUF's IQ3_S ... IQ1_M re-laid as nibbles (weights/grids.py): as iq4_XS on
            their own grid, with a scale per 32 or (IQ2_XS, IQ2_S, IQ1_M) per 16 values, times
            a power of two f: w = (d s f) (u - 128)

   Q3_K and Q2_K keep 2 low bits a value as stored (crumbs, four a byte), spread into the
   nibbles' two vectors by one broadcast load and two shifts. The grid formats' nibbles are
   looked up (vpshufb) into u = grid + 128, unsigned, whose offset is -128.

   The nibbles are vpdpbusd's unsigned operand, x's two signed bytes (cpu_activations.c) the
   other: per block sum q x = 256 sum q a + sum q b exactly in int32 (< 2^24, so exact in fp32
   too; the IQ4 formats' u up to 241 reach 2^26, rounded once to fp32), times d_b in fp32.
   The offsets are sum_b m_b sum_{k in b} x', from the block sums of the rounded x', so that a
   row is sum w x' (cpu_activations.c). With x in 8 bits (xparts_t's lowp, a prompt's opt-in)
   a is q itself with a scale per block, sum q a times d_b sx_b (half the dot products). The
   blocks of the formats with 16-value scales (Q6_K, Q3_K, Q2_K) come with their middle 8-value
   quarters swapped (weights/blocks.py; NVFP4's as stored), so that a byte's two nibbles share a
   scale: its lanes' scales go by halves of quarters. The high bits come as byte masks
   (vpmovm2b): for each group the mask of its low-nibble values, then of its high-nibble ones (per
   bit); Q1_0's one bit too.

   `el_dequant` writes the values themselves (fp32 or bf16), decoded by the same group loader:
   a long prefill multiplies them in bf16 (step/prefill.py); weights/blocks.py's `dequantize`
   is its reference, bit for bit. Q8_0's is here too, as the one other block format. */

#include <string.h>

#include "cpu_kernels.h"
#include "simd.h"

#ifdef EL_X86

#define IS_NL(F) ((F) == FMT_IQ4_NL || (F) == FMT_MXFP4) /* a grid, an f16 d per 32 */
#define IS_GRID(F) (IS_NL(F) || IS_XS(F) || IS_GRID16(F) || (F) == FMT_NVFP4)

/* the grids (weights/grids.py) plus 128, unsigned bytes: IQ4's (ggml's kvalues_iq4nl) and the
   codebook types' values (unused places: 0) */
static const uint8_t IQ4_U[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197,
                                  217, 241};
static const uint8_t ODD_U[16] = {113, 115, 117, 119, 121, 123, 125, 127, 129, 131, 133, 135, 137,
                                  139, 141, 143};
static const uint8_t IQ3_XXS_U[16] = {66, 76, 84, 92, 100, 108, 116, 124, 132, 140, 148, 156, 164,
                                      172, 180, 190};
static const uint8_t IQ2_U[16] = {85, 103, 120, 136, 153, 171, 128, 128, 128, 128, 128, 128, 128,
                                  128, 128, 128};
static const uint8_t IQ1_U[16] = {119, 121, 127, 129, 135, 137, 128, 128, 128, 128, 128, 128, 128,
                                  128, 128, 128};
static const uint8_t MXFP4_U[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124,
                                    122, 120, 116};

INLINE const uint8_t *grid_u(const int FMT) {
    return FMT == FMT_IQ3_S     ? ODD_U
           : FMT == FMT_IQ3_XXS ? IQ3_XXS_U
           : FMT == FMT_IQ2_XXS || FMT == FMT_IQ2_XS || FMT == FMT_IQ2_S ? IQ2_U
           : FMT == FMT_IQ1_S || FMT == FMT_IQ1_M ? IQ1_U
           : FMT == FMT_MXFP4 || FMT == FMT_NVFP4  ? MXFP4_U
                                                   : IQ4_U;
}

/* the power of two a codebook type's scales take (exact), 1 for the others */
INLINE float grid_f(const int FMT) {
    return FMT == FMT_IQ3_XXS ? 0.25f
           : FMT == FMT_IQ2_XXS || FMT == FMT_IQ2_XS || FMT == FMT_IQ2_S || FMT == FMT_IQ1_S ||
                   FMT == FMT_IQ1_M
               ? 0.125f
               : 1.0f;
}

/* per group: the values of its low and high nibbles (4 blocks x 16 bytes each), the scales of
   the blocks (16 lanes, a block's on its quarter; Q6_K, Q3_K, Q2_K: a 16-value scale on each
   half) */
typedef struct {
    __m512i lo, hi;
    __m512 dv;
} group_t;

/* a group's masks of one high bit: 2 n bytes for the low nibbles, then for the high (n blocks);
   masked loads, as a memcpy of a size known only at run time is a call */
T_VNNI INLINE void masks(const uint8_t *p, int64_t n, uint64_t *ml, uint64_t *mh) {
    const __mmask16 m = (__mmask16)((1u << (2 * n)) - 1);
    *ml = (uint64_t)_mm_cvtsi128_si64(_mm_maskz_loadu_epi8(m, p));
    *mh = (uint64_t)_mm_cvtsi128_si64(_mm_maskz_loadu_epi8(m, p + 2 * n));
}

T_VNNI INLINE void add_bit(group_t *G, const uint8_t *p, int64_t n, char bit) {
    uint64_t ml, mh;
    masks(p, n, &ml, &mh);
    const __m512i b = _mm512_set1_epi8(bit);
    G->lo = _mm512_or_si512(G->lo, _mm512_maskz_mov_epi8(ml, b));
    G->hi = _mm512_or_si512(G->hi, _mm512_maskz_mov_epi8(mh, b));
}

/* f16 d of the superblock times 4 byte scales (signed: int8, else uint8), each on its quarter */
T_VNNI INLINE __m512 k_scales(uint16_t d, __m128i s4, int is_signed) {
    const __m512i pick = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m128i s = is_signed ? _mm_cvtepi8_epi32(s4) : _mm_cvtepu8_epi32(s4);
    const __m128 ds = _mm_mul_ps(_mm_set1_ps(_cvtsh_ss(d)), _mm_cvtepi32_ps(s));
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(ds));
}

/* 8 values, value i on lanes 2i and 2i + 1 (a 16-value scale on the lanes of its half block) */
T_VNNI INLINE __m512 on_pairs(__m256 v) {
    const __m512i pick = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(pick, _mm512_castps256_ps512(v));
}

/* f16 d of the superblock times 8 byte scales of 16 values, scale i on lanes 2i and 2i + 1 */
T_VNNI INLINE __m512 half_scales(uint16_t d, __m256i s8) {
    return on_pairs(_mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d)), _mm256_cvtepi32_ps(s8)));
}

/* 2n f16 scales of 16 values (n <= 4 blocks), scale i on lanes 2i and 2i + 1 */
T_VNNI INLINE __m512 f16_halves(const uint16_t *d, int64_t n) {
    return on_pairs(_mm256_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << (2 * n)) - 1), d)));
}

/* Q1_0: the d of each of the 16 blocks of 32 from block b (a d per 4 blocks), zero past nb */
T_VNNI INLINE __m512 q1_scales(const uint16_t *d, int64_t nb, int64_t b) {
    const int64_t n4 = (nb - b >= 16 ? 16 : nb - b) / 4;
    return quarter_scales(_mm_maskz_loadu_epi16((__mmask8)((1u << n4) - 1), d + b / 4));
}

/* group g of a row (n <= 4 blocks in it) */
T_VNNI INLINE group_t load_group(const int FMT, const uint8_t *q, const uint16_t *d,
                                 const uint8_t *high, const int8_t *sub, int64_t g, int64_t n) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    group_t G;
    if (IS_BITS(FMT)) { /* 0 or 2 a value, from the group's masks */
        uint64_t ml, mh;
        masks(q + g * 16, n, &ml, &mh);
        G.lo = _mm512_maskz_mov_epi8(ml, _mm512_set1_epi8(2));
        G.hi = _mm512_maskz_mov_epi8(mh, _mm512_set1_epi8(2));
    } else if (IS_CRUMB(FMT)) { /* 32 bytes in both halves; lo: bits 0-1 | 2-3, hi: 4-5 | 6-7 */
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q + g * 32)));
        const __m512i three = _mm512_set1_epi8(3);
        const __m512i s_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        const __m512i s_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
        G.lo = _mm512_and_si512(_mm512_srlv_epi16(v, s_lo), three);
        G.hi = _mm512_and_si512(_mm512_srlv_epi16(v, s_hi), three);
    } else {
        const __mmask64 m = ((__mmask64)1 << (16 * n)) - 1;
        const __m512i v = n == 4 ? _mm512_loadu_si512(q + g * 64)
                                 : _mm512_maskz_loadu_epi8(m, q + g * 64);
        G.lo = _mm512_and_si512(v, low4);
        G.hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if (IS_GRID(FMT)) { /* indices -> the grid plus 128 */
        const __m512i u = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)grid_u(FMT)));
        G.lo = _mm512_shuffle_epi8(u, G.lo);
        G.hi = _mm512_shuffle_epi8(u, G.hi);
    }
    if (FMT == FMT_Q5_0 || FMT == FMT_Q5_1 || FMT == FMT_Q5_K) add_bit(&G, high + g * 16, n, 0x10);
    if (FMT == FMT_Q3_K) add_bit(&G, high + g * 16, 4, 0x04);
    if (FMT == FMT_Q6_K) {
        add_bit(&G, high + g * 32, 4, 0x10);
        add_bit(&G, high + g * 32 + 16, 4, 0x20);
    }
    if (FMT == FMT_Q4_K || FMT == FMT_Q5_K) { /* superblock g / 2, its scales 4 (g % 2) on */
        int32_t s;
        memcpy(&s, sub + (g / 2) * 16 + (g % 2) * 4, 4);
        G.dv = k_scales(d[g / 2], _mm_cvtsi32_si128(s), 0);
    } else if (IS_XS(FMT)) { /* an int8 scale per 32 values: 4 a group */
        int32_t s;
        memcpy(&s, sub + g * 4, 4);
        G.dv = k_scales(d[g / 2], _mm_cvtsi32_si128(s), 1);
    } else if (IS_HALF16(FMT)) { /* 8 scales of 16 values */
        int64_t s8;
        memcpy(&s8, sub + (g / 2) * 16 + (g % 2) * 8, 8);
        const __m128i s = _mm_cvtsi64_si128(s8);
        const __m128i s2 = _mm_and_si128(s, _mm_set1_epi8(0x0F)); /* q2_K: the scale, low 4 */
        G.dv = half_scales(d[g / 2], FMT == FMT_Q2_K ? _mm256_cvtepu8_epi32(s2)
                                                     : _mm256_cvtepi8_epi32(s));
    } else if (FMT == FMT_NVFP4) {
        G.dv = f16_halves(d + g * 8, n);
    } else if (FMT == FMT_Q1_0) { /* a group is a block of 128 */
        G.dv = _mm512_set1_ps(_cvtsh_ss(d[g]));
    } else {
        G.dv = quarter_scales(_mm_maskz_loadu_epi16((__mmask8)((1u << n) - 1), d + g * 4));
    }
    if (grid_f(FMT) != 1.0f) G.dv = _mm512_mul_ps(G.dv, _mm512_set1_ps(grid_f(FMT)));
    return G;
}

/* acc plus one token's part of a group (one fused multiply-add by the scales): p its chunk
   a_lo a_hi b_lo b_hi (LOWP: a_lo a_hi, then x's block scales as 16 lanes, which multiply the
   weights' first) */
T_VNNI INLINE __m512 group_tok(const group_t *G, const char *p, __m512 acc, const int LOWP) {
    const __m512i z = _mm512_setzero_si512();
    const __m512i al = _mm512_loadu_si512(p), ah = _mm512_loadu_si512(p + 64);
    __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, G->lo, al), G->hi, ah);
    if (LOWP) {
        const __m512 s = _mm512_mul_ps(G->dv, _mm512_loadu_ps((const float *)(p + 128)));
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc);
    }
    /* 256 sum q a + sum q b: b's dot products accumulate onto a's shifted (an add less; exact
       in int32, as shifts distribute over the sums) */
    const __m512i bl = _mm512_loadu_si512(p + 128), bh = _mm512_loadu_si512(p + 192);
    t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), G->lo, bl), G->hi, bh);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), G->dv, acc);
}

/* sum_b m_b (sum of x over block b) as 16 lanes to be summed, for each of T tokens (xs[t]: the
   token's block sums then half-block sums): each scale vector is loaded and converted once for
   all T, and every token's sum runs over the blocks in the same order whatever T is */
T_VNNI INLINE void offset_lanes(const int FMT, const uint16_t *d, const uint16_t *mn,
                                const int8_t *sub, const float *const *xs, int64_t nb,
                                int64_t Kp, __m512 *off, const int T) {
    __m512 acc[TMAX];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    if (FMT == FMT_Q4_K || FMT == FMT_Q5_K || IS_XS(FMT)) { /* per 32 values: the K-quants'
        - dmin m_j, the XS grids' - 128 f d s_j; a superblock of 8 blocks at a time */
        __m256 a8[TMAX];
        for (int t = 0; t < T; t++) a8[t] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nb / 8; sb++) {
            int64_t m8;
            memcpy(&m8, IS_XS(FMT) ? sub + sb * 8 : sub + sb * 16 + 8, 8);
            const __m128i m = _mm_cvtsi64_si128(m8);
            __m256 mf = _mm256_cvtepi32_ps(IS_XS(FMT) ? _mm256_cvtepi8_epi32(m)
                                                      : _mm256_cvtepu8_epi32(m));
            const uint16_t h = IS_XS(FMT) ? d[sb] : mn[sb];
            __m256 dm = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(h)), mf);
            for (int t = 0; t < T; t++)
                a8[t] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xs[t] + sb * 8), a8[t]);
        }
        const __m256 k = _mm256_set1_ps(IS_XS(FMT) ? -128.0f * grid_f(FMT) : -1.0f);
        for (int t = 0; t < T; t++) off[t] = _mm512_zextps256_ps512(_mm256_mul_ps(a8[t], k));
        return;
    }
    if (IS_HALF16(FMT)) { /* per 16 values: - 32 d s_j (q6_K), - 4 d s_j (q3_K), - dmin m_j,
                             - 128 f d s_j (GRID16) */
        for (int64_t sb = 0; sb < nb / 8; sb++) {
            const __m128i s = _mm_loadu_si128((const __m128i *)(sub + sb * 16));
            __m512 sf = _mm512_cvtepi32_ps(FMT == FMT_Q2_K
                                               ? _mm512_srli_epi32(_mm512_cvtepu8_epi32(s), 4)
                                               : _mm512_cvtepi8_epi32(s));
            const uint16_t h = FMT == FMT_Q2_K ? mn[sb] : d[sb];
            __m512 ds = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(h)), sf);
            for (int t = 0; t < T; t++)
                acc[t] = _mm512_fmadd_ps(ds, _mm512_loadu_ps(xs[t] + Kp / 32 + sb * 16), acc[t]);
        }
        const float k = FMT == FMT_Q6_K   ? -32.0f
                        : FMT == FMT_Q3_K ? -4.0f
                        : IS_GRID16(FMT)  ? -128.0f * grid_f(FMT)
                                          : -1.0f;
        for (int t = 0; t < T; t++) off[t] = _mm512_mul_ps(acc[t], _mm512_set1_ps(k));
        return;
    }
    /* an f16 scale per block of 32 (NVFP4: per 16 values, with x's 16-value sums after the
       32-value ones), times x's sums */
    const uint16_t *src = FMT == FMT_Q4_1 || FMT == FMT_Q5_1 ? mn : d;
    const int64_t n = FMT == FMT_NVFP4 ? 2 * nb : nb, at = FMT == FMT_NVFP4 ? Kp / 32 : 0;
    const float k = FMT == FMT_Q1_0                 ? -1.0f
                    : FMT == FMT_Q4_0               ? -8.0f
                    : FMT == FMT_Q5_0               ? -16.0f
                    : IS_NL(FMT) || FMT == FMT_NVFP4 ? -128.0f
                                                    : 1.0f;
    for (int64_t b = 0; b < n; b += 16) { /* the last 16 masked */
        const __mmask16 m = MASK(n, b);
        __m512 mv = FMT == FMT_Q1_0 ? q1_scales(src, nb, b)
                                    : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + b));
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(m, xs[t] + at + b), acc[t]);
    }
    for (int t = 0; t < T; t++)
        off[t] = k == 1.0f ? acc[t] : _mm512_mul_ps(acc[t], _mm512_set1_ps(k));
}

/* one row for T tokens: res[t] = sx[t] (its dot in units of x's scale) + its offsets, as 16
   lanes (EL_TILES sums them, 16 rows at once) */
T_VNNI INLINE void rows_t(const int FMT, const uint8_t *q, const uint16_t *d, const uint16_t *mn,
                          const uint8_t *high, const int8_t *sub, const char *xp,
                          const float *const *xs, const float *sx, int64_t K, int64_t Kp,
                          __m512 *res, const int T, const int LOWP) {
    const int64_t CB = LOWP ? 192 : 256, nb = K / 32;
    /* one accumulator a token: T of them are the independent chains (a second per token, for
       odd groups, was no faster at T = 1 and slower at T = 5). Measured and not taken
       (BENCHMARKS.md, 2026-11-28): two rows at a time sharing x's loads (level), and blocks of
       6 or 8 tokens, which one accumulator would allow (1.1-1.25x the time at 40 tokens). */
    __m512 acc[TMAX];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; (g + 1) * 4 <= nb; g++) {
        const group_t G = load_group(FMT, q, d, high, sub, g, 4);
        for (int t = 0; t < T; t++) acc[t] = group_tok(&G, xp + (g * T + t) * CB, acc[t], LOWP);
    }
    if (g * 4 < nb) { /* the last 1-3 blocks (legacy formats: K % 256 may be nonzero) */
        const group_t G = load_group(FMT, q, d, high, sub, g, nb - g * 4);
        for (int t = 0; t < T; t++) acc[t] = group_tok(&G, xp + (g * T + t) * CB, acc[t], LOWP);
    }
    __m512 off[TMAX];
    offset_lanes(FMT, d, mn, sub, xs, nb, Kp, off, T);
    for (int t = 0; t < T; t++)
        res[t] = _mm512_fmadd_ps(acc[t], _mm512_set1_ps(sx[t]), off[t]);
    /* LOWP: sx[t] is 1 (x's scales are in acc already): a multiply by 1 changes no bits */
}

/* row r of a matrix, its data at q: with its f16 scales, mins, high bits' masks and sub-scales */
typedef struct {
    const uint8_t *q, *high;
    const uint16_t *d, *mn;
    const int8_t *sub;
} wrow_t;

T_VNNI INLINE wrow_t wrow(const int FMT, const qmat_t *w, int64_t r, int64_t K, const char *q) {
    const int64_t per = SCALES_PER_ROW(FMT, K);
    wrow_t o;
    o.q = (const uint8_t *)q;
    o.d = (const uint16_t *)w->scale + r * per;
    o.mn = w->mins ? (const uint16_t *)w->mins + r * per : NULL;
    o.high = w->high ? (const uint8_t *)w->high + r * (K / (FMT == FMT_Q6_K ? 4 : 8)) : NULL;
    o.sub = w->sub ? (const int8_t *)w->sub + r * (K / (IS_XS(FMT) ? 32 : 16)) : NULL;
    return o;
}

/* one row for the T tokens of a span */
T_VNNI INLINE void row_t(const int FMT, const span_t *sp, int64_t r, const char *wr,
                         const char *xp, const int64_t *v, __m512 *res, const int T,
                         const int LOWP) {
    const int64_t K = sp->K, Kp = sp->P->Kp;
    const wrow_t w = wrow(FMT, sp->w, r, K, wr);
    const float *bsum[TMAX];
    float sx[TMAX];
    for (int t = 0; t < T; t++) {
        bsum[t] = sp->P->xs + v[t] * (Kp / 32 + Kp / 16);
        sx[t] = sp->P->sx[v[t]];
    }
    rows_t(FMT, w.q, w.d, w.mn, w.high, w.sub, xp, bsum, sx, K, Kp, res, T, LOWP);
}

/* every format of this file, once: each gets its span and decoder functions, and a case in
   el_span_nibble's and el_dequant's switches */
#define NIBBLE_FORMATS(X)                                                                      \
    X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q4_K) X(Q5_K) X(Q6_K) X(Q3_K) X(Q2_K) X(IQ4_NL) X(IQ4_XS) \
    X(MXFP4) X(NVFP4) X(Q1_0) X(IQ3_S) X(IQ3_XXS) X(IQ2_XXS) X(IQ1_S) X(IQ2_XS) X(IQ2_S) X(IQ1_M)

/* the rows of a span for T tokens (a constant: BY_T_LOWP) in format F_, a constant too */
#define ROWS(n, lp) EL_TILES(sp, r0, r1, rb, n, row_t(F_, sp, r, wr, xp, v, lanes, n, lp))
#define SPAN(F)                                                                  \
    T_VNNI static void span_##F(const span_t *sp, int64_t r0, int64_t r1) {      \
        const int F_ = FMT_##F;                                                  \
        const int64_t rb = el_row_bytes(F_, sp->K);                              \
        BY_T_LOWP(sp->T, sp->P->lowp, ROWS)                                      \
    }
NIBBLE_FORMATS(SPAN)

void el_span_nibble(const span_t *sp, int64_t r0, int64_t r1) {
#define SPAN_CASE(F) \
    case FMT_##F: span_##F(sp, r0, r1); break;
    switch ((int)sp->w->fmt) { NIBBLE_FORMATS(SPAN_CASE) }
#undef SPAN_CASE
}
/* ---- dequantization: the values themselves, for a prefill's GEMM (step/prefill.py) --------- */
/* 16 values to out at i: fp32, or bf16 rounded to nearest even (finite values: torch's
   rounding, without needing AVX512_BF16) */
T_VNNI INLINE void put16(void *out, int64_t i, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)out + i, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

T_VNNI INLINE __m512 u8_ps(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* block blk (32 values, q: its 16 low- and 16 high-nibble values) with weights/blocks.py's
   operations in its order: w = d (q - 8), d q + m, (d s) q - (dmin m), (d s) (q - 32), ... */
T_VNNI INLINE void deq_block(const int FMT, const uint8_t *ql, const uint8_t *qh,
                             const uint16_t *d, const uint16_t *mn, const int8_t *sub,
                             int64_t blk, void *out, int bf16) {
    __m512 q0 = u8_ps(ql), q1 = u8_ps(qh);
    const int64_t sb = blk / 8, j = blk % 8;
    __m512 w0, w1;
    if (IS_SWAPPED(FMT)) { /* quarters swapped: values 0-15 are the low nibbles' 0-7, then the
                              high ones' 0-7 */
        const __m512 v0 = _mm512_shuffle_f32x4(q0, q1, 0x44);
        q1 = _mm512_shuffle_f32x4(q0, q1, 0xEE);
        q0 = v0;
    }
    if (FMT == FMT_Q4_0 || FMT == FMT_Q5_0 || FMT == FMT_Q1_0) {
        const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d[FMT == FMT_Q1_0 ? blk / 4 : blk]));
        const __m512 off = _mm512_set1_ps(FMT == FMT_Q4_0 ? 8.0f : FMT == FMT_Q5_0 ? 16.0f : 1.0f);
        w0 = _mm512_mul_ps(dv, _mm512_sub_ps(q0, off));
        w1 = _mm512_mul_ps(dv, _mm512_sub_ps(q1, off));
    } else if (FMT == FMT_Q4_1 || FMT == FMT_Q5_1) {
        const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d[blk])), m = _mm512_set1_ps(_cvtsh_ss(mn[blk]));
        w0 = _mm512_add_ps(_mm512_mul_ps(dv, q0), m);
        w1 = _mm512_add_ps(_mm512_mul_ps(dv, q1), m);
    } else if (FMT == FMT_NVFP4) { /* the grid, a d per 16 values */
        const __m512 c = _mm512_set1_ps(128.0f);
        w0 = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(d[2 * blk])), _mm512_sub_ps(q0, c));
        w1 = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(d[2 * blk + 1])), _mm512_sub_ps(q1, c));
    } else if (IS_GRID(FMT) && !IS_GRID16(FMT)) { /* the grid: u - 128 */
        const __m512 c = _mm512_set1_ps(128.0f);
        const __m512 dv = _mm512_set1_ps(
            IS_NL(FMT) ? _cvtsh_ss(d[blk]) : _cvtsh_ss(d[sb]) * (float)sub[blk] * grid_f(FMT));
        w0 = _mm512_mul_ps(dv, _mm512_sub_ps(q0, c));
        w1 = _mm512_mul_ps(dv, _mm512_sub_ps(q1, c));
    } else if (FMT == FMT_Q2_K) { /* per 16 values a scale (low 4 bits) and a min (high 4) */
        const uint8_t *s = (const uint8_t *)sub + sb * 16 + 2 * j;
        const float dd = _cvtsh_ss(d[sb]), dm = _cvtsh_ss(mn[sb]);
        w0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dd * (float)(s[0] & 15)), q0),
                           _mm512_set1_ps(dm * (float)(s[0] >> 4)));
        w1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dd * (float)(s[1] & 15)), q1),
                           _mm512_set1_ps(dm * (float)(s[1] >> 4)));
    } else if (IS_HALF16(FMT)) { /* q6_K, q3_K, GRID16: an int8 scale per 16 values */
        const float dd = _cvtsh_ss(d[sb]), f = grid_f(FMT);
        const float c = FMT == FMT_Q6_K ? 32.0f : FMT == FMT_Q3_K ? 4.0f : 128.0f;
        const __m512 lo = _mm512_set1_ps(dd * (float)sub[sb * 16 + 2 * j] * f);
        const __m512 hi = _mm512_set1_ps(dd * (float)sub[sb * 16 + 2 * j + 1] * f);
        w0 = _mm512_mul_ps(lo, _mm512_sub_ps(q0, _mm512_set1_ps(c)));
        w1 = _mm512_mul_ps(hi, _mm512_sub_ps(q1, _mm512_set1_ps(c)));
    } else { /* q4_K, q5_K */
        const uint8_t *s = (const uint8_t *)sub + sb * 16;
        const __m512 ds = _mm512_set1_ps(_cvtsh_ss(d[sb]) * (float)s[j]);
        const __m512 dm = _mm512_set1_ps(_cvtsh_ss(mn[sb]) * (float)s[8 + j]);
        w0 = _mm512_sub_ps(_mm512_mul_ps(ds, q0), dm);
        w1 = _mm512_sub_ps(_mm512_mul_ps(ds, q1), dm);
    }
    put16(out, blk * 32, w0, bf16);
    put16(out, blk * 32 + 16, w1, bf16);
}

/* row r (K values) of a nibble-format matrix: its groups' values as the products read them */
T_VNNI INLINE void deq_row(const int FMT, const qmat_t *w, int64_t r, int64_t K, void *out,
                           int bf16) {
    const int64_t nb = K / 32;
    const wrow_t f = wrow(FMT, w, r, K, (const char *)w->data + r * el_row_bytes(FMT, K));
    uint8_t lo[64] __attribute__((aligned(64))), hi[64] __attribute__((aligned(64)));
    for (int64_t g = 0; g * 4 < nb; g++) {
        const int64_t n = nb - g * 4 >= 4 ? 4 : nb - g * 4;
        const group_t G = load_group(FMT, f.q, f.d, f.high, f.sub, g, n);
        _mm512_store_si512(lo, G.lo);
        _mm512_store_si512(hi, G.hi);
        for (int64_t b = 0; b < n; b++)
            deq_block(FMT, lo + 16 * b, hi + 16 * b, f.d, f.mn, f.sub, g * 4 + b, out, bf16);
    }
}

T_VNNI static void deq_q8_0_row(const qmat_t *w, int64_t r, int64_t K, void *out, int bf16) {
    const int8_t *q = (const int8_t *)w->data + r * K;
    const uint16_t *d = (const uint16_t *)w->scale + r * (K / 32);
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d[b]));
        for (int h = 0; h < 2; h++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(q + b * 32 + h * 16));
            put16(out, b * 32 + h * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), dv),
                  bf16);
        }
    }
}

#define DEQ(F)                                                                                 \
    T_VNNI static void deq_##F(const qmat_t *w, int64_t r, int64_t K, void *out, int bf16) {   \
        deq_row(FMT_##F, w, r, K, out, bf16);                                                  \
    }
NIBBLE_FORMATS(DEQ)

int el_dequant(const qmat_t *w, int64_t N, int64_t K, void *out, int bf16, int threads) {
    void (*row)(const qmat_t *, int64_t, int64_t, void *, int);
    switch ((int)w->fmt) {
    case FMT_Q8_0: row = deq_q8_0_row; break;
#define DEQ_CASE(F) \
    case FMT_##F: row = deq_##F; break;
        NIBBLE_FORMATS(DEQ_CASE)
#undef DEQ_CASE
    default: return -1;
    }
    if (!(el_features() & HAS_VNNI) || K % BLOCK_VALUES(w->fmt)) return -1;
    const int64_t rb = K * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < N; r++) row(w, r, K, (char *)out + r * rb, bf16);
    return 0;
}
#else
void el_span_nibble(const span_t *sp, int64_t r0, int64_t r1) { (void)sp, (void)r0, (void)r1; }
int el_dequant(const qmat_t *w, int64_t N, int64_t K, void *out, int bf16, int threads) {
    (void)w, (void)N, (void)K, (void)out, (void)bf16, (void)threads;
    return -1;
}
#endif
