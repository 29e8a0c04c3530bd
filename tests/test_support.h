// Helpers shared by the test executables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pd::test {

// Exit code CTest reads as "skipped" (SKIP_RETURN_CODE in tests/CMakeLists.txt).
inline constexpr int kSkipExitCode = 77;

// Prints "SKIPPED: <reason>" and ends the process with kSkipExitCode, so CTest
// reports the test as skipped, never as passed. Each Catch2 test case runs in
// its own process under CTest, so this skips exactly one test.
[[noreturn]] void skip(const std::string& reason);

// Path of the default model (models/SmolLM2-135M-Instruct.Q4_1.gguf), or the
// PD_MODEL environment variable when set.
std::string default_model_path();
// Skips the current test when the default model file is absent.
void require_default_model();
// Path of Gemma 3 270M (models/gemma-3-270m-q4_k_m.gguf, from
// scripts/fetch_model.sh gemma3-270m), or PD_GEMMA_MODEL when set; and a skip
// naming the fetch command when it is absent.
std::string gemma3_model_path();
void require_gemma3_model();

std::string test_data_dir();

// n floats drawn from N(0, scale^2), reproducible from the seed.
std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f);

}  // namespace pd::test
