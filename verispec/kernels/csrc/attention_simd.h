// The SIMD row kernel of attention.cpp's contract, written once for a 16-lane float vector V
// (AVX512: one zmm; AVX2: two ymm) and compiled by attention_avx512.cpp and attention_avx2.cpp
// for their own instructions.
//
// Every step is the scalar definition's IEEE operation on the same operands, lane for lane:
//   the score's 16 lanes over d are one vector, updated add(lane, mul(q, k)) (no fma);
//   the lane tree adds the upper half onto the lower one (w = 8, 4, 2, 1), as lane_tree does;
//   exp_fixed is the same steps on 16 lanes (min/max take the scalar's NaN choice: MINPS and
//   MAXPS return the second operand, the constant, as `x < c ? x : c` does);
//   the sum's lanes are i % 16, so 16 consecutive p's are one vector add;
//   each output element is its own accumulator over the keys in order.
// Only the order of independent work changes (four keys' scores at once, several vectors of
// outputs at once), so the bits equal attend_row_scalar's.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "attention.h"

namespace verispec {

template <class V>
static inline typename V::F exp_lanes(typename V::F x) {
  using F = typename V::F;
  x = V::min(x, V::set1(88.0f));
  x = V::max(x, V::set1(-87.0f));
  const F t = V::mul(x, V::set1(1.44269504088896341f));
  const F half = V::select_ge0(t, V::set1(0.5f), V::set1(-0.5f));
  const typename V::I n = V::cvtt(V::add(t, half));
  const F fn = V::cvt(n);
  F r = V::sub(x, V::mul(fn, V::set1(0.693359375f)));
  r = V::sub(r, V::mul(fn, V::set1(-2.12194440e-4f)));
  F p = V::set1(1.9875691500e-4f);
  p = V::add(V::mul(p, r), V::set1(1.3981999507e-3f));
  p = V::add(V::mul(p, r), V::set1(8.3334519073e-3f));
  p = V::add(V::mul(p, r), V::set1(4.1665795894e-2f));
  p = V::add(V::mul(p, r), V::set1(1.6666665459e-1f));
  p = V::add(V::mul(p, r), V::set1(5.0000001201e-1f));
  const F e = V::add(V::add(V::mul(p, V::mul(r, r)), r), V::set1(1.0f));
  return V::mul(e, V::pow2(n));
}

// out[d0 .. d0 + 16 NC) = sum_i p[i] * v[idx[i]][..] / sum, NC vectors held in registers.
template <class V, int NC>
static inline void values_chunk(const RowAttn& r, int64_t d0, float sum) {
  using F = typename V::F;
  F acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = V::zero();
  for (int64_t i = 0; i < r.n; ++i) {
    const float* vr = r.vb + r.idx[i] * r.vs + d0;
    const F pi = V::set1(r.p[i]);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] = V::add(acc[c], V::mul(pi, V::load(vr + 16 * c)));
  }
  const F s = V::set1(sum);
  for (int c = 0; c < NC; ++c) V::store(r.out + d0 + 16 * c, V::div(acc[c], s));
}

template <class V>
static void attend_row_simd(const RowAttn& r) {
  using F = typename V::F;
  const int64_t n = r.n, d = r.d;
  // scores, four keys at a time (independent chains)
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* k0 = r.kb + r.idx[i] * r.ks;
    const float* k1 = r.kb + r.idx[i + 1] * r.ks;
    const float* k2 = r.kb + r.idx[i + 2] * r.ks;
    const float* k3 = r.kb + r.idx[i + 3] * r.ks;
    F a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
    for (int64_t d0 = 0; d0 < d; d0 += 16) {
      const F qv = V::load(r.q + d0);
      a0 = V::add(a0, V::mul(qv, V::load(k0 + d0)));
      a1 = V::add(a1, V::mul(qv, V::load(k1 + d0)));
      a2 = V::add(a2, V::mul(qv, V::load(k2 + d0)));
      a3 = V::add(a3, V::mul(qv, V::load(k3 + d0)));
    }
    r.p[i] = V::tree(a0) * r.scale;
    r.p[i + 1] = V::tree(a1) * r.scale;
    r.p[i + 2] = V::tree(a2) * r.scale;
    r.p[i + 3] = V::tree(a3) * r.scale;
  }
  for (; i < n; ++i) {
    const float* k0 = r.kb + r.idx[i] * r.ks;
    F a0 = V::zero();
    for (int64_t d0 = 0; d0 < d; d0 += 16) a0 = V::add(a0, V::mul(V::load(r.q + d0), V::load(k0 + d0)));
    r.p[i] = V::tree(a0) * r.scale;
  }
  float mx = -INFINITY;
  for (i = 0; i < n; ++i) mx = r.p[i] > mx ? r.p[i] : mx;
  // p = exp(score - max), 16 at a time; the last vector's lanes past n are computed (from the
  // padding written here) but not added
  const int64_t n16 = (n + 15) / 16 * 16;
  for (i = n; i < n16; ++i) r.p[i] = mx;
  const F vmx = V::set1(mx);
  F lane = V::zero();
  for (i = 0; i < n16; i += 16) {
    const F e = exp_lanes<V>(V::sub(V::load(r.p + i), vmx));
    V::store(r.p + i, e);
    lane = V::add_first(lane, e, (int)std::min<int64_t>(16, n - i));
  }
  const float sum = V::tree(lane);
  int64_t d0 = 0;
  for (; d0 + 16 * V::kChunk <= d; d0 += 16 * V::kChunk) values_chunk<V, V::kChunk>(r, d0, sum);
  switch ((d - d0) / 16) {  // the rest, fewer than kChunk vectors
    case 1: values_chunk<V, 1>(r, d0, sum); break;
    case 2: values_chunk<V, 2>(r, d0, sum); break;
    case 3: values_chunk<V, 3>(r, d0, sum); break;
    case 4: values_chunk<V, 4>(r, d0, sum); break;
    case 5: values_chunk<V, 5>(r, d0, sum); break;
    case 6: values_chunk<V, 6>(r, d0, sum); break;
    case 7: values_chunk<V, 7>(r, d0, sum); break;
    default: break;
  }
}

}  // namespace verispec
