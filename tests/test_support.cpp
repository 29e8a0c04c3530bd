#include "test_support.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

namespace pd::test {

void skip(const std::string& reason) {
  std::printf("SKIPPED: %s\n", reason.c_str());
  std::fflush(stdout);
  std::_Exit(kSkipExitCode);
}

std::string default_model_path() {
  if (const char* env = std::getenv("PD_MODEL"); env && *env) return env;
  return std::string(PD_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

void require_default_model() {
  const std::string path = default_model_path();
  if (!std::filesystem::exists(path)) {
    skip("default model not found at " + path + " (run scripts/fetch_model.sh)");
  }
}

std::string gemma3_model_path() {
  if (const char* env = std::getenv("PD_GEMMA_MODEL"); env && *env) return env;
  return std::string(PD_SOURCE_DIR) + "/models/gemma-3-270m-q4_k_m.gguf";
}

void require_gemma3_model() {
  const std::string path = gemma3_model_path();
  if (!std::filesystem::exists(path)) skip("Gemma 3 270M not found at " + path + " (run scripts/fetch_model.sh gemma3-270m)");
}

std::string test_data_dir() { return PD_TEST_DATA_DIR; }

std::vector<float> random_floats(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace pd::test
