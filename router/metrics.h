// Prometheus metrics: counters, gauges and histograms with optional labels, and
// a registry that renders them in the text exposition format 0.0.4 (the body of
// GET /metrics, Content-Type kPrometheusContentType).
//
// Thread safety: every method of every class here may be called from any
// thread. Updating a child (one label-value combination) is a few atomic
// operations; finding a child by its label values takes a shared lock and a
// map lookup, and creating one an exclusive lock. Hot paths can look a child
// up once with with() and keep the reference: children live as long as the
// registry and are never removed.
//
// Lifetime: metrics are owned by their Registry; the references it hands out
// stay valid until the Registry is destroyed.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

namespace pd::router {

inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

// Label values in the order of the metric's label names.
using LabelValues = std::vector<std::string>;

// Latency buckets in seconds: 5 ms ... 60 s.
const std::vector<double>& default_latency_buckets();

// Escaping for the exposition format: label values escape \ " and newline,
// HELP text escapes \ and newline.
std::string escape_label_value(const std::string& s);
std::string escape_help(const std::string& s);
// A sample value: shortest round-trip decimal, "+Inf", "-Inf" or "NaN".
std::string format_metric_value(double v);

// What every metric shares: name, help, label names, and its rendering.
class Metric {
 public:
  virtual ~Metric() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  virtual const char* type() const = 0;  // "counter", "gauge", "histogram"
  // Appends "# HELP", "# TYPE" and one line per sample. Children appear in
  // the order of their label values; an unlabelled metric always has its one
  // sample (0 before any update).
  void render(std::string& out) const;

 protected:
  Metric(std::string name, std::string help, std::vector<std::string> label_names);
  // Appends this metric's sample lines.
  virtual void render_samples(std::string& out) const = 0;
  // 'a="x",b="y"' for these values (missing values render as "").
  std::string label_pairs(const LabelValues& values) const;
  // `values` resized to the number of label names (asserts they match: a
  // mismatch is a programming error, never input).
  LabelValues normalized(const LabelValues& values) const;

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
};

namespace detail {
// Children of a metric by label values, with stable addresses.
template <typename Child>
class ChildMap {
 public:
  template <typename Make>
  Child& get(const LabelValues& values, Make make) {
    {
      std::shared_lock lock(mu_);
      auto it = children_.find(values);
      if (it != children_.end()) return *it->second;
    }
    std::unique_lock lock(mu_);
    auto [it, inserted] = children_.try_emplace(values, nullptr);
    if (inserted) it->second = make();
    return *it->second;
  }
  template <typename Fn>
  void for_each(Fn fn) const {
    std::shared_lock lock(mu_);
    for (const auto& [values, child] : children_) fn(values, *child);
  }

 private:
  mutable std::shared_mutex mu_;
  std::map<LabelValues, std::unique_ptr<Child>> children_;  // guarded by mu_
};
}  // namespace detail

// A monotonically increasing count.
class Counter final : public Metric {
 public:
  class Child {
   public:
    void inc(double v = 1.0);  // v >= 0 (negative increments are dropped)
    double value() const { return value_.load(std::memory_order_relaxed); }

   private:
    std::atomic<double> value_{0.0};
  };
  Counter(std::string name, std::string help, std::vector<std::string> label_names);
  const char* type() const override { return "counter"; }
  // The child for these label values (created at 0 on first use); the
  // reference stays valid for the registry's lifetime.
  Child& with(const LabelValues& values);
  void inc(double v = 1.0) { with({}).inc(v); }
  void inc(const LabelValues& values, double v = 1.0) { with(values).inc(v); }
  // The child's value (creating the child, at 0, if it did not exist).
  double value(const LabelValues& values = {}) { return with(values).value(); }

 private:
  void render_samples(std::string& out) const override;
  detail::ChildMap<Child> children_;
};

// A value that goes up and down.
class Gauge final : public Metric {
 public:
  class Child {
   public:
    void set(double v) { value_.store(v, std::memory_order_relaxed); }
    void add(double d) { value_.fetch_add(d, std::memory_order_relaxed); }
    double value() const { return value_.load(std::memory_order_relaxed); }

   private:
    std::atomic<double> value_{0.0};
  };
  Gauge(std::string name, std::string help, std::vector<std::string> label_names);
  const char* type() const override { return "gauge"; }
  Child& with(const LabelValues& values);
  void set(double v) { with({}).set(v); }
  void set(const LabelValues& values, double v) { with(values).set(v); }
  void add(double d) { with({}).add(d); }
  void add(const LabelValues& values, double d) { with(values).add(d); }
  double value(const LabelValues& values = {}) { return with(values).value(); }

 private:
  void render_samples(std::string& out) const override;
  detail::ChildMap<Child> children_;
};

// Observations counted into fixed buckets (upper bounds, "le"), with their sum.
class Histogram final : public Metric {
 public:
  class Child {
   public:
    explicit Child(const std::vector<double>* bounds);
    void observe(double v);
    uint64_t count() const;  // all observations
    double sum() const { return sum_.load(std::memory_order_relaxed); }
    // Cumulative counts per bound, then +Inf (size bounds + 1).
    std::vector<uint64_t> cumulative_counts() const;

   private:
    const std::vector<double>* bounds_;                   // the histogram's, constant
    std::unique_ptr<std::atomic<uint64_t>[]> counts_;     // [bounds + 1], per bucket, not cumulative
    std::atomic<double> sum_{0.0};
  };
  // `bounds`: finite, strictly increasing upper bounds (+Inf is implicit; a
  // trailing +Inf given here is dropped).
  Histogram(std::string name, std::string help, std::vector<double> bounds, std::vector<std::string> label_names);
  const char* type() const override { return "histogram"; }
  Child& with(const LabelValues& values);
  void observe(double v) { with({}).observe(v); }
  void observe(const LabelValues& values, double v) { with(values).observe(v); }
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  void render_samples(std::string& out) const override;
  const std::vector<double> bounds_;
  detail::ChildMap<Child> children_;
};

// Owns metrics and renders them, in registration order.
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Each returns the metric named `name`, creating it on first use. Names
  // follow Prometheus ([a-zA-Z_:][a-zA-Z0-9_:]*); asking for an existing name
  // with another kind is a programming error (aborts with a message).
  Counter& counter(const std::string& name, const std::string& help, std::vector<std::string> label_names = {});
  Gauge& gauge(const std::string& name, const std::string& help, std::vector<std::string> label_names = {});
  Histogram& histogram(const std::string& name, const std::string& help,
                       std::vector<double> bounds = default_latency_buckets(),
                       std::vector<std::string> label_names = {});

  // The whole exposition (text format 0.0.4).
  std::string render() const;

 private:
  template <typename M, typename... Args>
  M& get_or_create(const std::string& name, Args&&... args);

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Metric>> metrics_;  // guarded by mu_; elements never move or die
};

}  // namespace pd::router
