// The linear layers' kernels of the native decode step (models/native/decode_step.cpp includes this file):
// y = x @ W^T + b for float32, float16 and int8 weights, a batch of M activation rows against rows [n0, n1) of
// the weight, shared over an OpenMP team. Layouts: decode_step.h.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "blocks.h"
#include "decode_step.h"

namespace {

// bfloat16: the upper half of a float32's bits.
struct bf16_t {
  uint16_t bits;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline float to_float(bf16_t v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// Round to nearest even, as torch's float32 -> bfloat16 (NaN stays NaN).
inline bf16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) { return blocks::hsum8(v); }

// The part [begin, end) of n items that thread tid of nt takes (contiguous, in units of `grain`).
inline void share(int64_t n, int64_t grain, int tid, int nt, int64_t& begin, int64_t& end) {
  const int64_t units = (n + grain - 1) / grain;
  const int64_t per = (units + nt - 1) / nt;
  begin = std::min(n, tid * per * grain);
  end = std::min(n, begin + per * grain);
}

// Work handed out in chunks from a counter the team shares (llama.cpp splits its matrix products the same way):
// a thread that gets less of its core (another process on it, or a slower part of a fused weight: q/k in Q4_K
// beside v in Q6_K) takes fewer chunks, where a fixed split keeps the team waiting at the next barrier for the
// slowest thread's share. A chunk is whole units of `grain` rows (groups of repacked rows), and a row's result
// does not depend on which chunk or thread computes it. Every thread of the team calls run() for every phase, in
// the same order, and a barrier ends each phase: the counters rotate over three, thread 0 zeroing the next
// phase's (last used two phases ago: a barrier has ended every use of it since).
class Chunks {
 public:
  static constexpr int64_t kPerThread = 4;  // chunks per thread: balance vs. shorter sequential streams
  explicit Chunks(std::atomic<int64_t>* counters) : counters_(counters) {}

  // f(begin, end) for the chunks of [0, n) this thread takes.
  template <typename F>
  void run(int64_t n, int64_t grain, int tid, int nt, F&& f) {
    std::atomic<int64_t>& next = counters_[phase_ % 3];
    if (tid == 0) counters_[(phase_ + 1) % 3].store(0, std::memory_order_relaxed);
    ++phase_;
    const int64_t units = (n + grain - 1) / grain;
    if (nt == 1 || units <= 1) {
      if (tid == 0 && n > 0) f(int64_t{0}, n);
      return;
    }
    const int64_t per = std::max<int64_t>(1, units / (kPerThread * nt)), chunks = (units + per - 1) / per;
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      f(c * per * grain, std::min(n, (c + 1) * per * grain));
  }

