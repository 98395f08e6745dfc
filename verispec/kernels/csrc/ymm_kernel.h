// The 256-bit kernel body shared by the AVX2 path (avx2.cpp) and the AVX-VNNI one (avxvnni.cpp):
// a 64-byte group is two ymm, columns 0-7 and 8-15, read straight from the packed tile (nibbles
// and high bits joined in registers, as the AVX512 path does), and used for a block of up to 4
// rows; per row and group one dot product of u8 weights with s8 activations into int32 column
// lanes, and per sub the fp32 steps of the contract (qgemm.h), on accumulators kept in the
// caller's acc (L1). Signed weights (Q8_0, IQ4) move their signs onto the activations with vpsignb
// (AVX2), or are read as w + 128 (AVX-VNNI).
//
// The including file sets the instruction set (#pragma GCC target) and defines, before the
// include, dot_u8s8(acc, w, x): acc plus, in each int32 lane, the sum of its four u8 x s8
// products. Both definitions give the same int32. AVX2's maddubs first adds two products into an
// int16, which cannot saturate here: stored weights are at most 63 (Q6_K) or 128 in magnitude
// (Q8_0) and activations at most 127, so a pair is at most 32512. VNNI's vpdpbusd adds all four
// into the int32 at once. Everything here is static, so each file gets its own copy compiled for
// its own instructions.
#ifndef VERISPEC_YMM_KERNEL_H_
#define VERISPEC_YMM_KERNEL_H_

#include <immintrin.h>

#include "qgemm.h"

namespace verispec {

// dl and ml of every sub of one tile superblock, one lane per column in two halves of 8 (the
// definitions are dl_of and ml_of in ref.cpp; the same fp32 products).
static inline __m256 u8_as_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline __m256 i8_as_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// Inlined: a call from the row loop would also cost a vzeroupper and the loop's reloaded constants.
static inline __attribute__((always_inline)) void unpack_scales(int fmt, const FormatInfo& f, const uint8_t* tile, Unpacked* u) {
  const uint8_t* s = tile + f.weight_bytes();
  const uint16_t* d16 = (const uint16_t*)(s + f.scale_bytes());
  for (int h = 0; h < 2; ++h) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 8 * h)));
    switch (fmt) {
      case Q4_K: case Q5_K: {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 16 + 8 * h)));
        for (int j = 0; j < f.nsub(); ++j) {
          _mm256_store_ps(u->dl[j] + 8 * h, _mm256_mul_ps(d, u8_as_float(s + 16 * j + 8 * h)));
          _mm256_store_ps(u->ml[j] + 8 * h, _mm256_mul_ps(dmin, u8_as_float(s + 16 * (f.nsub() + j) + 8 * h)));
        }
        break;
      }
      case Q6_K: case IQ4_XS:
        for (int j = 0; j < f.nsub(); ++j) _mm256_store_ps(u->dl[j] + 8 * h, _mm256_mul_ps(d, i8_as_float(s + 16 * j + 8 * h)));
        break;
      case Q4_1: case Q5_1: {  // ml = -m by flipping the sign bit, as the scalar negation does
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

// Four activation bytes in every 32-bit lane, as one load-port broadcast.
static inline __m256i bcast4(const int8_t* p) { return _mm256_castps_si256(_mm256_broadcast_ss((const float*)p)); }

// The weights of group g of a tile superblock (G groups), columns 0-7 in w[0] and 8-15 in w[1],
// as the dot product's unsigned operand (Q8_0, IQ4: the magnitudes, the signs in sg). GI: the group's
// place in its high block, g % (8 / HB), a constant so that the shifts are immediates.
template <int NIB, int HB, bool SIGNED, int G, int GI>
static inline void group_weights(const uint8_t* tile, int g, __m256i* w, __m256i* sg) {
  if constexpr (NIB == 2) {  // Q2_K, Q3_K: block g / 4, group g at bits 2 (g % 4) (GI % 4 == g % 4)
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(tile + 64 * (g / 4) + 32 * half));
      w[half] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (GI % 4)), _mm256_set1_epi8(3));
      if constexpr (HB > 0) {  // Q3_K's third bit, moved to bit 2
        constexpr int sh = 2 - HB * GI;
        const __m256i h = _mm256_loadu_si256((const __m256i*)(tile + G / 4 * 64 + 64 * (g / (8 / HB)) + 32 * half));
        const __m256i hs = sh > 0 ? _mm256_slli_epi16(h, sh) : sh < 0 ? _mm256_srli_epi16(h, -sh) : h;
        w[half] = _mm256_or_si256(w[half], _mm256_and_si256(hs, _mm256_set1_epi8((char)(((1 << HB) - 1) << 2))));
      }
    }
  } else if constexpr (NIB || HB) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(tile + 64 * (g / 2) + 32 * half));
      w[half] = _mm256_and_si256(GI % 2 ? _mm256_srli_epi16(v, 4) : v, low);  // GI % 2 == g % 2
      if constexpr (HB > 0) {
        constexpr int sh = 4 - HB * GI;
        const __m256i h = _mm256_loadu_si256((const __m256i*)(tile + G / 2 * 64 + 64 * (g / (8 / HB)) + 32 * half));
        const __m256i hs = sh > 0 ? _mm256_slli_epi16(h, sh) : sh < 0 ? _mm256_srli_epi16(h, -sh) : h;
        w[half] = _mm256_or_si256(w[half], _mm256_and_si256(hs, _mm256_set1_epi8((char)(((1 << HB) - 1) << 4))));
      }
      if constexpr (SIGNED) {  // IQ4: each nibble picks its int8 value, then as Q8_0's bytes below
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kIq4Values));
        sg[half] = _mm256_shuffle_epi8(table, w[half]);
        w[half] = kInt16Sums ? _mm256_abs_epi8(sg[half]) : _mm256_xor_si256(sg[half], _mm256_set1_epi8((char)0x80));
      }
    }
  } else {
    static_assert(SIGNED, "Q8_0 is the one 8-bit format");
    for (int half = 0; half < 2; ++half) {
      sg[half] = _mm256_loadu_si256((const __m256i*)(tile + 64 * g + 32 * half));
      // VNNI: w + 128 (the top bit flipped), the sums starting from -128 * bsum (QActs::off128);
      // AVX2's maddubs would saturate on (w + 128) * x, so it takes |w| and the signs onto x
      w[half] = kInt16Sums ? _mm256_abs_epi8(sg[half]) : _mm256_xor_si256(sg[half], _mm256_set1_epi8((char)0x80));
    }
  }
}

