#include "common.h"
#include <vector>

// x: bfloat16 [M, K]; q: int8 [N, K]; scales: float [N, G], G = 1 (one per row) or K / 32 (one
// per block of 32: GGUF's Q8_0); out: float [M, N].
// int8.cpp's per-channel weights against bfloat16 activations, for CPUs with AVX-512 BF16:
// the logits head of a bfloat16 model at decode and verification rows. An int8 weight is
// exactly a bfloat16 (8 significant bits), so the products are exact and summed in float32,
// then scaled once: y = scale_n * sum_k q_nk x_k (per block: each block's float sum scaled
// into the row's, one more FMA per 32 weights). The weights are converted once per weight
// row for up to 9 input rows; each row then costs one vdpbf16ps per 32 weights.
//
// Every row's sum runs in the same order for any M (16 weight rows' sums reduced together:
// ae_reduce16, the same additions as one at a time), so a row's logits do not depend on the
// rows beside it. K a multiple of 64. M == 0 is a query: out[0] = 1 where compiled in.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define AE_Q8_BF16 1

static inline __m512bh ae_q8_to_bf16(const int8_t* q) {  // 32 weights
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i*)q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i*)(q + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

template <int MC, bool PER_BLOCK>
static inline void ae_q8_bf16_rows(const int8_t* qn, const float* sn, const uint16_t* x,
                                   float* out, int64_t m0, int64_t n, int64_t N, int64_t K,
                                   __m512* part) {
    __m512 acc[MC], acc2[MC];  // two chains a row: even and odd chunks of 32
    for (int r = 0; r < MC; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
        if (MC >= 2)  // common.h: AE_PREFETCH_ROWS
            _mm_prefetch((const char*)(qn + AE_PREFETCH_ROWS * K + k), _MM_HINT_T0);
        const __m512bh w0 = ae_q8_to_bf16(qn + k), w1 = ae_q8_to_bf16(qn + k + 32);
        #pragma GCC unroll 9
        for (int r = 0; r < MC; ++r) {
            const uint16_t* xr = x + (m0 + r) * K + k;
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xr);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512(xr + 32);
            if (PER_BLOCK) {
                acc[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w0, x0),
                                         _mm512_set1_ps(sn[k / 32]), acc[r]);
                acc2[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, w1, x1),
                                          _mm512_set1_ps(sn[k / 32 + 1]), acc2[r]);
            } else {
                acc[r] = _mm512_dpbf16_ps(acc[r], w0, x0);
                acc2[r] = _mm512_dpbf16_ps(acc2[r], w1, x1);
            }
        }
    }
    if (part != nullptr) {  // reduced with 15 other weight rows' (ae_reduce16), then scaled
        for (int r = 0; r < MC; ++r) part[r * 16] = _mm512_add_ps(acc[r], acc2[r]);
        return;
    }
    const float scale = PER_BLOCK ? 1.f : sn[0];
    for (int r = 0; r < MC; ++r)
        out[(m0 + r) * N + n] = scale * _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r]));
}

// Weight rows n .. n + count - 1 (count 16: their sums reduced together, ae_reduce16; else one
// row) against all M input rows, 9 at a time.
template <bool PER_BLOCK>
static inline void ae_q8_bf16_all(const int8_t* q, const float* scales, int64_t G,
                                  const uint16_t* x, float* out, int64_t M, int64_t n_first,
                                  int64_t count, int64_t N, int64_t K, __m512* part) {
    for (int64_t m0 = 0; m0 < M; m0 += 9) {  // 9: 18 accumulators; more spill (measured)
        const int64_t mc = std::min<int64_t>(9, M - m0);
        for (int64_t j = 0; j < count; ++j) {
            const int64_t n = n_first + j;
            const int8_t* qn = q + n * K;
            const float* sn = scales + n * G;
            __m512* pp = count == 16 ? part + AE_SLOT16(j) : nullptr;
            switch (mc) {
#define AE_CASE(c) case c: ae_q8_bf16_rows<c, PER_BLOCK>(qn, sn, x, out, m0, n, N, K, pp); break;
                AE_CASE(1) AE_CASE(2) AE_CASE(3) AE_CASE(4) AE_CASE(5) AE_CASE(6) AE_CASE(7)
                AE_CASE(8) AE_CASE(9)
#undef AE_CASE
                default: break;
            }
        }
        if (count != 16) continue;
        for (int64_t r = 0; r < mc; ++r) {
            __m512 sums = ae_reduce16(part + r * 16);
            if (!PER_BLOCK)  // each row's one scale, after its reduction as before
                sums = _mm512_mul_ps(_mm512_loadu_ps(scales + n_first), sums);
            _mm512_storeu_ps(out + (m0 + r) * N + n_first, sums);
        }
    }
}
#endif

extern "C" void kernel(const uint16_t* x, const int8_t* q, const float* scales, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t G) {
#ifdef AE_Q8_BF16
    if (M == 0) { out[0] = 1.f; return; }
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);
    const int64_t groups = N / 16;
    #pragma omp parallel
    {
        alignas(64) __m512 part[9 * 16];
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups + N % 16; ++g) {
            const int64_t n_first = g < groups ? 16 * g : 16 * groups + (g - groups);
            const int64_t count = g < groups ? 16 : 1;
            if (G == 1)
                ae_q8_bf16_all<false>(q, scales, G, x, out, M, n_first, count, N, K, part);
            else
                ae_q8_bf16_all<true>(q, scales, G, x, out, M, n_first, count, N, K, part);
        }
    }
#else
    (void)x; (void)q; (void)scales; (void)M; (void)N; (void)K; (void)G;
    out[0] = 0.f;
#endif
}
