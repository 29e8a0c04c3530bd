// Packing, the portable (scalar) kernels and the instruction-set dispatch.
// The scalar kernels perform exactly the operations the AVX2 ones do (integer
// block sums, then fmaf in block order), so the two agree bit for bit.
#include "backend/cpu/q8_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

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

void gemm_q4x8f_scalar(const PackedQ4x8F* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  for (int t = 0; t < m; ++t) {
    const BlockQ8A* xt = x + t * nb;
    for (int r = 0; r < kPackRows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const PackedQ4x8F& B = w[b];
        int32_t isum = 0;
        for (int c = 0; c < 4; ++c) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = B.qs[32 * c + 4 * r + i];
            isum += (byte & 0x0F) * xt[b].qs[4 * c + i] + (byte >> 4) * xt[b].qs[16 + 4 * c + i];
          }
        }
        acc = std::fmaf(static_cast<float>(isum), B.d[r] * xt[b].d, acc);
        acc = std::fmaf(B.m[r], xt[b].s, acc);
      }
      out[t * out_stride + r] = acc;
    }
  }
}

void gemm_q8x8h_scalar(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride) {
  for (int t = 0; t < m; ++t) {
    const BlockQ8A* xt = x + t * nb;
    for (int r = 0; r < kPackRows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const PackedQ8x8H& B = w[b];
        int32_t isum[2] = {0, 0};
        for (int g = 0; g < 8; ++g)
          for (int i = 0; i < 4; ++i) isum[g / 4] += B.qs[32 * g + 4 * r + i] * xt[b].qs[4 * g + i];
        acc = std::fmaf(static_cast<float>(isum[0]), B.d[r] * xt[b].d, acc);
        acc = std::fmaf(static_cast<float>(isum[1]), B.d[8 + r] * xt[b].d, acc);
        acc = std::fmaf(B.m[r], xt[b].s, acc);
      }
      out[t * out_stride + r] = acc;
    }
  }
}

// Row r of `rows` as fp32: the row itself, or widened into buf (hd floats).
const float* kv_row_f32(KvRows rows, int r, int64_t hd, float* buf) {
  if (rows.type == GgmlType::kF32) return static_cast<const float*>(rows.rows[r]);
  dequantize_row(rows.type, rows.rows[r], buf, hd);
  return buf;
}

