// A build without the grammar engine (scripts/build_xgrammar.sh not run):
// every grammar is Unsupported, saying so.
#include "grammar/grammar.h"

namespace pd {
namespace {
Status absent() {
  return Status::unsupported(
      "structured output needs the grammar engine, and this build has none (run scripts/setup.sh, which builds "
      "xgrammar, then configure and build again)");
}
}  // namespace

bool grammar_engine_built() { return false; }

struct GrammarCompiler::Impl {};
GrammarCompiler::GrammarCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarCompiler::~GrammarCompiler() = default;

Result<std::unique_ptr<GrammarCompiler>> GrammarCompiler::create(const Tokenizer&, int64_t) {
  return std::unique_ptr<GrammarCompiler>(new GrammarCompiler(std::make_unique<Impl>()));
}
Status GrammarCompiler::check(const GrammarSpec& spec) { return spec.active() ? absent() : Status::ok(); }
Status GrammarCompiler::compile(const GrammarSpec& spec) { return check(spec); }
void GrammarCompiler::compile_in_background(const GrammarSpec&) {}
Result<std::unique_ptr<TokenConstraint>> GrammarCompiler::matcher(const GrammarSpec&, std::vector<TokenId>) {
  return absent();
}
GrammarCompiler::Stats GrammarCompiler::stats() const { return {}; }

}  // namespace pd
