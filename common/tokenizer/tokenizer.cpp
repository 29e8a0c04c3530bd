// Byte-level BPE (GPT-2 family) and SentencePiece-style BPE (Gemma, Llama 2),
// matching Hugging Face `tokenizers` (and llama.cpp where the two agree).
//
// Pipeline of encode(): special tokens (trie, leftmost-longest), then per span
//  - byte-level: pre-tokenizer (PCRE2 stages) -> per piece: bytes ->
//    single-byte tokens -> merges applied lowest rank first (ties: leftmost),
//    like HF's BPE::merge_word;
//  - SentencePiece: spaces -> "▁" -> characters (byte fallback) -> merges of
//    adjacent tokens whose concatenation is a token, best first (spm_piece()).
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <functional>
#include <string>
#include <utility>

#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace pd {
namespace {

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the other 68
// bytes to U+0100.. in byte order, so every byte is a visible character.
std::array<uint32_t, 256> make_byte_to_codepoint() {
  std::array<uint32_t, 256> map{};
  uint32_t extra = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    map[b] = printable ? b : 256 + extra++;
  }
  return map;
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

uint64_t pair_key(TokenId left, TokenId right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

struct Merge {
  int32_t rank;
  TokenId result;
};

// Open-addressing (linear probing) table of merges keyed by pair_key(): one
// cache line per lookup, which is most of BPE's cost. Read-only after build.
class MergeTable {
 public:
  void build_capacity(size_t n) {
    size_t cap = 16;
    int bits = 4;
    while (cap < 2 * n) {
      cap <<= 1;
      ++bits;
    }
    slots_.assign(cap, Slot{kEmpty, {0, 0}});
    mask_ = cap - 1;
    shift_ = 64 - bits;
  }
  // Inserts unless the key is present (the first, lowest-rank merge wins).
  void insert(uint64_t key, Merge m) {
    for (size_t i = index(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return;
      if (slots_[i].key == kEmpty) {
        slots_[i] = {key, m};
        return;
      }
    }
  }
  const Merge* find(uint64_t key) const {
    for (size_t i = index(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i].merge;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);  // ids are >= 0, so no real key is all ones
  struct Slot {
    uint64_t key;
    Merge merge;
  };
  // Fibonacci hashing: the top bits of key * 2^64/phi.
  size_t index(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  int shift_ = 60;
};

// Byte trie over the special (CONTROL / USER_DEFINED) token texts.
class SpecialTrie {
 public:
  SpecialTrie() : nodes_(1) {}
  bool empty() const { return nodes_.size() == 1; }
  bool may_start(unsigned char b) const { return first_[b]; }

  void insert(std::string_view text, TokenId id) {
    int32_t node = 0;
    for (unsigned char b : text) {
      auto [it, inserted] = edges_.try_emplace(edge_key(node, b), int32_t(nodes_.size()));
      if (inserted) nodes_.push_back(-1);
      node = it->second;
    }
    nodes_[node] = id;  // a later duplicate text replaces an earlier one, as in llama.cpp
    first_[static_cast<unsigned char>(text[0])] = true;
  }

  // Longest token whose text starts text[pos..] and that `allowed` accepts;
  // {id, length} or {-1, 0}.
  template <typename Allowed>
  std::pair<TokenId, size_t> longest_match(std::string_view text, size_t pos, const Allowed& allowed) const {
    std::pair<TokenId, size_t> best{-1, 0};
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      auto it = edges_.find(edge_key(node, static_cast<unsigned char>(text[i])));
      if (it == edges_.end()) break;
      node = it->second;
      const TokenId id = nodes_[node];
      if (id >= 0 && allowed(id)) best = {id, i + 1 - pos};
    }
    return best;
  }

 private:
  static uint64_t edge_key(int32_t node, unsigned char b) { return (uint64_t(uint32_t(node)) << 8) | b; }
  std::vector<TokenId> nodes_;  // token ending at each node, or -1
  std::unordered_map<uint64_t, int32_t> edges_;
  std::array<bool, 256> first_{};
};

// Per-call working memory of encode() (never shared between threads).
struct Scratch {
  struct Symbol {
    TokenId id;     // -1: a byte with no token; -2: merged away
    int32_t prev;   // index of the previous live symbol, -1 at the start
    int32_t next;   // index of the next live symbol, -1 at the end
  };
  struct Candidate {
    int32_t rank;
    int32_t left;
    int32_t right;
    TokenId left_id;
    TokenId right_id;
    TokenId result;
    // std heap functions build a max-heap: "greater" here = popped later.
    bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  // SentencePiece: a symbol is a token covering bytes [start, start + len) of
  // the normalized text; `literal` when the token's text is those bytes (not
  // a byte-fallback or unk token), so a merge is looked up without copying.
  struct SpmSymbol {
    TokenId id;     // -2: merged away
    int32_t start, len, chars;  // bytes in the normalized text; characters (merge order ties)
    int32_t prev, next;
    bool literal;
    bool unk;       // an unk standing for characters with no token (consecutive ones fuse)
  };
  struct SpmCandidate {
    double priority;  // higher first
    int32_t left_chars, right_chars;
    TokenId result;
    int32_t left, right;
    TokenId left_id, right_id;
    // Max-heap order: the best candidate compares greatest. Hugging Face's
    // converted merge list is ordered by (priority desc, left length desc,
    // right length desc, merged id asc); equal ranks go leftmost first.
    bool operator<(const SpmCandidate& o) const {
      if (priority != o.priority) return priority < o.priority;
      if (left_chars != o.left_chars) return left_chars < o.left_chars;
      if (right_chars != o.right_chars) return right_chars < o.right_chars;
      if (result != o.result) return result > o.result;
      return left > o.left;
    }
  };
  std::vector<std::string_view> pieces;
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
  std::string unicode_word;
  std::string normalized;
  std::string joined;
  std::vector<SpmSymbol> spm_symbols;
  std::vector<SpmCandidate> spm_heap;
};

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// Hugging Face's Gemma conversion spells a token of whitespace with a space in
// it (the GGUF stores "  ") as that many "▁", as the text will be spelled once
// its spaces are replaced. "" when `text` is not such a token.
std::string spm_respelled(std::string_view text) {
  if (text.find(' ') == std::string_view::npos) return {};
  for (char c : text) {
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '\v' && c != '\f') return {};
  }
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) out += kSpace;
  return out;
}

// "<0x0A>": the SentencePiece byte-fallback token of byte `b` (HF's spelling).
std::string byte_piece(unsigned b) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  return std::string{'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>'};
}

// Checks the vocabulary's sizes and special ids (shared by both kinds); fills
// in all-normal token types when there are none.
Status check_vocab(TokenizerVocab& vocab) {
  const size_t n = vocab.tokens.size();
  if (n == 0) return Status::invalid_argument("tokenizer vocabulary (tokens) is empty");
  if (n > size_t(INT32_MAX)) return Status::invalid_argument("tokenizer vocabulary has too many tokens");
  if (vocab.types.empty()) vocab.types.assign(n, TokenType::kNormal);
  if (vocab.types.size() != n) {
    return Status::invalid_argument("token_type has " + std::to_string(vocab.types.size()) +
                                    " entries but tokens has " + std::to_string(n));
  }
  const std::pair<const char*, TokenId> ids[] = {
      {"bos_id", vocab.bos_id}, {"eos_id", vocab.eos_id}, {"unk_id", vocab.unk_id}, {"pad_id", vocab.pad_id}};
  for (const auto& [name, id] : ids) {
    if (id < -1 || id >= TokenId(n)) {
      return Status::invalid_argument(std::string(name) + " " + std::to_string(id) + " is out of range [0, " +
                                      std::to_string(n) + ")");
    }
  }
  if (vocab.kind == VocabKind::kSentencePiece && !vocab.scores.empty() && vocab.scores.size() != n) {
    return Status::invalid_argument("scores has " + std::to_string(vocab.scores.size()) +
                                    " entries but tokens has " + std::to_string(n));
  }
  return Status::ok();
}

// Appends the bytes a byte-level token's text stands for: each GPT-2
// character (cp_to_byte) becomes its byte; other text is copied as-is.
void append_byte_level_bytes(const std::string& text, const std::array<int32_t, 324>& cp_to_byte,
                             std::string& bytes) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    const utf8::Step st = utf8::step(s + i, text.size() - i);
    if (st.kind != utf8::StepKind::kValid) {  // not byte-level text: copy the byte as-is
      bytes.push_back(char(s[i]));
      ++i;
      continue;
    }
    const uint32_t cp = utf8::decode_valid(s + i, st.len);
    if (cp < cp_to_byte.size() && cp_to_byte[cp] >= 0) {
      bytes.push_back(char(cp_to_byte[cp]));
    } else {
      bytes.append(text, i, st.len);
    }
    i += st.len;
  }
}

}  // namespace

