// The response side of a connection, apart from the socket: the responses the
// server writes (a handler's, its own error answers, an SSE stream's head), and
// OutQueue, the writes a connection owes its client in order — one in flight at
// a time, the SSE events waiting behind it gathered into one write, and whether
// the client reads too slowly for its events (max_write_buffer_bytes).
//
// Strand-only, no I/O: the connection starts each write OutQueue hands it and
// reports its end.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>

#include <boost/beast/http.hpp>

namespace pd::router::detail {

namespace http = boost::beast::http;
using Response = http::response<http::string_body>;

// A stream's client is behind (HttpServerConfig::max_write_buffer_bytes) when
// more than the limit waits and the write in progress began this long ago: a
// burst of events that the socket takes at once is not a client behind.
inline constexpr std::chrono::milliseconds kBehindAfter{100};

// A complete response with Content-Length. `status` outside 200..599 is sent
// as 500; 204 and 304 drop the body.
std::shared_ptr<Response> make_response(unsigned version, bool keep_alive, int status, const std::string& content_type,
                                        std::string body);
// The server's own JSON error answer (an OpenAI error body); the connection closes after it.
std::shared_ptr<Response> make_error_response(unsigned version, int status, std::string message, std::string type);

// An SSE stream's head: 200, text/event-stream, no-cache, chunked on HTTP/1.1
// (on HTTP/1.0 the stream ends with the connection).
struct SseHead {
  http::response<http::empty_body> res;
  std::optional<http::response_serializer<http::empty_body>> sr;  // over res, made once res is set
};
// `allow_origin`: its Access-Control-Allow-Origin ("" = none), as set_cors.
std::unique_ptr<SseHead> make_sse_head(unsigned version, bool keep_alive, const std::string& allow_origin = "");
// Marks an answer readable by a page of another origin: Access-Control-Allow-Origin
// `allow_origin` ("*" or the request's Origin), and Vary: Origin when it names one.
void set_cors(http::response_header<>& h, const std::string& allow_origin);

// One write the connection owes its client.
struct Outgoing {
  enum Kind { kResponse, kSseHead, kChunk, kLastChunk } kind;
  std::shared_ptr<Response> response = nullptr;  // kResponse
  std::unique_ptr<SseHead> head = nullptr;       // kSseHead
  std::string data = {};                         // kChunk: an event; once begun, the wire bytes of the events gathered
  bool final = false;                            // the exchange's last write
};

// Whether a write of the queue is in flight (its buffers in use by the socket).
enum class WriteState { kIdle, kInFlight };
const char* state_name(WriteState s);
bool legal(WriteState from, WriteState to);

class OutQueue {
 public:
  using Clock = std::chrono::steady_clock;
  // `id`: the connection's (for transition reports); `max_waiting_bytes`: of
  // events waiting behind the write in flight (see behind()).
  OutQueue(uint64_t id, size_t max_waiting_bytes) : id_(id), max_waiting_bytes_(max_waiting_bytes) {}

  void push(Outgoing item);
  // Begins the next write, or nullptr when one is in flight or nothing waits.
  // Every event at the front (up to an item of another kind) becomes the
  // front item's bytes, for one write: each event still its own HTTP chunk
  // ("<size in hex>\r\n<event>\r\n") when `chunked`, bare otherwise (HTTP/1.0).
  Outgoing* begin_write(Clock::time_point now, bool chunked);
  // The write in flight ended (done or failed): it leaves the queue. True when
  // it was the exchange's final write.
  bool end_write();
  bool in_flight() const { return state_ == WriteState::kInFlight; }
  bool empty() const { return items_.empty(); }
  // The client reads slower than its events come: more than
  // max_waiting_bytes of events wait while the write in flight began
  // kBehindAfter ago or more (the socket took nothing since).
  bool behind(Clock::time_point now) const;
  // Drops everything waiting; the write in flight keeps its item (its buffers)
  // until end_write().
  void clear();

 private:
  void gather_events(bool chunked);

  const uint64_t id_;
  const size_t max_waiting_bytes_;
  WriteState state_ = WriteState::kIdle;
  std::deque<Outgoing> items_;  // front: the write in flight when kInFlight
  size_t waiting_bytes_ = 0;    // of the events in items_ whose write has not begun
  Clock::time_point write_began_{};  // of the write in flight
};

}  // namespace pd::router::detail
