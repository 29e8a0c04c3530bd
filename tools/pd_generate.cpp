// pd-generate: run the engine on one prompt from the command line.
//
//   pd-generate -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p "text" [--chat] [-n N] [--temp T] [--seed S]
//
// Prints the continuation as it is generated, then one stats line on stderr.
//
//   pd-generate -m MODEL --batch prompts.jsonl
//
// Batch mode: one JSON object per input line, {"prompt": str, "chat": bool,
// "max_tokens": int, "ignore_eos": bool, "temperature": float, "seed": int}
// (all but "prompt" optional; the command-line values are the defaults; instead
// of "prompt", "messages": [{"role", "content"}, ...] is a whole conversation
// through the chat template, as /v1/chat/completions renders it), run
// together through one batched generate(); prints one JSON line per prompt:
// {"index", "prompt_tokens", "completion_tokens", "tokens", "text",
// "finish_reason"} — the reference the cluster tests compare against. Text
// leaves out EOS and the chat template's end-of-turn token, as the server does.
// Bad flags or an unreadable model: one line on stderr, exit status 2 (usage)
// or 1 (runtime failure).
#include <algorithm>
#include <CLI/CLI.hpp>

#include <fstream>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "grammar/grammar.h"
#include "kv/kv_block_manager.h"
#include "model/generate.h"
#include "router/structured_output.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"
#include "sampling/sampler.h"
#include "tokenizer/tokenizer.h"
#include "tool_common.h"

