// attention.cpp's row kernel with AVX512F: the 16 lanes are one zmm (see attention_simd.h).
#pragma GCC target("avx512f,fma")
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
  static F load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
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
  // only the first cnt lanes (cnt <= 16)
  static void store_first(float* p, F x, int cnt) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << cnt) - 1), x); }
  // lane l = lane_tree(a[l]), 16 trees at once: at each step w = 8, 4, 2, 1 every partial sum
  // gets lane[l] += lane[l + w] as in lane_tree, with the halves of two partials gathered into
  // one register by a shuffle. The last step leaves input (4v + u)'s tree in lane 4u + v, so the
  // inputs are read in the order that puts key l's tree in lane l.
  static F trees16(const F* a) {
    F b[8], c[4], e[2];
    const auto in = [&](int i) { return a[(i % 4) * 4 + i / 4]; };
    for (int k = 0; k < 8; ++k)  // w = 8: lanes 0-7 of input 2k, then of 2k + 1
      b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(in(2 * k), in(2 * k + 1), _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(in(2 * k), in(2 * k + 1), _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; ++m)  // w = 4: 128-bit lane u holds input 4m + u's four
      c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int n = 0; n < 2; ++n)  // w = 2: in 128-bit lane u, two of input 8n + u, two of 8n + 4 + u
      e[n] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * n], c[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(c[2 * n], c[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // w = 1
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // lane_tree: w = 8 (the upper 256 bits onto the lower), then 4, 2, 1
  static float tree(F a) {
    return tree_of_8(_mm256_add_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
  }
};

}  // namespace

void attend_rows_avx512(const RowAttn* rows, int npos) { attend_rows_simd<Zmm>(rows, npos); }

}  // namespace verispec
