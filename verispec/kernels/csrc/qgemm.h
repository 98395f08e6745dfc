// Quantized matmuls on GGUF weights: the layout, the formats and the contract every ISA path
// meets.
//
// Contract. For activations x [M, K] and a weight W [N, K] stored in a GGUF block format,
// y[m, n] = sum_k W[n, k] * x[m, k] is computed as follows, identically on every path:
//   1. Each row of x is quantized on its own (quantize_row), in blocks of 32:
//      amax = max |x|, iscale = 127 / amax, q = nearest(x * iscale) (ties to even),
//      dx = 1 / iscale; plus bs16, the int sums of every 16 q's.
//   2. The weight is a run of subs (16 or 32 consecutive k inside one activation block) with
//      fp32 per-sub values dl and ml that are gguf's own (dl = d*sc, ml = dmin*mn for Q4_K).
//      Per (row m, column n, sub j), an exact int32 sum, with an integer offset o:
//        isum = sum_{k in j} w[k] * q[k] - o * bsum_j          (bsum_j = sum_{k in j} q[k])
//   3. One fp32 accumulator per (m, n), updated sub by sub in k order:
//        acc = fma(dl, (float)isum * dx, acc)
//        acc = fma(-ml, dx * (float)bsum_j, acc)               (formats with an fp offset only)
//      Q2_K and Q3_K (int_scaled) apply their integer sub scales sc in int32 instead, one fp32
//      step per activation block of 32 (two subs j = 2i, 2i + 1), in k order:
//        S  = sc_2i * isum_2i + sc_2i+1 * isum_2i+1
//        Mn = mn_2i * bsum_2i + mn_2i+1 * bsum_2i+1             (Q2_K's mins only)
//        acc = fma(d, (float)S * dx, acc)
//        acc = fma(-dmin, dx * (float)Mn, acc)                  (Q2_K only)
//      Bounds: Q2_K |isum| <= 16*3*127 = 6,096, sc, mn <= 15, so |S| <= 182,880 and
//      |Mn| <= 2*15*2,032 = 60,960; Q3_K |isum| <= 16*4*127 = 8,128, |sc| <= 32, so
//      |S| <= 520,192. All below 2^24: no overflow, and the int -> float conversions are exact.
// Integer sums are exact whatever the instruction sequence, and the fp32 sequence per output is
// fixed, so a row's result does not depend on M, on the thread count or on the ISA path. Threads
// split the output columns only (in tiles of 16); the reduction over K is never split.
//
// What each format means in these terms (w is the stored integer; the weight is what gguf's
// dequantization returns; superblock KB is the packing unit):
//   Q4_K  KB 256, 8 subs of 32:  weight = (d*sc)*w - dmin*mn   dl = d*sc, ml = dmin*mn, o = 0
//   Q5_K  KB 256, 8 subs of 32:  as Q4_K, w of 4+1 bits
//   Q2_K  KB 256, 16 subs of 16: weight = (d*sc)*w - dmin*mn   w of 2 bits, 4-bit sc and mn,
//                                                              int_scaled (d, dmin, sc, mn as above)
//   Q6_K  KB 256, 16 subs of 16: weight = (d*sc)*(w-32)        dl = d*sc, o = 32
//   Q3_K  KB 256, 16 subs of 16: weight = (d*sc)*(w-4)         int_scaled (sc = 6-bit - 32), o = 4;
//                                w = 2 low bits | hmask bit << 2
//   IQ4_XS KB 256, 8 subs of 32: weight = (d*sc)*w             dl = d*sc (sc = 6-bit - 32);
//                                w = kvalues[nibble] (int8), the nibble stored
//   Q5_0  KB 32, one sub:        weight = d*(w-16)             dl = d, o = 16
//   Q4_0  KB 32, one sub:        weight = d*(w-8)              dl = d, o = 8
//   Q4_1  KB 32, one sub:        weight = d*w + m              dl = d, ml = -m
//   Q5_1  KB 32, one sub:        as Q4_1, w of 4+1 bits
//   Q8_0  KB 32, one sub:        weight = d*w  (w int8)        dl = d
//   IQ4_NL KB 32, one sub:       as Q8_0, w = kvalues[nibble] (int8), the nibble stored
// The IQ4 formats store the file's nibbles, which the SIMD loops turn into their int8 values in
// registers (one byte shuffle per group).
//
// Packed layout. Columns are grouped in tiles of 16; a weight is stored as
// [N/16 tiles][K/KB superblocks][tile bytes], so one thread reads one contiguous stream per tile.
// One tile superblock, with G = KB/4 groups of 4 consecutive k:
//
//   weights   8-bit formats (Q8_0): G x [16 cols][4 k] bytes  (byte = w[4g + j] of column c)
//             4-bit formats (Q4_K, Q4_0, Q4_1, IQ4_NL, IQ4_XS): G/2 x
//             [16 cols][4 k] bytes, low nibble group 2h, high nibble 2h + 1
//             (both nibbles of a byte in one sub, so one load feeds two groups of the same sub)
//             Q6_K, Q5_0, Q5_1, Q5_K (4+2 and 4+1 bits, hb high bits): the low 4 bits as the 4-bit
//             formats, then G*hb/8 x [16 cols][4 k] bytes of the high bits, each block holding
//             per = 8/hb groups, group g in block g / per at bits hb * (g % per) and up (so a
//             Q6_K sub of 16 k, groups 4j..4j+3, is nibble blocks 2j, 2j + 1 and high block j;
//             Q5_0's 8 groups share one high block, as each Q5_K sub's)
//             Q2_K, Q3_K (2 and 2+1 bits): G/4 x [16 cols][4 k] bytes, block h holding groups
//             4h..4h + 3 (one sub of 16), group g at bits 2 (g % 4) and up; then Q3_K's third
//             bits as the high bits above (hb = 1: a block per 8 groups, two subs)
//   scales    Q4_K, Q5_K: sc[8][16] u8, then mn[8][16] u8;  Q2_K: sc[16][16] u8, then mn[8][16][2]
//             u8 (per activation block, each column's two mins side by side: one vpmovzxbw makes
//             the int16 pairs that vpdpwssd multiplies by the block's two bsums);
//             Q6_K, Q3_K: sc[16][16] int8;  IQ4_XS: sc[8][16] int8;  others: none
//   d         [16] fp16 (the file's own bits)
//   dmin      Q4_K, Q5_K, Q2_K: dmin[16] fp16;  Q4_1, Q5_1: m[16] fp16;  others: none
//
// A group of 4 k for 16 columns is 64 bytes: one zmm, or two ymm (columns 0-7, 8-15), and each
// 32-bit lane holds one column's 4 consecutive weights, the shape maddubs/dpbusd consume against
// 4 broadcast activation bytes.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace verispec {

