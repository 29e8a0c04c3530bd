// GGUF reader: parses a GGUF v2/v3 file (memory-mapped) into its metadata and
// tensor directory. Tensor data stays in the mapping; nothing is copied.
//
// Every malformed input (truncated file, bad magic, unknown version, string or
// array lengths past the end, unknown metadata or tensor type, tensor data out
// of bounds or overlapping, misaligned offsets) is refused with a Status whose
// message names the problem and the file. The parser never reads out of bounds.
// Integers are read little-endian; big-endian files are refused.
//
// A GgufFile is immutable once open() / from_bytes() returns: its const methods
// may be called from any number of threads at once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "gguf/ggml_types.h"
#include "util/status.h"

namespace pd {

// GGUF metadata value types (on-disk ids).
enum class GgufValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5,
  kFloat32 = 6, kBool = 7, kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};

struct GgufArray;
// A metadata value. Integers of every width are kept in their declared type.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool, std::string,
               std::shared_ptr<GgufArray>, uint64_t, int64_t, double>
      v;

  // Conversions; nullopt when the value is not of a compatible kind.
  std::optional<int64_t> as_int() const;   // any integer type (uint64 > INT64_MAX: nullopt)
  std::optional<double> as_float() const;  // float32/float64 or any integer
  std::optional<bool> as_bool() const;
  const std::string* as_string() const;
  const GgufArray* as_array() const;
};

struct GgufArray {
  GgufValueType elem_type = GgufValueType::kUint8;
  std::vector<GgufValue> items;  // for arrays of strings/ints/floats alike
};

struct GgufTensorInfo {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<int64_t> ne;   // ggml order: ne[0] is the contiguous (fastest) dimension
  uint64_t offset = 0;       // relative to the data section
  const uint8_t* data = nullptr;  // into the mapping
  size_t nbytes = 0;
  int64_t n_elements() const;
};

class GgufFile;

// What tells one model file from another, cheaply: XXH3-64 of the header,
// metadata and tensor table, and of up to 4 KiB at the start, middle and end
// of each tensor's data (a different model, quantization or fine-tune
// differs there), as 16 hex digits. Reads a few KiB per tensor, not the file.
std::string gguf_fingerprint(const GgufFile& f);

class GgufFile {
 public:
  // Opens and validates a file. The returned object owns the mapping.
  static Result<std::unique_ptr<GgufFile>> open(const std::string& path);
  // Parses a buffer held in memory (copied). `name` is used in error messages.
  static Result<std::unique_ptr<GgufFile>> from_bytes(std::vector<uint8_t> bytes, const std::string& name);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  size_t file_size() const { return size_; }
  // The file's bytes (the mapping, or the copy from_bytes holds): file_size() bytes,
  // valid for the life of this object.
  const uint8_t* bytes() const { return base_; }
  // Absolute offset of the data section (aligned end of the tensor infos); every
  // tensor's data is bytes() + data_offset() + offset.
  uint64_t data_offset() const { return data_offset_; }

  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const GgufValue* find(const std::string& key) const;  // nullptr if absent
  // Typed getters: NotFound if absent, InvalidArgument (naming the key) if of the wrong type.
  Result<int64_t> get_int(const std::string& key) const;
  Result<double> get_float(const std::string& key) const;
  Result<std::string> get_string(const std::string& key) const;
  Result<bool> get_bool(const std::string& key) const;
  Result<std::vector<std::string>> get_string_array(const std::string& key) const;
  Result<std::vector<int64_t>> get_int_array(const std::string& key) const;
  Result<std::vector<float>> get_float_array(const std::string& key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;  // nullptr if absent

 private:
  GgufFile() = default;
  Status parse();

  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;          // mmap'ed region, or nullptr
  std::vector<uint8_t> owned_;       // from_bytes storage
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// Refuses a model whose general.architecture is not one this project runs
// (the Llama family of LlamaConfig: llama, qwen2, qwen3, gemma3). Unsupported
// names the architecture found and the file: "unsupported architecture 'gpt2'
// in m.gguf (supported: llama, qwen2, qwen3, gemma3)". A missing key is
// NotFound, a non-string one InvalidArgument (as get_string).
Status check_llama_family(const GgufFile& file);

}  // namespace pd
