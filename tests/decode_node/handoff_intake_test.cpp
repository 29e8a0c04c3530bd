// HandoffIntake (decode_node/handoff_intake.h) alone: the decode rank's side
// of a handoff on a tiny model's engine, the prefill rank played by a
// HandoffSender over the loopback transport (kvtransfer/loopback_transport.h)
// and the control messages read off a fake channel (fake_channel.h). No
// worker, no batcher: what the intake answers, what it lands, and what it
// gives back (blocks, tags) when a handoff ends early.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "decode_node/handoff_intake.h"
#include "fake_channel.h"
#include "fake_env.h"
#include "gguf/gguf_writer.h"
#include "kvtransfer/handoff_sender.h"
#include "kvtransfer/loopback_transport.h"

namespace pd::test::handoff_intake {
namespace {

constexpr int kRouter = 0, kPrefill = 1, kDecode = 2;

std::unique_ptr<Engine> tiny_engine() {
  static const std::string path = [] {
    const auto file = std::filesystem::temp_directory_path() / ("pd_intake_test_" + std::to_string(::getpid()) + ".gguf");
    const std::vector<uint8_t> bytes = make_tiny_llama_gguf(TinyLlamaSpec{});
    std::ofstream f(file, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return file.string();
  }();
  EngineConfig ec;
  ec.model_path = path;
  ec.threads = 1;
  ec.block_size = 16;
  ec.kv_budget_bytes = 64 << 10;  // a handful of blocks of the tiny model
  ec.prefix_sharing = true;
  auto e = Engine::create(ec);
  INFO(e.status().to_string());
  REQUIRE(e.is_ok());
  return std::move(e).value();
}

// The decode rank's intake and the prefill rank's end of both links.
struct Rig {
  LoopbackNetwork net;
  FakeChannelHub hub;
  std::unique_ptr<Engine> engine = tiny_engine();
  std::unique_ptr<Transport> decode_t = net.endpoint(kDecode), prefill_t = net.endpoint(kPrefill);
  std::unique_ptr<ControlChannel> decode_ch = hub.endpoint(kDecode);
  PeerEpochs peers;
  proto::KvWireHeader header = engine->wire_header();
  proto::KvEndpoint endpoint = local_kv_endpoint(false, "", decode_t->paths());
  proto::Epoch epoch = 0;
  std::shared_ptr<FakeEnv> fake = std::make_shared<FakeEnv>();
  std::shared_ptr<const Env> env = fake;
  ClusterConfig::Timeouts timeouts;
  HandoffIntake intake{HandoffIntake::Context{kDecode, kRouter, engine.get(), decode_t.get(), decode_ch.get(), &peers,
                                              &header, &endpoint, &epoch, &env, timeouts, 2}};
  std::vector<uint8_t> prefill_kv = std::vector<uint8_t>(engine->cache.buffer->size(), 7);  // the "prefill cache" the sender reads

  proto::HandoffOffer offer(proto::RequestId id, int n_prompt = 20) {
    proto::HandoffOffer m;
    m.header = header;
    m.header.request_id = id;
    m.header.n_tokens = n_prompt;
    for (int i = 0; i < n_prompt; ++i) m.prompt.push_back(3 + i);
    m.sampling.max_tokens = 4;
    m.endpoint = endpoint;
    return m;
  }
  // What the prefill rank received, in order.
  std::vector<proto::Message> to_prefill() {
    std::vector<proto::Message> out;
    for (auto& [source, m] : hub.take_all(kPrefill)) out.push_back(std::move(m));
    return out;
  }
  std::vector<proto::RequestFailed> failures() {
    std::vector<proto::RequestFailed> out;
    for (auto& [source, m] : hub.take_all(kRouter))
      if (auto* f = std::get_if<proto::RequestFailed>(&m)) out.push_back(*f);
    return out;
  }
  // The sender of handoff `id` under `tag`, every layer written (checksums off).
  HandoffSender sender(proto::RequestId id, int tag, int n_prompt = 20) {
    const int64_t bs = engine->blocks->block_size();
    HandoffSender s(kDecode, id, 0, header.n_layers, kv_segments((n_prompt + bs - 1) / bs));
    s.accept(tag);
    return s;
  }
  // Each region the size the decode rank's receive expects, from the prefill cache.
  HandoffSender::RegionOf region_of(proto::RequestId id) {
    std::vector<int32_t> table;
    for (BlockId b : engine->blocks->block_table(SeqId{static_cast<int64_t>(id)})) table.push_back(b.value);
    return [this, table](int layer, int segment) {
      KvRegion r = kv_layer_region(engine->cache.buffer->data(), engine->cache.layout, layer, kv_segment(table, segment));
      r.base = prefill_kv.data();  // same shape, the prefill side's bytes
      return r;
    };
  }
  bool all_free() const { return engine->blocks->num_free_blocks() == engine->blocks->num_blocks(); }
};

int accepted_tag(const std::vector<proto::Message>& msgs, proto::RequestId id) {
  for (const proto::Message& m : msgs)
    if (auto* a = std::get_if<proto::HandoffAccept>(&m); a != nullptr && a->id == id) return a->tag;
  return 0;
}

const proto::HandoffReject* reject_of(const std::vector<proto::Message>& msgs, proto::RequestId id) {
  for (const proto::Message& m : msgs)
    if (auto* r = std::get_if<proto::HandoffReject>(&m); r != nullptr && r->id == id) return r;
  return nullptr;
}

TEST_CASE("handoff intake: an offer is accepted under a tag, its KV lands with token 1, its blocks become the batcher's") {
  Rig rig;
  REQUIRE(rig.intake.on_offer(rig.offer(5), kPrefill, false, 17));
  CHECK(rig.intake.size() == 1);
  CHECK(rig.intake.source_of(5) == kPrefill);
  CHECK(rig.intake.accept_offers(0));
  const int tag = accepted_tag(rig.to_prefill(), 5);
  REQUIRE(proto::is_kv_tag(tag));
  CHECK_FALSE(rig.all_free());
  HandoffSender s = rig.sender(5, tag);
  s.finish(42, false, *rig.prefill_t, rig.region_of(5), rig.fake->now());
  std::vector<HandoffIntake::Landed> landed;
  CHECK(rig.intake.progress(landed));
  REQUIRE(landed.size() == 1);
  CHECK(landed[0].id == 5);
  CHECK(landed[0].source == kPrefill);
  CHECK(landed[0].first_token == 42);
  CHECK(landed[0].order == 17);
  CHECK(landed[0].prompt.size() == 20);
  CHECK(landed[0].kv.state() == SeqKv::State::kWritten);
  CHECK(rig.intake.size() == 0);
  CHECK(rig.failures().empty());
  // The tag is free again: every receive under it completed.
  proto::LoadReport r;
  rig.intake.fill_load(r);
  CHECK(r.kv_tags_reclaiming == 0);
  CHECK(r.kv_tags_retired == 0);
  CHECK_FALSE(rig.all_free());  // the landed sequence holds them (the worker releases them)
}

TEST_CASE("handoff intake: a cancel before the offer, a duplicate, an offer too long for the pool are refused at once") {
  Rig rig;
  rig.intake.on_cancel(6, false);  // the router's cancel overtook the offer
  CHECK_FALSE(rig.intake.on_offer(rig.offer(6), kPrefill, false, 0));
  CHECK_FALSE(rig.intake.on_offer(rig.offer(7), kPrefill, /*known=*/true, 0));
  proto::HandoffOffer huge = rig.offer(8);
  huge.sampling.max_tokens = 100000;
  CHECK_FALSE(rig.intake.on_offer(huge, kPrefill, false, 0));
  const auto msgs = rig.to_prefill();
  REQUIRE(reject_of(msgs, 6) != nullptr);
  CHECK(reject_of(msgs, 6)->cancelled);
  REQUIRE(reject_of(msgs, 7) != nullptr);
  CHECK(reject_of(msgs, 7)->reason.find("duplicate") != std::string::npos);
  REQUIRE(reject_of(msgs, 8) != nullptr);
  CHECK_FALSE(reject_of(msgs, 8)->cancelled);
  CHECK(rig.intake.size() == 0);
  // The tombstone went with its offer: a second offer of 6 is a new one.
  CHECK(rig.intake.on_offer(rig.offer(6), kPrefill, false, 1));
}

TEST_CASE("handoff intake: an offer waits for room, then is refused at handoff_ms") {
  Rig rig;
  REQUIRE(rig.intake.on_offer(rig.offer(9), kPrefill, false, 0));
  CHECK_FALSE(rig.intake.accept_offers(rig.engine->blocks->num_blocks()));  // the worker keeps every block
  CHECK(rig.to_prefill().empty());
  proto::LoadReport r;
  rig.intake.fill_load(r);
  CHECK(r.waiting == 1);
  rig.fake->advance(std::chrono::milliseconds(rig.timeouts.handoff_ms + 1));
  rig.intake.check_deadlines({});
  const auto msgs = rig.to_prefill();
  REQUIRE(reject_of(msgs, 9) != nullptr);
  CHECK(reject_of(msgs, 9)->reason.find("no KV room") != std::string::npos);
  CHECK(rig.intake.size() == 0);
  CHECK(rig.all_free());
}

TEST_CASE("handoff intake: cancelled by the router while receiving, the blocks come back only when the data has landed") {
  Rig rig;
  REQUIRE(rig.intake.on_offer(rig.offer(10), kPrefill, false, 0));
  REQUIRE(rig.intake.accept_offers(0));
  const int tag = accepted_tag(rig.to_prefill(), 10);
  rig.intake.on_cancel(10, false);  // kCancelling: the receives stay posted, waiting for the sender
  std::vector<HandoffIntake::Landed> landed;
  rig.intake.progress(landed);
  CHECK(rig.intake.size() == 1);
  CHECK_FALSE(rig.all_free());
  HandoffSender s = rig.sender(10, tag);
  s.finish(1, false, *rig.prefill_t, rig.region_of(10), rig.fake->now());
  rig.intake.progress(landed);
  CHECK(landed.empty());  // ended: nothing for the batcher
  CHECK(rig.intake.size() == 0);
  CHECK(rig.all_free());
  proto::LoadReport r;
  rig.intake.fill_load(r);
  CHECK(r.kv_tags_reclaiming == 0);  // every receive completed: the tag is free
}

TEST_CASE("handoff intake: a sender aborting mid-handoff ends it, its tag is sealed, reclaimed, and given out again") {
  Rig rig;
  REQUIRE(rig.intake.on_offer(rig.offer(11), kPrefill, false, 0));
  REQUIRE(rig.intake.accept_offers(0));
  const int tag = accepted_tag(rig.to_prefill(), 11);
  rig.intake.on_cancel(11, /*from_prefill=*/true);  // nothing was sent: the receives are cancelled
  std::vector<HandoffIntake::Landed> landed;
  rig.intake.progress(landed);
  CHECK(rig.intake.size() == 0);
  CHECK(rig.all_free());
  CHECK(rig.failures().empty());  // the prefill rank told the router
  // The tag ended early with its sender up: it is reclaimed before reuse.
  CHECK(rig.intake.seal_tags());
  const auto msgs = rig.to_prefill();
  const proto::KvTagSeal* seal = nullptr;
  for (const proto::Message& m : msgs)
    if (auto* k = std::get_if<proto::KvTagSeal>(&m)) seal = k;
  REQUIRE(seal != nullptr);
  CHECK(seal->tag == tag);
  CHECK(seal->id == 11);
  proto::LoadReport r;
  rig.intake.fill_load(r);
  CHECK(r.kv_tags_reclaiming == 1);
  // The prefill rank seals it (an empty send under the tag): the tag comes back.
  REQUIRE(rig.prefill_t->post_send_bytes(kDecode, tag, nullptr, 0).is_ok());
  rig.intake.progress(landed);
  proto::LoadReport after;
  rig.intake.fill_load(after);
  CHECK(after.kv_tags_reclaiming == 0);
  CHECK(after.kv_tags_retired == 0);
}

TEST_CASE("handoff intake: a trailer of another attempt under the tag fails the handoff, its tag is reclaimed") {
  Rig rig;
  REQUIRE(rig.intake.on_offer(rig.offer(12), kPrefill, false, 0));
  REQUIRE(rig.intake.accept_offers(0));
  const int tag = accepted_tag(rig.to_prefill(), 12);
  HandoffSender stale = rig.sender(99, tag);  // a stale transfer's data under this tag
  stale.finish(1, false, *rig.prefill_t, rig.region_of(12), rig.fake->now());
  std::vector<HandoffIntake::Landed> landed;
  rig.intake.progress(landed);
  CHECK(landed.empty());
  const auto failed = rig.failures();
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].id == 12);
  CHECK(failed[0].kind == proto::FailureKind::kTransfer);
  CHECK(failed[0].reason.find("stale transfer") != std::string::npos);
  CHECK(rig.intake.size() == 0);
  CHECK(rig.all_free());
  proto::LoadReport r;
  rig.intake.fill_load(r);
  CHECK(r.kv_tags_reclaiming == 1);  // its own sends may still be pending under the tag
}

TEST_CASE("handoff intake: its sender going down ends an offered and a receiving handoff (kPeerDown)") {
  Rig rig;
  REQUIRE(rig.intake.on_offer(rig.offer(13), kPrefill, false, 0));
  REQUIRE(rig.intake.accept_offers(0));
  REQUIRE(rig.intake.on_offer(rig.offer(14), kPrefill, false, 1));
  rig.peers.down(kPrefill, 0);
  rig.intake.on_peer_down(kPrefill);
  const auto failed = rig.failures();
  REQUIRE(failed.size() == 2);
  for (const auto& f : failed) CHECK(f.kind == proto::FailureKind::kPeerDown);
  std::vector<HandoffIntake::Landed> landed;
  rig.intake.progress(landed);  // the unmatched receives were cancelled
  CHECK(rig.intake.size() == 0);
  CHECK(rig.all_free());
}

}  // namespace
}  // namespace pd::test::handoff_intake
