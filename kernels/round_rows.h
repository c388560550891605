// Input rows rounded to int8 for the byte dot products of int4.cpp and int8.cpp.
#pragma once
#include "floats.h"

// Input rows rounded to int8 per block of 32, twice, for byte dot products (int4.cpp and
// int8.cpp): x ~= d (xq + xr / 256) with d = max|x| / 127, exact to d / 512. Per block,
// interleaved like int4's (scale, min) pairs so that one vector op serves both:
// xa[2b] = d_b / 256, xa[2b + 1] = 0; xb[2b] = 0, xb[2b + 1] = sum of block b.
static inline void ae_quantize_rows(const float* x, int8_t* xq, int8_t* xr, float* xa,
                                    float* xb, int64_t M, int64_t K) {
    const int64_t blocks = K / 32;
    for (int64_t i = 0; i < M * blocks; ++i) {
        const float* xs = x + i * 32;
        int8_t* q = xq + i * 32;
        int8_t* r = xr + i * 32;
#ifdef AE_AVX2
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(xs + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            sum = _mm256_add_ps(sum, v[j]);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const __m256 dv = _mm256_set1_ps(d), iv = _mm256_set1_ps(inv);
        const __m256 iv256 = _mm256_set1_ps(inv * 256.f);
        __m256i qi[4], ri[4];
        for (int j = 0; j < 4; ++j) {
            const __m256 rq = _mm256_round_ps(_mm256_mul_ps(v[j], iv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            qi[j] = _mm256_cvtps_epi32(rq);
            ri[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_fnmadd_ps(rq, dv, v[j]), iv256));
        }
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i pq = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                        _mm256_packs_epi32(qi[2], qi[3]));
        __m256i pr = _mm256_packs_epi16(_mm256_packs_epi32(ri[0], ri[1]),
                                        _mm256_packs_epi32(ri[2], ri[3]));
        _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(pq, perm));
        // -128 would not survive int8.cpp's sign trick (-(-128) wraps): clamp to -127.
        pr = _mm256_max_epi8(pr, _mm256_set1_epi8(-127));
        _mm256_storeu_si256((__m256i*)r, _mm256_permutevar8x32_epi32(pr, perm));
        const float s = ae_hsum8(sum);
#else
        float amax = 0.f, s = 0.f;
        for (int j = 0; j < 32; ++j) { amax = std::max(amax, std::fabs(xs[j])); s += xs[j]; }
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < 32; ++j) {
            const float rq = std::nearbyint(xs[j] * inv);
            q[j] = (int8_t)rq;
            const float rr = std::nearbyint((xs[j] - rq * d) * inv * 256.f);
            r[j] = (int8_t)std::min(127.f, std::max(-127.f, rr));
        }
#endif
        xa[2 * i] = d / 256.f; xa[2 * i + 1] = 0.f;
        xb[2 * i] = 0.f; xb[2 * i + 1] = s;
    }
}

// The rounded input rows of a byte-dot call (int4.cpp, int8.cpp), in scratch of the calling
// thread kept between calls; the team reads them through these pointers.
struct ae_rounded { int8_t* xq; int8_t* xr; float* xa; float* xb; };
static inline ae_rounded ae_round_rows(const float* x, int64_t M, int64_t K) {
    static thread_local ae_vec<int8_t> q;
    static thread_local ae_vec<float> f;
    const int64_t blocks = K / 32;
    if ((int64_t)q.size() < 2 * M * K) q.resize(2 * M * K);
    if ((int64_t)f.size() < 4 * M * blocks) f.resize(4 * M * blocks);
    ae_rounded r{q.data(), q.data() + M * K, f.data(), f.data() + 2 * M * blocks};
    ae_quantize_rows(x, r.xq, r.xr, r.xa, r.xb, M, K);
    return r;
}
