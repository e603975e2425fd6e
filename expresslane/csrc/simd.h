/* The SIMD helpers every kernel file shares: target attributes, masks, loaders, and the lane
   sums of a tile of rows.

   Each kernel is compiled for its instruction set with a target attribute (the rest of the
   extension stays baseline x86-64) and runs only where el_features() says the CPU has it.
   Every set includes T_F's (AVX-512 with FMA and F16C), so the helpers below inline anywhere. */
#ifndef EXPRESSLANE_SIMD_H
#define EXPRESSLANE_SIMD_H
#if defined(__x86_64__) && defined(__GNUC__)
#define EL_X86 1
#include <immintrin.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#ifdef EL_AVX2 /* the AVX2 build: every set is AVX2's, the AVX-512 intrinsics on two halves */
#define T_F __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define T_BF T_F
#define T_VNNI T_F
#include "simd_avx2.h"
#define AS_BH(v) (v) /* __m512bh is __m512i's two halves there */
#define DPBUSD2_U6 el_dpbusd2_u6
#else
#define AS_BH(v) ((__m512bh)(v))
/* two vpdpbusd where every unsigned byte is below 64 (one widening in the AVX2 build) */
#define DPBUSD2_U6(src, a1, b1, a2, b2)                                                          \
    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(src, a1, b1), a2, b2)
#define T_F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define T_BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")))
#define T_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512vnni")))
#endif

/* the first n (< 16) lanes */
#define MASK16(n) ((__mmask16)((1u << (n)) - 1))
/* the lanes of 16 starting at i that are below n */
#define MASK(n, i) ((n) - (i) >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ((n) - (i))) - 1))
/* the lanes of 16 starting at i that are below n, none where i >= n (a padded row's tail) */
#define MASK_PAD(n, i) ((n) > (i) ? MASK(n, i) : (__mmask16)0)
/* 32 bf16 values */
#define BF(p) AS_BH(_mm512_loadu_si512(p))

/* 16 weights from a row of fp32 / fp16 values, at k (masked: the lanes of m) */
T_F INLINE __m512 ld_f32(const void *w, int64_t k) { return _mm512_loadu_ps((const float *)w + k); }
T_F INLINE __m512 ldm_f32(const void *w, int64_t k, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)w + k);
}
T_F INLINE __m512 ld_f16(const void *w, int64_t k) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
}
T_F INLINE __m512 ldm_f16(const void *w, int64_t k, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k));
}

/* 16 floats from p at i, the last partial chunk masked (masked moves are slow on some cores) */
T_F INLINE __m512 load16(const float *p, int64_t n, int64_t i) {
    return n - i >= 16 ? _mm512_loadu_ps(p + i) : _mm512_maskz_loadu_ps(MASK(n, i), p + i);
}

/* e^x for x <= 0 (scores minus their max): 2^n 2^f, 2^f by its degree-6 Taylor polynomial on
   |f| <= 1/2 (relative error ~1e-7, an ulp); exactly 0 below -87 */
T_F INLINE __m512 exp_neg(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512 r = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), r);
}

/* max |x[k]| over k < K */
T_F INLINE float abs_max(const float *x, int64_t K) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x, K, k)));
    return _mm512_reduce_max_ps(amax);
}

/* four f16 scales (one per 32-value block of a 128-value group) as 16 fp32 lanes, each block's
   scale on the four lanes of its 128-bit quarter */
T_VNNI INLINE __m512 quarter_scales(__m128i d4) {
    const __m512i pick = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(d4)));
}
/* the lane sums of 16 vectors at once: lane j of the result is the sum of v[j]'s 16 lanes, in
   the same order for every j, (l0 + l2) + (l1 + l3) in each quarter, then (q0 + q1) + (q2 +
   q3): a row's bits do not depend on its slot. 45 instructions for 16 sums, and no chain of
   dependent ones as long as one _mm512_reduce_add_ps's per sum. */
T_F INLINE __m512 pair_sums(__m512 a, __m512 b) { /* per quarter: a0+a2 b0+b2 a1+a3 b1+b3 */
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
T_F INLINE __m512 quad_sums(__m512 p, __m512 q) { /* per quarter: 4 vectors' quarter sums */
    return _mm512_add_ps(_mm512_shuffle_ps(p, q, 0x44), _mm512_shuffle_ps(p, q, 0xEE));
}
T_F INLINE __m512 half_sums(__m512 a, __m512 b) { /* quarters 0 + 1 and 2 + 3, a's then b's */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
T_F INLINE __m512 sums16(const __m512 *v) {
    __m512 s[4];
    for (int i = 0; i < 4; i++)
        s[i] = quad_sums(pair_sums(v[4 * i], v[4 * i + 1]), pair_sums(v[4 * i + 2], v[4 * i + 3]));
    return half_sums(half_sums(s[0], s[1]), half_sums(s[2], s[3]));
}
#endif
#endif
