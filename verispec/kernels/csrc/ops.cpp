// The torch-facing side: shape checks, ISA dispatch, threads, repacking.
//
// Threads split the output columns in whole tiles (chunks of contiguous tiles, run by the
// kernels' own pool, pool.h; each chunk reads its own contiguous part of the packed weight);
// every output is computed by one thread over the whole of K, in superblock order, so the thread
// count cannot change a result.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention.h"
#include "floats.h"
#include "pool.h"
#include "qgemm.h"

namespace verispec {
namespace {

constexpr int64_t kPrefetchAhead = 2;  // kernel calls (superblocks, or groups of the 32-wide ones)
constexpr int64_t kGroup = 8;          // 32-wide superblocks per kernel call

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3, kAvxVnni = 4 };

// AMX needs the CPU's AMX-TILE and AMX-INT8 bits and the kernel's leave to use the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), asked once per process.
bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

bool isa_supported(int isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvxVnni: return isa_supported(kAvx2) && __builtin_cpu_supports("avxvnni");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && isa_supported(kAvx2);
    case kAmx: return isa_supported(kAvx512) && amx_usable();
    default: return false;
  }
}

// The default path for m rows. AMX's tile dot products have a fixed cost per superblock (eight
// tile stores of 1 KB for Q4_K) and per 16-row tile, whatever the rows in it, while the AVX512
// path pays per row: passes of 16 and 32 rows took the same time on both paths, of 17 to 20 rows
// clearly less on the AVX512 one (AMX's second tile mostly empty), and from 36 rows less on AMX
// (docs/kernels.md, Dispatch per ISA): AMX starts where its tiles are full.
constexpr int64_t kAmxMinRows = 32;

// The paths by speed, and the fastest one a call may take by default (set_max_isa; -1: any;
// atomic, since calls run without the GIL: one thread may set it while another's call reads it).
int speed_rank(int isa) {
  switch (isa) {
    case kAvx2: return 1;
    case kAvxVnni: return 2;
    case kAvx512: return 3;
    case kAmx: return 4;
    default: return 0;
  }
}
std::atomic<int> g_max_isa{-1};

bool default_may_use(int isa) {
  const int cap = g_max_isa.load(std::memory_order_relaxed);
  return isa_supported(isa) && (cap < 0 || speed_rank(isa) <= speed_rank(cap));
}

int best_isa(int64_t m) {
  if (m >= kAmxMinRows && default_may_use(kAmx)) return kAmx;
  for (int isa : {kAvx512, kAvxVnni, kAvx2})
    if (default_may_use(isa)) return isa;
  return kScalar;
}

SuperblockFn kernel_for(int isa) {
  TORCH_CHECK(isa_supported(isa), "ISA path ", isa, " is not supported by this CPU");
  switch (isa) {
    case kAmx: return superblock_amx;
    case kAvx512: return superblock_avx512;
    case kAvxVnni: return superblock_avxvnni;
    case kAvx2: return superblock_avx2;
    default: return superblock_scalar;
  }
}

// The float formats' path per ISA (floats.h): AMX CPUs run the AVX512 one, AVX-VNNI CPUs the AVX2 one.
FloatTilesFn float_kernel_for(int isa) {
  switch (isa) {
    case kAmx:
    case kAvx512: return float_tiles_avx512;
    case kAvxVnni:
    case kAvx2: return float_tiles_avx2;
    default: return float_tiles_scalar;
  }
}

// The quantized formats' constants; a float format (floats.h) has none, and f.kb = 32 stands for
// its rule on K (multiples of the activation block).
FormatInfo info_or_throw(int64_t fmt) {
  FormatInfo f{};
  if (is_float_format((int)fmt)) {
    f.kb = kActBlock;
    return f;
  }
  TORCH_CHECK(format_info((int)fmt, &f), "GGUF type ", fmt, " is not supported by the native kernels");
  return f;
}

void check_shape(const FormatInfo& f, int64_t n, int64_t k) {
  TORCH_CHECK(n > 0 && n % kTile == 0, "output features must be a positive multiple of ", kTile, ", got ", n);
  TORCH_CHECK(k > 0 && k % f.kb == 0, "input features must be a positive multiple of ", f.kb, ", got ", k);
}

