// The control plane's message channel, as the router and the workers see it:
// send protocol messages to a rank, receive the ones that arrived. The cluster
// runs MpiControlChannel (protocol/mpi_channel.h); tests run the workers and
// the router against an in-process fake (tests/fake_channel.h), as the
// KV path runs against a fake Transport.
//
// Threading: an object belongs to one thread (the engine loop or the router's
// link); nothing here is thread-safe. A worker's engine loop holds the
// communication side's end of a channel (kvtransfer/comm_side.h), which owns
// the real one on its own thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <thread>

#include "protocol/messages.h"

namespace pd {

class ControlChannel {
 public:
  virtual ~ControlChannel() = default;

  // Posts the message to rank `dest`; never blocks. The bytes are the channel's
  // until the send completes (progress()/flush()).
  virtual void send(int dest, const proto::Message& m) = 0;
  // Takes up to `max` messages that arrived and hands each well-formed one to
  // `fn` (in arrival order per source); a malformed one is logged (naming its
  // source) and dropped. Never blocks. Returns how many messages arrived,
  // malformed ones included.
  virtual int receive(const std::function<void(int source, proto::Message& m)>& fn, int max = 64) = 0;
  // As receive(), but stops before the first message `take` refuses, leaving it
  // and every later one for a later receive (so order per source holds). What a
  // worker calls in the middle of a pass for the messages it can act on there.
  // A channel that cannot look ahead takes nothing (the default).
  virtual int receive_while(const std::function<bool(int source, const proto::Message& m)>& take,
                            const std::function<void(int source, proto::Message& m)>& fn, int max = 64) {
    (void)take;
    (void)fn;
    (void)max;
    return 0;
  }
  // When the message being handed to receive()'s `fn` reached this rank (taken
  // off the network, steady clock); none outside `fn`, or for a channel that
  // does not know (the caller then takes its own now).
  virtual std::optional<std::chrono::steady_clock::time_point> arrival() const { return std::nullopt; }
  // Completes finished sends (frees their buffers). Call once per loop.
  virtual void progress() = 0;
  // Blocks until something may be there for the caller — a message arrived, or
  // (for a channel that also carries the rank's transfers) an operation ended —
  // or `max` passed. Spurious returns are allowed. What an idle engine loop
  // calls instead of sleeping; the default sleeps `max`.
  virtual void wait_for_work(std::chrono::microseconds max) { std::this_thread::sleep_for(max); }
  // Sends posted and not yet complete.
  virtual size_t pending_sends() const = 0;
  // Waits up to `deadline` for pending sends (shutdown); false if some remain.
  virtual bool flush(std::chrono::milliseconds deadline) = 0;
  // `rank` left the cluster for good (PeerLeft): release its link, if it has
  // one of its own (a rank that joined later). Sends already posted complete.
  virtual void forget(int rank) = 0;
  // Links refused since start because they did not prove the cluster secret
  // (protocol/link_auth.h); 0 for a channel that accepts no links.
  virtual int64_t refused_links() const { return 0; }
};

// When a worker sends the router its LoadReport: when it changed (at most
// every 20 ms) and at least once a second (the router's liveness signal).
class LoadReporter {
 public:
  // `now`: the caller's clock (a worker's Env).
  void maybe_send(ControlChannel& ch, int router, const proto::LoadReport& r, bool force,
                  std::chrono::steady_clock::time_point now);

 private:
  std::chrono::steady_clock::time_point last_{};
  proto::LoadReport last_report_{};
};

}  // namespace pd
