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

// x: float32 [M, K] -> (q int8 [M, K], dx float32 [M, K / 32], bs int16 [M, K / 16]).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32, "activations must be float32 [M, K]");
  const int64_t kb = kActBlock;
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kb == 0, "input features ", k, " are not a multiple of the block ", kb);
  auto q = torch::empty({m, k}, torch::kInt8);
  auto dx = torch::empty({m, k / kb}, torch::kFloat32);
  auto bs = torch::empty({m, k / 16}, torch::kInt16);
  for (int64_t i = 0; i < m; ++i)
    quantize_row(x.data_ptr<float>() + i * k, k, q.data_ptr<int8_t>() + i * k,
                 dx.data_ptr<float>() + i * (k / kb), bs.data_ptr<int16_t>() + i * (k / 16));
  return {q, dx, bs};
}

// out[:, col0 : col0 + N] = x @ W.T, with x given quantized (quantize_rows).
void gemm(int64_t fmt, torch::Tensor packed, int64_t n, int64_t k, torch::Tensor q, torch::Tensor dx,
          torch::Tensor bs, torch::Tensor out, int64_t col0, int64_t isa) {
  const FormatInfo f = info_or_throw(fmt);
  check_packed(f, packed, n, k);
  const int64_t m = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.size(1) == k && q.dtype() == torch::kInt8 && q.is_contiguous(), "bad q");
  TORCH_CHECK(dx.dtype() == torch::kFloat32 && dx.is_contiguous() && dx.numel() == m * (k / kActBlock), "bad dx");
  TORCH_CHECK(bs.dtype() == torch::kInt16 && bs.is_contiguous() && bs.numel() == m * (k / 16), "bad bs");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.dtype() == torch::kFloat32 && out.stride(1) == 1 &&
                  col0 >= 0 && col0 + n <= out.size(1),
              "out must be float32 [M, >= col0 + N] with unit column stride");
  const SuperblockFn fn = kernel_for(isa < 0 ? best_isa() : (int)isa);
  const QActs a{q.data_ptr<int8_t>(), dx.data_ptr<float>(), bs.data_ptr<int16_t>(), m, k};
  const int64_t nsb = k / f.kb, ldo = out.stride(0);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>() + col0;
  at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc((size_t)m * kTile);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* tile = w + t * nsb * f.tile_bytes();
      for (int64_t s = 0; s < nsb; ++s) fn((int)fmt, f, tile + s * f.tile_bytes(), a, s, acc.data());
      for (int64_t i = 0; i < m; ++i) std::memcpy(y + i * ldo + t * kTile, acc.data() + i * kTile, kTile * 4);
    }
  });
}

std::vector<int64_t> supported_isas() {
  std::vector<int64_t> out;
  for (int isa : {kScalar, kAvx2, kAvx512})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

int64_t format_packed_bytes(int64_t fmt, int64_t n, int64_t k) {
  const FormatInfo f = info_or_throw(fmt);
  check_shape(f, n, k);
  return packed_bytes(f, n, k);
}

}  // namespace verispec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("repack", &verispec::repack, "GGUF blocks -> packed tiles");
  m.def("dequantize", &verispec::dequantize, "packed tiles -> float32 weight, as gguf dequantizes");
  m.def("quantize_rows", &verispec::quantize_rows, "per-row activation quantization");
  m.def("gemm", &verispec::gemm, "out[:, col0:col0+N] = x @ W.T");
  m.def("supported_isas", &verispec::supported_isas);
  m.def("best_isa", &verispec::best_isa);
  m.def("format_packed_bytes", &verispec::format_packed_bytes);
}
