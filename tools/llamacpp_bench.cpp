#include "llamacpp_bench.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

namespace pd::tools {
namespace {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string join(const std::vector<int>& v) {
  std::string out;
  for (int x : v) out += (out.empty() ? "" : ",") + std::to_string(x);
  return out;
}

// stdout of `cmd` (stderr discarded); false if it could not run or failed.
bool run_capture(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) return false;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  return pclose(p) == 0;
}

// llama-bench -o json: one object per (prompt length, flash attention) test.
std::string read_llama_bench(const std::string& text, LlamaCppFigures* f) {
  const auto j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_array()) return "llama-bench printed no JSON array";
  for (const auto& t : j) {
    const int n = t.value("n_prompt", 0), fa = t.value("flash_attn", false) ? 1 : 0;
    const double tps = t.value("avg_ts", 0.0);
    if (n <= 0 || t.value("n_gen", 0) != 0) continue;
    f->build = t.value("build_commit", std::string());
    if (tps > f->prefill_tps[n]) f->prefill_tps[n] = tps, f->prefill_fa[n] = fa;
  }
  return "";
}

// llama-batched-bench --output-format jsonl: one object per batch size.
std::string read_batched_bench(const std::string& text, int fa, LlamaCppFigures* f) {
  std::istringstream in(text);
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("speed_tg")) continue;
    const int b = j.value("pl", 0);
    const double tps = j.value("speed_tg", 0.0);
    ++rows;
    if (b > 0 && tps > f->decode_tps[b]) f->decode_tps[b] = tps, f->decode_fa[b] = fa;
  }
  return rows > 0 ? "" : "llama-batched-bench printed no results";
}

}  // namespace

std::string llamacpp_program(const std::string& dir, const std::string& name) {
  for (const std::string& p : {dir + "/" + name, dir + "/bin/" + name})
    if (std::filesystem::is_regular_file(p)) return p;
  return "";
}

LlamaCppFigures run_llamacpp(const std::string& dir, const std::string& model, int threads,
                             const std::vector<int>& prefill_lengths, int prompt, int gen,
                             const std::vector<int>& batches, int reps) {
  LlamaCppFigures f;
  const std::string bench = llamacpp_program(dir, "llama-bench"), batched = llamacpp_program(dir, "llama-batched-bench");
  if (bench.empty() || batched.empty()) {
    f.error = "no llama-bench and llama-batched-bench in " + dir + " (or its bin/)";
    return f;
  }
  const std::string t = std::to_string(threads);
  std::string out;
  const std::string cmd = shell_quote(bench) + " -m " + shell_quote(model) + " -p " + join(prefill_lengths) +
                          " -n 0 -t " + t + " -fa 0,1 -r " + std::to_string(reps) + " -o json";
  if (!run_capture(cmd, &out)) {
    f.error = "llama-bench failed: " + cmd;
    return f;
  }
  if (std::string e = read_llama_bench(out, &f); !e.empty()) {
    f.error = e;
    return f;
  }
  int max_batch = 1;
  for (int b : batches) max_batch = std::max(max_batch, b);
  const std::string ctx = std::to_string(max_batch * (prompt + gen) + 64);
  for (int fa : {0, 1}) {
    out.clear();
    const std::string bcmd = shell_quote(batched) + " -m " + shell_quote(model) + " -c " + ctx + " -b 2048 -ub 512" +
                             " -npp " + std::to_string(prompt) + " -ntg " + std::to_string(gen) + " -npl " +
                             join(batches) + " -t " + t + " -tb " + t + (fa ? " -fa" : "") +
                             " --output-format jsonl";
    if (!run_capture(bcmd, &out)) {
      f.error = "llama-batched-bench failed: " + bcmd;
      return f;
    }
    if (std::string e = read_batched_bench(out, fa, &f); !e.empty()) {
      f.error = e;
      return f;
    }
  }
  return f;
}

}  // namespace pd::tools
