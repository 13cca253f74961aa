// Q4_0, Q4_K and Q6_K rows repacked at load 8 by 8 (llama.cpp's ggml-cpu/repack.cpp idea, block_q4_0x8 /
// block_q4_Kx8, in a layout of our own): the blocks b of rows 8g .. 8g + 7 are stored together, byte for byte
// as many as the 8 plain blocks, so that one register holds 4 weights of each of the 8 rows and one broadcast
// of 4 activation bytes feeds all 8 rows (maddubs then gives each row's products in its own lanes: no
// horizontal sums, one float fma per 8 rows per 32 weights instead of one per row). Included by blocks.h.
//
// A repacked weight keeps the shape [rows, row_bytes]: group g (rows 8g .. 8g + 7) is the 8 * row_bytes bytes at
// row 8g, holding its blocks b in order (8 * block_bytes each); the rows past the last whole group (rows % 8)
// stay plain, where they were. Layout of one group-block (r: row in the group, j: sub-block of 32, offsets in
// bytes; nibble pair (lo, hi) of a byte: weights of two sub-blocks; "chunk" c: weights 4c .. 4c + 3):
// - Q4_0x8 (144): d[8] fp16 | qs[4 regs of 32]: reg j byte 4r + i = q_r[4j + i] | q_r[16 + 4j + i] << 4.
// - Q8_0x8 (272): d[8] fp16 | qs[8 regs of 32]: reg c byte 4r + i = q_r[4c + i] (int8; blocks_q8_0x8.h).
// - Q4_Kx8 (1152): d[8] | dmin[8] fp16 | scales (48) | mins (48) | qs[32 regs]: reg 8p + c byte 4r + i =
//   q_r[64p + 4c + i] | q_r[64p + 32 + 4c + i] << 4 (sub-blocks 2p, 2p + 1 of ggml's order). The 64 6-bit
//   scales v = 8j + r: bytes 0..31 low nibble = low 4 bits of v[t], high nibble = of v[t + 32]; bytes 32..47:
//   bits 2s, 2s + 1 of byte t = the top 2 bits of v[t + 16 s].
// - Q6_Kx8 (1680): d[8] fp16 | scales int8 (128): per pair of groups of 16 weights (2P, 2P + 1), 16 bytes:
//   2P's rows 0..3, 2P + 1's rows 0..3, 2P's rows 4..7, 2P + 1's rows 4..7 (one cvtepi8_epi16 and an unpack
//   per group give each row's scale in both int16 halves of its lane) | q: group G (chunks 4G .. 4G + 3) in 96
//   bytes at 144 + 96G, 3 registers R_i (i = 0, 1, 2): byte 4r + j = u_r[16G + 4i + j] (chunk 4G + i) | bits
//   4 - 2i, 5 - 2i of u_r[16G + 12 + j] (chunk 4G + 3) << 6: chunks 0..2 are one `and` each, chunk 3 is
//   gathered from the three top bit pairs (u = q + 32 in 0..63, unsigned: maddubs takes it as is; the -32 is
//   subtracted per 16 weights with the activations' sums, BlockQ8::o16).
#pragma once

// The groups of 8 rows and the 8 results of one activation row as one vector.
constexpr int kGroup = 8;

// Each group's blocks are one sequential stream; asking for the bytes this far ahead (a few blocks) while the
// kernel works keeps more misses in flight than the hardware prefetcher alone: batch 1, one thread, a token's
// matrices from memory, CPU time 10-25% lower (measured 1024 / 2048 / 4096 / 8192: 4096 about the best). Only
// on the first pass of activation rows (`first`): later passes over the group find it in the cache.
constexpr int64_t kPrefetchBytes = 4096;
inline void prefetch_ahead(const uint8_t* p, bool first) {  // (a prefetch never faults: past the end too)
  if (first) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
}


inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }

inline int64_t load64(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Q4_Kx8: 48 bytes of packed 6-bit values -> 64 bytes v[0..63].
inline void unpack_scales_x8(const uint8_t* p, uint8_t* out) {
  const __m256i nib = load256(p), f = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  const __m256i h = _mm256_broadcastsi128_si256(load128(p + 32));
  const __m256i h0 = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), three);
  const __m256i h1 = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), three);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_or_si256(_mm256_and_si256(nib, f), _mm256_slli_epi16(h0, 4)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32),
                      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib, 4), f), _mm256_slli_epi16(h1, 4)));
}

