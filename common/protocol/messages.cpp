#include "protocol/messages.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace pd::proto {
namespace {

using nlohmann::json;

json sampling_json(const SamplingParams& p) {
  json j{{"temperature", p.temperature}, {"top_k", p.top_k},
              {"top_p", p.top_p},             {"min_p", p.min_p},
              {"presence", p.presence_penalty}, {"frequency", p.frequency_penalty},
              {"seed", p.seed},               {"max_tokens", p.max_tokens},
              {"ignore_eos", p.ignore_eos},   {"stop_ids", p.stop_token_ids},
              {"logprobs", p.logprobs},       {"prompt_logprobs", p.prompt_logprobs},
              {"resumed", p.resumed_tokens},  {"bias", p.logit_bias}};
  if (!p.speculate) j["spec"] = false;
  if (p.repetition_penalty != 1.0f) j["rep"] = p.repetition_penalty;
  if (p.min_tokens != 0) j["min_tokens"] = p.min_tokens;
  if (p.grammar.active()) {
    j["grammar"] = json{{"kind", static_cast<int32_t>(p.grammar.kind)}, {"text", p.grammar.text},
                        {"prefix", p.grammar.prefix}, {"suffix", p.grammar.suffix}};
  }
  return j;
}
SamplingParams sampling_from(const json& j) {
  SamplingParams p;
  p.temperature = j.at("temperature").get<float>();
  p.top_k = j.at("top_k").get<int32_t>();
  p.top_p = j.at("top_p").get<float>();
  p.min_p = j.at("min_p").get<float>();
  p.presence_penalty = j.at("presence").get<float>();
  p.frequency_penalty = j.at("frequency").get<float>();
  p.seed = j.at("seed").get<uint64_t>();
  p.max_tokens = j.at("max_tokens").get<int32_t>();
  p.ignore_eos = j.at("ignore_eos").get<bool>();
  p.stop_token_ids = j.at("stop_ids").get<std::vector<int32_t>>();
  p.logprobs = j.at("logprobs").get<int32_t>();
  p.prompt_logprobs = j.at("prompt_logprobs").get<bool>();
  p.resumed_tokens = j.at("resumed").get<int32_t>();
  p.logit_bias = j.value("bias", std::vector<std::pair<int32_t, float>>{});  // absent from an older peer: none
  p.speculate = j.value("spec", true);  // absent (also from an older peer): allowed
  p.repetition_penalty = j.value("rep", 1.0f);  // absent: off
  p.min_tokens = j.value("min_tokens", 0);
  if (const auto g = j.find("grammar"); g != j.end()) {  // absent: unconstrained
    const int32_t kind = g->at("kind").get<int32_t>();
    if (kind < 0 || kind > kGrammarKindMax) throw std::out_of_range("unknown grammar kind " + std::to_string(kind));
    p.grammar.kind = static_cast<GrammarKind>(kind);
    p.grammar.text = g->at("text").get<std::string>();
    p.grammar.prefix = g->at("prefix").get<std::string>();
    p.grammar.suffix = g->at("suffix").get<std::string>();
  }
  return p;
}
// A LogprobEntry as [token, logprob, [top ids], [top logprobs]].
json logprobs_json(const std::vector<LogprobEntry>& entries) {
  json out = json::array();
  for (const LogprobEntry& e : entries) {
    json ids = json::array(), lps = json::array();
    for (const TokenLogprob& t : e.top) {
      ids.push_back(t.id);
      lps.push_back(t.logprob);
    }
    out.push_back(json::array({e.token, e.logprob, std::move(ids), std::move(lps)}));
  }
  return out;
}
std::vector<LogprobEntry> logprobs_from(const json& j) {
  std::vector<LogprobEntry> out;
  for (const json& e : j) {
    if (!e.is_array() || e.size() != 4) throw std::out_of_range("a logprob entry must be [token, logprob, ids, logprobs]");
    LogprobEntry entry;
    entry.token = e[0].get<int32_t>();
    entry.logprob = e[1].get<float>();
    const auto ids = e[2].get<std::vector<int32_t>>();
    const auto lps = e[3].get<std::vector<float>>();
    if (ids.size() != lps.size()) throw std::out_of_range("a logprob entry's ids and logprobs differ in length");
    for (size_t i = 0; i < ids.size(); ++i) entry.top.push_back({ids[i], lps[i]});
    out.push_back(std::move(entry));
  }
  return out;
}
json header_json(const KvWireHeader& h) {
  return json{{"version", h.version},   {"id", h.request_id},       {"n_tokens", h.n_tokens},
              {"block_size", h.block_size}, {"dtype", h.dtype},     {"n_layers", h.n_layers},
              {"n_kv_heads", h.n_kv_heads}, {"head_dim", h.head_dim}, {"n_embd", h.n_embd},
              {"vocab", h.vocab},       {"checksum", h.checksum}};
}
KvWireHeader header_from(const json& j) {
  KvWireHeader h;
  h.version = j.at("version").get<uint32_t>();
  h.request_id = j.at("id").get<RequestId>();
  h.n_tokens = j.at("n_tokens").get<int32_t>();
  h.block_size = j.at("block_size").get<int32_t>();
  h.dtype = j.at("dtype").get<std::string>();
  h.n_layers = j.at("n_layers").get<int32_t>();
  h.n_kv_heads = j.at("n_kv_heads").get<int32_t>();
  h.head_dim = j.at("head_dim").get<int32_t>();
  h.n_embd = j.at("n_embd").get<int32_t>();
  h.vocab = j.at("vocab").get<int32_t>();
  h.checksum = j.at("checksum").get<bool>();
  return h;
}

json endpoint_json(const KvEndpoint& e) {
  return json{{"host", e.host}, {"memory", e.memory}, {"device", e.device}, {"paths", e.paths}};
}
KvEndpoint endpoint_from(const json& j) {
  KvEndpoint e;
  e.host = j.at("host").get<std::string>();
  e.memory = j.at("memory").get<std::string>();
  e.device = j.at("device").get<std::string>();
  e.paths = j.at("paths").get<std::vector<std::string>>();
  return e;
}

struct ToJson {
  json operator()(const PrefillRequest& m) const {
    return {{"t", "prefill"}, {"id", m.id}, {"prompt", m.prompt}, {"sampling", sampling_json(m.sampling)},
            {"decode_rank", m.decode_rank}};
  }
  json operator()(const Cancel& m) const { return {{"t", "cancel"}, {"id", m.id}}; }
  json operator()(const Shutdown&) const { return {{"t", "shutdown"}}; }
  json operator()(const HandoffOffer& m) const {
    return {{"t", "offer"}, {"header", header_json(m.header)}, {"prompt", m.prompt},
            {"sampling", sampling_json(m.sampling)}, {"epoch", m.epoch}, {"endpoint", endpoint_json(m.endpoint)}};
  }
  json operator()(const HandoffAccept& m) const {
    return {{"t", "accept"}, {"id", m.id}, {"tag", m.tag}, {"epoch", m.epoch}, {"endpoint", endpoint_json(m.endpoint)}};
  }
  json operator()(const HandoffReject& m) const {
    return {{"t", "reject"}, {"id", m.id}, {"reason", m.reason}, {"cancelled", m.cancelled}, {"epoch", m.epoch}};
  }
  json operator()(const KvTagSeal& m) const {
    return {{"t", "seal"}, {"id", m.id}, {"tag", m.tag}, {"epoch", m.epoch}};
  }
  json operator()(const HandoffAbort& m) const {
    return {{"t", "abort"}, {"id", m.id}, {"reason", m.reason}, {"epoch", m.epoch}};
  }
  json operator()(const PeerDown& m) const { return {{"t", "down"}, {"rank", m.rank}, {"epoch", m.epoch}}; }
  json operator()(const PeerUp& m) const { return {{"t", "up"}, {"rank", m.rank}, {"epoch", m.epoch}}; }
  json operator()(const Rejoin& m) const { return {{"t", "rejoin"}, {"epoch", m.epoch}}; }
  json operator()(const Listening& m) const { return {{"t", "listening"}, {"port", m.port}}; }
  json operator()(const Join& m) const {
    return {{"t", "join"}, {"role", m.role}, {"host", m.host}, {"pid", m.pid}, {"block_size", m.block_size},
            {"port", m.port}, {"pool", m.pool}, {"kv_dtype", m.kv_dtype}, {"proof", m.proof}, {"model", m.model}};
  }
  json operator()(const JoinAccepted& m) const {
    json peers = json::array();
    for (const JoinPeer& p : m.peers)
      peers.push_back({{"rank", p.rank}, {"role", p.role}, {"port", p.port}, {"epoch", p.epoch}});
    return {{"t", "joined"}, {"rank", m.rank}, {"epoch", m.epoch}, {"colocated", m.colocated}, {"peers", peers}};
  }
  json operator()(const JoinRefused& m) const { return {{"t", "refused"}, {"reason", m.reason}}; }
  json operator()(const Hello& m) const {
    return {{"t", "hello"}, {"rank", m.rank}, {"epoch", m.epoch}, {"proof", m.proof}};
  }
  json operator()(const Challenge& m) const { return {{"t", "challenge"}, {"nonce", m.nonce}}; }
  json operator()(const Leave&) const { return {{"t", "leave"}}; }
  json operator()(const Drain&) const { return {{"t", "drain"}}; }
  json operator()(const Drained&) const { return {{"t", "drained"}}; }
  json operator()(const PeerLeft& m) const { return {{"t", "left"}, {"rank", m.rank}}; }
  json operator()(const RouterBeat&) const { return {{"t", "beat"}}; }
  json operator()(const PeerGone& m) const { return {{"t", "gone"}, {"rank", m.rank}, {"epoch", m.epoch}}; }
  json operator()(const TokenEvents& m) const {
    json events = json::array();
    for (const TokenEvent& e : m.events) {
      json ev = {{"id", e.id}, {"first", e.first_index}, {"tokens", e.tokens},
                 {"finish", static_cast<int32_t>(e.finish)}, {"queue_s", e.queue_s}, {"prefill_s", e.prefill_s}};
      if (e.cached_tokens != 0) ev["cached"] = e.cached_tokens;
      // Only requests that asked carry logprobs: the common event stays small.
      if (!e.logprobs.empty()) ev["lp"] = logprobs_json(e.logprobs);
      if (!e.prompt_logprobs.empty()) ev["prompt_lp"] = logprobs_json(e.prompt_logprobs);
      events.push_back(std::move(ev));
    }
    return {{"t", "tokens"}, {"events", std::move(events)}};
  }
  json operator()(const KvEvents& m) const {
    return {{"t", "kv"}, {"epoch", m.epoch}, {"reset", m.reset}, {"stored", m.stored}, {"removed", m.removed}};
  }
  json operator()(const TransferStats& m) const {
    return {{"t", "xfer"},         {"id", m.id},         {"bytes", m.bytes},
            {"exposed_s", m.exposed_s}, {"wire_s", m.wire_s}, {"hidden", m.hidden_bytes}};
  }
  json operator()(const Warmed& m) const { return {{"t", "warmed"}, {"id", m.id}, {"computed", m.computed}}; }
  json operator()(const RequestFailed& m) const {
    return {{"t", "failed"}, {"id", m.id}, {"reason", m.reason}, {"kind", static_cast<int32_t>(m.kind)}};
  }
  json operator()(const LoadReport& m) const {
    return {{"t", "load"},           {"waiting", m.waiting},         {"running", m.running},
            {"free", m.free_blocks}, {"total", m.total_blocks}, {"preemptions", m.preemptions},
            {"ready", m.ready},        {"epoch", m.epoch},             {"quarantined", m.quarantined_blocks},
            {"cached", m.prompt_tokens_cached}, {"computed", m.prompt_tokens_computed},
            {"refused", m.refused_messages},
            {"tags_retired", m.kv_tags_retired}, {"tags_reclaiming", m.kv_tags_reclaiming},
            {"drafted", m.spec_drafted}, {"accepted", m.spec_accepted},
            {"spec_steps", m.spec_steps}};
  }
};

TokenEvents token_events_from(const json& j) {
  TokenEvents m;
  for (const json& e : j.at("events")) {
    TokenEvent ev;
    ev.id = e.at("id").get<RequestId>();
    ev.first_index = e.at("first").get<int32_t>();
    ev.tokens = e.at("tokens").get<std::vector<int32_t>>();
    const int32_t f = e.at("finish").get<int32_t>();
    if (f < 0 || f > 2) throw std::out_of_range("finish " + std::to_string(f));
    ev.finish = static_cast<Finish>(f);
    ev.queue_s = e.at("queue_s").get<double>();
    ev.prefill_s = e.at("prefill_s").get<double>();
    ev.cached_tokens = e.value("cached", int32_t{0});
    if (auto lp = e.find("lp"); lp != e.end()) ev.logprobs = logprobs_from(*lp);
    if (auto lp = e.find("prompt_lp"); lp != e.end()) ev.prompt_logprobs = logprobs_from(*lp);
    if (!ev.logprobs.empty() && ev.logprobs.size() != ev.tokens.size())
      throw std::out_of_range("token event with " + std::to_string(ev.tokens.size()) + " tokens and " +
                              std::to_string(ev.logprobs.size()) + " logprob entries");
    m.events.push_back(std::move(ev));
  }
  return m;
}

LoadReport load_report_from(const json& j) {
  LoadReport m;
  m.waiting = j.at("waiting").get<int32_t>();
  m.running = j.at("running").get<int32_t>();
  m.free_blocks = j.at("free").get<int64_t>();
  m.total_blocks = j.at("total").get<int64_t>();
  m.preemptions = j.at("preemptions").get<int64_t>();
  m.ready = j.at("ready").get<bool>();
  m.epoch = j.at("epoch").get<Epoch>();
  m.quarantined_blocks = j.at("quarantined").get<int64_t>();
  m.prompt_tokens_cached = j.at("cached").get<int64_t>();
  m.prompt_tokens_computed = j.at("computed").get<int64_t>();
  m.refused_messages = j.value("refused", int64_t{0});
  m.kv_tags_retired = j.value("tags_retired", int64_t{0});
  m.kv_tags_reclaiming = j.value("tags_reclaiming", int64_t{0});
  m.spec_drafted = j.value("drafted", int64_t{0});  // absent from an older peer: none
  m.spec_accepted = j.value("accepted", int64_t{0});
  m.spec_steps = j.value("spec_steps", int64_t{0});
  return m;
}

Message from_json(const json& j) {
  const std::string t = j.at("t").get<std::string>();
  if (t == "prefill")
    return PrefillRequest{j.at("id").get<RequestId>(), j.at("prompt").get<std::vector<int32_t>>(),
                          sampling_from(j.at("sampling")), j.at("decode_rank").get<int32_t>()};
  if (t == "cancel") return Cancel{j.at("id").get<RequestId>()};
  if (t == "shutdown") return Shutdown{};
  if (t == "offer")
    return HandoffOffer{header_from(j.at("header")), j.at("prompt").get<std::vector<int32_t>>(),
                        sampling_from(j.at("sampling")), j.at("epoch").get<Epoch>(), endpoint_from(j.at("endpoint"))};
  if (t == "accept")
    return HandoffAccept{j.at("id").get<RequestId>(), j.at("tag").get<int32_t>(), j.at("epoch").get<Epoch>(),
                         endpoint_from(j.at("endpoint"))};
  if (t == "reject")
    return HandoffReject{j.at("id").get<RequestId>(), j.at("reason").get<std::string>(),
                         j.at("cancelled").get<bool>(), j.at("epoch").get<Epoch>()};
  if (t == "abort")
    return HandoffAbort{j.at("id").get<RequestId>(), j.at("reason").get<std::string>(), j.at("epoch").get<Epoch>()};
  if (t == "seal") return KvTagSeal{j.at("id").get<RequestId>(), j.at("tag").get<int32_t>(), j.at("epoch").get<Epoch>()};
  if (t == "down") return PeerDown{j.at("rank").get<int32_t>(), j.at("epoch").get<Epoch>()};
  if (t == "up") return PeerUp{j.at("rank").get<int32_t>(), j.at("epoch").get<Epoch>()};
  if (t == "rejoin") return Rejoin{j.at("epoch").get<Epoch>()};
  if (t == "listening") return Listening{j.at("port").get<std::string>()};
  if (t == "join")
    return Join{j.at("role").get<int32_t>(), j.at("host").get<std::string>(), j.at("pid").get<int32_t>(),
                j.at("block_size").get<int32_t>(), j.at("port").get<std::string>(), j.at("pool").get<std::string>(),
                j.at("kv_dtype").get<std::string>(), j.value("proof", std::string()), j.value("model", std::string())};
  if (t == "joined") {
    JoinAccepted m{j.at("rank").get<int32_t>(), j.at("epoch").get<Epoch>(), j.at("colocated").get<bool>(), {}};
    for (const json& p : j.at("peers"))
      m.peers.push_back({p.at("rank").get<int32_t>(), p.at("role").get<int32_t>(), p.at("port").get<std::string>(),
                         p.value("epoch", Epoch{0})});
    return m;
  }
  if (t == "refused") return JoinRefused{j.at("reason").get<std::string>()};
  if (t == "hello")
    return Hello{j.at("rank").get<int32_t>(), j.at("epoch").get<Epoch>(), j.value("proof", std::string())};
  if (t == "challenge") return Challenge{j.at("nonce").get<std::string>()};
  if (t == "leave") return Leave{};
  if (t == "drain") return Drain{};
  if (t == "drained") return Drained{};
  if (t == "left") return PeerLeft{j.at("rank").get<int32_t>()};
  if (t == "beat") return RouterBeat{};
  if (t == "gone") return PeerGone{j.at("rank").get<int32_t>(), j.at("epoch").get<Epoch>()};
  if (t == "tokens") return token_events_from(j);
  if (t == "kv")
    return KvEvents{j.at("epoch").get<Epoch>(), j.at("reset").get<bool>(), j.at("stored").get<std::vector<uint64_t>>(),
                    j.at("removed").get<std::vector<uint64_t>>()};
  if (t == "xfer")
    return TransferStats{j.at("id").get<RequestId>(), j.at("bytes").get<int64_t>(), j.at("exposed_s").get<double>(),
                         j.at("wire_s").get<double>(), j.value("hidden", int64_t{0})};
  if (t == "warmed") return Warmed{j.at("id").get<RequestId>(), j.at("computed").get<int64_t>()};
  if (t == "failed") {
    const int32_t k = j.at("kind").get<int32_t>();
    if (k < 1 || k > kFailureKindMax) throw std::out_of_range("failure kind " + std::to_string(k));
    return RequestFailed{j.at("id").get<RequestId>(), j.at("reason").get<std::string>(), static_cast<FailureKind>(k)};
  }
  if (t == "load") return load_report_from(j);
  throw std::out_of_range("unknown message type '" + t + "'");
}

}  // namespace