// Groups whose maddubs results can be added in int16 before one madd widens them (AVX2 only:
// kInt16Sums): each int16 lane then sums 2 products per group, each at most wmax * 127 in
// magnitude, so chunk * 2 * wmax * 127 must stay within 32767 for the sum to be exact: the 4-bit
// formats (wmax 15) 8 groups, the 4+1-bit ones (31) 4, Q6_K (63) 2, the 8-bit ones (128) 1. The largest such divisor of
// the groups per sub (gps). Fewer madds: a Q4_K sub takes 16 maddubs, 16 adds and 2 madds per
// row instead of 16 maddubs, 16 madds and 16 adds.
constexpr int int16_chunk(int wmax, int gps) {
  int ch = 1;
  for (int c = 1; c <= gps; ++c)
    if (gps % c == 0 && c * 2 * wmax * 127 <= 32767) ch = c;
  return ch;
}

// OFF times the int16 pair of sums of the sub of SUB k starting at 16-block i, row m
// (QActs::cen16, cen32): what to take from a maddubs sum of w * x so that it becomes the sum of
// (w - OFF) * x, lane by lane. Those int16 sums are exact although the running sums of w * x may
// wrap: additions mod 2^16 end on the true value whenever it fits in an int16, and
// |sum (w - OFF) x| <= CH * 2 * OFF * 127. Then the sub's int32 sum is the contract's
// sum q * x - OFF * bsum without the separate offset.
template <int OFF, int SUB>
static inline const int32_t& centered_offset(const QActs& a, int64_t m, int64_t i) {
  static_assert(OFF == (SUB == 16 ? 32 : 16), "the centered offsets QActs holds: Q6_K's and Q5_0's");
  return SUB == 16 ? a.cen16[i * a.mp + m] : a.cen32[i / 2 * a.mp + m];
}

