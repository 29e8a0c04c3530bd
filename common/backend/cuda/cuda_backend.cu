// The CUDA backend (see cuda_backend.h): memory, argument validation (the same
// InvalidArgument cases as the CPU backend, plus the bounds a device kernel
// needs), host-to-device staging of index arrays, and the cuBLAS GEMM path.
// Kernels live in cuda_kernels.cu.
#include "backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_copy.h"
#include "backend/cuda/cuda_kernels.h"
#include "gguf/gguf_reader.h"

namespace pd {
namespace {

// ---- errors: every CUDA / cuBLAS failure becomes a Status naming the call.

Status cuda_status(const char* call, cudaError_t err) {
  const std::string msg = std::string("cuda: ") + call + ": " + cudaGetErrorString(err);
  return err == cudaErrorMemoryAllocation ? Status::resource_exhausted(msg) : Status::internal(msg);
}

#define PD_CUDA_TRY(call)                                              \
  do {                                                                 \
    const cudaError_t pd_cuda_err_ = (call);                           \
    if (pd_cuda_err_ != cudaSuccess) return cuda_status(#call, pd_cuda_err_); \
  } while (0)

// Kernel launchers return the launch error; name the op in the message.
#define PD_CUDA_LAUNCH(op, call)                                      \
  do {                                                                \
    const cudaError_t pd_cuda_err_ = (call);                          \
    if (pd_cuda_err_ != cudaSuccess) return cuda_status(op, pd_cuda_err_); \
  } while (0)

#define PD_CUBLAS_TRY(call)                                                                       \
  do {                                                                                            \
    const cublasStatus_t pd_cublas_st_ = (call);                                                  \
    if (pd_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                                   \
      return Status::internal(std::string("cuda: ") + #call + ": " + cublasGetStatusString(pd_cublas_st_)); \
  } while (0)

// ---- weight types (kept local so this library needs nothing from pd_common's sources)

struct TypeInfo {
  int64_t block_elems = 1;
  size_t block_bytes = 4;
  const char* name = "?";
};

bool type_info(GgmlType type, TypeInfo* out) {
  switch (type) {
    case GgmlType::kF32: *out = {1, 4, "F32"}; return true;
    case GgmlType::kF16: *out = {1, 2, "F16"}; return true;
    case GgmlType::kBF16: *out = {1, 2, "BF16"}; return true;
    case GgmlType::kQ4_0: *out = {32, sizeof(BlockQ4_0), "Q4_0"}; return true;
    case GgmlType::kQ4_1: *out = {32, sizeof(BlockQ4_1), "Q4_1"}; return true;
    case GgmlType::kQ8_0: *out = {32, sizeof(BlockQ8_0), "Q8_0"}; return true;
    case GgmlType::kQ5_0: *out = {32, sizeof(BlockQ5_0), "Q5_0"}; return true;
    case GgmlType::kQ5_1: *out = {32, sizeof(BlockQ5_1), "Q5_1"}; return true;
    case GgmlType::kQ4_K: *out = {kQK_K, sizeof(BlockQ4_K), "Q4_K"}; return true;
    case GgmlType::kQ5_K: *out = {kQK_K, sizeof(BlockQ5_K), "Q5_K"}; return true;
    case GgmlType::kQ6_K: *out = {kQK_K, sizeof(BlockQ6_K), "Q6_K"}; return true;
    case GgmlType::kQ8_K: *out = {kQK_K, sizeof(BlockQ8_K), "Q8_K"}; return true;
  }
  return false;
}

const char* type_name(GgmlType type) {
  TypeInfo ti;
  return type_info(type, &ti) ? ti.name : "unsupported type";
}

// Bytes of one row of t (ne[0] elements) and of the whole tensor; an error for
// an unsupported type or a row length that is not a whole number of blocks.
// `what` names the tensor in messages ("get_rows: table").
Status tensor_bytes(const Tensor& t, const std::string& what, size_t* row_bytes, size_t* total) {
  TypeInfo ti;
  if (!type_info(t.type, &ti))
    return Status::invalid_argument(what + " has an unsupported type id " +
                                    std::to_string(static_cast<uint32_t>(t.type)));
  for (int64_t n : t.ne) {
    if (n < 0) return Status::invalid_argument(what + " has a negative dimension");
  }
  if (t.ne[0] % ti.block_elems != 0)
    return Status::invalid_argument(what + ": a row of " + std::to_string(t.ne[0]) +
                                    " elements is not a multiple of the " + ti.name + " block size");
  const size_t rb = static_cast<size_t>(t.ne[0] / ti.block_elems) * ti.block_bytes;
  if (row_bytes) *row_bytes = rb;
  if (total) *total = rb * static_cast<size_t>(t.n_rows());
  return Status::ok();
}

Status expect_f32(const Tensor& t, const char* op, const char* arg) {
  if (t.type != GgmlType::kF32)
    return Status::invalid_argument(std::string(op) + ": " + arg + " must be F32, got " + type_name(t.type));
  return Status::ok();
}

const float* f32(const Tensor& t) { return static_cast<const float*>(t.data); }
float* f32(Tensor& t) { return static_cast<float*>(t.data); }

// ---- memory

class CudaBuffer final : public BackendBuffer {
 public:
  CudaBuffer(int device, void* data, size_t size) : device_(device), data_(data), size_(size) {}
  ~CudaBuffer() override {
    if (data_ == nullptr) return;
    // cudaFree waits for work that may still use the buffer; errors cannot be
    // reported from a destructor (a failed device has already reported them).
    int current = -1;
    const bool switch_device = cudaGetDevice(&current) == cudaSuccess && current != device_;
    if (switch_device) (void)cudaSetDevice(device_);
    (void)cudaFree(data_);
    if (switch_device) (void)cudaSetDevice(current);
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  int device_;
  void* data_;
  size_t size_;
};

// Device scratch that grows on demand. Growing waits for the stream, so work
// still reading the old allocation finishes first.
class DeviceScratch {
 public:
  ~DeviceScratch() {
    if (data_) (void)cudaFree(data_);
  }
  Status reserve(size_t bytes, cudaStream_t stream, const char* what) {
    if (bytes <= capacity_) return Status::ok();
    const size_t want = std::max(bytes, capacity_ + capacity_ / 2);
    PD_CUDA_TRY(cudaStreamSynchronize(stream));
    if (data_) PD_CUDA_TRY(cudaFree(data_));
    data_ = nullptr;
    capacity_ = 0;
    const cudaError_t err = cudaMalloc(&data_, want);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      data_ = nullptr;
      return Status::resource_exhausted(std::string("cuda: cannot allocate ") + std::to_string(want) +
                                        " bytes of " + what + " scratch: " + cudaGetErrorString(err));
    }
    capacity_ = want;
    return Status::ok();
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// Pinned host staging for the small per-call index arrays: a ring of slots,
// each reused only after the device has consumed its previous upload (an
// event recorded behind the copy), so a call never waits on the copies of the
// last kSlots - 1 calls and the caller's spans may be freed on return.
class PinnedRing {
 public:
  static constexpr int kSlots = 8;
  ~PinnedRing() {
    for (Slot& s : slots_) {
      if (s.event) (void)cudaEventSynchronize(s.event);
      if (s.event) (void)cudaEventDestroy(s.event);
      if (s.host) (void)cudaFreeHost(s.host);
    }
  }
  Status init() {
    for (Slot& s : slots_) PD_CUDA_TRY(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming));
    return Status::ok();
  }
  // Copies host[0..bytes) into a pinned slot and enqueues its copy to dev on stream.
  Status upload(const void* host, size_t bytes, void* dev, cudaStream_t stream) {
    Slot& s = slots_[next_];
    next_ = (next_ + 1) % kSlots;
    PD_CUDA_TRY(cudaEventSynchronize(s.event));
    if (s.capacity < bytes) {
      if (s.host) PD_CUDA_TRY(cudaFreeHost(s.host));
      s.host = nullptr;
      s.capacity = 0;
      const size_t want = std::max<size_t>(bytes, 4096);
      PD_CUDA_TRY(cudaMallocHost(&s.host, want));
      s.capacity = want;
    }
    std::memcpy(s.host, host, bytes);
    PD_CUDA_TRY(cudaMemcpyAsync(dev, s.host, bytes, cudaMemcpyHostToDevice, stream));
    PD_CUDA_TRY(cudaEventRecord(s.event, stream));
    return Status::ok();
  }

 private:
  struct Slot {
    void* host = nullptr;
    size_t capacity = 0;
    cudaEvent_t event = nullptr;
  };
  std::array<Slot, kSlots> slots_{};
  int next_ = 0;
};

// Host-side packing of one call's index arrays into one upload; pieces are
// 16-byte aligned so each can be read as int32 (or wider) on the device.
class ArgPack {
 public:
  void clear() { bytes_.clear(); }
  size_t put(const void* data, size_t n) {
    const size_t at = (bytes_.size() + 15) / 16 * 16;
    bytes_.resize(at + n);
    if (n) std::memcpy(bytes_.data() + at, data, n);
    return at;
  }
  // Appends right after the previous piece (continuing it, no alignment).
  void append(const void* data, size_t n) {
    const size_t at = bytes_.size();
    bytes_.resize(at + n);
    if (n) std::memcpy(bytes_.data() + at, data, n);
  }
  const uint8_t* data() const { return bytes_.data(); }
  size_t size() const { return bytes_.size(); }

 private:
  std::vector<uint8_t> bytes_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaBackendConfig& cfg) : cfg_(cfg) {}

  ~CudaBackend() override {
    if (cudaSetDevice(cfg_.device) != cudaSuccess) return;
    if (stream_) (void)cudaStreamSynchronize(stream_);
    if (cublas_) (void)cublasDestroy(cublas_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }

  Status init() {
    PD_CUDA_TRY(cudaSetDevice(cfg_.device));
    PD_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    PD_CUBLAS_TRY(cublasCreate(&cublas_));
    PD_CUBLAS_TRY(cublasSetStream(cublas_, stream_));
    // Plain fp32 GEMMs by default, so results track the CPU backend; TF32
    // tensor cores only when asked (CudaBackendConfig::tf32).
    PD_CUBLAS_TRY(cublasSetMathMode(cublas_, cfg_.tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    PD_RETURN_IF_ERROR(staging_.init());
    cudaDeviceProp prop{};
    PD_CUDA_TRY(cudaGetDeviceProperties(&prop, cfg_.device));
    device_id_ = "GPU-";
    static const char* const kHex = "0123456789abcdef";
    for (int i = 0; i < 16; ++i) {
      const auto b = static_cast<unsigned char>(prop.uuid.bytes[i]);
      device_id_ += kHex[b >> 4];
      device_id_ += kHex[b & 15];
      if (i == 3 || i == 5 || i == 7 || i == 9) device_id_ += '-';
    }
    return Status::ok();
  }

  std::string name() const override { return "cuda"; }

  // ---- memory

  Result<std::unique_ptr<BackendBuffer>> alloc(size_t bytes) override {
    PD_RETURN_IF_ERROR(activate());
    void* p = nullptr;
    if (bytes > 0) {
      const cudaError_t err = cudaMalloc(&p, bytes);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();  // an allocation failure is not sticky; clear it
        return Status::resource_exhausted("cuda: cannot allocate " + std::to_string(bytes) +
                                          " bytes on device " + std::to_string(cfg_.device) + ": " +
                                          cudaGetErrorString(err));
      }
    }
    return std::unique_ptr<BackendBuffer>(std::make_unique<CudaBuffer>(cfg_.device, p, bytes));
  }

  Result<Tensor> load_weight(const GgufTensorInfo& info, std::unique_ptr<BackendBuffer>* storage) override {
    if (info.ne.empty() || info.ne.size() > 4)
      return Status::invalid_argument("cuda: tensor '" + info.name + "' has unsupported rank");
    if (storage == nullptr)
      return Status::invalid_argument("cuda: load_weight of '" + info.name + "' needs storage for the device copy");
    Tensor t;
    t.type = info.type;
    for (size_t i = 0; i < info.ne.size(); ++i) t.ne[i] = info.ne[i];
    size_t bytes = 0;
    PD_RETURN_IF_ERROR(tensor_bytes(t, "cuda: tensor '" + info.name + "'", nullptr, &bytes));
    if (info.nbytes < bytes || (bytes > 0 && info.data == nullptr))
      return Status::invalid_argument("cuda: tensor '" + info.name + "' has " + std::to_string(info.nbytes) +
                                      " bytes of data, its shape needs " + std::to_string(bytes));
    PD_ASSIGN_OR_RETURN(std::unique_ptr<BackendBuffer> buf, alloc(bytes));
    if (bytes > 0) {
      PD_CUDA_TRY(cudaMemcpyAsync(buf->data(), info.data, bytes, cudaMemcpyHostToDevice, stream_));
      PD_CUDA_TRY(cudaStreamSynchronize(stream_));  // the mapping may go once we return
    }
    t.data = buf->data();
    *storage = std::move(buf);
    return t;
  }

  Status copy_to_host(const Tensor& src, void* dst, size_t bytes) override {
    size_t total = 0;
    PD_RETURN_IF_ERROR(tensor_bytes(src, "cuda: copy_to_host: src", nullptr, &total));
    if (bytes > total) return Status::invalid_argument("cuda: copy_to_host past end of tensor");
    if (bytes == 0) return Status::ok();
    PD_RETURN_IF_ERROR(activate());
    PD_CUDA_TRY(cudaMemcpyAsync(dst, src.data, bytes, cudaMemcpyDeviceToHost, stream_));
    PD_CUDA_TRY(cudaStreamSynchronize(stream_));
    return Status::ok();
  }

  Status copy_from_host(const void* src, Tensor& dst, size_t bytes) override {
    size_t total = 0;
    PD_RETURN_IF_ERROR(tensor_bytes(dst, "cuda: copy_from_host: dst", nullptr, &total));
    if (bytes > total) return Status::invalid_argument("cuda: copy_from_host past end of tensor");
    if (bytes == 0) return Status::ok();
    PD_RETURN_IF_ERROR(activate());
    // From pageable memory the runtime returns once src has been staged, so
    // the caller may reuse src on return; the copy is ordered on the stream.
    // From page-locked memory the copy is truly asynchronous: wait for it.
    cudaPointerAttributes attr{};
    PD_CUDA_TRY(cudaPointerGetAttributes(&attr, src));
    PD_CUDA_TRY(cudaMemcpyAsync(dst.data, src, bytes, cudaMemcpyHostToDevice, stream_));
    if (attr.type == cudaMemoryTypeHost) PD_CUDA_TRY(cudaStreamSynchronize(stream_));
    return Status::ok();
  }

  Status synchronize() override {
    PD_RETURN_IF_ERROR(activate());
    PD_CUDA_TRY(cudaStreamSynchronize(stream_));
    return Status::ok();
  }

  // ---- ops

  Status get_rows(const Tensor& table, std::span<const int32_t> ids, Tensor& out) override {
    PD_RETURN_IF_ERROR(expect_f32(out, "get_rows", "out"));
    const int64_t d = table.ne[0];
    if (out.ne[0] != d || out.n_rows() < static_cast<int64_t>(ids.size()))
      return Status::invalid_argument("get_rows: out shape mismatch");
    size_t row_bytes = 0;
    PD_RETURN_IF_ERROR(tensor_bytes(table, "get_rows: table", &row_bytes, nullptr));
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= table.n_rows())
        return Status::invalid_argument("get_rows: row id " + std::to_string(ids[i]) + " out of range [0, " +
                                        std::to_string(table.n_rows()) + ")");
    }
    if (ids.empty()) return Status::ok();
    PD_RETURN_IF_ERROR(activate());
    args_.clear();
    const size_t ids_at = args_.put(ids.data(), ids.size_bytes());
    PD_ASSIGN_OR_RETURN(const uint8_t* dev, upload_args());
    PD_CUDA_LAUNCH("get_rows kernel", cuda::get_rows(table.type, table.data, row_bytes, d,
                                                     reinterpret_cast<const int32_t*>(dev + ids_at),
                                                     static_cast<int64_t>(ids.size()), f32(out), stream_));
    return Status::ok();
  }

  Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    PD_RETURN_IF_ERROR(expect_f32(x, "rms_norm", "x"));
    PD_RETURN_IF_ERROR(expect_f32(w, "rms_norm", "w"));
    const int64_t d = x.ne[0], n = x.n_rows();
    if (w.ne[0] != d || out.ne[0] != d || out.n_rows() < n) return Status::invalid_argument("rms_norm: shape mismatch");
    PD_RETURN_IF_ERROR(expect_f32(out, "rms_norm", "out"));
    PD_RETURN_IF_ERROR(activate());
    PD_CUDA_LAUNCH("rms_norm kernel", cuda::rms_norm(f32(x), f32(w), d, n, eps, f32(out), stream_));
    return Status::ok();
  }

  Status matmul(const Tensor& x, const Tensor& w, Tensor& out) override {
    PD_RETURN_IF_ERROR(expect_f32(x, "matmul", "x"));
    PD_RETURN_IF_ERROR(expect_f32(out, "matmul", "out"));
    const int64_t k = w.ne[0], n = w.n_rows(), m = x.n_rows();
    if (x.ne[0] != k || out.ne[0] != n || out.n_rows() < m)
      return Status::invalid_argument("matmul: shape mismatch (x [" + std::to_string(x.ne[0]) + ", " +
                                      std::to_string(m) + "], w [" + std::to_string(k) + ", " +
                                      std::to_string(n) + "], out [" + std::to_string(out.ne[0]) + "])");
    TypeInfo ti;
    if (!type_info(w.type, &ti)) return Status::invalid_argument("matmul: w has an unsupported type");
    if (k % ti.block_elems != 0) return Status::invalid_argument("matmul: k not a multiple of the block size");
    if (m == 0 || n == 0) return Status::ok();
    const size_t w_row_bytes = static_cast<size_t>(k / ti.block_elems) * ti.block_bytes;
    PD_RETURN_IF_ERROR(activate());
    float* os = f32(out);
    if (k == 0) {  // empty dot products
      PD_CUDA_TRY(cudaMemsetAsync(os, 0, static_cast<size_t>(m * n) * sizeof(float), stream_));
      return Status::ok();
    }

    if (m < cfg_.gemm_min_rows) {
      // Fused dequantize-dot, kMaxFusedRows inputs per launch.
      for (int64_t i0 = 0; i0 < m; i0 += cuda::kMaxFusedRows) {
        const int mm = static_cast<int>(std::min<int64_t>(cuda::kMaxFusedRows, m - i0));
        PD_CUDA_LAUNCH("matmul (fused dequantize-dot) kernel",
                       cuda::matvec(w.type, w.data, w_row_bytes, k, n, f32(x) + i0 * k, mm, os + i0 * n, n, stream_));
      }
      return Status::ok();
    }

    if (k > INT_MAX || n > INT_MAX || m > INT_MAX)
      return Status::invalid_argument("matmul: dimensions beyond cuBLAS's int range");
    // Column-major view: out^T [n, m] = W^T [n, k] . X [k, m], where the weight
    // rows (k contiguous) are the columns of a k x n matrix.
    const float one = 1.0f, zero = 0.0f;
    const int ki = static_cast<int>(k), mi = static_cast<int>(m), ni = static_cast<int>(n);
    if (w.type == GgmlType::kF32) {
      PD_CUBLAS_TRY(cublasSgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, ni, mi, ki, &one, f32(w), ki, f32(x), ki, &zero,
                                os, ni));
      return Status::ok();
    }
    // Dequantize panels of weight rows into fp32 scratch, one sgemm per panel.
    const size_t row_f32_bytes = static_cast<size_t>(k) * sizeof(float);
    const int64_t panel_rows =
        std::clamp<int64_t>(static_cast<int64_t>(cfg_.max_panel_bytes / row_f32_bytes), 1, n);
    PD_RETURN_IF_ERROR(panel_.reserve(static_cast<size_t>(panel_rows) * row_f32_bytes, stream_, "matmul panel"));
    float* panel = static_cast<float*>(panel_.data());
    const uint8_t* wb = static_cast<const uint8_t*>(w.data);
    for (int64_t j0 = 0; j0 < n; j0 += panel_rows) {
      const int64_t rows = std::min(panel_rows, n - j0);
      PD_CUDA_LAUNCH("matmul (dequantize panel) kernel",
                     cuda::dequant_rows(w.type, wb + static_cast<size_t>(j0) * w_row_bytes, w_row_bytes, k, rows,
                                        panel, stream_));
      PD_CUBLAS_TRY(cublasSgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), mi, ki, &one, panel, ki,
                                f32(x), ki, &zero, os + j0, ni));
    }
    return Status::ok();
  }

