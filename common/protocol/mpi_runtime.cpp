#include "protocol/mpi_runtime.h"

#include <mpi.h>
#include <spdlog/spdlog.h>

#include <cstdlib>
#include <string>
#include <thread>

namespace pd {

Status mpi_init(int* argc, char*** argv, bool elastic) {
  int provided = 0;
  // SERIALIZED: a worker's MPI calls are made by its communication thread, not
  // by the thread that called MPI_Init (kvtransfer/comm_side.h).
  const int need = elastic ? MPI_THREAD_MULTIPLE : MPI_THREAD_SERIALIZED;
  if (MPI_Init_thread(argc, argv, need, &provided) != MPI_SUCCESS)
    return Status::internal("MPI_Init_thread failed");
  if (provided < need)
    return Status::unsupported("the MPI library provides thread level " + std::to_string(provided) +
                               ", pdcluster needs " + (elastic ? "MPI_THREAD_MULTIPLE (elastic pools)"
                                                               : "MPI_THREAD_SERIALIZED"));
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return Status::ok();
}

void mpi_finalize_bounded(int code, std::chrono::seconds limit) {
  std::thread([code, limit] {
    std::this_thread::sleep_for(limit);
    spdlog::warn("MPI_Finalize did not return within {} s (a rank of the job is gone); exiting without it",
                 limit.count());
    spdlog::default_logger()->flush();
    std::_Exit(code);
  }).detach();
  MPI_Finalize();
}

}  // namespace pd
