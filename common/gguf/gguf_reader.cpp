#include "gguf/gguf_reader.h"

#include <xxhash.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>

namespace pd {
namespace {

// GGML_MAX_DIMS.
constexpr uint32_t kMaxDims = 4;
// Nesting limit for arrays of arrays (the parser recurses once per level).
constexpr int kMaxArrayDepth = 8;
// Total array elements across all metadata. Real vocabularies hold well under
// a million; the cap bounds memory (~48 bytes per parsed element) on hostile input.
constexpr uint64_t kMaxArrayElements = uint64_t{1} << 24;
// Largest general.alignment accepted (the key is a uint32 in ggml).
constexpr uint64_t kMaxAlignment = uint64_t{1} << 31;
// Smallest encoded sizes, used to bound counts by the bytes that remain.
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;              // key len, 1-char key, type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;  // name, n_dims, ne[0], type, offset

const char* value_type_name(uint32_t t) {
  static constexpr const char* kNames[] = {"uint8",  "int8", "uint16", "int16", "uint32",
                                           "int32",  "float32", "bool", "string", "array",
                                           "uint64", "int64", "float64"};
  return t < 13 ? kNames[t] : "unknown";
}

// Smallest encoding of one value of type t (array: type + count).
uint64_t min_value_bytes(uint32_t t) {
  switch (static_cast<GgufValueType>(t)) {
    case GgufValueType::kUint8: case GgufValueType::kInt8: case GgufValueType::kBool: return 1;
    case GgufValueType::kUint16: case GgufValueType::kInt16: return 2;
    case GgufValueType::kUint32: case GgufValueType::kInt32: case GgufValueType::kFloat32: return 4;
    case GgufValueType::kUint64: case GgufValueType::kInt64: case GgufValueType::kFloat64: return 8;
    case GgufValueType::kString: return 8;
    case GgufValueType::kArray: return 12;
  }
  return 1;
}

// Names the field being read, for error messages. Cheap to pass; turned into a
// string only when a read fails.
struct What {
  const char* field;                        // "value", "name", "tensor count", ...
  const char* owner = nullptr;              // "metadata key", "tensor"
  const std::string* owner_name = nullptr;  // quoted after the owner
  int64_t index = -1;                       // "#index" when there is no owner_name

  std::string str() const {
    std::string s = field;
    if (owner != nullptr) {
      s += std::string(" of ") + owner;
      if (owner_name != nullptr) {
        s += " '" + *owner_name + "'";
      } else if (index >= 0) {
        s += " #" + std::to_string(index);
      }
    }
    return s;
  }
};

// Bounds-checked little-endian reader over [base, base + size). Every read
// either succeeds entirely or returns a Corruption naming what was being read.
class Cursor {
 public:
  Cursor(const uint8_t* base, size_t size, const std::string& file) : base_(base), size_(size), file_(file) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }

  template <typename T>
  Status read(T* out, const What& what) {
    if (sizeof(T) > remaining()) {
      return Status::corruption(file_ + ": truncated: " + what.str() + " (" + std::to_string(sizeof(T)) +
                                " bytes at offset " + std::to_string(pos_) + ") extends past end of file (size " +
                                std::to_string(size_) + ")");
    }
    std::memcpy(out, base_ + pos_, sizeof(T));  // host is little-endian (x86-64, aarch64)
    pos_ += sizeof(T);
    return Status::ok();
  }

