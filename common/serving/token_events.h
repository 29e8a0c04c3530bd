// From logits rows to what the router is told: the one way every worker
// samples a request's next token and reports it (sample -> logprobs -> stop
// check -> TokenEvent), and the one way prompt logprobs are gathered from the
// rows of a prompt's chunk.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "protocol/messages.h"
#include "sampling/logprobs.h"
#include "sampling/sampler.h"

namespace pd {

proto::Finish finish_of(StopReason r);

// Samples the next token of request `id` from `row` (sample() may change the
// row: its logprobs, when asked for, are of the row as it came, kept in
// `scratch`) and records it in `sampler`. `n_generated`: the request's
// generated tokens counting this one. The event carries no timings.
proto::TokenEvent sample_token_event(Sampler& sampler, proto::RequestId id, int32_t n_generated,
                                     std::span<float> row, TokenId eos_id, std::vector<float>& scratch);

// Prompt logprobs of a chunk: `rows` (row r computed at prompt position
// start + r) predict prompt tokens start + 1 .. end; appended to `out` for
// those that are prompt tokens (the last position predicts the first
// generated token, which is sampled instead).
void append_prompt_logprobs(std::span<const int32_t> prompt, int64_t start, int64_t end,
                            std::span<const float> rows, int64_t vocab, int32_t top_n,
                            std::vector<LogprobEntry>& out);

}  // namespace pd
