// Control messages between the router and the workers, and between prefill and
// decode workers. Small typed structs, serialized with nlohmann/json's
// MessagePack; KV payloads never travel here (see kvtransfer/).
//
// Who sends what (R = router, P = prefill rank, D = decode rank):
//   R -> P   PrefillRequest   a prompt to prefill and hand to decode rank `decode_rank`
//   R -> D   PrefillRequest   colocated mode: the decode rank prefills it itself
//   R -> P,D Cancel           the client went away / a stop string matched
//   R -> all Shutdown         the router is stopping (or a drained rank may go); exit
//   R -> P,D PeerDown         a rank (one incarnation of it) was declared down: drop work shared with it
//   R -> P,D PeerUp           a rank that was down is back under a new epoch
//   R -> P,D PeerGone         a rank that is down has ended (its process is gone, on any host): nothing
//                             it began can complete any more (blocks under its transfers can be freed)
//   R -> X   Rejoin           to a rank the router had declared down: drop all request state, come
//                             back under `epoch` (fencing: nothing of the old incarnation is trusted)
//   P -> D   HandoffOffer     "I hold (or will hold) this request's KV": wire header + request
//   D -> P   HandoffAccept    blocks are reserved and receives posted under `tag`
//   D -> P   HandoffReject    refused (fingerprint mismatch, cancelled, no room in time)
//   P -> D   HandoffAbort     an offered/accepted handoff will not be sent
//   D -> P   KvTagSeal        the handoff under `tag` ended early here: send nothing more of it, then the
//                             tag's seal (an empty KV message under it; decode_node/kv_tags.h)
//   P,D -> R TokenEvents      generated tokens (and the finish reason) of some requests
//   P,D -> R RequestFailed    a request ended with an error on that rank
//   P,D -> R LoadReport       the rank's queue lengths and KV pool occupancy (also its heartbeat)
//   P,D -> R KvEvents         which prefix blocks (chained hashes) its cache stored and evicted: the
//                             router's prefix index (router/prefix_index.h); `reset` replaces the
//                             rank's whole entry (sent on start, after a Rejoin, and on overflow)
//
// Elastic pools (docs/CLUSTER.md, "Growing and shrinking pools"): ranks of a later mpirun join a
// running cluster through MPI ports, and any worker can be drained and removed.
//   P,D -> R Listening        the MPI port this worker accepts joining ranks on
//   J -> R   Join             first message of a joining rank J (on its new link to the router)
//   R -> J   JoinAccepted     J's rank id and epoch, and the workers it must link to (their ports)
//   R -> J   JoinRefused      J cannot serve in this cluster (the reason names what differs)
//   J -> P,D Hello            first message on J's new link to a worker: who J is
//   R,P,D -> J Challenge      the acceptor's first message on a link J opened: Join and Hello answer it
//                             with the cluster secret (protocol/link_auth.h), or the link is dropped
//   P,D -> R Leave            asks to be drained and removed (a joined rank got SIGTERM)
//   R -> P,D Drain            no new work will come: finish (or hand back) what you hold, then Drained
//   P,D -> R Drained          holds nothing any more; the router then sends Shutdown
//   R -> P,D PeerLeft         that rank left for good: forget it (its link is freed)
//
// Epochs: each worker rank runs under an epoch the router gives it (0 at
// start, a new one each time it is re-admitted after being declared down).
// Messages between workers carry the sender's epoch; a receiver drops one from
// an epoch it knows to be over, so a rank that was stopped, declared down and
// resumed cannot act on work that was given to someone else.
//   P -> R   TransferStats    a handoff's last byte left: its size and timings
//   P -> R   Warmed           a warm-up prompt (a PrefillRequest with decode_rank -1: computed into
//                             the prefix cache, handed to no one) is in the cache
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "sampling/sampler.h"
#include "util/status.h"

