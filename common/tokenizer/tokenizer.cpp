// Byte-level BPE (GPT-2 family), matching Hugging Face `tokenizers` and llama.cpp.
//
// Pipeline of encode(): special tokens (trie, leftmost-longest) -> pre-tokenizer
// (PCRE2 stages) -> per piece: bytes -> single-byte tokens -> merges applied
// lowest rank first (ties: leftmost), like HF's BPE::merge_word.
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
  std::vector<std::string_view> pieces;
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
  std::string unicode_word;
};

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
  std::unique_ptr<PreTokenizer> pre;

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

  void encode_plain(std::string_view text, Scratch& sc, std::vector<TokenId>& out) const {
    if (text.empty()) return;
    sc.pieces.clear();
    pre->split(text, sc.pieces);
    for (std::string_view piece : sc.pieces) bpe_piece(piece, sc, out);
  }
};

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::create(TokenizerVocab vocab) {
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
  PD_ASSIGN_OR_RETURN(auto pre, PreTokenizer::create(vocab.pre));

  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  tok->impl_ = std::make_unique<Impl>();
  Impl& im = *tok->impl_;
  im.pre = std::move(pre);
  im.vocab = std::move(vocab);
  const TokenizerVocab& v = im.vocab;

  const std::array<uint32_t, 256> byte_cp = make_byte_to_codepoint();
  std::array<int32_t, 324> cp_to_byte;  // all GPT-2 codepoints are < 256 + 68
  cp_to_byte.fill(-1);
  for (uint32_t b = 0; b < 256; ++b) {
    utf8::append(im.byte_unicode[b], byte_cp[b]);
    cp_to_byte[byte_cp[b]] = int32_t(b);
  }

  im.token_to_id.reserve(n);
  im.token_bytes.resize(n);
  for (size_t id = 0; id < n; ++id) {
    const std::string& text = v.tokens[id];
    im.token_to_id[text] = TokenId(id);  // a later duplicate wins, as in llama.cpp
    const TokenType type = v.types[id];
    if (type == TokenType::kControl || type == TokenType::kUserDefined || type == TokenType::kUnknown) {
      im.token_bytes[id] = text;  // added tokens render as their literal text (HF, llama.cpp)
      continue;
    }
    std::string& bytes = im.token_bytes[id];
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
  for (size_t b = 0; b < 256; ++b) {
    auto it = im.token_to_id.find(std::string_view(im.byte_unicode[b]));
    im.byte_token[b] = it == im.token_to_id.end() ? -1 : it->second;
  }

  im.merges.build_capacity(v.merges.size());
  std::string joined;
  for (size_t rank = 0; rank < v.merges.size(); ++rank) {
    const std::string& m = v.merges[rank];
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos || sp + 1 >= m.size()) {
      return Status::invalid_argument("merges[" + std::to_string(rank) + "] '" + m + "' is not 'left right'");
    }
    const std::string_view left(m.data(), sp), right(m.data() + sp + 1, m.size() - sp - 1);
    auto l = im.token_to_id.find(left), r = im.token_to_id.find(right);
    joined.assign(left);
    joined.append(right);
    auto res = im.token_to_id.find(std::string_view(joined));
    // A merge naming tokens absent from the vocabulary can never fire; skip it.
    if (l == im.token_to_id.end() || r == im.token_to_id.end() || res == im.token_to_id.end()) continue;
    im.merges.insert(pair_key(l->second, r->second), Merge{int32_t(rank), res->second});
  }

  for (size_t id = 0; id < n; ++id) {
    if (im.is_special_type(TokenId(id)) && !v.tokens[id].empty()) im.specials.insert(v.tokens[id], TokenId(id));
  }
  return tok;
}

// Special-token matching follows HF's added vocabulary and llama.cpp:
// USER_DEFINED tokens are always matched; CONTROL tokens only when
// parse_special is true (otherwise their text is encoded as ordinary text).
// No BOS is prepended: callers that want one check add_bos().
std::vector<TokenId> Tokenizer::encode(std::string_view text, bool parse_special) const {
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
      im.encode_plain(text.substr(seg_start, pos - seg_start), sc, out);
      out.push_back(id);
      pos += len;
      seg_start = pos;
    }
  }
  im.encode_plain(text.substr(seg_start), sc, out);
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
  return out;
}

int32_t Tokenizer::vocab_size() const { return int32_t(impl_->vocab.tokens.size()); }
TokenId Tokenizer::bos_id() const { return impl_->vocab.bos_id; }
TokenId Tokenizer::eos_id() const { return impl_->vocab.eos_id; }
bool Tokenizer::add_bos() const { return impl_->vocab.add_bos; }

bool Tokenizer::is_control(TokenId id) const {
  return id >= 0 && size_t(id) < impl_->vocab.types.size() && impl_->vocab.types[size_t(id)] == TokenType::kControl;
}

// Looks up the text as stored in the vocabulary (byte-level form, e.g. "Ġthe").
TokenId Tokenizer::find_token(std::string_view text) const {
  auto it = impl_->token_to_id.find(text);
  return it == impl_->token_to_id.end() ? -1 : it->second;
}

}  // namespace pd
