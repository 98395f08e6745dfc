// Attention over the KV cache for a few query rows: the kernel each ISA path provides
// (attention.cpp has the contract, the scalar definition and the torch-facing side).
#pragma once

#include <cstdint>

namespace verispec {

// Query rows of up to kMaxHeads heads that share a KV head and a mask row (grouped-query
// heads at one position), each against the same attended keys idx[0 .. n-1] (n > 0, cache
// order): k row i at kb + idx[i] * ks, v row i at vb + idx[i] * vs, d elements each (d % 16 ==
// 0), float32, or IEEE float16 (uint16_t bits) where half is set, read as their exact floats;
// head j's query at q + j * qs, its output at out + j * os. p holds kMaxHeads rows of ps floats
// of scratch (ps at least n rounded up to 16). Each head's row is computed as if alone: sharing
// the keys only saves their loads.
constexpr int kMaxHeads = 8;
struct RowAttn {
  const float* q;
  int64_t qs;
  int heads;
  const void* kb;
  const void* vb;
  int64_t ks, vs;  // in elements
  const int64_t* idx;
  int64_t n, d;
  float scale;
  float* p;
  int64_t ps;
  float* acc;  // d floats of scratch (the scalar path)
  float* out;
  int64_t os;
  bool half;  // k and v hold float16
};

void attend_row_scalar(const RowAttn& r);

// The rows of npos positions (at most kMaxPositions) that share a KV head: rows[j] is position
// j's query heads against its own keys (n > 0), all with the same kb, vb, ks, vs and d. Each
// row's bits are those of attend_row_scalar on it alone.
constexpr int kMaxPositions = 16;
using AttendRowsFn = void (*)(const RowAttn* rows, int npos);
void attend_rows_scalar(const RowAttn* rows, int npos);
void attend_rows_avx2(const RowAttn* rows, int npos);
void attend_rows_avx512(const RowAttn* rows, int npos);

// The kernel for ISA path isa (ops.cpp's numbering; -1: the default path), checked against
// the CPU: AVX512 and AMX take the AVX512 one, AVX-VNNI and AVX2 the AVX2 one.
AttendRowsFn attend_rows_for(int64_t isa);

}  // namespace verispec