// The 8 rows' products with R activation rows m0 .. m0 + R - 1 of x (k columns), over the nb blocks of the
// group at g: out[r] holds row m0 + r's 8 results. Each weight register is unpacked once for the R rows.
template <int32_t K, int R>
inline void group_dot(const uint8_t* g, int64_t nb, const Q8& x, int64_t m0, int64_t k, __m256* out) {
  const __m256i f = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* xq[R];
  const float* dx[R];
  const float* dxs[R];
  const int32_t* o16[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q + (m0 + r) * k, dx[r] = x.dx + (m0 + r) * (k / 32), dxs[r] = x.dxs + (m0 + r) * (k / 32);
    o16[r] = x.o16 ? x.o16 + (m0 + r) * (k / 16) : nullptr;  // (Q6_Kx8 only)
    acc[r] = _mm256_setzero_ps();
  }
  if constexpr (K == Q4_0x8) {  // 8 maddubs per int16 lane: |sum| <= 8 * 2 * 15 * 127 = 30480
    __m256 off[R];
    for (int r = 0; r < R; ++r) off[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = g + b * 144;
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        if (j < 3) prefetch_ahead(p + 64 * j, m0 == 0);  // (144 bytes a block: three lines)
        const __m256i v = load256(p + 16 + 32 * j);
        const __m256i lo = _mm256_and_si256(v, f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), f);
        for (int r = 0; r < R; ++r) {
          s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, bcast4(xq[r] + 32 * b + 4 * j)));
          s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, bcast4(xq[r] + 32 * b + 16 + 4 * j)));
        }
      }
      const __m256 d = half8(p);  // w = d q - 8 d: the -8 d part summed apart (off), subtracted once at the end
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r], ones)),
                                 _mm256_mul_ps(d, _mm256_broadcast_ss(dx[r] + b)), acc[r]);
        off[r] = _mm256_fmadd_ps(d, _mm256_broadcast_ss(dxs[r] + b), off[r]);
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), off[r], acc[r]);
  } else if constexpr (K == Q4_Kx8) {  // w = d sc q - dmin m, activations per 256 (one scale dk per block):
    // per row, in integers, S = sum_j sc_j (q_j . x_j) and Mn = sum_j m_j bsum_j over the 8 sub-blocks j
    // (|S| <= 8 * 63 * 2 * 30480, |Mn| <= 8 * 63 * 4064: exact), then y += d dk S - dmin dk Mn: two float
    // fmas per block and row group instead of ~15 float operations per sub-block.
    // pshufb controls: row r's byte (bytes 0..7 in each 128-bit lane) in both int16 of its int32 lane (its
    // maddubs sums' two int16 lanes), or bytes r and 8 + r (sub-blocks j, j + 1) as the int16 of its lane.
    const __m256i dup = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
                                         4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
    const __m256i pair = _mm256_setr_epi8(0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11, -1,
                                          4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15, -1);
    const int32_t* bs2[R];
    for (int r = 0; r < R; ++r) bs2[r] = x.bs2 + (m0 + r) * (k / 64);
    alignas(32) uint8_t sc[64], mn[64];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = g + b * 1152;
      unpack_scales_x8(p + 32, sc);
      unpack_scales_x8(p + 80, mn);
      __m256i S[R];
      for (int r = 0; r < R; ++r) S[r] = _mm256_setzero_si256();
      for (int q = 0; q < 4; ++q) {
        __m256i s0[R], s1[R];
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          if (8 * q + c < 18) prefetch_ahead(p + 64 * (8 * q + c), m0 == 0);  // (1152 bytes a block: 18 lines)
          const __m256i v = load256(p + 128 + 32 * (8 * q + c));
          const __m256i lo = _mm256_and_si256(v, f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), f);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = xq[r] + 256 * b + 64 * q + 4 * c;
            s0[r] = _mm256_add_epi16(s0[r], _mm256_maddubs_epi16(lo, bcast4(xr)));
            s1[r] = _mm256_add_epi16(s1[r], _mm256_maddubs_epi16(hi, bcast4(xr + 32)));
          }
        }
        const __m256i sc0 = _mm256_shuffle_epi8(_mm256_set1_epi64x(load64(sc + 16 * q)), dup),
                      sc1 = _mm256_shuffle_epi8(_mm256_set1_epi64x(load64(sc + 16 * q + 8)), dup);
        for (int r = 0; r < R; ++r)
          S[r] = _mm256_add_epi32(S[r], _mm256_add_epi32(_mm256_madd_epi16(s0[r], sc0), _mm256_madd_epi16(s1[r], sc1)));
      }
      __m256i Mn[R];
      for (int pp = 0; pp < 4; ++pp) {  // sub-blocks 2pp, 2pp + 1
        const __m256i m2 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(load128(mn + 16 * pp)), pair);
        for (int r = 0; r < R; ++r) {
          const __m256i v = _mm256_madd_epi16(m2, _mm256_set1_epi32(bs2[r][4 * b + pp]));
          Mn[r] = pp ? _mm256_add_epi32(Mn[r], v) : v;
        }
      }
      const __m256 d = half8(p), dmin = half8(p + 16);
      for (int r = 0; r < R; ++r) {
        const __m256 dk = _mm256_broadcast_ss(dx[r] + 8 * b);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[r]), _mm256_mul_ps(d, dk), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(Mn[r]), _mm256_mul_ps(dmin, dk), acc[r]);
      }
    }
  } else {  // Q6_Kx8, per group G of 16 weights (4 chunks, one int8 scale per row): its 4 registers of u from 3
            // stored ones; the lanes' int16 sums wrap but their true values, sum (u - 32) x over 8 products, fit:
            // |.| <= 8 * 32 * 127 = 32512. Then each row's scale in integers (madd: |.| <= 2 * 32512 * 128 per
            // group), summed over the block's 16 groups (< 2^28: int32; activations per 256, one scale dk), one
            // float fma per block and row group.
    const __m256i m3f = _mm256_set1_epi8(0x3F), mc0 = _mm256_set1_epi8(static_cast<char>(0xC0));
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = g + b * 1680;
      __m256i i32[R];
      for (int pr = 0; pr < 8; ++pr) {  // groups 2 pr, 2 pr + 1
        const __m256i s16 = _mm256_cvtepi8_epi16(load128(p + 16 + 16 * pr));
        const __m256i sc[2] = {_mm256_unpacklo_epi16(s16, s16), _mm256_unpackhi_epi16(s16, s16)};  // (s_r, s_r)
        for (int e = 0; e < 2; ++e) {
          const int G = 2 * pr + e;
          const uint8_t* q = p + 144 + 96 * G;
          prefetch_ahead(p + 128 * G, m0 == 0);  // (1680 bytes a block: 27 lines, two asked per group)
          prefetch_ahead(p + 128 * G + 64, m0 == 0);
          const __m256i r0 = load256(q), r1 = load256(q + 32), r2 = load256(q + 64);
          const __m256i u0 = _mm256_and_si256(r0, m3f), u1 = _mm256_and_si256(r1, m3f),
                        u2 = _mm256_and_si256(r2, m3f);
          const __m256i t = _mm256_or_si256(  // chunk 3's u << 2 (its low 2 bits 0: nothing crosses bytes below)
              _mm256_and_si256(r0, mc0), _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(r1, mc0), 2),
                                                          _mm256_srli_epi16(_mm256_and_si256(r2, mc0), 4)));
          const __m256i u3 = _mm256_srli_epi16(t, 2);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = xq[r] + 256 * b + 16 * G;
            const __m256i s = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast4(xr)), _mm256_maddubs_epi16(u1, bcast4(xr + 4))),
                _mm256_add_epi16(_mm256_maddubs_epi16(u2, bcast4(xr + 8)), _mm256_maddubs_epi16(u3, bcast4(xr + 12))));
            const __m256i v = _mm256_madd_epi16(_mm256_sub_epi16(s, _mm256_set1_epi32(o16[r][16 * b + G])), sc[e]);
            i32[r] = G ? _mm256_add_epi32(i32[r], v) : v;
          }
        }
      }
      const __m256 d = half8(p);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r]), _mm256_mul_ps(d, _mm256_broadcast_ss(dx[r] + 8 * b)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#include "blocks_q8_0x8.h"  // (Q8_0x8: its layout and kernel)

// y[m, n] for rows [n0, n1) of a repacked part of `rows` rows (starting at row0) and all M activation rows.
// Every group that meets [n0, n1) is computed whole, and only its rows in range are written (a group cut by a
// split is computed by both threads: the same bits, each writes its own rows); the plain tail as before.
// Activation rows go 4 at a time (each weight register unpacked once for the 4), every row's sums in the same
// order whatever M: a row's results do not depend on the others.
template <int32_t K>
void gemm_x8_k(const uint8_t* w, int64_t row0, int64_t rows, int64_t k, const Q8& x, int64_t M, int64_t n0,
               int64_t n1, const BlockOut& out) {
  constexpr int32_t P = K - 100;
  const int64_t nb = k / block_weights(P), rb = row_bytes(P, k), groups = rows / kGroup;
  const int64_t a = n0 - row0, e = n1 - row0;
  __m256 v[4];
  alignas(32) float vals[kGroup];
  for (int64_t g = a / kGroup; g < std::min(groups, (e + kGroup - 1) / kGroup); ++g) {
    const uint8_t* gp = w + g * kGroup * rb;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t R = std::min<int64_t>(4, M - m0);
      switch (R) {
        case 4: group_dot<K, 4>(gp, nb, x, m0, k, v); break;
        case 3: group_dot<K, 3>(gp, nb, x, m0, k, v); break;
        case 2: group_dot<K, 2>(gp, nb, x, m0, k, v); break;
        default: group_dot<K, 1>(gp, nb, x, m0, k, v); break;
      }
      for (int64_t r = 0; r < R; ++r) {
        _mm256_store_ps(vals, v[r]);
        for (int i = 0; i < kGroup; ++i) {
          const int64_t n = g * kGroup + i;
          if (n >= a && n < e) put(out, m0 + r, row0 + n, vals[i]);
        }
      }
    }
  }
  const int64_t t0 = std::max(a, groups * kGroup);
  if (t0 < e) gemm_blocks_k<P>(w, row0, k, x, M, row0 + t0, n1, out);  // the plain rows past the groups
}

