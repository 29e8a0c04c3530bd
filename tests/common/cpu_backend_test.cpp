// The CPU backend's handling of repacked weights, against its own unpacked
// path and ggml's dequantization: matmul_multi equals one matmul per weight,
// get_rows reads packed tables exactly, and misuse is refused with a message.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/q8_kernels.h"
#include "model/kv_cache.h"
#include "model/llama_config.h"
#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "test_support.h"

namespace {

struct Loaded {
  std::unique_ptr<pd::Backend> backend;
  std::shared_ptr<const pd::GgufFile> file;
  std::vector<std::unique_ptr<pd::BackendBuffer>> storage;

  pd::Tensor weight(const std::string& name) {
    std::unique_ptr<pd::BackendBuffer> buf;
    auto t = backend->load_weight(*file->find_tensor(name), &buf);
    REQUIRE(t.is_ok());
    if (buf) storage.push_back(std::move(buf));
    return t.value();
  }
};

// The types the integer path repacks; the K-quants' rows are 256-element super-blocks.
constexpr pd::GgmlType kPackedTypes[] = {pd::GgmlType::kQ4_0, pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0,
                                         pd::GgmlType::kQ5_0, pd::GgmlType::kQ5_1, pd::GgmlType::kQ4_K,
                                         pd::GgmlType::kQ5_K, pd::GgmlType::kQ6_K};

// A tiny model whose matrices (or embeddings) are of `type`: hidden 256 where
// the type's blocks are 256 elements.
pd::TinyLlamaSpec spec_for(pd::GgmlType type) {
  pd::TinyLlamaSpec spec;
  if (type != pd::GgmlType::kF32 && pd::ggml_traits(type).block_elems > 64) spec.hidden = 256, spec.ffn = 512;
  return spec;
}

Loaded load(bool int8, pd::GgmlType weight_type) {
  pd::TinyLlamaSpec spec = spec_for(weight_type);
  spec.weight_type = weight_type;
  auto f = pd::GgufFile::from_bytes(pd::make_tiny_llama_gguf(spec), "tiny.gguf");
  REQUIRE(f.is_ok());
  pd::BackendConfig bc;
  bc.n_threads = 2;
  bc.int8_activations = int8;
  auto be = pd::create_backend(bc);
  REQUIRE(be.is_ok());
  return Loaded{std::move(be).value(), std::shared_ptr<const pd::GgufFile>(std::move(f).value()), {}};
}

pd::Tensor f32_tensor(std::vector<float>& v, int64_t ne0, int64_t ne1) {
  pd::Tensor t;
  t.ne = {ne0, ne1, 1, 1};
  t.data = v.data();
  return t;
}

}  // namespace

TEST_CASE("cpu backend: matmul_multi equals one matmul per weight, packed or not", "[cpu][backend]") {
  for (bool int8 : {true, false}) {
    std::vector<pd::GgmlType> types(std::begin(kPackedTypes), std::end(kPackedTypes));
    types.push_back(pd::GgmlType::kF32);
    for (pd::GgmlType wt : types) {
      INFO((int8 ? "int8" : "fp32") << " activations, " << pd::ggml_type_name(wt));
      Loaded l = load(int8, wt);
      const pd::Tensor wq = l.weight("blk.0.attn_q.weight"), wk = l.weight("blk.0.attn_k.weight"),
                       wv = l.weight("blk.0.attn_v.weight");
      CHECK((wq.layout != 0) == (int8 && wt != pd::GgmlType::kF32));  // only quantized weights are repacked
      const int64_t k = wq.ne[0], m = 5;
      std::vector<float> x = pd::test::random_floats(k * m, 3);
      pd::Tensor xt = f32_tensor(x, k, m);
      std::vector<std::vector<float>> one(3), multi(3);
      std::vector<pd::Tensor> one_t, multi_t;
      const pd::Tensor* ws[] = {&wq, &wk, &wv};
      for (int i = 0; i < 3; ++i) {
        one[i].assign(ws[i]->ne[1] * m, 0.0f);
        multi[i].assign(ws[i]->ne[1] * m, -1.0f);
        one_t.push_back(f32_tensor(one[i], ws[i]->ne[1], m));
        multi_t.push_back(f32_tensor(multi[i], ws[i]->ne[1], m));
        REQUIRE(l.backend->matmul(xt, *ws[i], one_t[i]).is_ok());
      }
      pd::Tensor* outs[] = {&multi_t[0], &multi_t[1], &multi_t[2]};
      REQUIRE(l.backend->matmul_multi(xt, ws, outs).is_ok());
      for (int i = 0; i < 3; ++i) CHECK(std::memcmp(one[i].data(), multi[i].data(), one[i].size() * 4) == 0);

      // Counts that differ, and a shape mismatch in any pair, are refused before anything runs.
      pd::Tensor* two[] = {&multi_t[0], &multi_t[1]};
      const pd::Status st = l.backend->matmul_multi(xt, ws, two);
      CHECK(st.is_invalid_argument());
      CHECK(st.message().find("matmul_multi") != std::string::npos);
      pd::Tensor* swapped[] = {&multi_t[0], &multi_t[0], &multi_t[2]};  // wk's output has wq's width
      CHECK(l.backend->matmul_multi(xt, ws, swapped).is_invalid_argument());
    }
  }
}

