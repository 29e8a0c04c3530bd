// Packing, the portable (scalar) kernels and the instruction-set dispatch.
// The scalar kernels perform exactly the operations the AVX2 ones do (integer
// block sums, then fmaf in block order), so the two agree bit for bit.
#include "backend/cpu/q8_kernels.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace pd::cpu {
namespace {


void quantize_rows_scalar(const float* x, int64_t k, int64_t x_stride, int m, BlockQ8A* out) {
  const int64_t nb = k / kQBlock;
  for (int i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * x_stride + b * kQBlock;
      BlockQ8A& o = out[i * nb + b];
      float amax = 0.0f;
      for (int j = 0; j < kQBlock; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int j = 0; j < kQBlock; ++j) {
        const float scaled = xb[j] * id;
        const int32_t q = static_cast<int32_t>(std::nearbyint(scaled));
        o.qs[j] = static_cast<int8_t>(q);
        sum += q;
      }
      o.d = d;
      o.s = d * static_cast<float>(sum);
    }
  }
}

void gemm_q4x8_scalar(const PackedQ4x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  for (int t = 0; t < m; ++t) {
    const BlockQ8A* xt = x + t * nb;
    for (int r = 0; r < kPackRows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const PackedQ4x8& B = w[b];
        int32_t isum = 0;
        for (int c = 0; c < 4; ++c) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = B.qs[32 * c + 4 * r + i];
            isum += (byte & 0x0F) * xt[b].qs[4 * c + i] + (byte >> 4) * xt[b].qs[16 + 4 * c + i];
          }
        }
        const float scale = fp16_to_fp32(B.d[r]) * xt[b].d;
        acc = std::fmaf(static_cast<float>(isum), scale, acc);
        acc = std::fmaf(fp16_to_fp32(B.m[r]), xt[b].s, acc);
      }
      out[t * out_stride + r] = acc;
    }
  }
}

void gemm_q8x8_scalar(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  for (int t = 0; t < m; ++t) {
    const BlockQ8A* xt = x + t * nb;
    for (int r = 0; r < kPackRows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const PackedQ8x8& B = w[b];
        int32_t isum = 0;
        for (int g = 0; g < 8; ++g)
          for (int i = 0; i < 4; ++i) isum += B.qs[32 * g + 4 * r + i] * xt[b].qs[4 * g + i];
        const float scale = fp16_to_fp32(B.d[r]) * xt[b].d;
        acc = std::fmaf(static_cast<float>(isum), scale, acc);
      }
      out[t * out_stride + r] = acc;
    }
  }
}

void qk_scores_scalar(const float* q, int64_t q_stride, int nr, const float* k, int64_t hd, int n, float scale,
                      float* s, int64_t s_stride) {
  for (int i = 0; i < nr; ++i) {
    const float* qi = q + i * q_stride;
    for (int r = 0; r < n; ++r) {
      float lane[8] = {};
      for (int64_t j = 0; j < hd; ++j) lane[j % 8] = std::fma(qi[j], k[r * hd + j], lane[j % 8]);
      s[i * s_stride + r] = (((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))) * scale;
    }
  }
}

void softmax_step_scalar(float* s, int64_t s_stride, int nr, const int* n, float* m, float* l, float* c) {
  for (int i = 0; i < nr; ++i) {
    float* si = s + i * s_stride;
    if (n[i] == 0) {
      c[i] = 1.0f;
      continue;
    }
    float m_new = m[i];
    for (int r = 0; r < n[i]; ++r) m_new = si[r] > m_new ? si[r] : m_new;
    float sum = 0.0f;
    for (int r = 0; r < n[i]; ++r) {
      si[r] = exp_approx(si[r] - m_new);
      sum += si[r];
    }
    c[i] = exp_approx(m[i] - m_new);  // 0 (1e-38 * 0) on a row's first step
    l[i] = l[i] * c[i] + sum;
    m[i] = m_new;
  }
}

