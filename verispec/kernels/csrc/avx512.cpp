// AVX512 path (F, BW, VL, VNNI): one tile superblock is 64-byte groups, one zmm each.
// Per row and group: vpdpbusd (u8 weight x s8 activation, 4 products per int32 column lane);
// per sub, one vpmulld by the sub's integer scale. Signed weights (Q8_0) move their signs onto
// the activations first. Integer sums and the fp32 epilogue follow the contract in qgemm.h.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
#include <immintrin.h>

#include <cstring>

#include "qgemm.h"

namespace verispec {

static void unpack_weights(const FormatInfo& f, const uint8_t* tile, Unpacked* u) {
  const int G = f.groups();
  if (f.nibbles) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int h = 0; h < G / 2; ++h) {
      const __m512i v = _mm512_loadu_si512(tile + 64 * h);
      _mm512_store_si512(u->w + 64 * h, _mm512_and_si512(v, low));
      _mm512_store_si512(u->w + 64 * (h + G / 2), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  } else if (f.signed_w) {
    for (int g = 0; g < G; ++g) {
      const __m512i v = _mm512_loadu_si512(tile + 64 * g);
      _mm512_store_si512(u->ws + 64 * g, v);
      _mm512_store_si512(u->w + 64 * g, _mm512_abs_epi8(v));
    }
  } else {
    for (int g = 0; g < G; ++g) _mm512_store_si512(u->w + 64 * g, _mm512_loadu_si512(tile + 64 * g));
  }
}

// The per-column scales of one tile superblock in the Unpacked form (see unpack_scales in
// ref.cpp for the definition); one lane per column.
static inline __m512i pair16(__m512i lo, __m512i hi) {
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16));
}

static void unpack_scales_simd(int fmt, const FormatInfo& f, const uint8_t* tile, Unpacked* u) {
  const uint8_t* s = tile + f.weight_bytes();
  const uint16_t* d16 = (const uint16_t*)(s + f.scale_bytes());
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)d16));
  _mm512_store_ps(u->d, d);
  switch (fmt) {
    case Q4_K:
      for (int k = 0; k < 8; ++k)
        _mm512_store_si512(u->sc[k], _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + 16 * k))));
      for (int p = 0; p < 4; ++p) {
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + 16 * (8 + 2 * p))));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + 16 * (9 + 2 * p))));
        _mm512_store_si512(u->mn[p], pair16(lo, hi));
      }
      _mm512_store_ps(u->dmin, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d16 + 16))));
      return;
    case Q6_K:
      for (int p = 0; p < 8; ++p) {
        const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(s + 16 * (2 * p))));
        const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(s + 16 * (2 * p + 1))));
        _mm512_store_si512(u->sc[2 * p], lo);
        _mm512_store_si512(u->sc[2 * p + 1], hi);
        _mm512_store_si512(u->mn[p], pair16(_mm512_slli_epi32(lo, 5), _mm512_slli_epi32(hi, 5)));
      }
      _mm512_store_ps(u->dmin, d);
      return;
    default: {  // one sub per superblock, scale 1
      _mm512_store_si512(u->sc[0], _mm512_set1_epi32(1));
      const int off = fmt == Q5_0 ? 16 : fmt == Q4_1 ? 1 : 0;
      _mm512_store_si512(u->mn[0], _mm512_set1_epi32(off));
      if (fmt == Q4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d16 + 16)));
        // -m by flipping the sign bit, as the scalar negation does (0 - m would differ at m = 0)
        _mm512_store_si512(u->dmin, _mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32(INT32_MIN)));
      } else {
        _mm512_store_ps(u->dmin, fmt == Q5_0 ? d : _mm512_setzero_ps());
      }
      return;
    }
  }
}