TEST_CASE("cpu backend: get_rows of a repacked table equals the ggml dequantization", "[cpu][backend]") {
  for (pd::GgmlType et : kPackedTypes) {
    pd::TinyLlamaSpec spec = spec_for(et);
    spec.embed_type = et;
    auto f = pd::GgufFile::from_bytes(pd::make_tiny_llama_gguf(spec), "tiny.gguf");
    REQUIRE(f.is_ok());
    auto be = pd::create_backend(pd::BackendConfig{});
    REQUIRE(be.is_ok());
    const pd::GgufTensorInfo* info = f.value()->find_tensor("token_embd.weight");
    std::unique_ptr<pd::BackendBuffer> buf;
    auto table = be.value()->load_weight(*info, &buf);
    REQUIRE(table.is_ok());
    REQUIRE(table->layout == static_cast<uint8_t>(pd::cpu::packed_format_for(et)));
    const int64_t d = info->ne[0];
    const std::vector<int32_t> ids{0, 7, 3, static_cast<int32_t>(info->ne[1] - 1), 7};
    std::vector<float> out(d * ids.size());
    pd::Tensor ot = f32_tensor(out, d, static_cast<int64_t>(ids.size()));
    REQUIRE(be.value()->get_rows(*table, ids, ot).is_ok());
    std::vector<float> want(d);
    for (size_t i = 0; i < ids.size(); ++i) {
      pd::dequantize_row(et, info->data + ids[i] * pd::ggml_row_bytes(et, d), want.data(), d);
      INFO(pd::ggml_type_name(et) << " row " << ids[i]);
      CHECK(std::memcmp(out.data() + i * d, want.data(), d * sizeof(float)) == 0);
    }
    // A repacked weight is not a plain ggml tensor: reading it back is refused.
    std::vector<uint8_t> host(64);
    const pd::Status st = be.value()->copy_to_host(*table, host.data(), host.size());
    CHECK(st.is_unsupported());
    CHECK(st.message().find("repacked") != std::string::npos);
  }
}

// Every packed type through the backend: a matrix of 21 rows (the last 8-row
// group padded) that takes its activations in one 8-bit pass (ffn_down) and
// one in two (attn_q, CpuBackendConfig::int8x2_matmul_kinds' default), against
// the fp32 path on the same file: within the 8-bit activations' error (the
// kernel tests' bound), the two-pass one within ~1/100 of it; the same bits
// on every ISA path, in matmul_multi, and for a token alone or in a batch.
TEST_CASE("cpu backend: every packed type's int8 matmuls agree with the fp32 path, on every ISA path",
          "[cpu][backend]") {
  for (pd::GgmlType type : kPackedTypes) {
    const int64_t k = 512, n = 21, m = 6;
    pd::GgufWriter gw;
    const char* names[2] = {"blk.0.ffn_down.weight", "blk.0.attn_q.weight"};  // one pass, two passes
    for (int i = 0; i < 2; ++i) gw.add_tensor(names[i], {k, n}, type, pd::test::random_floats(k * n, 90 + i, 0.05f));
    auto file = pd::GgufFile::from_bytes(gw.to_bytes(), "types.gguf");
    REQUIRE(file.is_ok());
    std::vector<float> x = pd::test::random_floats(k * m, 93);
    for (int64_t t = 0; t < m; ++t) x[t * k + 5 * t] *= 30.0f;  // a large value in a block, as in hidden states
    pd::Tensor xt = f32_tensor(x, k, m);

    // Each weight dequantized, for the error bound; the fp32 path's products.
    std::vector<std::vector<float>> deq(2, std::vector<float>(k * n)), want(2, std::vector<float>(n * m));
    pd::CpuBackendConfig fp32_cfg;
    fp32_cfg.n_threads = 2;
    fp32_cfg.int8_activations = false;
    auto fp32 = pd::make_cpu_backend(fp32_cfg);
    for (int i = 0; i < 2; ++i) {
      const pd::GgufTensorInfo* info = file.value()->find_tensor(names[i]);
      const size_t rb = pd::ggml_row_bytes(type, k);
      for (int64_t r = 0; r < n; ++r) pd::dequantize_row(type, info->data + r * rb, deq[i].data() + r * k, k);
      auto w = fp32->load_weight(*info, nullptr);
      REQUIRE(w.is_ok());
      CHECK(w->layout == 0);
      pd::Tensor ot = f32_tensor(want[i], n, m);
      REQUIRE(fp32->matmul(xt, w.value(), ot).is_ok());
    }

    std::vector<std::vector<float>> first_isa;
    for (pd::cpu::Isa isa : pd::cpu::kAllIsas) {
      if (!pd::cpu::isa_supported(isa)) continue;
      INFO(pd::ggml_type_name(type) << ", " << pd::cpu::isa_name(isa));
      pd::CpuBackendConfig cfg;
      cfg.n_threads = 2;
      cfg.isa = pd::cpu::isa_name(isa);
      auto be = pd::make_cpu_backend(cfg);
      std::vector<std::unique_ptr<pd::BackendBuffer>> storage(2);
      pd::Tensor ws[2];
      std::vector<std::vector<float>> got(2, std::vector<float>(n * m, -1.0f));
      for (int i = 0; i < 2; ++i) {
        auto w = be->load_weight(*file.value()->find_tensor(names[i]), &storage[i]);
        REQUIRE(w.is_ok());
        ws[i] = w.value();
        REQUIRE(ws[i].layout == static_cast<uint8_t>(pd::cpu::packed_format_for(type)));
        pd::Tensor ot = f32_tensor(got[i], n, m);
        REQUIRE(be->matmul(xt, ws[i], ot).is_ok());
      }
      double err[2] = {0, 0}, total_mag[2] = {0, 0};
      for (int i = 0; i < 2; ++i) {
        for (int64_t t = 0; t < m; ++t) {
          for (int64_t r = 0; r < n; ++r) {
            double mag = 0.0;
            for (int64_t j = 0; j < k; ++j) mag += std::fabs(static_cast<double>(deq[i][r * k + j]) * x[t * k + j]);
            const double e = std::fabs(got[i][t * n + r] - want[i][t * n + r]);
            INFO(names[i] << " token " << t << " row " << r);
            CHECK(e <= 0.02 * mag + 1e-5);                    // 8-bit activations
            if (i == 1) CHECK(e <= 2e-4 * mag + 1e-5);        // two passes: ~15 bits
            err[i] += e, total_mag[i] += mag;
          }
        }
      }
      CHECK(err[1] * 20 < err[0]);  // the second pass is taken
      // matmul_multi: both weights (one pass and two) in one call, the same bits.
      std::vector<std::vector<float>> multi(2, std::vector<float>(n * m, -1.0f));
      pd::Tensor mo[2] = {f32_tensor(multi[0], n, m), f32_tensor(multi[1], n, m)};
      const pd::Tensor* wp[2] = {&ws[0], &ws[1]};
      pd::Tensor* op[2] = {&mo[0], &mo[1]};
      REQUIRE(be->matmul_multi(xt, wp, op).is_ok());
      for (int i = 0; i < 2; ++i) CHECK(std::memcmp(multi[i].data(), got[i].data(), n * m * sizeof(float)) == 0);
      // Each token alone gives its row of the batch.
      for (int64_t t = 0; t < m; ++t) {
        std::vector<float> xa(x.begin() + t * k, x.begin() + (t + 1) * k), one(n);
        pd::Tensor xat = f32_tensor(xa, k, 1), ot = f32_tensor(one, n, 1);
        for (int i = 0; i < 2; ++i) {
          REQUIRE(be->matmul(xat, ws[i], ot).is_ok());
          INFO(names[i] << " token " << t << " alone");
          CHECK(std::memcmp(one.data(), got[i].data() + t * n, n * sizeof(float)) == 0);
        }
      }
      if (first_isa.empty()) {
        first_isa = got;
        std::printf("int8 path, %s: mean |error| one pass %.3g, two passes %.3g (of mean |w*x| sums %.3g)\n",
                    pd::ggml_type_name(type), err[0] / (n * m), err[1] / (n * m), total_mag[0] / (n * m));
      }
      for (int i = 0; i < 2; ++i) CHECK(std::memcmp(got[i].data(), first_isa[i].data(), n * m * sizeof(float)) == 0);
    }
  }
}

