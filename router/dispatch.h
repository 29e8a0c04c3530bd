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

struct WorkerView {
  int rank = -1;
  bool is_prefill = false;
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
  // Picks ranks for a request, or nullopt when every candidate is at
  // max_inflight (the request waits in the router's queue).
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
  // Ready: every rank has reported ready within `stale`. Otherwise `why` names a rank.
  bool ready(std::chrono::milliseconds stale, std::string* why) const;
  const std::vector<WorkerView>& prefill() const { return prefill_; }
  const std::vector<WorkerView>& decode() const { return decode_; }

 private:
  WorkerView* find(int rank);
  std::vector<WorkerView> prefill_, decode_;
  int block_size_;
};

}  // namespace pd::router
