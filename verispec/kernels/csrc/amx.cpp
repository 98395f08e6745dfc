// AMX path (AMX-TILE and AMX-INT8, with AVX512 for the fp32 steps): the integer sums of a whole
// sub for 16 rows and 16 columns come from one tile dot product (tdpbsud: signed activations
// times unsigned weights; tdpbssd for Q8_0's signed weights), which the VNNI path computes with
// one dpbusd per row and group of 4 k. The packed layout's groups ([16 columns][4 k] bytes) are
// already the B-tile layout: Q8_0's weights load straight from the packed tile, 4-bit ones after
// splitting the nibbles, and Q6_K's and Q5_0's joined from their 4+2 and 4+1 bits, with their
// integer offset taken off each byte (w - 32 and w - 16 fit int8), so that tdpbssd returns sum q * (w - o) = isum directly, with no
// per-row offset term. The sums are the contract's exact int32 isum, and the fp32 steps
// per row and sub are the avx512 path's, in the same order: the bits are the same as on every
// other path, for any number of rows.
//
// Tiles (configured per thread and sub size by amx_configure, released by amx_release):
//   0-3   C: 16 rows x 16 int32 columns
//   4, 5  A: 16 rows x sub bytes (activations)
//   6, 7  B: sub / 4 groups x 64 bytes (weights)
// A tile reads 16 activation rows, so the caller pads the quantized activations to a multiple of
// 16 rows (the padding rows' results are never used).
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "qgemm.h"
#include "scales512.h"

namespace verispec {

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config(int sub, int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = (uint8_t)(t < 6 ? rows : sub / 4);
    c.colsb[t] = (uint16_t)(t < 4 || t >= 6 ? 64 : sub);
  }
  return c;
}