// Q2_K and Q3_K (int_scaled, qgemm.h), after the int32 sums i0, i1 (columns 0-7, 8-15) of sub j of
// a tile superblock: per row, S = the sums times the sub's integer scales, kept in block_sum after
// a block's first sub; after its second, one fp32 step (and Q2_K's min step, its Mn the mins'
// int16 pairs times the block's two bsums in one madd) on the row's accumulators in acc.
template <int HB, bool FPOFF, int R>
static inline __attribute__((always_inline)) void int_scaled_step(const uint8_t* tile, const QActs& a, int64_t blk,
                                                                  int64_t m0, int j, const __m256i (&i0)[R],
                                                                  const __m256i (&i1)[R], int32_t (&block_sum)[R][kTile],
                                                                  float* acc) {
  const uint8_t* sc = tile + 1024 + 512 * HB;  // after the weights: 16 crumb blocks, Q3_K's 8 high blocks
  const __m128i scb = _mm_loadu_si128((const __m128i*)(sc + 16 * j));
  const __m256i sc0 = HB ? _mm256_cvtepi8_epi32(scb) : _mm256_cvtepu8_epi32(scb);
  const __m256i sc1 = HB ? _mm256_cvtepi8_epi32(_mm_srli_si128(scb, 8)) : _mm256_cvtepu8_epi32(_mm_srli_si128(scb, 8));
  if (j % 2 == 0) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm256_store_si256((__m256i*)block_sum[r], _mm256_mullo_epi32(i0[r], sc0));
      _mm256_store_si256((__m256i*)(block_sum[r] + 8), _mm256_mullo_epi32(i1[r], sc1));
    }
    return;
  }
  const uint16_t* d16 = (const uint16_t*)(sc + (FPOFF ? 512 : 256));
  const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)d16));
  const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 8)));
  const uint8_t* mn = sc + 256 + 16 * (j - 1);  // Q2_K: the block's [16 columns][2] mins
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256i s0 = _mm256_add_epi32(_mm256_load_si256((const __m256i*)block_sum[r]), _mm256_mullo_epi32(i0[r], sc0));
    const __m256i s1 =
        _mm256_add_epi32(_mm256_load_si256((const __m256i*)(block_sum[r] + 8)), _mm256_mullo_epi32(i1[r], sc1));
    float* y = acc + (m0 + r) * kTile;
    const __m256 dxj = _mm256_set1_ps(a.dx[blk * a.mp + m0 + r]);
    __m256 y0 = _mm256_fmadd_ps(d0, _mm256_mul_ps(_mm256_cvtepi32_ps(s0), dxj), _mm256_loadu_ps(y));
    __m256 y1 = _mm256_fmadd_ps(d1, _mm256_mul_ps(_mm256_cvtepi32_ps(s1), dxj), _mm256_loadu_ps(y + 8));
    if constexpr (FPOFF) {
      const __m256i bs = _mm256_set1_epi32(a.bs2[blk * a.mp + m0 + r]);
      const __m256 dmin0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 16)));
      const __m256 dmin1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d16 + 24)));
      const __m256i mn0 = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)mn)), bs);
      const __m256i mn1 = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(mn + 16))), bs);
      y0 = _mm256_fnmadd_ps(dmin0, _mm256_mul_ps(_mm256_cvtepi32_ps(mn0), dxj), y0);
      y1 = _mm256_fnmadd_ps(dmin1, _mm256_mul_ps(_mm256_cvtepi32_ps(mn1), dxj), y1);
    }
    _mm256_storeu_ps(y, y0);
    _mm256_storeu_ps(y + 8, y1);
  }
}

