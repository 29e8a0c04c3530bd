#include "tokenizer/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <string>

#include "tokenizer/utf8.h"

namespace pd {
namespace {

// Hugging Face ByteLevel / GPT-2.
constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Llama 3 (tiktoken cl100k-style).
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Qwen2 / Qwen2.5 / Qwen3 (their tokenizer.json; llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2):
// Llama 3's, but every digit alone.
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Hugging Face Digits(individual_digits=True): Rust's char::is_numeric is \p{N}.
constexpr const char* kIndividualDigitsRegex = R"(\p{N})";

struct MatchDataDeleter {
  void operator()(pcre2_match_data* md) const { pcre2_match_data_free(md); }
};
using MatchDataPtr = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

// Appends a gap (text no regex alternative matched) of the last stage: runs of
// valid UTF-8 stay whole, each byte of an ill-formed sequence is its own piece.
void append_final_gap(std::string_view gap, std::vector<std::string_view>& out) {
  const auto* s = reinterpret_cast<const unsigned char*>(gap.data());
  size_t run = 0, i = 0;
  while (i < gap.size()) {
    const utf8::Step st = utf8::step(s + i, gap.size() - i);
    if (st.kind == utf8::StepKind::kValid) {
      i += st.len;
      continue;
    }
    if (i > run) out.push_back(gap.substr(run, i - run));
    out.push_back(gap.substr(i, 1));
    i += 1;
    run = i;
  }
  if (i > run) out.push_back(gap.substr(run, i - run));
}

}  // namespace

struct PreTokenizer::Stage {
  explicit Stage(pcre2_code* c) : code(c) {}
  Stage(Stage&& o) noexcept : code(o.code) { o.code = nullptr; }
  Stage& operator=(Stage&&) = delete;
  ~Stage() {
    if (code) pcre2_code_free(code);
  }
  pcre2_code* code;  // compiled (and JIT-compiled where available); read-only after create()
};

PreTokenizer::~PreTokenizer() = default;

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::create(std::string_view pre) {
  std::vector<const char*> patterns;
  bool ignore_merges = false;
  if (pre == "gpt2" || pre == "gpt-2") {
    patterns = {kGpt2Regex};
  } else if (pre == "smollm" || pre == "starcoder" || pre == "refact") {
    patterns = {kIndividualDigitsRegex, kGpt2Regex};
  } else if (pre == "llama3" || pre == "llama-bpe" || pre == "llama-v3") {
    patterns = {kLlama3Regex};
    ignore_merges = true;
  } else if (pre == "qwen2" || pre == "deepseek-r1-qwen") {
    // Qwen's tokenizer.json also has an NFC normalizer; like llama.cpp and
    // transformers' GGUF conversion we apply none (text already in NFC, as
    // nearly all text is, tokenizes the same).
    patterns = {kQwen2Regex};
  } else {
    return Status::unsupported("tokenizer pre-tokenizer '" + std::string(pre) +
                               "' (tokenizer.ggml.pre) is not supported; known: gpt2, gpt-2, smollm, "
                               "starcoder, refact, llama3, llama-bpe, llama-v3, qwen2, deepseek-r1-qwen");
  }

  std::unique_ptr<PreTokenizer> p(new PreTokenizer());
  p->ignore_merges_ = ignore_merges;
  for (const char* pattern : patterns) {
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_offset, nullptr);
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return Status::internal("pre-tokenizer '" + std::string(pre) + "': PCRE2 cannot compile its regex at offset " +
                              std::to_string(err_offset) + ": " + reinterpret_cast<const char*>(msg));
    }
    // JIT is an optimisation only: when unavailable pcre2_match interprets.
    (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    p->stages_.emplace_back(code);
  }
  return p;
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& out) const {
  if (text.empty()) return;
  MatchDataPtr md(pcre2_match_data_create(1, nullptr));
  std::vector<std::string_view> cur{text}, next;
  for (size_t s = 0; s < stages_.size(); ++s) {
    const bool last = s + 1 == stages_.size();
    std::vector<std::string_view>& dst = last ? out : next;
    next.clear();
    for (std::string_view piece : cur) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
      const size_t n = piece.size();
      size_t pos = 0, gap_start = 0;
      auto emit_gap = [&](size_t end) {
        if (end <= gap_start) return;
        std::string_view gap = piece.substr(gap_start, end - gap_start);
        if (last) {
          append_final_gap(gap, dst);
        } else {
          dst.push_back(gap);
        }
      };
      while (pos < n && md) {
        const int rc = pcre2_match(stages_[s].code, subject, n, pos, 0, md.get(), nullptr);
        if (rc < 0) break;  // no match (or a matcher error): the rest is a gap
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
        const size_t m_start = ov[0], m_end = ov[1];
        if (m_end <= m_start) {
          // Empty match (none of our patterns produces one): step one byte on.
          pos = m_start + 1;
          continue;
        }
        emit_gap(m_start);
        dst.push_back(piece.substr(m_start, m_end - m_start));
        pos = gap_start = m_end;
      }
      emit_gap(n);
    }
    if (!last) cur.swap(next);
  }
}

}  // namespace pd
