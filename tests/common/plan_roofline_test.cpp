// Roofline formulas against hand-worked numbers.
#include <catch2/catch.hpp>

#include "common/plan_test_presets.h"

#include "plan/hardware.h"
#include "plan/model_spec.h"
#include "plan/roofline.h"

using namespace pd::plan;
using pd::plan::test::preset;
using pd::plan::test::hw;


TEST_CASE("plan: arithmetic intensity formulas", "[plan][roofline]") {
  // d = 8192 (70B), bf16 (S = 2).
  // Prefill, P = 4096: 2 P d^2 / ((2 P d + d^2) S) = 2*4096*8192 / ((2*4096 + 8192) * 2)
  //   = 67,108,864 / 32,768 = 2048 FLOP/B. The limit 2P/S = 4096 holds only for P << d/2.
  CHECK(linear_intensity(4096, 8192, 2, 2) == Approx(2048.0));
  CHECK(linear_intensity_limit(4096, 2) == Approx(4096.0));
  // P = 64 << d/2: 2*64*8192 / ((128 + 8192) * 2) = 1,048,576 / 16,640 = 63.015; limit 64.
  CHECK(linear_intensity(64, 8192, 2, 2) == Approx(63.0154).epsilon(1e-5));
  // Decode, B = 32: 2*32*8192 / ((64 + 8192) * 2) = 524,288 / 16,512 = 31.752; limit 2B/S = 32.
  CHECK(linear_intensity(32, 8192, 2, 2) == Approx(31.7519).epsilon(1e-5));
  CHECK(linear_intensity_limit(32, 2) == Approx(32.0));
  // Large P saturates at d / S_a: P = 1e9 -> ~4096.
  CHECK(linear_intensity(1e9, 8192, 2, 2) == Approx(4096.0).epsilon(1e-4));
  // Decode attention: 2G/S; 70B G = 8: 8 FLOP/B in bf16, 16 in fp8; MHA (G = 1) bf16: 1.
  CHECK(decode_attention_intensity(8, 2) == Approx(8.0));
  CHECK(decode_attention_intensity(8, 1) == Approx(16.0));
  CHECK(decode_attention_intensity(1, 2) == Approx(1.0));
}

TEST_CASE("plan: hardware presets and ridge points", "[plan][roofline]") {
  // H100 SXM: 989e12 / 3.35e12 = 295.2 FLOP/B; H200: 989e12 / 4.8e12 = 206.0; A100: 312e12 / 2.039e12 = 153.0.
  CHECK(hw("h100-sxm").ridge_intensity() == Approx(295.22).epsilon(1e-4));
  CHECK(hw("h200").ridge_intensity() == Approx(206.04).epsilon(1e-4));
  CHECK(hw("a100-80gb-sxm").ridge_intensity() == Approx(153.02).epsilon(1e-4));
  for (const HardwareSpec& h : hardware_presets()) CHECK(validate_hardware(h).is_ok());
  auto unknown = hardware_preset("tpu-v9");
  REQUIRE_FALSE(unknown.is_ok());
  CHECK(unknown.status().message().find("tpu-v9") != std::string::npos);
}

