// StreamDecoder: incremental detokenization that never emits broken UTF-8.
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace pd {
namespace {

// Removes from `pending` and returns its longest prefix that is complete text:
// well-formed characters are copied, every ill-formed maximal subpart becomes
// one U+FFFD. A well-formed but unfinished character at the end is kept in
// `pending` (it may still complete) unless `final`, when it becomes U+FFFD.
// Since a character is at most 4 bytes, at most 3 bytes are ever held back.
std::string take_complete(std::string& pending, bool final) {
  std::string out;
  const auto* s = reinterpret_cast<const unsigned char*>(pending.data());
  const size_t n = pending.size();
  size_t i = 0;
  while (i < n) {
    if (s[i] < 0x80) {
      out.push_back(char(s[i++]));
      continue;
    }
    const utf8::Step st = utf8::step(s + i, n - i);
    if (st.kind == utf8::StepKind::kValid) {
      out.append(pending, i, st.len);
    } else if (st.kind == utf8::StepKind::kInvalid) {
      out += utf8::kReplacement;
    } else if (final) {  // kIncomplete at the end of the input
      out += utf8::kReplacement;
    } else {
      break;
    }
    i += st.len;
  }
  pending.erase(0, i);
  return out;
}

}  // namespace

std::string StreamDecoder::push(TokenId id) {
  pending_ += tok_.token_to_bytes(id);
  return take_complete(pending_, /*final=*/false);
}

std::string StreamDecoder::flush() { return take_complete(pending_, /*final=*/true); }

}  // namespace pd