enum Format : int {  // ggml's type ids
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23,
};

// IQ4_NL's and IQ4_XS's non-linear 4-bit values (ggml's kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct FormatInfo {  // (field order: the initialisers in format_info)
  int kb;            // superblock (activation block) size
  int sub;           // k per integer scale
  int block_bytes;   // bytes of one GGUF block (one KB run of one row)
  bool nibbles;      // 4-bit storage
  int hbits;         // 4+hbits-bit storage (Q6_K 2, Q5_0 1): the nibbles, then the high bits
  bool signed_w;     // weights are int8: Q8_0's bytes, or IQ4's nibbles indexing kIq4Values
  bool int_scales;   // per-sub integer scales stored (the K-quants, IQ4_XS)
  bool stores_dmin;  // a second fp16 per column (the K-quants' dmin, Q4_1's and Q5_1's m)
  bool crumbs;       // 2-bit storage (Q2_K; Q3_K with hbits 1): the low plane, then any high bits

  int groups() const { return kb / 4; }
  int nsub() const { return kb / sub; }
  int weight_bytes() const {
    const int low = crumbs ? groups() / 4 * 64 : nibbles || hbits ? groups() / 2 * 64 : groups() * 64;
    return low + groups() * hbits / 8 * 64;
  }
  int scale_bytes() const { return int_scales ? (stores_dmin ? 2 : 1) * nsub() * 16 : 0; }
  int tile_bytes() const { return weight_bytes() + scale_bytes() + 32 + (stores_dmin ? 32 : 0); }
};

// nullptr-equivalent check: returns false for a format this library does not run.
bool format_info(int fmt, FormatInfo* out);

constexpr int kTile = 16;     // output columns per tile
constexpr int kMaxSub = 16;   // most subs per superblock (Q6_K)
constexpr int kActBlock = 32; // activation block

// One tile superblock in the form the row loops consume: the per-sub scales (every SIMD path), and
// for AMX the 4-bit and 4+hb-bit weights unpacked to bytes (the others read them from the tile).
struct alignas(64) Unpacked {
  uint8_t w[64 * 64];          // AMX: [G][16][4], up to G = 64
  float dl[kMaxSub][kTile];    // per sub and column (see the contract)
  float ml[kMaxSub][kTile];
};

