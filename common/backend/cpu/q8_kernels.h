// The CPU backend's hot kernels, in one table per instruction set. First of
// all the integer matmul kernels: quantized weights repacked at
// load into groups of 8 interleaved rows, activations quantized to 8 bits per
// 32-element block, dot products in integer arithmetic (AVX2 maddubs), one
// float scale-and-accumulate per block.
//
// Layout. A packed group holds 8 weight rows (the last group of a matrix is
// padded with zero rows). For each 32-element block b of those rows, 4-byte
// runs of the 8 rows are interleaved so that one 32-byte vector holds elements
// [4g, 4g+4) of every row, row r in 32-bit lane r. Broadcasting the matching
// four activation bytes to all lanes and multiplying gives 8 rows' partial
// dot products at once, each row in its own lane: no horizontal sums, and the
// output of row r is lane r of the accumulator.
//
// Numbers. For weights w = d*q + m (Q4_1; Q4_0 is packed as m = -8d) and
// activations x = dx*qx with sx = dx * sum(qx):
//   dot(w, x) = sum over blocks [ (float)isum_b * (d_b*dx_b) + m_b * sx_b ]
// accumulated with fused multiply-adds in block order. The K-quants and the
// 5-bit types are the same sum: each of their 32-element blocks is w = D*q +
// M with q a small integer and D, M exact fp32 products of the file's fp16
// scales and small integers (PackedQ4x8F, PackedQ8x8H below); Q6_K's
// 16-element sub-blocks make two integer sums per block, one per half, each
// scaled by its own D. The same sequence of
// operations runs for a (row, token) pair whatever the other rows and tokens
// of the call are, so results are batch invariant; the scalar and AVX2
// paths perform the same operations and agree bit for bit (tested).
//
// Dispatch. kernels(isa) returns the table for one instruction set;
// best_isa() picks the widest one this CPU runs (PD_CPU_ISA=scalar|avx2|
// avxvnni|avx512vnni overrides, for comparisons). Each ISA's kernels live in their own
// translation unit compiled for it (q8_kernels_avx2.cpp with -mavx2 -mfma
// -mf16c; q8_kernels_avx512vnni.cpp adds AVX512 F/BW/VL/VNNI: vpdpbusd does a
// 4-byte dot product per lane in one instruction), so the rest of the binary
// runs on any x86-64 (or other) CPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gguf/ggml_types.h"

