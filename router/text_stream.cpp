#include "router/text_stream.h"

#include <algorithm>

namespace pd::router {

TextStream::TextStream(const Tokenizer& tok, std::vector<std::string> stops, std::vector<TokenId> hidden,
                       TextOptions options)
    : tok_(tok), decoder_(tok), stops_(std::move(stops)), hidden_(std::move(hidden)), options_(options) {}

bool TextStream::prints(TokenId id) const {
  if (std::find(hidden_.begin(), hidden_.end(), id) != hidden_.end()) return false;
  return !(options_.skip_control && tok_.is_control(id));
}

std::string TextStream::push(TokenId id) {
  if (stopped_) return {};
  ++generated_;
  if (!prints(id)) return {};
  pending_ += decoder_.push(id);
  return take_safe();
}

std::string TextStream::take_safe() {
  size_t hold = 0;
  if (generated_ >= options_.min_tokens) {
    // The earliest stop string wins (at one place, the longest).
    size_t cut = std::string::npos, cut_len = 0;
    for (const std::string& s : stops_) {
      const size_t at = pending_.find(s);
      if (at != std::string::npos && (at < cut || (at == cut && s.size() > cut_len))) cut = at, cut_len = s.size();
    }
    if (cut != std::string::npos) {
      std::string out = pending_.substr(0, options_.include_stop ? cut + cut_len : cut);
      pending_.clear();
      stopped_ = true;
      return out;
    }
    // Hold back the longest tail that is a proper prefix of some stop string.
    for (const std::string& s : stops_) {
      for (size_t len = std::min(s.size() - 1, pending_.size()); len > hold; --len) {
        if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
          hold = len;
          break;
        }
      }
    }
  }
  size_t end = pending_.size() - hold;
  // Never split a UTF-8 character (continuation bytes are 10xxxxxx).
  while (end > 0 && end < pending_.size() && (static_cast<unsigned char>(pending_[end]) & 0xC0) == 0x80) --end;
  std::string out = pending_.substr(0, end);
  pending_.erase(0, end);
  return out;
}

std::string TextStream::finish() {
  if (stopped_) return {};
  pending_ += decoder_.flush();
  std::string out = take_safe();  // a stop string completed by the flush still applies
  if (!stopped_) {
    out += pending_;
    pending_.clear();
  }
  return out;
}

}  // namespace pd::router
