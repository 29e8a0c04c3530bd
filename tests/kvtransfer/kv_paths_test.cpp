// How KV travels between two ranks: the path both ends choose from their
// endpoints, the per-peer routing of KvPaths, and the host-staged transport a
// device-memory cache uses over MPI (here over the loopback network, with the
// CPU backend's copies standing in for the device's).
#include <catch2/catch.hpp>

#include <cstring>
#include <numeric>

#include "backend/backend.h"
#include "kvtransfer/kv_path.h"
#include "kvtransfer/kv_paths.h"
#include "kvtransfer/kv_region.h"
#include "kvtransfer/staged_transport.h"
#include "kvtransfer/loopback_transport.h"

namespace {

using pd::KvPath;
using pd::proto::KvEndpoint;

KvEndpoint host_end(const std::string& host) { return KvEndpoint{host, "host", "", {}}; }
KvEndpoint gpu_end(const std::string& host, const std::string& dev, std::vector<std::string> paths) {
  return KvEndpoint{host, "cuda", dev, std::move(paths)};
}

// Drives test() until the op leaves kPending (the loopback moves bytes when both sides are posted).
pd::OpState finish(pd::Transport& t, pd::TransferOp op) {
  for (int i = 0; i < 100; ++i) {
    auto r = t.test(op);
    REQUIRE(r.is_ok());
    if (*r != pd::OpState::kPending) return *r;
  }
  FAIL("transfer op never completed");
  return pd::OpState::kPending;
}

std::unique_ptr<pd::Backend> cpu() {
  pd::BackendConfig bc;
  bc.n_threads = 1;
  auto b = pd::create_backend(bc);
  REQUIRE(b.is_ok());
  return std::move(b).value();
}

}  // namespace

TEST_CASE("kv path: both ends choose the same path from the two endpoints", "[kvtransfer]") {
  const KvEndpoint h1 = host_end("a"), h2 = host_end("b");
  const KvEndpoint g0 = gpu_end("a", "GPU-0", {"nccl", "cuda_ipc"});
  const KvEndpoint g0_other_proc = gpu_end("a", "GPU-0", {"nccl", "cuda_ipc"});
  const KvEndpoint g1 = gpu_end("a", "GPU-1", {"nccl", "cuda_ipc"});
  const KvEndpoint g_remote = gpu_end("b", "GPU-7", {"nccl", "cuda_ipc"});
  const KvEndpoint g_no_nccl = gpu_end("b", "GPU-8", {"cuda_ipc"});
  const KvEndpoint g0_no_ipc = gpu_end("a", "GPU-0", {"nccl"});

  CHECK(pd::choose_kv_path(h1, h2).path == KvPath::kMpi);
  CHECK(pd::choose_kv_path(h1, h2).why == "host memory on both ends");
  // One end on a device: MPI, the device end staging.
  CHECK(pd::choose_kv_path(g0, h2).path == KvPath::kMpi);
  CHECK(pd::choose_kv_path(h1, g0).path == KvPath::kMpi);
  CHECK(pd::choose_kv_path(h1, g0).why.find("host-staged") == 0);
  // The same GPU: NCCL refuses two ranks on one device, so device-to-device copies.
  CHECK(pd::choose_kv_path(g0, g0_other_proc).path == KvPath::kCudaIpc);
  CHECK(pd::choose_kv_path(g0, g0_no_ipc).path == KvPath::kMpi);
  // Different GPUs, on this host or another: NCCL where both have it.
  CHECK(pd::choose_kv_path(g0, g1).path == KvPath::kNccl);
  CHECK(pd::choose_kv_path(g0, g_remote).path == KvPath::kNccl);
  CHECK(pd::choose_kv_path(g0, g_no_nccl).path == KvPath::kMpi);
  CHECK(pd::choose_kv_path(g0, g_no_nccl).why.find("the receiver has no nccl") != std::string::npos);
  // The same device name on two hosts is two devices.
  CHECK(pd::choose_kv_path(g0, gpu_end("b", "GPU-0", {"nccl", "cuda_ipc"})).path == KvPath::kNccl);
  // Symmetric in the decision (each end computes it with itself as sender or receiver).
  for (const auto& [a, b] : std::vector<std::pair<KvEndpoint, KvEndpoint>>{{h1, g0}, {g0, g1}, {g0, g_no_nccl}})
    CHECK(pd::choose_kv_path(a, b).path == pd::choose_kv_path(b, a).path);

  const KvEndpoint local = pd::local_kv_endpoint(false, "ignored", {KvPath::kMpi});
  CHECK(local.memory == "host");
  CHECK(local.device.empty());
  CHECK(local.paths.empty());
  CHECK_FALSE(local.host.empty());
  const KvEndpoint dev = pd::local_kv_endpoint(true, "GPU-x", {KvPath::kMpi, KvPath::kNccl, KvPath::kCudaIpc});
  CHECK(dev.memory == "cuda");
  CHECK(dev.device == "GPU-x");
  CHECK(dev.paths == std::vector<std::string>{"nccl", "cuda_ipc"});
}

