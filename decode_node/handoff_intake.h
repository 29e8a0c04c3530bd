// The decode rank's handoff intake: every attempt a prefill rank offers this
// rank, from its offer until its KV is here (verified) or the handoff ended.
// It answers offers (accept with a tag and posted receives, or reject), keeps
// each prefill rank's tag pool (kv_tags.h: releases, seals and reclaims),
// tombstones of attempts the router cancelled before their offer came, and
// the blocks under receives until MPI is done with them. What it hands the
// decode worker's batcher is a Landed sequence: KV complete and checked, its
// blocks published, token 1 known.
//
// A handoff's life here (State; every change checked, util/lifecycle.h):
//   kOffered (waiting for room and a tag) -> kReceiving (blocks reserved,
//   receives posted) -> landed (handed to the worker; erased here)
//   kReceiving -> kCancelling: ended while receives are posted; the blocks are
//   freed only when MPI can no longer write into them (below).
//   any -> ended (erased: tag back to its pool, blocks released).
//
// When may blocks under a receive be reused? When every receive completed or
// was cancelled (MPI reports it). A receive already matched to a send cannot
// be cancelled; if its sender is declared down, the handoff stays kCancelling
// and its blocks are quarantined: a stopped sender that resumes completes the
// send into them. They are released when the receives complete, or when the
// sender's process is confirmed gone (check_deadlines' `gone`: same host, pid
// ended, or mpirun's table). A sender on another host that never resumes
// keeps them quarantined (LoadReport.quarantined_blocks).
//
// Tags: a handoff's tag is free again when every receive under it completed.
// One that ended early (cancelled, failed) with its sender up, on the mpi
// path, is reclaimed: the sender is asked to seal it (KvTagSeal: it ends the
// handoff if it still holds it, then posts an empty message under the tag
// after all it sent there), and this rank takes and drops what the sender
// posted under the tag up to that seal (Transport::post_reclaim), then gives
// the tag out again. That record lives in the tag pool, not the handoff, so
// either order works: the sender's abort first or this rank's cancel first.
// A tag whose sender is down, or whose handoff took a device path, is retired
// until the sender leaves.
//
// Threading: the worker's engine loop calls everything.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "config/cluster_config.h"
#include "decode_node/kv_tags.h"
#include "decode_node/seq_kv.h"
#include "kvtransfer/handoff_receiver.h"
#include "kvtransfer/kv_path.h"
#include "kvtransfer/transport.h"
#include "protocol/control_channel.h"
#include "protocol/peer_epochs.h"
#include "serving/engine.h"
#include "util/env.h"

namespace pd {

class HandoffIntake {
 public:
  using TimePoint = Env::Clock::time_point;
  // What the intake works with: the decode worker's own (they outlive it;
  // the pointed-to values may change: this rank's epoch on Rejoin, the clock
  // a test sets).
  struct Context {
    int self = -1;                              // this rank (log lines)
    int router = 0;                             // where failures are reported
    Engine* engine = nullptr;                   // blocks, cache, backend (checksums)
    Transport* transport = nullptr;
    ControlChannel* channel = nullptr;
    const PeerEpochs* peers = nullptr;          // which prefill ranks are down, their epochs
    const proto::KvWireHeader* header = nullptr;
    const proto::KvEndpoint* endpoint = nullptr;
    const proto::Epoch* epoch = nullptr;        // this rank's incarnation
    const std::shared_ptr<const Env>* env = nullptr;
    ClusterConfig::Timeouts timeouts;           // handoff_ms, transfer_ms, prefill_queue_ms
    int tag_span = proto::kKvTagSpan;           // tags per prefill rank (kv.tag_span)
  };
  // A handoff whose KV is here and verified: the worker's batcher takes it.
  struct Landed {
    proto::RequestId id = 0;
    int source = -1;                  // its prefill rank
    std::vector<int32_t> prompt;
    SamplingParams params;
    int32_t first_token = -1;         // sampled by the prefill rank
    uint64_t order = 0;               // arrival order (the worker's)
    TimePoint received;               // its KV complete
    SeqKv kv;                         // kWritten: its blocks, published
  };

  explicit HandoffIntake(Context ctx) : ctx_(std::move(ctx)) {}