void qk_scores_scalar(const float* q, int64_t q_stride, int nr, KvRows k, int64_t hd, int n, float scale, float* s,
                      int64_t s_stride) {
  std::vector<float> buf(k.type == GgmlType::kF32 ? 0 : static_cast<size_t>(hd));
  for (int r = 0; r < n; ++r) {
    const float* kr = kv_row_f32(k, r, hd, buf.data());
    for (int i = 0; i < nr; ++i) {
      const float* qi = q + i * q_stride;
      float lane[8] = {};
      for (int64_t j = 0; j < hd; ++j) lane[j % 8] = std::fma(qi[j], kr[j], lane[j % 8]);
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

void pv_accumulate_scalar(const float* p, int64_t p_stride, int nr, const int* n, const float* c, KvRows v,
                          int64_t hd, float* acc, int64_t acc_stride) {
  int most = 0;
  for (int i = 0; i < nr; ++i) most = std::max(most, n[i]);
  const bool f32 = v.type == GgmlType::kF32;
  std::vector<float> widened(f32 ? 0 : static_cast<size_t>(most * hd));  // the rows as fp32, where they are not
  for (int r = 0; !f32 && r < most; ++r) dequantize_row(v.type, v.rows[r], widened.data() + r * hd, hd);
  const auto row = [&](int r) { return f32 ? static_cast<const float*>(v.rows[r]) : widened.data() + r * hd; };
  for (int i = 0; i < nr; ++i) {
    for (int64_t j = 0; j < hd; ++j) {
      float a = acc[i * acc_stride + j] * c[i];
      for (int r = 0; r < n[i]; ++r) a = std::fma(p[i * p_stride + r], row(r)[j], a);
      acc[i * acc_stride + j] = a;
    }
  }
}

void silu_mul_scalar(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
}

const Kernels kScalarKernels{quantize_rows_scalar, gemm_q4x8_scalar,     gemm_q8x8_scalar,
                             gemm_q4x8f_scalar,   gemm_q8x8h_scalar,    nullptr,
                             nullptr,             nullptr,              nullptr,
                             nullptr,             nullptr,              qk_scores_scalar,
                             softmax_step_scalar, pv_accumulate_scalar, silu_mul_scalar};

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avxvnni() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avxvnni");
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
    case GgmlType::kQ4_K: return PackedFormat::kQ4_Kx8;
    case GgmlType::kQ5_0: return PackedFormat::kQ5_0x8;
    case GgmlType::kQ5_1: return PackedFormat::kQ5_1x8;
    case GgmlType::kQ5_K: return PackedFormat::kQ5_Kx8;
    case GgmlType::kQ6_K: return PackedFormat::kQ6_Kx8;
    default: return PackedFormat::kNone;
  }
}

PackedLayout packed_layout(PackedFormat f) {
  switch (f) {
    case PackedFormat::kQ4_0x8:
    case PackedFormat::kQ4_1x8: return PackedLayout::kQ4x8;
    case PackedFormat::kQ8_0x8: return PackedLayout::kQ8x8;
    case PackedFormat::kQ4_Kx8: return PackedLayout::kQ4x8F;
    case PackedFormat::kQ5_0x8:
    case PackedFormat::kQ5_1x8:
    case PackedFormat::kQ5_Kx8:
    case PackedFormat::kQ6_Kx8: return PackedLayout::kQ8x8H;
    case PackedFormat::kNone: break;
  }
  return PackedLayout::kNone;
}

size_t packed_group_bytes(PackedFormat f, int64_t k) {
  const size_t nb = static_cast<size_t>(k / kQBlock);
  switch (packed_layout(f)) {
    case PackedLayout::kQ4x8: return nb * sizeof(PackedQ4x8);
    case PackedLayout::kQ4x8F: return nb * sizeof(PackedQ4x8F);
    case PackedLayout::kQ8x8: return nb * sizeof(PackedQ8x8);
    case PackedLayout::kQ8x8H: return nb * sizeof(PackedQ8x8H);
    case PackedLayout::kNone: break;
  }
  return 0;
}

size_t packed_bytes(PackedFormat f, int64_t n_rows, int64_t k) {
  const int64_t groups = (n_rows + kPackRows - 1) / kPackRows;
  return static_cast<size_t>(groups) * packed_group_bytes(f, k);
}

namespace {

// Block b (32 elements) of a ggml row of a PackedQ4x8F / PackedQ8x8H type
// as w = d[e / 16] * q[e] + m: the scales computed with the float operations
// of dequantize_row, so that unpacking gives its bits.
struct Block32 {
  int8_t q[32];
  float d[2];  // elements [0, 16) and [16, 32)
  float m;
};

Block32 decode_block32(GgmlType type, const uint8_t* row, int64_t b) {
  Block32 o{};
  switch (type) {
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1: {
      const bool has_min = type == GgmlType::kQ5_1;
      const uint8_t* p = row + b * (has_min ? sizeof(BlockQ5_1) : sizeof(BlockQ5_0));
      uint16_t dh, mh = 0;
      std::memcpy(&dh, p, 2);
      if (has_min) std::memcpy(&mh, p + 2, 2);
      uint32_t qh;
      std::memcpy(&qh, p + (has_min ? 4 : 2), 4);
      const uint8_t* qs = p + (has_min ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const int x0 = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) << 4) & 0x10);
        const int x1 = (qs[j] >> 4) | static_cast<int>((qh >> (j + 12)) & 0x10);
        o.q[j] = static_cast<int8_t>(has_min ? x0 : x0 - 16);
        o.q[j + 16] = static_cast<int8_t>(has_min ? x1 : x1 - 16);
      }
      o.d[0] = o.d[1] = fp16_to_fp32(dh);
      o.m = has_min ? fp16_to_fp32(mh) : 0.0f;
      return o;
    }
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K: {
      const bool five = type == GgmlType::kQ5_K;
      const int64_t sb = b / 8;
      const int j = static_cast<int>(b % 8);
      const uint8_t* p = row + sb * (five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K));
      uint16_t dh, mh;
      std::memcpy(&dh, p, 2);
      std::memcpy(&mh, p + 2, 2);
      uint8_t sc, mn;
      kquant_scale_min(j, p + 4, &sc, &mn);
      const uint8_t* qh = five ? p + 16 : nullptr;
      const uint8_t* qs = (five ? p + 48 : p + 16) + 32 * (j / 2);
      for (int l = 0; l < 32; ++l) {
        const int lo = j % 2 == 0 ? (qs[l] & 0xF) : (qs[l] >> 4);
        o.q[l] = static_cast<int8_t>(lo + (qh && (qh[l] >> j) & 1 ? 16 : 0));
      }
      o.d[0] = o.d[1] = fp16_to_fp32(dh) * sc;     // ggml: d * sc, then (d * sc) * q - min * m
      o.m = -(fp16_to_fp32(mh) * mn);
      return o;
    }
    case GgmlType::kQ6_K: {
      // Block b is elements 128n + 32k + l of super-block b / 8 (n = b % 8 / 4,
      // k = b % 4, l < 32), sub-blocks 2 (b % 8) and 2 (b % 8) + 1.
      const uint8_t* p = row + (b / 8) * sizeof(BlockQ6_K);
      const int n = static_cast<int>(b % 8) / 4, k = static_cast<int>(b % 4);
      const uint8_t* ql = p + 64 * n + 32 * (k & 1);
      const uint8_t* qh = p + 128 + 32 * n;
      const auto* scales = reinterpret_cast<const int8_t*>(p + 192);
      uint16_t dh;
      std::memcpy(&dh, p + 208, 2);
      for (int l = 0; l < 32; ++l) {
        const int lo = k >= 2 ? ql[l] >> 4 : ql[l] & 0xF;
        o.q[l] = static_cast<int8_t>((lo | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
      }
      const float d = fp16_to_fp32(dh);
      o.d[0] = d * static_cast<float>(scales[2 * (b % 8)]);
      o.d[1] = d * static_cast<float>(scales[2 * (b % 8) + 1]);
      o.m = 0.0f;
      return o;
    }
    default: break;
  }
  return o;
}

}  // namespace

