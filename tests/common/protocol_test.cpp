// Protocol messages: every type survives serialize -> deserialize; garbage is
// a Corruption value, never a crash; the KV wire header refuses a mismatched
// peer naming the fields.
#include <catch2/catch.hpp>

#include <limits>

#include <nlohmann/json.hpp>

#include "protocol/messages.h"

using namespace pd;
using namespace pd::proto;

namespace {
template <typename T>
T round_trip(const T& m) {
  const std::vector<uint8_t> bytes = serialize(Message{m});
  auto back = deserialize(bytes.data(), bytes.size());
  INFO(back.status().to_string());
  REQUIRE(back.is_ok());
  REQUIRE(std::holds_alternative<T>(*back));
  return std::get<T>(*back);
}
}  // namespace

TEST_CASE("protocol: every message round-trips", "[protocol]") {
  SamplingParams sp;
  sp.temperature = 0.7f;
  sp.top_k = 40;
  sp.top_p = 0.9f;
  sp.min_p = 0.05f;
  sp.presence_penalty = 0.5f;
  sp.frequency_penalty = -0.25f;
  sp.seed = 0xFFFFFFFFFFFFFFF0ULL;
  sp.max_tokens = 77;
  sp.ignore_eos = true;
  sp.stop_token_ids = {2, 5};
  sp.logprobs = 5;
  sp.prompt_logprobs = true;
  sp.resumed_tokens = 2;
  sp.logit_bias = {{3, -100.0f}, {1234, 2.5f}};
  PrefillRequest pr{123456789012345ULL, {1, 2, 3}, sp, 4};
  const PrefillRequest pr2 = round_trip(pr);
  CHECK(pr2.id == pr.id);
  CHECK(pr2.prompt == pr.prompt);
  CHECK(pr2.decode_rank == 4);
  CHECK(pr2.sampling.temperature == sp.temperature);
  CHECK(pr2.sampling.top_k == 40);
  CHECK(pr2.sampling.seed == sp.seed);
  CHECK(pr2.sampling.max_tokens == 77);
  CHECK(pr2.sampling.ignore_eos);
  CHECK(pr2.sampling.stop_token_ids == sp.stop_token_ids);
  CHECK(pr2.sampling.frequency_penalty == sp.frequency_penalty);
  CHECK(pr2.sampling.logprobs == 5);
  CHECK(pr2.sampling.prompt_logprobs);
  CHECK(pr2.sampling.resumed_tokens == 2);
  CHECK(pr2.sampling.logit_bias == sp.logit_bias);
  CHECK(!pr2.sampling.grammar.active());
  CHECK(pr2.sampling.speculate);
  CHECK(pr2.sampling.repetition_penalty == 1.0f);
  CHECK(pr2.sampling.min_tokens == 0);
  // An output constraint, the speculation switch, repetition_penalty and min_tokens travel too.
  PrefillRequest constrained = pr;
  constrained.sampling.grammar = GrammarSpec{GrammarKind::kJsonSchema, R"({"type":"object"})", "<a>", "</a>"};
  constrained.sampling.speculate = false;
  constrained.sampling.repetition_penalty = 1.25f;
  constrained.sampling.min_tokens = 9;
  const PrefillRequest c2 = round_trip(constrained);
  CHECK(c2.sampling.grammar == constrained.sampling.grammar);
  CHECK(!c2.sampling.speculate);
  CHECK(c2.sampling.repetition_penalty == 1.25f);
  CHECK(c2.sampling.min_tokens == 9);
  // A grammar kind outside the enum is a malformed message.
  auto j = nlohmann::json::from_msgpack(serialize(Message{constrained}));
  for (auto& [k, v] : j.items())
    if (v.is_object() && v.contains("grammar")) v["grammar"]["kind"] = 99;
  const auto bad_grammar = nlohmann::json::to_msgpack(j);
  CHECK(deserialize(bad_grammar.data(), bad_grammar.size()).status().is_corruption());

  KvWireHeader h;
  h.request_id = 9;
  h.n_tokens = 33;
  h.block_size = 16;
  h.n_layers = 30;
  h.n_kv_heads = 3;
  h.head_dim = 64;
  h.n_embd = 576;
  h.vocab = 49152;
  const HandoffOffer off = round_trip(HandoffOffer{h, {7, 8}, sp});
  CHECK(off.header.request_id == 9);
  CHECK(off.sampling.logprobs == 5);  // the decode rank reports logprobs too
  CHECK(off.header.n_tokens == 33);
  CHECK(check_compatible(h, off.header).is_ok());
  CHECK(off.prompt == std::vector<int32_t>{7, 8});

  CHECK(round_trip(Cancel{5}).id == 5);
  round_trip(Shutdown{});
  const HandoffAccept acc = round_trip(HandoffAccept{5, 1234, 3, KvEndpoint{"h2", "cuda", "GPU-9", {"cuda_ipc"}}});
  CHECK((acc.tag == 1234 && acc.epoch == 3));
  CHECK((acc.endpoint.host == "h2" && acc.endpoint.memory == "cuda" && acc.endpoint.device == "GPU-9"));
  CHECK(acc.endpoint.paths == std::vector<std::string>{"cuda_ipc"});
  HandoffOffer with_end{h, {7}, sp};
  with_end.endpoint = KvEndpoint{"h1", "host", "", {}};
  CHECK(round_trip(with_end).endpoint.host == "h1");
  CHECK(round_trip(with_end).endpoint.memory == "host");
  const HandoffReject rj = round_trip(HandoffReject{5, "no room", true, 2});
  CHECK((rj.reason == "no room" && rj.cancelled && rj.epoch == 2));
  const HandoffAbort ab = round_trip(HandoffAbort{6, "gone", 4});
  CHECK((ab.reason == "gone" && ab.epoch == 4));
  const PeerDown pd = round_trip(PeerDown{3, 1});
  CHECK((pd.rank == 3 && pd.epoch == 1));
  const PeerUp pu = round_trip(PeerUp{3, 2});
  CHECK((pu.rank == 3 && pu.epoch == 2));
  CHECK(round_trip(Rejoin{5}).epoch == 5);
  CHECK(round_trip(Listening{"123.0:456"}).port == "123.0:456");
  const Join jn = round_trip(Join{2, "node-b", 77, 16, "9.0:1", "node-b:70", "q8_0", "ab12"});
  CHECK((jn.role == 2 && jn.host == "node-b" && jn.pid == 77 && jn.block_size == 16 && jn.port == "9.0:1" &&
         jn.pool == "node-b:70" && jn.kv_dtype == "q8_0" && jn.proof == "ab12"));
  const JoinAccepted ja = round_trip(JoinAccepted{6, 0, false, {{1, 1, "p1", 0}, {2, 1, "p2", 3}}});
  REQUIRE(ja.peers.size() == 2);
  CHECK((ja.rank == 6 && !ja.colocated && ja.peers[1].rank == 2 && ja.peers[1].port == "p2" && ja.peers[1].epoch == 3));
  CHECK(round_trip(JoinRefused{"kv.block_size 32"}).reason == "kv.block_size 32");
  const Hello hi = round_trip(Hello{6, 1, "cd34"});
  CHECK((hi.rank == 6 && hi.epoch == 1 && hi.proof == "cd34"));
  CHECK(round_trip(Challenge{"0123abcd"}).nonce == "0123abcd");
  round_trip(Leave{});
  round_trip(Drain{});
  round_trip(Drained{});
  CHECK(round_trip(PeerLeft{6}).rank == 6);
  round_trip(RouterBeat{});
  const PeerGone gone = round_trip(PeerGone{5, 2});
  CHECK((gone.rank == 5 && gone.epoch == 2));
  CHECK(round_trip(RequestFailed{4, "leaving", FailureKind::kLeaving}).kind == FailureKind::kLeaving);
  TokenEvent ev;
  ev.id = 3;
  ev.first_index = 1;
  ev.tokens = {10, 11};
  ev.finish = Finish::kLength;
  ev.queue_s = 0.25;
  const TokenEvents te = round_trip(TokenEvents{{ev, ev}});
  REQUIRE(te.events.size() == 2);
  CHECK(te.events[1].tokens == ev.tokens);
  CHECK(te.events[1].finish == Finish::kLength);
  CHECK(te.events[1].queue_s == 0.25);
  CHECK(te.events[1].logprobs.empty());
  CHECK(te.events[1].prompt_logprobs.empty());
  CHECK(te.events[1].cached_tokens == 0);
  TokenEvent cached = ev;
  cached.cached_tokens = 384;
  CHECK(round_trip(TokenEvents{{cached}}).events[0].cached_tokens == 384);
  // KV events: 64-bit hashes exactly (the top bit set too).
  const KvEvents kv = round_trip(KvEvents{3, true, {0xfedcba9876543210ULL, 1}, {42}});
  CHECK((kv.epoch == 3 && kv.reset));
  CHECK(kv.stored == std::vector<uint64_t>{0xfedcba9876543210ULL, 1});
  CHECK(kv.removed == std::vector<uint64_t>{42});
  // Logprobs, bit-exact (-inf included), for each token and for the prompt.
  const float inf = std::numeric_limits<float>::infinity();
  TokenEvent lp = ev;
  lp.logprobs = {LogprobEntry{10, -0.125f, {{10, -0.125f}, {4, -3.5f}}}, LogprobEntry{11, -inf, {}}};
  lp.prompt_logprobs = {LogprobEntry{7, -1.0f / 3.0f, {{2, -0.01f}}}};
  const TokenEvents tl = round_trip(TokenEvents{{lp}});
  REQUIRE(tl.events.size() == 1);
  CHECK(tl.events[0].logprobs == lp.logprobs);
  CHECK(tl.events[0].prompt_logprobs == lp.prompt_logprobs);
  // One logprob entry per token, or none.
  TokenEvent uneven = lp;
  uneven.logprobs.pop_back();
  const std::vector<uint8_t> bytes = serialize(TokenEvents{{uneven}});
  CHECK(deserialize(bytes.data(), bytes.size()).status().is_corruption());
  CHECK(round_trip(TransferStats{3, 1000, 0.5, 0.25}).bytes == 1000);
  const Warmed w = round_trip(Warmed{5, 61});
  CHECK((w.id == 5 && w.computed == 61));
  const RequestFailed f = round_trip(RequestFailed{4, "boom", FailureKind::kPeerDown});
  CHECK((f.reason == "boom" && f.kind == FailureKind::kPeerDown));
  // A failure kind outside the enum is a malformed message, not a value.
  auto bad_kind = nlohmann::json::to_msgpack(nlohmann::json{{"t", "failed"}, {"id", 1}, {"reason", "x"}, {"kind", 99}});
  CHECK(deserialize(bad_kind.data(), bad_kind.size()).status().is_corruption());
  LoadReport lr;
  lr.waiting = 2;
  lr.running = 3;
  lr.free_blocks = 100;
  lr.total_blocks = 200;
  lr.preemptions = 7;
  lr.ready = true;
  lr.epoch = 2;
  lr.quarantined_blocks = 5;
  lr.prompt_tokens_cached = 640;
  lr.prompt_tokens_computed = 1234;
  lr.spec_drafted = 90;
  lr.spec_accepted = 61;
  lr.spec_steps = 30;
  const LoadReport lr2 = round_trip(lr);
  CHECK((lr2.spec_drafted == 90 && lr2.spec_accepted == 61 && lr2.spec_steps == 30));
  CHECK((lr2.waiting == 2 && lr2.running == 3 && lr2.free_blocks == 100 && lr2.preemptions == 7 && lr2.ready));
  CHECK((lr2.epoch == 2 && lr2.quarantined_blocks == 5));
  CHECK((lr2.prompt_tokens_cached == 640 && lr2.prompt_tokens_computed == 1234));
}