struct Tokenizer::Impl {
  // All constant after create(); encode()/decode() only read them, so any
  // number of threads may call them concurrently.
  TokenizerVocab vocab;
  std::vector<std::string> token_bytes;  // [n_vocab] what each token decodes to
  std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>> token_to_id;  // by stored text
  std::array<std::string, 256> byte_unicode;  // byte -> its GPT-2 unicode character (UTF-8)
  std::array<TokenId, 256> byte_token{};      // byte -> single-byte token, -1 if none
  MergeTable merges;  // pair_key(left, right) -> rank, merged token
  SpecialTrie specials;
  std::unique_ptr<PreTokenizer> pre;  // byte-level BPE only
  // SentencePiece only: tokens respelled for merging (spm_respelled), by id;
  // their stored text -> id for find_token(); merge priority by id.
  std::unordered_map<TokenId, std::string> spm_respelled_text;
  std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>> stored_text_to_id;
  std::vector<double> spm_priority;

  bool spm() const { return vocab.kind == VocabKind::kSentencePiece; }

  // The text a SentencePiece token is merged by.
  std::string_view spm_text(TokenId id) const {
    if (!spm_respelled_text.empty()) {
      auto it = spm_respelled_text.find(id);
      if (it != spm_respelled_text.end()) return it->second;
    }
    return vocab.tokens[size_t(id)];
  }