void pv_accumulate_scalar(const float* p, int64_t p_stride, int nr, const int* n, const float* c, const float* v,
                          int64_t hd, float* acc, int64_t acc_stride) {
  for (int i = 0; i < nr; ++i) {
    for (int64_t j = 0; j < hd; ++j) {
      float a = acc[i * acc_stride + j] * c[i];
      for (int r = 0; r < n[i]; ++r) a = std::fma(p[i * p_stride + r], v[r * hd + j], a);
      acc[i * acc_stride + j] = a;
    }
  }
}

void silu_mul_scalar(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
}

const Kernels kScalarKernels{quantize_rows_scalar, gemm_q4x8_scalar,  gemm_q8x8_scalar,    qk_scores_scalar,
                             softmax_step_scalar,  pv_accumulate_scalar, silu_mul_scalar};

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512vnni() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

}  // namespace

void quantization_residual(const float* x, const BlockQ8A* q, int64_t k, float* res) {
  for (int64_t j = 0; j < k; ++j) {
    const BlockQ8A& b = q[j / kQBlock];
    res[j] = std::fma(-b.d, static_cast<float>(b.qs[j % kQBlock]), x[j]);
  }
}

PackedFormat packed_format_for(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0: return PackedFormat::kQ4_0x8;
    case GgmlType::kQ4_1: return PackedFormat::kQ4_1x8;
    case GgmlType::kQ8_0: return PackedFormat::kQ8_0x8;
    default: return PackedFormat::kNone;
  }
}

size_t packed_group_bytes(PackedFormat f, int64_t k) {
  const size_t nb = static_cast<size_t>(k / kQBlock);
  switch (f) {
    case PackedFormat::kQ4_0x8:
    case PackedFormat::kQ4_1x8: return nb * sizeof(PackedQ4x8);
    case PackedFormat::kQ8_0x8: return nb * sizeof(PackedQ8x8);
    case PackedFormat::kNone: break;
  }
  return 0;
}

size_t packed_bytes(PackedFormat f, int64_t n_rows, int64_t k) {
  const int64_t groups = (n_rows + kPackRows - 1) / kPackRows;
  return static_cast<size_t>(groups) * packed_group_bytes(f, k);
}

bool pack_rows(GgmlType type, const void* src, int64_t n_rows, int64_t k, void* dst) {
  const PackedFormat f = packed_format_for(type);
  if (f == PackedFormat::kNone || k % kQBlock != 0) return false;
  const int64_t nb = k / kQBlock, groups = (n_rows + kPackRows - 1) / kPackRows;
  const size_t src_row = ggml_row_bytes(type, k);
  const uint8_t* s = static_cast<const uint8_t*>(src);
  std::memset(dst, 0, packed_bytes(f, n_rows, k));  // padding rows: d = m = q = 0
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < kPackRows && g * kPackRows + r < n_rows; ++r) {
      const uint8_t* row = s + static_cast<size_t>(g * kPackRows + r) * src_row;
      for (int64_t b = 0; b < nb; ++b) {
        if (f == PackedFormat::kQ8_0x8) {
          PackedQ8x8& P = static_cast<PackedQ8x8*>(dst)[g * nb + b];
          const BlockQ8_0& q = reinterpret_cast<const BlockQ8_0*>(row)[b];
          P.d[r] = q.d;
          for (int gg = 0; gg < 8; ++gg) std::memcpy(&P.qs[32 * gg + 4 * r], &q.qs[4 * gg], 4);
          continue;
        }
        PackedQ4x8& P = static_cast<PackedQ4x8*>(dst)[g * nb + b];
        const uint8_t* qs;
        if (type == GgmlType::kQ4_1) {
          const BlockQ4_1& q = reinterpret_cast<const BlockQ4_1*>(row)[b];
          P.d[r] = q.d;
          P.m[r] = q.m;
          qs = q.qs;
        } else {  // Q4_0: d*(q-8) = d*q + (-8d); -8d is exact in fp16 unless it overflows
          const BlockQ4_0& q = reinterpret_cast<const BlockQ4_0*>(row)[b];
          const float m = -8.0f * fp16_to_fp32(q.d);
          P.d[r] = q.d;
          P.m[r] = fp32_to_fp16(m);
          if (fp16_to_fp32(P.m[r]) != m) return false;
          qs = q.qs;
        }
        for (int c = 0; c < 4; ++c) std::memcpy(&P.qs[32 * c + 4 * r], &qs[4 * c], 4);
      }
    }
  }
  return true;
}

