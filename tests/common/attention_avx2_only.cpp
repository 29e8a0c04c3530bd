// The attention kernels (attention_kernels.inc) compiled a third time, as a
// CPU without AVX-512 gets them: 16 vector registers, so fewer query rows per
// pass (tests/CMakeLists.txt compiles this file with -mno-avx512f). Whatever
// machine the tests run on, q8_kernels_test.cpp checks this variant's bits
// against the scalar kernels too; the library's own AVX2 copy is that variant
// only where the build machine has no AVX-512 (-march=native).
#include "backend/cpu/q8_kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>

namespace pd::cpu {
namespace {
#include "backend/cpu/attention_kernels.inc"

constexpr AttentionKernels kAttention{qk_scores_simd, softmax_step_simd, pv_accumulate_simd};
}  // namespace

const AttentionKernels* attention_avx2_16_registers() { return &kAttention; }
}  // namespace pd::cpu

#else

namespace pd::cpu {
const AttentionKernels* attention_avx2_16_registers() { return nullptr; }
}  // namespace pd::cpu

#endif