  // Queues the merge of adjacent SentencePiece symbols left, right if their
  // concatenation is a token.
  void spm_push_candidate(Scratch& sc, int32_t left, int32_t right, bool keep_heap = true) const {
    const Scratch::SpmSymbol& l = sc.spm_symbols[size_t(left)];
    const Scratch::SpmSymbol& r = sc.spm_symbols[size_t(right)];
    std::string_view joined;
    if (l.literal && r.literal) {
      joined = std::string_view(sc.normalized).substr(size_t(l.start), size_t(l.len + r.len));
    } else {
      sc.joined.assign(spm_text(l.id));
      sc.joined.append(spm_text(r.id));
      joined = sc.joined;
    }
    auto it = token_to_id.find(joined);
    if (it == token_to_id.end()) return;
    sc.spm_heap.push_back({spm_priority[size_t(it->second)], l.chars, r.chars, it->second, left, right, l.id, r.id});
    if (keep_heap) std::push_heap(sc.spm_heap.begin(), sc.spm_heap.end());
  }

  // Appends one symbol for the character (or ill-formed byte) at
  // normalized[start, start + len): its token, else its bytes' <0xXX> tokens,
  // else unk (fused with an unk before it), as HF's BPE with byte_fallback.
  void spm_add_char(Scratch& sc, int32_t start, int32_t len, bool valid) const {
    auto push = [&](TokenId id, int32_t s0, int32_t l0, bool literal, bool unk) {
      const int32_t idx = int32_t(sc.spm_symbols.size());
      if (idx > 0) sc.spm_symbols.back().next = idx;
      sc.spm_symbols.push_back({id, s0, l0, 1, idx - 1, -1, literal, unk});
    };
    const std::string_view ch = std::string_view(sc.normalized).substr(size_t(start), size_t(len));
    if (valid) {
      auto it = token_to_id.find(ch);
      if (it != token_to_id.end()) return push(it->second, start, len, true, false);
    }
    bool all_bytes = true;
    for (unsigned char b : ch) all_bytes = all_bytes && byte_token[b] >= 0;
    if (all_bytes) {
      for (int32_t i = 0; i < len; ++i) {
        push(byte_token[static_cast<unsigned char>(ch[size_t(i)])], start + i, 1, false, false);
      }
      return;
    }
    if (vocab.unk_id < 0) return;  // no token, no byte tokens, no unk: dropped, as HF does
    if (!sc.spm_symbols.empty() && sc.spm_symbols.back().unk) {  // HF's fuse_unk
      Scratch::SpmSymbol& last = sc.spm_symbols.back();
      last.len += len;
      last.chars += 1;
      return;
    }
    push(vocab.unk_id, start, len, false, true);
  }

