// Randomized mutation test of the GGUF parser: a few thousand deterministic
// corruptions of a small valid file. The parser must never crash or read out of
// bounds (this test is meant to run under ASan/UBSan), must return OK or an
// error with a message, and when it returns OK every tensor must lie inside the
// buffer, aligned and non-overlapping.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/gguf_reader.h"
#include "gguf/gguf_writer.h"

namespace pd {
namespace {

using Bytes = std::vector<uint8_t>;

// Offsets of the length, count and type fields of a *valid* file, found by a
// trusting walk (the file came from our writer), so mutations can aim at them.
struct Fields {
  std::vector<size_t> u64s;  // counts, string/array lengths, ne[], tensor offsets
  std::vector<size_t> u32s;  // version, value/elem types, n_dims, tensor types
  size_t end_of_infos = 0;
};

class Walker {
 public:
  explicit Walker(const Bytes& b) : b_(b) {}
  Fields walk() {
    pos_ = 4;
    u32();
    const uint64_t n_tensors = u64();
    const uint64_t n_kv = u64();
    for (uint64_t i = 0; i < n_kv; ++i) {
      str();
      value(u32());
    }
    for (uint64_t i = 0; i < n_tensors; ++i) {
      str();
      const uint32_t n_dims = u32();
      for (uint32_t d = 0; d < n_dims; ++d) u64();
      u32();
      u64();
    }
    f_.end_of_infos = pos_;
    return f_;
  }

 private:
  template <typename T>
  T get() {
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  uint32_t u32() {
    f_.u32s.push_back(pos_);
    return get<uint32_t>();
  }
  uint64_t u64() {
    f_.u64s.push_back(pos_);
    return get<uint64_t>();
  }
  void str() { pos_ += u64(); }
  void value(uint32_t t) {
    static constexpr size_t kSizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (t == 8) {
      str();
    } else if (t == 9) {
      const uint32_t elem = u32();
      const uint64_t n = u64();
      for (uint64_t i = 0; i < n; ++i) value(elem);
    } else {
      pos_ += kSizes[t];
    }
  }
  const Bytes& b_;
  size_t pos_ = 0;
  Fields f_;
};

class Mutator {
 public:
  Mutator(const Bytes& original, const Fields& fields, uint64_t seed)
      : original_(original), fields_(fields), rng_(seed) {}

  // A copy of the original with 1..4 random mutations; `log` describes them.
  Bytes next(std::string* log) {
    Bytes b = original_;
    log->clear();
    const int n = 1 + static_cast<int>(below(4));
    for (int i = 0; i < n && !b.empty(); ++i) mutate(b, log);
    return b;
  }

 private:
  uint64_t below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  // Mostly inside the header/metadata/tensor infos, where the parser looks.
  size_t position(const Bytes& b) {
    const size_t hot = std::min(b.size(), fields_.end_of_infos + 64);
    return below(4) != 0 ? below(hot) : below(b.size());
  }
  uint64_t interesting_u64(const Bytes& b) {
    const uint64_t kValues[] = {0,
                                1,
                                ~uint64_t{0},
                                uint64_t{1} << 63,
                                (uint64_t{1} << 63) - 1,
                                uint64_t{1} << 32,
                                (uint64_t{1} << 32) - 1,
                                uint64_t{1} << 62,
                                b.size(),
                                b.size() + 1,
                                b.size() / 2,
                                ~uint64_t{0} - 31,
                                32,
                                0x7F,
                                0x80};
    return kValues[below(sizeof(kValues) / sizeof(kValues[0]))];
  }

  void mutate(Bytes& b, std::string* log) {
    switch (below(8)) {
      case 0: {  // bit flip
        const size_t at = position(b);
        b[at] ^= static_cast<uint8_t>(1u << below(8));
        *log += "flip@" + std::to_string(at) + " ";
        break;
      }
      case 1: {  // interesting byte
        static constexpr uint8_t kBytes[] = {0x00, 0xFF, 0x7F, 0x80, 0x01, 0x20};
        const size_t at = position(b);
        b[at] = kBytes[below(sizeof(kBytes))];
        *log += "byte@" + std::to_string(at) + " ";
        break;
      }
      case 2: {  // truncate
        const size_t n = below(b.size());
        b.resize(n);
        *log += "truncate" + std::to_string(n) + " ";
        break;
      }
      case 3: {  // insert 1..16 random bytes
        const size_t at = position(b);
        const size_t n = 1 + below(16);
        Bytes ins(n);
        for (uint8_t& x : ins) x = static_cast<uint8_t>(rng_());
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), ins.begin(), ins.end());
        *log += "insert" + std::to_string(n) + "@" + std::to_string(at) + " ";
        break;
      }
      case 4: {  // delete 1..16 bytes
        const size_t at = position(b);
        const size_t n = std::min<size_t>(1 + below(16), b.size() - at);
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
        *log += "erase" + std::to_string(n) + "@" + std::to_string(at) + " ";
        break;
      }
      case 5:
      case 6: {  // a length/count/ne/offset field set to an interesting value
        const size_t at = fields_.u64s[below(fields_.u64s.size())];
        if (at + 8 > b.size()) break;
        const uint64_t v = below(3) == 0 ? std::max<uint64_t>(1, rng_() >> below(64)) : interesting_u64(b);
        std::memcpy(b.data() + at, &v, 8);
        *log += "u64@" + std::to_string(at) + "=" + std::to_string(v) + " ";
        break;
      }
      case 7: {  // a type/n_dims field set to a nearby or hostile value
        const size_t at = fields_.u32s[below(fields_.u32s.size())];
        if (at + 4 > b.size()) break;
        const uint32_t kValues[] = {0, 1, 2, 3, 4, 5, 8, 9, 12, 13, 30, 39, 40, 0x7FFFFFFF, 0xFFFFFFFF};
        const uint32_t v = kValues[below(sizeof(kValues) / sizeof(kValues[0]))];
        std::memcpy(b.data() + at, &v, 4);
        *log += "u32@" + std::to_string(at) + "=" + std::to_string(v) + " ";
        break;
      }
    }
  }

