// The CPU backend: quantized weights repacked at load for integer kernels that
// multiply them by 8-bit activations (q8_kernels.h; AVX512-VNNI, AVX2 or
// portable, chosen at run time), attention and SiLU through the same kernel
// table, OpenMP threads. With int8_activations off, weights are used in
// place from the GGUF mapping against fp32 activations (cpu_kernels.h), and
// OpenBLAS sgemm on dequantized panels serves large batches when
// batch_invariant is off as well.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace pd {

struct CpuBackendConfig {
  int n_threads = 0;  // 0 = all cores
  // Batches with at least this many rows use dequantize + sgemm; smaller ones
  // use the fused dequantize-dot kernel (one weight stream for the batch).
  int gemm_min_rows = 8;
  // Every matmul row computed by the same row-dot kernel whatever the batch
  // size, so a sequence's logits (and greedy tokens) do not depend on what it
  // was batched with: the serving cluster needs this to match pd-generate
  // token for token under continuous batching and preemption. Off = the
  // sgemm path above gemm_min_rows (faster prefill, batch-dependent rounding).
  bool batch_invariant = true;
  // Quantized weights (Q4_0/Q4_1/Q8_0) repacked at load and multiplied by
  // activations quantized to 8 bits per 32-block, in integer arithmetic
  // (q8_kernels.h): the fast path, batch invariant. Off = fp32 activations
  // against the weights as stored (the reference path, slower).
  bool int8_activations = true;
};

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendConfig& cfg);

}  // namespace pd
