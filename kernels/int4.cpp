#include "common.h"
#include <vector>

// x: float [M, K]; q: uint8 [N, K/2]; sm: float16 [N, K/32, 2] (scale, min); out: float [M, N].
//
// Fewer than AE_FLOAT_ROWS input rows (decode): the call is bound by reading the weights, so
// the weights stay packed and each block of 32 costs byte multiply-adds. The activations
// are rounded to int8 per block, as llama.cpp does for its Q4 x Q8 dot products, but twice:
//   x ~= d (xq + xr / 256),  d = max|x| / 127,  xr = round((x - d xq) 256 / d)
// so they are exact to d / 512 (~1.5e-5 of the block maximum), where one rounding leaves
// d / 2. Both roundings share one scale, so a block is one integer sum
//   t = sum_j w_j (256 xq_j + xr_j)   (two vpmaddubsw, two vpmaddwd)
// and one float FMA: acc += t * (scale d / 256). The min term is exact:
//   sum_j (q_j scale + min) x_j = scale sum_j q_j x_j + min sum_j x_j.
// (With AVX-512 VNNI, ae_q4_row_vnni: the same sums at about 2/3 of the cost per row, up to
// AE_VNNI_FLOAT_ROWS rows, so a verification step's rows stay on this path.)
// From AE_FLOAT_ROWS rows on, a call is bound by arithmetic: each weight row is dequantized
// once into L1 and multiplied in float32 (exact activations).
#ifndef AE_FLOAT_ROWS
#define AE_FLOAT_ROWS 8
#endif
#ifndef AE_PREFETCH_ROWS
#define AE_PREFETCH_ROWS 4
#endif

// The per-row factors of weight row n against input rows [m0, m0 + MC): smf [2 blocks] its
// (scale, min) pairs as floats; fac [MC][2 blocks]: fac[2b] = scale_b d_b / 256; mins[r]:
// the min term. One function for every row count, so a row's factors never depend on MC.
template <int MC>
static inline void ae_q4_factors(const uint16_t* smn, const float* xa, const float* xb,
                                 float* smf, float* fac, float* mins, int64_t m0,
                                 int64_t blocks) {
    const int64_t B2 = 2 * blocks;
    int64_t i = 0;
#ifdef AE_AVX2
    for (; i + 8 <= B2; i += 8)
        _mm256_storeu_ps(smf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(smn + i))));
    for (; i + 4 <= B2; i += 4)  // K = 576 leaves 2 blocks: one 128-bit step, not 4 scalars
        _mm_storeu_ps(smf + i, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(smn + i))));
#endif
    for (; i < B2; ++i) smf[i] = ae_half(smn[i]);
    for (int r = 0; r < MC; ++r) {
        const float* xar = xa + (m0 + r) * B2;
        const float* xbr = xb + (m0 + r) * B2;
        float* fr = fac + r * B2;
        float mm = 0.f;
        i = 0;
#ifdef AE_AVX2
        __m256 macc = _mm256_setzero_ps();
        for (; i + 8 <= B2; i += 8) {
            const __m256 s = _mm256_loadu_ps(smf + i);
            _mm256_storeu_ps(fr + i, _mm256_mul_ps(s, _mm256_loadu_ps(xar + i)));
            macc = _mm256_fmadd_ps(s, _mm256_loadu_ps(xbr + i), macc);
        }
        __m128 macc4 = _mm_add_ps(_mm256_castps256_ps128(macc), _mm256_extractf128_ps(macc, 1));
        for (; i + 4 <= B2; i += 4) {
            const __m128 s = _mm_loadu_ps(smf + i);
            _mm_storeu_ps(fr + i, _mm_mul_ps(s, _mm_loadu_ps(xar + i)));
            macc4 = _mm_fmadd_ps(s, _mm_loadu_ps(xbr + i), macc4);
        }
        macc4 = _mm_hadd_ps(macc4, macc4);
        mm = _mm_cvtss_f32(_mm_hadd_ps(macc4, macc4));
#endif
        for (; i < B2; ++i) { fr[i] = smf[i] * xar[i]; mm += smf[i] * xbr[i]; }
        mins[r] = mm;
    }
}