namespace pd::cpu {

inline constexpr int kPackRows = 8;   // rows per packed group
inline constexpr int kQBlock = 32;    // elements per quantization block

// One 32-element block of a quantized activation row.
struct BlockQ8A {
  float d;         // scale: x ~ d * qs
  float s;         // d * sum(qs), for the weights' offset term
  int8_t qs[32];   // in [-127, 127]
};
static_assert(sizeof(BlockQ8A) == 40);

// 8 rows x 32 elements of Q4_0/Q4_1 weights: w = d*q + m, q in [0, 15].
// qs[32c + 4r + i] holds element 4c+i of row r in its low nibble and element
// 16+4c+i in its high nibble (c < 4, r < 8, i < 4) — which is byte 4c+i of
// row r's original Q4 block, so packing only moves bytes.
struct PackedQ4x8 {
  uint16_t d[8];  // fp16 scales, row r at r
  uint16_t m[8];  // fp16 offsets (Q4_0: -8d)
  uint8_t qs[128];
};
static_assert(sizeof(PackedQ4x8) == 160);

// 8 rows x 32 elements of Q8_0 weights: w = d*q, q in [-128, 127].
// qs[32g + 4r + i] = element 4g+i of row r (g < 8).
struct PackedQ8x8 {
  uint16_t d[8];
  int8_t qs[256];
};
static_assert(sizeof(PackedQ8x8) == 272);

// 8 rows x 32 elements of Q4_K weights: PackedQ4x8 with fp32 scales. Block
// b of a row is ggml sub-block j = b % 8 of super-block b / 8: d = d_sb *
// sc_j and m = -(dmin_sb * m_j), both exact in fp32 (11 x 6 significant bits),
// so w = d*q + m is exactly ggml's d*sc_j*q - dmin*m_j. qs as PackedQ4x8.
struct PackedQ4x8F {
  float d[8];
  float m[8];
  uint8_t qs[128];
};
static_assert(sizeof(PackedQ4x8F) == 192);

// 8 rows x 32 elements of int8 weights (|q| <= 32) with one scale per
// 16-element half: element e of row r is d[r]*q + m[r] for e < 16 and
// d[8+r]*q + m[r] for e >= 16; qs as PackedQ8x8 (runs g < 4 hold the first
// half). Q5_0: q = q5 - 16, d = d (both halves), m = 0. Q5_1: q = q5, d,
// m = m. Q5_K: as Q4_K with q in [0, 31]. Q6_K: q = q6 - 32, the two
// 16-element sub-blocks' d_sb * scales[j] (exact: 11 x 8 bits), m = 0.
struct PackedQ8x8H {
  float d[16];
  float m[8];
  int8_t qs[256];
};
static_assert(sizeof(PackedQ8x8H) == 352);

// Packed formats, one per GGUF type (so that unpacking reproduces ggml's
// dequantization exactly); they share four block layouts and kernels:
// PackedQ4x8 (Q4_0, Q4_1), PackedQ4x8F (Q4_K), PackedQ8x8 (Q8_0) and
// PackedQ8x8H (Q5_0, Q5_1, Q5_K, Q6_K). The values are stored in
// Tensor::layout.
enum class PackedFormat : uint8_t {
  kNone = 0,
  kQ4_0x8 = 1,
  kQ4_1x8 = 2,
  kQ8_0x8 = 3,
  kQ4_Kx8 = 4,
  kQ5_0x8 = 5,
  kQ5_1x8 = 6,
  kQ5_Kx8 = 7,
  kQ6_Kx8 = 8,
};
enum class PackedLayout : uint8_t { kNone, kQ4x8, kQ4x8F, kQ8x8, kQ8x8H };
PackedLayout packed_layout(PackedFormat f);
inline bool is_q4x8(PackedFormat f) { return f == PackedFormat::kQ4_0x8 || f == PackedFormat::kQ4_1x8; }

// The packed format for a GGUF weight type (kNone: not packable).
PackedFormat packed_format_for(GgmlType type);
size_t packed_group_bytes(PackedFormat f, int64_t k);  // one 8-row group, k elements per row
size_t packed_bytes(PackedFormat f, int64_t n_rows, int64_t k);
// Repacks n_rows ggml rows of k elements (k a multiple of the type's block
// size) into dst (packed_bytes() long). Fails only if Q4_0's -8d offset
// overflows fp16.
bool pack_rows(GgmlType type, const void* src, int64_t n_rows, int64_t k, void* dst);
// Row `row` of a packed matrix back to k floats (exactly what dequantizing the
// original ggml row gives).
void unpack_row(PackedFormat f, const void* packed, int64_t k, int64_t row, float* dst);

// exp(x) to ~1e-7 relative error for x in [-87, 88] (clamped there): x =
// n*ln2 + r with |r| <= ln2/2, e^r by Cephes' degree-6 polynomial, 2^n through
// the exponent bits. The AVX2 kernels evaluate the same formula 8 at a time.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = __builtin_nearbyintf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) * (1 << 23);
  return p * __builtin_bit_cast(float, bits);
}

// What quantizing k floats x (k a multiple of 32) to the blocks q lost:
// res[j] = x[j] - d_b * qs_b[j], one fused multiply-add each (exact in most
// cases, the same bits everywhere). Quantizing res again gives the second
// pass of two-pass activations (CpuBackendConfig::int8x2_matmul_kinds).
void quantization_residual(const float* x, const BlockQ8A* q, int64_t k, float* res);

// kAvxVnni: AVX2 with AVX-VNNI (vpdpbusd in 256-bit VEX form, no AVX-512).
enum class Isa { kScalar, kAvx2, kAvxVnni, kAvx512Vnni };
inline constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvxVnni, Isa::kAvx512Vnni};
const char* isa_name(Isa isa);
bool isa_supported(Isa isa);  // can this CPU run it (and was it compiled in)
Isa best_isa();               // widest supported, or PD_CPU_ISA if set and supported
// Whether isa's kernels were compiled with AVX-512's 32 vector registers: a
// -march=native build on an AVX-512 machine compiles the AVX2 and AVX-VNNI
// units so, and their speed there is not what a CPU without AVX-512 gets
// (the benchmarks say so when such a path is forced with PD_CPU_ISA).
bool isa_built_with_avx512(Isa isa);

// Key or value rows of the attention kernels: row r's hd elements start at
// rows[r], stored as `type`: F32, F16, or Q8_0 (hd a multiple of 32; a row is
// hd / 32 blocks). Both narrow types widen to fp32 exactly (an fp16 value; a
// q8_0 element is its block's fp16 scale times an int8, at most 19
// significant bits), so a kernel's results depend on the rows' values only,
// not on how they are stored.
struct KvRows {
  const void* const* rows;
  GgmlType type;
};

