// Two-rank test of the MPI Transport (run: mpirun -np 2). Rank 0 sends a
// sequence's KV layer by layer out of blocks {3, 1, 4} of its cache; rank 1
// receives it straight into blocks {0, 5, 2} of its own, and checks every
// byte landed where the sequence's logical layout says, with the trailer and
// checksums. Then rank 1 cancels a receive whose data never comes and checks
// it completes as cancelled (the blocks may then be reused).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "kvtransfer/kv_region.h"
#include "kvtransfer/mpi_transport.h"

namespace {

int failures = 0;
#define EXPECT(cond, ...)                                      \
  do {                                                         \
    if (!(cond)) {                                             \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                       \
      std::fprintf(stderr, "\n");                              \
      ++failures;                                              \
    }                                                          \
  } while (0)

// The byte a sequence holds at (layer, kind, logical block, offset in block).
uint8_t pattern(int layer, int kind, int logical_block, size_t i) {
  return static_cast<uint8_t>(layer * 131 + kind * 71 + logical_block * 29 + i * 7 + 1);
}

pd::OpState wait(pd::Transport& t, pd::TransferOp op) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < end) {
    auto r = t.test(op);
    if (!r.is_ok()) return pd::OpState::kPending;
    if (*r != pd::OpState::kPending) return *r;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return pd::OpState::kPending;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "run with mpirun -np 2\n");
    MPI_Finalize();
    return 2;
  }
  pd::KvCacheLayout L;
  L.n_layers = 4;
  L.n_kv_heads = 2;
  L.head_dim = 8;
  L.block_size = 4;
  L.num_blocks = 6;
  std::vector<uint8_t> cache(L.total_bytes(), 0);
  const std::vector<int32_t> table = rank == 0 ? std::vector<int32_t>{3, 1, 4} : std::vector<int32_t>{0, 5, 2};
  const int tag = 1234;
  pd::MpiTransport t;

  if (rank == 0) {
    for (int l = 0; l < L.n_layers; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (size_t b = 0; b < table.size(); ++b)
          for (size_t i = 0; i < L.block_bytes(); ++i) cache[L.offset(l, kind, table[b]) + i] = pattern(l, kind, b, i);
    std::vector<pd::TransferOp> ops;
    pd::KvTrailer trailer;
    trailer.first_token = 77;
    for (int l = 0; l < L.n_layers; ++l) {
      const pd::KvRegion r = pd::kv_layer_region(cache.data(), L, l, table);
      trailer.checksums.push_back(pd::kv_region_checksum(r));
      auto op = t.post_send(1, tag, r);
      EXPECT(op.is_ok(), "post_send layer %d: %s", l, op.status().to_string().c_str());
      if (op.is_ok()) ops.push_back(*op);
    }
    const auto bytes = trailer.serialize();
    auto op = t.post_send_bytes(1, tag, bytes.data(), bytes.size());
    EXPECT(op.is_ok(), "post_send_bytes");
    if (op.is_ok()) ops.push_back(*op);
    for (pd::TransferOp o : ops) EXPECT(wait(t, o) == pd::OpState::kDone, "send did not complete");
  } else {
    std::vector<pd::TransferOp> ops;
    for (int l = 0; l < L.n_layers; ++l) {
      auto op = t.post_recv(0, tag, pd::kv_layer_region(cache.data(), L, l, table));
      EXPECT(op.is_ok(), "post_recv layer %d", l);
      if (op.is_ok()) ops.push_back(*op);
    }
    std::vector<uint8_t> tbytes(pd::KvTrailer::serialized_size(L.n_layers));
    auto op = t.post_recv_bytes(0, tag, tbytes.data(), tbytes.size());
    EXPECT(op.is_ok(), "post_recv_bytes");
    if (op.is_ok()) ops.push_back(*op);
    for (pd::TransferOp o : ops) EXPECT(wait(t, o) == pd::OpState::kDone, "receive did not complete");
    auto trailer = pd::KvTrailer::deserialize(tbytes, L.n_layers);
    EXPECT(trailer.is_ok(), "trailer");
    if (trailer.is_ok()) {
      EXPECT(trailer->first_token == 77, "first token %d", trailer->first_token);
      for (int l = 0; l < L.n_layers; ++l)
        EXPECT(trailer->checksums[l] == pd::kv_region_checksum(pd::kv_layer_region(cache.data(), L, l, table)),
               "checksum of layer %d", l);
    }
    size_t wrong = 0;
    for (int l = 0; l < L.n_layers; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (size_t b = 0; b < table.size(); ++b)
          for (size_t i = 0; i < L.block_bytes(); ++i)
            wrong += cache[L.offset(l, kind, table[b]) + i] != pattern(l, kind, b, i);
    EXPECT(wrong == 0, "%zu bytes landed in the wrong place", wrong);
    // Blocks outside the table were not touched.
    size_t stray = 0;
    for (int l = 0; l < L.n_layers; ++l)
      for (int kind = 0; kind < 2; ++kind)
        for (int32_t blk : {1, 3, 4})
          for (size_t i = 0; i < L.block_bytes(); ++i) stray += cache[L.offset(l, kind, blk) + i] != 0;
    EXPECT(stray == 0, "%zu bytes written outside the sequence's blocks", stray);
    // A receive nobody sends to: cancel completes it as cancelled.
    auto lost = t.post_recv(0, tag + 1, pd::kv_layer_region(cache.data(), L, 0, table));
    EXPECT(lost.is_ok(), "post_recv (never sent)");
    if (lost.is_ok()) {
      t.cancel(*lost);
      EXPECT(wait(t, *lost) == pd::OpState::kCancelled, "cancelled receive did not report kCancelled");
    }
    EXPECT(t.pending() == 0, "%zu operations still pending", t.pending());
  }
  int mine = failures, total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("%s: %d failure(s)\n", total ? "FAIL" : "PASS", total);
  MPI_Finalize();
  return total ? 1 : 0;
}
