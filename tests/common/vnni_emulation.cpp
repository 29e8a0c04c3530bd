// The AVX512-VNNI matmul kernels compiled a second time for AVX2 with
// vpdpbusd emulated exactly (PD_VNNI_EMULATION), so q8_kernels_test.cpp can
// check their layout, token tiles and tails on CPUs without VNNI. The real
// instruction runs (and is tested) only where the CPU has it.
#define PD_VNNI_EMULATION 1
#include "backend/cpu/q8_kernels_avx512vnni.cpp"