namespace {

using pd::tools::kExitUsage;
using pd::tools::ToolError;

int fail(const std::string& msg, int code = pd::tools::kExitFailure) {
  return pd::tools::report_error("pd-generate", msg, code);
}
int fail(const ToolError& e) { return fail(e.message, e.exit_code); }

struct GenerateFlags {
  std::string model_path, prompt, batch_path, system_prompt, chat_template, kv_dtype = "f16";
  bool has_prompt = false, has_batch = false;
  bool chat = false, raw_specials = false, ignore_eos = false;
  int n_predict = 64, block_size = 16;
  float temp = 0.0f, top_p = 1.0f, min_p = 0.0f, presence = 0.0f, frequency = 0.0f, repetition = 1.0f;
  int top_k = 0, min_tokens = 0;
  uint64_t seed = 0;
  std::vector<std::pair<pd::TokenId, float>> logit_bias;  // --logit-bias, ids ascending
  pd::GrammarSpec grammar;  // --json-schema, --json-object, --regex, --grammar
  pd::SpeculationConfig speculation;  // --speculate, --ngram-min, --ngram-max
  pd::tools::BackendFlags backend;
};

// --logit-bias ID=BIAS (repeated): the same bias the API's logit_bias gives.
std::string parse_logit_bias(const std::vector<std::string>& specs, GenerateFlags* f) {
  for (const std::string& spec : specs) {
    const size_t eq = spec.find('=');
    char* end = nullptr;
    const long id = eq == std::string::npos ? -1 : std::strtol(spec.c_str(), &end, 10);
    const bool id_ok = eq != std::string::npos && end == spec.c_str() + eq && eq > 0 && id >= 0 && id <= INT32_MAX;
    const float bias = id_ok ? std::strtof(spec.c_str() + eq + 1, &end) : 0.0f;
    if (!id_ok || eq + 1 == spec.size() || *end != '\0' || !(bias >= -100.0f && bias <= 100.0f))
      return "--logit-bias: expected TOKEN_ID=BIAS with BIAS in [-100, 100], got '" + spec + "'";
    f->logit_bias.emplace_back(static_cast<pd::TokenId>(id), bias);
  }
  std::sort(f->logit_bias.begin(), f->logit_bias.end());
  for (size_t i = 1; i < f->logit_bias.size(); ++i)
    if (f->logit_bias[i].first == f->logit_bias[i - 1].first)
      return "--logit-bias: token " + std::to_string(f->logit_bias[i].first) + " given twice";
  return "";
}

// --json-schema / --json-object / --regex / --grammar: at most one; a value
// "@PATH" is read from that file. The same constraint as the API's
// response_format / structured_outputs.
std::string parse_grammar_flags(const std::string& schema, bool json_object, const std::string& regex,
                                const std::string& ebnf, GenerateFlags* f) {
  const int given = !schema.empty() + json_object + !regex.empty() + !ebnf.empty();
  if (given == 0) return "";
  if (given > 1) return "--json-schema, --json-object, --regex and --grammar: give at most one";
  auto value = [](const std::string& v, const char* flag, std::string* out) -> std::string {
    if (v.empty() || v[0] != '@') {
      *out = v;
      return "";
    }
    std::string error;
    auto text = pd::tools::read_input_file(v.substr(1), flag, &error);
    if (!text) return error;
    *out = std::move(*text);
    return "";
  };
  pd::GrammarSpec& g = f->grammar;
  std::string err;
  if (json_object) {
    g.kind = pd::GrammarKind::kJsonObject;
  } else if (!schema.empty()) {
    g.kind = pd::GrammarKind::kJsonSchema;
    err = value(schema, "--json-schema", &g.text);
    if (err.empty()) {
      const nlohmann::ordered_json j = nlohmann::ordered_json::parse(g.text, nullptr, false);  // keys keep their order
      if (j.is_discarded() || !j.is_object()) return "--json-schema: not a JSON object";
      // The keywords the grammar would not enforce are refused, as the API refuses them.
      if (auto e = pd::router::check_schema(j, "--json-schema")) return e->message;
      g.text = j.dump();  // compact, as the router sends it
    }
  } else if (!regex.empty()) {
    g.kind = pd::GrammarKind::kRegex;
    err = value(regex, "--regex", &g.text);
  } else {
    g.kind = pd::GrammarKind::kEbnf;
    err = value(ebnf, "--grammar", &g.text);
  }
  if (!err.empty()) return "--json-schema/--regex/--grammar: " + err;
  if (pd::Status st = pd::GrammarCompiler::check(g); !st.is_ok()) return "--" + std::string(
      g.kind == pd::GrammarKind::kEbnf ? "grammar" : g.kind == pd::GrammarKind::kRegex ? "regex" : "json-schema") +
      ": " + st.message();
  return "";
}

// Parses the command line into *f. Returns the exit status when the tool
// stops here (--help, a bad flag), nothing when it goes on.
std::optional<int> parse_flags(int argc, char** argv, GenerateFlags* f) {
  CLI::App app{"pd-generate: generate text with the pdcluster engine"};
  std::vector<std::string> bias_specs;
  std::string schema, regex, ebnf;
  bool json_object = false;
  app.add_option("-m,--model", f->model_path, "GGUF model file")->required();
  auto* prompt_opt = app.add_option("-p,--prompt", f->prompt, "prompt text (with --chat: the user message)");
  auto* batch_opt =
      app.add_option("--batch", f->batch_path, "JSONL file of prompts to run together (see the header)");
  prompt_opt->excludes(batch_opt);
  app.add_flag("--chat", f->chat, "wrap the prompt in the model's chat template");
  app.add_option("--system", f->system_prompt, "system message for --chat (default: the template's own)");
  app.add_option("--chat-template", f->chat_template,
                 "chat template for --chat and --batch chats instead of the file's: chatml, hermes, qwen2.5, gemma, llama3 or llama3.1 "
                 "(as cluster.json's \"chat_template\")")
      ->check(CLI::Validator(
          [](std::string& name) {
            auto t = pd::ChatTemplate::from_name(name);
            return t.is_ok() ? std::string() : t.status().message();
          },
          "NAME"));
  app.add_option("-n,--n-predict", f->n_predict, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  app.add_option("--temp", f->temp, "sampling temperature (0 = greedy)")->check(CLI::Range(0.0f, 100.0f));
  app.add_option("--top-k", f->top_k, "top-k (0 = off)")->check(CLI::Range(0, 1 << 30));
  app.add_option("--top-p", f->top_p, "top-p (1 = off)")->check(CLI::Range(0.0f, 1.0f));
  app.add_option("--min-p", f->min_p, "min-p (0 = off)")->check(CLI::Range(0.0f, 1.0f));
  app.add_option("--presence-penalty", f->presence, "presence penalty")->check(CLI::Range(-2.0f, 2.0f));
  app.add_option("--frequency-penalty", f->frequency, "frequency penalty")->check(CLI::Range(-2.0f, 2.0f));
  app.add_option("--repetition-penalty", f->repetition,
                 "divides the logits of tokens already in the prompt or output where positive, multiplies them "
                 "where negative (1 = off; the API's repetition_penalty)")
      ->check(CLI::Range(1e-3f, 100.0f));
  app.add_option("--min-tokens", f->min_tokens,
                 "generate at least this many tokens before EOS or a stop token (at most --n-predict; the API's "
                 "min_tokens)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--seed", f->seed, "sampling seed");
  app.add_flag("--ignore-eos", f->ignore_eos, "keep generating past the end-of-sequence token");
  auto* bias_opt = app.add_option("--logit-bias", bias_specs,
                                  "TOKEN_ID=BIAS added to that token's logit before sampling, BIAS in [-100, 100] "
                                  "(repeat the flag; the API's logit_bias)");
  app.add_option("--json-schema", schema,
                 "constrain the output to this JSON schema (its JSON text, or @FILE; the API's response_format "
                 "json_schema)");
  app.add_flag("--json-object", json_object, "constrain the output to a JSON object (response_format json_object)");
  app.add_option("--regex", regex, "constrain the output to this regular expression (or @FILE)");
  app.add_option("--grammar", ebnf, "constrain the output to this EBNF grammar, root rule \"root\" (or @FILE)");
  app.add_option("--speculate", f->speculation.max_draft,
                 "speculative decoding: draft up to N tokens a step from the text so far (prompt lookup, "
                 "n-grams), verified in the same pass; 0 = off")
      ->check(CLI::Range(0, 16));
  app.add_option("--ngram-max", f->speculation.max_ngram, "speculation: the longest n-gram looked up")
      ->check(CLI::Range(1, 16));
  app.add_option("--ngram-min", f->speculation.min_ngram, "speculation: the shortest n-gram looked up")
      ->check(CLI::Range(1, 16));
  app.add_flag("--parse-special", f->raw_specials, "recognize special tokens written in the prompt text");
  app.add_option("-t,--threads", f->backend.threads, "CPU threads (0 = all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--block-size", f->block_size, "KV block size in tokens")->check(CLI::Range(1, 1024));
  app.add_option("--backend", f->backend.kind, "compute backend: cpu or cuda");
  app.add_option("--device", f->backend.device, "cuda: device ordinal")->check(CLI::Range(0, 1023));
  app.add_flag("--tf32", f->backend.tf32, "cuda: GEMMs on TF32 tensor cores (changes outputs; off by default)");
  app.add_option("--kv-dtype", f->kv_dtype, "KV cache elements: f16 (default), q8_0 or f32 (the reference)");
  app.add_flag("--fp32-activations", f->backend.fp32_activations,
               "CPU: multiply fp32 activations by the weights as stored (the reference path) instead of "
               "8-bit activations with integer dot products");
  if (auto code = pd::tools::parse_command_line(app, argc, argv, "pd-generate")) return code;
  f->has_prompt = prompt_opt->count() > 0;
  f->has_batch = batch_opt->count() > 0;
  if (f->speculation.min_ngram > f->speculation.max_ngram)
    return fail("--ngram-min " + std::to_string(f->speculation.min_ngram) + " is more than --ngram-max " +
                    std::to_string(f->speculation.max_ngram),
                kExitUsage);
  if (bias_opt->count() > 0) {
    if (std::string err = parse_logit_bias(bias_specs, f); !err.empty()) return fail(err, kExitUsage);
  }
  if (std::string err = parse_grammar_flags(schema, json_object, regex, ebnf, f); !err.empty()) return fail(err, kExitUsage);
  return std::nullopt;
}

// The model file, its tokenizer, and the backend and model, loaded once the prompts are known.
struct Engine {
  std::shared_ptr<const pd::GgufFile> gguf;
  std::unique_ptr<pd::Tokenizer> tok;
  std::unique_ptr<pd::Backend> backend;
  std::unique_ptr<pd::LlamaModel> model;
  pd::GgmlType kv_dtype{};
};

// Opens the model file and its tokenizer into *e.
std::optional<ToolError> open_model(const GenerateFlags& f, Engine* e) {
  ToolError err;
  e->gguf = pd::tools::open_model_file(f.model_path, /*refusal_is_usage=*/false, &err);
  if (!e->gguf) return err;
  auto tok = pd::Tokenizer::from_gguf(*e->gguf);
  if (!tok.is_ok()) return ToolError{tok.status().to_string()};
  e->tok = std::move(tok).value();
  return std::nullopt;
}

// Creates the backend the flags name and loads the model on it.
std::optional<ToolError> load_model(const GenerateFlags& f, Engine* e) {
  auto backend = pd::create_backend(pd::tools::backend_config(f.backend));
  if (!backend.is_ok()) return ToolError{backend.status().to_string() + " (--backend)", kExitUsage};
  e->backend = std::move(backend).value();
  auto model = pd::LlamaModel::load(e->gguf, *e->backend);
  if (!model.is_ok()) return ToolError{model.status().to_string()};
  e->model = std::move(model).value();
  return std::nullopt;
}

// Runs reqs through one batched generate() on a cache of n_blocks blocks.
pd::Result<std::vector<pd::GenerateResult>> run_generate(const GenerateFlags& f, Engine& e,
                                                         std::span<const pd::GenerateRequest> reqs, int64_t n_blocks,
                                                         const pd::GenerateOptions& opt, pd::GenerateStats* stats) {
  PD_ASSIGN_OR_RETURN(auto cache,
                      pd::KvCache::create(*e.backend, e.model->config(), f.block_size, n_blocks, e.kv_dtype));
  pd::KvBlockManager blocks(pd::KvBlockManagerConfig{f.block_size, n_blocks, true});
  pd::GenerateOptions with_grammars = opt;
  std::unique_ptr<pd::GrammarCompiler> grammars;
  if (f.grammar.active()) {
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    PD_ASSIGN_OR_RETURN(grammars, pd::GrammarCompiler::create(*e.tok));
    const auto t1 = Clock::now();
    PD_RETURN_IF_ERROR(grammars->compile(f.grammar));
    const auto t2 = Clock::now();
    PD_RETURN_IF_ERROR(grammars->compile(f.grammar));  // from the cache, as every later request of it
    const auto t3 = Clock::now();
    auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
    std::fprintf(stderr, "[pd-generate] grammar: vocabulary %.1f ms, compile %.2f ms (cold), %.4f ms (cached)\n",
                 ms(t1 - t0), ms(t2 - t1), ms(t3 - t2));
    with_grammars.grammars = grammars.get();
  }
  with_grammars.speculation = f.speculation;
  return pd::generate(*e.model, cache, blocks, reqs, with_grammars, stats);
}

// ---- batch mode

// A --batch line's "messages" array; false if an entry is not {"role": str, "content": str}.
bool messages_from(const nlohmann::json& array, std::vector<pd::ChatMessage>* out) {
  out->clear();
  for (const auto& m : array) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      return false;
    out->push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return true;
}

// The chat template: --chat-template's when given, else the file's.
pd::Result<pd::ChatTemplate> chat_template_of(const GenerateFlags& f, const Engine& e) {
  if (!f.chat_template.empty()) {
    auto t = pd::ChatTemplate::from_name(f.chat_template);
    if (!t.is_ok()) return pd::Status::invalid_argument("--chat-template: " + t.status().message());
    return t;
  }
  return pd::ChatTemplate::from_gguf(*e.gguf);
}

std::optional<ToolError> fill_batch_request(const GenerateFlags& f, const Engine& e,
                                            const pd::Result<pd::ChatTemplate>& tmpl, const nlohmann::json& j,
                                            const std::string& where, bool has_messages, pd::GenerateRequest* req);

// The request of one --batch line; a line the tool cannot use is a usage
// error naming FILE:LINE, a chat template that fails a runtime failure.
std::optional<ToolError> batch_request(const GenerateFlags& f, const Engine& e,
                                       const pd::Result<pd::ChatTemplate>& tmpl, const std::string& line, int line_no,
                                       pd::GenerateRequest* req) {
  const std::string where = f.batch_path + ":" + std::to_string(line_no) + ": ";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const std::exception& ex) {
    return ToolError{where + ex.what(), kExitUsage};
  }
  if (j.is_object()) {
    // A field the tool does not read is refused, as the API refuses one.
    static const char* const kFields[] = {"prompt", "messages", "chat", "max_tokens", "ignore_eos", "temperature", "seed"};
    for (auto it = j.begin(); it != j.end(); ++it)
      if (std::find(std::begin(kFields), std::end(kFields), it.key()) == std::end(kFields))
        return ToolError{where + "unknown field \"" + it.key() +
                             "\" (a line takes prompt or messages, chat, max_tokens, ignore_eos, temperature, seed)",
                         kExitUsage};
  }
  const bool has_messages = j.is_object() && j.contains("messages") && j["messages"].is_array();
  if (!j.is_object() || (!has_messages && (!j.contains("prompt") || !j["prompt"].is_string())))
    return ToolError{where + "needs a string \"prompt\" or a \"messages\" array", kExitUsage};
  try {
    return fill_batch_request(f, e, tmpl, j, where, has_messages, req);
  } catch (const nlohmann::json::exception& ex) {  // a field of the wrong type
    return ToolError{where + ex.what(), kExitUsage};
  }
}

// batch_request's work once the line parsed: nlohmann's type errors reach it as exceptions.
std::optional<ToolError> fill_batch_request(const GenerateFlags& f, const Engine& e,
                                            const pd::Result<pd::ChatTemplate>& tmpl, const nlohmann::json& j,
                                            const std::string& where, bool has_messages, pd::GenerateRequest* req) {
  const bool is_chat = has_messages || j.value("chat", f.chat);
  std::string t = has_messages ? "" : j["prompt"].get<std::string>();
  std::vector<pd::ChatMessage> messages = {{"user", t}};
  if (has_messages && !messages_from(j["messages"], &messages))
    return ToolError{where + "each message needs a string \"role\" and \"content\"", kExitUsage};
  if (is_chat) {
    if (!tmpl.is_ok()) return ToolError{tmpl.status().to_string()};
    auto r = tmpl->encode(*e.tok, messages, true);
    if (!r.is_ok()) return ToolError{r.status().to_string()};
    req->prompt = std::move(r).value();
    req->sampling.stop_token_ids = tmpl->stop_ids(*e.tok);
  } else {
    req->prompt = e.tok->encode(t, false);
    if (e.tok->add_bos() && e.tok->bos_id() >= 0) req->prompt.insert(req->prompt.begin(), e.tok->bos_id());
  }
  req->sampling.max_tokens = j.value("max_tokens", f.n_predict);
  req->sampling.ignore_eos = j.value("ignore_eos", f.ignore_eos);
  req->sampling.temperature = j.value("temperature", f.temp);
  req->sampling.seed = j.value("seed", f.seed);
  req->sampling.logit_bias = f.logit_bias;
  req->sampling.grammar = f.grammar;
  if (auto st = req->sampling.validate(); !st.is_ok()) return ToolError{where + st.message(), kExitUsage};
  return std::nullopt;
}

// Every request of the --batch file, blank lines skipped.
std::optional<ToolError> read_batch(const GenerateFlags& f, const Engine& e, std::vector<pd::GenerateRequest>* reqs) {
  std::string error;
  const auto text = pd::tools::read_input_file(f.batch_path, "--batch file", &error);
  if (!text) return ToolError{error, kExitUsage};
  std::istringstream in(*text);
  const auto tmpl = chat_template_of(f, e);
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    if (line.empty()) continue;
    pd::GenerateRequest req;
    if (auto err = batch_request(f, e, tmpl, line, line_no, &req)) return err;
    reqs->push_back(std::move(req));
  }
  return std::nullopt;
}

