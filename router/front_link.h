// The seam between the router's two halves: the HTTP front (io threads:
// routes, completions intake, /health) and the link loop (the link thread:
// dispatch, worker messages, every request's state). They share nothing else;
// one queue goes each way:
//  - io -> link, the LinkInbox: new requests, a client that left, drain asks.
//  - link -> io, the LinkStatus: one snapshot of what the front reads of the
//    link (the router's lifecycle, readiness, /health's ranks, degraded),
//    republished whole, and the count of queued requests admission bounds.
// Ids (http ids, re-runs' wire ids, warm-ups') come from one RequestIds that
// either side may draw from.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

#include "router/http_server.h"
#include "router/request_table.h"

namespace pd::router {

// The router's lifecycle (its own stop, not a rank's drain):
//   kServing -> kStopping (SIGTERM/SIGINT or request_stop(): no new requests,
//   in-flight ones get timeouts.stop_grace_ms) -> kStopped (finish(): what is
//   left failed, the workers told to shut down). finish() without a stop (a
//   test) goes kServing -> kStopped.
enum class RouterState { kServing, kStopping, kStopped };
const char* state_name(RouterState s);
bool legal(RouterState from, RouterState to);

// Fresh ids, unique in this router. Any thread.
class RequestIds {
 public:
  uint64_t next() { return next_.fetch_add(1); }

 private:
  std::atomic<uint64_t> next_{1};
};

// What the io threads hand the link.
struct NewRequest {
  std::unique_ptr<Request> req;
};
struct ClientGone {  // the choices of the answer it was waiting for
  std::vector<uint64_t> http_ids;
};
struct DrainRank {  // POST /admin/drain, answered by the link thread
  int rank = -1;
  std::shared_ptr<ResponseWriter> writer;
};
using InboxItem = std::variant<NewRequest, ClientGone, DrainRank>;

// io -> link. Any thread posts; the link thread takes.
class LinkInbox {
 public:
  void post(InboxItem item);
  // Several items posted as one: while a Batch lives, other threads' posts
  // wait. An answer's choices go in one, then the client's disconnect hook is
  // registered under it, so the hook's ClientGone lands after them, whether it
  // runs later on an io thread or inline at once (the mutex is recursive).
  class Batch {
   public:
    explicit Batch(LinkInbox& inbox) : inbox_(inbox), lock_(inbox.mu_) {}
    void add(InboxItem item) { inbox_.items_.push_back(std::move(item)); }

   private:
    LinkInbox& inbox_;
    std::lock_guard<std::recursive_mutex> lock_;
  };
  // Everything posted so far, in order. Link thread.
  std::deque<InboxItem> take();

 private:
  std::recursive_mutex mu_;  // recursive: a disconnect hook may run inline while a Batch holds it
  std::deque<InboxItem> items_;  // guarded by mu_
};

// What the front reads of the link's state, as of its last publication.
struct LinkSnapshot {
  RouterState state = RouterState::kServing;
  bool ready = false;     // every role has an up rank (WorkerTable::ready)
  bool degraded = false;  // a rank is down or draining (WorkerTable::degraded)
  bool pool_left = false;  // a role's every rank left (WorkerTable::pool_left)
  std::string not_ready_reason;  // why it was last not ready
  std::string ranks_json = "[]";  // /health's per-rank list
  int64_t decode_kv_tokens = 0;  // the most tokens an up decode rank's whole KV pool holds (0 = none reported)
};

// link -> io. The link thread publishes; any thread reads.
class LinkStatus {
 public:
  void publish(const LinkSnapshot& s);
  LinkSnapshot snapshot() const;
  bool stopping() const;  // the router stops, or has stopped
  // Requests accepted and not yet dispatched: the io threads add the choices
  // they accept (admission bounds it), the link takes away those it dispatches
  // or ends while queued and adds back those it re-runs.
  void add_queued(int n) { queued_ += n; }
  // Adds `n` unless the count would pass `limit` (then adds nothing and
  // returns false). One atomic step: requests admitted at the same moment on
  // several io threads cannot each see room and overfill the queue together.
  bool try_add_queued(int n, int limit);
  int queued() const { return queued_.load(); }

 private:
  mutable std::mutex mu_;
  LinkSnapshot snapshot_;  // guarded by mu_
  std::atomic<int> queued_{0};
};

}  // namespace pd::router
