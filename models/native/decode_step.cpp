// One decode step of a dense decoder (Llama / Qwen2 / Qwen3) for B sequences, every layer in one call:
// the native decode kernel behind `--decode-kernel native` (models/decode/native.py builds and calls it).
//
// Why it exists: at batch 1 a decode step of a small model is bound by reading its weights, and the eager
// PyTorch step spends half its time elsewhere (hundreds of small ops, Python between them, a gathered K/V
// copy). Here a step is one call: one OpenMP team of the executor's threads runs every phase of every layer,
// separated by barriers, and each weight matrix is streamed once per step whatever the batch size.
//
// Layouts: decode_step.h; op.cpp (the torch op that calls this step) checks them. Built with -mavx2 -mfma
// -mf16c; the caller checks the CPU has them.
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

#include "decode_step.h"
#include "gemm.h"

namespace {

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

// a . b over d values (d % 8 == 0; b float32 or bfloat16).
template <typename KV>
inline float dot(const float* a, const KV* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  if (i < d) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
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

// d values of src into a K/V slot (rounded to bfloat16 for a bfloat16 cache).
inline void store_kv(float* dst, const float* src, int64_t d) { std::memcpy(dst, src, d * sizeof(float)); }
inline void store_kv(bf16_t* dst, const float* src, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = to_bf16(src[i]);
}

// One row's keys and values of KV heads [g0, g1): normalised (Qwen3) and rotated keys, and the values, written
// into the cache slot of position pos. k: scratch [d]. Where rows share a sequence (a step that verifies
// drafts: adjacent rows, consecutive positions) every row writes before any row attends (a barrier between),
// so each sees the rows before it, as one token per step would; otherwise a task writes its row's just before
// attending. The arithmetic is the same either way.
template <typename KV>
void write_kv(const TdModel& m, const TdLayer& L, const float* qkv, const float* cos, const float* sin,
              const int64_t* table, int64_t pos, int64_t g0, int64_t g1, float* k) {
  const int64_t d = m.head_dim, kvh = m.kv_heads, bs = m.block_size;
  const int64_t slot = table[pos / bs] * bs + pos % bs;
  KV* const k_pool = static_cast<KV*>(L.k_pool);
  KV* const v_pool = static_cast<KV*>(L.v_pool);
  for (int64_t g = g0; g < g1; ++g) {
    const float* ksrc = qkv + (m.heads + g) * d;
    if (L.k_norm) rms_norm(ksrc, L.k_norm, m.eps, d, k);
    else std::memcpy(k, ksrc, d * sizeof(float));
    rotate(k, cos, sin, d);
    store_kv(k_pool + (slot * kvh + g) * d, k, d);
    store_kv(v_pool + (slot * kvh + g) * d, qkv + (m.heads + kvh + g) * d, d);
  }
}

// One row and KV heads [g0, g1): normalise and rotate their query heads and attend them over positions
// 0..pos of the cache (write_kv has written every row's keys and values). out: [(g1 - g0) group, d] (the
// row's attention output from head g0 * group on). K and V are read token by token, each token's rows of all
// the heads in range at once: one sequential pass over the item's K/V blocks (an item's rows of every head
// are adjacent in the pool), which the prefetchers follow (a pass per head read them strided: at batch 32
// attention took ~20% of the step). Every head's sums run in token order either way, so a result does not
// depend on how many heads one call covers, nor on the other rows of the step.
template <typename KV>
void attend_heads(const TdModel& m, const TdLayer& L, const float* qkv, const float* cos, const float* sin,
                  const int64_t* table, int64_t pos, int64_t g0, int64_t g1, float* out, float* q,
                  std::vector<float>& scores) {
  // (No allocation in here: an exception must never leave the OpenMP team.)
  // q: scratch [(g1 - g0) group, d] (the heads' queries)
  const int64_t d = m.head_dim, kvh = m.kv_heads, group = m.heads / kvh, bs = m.block_size;
  const int64_t ctx = pos + 1, nh = (g1 - g0) * group;
  for (int64_t h = 0; h < nh; ++h) {
    const float* src = qkv + (g0 * group + h) * d;
    if (L.q_norm) rms_norm(src, L.q_norm, m.eps, d, q + h * d);
    else std::memcpy(q + h * d, src, d * sizeof(float));
    rotate(q + h * d, cos, sin, d);
  }
  const KV* const k_pool = static_cast<const KV*>(L.k_pool);
  const KV* const v_pool = static_cast<const KV*>(L.v_pool);

  float* s = scores.data();  // [nh, ctx]: sized for every head and the longest context before the team started
  const int64_t row = kvh * d;  // floats from one token's K (or V) rows to the next token's
  // Scores: K read block by block through the table (no division per token), each key once for its group.
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const KV* kb = k_pool + (table[t0 / bs] * bs * kvh + g0) * d;
    const int64_t n = std::min(bs, ctx - t0);
    for (int64_t o = 0; o < n; ++o)
      for (int64_t h = 0; h < nh; ++h)
        s[h * ctx + t0 + o] = dot(q + h * d, kb + o * row + (h / group) * d, d) * m.attn_scale;
  }
  for (int64_t h = 0; h < nh; ++h) softmax(s + h * ctx, ctx);
  // Output: the weighted sum of V rows, accumulated in out (L1) token after token.
  std::memset(out, 0, nh * d * sizeof(float));
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const KV* vb = v_pool + (table[t0 / bs] * bs * kvh + g0) * d;
    const int64_t n = std::min(bs, ctx - t0);
    for (int64_t o = 0; o < n; ++o) {
      const KV* vr = vb + o * row;
      for (int64_t h = 0; h < nh; ++h) {
        const __m256 pv = _mm256_set1_ps(s[h * ctx + t0 + o]);
        const KV* v = vr + (h / group) * d;
        float* acc = out + h * d;
        for (int64_t c = 0; c < d; c += 8)
          _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(pv, load8(v + c), _mm256_loadu_ps(acc + c)));
      }
    }
  }
}

}  // namespace

