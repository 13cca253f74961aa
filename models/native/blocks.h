// llama.cpp's block formats (ggml's block_q4_0 ... block_q6_K, bit for bit as in a GGUF file) computed on in
// place: a row of a weight is columns / QK blocks, read once per step. Included by gemm.h (the decode step's
// linear layers) and blocks.cpp (the ops block_linear / block_dequant of the PyTorch forward).
//
// Activations are quantized as llama.cpp does for these formats, one int8 per value with one float32 scale per
// block of the format's size (dx = absmax / 127): per 32 values for the formats of 32 (llama.cpp's q8_0), per
// 256 for the K-quants (its q8_K: the 8 sub-blocks of a weight block share the activations' scale, so the kernels
// sum their products in integers and multiply by floats once per 256 weights), plus each block of 32's sum of the
// int8 values times dx (for the formats with a minimum, whose dot product is a * (q . xq) + b * sum(xq)). Every weight format is unpacked, per 32
// weights, into 32 int8 values q (already offset for the signed formats) with a scale for each half (Q6_K scales
// 16 weights at a time; the others use one scale for both halves) and an offset b, so that w = scale * q + b:
// the products q . xq are exact integer sums (u8 x s8 pairs: maddubs), then one float fma per 32 weights.
// Row results do not depend on the other rows of the call (each activation row is quantized on its own).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// One activation row (or M rows, row-major) quantized for the block formats: q [K] int8, dx [K / 32] the
// scale of each block of 32 (quantized per 256: the same for each 8), dxs [K / 32] = dx * the block's sum of q,
// o16 [K / 16]: per 16 values, two int16 32 * (q[4c] + q[4c + 1]) and 32 * (q[4c + 2] + q[4c + 3]) summed over its
// 4 chunks c of 4 (Q6_Kx8's offset, blocks_x8.h; null: not made), bs2 [K / 64] (quantized per 256 only): the int
// sums of q of the blocks of 32 2p and 2p + 1 as the low and high int16 of bs2[p] (Q4_Kx8's minimums).
struct BlockQ8 {
  int8_t* q;
  float* dx;
  float* dxs;
  int32_t* o16;
  int32_t* bs2;
};

// Where a product's results go: y[m * ldy + n] = v * scale[n] + bias[n] (each if set), or += with accumulate.
struct BlockOut {
  float* y;
  int64_t ldy;
  const float* scale;
  const float* bias;
  bool accumulate;
};  // (no member functions: the AVX-512 build's copy of one, an inline function of this global type, could be
    // the one the linker keeps for both builds)

// The AVX-512 VNNI build of these kernels (blocks_vnni.cpp: the same code, one instruction per sub-block's
// integer products) and which one runs: tandem_block_isa 1 where the CPU has it, else 0 (the AVX2 code).
extern int tandem_block_isa;
void tandem_vnni_gemm_blocks(int32_t kind, const uint8_t* w, int64_t row0, int64_t rows, int64_t k, const BlockQ8& x,
                             int64_t M, int64_t n0, int64_t n1, const BlockOut& out);

#ifndef TANDEM_BLOCKS_NS
#define TANDEM_BLOCKS_NS blocks
#endif

namespace TANDEM_BLOCKS_NS {

// The TdLinear kinds of the formats: 100 + ggml's type id (models/quant/block_formats.py).
// 200 + ggml's type id: the same format's rows repacked 8 by 8 (blocks_x8.h).
enum Kind : int32_t { Q4_0 = 102, Q4_1 = 103, Q5_0 = 106, Q5_1 = 107, Q8_0 = 108, Q4_K = 112, Q5_K = 113, Q6_K = 114,
                      Q4_0x8 = 202, Q8_0x8 = 208, Q4_Kx8 = 212, Q6_Kx8 = 214 };

inline bool is_x8(int32_t kind) { return kind == Q4_0x8 || kind == Q8_0x8 || kind == Q4_Kx8 || kind == Q6_Kx8; }
inline int32_t plain_kind(int32_t kind) { return is_x8(kind) ? kind - 100 : kind; }

inline bool is_block_kind(int32_t kind) {
  switch (plain_kind(kind)) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K: return true;
    default: return false;
  }
}
inline int64_t block_weights(int32_t kind) { return plain_kind(kind) >= Q4_K ? 256 : 32; }
inline int64_t block_bytes(int32_t kind) {
  switch (plain_kind(kind)) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210;  // Q6_K
  }
}
inline int64_t row_bytes(int32_t kind, int64_t k) { return k / block_weights(kind) * block_bytes(kind); }

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

