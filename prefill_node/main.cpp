// pd-prefill: one prefill rank of the cluster (see prefill_worker.h).
//   mpirun -np 1 pd-router CFG : -np P pd-prefill CFG : -np D pd-decode CFG
// The worker's loop is the compute side; every MPI call is made by the rank's
// communication side (kvtransfer/comm_side.h).
#include <spdlog/spdlog.h>

#include "kvtransfer/comm_side.h"
#include "kvtransfer/fault_injection_transport.h"
#include "kvtransfer/kv_paths.h"
#include "kvtransfer/send_budget.h"
#include "prefill_node/prefill_worker.h"
#include "protocol/mpi_channel.h"
#include "worker/worker_main.h"

int main(int argc, char** argv) {
  return pd::worker_main(argc, argv, pd::Role::kPrefill, [](const pd::ClusterConfig& cfg, const pd::RoleTable& roles,
                                                             std::shared_ptr<pd::Engine> engine,
                                                             std::shared_ptr<pd::MpiLinks> links) {
    auto transport = pd::make_kv_transport(links, *engine->backend, *engine->cache.buffer);
    pd::CommSideOptions opts;
    opts.router = roles.router;
    return pd::serve_with_comm_side<pd::PrefillWorker>(
        std::make_unique<pd::MpiControlChannel>(links),
        std::make_unique<pd::SendBudgetTransport>(pd::FaultInjectionTransport::from_env(std::move(transport))), opts, [&](std::unique_ptr<pd::ControlChannel> channel, std::unique_ptr<pd::Transport> port) {
          return std::make_unique<pd::PrefillWorker>(cfg, roles, std::move(engine), std::move(port),
                                                     std::move(channel));
        });
  });
}