  // SentencePiece BPE over one span of text between special tokens.
  void spm_piece(std::string_view text, bool starts_input, Scratch& sc, std::vector<TokenId>& out) const {
    std::string& norm = sc.normalized;
    norm.clear();
    // HF's Metaspace(prepend_scheme="first"): only at the start of the input,
    // and not when the text already starts with a space.
    if (vocab.add_space_prefix && starts_input && text.front() != ' ' && text.substr(0, kSpace.size()) != kSpace) {
      norm += kSpace;
    }
    for (char c : text) {
      if (c == ' ') {
        norm += kSpace;
      } else {
        norm.push_back(c);
      }
    }
    if (norm.size() >= size_t(INT32_MAX)) return;  // int32 offsets (a 2 GiB prompt is refused long before)
    sc.spm_symbols.clear();
    const auto* s = reinterpret_cast<const unsigned char*>(norm.data());
    for (size_t i = 0; i < norm.size();) {
      const utf8::Step st = utf8::step(s + i, norm.size() - i);
      if (st.kind == utf8::StepKind::kValid) {
        spm_add_char(sc, int32_t(i), int32_t(st.len), true);
        i += st.len;
      } else {
        for (size_t k = 0; k < st.len; ++k) spm_add_char(sc, int32_t(i + k), 1, false);
        i += st.len;
      }
    }
    const int32_t n = int32_t(sc.spm_symbols.size());
    sc.spm_heap.clear();
    for (int32_t i = 0; i + 1 < n; ++i) spm_push_candidate(sc, i, i + 1, /*keep_heap=*/false);
    std::make_heap(sc.spm_heap.begin(), sc.spm_heap.end());
    while (!sc.spm_heap.empty()) {
      std::pop_heap(sc.spm_heap.begin(), sc.spm_heap.end());
      const Scratch::SpmCandidate c = sc.spm_heap.back();
      sc.spm_heap.pop_back();
      Scratch::SpmSymbol& left = sc.spm_symbols[size_t(c.left)];
      Scratch::SpmSymbol& right = sc.spm_symbols[size_t(c.right)];
      if (left.id != c.left_id || left.next != c.right || right.id != c.right_id) continue;  // stale
      left.id = c.result;
      left.len += right.len;
      left.chars += right.chars;
      left.literal = left.literal && right.literal;
      left.unk = false;
      left.next = right.next;
      if (right.next >= 0) sc.spm_symbols[size_t(right.next)].prev = c.left;
      right.id = -2;
      right.next = right.prev = -1;
      if (left.prev >= 0) spm_push_candidate(sc, left.prev, c.left);
      if (left.next >= 0) spm_push_candidate(sc, c.left, left.next);
    }
    for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = sc.spm_symbols[size_t(i)].next) out.push_back(sc.spm_symbols[size_t(i)].id);
  }

  bool is_special_type(TokenId id) const {
    const TokenType t = vocab.types[size_t(id)];
    return t == TokenType::kControl || t == TokenType::kUserDefined;
  }

  // Queues the merge of adjacent live symbols left, right if one exists.
  void push_candidate(Scratch& sc, int32_t left, int32_t right, bool keep_heap = true) const {
    const TokenId l = sc.symbols[size_t(left)].id, r = sc.symbols[size_t(right)].id;
    if (l < 0 || r < 0) return;
    const Merge* m = merges.find(pair_key(l, r));
    if (!m) return;
    sc.heap.push_back({m->rank, left, right, l, r, m->result});
    if (keep_heap) std::push_heap(sc.heap.begin(), sc.heap.end());
  }

  void emit(TokenId id, std::vector<TokenId>& out) const {
    if (id >= 0) {
      out.push_back(id);
    } else if (vocab.unk_id >= 0) {
      out.push_back(vocab.unk_id);
    }  // else: a byte without a token and no <unk> — dropped, as HF does without unk
  }

  // BPE over one pre-token.
  void bpe_piece(std::string_view piece, Scratch& sc, std::vector<TokenId>& out) const {
    const size_t n = piece.size();
    if (n == 1 || n >= size_t(INT32_MAX)) {  // (a >= 2 GiB piece is left unmerged: int32 indices)
      for (unsigned char b : piece) emit(byte_token[b], out);
      return;
    }
    if (pre->ignore_merges()) {
      sc.unicode_word.clear();
      for (unsigned char b : piece) sc.unicode_word += byte_unicode[b];
      auto it = token_to_id.find(std::string_view(sc.unicode_word));
      if (it != token_to_id.end()) {
        out.push_back(it->second);
        return;
      }
    }
    sc.symbols.resize(n);
    for (size_t i = 0; i < n; ++i) {
      sc.symbols[i] = {byte_token[static_cast<unsigned char>(piece[i])], int32_t(i) - 1,
                       i + 1 < n ? int32_t(i + 1) : -1};
    }
    sc.heap.clear();
    for (size_t i = 0; i + 1 < n; ++i) push_candidate(sc, int32_t(i), int32_t(i + 1), /*keep_heap=*/false);
    std::make_heap(sc.heap.begin(), sc.heap.end());
    while (!sc.heap.empty()) {
      std::pop_heap(sc.heap.begin(), sc.heap.end());
      const Scratch::Candidate c = sc.heap.back();
      sc.heap.pop_back();
      Scratch::Symbol& left = sc.symbols[size_t(c.left)];
      Scratch::Symbol& right = sc.symbols[size_t(c.right)];
      // Stale if either side has changed since the candidate was queued.
      if (left.id != c.left_id || left.next != c.right || right.id != c.right_id) continue;
      left.id = c.result;
      left.next = right.next;
      if (right.next >= 0) sc.symbols[size_t(right.next)].prev = c.left;
      right.id = -2;
      right.next = right.prev = -1;
      if (left.prev >= 0) push_candidate(sc, left.prev, c.left);
      if (left.next >= 0) push_candidate(sc, c.left, left.next);
    }
    for (int32_t i = 0; i >= 0; i = sc.symbols[size_t(i)].next) emit(sc.symbols[size_t(i)].id, out);
  }

  void encode_plain(std::string_view text, bool starts_input, Scratch& sc, std::vector<TokenId>& out) const {
    if (text.empty()) return;
    if (spm()) return spm_piece(text, starts_input, sc, out);
    sc.pieces.clear();
    pre->split(text, sc.pieces);
    for (std::string_view piece : sc.pieces) bpe_piece(piece, sc, out);
  }

  // Byte-level BPE: token_to_id, what each token decodes to (its GPT-2
  // characters mapped back to bytes), and the single-byte tokens.
  void index_byte_level_tokens() {
    const size_t n = vocab.tokens.size();
    const std::array<uint32_t, 256> byte_cp = make_byte_to_codepoint();
    std::array<int32_t, 324> cp_to_byte;  // all GPT-2 codepoints are < 256 + 68
    cp_to_byte.fill(-1);
    for (uint32_t b = 0; b < 256; ++b) {
      utf8::append(byte_unicode[b], byte_cp[b]);
      cp_to_byte[byte_cp[b]] = int32_t(b);
    }

    token_to_id.reserve(n);
    token_bytes.resize(n);
    for (size_t id = 0; id < n; ++id) {
      const std::string& text = vocab.tokens[id];
      token_to_id[text] = TokenId(id);  // a later duplicate wins, as in llama.cpp
      const TokenType type = vocab.types[id];
      if (type == TokenType::kControl || type == TokenType::kUserDefined || type == TokenType::kUnknown) {
        token_bytes[id] = text;  // added tokens render as their literal text (HF, llama.cpp)
        continue;
      }
      append_byte_level_bytes(text, cp_to_byte, token_bytes[id]);
    }
    for (size_t b = 0; b < 256; ++b) {
      auto it = token_to_id.find(std::string_view(byte_unicode[b]));
      byte_token[b] = it == token_to_id.end() ? -1 : it->second;
    }
  }

  // Byte-level BPE: the merge table from vocab.merges ("left right", by rank).
  Status build_merges() {
    merges.build_capacity(vocab.merges.size());
    std::string joined;
    for (size_t rank = 0; rank < vocab.merges.size(); ++rank) {
      const std::string& m = vocab.merges[rank];
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos || sp + 1 >= m.size()) {
        return Status::invalid_argument("merges[" + std::to_string(rank) + "] '" + m + "' is not 'left right'");
      }
      const std::string_view left(m.data(), sp), right(m.data() + sp + 1, m.size() - sp - 1);
      auto l = token_to_id.find(left), r = token_to_id.find(right);
      joined.assign(left);
      joined.append(right);
      auto res = token_to_id.find(std::string_view(joined));
      // A merge naming tokens absent from the vocabulary can never fire; skip it.
      if (l == token_to_id.end() || r == token_to_id.end() || res == token_to_id.end()) continue;
      merges.insert(pair_key(l->second, r->second), Merge{int32_t(rank), res->second});
    }
    return Status::ok();
  }
};

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::create(TokenizerVocab vocab) {
  PD_RETURN_IF_ERROR(check_vocab(vocab));
  if (vocab.kind == VocabKind::kSentencePiece) return create_sentencepiece(std::move(vocab));
  PD_ASSIGN_OR_RETURN(auto pre, PreTokenizer::create(vocab.pre));

  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  tok->impl_ = std::make_unique<Impl>();
  Impl& im = *tok->impl_;
  im.pre = std::move(pre);
  im.vocab = std::move(vocab);
  const TokenizerVocab& v = im.vocab;
  const size_t n = v.tokens.size();

  im.index_byte_level_tokens();
  PD_RETURN_IF_ERROR(im.build_merges());

  for (size_t id = 0; id < n; ++id) {
    if (im.is_special_type(TokenId(id)) && !v.tokens[id].empty()) im.specials.insert(v.tokens[id], TokenId(id));
  }
  return tok;
}

