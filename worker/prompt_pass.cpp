#include "worker/prompt_pass.h"

#include "serving/token_events.h"
#include "util/env.h"

namespace pd {
namespace {

// Places `prompt` in fresh blocks, reusing no cached prefix, so that every
// position is computed (prompt logprobs need each one's logits); the appends
// register the blocks as placed. Returns 0 cached tokens; on failure nothing changed.
Result<int64_t> allocate_uncached(KvBlockManager& blocks, SeqId seq, std::span<const int32_t> prompt) {
  PD_RETURN_IF_ERROR(blocks.allocate(seq, {}).status());
  if (Status st = blocks.append(seq, prompt, nullptr); !st.is_ok()) {
    (void)blocks.free(seq);
    return st;
  }
  return int64_t{0};
}

}  // namespace

Status PromptPass::place(KvBlockManager& blocks, std::span<const int32_t> tokens, int64_t end) {
  const SeqId seq{static_cast<int64_t>(id_)};
  if (!placed_) {
    const std::span<const int32_t> toks = tokens.first(static_cast<size_t>(end));
    Result<int64_t> cached = opts_.prompt_logprobs && opts_.publish
                                 ? allocate_uncached(blocks, seq, toks)
                                 : blocks.allocate(seq, toks, {.reuse = !opts_.prompt_logprobs, .publish = opts_.publish});
    PD_RETURN_IF_ERROR(cached.status());
    placed_ = true;
    computed_ = cached_ = *cached;
  } else {
    std::vector<BlockCopy> copies;  // a prompt's last block is its own: nothing to copy
    PD_RETURN_IF_ERROR(blocks.append(seq, tokens.subspan(static_cast<size_t>(placed_end_),
                                                         static_cast<size_t>(end - placed_end_)), &copies));
    if (!copies.empty()) return Status::internal("prefill: a prompt's block was shared while it was computed");
  }
  placed_end_ = end;
  return Status::ok();
}

SequenceBatch PromptPass::chunk(std::span<const int32_t> tokens, int64_t end, std::span<const int32_t> table) const {
  SequenceBatch sb;
  sb.tokens = tokens.subspan(static_cast<size_t>(computed_), static_cast<size_t>(end - computed_));
  sb.start_pos = static_cast<int32_t>(computed_);
  sb.block_table = table;
  sb.want_logits = opts_.first_token && end == opts_.target;
  sb.all_logits = opts_.first_token && opts_.prompt_logprobs;
  return sb;
}

size_t PromptPass::rows(int64_t end) const {
  if (opts_.first_token && opts_.prompt_logprobs) return static_cast<size_t>(end - computed_);
  return opts_.first_token && end == opts_.target ? 1 : 0;
}

void PromptPass::chunk_done(std::span<const int32_t> tokens, int64_t end, std::span<const float> rows, int64_t vocab) {
  if (opts_.first_token && opts_.prompt_logprobs)
    append_prompt_logprobs(tokens, computed_, end, rows, vocab, opts_.top_logprobs, prompt_logprobs_);
  computed_ = end;
}

proto::TokenEvent PromptPass::first_token(Sampler& sampler, std::span<const int32_t> prompt, std::span<float> last_row,
                                          int32_t eos_id, std::vector<float>& scratch) {
  sampler.resume(prompt);
  proto::TokenEvent ev = sample_token_event(sampler, id_, 1, last_row, eos_id, scratch);
  ev.prompt_logprobs = std::move(prompt_logprobs_);
  ev.cached_tokens = static_cast<int32_t>(cached_);
  return ev;
}

void PromptPass::stamp(proto::TokenEvent& ev, TimePoint arrived, TimePoint now) const {
  ev.queue_s = seconds(started_ - arrived);
  // From its first chunk's pass to its last (a chunked prompt's time includes
  // the other prompts' chunks computed beside it: what chunking costs it).
  ev.prefill_s = seconds(now - started_);
}

}  // namespace pd
