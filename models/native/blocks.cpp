// The block formats' kernels (blocks.h) as torch ops, for the PyTorch forward (models/quant/blocks.py):
//
//   y = torch.ops.tandem.block_linear(x, blocks, kind, columns, bias)  # x [M, columns] float32 -> [M, rows]
//   w = torch.ops.tandem.block_dequant(blocks, kind, columns, out=None)  # -> float32 [rows, columns]
//   r = torch.ops.tandem.block_rows(blocks, kind, columns, ids)  # rows ids [n] -> float32 [n, columns]
//   p = torch.ops.tandem.block_repack(blocks, kind, columns)  # the rows repacked 8 by 8 (kind + 100)
//
// blocks: [rows, row bytes] uint8 in ggml's layout of `kind` (100 + ggml's type id). block_linear quantizes each
// row of x to int8 per block of 32 (as the decode step does) and multiplies in integers: the kernel of small
// calls (decode, drafts); large ones (prefill) dequantize and multiply in float32, where the cost of
// dequantizing is shared by many rows. Both on the executor's OpenMP threads (at::get_num_threads()).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "blocks.h"
#include "blocks_repack.h"
#include "gemm.h"

namespace {

using at::Tensor;

void check_blocks(const Tensor& w, int64_t kind, int64_t columns) {
  TORCH_CHECK_VALUE(blocks::is_block_kind(static_cast<int32_t>(kind)), "kind ", kind, " is no block format");
  const int32_t k = static_cast<int32_t>(kind);
  TORCH_CHECK_VALUE(columns > 0 && columns % blocks::block_weights(k) == 0, "columns (", columns,
                    ") must be a positive multiple of the format's ", blocks::block_weights(k), " weights per block");
  TORCH_CHECK_VALUE(w.device().is_cpu(), "blocks must be on the CPU, not ", w.device());
  TORCH_CHECK_TYPE(w.scalar_type() == at::kByte, "blocks must be uint8, not ", w.scalar_type());
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == blocks::row_bytes(k, columns), "blocks must be [rows, ",
                    blocks::row_bytes(k, columns), "] for ", columns, " columns, not ", w.sizes());
  TORCH_CHECK_VALUE(w.is_contiguous(), "blocks must be contiguous");
}

Tensor block_linear(const Tensor& x, const Tensor& w, int64_t kind, int64_t columns,
                    const std::optional<Tensor>& bias) {
  check_blocks(w, kind, columns);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                        x.size(1) == columns && x.is_contiguous(),
                    "x must be a contiguous float32 CPU tensor [M, ", columns, "], not ", x.scalar_type(), " ",
                    x.sizes());
  const int64_t M = x.size(0), N = w.size(0), K = columns;
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N &&
                          bias->is_contiguous() && bias->device().is_cpu(),
                      "bias must be a contiguous float32 CPU tensor [", N, "]");
    b = bias->data_ptr<float>();
  }
  Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> q(M * K);
  std::vector<float> dx(M * K / 32), dxs(M * K / 32);
  const int32_t k = static_cast<int32_t>(kind);
  const int64_t group = blocks::block_weights(k);  // the activations' quantization blocks (blocks.h)
  std::vector<int32_t> o16(group == 256 ? M * K / 16 : 0), bs2(group == 256 ? M * K / 64 : 0);
  const blocks::Q8 q8{q.data(), dx.data(), dxs.data(), o16.empty() ? nullptr : o16.data(),
                      bs2.empty() ? nullptr : bs2.data()};  // (o16, bs2: the K-quants' only)
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  std::atomic<int64_t> counters[3] = {0, 0, 0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t b0, b1;
    share(M * (K / group), 1, tid, nt, b0, b1);
    if (group == 256) blocks::quantize_q8_256(xp, q8, b0, b1);
    else blocks::quantize_q8(xp, q8, b0, b1);
#pragma omp barrier
    Chunks chunks(counters);  // (whole groups of repacked rows)
    chunks.run(N, 8, tid, nt, [&](int64_t n0, int64_t n1) {
      blocks::gemm_blocks(k, wp, 0, N, K, q8, M, n0, n1, BlockOut{yp, N, nullptr, b, false});
    });
  }
  return y;
}