int tandem_decode_step(const TdModel& m, int64_t B, const int64_t* ids, const int64_t* pos, const int64_t* tables,
                       int64_t width, const float* cos, const float* sin, const int64_t* head_rows, int64_t n_head,
                       float* logits, int threads) {
  const int64_t H = m.hidden, d = m.head_dim, Q = m.heads * d, QKV = Q + 2 * m.kv_heads * d, I = m.inter;
  const int64_t max_ctx = B ? *std::max_element(pos, pos + B) + 1 : 1;
  // Whether some row may be of the sequence of the row before it (the same first block: drafts; also prompts
  // sharing a cached prefix, for which the barrier below is merely unneeded).
  bool rows_share = false;
  for (int64_t b = 1; b < B && !rows_share; ++b) rows_share = tables[b * width] == tables[(b - 1) * width];
  const int64_t max_k = std::max<int64_t>(H, std::max<int64_t>(Q, I));
  std::vector<float> x, xn, qkv, att, gate, up, qd, q8dx, q8dxs, q8kdx, q8kdxs;
  std::vector<int32_t> q8ko16, q8kbs2;
  std::vector<int8_t> qhi, qlo, q8, q8k;
  try {
    qhi.resize(B * max_k);
    qlo.resize(B * max_k);
    qd.resize(B * max_k / 32 + 1);
    q8.resize(B * max_k);
    q8dx.resize(B * max_k / 32 + 1);
    q8dxs.resize(B * max_k / 32 + 1);
    q8k.resize(B * max_k);  // (the same per block of 256: blocks.h)
    q8kdx.resize(B * max_k / 32 + 1);
    q8kdxs.resize(B * max_k / 32 + 1);
    q8ko16.resize(B * max_k / 16 + 1);
    q8kbs2.resize(B * max_k / 64 + 1);
    x.resize(B * H);
    xn.resize(B * H);
    qkv.resize(B * QKV);
    att.resize(B * Q);
    gate.resize(B * I);
    up.resize(B * I);
  } catch (const std::bad_alloc&) {
    return 1;
  }
  // (o16 and bs2 only per 256: the K-quants read them; blocks.h)
  const blocks::Q8 xq8{q8.data(), q8dx.data(), q8dxs.data(), nullptr, nullptr};
  const blocks::Q8 xq8k{q8k.data(), q8kdx.data(), q8kdxs.data(), q8ko16.data(), q8kbs2.data()};
  // The inputs of the linear layers: x, with the scratch of its quantized forms.
  auto input = [&](const float* rows) { return Input{rows, qhi.data(), qlo.data(), qd.data(), xq8, xq8k}; };
  for (int64_t b = 0; b < B; ++b) {
    if (m.embed_kind != 0) {  // a block-format table: the row dequantized
      blocks::matrix_row_to_float(m.embed_kind, static_cast<const uint8_t*>(m.embed), ids[b], m.vocab, H,
                                  x.data() + b * H);
    } else if (m.bf16) {
      const bf16_t* row = static_cast<const bf16_t*>(m.embed) + ids[b] * H;
      for (int64_t i = 0; i < H; ++i) x[b * H + i] = to_float(row[i]);
    } else {
      std::memcpy(x.data() + b * H, static_cast<const float*>(m.embed) + ids[b] * H, H * sizeof(float));
    }
  }
  int failed = 0;
  std::atomic<int64_t> counters[3] = {0, 0, 0};  // the team's Chunks (gemm.h)
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    Chunks chunks(counters);
    std::vector<float> wide, qhk, scores;
    try {
      wide.resize(4 * max_k);
      qhk.resize((m.heads + m.kv_heads) * d);
      scores.resize(m.heads * max_ctx);
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
        const Input xin = input(xn.data());
        gemm(L.qkv, xin, B, qkv.data(), QKV, false, wide.data(), tid, nt, chunks);
        // Keys and values of every row first where rows share a sequence (drafts: a row attends over the rows
        // of its sequence before it); otherwise each task writes its own just before it attends (no barrier).
        int64_t t0, t1;
        if (rows_share) {
          share(B * kvh, 1, tid, nt, t0, t1);
          for (int64_t task = t0; task < t1; ++task) {
            const int64_t b = task / kvh, g = task % kvh;
            (m.bf16 ? write_kv<bf16_t> : write_kv<float>)(m, L, qkv.data() + b * QKV, cos + b * d, sin + b * d,
                                                          tables + b * width, pos[b], g, g + 1, qhk.data());
          }
#pragma omp barrier
        }
        // Tasks: whole rows (every KV head in one pass) when there are enough to share, else (row, KV head)
        // pairs.
        const bool by_item = B >= 2 * nt;
        share(by_item ? B : B * kvh, 1, tid, nt, t0, t1);
        for (int64_t task = t0; task < t1; ++task) {
          const int64_t b = by_item ? task : task / kvh, g0 = by_item ? 0 : task % kvh, g1 = by_item ? kvh : g0 + 1;
          if (!rows_share)
            (m.bf16 ? write_kv<bf16_t> : write_kv<float>)(m, L, qkv.data() + b * QKV, cos + b * d, sin + b * d,
                                                          tables + b * width, pos[b], g0, g1, qhk.data());
          (m.bf16 ? attend_heads<bf16_t> : attend_heads<float>)(
              m, L, qkv.data() + b * QKV, cos + b * d, sin + b * d, tables + b * width, pos[b], g0, g1,
              att.data() + b * Q + g0 * group * d, qhk.data(), scores);
        }
#pragma omp barrier
        gemm(L.o, input(att.data()), B, x.data(), H, true, wide.data(), tid, nt, chunks);  // x += o(att)
        rms_norm_rows(x.data(), L.post_norm, m.eps, B, H, xn.data(), tid, nt);
        if (L.gate.kind == 3 || L.up.kind == 3) quantize_rows(xin, B, H, tid, nt);  // once for both
        if (L.gate.kind == kBlockKind || L.up.kind == kBlockKind) {
          bool by32 = false, by256 = false;
          forms_read(L.gate, by32, by256);
          forms_read(L.up, by32, by256);
          quantize_rows_q8(by32, by256, xin, B, H, tid, nt);
        }
        // gate, up and SiLU(gate) * up on a range of columns at a time: no barrier between
        auto mlp_in = [&](int64_t n0, int64_t n1) {
          gemm_part(L.gate, xin, B, gate.data(), I, n0, n1, false, wide.data());
          gemm_part(L.up, xin, B, up.data(), I, n0, n1, false, wide.data());
          for (int64_t b = 0; b < B; ++b) silu_mul(gate.data() + b * I, up.data() + b * I, n0, n1);
        };
        if (L.gate.kind == kBlockKind && L.up.kind == kBlockKind) {
          chunks.run(I, 8, tid, nt, mlp_in);  // (whole groups of repacked rows)
        } else {
          int64_t n0, n1;
          share(I, L.gate.kind == kBlockKind || L.up.kind == kBlockKind ? 8 : 4, tid, nt, n0, n1);
          if (n0 < n1) mlp_in(n0, n1);
        }
#pragma omp barrier
        gemm(L.down, input(gate.data()), B, x.data(), H, true, wide.data(), tid, nt, chunks);  // x += down(mid)
      }
      int64_t rows = B;  // the rows whose logits are wanted, moved to the front in order (gemm ended in a barrier)
      if (head_rows != nullptr) {
#pragma omp single
        for (int64_t i = 0; i < n_head; ++i)  // ascending: row i's source is at or after i
          if (head_rows[i] != i) std::memcpy(x.data() + i * H, x.data() + head_rows[i] * H, H * sizeof(float));
        rows = n_head;  // (single ends in a barrier)
      }
      if (rows > 0) {
        rms_norm_rows(x.data(), m.final_norm, m.eps, rows, H, xn.data(), tid, nt);
        gemm(m.head, input(xn.data()), rows, logits, m.vocab, false, wide.data(), tid, nt, chunks);
      }
    }
  }
  return failed;
}
