// What the command-line tools share: how they parse the command line, report
// an error and exit, how they open the model --model names, the backend their flags describe, the
// clock their measurements use, and how they write a JSON results file.
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"

namespace pd::tools {

// Exit statuses: a bad flag or a file a flag names, and a failure at run time.
inline constexpr int kExitUsage = 2;
inline constexpr int kExitFailure = 1;

// Prints "TOOL: error: MESSAGE" on stderr; returns exit_code, for `return fail(...)`.
int report_error(const char* tool, const std::string& message, int exit_code);

// Parses the command line with app. Returns the exit status when the tool
// stops here: --help (printed, 0), or a bad flag ("TOOL: error: ..." on
// stderr, kExitUsage); nothing when it goes on.
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, const char* tool);

// An error a tool stops on: the message it prints and the exit status.
struct ToolError {
  std::string message;
  int exit_code = kExitFailure;
};

// Opens the GGUF file --model names. No such file: a usage error
// "model file not found: PATH (--model)". A file the reader refuses: the
// reader's status, as a usage error naming --model where refusal_is_usage,
// else as a runtime failure. Returns null with *err set on failure.
std::shared_ptr<const GgufFile> open_model_file(const std::string& path, bool refusal_is_usage, ToolError* err);

// The flags that pick a compute backend, as the tools spell them.
struct BackendFlags {
  std::string kind = "cpu";       // --backend
  int threads = 0;                // --threads: CPU threads, 0 = all cores
  bool fp32_activations = false;  // --fp32-activations: the CPU reference path
  int device = 0;                 // --device: CUDA ordinal
  bool tf32 = false;              // --tf32: CUDA GEMMs on TF32 tensor cores
};
BackendConfig backend_config(const BackendFlags& f);

// The clock of the benchmarks, and a duration in seconds.
using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d);
// The upper median (the element at size/2 once sorted); 0 for an empty vector.
double median(std::vector<double> v);

// The whole of the file a flag names (`flag`: e.g. "--file"), or an error
// message naming the flag and the path: missing, a directory, unreadable.
std::optional<std::string> read_input_file(const std::string& path, const std::string& flag, std::string* error);

// Writes j (2-space indent, a trailing newline) to path; false when the file
// cannot be written.
bool write_json_file(const std::string& path, const nlohmann::json& j);
// A check for an output file flag (--json FILE): its directory exists and the
// file can be written there — refused on the command line, not after a long run.
CLI::Validator writable_file();

// Printed by the benchmarks when the ISA path they run (PD_CPU_ISA) was
// compiled with AVX-512's 32 registers (cpu::isa_built_with_avx512).
inline constexpr const char* kWideNarrowIsaNote =
    "# note: this build compiled the AVX2 / AVX-VNNI kernels with AVX-512's 32 registers (-march=native on this CPU):"
    " not what a CPU without AVX-512 runs. For its figures build with -DPD_NATIVE=OFF"
    " -DCMAKE_CXX_FLAGS=-march=znver2 (docs/ARCHITECTURE.md)\n";

}  // namespace pd::tools