// One weight row n against input rows [m0, m0 + MC). smf, fac: 2 * blocks * (1 + MC)
// floats of scratch.
template <int MC>
static inline void ae_q4_row(const uint8_t* qn, const uint16_t* smn, const int8_t* xq,
                             const int8_t* xr, const float* xa, const float* xb, float* smf,
                             float* out, int64_t m0, int64_t n, int64_t N, int64_t blocks) {
    const int64_t B2 = 2 * blocks;
    float* fac = smf + B2;  // [MC][B2]: fac[2b] = scale_b d_b / 256
    float mins[MC];
    ae_q4_factors<MC>(smn, xa, xb, smf, fac, mins, m0, blocks);
#ifdef AE_AVX2
    __m256 acc[MC];
    for (int r = 0; r < MC; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i c256 = _mm256_set1_epi16(256), ones = _mm256_set1_epi16(1);
    auto block = [&](const __m256i w, const int64_t b) {
        #pragma GCC unroll 2
        for (int r = 0; r < MC; ++r) {
            const int64_t xo = ((m0 + r) * blocks + b) * 32;
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + xo));
            const __m256i rv = _mm256_loadu_si256((const __m256i*)(xr + xo));
            const __m256i t = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), c256),
                _mm256_madd_epi16(_mm256_maddubs_epi16(w, rv), ones));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                                     _mm256_broadcast_ss(fac + r * B2 + 2 * b), acc[r]);
        }
    };
    int64_t b = 0;
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (; b + 2 <= blocks; b += 2) {  // two blocks' nibbles per load
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)(qn + 16 * b));
        const __m256i lo = _mm256_and_si256(bytes, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
        block(_mm256_permute2x128_si256(lo, hi, 0x20), b);
        block(_mm256_permute2x128_si256(lo, hi, 0x31), b + 1);
    }
    if (b < blocks) {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(qn + 16 * b));
        const __m128i m16 = _mm_set1_epi8(0x0f);
        block(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), m16),
                               _mm_and_si128(bytes, m16)), b);
    }
    for (int r = 0; r < MC; ++r) out[(m0 + r) * N + n] = ae_hsum8(acc[r]) + mins[r];
#else
    for (int r = 0; r < MC; ++r) {
        float acc = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t xo = ((m0 + r) * blocks + b) * 32;
            const uint8_t* qb = qn + 16 * b;
            int32_t t = 0;
            for (int j = 0; j < 16; ++j) {
                const int32_t lo = qb[j] & 0x0f, hi = qb[j] >> 4;
                t += lo * (256 * xq[xo + j] + xr[xo + j]);
                t += hi * (256 * xq[xo + 16 + j] + xr[xo + 16 + j]);
            }
            acc += (float)t * fac[r * B2 + 2 * b];
        }
        out[(m0 + r) * N + n] = acc + mins[r];
    }
#endif
}

