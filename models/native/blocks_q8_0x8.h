// Q8_0 rows repacked 8 by 8 (blocks_x8.h's scheme for ggml's block_q8_0: d fp16, then 32 int8 weights), so
// that prompt processing runs on int8 activations as the other repacked formats do, instead of dequantizing
// each weight to float per call. Included by blocks_x8.h (which dispatches kind Q8_0x8 here).
//
// Layout of one group-block (r: row in the group, offsets in bytes; chunk c: weights 4c .. 4c + 3), 272 bytes:
// as many as the 8 plain blocks (8 * 34), so a repacked weight is the file's size:
// - Q8_0x8 (272): d[8] fp16 (row r's at 2r) | qs[8 regs of 32] at 16 + 32c: byte 4r + i = q_r[4c + i] (int8).
//
// The weights are signed and maddubs takes u8 x s8: each register's |w| is the unsigned side (sign_epi8(w, w):
// -128 becomes 128 as u8) and the activations take the weights' signs (sign_epi8(x, w), 0 where w is 0), the
// plain kernel's sign trick (blocks.h sub_dot). One maddubs pair is at most 2 * 128 * 127 = 32512 in int16, but
// two chunks' sums would overflow it: each chunk's pairs go to int32 at once (madd with ones; the VNNI build:
// one dpbusd), and a block's 8 chunks summed in int32, |.| <= 32 * 128 * 127 < 2^24, convert exactly to float.
// Then one multiply (d_r dx) and one fma per block per activation row, for the 8 rows at once.
#pragma once

// The 8 rows' products with R activation rows m0 .. m0 + R - 1 of x (k columns), over the nb blocks of the
// group at g: out[r] holds row m0 + r's 8 results (as blocks_x8.h group_dot). Each register's |w| is made once
// for the R rows; every row's sums run in the same order whatever R (a row's results do not depend on the others).
template <int R>
inline void group_dot_q8_0(const uint8_t* g, int64_t nb, const Q8& x, int64_t m0, int64_t k, __m256* out) {
  const int8_t* xq[R];
  const float* dx[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = x.q + (m0 + r) * k, dx[r] = x.dx + (m0 + r) * (k / 32);
    acc[r] = _mm256_setzero_ps();
  }
#ifndef TANDEM_BLOCKS_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * 272;
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      if (c < 5) prefetch_ahead(p + 64 * c, m0 == 0);  // (272 bytes a block: five lines)
      const __m256i v = load256(p + 16 + 32 * c);
      const __m256i a = _mm256_sign_epi8(v, v);  // |w| (u8)
      for (int r = 0; r < R; ++r) {
        const __m256i sx = _mm256_sign_epi8(bcast4(xq[r] + 32 * b + 4 * c), v);  // x with w's sign
#ifdef TANDEM_BLOCKS_VNNI
        s[r] = _mm256_dpbusd_epi32(s[r], a, sx);
#else
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, sx), ones));
#endif
      }
    }
    const __m256 d = half8(p);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d, _mm256_broadcast_ss(dx[r] + b)), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// group_dot_q8_0 for R (1 .. 4) activation rows chosen at run time.
inline void group_dot_q8_0_rows(const uint8_t* g, int64_t nb, const Q8& x, int64_t m0, int64_t k, int64_t R,
                                __m256* out) {
  switch (R) {
    case 4: group_dot_q8_0<4>(g, nb, x, m0, k, out); break;
    case 3: group_dot_q8_0<3>(g, nb, x, m0, k, out); break;
    case 2: group_dot_q8_0<2>(g, nb, x, m0, k, out); break;
    default: group_dot_q8_0<1>(g, nb, x, m0, k, out); break;
  }
}

// Row r of a Q8_0x8 group-block (at p) unpacked as unpack<Q8_0> unpacks its plain block (the same bits).
inline void unpack_q8_0x8(const uint8_t* p, int r, Unpacked& u) {
  alignas(32) uint8_t t[32];
  for (int c = 0; c < 8; ++c) std::memcpy(t + 4 * c, p + 16 + 32 * c + 4 * r, 4);
  u.n = 1, u.is_signed = true;
  set_sub(u, 0, load256(t), half(p + 2 * r), 0.f);
}
