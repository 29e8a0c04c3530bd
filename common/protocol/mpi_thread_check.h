// Which threads may call MPI. A worker rank calls MPI from its communication
// side only (kvtransfer/comm_side.h); its compute side (the engine loop that
// runs passes) must never, or a long pass would stall every transfer and
// control message again. A thread marked here as a compute thread that calls
// one of the MPI functions the project uses aborts the process with a message
// naming the call (the functions are interposed through MPI's profiling
// interface: each checks, then calls its PMPI_ twin). The check is compiled in
// when PD_MPI_THREAD_CHECK is on (CMake option, default on: a thread-local read
// per MPI call).
#pragma once

namespace pd {

// Marks (or unmarks) the calling thread as a compute thread.
void mark_compute_thread(bool on);
bool is_compute_thread();

// While alive, the calling thread is a compute thread.
class ComputeThreadScope {
 public:
  ComputeThreadScope() : was_(is_compute_thread()) { mark_compute_thread(true); }
  ~ComputeThreadScope() { mark_compute_thread(was_); }
  ComputeThreadScope(const ComputeThreadScope&) = delete;
  ComputeThreadScope& operator=(const ComputeThreadScope&) = delete;

 private:
  bool was_;
};

// Whether the MPI functions are interposed in this build.
bool mpi_thread_check_compiled();

// MPI calls the calling thread has made through the interposed functions
// (always 0 when they are not compiled in): tests count what a code path
// costs in library calls — each test or probe of a request that has not
// ended runs MPI's progress engine, which may yield the core.
unsigned long mpi_calls_on_this_thread();

}  // namespace pd
