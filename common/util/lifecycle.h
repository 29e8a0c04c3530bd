// A request's lifecycle inside one component: one state enum, its legal
// transitions written once (a `legal(from, to)` function next to the enum),
// and every change of state made through transition(), which checks it — as
// vLLM's RequestStatus and TensorRT-LLM's LlmRequestState keep one state per
// request instead of a state plus flags.
//
//   enum class SeqState { kQueued, kComputing, ... };
//   const char* state_name(SeqState s);
//   bool legal(SeqState from, SeqState to);
//   transition(seq.state, SeqState::kComputing, seq.id, "prefill");
//
// An illegal transition is a bug: it is logged (component, request, from, to)
// and counted; a Debug build (the sanitizer test run) aborts on it.
#pragma once

#include <cstdint>

namespace pd {

// Illegal transitions seen by this process (0 in a correct program).
int64_t illegal_transitions();
void report_illegal_transition(const char* component, uint64_t id, const char* from, const char* to);

// Sets `state` to `to` if the move is legal for the enum (found by ADL: legal(),
// state_name()); otherwise reports it and leaves `state` unchanged. Returns
// whether it moved.
template <typename State>
bool transition(State& state, State to, uint64_t id, const char* component) {
  if (!legal(state, to)) {
    report_illegal_transition(component, id, state_name(state), state_name(to));
    return false;
  }
  state = to;
  return true;
}

}  // namespace pd