  const Bytes& original_;
  const Fields& fields_;
  std::mt19937_64 rng_;
};

// Exercises everything a caller would read from an accepted file.
void check_accepted(const GgufFile& f, size_t buffer_size) {
  REQUIRE(f.file_size() == buffer_size);
  const uint8_t* lo = f.bytes();
  const uint8_t* hi = f.bytes() + f.file_size();
  REQUIRE((f.alignment() != 0 && (f.alignment() & (f.alignment() - 1)) == 0));
  std::vector<const GgufTensorInfo*> by_offset;
  for (const GgufTensorInfo& t : f.tensors()) {
    INFO("tensor " << t.name);
    REQUIRE(t.nbytes > 0);
    REQUIRE(t.data >= lo);
    REQUIRE(t.data <= hi);
    REQUIRE(t.nbytes <= static_cast<size_t>(hi - t.data));
    REQUIRE(t.offset % f.alignment() == 0);
    REQUIRE(t.data == lo + f.data_offset() + t.offset);
    REQUIRE((!t.ne.empty() && t.ne.size() <= 4));
    REQUIRE(t.nbytes == ggml_row_bytes(t.type, t.ne[0]) * static_cast<size_t>(t.n_elements() / t.ne[0]));
    REQUIRE(f.find_tensor(t.name) == &t);
    // Touch both ends (ASan would flag an escape) and decode the first row.
    volatile uint8_t sink = t.data[0];
    sink = t.data[t.nbytes - 1];
    (void)sink;
    const int64_t n0 = std::min<int64_t>(t.ne[0], 4096);
    if (n0 == t.ne[0]) {
      std::vector<float> row(static_cast<size_t>(n0));
      dequantize_row(t.type, t.data, row.data(), n0);
    }
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    REQUIRE(by_offset[i - 1]->data + by_offset[i - 1]->nbytes <= by_offset[i]->data);
  }
  for (const auto& [key, value] : f.metadata()) {
    (void)f.get_int(key);
    (void)f.get_float(key);
    (void)f.get_string(key);
    (void)f.get_bool(key);
    (void)f.get_string_array(key);
    (void)f.get_int_array(key);
    (void)f.get_float_array(key);
  }
  (void)check_llama_family(f);
}

}  // namespace

TEST_CASE("gguf fuzz: mutated files never crash the parser", "[gguf][fuzz]") {
  TinyLlamaSpec spec;
  spec.n_layers = 1;
  spec.hidden = 32;
  spec.n_heads = 2;
  spec.n_kv_heads = 1;
  spec.ffn = 32;
  spec.context = 64;
  spec.vocab = kTinyVocabFirstMerge + 8;  // a small vocabulary keeps the corpus small
  const Bytes original = make_tiny_llama_gguf(spec);
  {
    auto r = GgufFile::from_bytes(original, "original.gguf");
    REQUIRE(r.status().to_string() == "OK");
    check_accepted(**r, original.size());
  }
  const Fields fields = Walker(original).walk();
  REQUIRE(fields.u64s.size() > 20);

  Mutator mutator(original, fields, /*seed=*/0x9e3779b97f4a7c15ull);
  constexpr int kIterations = 4000;
  int accepted = 0;
  std::string log;
  for (int i = 0; i < kIterations; ++i) {
    const Bytes b = mutator.next(&log);
    INFO("iteration " << i << ": " << log);
    auto r = GgufFile::from_bytes(b, "fuzz.gguf");
    if (r.is_ok()) {
      ++accepted;
      check_accepted(**r, b.size());
    } else {
      REQUIRE_FALSE(r.status().message().empty());
      REQUIRE(r.status().message().find("fuzz.gguf") != std::string::npos);
    }
  }
  // Both outcomes must occur, or the mutations are not exercising the parser.
  INFO("accepted " << accepted << " of " << kIterations);
  CHECK(accepted > 0);
  CHECK(accepted < kIterations / 2);
}

}  // namespace pd