  Status read_string(std::string* out, const What& what) {
    uint64_t len = 0;
    PD_RETURN_IF_ERROR(read(&len, what));
    if (len > remaining()) {
      return Status::corruption(file_ + ": truncated or corrupt: " + what.str() + " length " + std::to_string(len) +
                                " at offset " + std::to_string(pos_ - 8) + " extends past end of file (" +
                                std::to_string(remaining()) + " bytes left, size " + std::to_string(size_) + ")");
    }
    out->assign(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return Status::ok();
  }

 private:
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& file_;
};

bool is_pow2(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Reads one value of type `t` (already read) into *out.
class ValueParser {
 public:
  ValueParser(Cursor& cur, const std::string& file) : cur_(cur), file_(file) {}

  Status parse(uint32_t t, const std::string& key, int depth, GgufValue* out) {
    if (t > static_cast<uint32_t>(GgufValueType::kFloat64)) {
      return Status::corruption(file_ + ": metadata key '" + key + "' has unknown value type " + std::to_string(t));
    }
    out->type = static_cast<GgufValueType>(t);
    const What what{"value", "metadata key", &key};
    switch (out->type) {
      case GgufValueType::kUint8: return read_as<uint8_t>(out, what);
      case GgufValueType::kInt8: return read_as<int8_t>(out, what);
      case GgufValueType::kUint16: return read_as<uint16_t>(out, what);
      case GgufValueType::kInt16: return read_as<int16_t>(out, what);
      case GgufValueType::kUint32: return read_as<uint32_t>(out, what);
      case GgufValueType::kInt32: return read_as<int32_t>(out, what);
      case GgufValueType::kFloat32: return read_as<float>(out, what);
      case GgufValueType::kUint64: return read_as<uint64_t>(out, what);
      case GgufValueType::kInt64: return read_as<int64_t>(out, what);
      case GgufValueType::kFloat64: return read_as<double>(out, what);
      case GgufValueType::kBool: {
        uint8_t b = 0;
        PD_RETURN_IF_ERROR(cur_.read(&b, what));
        if (b > 1) {
          return Status::corruption(file_ + ": metadata key '" + key + "' has bool value " + std::to_string(b) +
                                    " (must be 0 or 1)");
        }
        out->v = b != 0;
        return Status::ok();
      }
      case GgufValueType::kString: {
        std::string s;
        PD_RETURN_IF_ERROR(cur_.read_string(&s, What{"string value", "metadata key", &key}));
        out->v = std::move(s);
        return Status::ok();
      }
      case GgufValueType::kArray: return parse_array(key, depth, out);
    }
    return Status::internal("unreachable");
  }

 private:
  template <typename T>
  Status read_as(GgufValue* out, const What& what) {
    T x{};
    PD_RETURN_IF_ERROR(cur_.read(&x, what));
    out->v = x;
    return Status::ok();
  }

  Status parse_array(const std::string& key, int depth, GgufValue* out) {
    if (depth >= kMaxArrayDepth) {
      return Status::corruption(file_ + ": metadata key '" + key + "' nests arrays deeper than " +
                                std::to_string(kMaxArrayDepth) + " levels");
    }
    uint32_t elem_type = 0;
    uint64_t count = 0;
    PD_RETURN_IF_ERROR(cur_.read(&elem_type, What{"array element type", "metadata key", &key}));
    if (elem_type > static_cast<uint32_t>(GgufValueType::kFloat64)) {
      return Status::corruption(file_ + ": metadata key '" + key + "' is an array of unknown value type " +
                                std::to_string(elem_type));
    }
    PD_RETURN_IF_ERROR(cur_.read(&count, What{"array length", "metadata key", &key}));
    // Each element needs at least min_value_bytes; this bounds `count` by the file.
    if (count > cur_.remaining() / min_value_bytes(elem_type)) {
      return Status::corruption(file_ + ": truncated or corrupt: metadata key '" + key + "' array length " +
                                std::to_string(count) + " (" + value_type_name(elem_type) + " values at offset " +
                                std::to_string(cur_.pos()) + ") extends past end of file (" +
                                std::to_string(cur_.remaining()) + " bytes left)");
    }
    if (count > kMaxArrayElements - total_elements_) {
      return Status::resource_exhausted(file_ + ": metadata key '" + key + "' array of " + std::to_string(count) +
                                        " elements exceeds the limit of " + std::to_string(kMaxArrayElements) +
                                        " array elements per file");
    }
    total_elements_ += count;
    auto arr = std::make_shared<GgufArray>();
    arr->elem_type = static_cast<GgufValueType>(elem_type);
    arr->items.resize(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i) {
      PD_RETURN_IF_ERROR(parse(elem_type, key, depth + 1, &arr->items[i]));
    }
    out->v = std::move(arr);
    return Status::ok();
  }

  Cursor& cur_;
  const std::string& file_;
  uint64_t total_elements_ = 0;
};

std::string tensor_span(uint64_t offset, uint64_t nbytes) {
  return "[offset " + std::to_string(offset) + ", " + std::to_string(nbytes) + " bytes]";
}

}  // namespace

// ---- GgufValue ----

std::optional<int64_t> GgufValue::as_int() const {
  switch (type) {
    case GgufValueType::kUint8: return std::get<uint8_t>(v);
    case GgufValueType::kInt8: return std::get<int8_t>(v);
    case GgufValueType::kUint16: return std::get<uint16_t>(v);
    case GgufValueType::kInt16: return std::get<int16_t>(v);
    case GgufValueType::kUint32: return std::get<uint32_t>(v);
    case GgufValueType::kInt32: return std::get<int32_t>(v);
    case GgufValueType::kInt64: return std::get<int64_t>(v);
    case GgufValueType::kUint64: {
      const uint64_t u = std::get<uint64_t>(v);
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
      return static_cast<int64_t>(u);
    }
    default: return std::nullopt;
  }
}

std::optional<double> GgufValue::as_float() const {
  if (type == GgufValueType::kFloat32) return std::get<float>(v);
  if (type == GgufValueType::kFloat64) return std::get<double>(v);
  if (type == GgufValueType::kUint64) return static_cast<double>(std::get<uint64_t>(v));
  if (auto i = as_int()) return static_cast<double>(*i);
  return std::nullopt;
}

std::optional<bool> GgufValue::as_bool() const {
  if (type == GgufValueType::kBool) return std::get<bool>(v);
  return std::nullopt;
}

const std::string* GgufValue::as_string() const {
  return type == GgufValueType::kString ? std::get_if<std::string>(&v) : nullptr;
}

const GgufArray* GgufValue::as_array() const {
  if (type != GgufValueType::kArray) return nullptr;
  const auto* p = std::get_if<std::shared_ptr<GgufArray>>(&v);
  return p ? p->get() : nullptr;
}

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

// ---- GgufFile ----

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) munmap(mapping_, size_);
}

