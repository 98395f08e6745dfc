// The scalar definitions for the float formats (floats.h): repacking, dequantizing, and the
// reference row loop every ISA path matches bit for bit. Nothing here depends on the CPU.
#include "floats.h"

#include <cmath>
#include <cstring>

#include "qgemm.h"

namespace verispec {

// The file's value of element i of a run of fmt elements, widened to fp32 (exact).
static inline float widen(int fmt, const uint8_t* p, int64_t i) {
  if (fmt == F32) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  if (fmt == F16) return fp16_to_float(h);
  const uint32_t bits = (uint32_t)h << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

void float_repack_tile(int fmt, const uint8_t* raw, int64_t row_bytes, int64_t k, uint8_t* tile) {
  const int e = float_bytes(fmt);
  for (int c = 0; c < kTile; ++c)
    for (int64_t j = 0; j < k; ++j) std::memcpy(tile + (j * kTile + c) * e, raw + c * row_bytes + j * e, (size_t)e);
}

void float_dequantize_tile(int fmt, const uint8_t* tile, int64_t k, float* out, int64_t ldo) {
  for (int c = 0; c < kTile; ++c)
    for (int64_t j = 0; j < k; ++j) out[c * ldo + j] = widen(fmt, tile, j * kTile + c);
}

void float_tiles_scalar(int fmt, const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m,
                        float* acc) {
  const int64_t tile_bytes = k * kTile * float_bytes(fmt);
  for (int t = 0; t < nt; ++t)
    for (int64_t i = 0; i < m; ++i)
      for (int c = 0; c < kTile; ++c) {
        float a = acc[(t * m + i) * kTile + c];
        for (int64_t j = 0; j < k; ++j) a = std::fmaf(widen(fmt, w + t * tile_bytes, j * kTile + c), x[i * ldx + j], a);
        acc[(t * m + i) * kTile + c] = a;
      }
}

}  // namespace verispec
