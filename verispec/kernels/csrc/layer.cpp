// One decoder layer of a float32 model on the native kernels, as one call: what
// DecoderLayer.forward runs for a decode step, a verify pass or a tree pass (normed q/k/v
// projection, RoPE, the cache write, attention over the cache, the output projection and the
// MLP with their residuals), with the same kernel calls on the same inputs in the same order, so
// the same bits. It exists for speed: the Python around those calls (module calls, argument
// handling, the cache's slice assignments and views) cost about as much as the attention and
// RoPE kernels themselves, a noticeable part of a decode step (docs/kernels.md, A layer in one
// call).
//
// The layer holds its weights' tensors (the packed parts, biases and norm weights) for its
// lifetime; the decoder makes one per layer and drops it when a layer's modules change.
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace verispec {

torch::Tensor linear(torch::Tensor x, std::vector<int64_t> fmts, std::vector<torch::Tensor> packed,
                     std::vector<int64_t> ns, c10::optional<torch::Tensor> bias, bool out_bf16, int64_t isa,
                     bool in_glu, c10::optional<torch::Tensor> norm_w, double eps,
                     c10::optional<torch::Tensor> residual);
torch::Tensor attention_out(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale,
                            int64_t isa, bool by_position, const std::vector<int64_t>& slots);
std::vector<torch::Tensor> qkv_rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t h, int64_t hkv);

namespace {

// A linear layer's packed parts, as NativeLinear passes them to linear().
struct Proj {
  std::vector<int64_t> fmts;
  std::vector<torch::Tensor> packed;
  std::vector<int64_t> ns;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x, bool glu, const c10::optional<torch::Tensor>& norm, double eps,
                           const c10::optional<torch::Tensor>& residual) const {
    return linear(x, fmts, packed, ns, bias, false, -1, glu, norm, eps, residual);
  }
};

Proj proj(py::tuple t) {
  TORCH_CHECK(t.size() == 4, "a projection is (fmts, packed, ns, bias)");
  return {t[0].cast<std::vector<int64_t>>(), t[1].cast<std::vector<torch::Tensor>>(), t[2].cast<std::vector<int64_t>>(),
          t[3].cast<c10::optional<torch::Tensor>>()};
}

// The smallest float32 magnitude that rounds to infinity in float16 (65504 is its largest).
constexpr float kHalfOverflow = 65520.0f;

// new [B, Hkv, T, D] into cache [slots, Hkv, max_len, D] at slots[b], indices starts[b] .. + T
void write_cache(torch::Tensor& cache, const torch::Tensor& fresh, const std::vector<int64_t>& slots,
                 const std::vector<int64_t>& starts) {
  const int64_t b = fresh.size(0), hkv = fresh.size(1), t = fresh.size(2), d = fresh.size(3);
  const int64_t len = cache.size(2);
  TORCH_CHECK(cache.size(1) == hkv && cache.size(3) == d, "the cache holds [", cache.size(1), " heads, ", cache.size(3),
              " dims] where the layer makes [", hkv, ", ", d, "]");
  const float* src = fresh.data_ptr<float>();
  const bool half = cache.dtype() == torch::kFloat16;
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < cache.size(0) && starts[i] >= 0 && starts[i] + t <= len,
                "slot ", slots[i], " cannot take ", t, " entries at ", starts[i]);
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t at = ((slots[i] * hkv + h) * len + starts[i]) * d;
      const float* from = src + ((i * hkv + h) * t) * d;
      if (!half) {
        std::memcpy(cache.data_ptr<float>() + at, from, (size_t)(t * d) * sizeof(float));
        continue;
      }
      // rounded to nearest even, as torch rounds a float32 tensor copied into a float16 one; a
      // finite value that float16 cannot hold would turn into an infinity, and the attention
      // over it into NaN: an error instead (kv_cache.py checks its writes alike)
      c10::Half* dst = cache.data_ptr<c10::Half>() + at;
      for (int64_t j = 0; j < t * d; ++j) {
        TORCH_CHECK(!(std::isfinite(from[j]) && std::fabs(from[j]) >= kHalfOverflow), "a key or value of ", from[j],
                    " does not fit the float16 KV cache; load the model with kv_cache_dtype='float32' "
                    "(--kv-cache-dtype float32)");
        dst[j] = c10::Half(from[j]);
      }
    }
  }
}

}  // namespace

