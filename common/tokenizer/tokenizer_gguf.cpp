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

// Keys: tokenizer.ggml.model ("gpt2" or "llama"), .tokens; for "gpt2"
// .merges (required) and .pre (default "gpt2"); for "llama" .scores and
// .add_space_prefix (default true, as llama.cpp); .token_type,
// .bos/eos/unknown/padding_token_id, .add_bos_token (default false for
// "gpt2", true for "llama", as llama.cpp and transformers). Errors name the
// key and the file.
Result<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const GgufFile& file) {
  const std::string& path = file.path();
  auto model = file.get_string("tokenizer.ggml.model");
  if (!model) return with_context(model.status(), path);
  TokenizerVocab vocab;
  if (*model == "llama") {
    vocab.kind = VocabKind::kSentencePiece;
  } else if (*model != "gpt2") {
    return Status::unsupported(path + ": tokenizer.ggml.model '" + *model +
                               "' is not supported (only 'gpt2', byte-level BPE, and 'llama', SentencePiece)");
  }
  const bool spm = vocab.kind == VocabKind::kSentencePiece;

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

  if (spm) {
    if (file.find("tokenizer.ggml.scores")) {
      auto scores = file.get_float_array("tokenizer.ggml.scores");
      if (!scores) return with_context(scores.status(), path);
      if (scores->size() != vocab.tokens.size()) {
        return Status::corruption(path + ": tokenizer.ggml.scores has " + std::to_string(scores->size()) +
                                  " entries but tokenizer.ggml.tokens has " + std::to_string(vocab.tokens.size()));
      }
      vocab.scores.assign(scores->begin(), scores->end());
    }
    vocab.add_space_prefix = true;
    if (file.find("tokenizer.ggml.add_space_prefix")) {
      auto prefix = file.get_bool("tokenizer.ggml.add_space_prefix");
      if (!prefix) return with_context(prefix.status(), path);
      vocab.add_space_prefix = *prefix;
    }
    vocab.add_bos = true;
    // Hugging Face ranks the merges of these architectures' files by token
    // position (transformers' GGUF tokenizer conversion, gemma_tokenizer).
    if (file.find("general.architecture")) {
      auto arch = file.get_string("general.architecture");
      if (!arch) return with_context(arch.status(), path);
      vocab.spm_gemma = *arch == "gemma" || *arch == "gemma2" || *arch == "gemma3";
    }
  } else {
    auto merges = file.get_string_array("tokenizer.ggml.merges");
    if (!merges) return with_context(merges.status(), path);
    vocab.merges = std::move(merges).value();
  }

  if (!spm && file.find("tokenizer.ggml.pre")) {
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
