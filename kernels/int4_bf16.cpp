#include "common.h"
#include <vector>

// x: bfloat16 [M, K]; q: uint8 [N, K/2]; sm: float16 [N, K/32, 2] (scale, min); out: float
// [M, N]. int4.cpp's weights against bfloat16 activations, for CPUs with AVX-512 BF16 (and
// VBMI's word permutes, AVX-512 BW): the bfloat16 model's decode and verification rows.
//
// Per two blocks of a weight row, the 16 values a nibble can stand for in each block,
// q * scale + min (float32 FMA, rounded once to bfloat16), make a 32-entry table, and one
// vpermw per 32 nibbles looks the weights up: the weights are unpacked once per weight row,
// whatever the row count. Each input row then costs one vdpbf16ps per 32 weights (float32
// sums of bfloat16 products), where the byte path (int4.cpp) costs two roundings and about
// six operations: a verification step of 1 + k rows costs little more than one row.
//
// Every row's sum runs in the same order for any M (16 float lanes over the blocks, then one
// reduction, 16 weight rows' at a time: ae_reduce16, the same additions as one at a time), so
// a row's result does not depend on the rows beside it: greedy output is the same with and
// without speculative decoding. The weights' order inside a pair of blocks is
// the lookup's: the activations are reordered to it once per call (``ae_bf16_order``).
//
// M == 0 is a query: out[0] = 1 where the AVX-512 path is compiled in, else 0 (the caller
// then takes int4.cpp's path).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define AE_Q4_BF16 1

// Row r's activations of blocks (b, b + 1) in lookup order: b's 0-15, b+1's 0-15 (the low
// nibbles), b's 16-31, b+1's 16-31 (the high ones).
static inline void ae_bf16_order(const uint16_t* x, uint16_t* xo, int64_t M, int64_t K) {
    for (int64_t r = 0; r < M; ++r) {
        const uint16_t* s = x + r * K;
        uint16_t* d = xo + r * K;
        for (int64_t k = 0; k < K; k += 64) {
            std::memcpy(d + k, s + k, 32);
            std::memcpy(d + k + 16, s + k + 32, 32);
            std::memcpy(d + k + 32, s + k + 16, 32);
            std::memcpy(d + k + 48, s + k + 48, 32);
        }
    }
}

template <int MC>
static inline void ae_q4_bf16_rows(const uint8_t* qn, const float* smf, const uint16_t* xo,
                                   float* out, int64_t m0, int64_t n, int64_t N, int64_t K,
                                   __m512* part) {
    __m512 acc[MC], acc2[MC];  // two chains a row: the low and the high nibbles' weights
    for (int r = 0; r < MC; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // word i of the second block of a pair looks at table entries 16-31
    const __m512i upper = _mm512_inserti64x4(_mm512_setzero_si512(),
                                             _mm256_set1_epi16(16), 1);
    const __m512i m0f = _mm512_set1_epi16(0x0f);
    for (int64_t k = 0; k < K; k += 64) {
        const int64_t b = k / 32;
        const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(smf[2 * b]),
                                          _mm512_set1_ps(smf[2 * b + 1]));
        const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(smf[2 * b + 2]),
                                          _mm512_set1_ps(smf[2 * b + 3]));
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);  // [b's 16 | b+1's 16]
        if (MC >= 2)  // common.h: AE_PREFETCH_ROWS
            _mm_prefetch((const char*)(qn + AE_PREFETCH_ROWS * (K / 2) + k / 2), _MM_HINT_T0);
        const __m512i words = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256((const __m256i*)(qn + k / 2)));
        // (words & 0x0f) | upper, (words >> 4) | upper  (0xf8: a | (b & c))
        const __m512i lo = _mm512_ternarylogic_epi32(upper, words, m0f, 0xf8);
        const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(words, 4), upper);
        const __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(lo, table);
        const __m512bh wh = (__m512bh)_mm512_permutexvar_epi16(hi, table);
        #pragma GCC unroll 12
        for (int r = 0; r < MC; ++r) {
            const uint16_t* xr = xo + (m0 + r) * K + k;
            acc[r] = _mm512_dpbf16_ps(acc[r], wl, (__m512bh)_mm512_loadu_si512(xr));
            acc2[r] = _mm512_dpbf16_ps(acc2[r], wh, (__m512bh)_mm512_loadu_si512(xr + 32));
        }
    }
    if (part == nullptr) {
        for (int r = 0; r < MC; ++r)
            out[(m0 + r) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r]));
    } else {  // reduced with 15 other weight rows' (ae_reduce16): the same sums
        for (int r = 0; r < MC; ++r) part[r * 16] = _mm512_add_ps(acc[r], acc2[r]);
    }
}
#endif