void unpack_row(PackedFormat f, const void* packed, int64_t k, int64_t row, float* dst) {
  const int64_t nb = k / kQBlock, g = row / kPackRows;
  const int r = static_cast<int>(row % kPackRows);
  for (int64_t b = 0; b < nb; ++b) {
    float* o = dst + b * kQBlock;
    if (f == PackedFormat::kQ8_0x8) {
      const PackedQ8x8& P = static_cast<const PackedQ8x8*>(packed)[g * nb + b];
      const float d = fp16_to_fp32(P.d[r]);
      for (int gg = 0; gg < 8; ++gg)
        for (int i = 0; i < 4; ++i) o[4 * gg + i] = d * static_cast<float>(P.qs[32 * gg + 4 * r + i]);
    } else {
      const PackedQ4x8& P = static_cast<const PackedQ4x8*>(packed)[g * nb + b];
      const float d = fp16_to_fp32(P.d[r]), m = fp16_to_fp32(P.m[r]);
      // Q4_0's values are d*(q-8), Q4_1's d*q + m: the same rounding as ggml.
      const bool q4_0 = f == PackedFormat::kQ4_0x8;
      auto value = [&](int q) {
        return q4_0 ? d * static_cast<float>(q - 8) : d * static_cast<float>(q) + m;
      };
      for (int c = 0; c < 4; ++c) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = P.qs[32 * c + 4 * r + i];
          o[4 * c + i] = value(byte & 0x0F);
          o[16 + 4 * c + i] = value(byte >> 4);
        }
      }
    }
  }
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512Vnni: return "avx512vnni";
    case Isa::kScalar: break;
  }
  return "scalar";
}

// The CPU is asked first: an ISA's translation unit is not entered at all
// on a CPU without it.
bool isa_supported(Isa isa) {
  static const bool avx2 = cpu_has_avx2() && avx2_kernels() != nullptr;
  static const bool vnni = avx2 && cpu_has_avx512vnni() && avx512vnni_gemm() != nullptr;
  switch (isa) {
    case Isa::kAvx2: return avx2;
    case Isa::kAvx512Vnni: return vnni;
    case Isa::kScalar: break;
  }
  return true;
}

Isa best_isa() {
  static const Isa chosen = [] {
    if (const char* env = std::getenv("PD_CPU_ISA")) {
      for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512Vnni})
        if (std::strcmp(env, isa_name(isa)) == 0 && isa_supported(isa)) return isa;
    }
    if (isa_supported(Isa::kAvx512Vnni)) return Isa::kAvx512Vnni;
    return isa_supported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar;
  }();
  return chosen;
}

const Kernels& kernels(Isa isa) {
  if (isa == Isa::kAvx512Vnni && isa_supported(isa)) {
    static const Kernels vnni = [] {
      Kernels k = *avx2_kernels();
      k.gemm_q4x8 = avx512vnni_gemm()->gemm_q4x8;
      k.gemm_q8x8 = avx512vnni_gemm()->gemm_q8x8;
      if (const AttentionKernels* a = avx512_attention()) {
        k.qk_scores = a->qk_scores;
        k.softmax_step = a->softmax_step;
        k.pv_accumulate = a->pv_accumulate;
      }
      return k;
    }();
    return vnni;
  }
  if (isa == Isa::kAvx2 && isa_supported(isa)) return *avx2_kernels();
  return kScalarKernels;
}

}  // namespace pd::cpu
