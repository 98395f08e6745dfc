// The torch-facing side: shape checks, ISA dispatch, threads, repacking.
//
// Threads split the output columns in whole tiles (at::parallel_for over tiles, so each thread
// reads its own contiguous part of the packed weight); every output is computed by one thread
// over the whole of K, in superblock order, so the thread count cannot change a result.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "qgemm.h"

namespace verispec {
namespace {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool isa_supported(int isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && isa_supported(kAvx2);
    default: return false;
  }
}

int best_isa() { return isa_supported(kAvx512) ? kAvx512 : isa_supported(kAvx2) ? kAvx2 : kScalar; }

SuperblockFn kernel_for(int isa) {
  TORCH_CHECK(isa_supported(isa), "ISA path ", isa, " is not supported by this CPU");
  return isa == kAvx512 ? superblock_avx512 : isa == kAvx2 ? superblock_avx2 : superblock_scalar;
}

FormatInfo info_or_throw(int64_t fmt) {
  FormatInfo f;
  TORCH_CHECK(format_info((int)fmt, &f), "GGUF type ", fmt, " is not supported by the native kernels");
  return f;
}

void check_shape(const FormatInfo& f, int64_t n, int64_t k) {
  TORCH_CHECK(n > 0 && n % kTile == 0, "output features must be a positive multiple of ", kTile, ", got ", n);
  TORCH_CHECK(k > 0 && k % f.kb == 0, "input features must be a positive multiple of ", f.kb, ", got ", k);
}

int64_t packed_bytes(const FormatInfo& f, int64_t n, int64_t k) { return n / kTile * (k / f.kb) * f.tile_bytes(); }

}  // namespace

// raw: uint8 [N, K / KB * block_bytes], the GGUF tensor's bytes (row n = output feature n).
torch::Tensor repack(int64_t fmt, torch::Tensor raw, int64_t n, int64_t k) {
  const FormatInfo f = info_or_throw(fmt);
  check_shape(f, n, k);
  const int64_t nsb = k / f.kb, row_bytes = nsb * f.block_bytes;
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous() && raw.numel() == n * row_bytes,
              "raw GGUF data must be contiguous uint8 with ", n * row_bytes, " bytes, got ", raw.numel());
  auto out = torch::zeros({packed_bytes(f, n, k)}, torch::kUInt8);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
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

void check_packed(const FormatInfo& f, const torch::Tensor& packed, int64_t n, int64_t k) {
  check_shape(f, n, k);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() == packed_bytes(f, n, k),
              "packed weight has ", packed.numel(), " bytes, expected ", packed_bytes(f, n, k));
}

// The float32 weight [N, K] the kernels multiply by, computed as gguf dequantizes the file.
torch::Tensor dequantize(int64_t fmt, torch::Tensor packed, int64_t n, int64_t k) {
  const FormatInfo f = info_or_throw(fmt);
  check_packed(f, packed, n, k);
  auto out = torch::empty({n, k}, torch::kFloat32);
  const int64_t nsb = k / f.kb;
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t s = 0; s < nsb; ++s)
        dequantize_tile(f, (int)fmt, src + (t * nsb + s) * f.tile_bytes(), dst + t * kTile * k + s * f.kb, k);
  });
  return out;
}

// x: float32 or bfloat16 [M, K] -> (q int8 [M, K], dx float32 [M, K / 32], bs int16 [M, K / 16]).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && (x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16),
              "activations must be float32 or bfloat16 [M, K]");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kActBlock == 0, "input features ", k, " are not a multiple of ", kActBlock);
  auto q = torch::empty({m, k}, torch::kInt8);
  auto dx = torch::empty({m, k / kActBlock}, torch::kFloat32);
  auto bs = torch::empty({m, k / 16}, torch::kInt16);
  std::vector<float> row(x.dtype() == torch::kBFloat16 ? k : 0);
  for (int64_t i = 0; i < m; ++i) {
    const float* xr;
    if (x.dtype() == torch::kBFloat16) {  // bf16 -> float32 is exact
      const at::BFloat16* src = x.data_ptr<at::BFloat16>() + i * k;
      for (int64_t j = 0; j < k; ++j) row[j] = static_cast<float>(src[j]);
      xr = row.data();
    } else {
      xr = x.data_ptr<float>() + i * k;
    }
    quantize_row(xr, k, q.data_ptr<int8_t>() + i * k, dx.data_ptr<float>() + i * (k / kActBlock),
                 bs.data_ptr<int16_t>() + i * (k / 16));
  }
  return {q, dx, bs};
}

