/* The AVX-512 intrinsics the kernels use, on AVX2 (EL_AVX2: the extension's second build,
   expresslane._cpu_kernels_avx2, for the many CPUs without AVX-512: AMD before Zen 4, Intel's
   client cores).

   Each _mm512_* (and the AVX-512VL/BW 128/256-bit masked loads) the kernels call is renamed
   here to an el_* function of the same meaning on two 256-bit halves, so every kernel file
   compiles unchanged for AVX2. This file: the 512-bit types as structs of two ymm registers
   (GCC keeps them in registers after inlining; its own 64-byte vector types went through the
   stack, 5-10x slower), their halves, masks as vectors, loads and stores (never a byte past a
   mask: a prefix by vpmaskmovd, any other mask through a zeroed copy), and the renames;
   simd_avx2_ops.h: the arithmetic, conversions and lane moves, with their bits. AMX is not
   built here (cpu_amx.h). */
#ifndef EXPRESSLANE_SIMD_AVX2_H
#define EXPRESSLANE_SIMD_AVX2_H
#include <string.h>

#define EA INLINE __attribute__((target("avx2,fma,f16c,bmi,bmi2")))

/* the 512-bit types as two 256-bit halves (GCC keeps a struct of two ymm in registers; its
   own 64-byte vector types went through the stack, 20x slower) */
typedef struct { __m256 l, h; } el_f512;
typedef struct { __m256i l, h; } el_i512;
#define __m512 el_f512
#define __m512i el_i512
#define __m512bh el_i512

/* ---- halves and joins --------------------------------------------------------------------- */
EA __m256 f_lo(__m512 a) { return a.l; }
EA __m256 f_hi(__m512 a) { return a.h; }
EA __m512 f_join(__m256 l, __m256 h) { return (__m512){l, h}; }
EA __m256i i_lo(__m512i a) { return a.l; }
EA __m256i i_hi(__m512i a) { return a.h; }
EA __m512i i_join(__m256i l, __m256i h) { return (__m512i){l, h}; }
EA __m512 as_ps(__m512i a) { return f_join(_mm256_castsi256_ps(a.l), _mm256_castsi256_ps(a.h)); }
EA __m512i as_si(__m512 a) { return i_join(_mm256_castps_si256(a.l), _mm256_castps_si256(a.h)); }

#define F_2(fn, a, b) f_join(fn(f_lo(a), f_lo(b)), fn(f_hi(a), f_hi(b)))
#define I_2(fn, a, b) i_join(fn(i_lo(a), i_lo(b)), fn(i_hi(a), i_hi(b)))

/* ---- masks as vectors --------------------------------------------------------------------- */
EA __m256i mask8_32(unsigned m) { /* 8 bits -> 8 dword lanes of all ones / zeros */
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), bit), bit);
}
EA __m256i mask32_8(uint32_t m) { /* 32 bits -> 32 byte lanes of all ones / zeros */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}
EA __m512 mask16_ps(__mmask16 m) {
    return f_join(_mm256_castsi256_ps(mask8_32(m & 0xFF)), _mm256_castsi256_ps(mask8_32(m >> 8)));
}
EA __m512i mask64_8(__mmask64 m) { return i_join(mask32_8((uint32_t)m), mask32_8((uint32_t)(m >> 32))); }

/* n bytes where mask bit i of an element of `size` bytes is set, the rest zero: no byte read
   outside the mask (a tail at the end of a buffer) */
static inline void masked_copy(void *dst, const void *src, uint64_t m, int n, int size) {
    memset(dst, 0, (size_t)n * size);
    for (int i = 0; i < n; i++)
        if (m >> i & 1) memcpy((char *)dst + i * size, (const char *)src + i * size, size);
}
static inline void masked_store(void *dst, const void *src, uint64_t m, int n, int size) {
    for (int i = 0; i < n; i++)
        if (m >> i & 1) memcpy((char *)dst + i * size, (const char *)src + i * size, size);
}