// One JSON line per result: its tokens, and its text without EOS and the chat's end-of-turn token.
void print_batch_results(const Engine& e, const std::vector<pd::GenerateRequest>& reqs,
                         const std::vector<pd::GenerateResult>& out) {
  const pd::TokenId eos = e.tok->eos_id();
  for (size_t i = 0; i < out.size(); ++i) {
    const pd::GenerateResult& r = out[i];
    const std::vector<pd::TokenId>& stops = reqs[i].sampling.stop_token_ids;
    pd::StreamDecoder dec(*e.tok);
    std::string text;
    for (pd::TokenId t : r.tokens)
      if (t != eos && std::find(stops.begin(), stops.end(), t) == stops.end()) text += dec.push(t);
    text += dec.flush();
    nlohmann::json o{{"index", i},
                     {"prompt_tokens", reqs[i].prompt.size()},
                     {"completion_tokens", r.tokens.size()},
                     {"tokens", r.tokens},
                     {"text", text},
                     {"finish_reason", r.stop == pd::StopReason::kLength ? "length" : "stop"}};
    std::cout << o.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  }
}

// The stats line on stderr.
void print_stats(const Engine& e, const pd::GenerateStats& stats, size_t generated) {
  const double prefill_tps = stats.prefill_seconds > 0 ? stats.prefill_tokens / stats.prefill_seconds : 0.0;
  const double decode_tps = stats.decode_seconds > 0 ? stats.decode_tokens / stats.decode_seconds : 0.0;
  std::fprintf(stderr,
               "[pd-generate] prompt tokens: %lld | generated: %zu | prefill: %.1f tok/s | decode: %.1f tok/s | "
               "KV bytes/token: %lld (%s) | backend: %s, weights %.1f MB\n",
               static_cast<long long>(stats.prompt_tokens), generated, prefill_tps, decode_tps,
               static_cast<long long>(e.model->config().kv_geometry(e.kv_dtype).bytes_per_token()),
               pd::kv_dtype_name(e.kv_dtype), e.backend->name().c_str(), e.model->weight_bytes() / 1e6);
  if (stats.drafted_tokens > 0 || stats.decode_steps > 0) {
    std::fprintf(stderr, "[pd-generate] decode steps: %lld | drafted: %lld | accepted: %lld\n",
                 static_cast<long long>(stats.decode_steps), static_cast<long long>(stats.drafted_tokens),
                 static_cast<long long>(stats.accepted_tokens));
  }
}

