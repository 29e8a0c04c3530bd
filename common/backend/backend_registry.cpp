// The one place in core code that knows which optional backends were built.
#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#ifdef PD_USE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace pd {

std::vector<std::string> available_backends() {
  std::vector<std::string> kinds{"cpu"};
#ifdef PD_USE_CUDA
  kinds.push_back("cuda");
#endif
  return kinds;
}

int backend_device_count(const std::string& kind) {
  if (kind == "cpu") return 1;
#ifdef PD_USE_CUDA
  if (kind == "cuda") return cuda_device_count();
#endif
  return 0;
}

Result<std::unique_ptr<Backend>> create_backend(const BackendConfig& cfg) {
  if (cfg.kind == "cpu") {
    CpuBackendConfig c;
    c.n_threads = cfg.n_threads;
    c.batch_invariant = cfg.batch_invariant;
    c.int8_activations = cfg.int8_activations;
    return make_cpu_backend(c);
  }
  if (cfg.kind == "cuda") {
#ifdef PD_USE_CUDA
    CudaBackendConfig c;
    c.device = cfg.device;
    c.tf32 = cfg.cuda_tf32;
    return make_cuda_backend(c);
#else
    return Status::unsupported("backend 'cuda' was not built into this binary (no CUDA toolkit at configure time)");
#endif
  }
  return Status::invalid_argument("unknown backend '" + cfg.kind + "' (expected cpu or cuda)");
}

Status check_kv_pieces(size_t cache_bytes, std::span<const int64_t> offsets, size_t piece_bytes, const char* op) {
  for (int64_t off : offsets)
    if (off < 0 || static_cast<size_t>(off) > cache_bytes || cache_bytes - static_cast<size_t>(off) < piece_bytes)
      return Status::invalid_argument(std::string(op) + ": piece at byte " + std::to_string(off) + " of " +
                                      std::to_string(piece_bytes) + " bytes lies outside the cache (" +
                                      std::to_string(cache_bytes) + " bytes)");
  return Status::ok();
}

Status Backend::kv_gather(const BackendBuffer& cache, std::span<const int64_t> offsets, size_t piece_bytes,
                          void* host) {
  PD_RETURN_IF_ERROR(check_kv_pieces(cache.size(), offsets, piece_bytes, "kv_gather"));
  PD_RETURN_IF_ERROR(synchronize());
  const auto* base = static_cast<const uint8_t*>(const_cast<BackendBuffer&>(cache).data());
  auto* out = static_cast<uint8_t*>(host);
  for (size_t i = 0; i < offsets.size(); ++i) std::memcpy(out + i * piece_bytes, base + offsets[i], piece_bytes);
  return Status::ok();
}

Status Backend::kv_scatter(BackendBuffer& cache, std::span<const int64_t> offsets, size_t piece_bytes,
                           const void* host) {
  PD_RETURN_IF_ERROR(check_kv_pieces(cache.size(), offsets, piece_bytes, "kv_scatter"));
  PD_RETURN_IF_ERROR(synchronize());
  auto* base = static_cast<uint8_t*>(cache.data());
  const auto* in = static_cast<const uint8_t*>(host);
  for (size_t i = 0; i < offsets.size(); ++i) std::memcpy(base + offsets[i], in + i * piece_bytes, piece_bytes);
  return Status::ok();
}

}  // namespace pd
