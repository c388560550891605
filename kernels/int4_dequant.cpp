#include "common.h"
#define kernel ae_int4_mm
#include "int4.cpp"
#undef kernel

// The float32 weights [N, K] of int4 weights q [N, K / 2], sm [N, K / 32, 2] (int4.cpp's
// layout): w = q * scale + min per block of 32. For prefill chunks, whose matmuls run in
// float32 through MKL.
extern "C" void kernel(const uint8_t* q, const uint16_t* sm, float* w, int64_t N, int64_t K) {
    const int64_t blocks = K / 32;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
        ae_dequant_q4(q + n * (K / 2), sm + n * blocks * 2, w + n * K, blocks);
}
