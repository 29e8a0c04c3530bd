// Two-rank test of the MPI Transport (run: mpirun -np 2). Rank 0 sends a
// sequence's KV layer by layer out of blocks {3, 1, 4} of its cache; rank 1
// receives it straight into blocks {0, 5, 2} of its own, and checks every
// byte landed where the sequence's logical layout says, with the trailer and
// checksums. Then rank 1 cancels a receive whose data never comes and checks
// it completes as cancelled (the blocks may then be reused). Last, the host-staged
// path a GPU cache takes: contiguous bytes from a StagedTransport meet plain
// hindexed regions on the other rank, in both directions, byte-exact. And a
// tag reclaimed: what rank 0 left under it (a region, a message large enough
// for rendezvous, a small one) is taken up to its seal, and rank 1's next
// receive under the tag gets what rank 0 sent after the seal. Last, many
// receives in flight: one progress() tests them all (one MPI_Testsome), and
// the test() of each then costs no MPI call — each MPI test of a request in
// flight runs MPI's progress engine, which on a busy node yields the core.
// The control channel likewise tests its sends in flight with one call.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "kvtransfer/kv_region.h"
#include "mpi/mpi_test_support.h"
#include "kvtransfer/mpi_transport.h"
#include "kvtransfer/staged_transport.h"
#include "protocol/mpi_channel.h"
#include "protocol/mpi_thread_check.h"

namespace {

using pd::test::failures;
using pd::test::pattern;
using pd::test::wait;

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