// The LM head's second pass near the top (CpuBackendConfig::
// lm_head_two_pass_margin): a group of 8 vocabulary rows gets it when one of
// its one-pass logits is within the margin of the token's largest, and then
// holds exactly the second-pass-everywhere bits; the other groups hold the
// one-pass bits. Rows scaled from 0.05x to 3x spread the logits over far more
// than the margin, so both kinds of group occur; 203 rows leave a padded last
// group. The same bits for a token alone and in a batch of 6 (the
// small-batch path: the second pass in the first sweep, for the tokens near
// the largest logit seen so far) as in the batch of 20 (picked groups read
// again), and on every ISA path.
TEST_CASE("cpu backend: the LM head's second pass runs for the groups near each token's largest logit",
          "[cpu][backend]") {
  const int64_t k = 256, n = 203, m = 20;
  const float margin = 1.5f;
  std::vector<float> w = pd::test::random_floats(k * n, 301, 0.05f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < k; ++j) w[r * k + j] *= 0.05f + 3.0f * static_cast<float>((r * 37) % n) / n;
  pd::GgufWriter gw;
  gw.add_tensor("output.weight", {k, n}, pd::GgmlType::kQ8_0, w);
  auto file = pd::GgufFile::from_bytes(gw.to_bytes(), "head.gguf");
  REQUIRE(file.is_ok());
  std::vector<float> x = pd::test::random_floats(k * m, 302);
  pd::Tensor xt = f32_tensor(x, k, m);
  const pd::GgufTensorInfo& info = *file.value()->find_tensor("output.weight");

  // Logits of one config: the whole batch, then each token alone (same bits).
  auto logits = [&](pd::CpuBackendConfig cfg) {
    cfg.n_threads = 2;
    auto be = pd::make_cpu_backend(cfg);
    std::unique_ptr<pd::BackendBuffer> storage;
    auto wt = be->load_weight(info, &storage);
    REQUIRE(wt.is_ok());
    std::vector<float> out(n * m);
    pd::Tensor ot = f32_tensor(out, n, m);
    REQUIRE(be->matmul(xt, wt.value(), ot).is_ok());
    const int64_t few = 6;
    std::vector<float> some(n * few);
    pd::Tensor xft = f32_tensor(x, k, few), oft = f32_tensor(some, n, few);
    REQUIRE(be->matmul(xft, wt.value(), oft).is_ok());
    INFO("the first " << few << " tokens, margin " << cfg.lm_head_two_pass_margin);
    CHECK(std::memcmp(some.data(), out.data(), some.size() * sizeof(float)) == 0);
    for (int64_t t = 0; t < m; ++t) {
      std::vector<float> xa(x.begin() + t * k, x.begin() + (t + 1) * k), one(n);
      pd::Tensor xat = f32_tensor(xa, k, 1), oat = f32_tensor(one, n, 1);
      REQUIRE(be->matmul(xat, wt.value(), oat).is_ok());
      INFO("token " << t << " alone, margin " << cfg.lm_head_two_pass_margin);
      CHECK(std::memcmp(one.data(), out.data() + t * n, n * sizeof(float)) == 0);
    }
    return out;
  };
  pd::CpuBackendConfig one_pass, everywhere, near_top;
  one_pass.int8x2_matmul_kinds = 0;
  everywhere.lm_head_two_pass_margin = 0.0f;
  near_top.lm_head_two_pass_margin = margin;
  const std::vector<float> a = logits(one_pass), b = logits(everywhere);
  std::vector<float> first_isa;
  for (pd::cpu::Isa isa : pd::cpu::kAllIsas) {
    if (!pd::cpu::isa_supported(isa)) continue;
    INFO(pd::cpu::isa_name(isa));
    near_top.isa = pd::cpu::isa_name(isa);
    const std::vector<float> got = logits(near_top);
    int groups_with = 0, groups_without = 0;
    for (int64_t t = 0; t < m; ++t) {
      const float* at = a.data() + t * n;
      const float top = *std::max_element(at, at + n);
      for (int64_t g0 = 0; g0 < n; g0 += 8) {
        const int64_t g1 = std::min(n, g0 + 8);
        const bool near = std::any_of(at + g0, at + g1, [&](float v) { return v >= top - margin; });
        const std::vector<float>& want = near ? b : a;
        (near ? groups_with : groups_without) += 1;
        INFO("token " << t << " rows " << g0 << "-" << g1 - 1 << (near ? " (second pass)" : " (one pass)"));
        CHECK(std::memcmp(got.data() + t * n + g0, want.data() + t * n + g0, (g1 - g0) * sizeof(float)) == 0);
      }
      // The largest logit is the same row, of the same value, as with the second pass everywhere.
      const float* gt = got.data() + t * n;
      const float* bt = b.data() + t * n;
      CHECK(std::max_element(gt, gt + n) - gt == std::max_element(bt, bt + n) - bt);
    }
    CHECK(groups_with >= m);
    CHECK(groups_without > groups_with);
    if (first_isa.empty()) first_isa = got;
    CHECK(std::memcmp(got.data(), first_isa.data(), n * m * sizeof(float)) == 0);
  }
  // PD_CPU_LM_HEAD_MARGIN: a number >= 0 replaces the configured margin (0:
  // the second pass everywhere); anything else is ignored (and reported).
  near_top.isa.clear();
  const std::vector<float> configured = logits(near_top);
  for (const char* bad : {"abc", "-1", "2x", ""}) {
    INFO("PD_CPU_LM_HEAD_MARGIN='" << bad << "'");
    setenv("PD_CPU_LM_HEAD_MARGIN", bad, 1);
    const std::vector<float> got = logits(near_top);
    CHECK(std::memcmp(got.data(), configured.data(), n * m * sizeof(float)) == 0);
  }
  setenv("PD_CPU_LM_HEAD_MARGIN", "0", 1);
  const std::vector<float> zero = logits(near_top);
  unsetenv("PD_CPU_LM_HEAD_MARGIN");
  CHECK(std::memcmp(zero.data(), b.data(), n * m * sizeof(float)) == 0);
}

