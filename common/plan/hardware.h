// Hardware the planner models: a device's peak dense FLOP/s, memory bandwidth
// and capacity, and the links KV caches and tensor-parallel traffic cross.
// Presets for datacenter GPUs, and a probe (`measure_cpu`) of this machine's CPU.
//
// All rates are per device and per direction; capacities in bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace pd::plan {

struct HardwareSpec {
  std::string name;
  std::string peak_note;            // what the peak is for, e.g. "dense bf16 tensor core"
  double peak_flops = 0;            // FLOP/s per device
  double mem_bandwidth = 0;         // bytes/s per device (HBM, or DRAM for a CPU)
  int64_t mem_capacity = 0;         // bytes per device
  double intra_node_bandwidth = 0;  // bytes/s per device per direction (NVLink): tensor-parallel all-reduce
  double inter_node_bandwidth = 0;  // bytes/s per device per direction (NIC): KV handoff between nodes
  double link_latency = 0;          // seconds added to every KV handoff
  // Fractions of peak a real engine reaches (1.0: the pure roofline). Used by
  // every time estimate; MFU for compute-bound kernels, MBU for memory-bound ones.
  double compute_efficiency = 1.0;
  double memory_efficiency = 1.0;

  // Ridge point of the roofline: FLOP per byte where compute and memory time are equal.
  double ridge_intensity() const { return peak_flops / mem_bandwidth; }
  double effective_flops() const { return peak_flops * compute_efficiency; }
  double effective_bandwidth() const { return mem_bandwidth * memory_efficiency; }
};

// OK when every rate and capacity is positive and the efficiencies are in (0, 1];
// InvalidArgument naming the field otherwise.
Status validate_hardware(const HardwareSpec& h);

// h100-sxm, h200, a100-80gb-sxm, and cpu-2core (the 2-core build VM as once
// measured; `measure_cpu` measures the machine it runs on afresh). Sources in docs/PLANNER.md.
const std::vector<HardwareSpec>& hardware_presets();
// A preset by name (case-insensitive). NotFound naming it and listing the known ones.
Result<HardwareSpec> hardware_preset(std::string_view name);

struct CpuProbeConfig {
  int threads = 1;                          // probe threads (each runs both kernels)
  int64_t triad_array_bytes = 64LL << 20;   // per array; three arrays (keep well above the LLC)
  int repetitions = 5;                      // best of N
  double fma_seconds = 0.2;                 // target duration of one FMA repetition
};

struct CpuProbeResult {
  double triad_bytes_per_second = 0;  // STREAM convention: 24 bytes per element (2 reads, 1 write)
  double fma_flops_per_second = 0;    // fp32, 2 FLOP per fused multiply-add
  int threads = 0;
  int vector_bits = 0;                // width of the vectors the FMA probe used
};

// Runs a STREAM-style triad (a[i] = b[i] + s * c[i], doubles) and an FMA
// throughput kernel (12 independent vector chains of fp32 FMAs) on `threads`
// threads, best of `repetitions`. InvalidArgument naming the field for a bad
// config; ResourceExhausted if the arrays cannot be allocated.
// Blocks the calling thread for about a second.
Result<CpuProbeResult> measure_cpu(const CpuProbeConfig& cfg);
// A HardwareSpec from a probe ("measured-cpu"): peak = FMA rate, bandwidth =
// triad rate; capacity and link bandwidth from `base` (a preset or defaults).
HardwareSpec hardware_from_probe(const CpuProbeResult& r, const HardwareSpec& base);

}  // namespace pd::plan
