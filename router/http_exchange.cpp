// One exchange between the handler and a connection (see http_exchange.h).
#include "router/http_exchange.h"

#include <chrono>

#include "util/lifecycle.h"

namespace pd::router::detail {

const char* state_name(ExchangeState s) {
  switch (s) {
    case ExchangeState::kAwaiting: return "awaiting";
    case ExchangeState::kStreaming: return "streaming";
    case ExchangeState::kDone: return "done";
    case ExchangeState::kLeftUnheard: return "left-unheard";
    case ExchangeState::kLeft: return "left";
  }
  return "?";
}

bool legal(ExchangeState from, ExchangeState to) {
  using S = ExchangeState;
  switch (from) {
    case S::kAwaiting: return to == S::kStreaming || to == S::kDone || to == S::kLeftUnheard || to == S::kLeft;
    case S::kStreaming: return to == S::kStreaming || to == S::kDone || to == S::kLeftUnheard || to == S::kLeft;
    case S::kLeftUnheard: return to == S::kLeft;
    case S::kDone:
    case S::kLeft: return false;
  }
  return false;
}

Exchange::Exchange(std::shared_ptr<ServerCore> core, Strand strand, uint64_t id)
    : core_(std::move(core)), strand_(std::move(strand)), id_(id), bell_(strand_) {
  bell_.expires_at(std::chrono::steady_clock::time_point::max());
}

bool Exchange::queue_locked(Answer a, ExchangeState to) {
  if (!legal(state_, to)) return false;  // out of turn, or the client left: not a bug
  queued_.push_back(std::move(a));
  // One ring per answer, posted in the order queued (a ring that finds the
  // queue already taken is harmless).
  if (!core_->post_if_running(strand_, [self = shared_from_this()] { self->bell_.cancel(); })) {
    queued_.pop_back();
    return false;
  }
  transition(state_, to, id_, "http exchange");
  return true;
}

bool Exchange::submit(Answer a) {
  using K = Answer::Kind;
  std::lock_guard lock(mu_);
  switch (a.kind) {
    case K::kRespond:
      return state_ == ExchangeState::kAwaiting && queue_locked(std::move(a), ExchangeState::kDone);
    case K::kStartSse:
      return state_ == ExchangeState::kAwaiting && queue_locked(std::move(a), ExchangeState::kStreaming);
    case K::kEvent:
      return state_ == ExchangeState::kStreaming && queue_locked(std::move(a), ExchangeState::kStreaming);
    case K::kFinish:
      return state_ == ExchangeState::kStreaming && queue_locked(std::move(a), ExchangeState::kDone);
    case K::kDroppedUnanswered:
    case K::kDroppedMidStream: return false;  // drop() queues these
  }
  return false;
}

void Exchange::drop() {
  std::function<void()> cb;  // released outside the lock
  std::lock_guard lock(mu_);
  if (state_ != ExchangeState::kAwaiting && state_ != ExchangeState::kStreaming) return;
  const auto kind =
      state_ == ExchangeState::kStreaming ? Answer::Kind::kDroppedMidStream : Answer::Kind::kDroppedUnanswered;
  queue_locked(Answer{kind}, ExchangeState::kDone);
  cb.swap(on_disconnect_);  // it can no longer fire
}

void Exchange::on_disconnect(std::function<void()> cb) {
  {
    std::lock_guard lock(mu_);
    if (state_ == ExchangeState::kAwaiting || state_ == ExchangeState::kStreaming) {
      on_disconnect_ = std::move(cb);
      return;
    }
    if (state_ != ExchangeState::kLeftUnheard) return;  // answered, or already reported: it can no longer fire
    transition(state_, ExchangeState::kLeft, id_, "http exchange");  // the client left before cb was set
  }
  if (!core_->post_if_running(strand_, [cb] { call_safely(cb, "on_disconnect callback"); })) {
    call_safely(cb, "on_disconnect callback");
  }
}

std::deque<Answer> Exchange::take() {
  std::lock_guard lock(mu_);
  return std::exchange(queued_, {});
}

void Exchange::client_gone() {
  std::function<void()> cb;
  {
    std::lock_guard lock(mu_);
    if (state_ != ExchangeState::kAwaiting && state_ != ExchangeState::kStreaming) return;  // answered: nothing to report
    cb.swap(on_disconnect_);
    transition(state_, cb ? ExchangeState::kLeft : ExchangeState::kLeftUnheard, id_, "http exchange");
  }
  if (cb) call_safely(cb, "on_disconnect callback");
}

bool Writer::respond(int status, std::string content_type, std::string body,
                     std::vector<std::pair<std::string, std::string>> headers) {
  bool close_after = !keep_alive_;
  auto res = make_response(version_, keep_alive_, status, content_type, std::move(body));
  for (auto& [name, value] : headers) {
    // Framing headers are the server's; CR/LF would split the header.
    if (name.find_first_of("\r\n:") != std::string::npos || value.find_first_of("\r\n") != std::string::npos) {
      continue;
    }
    if (beast::iequals(name, "Connection")) {
      if (beast::iequals(value, "close")) close_after = true;
      continue;
    }
    if (beast::iequals(name, "Content-Length") || beast::iequals(name, "Transfer-Encoding")) continue;
    res->set(name, value);
  }
  res->keep_alive(!close_after);
  return exchange_->submit(Answer{Answer::Kind::kRespond, std::move(res), close_after});
}

bool Writer::start_sse() { return exchange_->submit(Answer{Answer::Kind::kStartSse}); }

bool Writer::send_event(std::string data) {
  std::string chunk;
  chunk.reserve(data.size() + 8);
  chunk += "data: ";
  chunk += data;
  chunk += "\n\n";
  return exchange_->submit(Answer{Answer::Kind::kEvent, nullptr, false, std::move(chunk)});
}

bool Writer::finish() { return exchange_->submit(Answer{Answer::Kind::kFinish}); }

}  // namespace pd::router::detail
