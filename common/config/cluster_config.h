// The cluster's configuration: one JSON file every rank reads (deploy/cluster.json
// documents each key). Unknown keys and out-of-range values are errors naming
// the key, so a typo never silently falls back to a default.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "util/status.h"

namespace pd {

struct ClusterConfig {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string served_model_name;  // "" = the model file's name without .gguf
  // Chat template the router renders chats with: "" = the model file's own
  // (tokenizer.chat_template); "chatml", "gemma", "llama3", "llama3.1", "hermes" or "qwen2.5" = that format,
  // for a file with none (or one not recognized), in place of the file's.
  std::string chat_template;

  struct Http {
    std::string host = "127.0.0.1";
    int port = 8000;
    int threads = 2;
    int64_t max_body_bytes = 1 << 20;
    std::string api_key;            // "" = no authentication
    // The key of the admin endpoints (/admin/*), apart from api_key: "" = the
    // admin endpoints are closed (403); the API key never opens them.
    std::string admin_key;
    int read_timeout_ms = 30000;
    int max_connections = 1024;     // open client connections; beyond: /health only, else 503
    int max_header_bytes = 16384;   // request line + header fields (431 beyond)
    bool metrics_require_key = false;  // true: GET /metrics needs the API key too
    std::string port_file;          // "" = none; else the bound port is written there (use with port 0)
    // A streamed answer's bytes the router holds for a client that reads
    // slower than they come; beyond: the connection is closed and the request
    // cancelled.
    int64_t max_write_buffer_bytes = int64_t{4} << 20;
    // Origins whose web pages may call the API from a browser (CORS), each as
    // the browser sends it ("https://chat.example.com"), or "*" for any; empty
    // (the default): none — preflights are refused (403) and answers carry no
    // Access-Control-Allow-Origin.
    std::vector<std::string> allowed_origins;
  } http;

  struct EngineSection {
    // CPU: 8-bit activations with integer dot products (fast, the default) or
    // fp32 activations against the weights as stored (the reference path).
    bool int8_activations = true;
    // Where the model and the KV cache live: "cpu" or "cuda" (a binary built
    // with the CUDA toolkit; refused at start-up elsewhere).
    std::string backend = "cpu";
    // CUDA: the device of each rank on a host, by its node-local rank (entry
    // i for local rank i, cycling); empty = local rank modulo the device count.
    std::vector<int> devices;
    // The device of node-local rank `local_rank` on a host with `device_count`
    // devices: devices[local_rank % size] when listed, else local_rank modulo
    // the count (0 when there is none: creating the backend then says why).
    int device_of(int local_rank, int device_count) const;
  } engine;

  struct Kv {
    int block_size = 16;                 // tokens per KV block (prefill and decode must agree)
    int64_t decode_budget_mb = 512;      // KV pool per decode rank
    int64_t prefill_budget_mb = 256;     // KV pool per prefill rank (holds KV until handed off)
    bool checksum = true;                // XXH3-64 per layer on every transfer
    std::string dtype = "f16";           // KV cache elements: f16, q8_0 or f32 (prefill and decode must agree)
    // Prefix caching on every rank: KV of finished prompts (and, on decode
    // ranks, of finished sequences) stays resident, evictable, for later
    // prompts that start the same way; the router routes by it.
    bool prefix_cache = true;
    // MPI tags a decode rank receives KV under, per prefill rank (tests make it
    // small; above 30000 the tags pass MPI's guaranteed 32767).
    int tag_span = 30000;
  } kv;

  struct Prefill {
    int token_budget = 2048;   // prompt tokens (cost, when chunked) per prefill batch (one prompt may exceed it alone)
    int max_batch = 16;        // prompts per batch
    // Chunked prefill: the most of one prompt computed in one pass, on prefill
    // ranks and colocated ranks (0 = whole prompts). Measured in cost: a token
    // at context position p counts 1 + p / context_cost_tokens, as do
    // token_budget and decode.step_tokens. The policy: serving/prefill_chunks.h.
    int chunk_tokens = 256;
    // The context length at which a token's attention costs as much as the
    // rest of its compute on this engine (measured: docs/BENCHMARKS.md); 0 =
    // every token counts 1, wherever it sits.
    int context_cost_tokens = 512;
    int threads = 0;           // compute threads per prefill rank (0 = all cores)
  } prefill;

  struct Decode {
    int max_running = 64;      // sequences in the continuous batch
    // Colocated ranks (chunk_tokens > 0): tokens per step, one for each running
    // decode and the rest (at least a quarter) for prompt chunks, so a long
    // prompt slows the running decodes by about this many tokens' compute per
    // step instead of stalling them for the whole prompt.
    int step_tokens = 256;
    int threads = 0;           // compute threads per decode rank (0 = all cores)
    // Speculative decoding (serving/speculation.h): tokens drafted per
    // sequence and step from its own text (prompt lookup), at most; 0 = off.
    int speculate = 0;
    // Only while at most this many sequences run: a fuller batch is
    // compute-bound, where a verified draft costs about what it saves.
    int speculate_max_batch = 4;
  } decode;

