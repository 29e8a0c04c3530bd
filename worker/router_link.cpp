#include "worker/router_link.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "util/lifecycle.h"

namespace pd {

const char* state_name(RouterContact s) {
  switch (s) {
    case RouterContact::kWaiting: return "waiting";
    case RouterContact::kHeard: return "heard";
    case RouterContact::kLost: return "lost";
  }
  return "?";
}

bool legal(RouterContact from, RouterContact to) {
  switch (from) {
    case RouterContact::kWaiting: return to == RouterContact::kHeard || to == RouterContact::kLost;
    case RouterContact::kHeard: return to == RouterContact::kLost;
    case RouterContact::kLost: return false;  // a lost router stays lost: run() ends
  }
  return false;
}

RouterLink::RouterLink(const char* role, const ClusterConfig& cfg, const RoleTable& roles, ControlChannel& channel)
    : role_(role),
      cfg_(cfg),
      roles_(roles),
      channel_(channel),
      contact_(roles.joined ? RouterContact::kHeard : RouterContact::kWaiting) {}

bool RouterLink::accept(int source, const proto::Message& msg) {
  const proto::Sender allowed = proto::sender_of(msg);
  const bool ok = allowed == proto::Sender::kRouter   ? source == roles_.router
                  : allowed == proto::Sender::kWorker ? source != roles_.router && source != roles_.self
                                                      : false;  // a Challenge belongs to a join handshake only
  if (!ok) {
    refuse(source, msg, allowed);
    return false;
  }
  if (source == roles_.router && contact_ != RouterContact::kLost) {  // any message says the router is alive
    if (contact_ == RouterContact::kWaiting) transition(contact_, RouterContact::kHeard, roles_.self, "router link");
    silence_ = {};
  }
  return true;
}

void RouterLink::refuse(int source, const proto::Message& msg, proto::Sender allowed) {
  // Logged the first times and then sparsely: a flood must not flood the log too.
  if (refused_++ < 10 || refused_ % 1000 == 0)
    spdlog::warn("{} rank {}: ignored {} from rank {}: {} ({} ignored so far)", role_, roles_.self,
                 proto::message_name(msg), source,
                 allowed == proto::Sender::kRouter   ? "only the router (rank " + std::to_string(roles_.router) + ") sends it"
                 : allowed == proto::Sender::kWorker ? std::string("only another worker sends it")
                                                     : std::string("it belongs to a join handshake"),
                 refused_);
}

std::optional<Status> RouterLink::watch(Clock::time_point now) {
  if (last_iteration_) silence_ += std::min<Clock::duration>(now - *last_iteration_, std::chrono::seconds(1));
  last_iteration_ = now;
  if (contact_ == RouterContact::kLost) return std::nullopt;
  // Until the router is first heard, it may still be starting: startup_ms.
  const bool starting = contact_ != RouterContact::kHeard && cfg_.timeouts.startup_ms > cfg_.timeouts.router_ms;
  const int limit_ms = starting ? cfg_.timeouts.startup_ms : cfg_.timeouts.router_ms;
  if (silence_ <= std::chrono::milliseconds(limit_ms)) return std::nullopt;
  transition(contact_, RouterContact::kLost, roles_.self, "router link");
  return Status::timeout("the router (rank " + std::to_string(roles_.router) + ") sent nothing for " +
                         std::to_string(limit_ms) + " ms (" +
                         (starting ? "timeouts.startup_ms: never heard since start" : "timeouts.router_ms") +
                         "): it is gone");
}

void RouterLink::report_load(proto::LoadReport r, bool force, Clock::time_point now) {
  r.refused_messages = refused_;
  r.prompt_tokens_cached = prompt_tokens_cached_;
  r.prompt_tokens_computed = prompt_tokens_computed_;
  reporter_.maybe_send(channel_, roles_.router, r, force, now);
}

void RouterLink::send_kv_events(KvBlockManager& blocks, proto::Epoch epoch, bool snapshot) {
  KvCacheEvents e = blocks.take_events();
  if (snapshot) e = KvCacheEvents{true, blocks.cached_hashes(), {}};
  for (proto::KvEvents& m : proto::kv_events_messages(epoch, e.reset, e.stored, e.removed))
    channel_.send(roles_.router, std::move(m));
}

}  // namespace pd