namespace {

// A two-layer paged cache for the attention tests: layer 1 holds random K/V
// in the cache's own encoding (layer 0 is noise), blocks scattered; queries
// for every position of two sequences.
struct AttentionFixture {
  static constexpr int kHd = 64, kHeads = 6, kKvHeads = 2;
  static constexpr int64_t kRow = kHeads * kHd;
  const std::vector<int> lens{150, 40};  // past two 64-key windows; inside one
  pd::KvCacheLayout L;
  const int kBlock;
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::span<const int32_t>> spans;
  std::vector<uint8_t> cache_bytes;
  std::vector<float> deq;  // the values the cache holds, read back
  std::vector<std::vector<float>> queries;

  // Blocks of `block` tokens, handed out in a scrambled order (7 blocks apart).
  // Block sizes that do not divide the 64-key window make windows span part
  // blocks.
  AttentionFixture(pd::GgmlType dtype, int block) : kBlock(block), tables(2) {
    const int64_t per_seq[2] = {(lens[0] + block - 1) / block, (lens[1] + block - 1) / block};
    L.n_layers = 2, L.n_kv_heads = kKvHeads, L.head_dim = kHd, L.block_size = block;
    const int64_t needed = per_seq[0] + per_seq[1];
    L.num_blocks = needed + (needed % 7 == 0 ? 1 : 0);  // 7 steps visit every block
    for (int64_t b = 0, next = 0; b < needed; ++b, next = (next + 7) % L.num_blocks)
      tables[b < per_seq[0] ? 0 : 1].push_back(static_cast<int32_t>(next));
    spans.assign(tables.begin(), tables.end());
    L.dtype = dtype;
    cache_bytes.resize(L.total_bytes());
    const std::vector<float> noise = pd::test::random_floats(cache_bytes.size() / 4, 5);
    std::memcpy(cache_bytes.data(), noise.data(), cache_bytes.size() / 4 * 4);
    const std::vector<float> kv = pd::test::random_floats(2 * L.num_blocks * kKvHeads * kBlock * kHd, 6, 2.0f);
    deq.resize(kv.size());
    for (int kind = 0; kind < 2; ++kind)
      for (int64_t blk = 0; blk < L.num_blocks; ++blk)
        for (int r = 0; r < kKvHeads * kBlock; ++r) {
          const int64_t at = ((kind * L.num_blocks + blk) * kKvHeads * kBlock + r) * kHd;
          uint8_t* dst = cache_bytes.data() + L.offset(1, kind, blk) + r * L.row_bytes();
          pd::quantize_row(dtype, kv.data() + at, dst, kHd);
          pd::dequantize_row(dtype, dst, deq.data() + at, kHd);
        }
    for (int s = 0; s < 2; ++s) queries.push_back(pd::test::random_floats(lens[s] * kRow, 70 + s));
  }

