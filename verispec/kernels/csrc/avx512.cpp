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

// acc + in each int32 lane, its two int16 of w times the two int16 at p (the pair repeated in every
// lane, the broadcast folded into the instruction as dpbusd_bcast's).
static inline __m512i dpwssd_bcast(__m512i acc, __m512i w, const int32_t* p) {
  __asm__("vpdpwssd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*p), "v"(w));
  return acc;
}

// Group I (0-3) of a Q2_K / Q3_K sub of 16 from its 64-byte crumb block v (bits 2I and up), with
// Q3_K's third bit from the sub's high block h (group 4H + I of the block's 8, at that bit).
// (The third bit is shifted to bit 2 and merged by one vpternlogd: low | (h' & 4).)
template <int HB, int H, int I>
static inline __m512i crumb_group(__m512i v, __m512i h) {
  const __m512i w = _mm512_and_si512(I ? _mm512_srli_epi16(v, 2 * I) : v, _mm512_set1_epi8(3));
  if constexpr (HB == 0) {
    return w;
  } else {
    constexpr int sh = 2 - (4 * H + I);  // the bit's place in its byte, 4H + I, to 2
    const __m512i hs = sh > 0 ? _mm512_slli_epi16(h, sh) : sh < 0 ? _mm512_srli_epi16(h, -sh) : h;
    return _mm512_ternarylogic_epi32(w, hs, _mm512_set1_epi8(4), 0xf8);  // A | (B & C)
  }
}

// Sub 2b + H of a Q2_K / Q3_K tile superblock against R rows: each row's exact int32 sum
// (Q3_K's starting from its offset's term) times the sub's integer scales, added into S (H = 1) or
// stored there (H = 0). xb: the activation block's row 0.
template <int HB, int OFF, int R, int H>
static inline __attribute__((always_inline)) void crumb_sub(const uint8_t* tile, const uint8_t* sc, const QActs& a,
                                                            int64_t s, int64_t blk, int64_t m0, int b,
                                                            const int8_t* xb, __m512i (&S)[R], PrefetchQueue& pq) {
  const int j = 2 * b + H;
  prefetch_step(pq);
  const __m128i scb = _mm_loadu_si128((const __m128i*)(sc + 16 * j));
  const __m512i scj = HB ? _mm512_cvtepi8_epi32(scb) : _mm512_cvtepu8_epi32(scb);
  const __m512i v = _mm512_loadu_si512(tile + 64 * j);
  const __m512i h = HB ? _mm512_loadu_si512(tile + 1024 + 64 * b) : v;
  const __m512i w[4] = {crumb_group<HB, H, 0>(v, h), crumb_group<HB, H, 1>(v, h), crumb_group<HB, H, 2>(v, h),
                        crumb_group<HB, H, 3>(v, h)};
  // One dot-product chain per row, without rows_block's partial chains: the 16 subs' chains are
  // independent of each other, so their latency overlaps anyway, and the partial chains' adds
  // cost as many instructions as the dot products.
  __m512i isum[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    if constexpr (OFF != 0) isum[r] = _mm512_set1_epi32(a.offset_term<OFF, 16>(s * 16 + j, m0 + r));
    else isum[r] = _mm512_setzero_si512();
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g)
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) isum[r] = dpbusd_bcast(isum[r], w[g], xb + kActBlock * r + 16 * H + 4 * g);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    const __m512i t = _mm512_mullo_epi32(isum[r], scj);
    S[r] = H ? _mm512_add_epi32(S[r], t) : t;
  }
}

// Q2_K and Q3_K (int_scaled, qgemm.h): per activation block (two subs of 16) and row, S = the
// subs' sums times their integer scales and Q2_K's Mn = its mins times the subs' bsums (one
// vpdpwssd on the pairs), then one fp32 step for each: acc = fma(d, (float)S * dx, acc),
// acc = fma(-dmin, dx * (float)Mn, acc). Weights and scales are read straight from the tile.
// Each block's S waits in a register through its second sub's sums, so with more than 4 rows the
// accumulators stay in acc (YMEM; touched once per block), else in y: R rows then need 2 R
// registers, and up to 12 rows run as one block, each weight group split once for all of them.
template <int HB, int OFF, bool FPOFF, int R, bool YMEM>
static inline __attribute__((always_inline)) void crumb_superblock(const uint8_t* tile, const QActs& a, int64_t s,
                                                                   int64_t m0, __m512 (&y)[R], float* acc,
                                                                   PrefetchQueue& pq) {
  const uint8_t* sc = tile + 1024 + 512 * HB;  // after the weights: 16 crumb blocks, Q3_K's 8 high blocks
  const uint16_t* d16 = (const uint16_t*)(sc + (FPOFF ? 512 : 256));
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)d16));
  const __m512 dmin = FPOFF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d16 + 16))) : d;
