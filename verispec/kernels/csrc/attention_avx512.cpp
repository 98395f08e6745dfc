// attention.cpp's row kernel with AVX512F: the 16 lanes are one zmm (see attention_simd.h).
#pragma GCC target("avx512f")
#include "attention_simd.h"

namespace verispec {
namespace {

struct Zmm {
  using F = __m512;
  using I = __m512i;
  static constexpr int kMaxG = 8;  // heads at once
  static constexpr int kScoreAcc = 12;  // score accumulators (heads x keys) in registers
  static constexpr int kAcc = 16;  // output accumulators (vectors of 16) in registers
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F select_ge0(F t, F yes, F no) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_GE_OQ), no, yes);
  }
  static I cvtt(F x) { return _mm512_cvttps_epi32(x); }
  static F cvt(I n) { return _mm512_cvtepi32_ps(n); }
  static F pow2(I n) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23)); }
  // lane + e in the first `valid` lanes, lane unchanged in the others
  static F add_first(F lane, F e, int valid) {
    return _mm512_mask_add_ps(lane, (__mmask16)((1u << valid) - 1), lane, e);
  }
  // lane_tree: w = 8 (the upper 256 bits onto the lower), then 4, 2, 1
  static float tree(F a) {
    return tree_of_8(_mm256_add_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
  }
};

}  // namespace

void attend_row_avx512(const RowAttn& r) { attend_row_simd<Zmm>(r); }

}  // namespace verispec
