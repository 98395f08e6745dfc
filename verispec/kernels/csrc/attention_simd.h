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
// Only the order of independent work changes (the heads that share a KV head run together, so
// each key and value vector is loaded once for them; several keys' scores at once; several
// vectors of outputs at once), so the bits equal attend_row_scalar's.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "attention.h"

namespace verispec {

// The lane tree's steps w = 4, 2, 1 on the 8 sums of its step w = 8 (lane l of s8 holds
// lane[l] + lane[l + 8]).
static inline float tree_of_8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

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

// Scores of G heads against KB keys at a time (G * KB independent chains), times scale, into
// each head's p.
template <class V, int G, int KB>
static inline void scores(const RowAttn& r, int64_t i) {
  using F = typename V::F;
  const float* kr[KB];
  for (int j = 0; j < KB; ++j) kr[j] = r.kb + r.idx[i + j] * r.ks;
  F a[G][KB];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < KB; ++j) a[g][j] = V::zero();
  for (int64_t d0 = 0; d0 < r.d; d0 += 16) {
    F kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = V::load(kr[j] + d0);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const F qv = V::load(r.q + g * r.qs + d0);
      for (int j = 0; j < KB; ++j) a[g][j] = V::add(a[g][j], V::mul(qv, kv[j]));
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < KB; ++j) r.p[g * r.ps + i + j] = V::tree(a[g][j]) * r.scale;
}

// out[d0 .. d0 + 16 NC) of G heads = sum_i p[i] * v[idx[i]][..] / sum, G * NC vectors held in
// registers; each v vector is loaded once for the G heads.
template <class V, int G, int NC>
static inline void values_chunk(const RowAttn& r, int64_t d0, const float* sum) {
  using F = typename V::F;
  F acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = V::zero();
  for (int64_t i = 0; i < r.n; ++i) {
    const float* vr = r.vb + r.idx[i] * r.vs + d0;
    F vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = V::load(vr + 16 * c);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const F pi = V::set1(r.p[g * r.ps + i]);
      for (int c = 0; c < NC; ++c) acc[g][c] = V::add(acc[g][c], V::mul(pi, vv[c]));
    }
  }
  for (int g = 0; g < G; ++g) {
    const F s = V::set1(sum[g]);
    for (int c = 0; c < NC; ++c) V::store(r.out + g * r.os + d0 + 16 * c, V::div(acc[g][c], s));
  }
}

template <class V, int G>
static void attend_heads(const RowAttn& r) {
  using F = typename V::F;
  const int64_t n = r.n, d = r.d;
  constexpr int KB = V::kScoreAcc / G >= 4 ? 4 : V::kScoreAcc / G >= 1 ? V::kScoreAcc / G : 1;  // keys per score block
  int64_t i = 0;
  for (; i + KB <= n; i += KB) scores<V, G, KB>(r, i);
  for (; i < n; ++i) scores<V, G, 1>(r, i);
  float sum[G];
  const int64_t n16 = (n + 15) / 16 * 16;
  for (int g = 0; g < G; ++g) {
    float* p = r.p + g * r.ps;
    // the max in 16 lanes, then over the lanes: exact, and NaN skipped as the scalar
    // `p > mx ? p : mx` skips it (MAXPS returns its second operand, the running max, which is
    // never NaN). Only which zero wins a tie of +0 and -0 can differ, and p - mx, hence exp,
    // is the same for either.
    F vmax = V::set1(-INFINITY);
    for (i = 0; i + 16 <= n; i += 16) vmax = V::max(V::load(p + i), vmax);
    float lanes[16];
    V::store(lanes, vmax);
    float mx = -INFINITY;
    for (int l = 0; l < 16; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
    for (; i < n; ++i) mx = p[i] > mx ? p[i] : mx;
    // p = exp(score - max), 16 at a time; the last vector's lanes past n are computed (from
    // the padding written here) but not added
    for (i = n; i < n16; ++i) p[i] = mx;
    const F vmx = V::set1(mx);
    F lane = V::zero();
    for (i = 0; i < n16; i += 16) {
      const F e = exp_lanes<V>(V::sub(V::load(p + i), vmx));
      V::store(p + i, e);
      lane = V::add_first(lane, e, (int)std::min<int64_t>(16, n - i));
    }
    sum[g] = V::tree(lane);
  }
  constexpr int NC = V::kAcc / G > 1 ? V::kAcc / G : 1;
  int64_t d0 = 0;
  for (; d0 + 16 * NC <= d; d0 += 16 * NC) values_chunk<V, G, NC>(r, d0, sum);
  for (; d0 < d; d0 += 16) values_chunk<V, G, 1>(r, d0, sum);
}

// The heads in groups of at most V::kMaxG (the registers one group's accumulators take).
template <class V>
static void attend_row_simd(const RowAttn& r) {
  for (int h0 = 0; h0 < r.heads; h0 += V::kMaxG) {
    RowAttn part = r;
    part.heads = std::min(V::kMaxG, r.heads - h0);
    part.q = r.q + h0 * r.qs;
    part.p = r.p + h0 * r.ps;
    part.out = r.out + h0 * r.os;
    switch (part.heads) {
      case 1: attend_heads<V, 1>(part); break;
      case 2: attend_heads<V, 2>(part); break;
      case 3: attend_heads<V, 3>(part); break;
      case 4: attend_heads<V, 4>(part); break;
      case 5: if constexpr (V::kMaxG >= 5) attend_heads<V, 5>(part); break;
      case 6: if constexpr (V::kMaxG >= 6) attend_heads<V, 6>(part); break;
      case 7: if constexpr (V::kMaxG >= 7) attend_heads<V, 7>(part); break;
      default: if constexpr (V::kMaxG >= 8) attend_heads<V, 8>(part); break;
    }
  }
}

}  // namespace verispec