std::vector<uint8_t> serialize(const Message& m) { return json::to_msgpack(std::visit(ToJson{}, m)); }

namespace {

// nlohmann's DOM builder behind a depth check: MessagePack's reader recurses
// once per nested array or map, so bytes from a peer that nest a million
// levels deep would overflow the stack. Parsing stops (false) at the first
// container past `max_depth`, before the reader descends into it.
class DepthCappedSax {
 public:
  using number_integer_t = json::number_integer_t;
  using number_unsigned_t = json::number_unsigned_t;
  using number_float_t = json::number_float_t;
  using string_t = json::string_t;
  using binary_t = json::binary_t;

  DepthCappedSax(json& out, int max_depth) : dom_(out, true), max_depth_(max_depth) {}
  bool too_deep() const { return too_deep_; }

  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) { return dom_.number_float(v, s); }
  bool string(string_t& v) { return dom_.string(v); }
  bool binary(binary_t& v) { return dom_.binary(v); }
  bool start_object(std::size_t n) { return enter() && dom_.start_object(n); }
  bool key(string_t& k) { return dom_.key(k); }
  bool end_object() { --depth_; return dom_.end_object(); }
  bool start_array(std::size_t n) { return enter() && dom_.start_array(n); }
  bool end_array() { --depth_; return dom_.end_array(); }
  bool parse_error(std::size_t pos, const std::string& token, const nlohmann::detail::exception& e) {
    return dom_.parse_error(pos, token, e);  // throws e
  }