int64_t packed_bytes(int64_t fmt, const FormatInfo& f, int64_t n, int64_t k) {
  if (is_float_format((int)fmt)) return n * k * float_bytes((int)fmt);
  return n / kTile * (k / f.kb) * f.tile_bytes();
}
int64_t packed_nbytes(int64_t fmt, int64_t n, int64_t k) { return packed_bytes(fmt, info_or_throw(fmt), n, k); }

}  // namespace

AttendRowsFn attend_rows_for(int64_t isa) {
  TORCH_CHECK(isa < 0 || isa_supported((int)isa), "ISA path ", isa, " is not supported by this CPU");
  const int use = isa < 0 ? best_isa(1) : (int)isa;
  switch (use) {
    case kAmx:
    case kAvx512: return attend_rows_avx512;
    case kAvxVnni:
    case kAvx2: return attend_rows_avx2;
    default: return attend_rows_scalar;
  }
}

// raw: uint8 [N, K / KB * block_bytes] (a float format: [N, K * element bytes]), the GGUF
// tensor's bytes (row n = output feature n).
torch::Tensor repack(int64_t fmt, torch::Tensor raw, int64_t n, int64_t k) {
  const FormatInfo f = info_or_throw(fmt);
  check_shape(f, n, k);
  const bool flt = is_float_format((int)fmt);
  const int64_t nsb = k / f.kb, row_bytes = flt ? k * float_bytes((int)fmt) : nsb * f.block_bytes;
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous() && raw.numel() == n * row_bytes,
              "raw GGUF data must be contiguous uint8 with ", n * row_bytes, " bytes, got ", raw.numel());
  auto out = torch::zeros({packed_bytes(fmt, f, n, k)}, torch::kUInt8);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (flt) {
    at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        float_repack_tile((int)fmt, src + t * kTile * row_bytes, row_bytes, k, dst + t * kTile * row_bytes);
    });
    return out;
  }
  at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
    std::vector<Decoded> cols(kTile);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t s = 0; s < nsb; ++s) {
        for (int c = 0; c < kTile; ++c) {
          cols[c] = Decoded();
          decode_block((int)fmt, src + (t * kTile + c) * row_bytes + s * f.block_bytes, &cols[c]);
        }
        write_tile(f, cols.data(), dst + (t * nsb + s) * f.tile_bytes());
      }
  });
  return out;
}

void check_packed(int64_t fmt, const FormatInfo& f, const torch::Tensor& packed, int64_t n, int64_t k) {
  check_shape(f, n, k);
  const int64_t want = packed_bytes(fmt, f, n, k);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() == want,
              "packed weight has ", packed.numel(), " bytes, expected ", want);
}

// The float32 weight [N, K] the kernels multiply by, computed as gguf dequantizes the file.
torch::Tensor dequantize(int64_t fmt, torch::Tensor packed, int64_t n, int64_t k) {
  const FormatInfo f = info_or_throw(fmt);
  check_packed(fmt, f, packed, n, k);
  auto out = torch::empty({n, k}, torch::kFloat32);
  const int64_t nsb = k / f.kb;
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  if (is_float_format((int)fmt)) {
    const int64_t tile_bytes = kTile * k * float_bytes((int)fmt);
    at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) float_dequantize_tile((int)fmt, src + t * tile_bytes, k, dst + t * kTile * k, k);
    });
    return out;
  }
  at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t s = 0; s < nsb; ++s)
        dequantize_tile(f, (int)fmt, src + (t * nsb + s) * f.tile_bytes(), dst + t * kTile * k + s * f.kb, k);
  });
  return out;
}

// x: float32 or bfloat16 [M, K] -> the QActs arrays, block-major over mp rows (M rounded up to a
// multiple of 16; the extra rows of q are zero): q int8 [K / 32][mp][32], dx float32
// [K / 32][mp], bs int16 [K / 16][mp], dxb float32 [K / 32][mp]. Each block of each row is made
// and quantized from its own inputs (qgemm.h), so the blocks are spread over the threads: made
// on one thread, the gated input of a down projection took about as long as the matmul itself.
// The storage is the calling thread's, reused from call to call (a decode step makes over a
// hundred calls, and allocating and zeroing fresh tensors for each was a visible part of it).
struct ActBuffers {
  std::vector<int8_t> q;
  std::vector<float> dx, dxb, in, inv, made;
  std::vector<int16_t> bs;
  std::vector<int32_t> cen16, cen32, off16, off32, off128, bs2;
};

