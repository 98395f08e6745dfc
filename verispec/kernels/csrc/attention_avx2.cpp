// attention.cpp's row kernel with AVX2: the 16 lanes are two ymm, lanes 0-7 and 8-15 (see
// attention_simd.h).
#pragma GCC target("avx2")
#include "attention_simd.h"

namespace verispec {
namespace {

struct Ymm2 {
  struct F { __m256 lo, hi; };
  struct I { __m256i lo, hi; };
  static constexpr int kMaxG = 4;  // heads at once
  static constexpr int kScoreAcc = 4;  // score accumulators (heads x keys) in registers
  static constexpr int kAcc = 4;  // output accumulators (vectors of 16) in registers
  static F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static F set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static F load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x.lo); _mm256_storeu_ps(p + 8, x.hi); }
  static F add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static F sub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F div(F a, F b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static F min(F a, F b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
  static F max(F a, F b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  static __m256 ge0(__m256 t, __m256 yes, __m256 no) {
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
  static F select_ge0(F t, F yes, F no) { return {ge0(t.lo, yes.lo, no.lo), ge0(t.hi, yes.hi, no.hi)}; }
  static I cvtt(F x) { return {_mm256_cvttps_epi32(x.lo), _mm256_cvttps_epi32(x.hi)}; }
  static F cvt(I n) { return {_mm256_cvtepi32_ps(n.lo), _mm256_cvtepi32_ps(n.hi)}; }
  static __m256 pow2(__m256i n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  }
  static F pow2(I n) { return {pow2(n.lo), pow2(n.hi)}; }
  static __m256 first(int valid) {  // all-ones in lanes below valid
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane));
  }
  static F add_first(F lane, F e, int valid) {
    return {_mm256_blendv_ps(lane.lo, _mm256_add_ps(lane.lo, e.lo), first(valid)),
            _mm256_blendv_ps(lane.hi, _mm256_add_ps(lane.hi, e.hi), first(valid - 8))};
  }
  static float tree(F a) { return tree_of_8(_mm256_add_ps(a.lo, a.hi)); }  // w = 8, then 4, 2, 1
};

}  // namespace

void attend_row_avx2(const RowAttn& r) { attend_row_simd<Ymm2>(r); }

}  // namespace verispec