 private:
  std::atomic<int64_t>* counters_;  // [3], shared by the team, zero when it starts
  int64_t phase_ = 0;               // this thread's count of run() calls
};

struct Epilogue {
  const float* scale;  // per output row, or null
  const float* bias;   // per output row, or null
  bool accumulate;     // y += result (a residual add), else y = result
  inline void put(float* y, int64_t n, float v) const {
    if (scale) v *= scale[n];
    if (bias) v += bias[n];
    *y = accumulate ? *y + v : v;
  }
};

// A thread's rows [n0, n1) as four quarters of q rows each, walked side by side: tile t holds rows
// n0 + t + i q (i < 4). Each quarter is one long sequential stream, so a thread keeps four streams of
// memory reads going, which the hardware prefetchers follow and which keep more misses in flight than one
// stream (four adjacent rows of 576 values instead restart four short streams every tile: SmolLM2's float32
// step at batch 1 went from ~24 to ~16 ms on 2 cores). Rows past 4 q are done one by one.
struct Quarters {
  int64_t n0, q;
  Quarters(int64_t begin, int64_t end) : n0(begin), q((end - begin) / 4) {}
  int64_t row(int64_t t, int i) const { return n0 + t + i * q; }
  int64_t rest() const { return n0 + 4 * q; }  // the first row no tile holds
};

// y[m, n] for n in [n0, n1), all m < M: y = x[M, K] @ w[n0:n1, K]^T. Four weight rows at a time (Quarters);
// each is read from memory once and reused from L1 for every row of x (three rows of x per pass of the 4 x 3
// register tile). Half / int8 rows are widened to float32 once per tile when several rows of x reuse them
// (`wide`: 4 * K floats of this thread's scratch). Every y[m, n] is one accumulator summed in k order, the
// same bits whatever M and whichever path.
template <typename T>
void gemm_rows(const T* w, const Epilogue& ep, int64_t K, const float* x, int64_t M, float* y, int64_t ldy,
               int64_t n0, int64_t n1, float* wide) {
  const Quarters qs(n0, n1);
  for (int64_t t = 0; t < qs.q; ++t) {
    const int64_t idx[4] = {qs.row(t, 0), qs.row(t, 1), qs.row(t, 2), qs.row(t, 3)};
    const T* r[4] = {w + idx[0] * K, w + idx[1] * K, w + idx[2] * K, w + idx[3] * K};
    int64_t m = 0;
    if (M >= 3) {
      const float* f[4];
      if constexpr (std::is_same_v<T, float>) {
        for (int i = 0; i < 4; ++i) f[i] = r[i];
      } else {
        for (int i = 0; i < 4; ++i) {
          float* dst = wide + i * K;
          for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(dst + k, load8(r[i] + k));
          f[i] = dst;
        }
      }
      for (; m + 3 <= M; m += 3) {
        const float* x0 = x + m * K;
        const float* x1 = x0 + K;
        const float* x2 = x1 + K;
        __m256 a[4][3];
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 3; ++j) a[i][j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
          const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k), v2 = _mm256_loadu_ps(x2 + k);
          for (int i = 0; i < 4; ++i) {
            const __m256 wv = _mm256_loadu_ps(f[i] + k);
            a[i][0] = _mm256_fmadd_ps(wv, v0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(wv, v1, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(wv, v2, a[i][2]);
          }
        }
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 3; ++j) ep.put(y + (m + j) * ldy + idx[i], idx[i], hsum(a[i][j]));
      }
    }
    for (; m < M; ++m) {  // batch 1 (or the last rows): the weights straight from memory, converted in registers
      const float* xm = x + m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(xm + k);
        a0 = _mm256_fmadd_ps(load8(r[0] + k), v, a0);
        a1 = _mm256_fmadd_ps(load8(r[1] + k), v, a1);
        a2 = _mm256_fmadd_ps(load8(r[2] + k), v, a2);
        a3 = _mm256_fmadd_ps(load8(r[3] + k), v, a3);
      }
      float* ym = y + m * ldy;
      ep.put(ym + idx[0], idx[0], hsum(a0));
      ep.put(ym + idx[1], idx[1], hsum(a1));
      ep.put(ym + idx[2], idx[2], hsum(a2));
      ep.put(ym + idx[3], idx[3], hsum(a3));
    }
  }
  for (int64_t n = qs.rest(); n < n1; ++n) {  // the rows left over
    const T* r = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      __m256 a = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) a = _mm256_fmadd_ps(load8(r + k), _mm256_loadu_ps(xm + k), a);
      ep.put(y + m * ldy + n, n, hsum(a));
    }
  }
}


// An activation matrix x [M, K] as the kernels read it: float32, and for kind-3 weights its int8 form,
// made once per phase by quantize_rows: per block of 32 values with scale d = absmax / 127, x ~ (hi + lo / 254)
// * d with hi = round(x / d) and lo = round((x - hi d) * 254 / d), both int8 ([M, K] each; d: [M, K / 32]).
// Two int8 digits give ~15-bit activations (one digit, llama.cpp's q8_0 way, cost 4x the NLL increase of the
// int8 weights alone on SmolLM2); the integer products stay exact and the step stays bound by memory.
// For block-format weights (blocks.h) x is quantized to one int8 digit per value instead: into q8 per block of 32
// (the formats of 32), into q8k per block of 256 (the K-quants).
struct Input {
  const float* x;
  int8_t* hi;
  int8_t* lo;
  float* d;
  blocks::Q8 q8;
  blocks::Q8 q8k;
};

