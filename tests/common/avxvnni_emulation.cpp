// The AVX-VNNI matmul kernels (q8_kernels_avxvnni.cpp) compiled a second time
// for AVX2 with vpdpbusd emulated exactly, so q8_kernels_test.cpp checks them
// on CPUs without AVX-VNNI too. The real instruction runs (and is tested) only
// where the CPU has it.
#define PD_VNNI_EMULATION 1
#define PD_AVX_VNNI 1
#include "backend/cpu/q8_kernels_avx512vnni.cpp"
