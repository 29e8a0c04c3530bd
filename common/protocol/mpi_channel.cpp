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

void MpiControlChannel::refuse(int link, const std::string& why) {
  spdlog::warn("refused a joining link: {}; link freed", why);
  ++refused_links_;
  // A rank joining the router waits for its answer: tell it why (a worker's
  // link has no answer to wait for). The send completes before the link is
  // freed (MPI_Comm_free lets pending operations finish).
  if (link > MpiLinks::kProvisionalBase)
    if (const auto to = links_->endpoint(link)) {
      const proto::JoinRefused r{why + " (is --secret-file the cluster's secret?)"};
      isend(link, *to, proto::serialize(r), proto::message_name(r));
    }
  unproven_.erase(link);
  links_->forget(link);
}

void MpiControlChannel::challenge_accepted() {
  const auto now = std::chrono::steady_clock::now();
  for (int id : links_->take_accepted()) {
    if (!secret_) {
      const std::string& path = links_->secret_path();
      auto loaded = path.empty() ? Result<ClusterSecret>(Status::not_found("no cluster secret configured"))
                                 : ClusterSecret::load(path);
      if (!loaded.is_ok()) {
        spdlog::error("cannot check a joining rank's proof: {}", loaded.status().to_string());
        ++refused_links_;
        links_->forget(id);
        continue;
      }
      secret_ = std::move(loaded).value();
    }
    Unproven& u = unproven_[id];
    u.challenge = ClusterSecret::challenge();
    u.drop_at = now + kProofWait;
    if (const auto to = links_->endpoint(id)) {
      const proto::Challenge c{u.challenge};
      isend(id, *to, proto::serialize(c), proto::message_name(c));
    }
  }
  std::vector<int> late;
  for (const auto& [id, u] : unproven_)
    if (now >= u.drop_at) late.push_back(id);
  for (int id : late)
    refuse(id, "it proved nothing within " + std::to_string(kProofWait.count()) + " s");
}

bool MpiControlChannel::admit(Received& got) {
  const int link = got.source;
  const std::string challenge = unproven_.at(link).challenge;
  if (!got.message.is_ok()) {
    refuse(link, "its first message is malformed (" + got.message.status().message() + ")");
    return false;
  }
  proto::Message& m = *got.message;
  // The router hands ids out as it accepts (a Join answers); a worker's links
  // are provisional until a Hello names the rank on it.
  const bool worker_side = link <= MpiLinks::kProvisionalBase;
  const bool expected = worker_side ? std::holds_alternative<proto::Hello>(m) : std::holds_alternative<proto::Join>(m);
  if (!expected) {
    refuse(link, std::string("its first message is ") + proto::message_name(m) + ", not " +
                     (worker_side ? "Hello" : "Join"));
    return false;
  }
  if (!secret_->verify(challenge, m)) {
    refuse(link, std::string("its ") + proto::message_name(m) + " does not prove the cluster secret");
    return false;
  }
  if (auto* hello = std::get_if<proto::Hello>(&m)) {
    if (!links_->bind(link, hello->rank)) {
      refuse(link, "its Hello names rank " + std::to_string(hello->rank) + ", which already has a link");
      return false;
    }
    got.source = hello->rank;
  }
  unproven_.erase(link);
  return true;
}

std::optional<MpiControlChannel::Received> MpiControlChannel::poll() {
  challenge_accepted();
  if (!unlinked_.empty()) send_unlinked();
  for (;;) {
    const auto& links = links_->links();
    std::optional<Received> got;
    bool refused = false;
    for (size_t k = 0; k < links.size() && !got; ++k) {
      const size_t i = (next_link_ + k) % links.size();
      const MpiLinks::Link link = links[i];
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, proto::kTagControl, link.comm, &flag, &st) != MPI_SUCCESS || !flag) continue;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      if (count > kMaxProofBytes && unproven_.count(link.id) > 0) {
        // Not received at all: an unproven peer gets neither the memory nor a
        // blocking receive of a large (rendezvous) message it may never finish.
        refuse(link.id, "its first message is " + std::to_string(count) + " bytes, over " +
                            std::to_string(kMaxProofBytes));
        refused = true;  // the links changed: probe them afresh
        break;
      }
      recv_buf_.resize(static_cast<size_t>(std::max(count, 1)));
      MPI_Recv(recv_buf_.data(), count, MPI_BYTE, st.MPI_SOURCE, proto::kTagControl, link.comm, MPI_STATUS_IGNORE);
      next_link_ = i + 1;
      const int source = link.id == -1 ? links_->world_id(st.MPI_SOURCE) : link.id;
      if (source == -1) continue;  // a world-mate with no id here (this rank joined a new router alone)
      got = Received{source, proto::deserialize(recv_buf_.data(), static_cast<size_t>(count))};
    }
    if (refused) continue;
    if (!got) return std::nullopt;
    // An accepted link must prove the cluster secret before anything on it counts.
    if (unproven_.count(got->source) > 0 && !admit(*got)) continue;
    if (got->source > MpiLinks::kProvisionalBase) return got;
    // A provisional link that is not (or no longer) unproven: freed, its last bytes ignored.
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
  if (sends_.empty()) return;
  sweep_reqs_.clear();
  for (const PendingSend& s : sends_) sweep_reqs_.push_back(s.req);
  sweep_done_.resize(sweep_reqs_.size());
  int count = 0;
  // Completed sends (ended well or not: nothing more can be done for a failed
  // control message) come back freed, as MPI_REQUEST_NULL.
  MPI_Testsome(static_cast<int>(sweep_reqs_.size()), sweep_reqs_.data(), &count, sweep_done_.data(),
               MPI_STATUSES_IGNORE);
  for (size_t i = 0; i < sends_.size(); ++i) sends_[i].req = sweep_reqs_[i];
  std::erase_if(sends_, [](const PendingSend& s) { return s.req == MPI_REQUEST_NULL; });
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