bool pack_rows(GgmlType type, const void* src, int64_t n_rows, int64_t k, void* dst) {
  const PackedFormat f = packed_format_for(type);
  if (f == PackedFormat::kNone || k % kQBlock != 0 || k % ggml_traits(type).block_elems != 0) return false;
  const PackedLayout layout = packed_layout(f);
  const int64_t nb = k / kQBlock, groups = (n_rows + kPackRows - 1) / kPackRows;
  const size_t src_row = ggml_row_bytes(type, k);
  const uint8_t* s = static_cast<const uint8_t*>(src);
  std::memset(dst, 0, packed_bytes(f, n_rows, k));  // padding rows: d = m = q = 0
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < kPackRows && g * kPackRows + r < n_rows; ++r) {
      const uint8_t* row = s + static_cast<size_t>(g * kPackRows + r) * src_row;
      for (int64_t b = 0; b < nb; ++b) {
        if (layout == PackedLayout::kQ4x8F) {
          PackedQ4x8F& P = static_cast<PackedQ4x8F*>(dst)[g * nb + b];
          const Block32 q = decode_block32(type, row, b);
          P.d[r] = q.d[0];
          P.m[r] = q.m;
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i)
              P.qs[32 * c + 4 * r + i] = static_cast<uint8_t>(q.q[4 * c + i] | (q.q[16 + 4 * c + i] << 4));
          continue;
        }
        if (layout == PackedLayout::kQ8x8H) {
          PackedQ8x8H& P = static_cast<PackedQ8x8H*>(dst)[g * nb + b];
          const Block32 q = decode_block32(type, row, b);
          P.d[r] = q.d[0];
          P.d[8 + r] = q.d[1];
          P.m[r] = q.m;
          for (int gg = 0; gg < 8; ++gg) std::memcpy(&P.qs[32 * gg + 4 * r], &q.q[4 * gg], 4);
          continue;
        }
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
  const PackedLayout layout = packed_layout(f);
  for (int64_t b = 0; b < nb; ++b) {
    float* o = dst + b * kQBlock;
    if (layout == PackedLayout::kQ8x8) {
      const PackedQ8x8& P = static_cast<const PackedQ8x8*>(packed)[g * nb + b];
      const float d = fp16_to_fp32(P.d[r]);
      for (int gg = 0; gg < 8; ++gg)
        for (int i = 0; i < 4; ++i) o[4 * gg + i] = d * static_cast<float>(P.qs[32 * gg + 4 * r + i]);
    } else if (layout == PackedLayout::kQ8x8H) {
      // ggml's operations: Q5_0 (q5 - 16) * d and Q6_K (d * sc) * (q6 - 32),
      // one product; Q5_1 q * d + m and Q5_K (d * sc) * q - dmin * m (the
      // product is exact, and a - b is a + (-b)).
      const PackedQ8x8H& P = static_cast<const PackedQ8x8H*>(packed)[g * nb + b];
      const bool offset = f == PackedFormat::kQ5_1x8 || f == PackedFormat::kQ5_Kx8;
      for (int e = 0; e < kQBlock; ++e) {
        const float v = P.d[e < 16 ? r : 8 + r] * static_cast<float>(P.qs[32 * (e / 4) + 4 * r + e % 4]);
        o[e] = offset ? v + P.m[r] : v;
      }
    } else if (layout == PackedLayout::kQ4x8F) {
      const PackedQ4x8F& P = static_cast<const PackedQ4x8F*>(packed)[g * nb + b];
      for (int c = 0; c < 4; ++c) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = P.qs[32 * c + 4 * r + i];
          o[4 * c + i] = P.d[r] * static_cast<float>(byte & 0x0F) + P.m[r];
          o[16 + 4 * c + i] = P.d[r] * static_cast<float>(byte >> 4) + P.m[r];
        }
      }
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

bool uses_offset_activations(const Kernels& kern, PackedFormat f) {
  const PackedLayout l = packed_layout(f);
  return (l == PackedLayout::kQ8x8 && kern.gemm_q8x8_offset != nullptr) ||
         (l == PackedLayout::kQ8x8H && kern.gemm_q8x8h_offset != nullptr);
}

void offset_activations(const BlockQ8A* x, int64_t n, BlockQ8A* out) {
  for (int64_t b = 0; b < n; ++b) {
    out[b].d = x[b].d;
    out[b].s = x[b].s;
    for (int j = 0; j < kQBlock; ++j) out[b].qs[j] = static_cast<int8_t>(static_cast<uint8_t>(x[b].qs[j]) ^ 0x80u);
  }
}

void gemm_group(const Kernels& kern, PackedFormat f, const void* group, int64_t nb, const BlockQ8A* x, int m,
                float* out, int64_t out_stride, const BlockQ8A* xo) {
  if (xo != nullptr && uses_offset_activations(kern, f)) {
    if (packed_layout(f) == PackedLayout::kQ8x8)
      kern.gemm_q8x8_offset(static_cast<const PackedQ8x8*>(group), nb, xo, m, out, out_stride);
    else
      kern.gemm_q8x8h_offset(static_cast<const PackedQ8x8H*>(group), nb, xo, m, out, out_stride);
    return;
  }
  switch (packed_layout(f)) {
    case PackedLayout::kQ4x8: kern.gemm_q4x8(static_cast<const PackedQ4x8*>(group), nb, x, m, out, out_stride); break;
    case PackedLayout::kQ4x8F:
      kern.gemm_q4x8f(static_cast<const PackedQ4x8F*>(group), nb, x, m, out, out_stride);
      break;
    case PackedLayout::kQ8x8: kern.gemm_q8x8(static_cast<const PackedQ8x8*>(group), nb, x, m, out, out_stride); break;
    case PackedLayout::kQ8x8H:
      kern.gemm_q8x8h(static_cast<const PackedQ8x8H*>(group), nb, x, m, out, out_stride);
      break;
    case PackedLayout::kNone: break;
  }
}

void gemm_group_pair(const Kernels& kern, PackedFormat f, const void* group, int64_t nb, const BlockQ8A* x, int m,
                     float* out, int64_t out_stride, const BlockQ8A* xo) {
  const bool offset = xo != nullptr && uses_offset_activations(kern, f);
  switch (packed_layout(f)) {
    case PackedLayout::kQ4x8:
      if (kern.gemm_q4x8_x2 == nullptr) break;
      return kern.gemm_q4x8_x2(static_cast<const PackedQ4x8*>(group), nb, x, m, out, out_stride);
    case PackedLayout::kQ4x8F:
      if (kern.gemm_q4x8f_x2 == nullptr) break;
      return kern.gemm_q4x8f_x2(static_cast<const PackedQ4x8F*>(group), nb, x, m, out, out_stride);
    case PackedLayout::kQ8x8:
      if (!offset || kern.gemm_q8x8_offset_x2 == nullptr) break;
      return kern.gemm_q8x8_offset_x2(static_cast<const PackedQ8x8*>(group), nb, xo, m, out, out_stride);
    case PackedLayout::kQ8x8H:
      if (!offset || kern.gemm_q8x8h_offset_x2 == nullptr) break;
      return kern.gemm_q8x8h_offset_x2(static_cast<const PackedQ8x8H*>(group), nb, xo, m, out, out_stride);
    case PackedLayout::kNone: return;
  }
  const size_t group_bytes = packed_group_bytes(f, nb * kQBlock);
  gemm_group(kern, f, group, nb, x, m, out, out_stride, xo);
  gemm_group(kern, f, static_cast<const uint8_t*>(group) + group_bytes, nb, x, m, out + kPackRows, out_stride, xo);
}

bool has_pair_kernel(const Kernels& kern, PackedFormat f) {
  switch (packed_layout(f)) {
    case PackedLayout::kQ4x8: return kern.gemm_q4x8_x2 != nullptr;
    case PackedLayout::kQ4x8F: return kern.gemm_q4x8f_x2 != nullptr;
    case PackedLayout::kQ8x8: return uses_offset_activations(kern, f) && kern.gemm_q8x8_offset_x2 != nullptr;
    case PackedLayout::kQ8x8H: return uses_offset_activations(kern, f) && kern.gemm_q8x8h_offset_x2 != nullptr;
    case PackedLayout::kNone: break;
  }
  return false;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvxVnni: return "avxvnni";
    case Isa::kAvx512Vnni: return "avx512vnni";
    case Isa::kScalar: break;
  }
  return "scalar";
}

