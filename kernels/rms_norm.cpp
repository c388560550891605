#include "common.h"

// RMSNorm of rows of N, fused with the residual add that precedes it:
//   with a residual (has_residual): residual = x + residual (rounded to the element type),
//   y = residual; otherwise y = x. out = w * round(y / sqrt(mean(y^2) + eps)); with an offset
//   (Gemma's 1 + w, kept as w where the weights are bfloat16), out = round(y / sqrt(...) *
//   (offset + w)), the scale in float32 as Gemma's reference computes it.
// T tokens of `heads` rows each (a per-head q / k norm: heads > 1, never a residual): row j of
// token t at x + t x_stride + j N; residual, out: [T heads, N] contiguous.
extern "C" void kernel(const ae_t* x, ae_t* residual, const ae_t* w, ae_t* out, int64_t T,
                       int64_t N, int64_t x_stride, int64_t has_residual, float eps,
                       int64_t heads, float offset) {
    #pragma omp parallel for schedule(static) if (T * heads >= 32)
    for (int64_t r = 0; r < T * heads; ++r) {
        const ae_t* xt = x + (r / heads) * x_stride + (r % heads) * N;
        ae_t* yt = has_residual ? residual + r * N : nullptr;
        ae_t* ot = out + r * N;
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
        if (offset != 0.f) {
#ifdef AE_AVX2
            const __m256 vinv = _mm256_set1_ps(inv), voff = _mm256_set1_ps(offset);
            for (; i + 8 <= N; i += 8)  // the loop below, eight at a time
                ae_store8(ot + i, _mm256_mul_ps(_mm256_mul_ps(ae_load8(y + i), vinv),
                                                _mm256_add_ps(ae_load8(w + i), voff)));
#endif
            for (; i < N; ++i) ae_put(ot + i, (ae_get(y + i) * inv) * (ae_get(w + i) + offset));
            continue;
        }
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
