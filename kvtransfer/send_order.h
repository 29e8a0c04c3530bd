// Transfer scheduling: which waiting KV send to one peer goes out next.
// Pure policy over what each send is waited on by; knows nothing of MPI.
// The send budget (send_budget.h) asks it each time room frees to a peer.
//
// What waits on a send decides its order:
//  - kDecodeWaiting: a handoff whose prompt is computed — its token 1 is out,
//    and its decode starts the moment these bytes (the rest of its KV, its
//    trailer) land. Every step they wait is a step the user sees.
//  - kBehindCompute: segments of a prompt still computing (chunked prefill
//    sends each chunk's KV behind the next chunks' passes). Nothing can use
//    them before the prompt's last pass ends, seconds away for a long prompt.
//
// The rule, over the waiting sends in posting order:
//  1. A send that later sends have overtaken by more than max_bypass_bytes in
//     all goes first (the oldest such): no send starves, whatever keeps
//     arriving ahead of it.
//  2. Else the oldest kDecodeWaiting send.
//  3. Else the oldest send.
// Sends under one tag keep their order: a handoff becomes kDecodeWaiting for
// all of its waiting sends at once (and later ones under its tag join it), so
// an earlier send of a tag is never behind a later one of the same tag; and a
// send overtaken past the bound is overtaken by no later send of its tag
// either.
//
// Bound: a kBehindCompute send waits at most for max_bypass_bytes of later
// sends (plus the one that was being chosen): at the ~1 GB/s of a slow link,
// 32 MiB is ~30 ms, and a long prompt's chunk pass takes hundreds.
#pragma once

#include <cstdint>
#include <span>

namespace pd {

enum class SendUrgency { kBehindCompute, kDecodeWaiting };

struct WaitingSend {
  SendUrgency urgency = SendUrgency::kBehindCompute;
  int64_t bypassed_bytes = 0;  // bytes of later sends posted while this one waited
};

struct SendOrderPolicy {
  int64_t max_bypass_bytes = int64_t{32} << 20;
};

// Index (into `waiting`, oldest first) of the send to post next; waiting is not empty.
size_t next_send(std::span<const WaitingSend> waiting, const SendOrderPolicy& policy = {});

}  // namespace pd
