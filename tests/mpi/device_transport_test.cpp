// GPU test of the device KV transports (label gpu), run with mpirun.
//   -np 2 (both ranks on one GPU): CudaIpcTransport. Rank 0 sends a sequence's
//     KV layer by layer out of blocks {3, 1, 4} of its device cache; rank 1
//     receives into blocks {0, 5, 2} of its own; every byte lands where the
//     layout says and nothing else is written. Then rank 1 cancels a receive
//     whose descriptor comes later: it is drained (the send completes, nothing
//     lands), and the next receive of the same peer still gets its data. A
//     size mismatch fails the receive naming both sizes; the send completes.
//   -np 1: NcclTransport sending to itself (a 1-rank communicator), blocks
//     {3, 1, 4} of each layer into blocks {0, 5, 2}, byte-exact.
// Exits 77, saying why, where no CUDA device (or no such path) exists.
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "kvtransfer/device_transports.h"
#include "kvtransfer/kv_region.h"
#include "mpi/mpi_test_support.h"

namespace {

using pd::test::failures;
using pd::test::pattern;
using pd::test::wait;

struct Cache {
  pd::KvCacheLayout L;
  std::unique_ptr<pd::BackendBuffer> buf;
  std::vector<uint8_t> host;
  void fill(const std::vector<int32_t>& table) {
    host.assign(L.total_bytes(), 0);
    for (int l = 0; l < L.n_layers; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (size_t b = 0; b < table.size(); ++b)
          for (size_t i = 0; i < L.block_bytes(); ++i) host[L.offset(l, kind, table[b]) + i] = pattern(l, kind, b, i);
    cudaMemcpy(buf->data(), host.data(), host.size(), cudaMemcpyHostToDevice);
  }
  void fetch() { cudaMemcpy(host.data(), buf->data(), host.size(), cudaMemcpyDeviceToHost); }
  pd::KvRegion region(int layer, const std::vector<int32_t>& table) {
    return pd::kv_layer_region(buf->data(), L, layer, table);
  }
  // Bytes of `table`'s blocks that differ from the pattern (as logical blocks 0..).
  size_t wrong(const std::vector<int32_t>& table) const {
    size_t n = 0;
    for (int l = 0; l < L.n_layers; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (size_t b = 0; b < table.size(); ++b)
          for (size_t i = 0; i < L.block_bytes(); ++i)
            n += host[L.offset(l, kind, table[b]) + i] != pattern(l, kind, b, i);
    return n;
  }
  size_t nonzero(const std::vector<int32_t>& blocks) const {
    size_t n = 0;
    for (int l = 0; l < L.n_layers; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (int32_t blk : blocks)
          for (size_t i = 0; i < L.block_bytes(); ++i) n += host[L.offset(l, kind, blk) + i] != 0;
    return n;
  }
};

pd::Transport* find(std::vector<pd::DeviceTransport>& ts, pd::KvPath path) {
  for (auto& t : ts)
    if (t.path == path) return t.transport.get();
  return nullptr;
}

void ipc_test(int rank, pd::Transport& t, Cache& c) {
  const std::vector<int32_t> send_table{3, 1, 4}, recv_table{0, 5, 2};
  const int tag = 1234;
  if (rank == 0) {
    c.fill(send_table);
    std::vector<pd::TransferOp> ops;
    for (int l = 0; l < c.L.n_layers; ++l) {
      auto op = t.post_send(1, tag, c.region(l, send_table));
      EXPECT(op.is_ok(), "post_send layer %d: %s", l, op.status().to_string().c_str());
      if (op.is_ok()) ops.push_back(*op);
    }
    for (pd::TransferOp o : ops) EXPECT(wait(t, o) == pd::OpState::kDone, "send did not complete");
    MPI_Barrier(MPI_COMM_WORLD);  // rank 1 has cancelled its tag + 1 receive
    // Drained by rank 1 (no receive), then one it does receive.
    auto late = t.post_send(1, tag + 1, c.region(0, send_table));
    auto next = t.post_send(1, tag + 2, c.region(1, send_table));
    EXPECT(late.is_ok() && next.is_ok(), "post_send (late, next)");
    if (late.is_ok()) EXPECT(wait(t, *late) == pd::OpState::kDone, "drained send did not complete");
    if (next.is_ok()) EXPECT(wait(t, *next) == pd::OpState::kDone, "send after the drained one did not complete");
    // A size mismatch: the receive fails, the send completes.
    auto big = t.post_send(1, tag + 3, c.region(2, send_table));
    EXPECT(big.is_ok(), "post_send (mismatch)");
    if (big.is_ok()) EXPECT(wait(t, *big) == pd::OpState::kDone, "mismatched send did not complete");
  } else {
    std::vector<pd::TransferOp> ops;
    for (int l = 0; l < c.L.n_layers; ++l) {
      auto op = t.post_recv(0, tag, c.region(l, recv_table));
      EXPECT(op.is_ok(), "post_recv layer %d: %s", l, op.status().to_string().c_str());
      if (op.is_ok()) ops.push_back(*op);
    }
    for (pd::TransferOp o : ops) EXPECT(wait(t, o) == pd::OpState::kDone, "receive did not complete");
    c.fetch();
    EXPECT(c.wrong(recv_table) == 0, "%zu bytes landed in the wrong place", c.wrong(recv_table));
    EXPECT(c.nonzero({1, 3, 4}) == 0, "%zu bytes written outside the sequence's blocks", c.nonzero({1, 3, 4}));

    const std::vector<int32_t> cancelled_table{1, 3, 4};
    auto lost = t.post_recv(0, tag + 1, c.region(0, cancelled_table));
    EXPECT(lost.is_ok(), "post_recv (cancelled)");
    if (lost.is_ok()) {
      t.cancel(*lost);
      EXPECT(wait(t, *lost) == pd::OpState::kCancelled, "cancelled receive did not report kCancelled");
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const std::vector<int32_t> next_table{5, 0, 2};  // layer 1, rewritten in another order
    cudaMemset(c.buf->data(), 0, c.host.size());
    cudaDeviceSynchronize();
    auto next = t.post_recv(0, tag + 2, c.region(1, next_table));
    EXPECT(next.is_ok(), "post_recv (next)");
    if (next.is_ok()) EXPECT(wait(t, *next) == pd::OpState::kDone, "receive after the drained one did not complete");
    c.fetch();
    size_t wrong = 0;
    for (int kind = 0; kind < 2; ++kind)
      for (size_t b = 0; b < next_table.size(); ++b)
        for (size_t i = 0; i < c.L.block_bytes(); ++i)
          wrong += c.host[c.L.offset(1, kind, next_table[b]) + i] != pattern(1, kind, b, i);
    EXPECT(wrong == 0, "%zu bytes wrong after the drained descriptor", wrong);
    EXPECT(c.nonzero({1, 3, 4}) == 0, "the drained descriptor wrote %zu bytes", c.nonzero({1, 3, 4}));

    auto small = t.post_recv(0, tag + 3, c.region(2, {0, 5}));
    EXPECT(small.is_ok(), "post_recv (mismatch)");
    if (small.is_ok()) {
      std::string err;
      EXPECT(wait(t, *small, &err) == pd::OpState::kPending && err.find("sent") != std::string::npos &&
                 err.find(std::to_string(6 * c.L.block_bytes())) != std::string::npos &&
                 err.find(std::to_string(4 * c.L.block_bytes())) != std::string::npos,
             "size mismatch not reported with both sizes: '%s'", err.c_str());
    }
  }
}

void nccl_self_test(int rank, pd::Transport& t, Cache& c) {
  const std::vector<int32_t> send_table{3, 1, 4}, recv_table{0, 5, 2};
  c.fill(send_table);
  std::vector<pd::TransferOp> ops;
  for (int l = 0; l < c.L.n_layers; ++l) {
    auto r = t.post_recv(rank, 77, c.region(l, recv_table));
    auto s = t.post_send(rank, 77, c.region(l, send_table));
    EXPECT(r.is_ok() && s.is_ok(), "post layer %d: %s %s", l, r.status().to_string().c_str(),
           s.status().to_string().c_str());
    if (r.is_ok()) ops.push_back(*r);
    if (s.is_ok()) ops.push_back(*s);
  }
  for (pd::TransferOp o : ops) EXPECT(wait(t, o) == pd::OpState::kDone, "nccl op did not complete");
  c.fetch();
  EXPECT(c.wrong(recv_table) == 0, "%zu bytes landed in the wrong place", c.wrong(recv_table));
  EXPECT(c.wrong(send_table) == 0, "the source blocks changed");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto skip = [&](const std::string& why) {
    if (rank == 0) std::printf("SKIP: %s\n", why.c_str());
    MPI_Finalize();
    return 77;
  };
  if (size != 1 && size != 2) {
    if (rank == 0) std::fprintf(stderr, "run with mpirun -np 1 (nccl) or -np 2 (cuda_ipc)\n");
    MPI_Finalize();
    return 2;
  }
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  int have = err == cudaSuccess && devices > 0, all = 0;
  MPI_Allreduce(&have, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all)
    return skip(err != cudaSuccess ? std::string("no CUDA device: ") + cudaGetErrorString(err) : "no CUDA device");

  auto backend = pd::create_backend(pd::BackendConfig{.kind = "cuda"});
  if (!backend.is_ok()) return skip("no CUDA backend: " + backend.status().to_string());
  Cache c;
  c.L.n_layers = 3;
  c.L.n_kv_heads = 2;
  c.L.head_dim = 64;
  c.L.block_size = 16;
  c.L.num_blocks = 6;
  c.L.dtype = pd::GgmlType::kF16;
  auto buf = (*backend)->alloc(c.L.total_bytes());
  if (!buf.is_ok()) {
    std::fprintf(stderr, "alloc: %s\n", buf.status().to_string().c_str());
    MPI_Finalize();
    return 1;
  }
  c.buf = std::move(*buf);
  cudaMemset(c.buf->data(), 0, c.L.total_bytes());
  cudaDeviceSynchronize();
  c.host.assign(c.L.total_bytes(), 0);
  auto links = std::make_shared<pd::MpiLinks>();
  auto transports = pd::make_device_transports(links, **backend, *c.buf);
  const pd::KvPath want = size == 2 ? pd::KvPath::kCudaIpc : pd::KvPath::kNccl;
  pd::Transport* t = find(transports, want);
  int found = t != nullptr, all_found = 0;
  MPI_Allreduce(&found, &all_found, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_found) return skip(std::string("no ") + pd::kv_path_name(want) + " transport in this build or process");

  if (size == 2)
    ipc_test(rank, *t, c);
  else
    nccl_self_test(rank, *t, c);
  EXPECT(t->pending() == 0, "%zu operations still pending", t->pending());

  int mine = failures, total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("%s (%s): %d failure(s)\n", total ? "FAIL" : "PASS", pd::kv_path_name(want), total);
  transports.clear();
  MPI_Finalize();
  return total ? 1 : 0;
}