TEST_CASE("kv paths: a peer's region ops take its selected path, trailers always take mpi", "[kvtransfer]") {
  pd::test::LoopbackNetwork mpi_net, other_net;
  pd::KvPaths a(mpi_net.endpoint(0));
  a.add(KvPath::kNccl, other_net.endpoint(0));  // any transport stands in for a device path here
  auto b_mpi = mpi_net.endpoint(1);
  auto b_other = other_net.endpoint(1);
  CHECK(a.paths() == std::vector<KvPath>{KvPath::kMpi, KvPath::kNccl});
  CHECK(a.path_of(1) == KvPath::kMpi);
  const pd::Status missing = a.select_path(1, {KvPath::kCudaIpc, "test"});
  CHECK(missing.is_unsupported());
  CHECK(missing.message().find("cuda_ipc") != std::string::npos);

  std::vector<uint8_t> src(64), dst(64, 0), trailer_in(8), trailer_out(8, 0);
  std::iota(src.begin(), src.end(), uint8_t{1});
  std::iota(trailer_in.begin(), trailer_in.end(), uint8_t{100});
  pd::KvRegion send{src.data(), {0, 32}, 32}, recv{dst.data(), {32, 0}, 32};

  REQUIRE(a.select_path(1, {KvPath::kNccl, "test"}).is_ok());
  CHECK(a.path_of(1) == KvPath::kNccl);
  auto s = a.post_send(1, 1000, send);
  auto t = a.post_send_bytes(1, 1000, trailer_in.data(), trailer_in.size());
  REQUIRE(s.is_ok());
  REQUIRE(t.is_ok());
  CHECK(a.pending() == 2);
  // The region went over the selected path, the trailer over mpi.
  auto r = b_other->post_recv(0, 1000, recv);
  auto rt = b_mpi->post_recv_bytes(0, 1000, trailer_out.data(), trailer_out.size());
  REQUIRE(r.is_ok());
  REQUIRE(rt.is_ok());
  CHECK(finish(a, *s) == pd::OpState::kDone);
  CHECK(finish(a, *t) == pd::OpState::kDone);
  CHECK(finish(*b_other, *r) == pd::OpState::kDone);
  CHECK(finish(*b_mpi, *rt) == pd::OpState::kDone);
  CHECK(std::memcmp(dst.data() + 32, src.data(), 32) == 0);
  CHECK(std::memcmp(dst.data(), src.data() + 32, 32) == 0);
  CHECK(trailer_out == trailer_in);
  CHECK(a.pending() == 0);
  CHECK(a.test(*s).status().is_not_found());  // reported once, then released

  // Abandoned ops are forgotten; forgetting the peer resets its path to mpi.
  auto hung = a.post_send(1, 1001, send);
  REQUIRE(hung.is_ok());
  a.abandon(*hung);
  CHECK(a.pending() == 0);
  a.forget_peer(1);
  CHECK(a.path_of(1) == KvPath::kMpi);
}

