// An in-process control plane for tests: a hub that carries protocol messages
// between ControlChannel endpoints, one per rank, with the faults a test needs
// (hold and release, reorder, drop, duplicate, a dead rank). Every message is
// serialized and parsed again on delivery, so the wire format is exercised.
//
//   FakeChannelHub hub;
//   PrefillWorker p(cfg, roles_p, engine, transport, hub.endpoint(1));
//   hub.send(0, 1, proto::PrefillRequest{...});   // as the router (rank 0)
//   p.run_once();
//   for (auto& [source, m] : hub.take_all(0)) ...  // what reached the router
//
// Threading: one thread (the test's) uses the hub and all its endpoints.
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "protocol/control_channel.h"

namespace pd::test {

class FakeChannelHub {
 public:
  // Which messages a fault applies to: (source, dest, message).
  using Match = std::function<bool(int source, int dest, const proto::Message& m)>;

  FakeChannelHub();
  ~FakeChannelHub();
  FakeChannelHub(const FakeChannelHub&) = delete;
  FakeChannelHub& operator=(const FakeChannelHub&) = delete;

  // The channel of `rank`: what it sends goes to the hub, its receive() takes the
  // messages delivered to `rank`. May outlive the hub (its sends then vanish).
  std::unique_ptr<ControlChannel> endpoint(int rank);

  // Sends as `source` (a rank with no endpoint, e.g. the test playing the router).
  void send(int source, int dest, const proto::Message& m);
  // Delivers raw bytes as if `source` had sent them (malformed-message tests).
  void send_raw(int source, int dest, std::vector<uint8_t> bytes);
  // Everything delivered to `rank` and not yet received, parsed, in order
  // (a message that does not parse is skipped). For ranks the test plays.
  std::vector<std::pair<int, proto::Message>> take_all(int rank);

  // While held, sent messages wait in the hub; release() delivers them (in
  // reverse order when `reversed`, i.e. reordered) and stops holding.
  void hold() { holding_ = true; }
  void release(bool reversed = false);
  size_t held() const { return held_.size(); }
  // The next `n` messages that match vanish / are delivered twice.
  void drop_next(int n, Match match);
  void duplicate_next(int n, Match match);
  // Messages to or from `rank` vanish from now on (messages already delivered
  // to it stay in its inbox, unread).
  void kill(int rank);
  // The ranks `rank`'s channel was told to forget (a peer that left).
  std::set<int> forgotten(int rank) const;

 private:
  struct Packet {
    int source, dest;
    std::vector<uint8_t> bytes;
  };
  struct Fault {
    int left;
    Match match;
  };
  class Endpoint;
  struct Inboxes;  // shared with the endpoints (they may outlive the hub)

  void route(Packet p);
  void deliver(Packet p);
  static bool take(std::vector<Fault>& faults, int source, int dest, const proto::Message& m);

  std::shared_ptr<Inboxes> inboxes_;
  bool holding_ = false;
  std::vector<Packet> held_;
  std::vector<Fault> drops_, dups_;
  std::set<int> dead_;
};

}  // namespace pd::test
