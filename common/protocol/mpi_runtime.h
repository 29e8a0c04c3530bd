// Starting and stopping MPI in a cluster process: the thread level the cluster
// needs, errors returned instead of aborting the job, and a finalize that a
// dead rank cannot hold up for ever.
#pragma once

#include <chrono>

#include "util/status.h"

namespace pd {

// MPI_Init_thread(SERIALIZED, or MULTIPLE for `elastic` ranks: their MpiLinks
// accept on a background thread) with an error naming what was provided
// instead; MPI_COMM_WORLD then returns errors instead of aborting the job, so
// one rank's death is this rank's to handle (mpirun --mca orte_enable_recovery 1).
Status mpi_init(int* argc, char*** argv, bool elastic = false);
// MPI_Finalize, bounded: with a rank of the job dead (mpirun --mca
// orte_enable_recovery 1), OpenMPI 4.1's finalize can wait for it for ever
// (seen about once in ten chaos runs). After `limit` the process exits with
// `code` without finishing it; mpirun then ends the job as usual.
void mpi_finalize_bounded(int code, std::chrono::seconds limit = std::chrono::seconds(5));

}  // namespace pd
