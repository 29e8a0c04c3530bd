#include "kvtransfer/kv_path.h"

#include <unistd.h>

#include <algorithm>
#include <climits>

namespace pd {

const char* kv_path_name(KvPath p) {
  switch (p) {
    case KvPath::kMpi: return "mpi";
    case KvPath::kNccl: return "nccl";
    case KvPath::kCudaIpc: return "cuda_ipc";
  }
  return "?";
}

namespace {

bool has(const proto::KvEndpoint& e, KvPath p) {
  return std::find(e.paths.begin(), e.paths.end(), kv_path_name(p)) != e.paths.end();
}
bool on_device(const proto::KvEndpoint& e) { return e.memory != "host"; }

}  // namespace

KvPathChoice choose_kv_path(const proto::KvEndpoint& s, const proto::KvEndpoint& r) {
  if (!on_device(s) && !on_device(r)) return {KvPath::kMpi, "host memory on both ends"};
  if (!on_device(s) || !on_device(r))
    return {KvPath::kMpi, std::string("host-staged: the ") + (on_device(s) ? "receiver" : "sender") +
                              "'s KV cache is in host memory"};
  if (s.memory != r.memory)
    return {KvPath::kMpi, "host-staged: the ends keep KV in different kinds of device memory (" + s.memory + ", " +
                              r.memory + ")"};
  const bool same_device = !s.device.empty() && s.device == r.device && s.host == r.host;
  if (same_device) {
    if (has(s, KvPath::kCudaIpc) && has(r, KvPath::kCudaIpc))
      return {KvPath::kCudaIpc, "both ends on device " + s.device + " of host " + s.host};
    return {KvPath::kMpi, "host-staged: both ends on device " + s.device + " but " +
                              (has(s, KvPath::kCudaIpc) ? std::string("the receiver") : std::string("the sender")) +
                              " has no cuda_ipc path"};
  }
  if (has(s, KvPath::kNccl) && has(r, KvPath::kNccl))
    return {KvPath::kNccl, "GPU to GPU (" + s.device + "@" + s.host + " -> " + r.device + "@" + r.host + ")"};
  return {KvPath::kMpi, std::string("host-staged: ") + (has(s, KvPath::kNccl) ? "the receiver" : "the sender") +
                            " has no nccl path"};
}

proto::KvEndpoint local_kv_endpoint(bool device_memory, const std::string& device_id,
                                    const std::vector<KvPath>& paths) {
  proto::KvEndpoint e;
  char host[HOST_NAME_MAX + 1] = {};
  if (gethostname(host, sizeof host - 1) == 0) e.host = host;
  e.memory = device_memory ? "cuda" : "host";
  e.device = device_memory ? device_id : "";
  for (KvPath p : paths)
    if (p != KvPath::kMpi) e.paths.push_back(kv_path_name(p));
  return e;
}

}  // namespace pd