// QActs::cen16 and cen32 of one block of 32 q's: per 16 and per 32, the sums at k % 4 < 2 (low
// int16) and k % 4 >= 2 (high int16), times Q6_K's and Q5_0's offsets, mod 2^16.
static inline int32_t pack16(int32_t hi, int32_t lo) {
  return (int32_t)(((uint32_t)(uint16_t)hi << 16) | (uint16_t)lo);
}
static void centered_sums(const int8_t* q, int32_t* cen16_0, int32_t* cen16_1, int32_t* cen32) {
  int32_t lo[2] = {0, 0}, hi[2] = {0, 0};
  for (int h = 0; h < 2; ++h)
    for (int i = 16 * h; i < 16 * h + 16; i += 4) {
      lo[h] += q[i] + q[i + 1];
      hi[h] += q[i + 2] + q[i + 3];
    }
  const int32_t o6 = int_offset(Q6_K), o5 = int_offset(Q5_0);
  *cen16_0 = pack16(o6 * hi[0], o6 * lo[0]);
  *cen16_1 = pack16(o6 * hi[1], o6 * lo[1]);
  *cen32 = pack16(o5 * (hi[0] + hi[1]), o5 * (lo[0] + lo[1]));
}

constexpr int64_t kQuantChunk = 8;   // blocks of one row per unit of work
constexpr int64_t kQuantGrain = 16;  // units below which the quantization stays on one thread

// With floats, *rows is set to the layer's input in float32, [M][K] (x itself where it is float32
// and neither gated nor normed): the float formats' activations (floats.h). Without quant, the
// quantization is skipped (a call on float weights only).
QActs quantize_rows(const torch::Tensor& x, bool glu, const float* norm_w, float eps, bool avx2, ActBuffers& buf,
                    bool quant, bool floats, const float** rows) {
  TORCH_CHECK(x.dim() == 2 && (x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16),
              "activations must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(x.is_contiguous(), "activations must be contiguous");
  TORCH_CHECK(!glu || x.size(1) % 2 == 0, "a gated input has an even number of features");
  const int64_t m = x.size(0), kin = x.size(1), k = glu ? kin / 2 : kin, mp = (m + 15) / 16 * 16, nb = k / kActBlock;
  TORCH_CHECK(k % kActBlock == 0, "input features ", k, " are not a multiple of ", kActBlock);
  if (quant) {
    buf.q.resize((size_t)(nb * mp * kActBlock));
    buf.dx.resize((size_t)(nb * mp));
    buf.dxb.resize((size_t)(nb * mp));
    buf.bs.resize((size_t)(k / 16 * mp));
    buf.cen16.resize((size_t)(k / 16 * mp));
    buf.cen32.resize((size_t)(nb * mp));
    buf.off16.resize((size_t)(k / 16 * mp));
    buf.off32.resize((size_t)(nb * mp));
    buf.off128.resize((size_t)(nb * mp));
    buf.bs2.resize((size_t)(nb * mp));
  }
  const float* xf;
  if (x.dtype() == torch::kBFloat16) {  // bf16 -> float32 is exact
    buf.in.resize((size_t)(m * kin));
    const at::BFloat16* src = x.data_ptr<at::BFloat16>();
    for (int64_t j = 0; j < m * kin; ++j) buf.in[j] = static_cast<float>(src[j]);
    xf = buf.in.data();
  } else {
    xf = x.data_ptr<float>();
  }
  const float* inv = nullptr;
  if (norm_w) {
    buf.inv.resize((size_t)m);
    run_chunks(m, [&](int64_t i) { buf.inv[i] = row_rms_inv(xf + i * kin, k, eps); }, m >= 4 ? 0 : 1);
    inv = buf.inv.data();
  }
  // the float formats' rows: x's (as float32), or the made input, written block by block below
  float* made = nullptr;
  if (floats) {
    if (glu || inv) {
      buf.made.resize((size_t)(m * k));
      made = buf.made.data();
    }
    *rows = made ? made : xf;
  }
  if (!quant && !made) return QActs{};
  int8_t* pq = buf.q.data();
  const auto glu_fn = avx2 ? glu_block_avx2 : glu_block;
  const auto quant_fn = avx2 ? quantize_block_avx2 : quantize_block;
  const int64_t chunks = (nb + kQuantChunk - 1) / kQuantChunk;
  const int64_t units = m * chunks;
  run_chunks(units, [&](int64_t u) {
    alignas(32) float in[kActBlock];
    const int64_t i = u / chunks, b0 = u % chunks * kQuantChunk, b1 = std::min(nb, b0 + kQuantChunk);
    const float* xr = xf + i * kin;
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = xr + b * kActBlock;
      if (glu) {
        glu_fn(xb, xb + k, in);
        xb = in;
      } else if (inv) {
        const float* w = norm_w + b * kActBlock;
        for (int j = 0; j < kActBlock; ++j) in[j] = xb[j] * inv[i] * w[j];
        xb = in;
      }
      if (made) std::memcpy(made + i * k + b * kActBlock, xb, sizeof(in));
      if (!quant) continue;
      int16_t bs[2];
      quant_fn(xb, pq + (b * mp + i) * kActBlock, &buf.dx[b * mp + i], bs, &buf.dxb[b * mp + i]);
      buf.bs[2 * b * mp + i] = bs[0];
      buf.bs[(2 * b + 1) * mp + i] = bs[1];
      buf.off16[2 * b * mp + i] = -int_offset(Q6_K) * bs[0];
      buf.off16[(2 * b + 1) * mp + i] = -int_offset(Q6_K) * bs[1];
      buf.off32[b * mp + i] = -int_offset(Q5_0) * (bs[0] + bs[1]);
      buf.off128[b * mp + i] = -128 * (bs[0] + bs[1]);
      buf.bs2[b * mp + i] = pack16(bs[1], bs[0]);
      centered_sums(pq + (b * mp + i) * kActBlock, &buf.cen16[2 * b * mp + i], &buf.cen16[(2 * b + 1) * mp + i],
                    &buf.cen32[b * mp + i]);
    }
  }, units >= kQuantGrain ? 0 : 1);
  if (!quant) return QActs{};
  if (mp > m)  // AMX's A tiles read the padding rows (their results are never used)
    for (int64_t b = 0; b < nb; ++b) std::memset(pq + (b * mp + m) * kActBlock, 0, (size_t)((mp - m) * kActBlock));
  return QActs{pq, buf.dx.data(), buf.bs.data(), buf.dxb.data(), m, k, mp, buf.cen16.data(), buf.cen32.data(),
               buf.off16.data(), buf.off32.data(), buf.off128.data(), buf.bs2.data()};
}

