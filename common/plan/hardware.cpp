#include "plan/hardware.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#include "util/strings.h"

namespace pd::plan {
namespace {

constexpr double kGB = 1e9;
constexpr double kTB = 1e12;
constexpr int64_t kGiB = int64_t{1} << 30;

HardwareSpec make(const char* name, const char* note, double flops, double bw, int64_t capacity, double intra,
                  double inter, double latency) {
  HardwareSpec h;
  h.name = name;
  h.peak_note = note;
  h.peak_flops = flops;
  h.mem_bandwidth = bw;
  h.mem_capacity = capacity;
  h.intra_node_bandwidth = intra;
  h.inter_node_bandwidth = inter;
  h.link_latency = latency;
  return h;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- FMA probe -------------------------------------------------------------
// GCC/Clang vector extensions: the compiler emits the widest FMA the target
// has (x * m + a on vectors contracts to vfmadd). 512-bit vectors only where
// the build enables AVX-512, else 256-bit (AVX2/NEON pairs/SSE pairs).
#if defined(__AVX512F__)
constexpr int kVecFloats = 16;
#else
constexpr int kVecFloats = 8;
#endif
typedef float VecF __attribute__((vector_size(kVecFloats * sizeof(float))));

// 12 independent chains hide the FMA latency (4-5 cycles x 2 pipes on current cores).
__attribute__((noinline)) float fma_kernel(int64_t iters, float mul, float add) {
  VecF m, a;
  for (int k = 0; k < kVecFloats; ++k) {
    m[k] = mul;
    a[k] = add;
  }
  VecF x0 = m * 0.10f, x1 = m * 0.15f, x2 = m * 0.20f, x3 = m * 0.25f, x4 = m * 0.30f, x5 = m * 0.35f;
  VecF x6 = m * 0.40f, x7 = m * 0.45f, x8 = m * 0.50f, x9 = m * 0.55f, x10 = m * 0.60f, x11 = m * 0.65f;
  for (int64_t i = 0; i < iters; ++i) {
    x0 = x0 * m + a;
    x1 = x1 * m + a;
    x2 = x2 * m + a;
    x3 = x3 * m + a;
    x4 = x4 * m + a;
    x5 = x5 * m + a;
    x6 = x6 * m + a;
    x7 = x7 * m + a;
    x8 = x8 * m + a;
    x9 = x9 * m + a;
    x10 = x10 * m + a;
    x11 = x11 * m + a;
  }
  VecF s = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) + ((x8 + x9) + (x10 + x11));
  float total = 0;
  for (int k = 0; k < kVecFloats; ++k) total += s[k];
  return total;
}
constexpr double kFlopsPerIter = 2.0 * 12 * kVecFloats;

// Runs fn(thread_index) on `threads` threads (the caller's thread is index 0)
// and returns the wall time of the slowest.
template <typename Fn>
double timed_parallel(int threads, Fn fn) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (std::thread& th : pool) th.join();
  return seconds_since(t0);
}

}  // namespace

Status validate_hardware(const HardwareSpec& h) {
  const std::string who = "hardware '" + h.name + "': ";
  if (!(h.peak_flops > 0)) return Status::invalid_argument(who + "peak_flops must be positive");
  if (!(h.mem_bandwidth > 0)) return Status::invalid_argument(who + "mem_bandwidth must be positive");
  if (h.mem_capacity <= 0) return Status::invalid_argument(who + "mem_capacity must be positive");
  if (!(h.intra_node_bandwidth > 0)) return Status::invalid_argument(who + "intra_node_bandwidth must be positive");
  if (!(h.inter_node_bandwidth > 0)) return Status::invalid_argument(who + "inter_node_bandwidth must be positive");
  if (!(h.link_latency >= 0)) return Status::invalid_argument(who + "link_latency must not be negative");
  if (!(h.compute_efficiency > 0 && h.compute_efficiency <= 1)) {
    return Status::invalid_argument(who + "compute_efficiency must be in (0, 1]");
  }
  if (!(h.memory_efficiency > 0 && h.memory_efficiency <= 1)) {
    return Status::invalid_argument(who + "memory_efficiency must be in (0, 1]");
  }
  return Status::ok();
}

