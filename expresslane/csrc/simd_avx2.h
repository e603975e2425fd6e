/* The AVX-512 intrinsics the kernels use, on AVX2 (EL_AVX2: the extension's second build,
   expresslane._cpu_kernels_avx2, for the many CPUs without AVX-512: AMD before Zen 4, Intel's
   client cores).

   Each _mm512_* (and the AVX-512VL/BW 128/256-bit masked loads) the kernels call is renamed
   here to an el_* function of the same meaning on two 256-bit halves, so every kernel file
   compiles unchanged for AVX2 and gives the same bits: lane sums in the order GCC's own
   _mm512_reduce_* take them, VNNI's u8 x s8 sums exact (widened to 16 bits, never saturated),
   bf16 pair products added as vdpbf16ps adds them (the odd product, then the even: each product
   exact in fp32). Masked loads never read past their mask (a partial mask goes through a zeroed
   copy). The 512-bit types stay GCC's vector types: after inlining, each value lives in two
   ymm registers. AMX is not built here (cpu_amx.h). */
#ifndef EXPRESSLANE_SIMD_AVX2_H
#define EXPRESSLANE_SIMD_AVX2_H
#include <string.h>

#define EA INLINE __attribute__((target("avx2,fma,f16c,bmi,bmi2")))

/* the 512-bit types as two 256-bit halves (GCC keeps a struct of two ymm in registers; its
   own 64-byte vector types went through the stack, 20x slower) */
typedef struct { __m256 l, h; } el_f512;
typedef struct { __m256i l, h; } el_i512;
typedef struct { __m256d l, h; } el_d512;
#define __m512 el_f512
#define __m512i el_i512
#define __m512d el_d512
#define __m512bh el_i512

/* ---- halves and joins --------------------------------------------------------------------- */
EA __m256 f_lo(__m512 a) { return a.l; }
EA __m256 f_hi(__m512 a) { return a.h; }
EA __m512 f_join(__m256 l, __m256 h) { return (__m512){l, h}; }
EA __m256i i_lo(__m512i a) { return a.l; }
EA __m256i i_hi(__m512i a) { return a.h; }
EA __m512i i_join(__m256i l, __m256i h) { return (__m512i){l, h}; }
EA __m256d d_lo(__m512d a) { return a.l; }
EA __m256d d_hi(__m512d a) { return a.h; }
EA __m512d d_join(__m256d l, __m256d h) { return (__m512d){l, h}; }
EA __m512 as_ps(__m512i a) { return f_join(_mm256_castsi256_ps(a.l), _mm256_castsi256_ps(a.h)); }
EA __m512i as_si(__m512 a) { return i_join(_mm256_castps_si256(a.l), _mm256_castps_si256(a.h)); }