// y = h @ W.T (+ bias) (+ residual) for W the packed parts stacked along the output dim:
// [M, sum n], float32 or, with out_bf16, rounded to bfloat16 (to nearest even, as torch's cast),
// where h is x, or with in_glu silu(x[:, :K]) * x[:, K:], or with norm_w RMSNorm(x) (see
// input_row). The activations are quantized once (where a part is quantized; a float part reads
// them in float32, floats.h) and all parts' tiles share one parallel region, split in contiguous
// ranges; bias and residual are added in fp32 in that order, then rounded.
torch::Tensor linear(torch::Tensor x, std::vector<int64_t> fmts, std::vector<torch::Tensor> packed,
                     std::vector<int64_t> ns, c10::optional<torch::Tensor> bias, bool out_bf16, int64_t isa,
                     bool in_glu, c10::optional<torch::Tensor> norm_w, double eps,
                     c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(!fmts.empty() && fmts.size() == packed.size() && fmts.size() == ns.size(), "parts do not match");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t m = x.size(0), k = in_glu ? x.size(1) / 2 : x.size(1);
  struct Part { FormatInfo f; int fmt; bool flt; const uint8_t* w; int64_t tile0, col0, ntiles; };
  std::vector<Part> parts;
  int64_t tiles = 0, cols = 0;
  bool any_quant = false, any_float = false;
  for (size_t i = 0; i < fmts.size(); ++i) {
    const FormatInfo f = info_or_throw(fmts[i]);
    check_packed(fmts[i], f, packed[i], ns[i], k);
    const bool flt = is_float_format((int)fmts[i]);
    parts.push_back({f, (int)fmts[i], flt, packed[i].data_ptr<uint8_t>(), tiles, cols, ns[i] / kTile});
    (flt ? any_float : any_quant) = true;
    tiles += ns[i] / kTile;
    cols += ns[i];
  }
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == cols,
                "bias must be float32 [", cols, "]");
    b = bias->data_ptr<float>();
  }
  const float* nw = nullptr;
  if (norm_w.has_value()) {
    TORCH_CHECK(!in_glu, "a layer's input is normed or gated, not both");
    TORCH_CHECK(norm_w->dtype() == torch::kFloat32 && norm_w->is_contiguous() && norm_w->numel() == k,
                "norm weight must be float32 [", k, "]");
    nw = norm_w->data_ptr<float>();
  }
  const auto out_type = out_bf16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == m && residual->size(1) == cols &&
                residual->dtype() == out_type, "residual must be [", m, ", ", cols, "] in the output dtype");
    res = residual->contiguous();
  }
  const float* r32 = res.defined() && !out_bf16 ? res.data_ptr<float>() : nullptr;
  const at::BFloat16* r16 = res.defined() && out_bf16 ? res.data_ptr<at::BFloat16>() : nullptr;
  const int use = isa < 0 ? best_isa(m) : (int)isa;
  const SuperblockFn fn = kernel_for(use);
  const FloatTilesFn float_fn = float_kernel_for(use);
  thread_local ActBuffers buffers;
  // the scalar path makes the input with the generic code, every other with the AVX2 copy (the
  // same bits, which the scalar-against-ISA tests check)
  const torch::Tensor xc = x.contiguous();  // held: the float parts may read its rows
  const float* xrows = nullptr;
  const QActs a = quantize_rows(xc, in_glu, nw, (float)eps, use != kScalar, buffers, any_quant, any_float, &xrows);
  auto out = torch::empty({m, cols}, out_type);
  at::BFloat16* y16 = out_bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  float* y32 = out_bf16 ? nullptr : out.data_ptr<float>();
  // A few chunks per thread: contiguous enough to stream, small enough that a thread that
  // starts late (another process holding its core) leaves its share to the others.
  const int64_t nchunks = std::min<int64_t>(tiles, 4 * (int64_t)at::get_num_threads());
  run_chunks(nchunks, [&](int64_t chunk) {
    int64_t t0, t1;
    chunk_range(tiles, nchunks, chunk, &t0, &t1);
    thread_local std::vector<float> acc;
    acc.resize((size_t)m * kTile * 2);  // two tiles: the float kernels' steps
    size_t p = 0;
    int amx_sub = 0;  // the sub size the thread's tiles are configured for
    // a tile's accumulators [M][16], the output's columns col .. col + 15: the epilogue
    auto emit = [&](const float* tile_acc, int64_t col) {
      for (int64_t i = 0; i < m; ++i)
        for (int c = 0; c < kTile; ++c) {
          float v = b ? tile_acc[i * kTile + c] + b[col + c] : tile_acc[i * kTile + c];
          if (r32) v += r32[i * cols + col + c];
          else if (r16) v += static_cast<float>(r16[i * cols + col + c]);
          if (y16) y16[i * cols + col + c] = at::BFloat16(v);
          else y32[i * cols + col + c] = v;
        }
    };
    for (int64_t t = t0; t < t1; ++t) {
      while (p + 1 < parts.size() && parts[p + 1].tile0 <= t) ++p;
      const Part& part = parts[p];
      if (part.flt) {  // two tiles a step where the chunk and the part have them
        const int nt = t + 1 < t1 && t + 1 < part.tile0 + part.ntiles ? 2 : 1;
        const int64_t tile_bytes = k * kTile * float_bytes(part.fmt);
        std::fill(acc.begin(), acc.begin() + nt * m * kTile, 0.0f);
        float_fn(part.fmt, part.w + (t - part.tile0) * tile_bytes, k, nt, xrows, k, m, acc.data());
        for (int u = 0; u < nt; ++u) emit(acc.data() + u * m * kTile, part.col0 + (t + u - part.tile0) * kTile);
        t += nt - 1;
        continue;
      }
      // AMX runs the formats amx.cpp handles (amx_runs); a part in another format takes the
      // AVX512 path, the same bits by the contract (every AMX CPU has AVX512 with VNNI)
      const bool on_amx = use == kAmx && amx_runs(part.fmt);
      const SuperblockFn part_fn = use == kAmx && !on_amx ? superblock_avx512 : fn;
      if (on_amx && part.f.sub != amx_sub) amx_configure(amx_sub = part.f.sub, (int)std::min<int64_t>(m, 16));
      const int64_t nsb = k / part.f.kb, tb = part.f.tile_bytes();
      const int64_t col = part.col0 + (t - part.tile0) * kTile;
      std::fill(acc.begin(), acc.begin() + m * kTile, 0.0f);
      const uint8_t* tile = part.w + (t - part.tile0) * nsb * tb;
      // the 32-wide formats go kGroup superblocks per call (the kernels keep their
      // accumulators in registers across them); the 256-wide ones one at a time
      const int64_t group = part.f.kb == 256 ? 1 : kGroup;
      for (int64_t s = 0; s < nsb; s += group) {
        const int count = (int)std::min<int64_t>(group, nsb - s);
        // The weights stream from memory once; the hardware prefetcher alone leaves the core
        // waiting at the start of each superblock, so the superblock two ahead (in memory order,
        // across tiles) is asked into L2, a few lines per sub while this one computes. Against
        // no software prefetch, one superblock ahead in one burst, and one ahead spread, two
        // ahead spread gave the fastest decode steps and verify passes (docs/kernels.md,
        // Prefetch).
        const uint8_t* next = tile + (s + kPrefetchAhead * group) * tb;
        const int lines = (int)((count * tb + 63) / 64), subs = count * part.f.nsub();
        tl_prefetch = {(const char*)next, (const char*)next + lines * 64, (lines + subs - 1) / subs};
        part_fn(part.fmt, part.f, tile + s * tb, a, s, count, acc.data());
        tl_prefetch.per_step = lines;  // what a path without the per-sub steps left (scalar)
        prefetch_step(tl_prefetch);
      }
      emit(acc.data(), col);
    }
    if (amx_sub) amx_release();
  });
  return out;
}