  using Backend::rope;
  Status rope(Tensor& x, std::span<const int32_t> positions, const RopeSpec& spec) override {
    PD_RETURN_IF_ERROR(expect_f32(x, "rope", "x"));
    const int64_t hd = x.ne[0], nh = x.ne[1], nt = x.ne[2];
    if (hd % 2 != 0 || static_cast<int64_t>(positions.size()) < nt)
      return Status::invalid_argument("rope: odd head_dim or too few positions");
    if (!spec.freq_factors.empty() && static_cast<int64_t>(spec.freq_factors.size()) != hd / 2)
      return Status::invalid_argument("rope: " + std::to_string(spec.freq_factors.size()) +
                                      " frequency factors for head_dim " + std::to_string(hd) + " (need head_dim / 2)");
    if (nt <= 0 || nh <= 0 || hd <= 0) return Status::ok();
    PD_RETURN_IF_ERROR(activate());
    args_.clear();
    const size_t pos_at = args_.put(positions.data(), static_cast<size_t>(nt) * sizeof(int32_t));
    const size_t factors_at = args_.put(spec.freq_factors.data(), spec.freq_factors.size_bytes());
    PD_ASSIGN_OR_RETURN(const uint8_t* dev, upload_args());
    const float* factors = spec.freq_factors.empty() ? nullptr : reinterpret_cast<const float*>(dev + factors_at);
    PD_CUDA_LAUNCH("rope kernel", cuda::rope(f32(x), hd, nh, nt, reinterpret_cast<const int32_t*>(dev + pos_at),
                                             spec.freq_base, spec.neox, spec.freq_scale, factors, stream_));
    return Status::ok();
  }

