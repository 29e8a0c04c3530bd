#include "tool_common.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

namespace pd::tools {

int report_error(const char* tool, const std::string& message, int exit_code) {
  std::fprintf(stderr, "%s: error: %s\n", tool, message.c_str());
  return exit_code;
}

std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, const char* tool) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return report_error(tool, e.what(), kExitUsage);
  }
  return std::nullopt;
}

std::shared_ptr<const GgufFile> open_model_file(const std::string& path, bool refusal_is_usage, ToolError* err) {
  if (!std::filesystem::exists(path)) {
    *err = {"model file not found: " + path + " (--model)", kExitUsage};
    return nullptr;
  }
  auto file = GgufFile::open(path);
  if (!file.is_ok()) {
    *err = refusal_is_usage ? ToolError{file.status().to_string() + " (--model)", kExitUsage}
                            : ToolError{file.status().to_string(), kExitFailure};
    return nullptr;
  }
  return std::shared_ptr<const GgufFile>(std::move(file).value());
}

BackendConfig backend_config(const BackendFlags& f) {
  BackendConfig bc;
  bc.kind = f.kind;
  bc.n_threads = f.threads;
  bc.int8_activations = !f.fp32_activations;
  bc.device = f.device;
  bc.cuda_tf32 = f.tf32;
  return bc;
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

CLI::Validator writable_file() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        const std::filesystem::path p(path);
        const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
        std::error_code ec;
        if (!std::filesystem::is_directory(dir, ec)) return "directory '" + dir.string() + "' does not exist";
        if (std::filesystem::is_directory(p, ec)) return "'" + path + "' is a directory";
        const bool exists = std::filesystem::exists(p, ec);
        if (::access(exists ? path.c_str() : dir.c_str(), W_OK) != 0)
          return "cannot write '" + path + "'" + (exists ? "" : " (directory '" + dir.string() + "' is not writable)");
        return "";
      },
      "FILE (writable)");
}

std::optional<std::string> read_input_file(const std::string& path, const std::string& flag, std::string* error) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    *error = "cannot read " + flag + " '" + path + "': it is a directory";
    return std::nullopt;
  }
  std::ifstream in(path, std::ios::binary);
  if (in) {
    std::ostringstream all;
    all << in.rdbuf();
    if (!in.bad()) return all.str();
  }
  *error = "cannot read " + flag + " '" + path + "'";
  return std::nullopt;
}

bool write_json_file(const std::string& path, const nlohmann::json& j) {
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  return static_cast<bool>(f);
}

}  // namespace pd::tools