// Which quantized forms of its input the block-format parts of L read: per 32 (by32), per 256 (by256).
void forms_read(const TdLinear& L, bool& by32, bool& by256) {
  if (L.kind != kBlockKind) return;
  for (int p = 0; p < L.nparts; ++p) (blocks::per_256(L.parts[p].kind) ? by256 : by32) = true;
}

// x's rows [M, K] quantized in the forms asked for, the blocks split over the team, then a barrier.
void quantize_rows_q8(bool by32, bool by256, const Input& in, int64_t M, int64_t K, int tid, int nt) {
  int64_t b0, b1;
  if (by32) {
    share(M * (K / 32), 1, tid, nt, b0, b1);
    blocks::quantize_q8(in.x, in.q8, b0, b1);
  }
  if (by256) {
    share(M * (K / 256), 1, tid, nt, b0, b1);
    blocks::quantize_q8_256(in.x, in.q8k, b0, b1);
  }
#pragma omp barrier
}

// Rows of x rounded as above, blocks split over the team, then a barrier.
void quantize_rows(const Input& in, int64_t M, int64_t K, int tid, int nt) {
  int64_t b0, b1;
  share(M * (K / 32), 1, tid, nt, b0, b1);  // K % 32 == 0: the blocks of all rows are contiguous
  for (int64_t blk = b0; blk < b1; ++blk) {
    const float* src = in.x + blk * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(src[i]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int8_t* hi = in.hi + blk * 32;
    int8_t* lo = in.lo + blk * 32;
    for (int i = 0; i < 32; ++i) {
      const float h = std::nearbyint(src[i] * inv);  // |h| <= 127
      hi[i] = static_cast<int8_t>(h);
      lo[i] = static_cast<int8_t>(std::nearbyint((src[i] * inv - h) * 254.f));  // |x/d - h| <= 1/2: |lo| <= 127
    }
    in.d[blk] = d / 254.f;
  }
#pragma omp barrier
}

// One int8 weight row against one quantized row of x, per block of 32: exact integer dot products of |w| (u8)
// with sign(hi, w) and sign(lo, w) (s8), paired into int32 as 254 * hi.w + lo.w (|.| < 2^25), times the
// block's scale d / 254.
inline __m256 q8_block(__m256i w, __m256i hi, __m256i lo, __m256 d, __m256 acc, __m256i c254, __m256i ones) {
  const __m256i aw = _mm256_sign_epi8(w, w);
  const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(hi, w)), c254);
  const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(lo, w)), ones);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ph, pl)), d, acc);
}

