// The scalar definitions: formats, GGUF block decoding and repacking, gguf-exact
// dequantization, per-row activation quantization, and the reference row loop that every ISA
// path must match bit for bit. Nothing here depends on the CPU.
#include <cmath>
#include <cstring>

#include "qgemm.h"

namespace verispec {

bool format_info(int fmt, FormatInfo* out) {
  switch (fmt) {
    case Q4_K: *out = {256, 32, 144, true, 0, false, true, true}; return true;
    case Q5_K: *out = {256, 32, 176, false, 1, false, true, true}; return true;
    case Q2_K: *out = {256, 16, 84, false, 0, false, true, true, true}; return true;
    case Q6_K: *out = {256, 16, 210, false, 2, false, true, false}; return true;
    case Q3_K: *out = {256, 16, 110, false, 1, false, true, false, true}; return true;
    case IQ4_XS: *out = {256, 32, 136, true, 0, true, true, false}; return true;
    case Q5_0: *out = {32, 32, 22, false, 1, false, false, false}; return true;
    case Q4_0: *out = {32, 32, 18, true, 0, false, false, false}; return true;
    case Q4_1: *out = {32, 32, 20, true, 0, false, false, true}; return true;
    case Q5_1: *out = {32, 32, 24, false, 1, false, false, true}; return true;
    case Q8_0: *out = {32, 32, 34, false, 0, true, false, false}; return true;
    case IQ4_NL: *out = {32, 32, 18, true, 0, true, false, false}; return true;
    default: return false;
  }
}

float fp16_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else {
    bits = sign | (exp + 112) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static uint16_t rd16(const uint8_t* p) { return (uint16_t)(p[0] | p[1] << 8); }

// Q4_K's and Q5_K's 6-bit scales and mins, 8 of each in 12 bytes.
static void k_scale_min(const uint8_t* s, Decoded* out) {
  for (int j = 0; j < 4; ++j) {
    out->sc[j] = s[j] & 63;
    out->mn[j] = s[j + 4] & 63;
    out->sc[j + 4] = (s[j + 8] & 0xf) | (s[j] >> 6) << 4;
    out->mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
  }
}

// 32 nibbles of a 32-wide block (Q4_0, Q4_1, IQ4_NL): weight i in the low nibble of byte i,
// weight 16 + i in its high nibble.
static void block_nibbles(const uint8_t* qs, int32_t* q) {
  for (int i = 0; i < 16; ++i) {
    q[i] = qs[i] & 0xf;
    q[16 + i] = qs[i] >> 4;
  }
}

void decode_block(int fmt, const uint8_t* b, Decoded* out) {
  switch (fmt) {
    case Q4_K:
    case Q5_K: {
      out->d = rd16(b);
      out->dmin = rd16(b + 2);
      k_scale_min(b + 4, out);
      const uint8_t* qs = b + (fmt == Q5_K ? 48 : 16);
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) {
          out->q[64 * c + i] = qs[32 * c + i] & 0xf;
          out->q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
        }
      if (fmt == Q5_K)  // the fifth bit of weight 32 c + i: bit c of qh[i]
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 32; ++i) out->q[32 * c + i] |= ((b[16 + i] >> c) & 1) << 4;
      return;
    }
    case Q2_K: {  // scales[16] (low nibble sc, high nibble mn), qs[64], d, dmin
      for (int j = 0; j < 16; ++j) {
        out->sc[j] = b[j] & 0xf;
        out->mn[j] = b[j] >> 4;
      }
      const uint8_t* qs = b + 16;
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 32; ++i) out->q[128 * h + 32 * s + i] = (qs[32 * h + i] >> (2 * s)) & 3;
      out->d = rd16(b + 80);
      out->dmin = rd16(b + 82);
      return;
    }
    case Q3_K: {  // hmask[32], qs[64], scales[12], d
      const uint8_t* hm = b;
      const uint8_t* qs = b + 32;
      const uint8_t* s = b + 96;
      for (int j = 0; j < 16; ++j) {
        const int low = (s[j % 8] >> (4 * (j / 8))) & 0xf, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        out->sc[j] = (low | high << 4) - 32;
      }
      // w = the 2 low bits | the hmask bit << 2, so that the weight is (w - 4) times the scale
      // (gguf: q = low - 4 where the hmask bit is clear, low where it is set)
      for (int h = 0; h < 2; ++h)
        for (int s2 = 0; s2 < 4; ++s2)
          for (int i = 0; i < 32; ++i) out->q[128 * h + 32 * s2 + i] = (qs[32 * h + i] >> (2 * s2)) & 3;
      for (int c = 0; c < 8; ++c)
        for (int i = 0; i < 32; ++i) out->q[32 * c + i] |= ((hm[i] >> c) & 1) << 2;
      out->d = rd16(b + 108);
      return;
    }
    case IQ4_XS: {  // d, scales_h (u16), scales_l[4], qs[128]
      out->d = rd16(b);
      const uint16_t sh = rd16(b + 2);
      const uint8_t* sl = b + 4;
      for (int j = 0; j < 8; ++j) out->sc[j] = (((sl[j / 2] >> (4 * (j % 2))) & 0xf) | ((sh >> (2 * j)) & 3) << 4) - 32;
      for (int j = 0; j < 8; ++j) block_nibbles(b + 8 + 16 * j, out->q + 32 * j);
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = (const int8_t*)(b + 192);
      out->d = rd16(b + 208);
      for (int j = 0; j < 16; ++j) out->sc[j] = sc[j];
      for (int h = 0; h < 2; ++h) {
        for (int s = 0; s < 2; ++s)
          for (int i = 0; i < 64; ++i) out->q[128 * h + 64 * s + i] = (ql[64 * h + i] >> (4 * s)) & 0xf;
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 32; ++i)
            out->q[128 * h + 32 * s + i] |= ((qh[32 * h + i] >> (2 * s)) & 3) << 4;
      }
      return;
    }
    case Q5_0: {
      out->d = rd16(b);
      const uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
      const uint8_t* qs = b + 6;
      for (int i = 0; i < 16; ++i) {
        out->q[i] = (qs[i] & 0xf) | ((qh >> i) & 1) << 4;
        out->q[16 + i] = (qs[i] >> 4) | ((qh >> (16 + i)) & 1) << 4;
      }
      return;
    }
    case Q5_1: {  // d, m, qh (u32), qs[16]
      out->d = rd16(b);
      out->dmin = rd16(b + 2);
      const uint32_t qh = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
      block_nibbles(b + 8, out->q);
      for (int i = 0; i < 32; ++i) out->q[i] |= ((qh >> i) & 1) << 4;
      return;
    }
    case Q4_0:
    case IQ4_NL:
      out->d = rd16(b);
      block_nibbles(b + 2, out->q);
      return;
    case Q4_1:
      out->d = rd16(b);
      out->dmin = rd16(b + 2);
      block_nibbles(b + 4, out->q);
      return;
    case Q8_0: {
      out->d = rd16(b);
      for (int i = 0; i < 32; ++i) out->q[i] = (int8_t)b[2 + i];
      return;
    }
  }
}