#pragma GCC unroll 8
  for (int b = 0; b < 8; ++b) {
    const int64_t blk = s * 8 + b;
    const int8_t* xb = a.qb(blk, m0);  // row r at xb + 32 r
    __m512i S[R];
    crumb_sub<HB, OFF, R, 0>(tile, sc, a, s, blk, m0, b, xb, S, pq);
    crumb_sub<HB, OFF, R, 1>(tile, sc, a, s, blk, m0, b, xb, S, pq);
    const __m512i mn = FPOFF ? _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(sc + 256 + 32 * b)))
                                : _mm512_setzero_si512();
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const float* dx = a.dx + blk * a.mp + m0 + r;
      __m512 yr = YMEM ? _mm512_loadu_ps(acc + (m0 + r) * kTile) : y[r];
      yr = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(S[r]), _mm512_set1_ps(*dx)), yr);
      if constexpr (FPOFF) {
        const __m512i mins = dpwssd_bcast(_mm512_setzero_si512(), mn, a.bs2 + blk * a.mp + m0 + r);
        yr = _mm512_fnmadd_ps(dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(mins), _mm512_set1_ps(*dx)), yr);
      }
      if constexpr (YMEM) _mm512_storeu_ps(acc + (m0 + r) * kTile, yr);
      else y[r] = yr;
    }
  }
}

// R rows at once, reading the weights straight from the packed tile: each pair of groups is
// loaded (and its nibbles split) once for the R rows, and the R independent dpbusd chains hide
// the instruction's latency. scales: the superblock's fp32 scales, made once for all the row
// blocks of a 256-wide format's superblock (count 1), or null to make them here.
template <int KB, int SUB, int NIB, int HB, bool SIGNED, int OFF, bool FPOFF, int R>
static void rows_block(int fmt, const FormatInfo& f, const uint8_t* tile0, int count, const QActs& a, int64_t s0,
                       float* acc, int64_t m0, PrefetchQueue& pq, const Unpacked* scales) {
  constexpr int NSUB = KB / SUB, GPS = SUB / 4;
  __m512 y[R];
  if constexpr (NIB == 2 && R > 4) {  // Q2_K, Q3_K with their accumulators in acc
    for (int c = 0; c < count; ++c)
      crumb_superblock<HB, OFF, FPOFF, R, true>(tile0 + (int64_t)c * f.tile_bytes(), a, s0 + c, m0, y, acc, pq);
    return;
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) y[r] = _mm512_loadu_ps(acc + (m0 + r) * kTile);
  // count consecutive superblocks with the accumulators kept in registers (the 32-wide formats
  // come several at a time)
  for (int c = 0; c < count; ++c) {
  const uint8_t* tile = tile0 + (int64_t)c * f.tile_bytes();
  const int64_t s = s0 + c;
  if constexpr (NIB == 2) {  // Q2_K, Q3_K
    crumb_superblock<HB, OFF, FPOFF, R, false>(tile, a, s, m0, y, acc, pq);
    continue;
  }
  const int64_t b0 = s * (KB / kActBlock);
  Unpacked own;  // the scales only: the weights are read from the tile
  const Unpacked& u = scales ? *scales : (unpack_scales(fmt, f, tile, &own), own);
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
      if (FPOFF) y[r] = _mm512_fnmadd_ps(_mm512_load_ps(u.ml[j]), _mm512_set1_ps(a.dxb[blk * a.mp + m0 + r]), y[r]);
    }
  }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (m0 + r) * kTile, y[r]);
}

// Blocks of at most 12 rows for a call of M rows: the fewest blocks, ceil(M / 12), of sizes that
// differ by at most one (13 rows: 7 + 6; 17: 9 + 8; 24: 12 + 12). Each block unpacks the tile's
// weights again, so fewer blocks save that work, and even sizes keep every block wide enough that
// its dot-product chains overlap (a lone row runs at its latency-bound cost, about 2.4 rows' worth
// in a block). Up to 12 rows fit the 32 zmm registers (12 accumulators, 12 sums, the weights).
// A 256-wide superblock's fp32 scales are made once for all its blocks. Row blocks never change
// a row's arithmetic: the contract fixes each row's sums and fp32 order.
static inline int row_block_size(int64_t rows_left, int64_t blocks_left) {
  return (int)((rows_left + blocks_left - 1) / blocks_left);
}

template <int KB, int SUB, int NIB, int HB, bool SIGNED, int OFF, bool FPOFF>
static void rows(int fmt, const FormatInfo& f, const uint8_t* tile, int count, const QActs& a, int64_t s, float* acc) {
  PrefetchQueue& pq = thread_prefetch_queue();
  const int64_t nblocks = (a.m + 11) / 12;
  Unpacked shared;
  const Unpacked* scales = nullptr;
  if (KB == 256 && NIB != 2 && nblocks > 1 && count == 1) {  // (ops.cpp calls them one at a time)
    unpack_scales(fmt, f, tile, &shared);
    scales = &shared;
  }
  for (int64_t m = 0, blocks = nblocks; blocks > 0; --blocks) {
    const int r = row_block_size(a.m - m, blocks);
    switch (r) {
#define VERISPEC_ROWS(R) \
      case R: rows_block<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, R>(fmt, f, tile, count, a, s, acc, m, pq, scales); break;
      VERISPEC_ROWS(1) VERISPEC_ROWS(2) VERISPEC_ROWS(3) VERISPEC_ROWS(4) VERISPEC_ROWS(5) VERISPEC_ROWS(6)
      VERISPEC_ROWS(7) VERISPEC_ROWS(8) VERISPEC_ROWS(9) VERISPEC_ROWS(10) VERISPEC_ROWS(11) VERISPEC_ROWS(12)
#undef VERISPEC_ROWS
    }
    m += r;
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
