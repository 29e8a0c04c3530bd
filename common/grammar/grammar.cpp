// The grammar engine on xgrammar's C++ core: see grammar.h.
#include "grammar/grammar.h"

#include <dlpack/dlpack.h>
#include <xgrammar/xgrammar.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <future>
#include <limits>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "tokenizer/tokenizer.h"

namespace pd {
namespace {

// What the engine says went wrong, as one line (its messages can span several).
std::string engine_message(const std::exception& e) {
  std::string m = e.what();
  // Its log prefix, "[hh:mm:ss] /path/file.cc:123: ", says nothing to a client.
  if (!m.empty() && m[0] == '[') {
    const size_t close = m.find("] ");
    const size_t colon = close == std::string::npos ? std::string::npos : m.find(": ", close);
    if (colon != std::string::npos && m.find(".cc:", close) < colon) m.erase(0, colon + 2);
  }
  for (char& c : m)
    if (c == '\n' || c == '\r') c = ' ';
  while (!m.empty() && m.back() == ' ') m.pop_back();
  return m;
}

// The spec as one grammar: prefix, then what `kind` matches, then suffix.
// Throws the engine's exceptions on a bad spec.
xgrammar::Grammar build_grammar(const GrammarSpec& spec) {
  xgrammar::Grammar body = [&] {
    switch (spec.kind) {
      case GrammarKind::kJsonObject:
        return xgrammar::Grammar::FromJSONSchema(R"({"type": "object"})", /*any_whitespace=*/false);
      case GrammarKind::kJsonSchema:
        // Compact JSON (", " and ": " separators, no other whitespace): a small
        // model cannot wander into endless whitespace, and the text is the
        // same from every rank. strict_mode: no properties beyond the schema's
        // unless it allows them.
        return xgrammar::Grammar::FromJSONSchema(spec.text, /*any_whitespace=*/false);
      case GrammarKind::kRegex: return xgrammar::Grammar::FromRegex(spec.text);
      case GrammarKind::kEbnf: return xgrammar::Grammar::FromEBNF(spec.text, "root");
      case GrammarKind::kNone: break;
    }
    throw std::invalid_argument("no grammar");
  }();
  if (spec.prefix.empty() && spec.suffix.empty()) return body;
  std::vector<xgrammar::Grammar> parts;
  if (!spec.prefix.empty()) parts.push_back(xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(spec.prefix)));
  parts.push_back(std::move(body));
  if (!spec.suffix.empty()) parts.push_back(xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(spec.suffix)));
  return xgrammar::Grammar::Concat(parts);
}

std::string cache_key(const GrammarSpec& spec) {
  std::string k = std::to_string(static_cast<int32_t>(spec.kind));
  for (const std::string* s : {&spec.text, &spec.prefix, &spec.suffix}) {
    k += '\0';
    k += std::to_string(s->size());
    k += ':';
    k += *s;
  }
  return k;
}

// One sequence's place in its grammar, and the bitmask of the tokens allowed
// next (one bit per token, xgrammar's layout).
// The tokens `m` allows next, a bit each, into `bits` (GetBitmaskSize(vocab)
// words). False when every token is allowed (`bits` is then not written).
bool fill_bitmask(xgrammar::GrammarMatcher& m, std::vector<int32_t>& bits) {
  int64_t shape[1] = {static_cast<int64_t>(bits.size())};
  DLTensor t{};
  t.data = bits.data();
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = xgrammar::GetBitmaskDLType();
  t.shape = shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  return m.FillNextTokenBitmask(&t);
}

class XgrammarConstraint final : public TokenConstraint {
 public:
  XgrammarConstraint(const xgrammar::CompiledGrammar& g, std::vector<TokenId> stop_ids, int32_t vocab)
      : matcher_(g, stop_ids, /*terminate_without_stop_token=*/false),
        stop_ids_(std::move(stop_ids)),
        vocab_(vocab),
        bits_(static_cast<size_t>(xgrammar::GetBitmaskSize(vocab)), 0) {}