  Status swiglu(const Tensor& gate, const Tensor& up, Tensor& out) override {
    const int64_t n = gate.n_elements();
    if (up.n_elements() != n || out.n_elements() < n) return Status::invalid_argument("swiglu: shape mismatch");
    PD_RETURN_IF_ERROR(expect_f32(gate, "swiglu", "gate"));
    PD_RETURN_IF_ERROR(expect_f32(up, "swiglu", "up"));
    PD_RETURN_IF_ERROR(expect_f32(out, "swiglu", "out"));
    PD_RETURN_IF_ERROR(activate());
    PD_CUDA_LAUNCH("swiglu kernel", cuda::swiglu(f32(gate), f32(up), n, f32(out), stream_));
    return Status::ok();
  }

  Status geglu(const Tensor& gate, const Tensor& up, Tensor& out) override {
    const int64_t n = gate.n_elements();
    if (up.n_elements() != n || out.n_elements() < n) return Status::invalid_argument("geglu: shape mismatch");
    PD_RETURN_IF_ERROR(expect_f32(gate, "geglu", "gate"));
    PD_RETURN_IF_ERROR(expect_f32(up, "geglu", "up"));
    PD_RETURN_IF_ERROR(expect_f32(out, "geglu", "out"));
    PD_RETURN_IF_ERROR(activate());
    PD_CUDA_LAUNCH("geglu kernel", cuda::geglu(f32(gate), f32(up), n, f32(out), stream_));
    return Status::ok();
  }