Result<std::unique_ptr<GgufFile>> GgufFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::io_error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::io_error(path + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::io_error(path + ": not a regular file");
  }
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* m = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return Status::io_error(path + ": cannot mmap " + std::to_string(file->size_) + " bytes: " + std::strerror(err));
    }
    file->mapping_ = m;
    file->base_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);  // the mapping stays valid
  PD_RETURN_IF_ERROR(file->parse());
  return file;
}

Result<std::unique_ptr<GgufFile>> GgufFile::from_bytes(std::vector<uint8_t> bytes, const std::string& name) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->path_ = name;
  file->owned_ = std::move(bytes);
  file->base_ = file->owned_.data();
  file->size_ = file->owned_.size();
  PD_RETURN_IF_ERROR(file->parse());
  return file;
}

Status GgufFile::parse() {
  const std::string& f = path_;
  Cursor cur(base_, size_, f);

  // Header.
  uint8_t magic[4] = {};
  PD_RETURN_IF_ERROR(cur.read(&magic, What{"magic"}));
  if (std::memcmp(magic, "GGUF", 4) != 0) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%02x %02x %02x %02x", magic[0], magic[1], magic[2], magic[3]);
    return Status::corruption(f + ": bad magic " + buf + " (not a GGUF file; expected \"GGUF\")");
  }
  PD_RETURN_IF_ERROR(cur.read(&version_, What{"version"}));
  if (version_ == 1) {
    return Status::unsupported(f + ": GGUF version 1 is not supported (need version 2 or 3)");
  }
  if (version_ != 2 && version_ != 3) {
    if ((version_ & 0xFFFF) == 0 && (version_ >> 16) != 0) {
      return Status::unsupported(f + ": GGUF version " + std::to_string(version_) +
                                 " looks byte-swapped; big-endian GGUF files are not supported");
    }
    return Status::unsupported(f + ": unsupported GGUF version " + std::to_string(version_) +
                               " (need version 2 or 3)");
  }
  uint64_t n_tensors = 0;
  uint64_t n_kv = 0;
  PD_RETURN_IF_ERROR(cur.read(&n_tensors, What{"tensor count"}));
  PD_RETURN_IF_ERROR(cur.read(&n_kv, What{"metadata count"}));
  if (n_kv > cur.remaining() / kMinKvBytes) {
    return Status::corruption(f + ": metadata count " + std::to_string(n_kv) + " is more than the " +
                              std::to_string(cur.remaining()) + " remaining bytes can hold (truncated or corrupt)");
  }
  if (n_tensors > cur.remaining() / kMinTensorInfoBytes) {
    return Status::corruption(f + ": tensor count " + std::to_string(n_tensors) + " is more than the " +
                              std::to_string(cur.remaining()) + " remaining bytes can hold (truncated or corrupt)");
  }

  // Metadata.
  ValueParser values(cur, f);
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    PD_RETURN_IF_ERROR(cur.read_string(&key, What{"name", "metadata key", nullptr, static_cast<int64_t>(i)}));
    if (key.empty()) return Status::corruption(f + ": metadata key #" + std::to_string(i) + " is empty");
    uint32_t type = 0;
    PD_RETURN_IF_ERROR(cur.read(&type, What{"value type", "metadata key", &key}));
    GgufValue value;
    PD_RETURN_IF_ERROR(values.parse(type, key, 0, &value));
    if (!metadata_.emplace(key, std::move(value)).second) {
      return Status::corruption(f + ": duplicate metadata key '" + key + "'");
    }
  }

  alignment_ = 32;
  if (const GgufValue* a = find("general.alignment")) {
    const std::optional<int64_t> v = a->as_int();
    if (!v) {
      return Status::corruption(f + ": general.alignment must be an integer, not " +
                                value_type_name(static_cast<uint32_t>(a->type)));
    }
    if (*v <= 0 || !is_pow2(static_cast<uint64_t>(*v)) || static_cast<uint64_t>(*v) > kMaxAlignment) {
      return Status::corruption(f + ": general.alignment " + std::to_string(*v) +
                                " is not a power of two in [1, 2^31]");
    }
    alignment_ = static_cast<uint64_t>(*v);
  }

  // Tensor infos.
  tensors_.reserve(static_cast<size_t>(n_tensors));  // bounded by the file size above
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    PD_RETURN_IF_ERROR(cur.read_string(&t.name, What{"name", "tensor", nullptr, static_cast<int64_t>(i)}));
    if (t.name.empty()) return Status::corruption(f + ": tensor #" + std::to_string(i) + " has an empty name");
    auto tn = [&t] { return "tensor '" + t.name + "'"; };  // for messages
    uint32_t n_dims = 0;
    PD_RETURN_IF_ERROR(cur.read(&n_dims, What{"n_dims", "tensor", &t.name}));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return Status::corruption(f + ": " + tn() + " has " + std::to_string(n_dims) + " dimensions (must be 1.." +
                                std::to_string(kMaxDims) + ")");
    }
    t.ne.resize(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = 0;
      PD_RETURN_IF_ERROR(cur.read(&ne, What{"dimensions", "tensor", &t.name}));
      if (ne == 0 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Status::corruption(f + ": " + tn() + " has invalid dimension ne[" + std::to_string(d) +
                                  "] = " + std::to_string(ne) + " (must be >= 1)");
      }
      t.ne[d] = static_cast<int64_t>(ne);
    }
    uint32_t raw_type = 0;
    PD_RETURN_IF_ERROR(cur.read(&raw_type, What{"type", "tensor", &t.name}));
    PD_RETURN_IF_ERROR(cur.read(&t.offset, What{"data offset", "tensor", &t.name}));

    const std::optional<GgmlTypeTraits> traits = ggml_type_traits(raw_type);
    if (!traits) {
      return Status::unsupported("unsupported tensor type " + std::string(ggml_raw_type_name(raw_type)) +
                                 " for tensor " + t.name + " in " + f);
    }
    t.type = traits->type;
    if (t.ne[0] % traits->block_elems != 0) {
      return Status::corruption(f + ": " + tn() + " of type " + traits->name + " has ne[0] = " +
                                std::to_string(t.ne[0]) + ", not a multiple of the block size " +
                                std::to_string(traits->block_elems));
    }
    int64_t n = 1;
    for (int64_t d : t.ne) {
      if (__builtin_mul_overflow(n, d, &n)) {
        return Status::corruption(f + ": " + tn() + " element count overflows (dimensions too large)");
      }
    }
    uint64_t nbytes = 0;
    static_assert(sizeof(size_t) == sizeof(uint64_t));
    if (__builtin_mul_overflow(static_cast<uint64_t>(n / traits->block_elems), uint64_t{traits->block_bytes},
                               &nbytes)) {
      return Status::corruption(f + ": " + tn() + " byte size overflows (dimensions too large)");
    }
    t.nbytes = static_cast<size_t>(nbytes);
    if (t.offset % alignment_ != 0) {
      return Status::corruption(f + ": " + tn() + " data offset " + std::to_string(t.offset) +
                                " is misaligned (not a multiple of the alignment " + std::to_string(alignment_) + ")");
    }
    if (!tensor_index_.emplace(t.name, tensors_.size()).second) {
      return Status::corruption(f + ": duplicate tensor name '" + t.name + "'");
    }
    tensors_.push_back(std::move(t));
  }

  // Data section: the aligned offset after the tensor infos.
  const uint64_t end_of_infos = cur.pos();
  data_offset_ = end_of_infos + (alignment_ - end_of_infos % alignment_) % alignment_;  // <= size + 2^31
  for (GgufTensorInfo& t : tensors_) {
    uint64_t start = 0;
    uint64_t end = 0;
    if (__builtin_add_overflow(data_offset_, t.offset, &start)) {
      return Status::corruption(f + ": tensor '" + t.name + "' data offset " + std::to_string(t.offset) +
                                " extends past end of file (size " + std::to_string(size_) + ")");
    }
    if (__builtin_add_overflow(start, t.nbytes, &end) || end > size_) {
      return Status::corruption(f + ": tensor '" + t.name + "' data " + tensor_span(start, t.nbytes) +
                                " extends past end of file (size " + std::to_string(size_) + ")");
    }
    t.data = base_ + start;
  }
  // No two tensors may share bytes.
  std::vector<size_t> order(tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  for (size_t i = 1; i < order.size(); ++i) {
    const GgufTensorInfo& a = tensors_[order[i - 1]];
    const GgufTensorInfo& b = tensors_[order[i]];
    if (a.offset + a.nbytes > b.offset) {  // no overflow: both lie inside the file
      return Status::corruption(f + ": tensors '" + a.name + "' " +
                                tensor_span(data_offset_ + a.offset, a.nbytes) + " and '" + b.name + "' " +
                                tensor_span(data_offset_ + b.offset, b.nbytes) + " overlap");
    }
  }
  return Status::ok();
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

Status missing(const std::string& file, const std::string& key) {
  return Status::not_found(file + ": metadata key '" + key + "' not found");
}
Status wrong_type(const std::string& file, const std::string& key, const GgufValue& v, const char* wanted) {
  std::string got = value_type_name(static_cast<uint32_t>(v.type));
  if (const GgufArray* a = v.as_array()) got += std::string(" of ") + value_type_name(static_cast<uint32_t>(a->elem_type));
  return Status::invalid_argument(file + ": metadata key '" + key + "' is " + got + ", expected " + wanted);
}

}  // namespace