using Q8 = BlockQ8;

inline void put(const BlockOut& o, int64_t m, int64_t n, float v) {
  if (o.scale) v *= o.scale[n];
  if (o.bias) v += o.bias[n];
  float* p = o.y + m * o.ldy + n;
  *p = o.accumulate ? *p + v : v;
}

inline float absmax(const float* src, int n) {
  __m256 mx = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// Block `blk` of 32 values (at x + 32 blk) quantized with scale d = amax / 127 into out: q, dx, dxs, o16.
// Returns the int sum of its q.
inline int32_t quantize_block32(const float* x, const Q8& out, int64_t blk, float amax) {
  const float* src = x + blk * 32;
  const float d = amax / 127.f, inv = d > 0.f ? 127.f / amax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i r[4];
  for (int i = 0; i < 4; ++i)  // round to nearest even, as nearbyint: |.| <= 127
    r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * i), vinv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  s4 = _mm_hadd_epi32(s4, s4);
  // int32 -> int8 in order: packs work per 128-bit lane, the permute puts the lanes back in order
  const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  const __m256i p8 = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q + blk * 32), p8);
  const int32_t sum = _mm_cvtsi128_si32(s4);
  out.dx[blk] = d;
  out.dxs[blk] = d * static_cast<float>(sum);
  if (out.o16) {
    const int8_t* q = out.q + blk * 32;
    for (int h = 0; h < 2; ++h) {
      int32_t even = 0, odd = 0;
      for (int c = 0; c < 4; ++c) {
        even += q[16 * h + 4 * c] + q[16 * h + 4 * c + 1];
        odd += q[16 * h + 4 * c + 2] + q[16 * h + 4 * c + 3];
      }  // |32 * sum of 8| <= 32512: int16
      out.o16[2 * blk + h] = static_cast<int32_t>(static_cast<uint16_t>(32 * even) |
                                                  (static_cast<uint32_t>(static_cast<uint16_t>(32 * odd)) << 16));
    }
  }
  return sum;
}

// Rows of x [M, K] (K % 32 == 0) quantized into out per block of 32, blocks [b0, b1) of the M * K / 32
// (contiguous over rows).
inline void quantize_q8(const float* x, const Q8& out, int64_t b0, int64_t b1) {
  for (int64_t blk = b0; blk < b1; ++blk) quantize_block32(x, out, blk, absmax(x + blk * 32, 32));
}

// The same per block of 256 (K % 256 == 0; the K-quants' activations), blocks [c0, c1) of the M * K / 256, with
// bs2 (|a block of 32's sum| <= 32 * 127: int16).
inline void quantize_q8_256(const float* x, const Q8& out, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    const float amax = absmax(x + c * 256, 256);
    int32_t sums[8];
    for (int j = 0; j < 8; ++j) sums[j] = quantize_block32(x, out, 8 * c + j, amax);
    for (int p = 0; p < 4; ++p)
      out.bs2[4 * c + p] = static_cast<int32_t>(static_cast<uint16_t>(sums[2 * p]) |
                                                (static_cast<uint32_t>(static_cast<uint16_t>(sums[2 * p + 1])) << 16));
  }
}

// Whether a kind's activations are quantized per 256 (quantize_q8_256) rather than per 32.
inline bool per_256(int32_t kind) { return block_weights(kind) == 256; }

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// 16 bytes of nibbles -> 32 values: the low nibbles (weights 0..15), then the high ones (16..31).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i t = load128(p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

// 32 bits (weight i's in bit i) -> 0x10 in the bytes whose bit is set (llama.cpp's bytes_from_bits_32).
inline __m256i high_bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                  _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// One block unpacked: n sub-blocks of 32 weights, w = a[j][half] * q[j] + b[j].
struct Unpacked {
  __m256i q[8];
  float a[8][2];
  float b[8];
  __m256 av, bv;  // Q4_K / Q5_K: a and b of the 8 sub-blocks as vectors; Q6_K: its 16 scales (a[], b[] unset)
  int n;
  bool is_signed;  // q may be negative (signed formats); else 0 <= q < 128
};