// Layout offsets inside one tile superblock.
static const uint8_t* scales_of(const FormatInfo& f, const uint8_t* tile) { return tile + f.weight_bytes(); }
// The byte of sub k's min, column c, from the scales: mn[nsub][16], or Q2_K's mn[8][16][2] (the two
// subs of an activation block side by side).
static int min_index(const FormatInfo& f, int k, int c) {
  return f.nsub() * kTile + (f.crumbs ? k / 2 * 2 * kTile + 2 * c + k % 2 : k * kTile + c);
}
static const uint16_t* d_of(const FormatInfo& f, const uint8_t* tile) {
  return (const uint16_t*)(tile + f.weight_bytes() + f.scale_bytes());
}

void write_tile(const FormatInfo& f, const Decoded* cols, uint8_t* tile) {
  const int G = f.groups();
  std::memset(tile, 0, (size_t)f.weight_bytes());
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < kTile; ++c)
      for (int j = 0; j < 4; ++j) {
        const uint8_t v = (uint8_t)cols[c].q[4 * g + j];
        if (f.crumbs) {
          tile[g / 4 * 64 + 4 * c + j] |= (uint8_t)((v & 3) << (2 * (g % 4)));
          const int per = f.hbits ? 8 / f.hbits : 1;
          if (f.hbits) tile[G / 4 * 64 + g / per * 64 + 4 * c + j] |= (uint8_t)((v >> 2) << (f.hbits * (g % per)));
        } else if (f.nibbles || f.hbits) {
          tile[g / 2 * 64 + 4 * c + j] |= (uint8_t)((v & 0xf) << (4 * (g % 2)));
          const int per = f.hbits ? 8 / f.hbits : 1;
          if (f.hbits) tile[G / 2 * 64 + g / per * 64 + 4 * c + j] |= (uint8_t)((v >> 4) << (f.hbits * (g % per)));
        } else {
          tile[g * 64 + 4 * c + j] = v;
        }
      }
  uint8_t* s = tile + f.weight_bytes();
  if (f.int_scales) {
    for (int k = 0; k < f.nsub(); ++k)
      for (int c = 0; c < kTile; ++c) {
        s[k * kTile + c] = (uint8_t)cols[c].sc[k];
        if (f.stores_dmin) s[min_index(f, k, c)] = (uint8_t)cols[c].mn[k];
      }
  }
  uint16_t* d = (uint16_t*)(tile + f.weight_bytes() + f.scale_bytes());
  for (int c = 0; c < kTile; ++c) {
    d[c] = cols[c].d;
    if (f.stores_dmin) d[kTile + c] = cols[c].dmin;
  }
}

