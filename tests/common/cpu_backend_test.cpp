// The CPU backend's handling of repacked weights, against its own unpacked
// path and ggml's dequantization: matmul_multi equals one matmul per weight,
// get_rows reads packed tables exactly, and misuse is refused with a message.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <vector>

#include "backend/backend.h"
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

Loaded load(bool int8, pd::GgmlType weight_type) {
  pd::TinyLlamaSpec spec;
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
    for (pd::GgmlType wt : {pd::GgmlType::kQ4_0, pd::GgmlType::kQ4_1, pd::GgmlType::kQ8_0, pd::GgmlType::kF32}) {
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
  for (pd::GgmlType et : {pd::GgmlType::kQ4_0, pd::GgmlType::kQ8_0}) {
    pd::TinyLlamaSpec spec;
    spec.embed_type = et;
    auto f = pd::GgufFile::from_bytes(pd::make_tiny_llama_gguf(spec), "tiny.gguf");
    REQUIRE(f.is_ok());
    auto be = pd::create_backend(pd::BackendConfig{});
    REQUIRE(be.is_ok());
    const pd::GgufTensorInfo* info = f.value()->find_tensor("token_embd.weight");
    std::unique_ptr<pd::BackendBuffer> buf;
    auto table = be.value()->load_weight(*info, &buf);
    REQUIRE(table.is_ok());
    REQUIRE(table->layout != 0);
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