/* p's first n (<= 32) bytes and zeros after, reading no byte past them: whole dwords by
   vpmaskmovd, the last 1-3 bytes one by one (a prefix mask is what the kernels' tails ask: a
   row's last blocks, every row; the byte-by-byte copy below cost a token ~2 ms) */
EA __m256i prefix_bytes(const void *p, int n) {
    const int w = n >> 2, r = n & 3;
    __m256i v = _mm256_maskload_epi32((const int *)p, mask8_32((1u << w) - 1));
    if (r) {
        const uint8_t *b = (const uint8_t *)p + 4 * w;
        const uint32_t t = b[0] | (r > 1 ? (uint32_t)b[1] << 8 : 0) | (r > 2 ? (uint32_t)b[2] << 16 : 0);
        v = _mm256_blendv_epi8(v, _mm256_set1_epi32((int)t), mask8_32(1u << w));
    }
    return v;
}
#define IS_PREFIX(m) (((m) & ((m) + 1)) == 0)
EA __m512i prefix_bytes64(const void *p, int n) {
    return i_join(prefix_bytes(p, n < 32 ? n : 32),
                  n > 32 ? prefix_bytes((const char *)p + 32, n - 32) : _mm256_setzero_si256());
}

/* ---- loads and stores ----------------------------------------------------------------------- */
EA __m512 el_loadu_ps(const void *p) {
    return f_join(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}
EA void el_storeu_ps(void *p, __m512 a) {
    _mm256_storeu_ps((float *)p, f_lo(a));
    _mm256_storeu_ps((float *)p + 8, f_hi(a));
}
EA __m512i el_loadu_si512(const void *p) {
    return i_join(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
EA void el_storeu_si512(void *p, __m512i a) {
    _mm256_storeu_si256((__m256i *)p, i_lo(a));
    _mm256_storeu_si256((__m256i *)p + 1, i_hi(a));
}
EA __m512 el_maskz_loadu_ps(__mmask16 m, const void *p) {
    if (m == 0xFFFF) return el_loadu_ps(p);
    const float *f = (const float *)p;
    return f_join(_mm256_maskload_ps(f, mask8_32(m & 0xFF)), _mm256_maskload_ps(f + 8, mask8_32(m >> 8)));
}
EA __m512 el_mask_loadu_ps(__m512 src, __mmask16 m, const void *p) {
    const __m512 v = el_maskz_loadu_ps(m, p), keep = mask16_ps(m);
    return f_join(_mm256_blendv_ps(f_lo(src), f_lo(v), f_lo(keep)), _mm256_blendv_ps(f_hi(src), f_hi(v), f_hi(keep)));
}
EA void el_mask_storeu_ps(void *p, __mmask16 m, __m512 a) {
    float *f = (float *)p;
    _mm256_maskstore_ps(f, mask8_32(m & 0xFF), f_lo(a));
    _mm256_maskstore_ps(f + 8, mask8_32(m >> 8), f_hi(a));
}
EA __m512i el_maskz_loadu_epi16(__mmask32 m, const void *p) {
    if (m == 0xFFFFFFFFu) return el_loadu_si512(p);
    if (IS_PREFIX(m)) return prefix_bytes64(p, 2 * __builtin_popcount(m));
    __m512i v;
    masked_copy(&v, p, m, 32, 2);
    return v;
}
EA __m512i el_maskz_loadu_epi8(__mmask64 m, const void *p) {
    if (m == ~0ull) return el_loadu_si512(p);
    if (m == 0xFFFFFFFFull) return i_join(_mm256_loadu_si256((const __m256i *)p), _mm256_setzero_si256());
    if (IS_PREFIX(m)) return prefix_bytes64(p, __builtin_popcountll(m));
    __m512i v;
    masked_copy(&v, p, m, 64, 1);
    return v;
}
EA void el_mask_storeu_epi8(void *p, __mmask64 m, __m512i a) {
    if (m == ~0ull) return el_storeu_si512(p, a);
    masked_store(p, &a, m, 64, 1);
}
EA __m256i el_mm256_maskz_loadu_epi16(__mmask16 m, const void *p) {
    if (m == 0xFFFF) return _mm256_loadu_si256((const __m256i *)p);
    if (IS_PREFIX(m)) return prefix_bytes(p, 2 * __builtin_popcount(m));
    __m256i v;
    masked_copy(&v, p, m, 16, 2);
    return v;
}
EA __m128i el_mm_maskz_loadu_epi16(__mmask8 m, const void *p) {
    if (m == 0xFF) return _mm_loadu_si128((const __m128i *)p);
    if (m == 0x0F) return _mm_loadl_epi64((const __m128i *)p); /* a group's four f16 scales */
    if (IS_PREFIX(m)) return _mm256_castsi256_si128(prefix_bytes(p, 2 * __builtin_popcount(m)));
    __m128i v;
    masked_copy(&v, p, m, 8, 2);
    return v;
}
EA __m128i el_mm_maskz_loadu_epi8(__mmask16 m, const void *p) {
    if (m == 0xFFFF) return _mm_loadu_si128((const __m128i *)p);
    if (IS_PREFIX(m)) return _mm256_castsi256_si128(prefix_bytes(p, __builtin_popcount(m)));
    __m128i v;
    masked_copy(&v, p, m, 16, 1);
    return v;
}
EA __m512i el_maskz_mov_epi8(__mmask64 m, __m512i a) { return I_2(_mm256_and_si256, a, mask64_8(m)); }
EA __m512 el_maskz_mov_ps(__mmask16 m, __m512 a) { return F_2(_mm256_and_ps, a, mask16_ps(m)); }
EA __m512 el_mask_blend_ps(__mmask16 m, __m512 a, __m512 b) { /* b where set */
    const __m512 s = mask16_ps(m);
    return f_join(_mm256_blendv_ps(f_lo(a), f_lo(b), f_lo(s)), _mm256_blendv_ps(f_hi(a), f_hi(b), f_hi(s)));
}
EA void el_mask_compressstoreu_ps(void *p, __mmask16 m, __m512 a) {
    float v[16], *o = (float *)p;
    el_storeu_ps(v, a);
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) *o++ = v[i];
}

#include "simd_avx2_ops.h"

#define _mm512_loadu_ps el_loadu_ps
#define _mm512_storeu_ps el_storeu_ps
#define _mm512_loadu_si512 el_loadu_si512
#define _mm512_store_si512 el_storeu_si512
#define _mm512_maskz_loadu_ps el_maskz_loadu_ps
#define _mm512_mask_loadu_ps el_mask_loadu_ps
#define _mm512_mask_storeu_ps el_mask_storeu_ps
#define _mm512_maskz_loadu_epi16 el_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi8 el_maskz_loadu_epi8
#define _mm512_mask_storeu_epi8 el_mask_storeu_epi8
#define _mm256_maskz_loadu_epi16 el_mm256_maskz_loadu_epi16
#define _mm_maskz_loadu_epi16 el_mm_maskz_loadu_epi16
#define _mm_maskz_loadu_epi8 el_mm_maskz_loadu_epi8
#define _mm512_maskz_mov_epi8 el_maskz_mov_epi8
#define _mm512_maskz_mov_ps el_maskz_mov_ps
#define _mm512_mask_blend_ps el_mask_blend_ps
#define _mm512_mask_compressstoreu_ps el_mask_compressstoreu_ps
#define _mm512_setzero_ps el_setzero_ps
#define _mm512_set1_ps el_set1_ps
#define _mm512_add_ps el_add_ps
#define _mm512_sub_ps el_sub_ps
#define _mm512_mul_ps el_mul_ps
#define _mm512_div_ps el_div_ps
#define _mm512_max_ps el_max_ps
#define _mm512_fmadd_ps el_fmadd_ps
#define _mm512_abs_ps el_abs_ps
#define _mm512_roundscale_ps el_roundscale_ps
#define _mm512_scalef_ps el_scalef_ps
#define _mm512_cmp_ps_mask el_cmp_ps_mask
#define _mm512_reduce_add_ps el_reduce_add_ps
#define _mm512_reduce_max_ps el_reduce_max_ps
#define _mm512_reduce_add_epi32 el_reduce_add_epi32
#define _mm512_cvtss_f32 el_cvtss_f32
#define _mm512_cvtps_epi32 el_cvtps_epi32_
#define _mm512_cvtepi32_ps el_cvtepi32_ps
#define _mm512_cvtph_ps el_cvtph_ps
#define _mm512_cvtepi8_epi32 el_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 el_cvtepu8_epi32
#define _mm512_cvtepu16_epi32 el_cvtepu16_epi32
#define _mm512_cvtepi8_epi16 el_cvtepi8_epi16
#define _mm512_cvtepi32_epi8 el_cvtepi32_epi8
#define _mm512_cvtepi32_epi16 el_cvtepi32_epi16
#define _mm512_cvtepi16_epi8 el_cvtepi16_epi8
#define _mm512_cvtneps_pbh el_cvtneps_pbh
#define _mm512_setzero_si512 el_setzero_si512
#define _mm512_set1_epi8 el_set1_epi8
#define _mm512_set1_epi16 el_set1_epi16
#define _mm512_set1_epi32 el_set1_epi32
#define _mm512_set1_epi64 el_set1_epi64
#define _mm512_set_epi32 el_set_epi32
#undef _mm512_setr_epi64
#define _mm512_setr_epi64 el_setr_epi64
#define _mm512_set_epi64 el_set_epi64
#define _mm512_add_epi32 el_add_epi32
#define _mm512_sub_epi32 el_sub_epi32
#define _mm512_sub_epi8 el_sub_epi8
#define _mm512_mullo_epi16 el_mullo_epi16
#define _mm512_min_epi32 el_min_epi32
#define _mm512_max_epi32 el_max_epi32
#define _mm512_and_si512 el_and_si512
#define _mm512_or_si512 el_or_si512
#define _mm512_shuffle_epi8 el_shuffle_epi8
#define _mm512_slli_epi32 el_slli_epi32
#define _mm512_srli_epi32 el_srli_epi32
#define _mm512_srai_epi32 el_srai_epi32
#define _mm512_srli_epi16 el_srli_epi16
#define _mm512_srai_epi16 el_srai_epi16
#define _mm512_srlv_epi16 el_srlv_epi16
#define _mm512_dpbusd_epi32 el_dpbusd_epi32
#define _mm512_dpbf16_ps el_dpbf16_ps
#define _mm512_castsi512_ps el_castsi512_ps
#define _mm512_castps_si512 el_castps_si512
#define _mm512_castsi512_si256 el_castsi512_si256
#define _mm512_castsi256_si512 el_castsi256_si512
#define _mm512_castps256_ps512 el_castps256_ps512
#define _mm512_zextps256_ps512 el_zextps256_ps512
#define _mm512_castps128_ps512 el_castps128_ps512
#define _mm512_extracti64x4_epi64 el_extracti64x4_epi64
#define _mm512_inserti64x4 el_inserti64x4
#define _mm512_broadcast_i64x4 el_broadcast_i64x4
#define _mm512_broadcast_i32x4 el_broadcast_i32x4
#define _mm512_unpacklo_ps el_unpacklo_ps
#define _mm512_unpackhi_ps el_unpackhi_ps
#define _mm512_shuffle_ps el_shuffle_ps
#define _mm512_shuffle_f32x4 el_shuffle_f32x4
#define _mm512_permutexvar_ps el_permutexvar_ps
#define _mm512_permutex2var_epi64 el_permutex2var_epi64
#endif