// Activations quantized per row (see the contract), stored block-major: for each block of 32 k,
// the rows one after another (mp of them, m rounded up to 16, the extra rows zero). So the rows
// a kernel runs together sit at fixed offsets from one pointer (row r of block b at
// qb(b, 0) + 32 r), and an AMX A tile of 16 rows of one block is 512 contiguous bytes.
struct QActs {
  const int8_t* q;    // [K / 32][mp][32]
  const float* dx;    // [K / 32][mp]
  const int16_t* bs;  // [K / 16][mp]: the int sums of every 16 q's
  const float* dxb;   // [K / 32][mp]: dx * (float)bsum of each block of 32 (the fp offset's factor)
  int64_t m, k, mp;
  // What AVX2 takes out of its int16 lanes for the offset formats (ymm_kernel.h, centered_offset):
  // of a sub's q's, the sum of those at k % 4 < 2 (low int16) and of those at k % 4 >= 2 (high
  // int16), the two halves of a 4-byte group that maddubs adds into its two int16 lanes, each
  // times the offset o and kept mod 2^16: [K / 16][mp] for Q6_K (o = 32, subs of 16), [K / 32][mp]
  // for Q5_0 (o = 16, subs of 32). Made once per call, so the loop broadcasts it from memory.
  const int32_t* cen16;
  const int32_t* cen32;
  // The integer offset's term of the contract, -o * bsum_j, made once per call: [K / 16][mp] for
  // o = 32 and subs of 16 (Q6_K) and [K / 32][mp] for o = 16 and subs of 32 (Q5_0). The smaller
  // offsets of the same sub size are exact fractions of them (offset_term: Q3_K's o = 4 is
  // off16 / 8, Q4_0's o = 8 is off32 / 2). The VNNI loops (AVX512, AVX-VNNI) start a sub's sum
  // from it, where subtracting it after the dot products took two vector instructions per row
  // and sub.
  const int32_t* off16;
  const int32_t* off32;
  // [K / 32][mp]: -128 * bsum of each block of 32, for the signed formats read as unsigned bytes
  // (w + 128, by flipping each byte's top bit) on the VNNI paths: sum (w + 128) q - 128 bsum =
  // sum w q.
  const int32_t* off128;
  // [K / 32][mp]: each block's two sums of 16 as an int16 pair (the first in the low half), the
  // operand that multiplies Q2_K's pairs of mins in one madd (vpdpwssd, vpmaddwd).
  const int32_t* bs2;

  const int8_t* qb(int64_t blk, int64_t row) const { return q + (blk * mp + row) * 32; }
  // -OFF * bsum of the sub of SUB k starting at 16-block i, row m: off16 = -32 bs16 and
  // off32 = -16 bs32 divided exactly (OFF divides their factor).
  template <int OFF, int SUB>
  int32_t offset_term(int64_t i, int64_t m) const {
    static_assert(OFF > 0 && (SUB == 16 ? 32 % OFF : 16 % OFF) == 0, "an offset QActs' arrays divide into");
    return SUB == 16 ? off16[i * mp + m] / (32 / OFF) : off32[i / 2 * mp + m] / (16 / OFF);
  }
  // The sum of q over sub j (of size sub) of superblock s (of size kb), row m.
  int32_t bsum(int64_t m, int64_t s, int kb, int j, int sub) const {
    const int64_t i = s * (kb / 16) + j * (sub / 16);
    return sub == 16 ? bs[i * mp + m] : (int32_t)bs[i * mp + m] + bs[(i + 1) * mp + m];
  }
};

// The per-format constants of the contract.
static inline int int_offset(int fmt) {
  return fmt == Q6_K ? 32 : fmt == Q5_0 ? 16 : fmt == Q4_0 ? 8 : fmt == Q3_K ? 4 : 0;
}
static inline bool has_fp_offset(int fmt) {
  return fmt == Q4_K || fmt == Q5_K || fmt == Q2_K || fmt == Q4_1 || fmt == Q5_1;
}
// The formats whose integer sub scales are applied in int32, one fp32 step per activation block
// (the contract's step 3 for Q2_K and Q3_K): the 2-bit ones, whose subs of 16 would otherwise
// take 16 fp32 steps per superblock. In the SIMD loops' template arguments, NIB == 2.
static inline bool int_scaled(int fmt) { return fmt == Q2_K || fmt == Q3_K; }
// The formats the AMX path runs (amx.cpp); ops.cpp sends the others to the AVX512 path, which
// gives the same bits by the contract.
static inline bool amx_runs(int fmt) {
  return fmt == Q4_K || fmt == Q6_K || fmt == Q5_0 || fmt == Q4_1 || fmt == Q8_0;
}



