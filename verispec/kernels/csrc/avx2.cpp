// AVX2 path (with FMA and F16C): a 64-byte group is two ymm, columns 0-7 and 8-15.
// Per row and group: maddubs (u8 weight x s8 activation -> int16 pairs), madd with ones
// (-> int32 per column), add; per sub the fp32 steps of the contract. Signed weights (Q8_0) move
// their signs onto the activations with vpsignb. Integer sums and the fp32 epilogue follow the contract in qgemm.h.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <cstring>

#include "qgemm.h"

namespace verispec {

static void unpack_weights(const FormatInfo& f, const uint8_t* tile, Unpacked* u) {
  const int G = f.groups();
  if (f.nibbles) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < G; ++h) {  // G/2 groups of 64 bytes = G ymm
      const __m256i v = _mm256_loadu_si256((const __m256i*)(tile + 32 * h));
      const int g = h / 2, half = h % 2;
      _mm256_store_si256((__m256i*)(u->w + 128 * g + 32 * half), _mm256_and_si256(v, low));
      _mm256_store_si256((__m256i*)(u->w + 128 * g + 64 + 32 * half),
                         _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
  } else if (f.hbits) {  // Q6_K, Q5_0: nibbles and high bits joined (see high_bits in avx512.cpp)
    const int hb = f.hbits, per = 8 / hb;
    const __m256i low = _mm256_set1_epi8(0x0f), hmask = _mm256_set1_epi8((char)(((1 << hb) - 1) << 4));
    for (int g = 0; g < G; ++g)
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(tile + 64 * (g / 2) + 32 * half));
        const __m256i h = _mm256_loadu_si256((const __m256i*)(tile + G / 2 * 64 + 64 * (g / per) + 32 * half));
        const int sh = 4 - hb * (g % per);
        const __m256i hs = sh > 0 ? _mm256_slli_epi16(h, sh) : sh < 0 ? _mm256_srli_epi16(h, -sh) : h;
        const __m256i nib = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(v, 4) : v, low);
        _mm256_store_si256((__m256i*)(u->w + 64 * g + 32 * half), _mm256_or_si256(nib, _mm256_and_si256(hs, hmask)));
      }
  } else {  // Q8_0, the one 8-bit format: signed
    for (int h = 0; h < 2 * G; ++h) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(tile + 32 * h));
      _mm256_store_si256((__m256i*)(u->ws + 32 * h), v);
      _mm256_store_si256((__m256i*)(u->w + 32 * h), _mm256_abs_epi8(v));
    }
  }
}

// dl and ml of every sub of one tile superblock, one lane per column in two halves of 8 (the
// definitions are dl_of and ml_of in ref.cpp; the same fp32 products).
static inline __m256 u8_as_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline __m256 i8_as_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static void unpack_scales(int fmt, const FormatInfo& f, const uint8_t* tile, Unpacked* u) {
  const uint8_t* s = tile + f.weight_bytes();
  const uint16_t* d16 = (const uint16_t*)(s + f.scale_bytes());
  for (int h = 0; h < 2; ++h) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 8 * h)));
    switch (fmt) {
      case Q4_K: {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 16 + 8 * h)));
        for (int j = 0; j < 8; ++j) {
          _mm256_store_ps(u->dl[j] + 8 * h, _mm256_mul_ps(d, u8_as_float(s + 16 * j + 8 * h)));
          _mm256_store_ps(u->ml[j] + 8 * h, _mm256_mul_ps(dmin, u8_as_float(s + 16 * (8 + j) + 8 * h)));
        }
        break;
      }
      case Q6_K:
        for (int j = 0; j < 16; ++j) _mm256_store_ps(u->dl[j] + 8 * h, _mm256_mul_ps(d, i8_as_float(s + 16 * j + 8 * h)));
        break;
      case Q4_1: {  // ml = -m by flipping the sign bit, as the scalar negation does
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 16 + 8 * h)));
        _mm256_store_si256((__m256i*)(u->ml[0] + 8 * h),
                           _mm256_xor_si256(_mm256_castps_si256(m), _mm256_set1_epi32(INT32_MIN)));
        _mm256_store_ps(u->dl[0] + 8 * h, d);
        break;
      }
      default:
        _mm256_store_ps(u->dl[0] + 8 * h, d);
    }
  }
}

