#include "fake_channel.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <deque>
#include <map>

namespace pd::test {

struct FakeChannelHub::Inboxes {
  FakeChannelHub* hub = nullptr;  // null once the hub is gone
  std::map<int, std::deque<std::pair<int, std::vector<uint8_t>>>> by_rank;
  std::map<int, std::set<int>> forgotten;  // rank -> the ranks it forgot (PeerLeft)
};

class FakeChannelHub::Endpoint final : public ControlChannel {
 public:
  Endpoint(std::shared_ptr<Inboxes> inboxes, int rank) : inboxes_(std::move(inboxes)), rank_(rank) {}
  void send(int dest, const proto::Message& m) override {
    if (inboxes_->hub != nullptr) inboxes_->hub->send(rank_, dest, m);
  }
  int receive(const std::function<void(int source, proto::Message& m)>& fn, int max) override {
    auto& inbox = inboxes_->by_rank[rank_];
    int n = 0;
    for (; n < max && !inbox.empty(); ++n) {
      auto [source, bytes] = std::move(inbox.front());
      inbox.pop_front();
      auto msg = proto::deserialize(bytes.data(), bytes.size());
      if (!msg.is_ok()) {
        spdlog::error("control message from rank {}: {}", source, msg.status().to_string());
        continue;
      }
      fn(source, *msg);
    }
    return n;
  }
  int receive_while(const std::function<bool(int source, const proto::Message& m)>& take,
                    const std::function<void(int source, proto::Message& m)>& fn, int max) override {
    auto& inbox = inboxes_->by_rank[rank_];
    int n = 0;
    for (; n < max && !inbox.empty(); ++n) {
      auto msg = proto::deserialize(inbox.front().second.data(), inbox.front().second.size());
      const int source = inbox.front().first;
      if (msg.is_ok() && !take(source, *msg)) break;
      inbox.pop_front();
      if (!msg.is_ok()) {
        spdlog::error("control message from rank {}: {}", source, msg.status().to_string());
        continue;
      }
      fn(source, *msg);
    }
    return n;
  }
  void progress() override {}
  size_t pending_sends() const override { return 0; }  // the hub takes every send at once
  bool flush(std::chrono::milliseconds) override { return true; }
  void forget(int rank) override { inboxes_->forgotten[rank_].insert(rank); }

 private:
  std::shared_ptr<Inboxes> inboxes_;
  int rank_;
};

FakeChannelHub::FakeChannelHub() : inboxes_(std::make_shared<Inboxes>()) { inboxes_->hub = this; }
FakeChannelHub::~FakeChannelHub() { inboxes_->hub = nullptr; }

std::set<int> FakeChannelHub::forgotten(int rank) const { return inboxes_->forgotten[rank]; }

std::unique_ptr<ControlChannel> FakeChannelHub::endpoint(int rank) {
  return std::make_unique<Endpoint>(inboxes_, rank);
}

bool FakeChannelHub::take(std::vector<Fault>& faults, int source, int dest, const proto::Message& m) {
  for (Fault& f : faults) {
    if (f.left > 0 && f.match(source, dest, m)) {
      --f.left;
      return true;
    }
  }
  return false;
}

void FakeChannelHub::send(int source, int dest, const proto::Message& m) {
  if (dead_.count(source) || dead_.count(dest)) return;
  if (take(drops_, source, dest, m)) return;
  const int copies = take(dups_, source, dest, m) ? 2 : 1;
  for (int i = 0; i < copies; ++i) route(Packet{source, dest, proto::serialize(m)});
}

void FakeChannelHub::send_raw(int source, int dest, std::vector<uint8_t> bytes) {
  if (dead_.count(source) || dead_.count(dest)) return;
  route(Packet{source, dest, std::move(bytes)});
}

void FakeChannelHub::route(Packet p) {
  if (holding_) held_.push_back(std::move(p));
  else deliver(std::move(p));
}

void FakeChannelHub::deliver(Packet p) {
  if (dead_.count(p.source) || dead_.count(p.dest)) return;
  inboxes_->by_rank[p.dest].emplace_back(p.source, std::move(p.bytes));
}

void FakeChannelHub::release(bool reversed) {
  holding_ = false;
  std::vector<Packet> held;
  held.swap(held_);
  if (reversed) std::reverse(held.begin(), held.end());
  for (Packet& p : held) deliver(std::move(p));
}

void FakeChannelHub::drop_next(int n, Match match) { drops_.push_back({n, std::move(match)}); }
void FakeChannelHub::duplicate_next(int n, Match match) { dups_.push_back({n, std::move(match)}); }
void FakeChannelHub::kill(int rank) { dead_.insert(rank); }

std::vector<std::pair<int, proto::Message>> FakeChannelHub::take_all(int rank) {
  std::vector<std::pair<int, proto::Message>> out;
  auto& inbox = inboxes_->by_rank[rank];
  for (auto& [source, bytes] : inbox) {
    auto msg = proto::deserialize(bytes.data(), bytes.size());
    if (msg.is_ok()) out.emplace_back(source, std::move(msg).value());
  }
  inbox.clear();
  return out;
}

}  // namespace pd::test
