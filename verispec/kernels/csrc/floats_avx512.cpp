// AVX512 path of the float formats (floats.h): one zmm holds one k of a tile's 16 columns, each
// lane one output's chain of fused multiply-adds over k, so no lane ever meets another. A step
// takes up to two tiles and up to 8 rows (16 accumulators), each loaded weight vector feeding
// every row of the block; the accumulators live in registers over a run of k and in acc
// between runs (an exact store and load).
#pragma GCC target("avx512f,avx512bw,avx512vl,fma,f16c")
#include <immintrin.h>

#include "floats.h"
#include "qgemm.h"

namespace verispec {
namespace {

// k = j of a tile's 16 columns, widened to fp32 (exact).
template <int FMT>
inline __m512 load16(const uint8_t* tile, int64_t j) {
  if constexpr (FMT == F32) {
    return _mm512_loadu_ps((const float*)tile + j * kTile);
  } else {
    const __m256i h = _mm256_loadu_si256((const __m256i*)(tile + j * kTile * 2));
    if constexpr (FMT == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <int FMT, int NT, int R>
void block(const uint8_t* w, int64_t tile_bytes, int64_t j0, int64_t j1, const float* x, int64_t ldx, int64_t m,
           float* acc) {
  __m512 a[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a[r][t] = _mm512_loadu_ps(acc + (t * m + r) * kTile);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = load16<FMT>(w + t * tile_bytes, j);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + j]);
      for (int t = 0; t < NT; ++t) a[r][t] = _mm512_fmadd_ps(wv[t], xb, a[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc + (t * m + r) * kTile, a[r][t]);
}

constexpr int kRows = 8;

template <int FMT, int NT>
void tiles(const uint8_t* w, int64_t k, const float* x, int64_t ldx, int64_t m, float* acc) {
  const int64_t tile_bytes = k * kTile * (FMT == F32 ? 4 : 2);
  for (int64_t j0 = 0; j0 < k; j0 += kFloatKRun) {
    const int64_t j1 = j0 + kFloatKRun < k ? j0 + kFloatKRun : k;
    for (int64_t i = 0; i < m; i += kRows) {
      const float* xr = x + i * ldx;
      float* ar = acc + i * kTile;  // row i of tile t at ar + (t * m + r) * 16, as block reads it
      switch (m - i < kRows ? m - i : kRows) {
#define VERISPEC_ROWS(R) \
  case R: block<FMT, NT, R>(w, tile_bytes, j0, j1, xr, ldx, m, ar); break;
        VERISPEC_ROWS(1) VERISPEC_ROWS(2) VERISPEC_ROWS(3) VERISPEC_ROWS(4)
        VERISPEC_ROWS(5) VERISPEC_ROWS(6) VERISPEC_ROWS(7) VERISPEC_ROWS(8)
#undef VERISPEC_ROWS
      }
    }
  }
}

template <int FMT>
void tiles_of(const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m, float* acc) {
  if (nt == 2) tiles<FMT, 2>(w, k, x, ldx, m, acc);
  else tiles<FMT, 1>(w, k, x, ldx, m, acc);
}

}  // namespace

void float_tiles_avx512(int fmt, const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m,
                        float* acc) {
  switch (fmt) {
    case F32: tiles_of<F32>(w, k, nt, x, ldx, m, acc); break;
    case F16: tiles_of<F16>(w, k, nt, x, ldx, m, acc); break;
    case BF16: tiles_of<BF16>(w, k, nt, x, ldx, m, acc); break;
  }
}

}  // namespace verispec
