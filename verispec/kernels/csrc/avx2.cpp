// AVX2 path (with FMA and F16C): a 64-byte group is two ymm, columns 0-7 and 8-15.
// Per row and group: maddubs (u8 weight x s8 activation -> int16 pairs), madd with the sub's
// scale (-> int32 per column), add. Signed weights (Q8_0) move their signs onto the activations
// with vpsignb. Integer sums and the fp32 epilogue follow the contract in qgemm.h.
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
      _mm256_store_si256((__m256i*)(u->w + 64 * g + 32 * half), _mm256_and_si256(v, low));
      _mm256_store_si256((__m256i*)(u->w + 64 * (g + G / 2) + 32 * half),
                         _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    }
  } else if (f.signed_w) {
    for (int h = 0; h < 2 * G; ++h) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(tile + 32 * h));
      _mm256_store_si256((__m256i*)(u->ws + 32 * h), v);
      _mm256_store_si256((__m256i*)(u->w + 32 * h), _mm256_abs_epi8(v));
    }
  } else {
    std::memcpy(u->w, tile, (size_t)G * 64);
  }
}

// The per-column scales of one tile superblock in the Unpacked form (see unpack_scales in
// ref.cpp for the definition); one lane per column, two halves of 8.
static inline __m256i pair16(__m256i lo, __m256i hi) {
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16));
}
static inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256i i8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

static void unpack_scales_simd(int fmt, const FormatInfo& f, const uint8_t* tile, Unpacked* u) {
  const uint8_t* s = tile + f.weight_bytes();
  const uint16_t* d16 = (const uint16_t*)(s + f.scale_bytes());
  for (int h = 0; h < 2; ++h) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 8 * h)));
    _mm256_store_ps(u->d + 8 * h, d);
    switch (fmt) {
      case Q4_K:
        for (int k = 0; k < 8; ++k) {
          const __m256i v = u8x8(s + 16 * k + 8 * h);
          _mm256_store_si256((__m256i*)(u->sc[k] + 8 * h), pair16(v, v));
        }
        for (int p = 0; p < 4; ++p)
          _mm256_store_si256((__m256i*)(u->mn[p] + 8 * h),
                             pair16(u8x8(s + 16 * (8 + 2 * p) + 8 * h), u8x8(s + 16 * (9 + 2 * p) + 8 * h)));
        _mm256_store_ps(u->dmin + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 16 + 8 * h))));
        break;
      case Q6_K:
        for (int p = 0; p < 8; ++p) {
          const __m256i lo = i8x8(s + 16 * (2 * p) + 8 * h), hi = i8x8(s + 16 * (2 * p + 1) + 8 * h);
          _mm256_store_si256((__m256i*)(u->sc[2 * p] + 8 * h), pair16(lo, lo));
          _mm256_store_si256((__m256i*)(u->sc[2 * p + 1] + 8 * h), pair16(hi, hi));
          _mm256_store_si256((__m256i*)(u->mn[p] + 8 * h), pair16(_mm256_slli_epi32(lo, 5), _mm256_slli_epi32(hi, 5)));
        }
        _mm256_store_ps(u->dmin + 8 * h, d);
        break;
      default: {  // one sub per superblock, scale 1
        _mm256_store_si256((__m256i*)(u->sc[0] + 8 * h), _mm256_set1_epi32(0x00010001));
        const int off = fmt == Q5_0 ? 16 : fmt == Q4_1 ? 1 : 0;
        _mm256_store_si256((__m256i*)(u->mn[0] + 8 * h), _mm256_set1_epi32(off));
        if (fmt == Q4_1) {  // -m by flipping the sign bit, as the scalar negation does
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 16 + 8 * h)));
          _mm256_store_si256((__m256i*)(u->dmin + 8 * h),
                             _mm256_xor_si256(_mm256_castps_si256(m), _mm256_set1_epi32(INT32_MIN)));
        } else {
          _mm256_store_ps(u->dmin + 8 * h, fmt == Q5_0 ? d : _mm256_setzero_ps());
        }
      }
    }
  }
}

