#include "decode_node/seq_kv.h"

#include <spdlog/spdlog.h>

#include "util/lifecycle.h"

namespace pd {

const char* state_name(SeqKv::State s) {
  switch (s) {
    case SeqKv::State::kNone: return "none";
    case SeqKv::State::kWriting: return "writing";
    case SeqKv::State::kWritten: return "written";
  }
  return "?";
}

bool legal(SeqKv::State from, SeqKv::State to) {
  using S = SeqKv::State;
  switch (from) {
    case S::kNone: return to == S::kWriting;
    case S::kWriting: return to == S::kWritten || to == S::kNone;
    case S::kWritten: return to == S::kNone;
  }
  return false;
}

void SeqKv::allocated(proto::RequestId id) { transition(state_, State::kWriting, id, "decode kv"); }

void SeqKv::written(KvBlockManager& blocks, proto::RequestId id, int self) {
  transition(state_, State::kWritten, id, "decode kv");
  if (Status st = blocks.publish(SeqId{static_cast<int64_t>(id)}); !st.is_ok())
    spdlog::error("decode rank {}: request {}: {}", self, id, st.to_string());
}

void SeqKv::release(KvBlockManager& blocks, proto::RequestId id, int self) {
  if (state_ == State::kNone) return;
  const SeqId seq{static_cast<int64_t>(id)};
  Status st = state_ == State::kWritten ? blocks.free(seq) : blocks.discard(seq);
  if (!st.is_ok()) spdlog::error("decode rank {}: releasing request {}: {}", self, id, st.to_string());
  transition(state_, State::kNone, id, "decode kv");
}

}  // namespace pd