Result<int64_t> GgufFile::get_int(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(path_, key);
  if (auto i = v->as_int()) return *i;
  return wrong_type(path_, key, *v, "an integer");
}

Result<double> GgufFile::get_float(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(path_, key);
  if (auto x = v->as_float()) return *x;
  return wrong_type(path_, key, *v, "a number");
}

Result<std::string> GgufFile::get_string(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(path_, key);
  if (const std::string* s = v->as_string()) return *s;
  return wrong_type(path_, key, *v, "a string");
}

Result<bool> GgufFile::get_bool(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(path_, key);
  if (auto b = v->as_bool()) return *b;
  return wrong_type(path_, key, *v, "a bool");
}

Result<std::vector<std::string>> GgufFile::get_string_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(path_, key);
  const GgufArray* a = v->as_array();
  if (!a || a->elem_type != GgufValueType::kString) return wrong_type(path_, key, *v, "an array of strings");
  std::vector<std::string> out;
  out.reserve(a->items.size());
  for (const GgufValue& item : a->items) out.push_back(*item.as_string());
  return out;
}

Result<std::vector<int64_t>> GgufFile::get_int_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(path_, key);
  const GgufArray* a = v->as_array();
  if (!a) return wrong_type(path_, key, *v, "an array of integers");
  std::vector<int64_t> out;
  out.reserve(a->items.size());
  for (size_t i = 0; i < a->items.size(); ++i) {
    std::optional<int64_t> x = a->items[i].as_int();
    if (!x) {
      return Status::invalid_argument(path_ + ": metadata key '" + key + "' element " + std::to_string(i) +
                                      " is not an integer representable as int64");
    }
    out.push_back(*x);
  }
  return out;
}

