// pd-plan: the capacity planner. KV-cache footprint, roofline of prefill vs
// decode, and prefill/decode pool sizing by discrete-event simulation.
// docs/PLANNER.md explains every figure. Human-readable tables by default,
// --json for scripts; bad input is a one-line error naming it and exit code 2.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "plan/engine_profile.h"
#include "plan/hardware.h"
#include "plan/kv_footprint.h"
#include "plan/model_spec.h"
#include "plan/pool_search.h"
#include "plan/pool_simulator.h"
#include "plan/precision.h"
#include "plan/roofline.h"
#include "plan/text_report.h"

using namespace pd::plan;
using json = nlohmann::json;

namespace {

// ---- Options shared by the subcommands ----------------------------------------------

struct ModelOptions {
  std::string preset = "llama-3.1-8b";
  std::string json_path;
  std::string gguf_path;
  std::string weights = "bf16";
  std::string kv = "bf16";
};

struct HardwareOptions {
  std::string preset = "h100-sxm";
  bool measure = false;
  int threads = 0;  // 0: all cores
  int tp = 1;
  double mfu = 1.0;
  double mbu = 1.0;
  double memory_fraction = 0.9;
  int block_size = 16;
};

struct Resolved {
  ModelSpec model;
  Precision weights = Precision::kBf16;
  Precision kv = Precision::kBf16;
  HardwareSpec hw;
};

[[noreturn]] void die(const std::string& msg, int code = 2) {
  std::fprintf(stderr, "pd-plan: error: %s\n", msg.c_str());
  std::exit(code);
}

template <typename T>
T or_die(pd::Result<T> r) {
  if (!r.is_ok()) die(r.status().message());
  return std::move(r).value();
}

void add_model_options(CLI::App* app, ModelOptions* o) {
  app->add_option("--model", o->preset, "Model preset (see `pd-plan list`)")->capture_default_str();
  app->add_option("--model-json", o->json_path, "Model from a JSON file (own fields or a HF config.json)");
  app->add_option("--gguf", o->gguf_path, "Model from a GGUF file's metadata");
  app->add_option("--weights", o->weights, "Weight precision: fp32, bf16, fp16, fp8, int8, int4")->capture_default_str();
  app->add_option("--kv", o->kv, "KV-cache precision: fp32, bf16, fp16, fp8, int8, int4")->capture_default_str();
}

void add_hardware_options(CLI::App* app, HardwareOptions* o) {
  app->add_option("--hardware", o->preset, "Hardware preset (see `pd-plan list`)")->capture_default_str();
  app->add_flag("--measure", o->measure, "Probe this machine's CPU (STREAM triad + FMA peak) instead of a preset");
  app->add_option("--threads", o->threads, "Threads for --measure (0: all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app->add_option("--tp", o->tp, "Devices per rank (tensor parallel)")->capture_default_str();
  app->add_option("--mfu", o->mfu, "Fraction of peak FLOP/s reached (1 = pure roofline)")->capture_default_str();
  app->add_option("--mbu", o->mbu, "Fraction of peak bandwidth reached (1 = pure roofline)")->capture_default_str();
  app->add_option("--memory-fraction", o->memory_fraction, "Fraction of device memory for weights + KV")
      ->capture_default_str();
  app->add_option("--block-size", o->block_size, "Tokens per KV block")->capture_default_str();
}

// The KV pool one rank gets on the chosen hardware (the same sizing the cluster uses).
pd::Result<KvPoolPlan> kv_pool_of(const Resolved& r, const HardwareOptions& ho) {
  KvPoolConfig pc;
  pc.device_memory_bytes = r.hw.mem_capacity;
  pc.devices = ho.tp;
  pc.memory_fraction = ho.memory_fraction;
  pc.block_size = ho.block_size;
  return plan_kv_pool(r.model, r.kv, r.weights, pc);
}

Resolved resolve(const ModelOptions& mo, const HardwareOptions& ho, bool need_hw) {
  Resolved r;
  const int sources = !mo.json_path.empty() + !mo.gguf_path.empty();
  if (sources > 1) die("--model-json and --gguf: give one model source");
  if (!mo.json_path.empty()) {
    r.model = or_die(model_from_json_file(mo.json_path));
  } else if (!mo.gguf_path.empty()) {
    r.model = or_die(model_from_gguf_file(mo.gguf_path));
  } else {
    auto m = model_preset(mo.preset);
    if (!m.is_ok()) die("--model: " + m.status().message());
    r.model = *m;
  }
  r.weights = or_die(parse_precision(mo.weights, "--weights"));
  r.kv = or_die(parse_precision(mo.kv, "--kv"));
  if (ho.tp <= 0) die("--tp: must be positive, got " + std::to_string(ho.tp));
  if (!(ho.mfu > 0 && ho.mfu <= 1)) die("--mfu: must be in (0, 1], got " + fmt_sig(ho.mfu));
  if (!(ho.mbu > 0 && ho.mbu <= 1)) die("--mbu: must be in (0, 1], got " + fmt_sig(ho.mbu));
  if (!(ho.memory_fraction > 0 && ho.memory_fraction <= 1)) {
    die("--memory-fraction: must be in (0, 1], got " + fmt_sig(ho.memory_fraction));
  }
  if (ho.block_size <= 0) die("--block-size: must be positive, got " + std::to_string(ho.block_size));
  if (!need_hw && !ho.measure) {
    auto h = hardware_preset(ho.preset);
    if (!h.is_ok()) die("--hardware: " + h.status().message());
    r.hw = *h;
    return r;
  }
  if (ho.measure) {
    CpuProbeConfig pc;
    pc.threads = ho.threads > 0 ? ho.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    auto probe = measure_cpu(pc);
    if (!probe.is_ok()) die("--measure: " + probe.status().message());
    r.hw = hardware_from_probe(*probe, *hardware_preset("cpu-2core"));
  } else {
    auto h = hardware_preset(ho.preset);
    if (!h.is_ok()) die("--hardware: " + h.status().message());
    r.hw = *h;
  }
  r.hw.compute_efficiency = ho.mfu;
  r.hw.memory_efficiency = ho.mbu;
  return r;
}

void check_positive(const std::vector<int64_t>& v, const char* flag) {
  if (v.empty()) die(std::string(flag) + ": needs at least one value");
  for (int64_t x : v) {
    if (x <= 0) die(std::string(flag) + ": must be positive, got " + std::to_string(x));
  }
}

json model_json(const ModelSpec& m) {
  const ParamBreakdown b = parameter_breakdown(m);
  json j = {{"name", m.name},          {"n_layers", m.n_layers}, {"hidden_size", m.hidden},
            {"n_heads", m.n_heads},    {"n_kv_heads", m.n_kv_heads}, {"head_dim", m.head_dim},
            {"ffn_size", m.ffn},       {"vocab_size", m.vocab},  {"tied_embeddings", m.tied_embeddings},
            {"qkv_bias", m.qkv_bias},  {"max_context", m.max_context}, {"n_params", b.total},
            {"gqa_group", gqa_group(m)}};
  if (m.file_params > 0) {
    j["file_params"] = m.file_params;
    j["file_weight_bytes"] = m.file_weight_bytes;
  }
  return j;
}

json hardware_json(const HardwareSpec& h) {
  return {{"name", h.name},
          {"peak_note", h.peak_note},
          {"peak_flops", h.peak_flops},
          {"mem_bandwidth", h.mem_bandwidth},
          {"mem_capacity", h.mem_capacity},
          {"intra_node_bandwidth", h.intra_node_bandwidth},
          {"inter_node_bandwidth", h.inter_node_bandwidth},
          {"link_latency", h.link_latency},
          {"compute_efficiency", h.compute_efficiency},
          {"memory_efficiency", h.memory_efficiency},
          {"ridge_intensity", h.ridge_intensity()}};
}

void print_model_line(const ModelSpec& m, Precision w, Precision kv) {
  std::cout << "model " << m.name << ": " << m.n_layers << " layers, hidden " << m.hidden << ", " << m.n_heads
            << " query heads / " << m.n_kv_heads << " KV heads (G = " << gqa_group(m) << "), head dim "
            << m.head_dim << ", FFN " << m.ffn << ", vocab " << m.vocab << ", "
            << fmt_fixed(static_cast<double>(parameter_count(m)) / 1e9, 3) << " B params; weights "
            << precision_name(w) << ", KV " << precision_name(kv) << "\n";
}

void print_hw_line(const HardwareSpec& h, int tp) {
  std::cout << "hardware " << h.name << ": " << fmt_sig(h.peak_flops / 1e12) << " TFLOP/s (" << h.peak_note
            << "), " << fmt_sig(h.mem_bandwidth / 1e9) << " GB/s memory, " << fmt_bytes(double(h.mem_capacity))
            << ", ridge " << fmt_fixed(h.ridge_intensity(), 1) << " FLOP/B; efficiency " << fmt_fixed(h.compute_efficiency, 2)
            << " compute / " << fmt_fixed(h.memory_efficiency, 2) << " memory; " << tp << " device(s) per rank\n";
}

// ---- pd-plan kv ---------------------------------------------------------------------------

struct KvOptions {
  std::vector<int64_t> contexts = {4096, 32768, 131072};
  std::vector<int64_t> batches = {1, 32};
};

// The JSON of `pd-plan kv`: bytes per token, weights by precision, the footprint rows, one rank's pool.
json kv_json(const Resolved& r, const HardwareOptions& ho, const KvOptions& ko, const std::vector<KvFootprintRow>& rows,
             const pd::Result<KvPoolPlan>& pool) {
  json j;
  j["model"] = model_json(r.model);
  j["weights_precision"] = precision_name(r.weights);
  j["kv_precision"] = precision_name(r.kv);
  j["kv_bytes_per_token"] = kv_bytes_per_token(r.model, r.kv);
  j["kv_bytes_per_token_mha"] = kv_geometry_mha(r.model, r.kv).bytes_per_token();
  j["weight_bytes"] = weight_bytes(r.model, r.weights);
  j["weight_bytes_by_precision"] = json::object();
  for (Precision p : all_precisions()) j["weight_bytes_by_precision"][precision_name(p)] = weight_bytes(r.model, p);
  j["rows"] = json::array();
  for (const KvFootprintRow& row : rows) {
    j["rows"].push_back({{"context", row.context},
                         {"batch", row.batch},
                         {"kv_bytes", row.kv_bytes},
                         {"kv_bytes_mha", row.kv_bytes_mha},
                         {"weight_bytes", row.weight_bytes},
                         {"kv_percent_of_weights", row.kv_percent_of_weights},
                         {"kv_share_percent", row.kv_share_percent}});
  }
  json pj = {{"hardware", r.hw.name}, {"devices", ho.tp}, {"memory_fraction", ho.memory_fraction},
             {"block_size", ho.block_size}};
  if (pool.is_ok()) {
    pj["weight_bytes_per_device"] = pool->weight_bytes_per_device;
    pj["kv_budget_per_device"] = pool->kv_budget_per_device;
    pj["num_blocks"] = pool->num_blocks;
    pj["token_capacity"] = pool->token_capacity;
    pj["max_sequences"] = json::object();
    for (int64_t c : ko.contexts) pj["max_sequences"][std::to_string(c)] = pool->max_sequences(c);
  } else {
    pj["error"] = pool.status().message();
  }
  j["pool"] = pj;
  return j;
}

// The text of `pd-plan kv` up to the pool: bytes per token, weights, the footprint table.
void print_kv_footprint(const Resolved& r, const std::vector<KvFootprintRow>& rows) {
  const int64_t per_token = kv_bytes_per_token(r.model, r.kv);
  print_model_line(r.model, r.weights, r.kv);
  std::cout << "KV bytes per token = 2 x " << r.model.n_layers << " layers x " << r.model.n_kv_heads
            << " KV heads x " << r.model.head_dim << " head dim x " << fmt_sig(precision_bytes(r.kv))
            << " B = " << per_token << " B (" << fmt_fixed(per_token / 1024.0, 1) << " KiB); as plain MHA ("
            << r.model.n_heads << " KV heads): " << kv_geometry_mha(r.model, r.kv).bytes_per_token() << " B\n";
  std::cout << "weights: ";
  for (Precision p : all_precisions()) {
    if (p == Precision::kFp16 || p == Precision::kInt8) continue;  // same widths as bf16 / fp8
    std::cout << precision_name(p) << " " << fmt_bytes(double(weight_bytes(r.model, p)))
              << (p == Precision::kInt4 ? "\n" : ", ");
  }
  if (r.model.file_weight_bytes > 0) {
    std::cout << "weights in the GGUF file: " << fmt_bytes(double(r.model.file_weight_bytes)) << ", "
              << r.model.file_params << " parameters (computed from the fields: " << parameter_count(r.model)
              << ")\n";
  }
  std::cout << "units: GB = 10^9 bytes, GiB = 2^30 bytes\n\n";
  TextTable t({"context", "batch", "KV cache", "as MHA", "GQA saves", "KV/weights", "KV share"});
  for (const KvFootprintRow& row : rows) {
    t.add({std::to_string(row.context), std::to_string(row.batch), fmt_bytes(double(row.kv_bytes)),
           fmt_bytes(double(row.kv_bytes_mha)), fmt_bytes(double(row.kv_bytes_mha - row.kv_bytes)),
           fmt_fixed(row.kv_percent_of_weights, 1) + "%", fmt_fixed(row.kv_share_percent, 1) + "%"});
  }
  t.print(std::cout);
}

// The text of one rank's KV pool, or why the model does not fit.
void print_kv_pool(const Resolved& r, const HardwareOptions& ho, const KvOptions& ko,
                   const pd::Result<KvPoolPlan>& pool) {
  std::cout << "\nKV pool of one rank on " << ho.tp << " x " << r.hw.name << " (" << fmt_bytes(double(r.hw.mem_capacity))
            << " each, " << fmt_fixed(ho.memory_fraction * 100, 0) << "% usable, " << ho.block_size
            << "-token blocks):\n";
  if (!pool.is_ok()) {
    std::cout << "  does not fit: " << pool.status().message() << "\n";
    return;
  }
  std::cout << "  weights " << fmt_bytes(double(pool->weight_bytes_per_device)) << " per device, KV budget "
            << fmt_bytes(double(pool->kv_budget_per_device)) << " per device -> " << pool->num_blocks
            << " blocks = " << pool->token_capacity << " tokens per rank\n";
  for (int64_t c : ko.contexts) {
    std::cout << "  sequences of " << c << " tokens at once: " << pool->max_sequences(c) << "\n";
  }
}

int run_kv(const ModelOptions& mo, const HardwareOptions& ho, const KvOptions& ko, bool as_json) {
  check_positive(ko.contexts, "--context");
  check_positive(ko.batches, "--batch");
  const Resolved r = resolve(mo, ho, false);
  auto rows = kv_footprint_table(r.model, r.kv, r.weights, ko.contexts, ko.batches);
  if (!rows.is_ok()) die("--" + rows.status().message());
  const auto pool = kv_pool_of(r, ho);
  if (as_json) {
    std::cout << kv_json(r, ho, ko, *rows, pool).dump(2) << "\n";
    return 0;
  }
  print_kv_footprint(r, *rows);
  print_kv_pool(r, ho, ko, pool);
  return 0;
}

// ---- pd-plan roofline -----------------------------------------------------------------------

struct RooflineOptions {
  std::vector<int64_t> prompts = {128, 512, 2048, 8192};
  std::vector<int64_t> batches = {1, 8, 32, 128};
  int64_t context = 4096;
  int64_t generated = 1024;
  std::string activations = "";  // default: the weight precision
};

// One phase row of the roofline: prefill of `size` prompt tokens or a decode step of batch `size`.
struct RooflineRow {
  std::string phase;
  int64_t size;
  double exact, limit;  // linear-layer intensity: exact and its T << d/2 limit
  PhaseCost cost;
};

// The precisions and tensor parallelism the roofline is computed at; a bad combination dies naming the flag.
RooflineConfig roofline_config(const Resolved& r, const HardwareOptions& ho, const RooflineOptions& ro) {
  RooflineConfig rc;
  rc.weights = r.weights;
  rc.kv = r.kv;
  rc.activations = ro.activations.empty() ? r.weights : or_die(parse_precision(ro.activations, "--activations"));
  if (rc.activations == Precision::kInt4) rc.activations = Precision::kInt8;
  rc.tp = ho.tp;
  pd::Status s = validate_roofline_config(r.model, rc);
  if (!s.is_ok()) die("--" + s.message());
  return rc;
}

// A row per --prompt (prefill) and per --batch (decode at --context).
std::vector<RooflineRow> roofline_rows(const Resolved& r, const RooflineConfig& rc, const RooflineOptions& ro) {
  const double d = r.model.hidden;
  const double sw = precision_bytes(rc.weights), sa = precision_bytes(rc.activations);
  std::vector<RooflineRow> rows;
  for (int64_t p : ro.prompts) {
    rows.push_back({"prefill", p, linear_intensity(double(p), d, sw, sa), linear_intensity_limit(double(p), sw),
                    prefill_cost(r.model, r.hw, rc, double(p))});
  }
  for (int64_t b : ro.batches) {
    rows.push_back({"decode", b, linear_intensity(double(b), d, sw, sa), linear_intensity_limit(double(b), sw),
                    decode_step_cost(r.model, r.hw, rc, double(b), double(ro.context))});
  }
  return rows;
}

// A kernel group's cost and where it sits on the roofline.
json kernel_json(const KernelCost& k, const HardwareSpec& hw) {
  return {{"flops", k.flops},
          {"bytes", k.bytes},
          {"intensity", k.intensity()},
          {"compute_bound", k.compute_bound()},
          {"seconds", k.seconds()},
          {"attainable_flops", std::min(hw.peak_flops, k.intensity() * hw.mem_bandwidth)}};
}

json generation_json(const GenerationCost& g) {
  return json{{"per_layer", {{"cached", {{"attention", g.cached_per_layer.attention},
                                        {"projections", g.cached_per_layer.projections}}},
                            {"naive", {{"attention", g.naive_per_layer.attention},
                                       {"projections", g.naive_per_layer.projections}}}}},
              {"model", {{"cached", {{"attention", g.cached_model.attention},
                                    {"projections", g.cached_model.projections}}},
                        {"naive", {{"attention", g.naive_model.attention},
                                   {"projections", g.naive_model.projections}}}}}};
}

json roofline_json(const Resolved& r, const RooflineConfig& rc, const RooflineOptions& ro,
                   const std::vector<RooflineRow>& rows) {
  json j;
  j["model"] = model_json(r.model);
  j["hardware"] = hardware_json(r.hw);
  j["precision"] = {{"weights", precision_name(rc.weights)},
                    {"kv", precision_name(rc.kv)},
                    {"activations", precision_name(rc.activations)}};
  j["tp"] = rc.tp;
  j["context"] = ro.context;
  j["decode_attention_intensity"] = decode_attention_intensity(gqa_group(r.model), precision_bytes(rc.kv));
  j["phases"] = json::array();
  for (const RooflineRow& row : rows) {
    j["phases"].push_back({{"phase", row.phase},
                           {row.phase == "prefill" ? "prompt_tokens" : "batch", row.size},
                           {"linear_intensity_exact", row.exact},
                           {"linear_intensity_limit", row.limit},
                           {"linear", kernel_json(row.cost.linear, r.hw)},
                           {"attention", kernel_json(row.cost.attention, r.hw)},
                           {"comm_seconds", row.cost.comm_seconds},
                           {"seconds", row.cost.seconds()}});
  }
  j["no_cache"] = {{"generated", ro.generated},
                   {"step_at_n", generation_json(generation_step_flops(r.model, double(ro.generated)))},
                   {"total_over_n", generation_json(generation_total_flops(r.model, double(ro.generated)))}};
  return j;
}

// The phase table: intensities, which bound each kernel group hits, times.
void print_roofline_phases(const Resolved& r, const RooflineConfig& rc, const RooflineOptions& ro,
                           const std::vector<RooflineRow>& rows) {
  const double skv = precision_bytes(rc.kv);
  print_model_line(r.model, r.weights, r.kv);
  print_hw_line(r.hw, rc.tp);
  std::cout << "\nArithmetic intensity (FLOP/B) of the linear layers, d = " << r.model.hidden
            << ": exact 2Td^2/((2Td)S_a + d^2 S_w) and its T << d/2 limit 2T/S;\n"
            << "decode attention over the cache: 2G/S = "
            << fmt_fixed(decode_attention_intensity(gqa_group(r.model), skv), 2) << " (G = " << gqa_group(r.model)
            << ", S = " << fmt_sig(skv) << "). Ridge: " << fmt_fixed(r.hw.ridge_intensity(), 1) << " FLOP/B.\n"
            << "Times per rank: each kernel group at max(FLOPs/peak, bytes/bandwidth), summed";
  if (rc.tp > 1) std::cout << ", + tensor-parallel all-reduce";
  std::cout << ". Decode at context " << ro.context << ".\n\n";
  TextTable t({"phase", "T", "exact", "2T/S", "linear", "attn I", "attention", "time", "tokens/s"});
  for (const RooflineRow& row : rows) {
    const bool pre = row.phase == "prefill";
    const double tps = double(row.size) / row.cost.seconds();
    t.add({pre ? "prefill P" : "decode B", std::to_string(row.size), fmt_fixed(row.exact, 1), fmt_fixed(row.limit, 1),
           row.cost.linear.compute_bound() ? "compute" : "memory", fmt_fixed(row.cost.attention.intensity(), 1),
           row.cost.attention.compute_bound() ? "compute" : "memory", fmt_time(row.cost.seconds()),
           fmt_sig(tps)});
  }
  t.print(std::cout);
}

// The FLOPs of generating --generated tokens with and without a KV cache.
void print_no_cache_cost(const ModelSpec& m, int64_t generated) {
  const GenerationCost step = generation_step_flops(m, double(generated));
  const GenerationCost total = generation_total_flops(m, double(generated));
  std::cout << "\nGenerating without a KV cache (FLOPs), n = " << generated << " tokens (from an empty context):\n";
  TextTable g({"", "attention cached", "attention naive", "projections cached", "projections naive"});
  g.add({"step n, per layer", fmt_count(step.cached_per_layer.attention), fmt_count(step.naive_per_layer.attention),
         fmt_count(step.cached_per_layer.projections), fmt_count(step.naive_per_layer.projections)});
  g.add({"step n, model", fmt_count(step.cached_model.attention), fmt_count(step.naive_model.attention),
         fmt_count(step.cached_model.projections), fmt_count(step.naive_model.projections)});
  g.add({"all n steps, per layer", fmt_count(total.cached_per_layer.attention),
         fmt_count(total.naive_per_layer.attention), fmt_count(total.cached_per_layer.projections),
         fmt_count(total.naive_per_layer.projections)});
  g.add({"all n steps, model", fmt_count(total.cached_model.attention), fmt_count(total.naive_model.attention),
         fmt_count(total.cached_model.projections), fmt_count(total.naive_model.projections)});
  g.print(std::cout);
  std::cout << "(cumulative growth: attention N^3 naive vs N^2 cached; projections N^2 naive vs N cached; "
               "the model rows include the LM head)\n";
}

int run_roofline(const ModelOptions& mo, const HardwareOptions& ho, const RooflineOptions& ro, bool as_json) {
  check_positive(ro.prompts, "--prompt");
  check_positive(ro.batches, "--batch");
  if (ro.context <= 0) die("--context: must be positive, got " + std::to_string(ro.context));
  if (ro.generated <= 0) die("--generated: must be positive, got " + std::to_string(ro.generated));
  const Resolved r = resolve(mo, ho, true);
  const RooflineConfig rc = roofline_config(r, ho, ro);
  const std::vector<RooflineRow> rows = roofline_rows(r, rc, ro);
  if (as_json) {
    std::cout << roofline_json(r, rc, ro, rows).dump(2) << "\n";
    return 0;
  }
  print_roofline_phases(r, rc, ro, rows);
  print_no_cache_cost(r.model, ro.generated);
  return 0;
}

// ---- pd-plan pools and pd-plan layout: simulation ---------------------------------------------

// The options of the simulating subcommands. `pools` and `layout` differ in
// their defaults: `layout` mirrors the serving engine's (chunked prefill on).
struct PoolsOptions {
  double rate = 10;
  std::string prompt_len = "lognormal:1024:0.8";
  std::string output_len = "exp:256";
  int64_t requests = 20'000;
  uint64_t seed = 1;
  double ttft = 1.0;
  double tpot = 0.05;
  double quantile = 0.9;
  std::string profile;
  std::string trace;  // a request trace (Mooncake JSONL) instead of rate + lengths
  int64_t prefill_budget = 8192;
  int64_t chunk_tokens = 0;  // chunked prefill: tokens of a longer prompt per pass; 0 = off
  int64_t step_tokens = 256;  // colocated, chunked: cost per step
  int64_t context_cost_tokens = 0;  // chunked: a token at position p costs 1 + p / this (0: 1)
  int prefill_max_batch = 256;  // prompts per prefill pass
  int max_decode_batch = 256;
  int max_ranks = 256;
  int prefill = 0;  // > 0 with --decode: evaluate this configuration instead of searching
  int decode = 0;
  int ranks = 0;  // layout: ranks in all
  bool no_overlap = false;
};

// The engine's defaults (deploy/cluster.json): prefill.chunk_tokens 256,
// prefill.context_cost_tokens 512, prefill.token_budget 2048,
// prefill.max_batch 16, decode.step_tokens 256, decode.max_running 64.
PoolsOptions layout_defaults() {
  PoolsOptions o;
  o.prefill_budget = 2048;
  o.chunk_tokens = 256;
  o.step_tokens = 256;
  o.context_cost_tokens = 512;
  o.prefill_max_batch = 16;
  o.max_decode_batch = 64;
  o.ranks = 2;
  return o;
}

json sim_json(const SimResult& s) {
  auto lat = [](const LatencyStats& l) {
    return json{{"mean", l.mean}, {"p50", l.p50}, {"p90", l.p90}, {"p99", l.p99}, {"max", l.max}};
  };
  return {{"requests", s.requests},         {"measured", s.measured},
          {"completed", s.completed},       {"failed", s.failed},
          {"preemptions", s.preemptions},   {"ttft", lat(s.ttft)},
          {"tpot", lat(s.tpot)},            {"e2e", lat(s.e2e)},
          {"queue_wait", lat(s.queue_wait)}, {"worst_gap", lat(s.worst_gap)},
          {"throughput_rps", s.throughput_rps},
          {"goodput_rps", s.goodput_rps},   {"slo_attainment", s.slo_attainment},
          {"meets_slo", s.meets_slo},       {"output_tokens_per_second", s.output_tokens_per_second},
          {"mean_decode_batch", s.mean_decode_batch}, {"prefill_utilization", s.prefill_utilization},
          {"decode_utilization", s.decode_utilization}, {"max_router_queue", s.max_router_queue}};
}

void add_sim_row(TextTable* t, const std::string& name, int ranks, const SimResult& s) {
  t->add({name, std::to_string(ranks), fmt_time(s.ttft.p50), fmt_time(s.ttft.p90), fmt_time(s.tpot.p50),
          fmt_time(s.tpot.p90), fmt_fixed(s.slo_attainment * 100, 1) + "%", fmt_fixed(s.goodput_rps, 2),
          fmt_fixed(s.goodput_rps / ranks, 3), fmt_fixed(s.mean_decode_batch, 1), std::to_string(s.preemptions),
          s.meets_slo ? "yes" : "no"});
}

// Workload, SLO and cost options of `pools` and `layout`.
void add_sim_options(CLI::App* app, PoolsOptions* po, bool* as_json) {
  CLI::Option* rate_opt = app->add_option("--rate", po->rate, "Arrival rate, requests/s (Poisson)")->capture_default_str();
  CLI::Option* prompt_opt =
      app->add_option("--prompt-len", po->prompt_len, "Prompt length: N, uniform:LO:HI, exp:MEAN, lognormal:MEAN:SIGMA")
          ->capture_default_str();
  CLI::Option* output_opt =
      app->add_option("--output-len", po->output_len, "Output length, same forms")->capture_default_str();
  CLI::Option* requests_opt =
      app->add_option("--requests", po->requests, "Simulated requests per run")->capture_default_str();
  CLI::Option* seed_opt = app->add_option("--seed", po->seed, "Workload seed")->capture_default_str();
  app->add_option("--trace", po->trace,
                  "Request trace to simulate instead of --rate/--prompt-len/--output-len: JSONL lines "
                  "{\"timestamp\": ms, \"input_length\": N, \"output_length\": N} (AIPerf's mooncake_trace)")
      ->excludes(rate_opt)
      ->excludes(prompt_opt)
      ->excludes(output_opt)
      ->excludes(requests_opt)
      ->excludes(seed_opt);
  app->add_option("--ttft", po->ttft, "TTFT SLO, seconds")->capture_default_str();
  app->add_option("--tpot", po->tpot, "Time-per-output-token SLO, seconds")->capture_default_str();
  app->add_option("--quantile", po->quantile, "SLO quantile")->capture_default_str();
  app->add_option("--profile", po->profile, "Measured engine profile JSON (default: roofline costs)");
  app->add_flag("--no-overlap", po->no_overlap, "KV handoff after the prefill pass, not layer by layer during it");
  app->add_flag("--json", *as_json, "Machine-readable JSON output");
}

// What both simulating subcommands set up: the workload, SLO, cost model and
// the cluster settings other than the pool sizes. Bad input dies naming the flag.
struct SimSetup {
  Resolved r;
  Workload w;
  Slo slo;
  KvPoolPlan pool;
  std::unique_ptr<PhaseCostModel> cost;
  std::string cost_source;
  ClusterConfig base;
};

SimSetup setup_sim(const ModelOptions& mo, const HardwareOptions& ho, const PoolsOptions& po) {
  if (!(po.rate > 0)) die("--rate: must be positive, got " + fmt_sig(po.rate));
  if (po.requests <= 0) die("--requests: must be positive, got " + std::to_string(po.requests));
  if (!(po.ttft > 0)) die("--ttft: must be positive, got " + fmt_sig(po.ttft));
  if (!(po.tpot > 0)) die("--tpot: must be positive, got " + fmt_sig(po.tpot));
  if (!(po.quantile > 0 && po.quantile <= 1)) die("--quantile: must be in (0, 1]");
  if (po.max_decode_batch <= 0) die("--max-batch: must be positive");
  if (po.chunk_tokens < 0) die("--chunk-tokens: must be 0 (off) or positive, got " + std::to_string(po.chunk_tokens));
  if (po.step_tokens <= 0) die("--step-tokens: must be positive, got " + std::to_string(po.step_tokens));
  if (po.context_cost_tokens < 0)
    die("--context-cost-tokens: must be 0 (off) or positive, got " + std::to_string(po.context_cost_tokens));
  SimSetup s;
  if (!po.trace.empty()) {
    s.w = or_die(trace_workload(po.trace));
  } else {
    s.w.arrival_rate = po.rate;
    s.w.prompt = or_die(parse_length_dist(po.prompt_len, "--prompt-len"));
    s.w.output = or_die(parse_length_dist(po.output_len, "--output-len"));
    s.w.num_requests = po.requests;
    s.w.seed = po.seed;
  }
  s.r = resolve(mo, ho, true);
  RooflineConfig rc;
  rc.weights = s.r.weights;
  rc.kv = s.r.kv;
  rc.activations = s.r.weights == Precision::kInt4 ? Precision::kInt8 : s.r.weights;
  rc.tp = ho.tp;
  {
    pd::Status st = validate_roofline_config(s.r.model, rc);
    if (!st.is_ok()) die("--" + st.message());
  }
  auto pool = kv_pool_of(s.r, ho);
  if (!pool.is_ok()) die("--tp/--hardware: " + pool.status().message());
  s.pool = *pool;

  if (!po.profile.empty()) {
    auto loaded = engine_profile_from_file(po.profile);
    if (!loaded.is_ok()) die("--profile: " + loaded.status().message());
    EngineProfile prof = std::move(loaded).value();
    s.cost_source = "engine profile " + po.profile;
    // The profile's own KV bytes per token (the engine's cache type, scales
    // included) when it has them; else the --kv precision's.
    const double kv_per_token = prof.kv_bytes_per_token > 0 ? double(prof.kv_bytes_per_token)
                                                            : double(kv_bytes_per_token(s.r.model, s.r.kv));
    s.cost = std::make_unique<ProfileCostModel>(std::move(prof), kv_per_token, s.r.model.n_layers,
                                                s.r.hw.inter_node_bandwidth * ho.tp, s.r.hw.link_latency);
  } else {
    s.cost_source = "roofline";
    s.cost = std::make_unique<RooflineCostModel>(s.r.model, s.r.hw, rc);
  }
  s.base.prefill_token_budget = po.prefill_budget;
  s.base.chunk_tokens = po.chunk_tokens;
  s.base.step_tokens = po.step_tokens;
  s.base.context_cost_tokens = po.context_cost_tokens;
  s.base.max_prefill_batch = po.prefill_max_batch;
  s.base.max_decode_batch = po.max_decode_batch;
  s.base.block_size = ho.block_size;
  s.base.decode_kv_blocks = s.pool.num_blocks;
  s.base.prefill_kv_blocks = s.pool.num_blocks;
  s.base.overlap_transfer = !po.no_overlap;
  s.slo.ttft_seconds = po.ttft;
  s.slo.tpot_seconds = po.tpot;
  s.slo.quantile = po.quantile;
  return s;
}

json workload_json(const SimSetup& s, const PoolsOptions& po) {
  json j = {{"rate", s.w.arrival_rate}, {"prompt_len", length_dist_to_string(s.w.prompt)},
            {"output_len", length_dist_to_string(s.w.output)}, {"requests", s.w.num_requests},
            {"seed", po.seed}};
  if (!po.trace.empty()) j["trace"] = po.trace;
  return j;
}

// What `pools` and `layout` both put first in their JSON: model, hardware, costs, workload, SLO, KV pool.
json sim_header_json(const SimSetup& s, const HardwareOptions& ho, const PoolsOptions& po) {
  json j;
  j["model"] = model_json(s.r.model);
  j["hardware"] = hardware_json(s.r.hw);
  j["tp"] = ho.tp;
  j["cost_model"] = s.cost_source;
  j["workload"] = workload_json(s, po);
  j["slo"] = {{"ttft_seconds", po.ttft}, {"tpot_seconds", po.tpot}, {"quantile", po.quantile}};
  j["kv_pool"] = {{"blocks_per_rank", s.pool.num_blocks}, {"block_size", ho.block_size},
                  {"tokens_per_rank", s.pool.token_capacity}};
  return j;
}

void print_sim_header(const SimSetup& s, const HardwareOptions& ho, const PoolsOptions& po) {
  print_model_line(s.r.model, s.r.weights, s.r.kv);
  print_hw_line(s.r.hw, ho.tp);
  if (po.trace.empty()) {
    std::cout << "workload: " << po.rate << " req/s Poisson, prompt " << length_dist_to_string(s.w.prompt)
              << ", output " << length_dist_to_string(s.w.output) << ", " << po.requests << " requests (seed "
              << po.seed << ")\n";
  } else {
    std::cout << "workload: trace " << po.trace << ", " << s.w.num_requests << " requests, "
              << fmt_sig(s.w.arrival_rate) << " req/s, mean prompt " << fmt_fixed(s.w.prompt.a, 0) << " and output "
              << fmt_fixed(s.w.output.a, 0) << " tokens\n";
  }
  std::cout << "SLO: TTFT p" << fmt_fixed(po.quantile * 100, 0) << " <= " << fmt_time(po.ttft) << ", TPOT p"
            << fmt_fixed(po.quantile * 100, 0) << " <= " << fmt_time(po.tpot) << "; costs from " << s.cost_source
            << "; KV pool " << s.pool.num_blocks << " blocks (" << s.pool.token_capacity << " tokens) per rank\n";
}

// The given --prefill/--decode pools and a colocated pool of the same total
// simulated, or (without them) the smallest pools searched for.
PoolPlan evaluate_pools(const SimSetup& s, const PoolsOptions& po) {
  PoolPlan plan;
  if (po.prefill == 0) {
    PoolSearchConfig sc;
    sc.max_ranks_per_pool = po.max_ranks;
    return or_die(plan_pools(s.w, s.base, *s.cost, s.slo, sc));
  }
  ClusterConfig c = s.base;
  c.prefill_ranks = po.prefill;
  c.decode_ranks = po.decode;
  plan.prefill_ranks = po.prefill;
  plan.decode_ranks = po.decode;
  plan.disaggregated = or_die(simulate(s.w, c, *s.cost, s.slo));
  c.colocated = true;
  c.decode_ranks = po.prefill + po.decode;
  plan.colocated_same_total = or_die(simulate(s.w, c, *s.cost, s.slo));
  plan.feasible = plan.disaggregated.meets_slo;
  plan.simulations = 2;
  if (!plan.feasible) plan.reason = "the given pools miss the SLOs";
  return plan;
}

json pools_json(const SimSetup& s, const HardwareOptions& ho, const PoolsOptions& po, const PoolPlan& plan,
                double wall, bool evaluated) {
  json j = sim_header_json(s, ho, po);
  j["chunk_tokens"] = po.chunk_tokens;
  j["feasible"] = plan.feasible;
  if (!plan.reason.empty()) j["reason"] = plan.reason;
  j["simulations"] = plan.simulations;
  j["wall_seconds"] = wall;
  if (evaluated) {
    j["prefill_ranks"] = plan.prefill_ranks;
    j["decode_ranks"] = plan.decode_ranks;
    j["disaggregated"] = sim_json(plan.disaggregated);
    j["colocated_same_total"] = sim_json(plan.colocated_same_total);
    j["colocated_min_ranks"] = plan.colocated_min_ranks;
    if (plan.colocated_min_ranks > 0) j["colocated_min"] = sim_json(plan.colocated_min);
  }
  return j;
}

// The pools found (or given) against the colocated pools, as a table.
void print_pools_table(const SimSetup& s, const HardwareOptions& ho, const PoolsOptions& po, const PoolPlan& plan,
                       double wall) {
  if (po.prefill == 0) {
    std::cout << "smallest pools meeting the SLOs: " << plan.prefill_ranks << " prefill + " << plan.decode_ranks
              << " decode ranks (" << (plan.prefill_ranks + plan.decode_ranks) * ho.tp << " devices)\n\n";
  } else if (!plan.feasible) {
    std::cout << "the given pools (" << po.prefill << " prefill + " << po.decode << " decode) miss the SLOs\n\n";
  }
  TextTable t({"configuration", "ranks", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "in SLO", "goodput/s",
           "per rank", "batch", "preempt", "meets"});
  add_sim_row(&t,
              "disaggregated " + std::to_string(plan.prefill_ranks) + "P+" + std::to_string(plan.decode_ranks) + "D",
              plan.prefill_ranks + plan.decode_ranks, plan.disaggregated);
  add_sim_row(&t, "colocated, same total", plan.prefill_ranks + plan.decode_ranks, plan.colocated_same_total);
  if (po.prefill == 0) {
    if (plan.colocated_min_ranks > 0) {
      add_sim_row(&t, "colocated, smallest", plan.colocated_min_ranks, plan.colocated_min);
    } else {
      t.add({"colocated, smallest", "> " + std::to_string(po.max_ranks), "", "", "", "", "", "", "", "", "", "no"});
    }
  }
  t.print(std::cout);
  std::cout << "\n(goodput = requests/s within both SLOs; " << plan.simulations << " simulations of "
            << s.w.num_requests << " requests in " << fmt_fixed(wall, 2) << " s)\n";
}

int run_pools(const ModelOptions& mo, const HardwareOptions& ho, const PoolsOptions& po, bool as_json) {
  if (po.prefill_budget <= 0) die("--prefill-budget: must be positive");
  if (po.max_ranks <= 0) die("--max-ranks: must be positive");
  if ((po.prefill > 0) != (po.decode > 0)) die("--prefill and --decode: give both (or neither, to search)");
  const SimSetup s = setup_sim(mo, ho, po);
  const auto t0 = std::chrono::steady_clock::now();
  const PoolPlan plan = evaluate_pools(s, po);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool evaluated = po.prefill > 0 || plan.feasible;
  if (as_json) {
    std::cout << pools_json(s, ho, po, plan, wall, evaluated).dump(2) << "\n";
    return 0;
  }
  print_sim_header(s, ho, po);
  if (po.chunk_tokens > 0) {
    std::cout << "chunked prefill: " << po.chunk_tokens << " tokens of a longer prompt per pass; colocated steps of "
              << po.step_tokens << " tokens\n";
  }
  std::cout << "\n";
  if (!evaluated) {
    std::cout << "no pool sizes meet the SLOs: " << plan.reason << "\n";
    std::cout << "(" << plan.simulations << " simulations, " << fmt_fixed(wall, 2) << " s)\n";
    return 0;
  }
  print_pools_table(s, ho, po, plan, wall);
  return 0;
}

// The engine settings `layout` simulates, as its JSON reports them.
json layout_engine_json(const PoolsOptions& po) {
  return {{"chunk_tokens", po.chunk_tokens},      {"token_budget", po.prefill_budget},
          {"step_tokens", po.step_tokens},        {"prefill_max_batch", po.prefill_max_batch},
          {"context_cost_tokens", po.context_cost_tokens},
          {"max_running", po.max_decode_batch},   {"overlap_transfer", !po.no_overlap}};
}

json layout_json(const SimSetup& s, const HardwareOptions& ho, const PoolsOptions& po, const LayoutAnswer& ans,
                 bool feasible, double wall) {
  json j = sim_header_json(s, ho, po);
  j["engine"] = layout_engine_json(po);
  j["ranks"] = ans.ranks;
  j["layouts"] = json::array();
  for (const LayoutResult& l : ans.layouts) {
    json lj = sim_json(l.result);
    lj["name"] = l.name;
    lj["colocated"] = l.colocated;
    lj["prefill_ranks"] = l.prefill_ranks;
    lj["decode_ranks"] = l.decode_ranks;
    j["layouts"].push_back(lj);
  }
  j["recommended"] = ans.layouts[static_cast<size_t>(ans.recommended)].name;
  j["feasible"] = feasible;  // some layout meets both SLOs at their quantile
  if (!ans.reason.empty()) j["reason"] = ans.reason;
  j["simulations"] = ans.layouts.size();
  j["wall_seconds"] = wall;
  return j;
}

// The engine line, a row per layout, and the recommendation.
void print_layouts(const SimSetup& s, const PoolsOptions& po, const LayoutAnswer& ans, bool feasible, double wall) {
  std::cout << "engine: ";
  if (po.chunk_tokens > 0) {
    std::cout << "chunked prefill, chunks of " << po.chunk_tokens << " (a token at position p costs 1 + p/"
              << po.context_cost_tokens << "), ";
  } else {
    std::cout << "whole prompts, ";
  }
  std::cout << po.prefill_budget << " prompt tokens and " << po.prefill_max_batch << " prompts per prefill pass, ";
  if (po.chunk_tokens > 0) std::cout << po.step_tokens << " tokens per colocated step, ";
  std::cout << po.max_decode_batch << " running per rank\n\n";
  TextTable t({"layout", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "worst gap p90", "in SLO", "goodput/s",
               "meets"});
  for (const LayoutResult& l : ans.layouts) {
    const SimResult& r = l.result;
    t.add({l.name, fmt_time(r.ttft.p50), fmt_time(r.ttft.p90), fmt_time(r.tpot.p50), fmt_time(r.tpot.p90),
           fmt_time(r.worst_gap.p90), fmt_fixed(r.slo_attainment * 100, 1) + "%", fmt_fixed(r.goodput_rps, 3),
           r.meets_slo ? "yes" : "no"});
  }
  t.print(std::cout);
  const LayoutResult& best = ans.layouts[static_cast<size_t>(ans.recommended)];
  if (!feasible) {
    std::cout << "\nno layout of " << ans.ranks << " ranks meets the SLOs (p" << fmt_fixed(po.quantile * 100, 0)
              << "); the least bad:";
  } else {
    std::cout << "\nrecommended:";
  }
  std::cout << " " << best.name << " (" << fmt_fixed(best.result.goodput_rps, 3) << " of "
            << fmt_sig(s.w.arrival_rate) << " req/s within both SLOs, TTFT p90 " << fmt_time(best.result.ttft.p90)
            << ", TPOT p90 " << fmt_time(best.result.tpot.p90) << ")\n";
  if (!ans.reason.empty()) std::cout << "(no layout can: " << ans.reason << ")\n";
  std::cout << "(highest goodput = requests/s within both SLOs, ties to the lower TTFT p90; worst gap = a "
               "request's longest wait between two tokens; "
            << ans.layouts.size() << " simulations of " << s.w.num_requests << " requests in " << fmt_fixed(wall, 2)
            << " s)\n";
}

// pd-plan layout: with N ranks in all, colocated xN or which xP+yD?
int run_layout(const ModelOptions& mo, const HardwareOptions& ho, const PoolsOptions& po, bool as_json) {
  if (po.ranks < 1 || po.ranks > 1024) die("--ranks: must be in [1, 1024], got " + std::to_string(po.ranks));
  if (po.prefill_budget <= 0) die("--token-budget: must be positive, got " + std::to_string(po.prefill_budget));
  if (po.prefill_max_batch <= 0) {
    die("--prefill-max-batch: must be positive, got " + std::to_string(po.prefill_max_batch));
  }
  const SimSetup s = setup_sim(mo, ho, po);
  const auto t0 = std::chrono::steady_clock::now();
  const LayoutAnswer ans = or_die(compare_layouts(s.w, s.base, *s.cost, s.slo, po.ranks));
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool feasible = std::any_of(ans.layouts.begin(), ans.layouts.end(),
                                    [](const LayoutResult& l) { return l.result.meets_slo; });
  if (as_json) {
    std::cout << layout_json(s, ho, po, ans, feasible, wall).dump(2) << "\n";
    return 0;
  }
  print_sim_header(s, ho, po);
  print_layouts(s, po, ans, feasible, wall);
  return 0;
}

// ---- pd-plan list ---------------------------------------------------------------------------

int run_list(bool as_json) {
  if (as_json) {
    json j;
    j["models"] = json::array();
    for (const ModelSpec& m : model_presets()) j["models"].push_back(model_json(m));
    j["hardware"] = json::array();
    for (const HardwareSpec& h : hardware_presets()) j["hardware"].push_back(hardware_json(h));
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  TextTable m({"model", "layers", "hidden", "heads", "KV heads", "head dim", "FFN", "vocab", "params", "KV B/token bf16"});
  for (const ModelSpec& s : model_presets()) {
    m.add({s.name, std::to_string(s.n_layers), std::to_string(s.hidden), std::to_string(s.n_heads),
           std::to_string(s.n_kv_heads), std::to_string(s.head_dim), std::to_string(s.ffn), std::to_string(s.vocab),
           fmt_count(double(parameter_count(s))), std::to_string(kv_bytes_per_token(s, Precision::kBf16))});
  }
  m.print(std::cout);
  std::cout << "\n";
  TextTable h({"hardware", "peak TFLOP/s", "memory GB/s", "memory", "NVLink GB/s", "NIC GB/s", "ridge FLOP/B"});
  for (const HardwareSpec& s : hardware_presets()) {
    h.add({s.name, fmt_sig(s.peak_flops / 1e12), fmt_sig(s.mem_bandwidth / 1e9), fmt_bytes(double(s.mem_capacity)),
           fmt_sig(s.intra_node_bandwidth / 1e9), fmt_sig(s.inter_node_bandwidth / 1e9),
           fmt_fixed(s.ridge_intensity(), 1)});
  }
  h.print(std::cout);
  return 0;
}

// ---- the command line -------------------------------------------------------------------------

// Every subcommand's options; the subcommands share the model and hardware ones.
struct PlanOptions {
  bool as_json = false;
  ModelOptions mo;
  HardwareOptions ho;
  KvOptions ko;
  RooflineOptions ro;
  PoolsOptions po;
  PoolsOptions lo = layout_defaults();
};

CLI::App* add_kv_command(CLI::App* app, PlanOptions* o) {
  CLI::App* kv = app->add_subcommand("kv", "KV-cache footprint and KV pool sizing");
  add_model_options(kv, &o->mo);
  add_hardware_options(kv, &o->ho);
  kv->add_option("--context", o->ko.contexts, "Context lengths (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  kv->add_option("--batch", o->ko.batches, "Batch sizes (comma-separated)")->delimiter(',')->capture_default_str();
  kv->add_flag("--json", o->as_json, "Machine-readable JSON output");
  return kv;
}

CLI::App* add_roofline_command(CLI::App* app, PlanOptions* o) {
  RooflineOptions& ro = o->ro;
  CLI::App* rf = app->add_subcommand("roofline", "Roofline of prefill vs decode; cost without a KV cache");
  add_model_options(rf, &o->mo);
  add_hardware_options(rf, &o->ho);
  rf->add_option("--prompt", ro.prompts, "Prompt lengths P (comma-separated)")->delimiter(',')->capture_default_str();
  rf->add_option("--batch", ro.batches, "Decode batch sizes B (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  rf->add_option("--context", ro.context, "Decode context length L")->capture_default_str();
  rf->add_option("--generated", ro.generated, "N for the naive-vs-cached generation cost")->capture_default_str();
  rf->add_option("--activations", ro.activations, "Activation precision (default: the weight precision)");
  rf->add_flag("--json", o->as_json, "Machine-readable JSON output (input of scripts/plot_roofline.py)");
  return rf;
}

CLI::App* add_pools_command(CLI::App* app, PlanOptions* o) {
  PoolsOptions& po = o->po;
  CLI::App* pl = app->add_subcommand("pools", "Size prefill and decode pools by simulation");
  add_model_options(pl, &o->mo);
  add_hardware_options(pl, &o->ho);
  add_sim_options(pl, &po, &o->as_json);
  pl->add_option("--prefill-budget", po.prefill_budget, "Prompt tokens per prefill pass")->capture_default_str();
  pl->add_option("--chunk-tokens", po.chunk_tokens,
                 "Chunked prefill: tokens of a longer prompt per pass (0 = off: whole prompts)")
      ->capture_default_str();
  pl->add_option("--step-tokens", po.step_tokens,
                 "Chunked prefill, colocated: tokens per step (1 per running decode, prompt chunks the rest)")
      ->capture_default_str();
  pl->add_option("--context-cost-tokens", po.context_cost_tokens,
                 "Chunked prefill: a token at context position p costs 1 + p / this in chunks and budgets (0 = off)")
      ->capture_default_str();
  pl->add_option("--max-batch", po.max_decode_batch, "Running sequences per decode rank")->capture_default_str();
  pl->add_option("--max-ranks", po.max_ranks, "Search cap per pool")->capture_default_str();
  pl->add_option("--prefill", po.prefill, "Evaluate this many prefill ranks (with --decode) instead of searching")
      ->check(CLI::Range(1, 4096));
  pl->add_option("--decode", po.decode, "Evaluate this many decode ranks (with --prefill)")->check(CLI::Range(1, 4096));
  return pl;
}

CLI::App* add_layout_command(CLI::App* app, PlanOptions* o) {
  PoolsOptions& lo = o->lo;
  CLI::App* ly = app->add_subcommand(
      "layout", "With N ranks in all: colocated xN or xP+yD? Simulates each, recommends the best");
  add_model_options(ly, &o->mo);
  add_hardware_options(ly, &o->ho);
  add_sim_options(ly, &lo, &o->as_json);
  ly->add_option("--ranks", lo.ranks, "Ranks in all (N)")->capture_default_str();
  ly->add_option("--chunk-tokens", lo.chunk_tokens,
                 "prefill.chunk_tokens: tokens of a longer prompt per pass (0 = off: whole prompts)")
      ->capture_default_str();
  ly->add_option("--token-budget,--prefill-budget", lo.prefill_budget,
                 "prefill.token_budget: prompt tokens per prefill pass")
      ->capture_default_str();
  ly->add_option("--step-tokens", lo.step_tokens,
                 "decode.step_tokens: tokens per colocated step (1 per running decode, prompt chunks the rest, "
                 "at least a quarter)")
      ->capture_default_str();
  ly->add_option("--context-cost-tokens", lo.context_cost_tokens,
                 "prefill.context_cost_tokens: a token at context position p costs 1 + p / this (0 = off)")
      ->capture_default_str();
  ly->add_option("--prefill-max-batch", lo.prefill_max_batch, "prefill.max_batch: prompts per pass")
      ->capture_default_str();
  ly->add_option("--max-batch", lo.max_decode_batch, "decode.max_running: running sequences per rank")
      ->capture_default_str();
  return ly;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "pd-plan: capacity planner for a disaggregated prefill/decode cluster.\n"
      "  pd-plan kv        KV-cache footprint vs weights, GQA vs MHA, and a rank's KV pool\n"
      "  pd-plan roofline  arithmetic intensity of prefill and decode, ridge point, time estimates,\n"
      "                    and the cost of generating without a KV cache\n"
      "  pd-plan pools     smallest prefill/decode pools meeting TTFT/TPOT SLOs (simulation),\n"
      "                    against a colocated pool\n"
      "  pd-plan layout    with N ranks in all: colocated xN or xP+yD, which meets the SLOs best\n"
      "                    (chunked prefill as the engine runs it)\n"
      "  pd-plan list      model and hardware presets\n"
      "docs/PLANNER.md explains every figure."};
  app.require_subcommand(1);
  PlanOptions o;
  app.add_flag("--json", o.as_json, "Machine-readable JSON output");
  CLI::App* kv = add_kv_command(&app, &o);
  CLI::App* rf = add_roofline_command(&app, &o);
  CLI::App* pl = add_pools_command(&app, &o);
  CLI::App* ly = add_layout_command(&app, &o);
  CLI::App* ls = app.add_subcommand("list", "Model and hardware presets");
  ls->add_flag("--json", o.as_json, "Machine-readable JSON output");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    die(e.what());
  }
  if (kv->parsed()) return run_kv(o.mo, o.ho, o.ko, o.as_json);
  if (rf->parsed()) return run_roofline(o.mo, o.ho, o.ro, o.as_json);
  if (pl->parsed()) return run_pools(o.mo, o.ho, o.po, o.as_json);
  if (ly->parsed()) return run_layout(o.mo, o.ho, o.lo, o.as_json);
  if (ls->parsed()) return run_list(o.as_json);
  return 0;
}