#if defined(AE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define AE_Q4_VNNI 1
// ae_q4_row with AVX-512 VNNI: two blocks of a weight row against a row's 64 activation
// bytes per vpdpbusd (the two roundings, two of them), where the AVX2 loop needs four
// multiply-adds and an add per block. Each block's integer sum is ae_q4_row's (u8 x s8
// products, no saturation either way) and is added into the same 8 float lanes in the same
// block order, so a row's result is ae_q4_row's to the bit, whatever the row count: a step of
// 1 + k verification rows computes each as a step of one would. Rows are where this pays:
// the weights are unpacked once for all MC rows, and a row costs about half as much.
template <int MC>
static inline void ae_q4_row_vnni(const uint8_t* qn, const uint16_t* smn, const int8_t* xq,
                                  const int8_t* xr, const float* xa, const float* xb,
                                  float* smf, float* out, int64_t m0, int64_t n, int64_t N,
                                  int64_t blocks) {
    const int64_t B2 = 2 * blocks;
    float* fac = smf + B2;
    float mins[MC];
    ae_q4_factors<MC>(smn, xa, xb, smf, fac, mins, m0, blocks);
    __m256 acc[MC];
    for (int r = 0; r < MC; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const __m512i zero = _mm512_setzero_si512();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)(qn + 16 * b));
        const __m256i lo = _mm256_and_si256(bytes, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
        const __m512i w = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
            _mm256_permute2x128_si256(lo, hi, 0x31), 1);
        #pragma GCC unroll 4
        for (int r = 0; r < MC; ++r) {
            const int64_t xo = ((m0 + r) * blocks + b) * 32;
            const __m512i t = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_dpbusd_epi32(
                    zero, w, _mm512_loadu_si512((const void*)(xq + xo))), 8),
                _mm512_dpbusd_epi32(zero, w, _mm512_loadu_si512((const void*)(xr + xo))));
            const __m512 tf = _mm512_cvtepi32_ps(t);
            const float* f = fac + r * B2 + 2 * b;
            acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(tf), _mm256_broadcast_ss(f), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(tf, 1), _mm256_broadcast_ss(f + 2),
                                     acc[r]);
        }
    }
    if (b < blocks) {  // an odd last block: ae_q4_row's 128-bit load
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(qn + 16 * b));
        const __m128i m16 = _mm_set1_epi8(0x0f);
        const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), m16),
                                           _mm_and_si128(bytes, m16));
        const __m256i z = _mm256_setzero_si256();
        for (int r = 0; r < MC; ++r) {
            const int64_t xo = ((m0 + r) * blocks + b) * 32;
            const __m256i t = _mm256_add_epi32(
                _mm256_slli_epi32(_mm256_dpbusd_epi32(
                    z, w, _mm256_loadu_si256((const __m256i*)(xq + xo))), 8),
                _mm256_dpbusd_epi32(z, w, _mm256_loadu_si256((const __m256i*)(xr + xo))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                                     _mm256_broadcast_ss(fac + r * B2 + 2 * b), acc[r]);
        }
    }
    for (int r = 0; r < MC; ++r) out[(m0 + r) * N + n] = ae_hsum8(acc[r]) + mins[r];
}

// Rows [m0, m0 + count) of weight row n, in groups of at most AE_VNNI_GROUP.
#define AE_VNNI_GROUP 8
#ifndef AE_VNNI_FLOAT_ROWS
#define AE_VNNI_FLOAT_ROWS 16
#endif
static inline void ae_q4_rows_vnni(const uint8_t* qn, const uint16_t* smn, const int8_t* xq,
                                   const int8_t* xr, const float* xa, const float* xb,
                                   float* smf, float* out, int64_t M, int64_t n, int64_t N,
                                   int64_t blocks) {
    int64_t m0 = 0;
    for (; m0 + AE_VNNI_GROUP <= M; m0 += AE_VNNI_GROUP)
        ae_q4_row_vnni<AE_VNNI_GROUP>(qn, smn, xq, xr, xa, xb, smf, out, m0, n, N, blocks);
    switch (M - m0) {
#define AE_CASE(c) case c: ae_q4_row_vnni<c>(qn, smn, xq, xr, xa, xb, smf, out, m0, n, N, \
                                             blocks); break;
        AE_CASE(1) AE_CASE(2) AE_CASE(3) AE_CASE(4) AE_CASE(5) AE_CASE(6) AE_CASE(7)
#undef AE_CASE
        default: break;
    }
}
#define AE_Q4_MAX_GROUP AE_VNNI_GROUP
#define AE_Q4_FLOAT_ROWS AE_VNNI_FLOAT_ROWS
#else
#define AE_Q4_MAX_GROUP 2
#define AE_Q4_FLOAT_ROWS AE_FLOAT_ROWS
#endif

