// Structured output: compiling a GrammarSpec against the model's vocabulary
// and following one sequence's tokens through it. The grammar engine is
// xgrammar's C++ core (scripts/build_xgrammar.sh builds it; a build without it
// answers every grammar with Unsupported).
//
// Where a grammar is compiled: each rank that samples a constrained request's
// tokens (the prefill rank for token 1, the decode rank for the rest, a
// colocated rank for both; pd-generate) compiles it with its own
// GrammarCompiler, once: compiled grammars stay in the compiler's cache, keyed
// by the spec, up to a byte bound (least recently used first out). The router
// only checks a spec (GrammarCompiler::check), without the vocabulary.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sampling/grammar_spec.h"
#include "sampling/sampler.h"
#include "util/status.h"

namespace pd {

class Tokenizer;

// Whether this build has the grammar engine.
bool grammar_engine_built();

// Compiles specs for one vocabulary. Thread-safe.
class GrammarCompiler {
 public:
  // The vocabulary's tokens as bytes; control tokens never match grammar text
  // (only the stop tokens a matcher is given end it). `cache_bytes`: the bound
  // on the compiled grammars kept.
  static Result<std::unique_ptr<GrammarCompiler>> create(const Tokenizer& tok, int64_t cache_bytes = 256 << 20);
  ~GrammarCompiler();

  // Parses and checks a spec without compiling it against a vocabulary:
  // InvalidArgument with the engine's message for an invalid schema, regex or
  // grammar, or a JSON-schema feature the engine does not support, and for
  // one that admits no output at all (no text can start it and it cannot be
  // empty: checked over a vocabulary of single bytes); Unsupported when the
  // build has no grammar engine.
  static Status check(const GrammarSpec& spec);

  // Compiles `spec` into the cache (a no-op when it is there, or without a
  // grammar). Errors as matcher()'s.
  Status compile(const GrammarSpec& spec);
  // Starts compiling `spec` on this compiler's own thread unless it is cached
  // or already on its way, and returns at once: a rank calls it as a
  // constrained request (or handoff offer) arrives, so its loop does not stop
  // for the compile, and matcher() later takes the result (waiting for it if
  // the compile has not finished; an error shows there).
  void compile_in_background(const GrammarSpec& spec);

  // A matcher at the start of `spec`'s output (compiled, or taken from the
  // cache). `stop_ids`: the tokens that may end the output once the grammar is
  // complete (EOS and the request's stop tokens).
  Result<std::unique_ptr<TokenConstraint>> matcher(const GrammarSpec& spec, std::vector<TokenId> stop_ids);

  struct Stats {
    int64_t compiled = 0;     // specs compiled
    int64_t cache_hits = 0;   // matchers made from the cache
    int64_t cache_bytes = 0;  // bytes of the compiled grammars kept
  };
  Stats stats() const;

 private:
  struct Impl;
  explicit GrammarCompiler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pd

namespace pd {

// Tells `s` the model's EOS (Sampler::set_eos, for min_tokens) and makes it
// follow its parameters' grammar (nothing to do without one): a matcher from
// `compiler` whose stop tokens are `eos_id` and the request's stop tokens.
// InvalidArgument naming the grammar when it does not compile; Unsupported
// when there is no compiler (nullptr) or no grammar engine.
Status constrain(Sampler& s, GrammarCompiler* compiler, TokenId eos_id);

}  // namespace pd
