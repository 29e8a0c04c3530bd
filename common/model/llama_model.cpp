#include "model/llama_model.h"

#include <cmath>
#include <cstring>
#include <string>

#include "gguf/gguf_reader.h"

namespace pd {

namespace {

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

Tensor view(const BackendBuffer& buf, size_t offset, int64_t ne0, int64_t ne1, int64_t ne2 = 1) {
  Tensor t;
  t.type = GgmlType::kF32;
  t.ne = {ne0, ne1, ne2, 1};
  t.data = static_cast<uint8_t*>(const_cast<BackendBuffer&>(buf).data()) + offset;
  return t;
}

// Same memory, reshaped (rows of ne0 elements).
Tensor reshape(const Tensor& t, int64_t ne0, int64_t ne1, int64_t ne2 = 1) {
  Tensor r = t;
  r.ne = {ne0, ne1, ne2, 1};
  return r;
}

}  // namespace

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(std::shared_ptr<const GgufFile> file, Backend& backend) {
  PD_ASSIGN_OR_RETURN(LlamaConfig cfg, LlamaConfig::from_gguf(*file));
  std::unique_ptr<LlamaModel> m(new LlamaModel(std::move(file), backend, std::move(cfg)));
  PD_RETURN_IF_ERROR(m->load_weights());
  return m;
}

LlamaModel::~LlamaModel() = default;

Result<Tensor> LlamaModel::weight(const std::string& name, std::vector<int64_t> expected_ne, bool f32_only) {
  const GgufTensorInfo* info = file_->find_tensor(name);
  if (!info) return Status::invalid_argument(file_->path() + ": missing tensor " + name);
  if (info->ne != expected_ne)
    return Status::invalid_argument(file_->path() + ": tensor " + name + " has shape " + shape_str(info->ne) +
                                    ", expected " + shape_str(expected_ne));
  if (f32_only && info->type != GgmlType::kF32)
    return Status::unsupported(file_->path() + ": tensor " + name + " must be F32, got " +
                               ggml_type_name(info->type));
  std::unique_ptr<BackendBuffer> storage;
  PD_ASSIGN_OR_RETURN(Tensor t, backend_.load_weight(*info, &storage));
  if (storage) weight_storage_.push_back(std::move(storage));
  weight_bytes_ += info->nbytes;
  tensors_used_.insert(name);
  return t;
}

Status LlamaModel::load_weights() {
  const int64_t d = cfg_.hidden, hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads;
  PD_ASSIGN_OR_RETURN(tok_embd_, weight("token_embd.weight", {d, cfg_.vocab}));
  PD_ASSIGN_OR_RETURN(output_norm_, weight("output_norm.weight", {d}, true));
  if (cfg_.tied_embeddings) {
    output_ = tok_embd_;
  } else {
    PD_ASSIGN_OR_RETURN(output_, weight("output.weight", {d, cfg_.vocab}));
  }
  if (cfg_.rope_freq_factors) {
    // Read on the host: rope() takes them with each call.
    const GgufTensorInfo* info = file_->find_tensor("rope_freqs.weight");
    if (info->ne != std::vector<int64_t>{hd / 2} || info->type != GgmlType::kF32)
      return Status::invalid_argument(file_->path() + ": tensor rope_freqs.weight has shape " + shape_str(info->ne) +
                                      " of " + ggml_type_name(info->type) + ", expected [" + std::to_string(hd / 2) +
                                      "] of F32");
    rope_factors_.resize(static_cast<size_t>(hd / 2));
    std::memcpy(rope_factors_.data(), info->data, rope_factors_.size() * sizeof(float));
    for (float f : rope_factors_) {
      if (!(f > 0.0f) || !std::isfinite(f))
        return Status::invalid_argument(file_->path() + ": tensor rope_freqs.weight holds a factor that is not positive");
    }
    weight_bytes_ += info->nbytes;
    tensors_used_.insert(info->name);
  }
  layers_.resize(cfg_.n_layers);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer& L = layers_[l];
    PD_ASSIGN_OR_RETURN(L.attn_norm, weight(p + "attn_norm.weight", {d}, true));
    PD_ASSIGN_OR_RETURN(L.wq, weight(p + "attn_q.weight", {d, nh * hd}));
    PD_ASSIGN_OR_RETURN(L.wk, weight(p + "attn_k.weight", {d, nkv * hd}));
    PD_ASSIGN_OR_RETURN(L.wv, weight(p + "attn_v.weight", {d, nkv * hd}));
    PD_ASSIGN_OR_RETURN(L.wo, weight(p + "attn_output.weight", {nh * hd, d}));
    PD_ASSIGN_OR_RETURN(L.ffn_norm, weight(p + "ffn_norm.weight", {d}, true));
    PD_ASSIGN_OR_RETURN(L.w_gate, weight(p + "ffn_gate.weight", {d, cfg_.ffn}));
    PD_ASSIGN_OR_RETURN(L.w_up, weight(p + "ffn_up.weight", {d, cfg_.ffn}));
    PD_ASSIGN_OR_RETURN(L.w_down, weight(p + "ffn_down.weight", {cfg_.ffn, d}));
    if (cfg_.qkv_bias) {
      PD_ASSIGN_OR_RETURN(L.bq, weight(p + "attn_q.bias", {nh * hd}, true));
      PD_ASSIGN_OR_RETURN(L.bk, weight(p + "attn_k.bias", {nkv * hd}, true));
      PD_ASSIGN_OR_RETURN(L.bv, weight(p + "attn_v.bias", {nkv * hd}, true));
    }
    if (cfg_.qk_norm) {
      PD_ASSIGN_OR_RETURN(L.q_norm, weight(p + "attn_q_norm.weight", {hd}, true));
      PD_ASSIGN_OR_RETURN(L.k_norm, weight(p + "attn_k_norm.weight", {hd}, true));
    }
    if (cfg_.post_norms) {
      PD_ASSIGN_OR_RETURN(L.post_attn_norm, weight(p + "post_attention_norm.weight", {d}, true));
      PD_ASSIGN_OR_RETURN(L.post_ffn_norm, weight(p + "post_ffw_norm.weight", {d}, true));
    }
  }
  // A tensor the forward pass would not use means a variant it does not
  // implement (an output bias, a different block layout): refuse it by name
  // rather than compute something else.
  for (const GgufTensorInfo& t : file_->tensors()) {
    if (!tensors_used_.count(t.name))
      return Status::unsupported(file_->path() + ": tensor " + t.name + " is not part of the " + cfg_.arch +
                                 " model this project runs");
  }
  tensors_used_.clear();
  return Status::ok();
}

