#include "protocol/mpi_channel.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

namespace pd {

MpiControlChannel::~MpiControlChannel() {
  // Unfinished sends at destruction: the peer is gone or never received; free
  // the requests without waiting (MPI may still be finalizing).
  for (PendingSend& s : sends_)
    if (s.req != MPI_REQUEST_NULL) MPI_Request_free(&s.req);
}

void MpiControlChannel::send(int dest, const proto::Message& m) {
  const auto to = links_->endpoint(dest);
  const bool waiting = std::any_of(unlinked_.begin(), unlinked_.end(), [&](const Unlinked& u) { return u.dest == dest; });
  if (!to || waiting) {  // keep the order of messages to one rank
    unlinked_.push_back({dest, proto::serialize(m), proto::message_name(m),
                         std::chrono::steady_clock::now() + kUnlinkedWait});
    return;
  }
  isend(dest, *to, proto::serialize(m), proto::message_name(m));
}

void MpiControlChannel::isend(int dest, const MpiLinks::Endpoint& to, std::vector<uint8_t> bytes, const char* name) {
  PendingSend& s = sends_.emplace_back();
  s.bytes = std::move(bytes);
  if (MPI_Isend(s.bytes.data(), static_cast<int>(s.bytes.size()), MPI_BYTE, to.rank, proto::kTagControl, to.comm,
                &s.req) != MPI_SUCCESS) {
    spdlog::warn("control message {} to rank {}: MPI_Isend failed", name, dest);
    sends_.pop_back();
  }
}

void MpiControlChannel::send_unlinked() {
  const auto now = std::chrono::steady_clock::now();
  std::deque<Unlinked> still;
  for (Unlinked& u : unlinked_) {
    const bool blocked = std::any_of(still.begin(), still.end(), [&](const Unlinked& s) { return s.dest == u.dest; });
    const auto to = blocked ? std::nullopt : links_->endpoint(u.dest);
    if (to) {
      isend(u.dest, *to, std::move(u.bytes), u.name);
    } else if (now >= u.drop_at) {
      spdlog::warn("control message {} to rank {}: no link to that rank; dropped", u.name, u.dest);
    } else {
      still.push_back(std::move(u));
    }
  }
  unlinked_ = std::move(still);
}

std::optional<MpiControlChannel::Received> MpiControlChannel::poll() {
  links_->take_accepted();
  if (!unlinked_.empty()) send_unlinked();
  for (;;) {
    const auto& links = links_->links();
    std::optional<Received> got;
    for (size_t k = 0; k < links.size() && !got; ++k) {
      const size_t i = (next_link_ + k) % links.size();
      const MpiLinks::Link link = links[i];
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, proto::kTagControl, link.comm, &flag, &st) != MPI_SUCCESS || !flag) continue;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      recv_buf_.resize(static_cast<size_t>(std::max(count, 1)));
      MPI_Recv(recv_buf_.data(), count, MPI_BYTE, st.MPI_SOURCE, proto::kTagControl, link.comm, MPI_STATUS_IGNORE);
      next_link_ = i + 1;
      const int source = link.id == -1 ? links_->world_id(st.MPI_SOURCE) : link.id;
      if (source == -1) continue;  // a world-mate with no id here (this rank joined a new router alone)
      got = Received{source, proto::deserialize(recv_buf_.data(), static_cast<size_t>(count))};
    }
    if (!got) return std::nullopt;
    if (got->source > MpiLinks::kProvisionalBase) return got;
    // An accepted link not bound yet: its first message says who is on it.
    if (got->message.is_ok()) {
      if (auto* hello = std::get_if<proto::Hello>(&*got->message)) {
        if (links_->bind(got->source, hello->rank)) {
          got->source = hello->rank;
          return got;
        }
        spdlog::warn("Hello from rank {} on a new link: that rank already has one; dropped", hello->rank);
        continue;
      }
    }
    spdlog::warn("control message on a new link before its Hello; dropped");
  }
}

int MpiControlChannel::receive(const std::function<void(int, proto::Message&)>& fn, int max) {
  int n = 0;
  for (; n < max; ++n) {
    auto msg = poll();
    if (!msg) break;
    if (!msg->message.is_ok()) {
      spdlog::error("control message from rank {}: {}", msg->source, msg->message.status().to_string());
      continue;
    }
    fn(msg->source, *msg->message);
  }
  return n;
}

void MpiControlChannel::progress() {
  while (!sends_.empty()) {
    int done = 0;
    MPI_Test(&sends_.front().req, &done, MPI_STATUS_IGNORE);
    if (!done) break;
    sends_.pop_front();
  }
  // Later sends may finish before the front one; test them too so buffers don't pile up.
  for (auto it = sends_.begin(); it != sends_.end();) {
    int done = 0;
    MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
    it = done ? sends_.erase(it) : it + 1;
  }
}

bool MpiControlChannel::flush(std::chrono::milliseconds deadline) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  while (!sends_.empty() && std::chrono::steady_clock::now() < end) {
    progress();
    if (!sends_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return sends_.empty();
}

}  // namespace pd