// Q4_K / Q5_K: the 8 6-bit scales and 8 6-bit minimums of a block (12 bytes) as two vectors of floats
// (llama.cpp's unpacking of the 32-bit words: bytes 0-7 the scales, 8-15 the minimums).
inline void scales_mins_k4(const uint8_t* p, __m256& sc, __m256& mn) {
  uint32_t u[4];
  std::memcpy(u, p, 12);
  constexpr uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t aux = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = aux;
  u[0] &= m1;
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}

inline void set_sub(Unpacked& u, int j, __m256i q, float a, float b) {
  u.q[j] = q;
  u.a[j][0] = u.a[j][1] = a;
  u.b[j] = b;
}

template <int32_t K>
inline void unpack(const uint8_t* blk, Unpacked& u) {
  if constexpr (K == Q8_0) {
    u.n = 1, u.is_signed = true;
    set_sub(u, 0, load256(blk + 2), half(blk), 0.f);
  } else if constexpr (K == Q4_0) {
    // w = d (q - 8) as d q + (-8 d): q unsigned, so the products need no sign trick (two fewer instructions per
    // block; the offset's part comes from the activations' block sums, and fma(q, d, -8 d) rounds d (q - 8) once)
    u.n = 1, u.is_signed = false;
    const float d = half(blk);
    set_sub(u, 0, nibbles16(blk + 2), d, -8.f * d);
  } else if constexpr (K == Q4_1) {
    u.n = 1, u.is_signed = false;
    set_sub(u, 0, nibbles16(blk + 4), half(blk), half(blk + 2));
  } else if constexpr (K == Q5_0) {
    u.n = 1, u.is_signed = false;  // (as Q4_0: d (q - 16) as d q + (-16 d))
    const float d = half(blk);
    set_sub(u, 0, _mm256_or_si256(nibbles16(blk + 6), high_bits32(blk + 2)), d, -16.f * d);
  } else if constexpr (K == Q5_1) {
    u.n = 1, u.is_signed = false;
    set_sub(u, 0, _mm256_or_si256(nibbles16(blk + 8), high_bits32(blk + 4)), half(blk), half(blk + 2));
  } else if constexpr (K == Q4_K || K == Q5_K) {
    // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]: sub-block 2i is the low nibbles of qs[32 i .. 32 i + 32),
    // 2i + 1 their high nibbles; Q5_K's fifth bit of sub-block j is bit j of qh[l].
    u.n = 8, u.is_signed = false;
    __m256 sc, mn;
    scales_mins_k4(blk + 4, sc, mn);
    u.av = _mm256_mul_ps(sc, _mm256_set1_ps(half(blk)));
    u.bv = _mm256_mul_ps(mn, _mm256_set1_ps(-half(blk + 2)));
    const uint8_t* qs = blk + (K == Q4_K ? 16 : 48);
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (K == Q5_K) qh = load256(blk + 16);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load256(qs + 32 * i);
      __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if constexpr (K == Q5_K) {
        const __m256i one = _mm256_set1_epi8(1);
        const __m128i s0 = _mm_cvtsi32_si128(2 * i), s1 = _mm_cvtsi32_si128(2 * i + 1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, s0), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, s1), one), 4));
      }
      u.q[2 * i] = lo;
      u.q[2 * i + 1] = hi;
    }
  } else {  // Q6_K: ql[128], qh[64], scales[16] (int8), d; 16 weights per scale
    u.n = 8, u.is_signed = true;
    const __m256 d = _mm256_set1_ps(half(blk + 208));
    const __m128i sc = load128(blk + 192);  // scale 2j: sub-block j's weights 0..15, 2j + 1: 16..31
    u.av = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
    u.bv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; ++n) {
      const __m256i a = load256(blk + 64 * n), b = load256(blk + 64 * n + 32), h = load256(blk + 128 + 32 * n);
      const __m256i l4[4] = {_mm256_and_si256(a, low), _mm256_and_si256(b, low),
                             _mm256_and_si256(_mm256_srli_epi16(a, 4), low),
                             _mm256_and_si256(_mm256_srli_epi16(b, 4), low)};
      for (int g = 0; g < 4; ++g) {
        const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * g)), two);
        u.q[4 * n + g] = _mm256_sub_epi8(_mm256_or_si256(l4[g], _mm256_slli_epi16(h2, 4)), off);
      }
    }
  }
}

