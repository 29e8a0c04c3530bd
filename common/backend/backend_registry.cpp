// The one place in core code that knows which optional backends were built.
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
    return make_cuda_backend(cfg.device);
#else
    return Status::unsupported("backend 'cuda' was not built into this binary (no CUDA toolkit at configure time)");
#endif
  }
  return Status::invalid_argument("unknown backend '" + cfg.kind + "' (expected cpu or cuda)");
}

}  // namespace pd
