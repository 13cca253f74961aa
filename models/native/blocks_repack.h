// Plain rows of Q4_0, Q8_0, Q4_K and Q6_K (ggml's blocks) -> their repacked layout (blocks_x8.h,
// blocks_q8_0x8.h), group by group: each row's block is decoded into its plain values (4-, 6- or 8-bit
// integers, scales as stored) and written where the repacked layout keeps them. Scalar: it runs once per weight
// at load. Included by blocks.cpp.
#pragma once

#include <cstdint>
#include <cstring>

#include "blocks.h"

namespace blocks {

// One row's block as values: q (Q4_0 / Q4_K: the file's qs bytes, nibble pairs; Q8_0: its int8 weights; Q6_K:
// the values 0..63 in ggml's order), the 6-bit scales / mins of Q4_K, the int8 scales of Q6_K, the fp16 bytes
// of d (and dmin).
struct PlainBlock {
  uint8_t q[256];
  uint8_t sc[16], mn[8];
  uint8_t d[2], dmin[2];
};

inline void decode_plain(int32_t kind, const uint8_t* p, PlainBlock& o) {
  if (kind == Q4_0) {  // (q: the qs bytes as they are, nibble pairs)
    std::memcpy(o.d, p, 2);
    std::memcpy(o.q, p + 2, 16);
  } else if (kind == Q8_0) {  // (q: the 32 int8 weights as bytes)
    std::memcpy(o.d, p, 2);
    std::memcpy(o.q, p + 2, 32);
  } else if (kind == Q4_K) {  // (q: the qs bytes as they are)
    std::memcpy(o.d, p, 2);
    std::memcpy(o.dmin, p + 2, 2);
    const uint8_t* s = p + 4;  // ggml's get_scale_min_k4
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        o.sc[j] = s[j] & 63, o.mn[j] = s[j + 4] & 63;
      } else {
        o.sc[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        o.mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      }
    }
    std::memcpy(o.q, p + 16, 128);
  } else {  // Q6_K: ql[128], qh[64], scales[16], d (ggml's dequantize_row_q6_K's order)
    std::memcpy(o.d, p + 208, 2);
    std::memcpy(o.sc, p + 192, 16);
    for (int n = 0; n < 2; ++n) {
      const uint8_t* ql = p + 64 * n;
      const uint8_t* qh = p + 128 + 32 * n;
      uint8_t* q = o.q + 128 * n;
      for (int l = 0; l < 32; ++l) {
        q[l] = static_cast<uint8_t>((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
        q[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
        q[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
        q[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
      }
    }
  }
}

// Q4_Kx8's packing of 64 6-bit values v (blocks_x8.h) into 48 bytes.
inline void pack_scales_x8(const uint8_t* v, uint8_t* out) {
  for (int t = 0; t < 32; ++t) out[t] = static_cast<uint8_t>((v[t] & 0x0F) | ((v[t + 32] & 0x0F) << 4));
  for (int t = 0; t < 16; ++t) {
    uint8_t b = 0;
    for (int s = 0; s < 4; ++s) b |= static_cast<uint8_t>(((v[t + 16 * s] >> 4) & 3) << (2 * s));
    out[32 + t] = b;
  }
}

// The 8 rows' blocks b (o[r]) as one group-block of kind `kind` (plain) at out.
inline void encode_x8(int32_t kind, const PlainBlock* o, uint8_t* out) {
  for (int r = 0; r < 8; ++r) std::memcpy(out + 2 * r, o[r].d, 2);
  if (kind == Q4_0) {  // byte 4j + i of qs holds weights 4j + i and 16 + 4j + i: the bytes move 4 at a time
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < 8; ++r) std::memcpy(out + 16 + 32 * j + 4 * r, o[r].q + 4 * j, 4);
  } else if (kind == Q8_0) {  // (blocks_q8_0x8.h) byte 4r + i of register c: weight 4c + i of row r
    for (int c = 0; c < 8; ++c)
      for (int r = 0; r < 8; ++r) std::memcpy(out + 16 + 32 * c + 4 * r, o[r].q + 4 * c, 4);
  } else if (kind == Q4_K) {
    uint8_t sc[64], mn[64];
    for (int r = 0; r < 8; ++r) {
      std::memcpy(out + 16 + 2 * r, o[r].dmin, 2);
      for (int j = 0; j < 8; ++j) sc[8 * j + r] = o[r].sc[j], mn[8 * j + r] = o[r].mn[j];
    }
    pack_scales_x8(sc, out + 32);
    pack_scales_x8(mn, out + 80);
    for (int pp = 0; pp < 4; ++pp)  // qs byte 32 pp + l: weights 64 pp + l and 64 pp + 32 + l
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < 8; ++r) std::memcpy(out + 128 + 32 * (8 * pp + c) + 4 * r, o[r].q + 32 * pp + 4 * c, 4);
  } else {  // Q6_K
    for (int G = 0; G < 16; ++G)
      for (int r = 0; r < 8; ++r) out[16 + 16 * (G / 2) + 8 * (r / 4) + 4 * (G % 2) + r % 4] = o[r].sc[G];
    for (int G = 0; G < 16; ++G)
      for (int i = 0; i < 3; ++i)
        for (int r = 0; r < 8; ++r)
          for (int j = 0; j < 4; ++j) {
            const uint8_t* u = o[r].q + 16 * G;
            out[144 + 96 * G + 32 * i + 4 * r + j] =
                static_cast<uint8_t>((u[4 * i + j] & 0x3F) | (((u[12 + j] >> (4 - 2 * i)) & 3) << 6));
          }
  }
}

// rows [g0, g1) groups of a [rows, row_bytes] matrix of plain `kind` blocks (src) into dst (the same shape):
// whole groups repacked, the rows past them copied as they are (by the call whose range holds the last group).
inline void repack_groups(int32_t kind, const uint8_t* src, int64_t rows, int64_t k, uint8_t* dst, int64_t g0,
                          int64_t g1) {
  const int64_t rb = row_bytes(kind, k), bb = block_bytes(kind), nb = k / block_weights(kind);
  PlainBlock o[8];
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < 8; ++r) decode_plain(kind, src + (8 * g + r) * rb + b * bb, o[r]);
      encode_x8(kind, o, dst + 8 * g * rb + b * 8 * bb);
    }
  }
  if (g1 == rows / 8) std::memcpy(dst + g1 * 8 * rb, src + g1 * 8 * rb, (rows - g1 * 8) * rb);
}

}  // namespace blocks