// Row r of a repacked group-block (at p) unpacked as unpack<plain kind> unpacks its plain block.
template <int32_t K>
inline void unpack_x8(const uint8_t* p, int r, Unpacked& u) {
  alignas(32) uint8_t t[32];
  if constexpr (K == Q4_0x8) {
    for (int j = 0; j < 4; ++j) std::memcpy(t + 4 * j, p + 16 + 32 * j + 4 * r, 4);
    u.n = 1, u.is_signed = false;
    const float d = half(p + 2 * r);
    set_sub(u, 0, nibbles16(t), d, -8.f * d);
  } else if constexpr (K == Q4_Kx8) {
    alignas(32) uint8_t sc[64], mn[64];
    unpack_scales_x8(p + 32, sc);
    unpack_scales_x8(p + 80, mn);
    uint8_t s8[16];
    for (int j = 0; j < 8; ++j) s8[j] = sc[8 * j + r], s8[8 + j] = mn[8 * j + r];
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s8));
    u.n = 8, u.is_signed = false;
    u.av = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(half(p + 2 * r)));
    u.bv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))),
                         _mm256_set1_ps(-half(p + 16 + 2 * r)));
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int q = 0; q < 4; ++q) {
      for (int c = 0; c < 8; ++c) std::memcpy(t + 4 * c, p + 128 + 32 * (8 * q + c) + 4 * r, 4);
      const __m256i w = load256(t);
      u.q[2 * q] = _mm256_and_si256(w, low);
      u.q[2 * q + 1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    }
  } else {  // Q6_Kx8
    int8_t s16[16];
    for (int G = 0; G < 16; ++G) s16[G] = static_cast<int8_t>(p[16 + 16 * (G / 2) + 8 * (r / 4) + 4 * (G % 2) + r % 4]);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16));
    const __m256 d = _mm256_set1_ps(half(p + 2 * r));
    u.n = 8, u.is_signed = true;
    u.av = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
    u.bv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
    for (int j = 0; j < 8; ++j) {
      for (int c = 0; c < 8; ++c) {
        const int G = (8 * j + c) / 4, i = c % 4;
        const uint8_t* q = p + 144 + 96 * G + 4 * r;
        for (int k = 0; k < 4; ++k) {
          const int val = i < 3 ? q[32 * i + k] & 0x3F
                                : ((q[k] >> 6) << 4) | ((q[32 + k] >> 6) << 2) | (q[64 + k] >> 6);
          t[4 * c + k] = static_cast<uint8_t>(val - 32);
        }
      }
      u.q[j] = load256(t);
    }
  }
}

