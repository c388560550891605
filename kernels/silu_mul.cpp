#include "common.h"

// A gated MLP's activation: out[t] = act(gate[t]) * up[t], gate and up the two halves of a row
// of gu ([T, 2 I]); out: [T, I]. act: SwiGLU's silu(g) = g / (1 + exp(-g)), or (gelu) GELU's
// tanh form 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), computed as the same
// quotient, g / (1 + exp(-2 z)), since 0.5 (1 + tanh(z)) = 1 / (1 + exp(-2 z)).
// (Elementwise: each output's operations are the same on any lane width and thread.)
// A team from AE_SILU_TEAM_MIN elements (the decode stack, whose threads are still spinning
// from the matmul before, sets it lower).
#ifndef AE_SILU_TEAM_MIN
#define AE_SILU_TEAM_MIN 65536
#endif
#define AE_GELU_C1 1.5957691216057308f    // 2 sqrt(2 / pi)
#define AE_GELU_C3 0.07135481627260025f  // 2 sqrt(2 / pi) 0.044715
extern "C" void kernel(const ae_t* gu, ae_t* out, int64_t T, int64_t I, int64_t gelu) {
    #pragma omp parallel for schedule(static) if (T > 1 && T * I >= AE_SILU_TEAM_MIN)
    for (int64_t t = 0; t < T; ++t) {
        const ae_t* g = gu + t * 2 * I;
        const ae_t* u = g + I;
        ae_t* o = out + t * I;
        int64_t i = 0;
#ifdef AE_EXP16
        const __m512 one16 = _mm512_set1_ps(1.f);
        const __m512 c1_16 = _mm512_set1_ps(AE_GELU_C1), c3_16 = _mm512_set1_ps(AE_GELU_C3);
        for (; i + 16 <= I; i += 16) {
            const __m512 gv = ae_load16e(g + i);
            const __m512 z = gelu ? _mm512_mul_ps(gv, _mm512_add_ps(c1_16, _mm512_mul_ps(
                                        c3_16, _mm512_mul_ps(gv, gv))))
                                  : gv;
            const __m512 e = ae_exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
            const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(one16, e));
            ae_store16e(o + i, _mm512_mul_ps(act, ae_load16e(u + i)));
        }
#endif
#ifdef AE_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        const __m256 c1 = _mm256_set1_ps(AE_GELU_C1), c3 = _mm256_set1_ps(AE_GELU_C3);
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = ae_load8(g + i);
            const __m256 z = gelu ? _mm256_mul_ps(gv, _mm256_add_ps(c1, _mm256_mul_ps(
                                        c3, _mm256_mul_ps(gv, gv))))
                                  : gv;
            const __m256 e = ae_exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
            const __m256 act = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            ae_store8(o + i, _mm256_mul_ps(act, ae_load8(u + i)));
        }
#endif
        for (; i < I; ++i) {
            const float gv = ae_get(g + i);
            const float z = gelu ? gv * (AE_GELU_C1 + AE_GELU_C3 * (gv * gv)) : gv;
            ae_put(o + i, gv / (1.f + std::exp(-z)) * ae_get(u + i));
        }
    }
}