// gguf's per-sub fp32 scale (dl) and offset (ml) of sub k, column c (see the contract).
static inline float dl_of(const FormatInfo& f, int fmt, const uint8_t* tile, int k, int c) {
  const float d = fp16_to_float(d_of(f, tile)[c]);
  const uint8_t* s = scales_of(f, tile);
  switch (fmt) {
    case Q4_K: case Q5_K: case Q2_K: return d * (float)s[k * kTile + c];
    case Q6_K: case Q3_K: case IQ4_XS: return d * (float)(int8_t)s[k * kTile + c];
    default: return d;
  }
}
static inline float ml_of(const FormatInfo& f, int fmt, const uint8_t* tile, int k, int c) {
  const uint16_t* d = d_of(f, tile);
  switch (fmt) {
    case Q4_K: case Q5_K: case Q2_K:
      return fp16_to_float(d[kTile + c]) * (float)scales_of(f, tile)[min_index(f, k, c)];
    case Q4_1: case Q5_1: return -fp16_to_float(d[kTile + c]);
    default: return 0.0f;
  }
}

static inline int32_t weight_at(const FormatInfo& f, const uint8_t* tile, int k, int c) {
  const int G = f.groups(), g = k / 4, j = k % 4;
  if (f.crumbs) {
    const int32_t low = (tile[(g / 4) * 64 + 4 * c + j] >> (2 * (g % 4))) & 3;
    if (!f.hbits) return low;
    const int per = 8 / f.hbits;
    return low | ((tile[G / 4 * 64 + g / per * 64 + 4 * c + j] >> (f.hbits * (g % per))) & ((1 << f.hbits) - 1)) << 2;
  }
  if (f.nibbles || f.hbits) {
    const uint8_t b = tile[(g / 2) * 64 + 4 * c + j];
    const int32_t low = g % 2 == 0 ? (b & 0xf) : (b >> 4);
    if (!f.hbits) return f.signed_w ? kIq4Values[low] : low;
    const int per = 8 / f.hbits;
    return low | ((tile[G / 2 * 64 + g / per * 64 + 4 * c + j] >> (f.hbits * (g % per))) & ((1 << f.hbits) - 1)) << 4;
  }
  const uint8_t b = tile[g * 64 + 4 * c + j];
  return f.signed_w ? (int32_t)(int8_t)b : (int32_t)b;
}

// The integer scale of sub k, column c: Q2_K's u8, Q3_K's int8.
static inline int32_t int_scale_of(const FormatInfo& f, int fmt, const uint8_t* tile, int k, int c) {
  const uint8_t b = scales_of(f, tile)[k * kTile + c];
  return fmt == Q3_K ? (int32_t)(int8_t)b : (int32_t)b;
}