Status LlamaModel::ensure_scratch(int64_t n_tokens, int64_t n_logits) {
  if (n_tokens <= scratch_tokens_ && n_logits <= scratch_logits_) return Status::ok();
  n_tokens = std::max(n_tokens, scratch_tokens_);
  n_logits = std::max(n_logits, scratch_logits_);
  const int64_t d = cfg_.hidden, qd = cfg_.n_heads * cfg_.head_dim, kvd = cfg_.n_kv_heads * cfg_.head_dim;
  // Floats per activation: x, h, q, k, v, attn, o, gate, up, then per-logit rows.
  const int64_t sizes[] = {d * n_tokens,   d * n_tokens,         qd * n_tokens,       kvd * n_tokens,
                           kvd * n_tokens, qd * n_tokens,        d * n_tokens,        cfg_.ffn * n_tokens,
                           cfg_.ffn * n_tokens, d * n_logits,    d * n_logits,        cfg_.vocab * n_logits};
  size_t offsets[12];
  size_t total = 0;
  for (int i = 0; i < 12; ++i) {
    offsets[i] = total;
    total += (static_cast<size_t>(sizes[i]) * sizeof(float) + 63) / 64 * 64;
  }
  scratch_.reset();
  PD_ASSIGN_OR_RETURN(scratch_, backend_.alloc(total));
  x_ = view(*scratch_, offsets[0], d, n_tokens);
  h_ = view(*scratch_, offsets[1], d, n_tokens);
  q_ = view(*scratch_, offsets[2], qd, n_tokens);
  k_ = view(*scratch_, offsets[3], kvd, n_tokens);
  v_ = view(*scratch_, offsets[4], kvd, n_tokens);
  attn_ = view(*scratch_, offsets[5], qd, n_tokens);
  o_ = view(*scratch_, offsets[6], d, n_tokens);
  gate_ = view(*scratch_, offsets[7], cfg_.ffn, n_tokens);
  up_ = view(*scratch_, offsets[8], cfg_.ffn, n_tokens);
  xsel_ = view(*scratch_, offsets[9], d, n_logits);
  hsel_ = view(*scratch_, offsets[10], d, n_logits);
  logits_ = view(*scratch_, offsets[11], cfg_.vocab, n_logits);
  scratch_tokens_ = n_tokens;
  scratch_logits_ = n_logits;
  return Status::ok();
}

Status LlamaModel::decode(std::span<const SequenceBatch> steps, KvCache& cache, std::vector<float>* logits) {
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].tokens.size() != 1)
      return Status::invalid_argument("decode: sequence " + std::to_string(i) + " has " +
                                      std::to_string(steps[i].tokens.size()) + " tokens, expected 1");
  }
  return forward(steps, cache, logits);
}