// R rows at once (R <= 2 keeps the accumulators, sums, weights and scales in the 16 ymm).
template <int KB, int SUB, bool SIGNED, int OFF, bool FPOFF, int R>
static void rows_block(const Unpacked& u, const QActs& a, int64_t s, float* acc, int64_t m0) {
  constexpr int NSUB = KB / SUB, GPS = SUB / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t b0 = s * (KB / kActBlock);
  __m256 y0[R], y1[R];
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    y0[r] = _mm256_loadu_ps(acc + m * kTile);
    y1[r] = _mm256_loadu_ps(acc + m * kTile + 8);
  }
  for (int j = 0; j < NSUB; ++j) {
    prefetch_step();
    __m256i i0[R], i1[R];
    for (int r = 0; r < R; ++r) i0[r] = i1[r] = _mm256_setzero_si256();
    for (int g = j * GPS; g < (j + 1) * GPS; ++g) {
      const __m256i w0 = _mm256_load_si256((const __m256i*)(u.w + 64 * g));
      const __m256i w1 = _mm256_load_si256((const __m256i*)(u.w + 64 * g + 32));
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, a.qb(b0 + g / 8, m0 + r) + 4 * (g % 8), 4);
        const __m256i x = _mm256_set1_epi32(x4);
        __m256i x0 = x, x1 = x;
        if (SIGNED) {
          x0 = _mm256_sign_epi8(x, _mm256_load_si256((const __m256i*)(u.ws + 64 * g)));
          x1 = _mm256_sign_epi8(x, _mm256_load_si256((const __m256i*)(u.ws + 64 * g + 32)));
        }
        i0[r] = _mm256_add_epi32(i0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
        i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
      }
    }
    const __m256 dl0 = _mm256_load_ps(u.dl[j]), dl1 = _mm256_load_ps(u.dl[j] + 8);
    for (int r = 0; r < R; ++r) {
      if (OFF) {
        const __m256i o = _mm256_set1_epi32(OFF * a.bsum(m0 + r, s, KB, j, SUB));
        i0[r] = _mm256_sub_epi32(i0[r], o);
        i1[r] = _mm256_sub_epi32(i1[r], o);
      }
      const int64_t blk = b0 + j * SUB / kActBlock;
      const __m256 dxj = _mm256_set1_ps(a.dx[blk * a.mp + m0 + r]);
      y0[r] = _mm256_fmadd_ps(dl0, _mm256_mul_ps(_mm256_cvtepi32_ps(i0[r]), dxj), y0[r]);
      y1[r] = _mm256_fmadd_ps(dl1, _mm256_mul_ps(_mm256_cvtepi32_ps(i1[r]), dxj), y1[r]);
      if (FPOFF) {
        const __m256 v = _mm256_set1_ps(a.dxb[blk * a.mp + m0 + r]);
        y0[r] = _mm256_fnmadd_ps(_mm256_load_ps(u.ml[j]), v, y0[r]);
        y1[r] = _mm256_fnmadd_ps(_mm256_load_ps(u.ml[j] + 8), v, y1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + (m0 + r) * kTile, y0[r]);
    _mm256_storeu_ps(acc + (m0 + r) * kTile + 8, y1[r]);
  }
}

template <int KB, int SUB, bool SIGNED, int OFF, bool FPOFF>
static void rows(const Unpacked& u, const QActs& a, int64_t s, float* acc) {
  int64_t m = 0;
  for (; m + 2 <= a.m; m += 2) rows_block<KB, SUB, SIGNED, OFF, FPOFF, 2>(u, a, s, acc, m);
  if (m < a.m) rows_block<KB, SUB, SIGNED, OFF, FPOFF, 1>(u, a, s, acc, m);
}

void superblock_avx2(int fmt, const FormatInfo& f, const uint8_t* tile0, const QActs& a, int64_t s0, int count,
                     float* acc) {
  for (int c = 0; c < count; ++c) {
  const uint8_t* tile = tile0 + (int64_t)c * f.tile_bytes();
  const int64_t s = s0 + c;
  Unpacked u;
  unpack_weights(f, tile, &u);
  unpack_scales(fmt, f, tile, &u);
  switch (fmt) {
    case Q4_K: rows<256, 32, false, 0, true>(u, a, s, acc); break;
    case Q6_K: rows<256, 16, false, 32, false>(u, a, s, acc); break;
    case Q5_0: rows<32, 32, false, 16, false>(u, a, s, acc); break;
    case Q4_1: rows<32, 32, false, 0, true>(u, a, s, acc); break;
    case Q8_0: rows<32, 32, true, 0, false>(u, a, s, acc); break;
  }
  }
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
