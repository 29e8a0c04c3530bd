// The prefill worker: takes prompts from the router, runs them in batches under
// a token budget, samples each request's first token, and hands the KV cache to
// the request's decode rank layer by layer while the remaining layers compute.
//
// Handoff protocol (pull; see common/protocol/messages.h): on arrival the worker
// offers the attempt to its decode rank at once, so the decode rank can reserve
// blocks and post receives while the prompt is still queued or computing.
// Layers of accepted handoffs are sent as soon as each is written; a sequence
// whose offer is not yet accepted when its batch ends keeps its KV here until
// the accept (then all layers go at once), a reject, or the handoff timeout.
// Each sequence's transfer is one HandoffSender (kvtransfer/handoff_sender.h):
// its tag, the order of its sends, its trailer and checksums, what went out
// behind compute, whether it is held or sending, and abandonment. Each
// sequence's prompt is one PromptPass (worker/prompt_pass.h): its blocks
// placed chunk by chunk, its prompt logprobs, token 1. This worker keeps the
// queue, the batches and the sequence's lifecycle.
//
// A sequence's lifecycle (SeqState; every change checked, see util/lifecycle.h):
//   kQueued -> kComputing -> kHandingOff -> (ended: erased)
//   kComputing <-> kPrefilling (a chunk computed, more to come)
//   kComputing -> kAborted (ended while forward() still reads its blocks;
//                           erased when the pass returns)
//   any other state -> (ended: erased)
// kHandingOff: its whole prompt is computed and token 1 sent; its handoff
// holds the KV until the accept, then sends it (the sender's phase, kHeld or
// past kFinishing, says which).
// Ending a sequence with sends in flight abandons them (MPI cannot cancel a send):
// the decode rank was told (HandoffAbort) or is down, and discards whatever
// arrives; it posts no receive under that tag for us again until it has
// asked us to seal the tag (KvTagSeal) and taken everything we sent under it
// up to the seal (decode_node/kv_tags.h). So the blocks may be reused at
// once; the trailer bytes, which MPI may still read, are kept alive
// (graveyard_). A seal: the sequence under the tag (if still here) ends, then an
// empty send under the tag follows all it sent there; it is tested to its end
// (seals_), never abandoned while the decode rank is up — an abandoned send
// that waits in the send budget would never go out.
//
// The loop, peers' epochs, Rejoin, leaving the pool and load reports are the
// worker core's (worker/worker_core.h); this class is what is prefill's own.
// The communication side (kvtransfer/comm_side.h) keeps messages and sends
// moving while a pass runs: a control message that arrives during a pass is
// acted on at the next layer's end (mid_pass_message); sends of an accepted
// handoff go out layer by layer as each is written.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>

#include "kvtransfer/handoff_sender.h"
#include "worker/prompt_pass.h"
#include "worker/worker_core.h"

namespace pd {

class PrefillWorker final : public WorkerCore {
 public:
  // `channel` carries the control messages (MpiControlChannel in the cluster),
  // `transport` the KV bytes. run() / run_once(): WorkerCore.
  PrefillWorker(const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
                std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel);

 private:
  enum class SeqState { kQueued, kComputing, kPrefilling, kHandingOff, kAborted };
  friend const char* state_name(SeqState s);
  friend bool legal(SeqState from, SeqState to);
  struct Seq {
    proto::PrefillRequest req;
    SeqState state = SeqState::kQueued;
    Clock::time_point arrived, offered, computed;  // computed: its last chunk's pass ended
    PromptPass prompt;                   // its prompt's blocks, chunks, prompt logprobs and token 1
    bool last_chunk() const { return prompt.placed_end() == static_cast<int64_t>(req.prompt.size()); }
    // A warm-up (decode_rank -1): computed into this rank's prefix cache, handed to no one.
    bool warm() const { return req.decode_rank < 0; }
    std::vector<int32_t> table;          // block ids (valid while prompt.placed())
    HandoffSender handoff;               // the KV's way to the decode rank (tag, sends, trailer, checksums)
    int64_t hidden_bytes = 0;            // bytes sent when the last layer was computed
  };

  // WorkerCore
  bool on_message(int source, proto::Message& m) override;
  bool mid_pass_message(const proto::Message& m) const override;
  bool progress_transfers() override;
  void check_deadlines() override;
  bool work() override { return run_batch(); }
  void on_peer_down(int rank) override;
  void drop_all() override;
  // Hands queued sequences back (FailureKind::kLeaving); the rest finish.
  void on_drain() override;
  size_t held() const override { return seqs_.size(); }
  void fill_load(proto::LoadReport& r) const override;
  std::chrono::milliseconds exit_grace() const override;

  void on_request(proto::PrefillRequest req);
  void on_cancel(proto::RequestId id);
  void on_accept(const proto::HandoffAccept& m, int source);
  void on_reject(const proto::HandoffReject& m, int source);
  void on_seal(const proto::KvTagSeal& m, int source);
  void forget_peer(int rank) override;
  bool run_batch();
  void plan_pass();
  // Places the sequence's next chunk, tokens [prompt.computed(), end), and
  // refreshes its block table.
  Status place_chunk(Seq& seq, int64_t end);
  std::optional<proto::TokenEvent> finish_chunk(Seq& seq, std::span<float> rows);
  int64_t reserved_blocks() const;
  // Hands the written layers of an accepted handoff to the transport.
  void post_written(Seq& seq);
  void fail(Seq& seq, const std::string& reason, proto::FailureKind kind, bool tell_decode);
  // Ends the sequence: abandons its sends, frees its blocks, erases it (or, in
  // the running batch, marks it kAborted for run_batch to erase).
  void end(proto::RequestId id);

  std::unordered_map<proto::RequestId, Seq> seqs_;
  std::deque<proto::RequestId> queue_;
  std::vector<proto::RequestId> batch_;  // ids in the running batch (hook reads it)
  bool in_pass_ = false;                          // forward() is running (the layer hook may call in)
  std::deque<std::vector<uint8_t>> graveyard_;    // trailers of abandoned handoffs (MPI may still read them)
  struct Seal {
    int peer;
    TransferOp op;
  };
  std::vector<Seal> seals_;  // seals posted, not yet reported ended
  // (decode rank, tag) -> the attempt whose tag was sealed last: a KvTagSeal
  // for it again is a duplicate (a second seal would meet a later receive).
  std::map<std::pair<int, int>, proto::RequestId> sealed_;
};

}  // namespace pd