// The fastest path calls take by default (what a CPU with fewer instruction sets would run);
// -1 lifts the cap. Results are the same bits on every path; only the speed changes.
void set_max_isa(int64_t isa) {
  TORCH_CHECK(isa < 0 || isa_supported((int)isa), "ISA path ", isa, " is not supported by this CPU");
  g_max_isa.store((int)isa, std::memory_order_relaxed);
}

std::vector<int64_t> supported_isas() {
  std::vector<int64_t> out;
  for (int isa : {kScalar, kAvx2, kAvxVnni, kAvx512, kAmx})  // slowest first
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

// The calling core's clock in cycles per second: the fastest of many short timed chains of
// dependent integer adds, one cycle each on every x86-64 core, so the loop's own instructions run
// beside them. Short, so that on a shared core some chains run between two preemptions. The
// verify-pass bounds of `verispec bench kernels` turn instruction counts into time with it
// (docs/kernels.md, Bounds).
double core_clock_hz() {
  constexpr int64_t kIters = 250'000;  // x 8 adds: 2 million cycles, under a millisecond
  double best = 0.0;
  for (int trial = 0; trial < 64; ++trial) {
    uint64_t x = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kIters; ++i)
      __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                       "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 8.0 * kIters / s);
  }
  return best;
}

}  // namespace verispec

