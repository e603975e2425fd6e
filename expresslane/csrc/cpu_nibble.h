/* Decoding GGUF's 1- to 6-bit formats as re-laid at load (cpu_nibble.c's comment has the
   formats): a group of 128 values (four 32-value blocks) into its nibble values and scales, one
   row's pointers, and the list of the formats. Shared by the products (cpu_nibble.c) and the
   dequantization (cpu_dequant.c), so that both read a weight the same way. */
#ifndef EXPRESSLANE_CPU_NIBBLE_H
#define EXPRESSLANE_CPU_NIBBLE_H
#include <string.h>

#include "cpu_kernels.h"
#include "simd.h"

/* every nibble format, once: each gets its span and decoder functions, and a case in
   el_span_nibble's (cpu_nibble.c) and el_dequant's (cpu_dequant.c) switches */
#define NIBBLE_FORMATS(X)                                                                      \
    X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q4_K) X(Q5_K) X(Q6_K) X(Q3_K) X(Q2_K) X(IQ4_NL) X(IQ4_XS) \
    X(MXFP4) X(NVFP4) X(Q1_0) X(IQ3_S) X(IQ3_XXS) X(IQ2_XXS) X(IQ1_S) X(IQ2_XS) X(IQ2_S) X(IQ1_M)

/* those with an int8 scale per 16 values (IS_HALF16), for cpu_nibble.c's decode into tiles */
#define HALF16_FORMATS(X) X(Q6_K) X(Q3_K) X(Q2_K) X(IQ2_XS) X(IQ2_S) X(IQ1_M)

#ifdef EL_X86


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

#endif
#endif