  void prepare() override {
    if (prepared_) return;
    prepared_ = true;
    if (matcher_.IsTerminated()) return;  // apply() allows the stop tokens only
    all_allowed_ = !fill_bitmask(matcher_, bits_);
    // A state that admits no token, not even a stop token (a rule that only
    // refers to itself): the grammar cannot go on, so the output ends here
    // rather than with a token the grammar refuses.
    dead_ = !all_allowed_ && std::none_of(bits_.begin(), bits_.end(), [](int32_t w) { return w != 0; });
  }

  void apply(std::span<float> logits) override {
    prepare();
    prepared_ = false;  // the next token needs a new mask
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const size_t n = logits.size();
    if (matcher_.IsTerminated() || dead_) {
      // Complete (or at a dead end): a stop token, or (with ignore_eos)
      // whatever the caller allows after one. Only stop tokens stay.
      std::vector<float> keep;
      keep.reserve(stop_ids_.size());
      for (TokenId id : stop_ids_) keep.push_back(id >= 0 && static_cast<size_t>(id) < n ? logits[id] : kNegInf);
      std::fill(logits.begin(), logits.end(), kNegInf);
      for (size_t i = 0; i < stop_ids_.size(); ++i)
        if (stop_ids_[i] >= 0 && static_cast<size_t>(stop_ids_[i]) < n) logits[stop_ids_[i]] = keep[i];
      return;
    }
    if (all_allowed_) return;
    const size_t words = std::min(bits_.size(), (n + 31) / 32);
    for (size_t w = 0; w < words; ++w) {
      const uint32_t word = static_cast<uint32_t>(bits_[w]);
      if (word == 0xFFFFFFFFu) continue;
      const size_t base = w * 32;
      const size_t end = std::min(base + 32, n);
      for (size_t i = base; i < end; ++i)
        if (!((word >> (i - base)) & 1u)) logits[i] = kNegInf;
    }
    // Rows wider than the vocabulary the grammar knows (padding): never drawn.
    for (size_t i = static_cast<size_t>(vocab_); i < n; ++i) logits[i] = kNegInf;
  }

  bool accept(TokenId id) override {
    prepared_ = false;
    if (matcher_.IsTerminated() || dead_) return false;
    try {
      return matcher_.AcceptToken(id);
    } catch (const std::exception&) {
      return false;  // an id the engine does not know
    }
  }

  bool done() const override { return matcher_.IsTerminated() || dead_; }

 private:
  xgrammar::GrammarMatcher matcher_;
  std::vector<TokenId> stop_ids_;
  int32_t vocab_ = 0;
  std::vector<int32_t> bits_;
  bool prepared_ = false;
  bool all_allowed_ = false;
  bool dead_ = false;  // the grammar admits nothing more: only stop tokens are left
};

// A vocabulary of the 256 single bytes and a stop token (id 256). Every
// byte-level vocabulary holds each byte as a token, so a grammar that admits
// nothing here admits no token of a real one either.
const xgrammar::TokenizerInfo& byte_vocabulary() {
  static const xgrammar::TokenizerInfo info = [] {
    std::vector<std::string> bytes;
    for (int b = 0; b < 256; ++b) bytes.emplace_back(1, static_cast<char>(b));
    bytes.emplace_back();  // "": a special token, the stop token
    return xgrammar::TokenizerInfo(bytes, xgrammar::VocabType::RAW, 257, std::vector<int32_t>{256});
  }();
  return info;
}