namespace verispec {
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale,
                        int64_t isa);
std::vector<torch::Tensor> qkv_rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t h, int64_t hkv);
void bind_layer(py::module_& m);
}

// Every call that computes releases the GIL once its arguments are converted (py::call_guard),
// so other Python threads (the server's event loop) run while the kernels work. Nothing inside
// touches a Python object: tensors are read through their data pointers, and errors
// (TORCH_CHECK) are translated after the GIL is taken back. The three small queries and settings
// at the end keep it: they return at once.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("attention", &verispec::attention, "row-invariant attention over the cache (attention.cpp)", nogil());
  m.def("qkv_rope", &verispec::qkv_rope, "q/k/v split into heads, RoPE on q and k (attention.cpp)", nogil());
  m.def("repack", &verispec::repack, "GGUF blocks -> packed tiles", nogil());
  m.def("dequantize", &verispec::dequantize, "packed tiles -> float32 weight, as gguf dequantizes", nogil());
  m.def("linear", &verispec::linear, "x @ W.T (+ bias) over packed parts", nogil());
  m.def("packed_nbytes", &verispec::packed_nbytes, "bytes of a packed [n, k] weight");
  m.def("supported_isas", &verispec::supported_isas);
  m.def("set_max_isa", &verispec::set_max_isa);
  m.def("core_clock_hz", &verispec::core_clock_hz, "the calling core's cycles per second (a timed add chain)", nogil());
  verispec::bind_layer(m);
}