 private:
  bool enter() {
    if (++depth_ <= max_depth_) return true;
    too_deep_ = true;
    return false;
  }
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  int max_depth_;
  int depth_ = 0;
  bool too_deep_ = false;
};

}  // namespace

Result<Message> deserialize(const uint8_t* data, size_t size) {
  try {
    json j;
    DepthCappedSax sax(j, kMaxMessageDepth);
    const bool ok = json::sax_parse(data, data + size, &sax, json::input_format_t::msgpack, true);
    if (sax.too_deep())
      return Status::corruption("malformed control message: nested deeper than " + std::to_string(kMaxMessageDepth) +
                                " levels");
    if (!ok) return Status::corruption("malformed control message: not MessagePack");
    return from_json(j);
  } catch (const std::exception& e) {
    return Status::corruption(std::string("malformed control message: ") + e.what());
  }
}

Sender sender_of(const Message& m) {
  return std::visit(
      [](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, PrefillRequest> || std::is_same_v<T, Cancel> || std::is_same_v<T, Shutdown> ||
                      std::is_same_v<T, PeerDown> || std::is_same_v<T, PeerUp> || std::is_same_v<T, PeerGone> ||
                      std::is_same_v<T, Rejoin> || std::is_same_v<T, Drain> || std::is_same_v<T, PeerLeft> ||
                      std::is_same_v<T, RouterBeat> || std::is_same_v<T, JoinAccepted> ||
                      std::is_same_v<T, JoinRefused>)
          return Sender::kRouter;
        else if constexpr (std::is_same_v<T, Challenge>)
          return Sender::kAny;
        else
          return Sender::kWorker;
      },
      m);
}