struct Kernels {
  // Quantizes m rows of k floats (row stride x_stride) to k/32 blocks each,
  // row i at out + i * (k/32).
  void (*quantize_rows)(const float* x, int64_t k, int64_t x_stride, int m, BlockQ8A* out);
  // One packed group of 8 rows against m quantized activation rows of nb
  // blocks: out[t * out_stride + r] = dot(row r, x_t), r < 8, t < m.
  void (*gemm_q4x8)(const PackedQ4x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride);
  void (*gemm_q8x8)(const PackedQ8x8* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride);
  // The same for PackedQ4x8F (gemm_q4x8's arithmetic with fp32 scales) and
  // PackedQ8x8H: per block isum_lo (runs g < 4) and isum_hi (g >= 4), then
  // acc = fma(isum_lo, d[r]*dx, acc), fma(isum_hi, d[8+r]*dx, acc),
  // fma(m[r], sx, acc).
  void (*gemm_q4x8f)(const PackedQ4x8F* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride);
  void (*gemm_q8x8h)(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* x, int m, float* out, int64_t out_stride);
  // Optional (nullptr where the ISA has none): gemm_q8x8 and gemm_q8x8h
  // against activations stored offset by 128 (offset_activations): a u8 x s8
  // dot product (vpdpbusd) then takes the signed weights as they are, without
  // the sign trick, and subtracts 128 * (the block's weight sum) from the
  // exact integer sum. The same bits as the plain kernels.
  void (*gemm_q8x8_offset)(const PackedQ8x8* w, int64_t nb, const BlockQ8A* xo, int m, float* out,
                           int64_t out_stride);
  void (*gemm_q8x8h_offset)(const PackedQ8x8H* w, int64_t nb, const BlockQ8A* xo, int m, float* out,
                            int64_t out_stride);
  // Optional (nullptr where the ISA has none): gemm_q4x8, gemm_q4x8f and the
  // two offset kernels over two consecutive packed groups, w and w + nb
  // blocks (16 rows): out[t * out_stride + r] for r < 16, the same bits as a
  // call per group. One pass over both groups' blocks, in 512-bit vectors,
  // shares every activation load between the 16 rows. gemm_group_pair() falls
  // back to a call per group.
  decltype(gemm_q4x8) gemm_q4x8_x2;
  decltype(gemm_q4x8f) gemm_q4x8f_x2;
  decltype(gemm_q8x8_offset) gemm_q8x8_offset_x2;
  decltype(gemm_q8x8h_offset) gemm_q8x8h_offset_x2;

  // Attention pieces (fp32 arithmetic; hd a multiple of 8), over many query
  // rows at once: the rows share every key and value load. Keys and values
  // come as KvRows: a pointer per row, read in the cache's own element type
  // (f32, f16 or q8_0) and widened to fp32 in registers. Each score and each
  // output element goes through the same operations whatever the other rows
  // and keys of the call are, and whatever type its key and value rows are
  // stored in (the widening is exact), so results are batch invariant. Scores
  // and value sums are the same bits on every path, scalar included; the
  // softmax step's exps differ between the portable and SIMD paths within fp32
  // rounding.
  //
  // s[i * s_stride + r] = scale * dot(q + i * q_stride, k row r) for rows
  // i < nr and keys r < n. A dot product is eight lane sums (lane l takes the
  // elements j = l mod 8 in order, by fused multiply-adds) added as
  // ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then scaled.
  void (*qk_scores)(const float* q, int64_t q_stride, int nr, KvRows k, int64_t hd, int n, float scale, float* s,
                    int64_t s_stride);
  // One online-softmax step of rows i < nr over their first n[i] scores
  // s_i = s + i * s_stride: m' = max(m[i], max s_i), s_i[r] = exp(s_i[r] - m'),
  // c[i] = exp(m[i] - m') (~1e-38 when m[i] is -inf: l and acc are 0 then), l[i] = l[i] * c[i] + the sum
  // of s_i, m[i] = m'. A row with n[i] = 0 is left as it is, with c[i] = 1.
  void (*softmax_step)(float* s, int64_t s_stride, int nr, const int* n, float* m, float* l, float* c);
  // For rows i < nr: acc_i = acc_i * c[i] + sum over r < n[i] of
  // p_i[r] * (v row r), with p_i = p + i * p_stride and acc_i = acc + i *
  // acc_stride. Each element: one multiply by c[i], then fused multiply-adds
  // in key order.
  void (*pv_accumulate)(const float* p, int64_t p_stride, int nr, const int* n, const float* c, KvRows v,
                        int64_t hd, float* acc, int64_t acc_stride);
  // out[i] = silu(gate[i]) * up[i] for i < n.
  void (*silu_mul)(const float* gate, const float* up, int64_t n, float* out);
};
// The table for one instruction set; isa must be supported.
const Kernels& kernels(Isa isa);