// R rows at once: each weight group is loaded once for the R rows (R <= 4 keeps the 2R
// accumulators, the weights and the scales in the 16 ymm registers).
template <int KB, int SUB, bool SIGNED, bool OFFSET, int R>
static void rows_block(const Unpacked& u, const QActs& a, int64_t s, float* acc, int64_t m0) {
  constexpr int NSUB = KB / SUB, GPS = SUB / 4, NPAIR = (NSUB + 1) / 2;
  const int64_t nsb = a.k / KB;
  const int8_t* xq[R];
  __m256i isum0[R], isum1[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q + (m0 + r) * a.k + s * KB;
    isum0[r] = isum1[r] = _mm256_setzero_si256();
  }
  for (int k = 0; k < NSUB; ++k) {
    const __m256i sc0 = _mm256_load_si256((const __m256i*)u.sc[k]);
    const __m256i sc1 = _mm256_load_si256((const __m256i*)(u.sc[k] + 8));
    for (int g = k * GPS; g < (k + 1) * GPS; ++g) {
      const __m256i w0 = _mm256_load_si256((const __m256i*)(u.w + 64 * g));
      const __m256i w1 = _mm256_load_si256((const __m256i*)(u.w + 64 * g + 32));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq[r] + 4 * g, 4);
        const __m256i x = _mm256_set1_epi32(x4);
        __m256i x0 = x, x1 = x;
        if (SIGNED) {
          x0 = _mm256_sign_epi8(x, _mm256_load_si256((const __m256i*)(u.ws + 64 * g)));
          x1 = _mm256_sign_epi8(x, _mm256_load_si256((const __m256i*)(u.ws + 64 * g + 32)));
        }
        isum0[r] = _mm256_add_epi32(isum0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), sc0));
        isum1[r] = _mm256_add_epi32(isum1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), sc1));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const __m256 dxv = _mm256_set1_ps(a.dx[m * nsb + s]);
    float* y = acc + m * kTile;
    __m256 y0 = _mm256_loadu_ps(y), y1 = _mm256_loadu_ps(y + 8);
    y0 = _mm256_fmadd_ps(_mm256_mul_ps(dxv, _mm256_load_ps(u.d)), _mm256_cvtepi32_ps(isum0[r]), y0);
    y1 = _mm256_fmadd_ps(_mm256_mul_ps(dxv, _mm256_load_ps(u.d + 8)), _mm256_cvtepi32_ps(isum1[r]), y1);
    if (OFFSET) {
      const int16_t* bs = a.bs + m * (a.k / 16) + s * (KB / 16);
      __m256i msum0 = _mm256_setzero_si256(), msum1 = _mm256_setzero_si256();
      for (int p = 0; p < NPAIR; ++p) {
        int32_t b0 = 0, b1 = 0;
        for (int i = (2 * p) * SUB / 16; i < (2 * p + 1) * SUB / 16; ++i) b0 += bs[i];
        if (2 * p + 1 < NSUB)
          for (int i = (2 * p + 1) * SUB / 16; i < (2 * p + 2) * SUB / 16; ++i) b1 += bs[i];
        const __m256i pair = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)b0 | (uint32_t)(uint16_t)b1 << 16));
        msum0 = _mm256_add_epi32(msum0, _mm256_madd_epi16(_mm256_load_si256((const __m256i*)u.mn[p]), pair));
        msum1 = _mm256_add_epi32(msum1, _mm256_madd_epi16(_mm256_load_si256((const __m256i*)(u.mn[p] + 8)), pair));
      }
      y0 = _mm256_fnmadd_ps(_mm256_mul_ps(dxv, _mm256_load_ps(u.dmin)), _mm256_cvtepi32_ps(msum0), y0);
      y1 = _mm256_fnmadd_ps(_mm256_mul_ps(dxv, _mm256_load_ps(u.dmin + 8)), _mm256_cvtepi32_ps(msum1), y1);
    }
    _mm256_storeu_ps(y, y0);
    _mm256_storeu_ps(y + 8, y1);
  }
}

template <int KB, int SUB, bool SIGNED, bool OFFSET>
static void rows(const Unpacked& u, const QActs& a, int64_t s, float* acc) {
  int64_t m = 0;
  for (; m + 4 <= a.m; m += 4) rows_block<KB, SUB, SIGNED, OFFSET, 4>(u, a, s, acc, m);
  switch (a.m - m) {
    case 1: rows_block<KB, SUB, SIGNED, OFFSET, 1>(u, a, s, acc, m); break;
    case 2: rows_block<KB, SUB, SIGNED, OFFSET, 2>(u, a, s, acc, m); break;
    case 3: rows_block<KB, SUB, SIGNED, OFFSET, 3>(u, a, s, acc, m); break;
  }
}

void superblock_avx2(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, float* acc) {
  Unpacked u;
  unpack_weights(f, tile, &u);
  unpack_scales_simd(fmt, f, tile, &u);
  switch (fmt) {
    case Q4_K: rows<256, 32, false, true>(u, a, s, acc); break;
    case Q6_K: rows<256, 16, false, true>(u, a, s, acc); break;
    case Q5_0: case Q4_1: rows<32, 32, false, true>(u, a, s, acc); break;
    case Q8_0: rows<32, 32, true, false>(u, a, s, acc); break;
  }
}

}  // namespace verispec
