// AVX-VNNI path (CPUs with AVX2 and the 256-bit vpdpbusd, the avx_vnni flag, whether or not they
// have AVX512): the 256-bit kernel body of ymm_kernel.h with one vpdpbusd per row and group where
// AVX2 needs maddubs, madd and add. The same int32 sums (see ymm_kernel.h), so the same bits as
// every other path. A layer's input steps stay the AVX2 ones (avx2.cpp).
#pragma GCC target("avx2,fma,f16c,avxvnni")
#include <immintrin.h>

namespace verispec {
constexpr bool kInt16Sums = false;  // see int16_chunk in ymm_kernel.h
static inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
}  // namespace verispec

#include "ymm_kernel.h"

namespace verispec {

void superblock_avxvnni(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count,
                        float* acc) {
  superblock_ymm(fmt, f, tile, a, s, count, acc);
}

}  // namespace verispec