TEST_CASE("protocol: malformed bytes are a Corruption value", "[protocol]") {
  const std::vector<uint8_t> garbage{0xc1, 0x00, 0xff};
  auto r = deserialize(garbage.data(), garbage.size());
  REQUIRE(!r.is_ok());
  CHECK(r.status().is_corruption());
  // Valid MessagePack, unknown type / missing field.
  const auto unknown = nlohmann::json::to_msgpack(nlohmann::json{{"t", "teleport"}});
  CHECK(deserialize(unknown.data(), unknown.size()).status().is_corruption());
  const auto missing = nlohmann::json::to_msgpack(nlohmann::json{{"t", "cancel"}});
  CHECK(deserialize(missing.data(), missing.size()).status().is_corruption());
  // Every truncation of a real message fails cleanly.
  const auto bytes = serialize(Message{PrefillRequest{1, {1, 2, 3}, SamplingParams{}, 2}});
  for (size_t n = 0; n < bytes.size(); ++n) CHECK(!deserialize(bytes.data(), n).is_ok());
}

TEST_CASE("protocol: the KV wire header refuses a mismatched peer, naming the fields", "[protocol]") {
  KvWireHeader a;
  a.block_size = 16;
  a.n_layers = 30;
  a.n_kv_heads = 3;
  a.head_dim = 64;
  a.n_embd = 576;
  a.vocab = 49152;
  KvWireHeader b = a;
  CHECK(check_compatible(a, b).is_ok());
  b.n_layers = 2;
  b.block_size = 32;
  const Status st = check_compatible(a, b);
  REQUIRE(st.is_invalid_argument());
  CHECK(st.message().find("n_layers 2 (sender) != 30 (receiver)") != std::string::npos);
  CHECK(st.message().find("block_size 32") != std::string::npos);
  b = a;
  b.dtype = "f16";
  CHECK(check_compatible(a, b).message().find("dtype") != std::string::npos);
  b = a;
  b.version = 99;
  CHECK(check_compatible(a, b).is_unsupported());
}