int run_batch(const GenerateFlags& f, Engine& e) {
  std::vector<pd::GenerateRequest> reqs;
  if (auto err = read_batch(f, e, &reqs)) return fail(*err);
  if (auto err = load_model(f, &e)) return fail(*err);
  int64_t tokens_needed = 0;
  for (const auto& r : reqs) {
    if (static_cast<int64_t>(r.prompt.size()) + r.sampling.max_tokens > e.model->config().context)
      return fail("a --batch prompt plus its max_tokens exceeds the model's context", kExitUsage);
    tokens_needed += static_cast<int64_t>(r.prompt.size()) + r.sampling.max_tokens + f.block_size;
  }
  pd::GenerateOptions opt;
  opt.eos_id = e.tok->eos_id();
  pd::GenerateStats stats;
  auto out = run_generate(f, e, reqs, tokens_needed / f.block_size + 1, opt, &stats);
  if (!out.is_ok()) return fail(out.status().to_string());
  print_batch_results(e, reqs, *out);
  size_t generated = 0;
  for (const pd::GenerateResult& r : *out) generated += r.tokens.size();
  print_stats(e, stats, generated);
  return 0;
}

// ---- one prompt

// The prompt's token ids: through the chat template with --chat, BOS first where the model asks for one.
std::optional<ToolError> encode_prompt(const GenerateFlags& f, const Engine& e, std::vector<pd::TokenId>* ids) {
  if (f.chat) {
    // As the router does it: the template's control tokens parsed, the messages' text not.
    auto tmpl = chat_template_of(f, e);
    if (!tmpl.is_ok()) return ToolError{tmpl.status().to_string()};
    std::vector<pd::ChatMessage> msgs;
    if (!f.system_prompt.empty()) msgs.push_back({"system", f.system_prompt});
    msgs.push_back({"user", f.prompt});
    auto encoded = tmpl->encode(*e.tok, msgs, true);
    if (!encoded.is_ok()) return ToolError{encoded.status().to_string()};
    *ids = std::move(encoded).value();
    return std::nullopt;
  }
  // User text parses special-token text only with --parse-special.
  *ids = e.tok->encode(f.prompt, f.raw_specials);
  if (ids->empty()) return ToolError{"the prompt encodes to zero tokens (--prompt)", kExitUsage};
  if (e.tok->add_bos() && e.tok->bos_id() >= 0) ids->insert(ids->begin(), e.tok->bos_id());
  return std::nullopt;
}