#define F_2(fn, a, b) f_join(fn(f_lo(a), f_lo(b)), fn(f_hi(a), f_hi(b)))
#define I_2(fn, a, b) i_join(fn(i_lo(a), i_lo(b)), fn(i_hi(a), i_hi(b)))
#define D_2(fn, a, b) d_join(fn(d_lo(a), d_lo(b)), fn(d_hi(a), d_hi(b)))

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
EA __m512i el_maskz_loadu_epi32(__mmask16 m, const void *p) {
    if (m == 0xFFFF) return el_loadu_si512(p);
    const int *q = (const int *)p;
    return i_join(_mm256_maskload_epi32(q, mask8_32(m & 0xFF)), _mm256_maskload_epi32(q + 8, mask8_32(m >> 8)));
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

/* ---- fp32 and fp64 arithmetic ------------------------------------------------------------ */
EA __m512 el_setzero_ps(void) { return f_join(_mm256_setzero_ps(), _mm256_setzero_ps()); }
EA __m512 el_set1_ps(float x) { return f_join(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
EA __m512d el_set1_pd(double x) { return d_join(_mm256_set1_pd(x), _mm256_set1_pd(x)); }
EA __m512 el_add_ps(__m512 a, __m512 b) { return F_2(_mm256_add_ps, a, b); }
EA __m512 el_sub_ps(__m512 a, __m512 b) { return F_2(_mm256_sub_ps, a, b); }
EA __m512 el_mul_ps(__m512 a, __m512 b) { return F_2(_mm256_mul_ps, a, b); }
EA __m512 el_div_ps(__m512 a, __m512 b) { return F_2(_mm256_div_ps, a, b); }
EA __m512 el_max_ps(__m512 a, __m512 b) { return F_2(_mm256_max_ps, a, b); }
EA __m512 el_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    return f_join(_mm256_fmadd_ps(f_lo(a), f_lo(b), f_lo(c)), _mm256_fmadd_ps(f_hi(a), f_hi(b), f_hi(c)));
}
EA __m512d el_mul_pd(__m512d a, __m512d b) { return D_2(_mm256_mul_pd, a, b); }
EA __m512d el_fmadd_pd(__m512d a, __m512d b, __m512d c) {
    return d_join(_mm256_fmadd_pd(d_lo(a), d_lo(b), d_lo(c)), _mm256_fmadd_pd(d_hi(a), d_hi(b), d_hi(c)));
}
EA __m512 el_abs_ps(__m512 a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return f_join(_mm256_and_ps(a.l, m), _mm256_and_ps(a.h, m));
}
EA __m512 el_roundscale_ps(__m512 a, int imm) { /* imm: nearest, no exceptions (exp_neg) */
    (void)imm;
    const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return f_join(_mm256_round_ps(f_lo(a), r), _mm256_round_ps(f_hi(a), r));
}
EA __m512 el_scalef_ps(__m512 a, __m512 n) { /* a 2^n, n integral and in [-126, 127] here */
    const __m256i b = _mm256_set1_epi32(127);
    const __m256i l = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.l), b), 23);
    const __m256i h = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.h), b), 23);
    return el_mul_ps(a, f_join(_mm256_castsi256_ps(l), _mm256_castsi256_ps(h)));
}
EA __mmask16 el_cmp_ps_mask(__m512 a, __m512 b, int imm) { /* _CMP_GT_OQ (exp_neg) */
    (void)imm;
    const int l = _mm256_movemask_ps(_mm256_cmp_ps(f_lo(a), f_lo(b), _CMP_GT_OQ));
    return (__mmask16)(l | _mm256_movemask_ps(_mm256_cmp_ps(f_hi(a), f_hi(b), _CMP_GT_OQ)) << 8);
}
/* GCC's _mm512_reduce_*_ps order: the halves, the quarters, then (0 2)(1 3), then 0 1 */
EA float red4_add(__m128 v) {
    v = _mm_add_ps(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return v[0] + v[1];
}
EA float el_reduce_add_ps(__m512 a) {
    const __m256 s = _mm256_add_ps(f_hi(a), f_lo(a));
    return red4_add(_mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s)));
}
EA float el_reduce_max_ps(__m512 a) {
    const __m256 s = _mm256_max_ps(f_hi(a), f_lo(a));
    __m128 v = _mm_max_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
    v = _mm_max_ps(v, _mm_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return v[0] > v[1] ? v[0] : v[1];
}
EA int el_reduce_add_epi32(__m512i a) {
    const __m256i s = _mm256_add_epi32(i_hi(a), i_lo(a));
    __m128i v = _mm_add_epi32(_mm256_extracti128_si256(s, 1), _mm256_castsi256_si128(s));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(v) + _mm_extract_epi32(v, 1);
}
EA float el_cvtss_f32(__m512 a) { return _mm256_cvtss_f32(a.l); }

/* ---- conversions -------------------------------------------------------------------------- */
EA __m512i el_cvtps_epi32_(__m512 a) { /* the rounding mode's (nearest even) */
    return i_join(_mm256_cvtps_epi32(f_lo(a)), _mm256_cvtps_epi32(f_hi(a)));
}
EA __m512 el_cvtepi32_ps(__m512i a) {
    return f_join(_mm256_cvtepi32_ps(i_lo(a)), _mm256_cvtepi32_ps(i_hi(a)));
}
EA __m512d el_cvtepi32_pd(__m256i a) {
    return d_join(_mm256_cvtepi32_pd(_mm256_castsi256_si128(a)), _mm256_cvtepi32_pd(_mm256_extracti128_si256(a, 1)));
}
EA __m256 el_cvtpd_ps(__m512d a) {
    return _mm256_set_m128(_mm256_cvtpd_ps(d_hi(a)), _mm256_cvtpd_ps(d_lo(a)));
}
EA __m512d el_cvtps_pd(__m256 a) {
    return d_join(_mm256_cvtps_pd(_mm256_castps256_ps128(a)), _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
}
EA __m512 el_cvtph_ps(__m256i a) {
    return f_join(_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
}
EA __m512i el_cvtepi8_epi32(__m128i a) {
    return i_join(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
EA __m512i el_cvtepu8_epi32(__m128i a) {
    return i_join(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}
EA __m512i el_cvtepu16_epi32(__m256i a) {
    return i_join(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
EA __m512i el_cvtepi8_epi16(__m256i a) {
    return i_join(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a, 1)));
}
/* truncations: the low byte (word) of each lane, in lane order */
EA __m128i el_cvtepi32_epi8(__m512i a) {
    const __m256i low = _mm256_set1_epi32(0xFF);
    const __m256i w = _mm256_packus_epi32(_mm256_and_si256(i_lo(a), low), _mm256_and_si256(i_hi(a), low));
    const __m256i b = _mm256_packus_epi16(w, w); /* per 128-bit lane: lo0 hi0 lo0 hi0 | lo1 hi1 .. */
    const __m256i o = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
    return _mm256_castsi256_si128(o);
}
EA __m256i el_cvtepi32_epi16(__m512i a) {
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    const __m256i w = _mm256_packus_epi32(_mm256_and_si256(i_lo(a), low), _mm256_and_si256(i_hi(a), low));
    return _mm256_permute4x64_epi64(w, _MM_SHUFFLE(3, 1, 2, 0));
}
EA __m256i el_cvtepi16_epi8(__m512i a) {
    const __m256i low = _mm256_set1_epi16(0xFF);
    const __m256i b = _mm256_packus_epi16(_mm256_and_si256(i_lo(a), low), _mm256_and_si256(i_hi(a), low));
    return _mm256_permute4x64_epi64(b, _MM_SHUFFLE(3, 1, 2, 0));
}
/* fp32 -> bf16, round to nearest even (a NaN stays a quiet NaN) */
EA __m256i bf16_round(__m256 v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, q, nan);
}
EA __m256bh el_cvtneps_pbh(__m512 a) {
    const __m256i w = _mm256_packus_epi32(bf16_round(f_lo(a)), bf16_round(f_hi(a)));
    return (__m256bh)_mm256_permute4x64_epi64(w, _MM_SHUFFLE(3, 1, 2, 0));
}

/* ---- integers ----------------------------------------------------------------------------- */
EA __m512i el_setzero_si512(void) { return i_join(_mm256_setzero_si256(), _mm256_setzero_si256()); }
EA __m512i el_set1_epi8(char x) { return i_join(_mm256_set1_epi8(x), _mm256_set1_epi8(x)); }
EA __m512i el_set1_epi16(short x) { return i_join(_mm256_set1_epi16(x), _mm256_set1_epi16(x)); }
EA __m512i el_set1_epi32(int x) { return i_join(_mm256_set1_epi32(x), _mm256_set1_epi32(x)); }
EA __m512i el_set1_epi64(long long x) { return i_join(_mm256_set1_epi64x(x), _mm256_set1_epi64x(x)); }
#define el_setr_epi32(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p)                              \
    i_join(_mm256_setr_epi32(a, b, c, d, e, f, g, h), _mm256_setr_epi32(i, j, k, l, m, n, o, p))
#define el_set_epi32(p, o, n, m, l, k, j, i, h, g, f, e, d, c, b, a)                               \
    i_join(_mm256_setr_epi32(a, b, c, d, e, f, g, h), _mm256_setr_epi32(i, j, k, l, m, n, o, p))
#define el_setr_epi64(a, b, c, d, e, f, g, h)                                                      \
    i_join(_mm256_setr_epi64x(a, b, c, d), _mm256_setr_epi64x(e, f, g, h))
#define el_set_epi64(h, g, f, e, d, c, b, a)                                                       \
    i_join(_mm256_setr_epi64x(a, b, c, d), _mm256_setr_epi64x(e, f, g, h))
EA __m512i el_add_epi32(__m512i a, __m512i b) { return I_2(_mm256_add_epi32, a, b); }
EA __m512i el_sub_epi32(__m512i a, __m512i b) { return I_2(_mm256_sub_epi32, a, b); }
EA __m512i el_sub_epi8(__m512i a, __m512i b) { return I_2(_mm256_sub_epi8, a, b); }
EA __m512i el_mullo_epi32(__m512i a, __m512i b) { return I_2(_mm256_mullo_epi32, a, b); }
EA __m512i el_mullo_epi16(__m512i a, __m512i b) { return I_2(_mm256_mullo_epi16, a, b); }
EA __m512i el_min_epi32(__m512i a, __m512i b) { return I_2(_mm256_min_epi32, a, b); }
EA __m512i el_max_epi32(__m512i a, __m512i b) { return I_2(_mm256_max_epi32, a, b); }
EA __m512i el_and_si512(__m512i a, __m512i b) { return I_2(_mm256_and_si256, a, b); }
EA __m512i el_or_si512(__m512i a, __m512i b) { return I_2(_mm256_or_si256, a, b); }
EA __m512i el_xor_si512(__m512i a, __m512i b) { return I_2(_mm256_xor_si256, a, b); }
EA __m512i el_shuffle_epi8(__m512i a, __m512i b) { return I_2(_mm256_shuffle_epi8, a, b); }
#define el_slli_epi32(a, n) i_join(_mm256_slli_epi32(i_lo(a), n), _mm256_slli_epi32(i_hi(a), n))
#define el_srli_epi32(a, n) i_join(_mm256_srli_epi32(i_lo(a), n), _mm256_srli_epi32(i_hi(a), n))
#define el_srai_epi32(a, n) i_join(_mm256_srai_epi32(i_lo(a), n), _mm256_srai_epi32(i_hi(a), n))
#define el_srli_epi16(a, n) i_join(_mm256_srli_epi16(i_lo(a), n), _mm256_srli_epi16(i_hi(a), n))
#define el_srai_epi16(a, n) i_join(_mm256_srai_epi16(i_lo(a), n), _mm256_srai_epi16(i_hi(a), n))
EA __m256i srlv16(__m256i a, __m256i n) { /* each 16-bit lane shifted by its own count */
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    const __m256i l = _mm256_srlv_epi32(_mm256_and_si256(a, low), _mm256_and_si256(n, low));
    const __m256i h = _mm256_srlv_epi32(_mm256_andnot_si256(low, a), _mm256_srli_epi32(n, 16));
    return _mm256_or_si256(_mm256_and_si256(l, low), _mm256_andnot_si256(low, h));
}
EA __m512i el_srlv_epi16(__m512i a, __m512i n) { return I_2(srlv16, a, n); }
/* src + the four u8(a) x s8(b) products of each dword, exact */
EA __m256i dpbusd(__m256i src, __m256i a, __m256i b) {
    const __m256i lo = _mm256_set1_epi16(0xFF);
    const __m256i ae = _mm256_and_si256(a, lo), ao = _mm256_srli_epi16(a, 8);
    const __m256i be = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), bo = _mm256_srai_epi16(b, 8);
    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(ae, be), _mm256_madd_epi16(ao, bo));
    return _mm256_add_epi32(src, s);
}
EA __m512i el_dpbusd_epi32(__m512i src, __m512i a, __m512i b) {
    return i_join(dpbusd(i_lo(src), i_lo(a), i_lo(b)), dpbusd(i_hi(src), i_hi(a), i_hi(b)));
}
/* src + a1 . b1 + a2 . b2 (per dword) where every byte of a1 and a2 is below 64: the four
   products of two bytes fit in vpmaddubsw's int16 sums together (4 x 63 x 128 < 2^15), so the
   two dot products share one widening */
EA __m256i dpbusd2_u6(__m256i src, __m256i a1, __m256i b1, __m256i a2, __m256i b2) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(a1, b1), _mm256_maddubs_epi16(a2, b2));
    return _mm256_add_epi32(src, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
EA __m512i el_dpbusd2_u6(__m512i src, __m512i a1, __m512i b1, __m512i a2, __m512i b2) {
    return i_join(dpbusd2_u6(i_lo(src), i_lo(a1), i_lo(b1), i_lo(a2), i_lo(b2)),
                  dpbusd2_u6(i_hi(src), i_hi(a1), i_hi(b1), i_hi(a2), i_hi(b2)));
}
/* src + a[2j + 1] b[2j + 1], then + a[2j] b[2j]: vdpbf16ps's order, each product exact */
EA __m256 dpbf16(__m256 src, __m256i a, __m256i b) {
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256 ao = _mm256_castsi256_ps(_mm256_and_si256(a, hi));
    const __m256 bo = _mm256_castsi256_ps(_mm256_and_si256(b, hi));
    const __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    const __m256 be = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    return _mm256_add_ps(_mm256_add_ps(src, _mm256_mul_ps(ao, bo)), _mm256_mul_ps(ae, be));
}
EA __m512 el_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
    return f_join(dpbf16(f_lo(src), i_lo(a), i_lo(b)), dpbf16(f_hi(src), i_hi(a), i_hi(b)));
}

/* ---- lanes -------------------------------------------------------------------------------- */
EA __m512 el_castsi512_ps(__m512i a) { return as_ps(a); }
EA __m512i el_castps_si512(__m512 a) { return as_si(a); }
EA __m256i el_castsi512_si256(__m512i a) { return i_lo(a); }
EA __m512i el_castsi256_si512(__m256i a) { return i_join(a, _mm256_setzero_si256()); }
EA __m256 el_castps512_ps256(__m512 a) { return f_lo(a); }
EA __m512 el_castps256_ps512(__m256 a) { return f_join(a, _mm256_setzero_ps()); }
EA __m512 el_zextps256_ps512(__m256 a) { return f_join(a, _mm256_setzero_ps()); }
EA __m512 el_castps128_ps512(__m128 a) { return f_join(_mm256_castps128_ps256(a), _mm256_setzero_ps()); }
EA __m256i el_extracti64x4_epi64(__m512i a, int i) { return i ? i_hi(a) : i_lo(a); }
EA __m256 el_extractf32x8_ps(__m512 a, int i) { return i ? f_hi(a) : f_lo(a); }
EA __m512i el_inserti64x4(__m512i a, __m256i b, int i) { return i ? i_join(i_lo(a), b) : i_join(b, i_hi(a)); }
EA __m512 el_insertf32x8(__m512 a, __m256 b, int i) { return i ? f_join(f_lo(a), b) : f_join(b, f_hi(a)); }
EA __m512i el_broadcast_i64x4(__m256i a) { return i_join(a, a); }
EA __m512i el_broadcast_i32x4(__m128i a) { return el_broadcast_i64x4(_mm256_broadcastsi128_si256(a)); }
EA __m512 el_unpacklo_ps(__m512 a, __m512 b) { return F_2(_mm256_unpacklo_ps, a, b); }
EA __m512 el_unpackhi_ps(__m512 a, __m512 b) { return F_2(_mm256_unpackhi_ps, a, b); }
#define el_shuffle_ps(a, b, imm)                                                                 \
    f_join(_mm256_shuffle_ps(f_lo(a), f_lo(b), imm), _mm256_shuffle_ps(f_hi(a), f_hi(b), imm))
/* 128-bit lanes: a's (imm & 3) and (imm >> 2 & 3), then b's (imm >> 4 & 3) and (imm >> 6) */
EA __m512 el_shuffle_f32x4(__m512 a, __m512 b, int imm) {
    const __m128 q[8] = {_mm256_castps256_ps128(f_lo(a)), _mm256_extractf128_ps(f_lo(a), 1),
                         _mm256_castps256_ps128(f_hi(a)), _mm256_extractf128_ps(f_hi(a), 1),
                         _mm256_castps256_ps128(f_lo(b)), _mm256_extractf128_ps(f_lo(b), 1),
                         _mm256_castps256_ps128(f_hi(b)), _mm256_extractf128_ps(f_hi(b), 1)};
    return f_join(_mm256_set_m128(q[imm >> 2 & 3], q[imm & 3]),
                  _mm256_set_m128(q[4 + (imm >> 6 & 3)], q[4 + (imm >> 4 & 3)]));
}
EA __m256 perm16(__m512 a, __m256i idx) { /* a[idx & 15] in each of 8 lanes */
    const __m256 l = _mm256_permutevar8x32_ps(f_lo(a), idx), h = _mm256_permutevar8x32_ps(f_hi(a), idx);
    const __m256i high = _mm256_slli_epi32(idx, 28); /* bit 3 to the sign */
    return _mm256_blendv_ps(l, h, _mm256_castsi256_ps(high));
}
EA __m512 el_permutexvar_ps(__m512i idx, __m512 a) { return f_join(perm16(a, i_lo(idx)), perm16(a, i_hi(idx))); }
EA __m512i el_permutex2var_epi64(__m512i a, __m512i idx, __m512i b) {
    long long x[16], o[8];
    el_storeu_si512(x, a);
    el_storeu_si512(x + 8, b);
    long long ix[8];
    el_storeu_si512(ix, idx);
    for (int i = 0; i < 8; i++) o[i] = x[ix[i] & 15];
    return el_loadu_si512(o);
}
/* gathers and scatters (the AMX files' alone, not built here; kept for completeness of the set) */
#define el_i32gather_ps(idx, base, scale)                                                        \
    f_join(_mm256_i32gather_ps((const float *)(base), i_lo(idx), scale),                          \
           _mm256_i32gather_ps((const float *)(base), i_hi(idx), scale))

#define _mm512_loadu_ps el_loadu_ps
#define _mm512_storeu_ps el_storeu_ps
#define _mm512_loadu_si512 el_loadu_si512
#define _mm512_store_si512 el_storeu_si512
#define _mm512_maskz_loadu_ps el_maskz_loadu_ps
#define _mm512_mask_loadu_ps el_mask_loadu_ps
#define _mm512_mask_storeu_ps el_mask_storeu_ps
#define _mm512_maskz_loadu_epi32 el_maskz_loadu_epi32
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
#define _mm512_set1_pd el_set1_pd
#define _mm512_add_ps el_add_ps
#define _mm512_sub_ps el_sub_ps
#define _mm512_mul_ps el_mul_ps
#define _mm512_div_ps el_div_ps
#define _mm512_max_ps el_max_ps
#define _mm512_fmadd_ps el_fmadd_ps
#define _mm512_mul_pd el_mul_pd
#define _mm512_fmadd_pd el_fmadd_pd
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
#define _mm512_cvtepi32_pd el_cvtepi32_pd
#define _mm512_cvtpd_ps el_cvtpd_ps
#define _mm512_cvtps_pd el_cvtps_pd
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
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 el_setr_epi32
#define _mm512_set_epi32 el_set_epi32
#undef _mm512_setr_epi64
#define _mm512_setr_epi64 el_setr_epi64
#define _mm512_set_epi64 el_set_epi64
#define _mm512_add_epi32 el_add_epi32
#define _mm512_sub_epi32 el_sub_epi32
#define _mm512_sub_epi8 el_sub_epi8
#define _mm512_mullo_epi32 el_mullo_epi32
#define _mm512_mullo_epi16 el_mullo_epi16
#define _mm512_min_epi32 el_min_epi32
#define _mm512_max_epi32 el_max_epi32
#define _mm512_and_si512 el_and_si512
#define _mm512_or_si512 el_or_si512
#define _mm512_xor_si512 el_xor_si512
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
#define _mm512_castps512_ps256 el_castps512_ps256
#define _mm512_castps256_ps512 el_castps256_ps512
#define _mm512_zextps256_ps512 el_zextps256_ps512
#define _mm512_castps128_ps512 el_castps128_ps512
#define _mm512_extracti64x4_epi64 el_extracti64x4_epi64
#define _mm512_extractf32x8_ps el_extractf32x8_ps
#define _mm512_inserti64x4 el_inserti64x4
#define _mm512_insertf32x8 el_insertf32x8
#define _mm512_broadcast_i64x4 el_broadcast_i64x4
#define _mm512_broadcast_i32x4 el_broadcast_i32x4
#define _mm512_unpacklo_ps el_unpacklo_ps
#define _mm512_unpackhi_ps el_unpackhi_ps
#define _mm512_shuffle_ps el_shuffle_ps
#define _mm512_shuffle_f32x4 el_shuffle_f32x4
#define _mm512_permutexvar_ps el_permutexvar_ps
#define _mm512_permutex2var_epi64 el_permutex2var_epi64
#define _mm512_i32gather_ps el_i32gather_ps
#endif