  // Layer 1's attention output for `toks` (their queries in order) on a backend of `threads`
  // (window > 0: sliding-window attention).
  std::vector<float> run(int threads, const std::vector<pd::AttentionToken>& toks, int window = 0) const {
    pd::BackendConfig bc;
    bc.n_threads = threads;
    auto be = pd::create_backend(bc);
    REQUIRE(be.is_ok());
    auto buf = be.value()->alloc(cache_bytes.size());
    REQUIRE(buf.is_ok());
    std::memcpy(buf.value()->data(), cache_bytes.data(), cache_bytes.size());
    std::vector<float> q;
    for (const auto& t : toks)
      q.insert(q.end(), queries[t.seq].begin() + t.position * kRow, queries[t.seq].begin() + (t.position + 1) * kRow);
    std::vector<float> out(q.size(), 0.0f);
    pd::Tensor qt, ot;
    qt.ne = {kHd, kHeads, static_cast<int64_t>(toks.size()), 1}, qt.data = q.data();
    ot.ne = qt.ne, ot.data = out.data();
    REQUIRE(be.value()->paged_attention(qt, *buf.value(), L, 1, toks, spans, 0.125f, window, ot).is_ok());
    return out;
  }

  // Softmax attention in double over the cache's values: head h of (s, p),
  // over positions (p - window, p] when window > 0.
  std::vector<double> softmax(int s, int p, int h, int window = 0) const {
    const int g = h / (kHeads / kKvHeads);
    auto at = [&](int kind, int pos) {
      const int64_t blk = tables[s][pos / kBlock];
      return deq.data() + ((kind * L.num_blocks + blk) * kKvHeads * kBlock + g * kBlock + pos % kBlock) * kHd;
    };
    const float* qv = queries[s].data() + p * kRow + h * kHd;
    const int lo = window > 0 ? std::max(0, p - window + 1) : 0;
    std::vector<double> sc(p + 1, 0.0), out(kHd, 0.0);
    double mx = -1e300, z = 0;
    for (int j = lo; j <= p; ++j) {
      double d = 0;
      for (int e = 0; e < kHd; ++e) d += static_cast<double>(qv[e]) * at(0, j)[e];
      sc[j] = d * 0.125, mx = std::max(mx, sc[j]);
    }
    for (int j = lo; j <= p; ++j) z += (sc[j] = std::exp(sc[j] - mx));
    for (int j = lo; j <= p; ++j)
      for (int e = 0; e < kHd; ++e) out[e] += sc[j] / z * at(1, j)[e];
    return out;
  }
};

// The calls of one case: every token of both sequences at once, or sequence 0
// in chunks of 37 with one token of sequence 1 beside each (a decode step).
std::vector<std::vector<pd::AttentionToken>> attention_calls(const std::vector<int>& lens, bool chunked) {
  std::vector<std::vector<pd::AttentionToken>> calls;
  if (!chunked) {
    calls.emplace_back();
    for (int s = 0; s < 2; ++s)
      for (int p = 0; p < lens[s]; ++p) calls.back().push_back({p, s});
    return calls;
  }
  for (int p0 = 0; p0 < lens[0]; p0 += 37) {
    calls.emplace_back();
    for (int p = p0; p < std::min(p0 + 37, lens[0]); ++p) calls.back().push_back({p, 0});
    calls.back().push_back({p0 / 37, 1});
  }
  return calls;
}

}  // namespace

// Blocked ("flash") attention over the paged cache: a token's output is the
// same bits computed alone (a decode step), in a prefill tile of any size, or
// beside other sequences' tokens, for every KV type; and it equals softmax
// attention done in double over the cache's values.
TEST_CASE("cpu backend: paged attention gives a token the same bits in any tile or batch, and the softmax",
          "[cpu][backend]") {
  using F = AttentionFixture;
  for (auto [dtype, block] : {std::pair{pd::GgmlType::kF32, 16}, std::pair{pd::GgmlType::kF16, 16},
                              std::pair{pd::GgmlType::kQ8_0, 16}, std::pair{pd::GgmlType::kF16, 7},
                              std::pair{pd::GgmlType::kF16, 1}, std::pair{pd::GgmlType::kF32, 128}}) {
    INFO("KV " << pd::ggml_type_name(dtype) << ", blocks of " << block);
    const F fx(dtype, block);
    // Every token alone, on three threads (its heads split apart).
    std::vector<std::vector<float>> alone(2);
    for (int s = 0; s < 2; ++s)
      for (int p = 0; p < fx.lens[s]; ++p) {
        const std::vector<float> o = fx.run(3, {{p, s}});
        alone[s].insert(alone[s].end(), o.begin(), o.end());
      }
    for (int s = 0; s < 2; ++s)
      for (int p = 0; p < fx.lens[s]; p += 7)
        for (int h = 0; h < F::kHeads; ++h) {
          const std::vector<double> want = fx.softmax(s, p, h);
          for (int e = 0; e < F::kHd; ++e) {
            INFO("seq " << s << " pos " << p << " head " << h << " elem " << e);
            CHECK(std::fabs(alone[s][p * F::kRow + h * F::kHd + e] - want[e]) <= 1e-5 * (1 + std::fabs(want[e])));
          }
        }
    for (int threads : {1, 2})
      for (bool chunked : {false, true})
        for (const auto& toks : attention_calls(fx.lens, chunked)) {
          const std::vector<float> out = fx.run(threads, toks);
          for (size_t t = 0; t < toks.size(); ++t) {
            INFO("threads " << threads << " call of " << toks.size() << " tokens: seq " << toks[t].seq << " pos "
                            << toks[t].position);
            CHECK(std::memcmp(out.data() + t * F::kRow, alone[toks[t].seq].data() + toks[t].position * F::kRow,
                              F::kRow * sizeof(float)) == 0);
          }
        }
  }
}

