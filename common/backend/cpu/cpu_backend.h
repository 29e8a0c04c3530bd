// The CPU backend: weights used in place from the GGUF mapping (quantized),
// activations F32, GEMMs through OpenBLAS on dequantized weight panels for
// large batches and fused dequantize-dot kernels for small ones, OpenMP threads.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace pd {

struct CpuBackendConfig {
  int n_threads = 0;  // 0 = all cores
  // Batches with at least this many rows use dequantize + sgemm; smaller ones
  // use the fused dequantize-dot kernel (one weight stream for the batch).
  int gemm_min_rows = 8;
};

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendConfig& cfg);

}  // namespace pd