TEST_CASE("staged transport: contiguous host bytes meet a plain region end, both ways, byte-exact", "[kvtransfer]") {
  auto backend = cpu();
  pd::KvCacheLayout L;
  L.n_layers = 2;
  L.n_kv_heads = 2;
  L.head_dim = 8;
  L.block_size = 4;
  L.num_blocks = 6;
  L.dtype = pd::GgmlType::kF32;
  auto staged_cache = backend->alloc(L.total_bytes());
  REQUIRE(staged_cache.is_ok());
  pd::BackendBuffer& sc = **staged_cache;
  std::vector<uint8_t> plain_cache(L.total_bytes(), 0);
  auto* sbytes = static_cast<uint8_t*>(sc.data());
  for (size_t i = 0; i < L.total_bytes(); ++i) sbytes[i] = static_cast<uint8_t>(i * 7 + 3);

  pd::test::LoopbackNetwork net;
  pd::StagedTransport staged(net.endpoint(0), *backend, sc);
  auto plain = net.endpoint(1);
  CHECK(staged.name() == "loopback+staged");

  // Staged sender, plain receiver with other block placements.
  const std::vector<int32_t> s_table{4, 1, 2}, p_table{0, 5, 3};
  for (int layer = 0; layer < L.n_layers; ++layer) {
    const pd::KvRegion sr = pd::kv_layer_region(sc.data(), L, layer, s_table);
    const pd::KvRegion pr = pd::kv_layer_region(plain_cache.data(), L, layer, p_table);
    auto s = staged.post_send(1, 1000 + layer, sr);
    auto r = plain->post_recv(0, 1000 + layer, pr);
    REQUIRE(s.is_ok());
    REQUIRE(r.is_ok());
    CHECK(finish(staged, *s) == pd::OpState::kDone);
    CHECK(finish(*plain, *r) == pd::OpState::kDone);
    CHECK(pd::kv_region_checksum(pr) == pd::kv_region_checksum(sr));
    auto via_backend = pd::kv_region_checksum(*backend, sc, sr);
    REQUIRE(via_backend.is_ok());
    CHECK(*via_backend == pd::kv_region_checksum(sr));
  }

  // Plain sender, staged receiver: the bytes land in the staged cache's pieces only when the receive completes.
  for (size_t i = 0; i < plain_cache.size(); ++i) plain_cache[i] = static_cast<uint8_t>(255 - i);
  const std::vector<int32_t> into{3, 0};
  const pd::KvRegion sr = pd::kv_layer_region(sc.data(), L, 1, into);
  const pd::KvRegion pr = pd::kv_layer_region(plain_cache.data(), L, 1, std::vector<int32_t>{2, 4});
  const std::vector<uint8_t> before(sbytes, sbytes + L.total_bytes());
  auto r = staged.post_recv(1, 2000, sr);
  REQUIRE(r.is_ok());
  CHECK(staged.test(*r).value() == pd::OpState::kPending);
  CHECK(std::memcmp(before.data(), sbytes, before.size()) == 0);
  auto s = plain->post_send(0, 2000, pr);
  REQUIRE(s.is_ok());
  CHECK(finish(staged, *r) == pd::OpState::kDone);
  CHECK(finish(*plain, *s) == pd::OpState::kDone);
  CHECK(pd::kv_region_checksum(sr) == pd::kv_region_checksum(pr));
  // Nothing outside the region changed.
  std::vector<bool> inside(L.total_bytes(), false);
  for (int64_t off : sr.offsets)
    for (int64_t k = 0; k < sr.piece_bytes; ++k) inside[static_cast<size_t>(off + k)] = true;
  for (size_t i = 0; i < before.size(); ++i)
    if (!inside[i]) REQUIRE(sbytes[i] == before[i]);

  // A region of another buffer is refused; a cancelled receive lands nothing.
  CHECK(staged.post_send(1, 3000, pr).status().is_invalid_argument());
  const std::vector<uint8_t> snapshot(sbytes, sbytes + L.total_bytes());
  auto c = staged.post_recv(1, 3001, sr);
  REQUIRE(c.is_ok());
  staged.cancel(*c);
  CHECK(finish(staged, *c) == pd::OpState::kCancelled);
  CHECK(std::memcmp(snapshot.data(), sbytes, snapshot.size()) == 0);
  CHECK(staged.pending() == 0);
}

TEST_CASE("backend kv copies: gather and scatter move pieces in the order given, a piece past the buffer is refused",
          "[kvtransfer]") {
  auto backend = cpu();
  auto buf = backend->alloc(256);
  REQUIRE(buf.is_ok());
  auto* bytes = static_cast<uint8_t*>((*buf)->data());
  std::iota(bytes, bytes + 256, uint8_t{0});
  const std::vector<int64_t> offsets{128, 0, 64};
  std::vector<uint8_t> host(3 * 16);
  REQUIRE(backend->kv_gather(**buf, offsets, 16, host.data()).is_ok());
  CHECK(host[0] == 128);
  CHECK(host[16] == 0);
  CHECK(host[47] == 64 + 15);
  std::vector<uint8_t> in(3 * 16, 0xEE);
  REQUIRE(backend->kv_scatter(**buf, offsets, 16, in.data()).is_ok());
  CHECK(bytes[128] == 0xEE);
  CHECK(bytes[144] == 144);  // right after a piece: untouched
  const pd::Status past = backend->kv_gather(**buf, std::vector<int64_t>{250}, 16, host.data());
  CHECK(past.is_invalid_argument());
  CHECK(past.message().find("outside the cache") != std::string::npos);
  CHECK(backend->kv_scatter(**buf, std::vector<int64_t>{-16}, 16, in.data()).is_invalid_argument());
  CHECK_FALSE(backend->device_memory());
  CHECK(backend->device_id().empty());
  CHECK(pd::backend_device_count("cpu") == 1);
  CHECK(pd::backend_device_count("tpu") == 0);
}
