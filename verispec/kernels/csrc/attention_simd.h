// The SIMD row kernel of attention.cpp's contract, written once for a 16-lane float vector V
// (AVX512: one zmm; AVX2: two ymm) and compiled by attention_avx512.cpp and attention_avx2.cpp
// for their own instructions.
//
// Every step is the scalar definition's IEEE operation on the same operands, lane for lane:
//   the score's 16 lanes over d are one vector, updated fma(q, k, lane);
//   the lane tree adds the upper half onto the lower one (w = 8, 4, 2, 1), as lane_tree does;
//   exp_fixed is the same steps on 16 lanes (min/max take the scalar's NaN choice: MINPS and
//   MAXPS return the second operand, the constant, as `x < c ? x : c` does);
//   the sum's lanes are i % 16, so 16 consecutive p's are one vector add;
//   each output element is its own accumulator over the keys in order, fma(p, v, acc);
//   a float16 cache's keys and values are converted on load (vcvtph2ps, exact), where the scalar
//   definition converts each element, so both run the float32 steps on the same floats.
// Only the order of independent work changes (the heads that share a KV head run together, so
// each key and value vector is loaded once for them; the positions of a pass take turns on a
// block of keys; several keys' scores at once; several vectors of outputs at once), so the bits
// equal attend_row_scalar's.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

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

// 16 cache elements as floats: a float32 cache's as they are, a float16 cache's converted
// (exactly: every half is a float).
template <class V>
static inline typename V::F load_kv(const float* p) { return V::load(p); }
template <class V>
static inline typename V::F load_kv(const uint16_t* p) { return V::load_half(p); }