static void one_superblock_scalar(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s,
                                  float* acc) {
  const int off = int_offset(fmt);
  const bool fp_off = has_fp_offset(fmt);
  const int64_t b0 = s * (f.kb / kActBlock);  // the superblock's first activation block
  for (int64_t m = 0; m < a.m; ++m) {
    for (int c = 0; c < kTile; ++c) {
      float& y = acc[m * kTile + c];
      // the exact int32 sum of sub j: sum w * q - off * bsum_j
      auto isum_of = [&](int j) {
        int32_t isum = 0;
        for (int i = j * f.sub; i < (j + 1) * f.sub; ++i)
          isum += weight_at(f, tile, i, c) * (int32_t)a.qb(b0 + i / kActBlock, m)[i % kActBlock];
        return isum - off * a.bsum(m, s, f.kb, j, f.sub);
      };
      if (int_scaled(fmt)) {  // two subs of 16 per activation block, their scales applied in int32
        const float d = fp16_to_float(d_of(f, tile)[c]);
        for (int b = 0; b < f.kb / kActBlock; ++b) {
          int32_t sum = 0, mins = 0;
          for (int j = 2 * b; j < 2 * b + 2; ++j) {
            sum += int_scale_of(f, fmt, tile, j, c) * isum_of(j);
            if (fp_off) mins += (int32_t)scales_of(f, tile)[min_index(f, j, c)] * a.bsum(m, s, f.kb, j, f.sub);
          }
          const float dxb = a.dx[(b0 + b) * a.mp + m];
          y = std::fmaf(d, (float)sum * dxb, y);
          if (fp_off) y = std::fmaf(-fp16_to_float(d_of(f, tile)[kTile + c]), dxb * (float)mins, y);
        }
        continue;
      }
      for (int j = 0; j < f.nsub(); ++j) {
        const int32_t bsum = a.bsum(m, s, f.kb, j, f.sub);
        const int32_t isum = isum_of(j);
        const float dxj = a.dx[(b0 + j * f.sub / kActBlock) * a.mp + m];
        y = std::fmaf(dl_of(f, fmt, tile, j, c), (float)isum * dxj, y);
        if (fp_off) y = std::fmaf(-ml_of(f, fmt, tile, j, c), dxj * (float)bsum, y);
      }
    }
  }
}

void superblock_scalar(int fmt, const FormatInfo& f, const uint8_t* tile, const QActs& a, int64_t s, int count,
                       float* acc) {
  for (int c = 0; c < count; ++c) one_superblock_scalar(fmt, f, tile + (int64_t)c * f.tile_bytes(), a, s + c, acc);
}

void dequantize_tile(const FormatInfo& f, int fmt, const uint8_t* tile, float* out, int64_t ldo) {
  // gguf's own order of operations per format (gguf.quants.*.dequantize_blocks).
  const uint16_t* d = d_of(f, tile);
  for (int c = 0; c < kTile; ++c) {
    const float dc = fp16_to_float(d[c]);
    for (int k = 0; k < f.kb; ++k) {
      const int32_t w = weight_at(f, tile, k, c);
      const int sub = k / f.sub;
      float v;
      switch (fmt) {
        case Q4_K: case Q5_K: case Q2_K: v = dl_of(f, fmt, tile, sub, c) * (float)w - ml_of(f, fmt, tile, sub, c); break;
        case Q6_K: case Q3_K: v = dl_of(f, fmt, tile, sub, c) * (float)(w - int_offset(fmt)); break;
        case IQ4_XS: v = dl_of(f, fmt, tile, sub, c) * (float)w; break;
        case Q5_0: case Q4_0: v = dc * (float)(w - int_offset(fmt)); break;
        case Q4_1: case Q5_1: v = dc * (float)w + fp16_to_float(d[kTile + c]); break;
        default: v = (float)w * dc; break;  // Q8_0, IQ4_NL
      }
      out[c * ldo + k] = v;
    }
  }
}

float row_rms_inv(const float* x, int64_t k, float eps) { return row_rms_inv_impl(x, k, eps); }

void glu_block(const float* gate, const float* up, float* out) { glu_block_impl(gate, up, out); }

void quantize_block(const float* x, int8_t* q, float* dx, int16_t* bs, float* dxb) {
  quantize_block_impl(x, q, dx, bs, dxb);
}

}  // namespace verispec