// Sliding-window attention (Gemma 3's local layers): a token at p attends to
// (p - window, p]. Windows inside one 64-key step, exactly one, across steps
// and past the whole context; for each, a token's output equals windowed
// softmax attention done in double and has the same bits alone, in any tile,
// chunk or batch (the rows whose window starts mid-step run apart from the
// others); a window covering the context gives full attention's bits.
TEST_CASE("cpu backend: sliding-window paged attention is the windowed softmax, the same bits in any tile or batch",
          "[cpu][backend]") {
  using F = AttentionFixture;
  for (auto [dtype, block] : {std::pair{pd::GgmlType::kF32, 16}, std::pair{pd::GgmlType::kF16, 7},
                              std::pair{pd::GgmlType::kQ8_0, 1}}) {
    const F fx(dtype, block);
    for (int window : {1, 5, 64, 70, 100, 1000}) {
      INFO("KV " << pd::ggml_type_name(dtype) << ", blocks of " << block << ", window " << window);
      std::vector<std::vector<float>> alone(2);
      for (int s = 0; s < 2; ++s)
        for (int p = 0; p < fx.lens[s]; ++p) {
          const std::vector<float> o = fx.run(3, {{p, s}}, window);
          alone[s].insert(alone[s].end(), o.begin(), o.end());
        }
      for (int s = 0; s < 2; ++s)
        for (int p = 0; p < fx.lens[s]; p += 3)
          for (int h = 0; h < F::kHeads; h += 2) {
            const std::vector<double> want = fx.softmax(s, p, h, window);
            for (int e = 0; e < F::kHd; ++e) {
              INFO("seq " << s << " pos " << p << " head " << h << " elem " << e);
              CHECK(std::fabs(alone[s][p * F::kRow + h * F::kHd + e] - want[e]) <= 1e-5 * (1 + std::fabs(want[e])));
            }
          }
      for (bool chunked : {false, true})
        for (const auto& toks : attention_calls(fx.lens, chunked)) {
          const std::vector<float> out = fx.run(2, toks, window);
          for (size_t t = 0; t < toks.size(); ++t) {
            INFO("call of " << toks.size() << " tokens: seq " << toks[t].seq << " pos " << toks[t].position);
            CHECK(std::memcmp(out.data() + t * F::kRow, alone[toks[t].seq].data() + toks[t].position * F::kRow,
                              F::kRow * sizeof(float)) == 0);
          }
        }
      if (window >= fx.lens[0]) {
        const std::vector<float> full = fx.run(1, {{fx.lens[0] - 1, 0}});
        CHECK(std::memcmp(full.data(), alone[0].data() + (fx.lens[0] - 1) * F::kRow, F::kRow * sizeof(float)) == 0);
      }
    }
  }
}

namespace {

std::unique_ptr<pd::Backend> cpu_backend(int threads) {
  pd::BackendConfig bc;
  bc.n_threads = threads;
  auto be = pd::create_backend(bc);
  REQUIRE(be.is_ok());
  return std::move(be).value();
}

}  // namespace

