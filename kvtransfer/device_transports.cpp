#include "kvtransfer/device_transports.h"

#include <spdlog/spdlog.h>

#if PD_KV_CUDA
#include "kvtransfer/cuda_ipc_transport.h"
#endif
#if PD_KV_NCCL
#include "kvtransfer/nccl_transport.h"
#endif

namespace pd {

std::vector<DeviceTransport> make_device_transports(std::shared_ptr<MpiLinks> links, Backend& backend,
                                                    BackendBuffer& cache) {
  std::vector<DeviceTransport> out;
  if (!backend.device_memory()) return out;
#if PD_KV_CUDA
  if (auto t = CudaIpcTransport::create(links, backend.native_stream(), cache); t.is_ok())
    out.push_back({KvPath::kCudaIpc, std::move(*t)});
  else
    spdlog::warn("no cuda_ipc KV path: {}", t.status().to_string());
#endif
#if PD_KV_NCCL
  if (auto t = NcclTransport::create(links, backend.native_stream(), cache); t.is_ok())
    out.push_back({KvPath::kNccl, std::move(*t)});
  else
    spdlog::warn("no nccl KV path: {}", t.status().to_string());
#endif
  (void)links;
  (void)cache;
  return out;
}

}  // namespace pd