// What a format's blocks are, at compile time: sub-blocks of 32 per block, whether q may be negative (else
// 0 <= q < 128 and maddubs takes it as is), whether w has an offset b (a minimum), whether the two halves of a
// sub-block share one scale (all but Q6_K).
template <int32_t K>
struct Traits {
  static constexpr int kSubs = K >= Q4_K ? 8 : 1;
  static constexpr bool kSigned = K == Q8_0 || K == Q6_K;
  static constexpr bool kOffset = K == Q4_0 || K == Q5_0 || K == Q4_1 || K == Q5_1 || K == Q4_K || K == Q5_K;
  static constexpr bool kOneScale = K != Q6_K;
};

// q . xq of one sub-block as 8 int32 lanes (lanes 0-3: weights 0..15, lanes 4-7: 16..31), exact.
template <bool kSigned>
inline __m256i sub_dot(__m256i q, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
#ifdef TANDEM_BLOCKS_VNNI  // u8 x s8, four products summed into each int32 lane: maddubs and madd in one
  const __m256i zero = _mm256_setzero_si256();
  return kSigned ? _mm256_dpbusd_epi32(zero, _mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q))
                 : _mm256_dpbusd_epi32(zero, q, x);
#else
  const __m256i p = kSigned ? _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q))
                            : _mm256_maddubs_epi16(q, x);
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

// acc += the block's products with activation blocks xq / dx / dxs (its first sub-block's), per lane; the
// offsets' part (b * dx * sum(xq)) is added to `off`.
template <int32_t K>
inline __m256 block_dot(const Unpacked& u, const int8_t* xq, const float* dx, const float* dxs, __m256 acc,
                        float& off) {
  using T = Traits<K>;
  if constexpr (K == Q4_K || K == Q5_K) {  // a_j dx_j for every j at once; the offsets straight into acc's lanes
    const __m256 adx = _mm256_mul_ps(u.av, _mm256_loadu_ps(dx));
    for (int j = 0; j < 8; ++j) {
      const __m256 s = _mm256_cvtepi32_ps(sub_dot<false>(u.q[j], xq + 32 * j));
      acc = _mm256_fmadd_ps(s, _mm256_permutevar8x32_ps(adx, _mm256_set1_epi32(j)), acc);
    }
    return _mm256_fmadd_ps(u.bv, _mm256_loadu_ps(dxs), acc);
  }
  if constexpr (K == Q6_K) {  // sub-block j: scales 2j, 2j + 1 (of av: 0..7, bv: 8..15) on its halves, times dx_j
    const __m256 dxv = _mm256_loadu_ps(dx);
    for (int j = 0; j < 8; ++j) {
      const int h = 2 * (j % 4);
      const __m256 sc = _mm256_permutevar8x32_ps(j < 4 ? u.av : u.bv, _mm256_setr_epi32(h, h, h, h, h + 1, h + 1, h + 1, h + 1));
      const __m256 s = _mm256_cvtepi32_ps(sub_dot<true>(u.q[j], xq + 32 * j));
      acc = _mm256_fmadd_ps(s, _mm256_mul_ps(sc, _mm256_permutevar8x32_ps(dxv, _mm256_set1_epi32(j))), acc);
    }
    return acc;
  }
  for (int j = 0; j < T::kSubs; ++j) {
    const __m256 s = _mm256_cvtepi32_ps(sub_dot<T::kSigned>(u.q[j], xq + 32 * j));
    if constexpr (T::kOneScale) {
      acc = _mm256_fmadd_ps(s, _mm256_set1_ps(u.a[j][0] * dx[j]), acc);
    } else {
      acc = _mm256_fmadd_ps(s, _mm256_set_m128(_mm_set1_ps(u.a[j][1] * dx[j]), _mm_set1_ps(u.a[j][0] * dx[j])), acc);
    }
    if constexpr (T::kOffset) off += u.b[j] * dxs[j];
  }
  return acc;
}