const char* message_name(const Message& m) {
  static constexpr const char* kNames[] = {"PrefillRequest", "Cancel",       "Shutdown",    "HandoffOffer",
                                           "HandoffAccept",  "HandoffReject", "HandoffAbort", "TokenEvents",
                                           "TransferStats",  "RequestFailed", "LoadReport",   "PeerDown",
                                           "PeerUp",         "Rejoin",        "Listening",    "Join",
                                           "JoinAccepted",   "JoinRefused",   "Hello",        "Leave",
                                           "Drain",          "Drained",       "PeerLeft",     "RouterBeat",
                                           "PeerGone",       "KvEvents",      "Warmed",       "Challenge",
                                           "KvTagSeal"};
  static_assert(std::size(kNames) == std::variant_size_v<Message>);
  return kNames[m.index()];
}

std::vector<KvEvents> kv_events_messages(Epoch epoch, bool reset, const std::vector<uint64_t>& stored,
                                         const std::vector<uint64_t>& removed, size_t max_hashes) {
  std::vector<KvEvents> out;
  if (!reset && stored.empty() && removed.empty()) return out;
  max_hashes = std::max<size_t>(1, max_hashes);
  out.push_back(KvEvents{epoch, reset, {}, {}});
  auto add = [&](uint64_t h, bool store) {
    if (out.back().stored.size() + out.back().removed.size() == max_hashes) out.push_back(KvEvents{epoch, false, {}, {}});
    (store ? out.back().stored : out.back().removed).push_back(h);
  };
  for (uint64_t h : removed) add(h, false);
  for (uint64_t h : stored) add(h, true);
  return out;
}

