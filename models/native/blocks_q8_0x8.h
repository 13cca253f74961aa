// Q8_0 rows repacked 8 by 8 (blocks_x8.h's scheme for ggml's block_q8_0: d fp16, then 32 int8 weights), so
// that prompt processing runs on int8 activations as the other repacked formats do, instead of dequantizing
// each weight to float per call. Included by blocks_x8.h; kind Q8_0x8's products (blocks.h gemm_blocks_isa)
// and its rows as float (blocks_x8.h) come here.
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

// Groups walked side by side for 1 or 2 activation rows: those read 8.5 bits per weight for few instructions,
// and one sequential stream per thread leaves the memory idle (measured one thread, a [8192, 8192] weight from
// memory, batch 1: one group at a time 1.5x the plain kernel's time, whose 4 rows are 4 streams; 4 groups side by
// side, no software prefetch, 0.8-0.9x it (with blocks_x8.h's prefetch 4 KiB ahead of each stream: 1.0-1.1x);
// batch 2: 0.6x it). At 3 rows and more, one group at a time is as fast.
constexpr int kStreams = 4;

// R activation rows (x's first R) against S groups at once (gs[t]: group t's first block): out[R t + r] holds
// row r's 8 results of group t. The activation broadcasts are shared by the S groups; each row's sums are
// group_dot_q8_0's, in the same order (the same bits whichever kernel computes a row).
template <int S, int R>
inline void streams_dot_q8_0(const uint8_t* const* gs, int64_t nb, const Q8& x, int64_t k, __m256* out) {
  __m256 acc[S][R];
  for (int t = 0; t < S; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
#ifndef TANDEM_BLOCKS_VNNI
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[S][R];
    for (int t = 0; t < S; ++t)
      for (int r = 0; r < R; ++r) s[t][r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      __m256i bx[R];
      for (int r = 0; r < R; ++r) bx[r] = bcast4(x.q + r * k + 32 * b + 4 * c);
      for (int t = 0; t < S; ++t) {
        const uint8_t* p = gs[t] + b * 272;
        const __m256i v = load256(p + 16 + 32 * c);
        const __m256i av = _mm256_sign_epi8(v, v);
        for (int r = 0; r < R; ++r) {
          const __m256i sx = _mm256_sign_epi8(bx[r], v);
#ifdef TANDEM_BLOCKS_VNNI
          s[t][r] = _mm256_dpbusd_epi32(s[t][r], av, sx);
#else
          s[t][r] = _mm256_add_epi32(s[t][r], _mm256_madd_epi16(_mm256_maddubs_epi16(av, sx), ones));
#endif
        }
      }
    }
    for (int t = 0; t < S; ++t) {
      const __m256 d = half8(gs[t] + b * 272);
      for (int r = 0; r < R; ++r)
        acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][r]),
                                    _mm256_mul_ps(d, _mm256_broadcast_ss(x.dx + r * (k / 32) + b)), acc[t][r]);
    }
  }
  for (int t = 0; t < S; ++t)
    for (int r = 0; r < R; ++r) out[R * t + r] = acc[t][r];
}

// Activation row m's 8 results of group g (v) written for the rows in [a, e) (offsets from row0).
inline void put_group(const BlockOut& out, int64_t row0, int64_t g, int64_t a, int64_t e, int64_t m, __m256 v) {
  alignas(32) float vals[kGroup];
  _mm256_store_ps(vals, v);
  for (int i = 0; i < kGroup; ++i) {
    const int64_t n = g * kGroup + i;
    if (n >= a && n < e) put(out, m, row0 + n, vals[i]);
  }
}

// y[m, n] for rows [n0, n1) of a Q8_0x8 part of `rows` rows from row0, all M activation rows: blocks_x8.h's
// gemm_x8_k (groups meeting the range computed whole, only its rows written; the plain tail by the plain
// kernel), except that 1 or 2 activation rows walk the range's groups as kStreams streams (its quarters side by
// side). A row's results are the same bits whatever M and whichever path (tests/models/test_block_q8_0x8.py).
inline void gemm_q8_0x8(const uint8_t* w, int64_t row0, int64_t rows, int64_t k, const Q8& x, int64_t M,
                        int64_t n0, int64_t n1, const BlockOut& out) {
  const int64_t nb = k / 32, rb = row_bytes(Q8_0, k), groups = rows / kGroup;
  const int64_t a = n0 - row0, e = n1 - row0;
  const int64_t g0 = a / kGroup, g1 = std::min(groups, (e + kGroup - 1) / kGroup);
  __m256 v[2 * kStreams];
  if (M <= 2) {
    const int64_t q = std::max<int64_t>(g1 - g0, 0) / kStreams;
    for (int64_t t = 0; t < q; ++t) {
      int64_t g[kStreams];
      const uint8_t* gs[kStreams];
      for (int i = 0; i < kStreams; ++i) g[i] = g0 + t + i * q, gs[i] = w + g[i] * kGroup * rb;
      if (M == 1) streams_dot_q8_0<kStreams, 1>(gs, nb, x, k, v);
      else streams_dot_q8_0<kStreams, 2>(gs, nb, x, k, v);
      for (int i = 0; i < kStreams; ++i)
        for (int64_t r = 0; r < M; ++r) put_group(out, row0, g[i], a, e, r, v[M * i + r]);
    }
    for (int64_t g = g0 + kStreams * q; g < g1; ++g) {  // the groups left over, one at a time
      if (M == 1) group_dot_q8_0<1>(w + g * kGroup * rb, nb, x, 0, k, v);
      else group_dot_q8_0<2>(w + g * kGroup * rb, nb, x, 0, k, v);
      for (int64_t r = 0; r < M; ++r) put_group(out, row0, g, a, e, r, v[r]);
    }
  } else {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t R = std::min<int64_t>(4, M - m0);
        const uint8_t* gp = w + g * kGroup * rb;
        switch (R) {
          case 4: group_dot_q8_0<4>(gp, nb, x, m0, k, v); break;
          case 3: group_dot_q8_0<3>(gp, nb, x, m0, k, v); break;
          case 2: group_dot_q8_0<2>(gp, nb, x, m0, k, v); break;
          default: group_dot_q8_0<1>(gp, nb, x, m0, k, v); break;
        }
        for (int64_t r = 0; r < R; ++r) put_group(out, row0, g, a, e, m0 + r, v[r]);
      }
    }
  }
  const int64_t t0 = std::max(a, groups * kGroup);
  if (t0 < e) gemm_blocks_k<Q8_0>(w, row0, k, x, M, row0 + t0, n1, out);  // the plain rows past the groups
}

// Row r of a Q8_0x8 group-block (at p) unpacked as unpack<Q8_0> unpacks its plain block (the same bits).
inline void unpack_q8_0x8(const uint8_t* p, int r, Unpacked& u) {
  alignas(32) uint8_t t[32];
  for (int c = 0; c < 8; ++c) std::memcpy(t + 4 * c, p + 16 + 32 * c + 4 * r, 4);
  u.n = 1, u.is_signed = true;
  set_sub(u, 0, load256(t), half(p + 2 * r), 0.f);
}
