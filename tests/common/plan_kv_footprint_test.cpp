// KV bytes per token, footprints and pool sizing against hand-worked numbers.
#include <catch2/catch.hpp>

#include "common/plan_test_presets.h"

#include <cstdint>
#include <vector>

#include "kv/kv_block_manager.h"
#include "plan/kv_footprint.h"
#include "plan/model_spec.h"

using namespace pd::plan;
using pd::plan::test::preset;

namespace {
constexpr int64_t kGiB = int64_t{1} << 30;
}  // namespace

TEST_CASE("plan: KV bytes per token goes through KvGeometry", "[plan][kv]") {
  const ModelSpec l70 = preset("llama-3.1-70b");
  // 2 (K, V) x 80 layers x 8 KV heads x 128 head dim x 2 bytes (bf16) = 327,680 B = 320 KiB.
  CHECK(kv_bytes_per_token(l70, Precision::kBf16) == 327'680);
  CHECK(kv_geometry(l70, Precision::kBf16).bytes_per_token() == 327'680);
  CHECK(kv_bytes_per_token(l70, Precision::kFp32) == 655'360);
  CHECK(kv_bytes_per_token(l70, Precision::kFp8) == 163'840);
  CHECK(kv_bytes_per_token(l70, Precision::kInt8) == 163'840);
  // int4: half a byte per element: 2 x 80 x 8 x 128 / 2 = 81,920.
  CHECK(kv_bytes_per_token(l70, Precision::kInt4) == 81'920);
  // Plain MHA would hold all 64 heads: 8x as much.
  CHECK(kv_geometry_mha(l70, Precision::kBf16).bytes_per_token() == 2'621'440);

  // SmolLM2-135M: 2 x 30 x 3 x 64 x 2 = 23,040 B/token in bf16; 46,080 in fp32.
  const ModelSpec smol = preset("smollm2-135m");
  CHECK(kv_bytes_per_token(smol, Precision::kBf16) == 23'040);
  CHECK(kv_bytes_per_token(smol, Precision::kFp32) == 46'080);

  // The shared geometry: sub-byte widths through bits_per_element, old fields untouched.
  pd::KvGeometry g{80, 8, 128, 2};
  CHECK(g.bytes_per_token() == 327'680);
  g.bits_per_element = 4;
  CHECK(g.bytes_per_token() == 81'920);
}

TEST_CASE("plan: 70B GQA footprint at 4K, 32K and 128K context, batch 32", "[plan][kv]") {
  const ModelSpec l70 = preset("llama-3.1-70b");
  const std::vector<int64_t> contexts = {4096, 32768, 131072};
  const std::vector<int64_t> batches = {32};
  auto rows = kv_footprint_table(l70, Precision::kBf16, Precision::kBf16, contexts, batches);
  REQUIRE(rows.is_ok());
  REQUIRE(rows->size() == 3);
  // Weights: 70,553,706,496 params x 2 B = 141,107,412,992 B (141.1 GB).
  const int64_t weights = 141'107'412'992;
  // 4K:   327,680 B x 4,096 x 32   = 42,949,672,960 B    = 40 GiB    (42.9 GB); MHA 320 GiB.
  // 32K:  327,680 B x 32,768 x 32  = 343,597,383,680 B   = 320 GiB   (343.6 GB); MHA 2,560 GiB.
  // 128K: 327,680 B x 131,072 x 32 = 1,374,389,534,720 B = 1,280 GiB (1.37 TB); MHA 10,240 GiB.
  const int64_t expect_gib[] = {40, 320, 1280};
  for (size_t i = 0; i < 3; ++i) {
    const KvFootprintRow& r = (*rows)[i];
    INFO("context " << r.context);
    CHECK(r.batch == 32);
    CHECK(r.weight_bytes == weights);
    CHECK(r.kv_bytes == expect_gib[i] * kGiB);
    CHECK(r.kv_bytes_mha == 8 * expect_gib[i] * kGiB);
  }
  CHECK((*rows)[0].kv_bytes == 42'949'672'960);
  // 42,949,672,960 / 141,107,412,992 = 30.437%; 1,374,389,534,720 / 141,107,412,992 = 973.99%.
  CHECK((*rows)[0].kv_percent_of_weights == Approx(30.437).epsilon(1e-4));
  CHECK((*rows)[2].kv_percent_of_weights == Approx(973.99).epsilon(1e-4));
  // Share of KV in (KV + weights) at 4K: 42.95 / (42.95 + 141.11) = 23.335%.
  CHECK((*rows)[0].kv_share_percent == Approx(23.335).epsilon(1e-3));
  // int4 KV at 4K: a quarter of bf16: 10 GiB.
  CHECK(kv_bytes(l70, Precision::kInt4, 4096, 32) == 10 * kGiB);
}

TEST_CASE("plan: footprint table rejects non-positive sizes, naming them", "[plan][kv]") {
  const ModelSpec m = preset("llama-3.1-8b");
  const std::vector<int64_t> good = {1024};
  const std::vector<int64_t> bad = {1024, 0};
  const std::vector<int64_t> neg = {-5};
  auto r1 = kv_footprint_table(m, Precision::kBf16, Precision::kBf16, bad, good);
  REQUIRE_FALSE(r1.is_ok());
  CHECK(r1.status().message().find("context") != std::string::npos);
  auto r2 = kv_footprint_table(m, Precision::kBf16, Precision::kBf16, good, neg);
  REQUIRE_FALSE(r2.is_ok());
  CHECK(r2.status().message().find("batch") != std::string::npos);
}

TEST_CASE("plan: KV pool sizing for 70B on 4 x H100 80 GB", "[plan][kv]") {
  const ModelSpec l70 = preset("llama-3.1-70b");
  KvPoolConfig cfg;
  cfg.device_memory_bytes = 80'000'000'000;
  cfg.devices = 4;
  cfg.memory_fraction = 0.9;
  cfg.block_size = 16;
  auto plan = plan_kv_pool(l70, Precision::kBf16, Precision::kBf16, cfg);
  REQUIRE(plan.is_ok());
  // Usable 72e9 B per device; weights 141,107,412,992 / 4 = 35,276,853,248 B per device;
  // KV budget 36,723,146,752 B. Each device holds 8 / 4 = 2 KV heads: 2 x 80 x 2 x 128 x 2 =
  // 81,920 B per token, 1,310,720 B per 16-token block: 28,017 blocks = 448,272 tokens.
  CHECK(plan->weight_bytes_per_device == 35'276'853'248);
  CHECK(plan->kv_budget_per_device == 36'723'146'752);
  CHECK(plan->kv_heads_per_device == 2);
  CHECK(plan->kv_bytes_per_token_per_device == 81'920);
  CHECK(plan->num_blocks == 28'017);
  CHECK(plan->token_capacity == 448'272);
  // 4K-token sequences need 256 blocks each: 109 fit.
  CHECK(plan->max_sequences(4096) == 109);
  // The same number through the shared helper the decode workers call.
  pd::KvGeometry g = kv_geometry(l70, Precision::kBf16);
  g.n_kv_heads = 2;
  CHECK(pd::kv_blocks_for_budget(g, 16, plan->kv_budget_per_device) == plan->num_blocks);

  // On one device the weights alone do not fit.
  cfg.devices = 1;
  auto none = plan_kv_pool(l70, Precision::kBf16, Precision::kBf16, cfg);
  REQUIRE_FALSE(none.is_ok());
  CHECK(none.status().is_resource_exhausted());
  // Bad config names the field.
  cfg.devices = 3;  // 8 KV heads do not split over 3 devices
  auto split = plan_kv_pool(l70, Precision::kBf16, Precision::kBf16, cfg);
  REQUIRE_FALSE(split.is_ok());
  CHECK(split.status().message().find("tp") != std::string::npos);
  cfg.devices = 4;
  cfg.block_size = 0;
  auto bs = plan_kv_pool(l70, Precision::kBf16, Precision::kBf16, cfg);
  REQUIRE_FALSE(bs.is_ok());
  CHECK(bs.status().message().find("block_size") != std::string::npos);
}