bool isa_built_with_avx512(Isa isa) {
  if (isa == Isa::kAvx2) return avx2_unit_built_with_avx512();
  if (isa == Isa::kAvxVnni) return avxvnni_unit_built_with_avx512();
  return false;
}

// The CPU is asked first: an ISA's translation unit is not entered at all
// on a CPU without it.
bool isa_supported(Isa isa) {
  static const bool avx2 = cpu_has_avx2() && avx2_kernels() != nullptr;
  static const bool avx_vnni = avx2 && cpu_has_avxvnni() && avxvnni_gemm() != nullptr;
  static const bool vnni = avx2 && cpu_has_avx512vnni() && avx512vnni_gemm() != nullptr;
  switch (isa) {
    case Isa::kAvx2: return avx2;
    case Isa::kAvxVnni: return avx_vnni;
    case Isa::kAvx512Vnni: return vnni;
    case Isa::kScalar: break;
  }
  return true;
}

Isa best_isa() {
  static const Isa chosen = [] {
    if (const char* env = std::getenv("PD_CPU_ISA")) {
      for (Isa isa : kAllIsas)
        if (std::strcmp(env, isa_name(isa)) == 0 && isa_supported(isa)) return isa;
    }
    if (isa_supported(Isa::kAvx512Vnni)) return Isa::kAvx512Vnni;
    if (isa_supported(Isa::kAvxVnni)) return Isa::kAvxVnni;
    return isa_supported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar;
  }();
  return chosen;
}