// The 16 lanes over d of G heads against KB keys at a time (G * KB independent chains), into
// raw[g][j0 + j]: the scores before their lane trees.
template <class V, class KT, int G, int KB>
static inline void lane_sums(const RowAttn& r, int64_t i, typename V::F (*raw)[16], int j0) {
  using F = typename V::F;
  const KT* kr[KB];
  for (int j = 0; j < KB; ++j) kr[j] = (const KT*)r.kb + r.idx[i + j] * r.ks;
  F a[G][KB];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < KB; ++j) a[g][j] = V::zero();
  for (int64_t d0 = 0; d0 < r.d; d0 += 16) {
    F kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = load_kv<V>(kr[j] + d0);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const F qv = V::load(r.q + g * r.qs + d0);
      for (int j = 0; j < KB; ++j) a[g][j] = V::fma(qv, kv[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < KB; ++j) raw[g][j0 + j] = a[g][j];
}

// The scores of keys i0 .. i1 - 1 of the row's list, times scale, into each head's p: 16 keys'
// lane sums at a time, then their 16 lane trees at once (V::trees16: the same additions as
// one tree per key, laid out across registers).
template <class V, class KT, int G>
static void scores_range(const RowAttn& r, int64_t i0, int64_t i1) {
  using F = typename V::F;
  constexpr int KB = V::kScoreAcc / G >= 4 ? 4 : V::kScoreAcc / G >= 1 ? V::kScoreAcc / G : 1;  // keys per chain block
  F raw[G][16];
  const F scale = V::set1(r.scale);
  for (int64_t b = i0; b < i1; b += 16) {
    const int cnt = (int)std::min<int64_t>(16, i1 - b);
    int j = 0;
    for (; j + KB <= cnt; j += KB) lane_sums<V, KT, G, KB>(r, b + j, raw, j);
    for (; j < cnt; ++j) lane_sums<V, KT, G, 1>(r, b + j, raw, j);
    for (int g = 0; g < G; ++g) {
      for (int jj = cnt; jj < 16; ++jj) raw[g][jj] = V::zero();
      V::store_first(r.p + g * r.ps + b, V::mul(V::trees16(raw[g]), scale), cnt);
    }
  }
}

// p = exp(score - max) over the row's n scores, and each head's sum of them.
template <class V, int G>
static void softmax(const RowAttn& r, float* sum) {
  using F = typename V::F;
  const int64_t n = r.n;
  const int64_t n16 = (n + 15) / 16 * 16;
  for (int g = 0; g < G; ++g) {
    float* p = r.p + g * r.ps;
    // the max in 16 lanes, then over the lanes: exact, and NaN skipped as the scalar
    // `p > mx ? p : mx` skips it (MAXPS returns its second operand, the running max, which is
    // never NaN). Only which zero wins a tie of +0 and -0 can differ, and p - mx, hence exp,
    // is the same for either.
    F vmax = V::set1(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) vmax = V::max(V::load(p + i), vmax);
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
}

// The keys i0 .. i1 - 1 of the row's list added into out[d0 .. d0 + 16 NC) of G heads, G * NC
// vectors held in registers; each v vector is loaded once for the G heads. The running sums
// live in out between calls (first: they start at zero; last: they are divided by the sum).
template <class V, class KT, int G, int NC>
static inline void values_chunk(const RowAttn& r, int64_t d0, int64_t i0, int64_t i1, bool first, bool last,
                                const float* sum) {
  using F = typename V::F;
  F acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = first ? V::zero() : V::load(r.out + g * r.os + d0 + 16 * c);
  for (int64_t i = i0; i < i1; ++i) {
    const KT* vr = (const KT*)r.vb + r.idx[i] * r.vs + d0;
    F vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load_kv<V>(vr + 16 * c);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const F pi = V::set1(r.p[g * r.ps + i]);
      for (int c = 0; c < NC; ++c) acc[g][c] = V::fma(pi, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const F s = V::set1(sum[g]);
    for (int c = 0; c < NC; ++c) V::store(r.out + g * r.os + d0 + 16 * c, last ? V::div(acc[g][c], s) : acc[g][c]);
  }
}

template <class V, class KT, int G>
static void values_range(const RowAttn& r, int64_t i0, int64_t i1, bool first, bool last, const float* sum) {
  constexpr int NC = V::kAcc / G > 1 ? V::kAcc / G : 1;
  int64_t d0 = 0;
  for (; d0 + 16 * NC <= r.d; d0 += 16 * NC) values_chunk<V, KT, G, NC>(r, d0, i0, i1, first, last, sum);
  for (; d0 < r.d; d0 += 16) values_chunk<V, KT, G, 1>(r, d0, i0, i1, first, last, sum);
}

// f(std::integral_constant<int, G>()) for G = heads (1 .. V::kMaxG).
template <class V, class Fn>
static inline void with_heads(int heads, Fn&& f) {
  using std::integral_constant;
  switch (heads) {
    case 1: f(integral_constant<int, 1>()); break;
    case 2: f(integral_constant<int, 2>()); break;
    case 3: f(integral_constant<int, 3>()); break;
    case 4: f(integral_constant<int, 4>()); break;
    case 5: if constexpr (V::kMaxG >= 5) f(integral_constant<int, 5>()); break;
    case 6: if constexpr (V::kMaxG >= 6) f(integral_constant<int, 6>()); break;
    case 7: if constexpr (V::kMaxG >= 7) f(integral_constant<int, 7>()); break;
    default: if constexpr (V::kMaxG >= 8) f(integral_constant<int, 8>()); break;
  }
}

// Cache entries per block: the positions of a pass take turns on one block of keys (then of
// values) while it is in the core's first-level cache (64 keys of 128 floats: 32 KB).
constexpr int64_t kKeyBlock = 64;

// The rows of several positions that share one KV head (rows[j]: position j's query heads, its
// own keys idx[0 .. n), n > 0; the same kb, vb, ks, vs and d). Each row is computed exactly as
// alone; the work is ordered by blocks of cache entries, so that each key and value vector is
// read from memory once for all the positions, not once per position (at 2,048 cached tokens a
// KV head's keys and values are 2 MB, more than a core's second-level cache).
template <class V, class KT>
static void attend_rows_typed(const RowAttn* rows, int npos) {
  int64_t at[kMaxPositions], end = 0;  // at[j]: position j's first key not yet done
  float sums[kMaxPositions][kMaxHeads];
  for (int j = 0; j < npos; ++j) end = std::max(end, rows[j].idx[rows[j].n - 1] + 1);
  // for each position j, its keys below `stop` not yet done, i0 .. i1 - 1 of its list: fn(j, i0, i1)
  auto each_run = [&](int64_t stop, auto&& fn) {
    for (int j = 0; j < npos; ++j) {
      const RowAttn& r = rows[j];
      int64_t i1 = at[j];
      while (i1 < r.n && r.idx[i1] < stop) ++i1;
      if (i1 > at[j]) fn(j, at[j], i1);
      at[j] = i1;
    }
  };
  // each head group of a position (V::kMaxG heads at most) as a row of its own
  auto group = [&](const RowAttn& r, int h0) {
    RowAttn part = r;
    part.heads = std::min(V::kMaxG, r.heads - h0);
    part.q = r.q + h0 * r.qs;
    part.p = r.p + h0 * r.ps;
    part.out = r.out + h0 * r.os;
    return part;
  };
  for (int j = 0; j < npos; ++j) at[j] = 0;
  for (int64_t s0 = 0; s0 < end; s0 += kKeyBlock)
    each_run(s0 + kKeyBlock, [&](int j, int64_t i0, int64_t i1) {
      for (int h0 = 0; h0 < rows[j].heads; h0 += V::kMaxG) {
        const RowAttn part = group(rows[j], h0);
        with_heads<V>(part.heads, [&](auto g) { scores_range<V, KT, decltype(g)::value>(part, i0, i1); });
      }
    });
  for (int j = 0; j < npos; ++j)
    for (int h0 = 0; h0 < rows[j].heads; h0 += V::kMaxG) {
      const RowAttn part = group(rows[j], h0);
      with_heads<V>(part.heads, [&](auto g) { softmax<V, decltype(g)::value>(part, sums[j] + h0); });
    }
  for (int j = 0; j < npos; ++j) at[j] = 0;
  for (int64_t s0 = 0; s0 < end; s0 += kKeyBlock)
    each_run(s0 + kKeyBlock, [&](int j, int64_t i0, int64_t i1) {
      for (int h0 = 0; h0 < rows[j].heads; h0 += V::kMaxG) {
        const RowAttn part = group(rows[j], h0);
        with_heads<V>(part.heads, [&](auto g) {
          values_range<V, KT, decltype(g)::value>(part, i0, i1, i0 == 0, i1 == part.n, sums[j] + h0);
        });
      }
    });
}

template <class V>
static void attend_rows_simd(const RowAttn* rows, int npos) {
  if (rows[0].half)
    attend_rows_typed<V, uint16_t>(rows, npos);
  else
    attend_rows_typed<V, float>(rows, npos);
}

}  // namespace verispec