namespace pd::proto {

using RequestId = uint64_t;

// MPI tags. Control messages use kTagControl; each KV transfer uses one tag
// from [kTagKvFirst, kTagKvFirst + kKvTagSpan), chosen by the receiving rank.
inline constexpr int kTagControl = 1;
inline constexpr int kTagKvFirst = 1000;
inline constexpr int kKvTagSpan = 30000;  // MPI guarantees tags up to 32767
// Whether a tag a peer names (an accept's, a seal's) is one of the KV tags.
inline constexpr bool is_kv_tag(int tag) { return tag >= kTagKvFirst && tag < kTagKvFirst + kKvTagSpan; }

// Tags of the device KV paths' own small MPI messages, never probed by the
// control channel: CUDA IPC descriptors and acks; NCCL envelopes and
// communicator ids.
inline constexpr int kTagKvDevice = 2;
inline constexpr int kTagKvNccl = 3;

// Where one end of a KV handoff keeps its cache and which device paths it
// has; the handoff's offer carries the sender's, the accept the receiver's,
// and both ends pick the path from the pair (kvtransfer/kv_path.h).
struct KvEndpoint {
  std::string host;                // the process's host name
  std::string memory = "host";     // "host" or "cuda": where its KV cache lives
  std::string device;              // device identity ("GPU-<uuid>"), "" for host memory
  std::vector<std::string> paths;  // device paths it can use: "nccl", "cuda_ipc"
};

// The model and cache geometry a KV transfer must agree on (the "fingerprint").
struct KvWireHeader {
  static constexpr uint32_t kVersion = 1;
  uint32_t version = kVersion;
  RequestId request_id = 0;
  int32_t n_tokens = 0;     // tokens whose KV is sent (the prompt)
  int32_t block_size = 0;   // tokens per block
  std::string dtype = "f32";
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t n_embd = 0;
  int32_t vocab = 0;
  bool checksum = true;     // the trailer carries an XXH3-64 per layer
};

using Epoch = uint32_t;

struct PrefillRequest {
  RequestId id = 0;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int32_t decode_rank = -1;  // -1: a warm-up, computed into the prefill rank's cache only (Warmed)
};
struct Warmed {
  RequestId id = 0;
  int64_t computed = 0;  // prompt tokens it computed (the rest were in its cache)
};
struct Cancel { RequestId id = 0; };
struct Shutdown {};
struct HandoffOffer {
  KvWireHeader header;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  Epoch epoch = 0;  // the sender's
  KvEndpoint endpoint;  // the sender's
};
struct HandoffAccept {
  RequestId id = 0;
  int32_t tag = 0;
  Epoch epoch = 0;
  KvEndpoint endpoint;  // the receiver's
};
struct HandoffReject { RequestId id = 0; std::string reason; bool cancelled = false; Epoch epoch = 0; };
struct HandoffAbort { RequestId id = 0; std::string reason; Epoch epoch = 0; };
// The decode rank's handoff `id` under `tag` ended before every receive under
// the tag completed (cancelled, failed). The prefill rank ends that handoff if
// it still holds it, then posts the seal: an empty message under `tag`, after
// everything it sent under it. The decode rank takes and drops all of it up to
// the seal (Transport::post_reclaim), then gives the tag out again.
struct KvTagSeal { RequestId id = 0; int32_t tag = 0; Epoch epoch = 0; };
struct PeerDown { int32_t rank = -1; Epoch epoch = 0; };  // `epoch`: the incarnation that is over
struct PeerUp { int32_t rank = -1; Epoch epoch = 0; };    // `epoch`: the new incarnation
struct PeerGone { int32_t rank = -1; Epoch epoch = 0; };  // `epoch`: the incarnation that was down
struct Rejoin { Epoch epoch = 0; };
struct Listening { std::string port; };
struct Join {
  int32_t role = 0;  // Role (role_table.h): 1 prefill, 2 decode
  std::string host;
  int32_t pid = 0;
  int32_t block_size = 0;
  std::string port;  // where the joined rank accepts later joiners
  std::string pool;  // which pool (mpirun) it belongs to: its ranks reach each other
  std::string kv_dtype = "f16";  // its KV cache elements (kv.dtype): must be the cluster's
  std::string proof;  // link_auth.h: the cluster secret's answer to the router's Challenge on this link
  std::string model;  // gguf_fingerprint of its model file: must be the cluster's ("" = not said)
};
struct JoinPeer {
  int32_t rank = -1;
  int32_t role = 0;
  std::string port;
  Epoch epoch = 0;  // its current incarnation (a rank re-admitted after a fence is past 0)
};
struct JoinAccepted {
  int32_t rank = -1;       // the joined rank's id in the cluster (never reused)
  Epoch epoch = 0;
  bool colocated = false;
  std::vector<JoinPeer> peers;  // up workers of the other role: link to each (Hello)
};
struct JoinRefused { std::string reason; };
struct Hello {
  int32_t rank = -1;
  Epoch epoch = 0;
  std::string proof;  // link_auth.h: the cluster secret's answer to the worker's Challenge on this link
};
// The first message on a link a rank accepted (the router's or a worker's MPI
// port): the joiner's Join or Hello must answer it with the cluster secret
// (protocol/link_auth.h) before anything it says is acted on.
struct Challenge { std::string nonce; };  // hex
struct Leave {};
struct Drain {};
struct Drained {};
struct PeerLeft { int32_t rank = -1; };
// The router is alive: sent to every worker once a second. A worker that hears
// nothing from the router for timeouts.router_ms stops (the router is gone).
struct RouterBeat {};

enum class Finish : int32_t { kNone = 0, kStop = 1, kLength = 2 };
struct TokenEvent {
  RequestId id = 0;
  int32_t first_index = 0;        // index of tokens[0] among the request's generated tokens
  std::vector<int32_t> tokens;
  Finish finish = Finish::kNone;  // set on the request's last event
  // With SamplingParams::logprobs >= 0: one entry per token of `tokens`, else empty.
  std::vector<LogprobEntry> logprobs;
  // With SamplingParams::prompt_logprobs, on the event of token 0 (from the rank
  // that computed the prompt): prompt tokens 1..n-1, each given those before it.
  std::vector<LogprobEntry> prompt_logprobs;
  // Worker-side timings (seconds) for /metrics, on a rank's first event of the
  // request: prefill rank = its queue wait and the batch's compute time;
  // decode rank = the wait from "KV received" (or arrival, colocated) to its
  // first step. 0 = not measured here.
  double queue_s = 0, prefill_s = 0;
  // On the event of token 0: prompt tokens whose KV came from the computing
  // rank's prefix cache (the rest it computed).
  int32_t cached_tokens = 0;
};
struct TokenEvents { std::vector<TokenEvent> events; };
struct TransferStats {
  RequestId id = 0;
  int64_t bytes = 0;
  double exposed_s = 0;  // end of the prefill compute -> last byte sent (what the overlap did not hide)
  double wire_s = 0;     // first layer posted -> last byte sent
  // Of `bytes`, those whose send had completed when the prompt's last layer
  // was computed: moved behind compute (bytes - hidden_bytes were exposed).
  int64_t hidden_bytes = 0;
};
// Why a request failed on a worker. Workers say what happened; only the router
// decides what the client sees (HTTP status) and whether to re-run it.
enum class FailureKind : int32_t {
  kInvalid = 1,     // this request cannot be served here as asked (too long for the pool)
  kOverloaded = 2,  // no room or no turn within a deadline (queue bound, handoff not accepted)
  kTimeout = 3,     // work started and stopped making progress (a stalled transfer)
  kPeerDown = 4,    // the other rank of the request is down
  kTransfer = 5,    // the KV transfer failed or arrived corrupted
  kInternal = 6,    // a bug or a compute failure on the rank
  kLeaving = 7,     // handed back: the rank is being drained out of the cluster and had not started it
};
inline constexpr int32_t kFailureKindMax = 7;
const char* failure_kind_name(FailureKind k);
struct RequestFailed { RequestId id = 0; std::string reason; FailureKind kind = FailureKind::kInternal; };
struct LoadReport {
  int32_t waiting = 0;        // queued requests not yet running
  int32_t running = 0;        // sequences in the decode batch / being prefilled or transferred
  int64_t free_blocks = 0;
  int64_t total_blocks = 0;
  int64_t preemptions = 0;    // since start
  bool ready = false;         // model loaded, serving
  Epoch epoch = 0;            // the rank's incarnation (see Rejoin)
  int64_t quarantined_blocks = 0;  // KV blocks held back until MPI can no longer write into them
  // Prompt tokens of the prompts this rank computed, since it started: their KV
  // found in its prefix cache, or computed.
  int64_t prompt_tokens_cached = 0;
  int64_t prompt_tokens_computed = 0;
  // Control messages this rank ignored since it started because their sender
  // may not send them (a router's message from a worker, ...) or a number in
  // them is out of range (an accept's tag that is not a KV tag).
  int64_t refused_messages = 0;
  // Decode ranks, over their prefill peers: KV transfer tags retired for good
  // (their handoff ended early while the sender was down, or on a device
  // path) and being reclaimed (ended early: swept up to the sender's seal,
  // then given out again). decode_node/kv_tags.h.
  int64_t kv_tags_retired = 0;
  int64_t kv_tags_reclaiming = 0;
  // Decode ranks, since start: speculative decoding's drafted tokens, of
  // those the accepted ones, and the steps that drafted.
  int64_t spec_drafted = 0;
  int64_t spec_accepted = 0;
  int64_t spec_steps = 0;
};

// At most this many hashes travel in one KvEvents message (a larger change is
// sent as several, in order).
inline constexpr size_t kKvEventsMaxHashes = 4096;
struct KvEvents {
  Epoch epoch = 0;  // the sender's
  bool reset = false;
  std::vector<uint64_t> stored, removed;  // apply `removed`, then `stored`
};
// One change of a rank's prefix cache as messages of at most `max_hashes`
// hashes each, to apply in order: every removal before any storing, `reset`
// on the first only. A reset with nothing stored is one empty message; no
// change at all, none.
std::vector<KvEvents> kv_events_messages(Epoch epoch, bool reset, const std::vector<uint64_t>& stored,
                                         const std::vector<uint64_t>& removed,
                                         size_t max_hashes = kKvEventsMaxHashes);

using Message = std::variant<PrefillRequest, Cancel, Shutdown, HandoffOffer, HandoffAccept, HandoffReject, HandoffAbort,
                             TokenEvents, TransferStats, RequestFailed, LoadReport, PeerDown, PeerUp, Rejoin,
                             Listening, Join, JoinAccepted, JoinRefused, Hello, Leave, Drain, Drained, PeerLeft,
                             RouterBeat, PeerGone, KvEvents, Warmed, Challenge, KvTagSeal>;

// Who may send a message of a type (the table at the top of this file): the
// router (R ->), a worker (P,D ->, J ->), or either (Challenge: whoever
// accepted the link). A receiver acts on a message only from its class of sender.
enum class Sender { kRouter, kWorker, kAny };
Sender sender_of(const Message& m);

// The deepest nesting of arrays and maps a control message may have (the
// deepest real one, TokenEvents with logprobs, has 5): deeper bytes are
// refused before they are parsed further, so a peer cannot exhaust the stack.
inline constexpr int kMaxMessageDepth = 16;

// MessagePack bytes of a message, and back. Corruption naming the problem for
// bytes that are not a well-formed message of a known type (or nested deeper
// than kMaxMessageDepth).
std::vector<uint8_t> serialize(const Message& m);
Result<Message> deserialize(const uint8_t* data, size_t size);

// A short name of the message's type, for logs ("PrefillRequest").
const char* message_name(const Message& m);

// Checks a received header against the local one: InvalidArgument naming each
// differing field ("block_size 16 != 32"), Unsupported for another version.
Status check_compatible(const KvWireHeader& local, const KvWireHeader& remote);

}  // namespace pd::proto
