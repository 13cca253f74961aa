// The native decode step as a torch op (models/decode/native.py builds this file with decode_step.cpp through
// torch.utils.cpp_extension and calls it):
//
//   model = torch.classes.tandem.DecodeModel(embed, embed_kind, final_norm, norms, qk_norms, weights, kinds,
//                                            parts, scales, biases, k_cache, v_cache, heads, eps, attn_scale)
//                                            # once
//   logits = torch.ops.tandem.decode_step(model, token_ids, positions, block_tables, cos, sin)  # each step
//
// The tensors are the one description of the layout: a DecodeModel reads every size from them, checks each
// one's device, dtype, shape and contiguity against the others (the layout of decode_step.h), holds them (so
// the pointers it gives the step stay valid) and builds the step's structs once. The op checks the per-step
// tensors the same way, and the token ids, positions and block ids against the model and its KV pool, before
// the step reads anything through them. Bad input raises ValueError / TypeError naming the tensor; a failed
// scratch allocation raises torch.OutOfMemoryError, with nothing but this call's K/V slots written.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "blocks.h"
#include "decode_step.h"

namespace {

using at::Tensor;
using OptionalTensors = c10::List<std::optional<Tensor>>;

constexpr int kLinearsPerLayer = 5;  // qkv, o, gate, up, down (in this order in `weights`), then the LM head

// t: a contiguous CPU tensor of `dtype` with these sizes.
void check(const Tensor& t, const std::string& what, at::IntArrayRef sizes, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), what, " must be on the CPU, not ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, what, " must be ", dtype, ", not ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == sizes, what, " must have shape ", sizes, ", not ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), what, " must be contiguous");
}

int32_t weight_kind(at::ScalarType dtype, int64_t k, const std::string& what) {
  switch (dtype) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kChar: return k % 32 == 0 ? 3 : 2;  // integer dot products where the blocks of 32 fit (gemm.h)
    case at::kBFloat16: return 4;
    default: TORCH_CHECK_TYPE(false, what, ": no kernel for ", dtype, " weights (float32, float16, bfloat16, int8)");
  }
  return -1;
}

