#include "common.h"

// SwiGLU's gate: out[t] = silu(gate[t]) * up[t], gate and up the two halves of a row of
// gu ([T, 2 I]); silu(g) = g / (1 + exp(-g)). out: [T, I].
// (Elementwise: each output's operations are the same on any lane width and thread.)
// A team from AE_SILU_TEAM_MIN elements (the decode stack, whose threads are still spinning
// from the matmul before, sets it lower).
#ifndef AE_SILU_TEAM_MIN
#define AE_SILU_TEAM_MIN 65536
#endif
extern "C" void kernel(const ae_t* gu, ae_t* out, int64_t T, int64_t I) {
    #pragma omp parallel for schedule(static) if (T > 1 && T * I >= AE_SILU_TEAM_MIN)
    for (int64_t t = 0; t < T; ++t) {
        const ae_t* g = gu + t * 2 * I;
        const ae_t* u = g + I;
        ae_t* o = out + t * I;
        int64_t i = 0;
#ifdef AE_EXP16
        const __m512 one16 = _mm512_set1_ps(1.f);
        for (; i + 16 <= I; i += 16) {
            const __m512 gv = ae_load16e(g + i);
            const __m512 e = ae_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one16, e));
            ae_store16e(o + i, _mm512_mul_ps(silu, ae_load16e(u + i)));
        }
#endif
#ifdef AE_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = ae_load8(g + i);
            const __m256 e = ae_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            ae_store8(o + i, _mm256_mul_ps(silu, ae_load8(u + i)));
        }
#endif
        for (; i < I; ++i) {
            const float gv = ae_get(g + i);
            ae_put(o + i, gv / (1.f + std::exp(-gv)) * ae_get(u + i));
        }
    }
}
