#include "plan/workload.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <random>
#include <sstream>

namespace pd::plan {

double LengthDist::mean() const {
  switch (kind) {
    case Kind::kFixed: return a;
    case Kind::kUniform: return (a + b) / 2;
    case Kind::kExponential: return a;
    case Kind::kLognormal: return a;
  }
  return a;
}

namespace {

Result<double> parse_number(std::string_view s, std::string_view what, std::string_view whole) {
  std::string str(s);
  char* end = nullptr;
  const double v = std::strtod(str.c_str(), &end);
  if (str.empty() || end != str.c_str() + str.size() || !std::isfinite(v)) {
    return Status::invalid_argument(std::string(what) + ": bad number '" + str + "' in '" + std::string(whole) + "'");
  }
  return v;
}

}  // namespace

Result<LengthDist> parse_length_dist(std::string_view text, std::string_view what) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon == std::string_view::npos ? std::string_view::npos : colon - start));
    if (colon == std::string_view::npos) break;
    start = colon + 1;
  }
  const std::string usage = " (expected N, fixed:N, uniform:LO:HI, exp:MEAN or lognormal:MEAN:SIGMA)";
  LengthDist d;
  std::string kind(parts[0]);
  std::vector<double> nums;
  size_t first_num = 1;
  if (parts.size() == 1 && !kind.empty() && (std::isdigit(static_cast<unsigned char>(kind[0])) || kind[0] == '-')) {
    kind = "fixed";
    first_num = 0;
  }
  for (size_t i = first_num; i < parts.size(); ++i) {
    PD_ASSIGN_OR_RETURN(double v, parse_number(parts[i], what, text));
    nums.push_back(v);
  }
  auto bad = [&](const std::string& why) {
    return Status::invalid_argument(std::string(what) + ": " + why + " in '" + std::string(text) + "'" + usage);
  };
  if (kind == "fixed") {
    if (nums.size() != 1) return bad("fixed takes one value");
    d.kind = LengthDist::Kind::kFixed;
    d.a = nums[0];
    if (d.a < 1) return bad("length must be at least 1");
  } else if (kind == "uniform") {
    if (nums.size() != 2) return bad("uniform takes LO:HI");
    d.kind = LengthDist::Kind::kUniform;
    d.a = nums[0];
    d.b = nums[1];
    if (d.a < 1 || d.b < d.a) return bad("uniform needs 1 <= LO <= HI");
  } else if (kind == "exp" || kind == "exponential") {
    if (nums.size() != 1) return bad("exp takes MEAN");
    d.kind = LengthDist::Kind::kExponential;
    d.a = nums[0];
    if (d.a < 1) return bad("mean must be at least 1");
  } else if (kind == "lognormal") {
    if (nums.size() != 2) return bad("lognormal takes MEAN:SIGMA");
    d.kind = LengthDist::Kind::kLognormal;
    d.a = nums[0];
    d.b = nums[1];
    if (d.a < 1 || d.b < 0 || d.b > 5) return bad("lognormal needs MEAN >= 1 and 0 <= SIGMA <= 5");
  } else {
    return bad("unknown distribution '" + kind + "'");
  }
  const double hi = d.kind == LengthDist::Kind::kUniform ? d.b : d.a;
  if (hi > static_cast<double>(d.max)) return bad("length above " + std::to_string(d.max));
  return d;
}

std::string length_dist_to_string(const LengthDist& d) {
  std::ostringstream s;
  switch (d.kind) {
    case LengthDist::Kind::kFixed: s << "fixed:" << d.a; break;
    case LengthDist::Kind::kUniform: s << "uniform:" << d.a << ":" << d.b; break;
    case LengthDist::Kind::kExponential: s << "exp:" << d.a; break;
    case LengthDist::Kind::kLognormal: s << "lognormal:" << d.a << ":" << d.b; break;
  }
  return s.str();
}

Status validate_workload(const Workload& w) {
  if (!(w.arrival_rate > 0) || !std::isfinite(w.arrival_rate)) {
    return Status::invalid_argument("rate: arrival rate must be positive, got " + std::to_string(w.arrival_rate));
  }
  for (size_t i = 0; i < w.trace.size(); ++i) {
    const DrawnRequest& r = w.trace[i];
    if (r.prompt < 1 || r.output < 1 || !std::isfinite(r.arrival) || r.arrival < 0 ||
        (i > 0 && r.arrival < w.trace[i - 1].arrival)) {
      return Status::invalid_argument("trace: request " + std::to_string(i) +
                                      " needs lengths >= 1 and an arrival no earlier than the one before");
    }
  }
  if (w.num_requests <= 0 || w.num_requests > 100'000'000) {
    return Status::invalid_argument("requests: must be in [1, 1e8], got " + std::to_string(w.num_requests));
  }
  return Status::ok();
}

