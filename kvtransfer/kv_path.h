// Which way a KV handoff travels between two ranks, chosen the same way on both
// ends from the two ranks' endpoints (exchanged in the handoff's offer and
// accept), so the choice needs no extra round trip and survives pools that
// grow and shrink.
//
//   host memory on both ends               -> mpi (derived datatypes, no copy)
//   device memory, same device (one GPU)   -> cuda_ipc (device-to-device copy
//                                             between the processes; NCCL
//                                             refuses two ranks on one GPU)
//   device memory on both, different GPUs,
//   both built with NCCL                   -> nccl (GPU to GPU)
//   anything else                          -> mpi; a device-memory end stages
//                                             through host memory (same bytes
//                                             on the wire as the plain path)
#pragma once

#include <string>
#include <vector>

#include "protocol/messages.h"

namespace pd {

enum class KvPath { kMpi = 0, kNccl = 1, kCudaIpc = 2 };

const char* kv_path_name(KvPath p);

struct KvPathChoice {
  KvPath path = KvPath::kMpi;
  std::string why;  // for the log: what made the choice
};

// Deterministic: both ends compute the same result from the same two endpoints.
KvPathChoice choose_kv_path(const proto::KvEndpoint& sender, const proto::KvEndpoint& receiver);

// This process's endpoint: its host name, where its KV cache lives
// ("host" or "cuda"), its device identity, and the device paths it can use.
proto::KvEndpoint local_kv_endpoint(bool device_memory, const std::string& device_id,
                                    const std::vector<KvPath>& paths);

}  // namespace pd
