// The per-sub fp32 scales of one tile superblock with AVX512, shared by the AVX512 and AMX
// files: included after each file's `#pragma GCC target`, so each compiles it for its own
// instructions (both targets include AVX512F and F16C; static, one copy per file).
#pragma once

#include <immintrin.h>

#include "qgemm.h"

namespace verispec {

// dl and ml of every sub of one tile superblock, one lane per column (the definitions are
// dl_of and ml_of in ref.cpp; the same fp32 products).
static inline __m512 u8_as_float(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

static inline void unpack_scales(int fmt, const FormatInfo& f, const uint8_t* tile, Unpacked* u) {
  const uint8_t* s = tile + f.weight_bytes();
  const uint16_t* d16 = (const uint16_t*)(s + f.scale_bytes());
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)d16));
  switch (fmt) {
    case Q4_K: case Q5_K: {
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d16 + 16)));
      for (int j = 0; j < f.nsub(); ++j) {
        _mm512_store_ps(u->dl[j], _mm512_mul_ps(d, u8_as_float(s + 16 * j)));
        _mm512_store_ps(u->ml[j], _mm512_mul_ps(dmin, u8_as_float(s + 16 * (f.nsub() + j))));
      }
      return;
    }
    case Q6_K: case IQ4_XS:
      for (int j = 0; j < f.nsub(); ++j) {
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(s + 16 * j)));
        _mm512_store_ps(u->dl[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
      }
      return;
    case Q4_1: case Q5_1: {  // ml = -m by flipping the sign bit, as the scalar negation does
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d16 + 16)));
      _mm512_store_si512(u->ml[0], _mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32(INT32_MIN)));
      _mm512_store_ps(u->dl[0], d);
      return;
    }
    default:
      _mm512_store_ps(u->dl[0], d);
      return;
  }
}

}  // namespace verispec