// Row `row` of a matrix of `rows` rows of kind `kind` (plain or repacked) as float32 (k values).
template <int32_t K>
inline void x8_row_to_float(const uint8_t* w, int64_t row, int64_t k, float* out) {
  constexpr int32_t P = K - 100;
  const int64_t qk = block_weights(P), rb = row_bytes(P, k), gb = kGroup * block_bytes(P);
  const uint8_t* g = w + (row / kGroup) * kGroup * rb;
  Unpacked u;
  for (int64_t b = 0; b < k / qk; ++b) {
    if constexpr (K == Q8_0x8) unpack_q8_0x8(g + b * gb, static_cast<int>(row % kGroup), u);
    else unpack_x8<K>(g + b * gb, static_cast<int>(row % kGroup), u);
    block_to_float<P>(u, out + b * qk);
  }
}

inline void matrix_row_to_float(int32_t kind, const uint8_t* w, int64_t row, int64_t rows, int64_t k, float* out) {
  const int32_t p = plain_kind(kind);
  if (!is_x8(kind) || row >= rows / kGroup * kGroup) return row_to_float(p, w + row * row_bytes(p, k), k, out);
  switch (kind) {
    case Q4_0x8: x8_row_to_float<Q4_0x8>(w, row, k, out); break;
    case Q8_0x8: x8_row_to_float<Q8_0x8>(w, row, k, out); break;
    case Q4_Kx8: x8_row_to_float<Q4_Kx8>(w, row, k, out); break;
    default: x8_row_to_float<Q6_Kx8>(w, row, k, out); break;
  }
}