// The per-format constants of the SIMD row loops (AVX512, the 256-bit ones), as template
// arguments: superblock KB, sub SUB, low-plane bits NIB (4: nibbles, 2: Q2_K's and Q3_K's crumbs,
// 0: 8-bit weights, or nibbles joined with HB > 0 high bits), high bits HB, signed weights SIGNED,
// integer offset OFF, fp offset FPOFF. with_format calls f with the format's set.
template <int KB_, int SUB_, int NIB_, int HB_, bool SIGNED_, int OFF_, bool FPOFF_>
struct FormatArgs {
  static constexpr int KB = KB_, SUB = SUB_, NIB = NIB_, HB = HB_, OFF = OFF_;
  static constexpr bool SIGNED = SIGNED_, FPOFF = FPOFF_;
};
template <class F>
static inline void with_format(int fmt, F&& f) {
  switch (fmt) {
    case Q4_K: f(FormatArgs<256, 32, 4, 0, false, 0, true>{}); break;
    case Q5_K: f(FormatArgs<256, 32, 0, 1, false, 0, true>{}); break;
    case Q2_K: f(FormatArgs<256, 16, 2, 0, false, 0, true>{}); break;
    case Q6_K: f(FormatArgs<256, 16, 0, 2, false, 32, false>{}); break;
    case Q3_K: f(FormatArgs<256, 16, 2, 1, false, 4, false>{}); break;
    case IQ4_XS: f(FormatArgs<256, 32, 4, 0, true, 0, false>{}); break;
    case Q5_0: f(FormatArgs<32, 32, 0, 1, false, 16, false>{}); break;
    case Q4_0: f(FormatArgs<32, 32, 4, 0, false, 8, false>{}); break;
    case Q4_1: f(FormatArgs<32, 32, 4, 0, false, 0, true>{}); break;
    case Q5_1: f(FormatArgs<32, 32, 0, 1, false, 0, true>{}); break;
    case Q8_0: f(FormatArgs<32, 32, 0, 0, true, 0, false>{}); break;
    case IQ4_NL: f(FormatArgs<32, 32, 4, 0, true, 0, false>{}); break;
  }
}

// Software prefetch of the weights ahead of the kernels (ops.cpp sets the queue per superblock
// call; each ISA kernel issues per_step lines at the start of each sub), so the requests spread
// over the call's compute instead of coming in one burst, which stalls on the core's few
// outstanding-miss slots while the burst drains. A kernel looks the thread's queue up once per
// call and passes it down: in a shared library each access to a thread_local is a call to
// __tls_get_addr (with a vzeroupper before it), which once per sub cost the AVX2 loop about a
// fifth of its time at one row.
struct PrefetchQueue { const char* p = nullptr; const char* end = nullptr; int per_step = 0; };
inline thread_local PrefetchQueue tl_prefetch;
// The calling thread's queue, as a pointer the compiler cannot trace back to the thread_local
// (else GCC recomputes the address, with the call, at every use).
static inline PrefetchQueue& thread_prefetch_queue() {
  PrefetchQueue* q = &tl_prefetch;
  __asm__("" : "+r"(q));
  return *q;
}
static inline void prefetch_step(PrefetchQueue& q) {
  for (int i = 0; i < q.per_step && q.p < q.end; ++i, q.p += 64) __builtin_prefetch(q.p, 0, 2);
}

// fp16 bits -> float (exact).
float fp16_to_float(uint16_t h);

// Tile superblocks s .. s + count - 1 (16 columns x KB of k each, consecutive in memory from
// tile) against all M rows: acc [M][16] is updated as the contract says, superblock by
// superblock. (count > 1 lets the 32-wide formats keep the accumulators in registers across
// superblocks.) The scalar one is the definition; the ISA paths give the same bits.
using SuperblockFn = void (*)(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a,
                              int64_t s, int count, float* acc);
void superblock_scalar(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count, float* acc);
void superblock_avx2(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count, float* acc);
void superblock_avxvnni(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count, float* acc);
void superblock_avx512(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count, float* acc);
// AMX: the calling thread must have run amx_configure with the format's sub size (and runs
// amx_release when done).
void superblock_amx(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count, float* acc);
void amx_configure(int sub, int rows);  // rows: of the A and C tiles, 1..16
void amx_release();

