// One decode step of a dense decoder (Llama / Qwen2 / Qwen3) for B sequences, every layer in one call:
// the native decode kernel behind `--decode-kernel native` (models/native_decode.py builds and calls it).
//
// Why it exists: at batch 1 a decode step of a small model is bound by reading its weights, and the eager
// PyTorch step spends half its time elsewhere (hundreds of small ops, Python between them, a gathered K/V
// copy). Here a step is one call: one OpenMP team of the executor's threads runs every phase of every layer,
// separated by barriers, and each weight matrix is streamed once per step whatever the batch size.
//
// Layout contract (the Python side checks it before building the descriptors):
// - activations, norms, embedding, KV cache: float32, contiguous;
// - a linear weight is [n, k] row-major (out, in) in float32, float16 (kind 1) or int8 with one float32 scale
//   per output row (kind 2: float32 activations; kind 3: activations as two int8 digits per block of 32, for
//   integer dot products, see Input: k % 32 == 0); k % 8 == 0;
// - K/V pools per layer: [num_blocks, block_size, kv_heads, head_dim];
// - tables [B, width] int64 block ids; token t of item b is in block tables[b][t / bs] at t % bs;
// - cos / sin [B, head_dim]: rotary for each item's position (non-interleaved halves, as HF Llama/Qwen).
// Built with -mavx2 -mfma -mf16c; the caller checks the CPU has them.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

extern "C" {

struct TdLinear {
  int32_t kind;  // 0 float32, 1 float16, 2 int8 (+ scale), 3 int8 (+ scale) times int8 activations
  int32_t unused;
  const void* w;       // [n, k]
  const float* scale;  // [n] (int8) or null
  const float* bias;   // [n] or null
  int64_t n, k;
};

struct TdLayer {
  const float* in_norm;    // [hidden]
  const float* post_norm;  // [hidden]
  const float* q_norm;     // [head_dim] or null (Qwen3)
  const float* k_norm;     // [head_dim] or null
  TdLinear qkv, o, gate, up, down;
  float* k_pool;  // [num_blocks, block_size, kv_heads, head_dim]
  float* v_pool;
};

struct TdModel {
  int64_t hidden, heads, kv_heads, head_dim, inter, vocab, n_layers, block_size;
  float eps, attn_scale;
  const float* embed;       // [vocab, hidden]
  const float* final_norm;  // [hidden]
  TdLinear head;
  const TdLayer* layers;
};

}  // extern "C"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

// The part [begin, end) of n items that thread tid of nt takes (contiguous, in units of `grain`).
inline void share(int64_t n, int64_t grain, int tid, int nt, int64_t& begin, int64_t& end) {
  const int64_t units = (n + grain - 1) / grain;
  const int64_t per = (units + nt - 1) / nt;
  begin = std::min(n, tid * per * grain);
  end = std::min(n, begin + per * grain);
}

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