  // Host-staged: rank 0's cache is a backend buffer behind a StagedTransport
  // (one contiguous buffer per layer on the wire); rank 1 stays plain. Layer
  // l goes 0 -> 1 under tag 2000 + l, then back 1 -> 0 under 3000 + l.
  {
    pd::BackendConfig bc;
    bc.n_threads = 1;
    auto backend = pd::create_backend(bc);
    EXPECT(backend.is_ok(), "cpu backend");
    if (!backend.is_ok()) MPI_Abort(MPI_COMM_WORLD, 1);
    auto buf = (*backend)->alloc(L.total_bytes());
    EXPECT(buf.is_ok(), "alloc");
    if (!buf.is_ok()) MPI_Abort(MPI_COMM_WORLD, 1);
    auto* staged_bytes = static_cast<uint8_t*>((*buf)->data());
    pd::StagedTransport staged(std::make_unique<pd::MpiTransport>(), **backend, **buf);
    const std::vector<int32_t> s_table{5, 0, 2}, p_table{1, 4, 3};
    std::vector<uint8_t> plain(L.total_bytes(), 0);
    for (size_t i = 0; i < L.total_bytes(); ++i) staged_bytes[i] = static_cast<uint8_t>(i * 13 + rank);
    for (int l = 0; l < L.n_layers; ++l) {
      if (rank == 0) {
        const pd::KvRegion r = pd::kv_layer_region(staged_bytes, L, l, s_table);
        auto op = staged.post_send(1, 2000 + l, r);
        EXPECT(op.is_ok() && wait(staged, *op) == pd::OpState::kDone, "staged send of layer %d", l);
        const uint64_t sum = pd::kv_region_checksum(r);
        MPI_Send(&sum, 1, MPI_UINT64_T, 1, 2500 + l, MPI_COMM_WORLD);
        const pd::KvRegion back = pd::kv_layer_region(staged_bytes, L, l, std::vector<int32_t>{3, 1, 4});
        auto rop = staged.post_recv(1, 3000 + l, back);
        EXPECT(rop.is_ok() && wait(staged, *rop) == pd::OpState::kDone, "staged receive of layer %d", l);
        uint64_t want = 0;
        MPI_Recv(&want, 1, MPI_UINT64_T, 1, 3500 + l, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        EXPECT(pd::kv_region_checksum(back) == want, "staged receive of layer %d landed different bytes", l);
      } else {
        const pd::KvRegion r = pd::kv_layer_region(plain.data(), L, l, p_table);
        auto op = t.post_recv(0, 2000 + l, r);
        EXPECT(op.is_ok() && wait(t, *op) == pd::OpState::kDone, "plain receive of layer %d", l);
        uint64_t want = 0;
        MPI_Recv(&want, 1, MPI_UINT64_T, 0, 2500 + l, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        EXPECT(pd::kv_region_checksum(r) == want, "plain receive of layer %d from a staged sender differs", l);
        for (size_t i = 0; i < plain.size(); ++i) plain[i] = static_cast<uint8_t>(plain[i] ^ (i * 3 + l));
        auto sop = t.post_send(0, 3000 + l, r);
        EXPECT(sop.is_ok() && wait(t, *sop) == pd::OpState::kDone, "plain send of layer %d", l);
        const uint64_t sum = pd::kv_region_checksum(r);
        MPI_Send(&sum, 1, MPI_UINT64_T, 0, 3500 + l, MPI_COMM_WORLD);
      }
    }
    EXPECT(staged.pending() == 0, "%zu staged operations still pending", staged.pending());
  }
  // Reclaiming a tag (Transport::post_reclaim): nothing of rank 0's under
  // tag 4000 has a receive; its empty seal follows, then a fresh message.
  {
    const int rtag = 4000;
    std::vector<uint8_t> fresh(32);
    for (size_t i = 0; i < fresh.size(); ++i) fresh[i] = static_cast<uint8_t>(i * 5 + 1);
    if (rank == 0) {
      std::vector<uint8_t> big(size_t{4} << 20, 0xab), small(64, 0xcd);
      std::vector<pd::TransferOp> ops;
      auto keep = [&](pd::Result<pd::TransferOp> op, const char* what) {
        EXPECT(op.is_ok(), "post %s under the reclaimed tag", what);
        if (op.is_ok()) ops.push_back(*op);
      };
      keep(t.post_send(1, rtag, pd::kv_layer_region(cache.data(), L, 0, table)), "a region");
      keep(t.post_send_bytes(1, rtag, big.data(), big.size()), "4 MiB");
      keep(t.post_send_bytes(1, rtag, small.data(), small.size()), "64 bytes");
      keep(t.post_send_bytes(1, rtag, nullptr, 0), "the seal");
      keep(t.post_send_bytes(1, rtag, fresh.data(), fresh.size()), "the next handoff's message");
      for (pd::TransferOp o : ops) EXPECT(wait(t, o) == pd::OpState::kDone, "a send under the reclaimed tag did not complete");
    } else {
      auto rec = t.post_reclaim(0, rtag);
      EXPECT(rec.is_ok(), "post_reclaim");
      if (rec.is_ok()) EXPECT(wait(t, *rec) == pd::OpState::kDone, "the reclaim did not take the seal");
      std::vector<uint8_t> got(fresh.size(), 0);
      auto op = t.post_recv_bytes(0, rtag, got.data(), got.size());
      EXPECT(op.is_ok() && wait(t, *op) == pd::OpState::kDone, "the receive after the reclaim");
      EXPECT(got == fresh, "the receive after the reclaim got a stale message");
      auto idle = t.post_reclaim(0, rtag + 1);  // nothing comes: cancelled
      EXPECT(idle.is_ok(), "post_reclaim (nothing sent)");
      if (idle.is_ok()) {
        t.cancel(*idle);
        EXPECT(wait(t, *idle) == pd::OpState::kCancelled, "a cancelled reclaim did not report kCancelled");
      }
      EXPECT(t.pending() == 0, "%zu operations still pending after the reclaims", t.pending());
    }
  }
  {
    // Many receives in flight (a long prompt's segments); rank 0 sends only
    // after rank 1 has counted what testing them costs.
    constexpr int kMany = 64, kTag = 5000;
    std::vector<std::vector<uint8_t>> bufs(kMany, std::vector<uint8_t>(256, 0));
    if (rank == 1) {
      std::vector<pd::TransferOp> ops;
      for (int i = 0; i < kMany; ++i) {
        auto op = t.post_recv_bytes(0, kTag + i, bufs[i].data(), bufs[i].size());
        EXPECT(op.is_ok(), "post_recv_bytes %d", i);
        if (op.is_ok()) ops.push_back(*op);
      }
      t.progress();
      const unsigned long before = pd::mpi_calls_on_this_thread();
      int pending = 0;
      for (pd::TransferOp o : ops) {
        auto r = t.test(o);
        pending += r.is_ok() && *r == pd::OpState::kPending;
      }
      const unsigned long swept = pd::mpi_calls_on_this_thread() - before;
      EXPECT(pending == kMany, "%d of %d receives nobody sent to were pending", pending, kMany);
      if (pd::mpi_thread_check_compiled())
        EXPECT(swept == 0, "testing %d receives after progress() made %lu MPI calls (want 0: one sweep)", kMany, swept);
      // Without a sweep since, test() asks MPI itself (a caller that never calls progress()).
      const unsigned long again = pd::mpi_calls_on_this_thread();
      for (pd::TransferOp o : ops) (void)t.test(o);
      if (pd::mpi_thread_check_compiled())
        EXPECT(pd::mpi_calls_on_this_thread() - again >= kMany, "test() without a sweep did not test");
      // One more nobody will send to, cancelled, ending alone among the 64 in
      // flight: a sweep reports each op's own status (MPI_Testsome gives the
      // k-th completed one's status at k, not at its index).
      std::vector<uint8_t> never(256, 0);
      auto cancelled = t.post_recv_bytes(0, kTag + kMany, never.data(), never.size());
      EXPECT(cancelled.is_ok(), "post_recv_bytes (never sent)");
      if (cancelled.is_ok()) {
        t.cancel(*cancelled);
        pd::OpState got = pd::OpState::kPending;
        for (int i = 0; i < 100000 && got == pd::OpState::kPending; ++i) {
          t.progress();
          auto r = t.test(*cancelled);
          if (!r.is_ok()) break;
          got = *r;
        }
        EXPECT(got == pd::OpState::kCancelled, "a cancelled receive swept alone ended %s",
               got == pd::OpState::kDone ? "done" : "pending or failed");
      }
      MPI_Barrier(MPI_COMM_WORLD);
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      std::vector<bool> done(ops.size(), false);
      size_t n_done = 0;
      while (n_done < ops.size() && std::chrono::steady_clock::now() < end) {
        t.progress();
        for (size_t i = 0; i < ops.size(); ++i) {
          if (done[i]) continue;
          auto r = t.test(ops[i]);
          EXPECT(r.is_ok(), "test of receive %zu failed", i);
          if (!r.is_ok() || *r == pd::OpState::kPending) {
            if (!r.is_ok()) done[i] = true, ++n_done;
            continue;
          }
          done[i] = true, ++n_done;
          EXPECT(*r == pd::OpState::kDone, "receive %zu ended cancelled", i);
        }
      }
      EXPECT(n_done == ops.size(), "%zu of %zu receives completed", n_done, ops.size());
      for (int i = 0; i < kMany; ++i)
        EXPECT(bufs[i] == std::vector<uint8_t>(256, static_cast<uint8_t>(i + 1)), "receive %d got other bytes", i);
      EXPECT(t.pending() == 0, "%zu operations pending after the swept receives", t.pending());
    } else {
      MPI_Barrier(MPI_COMM_WORLD);
      std::vector<pd::TransferOp> ops;
      for (int i = 0; i < kMany; ++i) {
        bufs[i].assign(256, static_cast<uint8_t>(i + 1));
        auto op = t.post_send_bytes(1, kTag + i, bufs[i].data(), bufs[i].size());
        EXPECT(op.is_ok(), "post_send_bytes %d", i);
        if (op.is_ok()) ops.push_back(*op);
      }
      for (pd::TransferOp o : ops) EXPECT(wait(t, o) == pd::OpState::kDone, "a send to a swept receive");
    }
  }
  {
    // Control messages large enough for rendezvous, sent before the peer
    // receives any: one progress() of the channel is one MPI call.
    constexpr int kMessages = 16;
    pd::MpiControlChannel ch;
    if (rank == 0) {
      pd::proto::PrefillRequest big;
      big.prompt.assign(20000, 7);
      for (int i = 0; i < kMessages; ++i) {
        big.id = 900 + i;
        ch.send(1, big);
      }
      const unsigned long before = pd::mpi_calls_on_this_thread();
      ch.progress();
      if (pd::mpi_thread_check_compiled())
        EXPECT(pd::mpi_calls_on_this_thread() - before == 1, "the channel's progress() with %zu sends in flight made %lu MPI calls",
               ch.pending_sends(), pd::mpi_calls_on_this_thread() - before);
      MPI_Barrier(MPI_COMM_WORLD);
      EXPECT(ch.flush(std::chrono::seconds(60)), "control sends did not complete");
    } else {
      MPI_Barrier(MPI_COMM_WORLD);
      int got = 0;
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (got < kMessages && std::chrono::steady_clock::now() < end)
        got += ch.receive([&](int source, pd::proto::Message& m) {
          EXPECT(source == 0 && std::holds_alternative<pd::proto::PrefillRequest>(m), "an unexpected control message");
        });
      EXPECT(got == kMessages, "%d of %d control messages arrived", got, kMessages);
    }
  }
  int mine = failures, total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("%s: %d failure(s)\n", total ? "FAIL" : "PASS", total);
  MPI_Finalize();
  return total ? 1 : 0;
}
