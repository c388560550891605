#include "common.h"

// RMSNorm of T rows of N, fused with the residual add that precedes it:
//   with a residual (has_residual): residual = x + residual (rounded to the element type),
//   y = residual; otherwise y = x. out = w * round(y / sqrt(mean(y^2) + eps)).
// x rows have stride x_stride elements; residual, out: [T, N] contiguous.
extern "C" void kernel(const ae_t* x, ae_t* residual, const ae_t* w, ae_t* out, int64_t T,
                       int64_t N, int64_t x_stride, int64_t has_residual, float eps) {
    #pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; ++t) {
        const ae_t* xt = x + t * x_stride;
        ae_t* yt = has_residual ? residual + t * N : nullptr;
        ae_t* ot = out + t * N;
        float ss = 0.f;
        int64_t i = 0;
#ifdef AE_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= N; i += 8) {
            __m256 v = ae_load8(xt + i);
            if (yt) {
                v = _mm256_add_ps(v, ae_load8(yt + i));
                ae_store8(yt + i, v);
                v = ae_load8(yt + i);  // the rounded sum, as stored
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = ae_hsum8(acc);
#endif
        for (; i < N; ++i) {
            float v = ae_get(xt + i);
            if (yt) { ae_put(yt + i, v + ae_get(yt + i)); v = ae_get(yt + i); }
            ss += v * v;
        }
        const ae_t* y = yt ? yt : xt;
        const float inv = 1.f / std::sqrt(ss / (float)N + eps);
        i = 0;
#ifdef AE_AVX2
        const __m256 vinv = _mm256_set1_ps(inv);
        for (; i + 8 <= N; i += 8)  // the loop below, eight at a time
            ae_store8(ot + i, _mm256_mul_ps(ae_load8(w + i),
                                            ae_round8(_mm256_mul_ps(ae_load8(y + i), vinv))));
#endif
        for (; i < N; ++i) {
            ae_t n;
            ae_put(&n, ae_get(y + i) * inv);
            ae_put(ot + i, ae_get(w + i) * ae_get(&n));
        }
    }
}