// rope in each mode against the rotation done in double: adjacent pairs or
// NEOX halves, linear scaling, per-pair frequency factors (Llama 3.x).
// kv_write converts each K and V row into the cache's type: the bytes of
// ggml's reference quantizers (quantize_row) on every ISA path, serial or
// parallel, ties, subnormals, overflow and NaN included.
TEST_CASE("cpu backend: kv_write stores the reference bytes of every KV type on every ISA path", "[cpu][backend]") {
  constexpr int kHd = 64, kKv = 2, kTokens = 12;
  std::vector<float> k = pd::test::random_floats(kTokens * kKv * kHd, 81, 4.0f),
                     v = pd::test::random_floats(kTokens * kKv * kHd, 82, 4.0f);
  // Values fp16 rounds in every way: exact ties (to even, both directions),
  // fp16 subnormals and below, the overflow edge, infinities and NaNs.
  const float special[] = {1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, -(1.0f + 1.0f / 2048), 6.0e-8f, 3.0e-8f,
                           2.0e-8f, 1.0e-6f, -5.96e-8f, 65504.0f, 65519.0f, 65520.0f, -70000.0f,
                           std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                           std::bit_cast<float>(0x7FE00000u), std::bit_cast<float>(0xFF812345u)};  // NaN payloads
  for (size_t i = 0; i < std::size(special); ++i) k[3 * i + 1] = special[i], v[5 * i + 2] = special[i];
  for (pd::GgmlType dtype : {pd::GgmlType::kF32, pd::GgmlType::kF16, pd::GgmlType::kQ8_0}) {
    pd::KvCacheLayout L;
    L.n_layers = 2, L.n_kv_heads = kKv, L.head_dim = kHd, L.block_size = 4, L.num_blocks = 5, L.dtype = dtype;
    // Token i to slot 19 - i (blocks in reverse, offsets scattered); layer 1.
    std::vector<int32_t> slots(kTokens);
    for (int i = 0; i < kTokens; ++i) slots[i] = 19 - i;
    std::vector<uint8_t> want(L.total_bytes(), 0);
    for (int i = 0; i < kTokens; ++i)
      for (int kind = 0; kind < 2; ++kind)
        for (int g = 0; g < kKv; ++g) {
          const int64_t block = slots[i] / L.block_size, off = slots[i] % L.block_size;
          const float* src = (kind == 0 ? k : v).data() + (i * kKv + g) * kHd;
          pd::quantize_row(dtype, src, want.data() + L.offset(1, kind, block) + (g * L.block_size + off) * L.row_bytes(),
                           kHd);
        }
    for (pd::cpu::Isa isa : pd::cpu::kAllIsas) {
      if (!pd::cpu::isa_supported(isa)) continue;
      for (int tokens : {kTokens, 3}) {  // the parallel loop and the serial one
        INFO(pd::ggml_type_name(dtype) << ", " << pd::cpu::isa_name(isa) << ", " << tokens << " tokens");
        pd::CpuBackendConfig cfg;
        cfg.n_threads = 2;
        cfg.isa = pd::cpu::isa_name(isa);
        auto be = pd::make_cpu_backend(cfg);
        auto buf = be->alloc(L.total_bytes());
        REQUIRE(buf.is_ok());
        std::memset(buf.value()->data(), 0, L.total_bytes());
        pd::Tensor kt, vt;
        kt.ne = vt.ne = {kHd, kKv, kTokens, 1};
        kt.data = k.data(), vt.data = v.data();
        for (int i0 = 0; i0 < kTokens; i0 += tokens) {
          pd::Tensor ks = kt, vs = vt;
          ks.ne[2] = vs.ne[2] = tokens;
          ks.data = k.data() + i0 * kKv * kHd, vs.data = v.data() + i0 * kKv * kHd;
          const std::span<const int32_t> part(slots.data() + i0, tokens);
          REQUIRE(be->kv_write(*buf.value(), L, 1, ks, vs, part).is_ok());
        }
        CHECK(std::memcmp(buf.value()->data(), want.data(), want.size()) == 0);
      }
    }
  }
}

TEST_CASE("cpu backend: rope rotates the pairs of each mode by the scaled, factored angles", "[cpu][backend]") {
  constexpr int64_t kHd = 64, kHeads = 3;
  const std::vector<int32_t> pos{0, 1, 7, 130, 4095, 100000};
  const int64_t nt = static_cast<int64_t>(pos.size());
  const std::vector<float> x0 = pd::test::random_floats(kHd * kHeads * nt, 11);
  std::vector<float> factors(kHd / 2);
  for (int64_t i = 0; i < kHd / 2; ++i) factors[i] = 1.0f + static_cast<float>(i % 5) * 1.75f;
  auto be = cpu_backend(2);
  for (bool neox : {false, true})
    for (float scale : {1.0f, 0.25f})
      for (bool with_factors : {false, true}) {
        INFO("neox " << neox << ", freq_scale " << scale << ", factors " << with_factors);
        pd::RopeSpec spec;
        spec.freq_base = 500000.0f;
        spec.neox = neox;
        spec.freq_scale = scale;
        if (with_factors) spec.freq_factors = factors;
        std::vector<float> x = x0;
        pd::Tensor t;
        t.ne = {kHd, kHeads, nt, 1}, t.data = x.data();
        REQUIRE(be->rope(t, pos, spec).is_ok());
        for (int64_t tok = 0; tok < nt; ++tok)
          for (int64_t h = 0; h < kHeads; ++h)
            for (int64_t i = 0; i < kHd / 2; ++i) {
              const int64_t a = neox ? i : 2 * i, b = neox ? i + kHd / 2 : 2 * i + 1;
              double theta = pos[tok] * static_cast<double>(scale) * std::pow(500000.0, -2.0 * i / kHd);
              if (with_factors) theta /= factors[i];
              const float* v0 = x0.data() + (tok * kHeads + h) * kHd;
              const double ra = v0[a] * std::cos(theta) - v0[b] * std::sin(theta);
              const double rb = v0[a] * std::sin(theta) + v0[b] * std::cos(theta);
              const float* v = x.data() + (tok * kHeads + h) * kHd;
              INFO("token " << tok << " head " << h << " pair " << i);
              CHECK(std::fabs(v[a] - ra) <= 1e-6 * (1 + std::fabs(ra)));
              CHECK(std::fabs(v[b] - rb) <= 1e-6 * (1 + std::fabs(rb)));
            }
        // The plain overload is the default spec.
        if (!neox && scale == 1.0f && !with_factors) {
          std::vector<float> y = x0;
          pd::Tensor u;
          u.ne = t.ne, u.data = y.data();
          REQUIRE(be->rope(u, pos, 500000.0f).is_ok());
          CHECK(y == x);
        }
      }
  std::vector<float> x = x0;
  pd::Tensor t;
  t.ne = {kHd, kHeads, nt, 1}, t.data = x.data();
  pd::RopeSpec bad;
  bad.freq_factors = std::span<const float>(factors.data(), 5);
  const pd::Status st = be->rope(t, pos, bad);
  CHECK(st.is_invalid_argument());
  CHECK(st.message().find("frequency factors") != std::string::npos);
}

