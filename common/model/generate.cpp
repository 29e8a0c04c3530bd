#include "model/generate.h"

#include <algorithm>

#include "serving/speculation.h"

#include <chrono>
#include <string>

namespace pd {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Refills `t` with the sequence's block ids (its capacity is reused: no
// allocation once it has grown to the sequence's size).
void fill_table(const KvBlockManager& blocks, SeqId seq, std::vector<int32_t>& t) {
  t.clear();
  for (BlockId b : blocks.block_table(seq)) t.push_back(b.value);
}

// Runs requests [first, last) together.
Status run_group(LlamaModel& model, KvCache& cache, KvBlockManager& blocks, std::span<const GenerateRequest> reqs,
                 size_t first, const GenerateOptions& opt, GenerateStats* stats,
                 std::vector<GenerateResult>& results) {
  const size_t n = reqs.size();
  const int vocab = model.config().vocab;
  std::vector<SeqId> seqs(n);
  std::vector<Sampler> samplers;
  samplers.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    seqs[i] = SeqId{static_cast<int64_t>(first + i)};
    samplers.emplace_back(reqs[i].sampling);
    if (Status st = constrain(samplers.back(), opt.grammars, opt.eos_id); !st.is_ok()) {
      return st.is_invalid_argument() ? Status::invalid_argument("request " + std::to_string(first + i) + ": " + st.message())
                                      : st;
    }
    samplers.back().resume(reqs[i].prompt);
  }
  // On success every sequence is freed (its full blocks stay in the prefix
  // cache); on any failure discarded, so KV that may never have been written is
  // not offered to later prompts.
  struct Release {
    KvBlockManager& blocks;
    std::vector<SeqId>& seqs;
    bool completed = false;
    ~Release() {
      for (SeqId s : seqs)
        if (blocks.has(s)) (void)(completed ? blocks.free(s) : blocks.discard(s));
    }
  } release{blocks, seqs};

  // ---- prefill: all prompts of the group in one pass
  auto t0 = Clock::now();
  std::vector<std::vector<int32_t>> tables(n);
  std::vector<SequenceBatch> batch(n);
  for (size_t i = 0; i < n; ++i) {
    const std::vector<TokenId>& p = reqs[i].prompt;
    if (p.empty()) return Status::invalid_argument("request " + std::to_string(first + i) + ": empty prompt");
    PD_ASSIGN_OR_RETURN(int64_t cached, blocks.allocate(seqs[i], p));
    // Room for the whole sequence, so decode steps never grow it.
    const int64_t max_len = static_cast<int64_t>(p.size()) + std::max(reqs[i].sampling.max_tokens, 0);
    tables[i].reserve(static_cast<size_t>(max_len / blocks.block_size() + 2));
    fill_table(blocks, seqs[i], tables[i]);
    batch[i].tokens = std::span<const TokenId>(p).subspan(static_cast<size_t>(cached));
    batch[i].start_pos = static_cast<int32_t>(cached);
    batch[i].block_table = tables[i];
    batch[i].want_logits = true;
    if (stats) {
      stats->prompt_tokens += static_cast<int64_t>(p.size());
      stats->prefill_tokens += static_cast<int64_t>(p.size()) - cached;
    }
  }
  std::vector<float> logits;
  PD_RETURN_IF_ERROR(model.prefill(batch, cache, &logits));
  if (stats) stats->prefill_seconds += seconds_since(t0);

  std::vector<size_t> active;
  std::vector<TokenId> last(n);
  auto emit = [&](size_t i, std::span<float> row) {
    Sampler& s = samplers[i];
    const TokenId t = s.sample(row);
    s.accept(t);
    GenerateResult& r = results[first + i];
    r.tokens.push_back(t);
    last[i] = t;
    if (opt.on_token) opt.on_token(first + i, t);
    r.stop = check_stop(s.params(), t, opt.eos_id, static_cast<int32_t>(r.tokens.size()));
    return r.stop == StopReason::kNone;
  };
  for (size_t i = 0; i < n; ++i) {
    if (emit(i, std::span<float>(logits).subspan(i * vocab, vocab))) active.push_back(i);
  }

