// The metrics facade over prometheus-cpp (see metrics.h): series and their
// updates are prometheus-cpp's; what is here is the label-values calling
// convention and the order /metrics shows things in.
#include "router/metrics.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

namespace pd::router {

const std::vector<double>& default_latency_buckets() {
  static const std::vector<double> kBuckets = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                               1.0,   2.5,  5.0,   10.0, 20.0, 30.0, 60.0};
  return kBuckets;
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

// ---- Metric ----

namespace {
prometheus::MetricType type_of(const std::string& type) {
  if (type == "counter") return prometheus::MetricType::Counter;
  if (type == "gauge") return prometheus::MetricType::Gauge;
  return prometheus::MetricType::Histogram;
}
}  // namespace

Metric::Metric(std::string name, std::string help, std::vector<std::string> label_names)
    : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)) {
  for ([[maybe_unused]] const std::string& l : label_names_) assert(l != "le" && "le is a histogram's own label");
}

LabelValues Metric::normalized(const LabelValues& values) const {
  assert(values.size() == label_names_.size() && "label values do not match the metric's label names");
  LabelValues v = values;
  v.resize(label_names_.size());
  return v;
}

std::map<std::string, std::string> Metric::labels_of(const LabelValues& values) const {
  std::map<std::string, std::string> labels;
  for (size_t i = 0; i < label_names_.size(); ++i) labels.emplace(label_names_[i], values[i]);
  return labels;
}

prometheus::MetricFamily Metric::collect() const {
  std::vector<prometheus::MetricFamily> collected = collect_children();
  prometheus::MetricFamily family = collected.empty() ? prometheus::MetricFamily{} : std::move(collected.front());
  family.name = name_;  // (collected.empty(): HELP and TYPE alone, as before any child)
  family.type = type_of(type());
  // prometheus-cpp 1.0's TextSerializer writes HELP as given.
  family.help = escape_help(help_);
  // prometheus-cpp files labels by name: put them back in declared order (the
  // order scrapers of /metrics match series by), then sort the children by them.
  auto rank = [this](const prometheus::ClientMetric::Label& l) {
    return std::find(label_names_.begin(), label_names_.end(), l.name) - label_names_.begin();
  };
  for (prometheus::ClientMetric& m : family.metric) {
    std::sort(m.label.begin(), m.label.end(), [&](const auto& a, const auto& b) { return rank(a) < rank(b); });
  }
  std::sort(family.metric.begin(), family.metric.end(), [](const auto& a, const auto& b) {
    return std::lexicographical_compare(a.label.begin(), a.label.end(), b.label.begin(), b.label.end(),
                                        [](const auto& x, const auto& y) { return x.value < y.value; });
  });
  return family;
}

// ---- Counter ----

void Counter::Child::inc(double v) {
  if (!(v >= 0.0)) return;  // a counter never decreases (also drops NaN)
  c_.Increment(v);
}

double Counter::Child::value() const { return c_.Value(); }

Counter::Counter(prometheus::Registry& registry, std::string name, std::string help,
                 std::vector<std::string> label_names)
    : Metric(std::move(name), std::move(help), std::move(label_names)),
      family_(prometheus::BuildCounter().Name(this->name()).Register(registry)) {
  if (this->label_names().empty()) with({});  // an unlabelled counter shows 0 from the start
}

Counter::Child& Counter::with(const LabelValues& values) {
  if (values.size() != label_names().size()) return with(normalized(values));
  return children_.get(values, [&] { return std::make_unique<Child>(family_.Add(labels_of(values))); });
}

std::vector<prometheus::MetricFamily> Counter::collect_children() const { return family_.Collect(); }

// ---- Gauge ----

void Gauge::Child::set(double v) { g_.Set(v); }
void Gauge::Child::add(double d) { g_.Increment(d); }
double Gauge::Child::value() const { return g_.Value(); }

Gauge::Gauge(prometheus::Registry& registry, std::string name, std::string help, std::vector<std::string> label_names)
    : Metric(std::move(name), std::move(help), std::move(label_names)),
      family_(prometheus::BuildGauge().Name(this->name()).Register(registry)) {
  if (this->label_names().empty()) with({});
}

Gauge::Child& Gauge::with(const LabelValues& values) {
  if (values.size() != label_names().size()) return with(normalized(values));
  return children_.get(values, [&] { return std::make_unique<Child>(family_.Add(labels_of(values))); });
}

std::vector<prometheus::MetricFamily> Gauge::collect_children() const { return family_.Collect(); }

// ---- Histogram ----

void Histogram::Child::observe(double v) {
  if (!std::isnan(v)) return h_.Observe(v);
  // prometheus-cpp 1.0 counts NaN in the first bucket: count it in +Inf only,
  // as the facade always did (no bound is >= NaN).
  std::vector<double> one_in_inf(n_bounds_ + 1, 0.0);
  one_in_inf.back() = 1;
  h_.ObserveMultiple(one_in_inf, v);
}

uint64_t Histogram::Child::count() const { return h_.Collect().histogram.sample_count; }

double Histogram::Child::sum() const { return h_.Collect().histogram.sample_sum; }

std::vector<uint64_t> Histogram::Child::cumulative_counts() const {
  std::vector<uint64_t> out;
  for (const auto& b : h_.Collect().histogram.bucket) out.push_back(b.cumulative_count);
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

Histogram::Histogram(prometheus::Registry& registry, std::string name, std::string help, std::vector<double> bounds,
                     std::vector<std::string> label_names)
    : Metric(std::move(name), std::move(help), std::move(label_names)),
      bounds_(clean_bounds(std::move(bounds))),
      family_(prometheus::BuildHistogram().Name(this->name()).Register(registry)) {
  if (this->label_names().empty()) with({});
}

Histogram::Child& Histogram::with(const LabelValues& values) {
  if (values.size() != label_names().size()) return with(normalized(values));
  return children_.get(values,
                       [&] { return std::make_unique<Child>(family_.Add(labels_of(values), bounds_), bounds_.size()); });
}

std::vector<prometheus::MetricFamily> Histogram::collect_children() const { return family_.Collect(); }

// ---- Registry ----

Registry::Registry() : families_(std::make_unique<prometheus::Registry>()) {}

Registry::~Registry() = default;

template <typename M, typename... Args>
M& Registry::get_or_create(const std::string& name, Args&&... args) {
  std::lock_guard lock(mu_);
  for (const auto& m : metrics_) {
    if (m->name() != name) continue;
    if (auto* typed = dynamic_cast<M*>(m.get())) return *typed;
    std::fprintf(stderr, "pd::router::Registry: metric %s registered twice with different kinds\n", name.c_str());
    std::abort();
  }
  auto metric = std::make_unique<M>(*families_, name, std::forward<Args>(args)...);
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
  std::vector<prometheus::MetricFamily> families;
  {
    std::lock_guard lock(mu_);
    families.reserve(metrics_.size());
    for (const auto& m : metrics_) families.push_back(m->collect());
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace pd::router