class DecodeModel : public torch::CustomClassHolder {
 public:
  // embed: [vocab, hidden] float32 / bfloat16 (embed_kind 0), or [vocab, row bytes] uint8 blocks of
  // embed_kind (blocks.h; the K/V pools are float32 then); norms: per layer (input, post-attention), [hidden]
  // float32; qk_norms: per layer (q, k), [head_dim] float32 or None; weights: per layer (qkv, o, gate, up,
  // down), then the LM head: parts[i] tensors for linear i, each [out, in] in a dtype (kinds[j] 0), or [rows,
  // row bytes] uint8 of block kind kinds[j] (a linear's block parts are consecutive row ranges); scales /
  // biases: one per linear, float32 [out] or None (scales: int8 weights only, and required there); k_cache /
  // v_cache: [layers, num_blocks, block_size, kv_heads, head_dim] in the embedding's dtype (float32 or bfloat16).
  DecodeModel(Tensor embed, int64_t embed_kind, Tensor final_norm, std::vector<Tensor> norms,
              OptionalTensors qk_norms, std::vector<Tensor> weights, std::vector<int64_t> kinds,
              std::vector<int64_t> parts, OptionalTensors scales, OptionalTensors biases, Tensor k_cache,
              Tensor v_cache, int64_t heads, double eps, double attn_scale) {
    TORCH_CHECK_VALUE(embed.dim() == 2, "embed must be [vocab, hidden], not ", embed.sizes());
    TORCH_CHECK_VALUE(embed_kind == 0 || blocks::is_block_kind(static_cast<int32_t>(embed_kind)),
                      "embed_kind ", embed_kind, " is no block format");
    TORCH_CHECK_TYPE(embed_kind != 0 || embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16,
                     "embed must be float32 or bfloat16, not ", embed.scalar_type());
    TORCH_CHECK_VALUE(k_cache.dim() == 5, "k_cache must be [layers, num_blocks, block_size, kv_heads, head_dim], not ",
                      k_cache.sizes());
    const int64_t vocab = embed.size(0), n_layers = k_cache.size(0);
    const int64_t kv_heads = k_cache.size(3), d = k_cache.size(4);
    const at::ScalarType kv_dtype = embed_kind ? at::kFloat : embed.scalar_type();
    const int64_t hidden = embed_kind ? final_norm.numel() : embed.size(1);
    if (embed_kind) {
      TORCH_CHECK_VALUE(hidden % blocks::block_weights(static_cast<int32_t>(embed_kind)) == 0, "hidden (", hidden,
                        ") must be a multiple of the embedding's block size");
      check(embed, "embed", {vocab, blocks::row_bytes(static_cast<int32_t>(embed_kind), hidden)}, at::kByte);
    } else {
      check(embed, "embed", {vocab, hidden}, embed.scalar_type());
    }
    check(k_cache, "k_cache", k_cache.sizes(), kv_dtype);
    check(v_cache, "v_cache", k_cache.sizes(), kv_dtype);
    TORCH_CHECK_VALUE(kv_heads > 0 && heads > 0 && heads % kv_heads == 0, "heads (", heads,
                      ") must be a multiple of the cache's kv_heads (", kv_heads, ")");
    TORCH_CHECK_VALUE(d % 8 == 0 && hidden % 8 == 0, "head_dim (", d, ") and hidden (", hidden,
                      ") must be multiples of 8");
    const size_t n_linears = kLinearsPerLayer * n_layers + 1;
    TORCH_CHECK_VALUE(parts.size() == n_linears, "parts: one per linear (", kLinearsPerLayer,
                      " per layer of the cache's ", n_layers, " and the LM head), not ", parts.size());
    TORCH_CHECK_VALUE(kinds.size() == weights.size(), "kinds: one per weight tensor (", weights.size(), ")");
    std::vector<size_t> first(n_linears + 1, 0);  // linear i's tensors: weights[first[i] .. first[i + 1])
    for (size_t i = 0; i < n_linears; ++i) {
      TORCH_CHECK_VALUE(parts[i] >= 1 && parts[i] <= 3, "parts: 1 to 3 tensors per linear, not ", parts[i]);
      first[i + 1] = first[i] + static_cast<size_t>(parts[i]);
    }
    TORCH_CHECK_VALUE(first[n_linears] == weights.size(), "weights: the parts add up to ", first[n_linears],
                      " tensors, not ", weights.size());
    TORCH_CHECK_VALUE(static_cast<int64_t>(norms.size()) == 2 * n_layers &&
                          static_cast<int64_t>(qk_norms.size()) == 2 * n_layers,
                      "norms and qk_norms: two per layer of the cache's ", n_layers);
    TORCH_CHECK_VALUE(scales.size() == n_linears && biases.size() == n_linears,
                      "scales and biases: one per linear (", n_linears, ")");
    const int64_t q = heads * d, qkv = q + 2 * kv_heads * d;
    int64_t inter = 0;  // the gate's rows
    if (n_layers)
      for (size_t j = first[2]; j < first[3]; ++j) inter += weights[j].size(0);
    check(final_norm, "final_norm", {hidden}, at::kFloat);
    held_ = {embed, final_norm, k_cache, v_cache};

    auto linear = [&](size_t i, int64_t n, int64_t k, const std::string& what) {
      TORCH_CHECK_VALUE(k % 8 == 0, what, ": its input size (", k, ") must be a multiple of 8");
      const std::optional<Tensor> scale = scales[i], bias = biases[i];
      TdLinear out{};
      if (kinds[first[i]] != 0) {  // block formats: the parts' rows add up to n
        out.kind = kBlockKind, out.n = n, out.k = k, out.nparts = static_cast<int32_t>(parts[i]);
        int64_t rows = 0;
        for (size_t j = first[i]; j < first[i + 1]; ++j) {
          const int32_t kind = static_cast<int32_t>(kinds[j]);
          TORCH_CHECK_VALUE(blocks::is_block_kind(kind), what, ": kind ", kind, " is no block format");
          TORCH_CHECK_VALUE(k % blocks::block_weights(kind) == 0, what, ": its input size (", k,
                            ") is not a multiple of its blocks (", blocks::block_weights(kind), ")");
          const Tensor& w = weights[j];
          TORCH_CHECK_VALUE(w.dim() == 2, what, ": a block part must be [rows, row bytes], not ", w.sizes());
          check(w, what + ".weight part", {w.size(0), blocks::row_bytes(kind, k)}, at::kByte);
          out.parts[j - first[i]] = TdPart{kind, w.data_ptr(), w.size(0)};
          rows += w.size(0);
          held_.push_back(w);
        }
        TORCH_CHECK_VALUE(rows == n, what, ": its parts have ", rows, " rows, not ", n);
        TORCH_CHECK_VALUE(!scale.has_value(), what, ": block formats take no scales");
      } else {
        TORCH_CHECK_VALUE(parts[i] == 1, what, ": only block formats come in parts");
        const Tensor& w = weights[first[i]];
        check(w, what + ".weight", {n, k}, w.scalar_type());
        out = TdLinear{weight_kind(w.scalar_type(), k, what), w.data_ptr(), nullptr, nullptr, n, k};
        held_.push_back(w);
        TORCH_CHECK_VALUE(scale.has_value() == (w.scalar_type() == at::kChar), what,
                          scale ? ": only int8 weights take scales" : ": int8 weights need their per-row scales");
      }
      if (scale) {
        check(*scale, what + ".scale", {n}, at::kFloat);
        out.scale = scale->data_ptr<float>();
        held_.push_back(*scale);
      }
      if (bias) {
        check(*bias, what + ".bias", {n}, at::kFloat);
        out.bias = bias->data_ptr<float>();
        held_.push_back(*bias);
      }
      return out;
    };
    auto norm = [&](const Tensor& t, int64_t n, const std::string& what) {
      check(t, what, {n}, at::kFloat);
      held_.push_back(t);
      return t.data_ptr<float>();
    };

    layers_.resize(n_layers);
    for (int64_t l = 0; l < n_layers; ++l) {
      const std::string name = "layer " + std::to_string(l) + " ";
      const size_t w0 = kLinearsPerLayer * l;  // the layer's first linear
      TdLayer& L = layers_[l];
      L.in_norm = norm(norms[2 * l], hidden, name + "input norm");
      L.post_norm = norm(norms[2 * l + 1], hidden, name + "post-attention norm");
      const std::optional<Tensor> qn = qk_norms[2 * l], kn = qk_norms[2 * l + 1];
      L.q_norm = qn ? norm(*qn, d, name + "q norm") : nullptr;
      L.k_norm = kn ? norm(*kn, d, name + "k norm") : nullptr;
      L.qkv = linear(w0, qkv, hidden, name + "qkv");
      L.o = linear(w0 + 1, hidden, q, name + "o");
      L.gate = linear(w0 + 2, inter, hidden, name + "gate");
      L.up = linear(w0 + 3, inter, hidden, name + "up");
      L.down = linear(w0 + 4, hidden, inter, name + "down");
      L.k_pool = k_cache.select(0, l).data_ptr();
      L.v_pool = v_cache.select(0, l).data_ptr();
    }
    m_ = TdModel{hidden, heads, kv_heads, d, inter, vocab, n_layers, k_cache.size(2), static_cast<float>(eps),
                 static_cast<float>(attn_scale), embed.data_ptr(), final_norm.data_ptr<float>(),
                 linear(n_linears - 1, vocab, hidden, "lm_head"), layers_.data(),
                 embed_kind == 0 && embed.scalar_type() == at::kBFloat16, static_cast<int32_t>(embed_kind)};
    num_blocks_ = k_cache.size(1);
  }