// A GGUF block decoded to integers (see decode_block).
struct Decoded {
  int32_t q[256];            // stored integers, in k order (Q8_0 signed; IQ4: the nibbles)
  int32_t sc[kMaxSub], mn[kMaxSub];  // raw per-sub scale and min (K-quants)
  uint16_t d = 0, dmin = 0;  // fp16 bits (dmin: the K-quants' dmin, Q4_1's and Q5_1's m)
};
void decode_block(int fmt, const uint8_t* block, Decoded* out);
void write_tile(const FormatInfo& f, const Decoded* cols, uint8_t* tile);  // cols[16]
void dequantize_tile(const FormatInfo& f, int fmt, const uint8_t* tile, float* out, int64_t ldo);

// A layer's input row and its quantization, written once here and compiled by each file that
// calls it for its own instructions (ref.cpp generic, avx2.cpp with AVX2; static, so that the
// linker cannot hand one file's copy to the other): the same IEEE
// operations in the same order (no fma contraction, no reassociation; the max over a block is
// exact in any order, and NaN is skipped as fmax would), so both give the same bits.

// exp(x), x clamped to [-87, 88] (Cephes' single-precision polynomial after x = n ln2 + r).
static inline float exp_fixed(float x) {
  x = x < 88.0f ? x : 88.0f;
  x = x > -87.0f ? x : -87.0f;
  const float t = x * 1.44269504088896341f;
  const int n = (int)(t + (t >= 0.0f ? 0.5f : -0.5f));
  const float fn = (float)n;
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return e * scale;
}

// A layer's input and its quantization, one activation block (32 k) at a time, so blocks (and
// rows) can be spread over threads: the block is made from its own inputs only, and RMSNorm's
// one row-wide value, 1 / rms, is computed first (row_rms_inv, the sum of squares in k order).
//   glu:  in[j] = gate[j] / (1 + exp_fixed(-gate[j])) * up[j]
//   norm: in[j] = x[j] * inv * w[j]
//   then  amax = max |in|, iscale = 127 / amax, q = nearest(in * iscale) (ties to even) clamped
//         to [-127, 127], dx = 1 / iscale, the int sums of each 16 q's, dxb = dx * (float)bsum.
// Elementwise IEEE operations in a fixed order (no fma contraction, no reassociation; the max
// is exact in any order, and NaN is skipped as fmax would), so a vectorised copy gives the same
// bits as this generic one. Static, so that the linker cannot hand one file's copy to another.
static inline float row_rms_inv_impl(const float* x, int64_t k, float eps) {
  float ss = 0.0f;
  for (int64_t j = 0; j < k; ++j) ss += x[j] * x[j];
  return 1.0f / std::sqrt(ss / (float)k + eps);
}

static inline void glu_block_impl(const float* gate, const float* up, float* out) {
  for (int j = 0; j < kActBlock; ++j) out[j] = gate[j] / (1.0f + exp_fixed(-gate[j])) * up[j];
}

static inline void quantize_block_impl(const float* x, int8_t* q, float* dx, int16_t* bs, float* dxb) {
  float amax = 0.0f;
  for (int i = 0; i < kActBlock; ++i) {
    const float a = std::fabs(x[i]);
    amax = a > amax ? a : amax;
  }
  if (!(amax > 0.0f) || !std::isfinite(amax)) {
    // zeros (or a non-finite block, which then yields zeros rather than undefined casts)
    std::memset(q, 0, kActBlock);
    *dx = amax > 0.0f ? amax : 0.0f;
  } else {
    const float iscale = 127.0f / amax;
    for (int i = 0; i < kActBlock; ++i) {
      float v = std::nearbyint(x[i] * iscale);  // ties to even
      v = v > -127.0f ? v : -127.0f;            // NaN -> -127, as fmax(-127, NaN)
      v = v < 127.0f ? v : 127.0f;
      q[i] = (int8_t)(int)v;
    }
    *dx = 1.0f / iscale;
  }
  int32_t s0 = 0, s1 = 0;
  for (int i = 0; i < 16; ++i) s0 += q[i], s1 += q[16 + i];
  bs[0] = (int16_t)s0;
  bs[1] = (int16_t)s1;
  *dxb = *dx * (float)(s0 + s1);
}

// The generic copies (ref.cpp) and the AVX2 ones (avx2.cpp, written with intrinsics) of the two
// above; bs points at two int16 (the block's two sums of 16).
float row_rms_inv(const float* x, int64_t k, float eps);
void glu_block(const float* gate, const float* up, float* out);
void glu_block_avx2(const float* gate, const float* up, float* out);
void quantize_block(const float* x, int8_t* q, float* dx, int16_t* bs, float* dxb);
void quantize_block_avx2(const float* x, int8_t* q, float* dx, int16_t* bs, float* dxb);

}  // namespace verispec
