// A worker's engine: the model on a backend, its tokenizer facts, and a paged
// KV pool (cache bytes + block manager) sized from a byte budget. What both
// worker kinds (prefill, decode) build at start-up from the cluster config.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "grammar/grammar.h"
#include "kv/kv_block_manager.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"
#include "protocol/messages.h"

namespace pd {

struct EngineConfig {
  std::string model_path;
  std::string backend = "cpu";
  int device = 0;                  // CUDA device ordinal
  int threads = 0;                 // 0 = all cores
  bool int8_activations = true;    // CPU matmul path (BackendConfig::int8_activations)
  int block_size = 16;
  GgmlType kv_dtype = kDefaultKvDtype;  // KV cache elements (f16, q8_0, f32)
  int64_t kv_budget_bytes = 0;     // KV pool size
  // true: the pool is raised, when the budget is smaller, to hold one sequence
  // of the model's whole context, so any prompt the router admits fits.
  bool kv_fit_context = false;
  bool prefix_sharing = true;
  bool kv_checksum = true;
};

struct Engine {
  std::shared_ptr<const GgufFile> gguf;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<LlamaModel> model;
  KvCache cache;
  std::unique_ptr<KvBlockManager> blocks;
  TokenId eos_id = -1;
  bool kv_checksum = true;
  // Structured output: this rank's grammars, compiled once each and cached.
  std::unique_ptr<GrammarCompiler> grammars;

  // Loads the model and allocates the pool. IoError/Unsupported naming the
  // model file; ResourceExhausted if the budget holds no block.
  static Result<std::unique_ptr<Engine>> create(const EngineConfig& cfg);
  // This engine's side of the KV wire header (request_id and n_tokens unset).
  proto::KvWireHeader wire_header() const;
  const LlamaConfig& config() const { return model->config(); }
};

}  // namespace pd