// y = x @ W.T (+ bias) for W the packed parts stacked along the output dim: [M, sum n], float32
// or, with out_bf16, rounded to bfloat16 (to nearest even, as torch's cast). The activations are
// quantized once and all parts' tiles share one parallel region, split in contiguous ranges.
torch::Tensor linear(torch::Tensor x, std::vector<int64_t> fmts, std::vector<torch::Tensor> packed,
                     std::vector<int64_t> ns, c10::optional<torch::Tensor> bias, bool out_bf16, int64_t isa) {
  TORCH_CHECK(!fmts.empty() && fmts.size() == packed.size() && fmts.size() == ns.size(), "parts do not match");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  struct Part { FormatInfo f; int fmt; const uint8_t* w; int64_t tile0, col0; };
  std::vector<Part> parts;
  int64_t tiles = 0, cols = 0;
  for (size_t i = 0; i < fmts.size(); ++i) {
    const FormatInfo f = info_or_throw(fmts[i]);
    check_packed(f, packed[i], ns[i], k);
    parts.push_back({f, (int)fmts[i], packed[i].data_ptr<uint8_t>(), tiles, cols});
    tiles += ns[i] / kTile;
    cols += ns[i];
  }
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == cols,
                "bias must be float32 [", cols, "]");
    b = bias->data_ptr<float>();
  }
  const auto acts = quantize_rows(x);
  const QActs a{acts[0].data_ptr<int8_t>(), acts[1].data_ptr<float>(), acts[2].data_ptr<int16_t>(), m, k};
  auto out = torch::empty({m, cols}, out_bf16 ? torch::kBFloat16 : torch::kFloat32);
  const SuperblockFn fn = kernel_for(isa < 0 ? best_isa() : (int)isa);
  at::BFloat16* y16 = out_bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  float* y32 = out_bf16 ? nullptr : out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc((size_t)m * kTile);
    size_t p = 0;
    for (int64_t t = t0; t < t1; ++t) {
      while (p + 1 < parts.size() && parts[p + 1].tile0 <= t) ++p;
      const Part& part = parts[p];
      const int64_t nsb = k / part.f.kb, tb = part.f.tile_bytes();
      const int64_t col = part.col0 + (t - part.tile0) * kTile;
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* tile = part.w + (t - part.tile0) * nsb * tb;
      for (int64_t s = 0; s < nsb; ++s) fn(part.fmt, part.f, tile + s * tb, a, s, acc.data());
      for (int64_t i = 0; i < m; ++i)
        for (int c = 0; c < kTile; ++c) {
          const float v = b ? acc[i * kTile + c] + b[col + c] : acc[i * kTile + c];
          if (y16) y16[i * cols + col + c] = at::BFloat16(v);
          else y32[i * cols + col + c] = v;
        }
    }
  });
  return out;
}

std::vector<int64_t> supported_isas() {
  std::vector<int64_t> out;
  for (int isa : {kScalar, kAvx2, kAvx512})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

}  // namespace verispec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("repack", &verispec::repack, "GGUF blocks -> packed tiles");
  m.def("dequantize", &verispec::dequantize, "packed tiles -> float32 weight, as gguf dequantizes");
  m.def("linear", &verispec::linear, "x @ W.T (+ bias) over packed parts");
  m.def("supported_isas", &verispec::supported_isas);
}
