#include "protocol/mpi_links.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <mutex>
#include <thread>

namespace pd {

struct MpiLinks::Shared {
  std::string port;
  std::mutex mu;
  std::vector<MPI_Comm> accepted;  // guarded by mu
};

MpiLinks::MpiLinks(std::vector<int> world_ids) : world_ids_(std::move(world_ids)) {
  links_.push_back({MPI_COMM_WORLD, -1});
}

MpiLinks::~MpiLinks() {
  // The accept thread (if any) stays blocked in MPI_Comm_accept until the
  // process ends; MPI_Finalize does not wait for it. It only touches shared_.
}

void MpiLinks::set_world_ids(std::vector<int> ids) { world_ids_ = std::move(ids); }

int MpiLinks::world_id(int world_rank) const {
  if (world_ids_.empty()) return world_rank;
  return world_rank >= 0 && world_rank < static_cast<int>(world_ids_.size()) ? world_ids_[world_rank] : -1;
}

std::optional<MpiLinks::Endpoint> MpiLinks::endpoint(int id) const {
  if (auto it = by_id_.find(id); it != by_id_.end()) return Endpoint{links_[it->second].comm, 0};
  if (world_ids_.empty()) {
    if (world_size_ < 0) MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
    if (id >= 0 && id < world_size_) return Endpoint{MPI_COMM_WORLD, id};
    return std::nullopt;
  }
  for (size_t r = 0; r < world_ids_.size(); ++r)
    if (world_ids_[r] == id) return Endpoint{MPI_COMM_WORLD, static_cast<int>(r)};
  return std::nullopt;
}

Status MpiLinks::listen(int assign_from, std::string secret_path) {
  if (shared_) return Status::internal("MpiLinks::listen called twice");
  if (secret_path.empty()) return Status::invalid_argument("accepting joining ranks needs a cluster secret (--secret-file)");
  secret_path_ = std::move(secret_path);
  char name[MPI_MAX_PORT_NAME] = {};
  if (MPI_Open_port(MPI_INFO_NULL, name) != MPI_SUCCESS) return Status::internal("MPI_Open_port failed");
  port_ = name;
  next_assigned_ = assign_from;
  shared_ = std::make_shared<Shared>();
  shared_->port = port_;
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
  std::thread([s = shared_] {
    for (;;) {
      MPI_Comm inter = MPI_COMM_NULL;
      const auto started = std::chrono::steady_clock::now();
      if (MPI_Comm_accept(s->port.c_str(), MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter) != MPI_SUCCESS) {
        // An accept nobody answered ends after OpenMPI's own wait (PMIx's
        // lookup, 300 s): expected while no pool joins, so not a warning. One
        // that failed sooner was a joiner that died mid-handshake. Either
        // way, keep listening.
        const auto waited = std::chrono::steady_clock::now() - started;
        if (waited >= std::chrono::seconds(60))
          spdlog::debug("MPI_Comm_accept on {}: nobody joined within {} s; accepting again", s->port,
                        std::chrono::duration_cast<std::chrono::seconds>(waited).count());
        else
          spdlog::warn("MPI_Comm_accept on {} failed (a joiner left mid-handshake?); still accepting", s->port);
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        continue;
      }
      MPI_Comm_set_errhandler(inter, MPI_ERRORS_RETURN);
      std::lock_guard<std::mutex> lock(s->mu);
      s->accepted.push_back(inter);
    }
  }).detach();
  return Status::ok();
}

int MpiLinks::register_link(MPI_Comm comm, int id) {
  by_id_[id] = links_.size();
  links_.push_back({comm, id});
  return id;
}

std::vector<int> MpiLinks::take_accepted() {
  std::vector<int> ids;
  if (!shared_) return ids;
  std::vector<MPI_Comm> got;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    got.swap(shared_->accepted);
  }
  for (MPI_Comm c : got) ids.push_back(register_link(c, next_assigned_ >= 0 ? next_assigned_++ : next_provisional_--));
  return ids;
}

bool MpiLinks::bind(int provisional, int id) {
  // A real id, and one nobody has: not a joined rank's, not a world rank's
  // (a Hello claiming the router's id must not take the router's place).
  if (provisional > kProvisionalBase || id < 0 || by_id_.count(id) > 0 || endpoint(id).has_value()) return false;
  auto it = by_id_.find(provisional);
  if (it == by_id_.end()) return false;
  const size_t index = it->second;
  by_id_.erase(it);
  by_id_[id] = index;
  links_[index].id = id;
  return true;
}

Result<int> MpiLinks::connect(const std::string& port, int id) {
  if (id >= 0 && (by_id_.count(id) > 0 || endpoint(id).has_value()))
    return Status::invalid_argument("rank " + std::to_string(id) + " already has a link");
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
  MPI_Comm inter = MPI_COMM_NULL;
  if (MPI_Comm_connect(port.c_str(), MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter) != MPI_SUCCESS)
    return Status::io_error("MPI_Comm_connect to port '" + port + "' failed");
  MPI_Comm_set_errhandler(inter, MPI_ERRORS_RETURN);
  return register_link(inter, id >= 0 ? id : next_provisional_--);
}

void MpiLinks::forget(int id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return;
  const size_t index = it->second;
  MPI_Comm_free(&links_[index].comm);
  links_.erase(links_.begin() + static_cast<std::ptrdiff_t>(index));
  by_id_.clear();
  for (size_t i = 1; i < links_.size(); ++i) by_id_[links_[i].id] = i;
}

void MpiLinks::close_all() {
  for (size_t i = 1; i < links_.size(); ++i) MPI_Comm_free(&links_[i].comm);
  links_.resize(1);
  by_id_.clear();
}

}  // namespace pd