void gemm_q8(const int8_t* w, const Epilogue& ep, int64_t K, const Input& in, int64_t M, float* y, int64_t ldy,
             int64_t n0, int64_t n1) {
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1), c254 = _mm256_set1_epi16(254);
  auto load = [](const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  const Quarters qs(n0, n1);
  for (int64_t t = 0; t < qs.q; ++t) {
    const int64_t idx[4] = {qs.row(t, 0), qs.row(t, 1), qs.row(t, 2), qs.row(t, 3)};
    const int8_t* r[4] = {w + idx[0] * K, w + idx[1] * K, w + idx[2] * K, w + idx[3] * K};
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xh = in.hi + m * K;
      const int8_t* xl = in.lo + m * K;
      const float* xd = in.d + m * nb;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i hv = load(xh + b * 32), lv = load(xl + b * 32);
        const __m256 dv = _mm256_broadcast_ss(xd + b);
        a0 = q8_block(load(r[0] + b * 32), hv, lv, dv, a0, c254, ones);
        a1 = q8_block(load(r[1] + b * 32), hv, lv, dv, a1, c254, ones);
        a2 = q8_block(load(r[2] + b * 32), hv, lv, dv, a2, c254, ones);
        a3 = q8_block(load(r[3] + b * 32), hv, lv, dv, a3, c254, ones);
      }
      float* ym = y + m * ldy;
      ep.put(ym + idx[0], idx[0], hsum(a0));
      ep.put(ym + idx[1], idx[1], hsum(a1));
      ep.put(ym + idx[2], idx[2], hsum(a2));
      ep.put(ym + idx[3], idx[3], hsum(a3));
    }
  }
  for (int64_t n = qs.rest(); n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b)
        a = q8_block(load(w + n * K + b * 32), load(in.hi + m * K + b * 32), load(in.lo + m * K + b * 32),
                     _mm256_broadcast_ss(in.d + m * nb + b), a, c254, ones);
      ep.put(y + m * ldy + n, n, hsum(a));
    }
  }
}

void gemm_part(const TdLinear& L, const Input& in, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1,
               bool accumulate, float* wide) {
  const Epilogue ep{L.scale, L.bias, accumulate};
  if (L.kind == kBlockKind) {  // each part's rows in [n0, n1)
    int64_t row0 = 0;
    for (int p = 0; p < L.nparts; ++p) {
      const TdPart& part = L.parts[p];
      const int64_t a = std::max(n0, row0), b = std::min(n1, row0 + part.rows);
      if (a < b)
        blocks::gemm_blocks(part.kind, static_cast<const uint8_t*>(part.w), row0, part.rows, L.k,
                            blocks::per_256(part.kind) ? in.q8k : in.q8, M, a, b,
                            BlockOut{y, ldy, L.scale, L.bias, accumulate});
      row0 += part.rows;
    }
    return;
  }
  switch (L.kind) {
    case 0: gemm_rows(static_cast<const float*>(L.w), ep, L.k, in.x, M, y, ldy, n0, n1, wide); break;
    case 1: gemm_rows(static_cast<const uint16_t*>(L.w), ep, L.k, in.x, M, y, ldy, n0, n1, wide); break;
    case 2: gemm_rows(static_cast<const int8_t*>(L.w), ep, L.k, in.x, M, y, ldy, n0, n1, wide); break;
    case 4: gemm_rows(static_cast<const bf16_t*>(L.w), ep, L.k, in.x, M, y, ldy, n0, n1, wide); break;
    default: gemm_q8(static_cast<const int8_t*>(L.w), ep, L.k, in, M, y, ldy, n0, n1); break;
  }
}

// This thread's share of y = x @ L^T, then a barrier: block formats in chunks (whole groups of repacked rows)
// taken from `chunks`, the others split evenly in 4-row tiles (their four quarter streams per thread want one
// long range each). (Kind 3: x is quantized first, by the whole team.)
void gemm(const TdLinear& L, const Input& in, int64_t M, float* y, int64_t ldy, bool accumulate, float* wide,
          int tid, int nt, Chunks& chunks) {
  if (L.kind == 3) quantize_rows(in, M, L.k, tid, nt);
  if (L.kind == kBlockKind) {
    bool by32 = false, by256 = false;
    forms_read(L, by32, by256);
    quantize_rows_q8(by32, by256, in, M, L.k, tid, nt);
    chunks.run(L.n, 8, tid, nt, [&](int64_t n0, int64_t n1) { gemm_part(L, in, M, y, ldy, n0, n1, accumulate, wide); });
  } else {
    int64_t n0, n1;
    share(L.n, 4, tid, nt, n0, n1);
    if (n0 < n1) gemm_part(L, in, M, y, ldy, n0, n1, accumulate, wide);
  }
#pragma omp barrier
}

}  // namespace
