// The responses the server writes and the queue of a connection's writes (see
// http_outgoing.h).
#include "router/http_outgoing.h"

#include <cstdio>
#include <utility>

#include "router/openai_api.h"
#include "util/lifecycle.h"

namespace pd::router::detail {

std::shared_ptr<Response> make_response(unsigned version, bool keep_alive, int status, const std::string& content_type,
                                        std::string body) {
  auto res = std::make_shared<Response>();
  res->version(version);
  // A final answer is 2xx..5xx; 204 and 304 carry no body (Beast would throw on one).
  res->result(status >= 200 && status <= 599 ? static_cast<unsigned>(status) : 500u);
  res->set(http::field::server, "pdcluster");
  if (!content_type.empty()) res->set(http::field::content_type, content_type);
  if (status != 204 && status != 304) res->body() = std::move(body);
  res->keep_alive(keep_alive);
  res->prepare_payload();
  return res;
}

std::shared_ptr<Response> make_error_response(unsigned version, int status, std::string message, std::string type) {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  return make_response(version, /*keep_alive=*/false, status, "application/json", error_body(e));
}

void set_cors(http::response_header<>& h, const std::string& allow_origin) {
  h.set(http::field::access_control_allow_origin, allow_origin);
  if (allow_origin != "*") h.set(http::field::vary, "Origin");
}

std::unique_ptr<SseHead> make_sse_head(unsigned version, bool keep_alive, const std::string& allow_origin) {
  auto head = std::make_unique<SseHead>();
  http::response<http::empty_body>& res = head->res;
  res.version(version);
  res.result(http::status::ok);
  res.set(http::field::server, "pdcluster");
  res.set(http::field::content_type, "text/event-stream; charset=utf-8");  // text/* without a charset reads as Latin-1 to some clients
  res.set(http::field::cache_control, "no-cache");
  res.set("X-Accel-Buffering", "no");  // proxies must not buffer the stream
  if (!allow_origin.empty()) set_cors(res, allow_origin);
  res.keep_alive(keep_alive);
  if (version >= 11) res.chunked(true);
  head->sr.emplace(res);
  return head;
}

const char* state_name(WriteState s) {
  switch (s) {
    case WriteState::kIdle: return "idle";
    case WriteState::kInFlight: return "in-flight";
  }
  return "?";
}

bool legal(WriteState from, WriteState to) { return from != to; }

void OutQueue::push(Outgoing item) {
  if (item.kind == Outgoing::kChunk) waiting_bytes_ += item.data.size();
  items_.push_back(std::move(item));
}

Outgoing* OutQueue::begin_write(Clock::time_point now, bool chunked) {
  if (state_ == WriteState::kInFlight || items_.empty()) return nullptr;
  transition(state_, WriteState::kInFlight, id_, "http write");
  write_began_ = now;
  if (items_.front().kind == Outgoing::kChunk) gather_events(chunked);
  return &items_.front();
}

bool OutQueue::end_write() {
  transition(state_, WriteState::kIdle, id_, "http write");
  if (items_.empty()) return false;  // cleared meanwhile (cannot happen: clear() keeps it)
  const bool final = items_.front().final;
  items_.pop_front();
  return final;
}

bool OutQueue::behind(Clock::time_point now) const {
  return waiting_bytes_ > max_waiting_bytes_ && state_ == WriteState::kInFlight && now - write_began_ >= kBehindAfter;
}

void OutQueue::clear() {
  if (state_ == WriteState::kInFlight && !items_.empty()) {
    items_.erase(items_.begin() + 1, items_.end());
  } else {
    items_.clear();
  }
  waiting_bytes_ = 0;
}

// So a burst of events costs one write, and what waits behind a write is only
// what came while it ran.
void OutQueue::gather_events(bool chunked) {
  std::string wire;
  auto end = items_.begin();
  for (; end != items_.end() && end->kind == Outgoing::kChunk; ++end) {
    waiting_bytes_ -= end->data.size();  // no longer waiting: being written
    if (!chunked) {
      wire += end->data;
      continue;
    }
    char size[20];
    std::snprintf(size, sizeof size, "%zx\r\n", end->data.size());
    wire += size;
    wire += end->data;
    wire += "\r\n";
  }
  items_.erase(items_.begin() + 1, end);
  items_.front().data = std::move(wire);
}

}  // namespace pd::router::detail
