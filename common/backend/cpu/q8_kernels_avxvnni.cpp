// The AVX-VNNI integer matmul kernels: q8_kernels_avx512vnni.cpp's one-group
// kernels compiled for the 256-bit VEX vpdpbusd (see there). This file alone
// is compiled with -mavxvnni (plus AVX2/FMA/F16C).
#define PD_AVX_VNNI 1
#include "backend/cpu/q8_kernels_avx512vnni.cpp"

namespace pd::cpu {
bool avxvnni_unit_built_with_avx512() { return PD_UNIT_HAS_AVX512; }
}  // namespace pd::cpu