// y[m, n] for n in [n0, n1), all m < M: y = x[M, K] @ w[n0:n1, K]^T. Four weight rows at a time; each is
// read from memory once and reused from L1 for every row of x (three rows of x per pass of the 4 x 3
// register tile). Half / int8 rows are widened to float32 once per 4-row tile when several rows of x
// reuse them (`wide`: 4 * K floats of this thread's scratch).
template <typename T>
void gemm_rows(const T* w, const Epilogue& ep, int64_t K, const float* x, int64_t M, float* y, int64_t ldy,
               int64_t n0, int64_t n1, float* wide) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const T* r[4] = {w + n * K, w + (n + 1) * K, w + (n + 2) * K, w + (n + 3) * K};
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
      // The next tile's weight rows, fetched during the first pass (they come from memory, not cache).
      const char* next = reinterpret_cast<const char*>(r[0] + 4 * K);
      const int64_t ahead = 4 * static_cast<int64_t>(sizeof(T)) * 8;  // its bytes per k-step of this tile
      for (; m + 3 <= M; m += 3) {
        const float* x0 = x + m * K;
        const float* x1 = x0 + K;
        const float* x2 = x1 + K;
        __m256 a[4][3];
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 3; ++j) a[i][j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
          if (m == 0)
            for (int64_t off = 0; off < ahead; off += 64) _mm_prefetch(next + k / 8 * ahead + off, _MM_HINT_T0);
          const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k), v2 = _mm256_loadu_ps(x2 + k);
          for (int i = 0; i < 4; ++i) {
            const __m256 wv = _mm256_loadu_ps(f[i] + k);
            a[i][0] = _mm256_fmadd_ps(wv, v0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(wv, v1, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(wv, v2, a[i][2]);
          }
        }
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 3; ++j) ep.put(y + (m + j) * ldy + n + i, n + i, hsum(a[i][j]));
      }
    }
    for (; m < M; ++m) {  // batch 1 (or the last rows): the weights straight from memory, converted in registers
      const float* xm = x + m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < K; k += 8) {
        if (!std::is_same_v<T, float> && m == 0 && (k & 8) == 0) {  // 4 rows ahead: 4 * K * sizeof(T) bytes over K / 16 prefetch points
          const char* next = reinterpret_cast<const char*>(r[0] + 4 * K);
          const int64_t step = 4 * sizeof(T) * 16;  // bytes of the next tile per two k-steps
          for (int64_t off = 0; off < step; off += 64) _mm_prefetch(next + (k / 16) * step + off, _MM_HINT_T0);
        }
        const __m256 v = _mm256_loadu_ps(xm + k);
        a0 = _mm256_fmadd_ps(load8(r[0] + k), v, a0);
        a1 = _mm256_fmadd_ps(load8(r[1] + k), v, a1);
        a2 = _mm256_fmadd_ps(load8(r[2] + k), v, a2);
        a3 = _mm256_fmadd_ps(load8(r[3] + k), v, a3);
      }
      float* ym = y + m * ldy + n;
      ep.put(ym, n, hsum(a0));
      ep.put(ym + 1, n + 1, hsum(a1));
      ep.put(ym + 2, n + 2, hsum(a2));
      ep.put(ym + 3, n + 3, hsum(a3));
    }
  }
  for (; n < n1; ++n) {  // fewer than 4 rows left
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
struct Input {
  const float* x;
  int8_t* hi;
  int8_t* lo;
  float* d;
};

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
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const int8_t* r = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xh = in.hi + m * K;
      const int8_t* xl = in.lo + m * K;
      const float* xd = in.d + m * nb;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t b = 0; b < nb; ++b) {
        if (m == 0) {  // the next tile's rows, two lines per block: 4 short interleaved rows defeat the prefetcher
          _mm_prefetch(reinterpret_cast<const char*>(r + 4 * K) + b * 128, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r + 4 * K) + b * 128 + 64, _MM_HINT_T0);
        }
        const __m256i hv = load(xh + b * 32), lv = load(xl + b * 32);
        const __m256 dv = _mm256_broadcast_ss(xd + b);
        a0 = q8_block(load(r + b * 32), hv, lv, dv, a0, c254, ones);
        a1 = q8_block(load(r + K + b * 32), hv, lv, dv, a1, c254, ones);
        a2 = q8_block(load(r + 2 * K + b * 32), hv, lv, dv, a2, c254, ones);
        a3 = q8_block(load(r + 3 * K + b * 32), hv, lv, dv, a3, c254, ones);
      }
      float* ym = y + m * ldy + n;
      ep.put(ym, n, hsum(a0));
      ep.put(ym + 1, n + 1, hsum(a1));
      ep.put(ym + 2, n + 2, hsum(a2));
      ep.put(ym + 3, n + 3, hsum(a3));
    }
  }
  for (; n < n1; ++n) {
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
  switch (L.kind) {
    case 0: gemm_rows(static_cast<const float*>(L.w), ep, L.k, in.x, M, y, ldy, n0, n1, wide); break;
    case 1: gemm_rows(static_cast<const uint16_t*>(L.w), ep, L.k, in.x, M, y, ldy, n0, n1, wide); break;
    case 2: gemm_rows(static_cast<const int8_t*>(L.w), ep, L.k, in.x, M, y, ldy, n0, n1, wide); break;
    default: gemm_q8(static_cast<const int8_t*>(L.w), ep, L.k, in, M, y, ldy, n0, n1); break;
  }
}

// This thread's share of y = x @ L^T (rows of L split over the team in 4-row tiles), then a barrier.
// (Kind 3: x is quantized first, by the whole team.)
void gemm(const TdLinear& L, const Input& in, int64_t M, float* y, int64_t ldy, bool accumulate, float* wide,
          int tid, int nt) {
  if (L.kind == 3) quantize_rows(in, M, L.k, tid, nt);
  int64_t n0, n1;
  share(L.n, 4, tid, nt, n0, n1);
  if (n0 < n1) gemm_part(L, in, M, y, ldy, n0, n1, accumulate, wide);
#pragma omp barrier
}

void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// Rows of x [M, n] normalised into out, split over the team, then a barrier.
void rms_norm_rows(const float* x, const float* w, float eps, int64_t M, int64_t n, float* out, int tid, int nt) {
  int64_t b0, b1;
  share(M, 1, tid, nt, b0, b1);
  for (int64_t m = b0; m < b1; ++m) rms_norm(x + m * n, w, eps, n, out + m * n);
#pragma omp barrier
}

