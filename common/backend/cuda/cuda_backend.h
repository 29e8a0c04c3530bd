// The CUDA backend: weights copied to device memory in their GGUF type,
// activations F32, everything enqueued on one stream owned by the backend.
//
// matmul: batches of at least gemm_min_rows rows dequantize the weight into an
// fp32 device panel and call cublasSgemm (F32 weights go to cuBLAS directly);
// smaller batches use a fused dequantize-dot kernel (one warp per output row).
// Every CUDA / cuBLAS failure comes back as a Status naming the call; nothing
// throws or aborts. Plain C++ header: no CUDA types.
#pragma once

#include <cstddef>
#include <memory>

#include "backend/backend.h"

namespace pd {

struct CudaBackendConfig {
  int device = 0;  // CUDA device ordinal
  // Batches with at least this many rows use dequantize + cuBLAS; smaller ones
  // the fused dequantize-dot kernel.
  int gemm_min_rows = 8;
  // Upper bound of the fp32 scratch panel a quantized weight is dequantized
  // into before cuBLAS; larger weights are processed in row panels.
  size_t max_panel_bytes = size_t{256} << 20;
  // cuBLAS GEMMs (batches of gemm_min_rows rows or more) on tensor cores in
  // TF32 (10-bit mantissa products, fp32 accumulation) instead of plain fp32.
  // Off by default: it changes outputs, and is chosen only on measured figures.
  bool tf32 = false;
};

// Unsupported when no CUDA device exists ("cuda: no CUDA device available
// (cudaGetDeviceCount: ...)"), when the ordinal is out of range, or when this
// binary carries no kernels for the device's architecture.
Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendConfig& cfg);
Result<std::unique_ptr<Backend>> make_cuda_backend(int device);
// CUDA devices this process sees (0 where none, or the driver is missing).
int cuda_device_count();

}  // namespace pd
