// pd-make-tiny-model: writes a tiny random-weight Llama GGUF (byte-level
// tokenizer, ChatML template) for tests that need a model file but no real
// weights: the cluster tests start whole MPI jobs on it in a second.
//
//   pd-make-tiny-model -o tiny.gguf [--layers 2] [--context 512] [--seed 1]
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>

#include "gguf/gguf_writer.h"
#include "tool_common.h"

int main(int argc, char** argv) {
  std::string out;
  pd::TinyLlamaSpec spec;
  spec.context = 512;
  CLI::App app{"pd-make-tiny-model: write a tiny random Llama GGUF for tests"};
  app.add_option("-o,--output", out, "output .gguf path")->required();
  app.add_option("--layers", spec.n_layers, "transformer layers")->check(CLI::Range(1, 64));
  app.add_option("--context", spec.context, "context length")->check(CLI::Range(16, 1 << 20));
  app.add_option("--seed", spec.seed, "weight seed");
  if (auto code = pd::tools::parse_command_line(app, argc, argv, "pd-make-tiny-model")) return *code;
  const std::vector<uint8_t> bytes = pd::make_tiny_llama_gguf(spec);
  std::ofstream f(out, std::ios::binary);
  if (!f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()))) {
    std::fprintf(stderr, "pd-make-tiny-model: cannot write '%s' (--output)\n", out.c_str());
    return 1;
  }
  return 0;
}
