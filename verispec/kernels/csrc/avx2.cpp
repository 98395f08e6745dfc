// AVX2 path (with FMA and F16C): the 256-bit kernel body of ymm_kernel.h with maddubs (u8 weight
// x s8 activation -> int16 pairs) and madd with ones (-> int32 per column); also the AVX2 copies
// of a layer's input steps (exp, SiLU * up, the activation quantizer). Integer sums and the fp32
// epilogue follow the contract in qgemm.h.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cstring>

namespace verispec {
constexpr bool kInt16Sums = true;  // see int16_chunk in ymm_kernel.h
static inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
}  // namespace verispec

#include "ymm_kernel.h"

namespace verispec {

void superblock_avx2(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count,
                     float* acc) {
  superblock_ymm(fmt, f, tile, a, s, count, acc);
}

// exp_fixed (qgemm.h) on 8 lanes: the same IEEE operations in the same order. min/max return
// their second operand when the first is NaN, as the scalar clamps do; the rounding to the
// nearest integer adds +-0.5 and truncates, as the scalar cast does.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 half = _mm256_blendv_ps(_mm256_set1_ps(-0.5f), _mm256_set1_ps(0.5f),
                                       _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_GE_OQ));
  const __m256i n = _mm256_cvttps_epi32(_mm256_add_ps(t, half));
  const __m256 fn = _mm256_cvtepi32_ps(n);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fn, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fn, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(e, scale);
}

void glu_block_avx2(const float* gate, const float* up, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int j = 0; j < kActBlock; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 e = exp8(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + j)));
  }
}

void quantize_block_avx2(const float* x, int8_t* q, float* dx, int16_t* bs, float* dxb) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], lane = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    lane = _mm256_max_ps(_mm256_and_ps(v[i], absmask), lane);  // a > lane ? a : lane
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(lane), _mm256_extractf128_ps(lane, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float amax = _mm_cvtss_f32(h);  // exact: no lane is NaN
  if (!(amax > 0.0f) || !std::isfinite(amax)) {
    std::memset(q, 0, kActBlock);
    *dx = amax > 0.0f ? amax : 0.0f;
    bs[0] = bs[1] = 0;
    *dxb = *dx * 0.0f;
    return;
  }
  const float iscale = 127.0f / amax;
  const __m256 is = _mm256_set1_ps(iscale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], is), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);  // max(NaN, lo) = lo, as the scalar clamp
    qi[i] = _mm256_cvtps_epi32(r);
  }
  // int32 -> int8 in k order (packs interleave 128-bit lanes; the permute restores the order)
  const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]), w23 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, b);
  const __m256i s01 = _mm256_add_epi32(qi[0], qi[1]), s23 = _mm256_add_epi32(qi[2], qi[3]);
  auto hsum = [](__m256i t) {
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1));
    return _mm_cvtsi128_si32(u);
  };
  const int32_t a0 = hsum(s01), a1 = hsum(s23);
  bs[0] = (int16_t)a0;
  bs[1] = (int16_t)a1;
  *dx = 1.0f / iscale;
  *dxb = *dx * (float)(a0 + a1);
}

}  // namespace verispec
