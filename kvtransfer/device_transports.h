// The device KV transports this build and this process can use, for the
// workers to hand to their KvPaths. Compiled in every build; CUDA appears
// only in the .cpp, and only where the build has it.
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "kvtransfer/kv_path.h"
#include "kvtransfer/transport.h"
#include "protocol/mpi_links.h"

namespace pd {

struct DeviceTransport {
  KvPath path;
  std::unique_ptr<Transport> transport;
};

// The device paths for a KV cache in `cache` on `backend`: none for a
// host-memory backend or a build without CUDA; cuda_ipc with CUDA; nccl with
// NCCL too. A transport that cannot be made here (logged with why) is left out.
std::vector<DeviceTransport> make_device_transports(std::shared_ptr<MpiLinks> links, Backend& backend,
                                                    BackendBuffer& cache);

}  // namespace pd
