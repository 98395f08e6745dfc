// AVX2 path of the float formats (floats.h): a tile's 16 columns at one k are two ymm (columns
// 0-7 and 8-15), each lane one output's chain of fused multiply-adds over k, so no lane ever
// meets another. With 16 registers, a step takes two tiles and up to 2 rows (8 accumulators),
// or one tile and up to 6 rows (12); the accumulators live in registers over a run of k and in
// acc between runs (an exact store and load).
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "floats.h"
#include "qgemm.h"

namespace verispec {
namespace {

// k = j of columns h*8 .. h*8 + 7 of a tile, widened to fp32 (exact).
template <int FMT>
inline __m256 load8(const uint8_t* tile, int64_t j, int h) {
  if constexpr (FMT == F32) {
    return _mm256_loadu_ps((const float*)tile + j * kTile + 8 * h);
  } else {
    const __m128i v = _mm_loadu_si128((const __m128i*)(tile + (j * kTile + 8 * h) * 2));
    if constexpr (FMT == F16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
}

template <int FMT, int NT, int R>
void block(const uint8_t* w, int64_t tile_bytes, int64_t j0, int64_t j1, const float* x, int64_t ldx, int64_t m,
           float* acc) {
  __m256 a[R][NT][2];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < 2; ++h) a[r][t][h] = _mm256_loadu_ps(acc + (t * m + r) * kTile + 8 * h);
  for (int64_t j = j0; j < j1; ++j) {
    __m256 wv[NT][2];
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < 2; ++h) wv[t][h] = load8<FMT>(w + t * tile_bytes, j, h);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + j);
      for (int t = 0; t < NT; ++t)
        for (int h = 0; h < 2; ++h) a[r][t][h] = _mm256_fmadd_ps(wv[t][h], xb, a[r][t][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + (t * m + r) * kTile + 8 * h, a[r][t][h]);
}

template <int FMT, int NT>
void tiles(const uint8_t* w, int64_t k, const float* x, int64_t ldx, int64_t m, float* acc) {
  constexpr int kRows = NT == 2 ? 2 : 6;
  const int64_t tile_bytes = k * kTile * (FMT == F32 ? 4 : 2);
  for (int64_t j0 = 0; j0 < k; j0 += kFloatKRun) {
    const int64_t j1 = j0 + kFloatKRun < k ? j0 + kFloatKRun : k;
    for (int64_t i = 0; i < m; i += kRows) {
      const float* xr = x + i * ldx;
      float* ar = acc + i * kTile;  // row i of tile t at ar + (t * m + r) * 16, as block reads it
      const int64_t rows = m - i < kRows ? m - i : kRows;
      if constexpr (NT == 2) {
        if (rows == 1) block<FMT, 2, 1>(w, tile_bytes, j0, j1, xr, ldx, m, ar);
        else block<FMT, 2, 2>(w, tile_bytes, j0, j1, xr, ldx, m, ar);
      } else {
        switch (rows) {
#define VERISPEC_ROWS(R) \
  case R: block<FMT, 1, R>(w, tile_bytes, j0, j1, xr, ldx, m, ar); break;
          VERISPEC_ROWS(1) VERISPEC_ROWS(2) VERISPEC_ROWS(3) VERISPEC_ROWS(4) VERISPEC_ROWS(5) VERISPEC_ROWS(6)
#undef VERISPEC_ROWS
        }
      }
    }
  }
}

template <int FMT>
void tiles_of(const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m, float* acc) {
  // two tiles a step where there are at most two rows (more independent chains for a decode
  // step); else one tile, more rows
  if (nt == 2 && m <= 2) {
    tiles<FMT, 2>(w, k, x, ldx, m, acc);
  } else {
    const int64_t tile_bytes = k * kTile * (FMT == F32 ? 4 : 2);
    for (int t = 0; t < nt; ++t) tiles<FMT, 1>(w + t * tile_bytes, k, x, ldx, m, acc + t * m * kTile);
  }
}

}  // namespace

void float_tiles_avx2(int fmt, const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m,
                      float* acc) {
  switch (fmt) {
    case F32: tiles_of<F32>(w, k, nt, x, ldx, m, acc); break;
    case F16: tiles_of<F16>(w, k, nt, x, ldx, m, acc); break;
    case BF16: tiles_of<BF16>(w, k, nt, x, ldx, m, acc); break;
  }
}

}  // namespace verispec
