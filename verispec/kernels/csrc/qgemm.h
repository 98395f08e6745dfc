// Quantized matmuls on GGUF weights: the layout, the formats and the contract every ISA path
// meets.
//
// Contract. For activations x [M, K] and a weight W [N, K] stored in a GGUF block format,
// y[m, n] = sum_k W[n, k] * x[m, k] is computed as follows, identically on every path:
//   1. Each row of x is quantized on its own (quantize_rows), in blocks of the format's
//      superblock size KB: amax = max |x|, iscale = 127 / amax, q = nearest(x * iscale)
//      (ties to even), dx = 1 / iscale; plus bs16, the int sums of every 16 q's.
//   2. Per (row m, column n, superblock s), two exact int32 sums:
//        isum = sum_sub sc[sub] * sum_{k in sub} w[k] * q[k]
//        msum = sum_sub mn[sub] * bsum[sub]
//   3. One fp32 accumulator per (m, n), updated in superblock order s = 0, 1, ...:
//        acc = fma(dx[s] * d, (float)isum, acc);  acc = fma(-(dx[s] * dmin), (float)msum, acc)
//      (the second step only for formats with an offset).
// Integer sums are exact whatever the instruction sequence, and the fp32 sequence per output is
// fixed, so a row's result does not depend on M, on the thread count or on the ISA path. Threads
// split the output columns only (in tiles of 16); the reduction over K is never split.
//
// What each format means in these terms (w is the stored unsigned or signed integer, the weight
// is what gguf's dequantization returns):
//   Q4_K  KB 256, 8 subs of 32:  weight = (d*sc)*w - dmin*mn   w 0..15, sc, mn 6-bit
//   Q6_K  KB 256, 16 subs of 16: weight = (d*sc)*(w-32)        w 0..63, sc int8; mn = 32*sc, dmin = d
//   Q5_0  KB 32:                 weight = d*(w-16)             w 0..31; sc = 1, mn = 16, dmin = d
//   Q4_1  KB 32:                 weight = d*w + m              w 0..15; sc = 1, mn = 1, dmin = -m
//   Q8_0  KB 32:                 weight = d*w                  w int8;  sc = 1, no offset
//
// Packed layout. Columns are grouped in tiles of 16; a weight is stored as
// [N/16 tiles][K/KB superblocks][tile bytes], so one thread reads one contiguous stream per tile.
// One tile superblock, with G = KB/4 groups of 4 consecutive k:
//
//   weights   8-bit formats: G x [16 cols][4 k] bytes        (byte = w[4g + j] of column c)
//             4-bit formats: G/2 x [16 cols][4 k] bytes, low nibble group g, high nibble g + G/2
//   scales    Q4_K: sc[8][16] u8, then mn[8][16] u8;  Q6_K: sc[16][16] int8;  others: none
//   d         [16] fp16 (the file's own bits)
//   dmin      Q4_K: dmin[16] fp16;  Q4_1: m[16] fp16;  others: none
//
// A group of 4 k for 16 columns is 64 bytes: one zmm, or two ymm (columns 0-7, 8-15), and each
// 32-bit lane holds one column's 4 consecutive weights, the shape maddubs/dpbusd consume against
// 4 broadcast activation bytes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace verispec {

enum Format : int {  // ggml's type ids
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14,
};

struct FormatInfo {
  int kb;            // superblock (activation block) size
  int sub;           // k per integer scale
  int block_bytes;   // bytes of one GGUF block (one KB run of one row)
  bool nibbles;      // 4-bit storage
  bool signed_w;     // weights are int8 (Q8_0)
  bool int_scales;   // per-sub integer scales stored (Q4_K, Q6_K)
  bool has_offset;   // msum term present
  bool stores_dmin;  // a second fp16 per column (Q4_K dmin, Q4_1 m)

  int groups() const { return kb / 4; }
  int nsub() const { return kb / sub; }
  int weight_bytes() const { return nibbles ? groups() / 2 * 64 : groups() * 64; }
  int scale_bytes() const { return int_scales ? (stores_dmin ? 2 : 1) * nsub() * 16 : 0; }
  int tile_bytes() const { return weight_bytes() + scale_bytes() + 32 + (stores_dmin ? 32 : 0); }
};

// nullptr-equivalent check: returns false for a format this library does not run.
bool format_info(int fmt, FormatInfo* out);

constexpr int kTile = 16;     // output columns per tile
constexpr int kMaxSub = 16;   // most integer scales per superblock (Q6_K)

// One tile superblock in the form the row loops consume (see unpack_* per ISA).
struct alignas(64) Unpacked {
  uint8_t w[64 * 64];          // [G][16][4], up to G = 64; |w| for signed formats
  int8_t ws[8 * 64];           // signed formats (Q8_0, G = 8): the weights with their signs
  int32_t sc[kMaxSub][kTile];  // per sub: the scale (AVX2: in both int16 halves of each lane)
  int32_t mn[kMaxSub / 2][kTile];  // per pair of subs: mn[2p] | mn[2p + 1] << 16
  float d[kTile];
  float dmin[kTile];
};

// Activations quantized per row (see the contract).
struct QActs {
  const int8_t* q;    // [M][K]
  const float* dx;    // [M][K / kb]
  const int16_t* bs;  // [M][K / 16]
  int64_t m, k;
};

// fp16 bits -> float (exact).
float fp16_to_float(uint16_t h);

// One tile superblock s (16 columns x KB of k) against all M rows: acc [M][16] is updated as
// the contract says. The scalar one is the definition; the ISA paths give the same bits.
using SuperblockFn = void (*)(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a,
                              int64_t s, float* acc);
void superblock_scalar(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, float* acc);
void superblock_avx2(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, float* acc);
void superblock_avx512(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, float* acc);

// A GGUF block decoded to integers (see decode_block).
struct Decoded {
  int32_t q[256];            // stored integers, in k order (Q8_0 signed)
  int32_t sc[kMaxSub], mn[kMaxSub];  // raw per-sub scale and min (K-quants)
  uint16_t d = 0, dmin = 0;  // fp16 bits (dmin: Q4_K dmin, Q4_1 m)
};
void decode_block(int fmt, const uint8_t* block, Decoded* out);
void write_tile(const FormatInfo& f, const Decoded* cols, uint8_t* tile);  // cols[16]
void dequantize_tile(const FormatInfo& f, int fmt, const uint8_t* tile, float* out, int64_t ldo);
void quantize_row(const float* x, int64_t k, int kb, int8_t* q, float* dx, int16_t* bs);

}  // namespace verispec