// R rows (R <= 4) against count consecutive tile superblocks. Each group's weights are made once
// for the R rows (MADE: read from made, where make_weights put them for every block); the int32
// sums of a sub stay in registers (2 R of them), the fp32 accumulators in acc. scales: the
// superblock's dl and ml when the caller unpacked them (count 1), else null.
template <int KB, int SUB, int NIB, int HB, bool SIGNED, int OFF, bool FPOFF, int R, bool MADE>
static void rows_block(int fmt, const FormatInfo& f, const uint8_t* tile0, int count, const QActs& a, int64_t s0,
                       float* acc, int64_t m0, PrefetchQueue& pq, const Unpacked* scales, const __m256i* made) {
  constexpr int NSUB = KB / SUB, GPS = SUB / 4, G = KB / 4, PER = HB ? 8 / HB : 8;
  // CENTER: the offset formats' int16 sums are of w - OFF (at most OFF in magnitude), a whole sub
  // per chunk, where the stored w alone would take more chunks (Q6_K, Q5_0; the nibble formats
  // with an offset, Q4_0 and Q3_K, take a whole sub per chunk as they are, and start from the
  // offset's term); see centered_offset.
  constexpr int WMAX = SIGNED ? 128 : NIB == 2 ? (4 << HB) - 1 : NIB ? 15 : HB ? (16 << HB) - 1 : 128;
  constexpr bool CENTER = kInt16Sums && OFF > 0 && int16_chunk(WMAX, GPS) < GPS && int16_chunk(OFF, GPS) == GPS;
  constexpr int CH = CENTER ? GPS : kInt16Sums ? int16_chunk(WMAX, GPS) : 1;
  for (int c = 0; c < count; ++c) {
    const uint8_t* tile = tile0 + (int64_t)c * f.tile_bytes();
    const int64_t s = s0 + c;
    const int64_t b0 = s * (KB / kActBlock);
    Unpacked own;  // the scales only (Q2_K's and Q3_K's are read in the loop)
    if (NIB != 2 && !scales) unpack_scales(fmt, f, tile, &own);
    const Unpacked& u = scales ? *scales : own;
    alignas(32) int32_t block_sum[R][kTile];  // Q2_K, Q3_K: a block's first sub's S, per row
    for (int j = 0; j < NSUB; ++j) {
      const int64_t blk = b0 + j * SUB / kActBlock;
      const int8_t* xj = a.qb(blk, m0) + j * SUB % kActBlock;  // row r at xj + 32 r
      prefetch_step(pq);
      __m256i i0[R], i1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        // An offset format starts from the offset's term, -o * bsum_j (QActs::offset_term),
        // instead of subtracting it after the dot products, and on AVX-VNNI the signed formats,
        // read as w + 128, from -128 * bsum_j (off128); AVX2 centers the int16 lanes of Q6_K and
        // Q5_0 instead (centered_offset).
        if constexpr (SIGNED && !kInt16Sums) {
          i0[r] = i1[r] = _mm256_set1_epi32(a.off128[blk * a.mp + m0 + r]);
        } else if constexpr (OFF != 0 && !CENTER) {
          i0[r] = i1[r] = _mm256_set1_epi32(a.offset_term<OFF, SUB>(s * (KB / 16) + j * (SUB / 16), m0 + r));
        } else {
          i0[r] = i1[r] = _mm256_setzero_si256();
        }
      }
#pragma GCC unroll 8
      for (int c0 = 0; c0 < GPS; c0 += CH) {  // CH groups per int16 chunk (1: straight to int32)
        __m256i t0[R], t1[R];
        if constexpr (CH > 1) {
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) t0[r] = t1[r] = _mm256_setzero_si256();
        }
#pragma GCC unroll 8
        for (int gg = c0; gg < c0 + CH; ++gg) {
          const int g = j * GPS + gg;
          __m256i w[2], sg[2];
          if constexpr (MADE) {
            w[0] = _mm256_load_si256(made + 2 * (c * G + g));
            w[1] = _mm256_load_si256(made + 2 * (c * G + g) + 1);
          } else switch ((GPS % PER == 0 ? gg : g) % PER) {  // a constant where GPS is a multiple of PER
#define VERISPEC_GROUP(I) \
            case I: group_weights<NIB, HB, SIGNED, G, I>(tile, g, w, sg); break;
            VERISPEC_GROUP(0) VERISPEC_GROUP(1) VERISPEC_GROUP(2) VERISPEC_GROUP(3)
            VERISPEC_GROUP(4) VERISPEC_GROUP(5) VERISPEC_GROUP(6) VERISPEC_GROUP(7)
#undef VERISPEC_GROUP
          }
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256i x = bcast4(xj + kActBlock * r + 4 * gg);
            constexpr bool SIGNS = SIGNED && kInt16Sums;  // the signs moved onto x (AVX2)
            const __m256i x0 = SIGNS ? _mm256_sign_epi8(x, sg[0]) : x, x1 = SIGNS ? _mm256_sign_epi8(x, sg[1]) : x;
            if constexpr (CH > 1) {
              t0[r] = _mm256_add_epi16(t0[r], _mm256_maddubs_epi16(w[0], x0));
              t1[r] = _mm256_add_epi16(t1[r], _mm256_maddubs_epi16(w[1], x1));
              // Keeps GCC from reassociating the sums into a tree of all the sub's products
              // (held in 32 spilled registers for 3 rows); one chain per accumulator instead.
              // One row had no spills and needs no barrier.
              if constexpr (R > 1) __asm__("" : "+x"(t0[r]), "+x"(t1[r]));
            } else {
              i0[r] = dot_u8s8(i0[r], w[0], x0);
              i1[r] = dot_u8s8(i1[r], w[1], x1);
            }
          }
        }
        if constexpr (CH > 1) {
          const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            if constexpr (CENTER) {
              const __m256i o = _mm256_set1_epi32(centered_offset<OFF, SUB>(a, m0 + r, s * (KB / 16) + j * (SUB / 16)));
              t0[r] = _mm256_sub_epi16(t0[r], o);
              t1[r] = _mm256_sub_epi16(t1[r], o);
            }
            i0[r] = _mm256_add_epi32(i0[r], _mm256_madd_epi16(t0[r], ones));
            i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(t1[r], ones));
          }
        }
      }
      if constexpr (NIB == 2) {
        int_scaled_step<HB, FPOFF, R>(tile, a, blk, m0, j, i0, i1, block_sum, acc);
        continue;
      }
      const __m256 dl0 = _mm256_load_ps(u.dl[j]), dl1 = _mm256_load_ps(u.dl[j] + 8);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        float* y = acc + (m0 + r) * kTile;
        const __m256 dxj = _mm256_set1_ps(a.dx[blk * a.mp + m0 + r]);
        __m256 y0 = _mm256_fmadd_ps(dl0, _mm256_mul_ps(_mm256_cvtepi32_ps(i0[r]), dxj), _mm256_loadu_ps(y));
        __m256 y1 = _mm256_fmadd_ps(dl1, _mm256_mul_ps(_mm256_cvtepi32_ps(i1[r]), dxj), _mm256_loadu_ps(y + 8));
        if (FPOFF) {
          const __m256 v = _mm256_set1_ps(a.dxb[blk * a.mp + m0 + r]);
          y0 = _mm256_fnmadd_ps(_mm256_load_ps(u.ml[j]), v, y0);
          y1 = _mm256_fnmadd_ps(_mm256_load_ps(u.ml[j] + 8), v, y1);
        }
        _mm256_storeu_ps(y, y0);
        _mm256_storeu_ps(y + 8, y1);
      }
    }
  }
}

