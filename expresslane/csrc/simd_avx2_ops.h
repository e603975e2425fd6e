/* simd_avx2.h's operations (arithmetic, conversions, integers, lane moves) on two 256-bit
   halves, with the bits of the AVX-512 instructions they stand for: lane sums in the order GCC's
   own _mm512_reduce_* take them, VNNI's u8 x s8 sums exact (widened to 16 bits, never
   saturated), bf16 pair products added as vdpbf16ps adds them (the odd product, then the even:
   each product exact in fp32). Included by simd_avx2.h alone. */
#ifndef EXPRESSLANE_SIMD_AVX2_OPS_H
#define EXPRESSLANE_SIMD_AVX2_OPS_H

/* ---- fp32 arithmetic ------------------------------------------------------------ */
EA __m512 el_setzero_ps(void) { return f_join(_mm256_setzero_ps(), _mm256_setzero_ps()); }
EA __m512 el_set1_ps(float x) { return f_join(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
EA __m512 el_add_ps(__m512 a, __m512 b) { return F_2(_mm256_add_ps, a, b); }
EA __m512 el_sub_ps(__m512 a, __m512 b) { return F_2(_mm256_sub_ps, a, b); }
EA __m512 el_mul_ps(__m512 a, __m512 b) { return F_2(_mm256_mul_ps, a, b); }
EA __m512 el_div_ps(__m512 a, __m512 b) { return F_2(_mm256_div_ps, a, b); }
EA __m512 el_max_ps(__m512 a, __m512 b) { return F_2(_mm256_max_ps, a, b); }
EA __m512 el_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    return f_join(_mm256_fmadd_ps(f_lo(a), f_lo(b), f_lo(c)), _mm256_fmadd_ps(f_hi(a), f_hi(b), f_hi(c)));
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
#define el_set_epi32(p, o, n, m, l, k, j, i, h, g, f, e, d, c, b, a)                               \
    i_join(_mm256_setr_epi32(a, b, c, d, e, f, g, h), _mm256_setr_epi32(i, j, k, l, m, n, o, p))
#define el_setr_epi64(a, b, c, d, e, f, g, h)                                                      \
    i_join(_mm256_setr_epi64x(a, b, c, d), _mm256_setr_epi64x(e, f, g, h))
#define el_set_epi64(h, g, f, e, d, c, b, a)                                                       \
    i_join(_mm256_setr_epi64x(a, b, c, d), _mm256_setr_epi64x(e, f, g, h))
EA __m512i el_add_epi32(__m512i a, __m512i b) { return I_2(_mm256_add_epi32, a, b); }
EA __m512i el_sub_epi32(__m512i a, __m512i b) { return I_2(_mm256_sub_epi32, a, b); }
EA __m512i el_sub_epi8(__m512i a, __m512i b) { return I_2(_mm256_sub_epi8, a, b); }
EA __m512i el_mullo_epi16(__m512i a, __m512i b) { return I_2(_mm256_mullo_epi16, a, b); }
EA __m512i el_min_epi32(__m512i a, __m512i b) { return I_2(_mm256_min_epi32, a, b); }
EA __m512i el_max_epi32(__m512i a, __m512i b) { return I_2(_mm256_max_epi32, a, b); }
EA __m512i el_and_si512(__m512i a, __m512i b) { return I_2(_mm256_and_si256, a, b); }
EA __m512i el_or_si512(__m512i a, __m512i b) { return I_2(_mm256_or_si256, a, b); }
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
/* a 256-bit half's even and odd bytes, each widened to its 16-bit lane (unsigned or signed):
   vpmaddwd of the two against 16-bit partners sums each dword's four bytes, as vpdpbusd does */
EA __m256i even_u8(__m256i a) { return _mm256_and_si256(a, _mm256_set1_epi16(0xFF)); }
EA __m256i odd_u8(__m256i a) { return _mm256_srli_epi16(a, 8); }
EA __m256i even_s8(__m256i a) { return _mm256_srai_epi16(_mm256_slli_epi16(a, 8), 8); }
EA __m256i odd_s8(__m256i a) { return _mm256_srai_epi16(a, 8); }
/* per dword e . x_e + o . x_o: the widened even and odd bytes e, o times 16-bit x_e, x_o */
EA __m256i madd_eo(__m256i e, __m256i o, __m256i xe, __m256i xo) {
    return _mm256_add_epi32(_mm256_madd_epi16(e, xe), _mm256_madd_epi16(o, xo));
}
/* src + the four u8(a) x s8(b) products of each dword, exact */
EA __m256i dpbusd(__m256i src, __m256i a, __m256i b) {
    return _mm256_add_epi32(src, madd_eo(even_u8(a), odd_u8(a), even_s8(b), odd_s8(b)));
}
EA __m512i el_dpbusd_epi32(__m512i src, __m512i a, __m512i b) {
    return i_join(dpbusd(i_lo(src), i_lo(a), i_lo(b)), dpbusd(i_hi(src), i_hi(a), i_hi(b)));
}
/* src + a1 . b1 + a2 . b2 (per dword) where every byte of a1 and a2 is below 64: the four
   products of two bytes fit in vpmaddubsw's int16 sums together (4 x 63 x 128 < 2^15), so the
   two dot products share one widening */
EA __m256i dpbusd2_u6(__m256i src, __m256i a1, __m256i b1, __m256i a2, __m256i b2) {
    const __m256i pairs =
        _mm256_add_epi16(_mm256_maddubs_epi16(a1, b1), _mm256_maddubs_epi16(a2, b2));
    return _mm256_add_epi32(src, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
EA __m512i el_dpbusd2_u6(__m512i src, __m512i a1, __m512i b1, __m512i a2, __m512i b2) {
    return i_join(dpbusd2_u6(i_lo(src), i_lo(a1), i_lo(b1), i_lo(a2), i_lo(b2)),
                  dpbusd2_u6(i_hi(src), i_hi(a1), i_hi(b1), i_hi(a2), i_hi(b2)));
}
/* the dwords of vpdpbusd(vpdpbusd(0, lo, a_lo), hi, a_hi) << 8 plus the same with b (the nibble
   kernels' sum over a group of 256 q a + q b), where x comes as x16 = 256 a + b itself: per
   256-bit half of lo and of hi, x16 of its even bytes then of its odd bytes (el_pack_block's
   order for the formats X16 names). A byte widened to 16 bits times x16 is exact in int32, and
   dword i sums bytes 4i..4i + 3 as vpdpbusd does, so the integers are the same: one vpmaddwd per
   16 values in place of the widening of both operands */
EA __m256i ld_x16(const char *x) { return _mm256_loadu_si256((const __m256i *)x); }
EA __m256i dot_x16(__m256i lo, __m256i hi, const char *xl, const char *xh) {
    return _mm256_add_epi32(madd_eo(even_u8(lo), odd_u8(lo), ld_x16(xl), ld_x16(xl + 32)),
                            madd_eo(even_u8(hi), odd_u8(hi), ld_x16(xh), ld_x16(xh + 32)));
}
EA __m512i el_dot_x16(__m512i lo, __m512i hi, const char *p) {
    return i_join(dot_x16(i_lo(lo), i_lo(hi), p, p + 128),
                  dot_x16(i_hi(lo), i_hi(hi), p + 64, p + 192));
}
/* Q8_0's sum w q per dword where x comes as q itself (X16's order: per 256-bit half of the
   weights, q of the even bytes, then of the odd): the weights' bytes widened to 16 bits as
   signed, one vpmaddwd for 16 of them; the integers of 256 (sum w (a + 128) - 128 sum w) +
   sum w b, which the AVX-512 build takes from three vpdpbusd */
EA __m256i dot_s8_x16(__m256i w, const char *x) {
    return madd_eo(even_s8(w), odd_s8(w), ld_x16(x), ld_x16(x + 32));
}
EA __m512i el_dot_s8_x16(__m512i w, const char *p) {
    return i_join(dot_s8_x16(i_lo(w), p), dot_s8_x16(i_hi(w), p + 64));
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
EA __m512 el_castps256_ps512(__m256 a) { return f_join(a, _mm256_setzero_ps()); }
EA __m512 el_zextps256_ps512(__m256 a) { return f_join(a, _mm256_setzero_ps()); }
EA __m512 el_castps128_ps512(__m128 a) { return f_join(_mm256_castps128_ps256(a), _mm256_setzero_ps()); }
EA __m256i el_extracti64x4_epi64(__m512i a, int i) { return i ? i_hi(a) : i_lo(a); }
EA __m512i el_inserti64x4(__m512i a, __m256i b, int i) { return i ? i_join(i_lo(a), b) : i_join(b, i_hi(a)); }
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

#endif