// SentencePiece-style vocabulary. No merge table: a merge is a lookup of the
// two tokens' concatenated text (so loading 262k tokens costs one hash insert
// each), ranked by the merged token's priority.
Result<std::unique_ptr<Tokenizer>> Tokenizer::create_sentencepiece(TokenizerVocab vocab) {
  const size_t n = vocab.tokens.size();
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  tok->impl_ = std::make_unique<Impl>();
  Impl& im = *tok->impl_;
  im.vocab = std::move(vocab);
  const TokenizerVocab& v = im.vocab;

  im.token_to_id.reserve(n);
  im.token_bytes.resize(n);
  im.spm_priority.resize(n);
  for (size_t id = 0; id < n; ++id) {
    const std::string& text = v.tokens[id];
    im.spm_priority[id] = v.spm_gemma ? -double(id) : v.scores.empty() ? 0.0 : double(v.scores[id]);
    const TokenType type = v.types[id];
    std::string respelled = v.spm_gemma ? spm_respelled(text) : std::string();
    if (!respelled.empty()) {
      im.stored_text_to_id[text] = TokenId(id);
      im.token_to_id[respelled] = TokenId(id);  // a later duplicate wins, as in HF's vocabulary
      im.spm_respelled_text.emplace(TokenId(id), std::move(respelled));
    } else if (!text.empty()) {
      im.token_to_id[text] = TokenId(id);
    }
    std::string& bytes = im.token_bytes[id];
    if (type == TokenType::kControl || type == TokenType::kUserDefined || type == TokenType::kUnknown) {
      bytes = text;  // added tokens render as their literal text (HF, llama.cpp)
      continue;
    }
    // HF's decoder: "▁" -> " ", a "<0xXX>" token -> that byte.
    if (text.size() == 6 && text.compare(0, 3, "<0x") == 0 && text[5] == '>') {
      unsigned byte = 0;
      bool hex = true;
      for (size_t i = 3; i < 5; ++i) {
        const char c = text[i];
        const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        hex = hex && d >= 0;
        byte = byte * 16 + unsigned(d < 0 ? 0 : d);
      }
      if (hex) {
        bytes.push_back(char(byte));
        continue;
      }
    }
    for (size_t i = 0; i < text.size();) {
      if (text.compare(i, kSpace.size(), kSpace) == 0) {
        bytes.push_back(' ');
        i += kSpace.size();
      } else {
        bytes.push_back(text[i++]);
      }
    }
  }
  for (unsigned b = 0; b < 256; ++b) {
    auto it = im.token_to_id.find(std::string_view(byte_piece(b)));
    im.byte_token[b] = it == im.token_to_id.end() ? -1 : it->second;
  }
  // Added tokens as HF's conversion makes them: CONTROL and USER_DEFINED,
  // except the respelled whitespace runs (they are reached by merging).
  for (size_t id = 0; id < n; ++id) {
    if (im.is_special_type(TokenId(id)) && !v.tokens[id].empty() && !im.spm_respelled_text.count(TokenId(id))) {
      im.specials.insert(v.tokens[id], TokenId(id));
    }
  }
  return tok;
}