// out: where to write (a caller's scratch, reused across calls: a fresh [N, columns] buffer per call costs a page
// fault per 4 KiB of it), else a new tensor.
Tensor block_dequant(const Tensor& w, int64_t kind, int64_t columns, const std::optional<Tensor>& out_) {
  check_blocks(w, kind, columns);
  const int64_t N = w.size(0);
  Tensor out = out_.has_value() ? *out_ : at::empty({N, columns}, w.options().dtype(at::kFloat));
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                        out.size(0) == N && out.size(1) == columns && out.is_contiguous(),
                    "out must be a contiguous float32 CPU tensor [", N, ", ", columns, "]");
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  float* op = out.data_ptr<float>();
  const int32_t k = static_cast<int32_t>(kind);
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
  for (int64_t r = 0; r < N; ++r) blocks::matrix_row_to_float(k, wp, r, N, columns, op + r * columns);
  return out;
}

// Rows `ids` [n] (int64) of the weight as float32 [n, columns]: an embedding lookup (either layout).
Tensor block_rows(const Tensor& w, int64_t kind, int64_t columns, const Tensor& ids) {
  check_blocks(w, kind, columns);
  TORCH_CHECK_VALUE(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
                    "ids must be a contiguous int64 CPU tensor [n]");
  const int64_t N = w.size(0), n = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < N, "row ", id[i], " of ", N, " rows");
  Tensor out = at::empty({n, columns}, w.options().dtype(at::kFloat));
  const auto* wp = static_cast<const uint8_t*>(w.data_ptr());
  float* op = out.data_ptr<float>();
  const int32_t k = static_cast<int32_t>(kind);
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static) if (n > 16)
  for (int64_t i = 0; i < n; ++i) blocks::matrix_row_to_float(k, wp, id[i], N, columns, op + i * columns);
  return out;
}

// The kind of a format's rows repacked 8 by 8 (blocks_x8.h), or 0 where it has none.
int64_t block_repacked_kind(int64_t kind) {
  return kind == blocks::Q4_0 || kind == blocks::Q8_0 || kind == blocks::Q4_K || kind == blocks::Q6_K ? kind + 100
                                                                                                        : 0;
}

// blocks [rows, row bytes] of a plain kind that has a repacked layout -> a new tensor of the same shape in it.
Tensor block_repack(const Tensor& w, int64_t kind, int64_t columns) {
  check_blocks(w, kind, columns);
  TORCH_CHECK_VALUE(block_repacked_kind(kind) != 0, "kind ", kind, " has no repacked layout");
  Tensor out = at::empty(w.sizes(), w.options());
  const int64_t groups = w.size(0) / 8;
  const auto* src = static_cast<const uint8_t*>(w.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const int32_t k = static_cast<int32_t>(kind);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    int64_t g0, g1;
    share(groups, 1, omp_get_thread_num(), omp_get_num_threads(), g0, g1);
    if (g0 < g1 || (g1 == groups && omp_get_thread_num() == 0 && groups == 0))
      blocks::repack_groups(k, src, w.size(0), columns, dst, g0, g1);
  }
  return out;
}

// The instructions the block kernels run on: "avx512vnni" where the CPU has AVX-512 VNNI, else "avx2".
std::string block_isa() { return tandem_block_isa == 1 ? "avx512vnni" : "avx2"; }

// Forces one (tests compare the two builds); "avx512vnni" is refused where the CPU lacks it.
void set_block_isa(const std::string& isa) {
  TORCH_CHECK_VALUE(isa == "avx2" || isa == "avx512vnni", "unknown block ISA ", isa, " (avx2, avx512vnni)");
  if (isa == "avx512vnni") {
    __builtin_cpu_init();
    TORCH_CHECK_VALUE(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw"),
                      "this CPU lacks AVX-512 VNNI");
  }
  tandem_block_isa = isa == "avx512vnni" ? 1 : 0;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("block_isa() -> str");
  m.def("set_block_isa(str isa) -> ()");
  m.def("block_linear(Tensor x, Tensor blocks, int kind, int columns, Tensor? bias=None) -> Tensor");
  m.def("block_dequant(Tensor blocks, int kind, int columns, Tensor(a!)? out=None) -> Tensor");
  m.def("block_repacked_kind(int kind) -> int");
  m.def("block_rows(Tensor blocks, int kind, int columns, Tensor ids) -> Tensor");
  m.def("block_repack(Tensor blocks, int kind, int columns) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("block_linear", &block_linear);
  m.impl("block_dequant", &block_dequant);
  m.impl("block_repack", &block_repack);
  m.impl("block_rows", &block_rows);
}

TORCH_LIBRARY_IMPL(tandem, CatchAll, m) {  // (no tensor arguments: no dispatch key to pick a kernel by)
  m.impl("block_isa", &block_isa);
  m.impl("set_block_isa", &set_block_isa);
  m.impl("block_repacked_kind", &block_repacked_kind);
}
