#include "common.h"

// Rotary embedding in place, neox layout (the two halves of the rotated part of each head
// turn together): the first R of each head's D (R = D, or fewer: partial rotary, the rest
// left as it is), with halves x1, x2 of those, x1' = x1 * cos1 + x2 * sin1 and
// x2' = x2 * cos2 + x1 * sin2, where cos, sin ([T, R], from RotaryEmbedding) hold cos for both
// halves and sin negated in the first half. x: [T, heads, D] rows of stride x_stride
// elements, heads contiguous.
extern "C" void kernel(ae_t* x, const ae_t* cos, const ae_t* sin, int64_t T, int64_t heads,
                       int64_t D, int64_t x_stride, int64_t R) {
    const int64_t half = R / 2;
    #pragma omp parallel for schedule(static) if (T * heads >= 512)
    for (int64_t th = 0; th < T * heads; ++th) {
        const int64_t t = th / heads;
        ae_t* xh = x + t * x_stride + (th % heads) * D;
        const ae_t* c = cos + t * R;
        const ae_t* s = sin + t * R;
        int64_t j = 0;
#ifdef AE_AVX2
        for (; j + 8 <= half; j += 8) {
            const __m256 x1 = ae_load8(xh + j), x2 = ae_load8(xh + half + j);
            ae_store8(xh + j, _mm256_add_ps(_mm256_mul_ps(x1, ae_load8(c + j)),
                                            _mm256_mul_ps(x2, ae_load8(s + j))));
            ae_store8(xh + half + j, _mm256_add_ps(_mm256_mul_ps(x2, ae_load8(c + half + j)),
                                                   _mm256_mul_ps(x1, ae_load8(s + half + j))));
        }
#endif
        for (; j < half; ++j) {
            const float x1 = ae_get(xh + j), x2 = ae_get(xh + half + j);
            ae_put(xh + j, x1 * ae_get(c + j) + x2 * ae_get(s + j));
            ae_put(xh + half + j, x2 * ae_get(c + half + j) + x1 * ae_get(s + half + j));
        }
    }
}