// The request of the one prompt, sampled as the flags say.
pd::GenerateRequest single_request(const GenerateFlags& f, std::vector<pd::TokenId> ids) {
  pd::GenerateRequest req;
  req.prompt = std::move(ids);
  req.sampling.temperature = f.temp;
  req.sampling.top_k = f.top_k;
  req.sampling.top_p = f.top_p;
  req.sampling.min_p = f.min_p;
  req.sampling.presence_penalty = f.presence;
  req.sampling.frequency_penalty = f.frequency;
  req.sampling.repetition_penalty = f.repetition;
  req.sampling.min_tokens = f.min_tokens;
  req.sampling.seed = f.seed;
  req.sampling.max_tokens = f.n_predict;
  req.sampling.ignore_eos = f.ignore_eos;
  req.sampling.logit_bias = f.logit_bias;
  req.sampling.grammar = f.grammar;
  return req;
}


// Generates from --prompt, printing the text as it comes, then the stats line.
int run_single(const GenerateFlags& f, Engine& e) {
  std::vector<pd::TokenId> ids;
  if (auto err = encode_prompt(f, e, &ids)) return fail(*err);
  if (auto err = load_model(f, &e)) return fail(*err);
  const pd::LlamaConfig& cfg = e.model->config();
  if (f.min_tokens > f.n_predict)
    return fail("--min-tokens " + std::to_string(f.min_tokens) + " is more than --n-predict " +
                    std::to_string(f.n_predict),
                kExitUsage);
  if (static_cast<int64_t>(ids.size()) + f.n_predict > cfg.context)
    return fail("prompt (" + std::to_string(ids.size()) + " tokens) + --n-predict " + std::to_string(f.n_predict) +
                    " exceeds the model's context length " + std::to_string(cfg.context),
                kExitUsage);
  const int64_t tokens_needed = static_cast<int64_t>(ids.size()) + f.n_predict;
  const int64_t n_blocks = (tokens_needed + f.block_size - 1) / f.block_size + 1;
  pd::GenerateRequest req = single_request(f, std::move(ids));
  if (auto st = req.sampling.validate(); !st.is_ok()) return fail(st.message(), kExitUsage);

  pd::StreamDecoder decoder(*e.tok);
  pd::GenerateOptions opt;
  opt.eos_id = e.tok->eos_id();
  if (f.chat) {
    // A turn ends at the template's end-of-turn tokens (<|im_end|>, <end_of_turn>, ...), which may differ from EOS.
    if (auto tmpl = chat_template_of(f, e); tmpl.is_ok()) req.sampling.stop_token_ids = tmpl->stop_ids(*e.tok);
  }
  opt.on_token = [&](size_t, pd::TokenId t) {
    const pd::StopReason stop = pd::check_stop(req.sampling, t, opt.eos_id, /*n_generated=*/0);
    if (stop == pd::StopReason::kEos || stop == pd::StopReason::kStopToken) return;  // not printed
    std::fputs(decoder.push(t).c_str(), stdout);
    std::fflush(stdout);
  };
  pd::GenerateStats stats;
  auto out = run_generate(f, e, std::span<const pd::GenerateRequest>(&req, 1), n_blocks, opt, &stats);
  if (!out.is_ok()) return fail(out.status().to_string());
  std::fputs(decoder.flush().c_str(), stdout);
  std::fputs("\n", stdout);
  std::fflush(stdout);
  print_stats(e, stats, (*out)[0].tokens.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  GenerateFlags flags;
  if (auto code = parse_flags(argc, argv, &flags)) return *code;
  if (!flags.has_prompt && !flags.has_batch) return fail("one of --prompt or --batch is required", kExitUsage);
  Engine engine;
  const auto kv_dtype = pd::parse_kv_dtype(flags.kv_dtype, "--kv-dtype");
  if (!kv_dtype.is_ok()) return fail(kv_dtype.status().message(), kExitUsage);
  engine.kv_dtype = *kv_dtype;
  if (auto err = open_model(flags, &engine)) return fail(*err);
  // The API refuses a bias on a token past the vocabulary (logit_bias); so does the flag.
  const int32_t vocab = engine.tok->vocab_size();
  for (const auto& [id, bias] : flags.logit_bias)
    if (id >= vocab)
      return fail("--logit-bias: token " + std::to_string(id) + " is outside the vocabulary [0, " +
                      std::to_string(vocab) + ") of " + flags.model_path,
                  kExitUsage);
  return flags.batch_path.empty() ? run_single(flags, engine) : run_batch(flags, engine);
}
