// Prometheus metrics: counters, gauges and histograms with optional labels, and
// a registry that renders them in the text exposition format 0.0.4 (the body of
// GET /metrics, Content-Type kPrometheusContentType).
//
// A thin facade over prometheus-cpp (its core library): the series, their
// children and the exposition are prometheus-cpp's; this keeps the router's
// calling convention (label values in the order of the metric's label names, a
// child looked up once and kept) and the shape of /metrics that its scrapers
// read: families in registration order, labels in the order they were
// declared, children sorted by their label values, every unlabelled series
// present from the start (0).
//
// Thread safety: every method of every class here may be called from any
// thread. Updating a child (one label-value combination) is prometheus-cpp's
// update (atomic for counters and gauges, a short lock for a histogram);
// finding a child by its label values takes a shared lock and a map lookup,
// and creating one an exclusive lock. Hot paths can look a child up once with
// with() and keep the reference: children live as long as the registry and
// are never removed.
//
// Lifetime: metrics are owned by their Registry; the references it hands out
// stay valid until the Registry is destroyed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
struct MetricFamily;
template <typename T>
class Family;
}  // namespace prometheus

namespace pd::router {

inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

// Label values in the order of the metric's label names.
using LabelValues = std::vector<std::string>;

// Latency buckets in seconds: 5 ms ... 60 s.
const std::vector<double>& default_latency_buckets();

// HELP text as the exposition format wants it: \ and newline escaped.
std::string escape_help(const std::string& s);

// What every metric shares: name, help, label names, and its part of the
// exposition.
class Metric {
 public:
  virtual ~Metric() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  virtual const char* type() const = 0;  // "counter", "gauge", "histogram"
  // This metric's family as the exposition shows it: its children in the
  // order of their label values, each child's labels in the order of
  // label_names(); HELP and TYPE even before any child exists.
  prometheus::MetricFamily collect() const;

 protected:
  Metric(std::string name, std::string help, std::vector<std::string> label_names);
  // prometheus-cpp's collection of this metric's children (empty: none yet).
  virtual std::vector<prometheus::MetricFamily> collect_children() const = 0;
  // `values` resized to the number of label names (asserts they match: a
  // mismatch is a programming error, never input).
  LabelValues normalized(const LabelValues& values) const;
  // The label set prometheus-cpp files a child under.
  std::map<std::string, std::string> labels_of(const LabelValues& values) const;

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
};

namespace detail {
// Children of a metric by label values, with stable addresses: the lookup
// that keeps a labelled update to a shared lock and a map find.
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
    explicit Child(prometheus::Counter& c) : c_(c) {}
    void inc(double v = 1.0);  // v >= 0 (negative increments and NaN are dropped)
    double value() const;

   private:
    prometheus::Counter& c_;
  };
  Counter(prometheus::Registry& registry, std::string name, std::string help, std::vector<std::string> label_names);
  const char* type() const override { return "counter"; }
  // The child for these label values (created at 0 on first use); the
  // reference stays valid for the registry's lifetime.
  Child& with(const LabelValues& values);
  void inc(double v = 1.0) { with({}).inc(v); }
  void inc(const LabelValues& values, double v = 1.0) { with(values).inc(v); }
  // The child's value (creating the child, at 0, if it did not exist).
  double value(const LabelValues& values = {}) { return with(values).value(); }

 private:
  std::vector<prometheus::MetricFamily> collect_children() const override;
  prometheus::Family<prometheus::Counter>& family_;
  detail::ChildMap<Child> children_;
};

// A value that goes up and down.
class Gauge final : public Metric {
 public:
  class Child {
   public:
    explicit Child(prometheus::Gauge& g) : g_(g) {}
    void set(double v);
    void add(double d);
    double value() const;

   private:
    prometheus::Gauge& g_;
  };
  Gauge(prometheus::Registry& registry, std::string name, std::string help, std::vector<std::string> label_names);
  const char* type() const override { return "gauge"; }
  Child& with(const LabelValues& values);
  void set(double v) { with({}).set(v); }
  void set(const LabelValues& values, double v) { with(values).set(v); }
  void add(double d) { with({}).add(d); }
  void add(const LabelValues& values, double d) { with(values).add(d); }
  double value(const LabelValues& values = {}) { return with(values).value(); }

 private:
  std::vector<prometheus::MetricFamily> collect_children() const override;
  prometheus::Family<prometheus::Gauge>& family_;
  detail::ChildMap<Child> children_;
};

// Observations counted into fixed buckets (upper bounds, "le"), with their sum.
class Histogram final : public Metric {
 public:
  class Child {
   public:
    Child(prometheus::Histogram& h, size_t n_bounds) : h_(h), n_bounds_(n_bounds) {}
    // Bucket i counts v <= bounds[i]; the last one (+Inf) the rest, NaN included.
    void observe(double v);
    uint64_t count() const;  // all observations
    double sum() const;
    // Cumulative counts per bound, then +Inf (size bounds + 1).
    std::vector<uint64_t> cumulative_counts() const;

   private:
    prometheus::Histogram& h_;
    const size_t n_bounds_;
  };
  // `bounds`: finite, strictly increasing upper bounds (+Inf is implicit; a
  // trailing +Inf given here is dropped).
  Histogram(prometheus::Registry& registry, std::string name, std::string help, std::vector<double> bounds,
            std::vector<std::string> label_names);
  const char* type() const override { return "histogram"; }
  Child& with(const LabelValues& values);
  void observe(double v) { with({}).observe(v); }
  void observe(const LabelValues& values, double v) { with(values).observe(v); }
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  std::vector<prometheus::MetricFamily> collect_children() const override;
  const std::vector<double> bounds_;
  prometheus::Family<prometheus::Histogram>& family_;
  detail::ChildMap<Child> children_;
};

// Owns metrics and renders them, in registration order.
class Registry {
 public:
  Registry();
  ~Registry();
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

  // The whole exposition (text format 0.0.4, prometheus-cpp's TextSerializer).
  std::string render() const;

 private:
  template <typename M, typename... Args>
  M& get_or_create(const std::string& name, Args&&... args);

  mutable std::mutex mu_;
  const std::unique_ptr<prometheus::Registry> families_;  // prometheus-cpp's: owns the families
  std::vector<std::unique_ptr<Metric>> metrics_;          // guarded by mu_; elements never move or die
};

}  // namespace pd::router