const std::vector<HardwareSpec>& hardware_presets() {
  // name, peak note, peak FLOP/s, HBM B/s, capacity, NVLink B/s per direction,
  // NIC B/s per direction, per-handoff latency. Sources: docs/PLANNER.md.
  static const std::vector<HardwareSpec> presets = {
      make("h100-sxm", "dense bf16 tensor core", 989e12, 3.35 * kTB, 80 * int64_t{1'000'000'000}, 450 * kGB,
           50 * kGB, 10e-6),
      make("h200", "dense bf16 tensor core", 989e12, 4.8 * kTB, 141 * int64_t{1'000'000'000}, 450 * kGB, 50 * kGB,
           10e-6),
      make("a100-80gb-sxm", "dense bf16 tensor core", 312e12, 2.039 * kTB, 80 * int64_t{1'000'000'000}, 300 * kGB,
           25 * kGB, 10e-6),
      make("cpu-2core", "fp32 FMA, 2 threads (the 2-core build VM, measured)", 364e9, 55 * kGB, 24 * kGiB, 9 * kGB, 9 * kGB, 20e-6),
  };
  return presets;
}

Result<HardwareSpec> hardware_preset(std::string_view name) {
  const std::string want = ascii_lower(name);
  std::string known;
  for (const HardwareSpec& h : hardware_presets()) {
    if (h.name == want) return h;
    known += (known.empty() ? "" : ", ") + h.name;
  }
  return Status::not_found("unknown hardware preset '" + std::string(name) + "' (known: " + known + ")");
}

Result<CpuProbeResult> measure_cpu(const CpuProbeConfig& cfg) {
  if (cfg.threads <= 0 || cfg.threads > 1024) {
    return Status::invalid_argument("threads: must be in [1, 1024], got " + std::to_string(cfg.threads));
  }
  if (cfg.triad_array_bytes < (1 << 20)) {
    return Status::invalid_argument("triad_array_bytes: must be at least 1 MiB, got " +
                                    std::to_string(cfg.triad_array_bytes));
  }
  if (cfg.repetitions <= 0) {
    return Status::invalid_argument("repetitions: must be positive, got " + std::to_string(cfg.repetitions));
  }
  if (!(cfg.fma_seconds > 0 && cfg.fma_seconds <= 60)) {
    return Status::invalid_argument("fma_seconds: must be in (0, 60]");
  }
  CpuProbeResult r;
  r.threads = cfg.threads;
  r.vector_bits = kVecFloats * 32;

  // Triad. Each thread owns a contiguous slice, and touches it first (first-touch
  // places its pages near that thread on NUMA machines).
  const int64_t n = cfg.triad_array_bytes / static_cast<int64_t>(sizeof(double));
  std::unique_ptr<double[]> a(new (std::nothrow) double[n]);
  std::unique_ptr<double[]> b(new (std::nothrow) double[n]);
  std::unique_ptr<double[]> c(new (std::nothrow) double[n]);
  if (!a || !b || !c) {
    return Status::resource_exhausted("triad_array_bytes: cannot allocate 3 x " +
                                      std::to_string(cfg.triad_array_bytes) + " bytes");
  }
  auto slice = [&](int t, int64_t* lo, int64_t* hi) {
    *lo = n * t / cfg.threads;
    *hi = n * (t + 1) / cfg.threads;
  };
  timed_parallel(cfg.threads, [&](int t) {
    int64_t lo, hi;
    slice(t, &lo, &hi);
    for (int64_t i = lo; i < hi; ++i) {
      a[i] = 0.0;
      b[i] = 1.0;
      c[i] = 2.0;
    }
  });
  const double scalar = 3.0;
  double best = 1e300;
  for (int rep = 0; rep < cfg.repetitions; ++rep) {
    const double s = timed_parallel(cfg.threads, [&](int t) {
      int64_t lo, hi;
      slice(t, &lo, &hi);
      double* __restrict pa = a.get();
      const double* __restrict pb = b.get();
      const double* __restrict pc = c.get();
      for (int64_t i = lo; i < hi; ++i) pa[i] = pb[i] + scalar * pc[i];
    });
    best = std::min(best, s);
  }
  volatile double sink = a[n / 2];  // keep the stores observable
  (void)sink;
  r.triad_bytes_per_second = 3.0 * sizeof(double) * static_cast<double>(n) / best;

  // FMA: calibrate the iteration count to ~fma_seconds on one thread, then time all threads.
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile float v = fma_kernel(iters, 0.999999f, 1e-7f);
    (void)v;
    const double s = seconds_since(t0);
    if (s >= cfg.fma_seconds / 4 || iters >= (int64_t{1} << 40)) {
      iters = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(iters) * cfg.fma_seconds / std::max(s, 1e-9)));
      break;
    }
    iters *= 4;
  }
  std::vector<float> sinks(cfg.threads);
  best = 1e300;
  for (int rep = 0; rep < std::min(cfg.repetitions, 3); ++rep) {
    const double s =
        timed_parallel(cfg.threads, [&](int t) { sinks[t] = fma_kernel(iters, 0.999999f, 1e-7f); });
    best = std::min(best, s);
  }
  r.fma_flops_per_second = kFlopsPerIter * static_cast<double>(iters) * cfg.threads / best;
  return r;
}

HardwareSpec hardware_from_probe(const CpuProbeResult& r, const HardwareSpec& base) {
  HardwareSpec h = base;
  h.name = "measured-cpu";
  h.peak_note = "fp32 FMA, " + std::to_string(r.threads) + " thread(s), " + std::to_string(r.vector_bits) +
                "-bit vectors (measured)";
  h.peak_flops = r.fma_flops_per_second;
  h.mem_bandwidth = r.triad_bytes_per_second;
  return h;
}

}  // namespace pd::plan