  Status add(const Tensor& a, const Tensor& b, Tensor& out) override {
    const int64_t n = a.n_elements();
    const bool row = b.n_elements() != n;  // one row added to every row (a bias)
    if ((row && b.n_elements() != a.ne[0]) || out.n_elements() < n)
      return Status::invalid_argument("add: shape mismatch");
    PD_RETURN_IF_ERROR(expect_f32(a, "add", "a"));
    PD_RETURN_IF_ERROR(expect_f32(b, "add", "b"));
    PD_RETURN_IF_ERROR(expect_f32(out, "add", "out"));
    PD_RETURN_IF_ERROR(activate());
    if (row) {
      PD_CUDA_LAUNCH("add kernel", cuda::add_row(f32(a), f32(b), a.ne[0], a.n_rows(), f32(out), stream_));
    } else {
      PD_CUDA_LAUNCH("add kernel", cuda::add(f32(a), f32(b), n, f32(out), stream_));
    }
    return Status::ok();
  }

  Status scale(const Tensor& x, float s, Tensor& out) override {
    const int64_t n = x.n_elements();
    if (out.n_elements() < n) return Status::invalid_argument("scale: shape mismatch");
    PD_RETURN_IF_ERROR(expect_f32(x, "scale", "x"));
    PD_RETURN_IF_ERROR(expect_f32(out, "scale", "out"));
    PD_RETURN_IF_ERROR(activate());
    PD_CUDA_LAUNCH("scale kernel", cuda::scale(f32(x), s, n, f32(out), stream_));
    return Status::ok();
  }