// One packed group (8 rows, nb blocks, format f) against m quantized
// activation rows through kern's kernel for f's layout; with xo (the same
// rows through offset_activations), the offset kernel where kern has one
// for that layout (uses_offset_activations).
void gemm_group(const Kernels& kern, PackedFormat f, const void* group, int64_t nb, const BlockQ8A* x, int m,
                float* out, int64_t out_stride, const BlockQ8A* xo = nullptr);
// gemm_group for two consecutive groups (group and the next, 16 rows, out
// columns r < 16): through kern's two-group kernel for f's layout where it
// has one, else a gemm_group call per group. The same bits either way.
void gemm_group_pair(const Kernels& kern, PackedFormat f, const void* group, int64_t nb, const BlockQ8A* x, int m,
                     float* out, int64_t out_stride, const BlockQ8A* xo = nullptr);
// Whether gemm_group_pair runs f's groups through a two-group kernel of kern
// (given the offset activations where kern takes them for f): such a kernel
// prefetches the next pair of groups itself.
bool has_pair_kernel(const Kernels& kern, PackedFormat f);
bool uses_offset_activations(const Kernels& kern, PackedFormat f);
// out[i] = x[i] with every quant byte stored as x + 128 (XOR 0x80; read as
// unsigned by the offset kernels), d and s unchanged; n blocks.
void offset_activations(const BlockQ8A* x, int64_t n, BlockQ8A* out);

// The AVX2 table (q8_kernels_avx2.cpp); nullptr where it was not compiled.
const Kernels* avx2_kernels();
// Whether that unit, and the AVX-VNNI one, were compiled with AVX-512
// (each returns PD_UNIT_HAS_AVX512 as its own unit sees it).
bool avx2_unit_built_with_avx512();
bool avxvnni_unit_built_with_avx512();
#if defined(__AVX512F__)
#define PD_UNIT_HAS_AVX512 true
#else
#define PD_UNIT_HAS_AVX512 false
#endif
// The AVX512-VNNI integer matmul kernels (q8_kernels_avx512vnni.cpp); that
// ISA's table is the AVX2 one with these and avx512_attention() in place.
// nullptr where not compiled.
struct IntegerGemm {
  decltype(Kernels::gemm_q4x8) gemm_q4x8;
  decltype(Kernels::gemm_q8x8) gemm_q8x8;
  decltype(Kernels::gemm_q4x8f) gemm_q4x8f;
  decltype(Kernels::gemm_q8x8h) gemm_q8x8h;
  decltype(Kernels::gemm_q8x8_offset) gemm_q8x8_offset;
  decltype(Kernels::gemm_q8x8h_offset) gemm_q8x8h_offset;
  decltype(Kernels::gemm_q4x8_x2) gemm_q4x8_x2;
  decltype(Kernels::gemm_q4x8f_x2) gemm_q4x8f_x2;
  decltype(Kernels::gemm_q8x8_offset_x2) gemm_q8x8_offset_x2;
  decltype(Kernels::gemm_q8x8h_offset_x2) gemm_q8x8h_offset_x2;
};
const IntegerGemm* avx512vnni_gemm();
// The AVX-VNNI kernels (q8_kernels_avxvnni.cpp): one-group kernels only (the
// *_x2 entries are nullptr); that ISA's table is the AVX2 one with these in
// place. nullptr where not compiled.
const IntegerGemm* avxvnni_gemm();
// The attention kernels compiled for AVX-512 (q8_kernels_avx512vnni.cpp, from
// attention_kernels.inc; the same bits as the AVX2 ones). nullptr where not compiled.
struct AttentionKernels {
  decltype(Kernels::qk_scores) qk_scores;
  decltype(Kernels::softmax_step) softmax_step;
  decltype(Kernels::pv_accumulate) pv_accumulate;
};
const AttentionKernels* avx512_attention();

}  // namespace pd::cpu