void unpack_nibbles(const FormatInfo& f, const uint8_t* tile, uint8_t* w) {
  const int G = f.groups();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int h = 0; h < G / 2; ++h) {
    const __m512i v = _mm512_loadu_si512(tile + 64 * h);
    _mm512_store_si512(w + 128 * h, _mm512_and_si512(v, low));
    _mm512_store_si512(w + 128 * h + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// Q6_K's 4+2 and Q5_0's 4+1 bits joined (see high_bits in avx512.cpp), minus the integer
// offset, as int8 (the values fit: 0..63 - 32, 0..31 - 16).
void unpack_high(const FormatInfo& f, const uint8_t* tile, int off, uint8_t* w) {
  const int G = f.groups(), hb = f.hbits, per = 8 / hb;
  const __m512i low = _mm512_set1_epi8(0x0f), hmask = _mm512_set1_epi8((char)(((1 << hb) - 1) << 4));
  const __m512i o = _mm512_set1_epi8((char)off);
  for (int g = 0; g < G; ++g) {
    const __m512i h = _mm512_loadu_si512(tile + G / 2 * 64 + g / per * 64);
    const int sh = 4 - hb * (g % per);
    const __m512i hs = sh > 0 ? _mm512_slli_epi16(h, sh) : sh < 0 ? _mm512_srli_epi16(h, -sh) : h;
    const __m512i v = _mm512_loadu_si512(tile + 64 * (g / 2));
    const __m512i nib = _mm512_and_si512(g % 2 ? _mm512_srli_epi16(v, 4) : v, low);
    _mm512_store_si512(w + 64 * g, _mm512_sub_epi8(_mm512_or_si512(nib, _mm512_and_si512(hs, hmask)), o));
  }
}

// The integer sums of sub J for 16 rows (activations xa, row stride 32 bytes) into c[16][16]:
// C tile J % 4, A and B tiles 4 + J % 2 and 6 + J % 2, so consecutive subs share no tile and the
// loads of one overlap the dot product of the previous.
// (The tile intrinsics take literal register numbers, hence the macro.)
#define VERISPEC_SUB_SUMS(C, A, B)                                   \
  do {                                                               \
    _tile_zero(C);                                                   \
    _tile_loadd(A, xa, 32);                                          \
    _tile_loadd(B, w, 64);                                           \
    if constexpr (SIGNED) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B); \
    _tile_stored(C, c, 64);                                          \
  } while (0)

template <int J, bool SIGNED>
inline void sub_sums(const int8_t* xa, const uint8_t* w, int32_t* c, PrefetchQueue& pq) {
  prefetch_step(pq);
  if constexpr (J % 4 == 0) VERISPEC_SUB_SUMS(0, 4, 6);
  else if constexpr (J % 4 == 1) VERISPEC_SUB_SUMS(1, 5, 7);
  else if constexpr (J % 4 == 2) VERISPEC_SUB_SUMS(2, 4, 6);
  else VERISPEC_SUB_SUMS(3, 5, 7);
}
#undef VERISPEC_SUB_SUMS

template <int SUB, bool SIGNED, int... J>
inline void all_sums(const QActs& a, int64_t b0, int64_t m0, const uint8_t* w, int32_t (*c)[16][16],
                     std::integer_sequence<int, J...>, PrefetchQueue& pq) {
  constexpr int GPS = SUB / 4;
  (sub_sums<J, SIGNED>(a.qb(b0 + J * SUB / kActBlock, m0) + J * SUB % kActBlock, w + 64 * GPS * J, &c[J][0][0], pq), ...);
}

// The contract's fp32 steps for R rows from m (row r of the sums at c[j][r0 + r]), sub by sub:
// R independent fma chains (one row at a time, each row's chain of 2 x NSUB dependent fma waits
// on their latency). On a 256-row Q4_K product, R = 8 took clearly less time than one row at a
// time, measured against the avx512 path in the same process. Per output the steps and their
// order are the contract's, as on every path.
template <int SUB, int NSUB, bool FPOFF, int R>
inline void fp32_rows(const int32_t (*c)[16][16], int r0, const Unpacked& u, const QActs& a, int64_t b0, int64_t m,
                      float* acc) {
  __m512 y[R];
  for (int i = 0; i < R; ++i) y[i] = _mm512_loadu_ps(acc + (m + i) * kTile);
  for (int j = 0; j < NSUB; ++j) {
    const int64_t blk = b0 + j * SUB / kActBlock;  // block i's scales at dx[i * a.mp]
    const float* dx = a.dx + blk * a.mp + m;
    const __m512 dl = _mm512_load_ps(u.dl[j]);
    for (int i = 0; i < R; ++i) {
      const __m512i isum = _mm512_load_si512(c[j][r0 + i]);
      y[i] = _mm512_fmadd_ps(dl, _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dx[i])), y[i]);
    }
    if constexpr (FPOFF) {
      const float* dxb = a.dxb + blk * a.mp + m;
      const __m512 ml = _mm512_load_ps(u.ml[j]);
      for (int i = 0; i < R; ++i) y[i] = _mm512_fnmadd_ps(ml, _mm512_set1_ps(dxb[i]), y[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(acc + (m + i) * kTile, y[i]);
}

template <int KB, int SUB, bool SIGNED, bool FPOFF>
void run(const uint8_t* w, const Unpacked& u, const QActs& a, int64_t s, float* acc, PrefetchQueue& pq) {
  // R rows at a time for the formats with an fp offset (two fma per sub); Q6_K measured slower
  // that way (its sixteen subs of one fma each: 0.78 against 0.73 of the avx512 path's time at
  // 256 rows, 1.14 against 1.0 at 32), so it keeps one row at a time
  constexpr int NSUB = KB / SUB, R = FPOFF ? 8 : 1;
  alignas(64) int32_t c[NSUB][16][16];
  const int64_t b0 = s * (KB / kActBlock);
  for (int64_t m0 = 0; m0 < a.m; m0 += 16) {
    all_sums<SUB, SIGNED>(a, b0, m0, w, c, std::make_integer_sequence<int, NSUB>(), pq);
    const int rows = (int)std::min<int64_t>(16, a.m - m0);
    int r = 0;
    for (; r + R <= rows; r += R) fp32_rows<SUB, NSUB, FPOFF, R>(c, r, u, a, b0, m0 + r, acc);
    for (; r < rows; ++r) fp32_rows<SUB, NSUB, FPOFF, 1>(c, r, u, a, b0, m0 + r, acc);
  }
}

}  // namespace

void amx_configure(int sub, int rows) {
  static const auto configs = [] {
    std::array<std::array<TileConfig, 17>, 2> c;
    for (int r = 1; r <= 16; ++r) c[0][r] = make_config(16, r), c[1][r] = make_config(32, r);
    return c;
  }();
  _tile_loadconfig(&configs[sub == 32][rows]);
}

void amx_release() { _tile_release(); }

void superblock_amx(int fmt, const FormatInfo& f, const uint8_t* tile0, const QActs& a, int64_t s0, int count,
                    float* acc) {
  PrefetchQueue& pq = thread_prefetch_queue();
  for (int c = 0; c < count; ++c) {
  const uint8_t* tile = tile0 + (int64_t)c * f.tile_bytes();
  const int64_t s = s0 + c;
  Unpacked u;
  const uint8_t* w = u.w;
  if (f.nibbles) unpack_nibbles(f, tile, u.w);
  else if (f.hbits) unpack_high(f, tile, int_offset(fmt), u.w);
  else w = tile;  // Q8_0
  unpack_scales(fmt, f, tile, &u);
  switch (fmt) {  // the formats of amx_runs (qgemm.h); ops.cpp sends no other here
    case Q4_K: run<256, 32, false, true>(w, u, a, s, acc, pq); break;
    case Q6_K: run<256, 16, true, false>(w, u, a, s, acc, pq); break;
    case Q5_0: run<32, 32, true, false>(w, u, a, s, acc, pq); break;
    case Q4_1: run<32, 32, false, true>(w, u, a, s, acc, pq); break;
    case Q8_0: run<32, 32, true, false>(w, u, a, s, acc, pq); break;
  }
  }
}

}  // namespace verispec