// rope keeps the angles of its last positions per spec (two specs): calls that
// alternate specs, positions and token counts on one backend give the bits of
// a fresh backend for each call.
TEST_CASE("cpu backend: rope's cached angles follow every change of spec and positions", "[cpu][backend]") {
  constexpr int64_t kHd = 32, kHeads = 2;
  std::vector<float> factors(kHd / 2);
  for (int64_t i = 0; i < kHd / 2; ++i) factors[i] = 1.0f + static_cast<float>(i % 3);
  pd::RopeSpec a, b, c, d;
  a.freq_base = 10000.0f;
  b.freq_base = 1000000.0f;
  c.freq_base = 10000.0f, c.freq_scale = 0.5f;
  d.freq_base = 10000.0f, d.freq_factors = factors;
  const std::vector<int32_t> p1{5, 6, 7, 8, 9, 10}, p2{5, 6, 7, 8, 9, 11}, p3{40};
  struct Call {
    const pd::RopeSpec* spec;
    const std::vector<int32_t>* pos;
    int64_t tokens;
  };
  const Call calls[] = {{&a, &p1, 6}, {&a, &p1, 6}, {&b, &p1, 6}, {&a, &p1, 6}, {&a, &p2, 6}, {&b, &p2, 6},
                        {&c, &p2, 6}, {&a, &p2, 6}, {&a, &p2, 4}, {&a, &p1, 4}, {&d, &p1, 6}, {&a, &p3, 1},
                        {&d, &p1, 6}, {&d, &p3, 1}, {&b, &p1, 5}, {&b, &p1, 6}};
  auto cached = cpu_backend(2);
  int index = 0;
  for (const Call& call : calls) {
    INFO("call " << index++);
    const std::vector<float> x0 = pd::test::random_floats(kHd * kHeads * call.tokens, 40 + index);
    std::vector<float> x = x0, y = x0;
    pd::Tensor t, u;
    t.ne = u.ne = {kHd, kHeads, call.tokens, 1};
    t.data = x.data(), u.data = y.data();
    REQUIRE(cached->rope(t, *call.pos, *call.spec).is_ok());
    REQUIRE(cpu_backend(2)->rope(u, *call.pos, *call.spec).is_ok());
    CHECK(x == y);
  }
}

// geglu against GELU's tanh form in double; add with a one-row b (a bias) and
// scale exactly.
TEST_CASE("cpu backend: geglu, bias add and scale", "[cpu][backend]") {
  auto be = cpu_backend(2);
  constexpr int64_t kD = 48, kRows = 200;  // past the parallel threshold
  std::vector<float> g = pd::test::random_floats(kD * kRows, 21, 6.0f), u = pd::test::random_floats(kD * kRows, 22);
  g[0] = 0.0f, g[1] = -12.0f, g[2] = 12.0f;
  std::vector<float> out(g.size());
  pd::Tensor gt = f32_tensor(g, kD, kRows), ut = f32_tensor(u, kD, kRows), ot = f32_tensor(out, kD, kRows);
  REQUIRE(be->geglu(gt, ut, ot).is_ok());
  for (size_t i = 0; i < g.size(); ++i) {
    const double x = g[i];
    const double want = 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))) * u[i];
    INFO("element " << i << " gate " << g[i]);
    CHECK(std::fabs(out[i] - want) <= 2e-6 * (1 + std::fabs(want)));
  }
  std::vector<float> bias = pd::test::random_floats(kD, 23);
  pd::Tensor bt = f32_tensor(bias, kD, 1);
  REQUIRE(be->add(gt, bt, ot).is_ok());
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kD; ++j) CHECK(out[r * kD + j] == g[r * kD + j] + bias[j]);
  REQUIRE(be->scale(gt, 8.0f, ot).is_ok());
  for (size_t i = 0; i < g.size(); ++i) CHECK(out[i] == g[i] * 8.0f);
  std::vector<float> odd(kD + 1);
  pd::Tensor odd_t = f32_tensor(odd, kD + 1, 1);
  CHECK(be->add(gt, odd_t, ot).is_invalid_argument());
  CHECK(be->geglu(gt, odd_t, ot).is_invalid_argument());
}

// The KV pool is resident from its creation: a page first written in the
// middle of serving costs a fault and the kernel zeroing it, and a pool's
// pages are first written by decode steps and KV receives far into serving
// (a decode step once stalled 0.27 s on them).
TEST_CASE("cpu backend: a KV cache's pages are resident once created") {
  auto resident_kib = [] {
    std::FILE* f = std::fopen("/proc/self/status", "r");
    REQUIRE(f != nullptr);
    char line[256];
    long kib = -1;
    while (std::fgets(line, sizeof line, f))
      if (std::strncmp(line, "VmRSS:", 6) == 0) kib = std::strtol(line + 6, nullptr, 10);
    std::fclose(f);
    return kib;
  };
  pd::CpuBackendConfig cfg;
  cfg.n_threads = 1;
  auto be = pd::make_cpu_backend(cfg);
  pd::LlamaConfig lc;
  lc.n_layers = 8;
  lc.n_kv_heads = 4;
  lc.head_dim = 64;
  // 8 layers x 2 x 4 heads x 64 x 2 bytes = 8 KiB per token; 16-token blocks: 128 KiB a block.
  const long before = resident_kib();
  auto cache = pd::KvCache::create(*be, lc, 16, 512, pd::GgmlType::kF16);  // 64 MiB
  REQUIRE(cache.is_ok());
  const long grown = resident_kib() - before;
  INFO("resident memory grew by " << grown << " KiB for a 64 MiB pool");
  CHECK(grown >= 60 * 1024);
}
