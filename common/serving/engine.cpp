#include "serving/engine.h"

#include <spdlog/spdlog.h>

#include <filesystem>

#include "tokenizer/tokenizer.h"

namespace pd {

Result<std::unique_ptr<Engine>> Engine::create(const EngineConfig& cfg) {
  if (!std::filesystem::exists(cfg.model_path))
    return Status::io_error("model file not found: '" + cfg.model_path + "' (config key 'model')");
  auto e = std::make_unique<Engine>();
  PD_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::open(cfg.model_path));
  e->gguf = std::shared_ptr<const GgufFile>(std::move(file));
  PD_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, Tokenizer::from_gguf(*e->gguf));
  e->eos_id = tok->eos_id();
  PD_ASSIGN_OR_RETURN(e->grammars, GrammarCompiler::create(*tok));
  BackendConfig bc;
  bc.kind = cfg.backend;
  bc.n_threads = cfg.threads;
  bc.device = cfg.device;
  bc.int8_activations = cfg.int8_activations;
  PD_ASSIGN_OR_RETURN(e->backend, create_backend(bc));
  PD_ASSIGN_OR_RETURN(e->model, LlamaModel::load(e->gguf, *e->backend));
  const LlamaConfig& mc = e->model->config();
  const KvGeometry g = mc.kv_geometry(cfg.kv_dtype);
  int64_t n_blocks = kv_blocks_for_budget(g, cfg.block_size, cfg.kv_budget_bytes);
  if (cfg.kv_fit_context && cfg.block_size > 0) {
    const int64_t context_blocks = (static_cast<int64_t>(mc.context) + cfg.block_size - 1) / cfg.block_size;
    if (n_blocks < context_blocks) {
      spdlog::info("KV budget of {} MiB holds {} tokens, less than the model's context of {}: pool raised to {} blocks",
                   cfg.kv_budget_bytes >> 20, n_blocks * cfg.block_size, mc.context, context_blocks);
      n_blocks = context_blocks;
    }
  }
  if (n_blocks < 1)
    return Status::resource_exhausted("KV budget of " + std::to_string(cfg.kv_budget_bytes) +
                                      " bytes holds no block of " + std::to_string(cfg.block_size) + " tokens");
  PD_ASSIGN_OR_RETURN(e->cache, KvCache::create(*e->backend, mc, cfg.block_size, n_blocks, cfg.kv_dtype));
  e->blocks = std::make_unique<KvBlockManager>(KvBlockManagerConfig{cfg.block_size, n_blocks, cfg.prefix_sharing});
  e->kv_checksum = cfg.kv_checksum;
  return e;
}

proto::KvWireHeader Engine::wire_header() const {
  const LlamaConfig& mc = model->config();
  proto::KvWireHeader h;
  h.block_size = cache.layout.block_size;
  h.dtype = kv_dtype_name(cache.layout.dtype);
  h.n_layers = mc.n_layers;
  h.n_kv_heads = mc.n_kv_heads;
  h.head_dim = mc.head_dim;
  h.n_embd = mc.hidden;
  h.vocab = mc.vocab;
  h.checksum = kv_checksum;
  return h;
}

}  // namespace pd
