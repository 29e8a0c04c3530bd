// A llama.cpp Q4_K_M file through the CPU backend's int8 path: gemma-3-270m
// (models/gemma-3-270m-q4_k_m.gguf, or PD_GEMMA_MODEL) mixes Q4_K, Q5_0 (the
// matrices whose rows, 640 elements, are not whole 256-element super-blocks),
// Q6_K and Q8_0. Every quantized weight must be repacked and unpack to
// ggml's dequantization bit for bit; only the F32 norms stay as stored; one
// matrix of each type gives the fp32 path's products within the 8-bit
// activations' error. Loading only: the model itself is not run here.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/q8_kernels.h"
#include "gguf/gguf_reader.h"
#include "test_support.h"

namespace {

pd::Tensor f32_tensor(std::vector<float>& v, int64_t ne0, int64_t ne1) {
  pd::Tensor t;
  t.ne = {ne0, ne1, 1, 1};
  t.data = v.data();
  return t;
}

}  // namespace

TEST_CASE("gemma-3-270m Q4_K_M: every quantized weight loads repacked and unpacks exactly", "[model][kquant]") {
  pd::test::require_gemma3_model();
  const std::string path = pd::test::gemma3_model_path();
  auto file = pd::GgufFile::open(path);
  REQUIRE(file.is_ok());
  pd::CpuBackendConfig cfg;
  cfg.n_threads = 2;
  auto be = pd::make_cpu_backend(cfg);
  pd::CpuBackendConfig fp32_cfg = cfg;
  fp32_cfg.int8_activations = false;
  auto fp32 = pd::make_cpu_backend(fp32_cfg);

  std::map<std::string, int> packed, kept;
  std::map<pd::GgmlType, const pd::GgufTensorInfo*> sample;  // one matrix of each type, for the matmul check
  std::vector<std::unique_ptr<pd::BackendBuffer>> storage;
  std::vector<float> a, b;
  for (const pd::GgufTensorInfo& t : file.value()->tensors()) {
    std::unique_ptr<pd::BackendBuffer> buf;
    auto w = be->load_weight(t, &buf);
    REQUIRE(w.is_ok());
    INFO(t.name << " " << pd::ggml_type_name(t.type));
    if (w->layout == 0) {
      ++kept[pd::ggml_type_name(t.type)];
      CHECK(t.type == pd::GgmlType::kF32);
      continue;
    }
    ++packed[pd::ggml_type_name(t.type)];
    CHECK(w->layout == static_cast<uint8_t>(pd::cpu::packed_format_for(t.type)));
    const int64_t k = t.ne[0], n = t.n_elements() / k;
    const size_t rb = pd::ggml_row_bytes(t.type, k);
    a.resize(k), b.resize(k);
    int64_t mismatched = 0;
    for (int64_t r = 0; r < n; ++r) {
      pd::cpu::unpack_row(static_cast<pd::cpu::PackedFormat>(w->layout), w->data, k, r, a.data());
      pd::dequantize_row(t.type, t.data + r * rb, b.data(), k);
      mismatched += std::memcmp(a.data(), b.data(), k * sizeof(float)) != 0;
    }
    CHECK(mismatched == 0);
    if (t.name != "token_embd.weight" && !sample.count(t.type)) sample[t.type] = &t;
    storage.push_back(std::move(buf));
  }
  for (const auto& [type, count] : packed) std::printf("gemma-3-270m: %d %s matrices repacked\n", count, type.c_str());
  for (const auto& [type, count] : kept) std::printf("gemma-3-270m: %d %s tensors as stored\n", count, type.c_str());
  CHECK(packed.size() == 4);  // Q4_K, Q5_0, Q6_K, Q8_0
  CHECK(kept.size() == 1);    // F32

  for (const auto& [type, info] : sample) {
    INFO(info->name << " " << pd::ggml_type_name(type));
    const int64_t k = info->ne[0], n = info->ne[1], m = 3;
    std::vector<float> x = pd::test::random_floats(k * m, 5), got(n * m), want(n * m), deq(k * n);
    pd::Tensor xt = f32_tensor(x, k, m), gt = f32_tensor(got, n, m), wt = f32_tensor(want, n, m);
    std::unique_ptr<pd::BackendBuffer> buf;
    auto w8 = be->load_weight(*info, &buf);
    auto w32 = fp32->load_weight(*info, nullptr);
    REQUIRE((w8.is_ok() && w32.is_ok()));
    REQUIRE(w8->layout != 0);
    REQUIRE(be->matmul(xt, w8.value(), gt).is_ok());
    REQUIRE(fp32->matmul(xt, w32.value(), wt).is_ok());
    const size_t rb = pd::ggml_row_bytes(type, k);
    for (int64_t r = 0; r < n; ++r) pd::dequantize_row(type, info->data + r * rb, deq.data() + r * k, k);
    int64_t outside = 0;
    for (int64_t t = 0; t < m; ++t)
      for (int64_t r = 0; r < n; ++r) {
        double mag = 0.0;
        for (int64_t j = 0; j < k; ++j) mag += std::fabs(static_cast<double>(deq[r * k + j]) * x[t * k + j]);
        outside += std::fabs(got[t * n + r] - want[t * n + r]) > 0.02 * mag + 1e-5;
      }
    CHECK(outside == 0);
  }
}
