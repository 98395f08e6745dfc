// Attention over the KV cache for a few query rows, each row computed alone in fixed float32
// steps, so that its bits do not depend on the other rows of the pass, on how many keys the pass
// holds beyond the row's own, or on the thread count.
//
// Why it exists: torch 2.13's float32 matmuls on CPU change a row's last bits with the shapes
// around it. Padding the query rows to a fixed count (decoder.invariant_matmul) removes the
// dependence on the row count, but not on S, the number of cache entries a pass attends over, which
// grows with the pass's last position: a verify pass whose keys run past a row's own differed from
// the decode steps over the same keys on most rows of a long sequence (docs/kernels.md, Attention).
// Here a row reduces over its own attended keys only, compacted in cache order, so a decode step, a
// chain verify pass and a tree pass (whose rows attend to scattered entries) give the same bits for
// the same keys.
//
// Per (batch, head, row), with the row's attended cache indices s_0 < s_1 < ... < s_{n-1}:
//   score_i = dot(q, k[s_i]) * scale      dot: 16 lanes over d (d % 16), each lane a chain of
//                                         fused multiply-adds in d order, then a fixed tree
//   p_i = exp(score_i - max_i score_i)    exp_fixed (qgemm.h): fixed steps, no libm call
//   sum = 16 lanes over i (i % 16), then the same tree
//   out[d] = (fma chain of p_i * v[s_i][d], i in order) / sum
// This file's attend_row_scalar is the definition. It is compiled for baseline x86-64, without
// fma contraction (its fused steps are explicit std::fma calls) and without reassociation, so
// the compiler's vectorisation cannot change these sums. Fused steps rather than a multiply and
// an add: half the instructions on the SIMD paths (docs/kernels.md). The AVX2 and AVX512
// kernels (attention_simd.h) run the same IEEE operations on 16 lanes at once and give the same
// bits; they are what a pass runs by default, since with the scalar one attention took a large
// share of a verify pass once a few hundred tokens are cached (docs/kernels.md, Attention).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"
#include "pool.h"
#include "qgemm.h"

namespace verispec {

namespace {

constexpr int kLanes = 16;

inline float lane_tree(float* lane) {
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}

// Element j of cache row `row` as a float: a float16 cache's converted exactly.
inline float element(const RowAttn& r, const void* base, int64_t row, int64_t j) {
  if (!r.half) return ((const float*)base)[row + j];
  return static_cast<float>(c10::Half(((const uint16_t*)base)[row + j], c10::Half::from_bits()));
}

}  // namespace

// The definition (the ISA paths give its bits: attention_simd.h), one head at a time.
void attend_row_scalar(const RowAttn& r) {
  const int64_t n = r.n, d = r.d;
  for (int hh = 0; hh < r.heads; ++hh) {
    const float* q = r.q + hh * r.qs;
    float* p = r.p + hh * r.ps;
    float* out = r.out + hh * r.os;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t kr = r.idx[i] * r.ks;
      float lane[kLanes] = {};
      for (int64_t d0 = 0; d0 < d; d0 += kLanes)
        for (int l = 0; l < kLanes; ++l) lane[l] = std::fma(q[d0 + l], element(r, r.kb, kr, d0 + l), lane[l]);
      p[i] = lane_tree(lane) * r.scale;
      mx = p[i] > mx ? p[i] : mx;
    }
    float lane[kLanes] = {};
    for (int64_t i = 0; i < n; ++i) {
      p[i] = exp_fixed(p[i] - mx);
      lane[i % kLanes] += p[i];
    }
    const float sum = lane_tree(lane);
    std::fill(r.acc, r.acc + d, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t vr = r.idx[i] * r.vs;
      const float pi = p[i];
      for (int64_t j = 0; j < d; ++j) r.acc[j] = std::fma(pi, element(r, r.vb, vr, j), r.acc[j]);
    }
    for (int64_t j = 0; j < d; ++j) out[j] = r.acc[j] / sum;
  }
}

void attend_rows_scalar(const RowAttn* rows, int npos) {
  for (int j = 0; j < npos; ++j) attend_row_scalar(rows[j]);
}