TEST_CASE("protocol: KV events travel in bounded messages, removals first, the reset on the first", "[protocol]") {
  using pd::proto::kv_events_messages;
  CHECK(kv_events_messages(1, false, {}, {}).empty());  // nothing changed: nothing sent
  const auto empty_reset = kv_events_messages(1, true, {}, {});
  REQUIRE(empty_reset.size() == 1);  // "forget all I had", with nothing new
  CHECK((empty_reset[0].reset && empty_reset[0].stored.empty()));
  std::vector<uint64_t> stored, removed{100, 101};
  for (uint64_t h = 0; h < 7; ++h) stored.push_back(h);
  const auto ms = kv_events_messages(4, true, stored, removed, 3);
  REQUIRE(ms.size() == 3);  // 9 hashes, 3 per message
  CHECK((ms[0].reset && !ms[1].reset && !ms[2].reset));
  CHECK(ms[0].removed == std::vector<uint64_t>{100, 101});
  CHECK(ms[0].stored == std::vector<uint64_t>{0});
  CHECK(ms[1].stored == std::vector<uint64_t>{1, 2, 3});
  CHECK(ms[2].stored == std::vector<uint64_t>{4, 5, 6});
  for (const auto& m : ms) CHECK(m.epoch == 4);
}

TEST_CASE("protocol: bytes nested deeper than kMaxMessageDepth are refused without recursing into them",
          "[protocol][refuse]") {
  // A million one-element arrays, one inside the next (0x91 = fixarray of 1),
  // around a nil: parsed recursively, this would exhaust the stack.
  std::vector<uint8_t> deep(1000000, 0x91);
  deep.push_back(0xc0);
  const auto r = deserialize(deep.data(), deep.size());
  REQUIRE(r.status().is_corruption());
  CHECK(r.status().message().find("nested deeper than") != std::string::npos);
  // The same within the cap is a well-formed MessagePack value, refused only as no message.
  std::vector<uint8_t> shallow(static_cast<size_t>(kMaxMessageDepth) - 1, 0x91);
  shallow.push_back(0xc0);
  const auto s = deserialize(shallow.data(), shallow.size());
  REQUIRE(s.status().is_corruption());
  CHECK(s.status().message().find("nested deeper than") == std::string::npos);
  // Maps count too (0x81 = fixmap of 1, key "a" = 0xa1 0x61).
  std::vector<uint8_t> maps;
  for (int i = 0; i < 100000; ++i) maps.insert(maps.end(), {0x81, 0xa1, 0x61});
  maps.push_back(0xc0);
  CHECK(deserialize(maps.data(), maps.size()).status().message().find("nested deeper than") != std::string::npos);
  // The deepest real message still parses: token events with logprobs.
  TokenEvent ev;
  ev.tokens = {1};
  ev.logprobs = {LogprobEntry{1, -0.5f, {{1, -0.5f}, {2, -1.5f}}}};
  ev.prompt_logprobs = ev.logprobs;
  CHECK(round_trip(TokenEvents{{ev}}).events[0].logprobs[0].top.size() == 2);
}

TEST_CASE("protocol: each message has one class of sender", "[protocol]") {
  CHECK(sender_of(Shutdown{}) == Sender::kRouter);
  CHECK(sender_of(Drain{}) == Sender::kRouter);
  CHECK(sender_of(Rejoin{}) == Sender::kRouter);
  CHECK(sender_of(PeerDown{}) == Sender::kRouter);
  CHECK(sender_of(PeerLeft{}) == Sender::kRouter);
  CHECK(sender_of(PrefillRequest{}) == Sender::kRouter);
  CHECK(sender_of(Cancel{}) == Sender::kRouter);
  CHECK(sender_of(JoinAccepted{}) == Sender::kRouter);
  CHECK(sender_of(Hello{}) == Sender::kWorker);
  CHECK(sender_of(Join{}) == Sender::kWorker);
  CHECK(sender_of(HandoffOffer{}) == Sender::kWorker);
  CHECK(sender_of(HandoffAccept{}) == Sender::kWorker);
  CHECK(sender_of(LoadReport{}) == Sender::kWorker);
  CHECK(sender_of(TokenEvents{}) == Sender::kWorker);
  CHECK(sender_of(Challenge{}) == Sender::kAny);
}
