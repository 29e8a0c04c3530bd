// The prefill and decode workers' state machines, stepped by hand: one of each
// on a tiny random model, joined by an in-process control channel
// (fake_channel.h) and an in-process KV transport (loopback_transport.h), the
// test playing the router (rank 0). No MPI job; each test runs in milliseconds
// to a few hundred (the deadline tests wait on purpose).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "decode_node/decode_worker.h"
#include "gguf/gguf_writer.h"
#include "kvtransfer/kv_paths.h"
#include "kvtransfer/send_budget.h"
#include "kvtransfer/staged_transport.h"
#include "fake_channel.h"
#include "kvtransfer/forwarding_transport.h"
#include "kvtransfer/loopback_transport.h"
#include "prefill_node/prefill_worker.h"
#include "protocol/role_table.h"
#include "fake_env.h"
#include "util/env.h"
#include "util/lifecycle.h"

#include <set>

namespace pd {
namespace {

using test::FakeChannelHub;
using test::LoopbackNetwork;
using Clock = std::chrono::steady_clock;

constexpr int kRouter = 0, kPrefill = 1, kDecode = 2;

// The tiny model as a file (Engine::create reads a path): written once per
// process, removed at exit.
std::filesystem::path tiny_model_file() {
  return std::filesystem::temp_directory_path() / ("pd_worker_test_" + std::to_string(::getpid()) + ".gguf");
}
const std::string& tiny_model_path() {
  static const std::string path = [] {
    const std::vector<uint8_t> bytes = make_tiny_llama_gguf(TinyLlamaSpec{});
    std::ofstream f(tiny_model_file(), std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(f.good());
    return tiny_model_file().string();
  }();
  return path;
}
struct TinyModelFileRemover {
  ~TinyModelFileRemover() {
    std::error_code ec;
    std::filesystem::remove(tiny_model_file(), ec);
  }
} remove_tiny_model_at_exit;

RoleTable roles_as(int self) {
  RoleTable t;
  t.roles = {Role::kRouter, Role::kPrefill, Role::kDecode};
  t.hosts = {"test", "test", "test"};
  t.self = self;
  t.router = kRouter;
  t.prefill = {kPrefill};
  t.decode = {kDecode};
  return t;
}

std::unique_ptr<Engine> make_engine(bool prefill_side) {
  EngineConfig ec;
  ec.model_path = tiny_model_path();
  ec.threads = 1;
  ec.block_size = 16;
  ec.kv_budget_bytes = 256 << 10;  // a few dozen blocks of the tiny model
  ec.kv_fit_context = prefill_side;
  ec.prefix_sharing = true;  // both pools keep a prefix cache, as worker_main sets them up
  auto e = Engine::create(ec);
  INFO(e.status().to_string());
  REQUIRE(e.is_ok());
  return std::move(e).value();
}

// An engine like make_engine's with blocks of 4 tokens: a KV segment
// (kKvSegmentBlocks blocks) is 64 tokens, so a 200-token prompt hands off in 4.
std::unique_ptr<Engine> make_small_block_engine(bool prefill_side) {
  EngineConfig ec;
  ec.model_path = tiny_model_path();
  ec.threads = 1;
  ec.block_size = 4;
  ec.kv_budget_bytes = 256 << 10;
  ec.kv_fit_context = prefill_side;
  ec.prefix_sharing = true;
  auto e = Engine::create(ec);
  REQUIRE(e.is_ok());
  return std::move(e).value();
}

// A backend that forwards to the CPU one until told to fail: then matmul
// errors, and device_health() reports the device gone or not (a failing op
// on a healthy device, e.g. out of memory, versus a dead GPU).
class FlakyBackend final : public Backend {
 public:
  explicit FlakyBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  bool fail_ops = false, device_gone = false;

  std::string name() const override { return "flaky-" + inner_->name(); }
  Result<std::unique_ptr<BackendBuffer>> alloc(size_t bytes) override { return inner_->alloc(bytes); }
  Result<Tensor> load_weight(const GgufTensorInfo& info, std::unique_ptr<BackendBuffer>* storage) override {
    return inner_->load_weight(info, storage);
  }
  Status copy_to_host(const Tensor& src, void* dst, size_t bytes) override { return inner_->copy_to_host(src, dst, bytes); }
  Status copy_from_host(const void* src, Tensor& dst, size_t bytes) override {
    return inner_->copy_from_host(src, dst, bytes);
  }
  Status synchronize() override { return inner_->synchronize(); }
  Status get_rows(const Tensor& t, std::span<const int32_t> ids, Tensor& out) override { return inner_->get_rows(t, ids, out); }
  Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override { return inner_->rms_norm(x, w, eps, out); }
  Status matmul(const Tensor& x, const Tensor& w, Tensor& out) override {
    if (fail_ops) return Status::resource_exhausted("flaky: matmul refused");
    return inner_->matmul(x, w, out);
  }
  Status matmul_multi(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> outs) override {
    if (fail_ops) return Status::resource_exhausted("flaky: matmul refused");
    return inner_->matmul_multi(x, ws, outs);
  }
  Status rope(Tensor& x, std::span<const int32_t> positions, const RopeSpec& spec) override {
    return inner_->rope(x, positions, spec);
  }
  Status swiglu(const Tensor& g, const Tensor& u, Tensor& out) override { return inner_->swiglu(g, u, out); }
  Status geglu(const Tensor& g, const Tensor& u, Tensor& out) override { return inner_->geglu(g, u, out); }
  Status add(const Tensor& a, const Tensor& b, Tensor& out) override { return inner_->add(a, b, out); }
  Status scale(const Tensor& x, float s, Tensor& out) override { return inner_->scale(x, s, out); }
  Status kv_write(BackendBuffer& cache, const KvCacheLayout& L, int layer, const Tensor& k, const Tensor& v,
                  std::span<const int32_t> slots) override {
    return inner_->kv_write(cache, L, layer, k, v, slots);
  }
  Status paged_attention(const Tensor& q, const BackendBuffer& cache, const KvCacheLayout& L, int layer,
                         std::span<const AttentionToken> tokens, std::span<const std::span<const int32_t>> tables,
                         float scale, int window, Tensor& out) override {
    return inner_->paged_attention(q, cache, L, layer, tokens, tables, scale, window, out);
  }
  Status kv_copy_block(BackendBuffer& cache, const KvCacheLayout& L, int64_t src, int64_t dst) override {
    return inner_->kv_copy_block(cache, L, src, dst);
  }
  Status device_health() override {
    return device_gone ? Status::internal("flaky: the device is gone") : Status::ok();
  }

 private:
  std::unique_ptr<Backend> inner_;
};

// An engine like make_engine's whose backend is a FlakyBackend.
std::unique_ptr<Engine> make_flaky_engine(bool prefill_side, FlakyBackend** flaky) {
  std::unique_ptr<Engine> e = make_engine(prefill_side);
  BackendConfig bc;
  bc.n_threads = 1;
  auto cpu = create_backend(bc);
  REQUIRE(cpu.is_ok());
  auto backend = std::make_unique<FlakyBackend>(std::move(cpu).value());
  *flaky = backend.get();
  auto model = LlamaModel::load(e->gguf, *backend);
  REQUIRE(model.is_ok());
  auto cache = KvCache::create(*backend, (*model)->config(), e->cache.layout.block_size, e->cache.layout.num_blocks,
                               e->cache.layout.dtype);
  REQUIRE(cache.is_ok());
  e->model = std::move(model).value();
  e->cache = std::move(cache).value();
  e->backend = std::move(backend);
  return e;
}

// Which ends stage their KV through a host buffer (as a device-memory cache does).
struct KvStaging {
  bool prefill = false, decode = false;
};

// A prefill rank and a decode rank, and what reached the router.
// The prefill rank's channel, with a test's hook run each time the worker
// looks at its inbox in the middle of a pass (receive_while: only the layer
// hook calls it) — so a test can make messages arrive during a pass.
class MidPassChannel final : public ControlChannel {
 public:
  MidPassChannel(std::unique_ptr<ControlChannel> inner, const std::function<void()>* hook)
      : inner_(std::move(inner)), hook_(hook) {}
  void send(int dest, const proto::Message& m) override { inner_->send(dest, m); }
  int receive(const std::function<void(int, proto::Message&)>& fn, int max) override { return inner_->receive(fn, max); }
  int receive_while(const std::function<bool(int, const proto::Message&)>& take,
                    const std::function<void(int, proto::Message&)>& fn, int max) override {
    if (*hook_) (*hook_)();
    return inner_->receive_while(take, fn, max);
  }
  void progress() override { inner_->progress(); }
  size_t pending_sends() const override { return inner_->pending_sends(); }
  bool flush(std::chrono::milliseconds d) override { return inner_->flush(d); }
  void forget(int rank) override { inner_->forget(rank); }

 private:
  std::unique_ptr<ControlChannel> inner_;
  const std::function<void()>* hook_;
};

struct MiniCluster {
  ClusterConfig cfg;
  FakeChannelHub hub;
  LoopbackNetwork net;
  Engine* prefill_engine = nullptr;
  Engine* decode_engine = nullptr;
  std::unique_ptr<PrefillWorker> prefill;
  std::unique_ptr<DecodeWorker> decode;
  std::shared_ptr<FakeEnv> fake;  // use_fake_clock()
  std::function<void()> mid_pass;  // run when the prefill rank looks at its inbox mid-pass
  // Router's view.
  std::map<proto::RequestId, std::vector<proto::TokenEvent>> events;
  std::vector<std::pair<int, proto::RequestFailed>> failed;
  std::vector<proto::TransferStats> transfers;

  // Last LoadReport each rank sent the router.
  std::map<int, proto::LoadReport> loads;
  // Each rank's prefix cache as its KV events describe it (the router's index).
  std::map<int, std::set<uint64_t>> cached;
  std::vector<int> drained;  // ranks that said Drained, in order

  using WrapTransport = std::function<std::unique_ptr<Transport>(std::unique_ptr<Transport>)>;
  using MakeEngine = std::function<std::unique_ptr<Engine>(bool prefill_side)>;
  // `prefill_roles` may change the prefill rank's table (a joined rank's peer epochs).
  explicit MiniCluster(ClusterConfig c, const WrapTransport& wrap_prefill = {}, KvStaging staged = {},
                       const MakeEngine& engines = make_engine,
                       const std::function<void(RoleTable&)>& prefill_roles = {})
      : cfg(std::move(c)) {
    auto pe = engines(true);
    auto de = engines(false);
    prefill_engine = pe.get();
    decode_engine = de.get();
    auto paths = [](std::unique_ptr<Transport> t, Engine& e, bool stage) -> std::unique_ptr<Transport> {
      if (stage) t = std::make_unique<StagedTransport>(std::move(t), *e.backend, *e.cache.buffer);
      return std::make_unique<KvPaths>(std::move(t));
    };
    std::unique_ptr<Transport> pt = paths(net.endpoint(kPrefill), *pe, staged.prefill);
    if (wrap_prefill) pt = wrap_prefill(std::move(pt));
    pt = std::make_unique<SendBudgetTransport>(std::move(pt));  // as pd-prefill's communication side has it
    RoleTable proles = roles_as(kPrefill);
    if (prefill_roles) prefill_roles(proles);
    prefill = std::make_unique<PrefillWorker>(cfg, proles, std::move(pe), std::move(pt),
                                              std::make_unique<MidPassChannel>(hub.endpoint(kPrefill), &mid_pass));
    decode = std::make_unique<DecodeWorker>(cfg, roles_as(kDecode), std::move(de),
                                            paths(net.endpoint(kDecode), *de, staged.decode), hub.endpoint(kDecode));
  }

  static proto::PrefillRequest request(proto::RequestId id, int n_prompt = 20, int max_tokens = 6) {
    proto::PrefillRequest r;
    r.id = id;
    for (int i = 0; i < n_prompt; ++i) r.prompt.push_back(3 + static_cast<int32_t>((id * 31 + i * 7) % 250));
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;  // random weights: end by length only
    r.decode_rank = kDecode;
    return r;
  }
  // As the router: a prompt to the prefill rank; a cancel to both ranks.
  void submit(const proto::PrefillRequest& r) { hub.send(kRouter, kPrefill, r); }
  void cancel(proto::RequestId id) {
    hub.send(kRouter, kPrefill, proto::Cancel{id});
    hub.send(kRouter, kDecode, proto::Cancel{id});
  }

  void collect() {
    for (auto& [source, m] : hub.take_all(kRouter)) {
      if (auto* te = std::get_if<proto::TokenEvents>(&m))
        for (auto& e : te->events) events[e.id].push_back(e);
      else if (auto* f = std::get_if<proto::RequestFailed>(&m)) failed.emplace_back(source, *f);
      else if (auto* t = std::get_if<proto::TransferStats>(&m)) transfers.push_back(*t);
      else if (auto* l = std::get_if<proto::LoadReport>(&m)) loads[source] = *l;
      else if (std::holds_alternative<proto::Drained>(m)) drained.push_back(source);
      else if (auto* kv = std::get_if<proto::KvEvents>(&m)) {
        std::set<uint64_t>& held = cached[source];
        if (kv->reset) held.clear();
        for (uint64_t h : kv->removed) held.erase(h);
        held.insert(kv->stored.begin(), kv->stored.end());
      }
    }
  }
  // As the router: `rank` (incarnation `epoch`) is down / back under `epoch`.
  void peer_down(int rank, proto::Epoch epoch = 0) {
    hub.send(kRouter, rank == kPrefill ? kDecode : kPrefill, proto::PeerDown{rank, epoch});
  }
  void rejoin(int rank, proto::Epoch epoch) {
    hub.send(kRouter, rank, proto::Rejoin{epoch});
    hub.send(kRouter, rank == kPrefill ? kDecode : kPrefill, proto::PeerUp{rank, epoch});
  }
  std::vector<int32_t> token_ids(proto::RequestId id) const {
    std::map<int, int32_t> by_index;
    if (auto it = events.find(id); it != events.end())
      for (const auto& e : it->second)
        for (size_t k = 0; k < e.tokens.size(); ++k) by_index[e.first_index + static_cast<int>(k)] = e.tokens[k];
    std::vector<int32_t> out;
    for (auto& [i, t] : by_index) out.push_back(t);
    return out;
  }
  bool prefill_free() const { return prefill_engine->blocks->num_free_blocks() == prefill_engine->blocks->num_blocks(); }
  bool decode_free() const { return decode_engine->blocks->num_free_blocks() == decode_engine->blocks->num_blocks(); }
  bool step_prefill() {
    const bool busy = prefill->run_once();
    collect();
    return busy;
  }
  bool step_decode() {
    const bool busy = decode->run_once();
    collect();
    return busy;
  }
  bool step_both() {
    const bool busy = step_prefill();
    return step_decode() || busy;
  }
  // Both workers read time from a clock the test steps (FakeEnv) from now on:
  // deadlines expire when the test says, the same in Debug and Release.
  void use_fake_clock() {
    fake = std::make_shared<FakeEnv>();
    prefill->set_env(fake);
    decode->set_env(fake);
  }
  // Time passes: on the fake clock if there is one, else for real.
  void pass(std::chrono::microseconds d) {
    if (fake) fake->advance(d);
    else std::this_thread::sleep_for(d);
  }
  // Steps both ranks until `done` holds; false after `max_iters` iterations.
  // An iteration where neither rank had work lets 100 us pass (as run() sleeps).
  bool run_until(const std::function<bool()>& done, int max_iters = 2000) {
    for (int i = 0; i < max_iters; ++i) {
      if (done()) return true;
      if (!step_both()) pass(std::chrono::microseconds(100));
    }
    return done();
  }
  // Steps only the decode rank while `d` passes, 1 ms a step (the prefill rank stalls meanwhile).
  void step_decode_for(std::chrono::milliseconds d) {
    for (auto t = std::chrono::milliseconds(0); t < d; t += std::chrono::milliseconds(1)) {
      step_decode();
      pass(std::chrono::milliseconds(1));
    }
  }

  int64_t tokens(proto::RequestId id) const {
    auto it = events.find(id);
    if (it == events.end()) return 0;
    int64_t n = 0;
    for (const auto& e : it->second) n += static_cast<int64_t>(e.tokens.size());
    return n;
  }
  bool finished(proto::RequestId id) const {
    auto it = events.find(id);
    if (it == events.end()) return false;
    for (const auto& e : it->second)
      if (e.finish != proto::Finish::kNone) return true;
    return false;
  }
  // Token indices 0..n-1, each once, the last event marked finished.
  void check_stream(proto::RequestId id, int max_tokens) const {
    INFO("request " << id);
    REQUIRE(events.count(id));
    std::vector<int> seen(static_cast<size_t>(max_tokens), 0);
    for (const auto& e : events.at(id))
      for (size_t k = 0; k < e.tokens.size(); ++k) {
        const int idx = e.first_index + static_cast<int>(k);
        REQUIRE(idx >= 0);
        REQUIRE(idx < max_tokens);
        ++seen[static_cast<size_t>(idx)];
      }
    for (int n : seen) CHECK(n == 1);
    CHECK(events.at(id).back().finish == proto::Finish::kLength);
  }
  bool failed_with(proto::RequestId id, int source, proto::FailureKind kind) const {
    for (const auto& [src, f] : failed)
      if (f.id == id && src == source && f.kind == kind) return true;
    return false;
  }
  bool pools_free() const {
    return prefill_engine->blocks->num_free_blocks() == prefill_engine->blocks->num_blocks() &&
           decode_engine->blocks->num_free_blocks() == decode_engine->blocks->num_blocks();
  }
  // Steps until both pools are free again (transfers tested, blocks released).
  // Every block back in both pools within 100 ms (idle iterations let 100 us pass).
  bool settle() { return run_until([&] { return pools_free(); }, 1000); }
};

ClusterConfig small_config() {
  ClusterConfig cfg;
  cfg.prefill.threads = cfg.decode.threads = 1;
  return cfg;
}

TEST_CASE("workers: a request goes end to end through prefill, handoff and decode", "[workers]") {
  MiniCluster c(small_config());
  c.submit(MiniCluster::request(1, 40, 8));
  REQUIRE(c.run_until([&] { return c.finished(1); }));
  c.check_stream(1, 8);
  CHECK(c.failed.empty());
  REQUIRE(c.settle());
  REQUIRE(c.transfers.size() == 1);
  CHECK(c.transfers[0].id == 1);
  CHECK(c.transfers[0].bytes > 0);
  CHECK(c.net.bytes_moved() >= c.transfers[0].bytes);
}

// A request run whole, then again as a migrated one would be (its first k
// tokens after the prompt, resumed_tokens = k, the rest to generate): the
// tokens after k are the same, greedy or seeded with penalties, on either pool.
TEST_CASE("workers: a migrated request goes on with the tokens the whole run gives, greedy and seeded", "[workers]") {
  constexpr int kTokens = 10;
  for (bool colocated : {false, true})
    for (float temperature : {0.0f, 0.9f}) {
      INFO((colocated ? "colocated" : "prefill rank") << ", temperature " << temperature);
      MiniCluster c(small_config());
      auto send = [&](const proto::PrefillRequest& r) {
        if (colocated) c.hub.send(kRouter, kDecode, r);
        else c.submit(r);
      };
      proto::PrefillRequest whole = MiniCluster::request(1, 30, kTokens);
      whole.sampling.temperature = temperature;
      whole.sampling.seed = 1234;
      whole.sampling.presence_penalty = 0.5f;
      whole.sampling.frequency_penalty = 0.3f;
      send(whole);
      REQUIRE(c.run_until([&] { return c.finished(1); }));
      const std::vector<int32_t> reference = c.token_ids(1);
      REQUIRE(reference.size() == static_cast<size_t>(kTokens));
      for (int k : {1, 4, kTokens - 1}) {
        INFO("resumed after " << k << " tokens");
        proto::PrefillRequest rest = whole;
        rest.id = static_cast<proto::RequestId>(10 + k);
        rest.prompt.insert(rest.prompt.end(), reference.begin(), reference.begin() + k);
        rest.sampling.resumed_tokens = k;
        rest.sampling.max_tokens = kTokens - k;
        send(rest);
        REQUIRE(c.run_until([&] { return c.finished(rest.id); }));
        c.check_stream(rest.id, kTokens - k);
        CHECK(c.token_ids(rest.id) == std::vector<int32_t>(reference.begin() + k, reference.end()));
      }
      CHECK(c.failed.empty());
      REQUIRE(c.settle());
    }
}

TEST_CASE("workers: a worker that hears nothing from the router for router_ms stops, its own pauses not counted",
          "[workers]") {
  using namespace std::chrono_literals;
  ClusterConfig cfg = small_config();
  cfg.timeouts.router_ms = 2000;
  cfg.timeouts.startup_ms = 3000;
  MiniCluster c(cfg);
  c.use_fake_clock();
  auto idle_for = [&](int steps, bool beat_each_second) {
    for (int i = 0; i < steps; ++i) {
      if (beat_each_second && i % 100 == 0) c.hub.send(kRouter, kDecode, proto::RouterBeat{});
      c.step_decode();
      c.pass(10ms);
    }
  };
  idle_for(250, false);  // 2.5 s: past router_ms, but the router was never heard (startup_ms)
  CHECK(c.decode->router_lost().is_ok());
  idle_for(300, true);  // heard, and beating
  CHECK(c.decode->router_lost().is_ok());
  c.hub.send(kRouter, kDecode, proto::RouterBeat{});
  c.step_decode();
  c.pass(60s);  // the process was stopped (or in one long pass): counts as 1 s at most
  c.step_decode();
  CHECK(c.decode->router_lost().is_ok());
  idle_for(150, false);  // then 1.5 s more of silence while it runs: 2.5 s > router_ms
  REQUIRE_FALSE(c.decode->router_lost().is_ok());
  CHECK_THAT(c.decode->router_lost().message(), Catch::Contains("timeouts.router_ms"));
  const Status ran = c.decode->run();  // stops at once, saying why
  CHECK(ran.is_unavailable());             // holding nothing: it may serve a new router
  CHECK_THAT(ran.message(), Catch::Contains("timeouts.router_ms"));
  CHECK(c.prefill->router_lost().is_ok());  // the prefill rank was not stepped meanwhile
}

TEST_CASE("workers: when the router is gone, both workers drop what they held and free every block",
          "[workers]") {
  using namespace std::chrono_literals;
  ClusterConfig cfg = small_config();
  cfg.timeouts.router_ms = 2000;
  cfg.timeouts.startup_ms = 3000;
  MiniCluster c(cfg);
  c.use_fake_clock();
  c.submit(MiniCluster::request(1, 40, 500));
  c.submit(MiniCluster::request(2, 30, 500));
  REQUIRE(c.run_until([&] { return c.tokens(1) >= 3 && c.tokens(2) >= 3; }));
  for (int i = 0; i < 400 && (c.prefill->router_lost().is_ok() || c.decode->router_lost().is_ok()); ++i) {
    c.step_both();
    c.pass(10ms);
  }
  REQUIRE_FALSE(c.prefill->router_lost().is_ok());
  REQUIRE_FALSE(c.decode->router_lost().is_ok());
  CHECK_FALSE(c.finished(1));
  CHECK(c.decode->run().is_unavailable());
  CHECK(c.prefill->run().is_unavailable());
  CHECK(c.decode_free());
  CHECK(c.prefill_free());
}

TEST_CASE("workers: load reports count prompt tokens found in the prefix cache and computed", "[workers]") {
  MiniCluster c(small_config());
  const proto::PrefillRequest first = MiniCluster::request(1, 40, 2);
  proto::PrefillRequest again = first;  // the same 40 tokens: two whole 16-token blocks are cached
  again.id = 2;
  c.submit(first);
  REQUIRE(c.run_until([&] { return c.finished(1); }));
  c.submit(again);
  REQUIRE(c.run_until([&] { return c.finished(2); }));
  REQUIRE(c.run_until([&] {
    return c.loads[kPrefill].prompt_tokens_cached + c.loads[kPrefill].prompt_tokens_computed == 80;
  }));
  CHECK(c.loads[kPrefill].prompt_tokens_cached == 32);
  CHECK(c.loads[kPrefill].prompt_tokens_computed == 48);
  CHECK(c.loads[kDecode].prompt_tokens_computed == 0);  // it computes no prompt here (its KV arrives)
  REQUIRE(c.settle());
}

// The chained hashes of the first `blocks` full blocks of `tokens` (16 per block).
std::vector<uint64_t> block_hashes(const std::vector<int32_t>& tokens, size_t blocks) {
  std::vector<uint64_t> out;
  uint64_t parent = kKvRootBlockHash;
  for (size_t k = 0; k < blocks; ++k) {
    parent = kv_block_hash(parent, std::span<const int32_t>(tokens).subspan(k * 16, 16));
    out.push_back(parent);
  }
  return out;
}

TEST_CASE("workers: a follow-up computed by the decode rank from its cache gives the prefill path's tokens",
          "[workers]") {
  for (int chunk_tokens : {0, 8}) {
    CAPTURE(chunk_tokens);
    ClusterConfig cfg = small_config();
    cfg.prefill.chunk_tokens = chunk_tokens;
    MiniCluster c(cfg);
    const proto::PrefillRequest turn1 = MiniCluster::request(1, 40, 12);
    c.submit(turn1);
    REQUIRE(c.run_until([&] { return c.finished(1); }));
    // The decode rank holds the prompt and 11 of the 12 answer tokens (the last is never fed):
    // 51 tokens, 3 full blocks, and its KV events said so.
    std::vector<int32_t> history = turn1.prompt;
    for (int32_t t : c.token_ids(1)) history.push_back(t);
    REQUIRE(c.run_until([&] { return c.cached[kDecode].size() >= 3; }));
    for (uint64_t h : block_hashes(history, 3)) CHECK(c.cached[kDecode].count(h) == 1);
    CHECK(c.cached[kPrefill].size() == 2);  // the prompt's two full blocks
    // The next turn: the history and 5 new tokens, once computed on the decode rank from its
    // cache (as the router sends it there), once through the prefill rank.
    proto::PrefillRequest turn2 = MiniCluster::request(2, 0, 8);
    turn2.prompt = history;
    for (int i = 0; i < 5; ++i) turn2.prompt.push_back(200 + i);
    c.hub.send(kRouter, kDecode, turn2);
    REQUIRE(c.run_until([&] { return c.finished(2); }));
    proto::PrefillRequest via_prefill = turn2;
    via_prefill.id = 3;
    c.submit(via_prefill);
    REQUIRE(c.run_until([&] { return c.finished(3); }));
    CHECK(c.token_ids(2) == c.token_ids(3));
    CHECK(c.events.at(2).front().cached_tokens == 48);
    CHECK(c.events.at(3).front().cached_tokens == 32);  // the prefill rank holds only turn 1's prompt
    REQUIRE(c.run_until([&] { return c.loads[kDecode].prompt_tokens_cached == 48; }));
    CHECK(c.loads[kDecode].prompt_tokens_computed == static_cast<int64_t>(turn2.prompt.size()) - 48);
    CHECK(c.failed.empty());
    REQUIRE(c.settle());
  }
}

TEST_CASE("workers: a decode rank's KV events report a handed-off prompt's blocks once its KV landed", "[workers]") {
  MiniCluster c(small_config());
  const proto::PrefillRequest r = MiniCluster::request(1, 48, 4);
  c.submit(r);
  REQUIRE(c.run_until([&] { return c.finished(1); }));
  REQUIRE(c.run_until([&] { return c.cached[kDecode].size() >= 3; }));
  for (uint64_t h : block_hashes(r.prompt, 3)) CHECK(c.cached[kDecode].count(h) == 1);
  REQUIRE(c.settle());
}

TEST_CASE("workers: a host-staged end (a device-memory cache's path) talks to a plain one unchanged", "[workers]") {

  // The staged end sends and receives one contiguous buffer where the plain
  // end uses the region's pieces: the same bytes in wire order, so either
  // pairing must hand off the KV intact (checksummed) and decode the same tokens.
  auto tokens_of = [](MiniCluster& c, proto::RequestId id) {
    std::vector<int32_t> out;
    for (const auto& e : c.events.at(id)) out.insert(out.end(), e.tokens.begin(), e.tokens.end());
    return out;
  };
  MiniCluster plain(small_config());
  plain.submit(MiniCluster::request(1, 40, 8));
  REQUIRE(plain.run_until([&] { return plain.finished(1); }));
  for (KvStaging staged : {KvStaging{true, false}, KvStaging{false, true}, KvStaging{true, true}}) {
    INFO("staged prefill " << staged.prefill << ", staged decode " << staged.decode);
    MiniCluster c(small_config(), {}, staged);
    c.submit(MiniCluster::request(1, 40, 8));
    REQUIRE(c.run_until([&] { return c.finished(1); }));
    c.check_stream(1, 8);
    CHECK(c.failed.empty());
    CHECK(tokens_of(c, 1) == tokens_of(plain, 1));
    REQUIRE(c.settle());
    CHECK(c.pools_free());
    REQUIRE(c.transfers.size() == 1);
    CHECK(c.net.bytes_moved() >= c.transfers[0].bytes);
  }
}

TEST_CASE("workers: a failing op fails its requests, a failed device stops the rank", "[workers]") {
  FlakyBackend* prefill_backend = nullptr;
  FlakyBackend* decode_backend = nullptr;
  MiniCluster c(small_config(), {}, {}, [&](bool prefill_side) {
    return make_flaky_engine(prefill_side, prefill_side ? &prefill_backend : &decode_backend);
  });
  REQUIRE(prefill_backend != nullptr);
  REQUIRE(decode_backend != nullptr);
  // An op fails on a healthy device (out of memory, say): that batch's request
  // fails with the reason, and the rank serves the next one.
  prefill_backend->fail_ops = true;
  c.submit(MiniCluster::request(1, 20, 4));
  REQUIRE(c.run_until([&] { return c.failed_with(1, kPrefill, proto::FailureKind::kInternal); }));
  CHECK(c.prefill->device_fault().is_ok());
  prefill_backend->fail_ops = false;
  c.submit(MiniCluster::request(2, 20, 4));
  REQUIRE(c.run_until([&] { return c.finished(2); }));
  c.check_stream(2, 4);
  // The decode rank's device dies mid-stream: its sequence fails and the rank
  // stops (run() returns the fault at once) instead of failing every later request.
  c.submit(MiniCluster::request(3, 20, 40));
  REQUIRE(c.run_until([&] { return c.events.count(3) > 0; }));
  decode_backend->fail_ops = decode_backend->device_gone = true;
  REQUIRE(c.run_until([&] { return c.failed_with(3, kDecode, proto::FailureKind::kInternal); }));
  CHECK(c.decode->device_fault().message().find("the device is gone") != std::string::npos);
  const Status ran = c.decode->run();
  CHECK(ran.message().find("the device is gone") != std::string::npos);
  CHECK(c.prefill->device_fault().is_ok());
}

TEST_CASE("workers: a cancel reaching the prefill rank while its prompt is queued", "[workers]") {
  // The fix: on_cancel used to erase the sequence but leave its id in queue_, and
  // the next batch's seqs_.at() threw out of run_once (the rank died).
  ClusterConfig cfg = small_config();
  cfg.prefill.max_batch = 1;
  MiniCluster c(cfg);
  for (proto::RequestId id : {1, 2, 3}) c.submit(MiniCluster::request(id));
  c.cancel(2);  // arrives before the prefill rank runs any batch
  REQUIRE_NOTHROW(c.run_until([&] { return c.finished(1) && c.finished(3); }));
  REQUIRE(c.finished(1));
  REQUIRE(c.finished(3));
  c.check_stream(1, 6);
  c.check_stream(3, 6);
  CHECK(c.tokens(2) == 0);
  CHECK(c.failed.empty());
  CHECK(c.settle());
}

TEST_CASE("workers: sampling parameters out of bounds fail the request on the prefill rank, naming why",
          "[workers]") {
  MiniCluster c(small_config());
  proto::PrefillRequest bad = MiniCluster::request(1);
  bad.sampling.grammar = GrammarSpec{GrammarKind::kRegex, std::string(kMaxGrammarBytes + 1, 'a'), "", ""};
  c.submit(bad);
  c.submit(MiniCluster::request(2));
  REQUIRE(c.run_until([&] { return c.finished(2) && !c.failed.empty(); }));
  REQUIRE(c.failed.size() == 1);
  CHECK(c.failed[0].second.id == 1);
  CHECK(c.failed[0].second.kind == proto::FailureKind::kInvalid);
  CHECK(c.failed[0].second.reason.find("grammar") != std::string::npos);
  CHECK(c.tokens(1) == 0);
  c.check_stream(2, 6);
  CHECK(c.settle());
}

TEST_CASE("workers: a cancel for a prompt in each state leaves nothing behind", "[workers]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.max_batch = 1;
  MiniCluster c(cfg);
  for (proto::RequestId id : {1, 2, 3, 4}) c.submit(MiniCluster::request(id, 20, 12));
  c.step_prefill();  // 1 computed (held, not accepted yet); 2..4 queued
  c.cancel(1);       // held on the prefill rank, offered on the decode rank
  c.step_decode();
  c.step_prefill();  // 2 computed
  c.cancel(3);       // queued, accepted by the decode rank
  REQUIRE_NOTHROW(c.run_until([&] { return c.finished(2) && c.finished(4); }));
  c.cancel(2);  // already finished: ignored
  REQUIRE(c.finished(4));
  CHECK(c.tokens(3) == 0);
  CHECK(c.failed.empty());
  CHECK(c.settle());
}

TEST_CASE("workers: an accept that arrives during the pass sends the layers written so far, during the pass",
          "[workers]") {
  MiniCluster c(small_config());
  int looks = 0;
  // The first time the prefill rank looks at its inbox mid-pass (after layer
  // 0), the decode rank runs: it takes the offer and accepts.
  c.mid_pass = [&] {
    if (looks++ == 0) c.step_decode();
  };
  c.submit(MiniCluster::request(1, 40, 6));
  REQUIRE(c.run_until([&] { return c.finished(1); }));
  c.check_stream(1, 6);
  CHECK(looks >= 2);  // one look per layer
  REQUIRE(c.transfers.size() == 1);
  const proto::TransferStats& t = c.transfers[0];
  CHECK(t.bytes > 0);
  // Every layer went out before the pass ended: all of it hid behind compute.
  // (Acting on the accept only after the pass, none of it would have.)
  CHECK(t.hidden_bytes == t.bytes);
  CHECK(c.settle());
}

TEST_CASE("workers: the decode rank's transfer deadline ignores time the prompt spent queued", "[workers]") {
  // Before the fix the decode rank gave an accepted handoff transfer_ms from
  // the accept, so a prompt still queued (or computing) on the prefill rank
  // failed with 504 although nothing was stalled. Now it allows
  // prefill_queue_ms + transfer_ms before the first layer, transfer_ms after.
  ClusterConfig cfg = small_config();
  cfg.prefill.max_batch = 1;
  cfg.timeouts.transfer_ms = 50;
  MiniCluster c(cfg);
  c.use_fake_clock();
  c.submit(MiniCluster::request(1));
  c.submit(MiniCluster::request(2));
  c.step_prefill();  // offers both; 1 computed and held, 2 queued
  c.step_decode_for(std::chrono::milliseconds(200));  // accepts both; the prefill rank is busy elsewhere
  CHECK(c.failed.empty());
  REQUIRE(c.run_until([&] { return c.finished(1) && c.finished(2); }));
  c.check_stream(1, 6);
  c.check_stream(2, 6);
  CHECK(c.failed.empty());
  CHECK(c.settle());
}

TEST_CASE("workers: a stalled transfer fails on both ranks and frees both pools", "[workers]") {
  ClusterConfig cfg = small_config();
  cfg.timeouts.transfer_ms = 50;
  MiniCluster c(cfg);
  c.use_fake_clock();
  c.net.hang_sends(true);
  c.submit(MiniCluster::request(1));
  REQUIRE(c.run_until([&] { return c.tokens(1) == 1; }));
  CHECK(c.failed.empty());
  REQUIRE(c.run_until([&] { return c.failed_with(1, kPrefill, proto::FailureKind::kTimeout); }, 1000));
  CHECK(c.fake->now() > Env::Clock::time_point(std::chrono::hours(1)) + std::chrono::milliseconds(50));
  CHECK(c.tokens(1) == 1);  // the first token came from the prefill rank
  c.net.hang_sends(false);
  CHECK(c.settle());
  // The ranks still serve.
  c.submit(MiniCluster::request(2));
  REQUIRE(c.run_until([&] { return c.finished(2); }));
  c.check_stream(2, 6);
}

TEST_CASE("workers: a prompt queued past prefill_queue_ms fails (overloaded) and the decode rank lets go", "[workers]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.max_batch = 1;
  cfg.timeouts.prefill_queue_ms = 50;
  MiniCluster c(cfg);
  c.use_fake_clock();
  c.submit(MiniCluster::request(1));
  c.submit(MiniCluster::request(2));
  c.step_prefill();                                   // 1 computed and held; 2 queued
  c.step_decode_for(std::chrono::milliseconds(100));  // accepts (reserves blocks for) both
  CHECK(c.decode_engine->blocks->num_free_blocks() < c.decode_engine->blocks->num_blocks());
  REQUIRE(c.run_until([&] { return c.finished(1) && c.failed_with(2, kPrefill, proto::FailureKind::kOverloaded); }));
  c.check_stream(1, 6);
  CHECK(c.tokens(2) == 0);
  // The decode rank got the HandoffAbort and cancelled its receives; the
  // prefill rank alone told the router (one failure per request).
  for (const auto& [src, f] : c.failed) CHECK(src == kPrefill);
  CHECK(c.settle());
}

TEST_CASE("workers: control messages about unknown or ended requests are ignored", "[workers]") {
  MiniCluster c(small_config());
  auto garbage_about = [&](proto::RequestId id) {
    c.hub.send(kRouter, kPrefill, proto::Cancel{id});
    c.hub.send(kDecode, kPrefill, proto::HandoffAccept{id, proto::kTagKvFirst + 7, 0, {}});
    c.hub.send(kDecode, kPrefill, proto::HandoffReject{id, "no", false});
    c.hub.send(kDecode, kPrefill, proto::HandoffReject{id, "cancelled", true});
    c.hub.send(kRouter, kDecode, proto::PeerUp{kPrefill, 0});
    c.hub.send(kRouter, kDecode, proto::Cancel{id});
    c.hub.send(kPrefill, kDecode, proto::HandoffAbort{id, "gone"});
    c.hub.send(kPrefill, kDecode, proto::HandoffAbort{id, "cancelled"});
  };
  garbage_about(999);
  garbage_about(999);
  c.hub.send_raw(kRouter, kPrefill, {0x01, 0x02, 0x03});  // not a message
  c.hub.send_raw(kRouter, kDecode, {0xff});
  // Duplicates: the same PrefillRequest twice, every accept delivered twice.
  c.hub.duplicate_next(100, [](int, int, const proto::Message& m) {
    return std::holds_alternative<proto::HandoffAccept>(m);
  });
  c.submit(MiniCluster::request(5));
  c.submit(MiniCluster::request(5));
  REQUIRE_NOTHROW(c.run_until([&] { return c.finished(5); }));
  REQUIRE(c.finished(5));
  c.check_stream(5, 6);
  REQUIRE(c.settle());
  // Everything again about the request that just ended, and one never seen.
  garbage_about(5);
  garbage_about(12345);
  c.submit(MiniCluster::request(6));
  REQUIRE_NOTHROW(c.run_until([&] { return c.finished(6); }));
  c.check_stream(6, 6);
  CHECK(c.failed.empty());
  CHECK(c.settle());
}

TEST_CASE("workers: a lost accept ends in the prefill rank's handoff deadline on both ranks", "[workers]") {
  ClusterConfig cfg = small_config();
  cfg.timeouts.handoff_ms = 50;
  MiniCluster c(cfg);
  c.use_fake_clock();
  c.hub.drop_next(1, [](int, int, const proto::Message& m) { return std::holds_alternative<proto::HandoffAccept>(m); });
  c.submit(MiniCluster::request(1));
  REQUIRE(c.run_until([&] { return c.failed_with(1, kPrefill, proto::FailureKind::kOverloaded); }, 1000));
  CHECK(c.failed_with(1, kPrefill, proto::FailureKind::kOverloaded));
  CHECK(c.settle());  // the decode rank got the abort and cancelled its receives
  c.submit(MiniCluster::request(2));
  REQUIRE(c.run_until([&] { return c.finished(2); }));
  c.check_stream(2, 6);
}

TEST_CASE("workers: a dead decode rank costs the prefill rank nothing but the request", "[workers]") {
  ClusterConfig cfg = small_config();
  cfg.timeouts.handoff_ms = 50;
  MiniCluster c(cfg);
  c.use_fake_clock();
  c.hub.kill(kDecode);
  c.submit(MiniCluster::request(1));
  REQUIRE(c.run_until([&] { return c.failed_with(1, kPrefill, proto::FailureKind::kOverloaded); }, 1000));
  CHECK(c.failed_with(1, kPrefill, proto::FailureKind::kOverloaded));
  const KvBlockManager& pool = *c.prefill_engine->blocks;
  CHECK(c.run_until([&] { return pool.num_free_blocks() == pool.num_blocks(); }, 200));
}

TEST_CASE("workers: reordered control messages still end every request", "[workers]") {
  // A cancel overtaking its offer at the decode rank (the tombstone path) and
  // a batch of messages delivered in reverse.
  ClusterConfig cfg = small_config();
  MiniCluster c(cfg);
  c.submit(MiniCluster::request(1));
  c.submit(MiniCluster::request(2));
  c.hub.hold();
  c.step_prefill();  // offers for 1 and 2 held in the hub
  c.cancel(2);       // held too
  c.hub.release(/*reversed=*/true);
  REQUIRE_NOTHROW(c.run_until([&] { return c.finished(1); }));
  c.check_stream(1, 6);
  CHECK(c.tokens(2) <= 1);  // at most the prefill rank's first token
  CHECK(c.settle());
}

// ---------------------------------------------------------------- rank faults

// The tokens each request produces with nothing going wrong (the reference).
std::map<proto::RequestId, std::vector<int32_t>> clean_run(const std::vector<proto::RequestId>& ids) {
  MiniCluster c(small_config());
  for (proto::RequestId id : ids) {
    c.submit(MiniCluster::request(id));
    REQUIRE(c.run_until([&] { return c.finished(id); }));
  }
  std::map<proto::RequestId, std::vector<int32_t>> out;
  for (proto::RequestId id : ids) out[id] = c.token_ids(id);
  return out;
}

TEST_CASE("kv tags: a retired tag is never reissued, a released one is", "[workers]") {
  LoopbackNetwork net;
  auto t = net.endpoint(kDecode);
  KvTagPool pool(1000, 3);
  const int a = *pool.acquire(), b = *pool.acquire(), c = *pool.acquire();
  CHECK(!pool.acquire());  // all in use
  pool.release(a);
  pool.retire(b, *t);
  CHECK(pool.retired() == 1);
  for (int i = 0; i < 10; ++i) {  // wraps many times: only `a` comes back
    auto t = pool.acquire();
    REQUIRE(t);
    CHECK(*t == a);
    pool.release(*t);
  }
  pool.release(c);
  std::set<int> seen;
  for (int i = 0; i < 2; ++i) seen.insert(*pool.acquire());
  CHECK(seen == std::set<int>{a, c});
}

TEST_CASE("kv tags: a reclaimed tag comes back once the peer's seal is taken, past its limit it is retired",
          "[workers][tags]") {
  using S = KvTagPool::TagState;
  LoopbackNetwork net;
  auto sender = net.endpoint(kPrefill);
  auto receiver = net.endpoint(kDecode);
  const auto t0 = Clock::now();
  const auto limit = std::chrono::milliseconds(50);
  const int64_t illegal = illegal_transitions();
  KvTagPool pool(1000, 2);
  const int a = *pool.acquire(), b = *pool.acquire();
  std::vector<uint8_t> stale(64, 7);
  REQUIRE(sender->post_send_bytes(kDecode, a, stale.data(), stale.size()).is_ok());  // no receive takes it
  pool.reclaim(a, 11, t0);
  pool.reclaim(b, 12, t0 + std::chrono::milliseconds(1));
  CHECK(pool.state(a) == S::kUnsealed);
  CHECK(pool.reclaiming() == 2);
  CHECK(!pool.acquire());  // being reclaimed: not given out
  const std::vector<KvTagPool::Unsealed> asked = pool.unsealed();
  REQUIRE(asked.size() == 2);
  CHECK((asked[0].tag == a && asked[0].id == 11 && asked[1].tag == b));  // oldest first
  for (const auto& u : asked) pool.sealing(u.tag, *receiver->post_reclaim(kPrefill, u.tag));
  CHECK(pool.unsealed().empty());
  CHECK(!pool.poll(*receiver, t0, limit));  // nothing sealed yet (the stale message is taken meanwhile)
  CHECK(net.messages_reclaimed() == 1);
  REQUIRE(sender->post_send_bytes(kDecode, a, nullptr, 0).is_ok());  // a's seal
  CHECK(pool.poll(*receiver, t0, limit));
  CHECK(pool.state(a) == S::kFree);
  CHECK(pool.state(b) == S::kSealing);
  // b's peer never seals: past the limit its reclaim is cancelled, then the tag retired.
  pool.poll(*receiver, t0 + 2 * limit, limit);
  pool.poll(*receiver, t0 + 2 * limit, limit);
  CHECK(pool.state(b) == S::kRetired);
  CHECK(pool.retired() == 1);
  CHECK(pool.reclaiming() == 0);
  CHECK(receiver->pending() == 0);
  CHECK(*pool.acquire() == a);
  CHECK(illegal_transitions() == illegal);
}

TEST_CASE("workers: a handoff abandoned after its receives were cancelled never feeds another request (defect: tag reuse)",
          "[workers]") {
  // The decode rank gives up on request 1 (its backstop) and cancels its
  // receives before the accept reaches the prefill rank, which then posts
  // sends nobody receives; MPI cannot cancel them. Before the fix the tag
  // came round again (every 30,000 handoffs; here 2) and the stale sends
  // matched a new request's receives; the prefill rank's blocks never
  // returned (its sequence waited for the sends forever).
  const auto reference = clean_run({2, 3, 4, 5});
  ClusterConfig cfg = small_config();
  cfg.timeouts.prefill_queue_ms = 20;
  cfg.timeouts.transfer_ms = 20;
  cfg.kv.tag_span = 2;
  MiniCluster c(cfg);
  c.use_fake_clock();
  c.submit(MiniCluster::request(1));
  c.step_prefill();  // offered, computed, held (no accept yet)
  c.hub.hold();      // the accept will arrive late
  c.step_decode_for(std::chrono::milliseconds(100));  // accepts, then fails request 1: nothing arrived
  c.hub.release();
  c.collect();
  REQUIRE(c.failed_with(1, kDecode, proto::FailureKind::kTimeout));
  c.step_prefill();  // the late accept: request 1's layers go out under the cancelled tag
  for (proto::RequestId id : {2, 3, 4, 5}) {
    c.submit(MiniCluster::request(id));
    REQUIRE(c.run_until([&] { return c.finished(id); }));
    CHECK(c.token_ids(id) == reference.at(id));
  }
  for (const auto& [src, f] : c.failed) CHECK((f.id == 1));
  // The prefill rank's stalled sends hit timeouts.transfer_ms: abandoned, blocks back.
  CHECK(c.settle());
}

// Handoffs that end mid-transfer, in each order the ends can learn it. Before
// tags were reclaimed each of these retired its tag for good: with 4 tags per
// prefill rank the fifth such handoff left the pair refusing every handoff
// ("no free KV transfer tag"), the user's next request failed.
TEST_CASE("workers: handoffs ended mid-transfer in every order give their tags back: 4 tags serve on",
          "[workers][tags]") {
  ClusterConfig cfg = small_config();
  cfg.kv.tag_span = 4;
  cfg.prefill.chunk_tokens = 16;  // a 200-token prompt: 13 passes, its KV in 4 segments
  const auto reference = [&] {
    MiniCluster r(cfg, {}, {}, make_small_block_engine);
    std::map<proto::RequestId, std::vector<int32_t>> out;
    for (proto::RequestId id : {900, 901}) {
      r.submit(MiniCluster::request(id, 200, 5));
      REQUIRE(r.run_until([&] { return r.finished(id); }));
      out[id] = r.token_ids(id);
    }
    return out;
  }();
  // The decode rank's own backstop (prefill_queue_ms + transfer_ms) ends the third kind.
  cfg.timeouts.prefill_queue_ms = 20;
  cfg.timeouts.transfer_ms = 100;
  MiniCluster c(cfg, {}, {}, make_small_block_engine);
  c.use_fake_clock();
  std::set<proto::RequestId> ended;
  for (int round = 0; round < 21; ++round) {
    const proto::RequestId id = 100 + static_cast<proto::RequestId>(round);
    ended.insert(id);
    INFO("round " << round << " (request " << id << ")");
    const int64_t moved = c.net.bytes_moved();
    switch (round % 3) {
      case 0: {
        // The user pressed stop mid-prefill, after the first segment went out:
        // the router's cancel reaches the prefill rank first (it aborts), then
        // the decode rank.
        c.submit(MiniCluster::request(id, 200, 5));
        REQUIRE(c.run_until([&] { return c.net.bytes_moved() > moved; }, 200));
        REQUIRE(c.events.count(id) == 0);  // still computing
        c.cancel(id);
        break;
      }
      case 1: {
        // The cancel reaches the decode rank first (it waits for the abort or
        // the data), then the prefill rank, before anything was sent.
        c.submit(MiniCluster::request(id, 200, 5));
        c.step_both();
        c.step_both();  // offered and accepted; computing its second chunk
        REQUIRE(c.net.bytes_moved() == moved);
        c.hub.send(kRouter, kDecode, proto::Cancel{id});
        c.step_decode();
        c.hub.send(kRouter, kPrefill, proto::Cancel{id});
        break;
      }
      case 2: {
        // The decode rank ends first on its own (nothing arrived within its
        // backstop: its accept was late) and cancels its receives; then the
        // accept reaches the prefill rank, which sends the whole KV under the
        // tag with no receive left to take it. The seal request follows it.
        c.submit(MiniCluster::request(id, 40, 5));
        c.step_prefill();  // offered, computed, held
        c.hub.hold();
        c.step_decode_for(std::chrono::milliseconds(130));  // accepts; fails it at 120 ms
        c.hub.release();
        c.collect();
        REQUIRE(c.failed_with(id, kDecode, proto::FailureKind::kTimeout));
        break;
      }
    }
    REQUIRE(c.settle());
  }
  CHECK(c.net.messages_reclaimed() > 7);  // the third kind's sends were swept, with the seals
  c.step_decode_for(std::chrono::milliseconds(1100));  // a load report (one a second when nothing else changes)
  CHECK(c.loads[kDecode].kv_tags_retired == 0);
  CHECK(c.loads[kDecode].kv_tags_reclaiming == 0);
  // The pair serves on, with the tokens a fresh pair gives.
  for (proto::RequestId id : {900, 901}) {
    c.submit(MiniCluster::request(id, 200, 5));
    REQUIRE(c.run_until([&] { return c.finished(id); }));
    CHECK(c.token_ids(id) == reference.at(id));
  }
  for (const auto& [src, f] : c.failed) {
    INFO("rank " << src << ": request " << f.id << ": " << f.reason);
    CHECK(ended.count(f.id));
  }
  CHECK(illegal_transitions() == 0);
  CHECK(c.settle());
}

TEST_CASE("workers: a tag being reclaimed when its prefill rank goes down is retired, the other tags serve on",
          "[workers][tags]") {
  ClusterConfig cfg = small_config();
  cfg.kv.tag_span = 2;
  cfg.timeouts.prefill_queue_ms = 20;
  cfg.timeouts.transfer_ms = 100;
  MiniCluster c(cfg);
  c.use_fake_clock();
  c.submit(MiniCluster::request(1));
  c.step_prefill();  // offered, computed, held
  c.hub.hold();      // the accept and the seal request wait
  c.step_decode_for(std::chrono::milliseconds(150));  // accepts; its backstop fails it; asks for the seal
  c.hub.release();
  c.collect();
  REQUIRE(c.failed_with(1, kDecode, proto::FailureKind::kTimeout));
  REQUIRE(c.loads[kDecode].kv_tags_reclaiming == 1);
  c.peer_down(kPrefill);  // a stopped sender may resume and send under the tag
  c.step_decode_for(std::chrono::milliseconds(1100));
  CHECK(c.loads[kDecode].kv_tags_retired == 1);
  CHECK(c.loads[kDecode].kv_tags_reclaiming == 0);
  c.rejoin(kPrefill, 1);  // it comes back under a new epoch
  c.step_prefill();
  for (proto::RequestId id : {2, 3, 4}) {  // one tag left for them, one handoff at a time
    c.submit(MiniCluster::request(id));
    REQUIRE(c.run_until([&] { return c.finished(id); }));
    c.check_stream(id, 6);
  }
  CHECK(c.loads[kDecode].kv_tags_retired == 1);
  CHECK(c.settle());
}

TEST_CASE("workers: a decode rank declared down: the prefill rank ends its handoffs in every state", "[workers]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.max_batch = 1;
  MiniCluster c(cfg);
  for (proto::RequestId id : {1, 2, 3}) c.submit(MiniCluster::request(id));
  c.step_prefill();  // 1 computed and held; 2, 3 queued; all offered
  c.step_decode();   // accepts all three
  c.hub.kill(kDecode);
  c.net.kill(kDecode);
  c.step_prefill();  // accept(1): sending (never completes); 2 computed with its layers posted; 3 queued
  c.peer_down(kDecode);
  c.step_prefill();
  for (proto::RequestId id : {1, 2, 3}) CHECK(c.failed_with(id, kPrefill, proto::FailureKind::kPeerDown));
  CHECK(c.prefill_free());
  // New work naming the down rank fails at once instead of waiting for a handoff deadline.
  c.submit(MiniCluster::request(4));
  c.step_prefill();
  CHECK(c.failed_with(4, kPrefill, proto::FailureKind::kPeerDown));
  CHECK(c.prefill_free());
}

// Request 1's receives matched by a prefill rank that then stops: MPI cannot
// cancel them. Returns once the decode rank has been told the rank is down.
void stop_prefill_mid_transfer(MiniCluster& c) {
  c.net.freeze(kPrefill);  // its matched sends do not move
  c.submit(MiniCluster::request(1, 40, 6));
  for (int i = 0; i < 10; ++i) c.step_both();
  REQUIRE(!c.finished(1));
  c.peer_down(kPrefill);
  c.step_decode();
  REQUIRE(c.failed_with(1, kDecode, proto::FailureKind::kPeerDown));
}

TEST_CASE("workers: blocks under receives from a down prefill rank are quarantined until its process is gone",
          "[workers]") {
  MiniCluster c(small_config());
  auto env = std::make_shared<FakeEnv>();  // the clock is still only stepped by step_decode_for
  c.prefill->set_env(env);
  c.decode->set_env(env);
  c.fake = env;
  stop_prefill_mid_transfer(c);
  c.step_decode_for(std::chrono::milliseconds(30));
  CHECK(!c.decode_free());  // a stopped rank may resume and write into them
  CHECK(c.loads[kDecode].quarantined_blocks > 0);
  c.net.kill(kPrefill);
  env->set_gone(kPrefill);
  c.step_decode();
  CHECK(c.decode_free());
  c.step_decode_for(std::chrono::milliseconds(30));  // the next load report (at most every 20 ms)
  CHECK(c.loads[kDecode].quarantined_blocks == 0);
}

TEST_CASE("workers: quarantined blocks come back when the router says the prefill rank's process ended (another host)",
          "[workers]") {
  MiniCluster c(small_config());
  c.use_fake_clock();  // no process is ever gone as this rank can see (another host)
  stop_prefill_mid_transfer(c);
  c.step_decode_for(std::chrono::milliseconds(30));
  CHECK(!c.decode_free());
  c.hub.send(kRouter, kDecode, proto::PeerGone{kDecode, 0});  // another rank than the sender: nothing changes
  c.step_decode_for(std::chrono::milliseconds(30));
  CHECK(!c.decode_free());
  c.net.kill(kPrefill);
  c.hub.send(kRouter, kDecode, proto::PeerGone{kPrefill, 0});  // mpirun's process table: it ended
  c.step_decode();
  CHECK(c.decode_free());
  c.step_decode_for(std::chrono::milliseconds(30));
  CHECK(c.loads[kDecode].quarantined_blocks == 0);
}

TEST_CASE("workers: a stopped prefill rank that resumes writes only into its own quarantined blocks, then rejoins",
          "[workers]") {
  MiniCluster c(small_config());
  c.use_fake_clock();  // no process is ever gone: stopped, not dead
  stop_prefill_mid_transfer(c);
  CHECK(!c.decode_free());
  // kill -CONT: its sends complete into the blocks that were held back for them.
  c.net.thaw(kPrefill);
  c.step_decode();
  CHECK(c.decode_free());
  // Its old messages are stale to the decode rank once the router re-admits it.
  c.rejoin(kPrefill, 1);
  c.step_prefill();  // drops request 1 (the router re-ran or failed it), reports epoch 1
  c.step_decode();
  CHECK(c.loads[kPrefill].epoch == 1);
  CHECK(c.prefill_free());
  const size_t failures = c.failed.size();
  c.submit(MiniCluster::request(2));
  c.hub.send(kPrefill, kDecode, proto::HandoffAbort{2, "from the old incarnation", 0});  // dropped
  REQUIRE(c.run_until([&] { return c.finished(2); }));
  c.check_stream(2, 6);
  CHECK(c.failed.size() == failures);
  CHECK(c.settle());
}

// A rank that joins after a peer was re-admitted (epoch 2) learns that epoch
// from the router's JoinAccepted: the peer's first message is current, not a
// new incarnation that would end the handoffs just made to it.
TEST_CASE("workers: a joined rank takes a re-admitted peer's epoch from the join and serves with it", "[workers]") {
  MiniCluster c(small_config(), {}, {}, make_engine, [](RoleTable& t) { t.peer_epochs = {{kDecode, 2}}; });
  c.hub.send(kRouter, kDecode, proto::Rejoin{2});  // the decode rank's incarnation since its re-admission
  c.step_decode();
  c.collect();
  c.failed.clear();
  c.submit(MiniCluster::request(1));
  REQUIRE(c.run_until([&] { return c.finished(1) || !c.failed.empty(); }));
  CHECK(c.failed.empty());
  c.check_stream(1, 6);
  REQUIRE(c.settle());
}

TEST_CASE("workers: a Rejoin makes a decode rank drop every sequence and come back under the new epoch", "[workers]") {
  MiniCluster c(small_config());
  c.submit(MiniCluster::request(1, 20, 40));
  REQUIRE(c.run_until([&] { return c.tokens(1) >= 5; }));
  c.rejoin(kDecode, 1);
  c.step_both();
  c.step_both();
  CHECK(!c.finished(1));
  CHECK(c.decode_free());
  CHECK(c.loads[kDecode].epoch == 1);
  c.submit(MiniCluster::request(2));
  REQUIRE(c.run_until([&] { return c.finished(2); }));
  c.check_stream(2, 6);
  CHECK(c.settle());
}

// Fails every post_send from the `after`-th on (a send path that breaks mid-pass).
class FailingSends final : public test::ForwardingTransport {
 public:
  FailingSends(std::unique_ptr<Transport> inner, int after) : ForwardingTransport(std::move(inner)), left_(after) {}
  std::string name() const override { return "failing"; }
  Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) override {
    if (left_-- <= 0) return Status::io_error("injected send failure");
    return ForwardingTransport::post_send(peer, tag, region);
  }

 private:
  int left_;
};

TEST_CASE("workers: a send failing inside forward() ends the sequence after the pass, not during it", "[workers]") {
  // Request 2 is accepted before its batch, so its layers are posted from the
  // layer hook while forward() reads its block table; the second layer's
  // send fails there. The sequence must outlive the pass (ASan checks the reads).
  ClusterConfig cfg = small_config();
  cfg.prefill.max_batch = 1;
  const int layers = TinyLlamaSpec{}.n_layers;
  MiniCluster c(cfg, [&](std::unique_ptr<Transport> t) {
    return std::make_unique<FailingSends>(std::move(t), layers + 1);  // request 1's layers, then one of 2's
  });
  c.submit(MiniCluster::request(1));
  c.submit(MiniCluster::request(2));
  c.step_prefill();  // 1 computed (held)
  c.step_decode();   // accepts 1 and 2
  REQUIRE(c.run_until([&] { return c.finished(1) && c.failed_with(2, kPrefill, proto::FailureKind::kTransfer); }));
  c.check_stream(1, 6);
  CHECK(illegal_transitions() == 0);
  CHECK(c.settle());
}

}  // namespace
}  // namespace pd
namespace pd {
namespace {
TEST_CASE("workers: a decode rank wrongly declared down mid-transfer rejoins and serves again", "[workers]") {
  ClusterConfig cfg = small_config();
  MiniCluster c(cfg);
  for (proto::RequestId id : {1, 2, 3}) c.submit(MiniCluster::request(id, 40, 6));
  c.step_prefill();
  c.step_decode();  // accepts
  c.step_prefill();  // sends go out
  // The router lost patience with the decode rank (it was only slow).
  c.hub.send(kRouter, kPrefill, proto::PeerDown{kDecode, 0});
  c.hub.send(kRouter, kDecode, proto::Rejoin{1});
  c.hub.send(kRouter, kPrefill, proto::PeerUp{kDecode, 1});
  for (int i = 0; i < 5; ++i) c.step_both();
  for (proto::RequestId id : {4, 5}) {
    c.submit(MiniCluster::request(id, 40, 6));
    REQUIRE(c.run_until([&] { return c.finished(id); }));
    c.check_stream(id, 6);
  }
  CHECK(c.settle());
}
}  // namespace
}  // namespace pd
namespace pd {
namespace {
TEST_CASE("workers: sends queued for a decode rank that went down never block its next incarnation", "[workers]") {
  // One send in flight per decode rank at a time: the rest queue. The rank is
  // declared down with sends queued, then re-admitted. Before the fix the
  // ended jobs' entries stayed at the head of the queue, nothing refunded the
  // budget, and the new incarnation's handoffs waited for ever.
  MiniCluster c(small_config(), [](std::unique_ptr<Transport> t) -> std::unique_ptr<Transport> {
    return std::make_unique<SendBudgetTransport>(std::move(t), SendBudget{1, 128 << 10, {}});
  });
  c.net.freeze(kDecode);  // stopped: the sends it matched do not complete
  for (proto::RequestId id : {1, 2}) c.submit(MiniCluster::request(id, 40, 6));
  for (int i = 0; i < 6; ++i) c.step_both();
  c.hub.send(kRouter, kPrefill, proto::PeerDown{kDecode, 0});
  c.hub.send(kRouter, kDecode, proto::Rejoin{1});
  c.hub.send(kRouter, kPrefill, proto::PeerUp{kDecode, 1});
  c.net.thaw(kDecode);
  for (int i = 0; i < 4; ++i) c.step_both();
  for (proto::RequestId id : {3, 4}) {
    c.submit(MiniCluster::request(id, 40, 6));
    REQUIRE(c.run_until([&] { return c.finished(id); }));
    c.check_stream(id, 6);
  }
  CHECK(c.settle());
}
}  // namespace
}  // namespace pd
namespace pd {
namespace {
TEST_CASE("peer epochs: a message is current, stale, from a down peer, or from a newer incarnation", "[workers]") {
  using V = PeerEpochs::Verdict;
  PeerEpochs p;
  CHECK(p.check(3, 0) == V::kCurrent);
  CHECK(p.down(3, 0));
  CHECK(p.check(3, 0) == V::kDown);
  CHECK(p.check(3, 1) == V::kNewer);  // re-admitted before we heard
  CHECK(p.up(3, 1));
  CHECK(p.check(3, 1) == V::kCurrent);
  CHECK(p.check(3, 0) == V::kStale);
  CHECK(!p.down(3, 0));  // a PeerDown for the old incarnation arriving late changes nothing
  CHECK(p.check(3, 1) == V::kCurrent);
  CHECK(!p.up(3, 0));
  CHECK(p.epoch(3) == 1);
}
}  // namespace
}  // namespace pd
namespace pd {
namespace {
TEST_CASE("workers: a prefill rank declared down: handoffs offered, receiving and done each end right", "[workers]") {
  MiniCluster c(small_config());
  c.use_fake_clock();
  c.fake->set_gone(kPrefill);  // it is gone for good
  // Request 1 completes its handoff first and is decoding when the prefill rank goes.
  c.submit(MiniCluster::request(1, 20, 30));
  REQUIRE(c.run_until([&] { return c.tokens(1) >= 2; }));
  // Then more than the decode pool holds at once: some wait as offers, some receive.
  c.net.freeze(kPrefill);
  const std::vector<proto::RequestId> later{2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  for (proto::RequestId id : later) c.submit(MiniCluster::request(id, 100, 20));
  for (int i = 0; i < 6; ++i) c.step_both();
  c.step_decode_for(std::chrono::milliseconds(30));  // a load report: offers are waiting for room
  REQUIRE(c.loads[kDecode].waiting > 0);
  c.net.kill(kPrefill);
  c.hub.kill(kPrefill);
  c.peer_down(kPrefill);
  c.step_decode();
  REQUIRE(c.run_until([&] { return c.finished(1); }));  // its KV was here: it runs to the end
  c.check_stream(1, 30);
  for (proto::RequestId id : later) {
    INFO("request " << id);
    CHECK(c.failed_with(id, kDecode, proto::FailureKind::kPeerDown));
  }
  CHECK(c.run_until([&] { return c.decode_free(); }, 200));
  CHECK(illegal_transitions() == 0);
}
TEST_CASE("workers: an accept for a handoff the prefill rank no longer holds is answered with an abort", "[workers]") {
  // A decode rank wrongly declared down rejoins and accepts an offer the prefill
  // rank had already ended (without telling it, as it was down): without the
  // abort its blocks waited for timeouts.transfer_ms (seen in the chaos suite).
  MiniCluster c(small_config());
  c.hub.send(kDecode, kPrefill, proto::HandoffAccept{999, proto::kTagKvFirst, 0, {}});
  c.step_prefill();
  bool aborted = false;
  for (auto& [source, m] : c.hub.take_all(kDecode))
    if (auto* a = std::get_if<proto::HandoffAbort>(&m)) aborted |= a->id == 999 && source == kPrefill;
  CHECK(aborted);
}

TEST_CASE("workers: a drained prefill rank hands queued prompts back, finishes the running one, then says Drained",
          "[workers]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.max_batch = 1;
  MiniCluster c(cfg);
  for (proto::RequestId id : {1, 2, 3}) c.submit(MiniCluster::request(id, 20, 6));
  c.step_prefill();  // request 1 computes; 2 and 3 wait in the queue
  c.hub.send(kRouter, kPrefill, proto::Drain{});
  REQUIRE(c.run_until([&] { return c.finished(1) && !c.drained.empty(); }));
  c.check_stream(1, 6);
  CHECK(c.failed_with(2, kPrefill, proto::FailureKind::kLeaving));
  CHECK(c.failed_with(3, kPrefill, proto::FailureKind::kLeaving));
  CHECK(c.drained == std::vector<int>{kPrefill});
  REQUIRE(c.settle());
  c.step_both();
  CHECK(c.drained.size() == 1);  // said once
}

TEST_CASE("workers: a drained decode rank finishes its sequences before Drained, PeerLeft makes the prefill rank forget it",
          "[workers]") {
  MiniCluster c(small_config());
  c.submit(MiniCluster::request(1, 20, 12));
  REQUIRE(c.run_until([&] { return c.tokens(1) >= 3; }));
  c.hub.send(kRouter, kDecode, proto::Drain{});
  REQUIRE(c.run_until([&] { return !c.drained.empty(); }));
  CHECK(c.finished(1));  // finished before it said Drained
  c.check_stream(1, 12);
  CHECK(c.drained == std::vector<int>{kDecode});
  c.hub.send(kRouter, kPrefill, proto::PeerLeft{kDecode});
  c.step_prefill();
  CHECK(c.hub.forgotten(kPrefill) == std::set<int>{kDecode});
  CHECK(c.settle());
}


TEST_CASE("workers: a pass with all_logits gives each position the logits its prefix alone ends with", "[workers]") {
  std::unique_ptr<Engine> e = make_engine(false);
  const int64_t vocab = e->config().vocab;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back(3 + (i * 37) % 250);
  auto logits_of = [&](std::span<const int32_t> tokens, bool all) {
    const SeqId seq{1};
    REQUIRE(e->blocks->allocate(seq, tokens).is_ok());
    std::vector<int32_t> table;
    for (BlockId b : e->blocks->block_table(seq)) table.push_back(b.value);
    SequenceBatch sb{tokens, 0, table, true, all};
    std::vector<float> logits;
    REQUIRE(e->model->prefill(std::span<const SequenceBatch>(&sb, 1), e->cache, &logits).is_ok());
    REQUIRE(e->blocks->free(seq).is_ok());
    return logits;
  };
  const std::vector<float> all = logits_of(prompt, true);
  REQUIRE(all.size() == prompt.size() * static_cast<size_t>(vocab));
  for (size_t p : {1u, 2u, 16u, 17u, 40u}) {
    const std::vector<float> last = logits_of(std::span<const int32_t>(prompt).first(p), false);
    REQUIRE(last.size() == static_cast<size_t>(vocab));
    INFO("prefix of " << p);
    for (int64_t v = 0; v < vocab; v += 7) CHECK(all[(p - 1) * vocab + v] == Approx(last[v]).margin(1e-3));
  }
}

// Greedy: each generated token is the first alternative, with the same logprob.
void check_greedy_logprobs(const std::vector<proto::TokenEvent>& events, size_t top_n) {
  for (const proto::TokenEvent& e : events) {
    REQUIRE(e.logprobs.size() == e.tokens.size());
    for (size_t k = 0; k < e.tokens.size(); ++k) {
      const LogprobEntry& lp = e.logprobs[k];
      CHECK(lp.token == e.tokens[k]);
      REQUIRE(lp.top.size() == top_n);
      CHECK(lp.top[0].id == lp.token);
      CHECK(lp.top[0].logprob == lp.logprob);
      double mass = 0.0;
      for (const TokenLogprob& t : lp.top) mass += std::exp(static_cast<double>(t.logprob));
      CHECK(mass <= 1.0 + 1e-6);
    }
  }
}

TEST_CASE("workers: logprobs come from both ranks, prompt logprobs from every prompt position", "[workers]") {
  MiniCluster c(small_config());
  constexpr int kTop = 20;
  proto::PrefillRequest r = MiniCluster::request(1, 40, 6);
  r.sampling.logprobs = kTop;
  r.sampling.prompt_logprobs = true;
  c.submit(r);
  REQUIRE(c.run_until([&] { return c.finished(1); }));
  c.check_stream(1, 6);
  check_greedy_logprobs(c.events.at(1), kTop);
  const proto::TokenEvent& first = c.events.at(1).front();
  REQUIRE(first.first_index == 0);
  REQUIRE(first.prompt_logprobs.size() == r.prompt.size() - 1);
  for (const proto::TokenEvent& e : c.events.at(1))
    if (e.first_index > 0) CHECK(e.prompt_logprobs.empty());

  // Prompt position p's entry is what prefilling the first p tokens alone gives
  // for the next token (its logits row), e.g. for p = 1, 15, 16, 17 and 39
  // (around a block boundary: those prefixes hit the prefix cache).
  proto::RequestId id = 10;
  for (size_t p : {1, 15, 16, 17, 39}) {
    proto::PrefillRequest prefix = MiniCluster::request(++id, 0, 1);
    prefix.prompt.assign(r.prompt.begin(), r.prompt.begin() + static_cast<std::ptrdiff_t>(p));
    prefix.sampling.logprobs = kTop;
    c.submit(prefix);
    REQUIRE(c.run_until([&] { return c.finished(id); }));
    const LogprobEntry& next = c.events.at(id).front().logprobs.at(0);
    const LogprobEntry& at = first.prompt_logprobs[p - 1];
    INFO("prompt position " << p);
    CHECK(at.token == r.prompt[p]);
    REQUIRE(at.top.size() == next.top.size());
    for (size_t k = 0; k < at.top.size(); ++k) {
      CHECK(at.top[k].id == next.top[k].id);
      CHECK(at.top[k].logprob == Approx(next.top[k].logprob).margin(1e-4));
      if (at.top[k].id == at.token) CHECK(at.logprob == at.top[k].logprob);
    }
  }

  // The same prompt again: its prefix is resident now, yet every position is
  // computed (prompt logprobs never reuse cached KV), with the same result.
  proto::PrefillRequest again = r;
  again.id = 2;
  c.submit(again);
  REQUIRE(c.run_until([&] { return c.finished(2); }));
  CHECK(c.token_ids(2) == c.token_ids(1));
  const proto::TokenEvent& first2 = c.events.at(2).front();
  REQUIRE(first2.prompt_logprobs.size() == first.prompt_logprobs.size());
  for (size_t p = 0; p < first.prompt_logprobs.size(); ++p) {
    CHECK(first2.prompt_logprobs[p].token == first.prompt_logprobs[p].token);
    CHECK(first2.prompt_logprobs[p].logprob == Approx(first.prompt_logprobs[p].logprob).margin(1e-4));
  }
  // Without logprobs nothing extra travels.
  c.submit(MiniCluster::request(3, 20, 4));
  REQUIRE(c.run_until([&] { return c.finished(3); }));
  for (const proto::TokenEvent& e : c.events.at(3)) CHECK((e.logprobs.empty() && e.prompt_logprobs.empty()));
  CHECK(c.failed.empty());
  REQUIRE(c.settle());
}

TEST_CASE("workers: a decode rank prefilling a prompt itself (colocated) reports the same logprobs", "[workers]") {
  MiniCluster c(small_config());
  proto::PrefillRequest r = MiniCluster::request(1, 24, 4);
  r.sampling.logprobs = 5;
  r.sampling.prompt_logprobs = true;
  c.submit(r);
  REQUIRE(c.run_until([&] { return c.finished(1); }));
  proto::PrefillRequest local = r;
  local.id = 2;
  c.hub.send(kRouter, kDecode, local);  // as the router does in colocated mode
  REQUIRE(c.run_until([&] { return c.finished(2); }));
  CHECK(c.token_ids(2) == c.token_ids(1));
  check_greedy_logprobs(c.events.at(2), 5);
  const proto::TokenEvent& a = c.events.at(1).front();
  const proto::TokenEvent& b = c.events.at(2).front();
  REQUIRE(b.prompt_logprobs.size() == a.prompt_logprobs.size());
  for (size_t p = 0; p < a.prompt_logprobs.size(); ++p) {
    CHECK(b.prompt_logprobs[p].token == a.prompt_logprobs[p].token);
    CHECK(b.prompt_logprobs[p].logprob == Approx(a.prompt_logprobs[p].logprob).margin(1e-4));
  }
  CHECK(c.failed.empty());
  REQUIRE(c.settle());
}


// ---------------------------------------------------------------- chunked prefill

// Requests of several prompt lengths, one with prompt logprobs, through a
// 1P+1D pair (and, colocated, straight to the decode rank) with the given
// chunk size: the token ids each request produced, and request 3's prompt logprobs.
struct ChunkedRun {
  std::map<proto::RequestId, std::vector<int32_t>> tokens;
  std::vector<LogprobEntry> prompt_logprobs;
};
ChunkedRun chunked_run(int chunk_tokens, bool colocated) {
  ClusterConfig cfg = small_config();
  cfg.prefill.chunk_tokens = chunk_tokens;
  cfg.prefill.token_budget = 64;
  cfg.decode.step_tokens = 24;
  MiniCluster c(cfg);
  std::vector<proto::PrefillRequest> reqs = {MiniCluster::request(1, 90, 6), MiniCluster::request(2, 20, 6),
                                             MiniCluster::request(3, 57, 6), MiniCluster::request(4, 33, 6)};
  reqs[2].sampling.logprobs = 3;
  reqs[2].sampling.prompt_logprobs = true;
  for (const auto& r : reqs) {
    if (colocated) c.hub.send(kRouter, kDecode, r);
    else c.submit(r);
  }
  REQUIRE(c.run_until([&] {
    for (const auto& r : reqs)
      if (!c.finished(r.id)) return false;
    return true;
  }));
  CHECK(c.failed.empty());
  ChunkedRun out;
  for (const auto& r : reqs) {
    c.check_stream(r.id, 6);
    out.tokens[r.id] = c.token_ids(r.id);
  }
  out.prompt_logprobs = c.events.at(3).front().prompt_logprobs;
  REQUIRE(c.settle());
  return out;
}

TEST_CASE("chunked prefill: tokens and prompt logprobs do not depend on the chunk size, on either pool",
          "[workers][chunks]") {
  const ChunkedRun whole = chunked_run(0, false);
  REQUIRE(whole.prompt_logprobs.size() == 56);
  for (bool colocated : {false, true})
    for (int chunk : {0, 5, 16, 33, 512}) {
      INFO((colocated ? "colocated" : "prefill rank") << ", chunk_tokens " << chunk);
      const ChunkedRun run = chunked_run(chunk, colocated);
      CHECK(run.tokens == whole.tokens);
      REQUIRE(run.prompt_logprobs.size() == whole.prompt_logprobs.size());
      for (size_t p = 0; p < run.prompt_logprobs.size(); ++p) {
        CHECK(run.prompt_logprobs[p].token == whole.prompt_logprobs[p].token);
        CHECK(run.prompt_logprobs[p].logprob == Approx(whole.prompt_logprobs[p].logprob).margin(1e-4));
      }
    }
}

TEST_CASE("chunked prefill: the prefill rank's events say which came first", "[workers][chunks]") {
  // Order of first tokens as the router sees them: chunked, the short prompt's
  // token 1 arrives while the long prompt still has chunks to go.
  ClusterConfig cfg = small_config();
  cfg.prefill.chunk_tokens = 16;
  MiniCluster c(cfg);
  c.submit(MiniCluster::request(1, 200, 4));
  REQUIRE(c.step_prefill());
  c.submit(MiniCluster::request(2, 10, 4));
  REQUIRE(c.step_prefill());
  CHECK(c.events.count(2) == 1);
  CHECK(c.events.count(1) == 0);
  REQUIRE(c.run_until([&] { return c.finished(1) && c.finished(2); }));
  CHECK(c.failed.empty());
  REQUIRE(c.settle());
}

TEST_CASE("chunked prefill: colocated decodes keep stepping while a long prompt is computed", "[workers][chunks]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.chunk_tokens = 16;
  cfg.decode.step_tokens = 17;
  MiniCluster c(cfg);
  c.hub.send(kRouter, kDecode, MiniCluster::request(1, 10, 40));
  REQUIRE(c.run_until([&] { return c.tokens(1) >= 2; }));
  c.hub.send(kRouter, kDecode, MiniCluster::request(2, 200, 4));
  const int64_t before = c.tokens(1);
  REQUIRE(c.run_until([&] { return c.tokens(2) >= 1; }));
  // 200 tokens at 16 a step: 13 steps, each also a decode step of request 1.
  CHECK(c.tokens(1) - before >= 12);
  REQUIRE(c.run_until([&] { return c.finished(1) && c.finished(2); }));
  c.check_stream(1, 40);
  c.check_stream(2, 4);
  CHECK(c.failed.empty());
  REQUIRE(c.settle());
}

// Requests on a colocated rank whose pool holds a few of them, half with one
// prompt: preempted ones are computed again reusing the others' cached blocks,
// so a later victim holds blocks that preempting it does not free. The
// scheduler must count only what a victim holds alone (a sequence admitted on
// the rest found the pool short and failed): every request finishes (with
// speculation drafting too), those with the shared prompt with one answer.
TEST_CASE("workers: requests sharing cached blocks are preempted and computed again and none fails", "[workers][chunks]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.chunk_tokens = 16;
  cfg.decode.speculate = GENERATE(0, 4);
  const uint32_t seed = GENERATE(range(1u, 9u));
  CAPTURE(cfg.decode.speculate, seed);
  MiniCluster c(cfg);
  const int64_t pool = c.decode_engine->blocks->num_blocks() * c.decode_engine->blocks->block_size();
  const int context = c.decode_engine->config().context;
  std::mt19937 rng(seed);
  std::vector<proto::PrefillRequest> reqs;
  int64_t total = 0;
  for (proto::RequestId id = 1; total < 3 * pool; ++id) {
    const bool shared = id % 2 == 1;
    const int n_prompt = shared ? 40 : 20 + static_cast<int>(rng() % 100);
    proto::PrefillRequest r = MiniCluster::request(shared ? 1 : id, n_prompt, 8 + static_cast<int>(rng() % (context - n_prompt - 8)));
    r.id = id;
    total += n_prompt + r.sampling.max_tokens;
    reqs.push_back(r);
  }
  CAPTURE(pool, reqs.size());
  size_t sent = 0;
  auto all_ended = [&] {
    for (const auto& r : reqs)
      if (!c.finished(r.id) && !c.failed_with(r.id, kDecode, proto::FailureKind::kInternal)) return false;
    return true;
  };
  for (int i = 0; i < 400000 && !all_ended(); ++i) {
    if (sent < reqs.size() && (i % 7 == 0)) c.hub.send(kRouter, kDecode, reqs[sent++]);
    if (!c.step_both()) c.pass(std::chrono::microseconds(100));
  }
  REQUIRE(all_ended());
  CHECK(c.failed.empty());
  for (const auto& r : reqs) {
    c.check_stream(r.id, r.sampling.max_tokens);
    if (r.id % 2 == 1 && r.sampling.max_tokens <= reqs[0].sampling.max_tokens) {
      const auto mine = c.token_ids(r.id), first = c.token_ids(1);
      REQUIRE(mine.size() <= first.size());
      CHECK(std::equal(mine.begin(), mine.end(), first.begin()));
    }
  }
  REQUIRE(c.settle());
  // The rank's load reports (paced) say it preempted.
  CHECK(c.run_until([&] { return c.loads.count(kDecode) && c.loads.at(kDecode).preemptions > 0; }, 20000));
}

// A colocated step is about one chunk (decode.step_tokens): the long prompt's
// chunk leaves a short prompt that arrives its room, so the short one's token
// 1 comes in the next step or the one after, not after the whole long prompt.
TEST_CASE("chunked prefill: a short prompt gets into a colocated step beside a long one being chunked",
          "[workers][chunks]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.chunk_tokens = 32;
  cfg.decode.step_tokens = 33;  // one running decode + a 32-token chunk
  MiniCluster c(cfg);
  c.hub.send(kRouter, kDecode, MiniCluster::request(1, 10, 60));  // a step counter
  REQUIRE(c.run_until([&] { return c.tokens(1) >= 2; }));
  c.hub.send(kRouter, kDecode, MiniCluster::request(2, 200, 4));  // long: 7 chunks
  const int64_t long_started = c.tokens(1);
  REQUIRE(c.run_until([&] { return c.tokens(1) >= long_started + 3; }));
  c.hub.send(kRouter, kDecode, MiniCluster::request(3, 10, 4));  // short
  const int64_t short_sent = c.tokens(1);
  REQUIRE(c.run_until([&] { return c.tokens(3) >= 1; }));
  CHECK(c.tokens(1) - short_sent <= 2);
  CHECK(c.tokens(2) == 0);  // the long prompt is still being computed
  REQUIRE(c.run_until([&] { return c.finished(1) && c.finished(2) && c.finished(3); }));
  c.check_stream(1, 60);
  c.check_stream(2, 4);
  c.check_stream(3, 4);
  CHECK(c.failed.empty());
  REQUIRE(c.settle());
}

TEST_CASE("chunked prefill: a prompt ended between chunks leaves nothing behind", "[workers][chunks]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.chunk_tokens = 16;
  MiniCluster c(cfg);
  // Cancelled between chunks, on the prefill rank and (colocated) the decode rank.
  c.submit(MiniCluster::request(1, 200, 4));
  c.hub.send(kRouter, kDecode, MiniCluster::request(2, 200, 4));
  for (int i = 0; i < 3; ++i) c.step_both();
  REQUIRE(c.events.count(1) == 0);
  REQUIRE(c.events.count(2) == 0);
  c.cancel(1);
  c.cancel(2);
  for (int i = 0; i < 20; ++i) c.step_both();
  CHECK(c.events.count(1) == 0);
  CHECK(c.events.count(2) == 0);
  REQUIRE(c.settle());
  CHECK(c.prefill_engine->blocks->check_invariants().is_ok());

  // The decode rank goes down under a prompt between chunks: the prefill rank ends it.
  MiniCluster d(cfg);
  d.submit(MiniCluster::request(3, 200, 4));
  for (int i = 0; i < 2; ++i) d.step_prefill();
  REQUIRE(d.events.count(3) == 0);
  d.peer_down(kDecode);
  REQUIRE(d.run_until([&] { return d.failed_with(3, kPrefill, proto::FailureKind::kPeerDown); }));
  CHECK(d.prefill_free());
  CHECK(d.prefill_engine->blocks->check_invariants().is_ok());
}

TEST_CASE("chunked prefill: a prompt sharing a prefix with one between chunks reuses only written blocks",
          "[workers][chunks]") {
  ClusterConfig cfg = small_config();
  cfg.prefill.chunk_tokens = 16;
  MiniCluster c(cfg);
  proto::PrefillRequest a = MiniCluster::request(1, 120, 5);
  proto::PrefillRequest b = a;  // a's first 40 tokens and 5 of its own: 13 to compute after 32 cached
  b.id = 2;
  b.prompt.resize(40);
  b.prompt.insert(b.prompt.end(), {7, 8, 9, 10, 11});
  c.submit(a);
  c.step_prefill();
  c.step_prefill();  // a: 32 of 120 tokens computed
  c.submit(b);       // reuses a's two written blocks, runs beside a's third chunk
  c.step_prefill();
  REQUIRE(c.events.count(2) == 1);
  CHECK(c.events.count(1) == 0);
  REQUIRE(c.run_until([&] { return c.finished(1) && c.finished(2); }));
  CHECK(c.failed.empty());
  // The reference: b alone on a fresh pair.
  MiniCluster ref(cfg);
  ref.submit(b);
  REQUIRE(ref.run_until([&] { return ref.finished(2); }));
  CHECK(c.token_ids(2) == ref.token_ids(2));
  REQUIRE(c.settle());
  CHECK(c.prefill_engine->blocks->check_invariants().is_ok());
}

TEST_CASE("chunked prefill: a long prompt's completed KV segments move behind its later chunks", "[workers][chunks]") {
  // Blocks of 4 tokens: a 200-token prompt hands off in 4 segments.
  const auto small_blocks = make_small_block_engine;
  std::vector<int32_t> whole;
  for (int chunk : {0, 16}) {
    INFO("chunk_tokens " << chunk);
    ClusterConfig cfg = small_config();
    cfg.prefill.chunk_tokens = chunk;
    MiniCluster c(cfg, {}, {}, small_blocks);
    c.submit(MiniCluster::request(1, 200, 4));
    // Eight iterations: the offer is accepted and about half the prompt is
    // computed (a chunk a pass), so its first segment is complete, its last not.
    for (int i = 0; i < 8; ++i) c.step_both();
    const bool moved_before_last_pass = c.events.count(1) == 0 && c.net.bytes_moved() > 0;
    REQUIRE(c.run_until([&] { return c.finished(1); }));
    REQUIRE(c.settle());
    REQUIRE(c.transfers.size() == 1);
    if (chunk == 0) {
      whole = c.token_ids(1);
    } else {
      CHECK(c.token_ids(1) == whole);
      CHECK(moved_before_last_pass);  // segments went while later chunks computed
      CHECK(c.transfers[0].hidden_bytes == c.transfers[0].bytes);
    }
  }
}


TEST_CASE("workers: the router's messages from a worker, and a worker's from the router, are ignored and counted",
          "[workers][senders]") {
  MiniCluster c(small_config());
  c.use_fake_clock();
  c.submit(MiniCluster::request(1, 20, 12));
  REQUIRE(c.run_until([&] { return c.tokens(1) >= 2; }));
  // The decode rank (or anything speaking as it) steers the prefill rank, and
  // the prefill rank the decode rank, with the router's messages.
  for (const auto& [from, to] : {std::pair{kDecode, kPrefill}, std::pair{kPrefill, kDecode}}) {
    c.hub.send(from, to, proto::Shutdown{});
    c.hub.send(from, to, proto::Drain{});
    c.hub.send(from, to, proto::Rejoin{7});
    c.hub.send(from, to, proto::PeerDown{to == kPrefill ? kDecode : kPrefill, 0});
    c.hub.send(from, to, proto::PeerLeft{to == kPrefill ? kDecode : kPrefill});
    c.hub.send(from, to, proto::Cancel{1});
    c.hub.send(from, to, MiniCluster::request(2));
  }
  // The router speaking a worker's part: a Hello, an accept, an abort.
  c.hub.send(kRouter, kPrefill, proto::Hello{kDecode, 0});
  c.hub.send(kRouter, kPrefill, proto::HandoffAccept{1, proto::kTagKvFirst + 3, 0, {}});
  c.hub.send(kRouter, kDecode, proto::HandoffAbort{1, "forged", 0});
  // A Challenge belongs to a join handshake, never to a serving rank.
  c.hub.send(kPrefill, kDecode, proto::Challenge{"00"});
  // Nothing of it counted: request 1 streams to its end, nobody drains,
  // shuts down, rejoins or drops the other, and the forged prompt never ran.
  REQUIRE(c.run_until([&] { return c.finished(1); }));
  c.check_stream(1, 12);
  CHECK_FALSE(c.prefill->shutting_down());
  CHECK_FALSE(c.decode->shutting_down());
  CHECK(c.drained.empty());
  CHECK(c.failed.empty());
  CHECK(c.events.count(2) == 0);
  c.submit(MiniCluster::request(3));
  REQUIRE(c.run_until([&] { return c.finished(3); }));
  c.check_stream(3, 6);
  REQUIRE(c.settle());
  c.pass(std::chrono::milliseconds(1100));  // the next load report is due
  c.step_both();
  CHECK(c.loads[kPrefill].refused_messages == 7 + 2);
  CHECK(c.loads[kDecode].refused_messages == 7 + 2);
  CHECK(c.loads[kPrefill].epoch == 0);
  CHECK(c.loads[kDecode].epoch == 0);
}

TEST_CASE("workers: an accept or a seal naming a tag outside the KV tags is ignored and counted, and the real accept serves",
          "[workers][senders]") {
  MiniCluster c(small_config());
  c.use_fake_clock();
  c.submit(MiniCluster::request(1, 20, 6));
  c.step_prefill();  // the offer is out
  // Before the decode rank's own accept: one whose KV would travel under the control messages' tag.
  c.hub.send(kDecode, kPrefill, proto::HandoffAccept{1, proto::kTagControl, 0, {}});
  // And a seal asked for under it: the prefill rank would send an empty message among the control messages.
  c.hub.send(kDecode, kPrefill, proto::KvTagSeal{1, proto::kTagControl, 0});
  REQUIRE(c.run_until([&] { return c.finished(1); }));
  c.check_stream(1, 6);
  CHECK(c.failed.empty());
  REQUIRE(c.settle());
  c.pass(std::chrono::milliseconds(1100));
  c.step_both();
  CHECK(c.loads[kPrefill].refused_messages == 2);
}

}  // namespace
}  // namespace pd
