// The queues between the HTTP front and the link loop (see front_link.h).
#include "router/front_link.h"

namespace pd::router {

const char* state_name(RouterState s) {
  switch (s) {
    case RouterState::kServing: return "serving";
    case RouterState::kStopping: return "stopping";
    case RouterState::kStopped: return "stopped";
  }
  return "?";
}

bool legal(RouterState from, RouterState to) {
  switch (from) {
    case RouterState::kServing: return to == RouterState::kStopping || to == RouterState::kStopped;
    case RouterState::kStopping: return to == RouterState::kStopped;
    case RouterState::kStopped: return false;
  }
  return false;
}

void LinkInbox::post(InboxItem item) {
  std::lock_guard lock(mu_);
  items_.push_back(std::move(item));
}

std::deque<InboxItem> LinkInbox::take() {
  std::deque<InboxItem> out;
  std::lock_guard lock(mu_);
  out.swap(items_);
  return out;
}

void LinkStatus::publish(const LinkSnapshot& s) {
  std::lock_guard lock(mu_);
  snapshot_ = s;
}

LinkSnapshot LinkStatus::snapshot() const {
  std::lock_guard lock(mu_);
  return snapshot_;
}

bool LinkStatus::try_add_queued(int n, int limit) {
  int now = queued_.load();
  do {
    if (now + n > limit) return false;
  } while (!queued_.compare_exchange_weak(now, now + n));
  return true;
}

bool LinkStatus::stopping() const {
  std::lock_guard lock(mu_);
  return snapshot_.state != RouterState::kServing;
}

}  // namespace pd::router
