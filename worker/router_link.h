// A worker rank's dealings with the router, apart from its own work: which
// messages it takes from whom, whether the router is still there, and what it
// reports to it (load, prefix-cache events).
//
// - Senders: a message is acted on only from the rank that may send it
//   (proto::sender_of): the router's (Shutdown, Drain, Rejoin, PeerDown, a
//   prompt, ...) from the router alone, the workers' (offers, accepts, Hello)
//   from another worker; the rest are ignored and counted (the load report's
//   refused_messages), logged the first times and then sparsely.
// - The router's liveness (RouterContact, checked): kWaiting until the router
//   is first heard (it may still be starting: timeouts.startup_ms), kHeard
//   after, kLost once it sent nothing for timeouts.router_ms. Only time the
//   worker's loop runs counts (at most 1 s between two iterations): a long
//   pass or a stopped process is not the router's silence.
// - Load reports go out at most every few ms unless forced (LoadReporter);
//   they carry the counts kept here (refused messages, prompt tokens cached
//   and computed).
// One thread (the worker's loop) calls everything.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "config/cluster_config.h"
#include "kv/kv_block_manager.h"
#include "protocol/control_channel.h"
#include "protocol/role_table.h"
#include "util/status.h"

namespace pd {

enum class RouterContact { kWaiting, kHeard, kLost };
const char* state_name(RouterContact s);
bool legal(RouterContact from, RouterContact to);

class RouterLink {
 public:
  using Clock = std::chrono::steady_clock;
  // `role` names this rank in log lines ("prefill", "decode"); `channel` must
  // outlive this. A rank that joined a running cluster has heard the router
  // already (its join was answered).
  RouterLink(const char* role, const ClusterConfig& cfg, const RoleTable& roles, ControlChannel& channel);

  // Whether `source` may send `msg`; a message from the router also says it is alive.
  bool accept(int source, const proto::Message& msg);
  // Counts the router's silence since the last iteration and gives up past its
  // limit: the reason, once, when the router is found gone.
  std::optional<Status> watch(Clock::time_point now);
  RouterContact contact() const { return contact_; }

  // A message refused for what it says (an index or count out of range).
  void count_refused() { ++refused_; }
  // A prompt's KV is complete: `cached` of its tokens came from the prefix cache.
  void count_prompt(int64_t cached, int64_t computed) {
    prompt_tokens_cached_ += cached;
    prompt_tokens_computed_ += computed;
  }
  // Sends `r` (the worker's fields filled) with the counts kept here, unless
  // one went out moments ago and nothing forces it.
  void report_load(proto::LoadReport r, bool force, Clock::time_point now);
  // What the prefix cache stored and evicted since the last call; `snapshot`:
  // all it holds (the router resets its index for this rank).
  void send_kv_events(KvBlockManager& blocks, proto::Epoch epoch, bool snapshot);

 private:
  void refuse(int source, const proto::Message& msg, proto::Sender allowed);

  const char* role_;
  const ClusterConfig& cfg_;
  const RoleTable& roles_;
  ControlChannel& channel_;
  RouterContact contact_;
  Clock::duration silence_{};
  std::optional<Clock::time_point> last_iteration_;
  LoadReporter reporter_;
  int64_t refused_ = 0;
  int64_t prompt_tokens_cached_ = 0, prompt_tokens_computed_ = 0;
};

}  // namespace pd