// e^x for 8 floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n through the exponent
// bits): ~1 ulp, like libm's expf, at a fraction of its cost. Inputs below -87.3 give ~0, as expf does.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float exp1(float x) {  // exp256 on one value: the tails of vector loops compute exactly as their bodies
  alignas(32) float v[8];
  _mm256_store_ps(v, exp256(_mm256_set1_ps(x)));
  return v[0];
}

// a . b over d floats (d % 8 == 0).
inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  if (i < d) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

// x [n] replaced by softmax(x).
void softmax(float* x, int64_t n) {
  float mx = x[0];
  for (int64_t t = 1; t < n; ++t) mx = std::max(mx, x[t]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + t), vmx));
    _mm256_storeu_ps(x + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; t < n; ++t) {
    x[t] = exp1(x[t] - mx);
    sum += x[t];
  }
  const float inv = 1.f / sum;
  for (t = 0; t < n; ++t) x[t] *= inv;
}

// g[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u over [i0, i1).
void silu_mul(float* g, const float* u, int64_t i0, int64_t i1) {
  int64_t i = i0;
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= i1; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), v));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  for (; i < i1; ++i) g[i] = g[i] / (1.f + exp1(-g[i])) * u[i];
}

// x [d] rotated in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the two halves.
void rotate(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One item and one KV head: normalise and rotate its query heads and key, write key and value into the
// cache slot of position pos, and attend the group's query heads over positions 0..pos. out: [group, d].
void attend_group(const TdModel& m, const TdLayer& L, const float* qkv, const float* cos, const float* sin,
                  const int64_t* table, int64_t pos, int64_t g, float* out, float* q, std::vector<float>& scores) {
  // (No allocation in here: an exception must never leave the OpenMP team.)
  // q: scratch [group + 1, d] (the group's queries, then the key)
  const int64_t d = m.head_dim, kvh = m.kv_heads, group = m.heads / kvh, bs = m.block_size;
  const int64_t ctx = pos + 1;
  float* k = q + group * d;
  for (int64_t j = 0; j < group; ++j) {
    const float* src = qkv + (g * group + j) * d;
    if (L.q_norm) rms_norm(src, L.q_norm, m.eps, d, q + j * d);
    else std::memcpy(q + j * d, src, d * sizeof(float));
    rotate(q + j * d, cos, sin, d);
  }
  const float* ksrc = qkv + (m.heads + g) * d;
  if (L.k_norm) rms_norm(ksrc, L.k_norm, m.eps, d, k);
  else std::memcpy(k, ksrc, d * sizeof(float));
  rotate(k, cos, sin, d);
  const int64_t slot = table[pos / bs] * bs + pos % bs;
  std::memcpy(L.k_pool + (slot * kvh + g) * d, k, d * sizeof(float));
  std::memcpy(L.v_pool + (slot * kvh + g) * d, qkv + (m.heads + kvh + g) * d, d * sizeof(float));

  float* s = scores.data();  // [group, ctx]: sized for the longest context before the team started
  const int64_t row = kvh * d;  // floats from one token's K (or V) of this head to the next token's
  // Scores: K read block by block through the table (no division per token), each key once for the group.
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const float* kb = L.k_pool + (table[t0 / bs] * bs * kvh + g) * d;
    const int64_t n = std::min(bs, ctx - t0);
    for (int64_t o = 0; o < n; ++o)
      for (int64_t j = 0; j < group; ++j) s[j * ctx + t0 + o] = dot(q + j * d, kb + o * row, d) * m.attn_scale;
  }
  for (int64_t j = 0; j < group; ++j) softmax(s + j * ctx, ctx);
  // Output: per query head, the weighted sum of V rows, 64 columns at a time in registers.
  for (int64_t j = 0; j < group; ++j) {
    const float* p = s + j * ctx;
    for (int64_t c = 0; c < d; c += 64) {
      const int64_t lanes = std::min<int64_t>(8, (d - c) / 8);  // d % 8 == 0
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
        const float* vb = L.v_pool + (table[t0 / bs] * bs * kvh + g) * d + c;
        const int64_t n = std::min(bs, ctx - t0);
        for (int64_t o = 0; o < n; ++o) {
          const __m256 pv = _mm256_set1_ps(p[t0 + o]);
          const float* vr = vb + o * row;
          if (lanes == 8) {
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * i), acc[i]);
          } else {
            for (int i = 0; i < lanes; ++i) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * i), acc[i]);
          }
        }
      }
      for (int i = 0; i < lanes; ++i) _mm256_storeu_ps(out + j * d + c + 8 * i, acc[i]);
    }
  }
}

}  // namespace