  // ---- paged KV cache

  Status kv_write(BackendBuffer& cache, const KvCacheLayout& L, int layer, const Tensor& k, const Tensor& v,
                  std::span<const int32_t> slots) override {
    PD_RETURN_IF_ERROR(check_kv_dtype(L));
    const int64_t hd = L.head_dim, nkv = L.n_kv_heads;
    if (k.ne[0] != hd || k.ne[1] != nkv || v.ne[0] != hd || v.ne[1] != nkv)
      return Status::invalid_argument("kv_write: k/v shape does not match the cache layout");
    PD_RETURN_IF_ERROR(check_cache(cache, L, layer, "kv_write"));
    PD_RETURN_IF_ERROR(expect_f32(k, "kv_write", "k"));
    PD_RETURN_IF_ERROR(expect_f32(v, "kv_write", "v"));
    const int64_t n = static_cast<int64_t>(slots.size());
    if (k.ne[2] * k.ne[3] < n || v.ne[2] * v.ne[3] < n)
      return Status::invalid_argument("kv_write: " + std::to_string(n) + " slots but k/v hold fewer tokens");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t block = slots[i] / L.block_size;
      if (slots[i] < 0 || block >= L.num_blocks) return Status::invalid_argument("kv_write: slot out of range");
    }
    if (n == 0) return Status::ok();
    PD_RETURN_IF_ERROR(activate());
    args_.clear();
    const size_t slots_at = args_.put(slots.data(), slots.size_bytes());
    PD_ASSIGN_OR_RETURN(const uint8_t* dev, upload_args());
    PD_CUDA_LAUNCH("kv_write kernel", cuda::kv_write(layer_view(cache, L, layer), f32(k), f32(v),
                                                     reinterpret_cast<const int32_t*>(dev + slots_at), n, stream_));
    return Status::ok();
  }

