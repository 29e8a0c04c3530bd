// What each worker supplies to the loop it shares (worker_core.h): its own
// messages, its transfers, its deadlines, its piece of compute, and what it
// does when a peer, the router or the pool changes. The prefill and the decode
// worker implement these; WorkerCore calls them from run_once() in a fixed
// order (the template-method shape of vLLM's EngineCore and SGLang's two
// disaggregation loops). Kept apart from WorkerCore so the shared loop reads
// as the shared loop, and a new worker kind sees at once what it must write.
#pragma once

#include <chrono>
#include <cstddef>

#include "protocol/messages.h"

namespace pd {

class WorkerHooks {
 public:
  virtual ~WorkerHooks() = default;

 protected:
  // A message of this worker's own kind (prompts, offers, handoff answers).
  // False: this worker does not take such messages (logged).
  virtual bool on_message(int source, proto::Message& m) = 0;
  // Moves the KV transfers; true when one made progress.
  virtual bool progress_transfers() = 0;
  // Ends what has waited longer than its deadline allows.
  virtual void check_deadlines() = 0;
  // At most one piece of compute (a pass, a step); true when it did work.
  virtual bool work() = 0;
  // Peer `rank`'s incarnation is over: end what involves it.
  virtual void on_peer_down(int rank) = 0;
  // Peer `rank` left the cluster for good (after on_peer_down).
  virtual void forget_peer(int /*rank*/) {}
  // This rank was declared down: drop everything it holds, silently.
  virtual void drop_all() = 0;
  // Leaving the pool begins: hand back what has not started.
  virtual void on_drain() = 0;
  // Sequences this rank holds (Drained waits for none; logs).
  virtual size_t held() const = 0;
  // The worker's fields of a load report (waiting, running, ...).
  virtual void fill_load(proto::LoadReport& r) const = 0;
  // Shutdown: stops what need not finish; then run() waits up to exit_grace()
  // for the transfers still in flight.
  virtual void before_exit() {}
  virtual std::chrono::milliseconds exit_grace() const = 0;
  // Appended to the "ready" log line (e.g. what mode the rank serves in).
  virtual const char* ready_note() const { return ""; }
  // Whether the layer hook may act on `m` in the middle of a pass (only
  // workers that call handle_messages(true) from their hook need say).
  virtual bool mid_pass_message(const proto::Message& /*m*/) const { return false; }
};

}  // namespace pd
