// Transfer scheduling (kvtransfer/send_order.h): which waiting send to a peer
// goes out next, as a table; then the starvation bound over a simulated queue.
#include <catch2/catch.hpp>

#include <vector>

#include "kvtransfer/send_order.h"

namespace pd {
namespace {

constexpr SendUrgency kB = SendUrgency::kBehindCompute;
constexpr SendUrgency kD = SendUrgency::kDecodeWaiting;

TEST_CASE("send order: which waiting send goes next", "[send_order]") {
  struct Row {
    const char* what;
    std::vector<WaitingSend> waiting;  // oldest first
    size_t expected;
  };
  const SendOrderPolicy policy{1000};
  const std::vector<Row> table{
      {"one send", {{kB, 0}}, 0},
      {"nothing waits on any: oldest first", {{kB, 0}, {kB, 0}, {kB, 0}}, 0},
      {"a decode waits on a later one: it overtakes", {{kB, 0}, {kB, 0}, {kD, 0}}, 2},
      {"several a decode waits on: the oldest of them", {{kB, 0}, {kD, 0}, {kD, 0}}, 1},
      {"the oldest waited on goes first anyway", {{kD, 0}, {kB, 0}}, 0},
      {"overtaken up to the bound: still waits", {{kB, 1000}, {kD, 0}}, 1},
      {"overtaken past the bound: goes first", {{kB, 1001}, {kD, 0}}, 0},
      {"several past the bound: the oldest", {{kB, 0}, {kB, 5000}, {kB, 2000}, {kD, 0}}, 1},
      {"a waited-on send past the bound is still first among them", {{kD, 2000}, {kD, 0}}, 0},
  };
  for (const Row& r : table) {
    INFO(r.what);
    CHECK(next_send(r.waiting, policy) == r.expected);
  }
}

// A queue fed with a waited-on send every time one goes out: the send that
// nothing waits on still goes once it has been overtaken by the bound.
TEST_CASE("send order: no send starves behind sends a decode waits on", "[send_order]") {
  const SendOrderPolicy policy{10 * 4096};
  std::vector<WaitingSend> q{{kB, 0}, {kD, 0}};
  int rounds = 0;
  bool behind_went = false;
  while (!behind_went && rounds < 1000) {
    const size_t pick = next_send(q, policy);
    behind_went = q[pick].urgency == kB;
    for (size_t i = 0; i < pick; ++i) q[i].bypassed_bytes += 4096;
    q.erase(q.begin() + static_cast<std::ptrdiff_t>(pick));
    q.push_back({kD, 0});  // another handoff's token 1 is out
    ++rounds;
  }
  CHECK(behind_went);
  CHECK(rounds == 12);  // 11 overtook it (4096 bytes each) before it passed 10 x 4096
}

}  // namespace
}  // namespace pd