// Validates the batch and builds the index arrays (ids_, positions_, slots_,
// att_tokens_, tables_, logit_rows_); changes no other state.
Status LlamaModel::plan_batch(std::span<const SequenceBatch> batch, const KvCacheLayout& L) {
  ids_.clear();
  positions_.clear();
  slots_.clear();
  att_tokens_.clear();
  tables_.clear();
  logit_rows_.clear();
  for (size_t s = 0; s < batch.size(); ++s) {
    const SequenceBatch& sb = batch[s];
    const int64_t end = static_cast<int64_t>(sb.start_pos) + static_cast<int64_t>(sb.tokens.size());
    if (sb.tokens.empty()) return Status::invalid_argument("forward: sequence " + std::to_string(s) + " has no tokens");
    if (sb.start_pos < 0 || end > cfg_.context)
      return Status::invalid_argument("forward: sequence " + std::to_string(s) + " ends at position " +
                                      std::to_string(end) + ", past the context length " + std::to_string(cfg_.context));
    if (static_cast<int64_t>(sb.block_table.size()) * L.block_size < end)
      return Status::invalid_argument("forward: sequence " + std::to_string(s) + "'s block table covers " +
                                      std::to_string(sb.block_table.size() * L.block_size) + " tokens, needs " +
                                      std::to_string(end));
    for (int32_t b : sb.block_table) {
      if (b < 0 || b >= L.num_blocks)
        return Status::invalid_argument("forward: block id " + std::to_string(b) + " out of range");
    }
    tables_.push_back(sb.block_table);
    for (size_t i = 0; i < sb.tokens.size(); ++i) {
      const TokenId t = sb.tokens[i];
      if (t < 0 || t >= cfg_.vocab)
        return Status::invalid_argument("forward: token id " + std::to_string(t) + " out of range [0, " +
                                        std::to_string(cfg_.vocab) + ")");
      const int32_t pos = sb.start_pos + static_cast<int32_t>(i);
      ids_.push_back(t);
      positions_.push_back(pos);
      slots_.push_back(sb.block_table[pos / L.block_size] * L.block_size + pos % L.block_size);
      att_tokens_.push_back(AttentionToken{pos, static_cast<int32_t>(s)});
    }
    if (sb.all_logits) {
      for (size_t i = ids_.size() - sb.tokens.size(); i < ids_.size(); ++i) logit_rows_.push_back(static_cast<int32_t>(i));
    } else if (sb.want_logits) {
      logit_rows_.push_back(static_cast<int32_t>(ids_.size() - 1));
    }
  }
  return Status::ok();
}

// Layer l's attention sub-block over the n tokens in x_: norm, Q/K/V, RoPE,
// K/V into the cache (then kv_written_hook_), paged attention, output
// projection, residual add.
Status LlamaModel::attention_block(int l, int64_t n, KvCache& cache, RopeSpec& rope) {
  const KvCacheLayout& L = cache.layout;
  const int64_t d = cfg_.hidden, hd = cfg_.head_dim, nh = cfg_.n_heads, nkv = cfg_.n_kv_heads;
  const float scale = cfg_.attn_scale;
  Backend& be = backend_;
  Tensor x = reshape(x_, d, n), h = reshape(h_, d, n), o = reshape(o_, d, n);
  Tensor q = reshape(q_, hd, nh, n), k = reshape(k_, hd, nkv, n), v = reshape(v_, hd, nkv, n);
  Tensor q2 = reshape(q_, hd * nh, n), k2 = reshape(k_, hd * nkv, n), v2 = reshape(v_, hd * nkv, n);
  Tensor attn = reshape(attn_, hd, nh, n), attn2 = reshape(attn_, hd * nh, n);
  // Q/K as rows of one head, for the per-head norms.
  Tensor q_heads = reshape(q_, hd, nh * n), k_heads = reshape(k_, hd, nkv * n);

  const Layer& W = layers_[l];
  PD_RETURN_IF_ERROR(be.rms_norm(x, W.attn_norm, cfg_.rms_eps, h));
  {
    const Tensor* w[] = {&W.wq, &W.wk, &W.wv};
    Tensor* out[] = {&q2, &k2, &v2};
    PD_RETURN_IF_ERROR(be.matmul_multi(h, w, out));
  }
  if (cfg_.qkv_bias) {
    PD_RETURN_IF_ERROR(be.add(q2, W.bq, q2));
    PD_RETURN_IF_ERROR(be.add(k2, W.bk, k2));
    PD_RETURN_IF_ERROR(be.add(v2, W.bv, v2));
  }
  if (cfg_.qk_norm) {
    PD_RETURN_IF_ERROR(be.rms_norm(q_heads, W.q_norm, cfg_.rms_eps, q_heads));
    PD_RETURN_IF_ERROR(be.rms_norm(k_heads, W.k_norm, cfg_.rms_eps, k_heads));
  }
  rope.freq_base = cfg_.layer_rope_base(l);
  rope.freq_scale = cfg_.layer_rope_scale(l);
  PD_RETURN_IF_ERROR(be.rope(q, positions_, rope));
  PD_RETURN_IF_ERROR(be.rope(k, positions_, rope));
  PD_RETURN_IF_ERROR(be.kv_write(*cache.buffer, L, l, k, v, slots_));
  if (kv_written_hook_) {
    PD_RETURN_IF_ERROR(be.synchronize());
    kv_written_hook_(l);
  }
  PD_RETURN_IF_ERROR(be.paged_attention(q, *cache.buffer, L, l, att_tokens_, tables_, scale, cfg_.window(l), attn));
  PD_RETURN_IF_ERROR(be.matmul(attn2, W.wo, o));
  if (cfg_.post_norms) PD_RETURN_IF_ERROR(be.rms_norm(o, W.post_attn_norm, cfg_.rms_eps, o));
  return be.add(x, o, x);
}

