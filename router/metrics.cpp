#include "router/metrics.h"

#include <algorithm>
#include <cassert>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

namespace pd::router {
namespace {

[[maybe_unused]] bool valid_name(const std::string& name) {  // used by asserts
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// "{pairs}" or "" when there are none.
std::string braced(const std::string& pairs) { return pairs.empty() ? std::string() : "{" + pairs + "}"; }

void append_sample(std::string& out, const std::string& name, const std::string& pairs, double v) {
  out += name;
  out += braced(pairs);
  out += ' ';
  out += format_metric_value(v);
  out += '\n';
}

}  // namespace

const std::vector<double>& default_latency_buckets() {
  static const std::vector<double> kBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                               1.0,   2.5,  5.0,   10.0, 20.0, 30.0, 60.0};
  return kBuckets;
}

std::string escape_label_value(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string escape_help(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string format_metric_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v);  // shortest round-trip form
  return std::string(buf, res.ptr);
}

// ---- Metric ----

Metric::Metric(std::string name, std::string help, std::vector<std::string> label_names)
    : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)) {
  assert(valid_name(name_) && "invalid Prometheus metric name");
  for ([[maybe_unused]] const std::string& l : label_names_) assert(valid_name(l) && l != "le");
}

void Metric::render(std::string& out) const {
  out += "# HELP " + name_ + " " + escape_help(help_) + "\n";
  out += "# TYPE " + name_ + " " + type() + "\n";
  render_samples(out);
}

std::string Metric::label_pairs(const LabelValues& values) const {
  std::string out;
  for (size_t i = 0; i < label_names_.size(); ++i) {
    if (i > 0) out += ',';
    out += label_names_[i];
    out += "=\"";
    out += escape_label_value(i < values.size() ? values[i] : std::string());
    out += '"';
  }
  return out;
}

LabelValues Metric::normalized(const LabelValues& values) const {
  assert(values.size() == label_names_.size() && "label values do not match the metric's label names");
  if (values.size() == label_names_.size()) return values;
  LabelValues v = values;
  v.resize(label_names_.size());
  return v;
}

// ---- Counter ----

void Counter::Child::inc(double v) {
  if (!(v >= 0.0)) return;  // a counter never decreases (also drops NaN)
  value_.fetch_add(v, std::memory_order_relaxed);
}

Counter::Counter(std::string name, std::string help, std::vector<std::string> label_names)
    : Metric(std::move(name), std::move(help), std::move(label_names)) {
  if (this->label_names().empty()) with({});  // an unlabelled counter renders 0 from the start
}

Counter::Child& Counter::with(const LabelValues& values) {
  if (values.size() == label_names().size()) return children_.get(values, [] { return std::make_unique<Child>(); });
  return children_.get(normalized(values), [] { return std::make_unique<Child>(); });
}

void Counter::render_samples(std::string& out) const {
  children_.for_each([&](const LabelValues& values, const Child& c) {
    append_sample(out, name(), label_pairs(values), c.value());
  });
}

// ---- Gauge ----

Gauge::Gauge(std::string name, std::string help, std::vector<std::string> label_names)
    : Metric(std::move(name), std::move(help), std::move(label_names)) {
  if (this->label_names().empty()) with({});
}

Gauge::Child& Gauge::with(const LabelValues& values) {
  if (values.size() == label_names().size()) return children_.get(values, [] { return std::make_unique<Child>(); });
  return children_.get(normalized(values), [] { return std::make_unique<Child>(); });
}

void Gauge::render_samples(std::string& out) const {
  children_.for_each([&](const LabelValues& values, const Child& c) {
    append_sample(out, name(), label_pairs(values), c.value());
  });
}

// ---- Histogram ----

Histogram::Child::Child(const std::vector<double>* bounds)
    : bounds_(bounds), counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds->size() + 1)) {}

void Histogram::Child::observe(double v) {
  // Bucket i counts v <= bounds[i]; the last one (+Inf) the rest, NaN included.
  const size_t i = std::isnan(v) ? bounds_->size()
                                 : static_cast<size_t>(std::lower_bound(bounds_->begin(), bounds_->end(), v) -
                                                       bounds_->begin());
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

uint64_t Histogram::Child::count() const {
  uint64_t n = 0;
  for (size_t i = 0; i <= bounds_->size(); ++i) n += counts_[i].load(std::memory_order_relaxed);
  return n;
}

std::vector<uint64_t> Histogram::Child::cumulative_counts() const {
  std::vector<uint64_t> out(bounds_->size() + 1);
  uint64_t n = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    n += counts_[i].load(std::memory_order_relaxed);
    out[i] = n;
  }
  return out;
}

namespace {
// Finite, sorted, without duplicates; a trailing +Inf is implicit and dropped.
std::vector<double> clean_bounds(std::vector<double> bounds) {
  assert(std::is_sorted(bounds.begin(), bounds.end()) && "histogram bounds must be increasing");
  std::erase_if(bounds, [](double b) { return !std::isfinite(b); });
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  return bounds;
}
}  // namespace

Histogram::Histogram(std::string name, std::string help, std::vector<double> bounds,
                     std::vector<std::string> label_names)
    : Metric(std::move(name), std::move(help), std::move(label_names)), bounds_(clean_bounds(std::move(bounds))) {
  if (this->label_names().empty()) with({});
}

Histogram::Child& Histogram::with(const LabelValues& values) {
  auto make = [this] { return std::make_unique<Child>(&bounds_); };
  if (values.size() == label_names().size()) return children_.get(values, make);
  return children_.get(normalized(values), make);
}

void Histogram::render_samples(std::string& out) const {
  children_.for_each([&](const LabelValues& values, const Child& c) {
    const std::string pairs = label_pairs(values);
    const std::string sep = pairs.empty() ? "" : ",";
    const std::vector<uint64_t> cum = c.cumulative_counts();
    for (size_t i = 0; i < cum.size(); ++i) {
      const std::string le = i < bounds_.size() ? format_metric_value(bounds_[i]) : "+Inf";
      append_sample(out, name() + "_bucket", pairs + sep + "le=\"" + le + "\"", static_cast<double>(cum[i]));
    }
    append_sample(out, name() + "_sum", pairs, c.sum());
    // _count equals the +Inf bucket of the same snapshot, even while others observe.
    append_sample(out, name() + "_count", pairs, static_cast<double>(cum.back()));
  });
}

// ---- Registry ----

template <typename M, typename... Args>
M& Registry::get_or_create(const std::string& name, Args&&... args) {
  std::lock_guard lock(mu_);
  for (const auto& m : metrics_) {
    if (m->name() != name) continue;
    if (auto* typed = dynamic_cast<M*>(m.get())) return *typed;
    std::fprintf(stderr, "pd::router::Registry: metric %s registered twice with different kinds\n", name.c_str());
    std::abort();
  }
  auto metric = std::make_unique<M>(name, std::forward<Args>(args)...);
  M& ref = *metric;
  metrics_.push_back(std::move(metric));
  return ref;
}

Counter& Registry::counter(const std::string& name, const std::string& help, std::vector<std::string> label_names) {
  return get_or_create<Counter>(name, help, std::move(label_names));
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, std::vector<std::string> label_names) {
  return get_or_create<Gauge>(name, help, std::move(label_names));
}

Histogram& Registry::histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                               std::vector<std::string> label_names) {
  return get_or_create<Histogram>(name, help, std::move(bounds), std::move(label_names));
}

std::string Registry::render() const {
  std::string out;
  std::lock_guard lock(mu_);
  for (const auto& m : metrics_) m->render(out);
  return out;
}

}  // namespace pd::router
