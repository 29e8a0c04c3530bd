#include "grammar/grammar.h"

namespace pd {

Status constrain(Sampler& s, GrammarCompiler* compiler, TokenId eos_id) {
  s.set_eos(eos_id);
  const SamplingParams& p = s.params();
  if (!p.grammar.active()) return Status::ok();
  if (compiler == nullptr) return Status::unsupported("structured output: no grammar compiler on this rank");
  std::vector<TokenId> stops = p.stop_token_ids;
  if (eos_id >= 0) stops.push_back(eos_id);
  PD_ASSIGN_OR_RETURN(std::unique_ptr<TokenConstraint> c, compiler->matcher(p.grammar, std::move(stops)));
  s.constrain(std::move(c));
  return Status::ok();
}

}  // namespace pd