TEST_CASE("plan: 70B decode step at 4K context, batch 32, on one H100 (whole model)", "[plan][roofline]") {
  const ModelSpec m = preset("llama-3.1-70b");
  const HardwareSpec h = hw("h100-sxm");
  RooflineConfig c;  // bf16 weights, KV, activations; tp 1 (the whole model's work on one device)
  const PhaseCost p = decode_step_cost(m, h, c, 32, 4096);
  // Attention: 80 layers x 4 x 64 heads x 128 x 32 seqs x 4096 = 343,597,383,680 FLOPs;
  // bytes: KV 32 x 4096 x 327,680 = 42,949,672,960 + Q/O 32 x 80 x 2 x 8192 x 2 = 83,886,080
  //   = 43,033,559,040 B; intensity 7.984 (~2G/S = 8): memory-bound (ridge 295).
  CHECK(p.attention.flops == Approx(343'597'383'680.0));
  CHECK(p.attention.bytes == Approx(43'033'559'040.0));
  CHECK(p.attention.intensity() == Approx(7.9844).epsilon(1e-4));
  CHECK_FALSE(p.attention.compute_bound());
  // 43,033,559,040 / 3.35e12 = 12.846 ms.
  CHECK(p.attention.seconds() == Approx(0.0128458).epsilon(1e-4));
  // Linear: matrix weights 80 x 855,638,016 + LM head 8192 x 128,256 = 69,501,714,432;
  // FLOPs 2 x 32 x 69,501,714,432 = 4,448,109,723,648; bytes 2 x 69,501,714,432 (weights)
  // + activations 32 x 80 x 161,792 x 2 + 32 x (8192 + 128,256) x 2 = 139,840,536,576 B.
  CHECK(p.linear.flops == Approx(4'448'109'723'648.0));
  CHECK(p.linear.bytes == Approx(139'840'536'576.0));
  CHECK_FALSE(p.linear.compute_bound());
  // 139,840,536,576 / 3.35e12 = 41.743 ms; step = 41.743 + 12.846 = 54.59 ms.
  CHECK(p.seconds() == Approx(0.054589).epsilon(1e-4));
}

TEST_CASE("plan: 70B prefill of 4096 tokens is compute-bound on an H100", "[plan][roofline]") {
  const ModelSpec m = preset("llama-3.1-70b");
  const HardwareSpec h = hw("h100-sxm");
  RooflineConfig c;
  const PhaseCost p = prefill_cost(m, h, c, 4096);
  // Linear FLOPs: 2 x 4096 x 80 x 855,638,016 + 2 x 1 x 128,256 x 8192 = 560,750,348,779,520
  //   + 2,101,346,304 = 560,752,450,125,824 (~2 x params x P).
  CHECK(p.linear.flops == Approx(560'752'450'125'824.0));
  CHECK(p.linear.compute_bound());
  // Causal attention: 80 x 2 x 64 x 128 x (4096^2 + 4096) = 21,995,857,510,400 FLOPs.
  CHECK(p.attention.flops == Approx(21'995'857'510'400.0));
  // Time ~ (560.75 + 22.00) TFLOP / 989 TFLOP/s = 0.589 s (the attention group is compute-bound too).
  CHECK(p.seconds() == Approx((560'752'450'125'824.0 + 21'995'857'510'400.0) / 989e12).epsilon(1e-3));
}

TEST_CASE("plan: tensor parallelism splits work and adds all-reduce time", "[plan][roofline]") {
  const ModelSpec m = preset("llama-3.1-70b");
  const HardwareSpec h = hw("h100-sxm");
  RooflineConfig one, four;
  four.tp = 4;
  const PhaseCost a = decode_step_cost(m, h, one, 32, 4096);
  const PhaseCost b = decode_step_cost(m, h, four, 32, 4096);
  CHECK(b.linear.seconds() == Approx(a.linear.seconds() / 4));
  // All-reduce: 2 per layer x 80 x 2 x 3/4 x (32 x 8192 x 2 B) / 450e9 B/s = 0.2237 ms.
  CHECK(b.comm_seconds == Approx(2.0 * 80 * 2 * 0.75 * 32 * 8192 * 2 / 450e9));
  CHECK(validate_roofline_config(m, four).is_ok());
  RooflineConfig bad;
  bad.tp = 3;  // 64 heads over 3 devices
  CHECK_FALSE(validate_roofline_config(m, bad).is_ok());
  bad.tp = 0;
  auto st = validate_roofline_config(m, bad);
  REQUIRE_FALSE(st.is_ok());
  CHECK(st.message().find("tp") != std::string::npos);
}

TEST_CASE("plan: generating without a cache, per step and cumulative", "[plan][roofline]") {
  const ModelSpec m = preset("smollm2-135m");
  // W = matrix weights per layer = 884,736 + 2,654,208 = 3,538,944; H hd = 9 x 64 = 576.
  const GenerationCost s = generation_step_flops(m, 100);
  CHECK(s.cached_per_layer.projections == Approx(2.0 * 3'538'944));         // 7,077,888
  CHECK(s.cached_per_layer.attention == Approx(4.0 * 576 * 100));            // 230,400
  CHECK(s.naive_per_layer.projections == Approx(2.0 * 3'538'944 * 100));     // 707,788,800
  CHECK(s.naive_per_layer.attention == Approx(2.0 * 576 * 100 * 101));       // 11,635,200
  // Whole model: x 30 layers, + LM head 2 x 49,152 x 576 = 56,623,104 per step.
  CHECK(s.cached_model.projections == Approx(30 * 7'077'888.0 + 56'623'104.0));

  const GenerationCost t = generation_total_flops(m, 100);
  CHECK(t.cached_per_layer.attention == Approx(2.0 * 576 * 100 * 101));          // 11,635,200 (~N^2)
  CHECK(t.naive_per_layer.attention == Approx(395'596'800.0));                   // 2*576*100*101*102/3 (~N^3)
  CHECK(t.cached_per_layer.projections == Approx(2.0 * 3'538'944 * 100));        // ~N
  CHECK(t.naive_per_layer.projections == Approx(35'743'334'400.0));              // W * 100 * 101 (~N^2)
  // Closed forms agree with summing the steps, also after a prompt.
  GenerationCost sum;
  for (int n = 51; n <= 80; ++n) {
    const GenerationCost g = generation_step_flops(m, n);
    sum.cached_per_layer.attention += g.cached_per_layer.attention;
    sum.naive_per_layer.attention += g.naive_per_layer.attention;
    sum.naive_per_layer.projections += g.naive_per_layer.projections;
    sum.naive_model.projections += g.naive_model.projections;
  }
  const GenerationCost closed = generation_total_flops(m, 30, 50);
  CHECK(closed.cached_per_layer.attention == Approx(sum.cached_per_layer.attention));
  CHECK(closed.naive_per_layer.attention == Approx(sum.naive_per_layer.attention));
  CHECK(closed.naive_per_layer.projections == Approx(sum.naive_per_layer.projections));
  CHECK(closed.naive_model.projections == Approx(sum.naive_model.projections));
  // Growth orders: doubling N multiplies naive attention by ~8 and cached by ~4.
  const GenerationCost t2 = generation_total_flops(m, 2000), t1 = generation_total_flops(m, 1000);
  CHECK(t2.naive_per_layer.attention / t1.naive_per_layer.attention == Approx(8.0).epsilon(0.01));
  CHECK(t2.cached_per_layer.attention / t1.cached_per_layer.attention == Approx(4.0).epsilon(0.01));
  CHECK(t2.naive_per_layer.projections / t1.naive_per_layer.projections == Approx(4.0).epsilon(0.01));
  CHECK(t2.cached_per_layer.projections / t1.cached_per_layer.projections == Approx(2.0));
}