  using Backend::paged_attention;
  Status paged_attention(const Tensor& q, const BackendBuffer& cache, const KvCacheLayout& L, int layer,
                         std::span<const AttentionToken> tokens,
                         std::span<const std::span<const int32_t>> block_tables, float scale, int window,
                         Tensor& out) override {
    PD_RETURN_IF_ERROR(check_kv_dtype(L));
    if (window < 0) return Status::invalid_argument("paged_attention: negative window");
    const int64_t hd = q.ne[0], nh = q.ne[1], nt = static_cast<int64_t>(tokens.size());
    const int64_t nkv = L.n_kv_heads, bs = L.block_size;
    if (hd != L.head_dim || nkv <= 0 || nh % nkv != 0 || q.ne[2] < nt || hd > cuda::kMaxAttnHeadDim)
      return Status::invalid_argument("paged_attention: q shape does not match the cache layout");
    // Per sequence, the furthest position any token attends to (-1: unused).
    std::vector<int64_t>& last_pos = attn_last_pos_;
    last_pos.assign(block_tables.size(), -1);
    for (const AttentionToken& t : tokens) {
      if (t.seq < 0 || t.seq >= static_cast<int32_t>(block_tables.size()) || t.position < 0 ||
          static_cast<int64_t>(block_tables[t.seq].size()) * bs <= t.position)
        return Status::invalid_argument("paged_attention: token position not covered by its block table");
      last_pos[t.seq] = std::max<int64_t>(last_pos[t.seq], t.position);
    }
    PD_RETURN_IF_ERROR(check_cache(cache, L, layer, "paged_attention"));
    PD_RETURN_IF_ERROR(expect_f32(q, "paged_attention", "q"));
    PD_RETURN_IF_ERROR(expect_f32(out, "paged_attention", "out"));
    if (out.n_elements() < hd * nh * nt)
      return Status::invalid_argument("paged_attention: out holds fewer than head_dim * n_heads * n_tokens floats");
    if (nh > INT_MAX) return Status::invalid_argument("paged_attention: too many heads");
    // The blocks a kernel will read must exist: the device cannot report a bad id.
    for (size_t s = 0; s < block_tables.size(); ++s) {
      const int64_t used = last_pos[s] < 0 ? 0 : last_pos[s] / bs + 1;
      for (int64_t i = 0; i < used; ++i) {
        const int32_t b = block_tables[s][i];
        if (b < 0 || b >= L.num_blocks)
          return Status::invalid_argument("paged_attention: sequence " + std::to_string(s) + " lists block " +
                                          std::to_string(b) + " outside [0, " + std::to_string(L.num_blocks) +
                                          ")");
      }
    }
    if (nt == 0 || nh == 0) return Status::ok();
    PD_RETURN_IF_ERROR(activate());

    // One upload: tokens {position, seq}, table offsets, then the tables back to back.
    static_assert(sizeof(AttentionToken) == 2 * sizeof(int32_t), "AttentionToken is read as int32 pairs");
    std::vector<int32_t>& offsets = attn_offsets_;
    offsets.assign(block_tables.size() + 1, 0);
    int64_t total = 0;
    for (size_t s = 0; s < block_tables.size(); ++s) {
      offsets[s] = static_cast<int32_t>(total);
      total += static_cast<int64_t>(block_tables[s].size());
      if (total > INT32_MAX) return Status::invalid_argument("paged_attention: block tables too long");
    }
    offsets[block_tables.size()] = static_cast<int32_t>(total);
    args_.clear();
    const size_t tokens_at = args_.put(tokens.data(), tokens.size_bytes());
    const size_t offsets_at = args_.put(offsets.data(), offsets.size() * sizeof(int32_t));
    const size_t tables_at = args_.put(nullptr, 0);
    for (const std::span<const int32_t>& table : block_tables) args_.append(table.data(), table.size_bytes());
    PD_ASSIGN_OR_RETURN(const uint8_t* dev, upload_args());
    PD_CUDA_LAUNCH("paged_attention kernel",
                   cuda::paged_attention(layer_view(const_cast<BackendBuffer&>(cache), L, layer), f32(q),
                                         static_cast<int>(nh), reinterpret_cast<const int32_t*>(dev + tokens_at), nt,
                                         reinterpret_cast<const int32_t*>(dev + offsets_at),
                                         reinterpret_cast<const int32_t*>(dev + tables_at), scale, window,
                                         f32(out), stream_));
    return Status::ok();
  }