  struct Router {
    int max_queued = 256;          // requests waiting in the router before 503
    int max_inflight_per_worker = 64;  // requests a worker may hold before the router queues
    int retry_after_s = 1;
    // Attempts per request when ranks fail under it: a re-run before any token
    // reached the client, a migration after (1 = neither).
    int max_attempts = 3;
    // A stream whose rank was lost after tokens went out continues on another
    // pair from the next token (false: it ends with an error event).
    bool migrate = true;
    // Dispatch (docs/ROUTING.md). "cache_aware": the prefill rank with the
    // least expected cost, (prompt tokens not in its prefix cache) +
    // queue_weight x (prompt tokens it has outstanding), among ranks within the
    // imbalance bound; and a follow-up whose KV a decode rank still holds goes
    // back to it (decode_reuse_tokens). "least_work": fewest outstanding prompt
    // tokens, the caches not consulted.
    std::string policy = "cache_aware";
    double queue_weight = 1.0;
    // Imbalance bound: a rank whose outstanding prompt tokens exceed
    // balance_ratio x the least loaded rank's + balance_tokens is not chosen
    // for its cache (only for being least loaded).
    double balance_ratio = 1.5;
    int64_t balance_tokens = 1024;
    // A prompt a decode rank holds all but at most this many tokens of goes
    // to that decode rank, which computes the rest itself (0 = never).
    int decode_reuse_tokens = 256;
    // The cost of a prompt token a decode rank computes, in prefill-rank tokens:
    // a decode rank with follow-ups of its own still to compute leaves a new one
    // to a prefill rank whose expected cost is lower than this x (the new
    // suffix + those tokens).
    double decode_reuse_weight = 1.0;
    // cache_aware, disaggregated: when a request finishes, an idle prefill rank
    // that holds most of its prompt computes the answer's tokens into its cache
    // (a warm-up), so the conversation's next turn finds its whole history on a
    // prefill rank, not only on the decode rank that generated the answer.
    // Off by default: it measured no gain on the multi-turn chat benchmark
    // (docs/BENCHMARKS.md).
    bool warm_prefill = false;
    // A rank's cache draws a prompt only when it holds at least this fraction
    // of it (a short common head, e.g. a template's default system prompt, must
    // not pile prompts onto the first rank that computed it).
    double min_cached_fraction = 0.3;
    // What a non-streamed answer may hold until it is sent, in token entries:
    // summed over its choices, (max_tokens, plus the prompt's tokens with echo)
    // x (1 + the logprobs alternatives asked for). A request over it is a 400
    // (streamed answers hold nothing: http.max_write_buffer_bytes bounds them).
    int64_t max_answer_entries = int64_t{1} << 22;
  } router;

  // Sampling for requests that omit a parameter. Without this section: OpenAI's
  // defaults (temperature 1, top_p 1, no top-k, no min-p). deploy/cluster.json sets
  // the default model's recommendation.
  struct Sampling {
    double temperature = 1.0;
    double top_p = 1.0;
    int top_k = 0;               // 0 or -1 = disabled
    double min_p = 0.0;
  } sampling;

  struct Timeouts {
    int handoff_ms = 120000;   // offer -> accept (the decode rank has no KV room yet)
    int transfer_ms = 30000;   // a KV transfer making no progress (no layer landed) this long fails
    int prefill_queue_ms = 300000;  // waiting in a prefill rank's queue for a batch to start
    int request_ms = 600000;   // whole request, router side
    int queue_ms = 60000;      // waiting in the router's queue
    // SIGTERM to the router: its in-flight requests get this long to finish.
    int stop_grace_ms = 30000;
    // A rank draining out of the cluster (POST /admin/drain, or its Leave) that
    // has not finished within this long is ended as down, then removed.
    int rank_drain_ms = 30000;
    int startup_ms = 120000;   // workers to report ready
    int heartbeat_ms = 5000;   // a rank silent this long is declared down (its requests re-run or fail)
    int router_ms = 15000;     // a worker that hears nothing from the router this long stops (it is gone)
    int rejoin_ms = 60000;     // then waits this long for a new router to take it back (join file); 0 = exits
  } timeouts;

  // What parse() accepted but the operator should change (a deprecated key,
  // with the keys that replace it). The caller logs them; they never fail the load.
  std::vector<std::string> warnings;

  // Reads a JSON file. IoError naming the path; InvalidArgument naming the key.
  static Result<ClusterConfig> load(const std::string& path);
  static Result<ClusterConfig> parse(const std::string& json_text);
  // Range checks (also run by load/parse); InvalidArgument naming the key.
  Status validate() const;
  std::string model_name() const;
};

}  // namespace pd