// Whether `g` can produce anything at its start: some text, or the end at
// once. One that can do neither (root ::= root; a regex of an empty class)
// would mask every token of any vocabulary. Compiling against the byte
// vocabulary takes about a millisecond and needs no model, so the router can
// refuse such a grammar before a request is admitted.
bool admits_something(const xgrammar::Grammar& g) {
  static std::mutex mu;
  static xgrammar::GrammarCompiler compiler(byte_vocabulary(), /*max_threads=*/1, /*cache_enabled=*/false);
  std::lock_guard lock(mu);
  xgrammar::GrammarMatcher m(compiler.CompileGrammar(g), std::vector<int32_t>{256},
                             /*terminate_without_stop_token=*/false);
  std::vector<int32_t> bits(static_cast<size_t>(xgrammar::GetBitmaskSize(257)), 0);
  if (!fill_bitmask(m, bits)) return true;  // everything is allowed
  return std::any_of(bits.begin(), bits.end(), [](int32_t w) { return w != 0; });
}

}  // namespace

bool grammar_engine_built() { return true; }

struct GrammarCompiler::Impl {
  xgrammar::TokenizerInfo info;
  xgrammar::GrammarCompiler compiler;
  int32_t vocab = 0;
  int64_t bound = 0;

  using Compiled = Result<std::shared_ptr<const xgrammar::CompiledGrammar>>;
  struct Job {
    GrammarSpec spec;
    std::string key;
    std::promise<Compiled> done;
  };

  std::mutex mu;  // guards everything below
  using Entry = std::pair<std::string, std::shared_ptr<const xgrammar::CompiledGrammar>>;
  std::list<Entry> lru;  // most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index;
  int64_t bytes = 0;
  Stats stats;
  // Background compiles (start()): queued jobs, and the results to come of
  // those queued or running, which get() waits for instead of compiling again.
  std::deque<Job> jobs;
  std::unordered_map<std::string, std::shared_future<Compiled>> pending;
  std::condition_variable wake;
  bool stopping = false;
  std::thread worker;  // started by the first start()

  Impl(xgrammar::TokenizerInfo i, int32_t v, int64_t cache_bytes)
      : info(std::move(i)),
        compiler(info, static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u)),
                 /*cache_enabled=*/false),
        vocab(v),
        bound(cache_bytes) {}

  ~Impl() {
    {
      std::lock_guard lock(mu);
      stopping = true;
    }
    wake.notify_all();
    if (worker.joinable()) worker.join();
  }

  Compiled get(const GrammarSpec& spec);
  Compiled compile_now(const GrammarSpec& spec, const std::string& key);
  void start(const GrammarSpec& spec);
  void run_jobs();

  std::shared_ptr<const xgrammar::CompiledGrammar> find(const std::string& key) {
    std::lock_guard lock(mu);
    const auto it = index.find(key);
    if (it == index.end()) return nullptr;
    lru.splice(lru.begin(), lru, it->second);
    ++stats.cache_hits;
    return it->second->second;
  }

  void keep(const std::string& key, std::shared_ptr<const xgrammar::CompiledGrammar> g) {
    std::lock_guard lock(mu);
    ++stats.compiled;
    if (index.count(key)) return;  // another thread compiled it meanwhile
    bytes += static_cast<int64_t>(g->MemorySizeBytes());
    lru.emplace_front(key, std::move(g));
    index[key] = lru.begin();
    while (bytes > bound && lru.size() > 1) {
      bytes -= static_cast<int64_t>(lru.back().second->MemorySizeBytes());
      index.erase(lru.back().first);
      lru.pop_back();
    }
    stats.cache_bytes = bytes;
  }
};

GrammarCompiler::GrammarCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarCompiler::~GrammarCompiler() = default;

Result<std::unique_ptr<GrammarCompiler>> GrammarCompiler::create(const Tokenizer& tok, int64_t cache_bytes) {
  const int32_t vocab = tok.vocab_size();
  std::vector<std::string> bytes(static_cast<size_t>(vocab));
  for (TokenId id = 0; id < vocab; ++id) {
    // "" marks a special token to the engine: never part of grammar text.
    if (!tok.is_control(id)) bytes[static_cast<size_t>(id)] = tok.token_to_bytes(id);
  }
  try {
    xgrammar::TokenizerInfo info(bytes, xgrammar::VocabType::RAW, vocab, std::vector<int32_t>{tok.eos_id()});
    return std::unique_ptr<GrammarCompiler>(
        new GrammarCompiler(std::make_unique<Impl>(std::move(info), vocab, cache_bytes)));
  } catch (const std::exception& e) {
    return Status::internal("grammar engine: the vocabulary was refused: " + engine_message(e));
  }
}

