// Tests of the HTTP server's connection-limit policy (router/connection_slots.h),
// table-driven: each case is a sequence of steps (accept, idle, busy, close)
// with, after every step, what the new connection got, which idle slot holder
// was evicted, and the slots, listed idle holders and open connections.
#include "router/connection_slots.h"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pd::router {
namespace {

enum class Op { kAccept, kIdle, kBusy, kClose };

struct Step {
  Op op;
  uint64_t id;  // kIdle/kBusy/kClose: the connection; kAccept: the id expected
  // kAccept only: what it got, and the evicted holder (-1: none).
  Admission admission = Admission::kSlot;
  int64_t evicted = -1;
  // After the step.
  size_t slots_used = 0;
  size_t idle = 0;
  size_t open = 0;
};

Step accept(uint64_t id, Admission a, int64_t evicted, size_t slots, size_t idle, size_t open) {
  return {Op::kAccept, id, a, evicted, slots, idle, open};
}
Step refuse(size_t slots, size_t idle, size_t open) {
  return {Op::kAccept, 0, Admission::kRefused, -1, slots, idle, open};
}
Step step(Op op, uint64_t id, size_t slots, size_t idle, size_t open) {
  return {op, id, Admission::kSlot, -1, slots, idle, open};
}

struct Case {
  std::string name;
  size_t max_connections;
  size_t max_overflow;
  std::vector<Step> steps;
};

void run(const Case& c) {
  ConnectionSlots slots(c.max_connections, c.max_overflow);
  for (size_t i = 0; i < c.steps.size(); ++i) {
    const Step& s = c.steps[i];
    INFO(c.name << ", step " << i);
    switch (s.op) {
      case Op::kAccept: {
        const AdmitResult r = slots.admit();
        CHECK(std::string(admission_name(r.admission)) == admission_name(s.admission));
        if (s.admission != Admission::kRefused) CHECK(r.id == s.id);
        CHECK(r.evicted == (s.evicted < 0 ? std::nullopt : std::optional<uint64_t>(s.evicted)));
        if (r.evicted) CHECK_FALSE(slots.holds_slot(*r.evicted));
        if (s.admission == Admission::kSlot) CHECK(slots.holds_slot(r.id));
        break;
      }
      case Op::kIdle: slots.set_idle(s.id, true); break;
      case Op::kBusy: slots.set_idle(s.id, false); break;
      case Op::kClose: slots.remove(s.id); break;
    }
    CHECK(slots.slots_used() == s.slots_used);
    CHECK(slots.idle() == s.idle);
    CHECK(slots.open() == s.open);
  }
}

TEST_CASE("connection slots: admission and eviction, step by step", "[http][slots]") {
  using A = Admission;
  const std::vector<Case> cases = {
      {"unlimited: no slots, no overflow, no ceiling, nobody listed idle",
       0,
       0,
       {accept(0, A::kUnlimited, -1, 0, 0, 1), accept(1, A::kUnlimited, -1, 0, 0, 2), step(Op::kIdle, 0, 0, 0, 2),
        accept(2, A::kUnlimited, -1, 0, 0, 3), step(Op::kClose, 1, 0, 0, 2)}},
      {"slots, then overflow places, then refusal; a busy holder is never evicted",
       2,
       1,
       {accept(0, A::kSlot, -1, 1, 1, 1), step(Op::kBusy, 0, 1, 0, 1), accept(1, A::kSlot, -1, 2, 1, 2),
        step(Op::kBusy, 1, 2, 0, 2), accept(2, A::kOverflow, -1, 2, 0, 3), refuse(2, 0, 3), refuse(2, 0, 3),
        step(Op::kClose, 2, 2, 0, 2), accept(3, A::kOverflow, -1, 2, 0, 3)}},
      {"a refused connection takes no id",
       1,
       0,
       {accept(0, A::kSlot, -1, 1, 1, 1), refuse(1, 1, 1), step(Op::kClose, 0, 0, 0, 0),
        accept(1, A::kSlot, -1, 1, 1, 1)}},
      {"a new holder is idle from its accept on: with nothing received, the one accepted first goes first",
       2,
       2,
       {accept(0, A::kSlot, -1, 1, 1, 1), accept(1, A::kSlot, -1, 2, 2, 2), step(Op::kIdle, 0, 2, 2, 2),
        accept(2, A::kSlot, 0, 2, 2, 3), accept(3, A::kSlot, 1, 2, 2, 4), refuse(2, 2, 4)}},
      {"the longest idle holder is evicted first; its slot goes to the newcomer",
       2,
       2,
       {accept(0, A::kSlot, -1, 1, 1, 1), accept(1, A::kSlot, -1, 2, 2, 2), step(Op::kBusy, 0, 2, 1, 2),
        step(Op::kBusy, 1, 2, 0, 2), step(Op::kIdle, 1, 2, 1, 2), step(Op::kIdle, 0, 2, 2, 2),
        step(Op::kIdle, 1, 2, 2, 2),  // listing again keeps its place
        accept(2, A::kSlot, 1, 2, 2, 3), accept(3, A::kSlot, 0, 2, 2, 4), refuse(2, 2, 4)}},
      {"the ceiling counts every open connection, evicted ones too: at it, an idle holder is not evicted",
       1,
       0,
       {accept(0, A::kSlot, -1, 1, 1, 1), step(Op::kIdle, 0, 1, 1, 1), refuse(1, 1, 1)}},
      {"eviction goes before overflow even with overflow places free",
       1,
       4,
       {accept(0, A::kSlot, -1, 1, 1, 1), accept(1, A::kSlot, 0, 1, 1, 2), step(Op::kBusy, 1, 1, 0, 2),
        accept(2, A::kOverflow, -1, 1, 0, 3)}},
      {"an evicted connection is slotless: listing it idle does nothing, closing it frees no slot",
       1,
       2,
       {accept(0, A::kSlot, -1, 1, 1, 1), accept(1, A::kSlot, 0, 1, 1, 2), step(Op::kBusy, 1, 1, 0, 2),
        step(Op::kIdle, 0, 1, 0, 2), accept(2, A::kOverflow, -1, 1, 0, 3), step(Op::kClose, 0, 1, 0, 2),
        accept(3, A::kOverflow, -1, 1, 0, 3)}},
      {"a holder that got busy again is no candidate",
       1,
       1,
       {accept(0, A::kSlot, -1, 1, 1, 1), step(Op::kBusy, 0, 1, 0, 1), accept(1, A::kOverflow, -1, 1, 0, 2),
        step(Op::kIdle, 1, 1, 0, 2) /* overflow: never listed */}},
      {"closing a listed holder frees its slot and unlists it",
       1,
       0,
       {accept(0, A::kSlot, -1, 1, 1, 1), step(Op::kClose, 0, 0, 0, 0), accept(1, A::kSlot, -1, 1, 1, 1)}},
      {"unknown ids are ignored",
       1,
       0,
       {step(Op::kIdle, 7, 0, 0, 0), step(Op::kClose, 7, 0, 0, 0), accept(0, A::kSlot, -1, 1, 1, 1),
        step(Op::kClose, 0, 0, 0, 0), step(Op::kClose, 0, 0, 0, 0)}},
  };
  for (const Case& c : cases) run(c);
}

TEST_CASE("connection slots: a holder reading a request is a candidate once silent for stall_after, oldest first",
          "[http][slots]") {
  using namespace std::chrono_literals;
  using A = Admission;
  const ConnectionSlots::Clock::time_point t0{};
  ConnectionSlots slots(2, 4, 2000ms);
  const AdmitResult a = slots.admit(t0), b = slots.admit(t0);
  REQUIRE(a.admission == A::kSlot);
  REQUIRE(b.admission == A::kSlot);
  slots.list(a.id, Listing::kReading, t0);  // part of a request came at t0
  slots.list(b.id, Listing::kIdle, t0 + 1s);  // idle since its accept at t0: keeps its place
  CHECK(slots.reading() == 1);
  CHECK(slots.idle() == 1);

  // a has been silent 1.5 s only: the idle holder goes.
  const AdmitResult c = slots.admit(t0 + 1500ms);
  CHECK(c.admission == A::kSlot);
  CHECK(c.evicted == std::optional<uint64_t>(b.id));
  CHECK_FALSE(c.evicted_reading);
  slots.remove(b.id);
  slots.list(c.id, Listing::kReading, t0 + 1500ms);
  CHECK(slots.admit(t0 + 1900ms).admission == A::kOverflow);  // nobody silent for 2 s yet

  // Bytes reached a at 1.8 s: its silence starts again.
  slots.list(a.id, Listing::kReading, t0 + 1800ms);
  CHECK(slots.admit(t0 + 3s).admission == A::kOverflow);
  // At 3.6 s, c has been silent 2.1 s, a 1.8 s: c goes.
  const AdmitResult d = slots.admit(t0 + 3600ms);
  CHECK(d.admission == A::kSlot);
  CHECK(d.evicted == std::optional<uint64_t>(c.id));
  CHECK(d.evicted_reading);
  CHECK_FALSE(slots.holds_slot(c.id));
  slots.list(c.id, Listing::kReading, t0 + 3600ms);  // evicted: slotless, never listed again
  CHECK(slots.reading() == 1);

  // Stalled since 1.8 s vs idle since its accept at 3.6 s: the one listed longest ago goes.
  slots.list(d.id, Listing::kIdle, t0 + 3700ms);
  const AdmitResult e = slots.admit(t0 + 4s);
  CHECK(e.evicted == std::optional<uint64_t>(a.id));
  CHECK(e.evicted_reading);
  CHECK(slots.reading() == 0);
  CHECK(slots.idle() == 2);  // d, and e since its accept

  // Unlisted (its request went to the handler): no candidate.
  slots.list(e.id, Listing::kReading, t0);
  slots.list(e.id, Listing::kNone, t0);
  slots.list(d.id, Listing::kNone, t0);
  CHECK(slots.reading() == 0);
  CHECK(slots.idle() == 0);
  CHECK(slots.open() == 6);
  CHECK(slots.admit(t0 + 60s).admission == A::kRefused);  // 2 + 4 open: the ceiling
  slots.remove(a.id);
  CHECK(slots.admit(t0 + 60s).admission == A::kOverflow);
}

}  // namespace
}  // namespace pd::router