Result<std::vector<float>> GgufFile::get_float_array(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(path_, key);
  const GgufArray* a = v->as_array();
  if (!a) return wrong_type(path_, key, *v, "an array of numbers");
  std::vector<float> out;
  out.reserve(a->items.size());
  for (size_t i = 0; i < a->items.size(); ++i) {
    std::optional<double> x = a->items[i].as_float();
    if (!x) {
      return Status::invalid_argument(path_ + ": metadata key '" + key + "' element " + std::to_string(i) +
                                      " is not a number");
    }
    out.push_back(static_cast<float>(*x));
  }
  return out;
}

Status check_llama_family(const GgufFile& file) {
  PD_ASSIGN_OR_RETURN(const std::string arch, file.get_string("general.architecture"));
  for (const char* a : {"llama", "qwen2", "qwen3", "gemma3"}) {
    if (arch == a) return Status::ok();
  }
  return Status::unsupported("unsupported architecture '" + arch + "' in " + file.path() +
                             " (supported: llama, qwen2, qwen3, gemma3)");
}

std::string gguf_fingerprint(const GgufFile& f) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, f.bytes(), static_cast<size_t>(std::min<uint64_t>(f.data_offset(), f.file_size())));
  constexpr size_t kSample = 4096;
  for (const GgufTensorInfo& t : f.tensors()) {
    if (t.data == nullptr || t.nbytes == 0) continue;
    const size_t n = std::min(kSample, t.nbytes);
    for (const size_t at : {size_t{0}, (t.nbytes - n) / 2, t.nbytes - n}) XXH3_64bits_update(st, t.data + at, n);
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

}  // namespace pd
