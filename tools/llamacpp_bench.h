// llama.cpp measured beside pd-bench-engine, in the same run: its llama-bench
// (prefill of one prompt) and llama-batched-bench (aggregate decode of b
// sequences) from a llama.cpp build directory, on the same GGUF file and
// thread count, each with flash attention off and on (the better is kept, as
// one would configure it). Nothing of llama.cpp is linked: the two programs
// are run and their JSON output read.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace pd::tools {

struct LlamaCppFigures {
  std::string build;                   // llama.cpp's build commit, as it reports it
  std::map<int, double> prefill_tps;   // prompt tokens -> tok/s, best of flash attention off/on
  std::map<int, int> prefill_fa;       // ... and which (0 off, 1 on)
  std::map<int, double> decode_tps;    // batch -> aggregate decode tok/s
  std::map<int, int> decode_fa;
  std::string error;                   // set when a program is missing or failed
};

// The programs' paths under `dir` (dir itself, or its bin/).
std::string llamacpp_program(const std::string& dir, const std::string& name);

// Runs both programs. Decode rows: `prompt` tokens per sequence, `gen`
// generated, batches `batches` (llama-batched-bench's -npp/-ntg/-npl).
LlamaCppFigures run_llamacpp(const std::string& dir, const std::string& model, int threads,
                             const std::vector<int>& prefill_lengths, int prompt, int gen,
                             const std::vector<int>& batches, int reps);

}  // namespace pd::tools