namespace {

// Deterministic uniform/exponential/normal draws from a 64-bit Mersenne twister
// (the std:: distributions differ between standard libraries).
class Stream {
 public:
  explicit Stream(uint64_t seed) : engine_(seed) {}
  double uniform_open() { return (static_cast<double>(engine_() >> 11) + 0.5) * 0x1.0p-53; }  // (0, 1)
  double exponential(double mean) { return -mean * std::log(uniform_open()); }
  double normal() {
    const double u1 = uniform_open(), u2 = uniform_open();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::mt19937_64 engine_;
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

int64_t draw_length(const LengthDist& d, Stream& s) {
  double v = d.a;
  switch (d.kind) {
    case LengthDist::Kind::kFixed: v = d.a; break;
    case LengthDist::Kind::kUniform: v = std::floor(d.a + s.uniform_open() * (d.b - d.a + 1)); break;
    case LengthDist::Kind::kExponential: v = s.exponential(d.a); break;
    case LengthDist::Kind::kLognormal: {
      const double mu = std::log(d.a) - d.b * d.b / 2;  // so that the mean is d.a
      v = std::exp(mu + d.b * s.normal());
      break;
    }
  }
  const int64_t n = static_cast<int64_t>(std::llround(std::min(v, 1e15)));
  return std::clamp(n, d.min, d.max);
}

}  // namespace

std::vector<DrawnRequest> draw_workload(const Workload& w) {
  if (!w.trace.empty()) return w.trace;
  std::vector<DrawnRequest> out(static_cast<size_t>(w.num_requests));
  Stream arrivals(splitmix64(w.seed * 3 + 0));
  Stream prompts(splitmix64(w.seed * 3 + 1));
  Stream outputs(splitmix64(w.seed * 3 + 2));
  double t = 0;
  for (DrawnRequest& r : out) {
    t += w.poisson ? arrivals.exponential(1.0 / w.arrival_rate) : 1.0 / w.arrival_rate;
    r.arrival = t;
    r.prompt = static_cast<int32_t>(draw_length(w.prompt, prompts));
    r.output = static_cast<int32_t>(draw_length(w.output, outputs));
  }
  return out;
}

Result<Workload> trace_workload(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::invalid_argument("--trace: cannot open '" + path + "'");
  Workload w;
  std::string line;
  int64_t line_no = 0;
  double prompt_sum = 0, output_sum = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = "--trace: " + path + ":" + std::to_string(line_no) + ": ";
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return Status::invalid_argument(where + "not a JSON object");
    for (const char* key : {"timestamp", "input_length", "output_length"}) {
      if (!j.contains(key) || !j[key].is_number() || !std::isfinite(j[key].get<double>()) || j[key].get<double>() < 0) {
        return Status::invalid_argument(where + "field '" + key + "' must be a non-negative number");
      }
    }
    DrawnRequest r;
    r.arrival = j["timestamp"].get<double>() / 1000.0;
    const double in_len = j["input_length"].get<double>(), out_len = j["output_length"].get<double>();
    if (in_len < 1 || out_len < 1 || in_len > 1e8 || out_len > 1e8) {
      return Status::invalid_argument(where + "input_length and output_length must be in [1, 1e8]");
    }
    r.prompt = static_cast<int32_t>(in_len);
    r.output = static_cast<int32_t>(out_len);
    if (!w.trace.empty() && r.arrival < w.trace.back().arrival) {
      return Status::invalid_argument(where + "timestamp earlier than the line before (sort the trace)");
    }
    prompt_sum += r.prompt;
    output_sum += r.output;
    w.trace.push_back(r);
  }
  if (w.trace.empty()) return Status::invalid_argument("--trace: no requests in '" + path + "'");
  const double n = static_cast<double>(w.trace.size());
  const double span = w.trace.back().arrival - w.trace.front().arrival;
  w.num_requests = static_cast<int64_t>(w.trace.size());
  w.arrival_rate = span > 0 ? (n - 1) / span : n;
  w.prompt.kind = w.output.kind = LengthDist::Kind::kFixed;
  w.prompt.a = std::max(1.0, prompt_sum / n);
  w.output.a = std::max(1.0, output_sum / n);
  return w;
}

}  // namespace pd::plan
