// The native decode step's view of a model: plain structs of pointers into tensors that op.cpp checked, and
// the step itself (decode_step.cpp). Nothing here knows torch; op.cpp is the only file that builds these.
//
// Layout (op.cpp checks every tensor against it when the model is described, and the per-step tensors
// each call):
// - activations and norms: float32, contiguous; embedding and KV cache float32, or both bfloat16 (TdModel.bf16:
//   a bfloat16 model; its activations are float32 here all the same, K/V are rounded to bfloat16 when written);
// - a linear weight is [n, k] row-major (out, in) in float32, float16 (kind 1), bfloat16 (kind 4) or int8 with
//   one float32 scale per output row (kind 2: float32 activations; kind 3: activations as two int8 digits per
//   block of 32, for integer dot products, see Input in gemm.h: k % 32 == 0); k % 8 == 0;
// - K/V pools per layer: [num_blocks, block_size, kv_heads, head_dim];
// - tables [B, width] int64 block ids; token t of item b is in block tables[b][t / bs] at t % bs;
// - cos / sin [B, head_dim]: rotary for each item's position (non-interleaved halves, as HF Llama/Qwen).
#pragma once

#include <cstdint>

// Rows of a linear layer in one of llama.cpp's block formats (blocks.h): [rows, row_bytes(kind, k)] uint8.
struct TdPart {
  int32_t kind;  // blocks::Kind (100 + ggml's type id)
  const void* w;
  int64_t rows;
};

struct TdLinear {
  int32_t kind;  // 0 float32, 1 float16, 2 int8 (+ scale), 3 int8 (+ scale) times int8 activations, 4 bfloat16;
                 // 100: block formats, in `parts` (consecutive row ranges: a fused q/k/v may mix formats)
  const void* w;       // [n, k] (kinds 0-4)
  const float* scale;  // [n] (int8) or null
  const float* bias;   // [n] or null
  int64_t n, k;
  int32_t nparts;      // kind 100: 1 to 3 parts whose rows add up to n
  TdPart parts[3];
};
constexpr int32_t kBlockKind = 100;

struct TdLayer {
  const float* in_norm;    // [hidden]
  const float* post_norm;  // [hidden]
  const float* q_norm;     // [head_dim] or null (Qwen3)
  const float* k_norm;     // [head_dim] or null
  TdLinear qkv, o, gate, up, down;
  void* k_pool;  // [num_blocks, block_size, kv_heads, head_dim], float32 or bfloat16 (TdModel.bf16)
  void* v_pool;
};

struct TdModel {
  int64_t hidden, heads, kv_heads, head_dim, inter, vocab, n_layers, block_size;
  float eps, attn_scale;
  const void* embed;        // [vocab, hidden], float32 or bfloat16 (bf16), or blocks of embed_kind
  const float* final_norm;  // [hidden]
  TdLinear head;
  const TdLayer* layers;
  int32_t bf16;  // 1: the embedding and the K/V pools are bfloat16
  int32_t embed_kind;  // 0: float32 / bfloat16 as bf16 says; else a blocks::Kind ([vocab, row bytes] uint8)
};

// One decode step of B rows, every layer, on `threads` OpenMP threads (torch's runtime: op.cpp passes
// at::get_num_threads()). ids, pos: [B]; tables: [B, width]; cos, sin: [B, head_dim]; logits: [B, vocab]
// (written), or with head_rows (n_head ascending row indices) [n_head, vocab]: the LM head of those rows only
// (a prompt chunk wants its last row's), each row's logits the same bits either way. A row is one token of a
// sequence; several adjacent rows may be one sequence's tokens (a step verifying drafts: the same table,
// consecutive positions), each attending over the positions up to its own, the others' K/V included, as if they
// came one step at a time. Inputs are trusted (op.cpp checked them). Returns 0, or 1 when scratch memory could
// not be allocated (nothing but this call's K/V slots written). Never throws.
int tandem_decode_step(const TdModel& m, int64_t B, const int64_t* ids, const int64_t* pos, const int64_t* tables,
                       int64_t width, const float* cos, const float* sin, const int64_t* head_rows, int64_t n_head,
                       float* logits, int threads);