// R rows at once: each weight group is loaded once for the R rows, and the R independent
// dpbusd chains hide the instruction's latency.
template <int KB, int SUB, bool SIGNED, bool OFFSET, bool SCALES, int R>
static void rows_block(const Unpacked& u, const QActs& a, int64_t s, float* acc, int64_t m0) {
  constexpr int NSUB = KB / SUB, GPS = SUB / 4, NPAIR = (NSUB + 1) / 2;
  const int64_t nsb = a.k / KB;
  const int8_t* xq[R];
  __m512i isum[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q + (m0 + r) * a.k + s * KB;
    isum[r] = _mm512_setzero_si512();
  }
  for (int k = 0; k < NSUB; ++k) {
    __m512i sub[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sub[r] = _mm512_setzero_si512();
    for (int g = k * GPS; g < (k + 1) * GPS; ++g) {
      const __m512i w = _mm512_load_si512(u.w + 64 * g);
      __mmask64 neg = 0;
      if (SIGNED) neg = _mm512_movepi8_mask(_mm512_load_si512(u.ws + 64 * g));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq[r] + 4 * g, 4);
        __m512i x = _mm512_set1_epi32(x4);
        if (SIGNED) x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
        sub[r] = _mm512_dpbusd_epi32(sub[r], w, x);
      }
    }
    if (SCALES) {
      const __m512i sc = _mm512_load_si512(u.sc[k]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sub[r], sc));
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) isum[r] = sub[r];
    }
  }
  const __m512 d = _mm512_load_ps(u.d), dmin = _mm512_load_ps(u.dmin);
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    float* y = acc + m * kTile;
    const __m512 dxv = _mm512_set1_ps(a.dx[m * nsb + s]);
    __m512 yv = _mm512_fmadd_ps(_mm512_mul_ps(dxv, d), _mm512_cvtepi32_ps(isum[r]), _mm512_loadu_ps(y));
    if (OFFSET) {
      const int16_t* bs = a.bs + m * (a.k / 16) + s * (KB / 16);
      __m512i msum = _mm512_setzero_si512();
      for (int p = 0; p < NPAIR; ++p) {
        int32_t b0 = 0, b1 = 0;
        for (int i = (2 * p) * SUB / 16; i < (2 * p + 1) * SUB / 16; ++i) b0 += bs[i];
        if (2 * p + 1 < NSUB)
          for (int i = (2 * p + 1) * SUB / 16; i < (2 * p + 2) * SUB / 16; ++i) b1 += bs[i];
        const int32_t pair = (int32_t)((uint32_t)(uint16_t)b0 | (uint32_t)(uint16_t)b1 << 16);
        msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(u.mn[p]), _mm512_set1_epi32(pair));
      }
      yv = _mm512_fnmadd_ps(_mm512_mul_ps(dxv, dmin), _mm512_cvtepi32_ps(msum), yv);
    }
    _mm512_storeu_ps(y, yv);
  }
}

template <int KB, int SUB, bool SIGNED, bool OFFSET, bool SCALES>
static void rows(const Unpacked& u, const QActs& a, int64_t s, float* acc) {
  int64_t m = 0;
  for (; m + 8 <= a.m; m += 8) rows_block<KB, SUB, SIGNED, OFFSET, SCALES, 8>(u, a, s, acc, m);
  switch (a.m - m) {
    case 1: rows_block<KB, SUB, SIGNED, OFFSET, SCALES, 1>(u, a, s, acc, m); break;
    case 2: rows_block<KB, SUB, SIGNED, OFFSET, SCALES, 2>(u, a, s, acc, m); break;
    case 3: rows_block<KB, SUB, SIGNED, OFFSET, SCALES, 3>(u, a, s, acc, m); break;
    case 4: rows_block<KB, SUB, SIGNED, OFFSET, SCALES, 4>(u, a, s, acc, m); break;
    case 5: rows_block<KB, SUB, SIGNED, OFFSET, SCALES, 5>(u, a, s, acc, m); break;
    case 6: rows_block<KB, SUB, SIGNED, OFFSET, SCALES, 6>(u, a, s, acc, m); break;
    case 7: rows_block<KB, SUB, SIGNED, OFFSET, SCALES, 7>(u, a, s, acc, m); break;
  }
}

void superblock_avx512(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, float* acc) {
  Unpacked u;
  unpack_weights(f, tile, &u);
  unpack_scales_simd(fmt, f, tile, &u);
  switch (fmt) {
    case Q4_K: rows<256, 32, false, true, true>(u, a, s, acc); break;
    case Q6_K: rows<256, 16, false, true, true>(u, a, s, acc); break;
    case Q5_0: case Q4_1: rows<32, 32, false, true, false>(u, a, s, acc); break;
    case Q8_0: rows<32, 32, true, false, false>(u, a, s, acc); break;
  }
}

}  // namespace verispec