  // ---- decode: one step for every active sequence per iteration. With
  // speculation a sequence's step is its last token and the tokens drafted
  // from its history (serving/speculation.h), verified in the same pass.
  const SpeculationConfig& spec = opt.speculation;
  std::vector<BlockCopy> copies;
  std::vector<std::vector<TokenId>> step_tokens(n);  // per sequence: its last token, then its draft
  std::vector<std::vector<TokenId>> history(n);      // speculation only: prompt + generated tokens
  std::vector<DraftPolicy> policy(n, DraftPolicy(spec.max_draft));
  StepCost step_cost;
  std::vector<int64_t> step_pos(n);  // the position of a sequence's step's first token
  if (spec.max_draft > 0) {
    for (size_t i = 0; i < n; ++i) {
      history[i] = reqs[i].prompt;
      history[i].insert(history[i].end(), results[first + i].tokens.begin(), results[first + i].tokens.end());
    }
  }
  std::vector<size_t> still;
  still.reserve(active.size());
  while (!active.empty()) {
    t0 = Clock::now();
    batch.clear();
    for (size_t i : active) {
      const int64_t pos = blocks.num_tokens(seqs[i]);
      step_pos[i] = pos;
      std::vector<TokenId>& st = step_tokens[i];
      st.assign(1, last[i]);
      if (spec.max_draft > 0 && reqs[i].sampling.speculate) {
        const int64_t left = reqs[i].sampling.max_tokens - static_cast<int64_t>(results[first + i].tokens.size());
        int64_t k = std::min<int64_t>({policy[i].next(step_cost.draft_costs(static_cast<int>(active.size()))),
                                       left - 1, model.config().context - pos - 1});
        if (k > 0 && blocks.blocks_needed_to_append(seqs[i], static_cast<int>(k + 1)) > blocks.num_free_blocks()) k = 0;
        if (k > 0) {
          const std::vector<TokenId> d = ngram_draft(history[i], static_cast<int>(k), spec.max_ngram, spec.min_ngram);
          st.insert(st.end(), d.begin(), d.end());
        } else if (policy[i].wants_shadow()) {
          policy[i].shadow(ngram_draft(history[i], spec.max_draft, spec.max_ngram, spec.min_ngram));
        }
      }
      if (pos + 1 > model.config().context)
        return Status::invalid_argument("request " + std::to_string(first + i) + " exceeds the context length");
      copies.clear();
      PD_RETURN_IF_ERROR(blocks.append(seqs[i], st, &copies));
      for (const BlockCopy& c : copies)
        PD_RETURN_IF_ERROR(model.backend().kv_copy_block(*cache.buffer, cache.layout, c.src.value, c.dst.value));
      fill_table(blocks, seqs[i], tables[i]);
      SequenceBatch sb;
      sb.tokens = st;
      sb.start_pos = static_cast<int32_t>(pos);
      sb.block_table = tables[i];
      sb.all_logits = st.size() > 1;
      batch.push_back(sb);
    }
    const auto t_forward = Clock::now();
    PD_RETURN_IF_ERROR(model.forward(batch, cache, &logits));
    if (spec.max_draft > 0) {
      int64_t rows = 0;
      for (const SequenceBatch& sb : batch) rows += static_cast<int64_t>(sb.tokens.size());
      step_cost.observe(static_cast<int>(rows), seconds_since(t_forward));
    }
    still.clear();
    size_t row = 0;
    int64_t emitted = 0;
    for (size_t i : active) {
      const std::vector<TokenId>& st = step_tokens[i];
      const size_t drafted = st.size() - 1;
      const size_t before = results[first + i].tokens.size();
      // Position j's row gives the token after st[j]: kept while it is the
      // draft's next token; the first that is not (or the last row) ends it.
      bool going = true;
      size_t accepted = 0;
      for (size_t j = 0; j <= drafted && going; ++j) {
        going = emit(i, std::span<float>(logits).subspan((row + j) * vocab, vocab));
        if (j < drafted && last[i] == st[j + 1]) {
          ++accepted;
        } else {
          break;
        }
      }
      row += drafted + 1;
      const std::vector<TokenId>& out = results[first + i].tokens;
      emitted += static_cast<int64_t>(out.size() - before);
      if (spec.max_draft > 0) {
        history[i].insert(history[i].end(), out.begin() + static_cast<std::ptrdiff_t>(before), out.end());
        if (drafted > 0) {
          policy[i].verified(static_cast<int>(drafted), static_cast<int>(accepted));
        } else {
          for (size_t j = before; j < out.size(); ++j) policy[i].emitted(out[j]);
        }
        if (stats) {
          stats->drafted_tokens += static_cast<int64_t>(drafted);
          stats->accepted_tokens += static_cast<int64_t>(accepted);
        }
        // Rejected draft tokens leave the cache (and the prefix cache: a
        // finished sequence's blocks stay there): it keeps the step's last
        // token and the accepted drafts; the token sampled after them is the
        // next step's input.
        if (accepted < drafted) {
          const size_t keep = static_cast<size_t>(step_pos[i]) + 1 + accepted;
          PD_RETURN_IF_ERROR(blocks.truncate(seqs[i], std::span<const TokenId>(history[i]).first(keep)));
        }
      }
      if (going) still.push_back(i);
    }
    if (stats) {
      stats->decode_seconds += seconds_since(t0);
      stats->decode_tokens += emitted;
      stats->decode_steps += 1;
    }
    active.swap(still);
  }
  release.completed = true;
  return Status::ok();
}

}  // namespace

Result<std::vector<GenerateResult>> generate(LlamaModel& model, KvCache& cache, KvBlockManager& blocks,
                                             std::span<const GenerateRequest> requests,
                                             const GenerateOptions& options, GenerateStats* stats) {
  for (size_t i = 0; i < requests.size(); ++i) {
    PD_RETURN_IF_ERROR(requests[i].sampling.validate());
    const int64_t need = static_cast<int64_t>(requests[i].prompt.size()) + requests[i].sampling.max_tokens;
    if (need > model.config().context)
      return Status::invalid_argument("request " + std::to_string(i) + ": prompt (" +
                                      std::to_string(requests[i].prompt.size()) + " tokens) + max_tokens (" +
                                      std::to_string(requests[i].sampling.max_tokens) + ") exceeds the context length " +
                                      std::to_string(model.config().context));
  }
  std::vector<GenerateResult> results(requests.size());
  if (options.one_at_a_time) {
    for (size_t i = 0; i < requests.size(); ++i)
      PD_RETURN_IF_ERROR(run_group(model, cache, blocks, requests.subspan(i, 1), i, options, stats, results));
  } else if (!requests.empty()) {
    PD_RETURN_IF_ERROR(run_group(model, cache, blocks, requests, 0, options, stats, results));
  }
  return results;
}

}  // namespace pd