// Layer l's FFN sub-block over the n tokens in x_: norm, gated MLP (GeGLU or
// SwiGLU), down projection, residual add.
Status LlamaModel::ffn_block(int l, int64_t n) {
  const int64_t d = cfg_.hidden;
  Backend& be = backend_;
  Tensor x = reshape(x_, d, n), h = reshape(h_, d, n), o = reshape(o_, d, n);
  Tensor gate = reshape(gate_, cfg_.ffn, n), up = reshape(up_, cfg_.ffn, n);

  const Layer& W = layers_[l];
  PD_RETURN_IF_ERROR(be.rms_norm(x, W.ffn_norm, cfg_.rms_eps, h));
  {
    const Tensor* w[] = {&W.w_gate, &W.w_up};
    Tensor* out[] = {&gate, &up};
    PD_RETURN_IF_ERROR(be.matmul_multi(h, w, out));
  }
  if (cfg_.gelu_ffn) {
    PD_RETURN_IF_ERROR(be.geglu(gate, up, gate));
  } else {
    PD_RETURN_IF_ERROR(be.swiglu(gate, up, gate));
  }
  PD_RETURN_IF_ERROR(be.matmul(gate, W.w_down, o));
  if (cfg_.post_norms) PD_RETURN_IF_ERROR(be.rms_norm(o, W.post_ffn_norm, cfg_.rms_eps, o));
  return be.add(x, o, x);
}

Status LlamaModel::forward(std::span<const SequenceBatch> batch, KvCache& cache, std::vector<float>* logits) {
  const KvCacheLayout& L = cache.layout;
  if (L.n_layers != cfg_.n_layers || L.n_kv_heads != cfg_.n_kv_heads || L.head_dim != cfg_.head_dim)
    return Status::invalid_argument("forward: KV cache layout does not match the model");

  // ---- plan: validate everything and build the index arrays; no state changes yet.
  PD_RETURN_IF_ERROR(plan_batch(batch, L));
  const int64_t n = static_cast<int64_t>(ids_.size());
  const int64_t n_logits = static_cast<int64_t>(logit_rows_.size());
  if (n == 0) {
    if (logits) logits->clear();
    return Status::ok();
  }
  PD_RETURN_IF_ERROR(ensure_scratch(n, std::max<int64_t>(n_logits, 1)));

  // ---- run
  const int64_t d = cfg_.hidden;
  Backend& be = backend_;
  Tensor x = reshape(x_, d, n);
  RopeSpec rope;
  rope.neox = cfg_.rope_neox;
  rope.freq_factors = rope_factors_;

  PD_RETURN_IF_ERROR(be.get_rows(tok_embd_, ids_, x));
  if (cfg_.embed_scale != 1.0f) PD_RETURN_IF_ERROR(be.scale(x, cfg_.embed_scale, x));
  for (int l = 0; l < cfg_.n_layers; ++l) {
    PD_RETURN_IF_ERROR(attention_block(l, n, cache, rope));
    PD_RETURN_IF_ERROR(ffn_block(l, n));
  }
  if (n_logits == 0) {
    if (logits) logits->clear();
    return be.synchronize();
  }
  // The LM head runs only on the rows whose logits are wanted.
  Tensor xsel = reshape(xsel_, d, n_logits), hsel = reshape(hsel_, d, n_logits);
  Tensor out = reshape(logits_, cfg_.vocab, n_logits);
  PD_RETURN_IF_ERROR(be.get_rows(x, logit_rows_, xsel));
  PD_RETURN_IF_ERROR(be.rms_norm(xsel, output_norm_, cfg_.rms_eps, hsel));
  PD_RETURN_IF_ERROR(be.matmul(hsel, output_, out));
  if (logits) {
    logits->resize(static_cast<size_t>(cfg_.vocab * n_logits));
    PD_RETURN_IF_ERROR(be.copy_to_host(out, logits->data(), logits->size() * sizeof(float)));
  }
  return be.synchronize();
}

}  // namespace pd
