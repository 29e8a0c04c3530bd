// Rank ids and the MPI links behind them.
//
// Every rank of a cluster has an id. The ranks of the launching mpirun keep
// their MPI_COMM_WORLD ranks as ids. A rank started later by another mpirun
// (an elastic pool, docs/CLUSTER.md) joins through MPI ports: it connects to
// the router's port, gets the next free id, then connects to the port of each
// worker it will exchange KV with. Each such link is an intercommunicator
// between exactly two processes (MPI_Comm_connect/accept over MPI_COMM_SELF),
// so either side can leave or die without a collective call involving anyone
// else; a link is freed (MPI_Comm_free, never a blocking disconnect) when its
// peer leaves.
//
// The control channel and the KV transport share one MpiLinks and address
// ranks by id only. A link accepted by a worker is bound to an id by the
// first message on it (a Hello naming the joiner); until then it has a
// provisional (negative) id. The router's links are given ids as they are
// accepted (it is the one that hands ids out).
//
// Threading: accepting needs MPI_THREAD_MULTIPLE (mpi_init(.., true)): a
// background thread blocks in MPI_Comm_accept and hands each link to the
// owner's thread through take_accepted(). Everything else belongs to the
// owner's thread (the engine loop / the router's link thread).
#pragma once

#include <mpi.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "util/status.h"

namespace pd {

class MpiLinks {
 public:
  struct Endpoint {
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = -1;  // in comm (its remote group for an intercommunicator)
  };
  // A link's provisional ids are below this (bound or given a real id later).
  static constexpr int kProvisionalBase = -2;

  // World rank r has id world_ids[r]; empty = the identity (the launching job).
  explicit MpiLinks(std::vector<int> world_ids = {});
  ~MpiLinks();
  MpiLinks(const MpiLinks&) = delete;
  MpiLinks& operator=(const MpiLinks&) = delete;

  std::optional<Endpoint> endpoint(int id) const;
  void set_world_ids(std::vector<int> ids);

  // Opens this process's port (MPI_Open_port) and starts the accept thread.
  // `assign_from` >= 0 (the router): accepted links get ids from there up;
  // otherwise provisional ids until bind(). Every accepted link must prove
  // the cluster secret in `secret_path` before it counts (the control
  // channel challenges it: protocol/mpi_channel.h, protocol/link_auth.h).
  Status listen(int assign_from, std::string secret_path);
  const std::string& port() const { return port_; }
  const std::string& secret_path() const { return secret_path_; }
  // Registers the links accepted since the last call; returns their ids.
  std::vector<int> take_accepted();
  // Gives a provisionally-numbered link its id. False if `provisional` is not
  // one, or `id` is negative or already reached another way (a joined rank's
  // link, or a rank of this process's MPI_COMM_WORLD).
  bool bind(int provisional, int id);

  // Connects to `port` (blocking: the other side's accept thread answers) and
  // registers the link under `id`. `id` may be provisional-free (>= 0) or
  // kProvisionalBase to get a provisional id. Returns the id.
  Result<int> connect(const std::string& port, int id);
  // Frees the link of a rank that left (MPI_Comm_free: pending operations
  // complete first; no handshake with the peer).
  void forget(int id);
  // Frees every intercommunicator (before MPI_Finalize).
  void close_all();

  // For the channel's probing: each link as (comm, id of source), the world
  // first. For the world, `id` is -1 and world_id() maps the source.
  struct Link {
    MPI_Comm comm;
    int id;
  };
  const std::vector<Link>& links() const { return links_; }
  int world_id(int world_rank) const;

 private:
  struct Shared;  // state the accept thread shares (outlives this object if the thread does)
  int register_link(MPI_Comm comm, int id);
  std::vector<int> world_ids_;
  mutable int world_size_ = -1;  // MPI_COMM_WORLD's, asked once
  std::vector<Link> links_;  // world first, then intercommunicators
  std::unordered_map<int, size_t> by_id_;  // intercommunicator ids -> links_ index
  std::string port_;
  std::string secret_path_;
  std::shared_ptr<Shared> shared_;
  int next_assigned_ = -1;
  int next_provisional_ = kProvisionalBase;
};

}  // namespace pd