// The weights of count consecutive tile superblocks (count * KB / 4 <= 64 groups), as group_weights
// makes them: group g of superblock c at made[2 (c G + g)] (columns 0-7) and the next (8-15).
template <int KB, int NIB, int HB, bool SIGNED>
static inline void make_weights(const FormatInfo& f, const uint8_t* tile0, int count, __m256i* made) {
  constexpr int G = KB / 4, PER = HB ? 8 / HB : 8;
  for (int c = 0; c < count; ++c) {
    const uint8_t* tile = tile0 + (int64_t)c * f.tile_bytes();
    for (int g0 = 0; g0 < G; g0 += PER) {
#pragma GCC unroll 8
      for (int gi = 0; gi < PER; ++gi) {
        __m256i* w = made + 2 * (c * G + g0 + gi);
        __m256i sg[2];
        switch (gi) {
#define VERISPEC_GROUP(I) \
          case I: group_weights<NIB, HB, SIGNED, G, I>(tile, g0 + gi, w, sg); break;
          VERISPEC_GROUP(0) VERISPEC_GROUP(1) VERISPEC_GROUP(2) VERISPEC_GROUP(3)
          VERISPEC_GROUP(4) VERISPEC_GROUP(5) VERISPEC_GROUP(6) VERISPEC_GROUP(7)
#undef VERISPEC_GROUP
        }
      }
    }
  }
}