// Special-token matching follows HF's added vocabulary and llama.cpp:
// USER_DEFINED tokens are always matched; CONTROL tokens only when
// parse_special is true (otherwise their text is encoded as ordinary text).
// No BOS is prepended: callers that want one check add_bos().
std::vector<TokenId> Tokenizer::encode(std::string_view text, bool parse_special, bool starts_input) const {
  const Impl& im = *impl_;
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  Scratch sc;
  size_t seg_start = 0;
  if (!im.specials.empty()) {
    auto allowed = [&](TokenId id) { return parse_special || im.vocab.types[size_t(id)] != TokenType::kControl; };
    for (size_t pos = 0; pos < text.size();) {
      if (!im.specials.may_start(static_cast<unsigned char>(text[pos]))) {
        ++pos;
        continue;
      }
      const auto [id, len] = im.specials.longest_match(text, pos, allowed);
      if (id < 0) {
        ++pos;
        continue;
      }
      im.encode_plain(text.substr(seg_start, pos - seg_start), starts_input && seg_start == 0, sc, out);
      out.push_back(id);
      pos += len;
      seg_start = pos;
    }
  }
  im.encode_plain(text.substr(seg_start), starts_input && seg_start == 0, sc, out);
  return out;
}

std::string Tokenizer::token_to_bytes(TokenId id) const {
  if (id < 0 || size_t(id) >= impl_->token_bytes.size()) return {};
  return impl_->token_bytes[size_t(id)];
}