  Status kv_copy_block(BackendBuffer& cache, const KvCacheLayout& L, int64_t src, int64_t dst) override {
    if (src < 0 || dst < 0 || src >= L.num_blocks || dst >= L.num_blocks)
      return Status::invalid_argument("kv_copy_block: block out of range");
    if (cache.size() < L.total_bytes())
      return Status::invalid_argument("kv_copy_block: cache buffer of " + std::to_string(cache.size()) +
                                      " bytes is smaller than its layout (" + std::to_string(L.total_bytes()) + ")");
    if (src == dst || L.block_bytes() == 0) return Status::ok();
    PD_RETURN_IF_ERROR(activate());
    uint8_t* base = static_cast<uint8_t*>(cache.data());
    for (int layer = 0; layer < L.n_layers; ++layer) {
      for (int kind = 0; kind < 2; ++kind) {
        PD_CUDA_TRY(cudaMemcpyAsync(base + L.offset(layer, kind, dst), base + L.offset(layer, kind, src),
                                    L.block_bytes(), cudaMemcpyDeviceToDevice, stream_));
      }
    }
    return Status::ok();
  }

  // ---- KV bytes to and from host memory

  Status kv_gather(const BackendBuffer& cache, std::span<const int64_t> offsets, size_t piece_bytes,
                   void* host) override {
    PD_RETURN_IF_ERROR(check_kv_pieces(cache.size(), offsets, piece_bytes, "kv_gather"));
    const size_t total = offsets.size() * piece_bytes;
    if (total == 0) return synchronize();
    PD_RETURN_IF_ERROR(activate());
    const void* base = const_cast<BackendBuffer&>(cache).data();
    args_.clear();
    const size_t off_at = args_.put(offsets.data(), offsets.size_bytes());
    PD_ASSIGN_OR_RETURN(const uint8_t* dev, upload_args());
    PD_RETURN_IF_ERROR(pieces_.reserve(total, stream_, "KV gather"));
    const auto n = static_cast<int64_t>(offsets.size());
    PD_CUDA_LAUNCH("kv_gather kernel",
                   cuda::copy_pieces(base, reinterpret_cast<const int64_t*>(dev + off_at), pieces_.data(), nullptr, n,
                                     piece_bytes, cuda::pieces_aligned16(base, offsets.data(), n, piece_bytes) &&
                                                      cuda::pieces_aligned16(pieces_.data(), nullptr, n, piece_bytes),
                                     stream_));
    PD_CUDA_TRY(cudaMemcpyAsync(host, pieces_.data(), total, cudaMemcpyDeviceToHost, stream_));
    PD_CUDA_TRY(cudaStreamSynchronize(stream_));
    return Status::ok();
  }

  Status kv_scatter(BackendBuffer& cache, std::span<const int64_t> offsets, size_t piece_bytes,
                    const void* host) override {
    PD_RETURN_IF_ERROR(check_kv_pieces(cache.size(), offsets, piece_bytes, "kv_scatter"));
    const size_t total = offsets.size() * piece_bytes;
    if (total == 0) return synchronize();
    PD_RETURN_IF_ERROR(activate());
    void* base = cache.data();
    args_.clear();
    const size_t off_at = args_.put(offsets.data(), offsets.size_bytes());
    PD_ASSIGN_OR_RETURN(const uint8_t* dev, upload_args());
    PD_RETURN_IF_ERROR(pieces_.reserve(total, stream_, "KV scatter"));
    PD_CUDA_TRY(cudaMemcpyAsync(pieces_.data(), host, total, cudaMemcpyHostToDevice, stream_));
    const auto n = static_cast<int64_t>(offsets.size());
    PD_CUDA_LAUNCH("kv_scatter kernel",
                   cuda::copy_pieces(pieces_.data(), nullptr, base, reinterpret_cast<const int64_t*>(dev + off_at), n,
                                     piece_bytes, cuda::pieces_aligned16(base, offsets.data(), n, piece_bytes) &&
                                                      cuda::pieces_aligned16(pieces_.data(), nullptr, n, piece_bytes),
                                     stream_));
    PD_CUDA_TRY(cudaStreamSynchronize(stream_));  // `host` may be reused on return
    return Status::ok();
  }