Status GrammarCompiler::check(const GrammarSpec& spec) {
  if (!spec.active()) return Status::ok();
  try {
    if (!admits_something(build_grammar(spec))) {
      return Status::invalid_argument("it admits no output: no text can start it and it cannot be empty");
    }
    return Status::ok();
  } catch (const std::exception& e) {
    return Status::invalid_argument(engine_message(e));
  }
}

// The compiled grammar of `spec`: from the cache, from a background compile
// of it (waited for), or compiled here.
GrammarCompiler::Impl::Compiled GrammarCompiler::Impl::get(const GrammarSpec& spec) {
  const std::string key = cache_key(spec);
  if (std::shared_ptr<const xgrammar::CompiledGrammar> g = find(key)) return g;
  std::shared_future<Compiled> coming;
  {
    std::lock_guard lock(mu);
    if (const auto it = pending.find(key); it != pending.end()) coming = it->second;
  }
  if (coming.valid()) return coming.get();
  return compile_now(spec, key);
}

GrammarCompiler::Impl::Compiled GrammarCompiler::Impl::compile_now(const GrammarSpec& spec, const std::string& key) {
  try {
    auto g = std::make_shared<const xgrammar::CompiledGrammar>(compiler.CompileGrammar(build_grammar(spec)));
    keep(key, g);
    return g;
  } catch (const std::exception& e) {
    return Status::invalid_argument(std::string(grammar_kind_name(spec.kind)) + ": " + engine_message(e));
  }
}

void GrammarCompiler::Impl::start(const GrammarSpec& spec) {
  std::string key = cache_key(spec);
  {
    std::lock_guard lock(mu);
    if (index.count(key) || pending.count(key)) return;
    Job job{spec, key, {}};
    pending[key] = job.done.get_future().share();
    jobs.push_back(std::move(job));
    if (!worker.joinable()) worker = std::thread([this] { run_jobs(); });
  }
  wake.notify_one();
}

// The background thread: one compile at a time, in arrival order.
void GrammarCompiler::Impl::run_jobs() {
  std::unique_lock lock(mu);
  while (true) {
    wake.wait(lock, [this] { return stopping || !jobs.empty(); });
    if (stopping) return;  // queued compiles are dropped: nobody is left to use them
    Job job = std::move(jobs.front());
    jobs.pop_front();
    lock.unlock();
    Compiled r = compile_now(job.spec, job.key);
    lock.lock();
    pending.erase(job.key);  // in the cache now (or failed: a later get() says why again)
    job.done.set_value(std::move(r));
  }
}

Status GrammarCompiler::compile(const GrammarSpec& spec) {
  if (!spec.active()) return Status::ok();
  return impl_->get(spec).status();
}

void GrammarCompiler::compile_in_background(const GrammarSpec& spec) {
  if (spec.active()) impl_->start(spec);
}

Result<std::unique_ptr<TokenConstraint>> GrammarCompiler::matcher(const GrammarSpec& spec, std::vector<TokenId> stop_ids) {
  if (!spec.active()) return Status::invalid_argument("no grammar to match");
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const xgrammar::CompiledGrammar> g, impl_->get(spec));
  try {
    return std::unique_ptr<TokenConstraint>(std::make_unique<XgrammarConstraint>(*g, std::move(stop_ids), impl_->vocab));
  } catch (const std::exception& e) {
    return Status::invalid_argument(std::string(grammar_kind_name(spec.kind)) + ": " + engine_message(e));
  }
}

GrammarCompiler::Stats GrammarCompiler::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

}  // namespace pd
