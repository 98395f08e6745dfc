// AVX512 path (F, BW, VL, VNNI): one tile superblock is 64-byte groups, one zmm each, read
// straight from the packed tile (no scratch copy).
// Per row and group: vpdpbusd (u8 weight x s8 activation, 4 products per int32 column lane),
// and per sub the fp32 steps of the contract. Signed weights (Q8_0, and IQ4's nibbles once turned
// into their int8 values) are read as unsigned bytes (w + 128), each sum starting from
// -128 * bsum. Integer sums and the fp32 epilogue follow the
// contract in qgemm.h.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
#include <immintrin.h>

#include "qgemm.h"
#include "scales512.h"

namespace verispec {

// The high bits of group g (HB of them, HB > 0: Q6_K 2, Q5_0 1) moved to bits 4 and up of each
// byte, from a high-bit block h (see the layout in qgemm.h). The shifts are 16-bit; the mask
// drops what crosses from the neighbouring byte.
template <int HB, int GI, int TO = 4>  // GI: the group's place in its high block, g % (8 / HB)
static inline __m512i high_bits(__m512i h) {
  constexpr int sh = TO - HB * GI;
  const __m512i v = sh > 0 ? _mm512_slli_epi16(h, sh) : sh < 0 ? _mm512_srli_epi16(h, -sh) : h;
  return _mm512_and_si512(v, _mm512_set1_epi8((char)(((1 << HB) - 1) << TO)));
}

// Groups g and g + 1 of a tile superblock as dpbusd's unsigned operand: both nibbles of one
// 64-byte load (4-bit formats; with HB, joined with their high bits), or two loads (Q8_0, as
// w + 128). G: the superblock's groups.
template <int NIB, int HB, bool SIGNED, int G, int GI>  // GI: g % (8 / HB), a constant
static inline void group_pair(const uint8_t* tile, int g, __m512i* w0, __m512i* w1) {
  if constexpr (NIB == 2) {  // Q2_K, Q3_K: block g / 4, group g at bits 2 (g % 4) (GI % 4 == g % 4)
    const __m512i v = _mm512_loadu_si512(tile + 64 * (g / 4));
    *w0 = _mm512_and_si512(_mm512_srli_epi16(v, 2 * (GI % 4)), _mm512_set1_epi8(3));
    *w1 = _mm512_and_si512(_mm512_srli_epi16(v, 2 * ((GI + 1) % 4)), _mm512_set1_epi8(3));
    if constexpr (HB > 0) {  // Q3_K's third bit, moved to bit 2
      const __m512i h = _mm512_loadu_si512(tile + G / 4 * 64 + g / (8 / HB) * 64);
      *w0 = _mm512_or_si512(*w0, high_bits<HB, GI, 2>(h));
      *w1 = _mm512_or_si512(*w1, high_bits<HB, GI + 1, 2>(h));
    }
  } else if constexpr (NIB || HB) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i v = _mm512_loadu_si512(tile + 32 * g);  // byte block g / 2
    *w0 = _mm512_and_si512(v, low);
    *w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if constexpr (HB > 0) {
      const __m512i h = _mm512_loadu_si512(tile + G / 2 * 64 + g / (8 / HB) * 64);
      *w0 = _mm512_or_si512(*w0, high_bits<HB, GI>(h));
      *w1 = _mm512_or_si512(*w1, high_bits<HB, GI + 1>(h));
    }
    if constexpr (SIGNED) {  // IQ4: each nibble picks its int8 value, as w + 128 (as Q8_0's)
      const __m128i kv = _mm_xor_si128(_mm_loadu_si128((const __m128i*)kIq4Values), _mm_set1_epi8((char)0x80));
      const __m512i table = _mm512_broadcast_i32x4(kv);
      *w0 = _mm512_shuffle_epi8(table, *w0);
      *w1 = _mm512_shuffle_epi8(table, *w1);
    }
  } else {
    // Q8_0 as unsigned bytes, w + 128 (the top bit flipped); each sum starts from -128 * bsum
    static_assert(SIGNED, "Q8_0 is the one 8-bit format");
    const __m512i top = _mm512_set1_epi8((char)0x80);
    *w0 = _mm512_xor_si512(_mm512_loadu_si512(tile + 64 * g), top);
    *w1 = _mm512_xor_si512(_mm512_loadu_si512(tile + 64 * g + 64), top);
  }
}

// acc + the dot products of w's unsigned bytes with the 4 signed activation bytes at p, repeated
// in every lane. One instruction with the broadcast folded into its memory operand ({1to16}),
// which GCC does not emit for the intrinsics: a separate vpbroadcastd competes for the vector
// ports that the dot products and the fp32 steps need (docs/kernels.md, Bounds: fewer
// instructions per row made 4- to 16-row calls measurably faster).
static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const int32_t*)p), "v"(w));
  return acc;
}

