// AVX512 path (F, BW, VL, VNNI): one tile superblock is 64-byte groups, one zmm each.
// Per row and group: vpdpbusd (u8 weight x s8 activation, 4 products per int32 column lane),
// and per sub the fp32 steps of the contract. Signed weights (Q8_0) move their signs onto the
// activations first. Integer sums and the fp32 epilogue follow the contract in qgemm.h.
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

// dl and ml of every sub of one tile superblock, one lane per column (the definitions are
// dl_of and ml_of in ref.cpp; the same fp32 products).
static inline __m512 u8_as_float(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

static void unpack_scales(int fmt, const FormatInfo& f, const uint8_t* tile, Unpacked* u) {
  const uint8_t* s = tile + f.weight_bytes();
  const uint16_t* d16 = (const uint16_t*)(s + f.scale_bytes());
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)d16));
  switch (fmt) {
    case Q4_K: {
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d16 + 16)));
      for (int j = 0; j < 8; ++j) {
        _mm512_store_ps(u->dl[j], _mm512_mul_ps(d, u8_as_float(s + 16 * j)));
        _mm512_store_ps(u->ml[j], _mm512_mul_ps(dmin, u8_as_float(s + 16 * (8 + j))));
      }
      return;
    }
    case Q6_K:
      for (int j = 0; j < 16; ++j) {
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(s + 16 * j)));
        _mm512_store_ps(u->dl[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
      }
      return;
    case Q4_1: {  // ml = -m by flipping the sign bit, as the scalar negation does
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

// R rows at once: each weight group is loaded once for the R rows, and the R independent
// dpbusd chains hide the instruction's latency.
template <int KB, int SUB, bool SIGNED, int OFF, bool FPOFF, int R>
static void rows_block(const Unpacked& u, const QActs& a, int64_t s, float* acc, int64_t m0) {
  constexpr int NSUB = KB / SUB, GPS = SUB / 4;
  const int8_t* xq[R];
  const int16_t* bs[R];
  const float* dx[R];
  __m512 y[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    xq[r] = a.q + m * a.k + s * KB;
    bs[r] = a.bs + m * (a.k / 16) + s * (KB / 16);
    dx[r] = a.dx + m * (a.k / kActBlock) + s * (KB / kActBlock);
    y[r] = _mm512_loadu_ps(acc + m * kTile);
  }
  // With few rows, each row's sum runs in P partial chains (groups g % P), added at the end:
  // integer sums, so the split cannot change a result, and the chains overlap their latency.
  constexpr int P = R == 1 ? 4 : R < 4 ? 2 : 1;
  for (int j = 0; j < NSUB; ++j) {
    __m512i part[P][R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) part[p][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = j * GPS; g < (j + 1) * GPS; ++g) {
      const __m512i w = _mm512_load_si512(u.w + 64 * g);
      __mmask64 neg = 0;
      if (SIGNED) neg = _mm512_movepi8_mask(_mm512_load_si512(u.ws + 64 * g));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq[r] + 4 * g, 4);
        __m512i x = _mm512_set1_epi32(x4);
        if (SIGNED) x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
        part[g % P][r] = _mm512_dpbusd_epi32(part[g % P][r], w, x);
      }
    }
    __m512i isum[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      isum[r] = part[0][r];
      for (int p = 1; p < P; ++p) isum[r] = _mm512_add_epi32(isum[r], part[p][r]);
    }
    const __m512 dl = _mm512_load_ps(u.dl[j]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int32_t bsum = (OFF || FPOFF) ? sub_bsum(bs[r], j, SUB) : 0;
      if (OFF) isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(OFF * bsum));
      const float dxj = dx[r][j * SUB / kActBlock];
      y[r] = _mm512_fmadd_ps(dl, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(dxj)), y[r]);
      if (FPOFF) y[r] = _mm512_fnmadd_ps(_mm512_load_ps(u.ml[j]), _mm512_set1_ps(dxj * (float)bsum), y[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (m0 + r) * kTile, y[r]);
}

template <int KB, int SUB, bool SIGNED, int OFF, bool FPOFF>
static void rows(const Unpacked& u, const QActs& a, int64_t s, float* acc) {
  int64_t m = 0;
  for (; m + 8 <= a.m; m += 8) rows_block<KB, SUB, SIGNED, OFF, FPOFF, 8>(u, a, s, acc, m);
  switch (a.m - m) {
    case 1: rows_block<KB, SUB, SIGNED, OFF, FPOFF, 1>(u, a, s, acc, m); break;
    case 2: rows_block<KB, SUB, SIGNED, OFF, FPOFF, 2>(u, a, s, acc, m); break;
    case 3: rows_block<KB, SUB, SIGNED, OFF, FPOFF, 3>(u, a, s, acc, m); break;
    case 4: rows_block<KB, SUB, SIGNED, OFF, FPOFF, 4>(u, a, s, acc, m); break;
    case 5: rows_block<KB, SUB, SIGNED, OFF, FPOFF, 5>(u, a, s, acc, m); break;
    case 6: rows_block<KB, SUB, SIGNED, OFF, FPOFF, 6>(u, a, s, acc, m); break;
    case 7: rows_block<KB, SUB, SIGNED, OFF, FPOFF, 7>(u, a, s, acc, m); break;
  }
}

void superblock_avx512(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, float* acc) {
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

}  // namespace verispec
