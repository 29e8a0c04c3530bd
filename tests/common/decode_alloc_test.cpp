// The decode hot path allocates nothing once warm: every heap allocation in
// this test binary goes through the counting operator new below, and a run of
// decode steps (after a few warm-up steps) must not make any. Under
// AddressSanitizer, which owns operator new, the test skips (the Release run
// covers it).
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"

#include "test_support.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations{0};
}  // namespace

#if !defined(__SANITIZE_ADDRESS__)

void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif

TEST_CASE("decode steps allocate nothing once warm (both matmul paths)", "[model][alloc]") {
#if defined(__SANITIZE_ADDRESS__)
  pd::test::skip("allocation counting replaces operator new, which AddressSanitizer owns here");
#endif
  for (bool int8 : {true, false}) {
    INFO((int8 ? "int8" : "fp32") << " activations");
    pd::TinyLlamaSpec spec;
    auto f = pd::GgufFile::from_bytes(pd::make_tiny_llama_gguf(spec), "tiny.gguf");
    REQUIRE(f.is_ok());
    std::shared_ptr<const pd::GgufFile> file(std::move(f).value());
    pd::BackendConfig bc;
    bc.n_threads = 2;
    bc.int8_activations = int8;
    auto be = pd::create_backend(bc);
    REQUIRE(be.is_ok());
    auto model = pd::LlamaModel::load(file, *be.value());
    REQUIRE(model.is_ok());
    auto cache = pd::KvCache::create(*be.value(), model.value()->config(), 16, 32, pd::GgmlType::kF32);
    REQUIRE(cache.is_ok());

    const int n_seq = 3, prompt = 20, steps = 12;
    std::vector<std::vector<int32_t>> prompts(n_seq), tables(n_seq);
    for (int s = 0; s < n_seq; ++s) {
      for (int i = 0; i < prompt; ++i) prompts[s].push_back((7 * s + 3 * i) % model.value()->config().vocab);
      for (int b = 0; b < 3; ++b) tables[s].push_back(s * 3 + b);
    }
    std::vector<pd::SequenceBatch> batch(n_seq);
    for (int s = 0; s < n_seq; ++s) batch[s] = {prompts[s], 0, tables[s], true};
    std::vector<float> logits;
    REQUIRE(model.value()->prefill(batch, *cache, &logits).is_ok());

    std::vector<int32_t> next(n_seq, 1);
    for (int i = 0; i < steps; ++i) {
      for (int s = 0; s < n_seq; ++s) batch[s] = {std::span<const int32_t>(&next[s], 1), prompt + i, tables[s], true};
      if (i == 4) {  // steps 0-3 warm up (scratch sized, thread pool started)
        g_allocations = 0;
        g_counting = true;
      }
      const pd::Status st = model.value()->decode(batch, *cache, &logits);
      REQUIRE(st.is_ok());
    }
    g_counting = false;
    CHECK(g_allocations.load() == 0);
  }
}
