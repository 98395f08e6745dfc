// attention.cpp's row kernel with AVX2: the 16 lanes are two ymm, lanes 0-7 and 8-15 (see
// attention_simd.h).
#pragma GCC target("avx2,fma,f16c")
#include <cstring>

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
  static F load_half(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x.lo); _mm256_storeu_ps(p + 8, x.hi); }
  static F add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static F sub(F a, F b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
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
  static void store_first(float* p, F x, int cnt) {
    if (cnt == 16) return store(p, x);
    float tmp[16];
    store(tmp, x);
    std::memcpy(p, tmp, (size_t)cnt * sizeof(float));
  }
  // lane l = lane_tree(a[l]), 16 trees at once: w = 8 adds each input's upper ymm onto its
  // lower one; then w = 4, 2, 1 on eight partials at a time, the halves of two partials gathered
  // into one register by a shuffle, as in attention_avx512.cpp's trees16 (each lane gets
  // lane[l] += lane[l + w]). The last step leaves input (2v + u)'s tree in lane 4u + v (u < 2), so
  // the inputs are read in the order that puts key l's tree in lane l.
  static __m256 trees8(const F* a) {
    __m256 x[8], y[4], z[2];
    for (int i = 0; i < 8; ++i) {
      const F& in = a[4 * (i % 2) + i / 2];
      x[i] = _mm256_add_ps(in.lo, in.hi);  // w = 8
    }
    for (int k = 0; k < 4; ++k)  // w = 4: 128-bit lane u holds input 2k + u's four
      y[k] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * k], x[2 * k + 1], 0x20),
                           _mm256_permute2f128_ps(x[2 * k], x[2 * k + 1], 0x31));
    for (int n = 0; n < 2; ++n)  // w = 2
      z[n] = _mm256_add_ps(_mm256_shuffle_ps(y[2 * n], y[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(y[2 * n], y[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),  // w = 1
                         _mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  static F trees16(const F* a) { return {trees8(a), trees8(a + 8)}; }
  static float tree(F a) { return tree_of_8(_mm256_add_ps(a.lo, a.hi)); }  // w = 8, then 4, 2, 1
};

}  // namespace

void attend_rows_avx2(const RowAttn* rows, int npos) { attend_rows_simd<Ymm2>(rows, npos); }

}  // namespace verispec