extern "C" {

int tandem_abi_version() { return 1; }

// ids, pos: [B]; tables: [B, width]; cos, sin: [B, head_dim]; logits: [B, vocab] (written).
// Returns 0, or 1 when scratch memory could not be allocated (nothing but this call's K/V slots written).
int tandem_decode_step(const TdModel* mp, int64_t B, const int64_t* ids, const int64_t* pos, const int64_t* tables,
                       int64_t width, const float* cos, const float* sin, float* logits, int threads) {
  const TdModel& m = *mp;
  const int64_t H = m.hidden, d = m.head_dim, Q = m.heads * d, QKV = Q + 2 * m.kv_heads * d, I = m.inter;
  const int64_t max_ctx = B ? *std::max_element(pos, pos + B) + 1 : 1;
  const int64_t max_k = std::max<int64_t>(H, std::max<int64_t>(Q, I));
  std::vector<float> x, xn, qkv, att, gate, up, qd;
  std::vector<int8_t> qhi, qlo;
  try {
    qhi.resize(B * max_k);
    qlo.resize(B * max_k);
    qd.resize(B * max_k / 32 + 1);
    x.resize(B * H);
    xn.resize(B * H);
    qkv.resize(B * QKV);
    att.resize(B * Q);
    gate.resize(B * I);
    up.resize(B * I);
  } catch (const std::bad_alloc&) {
    return 1;
  }
  for (int64_t b = 0; b < B; ++b) std::memcpy(x.data() + b * H, m.embed + ids[b] * H, H * sizeof(float));
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    std::vector<float> wide, qhk, scores;
    try {
      wide.resize(4 * max_k);
      qhk.resize((m.heads / m.kv_heads + 1) * d);
      scores.resize((m.heads / m.kv_heads) * max_ctx);
    } catch (const std::bad_alloc&) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    if (!failed) {
      const int64_t kvh = m.kv_heads, group = m.heads / kvh;
      for (int64_t l = 0; l < m.n_layers; ++l) {
        const TdLayer& L = m.layers[l];
        rms_norm_rows(x.data(), L.in_norm, m.eps, B, H, xn.data(), tid, nt);
        const Input xin{xn.data(), qhi.data(), qlo.data(), qd.data()};
        gemm(L.qkv, xin, B, qkv.data(), QKV, false, wide.data(), tid, nt);
        // Tasks: whole items when there are enough to share (an item's K/V rows of all heads are adjacent in
        // the pool, so one thread reads each line once), else (item, KV head) pairs.
        const bool by_item = B >= 2 * nt;
        int64_t t0, t1;
        share(by_item ? B : B * kvh, 1, tid, nt, t0, t1);
        for (int64_t task = t0; task < t1; ++task) {
          for (int64_t g = by_item ? 0 : task % kvh; g < (by_item ? kvh : task % kvh + 1); ++g) {
            const int64_t b = by_item ? task : task / kvh;
            attend_group(m, L, qkv.data() + b * QKV, cos + b * d, sin + b * d, tables + b * width, pos[b], g,
                         att.data() + b * Q + g * group * d, qhk.data(), scores);
          }
        }
#pragma omp barrier
        gemm(L.o, Input{att.data(), qhi.data(), qlo.data(), qd.data()}, B, x.data(), H, true, wide.data(), tid, nt);  // x += o(att)
        rms_norm_rows(x.data(), L.post_norm, m.eps, B, H, xn.data(), tid, nt);
        if (L.gate.kind == 3 || L.up.kind == 3) quantize_rows(xin, B, H, tid, nt);  // once for both
        int64_t n0, n1;
        share(I, 4, tid, nt, n0, n1);  // gate, up and SiLU(gate) * up on this thread's columns: no barrier between
        if (n0 < n1) {
          gemm_part(L.gate, xin, B, gate.data(), I, n0, n1, false, wide.data());
          gemm_part(L.up, xin, B, up.data(), I, n0, n1, false, wide.data());
          for (int64_t b = 0; b < B; ++b) {
            float* gb = gate.data() + b * I;
            const float* ub = up.data() + b * I;
            silu_mul(gb, ub, n0, n1);
          }
        }
#pragma omp barrier
        gemm(L.down, Input{gate.data(), qhi.data(), qlo.data(), qd.data()}, B, x.data(), H, true, wide.data(), tid, nt);  // x += down(mid)
      }
      rms_norm_rows(x.data(), m.final_norm, m.eps, B, H, xn.data(), tid, nt);
      gemm(m.head, Input{xn.data(), qhi.data(), qlo.data(), qd.data()}, B, logits, m.vocab, false, wide.data(), tid, nt);
    }
  }
  return failed;
}

}  // extern "C"