  const TdModel& model() const { return m_; }
  int64_t num_blocks() const { return num_blocks_; }

 private:
  std::vector<Tensor> held_;  // every tensor m_ points into
  std::vector<TdLayer> layers_;
  TdModel m_{};
  int64_t num_blocks_ = 0;
};

// token_ids, positions: [B] int64; block_tables: [B, width] int64 (row b's position t in block
// block_tables[b][t / block_size], already reserved for it); cos, sin: [B, head_dim] float32 (the rotary
// of each row's position). Writes each row's K/V at its position; returns float32 logits [B, vocab]. Adjacent
// rows of one sequence (drafts: its table repeated, consecutive positions) each see the K/V of those before them.
Tensor decode_step(const c10::intrusive_ptr<DecodeModel>& model, const Tensor& token_ids, const Tensor& positions,
                   const Tensor& block_tables, const Tensor& cos, const Tensor& sin,
                   const std::optional<Tensor>& head_rows) {
  const TdModel& m = model->model();
  TORCH_CHECK_VALUE(token_ids.dim() == 1, "token_ids must be [B], not ", token_ids.sizes());
  const int64_t B = token_ids.size(0);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.size(1) > 0,
                    "block_tables must be [B=", B, ", width >= 1], not ", block_tables.sizes());
  const int64_t width = block_tables.size(1);
  check(token_ids, "token_ids", {B}, at::kLong);
  check(positions, "positions", {B}, at::kLong);
  check(block_tables, "block_tables", {B, width}, at::kLong);
  check(cos, "cos", {B, m.head_dim}, at::kFloat);
  check(sin, "sin", {B, m.head_dim}, at::kFloat);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // everything the step reads through an index, checked first
    TORCH_CHECK_VALUE(ids[b] >= 0 && ids[b] < m.vocab, "token ids must be in [0, ", m.vocab, "), not ", ids[b]);
    TORCH_CHECK_VALUE(pos[b] >= 0 && pos[b] / m.block_size < width, "item ", b, "'s position ", pos[b],
                      " is not covered by its block table (width ", width, ", block size ", m.block_size, ")");
    for (int64_t j = 0; j <= pos[b] / m.block_size; ++j) {
      const int64_t block = tables[b * width + j];
      TORCH_CHECK_VALUE(block >= 0 && block < model->num_blocks(), "item ", b, "'s block table names block ",
                        block, " of a pool of ", model->num_blocks());
    }
  }
  const int64_t* rows = nullptr;  // head_rows: [n] int64, ascending, each < B: the logits of those rows only
  int64_t n_head = B;
  if (head_rows.has_value()) {
    TORCH_CHECK_VALUE(head_rows->dim() == 1, "head_rows must be [n], not ", head_rows->sizes());
    n_head = head_rows->size(0);
    check(*head_rows, "head_rows", {n_head}, at::kLong);
    rows = head_rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < n_head; ++i)
      TORCH_CHECK_VALUE(rows[i] >= 0 && rows[i] < B && (i == 0 || rows[i] > rows[i - 1]),
                        "head_rows must be ascending row indices below ", B);
  }
  Tensor logits = at::empty({n_head, m.vocab}, token_ids.options().dtype(at::kFloat));
  if (B == 0) return logits;
  const int failed = tandem_decode_step(m, B, ids, pos, tables, width, cos.data_ptr<float>(), sin.data_ptr<float>(),
                                        rows, n_head, logits.data_ptr<float>(), at::get_num_threads());
  TORCH_CHECK_WITH(OutOfMemoryError, !failed, "the native decode step could not allocate its scratch memory");
  return logits;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.class_<DecodeModel>("DecodeModel")
      .def(torch::init<Tensor, int64_t, Tensor, std::vector<Tensor>, OptionalTensors, std::vector<Tensor>,
                       std::vector<int64_t>, std::vector<int64_t>, OptionalTensors, OptionalTensors, Tensor, Tensor,
                       int64_t, double, double>());
  m.def("decode_step(__torch__.torch.classes.tandem.DecodeModel model, Tensor token_ids, Tensor positions, "
        "Tensor block_tables, Tensor cos, Tensor sin, Tensor? head_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("decode_step", &decode_step); }
