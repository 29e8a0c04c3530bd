#include "serving/token_events.h"

namespace pd {

proto::Finish finish_of(StopReason r) {
  switch (r) {
    case StopReason::kNone: return proto::Finish::kNone;
    case StopReason::kLength: return proto::Finish::kLength;
    case StopReason::kEos:
    case StopReason::kStopToken: return proto::Finish::kStop;
  }
  return proto::Finish::kStop;
}

proto::TokenEvent sample_token_event(Sampler& sampler, proto::RequestId id, int32_t n_generated,
                                     std::span<float> row, TokenId eos_id, std::vector<float>& scratch) {
  const SamplingParams& sp = sampler.params();
  if (sp.logprobs >= 0) scratch.assign(row.begin(), row.end());
  const TokenId t = sampler.sample(row);
  sampler.accept(t);
  proto::TokenEvent ev;
  ev.id = id;
  ev.first_index = n_generated - 1;
  ev.tokens = {t};
  if (sp.logprobs >= 0) ev.logprobs.push_back(token_logprob(scratch, t, sp.logprobs));
  ev.finish = finish_of(check_stop(sp, t, eos_id, n_generated));
  return ev;
}

void append_prompt_logprobs(std::span<const int32_t> prompt, int64_t start, int64_t end,
                            std::span<const float> rows, int64_t vocab, int32_t top_n,
                            std::vector<LogprobEntry>& out) {
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  for (int64_t p = start + 1; p <= end && p < n_prompt; ++p)
    out.push_back(token_logprob(rows.subspan(static_cast<size_t>((p - 1 - start) * vocab), static_cast<size_t>(vocab)),
                                prompt[static_cast<size_t>(p)], top_n));
}

}  // namespace pd