namespace {

// The AVX2 table with a VNNI build's integer matmul kernels in place (its
// two-group entries nullptr where it has none).
Kernels avx2_with(const IntegerGemm& g) {
  Kernels k = *avx2_kernels();
  k.gemm_q4x8 = g.gemm_q4x8, k.gemm_q8x8 = g.gemm_q8x8, k.gemm_q4x8f = g.gemm_q4x8f, k.gemm_q8x8h = g.gemm_q8x8h;
  k.gemm_q8x8_offset = g.gemm_q8x8_offset, k.gemm_q8x8h_offset = g.gemm_q8x8h_offset;
  k.gemm_q4x8_x2 = g.gemm_q4x8_x2, k.gemm_q4x8f_x2 = g.gemm_q4x8f_x2;
  k.gemm_q8x8_offset_x2 = g.gemm_q8x8_offset_x2, k.gemm_q8x8h_offset_x2 = g.gemm_q8x8h_offset_x2;
  return k;
}

}  // namespace

const Kernels& kernels(Isa isa) {
  if (isa == Isa::kAvx512Vnni && isa_supported(isa)) {
    static const Kernels vnni = [] {
      Kernels k = avx2_with(*avx512vnni_gemm());
      if (const AttentionKernels* a = avx512_attention()) {
        k.qk_scores = a->qk_scores;
        k.softmax_step = a->softmax_step;
        k.pv_accumulate = a->pv_accumulate;
      }
      return k;
    }();
    return vnni;
  }
  if (isa == Isa::kAvxVnni && isa_supported(isa)) {
    static const Kernels avx_vnni = avx2_with(*avxvnni_gemm());
    return avx_vnni;
  }
  if (isa == Isa::kAvx2 && isa_supported(isa)) return *avx2_kernels();
  return kScalarKernels;
}

}  // namespace pd::cpu