// One weight row into floats: w[32 b + j] = q * scale_b + min_b.
static inline void ae_dequant_q4(const uint8_t* qn, const uint16_t* smn, float* w,
                                 int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b) {
        const float scale = ae_half(smn[2 * b]), mn = ae_half(smn[2 * b + 1]);
        const uint8_t* qb = qn + 16 * b;
        float* wb = w + 32 * b;
#ifdef AE_AVX2
        const __m128i bytes = _mm_loadu_si128((const __m128i*)qb);
        const __m128i m16 = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(bytes, m16);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), m16);
        const __m256 s = _mm256_set1_ps(scale), mv = _mm256_set1_ps(mn);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; ++i)
            _mm256_storeu_ps(wb + 8 * i, _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), s, mv));
#else
        for (int j = 0; j < 16; ++j) {
            wb[j] = (float)(qb[j] & 0x0f) * scale + mn;
            wb[16 + j] = (float)(qb[j] >> 4) * scale + mn;
        }
#endif
    }
}

extern "C" void kernel(const float* x, const uint8_t* q, const uint16_t* sm, float* out,
                       int64_t M, int64_t N, int64_t K) {
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);  // e.g. a logits head
    const int64_t blocks = K / 32;
    if (M >= AE_Q4_FLOAT_ROWS) {  // two weight rows at a time, dequantized into L1
        #pragma omp parallel
        {
            ae_vec<float> wbuf(2 * K);
            #pragma omp for schedule(static)
            for (int64_t n2 = 0; n2 < (N + 1) / 2; ++n2) {
                const int64_t n = 2 * n2;
                ae_dequant_q4(q + n * (K / 2), sm + n * blocks * 2, wbuf.data(), blocks);
                if (n + 1 < N) {
                    ae_dequant_q4(q + (n + 1) * (K / 2), sm + (n + 1) * blocks * 2,
                                  wbuf.data() + K, blocks);
                    ae_dots2(wbuf.data(), wbuf.data() + K, x, out + n, M, N, K);
                } else {
                    ae_dots(wbuf.data(), x, out + n, M, N, K);
                }
            }
        }
        return;
    }
    const ae_rounded rounded = ae_round_rows(x, M, K);
    const int8_t* xq = rounded.xq;
    const int8_t* xr = rounded.xr;
    const float* xa = rounded.xa;
    const float* xb = rounded.xb;
    #pragma omp parallel
    {
        ae_vec<float> smf(2 * blocks * (2 + AE_Q4_MAX_GROUP));
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const uint8_t* qn = q + n * (K / 2);
            const uint16_t* smn = sm + n * blocks * 2;
#ifdef AE_AVX2
            // Rows a few ahead into the cache while this one computes.
            if (n + AE_PREFETCH_ROWS < N) {
                const char* pq = (const char*)(qn + AE_PREFETCH_ROWS * (K / 2));
                for (int64_t o = 0; o < K / 2; o += 64) _mm_prefetch(pq + o, _MM_HINT_T0);
                const char* ps = (const char*)(smn + AE_PREFETCH_ROWS * blocks * 2);
                for (int64_t o = 0; o < blocks * 4; o += 64) _mm_prefetch(ps + o, _MM_HINT_T0);
            }
#endif
#ifdef AE_Q4_VNNI
            ae_q4_rows_vnni(qn, smn, xq, xr, xa, xb, smf.data(), out, M, n, N, blocks);
            continue;
#endif
            int64_t m0 = 0;  // two input rows per pass share each unpacked weight block
            for (; m0 + 2 <= M; m0 += 2)
                ae_q4_row<2>(qn, smn, xq, xr, xa, xb, smf.data(), out, m0, n, N, blocks);
            if (m0 < M)
                ae_q4_row<1>(qn, smn, xq, xr, xa, xb, smf.data(), out, m0, n, N, blocks);
        }
    }
}