extern "C" void kernel(const uint16_t* x, const uint8_t* q, const uint16_t* sm, float* out,
                       int64_t M, int64_t N, int64_t K) {
#ifdef AE_Q4_BF16
    if (M == 0) { out[0] = 1.f; return; }
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);
    static thread_local ae_vec<uint16_t> xbuf;
    if ((int64_t)xbuf.size() < M * K) xbuf.resize(M * K);
    ae_bf16_order(x, xbuf.data(), M, K);
    const uint16_t* xo = xbuf.data();
    const int64_t blocks = K / 32;
    const int64_t groups = N / 16;
    #pragma omp parallel
    {
        ae_vec<float> smf(16 * 2 * blocks);  // a group's scales and mins, as floats
        alignas(64) __m512 part[12 * 16];
        // Groups of 16 weight rows, whose sums are reduced together (ae_reduce16), then the
        // N % 16 rows left one at a time. Up to 12 input rows per pass over a weight row.
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups + N % 16; ++g) {
            const int64_t n_first = g < groups ? 16 * g : 16 * groups + (g - groups);
            const int64_t count = g < groups ? 16 : 1;
            {  // once per group, whatever the number of passes over its rows
                const uint16_t* smn = sm + n_first * blocks * 2;
                if (M >= 2)  // the next group's
                    for (int64_t p = 0; p < count * 2 * blocks; p += 32)  // 64 bytes
                        _mm_prefetch((const char*)(smn + 16 * blocks * 2 + p), _MM_HINT_T0);
                const int64_t total = count * 2 * blocks;
                int64_t i = 0;
                for (; i + 16 <= total; i += 16)
                    _mm512_storeu_ps(smf.data() + i, _mm512_cvtph_ps(
                        _mm256_loadu_si256((const __m256i*)(smn + i))));
                for (; i < total; ++i) smf[i] = _cvtsh_ss(smn[i]);
            }
            for (int64_t m0 = 0; m0 < M; m0 += 12) {
                const int64_t mc = std::min<int64_t>(12, M - m0);
                for (int64_t j = 0; j < count; ++j) {
                    const int64_t n = n_first + j;
                    const float* smj = smf.data() + j * 2 * blocks;
                    const uint8_t* qn = q + n * (K / 2);
                    __m512* pp = count == 16 ? part + AE_SLOT16(j) : nullptr;
                    switch (mc) {
#define AE_CASE(c) case c: ae_q4_bf16_rows<c>(qn, smj, xo, out, m0, n, N, K, pp); break;
                        AE_CASE(1) AE_CASE(2) AE_CASE(3) AE_CASE(4) AE_CASE(5) AE_CASE(6)
                        AE_CASE(7) AE_CASE(8) AE_CASE(9) AE_CASE(10) AE_CASE(11) AE_CASE(12)
#undef AE_CASE
                        default: break;
                    }
                }
                if (count == 16)
                    for (int64_t r = 0; r < mc; ++r)
                        _mm512_storeu_ps(out + (m0 + r) * N + n_first,
                                         ae_reduce16(part + r * 16));
            }
        }
    }
#else
    (void)x; (void)q; (void)sm; (void)M; (void)N; (void)K;
    out[0] = 0.f;
#endif
}
