#include "kvtransfer/kv_paths.h"

#include <spdlog/spdlog.h>

#include "kvtransfer/device_transports.h"
#include "kvtransfer/mpi_transport.h"
#include "kvtransfer/staged_transport.h"

namespace pd {

KvPaths::KvPaths(std::unique_ptr<Transport> mpi) { paths_[KvPath::kMpi] = std::move(mpi); }

void KvPaths::add(KvPath path, std::unique_ptr<Transport> transport) {
  if (path == KvPath::kMpi || transport == nullptr) return;
  paths_[path] = std::move(transport);
}

std::string KvPaths::name() const {
  std::string n;
  for (const auto& [path, t] : paths_) n += (n.empty() ? "" : "+") + t->name();
  return n;
}

std::vector<KvPath> KvPaths::paths() const {
  std::vector<KvPath> out;
  for (const auto& [path, t] : paths_) out.push_back(path);
  return out;
}

Status KvPaths::select_path(int peer, const KvPathChoice& choice) {
  if (!paths_.count(choice.path))
    return Status::unsupported(std::string("no ") + kv_path_name(choice.path) + " path in this process (it has " +
                               name() + ") for KV with rank " + std::to_string(peer));
  const auto [it, fresh] = selected_.try_emplace(peer, choice.path);
  if (fresh || it->second != choice.path) {
    it->second = choice.path;
    spdlog::info("KV with rank {} takes the {} path: {}", peer, kv_path_name(choice.path), choice.why);
  }
  return Status::ok();
}

KvPath KvPaths::path_of(int peer) const {
  const auto it = selected_.find(peer);
  return it == selected_.end() ? KvPath::kMpi : it->second;
}

void KvPaths::bind_thread() {
  for (auto& [path, t] : paths_) t->bind_thread();
}

void KvPaths::progress() {
  for (auto& [path, t] : paths_) t->progress();
}

void KvPaths::forget_peer(int peer) {
  selected_.erase(peer);
  for (auto& [path, t] : paths_) t->forget_peer(peer);
}

Result<TransferOp> KvPaths::track(Transport* t, Result<TransferOp> op) {
  if (!op.is_ok()) return op.status();
  const int64_t id = next_++;
  ops_.emplace(id, Inner{t, *op});
  return TransferOp{id};
}

Result<TransferOp> KvPaths::post_send(int peer, int tag, const KvRegion& region) {
  Transport* t = paths_.at(path_of(peer)).get();
  return track(t, t->post_send(peer, tag, region));
}

Result<TransferOp> KvPaths::post_recv(int peer, int tag, const KvRegion& region) {
  Transport* t = paths_.at(path_of(peer)).get();
  return track(t, t->post_recv(peer, tag, region));
}

Result<TransferOp> KvPaths::post_send_bytes(int peer, int tag, const void* data, size_t bytes) {
  Transport* t = paths_.at(KvPath::kMpi).get();
  return track(t, t->post_send_bytes(peer, tag, data, bytes));
}

Result<TransferOp> KvPaths::post_recv_bytes(int peer, int tag, void* data, size_t bytes) {
  Transport* t = paths_.at(KvPath::kMpi).get();
  return track(t, t->post_recv_bytes(peer, tag, data, bytes));
}

Result<OpState> KvPaths::test(TransferOp op) {
  const auto it = ops_.find(op.value);
  if (it == ops_.end()) return Status::not_found("kv paths: unknown transfer op " + std::to_string(op.value));
  Result<OpState> r = it->second.transport->test(it->second.op);
  // The inner op is released once it reports an end (or an error for it).
  if (!r.is_ok() || *r != OpState::kPending) ops_.erase(it);
  return r;
}

Result<TransferOp> KvPaths::post_reclaim(int peer, int tag) {
  Transport* t = paths_.at(path_of(peer)).get();
  return track(t, t->post_reclaim(peer, tag));
}

void KvPaths::cancel(TransferOp op) {
  const auto it = ops_.find(op.value);
  if (it != ops_.end()) it->second.transport->cancel(it->second.op);
}

void KvPaths::abandon(TransferOp op) {
  const auto it = ops_.find(op.value);
  if (it == ops_.end()) return;
  it->second.transport->abandon(it->second.op);
  ops_.erase(it);
}

std::unique_ptr<KvPaths> make_kv_transport(std::shared_ptr<MpiLinks> links, Backend& backend, BackendBuffer& cache) {
  std::unique_ptr<Transport> mpi = std::make_unique<MpiTransport>(links);
  if (backend.device_memory()) mpi = std::make_unique<StagedTransport>(std::move(mpi), backend, cache);
  auto paths = std::make_unique<KvPaths>(std::move(mpi));
  for (DeviceTransport& d : make_device_transports(links, backend, cache)) paths->add(d.path, std::move(d.transport));
  spdlog::info("KV transport paths: {}", paths->name());
  return paths;
}

}  // namespace pd