  // ---- where memory lives

  bool device_memory() const override { return true; }
  Status device_health() override {
    if (cudaSetDevice(cfg_.device) != cudaSuccess) return cuda_status("cudaSetDevice", cudaGetLastError());
    const cudaError_t e = cudaStreamQuery(stream_);  // an asynchronous fault is sticky: it shows here
    if (e == cudaSuccess || e == cudaErrorNotReady) return Status::ok();
    return cuda_status("device health (cudaStreamQuery)", e);
  }
  std::string device_id() const override { return device_id_; }
  void* native_stream() override { return stream_; }

 private:
  Status activate() {
    PD_CUDA_TRY(cudaSetDevice(cfg_.device));
    return Status::ok();
  }

  // Uploads args_ into device scratch (ordered on the stream before the next kernel).
  Result<const uint8_t*> upload_args() {
    PD_RETURN_IF_ERROR(args_dev_.reserve(args_.size(), stream_, "argument"));
    PD_RETURN_IF_ERROR(staging_.upload(args_.data(), args_.size(), args_dev_.data(), stream_));
    return static_cast<const uint8_t*>(args_dev_.data());
  }

  static Status check_cache(const BackendBuffer& cache, const KvCacheLayout& L, int layer, const char* op) {
    if (layer < 0 || layer >= L.n_layers)
      return Status::invalid_argument(std::string(op) + ": layer " + std::to_string(layer) + " outside [0, " +
                                      std::to_string(L.n_layers) + ")");
    if (L.block_size <= 0) return Status::invalid_argument(std::string(op) + ": block_size must be positive");
    if (cache.size() < L.total_bytes())
      return Status::invalid_argument(std::string(op) + ": cache buffer of " + std::to_string(cache.size()) +
                                      " bytes is smaller than its layout (" + std::to_string(L.total_bytes()) + ")");
    return Status::ok();
  }

  static Status check_kv_dtype(const KvCacheLayout& L) {
    if (L.dtype != GgmlType::kF32 && L.dtype != GgmlType::kF16 && L.dtype != GgmlType::kQ8_0)
      return Status::unsupported(std::string("cuda: KV cache type ") + ggml_type_name(L.dtype) + " (f32, f16 or q8_0)");
    if (L.dtype == GgmlType::kQ8_0 && L.head_dim % 32 != 0)
      return Status::invalid_argument("cuda: a q8_0 KV cache needs head_dim a multiple of 32");
    return Status::ok();
  }

  static cuda::KvLayerView layer_view(BackendBuffer& cache, const KvCacheLayout& L, int layer) {
    cuda::KvLayerView kv;
    kv.dtype = L.dtype;
    kv.row_bytes = L.row_bytes();
    kv.base = static_cast<uint8_t*>(cache.data());
    kv.k_offset = L.offset(layer, 0, 0);
    kv.v_offset = L.offset(layer, 1, 0);
    kv.block_bytes = L.block_bytes();
    kv.block_size = L.block_size;
    kv.n_kv_heads = L.n_kv_heads;
    kv.head_dim = L.head_dim;
    return kv;
  }

  // Constant after init().
  CudaBackendConfig cfg_;
  std::string device_id_;  // "GPU-" + the device's UUID
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  // Scratch, used by the driving thread only. Declared after stream_ so they
  // are destroyed first (the backend's destructor has synchronized the stream).
  PinnedRing staging_;
  DeviceScratch args_dev_;
  DeviceScratch panel_;
  DeviceScratch pieces_;  // kv_gather / kv_scatter: the region, contiguous
  ArgPack args_;
  std::vector<int64_t> attn_last_pos_;
  std::vector<int32_t> attn_offsets_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendConfig& cfg) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return Status::unsupported(std::string("cuda: no CUDA device available (cudaGetDeviceCount: ") +
                               (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") + ")");
  }
  if (cfg.device < 0 || cfg.device >= count)
    return Status::unsupported("cuda: device ordinal " + std::to_string(cfg.device) + " out of range (" +
                               std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s") + " present)");
  if (cfg.gemm_min_rows < 1) return Status::invalid_argument("cuda: gemm_min_rows must be at least 1");
  PD_CUDA_TRY(cudaSetDevice(cfg.device));
  // This binary carries kernels for sm_80 / sm_90 (and PTX); refuse older devices up front.
  cudaDeviceProp prop{};
  PD_CUDA_TRY(cudaGetDeviceProperties(&prop, cfg.device));
  if (prop.major < 8)
    return Status::unsupported("cuda: device " + std::to_string(cfg.device) + " (" + prop.name +
                               ") has compute capability " + std::to_string(prop.major) + "." +
                               std::to_string(prop.minor) + "; this build needs 8.0 or newer");
  auto backend = std::make_unique<CudaBackend>(cfg);
  PD_RETURN_IF_ERROR(backend->init());
  return std::unique_ptr<Backend>(std::move(backend));
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

Result<std::unique_ptr<Backend>> make_cuda_backend(int device) {
  CudaBackendConfig cfg;
  cfg.device = device;
  return make_cuda_backend(cfg);
}

}  // namespace pd
