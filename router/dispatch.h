// The router's view of the workers and the dispatch policy. Owned by the
// cluster-link thread; counts what the router itself sent (exact, immediate)
// and what the workers last reported (queue lengths, free KV blocks).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "protocol/messages.h"

namespace pd::router {

// A rank's membership as the router sees it. kStarting until its first ready
// report; kUp while it is heard from within timeouts.heartbeat_ms; kDown when
// it is not (or never started within timeouts.startup_ms). A down rank is
// re-admitted (kUp under a new epoch) when it reports under the epoch the
// router gave it in a Rejoin.
enum class RankState { kStarting, kUp, kDown };
const char* rank_state_name(RankState s);

struct WorkerView {
  int rank = -1;
  bool is_prefill = false;
  RankState state = RankState::kStarting;
  proto::Epoch epoch = 0;          // current incarnation (kUp) / the one that went down (kDown)
  std::chrono::steady_clock::time_point last_heard{};  // any message from it
  std::chrono::steady_clock::time_point last_rejoin_sent{};
  int64_t times_down = 0;
  int outstanding = 0;             // requests the router sent it that are not finished there
  int64_t outstanding_tokens = 0;  // prompt tokens (prefill) / prompt + max_tokens (decode) of those
  proto::LoadReport load;          // last report
  std::chrono::steady_clock::time_point last_report{};
  bool reported = false;
};

struct DispatchChoice {
  int prefill_rank = -1;  // -1 in colocated mode
  int decode_rank = -1;
};

class WorkerTable {
 public:
  WorkerTable(const std::vector<int>& prefill_ranks, const std::vector<int>& decode_ranks, int block_size);
  bool colocated() const { return prefill_.empty(); }
  // Picks ranks for a request among those up, or nullopt when every candidate
  // is down or at max_inflight (the request waits in the router's queue).
  //  - prefill: fewest outstanding prompt tokens, then fewest queued (reported);
  //  - decode: among ranks whose free KV blocks (reported, minus what the router
  //    sent since) hold the whole request, the fewest outstanding requests;
  //    if none has room, the one with the most free blocks (it will queue the handoff).
  std::optional<DispatchChoice> pick(int64_t prompt_tokens, int64_t max_tokens, int max_inflight) const;
  void on_dispatch(const DispatchChoice& c, int64_t prompt_tokens, int64_t max_tokens);
  // The prefill leg is over (first token or failure) / the whole request is over.
  void on_prefill_done(int rank, int64_t prompt_tokens);
  void on_request_done(int rank, int64_t prompt_tokens, int64_t max_tokens);
  void on_report(int rank, const proto::LoadReport& r);
  // Any message from `rank` (its heartbeat, while it is up).
  void heard(int rank);
  // Up ranks silent for longer than `heartbeat`, and starting ranks not ready
  // after `startup`: marked down; returned.
  std::vector<int> expire(std::chrono::milliseconds heartbeat, std::chrono::milliseconds startup);
  // Marks `rank` down (its current epoch is the one that ended).
  void mark_down(int rank);
  // Marks a down rank up again under `epoch`.
  void mark_up(int rank, proto::Epoch epoch);
  WorkerView* find(int rank);
  // Ready: at least one prefill rank and one decode rank are up (colocated: one
  // decode rank), and every rank has either reported or been declared down.
  // Otherwise `why` says what is missing.
  bool ready(std::string* why) const;
  // Whether some rank is down (the cluster serves, degraded).
  bool degraded() const;
  const std::vector<WorkerView>& prefill() const { return prefill_; }
  const std::vector<WorkerView>& decode() const { return decode_; }

 private:
  std::vector<WorkerView> prefill_, decode_;
  int block_size_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();  // startup deadline from here
};

}  // namespace pd::router
