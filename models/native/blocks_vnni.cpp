// The block kernels (blocks.h) built for AVX-512 VNNI (+ VL, BW): the same code, the u8 x s8 products of a
// sub-block summed by one vpdpbusd instead of maddubs + madd (exactly: neither saturates in these formats'
// ranges, so both builds give the same bits). This file alone is compiled for those instructions (the pragma),
// and it runs only where the CPU has them: tandem_block_isa says which build runs (blocks.cpp's ops
// block_isa / set_block_isa read and force it; tests compare the two where the CPU can run both).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define TANDEM_BLOCKS_VNNI
#define TANDEM_BLOCKS_NS blocks_vnni
#include "blocks.h"

namespace {

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

}  // namespace

int tandem_block_isa = cpu_has_vnni() ? 1 : 0;

void tandem_vnni_gemm_blocks(int32_t kind, const uint8_t* w, int64_t row0, int64_t rows, int64_t k, const BlockQ8& x,
                             int64_t M, int64_t n0, int64_t n1, const BlockOut& out) {
  blocks_vnni::gemm_blocks_isa(kind, w, row0, rows, k, x, M, n0, n1, out);
}