// R rows at once, reading the weights straight from the packed tile: each pair of groups is
// loaded (and its nibbles split) once for the R rows, and the R independent dpbusd chains hide
// the instruction's latency.
template <int KB, int SUB, int NIB, int HB, bool SIGNED, int OFF, bool FPOFF, int R>
static void rows_block(int fmt, const FormatInfo& f, const uint8_t* tile0, int count, const QActs& a, int64_t s0,
                       float* acc, int64_t m0, PrefetchQueue& pq) {
  constexpr int NSUB = KB / SUB, GPS = SUB / 4;
  __m512 y[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) y[r] = _mm512_loadu_ps(acc + (m0 + r) * kTile);
  // count consecutive superblocks with the accumulators kept in registers (the 32-wide formats
  // come several at a time)
  for (int c = 0; c < count; ++c) {
  const uint8_t* tile = tile0 + (int64_t)c * f.tile_bytes();
  const int64_t s = s0 + c;
  const int64_t b0 = s * (KB / kActBlock);
  Unpacked u;  // the scales only: the weights are read from the tile
  unpack_scales(fmt, f, tile, &u);
  // With few rows, each row's sum runs in P partial chains (groups g % P), added at the end:
  // integer sums, so the split cannot change a result, and the chains overlap their latency.
  constexpr int P = R == 1 ? 4 : R < 4 ? 2 : 1;
  for (int j = 0; j < NSUB; ++j) {
    const int64_t blk = b0 + j * SUB / kActBlock;
    const int8_t* xj = a.qb(blk, m0) + j * SUB % kActBlock;  // row r at xj + 32 r
    prefetch_step(pq);
    __m512i part[P][R];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      // a format with an integer offset starts from its term, -o * bsum_j (QActs::offset_term),
      // and the signed formats, read as w + 128, from -128 * bsum_j (off128)
      if constexpr (SIGNED) {
        part[0][r] = _mm512_set1_epi32(a.off128[blk * a.mp + m0 + r]);
      } else if constexpr (OFF != 0) {
        part[0][r] = _mm512_set1_epi32(a.offset_term<OFF, SUB>(s * (KB / 16) + j * (SUB / 16), m0 + r));
      } else {
        part[0][r] = _mm512_setzero_si512();
      }
      for (int p = 1; p < P; ++p) part[p][r] = _mm512_setzero_si512();
    }
#pragma GCC unroll 12
    for (int gg = 0; gg < GPS; gg += 2) {  // GPS is a multiple of P, so g % P == gg % P
      const int g = j * GPS + gg;
      __m512i w0, w1;
      // the group's place in its high block, g % per: gg % per where GPS is a multiple of per, a
      // constant once the loop is unrolled (Q3_K's high blocks span two subs); spelled as a
      // switch so that the shifts are immediates
      constexpr int per = HB ? 8 / HB : 8;
      switch ((GPS % per == 0 ? gg : g) % per) {
        case 0: group_pair<NIB, HB, SIGNED, KB / 4, 0>(tile, g, &w0, &w1); break;
        case 2: group_pair<NIB, HB, SIGNED, KB / 4, 2>(tile, g, &w0, &w1); break;
        case 4: group_pair<NIB, HB, SIGNED, KB / 4, 4>(tile, g, &w0, &w1); break;
        default: group_pair<NIB, HB, SIGNED, KB / 4, 6>(tile, g, &w0, &w1); break;
      }
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xj + kActBlock * r + 4 * gg;
        part[gg % P][r] = dpbusd_bcast(part[gg % P][r], w0, x);
        part[(gg + 1) % P][r] = dpbusd_bcast(part[(gg + 1) % P][r], w1, x + 4);
      }
    }
    __m512i isum[R];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      isum[r] = part[0][r];
      for (int p = 1; p < P; ++p) isum[r] = _mm512_add_epi32(isum[r], part[p][r]);
    }
    const __m512 dl = _mm512_load_ps(u.dl[j]);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 dxj = _mm512_set1_ps(a.dx[blk * a.mp + m0 + r]);
      y[r] = _mm512_fmadd_ps(dl, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), dxj), y[r]);
      if (FPOFF) {
        const float v = a.offset_factor<SUB>(s * (KB / 16) + j * (SUB / 16), m0 + r);
        y[r] = _mm512_fnmadd_ps(_mm512_load_ps(u.ml[j]), _mm512_set1_ps(v), y[r]);
      }
    }
  }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (m0 + r) * kTile, y[r]);
}

template <int KB, int SUB, int NIB, int HB, bool SIGNED, int OFF, bool FPOFF>
static void rows(int fmt, const FormatInfo& f, const uint8_t* tile, int count, const QActs& a, int64_t s, float* acc) {
  // Blocks of 8 rows, and the rest in one block: up to 12 rows fit the 32 zmm registers (12
  // accumulators, 12 sums, the weights), so a 9-row verify pass is one block, not 8 + 1 (a lone
  // row runs at its latency-bound cost, about 2.4 rows' worth in a block).
  PrefetchQueue& pq = thread_prefetch_queue();
  int64_t m = 0;
  for (; a.m - m > 12; m += 8) rows_block<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, 8>(fmt, f, tile, count, a, s, acc, m, pq);
  switch (a.m - m) {
#define VERISPEC_ROWS(R) \
    case R: rows_block<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, R>(fmt, f, tile, count, a, s, acc, m, pq); break;
    VERISPEC_ROWS(1) VERISPEC_ROWS(2) VERISPEC_ROWS(3) VERISPEC_ROWS(4) VERISPEC_ROWS(5) VERISPEC_ROWS(6)
    VERISPEC_ROWS(7) VERISPEC_ROWS(8) VERISPEC_ROWS(9) VERISPEC_ROWS(10) VERISPEC_ROWS(11) VERISPEC_ROWS(12)
#undef VERISPEC_ROWS
  }
}

void superblock_avx512(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count,
                       float* acc) {
  with_format(fmt, [&](auto t) {
    using A = decltype(t);
    rows<A::KB, A::SUB, A::NIB, A::HB, A::SIGNED, A::OFF, A::FPOFF>(fmt, f, tile, count, a, s, acc);
  });
}

}  // namespace verispec
