// One exchange — a request with the handler and its answer — between the
// handler's threads and the connection's strand.
//
// The handler holds a Writer (the ResponseWriter it was given); the connection
// holds the Exchange. The Writer only asks the Exchange; the Exchange checks
// the answer is in turn (ExchangeState), queues it and rings a bell (a timer
// the connection waits on, cancelled on the connection's strand), and the
// connection takes what is queued when the bell rings. Neither side calls the
// other: the queue is between them. The departure of the client goes the other
// way: the connection tells the Exchange, which runs the handler's
// on_disconnect callback.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "router/http_outgoing.h"
#include "router/http_server_core.h"

namespace pd::router::detail {

// What the handler asks of the connection, in the order asked.
struct Answer {
  enum class Kind {
    kRespond,             // a complete response
    kStartSse,            // the head of an event stream
    kEvent,               // one event: "data: ...\n\n"
    kFinish,              // the stream's last chunk
    kDroppedUnanswered,   // the writer went away without an answer: 500
    kDroppedMidStream,    // the writer went away mid-stream: the connection closes
  } kind;
  std::shared_ptr<Response> response = nullptr;  // kRespond
  bool close_after = false;                      // kRespond: the connection closes after it
  std::string data = {};                         // kEvent
};

// The handler's side of an exchange. Answers are accepted while awaiting
// (respond or start_sse) or streaming (events, finish); done once the final
// answer is queued or the writer went away; the client may leave before that —
// left unheard while no on_disconnect callback was set yet, left once it ran.
enum class ExchangeState { kAwaiting, kStreaming, kDone, kLeftUnheard, kLeft };
const char* state_name(ExchangeState s);
bool legal(ExchangeState from, ExchangeState to);

class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  // `strand`: the connection's; `id`: the connection's (transition reports).
  Exchange(std::shared_ptr<ServerCore> core, Strand strand, uint64_t id);

  // ---- The handler's side: any thread.

  // Queues `a` for the connection when it is in turn (see ResponseWriter) and
  // the server runs; false, queuing nothing, otherwise.
  bool submit(Answer a);
  // The writer went away: an exchange still awaiting or streaming queues its
  // drop (kDroppedUnanswered / kDroppedMidStream) and is done.
  void drop();
  // See ResponseWriter::on_disconnect.
  void on_disconnect(std::function<void()> cb);

  // ---- The connection's side: its strand.

  // Never expires; cancelled ("rung") on the strand after answers were queued.
  net::steady_timer& bell() { return bell_; }
  // The answers queued since the last take, in order.
  std::deque<Answer> take();
  // The client went away (or the server is stopping): runs the on_disconnect
  // callback now, or when it is set, unless the final answer came first.
  void client_gone();

 private:
  // Moves to `to` when legal and the bell can be rung; false otherwise.
  bool queue_locked(Answer a, ExchangeState to);

  // Constant after construction. core_ first: the bell needs its io_context.
  const std::shared_ptr<ServerCore> core_;
  const Strand strand_;
  const uint64_t id_;
  net::steady_timer bell_;  // used on strand_

  std::mutex mu_;
  ExchangeState state_ = ExchangeState::kAwaiting;  // guarded by mu_
  std::deque<Answer> queued_;                       // guarded by mu_
  std::function<void()> on_disconnect_;             // guarded by mu_
};

// The ResponseWriter a handler gets: it shapes responses and events and hands
// them to its Exchange. It keeps its connection alive (an opaque reference: it
// never calls it); dropping it unanswered drops the exchange (Exchange::drop).
class Writer final : public ResponseWriter {
 public:
  Writer(std::shared_ptr<Exchange> exchange, std::shared_ptr<const void> connection, unsigned version,
         bool keep_alive)
      : exchange_(std::move(exchange)), connection_(std::move(connection)), version_(version),
        keep_alive_(keep_alive) {}
  ~Writer() override { exchange_->drop(); }

  bool respond(int status, std::string content_type, std::string body,
               std::vector<std::pair<std::string, std::string>> headers) override;
  bool start_sse() override;
  bool send_event(std::string data) override;
  bool finish() override;
  void on_disconnect(std::function<void()> cb) override { exchange_->on_disconnect(std::move(cb)); }

 private:
  // Constant after construction.
  const std::shared_ptr<Exchange> exchange_;
  const std::shared_ptr<const void> connection_;  // keeps the connection alive
  const unsigned version_;                        // the request's HTTP version (11 = 1.1)
  const bool keep_alive_;                         // what the request and the connection allow
};

}  // namespace pd::router::detail