const char* failure_kind_name(FailureKind k) {
  switch (k) {
    case FailureKind::kInvalid: return "invalid";
    case FailureKind::kLeaving: return "leaving";
    case FailureKind::kOverloaded: return "overloaded";
    case FailureKind::kTimeout: return "timeout";
    case FailureKind::kPeerDown: return "peer_down";
    case FailureKind::kTransfer: return "transfer";
    case FailureKind::kInternal: return "internal";
  }
  return "?";
}

Status check_compatible(const KvWireHeader& local, const KvWireHeader& remote) {
  if (remote.version != local.version)
    return Status::unsupported("KV wire version " + std::to_string(remote.version) + " (this rank speaks " +
                               std::to_string(local.version) + ")");
  std::string diff;
  auto field = [&](const char* name, const auto& mine, const auto& theirs) {
    if (mine == theirs) return;
    std::string a, b;
    if constexpr (std::is_same_v<std::decay_t<decltype(mine)>, std::string>) a = mine, b = theirs;
    else a = std::to_string(mine), b = std::to_string(theirs);
    diff += (diff.empty() ? "" : ", ") + std::string(name) + " " + b + " (sender) != " + a + " (receiver)";
  };
  field("block_size", local.block_size, remote.block_size);
  field("dtype", local.dtype, remote.dtype);
  field("n_layers", local.n_layers, remote.n_layers);
  field("n_kv_heads", local.n_kv_heads, remote.n_kv_heads);
  field("head_dim", local.head_dim, remote.head_dim);
  field("n_embd", local.n_embd, remote.n_embd);
  field("vocab", local.vocab, remote.vocab);
  if (!diff.empty()) return Status::invalid_argument("KV handoff refused, model/cache mismatch: " + diff);
  return Status::ok();
}

}  // namespace pd::proto