// The block's weights as float32 (out: n * 32 values).
template <int32_t K>
inline void block_to_float(Unpacked& u, float* out) {
  if constexpr (K == Q4_K || K == Q5_K) {  // a[] and b[] from the vectors
    alignas(32) float a[8], b[8];
    _mm256_store_ps(a, u.av);
    _mm256_store_ps(b, u.bv);
    for (int j = 0; j < 8; ++j) u.a[j][0] = u.a[j][1] = a[j], u.b[j] = b[j];
  }
  if constexpr (K == Q6_K) {  // the 16 scales from the vectors
    alignas(32) float a[16];
    _mm256_store_ps(a, u.av);
    _mm256_store_ps(a + 8, u.bv);
    for (int j = 0; j < 8; ++j) u.a[j][0] = a[2 * j], u.a[j][1] = a[2 * j + 1], u.b[j] = 0.f;
  }
  for (int j = 0; j < u.n; ++j) {
    alignas(32) int8_t v[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(v), u.q[j]);
    const __m256 b = _mm256_set1_ps(u.b[j]);
    for (int h = 0; h < 4; ++h) {
      const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * h))));
      _mm256_storeu_ps(out + 32 * j + 8 * h, _mm256_fmadd_ps(w, _mm256_set1_ps(u.a[j][h / 2]), b));
    }
  }
}

// A row of `k` weights (row_bytes(kind, k) bytes) as float32.
template <int32_t K>
inline void row_to_float_k(const uint8_t* row, int64_t k, float* out) {
  const int64_t qk = K >= Q4_K ? 256 : 32, bytes = block_bytes(K);
  Unpacked u;
  for (int64_t b = 0; b < k / qk; ++b) {
    unpack<K>(row + b * bytes, u);
    block_to_float<K>(u, out + b * qk);
  }
}

inline void row_to_float(int32_t kind, const uint8_t* row, int64_t k, float* out) {
  switch (kind) {
    case Q4_0: row_to_float_k<Q4_0>(row, k, out); break;
    case Q4_1: row_to_float_k<Q4_1>(row, k, out); break;
    case Q5_0: row_to_float_k<Q5_0>(row, k, out); break;
    case Q5_1: row_to_float_k<Q5_1>(row, k, out); break;
    case Q8_0: row_to_float_k<Q8_0>(row, k, out); break;
    case Q4_K: row_to_float_k<Q4_K>(row, k, out); break;
    case Q5_K: row_to_float_k<Q5_K>(row, k, out); break;
    default: row_to_float_k<Q6_K>(row, k, out); break;
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

// y[m, n] for weight rows n in [n0, n1) and all M activation rows: rows `w + (n - row0) * rb`. Four weight rows at
// a time, walked side by side as four sequential streams (as gemm.h's Quarters: more misses in flight); each
// block of the four is unpacked once and reused for every activation row.
template <int32_t K>
void gemm_blocks_k(const uint8_t* w, int64_t row0, int64_t k, const Q8& x, int64_t M, int64_t n0, int64_t n1,
                   const BlockOut& out) {
  const int64_t qk = K >= Q4_K ? 256 : 32, bytes = block_bytes(K), rb = row_bytes(K, k), nb = k / qk,
                xb = k / 32;  // activation blocks per row
  const int64_t q = (n1 - n0) / 4;
  constexpr int kRowsMax = 8;  // activation rows per pass: their accumulators stay in registers / L1
  Unpacked u[4];
  for (int64_t t = 0; t < q; ++t) {
    const int64_t idx[4] = {n0 + t, n0 + t + q, n0 + t + 2 * q, n0 + t + 3 * q};
    const uint8_t* r[4];
    for (int i = 0; i < 4; ++i) r[i] = w + (idx[i] - row0) * rb;
    if (M == 1) {  // decode at batch 1: each block unpacked and used at once, in registers
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      float off[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t xo = b * (qk / 32);
        for (int i = 0; i < 4; ++i) {
          Unpacked one;
          unpack<K>(r[i] + b * bytes, one);
          acc[i] = block_dot<K>(one, x.q + xo * 32, x.dx + xo, x.dxs + xo, acc[i], off[i]);
        }
      }
      for (int i = 0; i < 4; ++i) put(out, 0, idx[i], hsum8(acc[i]) + off[i]);
      continue;
    }
    for (int64_t m0 = 0; m0 < M; m0 += kRowsMax) {
      const int64_t mr = std::min<int64_t>(kRowsMax, M - m0);
      __m256 acc[kRowsMax][4];
      float off[kRowsMax][4];
      for (int64_t m = 0; m < mr; ++m)
        for (int i = 0; i < 4; ++i) acc[m][i] = _mm256_setzero_ps(), off[m][i] = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        for (int i = 0; i < 4; ++i) unpack<K>(r[i] + b * bytes, u[i]);
        for (int64_t m = 0; m < mr; ++m) {
          const int64_t xo = (m0 + m) * xb + b * (qk / 32);
          for (int i = 0; i < 4; ++i)
            acc[m][i] = block_dot<K>(u[i], x.q + xo * 32, x.dx + xo, x.dxs + xo, acc[m][i], off[m][i]);
        }
      }
      for (int64_t m = 0; m < mr; ++m)
        for (int i = 0; i < 4; ++i) put(out, m0 + m, idx[i], hsum8(acc[m][i]) + off[m][i]);
    }
  }
  for (int64_t n = n0 + 4 * q; n < n1; ++n) {  // the rows left over, one at a time
    const uint8_t* row = w + (n - row0) * rb;
    for (int64_t m = 0; m < M; ++m) {
      __m256 acc = _mm256_setzero_ps();
      float off = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        unpack<K>(row + b * bytes, u[0]);
        const int64_t xo = m * xb + b * (qk / 32);
        acc = block_dot<K>(u[0], x.q + xo * 32, x.dx + xo, x.dxs + xo, acc, off);
      }
      put(out, m, n, hsum8(acc) + off);
    }
  }
}