// Ids outside the vocabulary render as nothing.
std::string Tokenizer::decode(const std::vector<TokenId>& ids) const {
  std::string out;
  for (TokenId id : ids) {
    if (id >= 0 && size_t(id) < impl_->token_bytes.size()) out += impl_->token_bytes[size_t(id)];
  }
  // HF's Strip(left=1) decoder of a SentencePiece vocabulary with a prefix space.
  if (impl_->spm() && impl_->vocab.add_space_prefix && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

int32_t Tokenizer::vocab_size() const { return int32_t(impl_->vocab.tokens.size()); }
TokenId Tokenizer::bos_id() const { return impl_->vocab.bos_id; }
TokenId Tokenizer::eos_id() const { return impl_->vocab.eos_id; }
bool Tokenizer::add_bos() const { return impl_->vocab.add_bos; }

bool Tokenizer::is_control(TokenId id) const {
  return id >= 0 && size_t(id) < impl_->vocab.types.size() && impl_->vocab.types[size_t(id)] == TokenType::kControl;
}

VocabKind Tokenizer::kind() const { return impl_->vocab.kind; }

// Looks up the text as stored in the vocabulary (byte-level form, e.g. "Ġthe").
TokenId Tokenizer::find_token(std::string_view text) const {
  if (!impl_->stored_text_to_id.empty()) {
    auto st = impl_->stored_text_to_id.find(text);
    if (st != impl_->stored_text_to_id.end()) return st->second;
  }
  auto it = impl_->token_to_id.find(text);
  return it == impl_->token_to_id.end() ? -1 : it->second;
}

}  // namespace pd
