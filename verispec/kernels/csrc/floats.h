// Float weights (GGUF's F32, F16 and BF16 tensors) on the kernels: the contract, the layout and
// the row loops, beside the quantized formats of qgemm.h and under the same guarantee.
//
// Contract. For activations x [M, K] (float32, never quantized: a layer's fused input, glu or
// norm, is made in float32 exactly as for the quantized formats) and a float weight W [N, K],
// each output is one fp32 accumulator run over k in order, with a fused multiply-add per k:
//   acc = 0;  for k = 0 .. K-1:  acc = fma(w[n, k], x[m, k], acc)
// where w[n, k] is the file's value widened to fp32, which is exact (F16 by vcvtph2ps or
// fp16_to_float, BF16 by a 16-bit left shift, F32 as stored). Every path runs exactly this
// chain for every output: the vector paths hold one output per lane (16 columns of a tile in
// one zmm, or two ymm), so no reduction ever crosses lanes, and independent chains (other
// columns, other rows) are what hides the multiply-add's latency. Nothing about rows per block,
// tiles per step, threads or SIMD width can change a result. Threads split output columns only
// (in tiles of 16, as for every format); the reduction over K is never split.
//
// Packed layout. Columns in tiles of 16, each tile stored k-major:
//   [N/16 tiles][K][16 cols] elements of the file's own type (F32 4 bytes, F16 and BF16 2)
// One F16 tile (columns n0 .. n0 + 15), byte offsets:
//   0:  w[n0, 0]  w[n0+1, 0]  ...  w[n0+15, 0]     32 bytes: one ymm, vcvtph2ps -> one zmm
//   32: w[n0, 1]  w[n0+1, 1]  ...  w[n0+15, 1]
//   ...
//   32 (K-1): w[n0, K-1]  ...  w[n0+15, K-1]      the next tile follows
// so one k of one tile is one contiguous vector load (64 bytes of F32, 32 of F16 or BF16) that
// feeds 16 columns, reused across every row in the pass. The packed weight is exactly the
// file's size. K must be a multiple of 32, as for the quantized formats (a fused input is made
// in activation blocks of 32), and N of 16.
#pragma once

#include <cstdint>

namespace verispec {

enum FloatFormat : int { F32 = 0, F16 = 1, BF16 = 30 };  // ggml's type ids

static inline bool is_float_format(int fmt) { return fmt == F32 || fmt == F16 || fmt == BF16; }
static inline int float_bytes(int fmt) { return fmt == F32 ? 4 : 2; }

// The loops take k in runs of this many, each run through every block of rows, so that the run's
// weights come from memory once and from L1 for the row blocks after the first (two F32 tiles:
// 2 x 128 x 64 bytes = 16 KB). The accumulators are stored between runs: an exact store and load.
constexpr int64_t kFloatKRun = 128;

// nt (1 or 2) adjacent tiles, starting at w (tile_bytes = K * 16 * float_bytes apart), against
// rows x [m][ldx] over k = 0 .. K-1: acc [nt][m][16] updated as the contract says. The scalar
// one is the definition; the others give the same bits.
using FloatTilesFn = void (*)(int fmt, const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m,
                              float* acc);
void float_tiles_scalar(int fmt, const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m,
                        float* acc);
void float_tiles_avx2(int fmt, const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m,
                      float* acc);
void float_tiles_avx512(int fmt, const uint8_t* w, int64_t k, int nt, const float* x, int64_t ldx, int64_t m,
                        float* acc);

// One tile: the file's 16 rows from raw (k elements each, row_bytes apart) into the layout above,
// and back as float32 rows out [16][ldo] (gguf's dequantization: the exact widening).
void float_repack_tile(int fmt, const uint8_t* raw, int64_t row_bytes, int64_t k, uint8_t* tile);
void float_dequantize_tile(int fmt, const uint8_t* tile, int64_t k, float* out, int64_t ldo);

}  // namespace verispec