class NativeLayer {
 public:
  NativeLayer(py::tuple qkv, py::tuple o, py::tuple gate_up, py::tuple down, torch::Tensor input_norm,
              double input_eps, torch::Tensor post_norm, double post_eps, int64_t heads, int64_t kv_heads,
              double scale)
      : qkv_(proj(qkv)), o_(proj(o)), gate_up_(proj(gate_up)), down_(proj(down)), input_norm_(input_norm),
        post_norm_(post_norm), input_eps_(input_eps), post_eps_(post_eps), heads_(heads), kv_heads_(kv_heads),
        scale_(scale) {
    TORCH_CHECK(input_norm.dtype() == torch::kFloat32 && post_norm.dtype() == torch::kFloat32,
                "the norms' weights must be float32");
  }

  // x [B, T, C] float32, cos and sin [B, 1, T, D], k_cache and v_cache this layer's
  // [slots, Hkv, max_len, D] (written at slots[b], from starts[b]), mask [B, T, S] (True =
  // attend, S = attend_len): the layer's output [B, T, C].
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                        torch::Tensor v_cache, std::vector<int64_t> slots, std::vector<int64_t> starts,
                        int64_t attend_len, torch::Tensor mask) const {
    TORCH_CHECK(x.dim() == 3 && x.dtype() == torch::kFloat32, "x must be float32 [B, T, C]");
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
    TORCH_CHECK((int64_t)slots.size() == b && (int64_t)starts.size() == b, "one slot and one start per row");
    for (const torch::Tensor* cache : {&k_cache, &v_cache})
      TORCH_CHECK(cache->dim() == 4 && cache->dtype() == k_cache.dtype() &&
                      (cache->dtype() == torch::kFloat32 || cache->dtype() == torch::kFloat16) && cache->is_contiguous() &&
                      cache->size(1) == kv_heads_ && attend_len <= cache->size(2),
                  "the caches must be contiguous [slots, Hkv, max_len, D], both float32 or both float16");
    const torch::Tensor rows = x.reshape({b * t, c});
    const torch::Tensor qkv = qkv_(rows, false, input_norm_, input_eps_, c10::nullopt);
    const std::vector<torch::Tensor> qkv_heads = qkv_rope(qkv.view({b, t, qkv.size(1)}), cos, sin, heads_, kv_heads_);
    write_cache(k_cache, qkv_heads[1], slots, starts);
    write_cache(v_cache, qkv_heads[2], slots, starts);
    // each row reads its own slot's entries [0, attend_len) in place and writes [B, T, H, D],
    // the output projection's rows as they are (see attention_out)
    const torch::Tensor attn = attention_out(qkv_heads[0], k_cache.narrow(2, 0, attend_len),
                                             v_cache.narrow(2, 0, attend_len), mask, scale_, -1, true, slots);
    const torch::Tensor h = o_(attn.view({b * t, -1}), false, c10::nullopt, 0.0, rows);
    const torch::Tensor gate_up = gate_up_(h, false, post_norm_, post_eps_, c10::nullopt);
    return down_(gate_up, true, c10::nullopt, 0.0, h).view({b, t, c});
  }

 private:
  Proj qkv_, o_, gate_up_, down_;
  torch::Tensor input_norm_, post_norm_;
  double input_eps_, post_eps_;
  int64_t heads_, kv_heads_;
  double scale_;
};

void bind_layer(py::module_& m) {
  py::class_<NativeLayer>(m, "NativeLayer", "a decoder layer on the native kernels in one call (layer.cpp)")
      .def(py::init<py::tuple, py::tuple, py::tuple, py::tuple, torch::Tensor, double, torch::Tensor, double, int64_t,
                    int64_t, double>())
      // the constructor reads Python tuples, so it keeps the GIL; forward releases it (ops.cpp)
      .def("forward", &NativeLayer::forward, py::call_guard<py::gil_scoped_release>());
}

}  // namespace verispec
