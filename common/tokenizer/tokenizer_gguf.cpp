// Tokenizer::from_gguf: the vocabulary read from a GGUF file's tokenizer.ggml.* keys.
#include <string>

#include "gguf/gguf_reader.h"
#include "tokenizer/status_context.h"
#include "tokenizer/tokenizer.h"

namespace pd {
namespace {

using tokenizer_internal::with_context;

// An optional token id: -1 when the key is absent; an error if present but
// not an integer.
Status read_optional_id(const GgufFile& file, const std::string& key, TokenId& id) {
  id = -1;
  if (!file.find(key)) return Status::ok();
  auto v = file.get_int(key);
  if (!v) return with_context(v.status(), file.path());
  if (*v < 0 || *v > INT32_MAX) {
    return Status::corruption(file.path() + ": " + key + " = " + std::to_string(*v) + " is not a valid token id");
  }
  id = TokenId(*v);
  return Status::ok();
}

}  // namespace

// Keys: tokenizer.ggml.model (must be "gpt2"), .tokens, .merges (required),
// .token_type, .pre (default "gpt2"), .bos/eos/unknown/padding_token_id,
// .add_bos_token (all optional). Errors name the key and the file.
Result<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const GgufFile& file) {
  const std::string& path = file.path();
  auto model = file.get_string("tokenizer.ggml.model");
  if (!model) return with_context(model.status(), path);
  if (*model != "gpt2") {
    return Status::unsupported(path + ": tokenizer.ggml.model '" + *model +
                               "' is not supported (only 'gpt2', byte-level BPE)");
  }

  TokenizerVocab vocab;
  auto tokens = file.get_string_array("tokenizer.ggml.tokens");
  if (!tokens) return with_context(tokens.status(), path);
  vocab.tokens = std::move(tokens).value();

  if (file.find("tokenizer.ggml.token_type")) {
    auto types = file.get_int_array("tokenizer.ggml.token_type");
    if (!types) return with_context(types.status(), path);
    if (types->size() != vocab.tokens.size()) {
      return Status::corruption(path + ": tokenizer.ggml.token_type has " + std::to_string(types->size()) +
                                " entries but tokenizer.ggml.tokens has " + std::to_string(vocab.tokens.size()));
    }
    vocab.types.reserve(types->size());
    for (size_t i = 0; i < types->size(); ++i) {
      const int64_t t = (*types)[i];
      if (t < 0 || t > int64_t(TokenType::kByte)) {
        return Status::corruption(path + ": tokenizer.ggml.token_type[" + std::to_string(i) + "] = " +
                                  std::to_string(t) + " is not a known token type");
      }
      vocab.types.push_back(TokenType(t));
    }
  }

  auto merges = file.get_string_array("tokenizer.ggml.merges");
  if (!merges) return with_context(merges.status(), path);
  vocab.merges = std::move(merges).value();

  if (file.find("tokenizer.ggml.pre")) {
    auto pre = file.get_string("tokenizer.ggml.pre");
    if (!pre) return with_context(pre.status(), path);
    vocab.pre = std::move(pre).value();
  }

  PD_RETURN_IF_ERROR(read_optional_id(file, "tokenizer.ggml.bos_token_id", vocab.bos_id));
  PD_RETURN_IF_ERROR(read_optional_id(file, "tokenizer.ggml.eos_token_id", vocab.eos_id));
  PD_RETURN_IF_ERROR(read_optional_id(file, "tokenizer.ggml.unknown_token_id", vocab.unk_id));
  PD_RETURN_IF_ERROR(read_optional_id(file, "tokenizer.ggml.padding_token_id", vocab.pad_id));

  if (file.find("tokenizer.ggml.add_bos_token")) {
    auto add_bos = file.get_bool("tokenizer.ggml.add_bos_token");
    if (!add_bos) return with_context(add_bos.status(), path);
    vocab.add_bos = *add_bos;
  }

  auto tok = create(std::move(vocab));
  if (!tok) return with_context(tok.status(), path);
  return tok;
}

}  // namespace pd