// q [B, H, T, D] float32, k and v [B, Hkv, S, D] (D contiguous) float32 or both float16 (a
// float16 cache: each element read as its exact float, then the same steps), mask [B, T, S]
// bool (True = attend): out [B, H, T, D], or [B, T, H, D] when by_position (the rows the output
// projection reads, so the layer need not transpose them: torch's copy of that size was slow
// inside the layer, docs/kernels.md, A layer in one call). H is a multiple
// of Hkv (grouped-query heads share KV heads). isa: the row kernel's path (-1: the default one,
// see attend_rows_for). The layout changes where a row is written, not how it is computed.
// With slots (one per batch row), k and v are a cache [slots, Hkv, S, D] and row b reads slot
// slots[b] in place, where a gathered copy cost as much (see by_position).
torch::Tensor attention_out(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale,
                            int64_t isa, bool by_position, const std::vector<int64_t>& slots) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3, "attention takes q, k, v [B, H, T, D] and mask [B, T, S]");
  TORCH_CHECK(q.dtype() == torch::kFloat32, "attention runs float32 queries");
  TORCH_CHECK(k.dtype() == v.dtype() && (k.dtype() == torch::kFloat32 || k.dtype() == torch::kFloat16),
              "k and v must both be float32 or both float16");
  const bool half = k.dtype() == torch::kFloat16;
  TORCH_CHECK(mask.dtype() == torch::kBool, "mask must be bool");
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), s = k.size(2);
  TORCH_CHECK(d % kLanes == 0, "head dim ", d, " is not a multiple of ", kLanes);
  TORCH_CHECK(hkv > 0 && h % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.empty() || (int64_t)slots.size() == b, "one slot per batch row");
  for (int64_t sl : slots)
    TORCH_CHECK(sl >= 0 && sl < k.size(0) && sl < v.size(0), "slot ", sl, " is not in the cache");
  TORCH_CHECK((!slots.empty() || (k.size(0) == b && v.size(0) == b)) && v.size(1) == hkv && v.size(2) == s &&
                  k.size(3) == d && v.size(3) == d,
              "k and v must be [B, Hkv, S, D], or caches [slots, Hkv, S, D] with a slot per row");
  TORCH_CHECK(mask.size(0) == b && mask.size(1) == t && mask.size(2) == s, "mask must be [B, T, S]");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v must be contiguous in D");
  const AttendRowsFn rows_fn = attend_rows_for(isa);
  q = q.contiguous();
  mask = mask.contiguous();
  auto out = by_position ? torch::empty({b, t, h, d}, torch::kFloat32) : torch::empty({b, h, t, d}, torch::kFloat32);
  const float* pq = q.data_ptr<float>();
  const char* pk = (const char*)k.data_ptr();
  const char* pv = (const char*)v.data_ptr();
  const int64_t es = k.element_size();
  const bool* pm = mask.data_ptr<bool>();
  float* po = out.data_ptr<float>();
  if (out.numel() == 0) return out;  // no rows (B, H or T is 0)
  const int64_t group = h / hkv;
  const float sc = (float)scale;
  // One unit: the query heads (up to kMaxHeads) of one KV head at up to kMaxPositions
  // positions. The heads of a position attend to the same keys, gathered from the mask once for
  // them all; the positions take turns on each block of keys (attention_simd.h).
  // Positions are cut into spans of at most kMaxPositions, and into at least two units per
  // thread where there are positions enough, so that a late thread leaves little to wait for.
  const int64_t parts = (group + kMaxHeads - 1) / kMaxHeads, others = b * hkv * parts;
  const int64_t threads = at::get_num_threads();
  const int64_t spans = std::min<int64_t>(t, std::max<int64_t>((t + kMaxPositions - 1) / kMaxPositions,
                                                               (2 * threads + others - 1) / others));
  const int64_t per_span = (t + spans - 1) / spans;
  const int64_t units = others * spans;
  const int64_t nchunks = std::min<int64_t>(units, 4 * threads);
  const int64_t ps = (s + kLanes - 1) / kLanes * kLanes;
  run_chunks(nchunks, [&](int64_t chunk) {
    int64_t u0, u1;
    chunk_range(units, nchunks, chunk, &u0, &u1);
    thread_local std::vector<int64_t> idx;
    thread_local std::vector<float> p, acc;
    if ((int64_t)idx.size() < per_span * s) idx.resize((size_t)(per_span * s));
    if ((int64_t)p.size() < per_span * kMaxHeads * ps) p.resize((size_t)(per_span * kMaxHeads * ps));
    if ((int64_t)acc.size() < d) acc.resize((size_t)d);
    RowAttn rows[kMaxPositions];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t span = u % spans, part = u / spans % parts, kv = u / (spans * parts) % hkv;
      const int64_t bi = u / (spans * parts * hkv);
      const int64_t h0 = kv * group + part * kMaxHeads;
      const int heads = (int)std::min<int64_t>(kMaxHeads, (kv + 1) * group - h0);
      const int64_t sb = slots.empty() ? bi : slots[bi];
      const int64_t t0 = span * per_span, t1 = std::min(t, t0 + per_span);
      int npos = 0;
      for (int64_t ti = t0; ti < t1; ++ti) {
        const bool* mr = pm + (bi * t + ti) * s;
        const int64_t row0 = (bi * h + h0) * t + ti;  // head h0's query row; the next head's is t rows on
        // head h0's output row, and the distance to the next head's
        float* out0 = po + (by_position ? (bi * t + ti) * h + h0 : row0) * d;
        const int64_t os = by_position ? d : t * d;
        int64_t* ix = idx.data() + npos * s;
        int64_t n = 0;
        for (int64_t j = 0; j < s; ++j)
          if (mr[j]) ix[n++] = j;
        if (n == 0) {
          for (int hh = 0; hh < heads; ++hh) std::memset(out0 + hh * os, 0, (size_t)d * sizeof(float));
          continue;
        }
        rows[npos] = {pq + row0 * d, t * d, heads, pk + (sb * k.stride(0) + kv * k.stride(1)) * es,
                      pv + (sb * v.stride(0) + kv * v.stride(1)) * es, k.stride(2), v.stride(2), ix, n, d, sc,
                      p.data() + npos * kMaxHeads * ps, ps, acc.data(), out0, os, half};
        ++npos;
      }
      if (npos > 0) rows_fn(rows, npos);
    }
  });
  return out;
}

torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale,
                        int64_t isa) {
  return attention_out(q, k, v, mask, scale, isa, false, {});
}

}  // namespace verispec

namespace verispec {

// The q/k/v projection's output split into heads, with RoPE on q and k, for a pass's rows:
// qkv [B, T, (H + 2 Hkv) D] and cos, sin [B, 1, T, D] float32 -> q [B, H, T, D], k and v
// [B, Hkv, T, D], contiguous. The rotation is x * cos + rotate_half(x) * sin with
// rotate_half(x) = [-x[D/2:], x[:D/2]], element by element: one multiply, one multiply and one
// add, as the same three PyTorch ops compute it, so the bits equal the decoder's PyTorch form.
std::vector<torch::Tensor> qkv_rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t h, int64_t hkv) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.dtype() == torch::kFloat32, "qkv must be float32 [B, T, C]");
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32, "cos and sin must be float32");
  const int64_t b = qkv.size(0), t = qkv.size(1), c = qkv.size(2), heads = h + 2 * hkv;
  TORCH_CHECK(heads > 0 && c % heads == 0 && (c / heads) % 2 == 0, "qkv width ", c, " does not split into ", heads, " heads");
  const int64_t d = c / heads, half = d / 2;
  TORCH_CHECK(cos.numel() == b * t * d && sin.numel() == b * t * d, "cos and sin must be [B, 1, T, D]");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto q = torch::empty({b, h, t, d}, torch::kFloat32);
  auto k = torch::empty({b, hkv, t, d}, torch::kFloat32);
  auto v = torch::empty({b, hkv, t, d}, torch::kFloat32);
  const float* src = qkv.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin.data_ptr<float>();
  float* pq = q.data_ptr<float>();
  float* pk = k.data_ptr<float>();
  float* pv = v.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti) {
      const float* row = src + (bi * t + ti) * c;
      const float* cr = pc + (bi * t + ti) * d;
      const float* sr = ps + (bi * t + ti) * d;
      for (int64_t hi = 0; hi < heads; ++hi) {
        const float* x = row + hi * d;
        float* out = hi < h ? pq + ((bi * h + hi) * t + ti) * d
                   : hi < h + hkv ? pk + ((bi * hkv + hi - h) * t + ti) * d
                   : pv + ((bi * hkv + hi - h - hkv) * t + ti) * d;
        if (hi >= h + hkv) {
          std::memcpy(out, x, (size_t)d * sizeof(float));
          continue;
        }
        for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cr[j] + (-x[j + half]) * sr[j];
        for (int64_t j = half; j < d; ++j) out[j] = x[j] * cr[j] + x[j - half] * sr[j];
      }
    }
  return {q, k, v};
}

}  // namespace verispec