// The rows in blocks of at most 4, as even as possible (9 rows: 3 + 3 + 3), since a block's
// cost per row falls with its size. made: the weights made once for all the blocks, or null.
template <int KB, int SUB, int NIB, int HB, bool SIGNED, int OFF, bool FPOFF, bool MADE>
static void row_blocks(int fmt, const FormatInfo& f, const uint8_t* tile, int count, const QActs& a, int64_t s,
                       float* acc, PrefetchQueue& pq, const Unpacked* scales, const __m256i* made) {
  int64_t m = 0;
  while (m < a.m) {
    const int64_t left = a.m - m, blocks = (left + 3) / 4, r = (left + blocks - 1) / blocks;
    switch (r) {
      case 1: rows_block<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, 1, MADE>(fmt, f, tile, count, a, s, acc, m, pq, scales, made); break;
      case 2: rows_block<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, 2, MADE>(fmt, f, tile, count, a, s, acc, m, pq, scales, made); break;
      case 3: rows_block<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, 3, MADE>(fmt, f, tile, count, a, s, acc, m, pq, scales, made); break;
      default: rows_block<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, 4, MADE>(fmt, f, tile, count, a, s, acc, m, pq, scales, made); break;
    }
    m += r;
  }
}

// A K-quant superblock's scales are unpacked once for all the row blocks (a few per cent faster
// at 9 and 16 rows); the 32-wide formats' are a few loads, made inside the block. With more than
// 12 rows (a long prompt's prefill, a wide batch) the weights are also made once, into L1, for
// all the blocks: their stores cost about what two blocks' unpacking saves, so fewer rows keep
// the unpacking in the block (made once, 9 rows of Q4_K were slower; 16 to 64 rows of Q4_K, Q6_K
// and Q5_0 faster: docs/kernels.md, Dispatch per ISA). Q8_0's weights take one instruction to
// make and keep their own path.
template <int KB, int SUB, int NIB, int HB, bool SIGNED, int OFF, bool FPOFF>
static void rows(int fmt, const FormatInfo& f, const uint8_t* tile, int count, const QActs& a, int64_t s, float* acc) {
  PrefetchQueue& pq = thread_prefetch_queue();
  Unpacked u;
  const Unpacked* scales = nullptr;
  if (KB == 256 && NIB != 2 && count == 1 && a.m > 4) {
    unpack_scales(fmt, f, tile, &u);
    scales = &u;
  }
  constexpr int kMadeGroups = 64;  // the 256-wide formats' groups, or kGroup 32-wide superblocks'
  if constexpr (!SIGNED) {
    if (a.m > 12 && count * (KB / 4) <= kMadeGroups) {
      alignas(32) __m256i made[2 * kMadeGroups];
      make_weights<KB, NIB, HB, SIGNED>(f, tile, count, made);
      row_blocks<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, true>(fmt, f, tile, count, a, s, acc, pq, scales, made);
      return;
    }
  }
  row_blocks<KB, SUB, NIB, HB, SIGNED, OFF, FPOFF, false>(fmt, f, tile, count, a, s, acc, pq, scales, nullptr);
}

static inline void superblock_ymm(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s,
                                  int count, float* acc) {
  with_format(fmt, [&](auto t) {
    using A = decltype(t);
    rows<A::KB, A::SUB, A::NIB, A::HB, A::SIGNED, A::OFF, A::FPOFF>(fmt, f, tile, count, a, s, acc);
  });
}

}  // namespace verispec

#endif  // VERISPEC_YMM_KERNEL_H_