#include "blocks_x8.h"

// y = x @ W^T for weight rows [n0, n1) of a block-format weight of `rows` rows from row0 (rows
// `w + (n - row0) * row bytes`; repacked kinds: blocks_x8.h), all M rows of x, on this build's instructions.
inline void gemm_blocks_isa(int32_t kind, const uint8_t* w, int64_t row0, int64_t rows, int64_t k, const Q8& x,
                            int64_t M, int64_t n0, int64_t n1, const BlockOut& put) {
  switch (kind) {
    case Q4_0x8: gemm_x8_k<Q4_0x8>(w, row0, rows, k, x, M, n0, n1, put); break;
    case Q8_0x8: gemm_q8_0x8(w, row0, rows, k, x, M, n0, n1, put); break;  // (blocks_q8_0x8.h)
    case Q4_Kx8: gemm_x8_k<Q4_Kx8>(w, row0, rows, k, x, M, n0, n1, put); break;
    case Q6_Kx8: gemm_x8_k<Q6_Kx8>(w, row0, rows, k, x, M, n0, n1, put); break;
    case Q4_0: gemm_blocks_k<Q4_0>(w, row0, k, x, M, n0, n1, put); break;
    case Q4_1: gemm_blocks_k<Q4_1>(w, row0, k, x, M, n0, n1, put); break;
    case Q5_0: gemm_blocks_k<Q5_0>(w, row0, k, x, M, n0, n1, put); break;
    case Q5_1: gemm_blocks_k<Q5_1>(w, row0, k, x, M, n0, n1, put); break;
    case Q8_0: gemm_blocks_k<Q8_0>(w, row0, k, x, M, n0, n1, put); break;
    case Q4_K: gemm_blocks_k<Q4_K>(w, row0, k, x, M, n0, n1, put); break;
    case Q5_K: gemm_blocks_k<Q5_K>(w, row0, k, x, M, n0, n1, put); break;
    default: gemm_blocks_k<Q6_K>(w, row0, k, x, M, n0, n1, put); break;
  }
}

#ifndef TANDEM_BLOCKS_VNNI
// The same on the best instructions of this CPU (tandem_block_isa).
inline void gemm_blocks(int32_t kind, const uint8_t* w, int64_t row0, int64_t rows, int64_t k, const Q8& x,
                        int64_t M, int64_t n0, int64_t n1, const BlockOut& out) {
  if (tandem_block_isa == 1) tandem_vnni_gemm_blocks(kind, w, row0, rows, k, x, M, n0, n1, out);
  else gemm_blocks_isa(kind, w, row0, rows, k, x, M, n0, n1, out);
}
#endif

}  // namespace TANDEM_BLOCKS_NS
