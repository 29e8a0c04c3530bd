#include "protocol/mpi_thread_check.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace pd {
namespace {
thread_local bool t_compute = false;
thread_local unsigned long t_calls = 0;
}  // namespace

void mark_compute_thread(bool on) { t_compute = on; }
bool is_compute_thread() { return t_compute; }
unsigned long mpi_calls_on_this_thread() { return t_calls; }

#ifdef PD_MPI_THREAD_CHECK
bool mpi_thread_check_compiled() { return true; }

namespace {
void check(const char* call) {
  ++t_calls;
  if (!t_compute) return;
  std::fprintf(stderr,
               "pdcluster: %s called from a compute thread; only the rank's communication side may call MPI "
               "(kvtransfer/comm_side.h)\n",
               call);
  std::fflush(stderr);
  std::abort();
}
}  // namespace
#else
bool mpi_thread_check_compiled() { return false; }
#endif

}  // namespace pd

#ifdef PD_MPI_THREAD_CHECK
// The MPI calls this project makes, each checked, then passed to the library.
// (Defining MPI_X here overrides the library's weak MPI_X; PMPI_X is the real one.)
extern "C" {
#define PD_CHECKED(call) pd::check(#call)

int MPI_Isend(const void* buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm, MPI_Request* req) {
  PD_CHECKED(MPI_Isend);
  return PMPI_Isend(buf, count, type, dest, tag, comm, req);
}
int MPI_Irecv(void* buf, int count, MPI_Datatype type, int source, int tag, MPI_Comm comm, MPI_Request* req) {
  PD_CHECKED(MPI_Irecv);
  return PMPI_Irecv(buf, count, type, source, tag, comm, req);
}
int MPI_Send(const void* buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
  PD_CHECKED(MPI_Send);
  return PMPI_Send(buf, count, type, dest, tag, comm);
}
int MPI_Recv(void* buf, int count, MPI_Datatype type, int source, int tag, MPI_Comm comm, MPI_Status* st) {
  PD_CHECKED(MPI_Recv);
  return PMPI_Recv(buf, count, type, source, tag, comm, st);
}
int MPI_Iprobe(int source, int tag, MPI_Comm comm, int* flag, MPI_Status* st) {
  PD_CHECKED(MPI_Iprobe);
  return PMPI_Iprobe(source, tag, comm, flag, st);
}
int MPI_Probe(int source, int tag, MPI_Comm comm, MPI_Status* st) {
  PD_CHECKED(MPI_Probe);
  return PMPI_Probe(source, tag, comm, st);
}
int MPI_Test(MPI_Request* req, int* flag, MPI_Status* st) {
  PD_CHECKED(MPI_Test);
  return PMPI_Test(req, flag, st);
}
int MPI_Testsome(int count, MPI_Request reqs[], int* outcount, int indices[], MPI_Status statuses[]) {
  PD_CHECKED(MPI_Testsome);
  return PMPI_Testsome(count, reqs, outcount, indices, statuses);
}
int MPI_Wait(MPI_Request* req, MPI_Status* st) {
  PD_CHECKED(MPI_Wait);
  return PMPI_Wait(req, st);
}
int MPI_Cancel(MPI_Request* req) {
  PD_CHECKED(MPI_Cancel);
  return PMPI_Cancel(req);
}
int MPI_Request_free(MPI_Request* req) {
  PD_CHECKED(MPI_Request_free);
  return PMPI_Request_free(req);
}
int MPI_Type_create_hindexed_block(int count, int blocklength, const MPI_Aint displs[], MPI_Datatype old,
                                   MPI_Datatype* type) {
  PD_CHECKED(MPI_Type_create_hindexed_block);
  return PMPI_Type_create_hindexed_block(count, blocklength, displs, old, type);
}
int MPI_Type_commit(MPI_Datatype* type) {
  PD_CHECKED(MPI_Type_commit);
  return PMPI_Type_commit(type);
}
int MPI_Type_free(MPI_Datatype* type) {
  PD_CHECKED(MPI_Type_free);
  return PMPI_Type_free(type);
}
int MPI_Comm_free(MPI_Comm* comm) {
  PD_CHECKED(MPI_Comm_free);
  return PMPI_Comm_free(comm);
}
int MPI_Comm_connect(const char* port, MPI_Info info, int root, MPI_Comm comm, MPI_Comm* out) {
  PD_CHECKED(MPI_Comm_connect);
  return PMPI_Comm_connect(port, info, root, comm, out);
}
int MPI_Barrier(MPI_Comm comm) {
  PD_CHECKED(MPI_Barrier);
  return PMPI_Barrier(comm);
}
int MPI_Allgather(const void* sbuf, int scount, MPI_Datatype stype, void* rbuf, int rcount, MPI_Datatype rtype,
                  MPI_Comm comm) {
  PD_CHECKED(MPI_Allgather);
  return PMPI_Allgather(sbuf, scount, stype, rbuf, rcount, rtype, comm);
}
int MPI_Allreduce(const void* sbuf, void* rbuf, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  PD_CHECKED(MPI_Allreduce);
  return PMPI_Allreduce(sbuf, rbuf, count, type, op, comm);
}

#undef PD_CHECKED
}  // extern "C"
#endif