  // A HandoffOffer from prefill rank `source`: rejected at once (cancelled
  // before it came, `known` id, incompatible, invalid, too long for this
  // pool), or queued for room. True when queued (it took `order`).
  bool on_offer(proto::HandoffOffer m, int source, bool known, uint64_t order);
  // Whether the router cancelled `id` before it arrived (the tombstone goes).
  bool was_cancelled(proto::RequestId id) { return cancelled_.erase(id) > 0; }
  // Ends handoff `id` (from_prefill: its sender aborted it; else the router
  // cancelled it). An id not here yet is remembered (router cancels only).
  void on_cancel(proto::RequestId id, bool from_prefill);
  // The prefill rank of handoff `id`, if this rank holds it.
  std::optional<int> source_of(proto::RequestId id) const;
  size_t size() const { return handoffs_.size(); }
  bool has_offers() const { return !offers_.empty(); }

  // Accepts the queued offers that fit, in order, beside `reserved` blocks
  // the worker keeps for its own sequences; true when it accepted or refused one.
  bool accept_offers(int64_t reserved);
  // Tests the receives and the tag reclaims; a handoff whose KV arrived and
  // verified is appended to `landed`. True when anything moved.
  bool progress(std::vector<Landed>& landed);
  // Asks each prefill rank to seal the tags of its handoffs that ended early,
  // posting the reclaim that sweeps them; true when it asked.
  bool seal_tags();
  // The senders, down, under whose ended handoffs receives are still posted
  // (the worker tells check_deadlines which of them are gone).
  std::set<int> down_senders() const;
  // Offers with no room within handoff_ms are rejected; receives that saw
  // nothing for prefill_queue_ms + transfer_ms fail; blocks quarantined under
  // a sender in `gone` are released; old tombstones are dropped.
  void check_deadlines(const std::set<int>& gone);

  // Prefill rank `rank` went down: its offered and receiving handoffs fail;
  // its tags being reclaimed are retired.
  void on_peer_down(int rank);
  // It left for good: its whole tag pool goes.
  void forget_peer(int rank);
  // This rank was declared down: everything ends (posted receives still end
  // through MPI as usual).
  void drop_all();
  // Shutdown: receives and reclaims are cancelled.
  void before_exit();
  // Offers waiting, tags retired and being reclaimed, blocks quarantined.
  void fill_load(proto::LoadReport& r) const;

 private:
  enum class State { kOffered, kReceiving, kCancelling };
  friend const char* state_name(State s);
  friend bool legal(State from, State to);
  struct Handoff {
    proto::RequestId id = 0;
    int source = -1;                   // prefill rank
    State state = State::kOffered;
    std::vector<int32_t> prompt;
    SamplingParams params;
    uint64_t order = 0;
    KvPathChoice path;                 // how its KV travels (from the offer's and this rank's endpoints)
    int tag = 0;                       // from tags_of(source) while it holds one
    HandoffReceiver receiver;          // its receives, trailer, and whether they all completed
    SeqKv kv;                          // its blocks
    TimePoint arrived, accepted;
  };

  Handoff* find(proto::RequestId id);
  void fail(Handoff& h, const std::string& reason, proto::FailureKind kind);
  // Ends a handoff whose receives are posted: cancels them (kCancelling) or,
  // with none left, erases it.
  void cancel_receives(Handoff& h);
  // Erases an ended handoff: its tag back to the pool (end_tag), blocks released.
  void erase(Handoff& h);
  // The handoff's tag as it ends: free (every receive completed), to reclaim
  // (ended early, the sender up, the mpi path), else retired.
  void end_tag(Handoff& h);
  // Every receive completed: checks the trailer and the checksums; lands it
  // (appended to `landed`), or erases it when it ended at its first token, or fails it.
  void finish_transfer(Handoff& h, std::vector<Landed>& landed);
  KvTagPool& tags_of(int source) {
    return tags_.try_emplace(source, proto::kTagKvFirst, ctx_.tag_span).first->second;
  }
  TimePoint now() const { return (*ctx_.env)->now(); }

  Context ctx_;
  std::unordered_map<proto::RequestId, Handoff> handoffs_;
  std::deque<proto::RequestId> offers_;                       // offered, waiting for room (FIFO)
  std::map<proto::RequestId, TimePoint> cancelled_;           // tombstones: cancel before offer
  std::unordered_map<int, KvTagPool> tags_;                   // by prefill rank (tags_of)
};

}  // namespace pd
