#include "common.h"
#include <vector>

// One weight row into floats: w[k] = q[k] * scale of k's group.
static inline void ae_dequant_q8(const int8_t* qn, const float* sn, float* w, int64_t K,
                                 int64_t group) {
    for (int64_t g = 0; g < K / group; ++g) {
        const float scale = sn[g];
        const int64_t k0 = g * group;
#ifdef AE_AVX2
        const __m256 s = _mm256_set1_ps(scale);
        for (int64_t k = k0; k < k0 + group; k += 8) {
            const __m128i b = _mm_loadl_epi64((const __m128i*)(qn + k));
            _mm256_storeu_ps(w + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
        }
#else
        for (int64_t k = k0; k < k0 + group; ++k) w[k] = (float)qn[k] * scale;
#endif
    }
}

// One weight row n against input row m (rounded by ae_quantize_rows): per block of 32,
//   t = sum_j w_j (256 xq_j + xr_j)  (vpmaddubsw needs an unsigned operand: |w| times x
//   with w's sign), acc += t * (scale d / 256).
// |w| <= 127 and |x| <= 128 keep every pair sum inside int16.
// PER_BLOCK: a scale per block of 32 (GGUF's Q8_0), else one per row (per channel).
template <bool PER_BLOCK>
static inline float ae_q8_dot(const int8_t* qn, const float* sn, const int8_t* xq,
                              const int8_t* xr, const float* xa, int64_t blocks) {
#ifdef AE_AVX2
    __m256 acc = _mm256_setzero_ps();
    const __m256i c256 = _mm256_set1_epi16(256), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; ++b) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(qn + 32 * b));
        const __m256i aw = _mm256_sign_epi8(w, w);
        const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(xq + 32 * b)), w);
        const __m256i rv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(xr + 32 * b)), w);
        const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), c256),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(aw, rv), ones));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                              _mm256_set1_ps(sn[PER_BLOCK ? b : 0] * xa[2 * b]), acc);
    }
    return ae_hsum8(acc);
#else
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
        int32_t t = 0;
        for (int j = 0; j < 32; ++j)
            t += (int32_t)qn[32 * b + j] * (256 * xq[32 * b + j] + xr[32 * b + j]);
        acc += (float)t * sn[PER_BLOCK ? b : 0] * xa[2 * b];
    }
    return acc;
#endif
}

#if defined(AE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define AE_Q8_VNNI 1
// Several input rows against weight row n with AVX-512 VNNI, two blocks per vpdpbusd: its
// unsigned operand is the activations plus 128 (xu = x ^ 0x80, made once per call), and
// 128 sum(w) per lane, once per weight block, takes the offset out again. Each block's
// integer sum is ae_q8_dot's, added into the same 8 float lanes with the same factor in the
// same block order: each row's result is ae_q8_dot's to the bit, whatever the row count.
template <int MC, bool PER_BLOCK>
static inline void ae_q8_rows_vnni(const int8_t* qn, const float* sn, const uint8_t* xqu,
                                   const uint8_t* xru, const float* xa, float* out, int64_t m0,
                                   int64_t n, int64_t N, int64_t K) {
    const int64_t blocks = K / 32;
    __m256 acc[MC];
    for (int r = 0; r < MC; ++r) acc[r] = _mm256_setzero_ps();
    const __m512i zero = _mm512_setzero_si512(), c128 = _mm512_set1_epi8((char)0x80);
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        const __m512i w = _mm512_loadu_si512((const void*)(qn + 32 * b));
        // 257 * 128 * sum(w) per lane: the offsets of both roundings (256 xq + xr).
        const __m512i off = _mm512_mullo_epi32(_mm512_dpbusd_epi32(zero, c128, w),
                                               _mm512_set1_epi32(257));
        const float s0 = sn[PER_BLOCK ? b : 0], s1 = sn[PER_BLOCK ? b + 1 : 0];
        #pragma GCC unroll 4
        for (int r = 0; r < MC; ++r) {
            const int64_t xo = (m0 + r) * K + 32 * b;
            const __m512i t = _mm512_sub_epi32(_mm512_add_epi32(
                _mm512_slli_epi32(_mm512_dpbusd_epi32(
                    zero, _mm512_loadu_si512((const void*)(xqu + xo)), w), 8),
                _mm512_dpbusd_epi32(zero, _mm512_loadu_si512((const void*)(xru + xo)), w)),
                off);
            const __m512 tf = _mm512_cvtepi32_ps(t);
            const float* xar = xa + 2 * (m0 + r) * blocks;
            acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(tf),
                                     _mm256_set1_ps(s0 * xar[2 * b]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(tf, 1),
                                     _mm256_set1_ps(s1 * xar[2 * b + 2]), acc[r]);
        }
    }
    if (b < blocks) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(qn + 32 * b));
        const __m256i z = _mm256_setzero_si256();
        const __m256i off = _mm256_mullo_epi32(
            _mm256_dpbusd_epi32(z, _mm256_set1_epi8((char)0x80), w), _mm256_set1_epi32(257));
        const float s0 = sn[PER_BLOCK ? b : 0];
        for (int r = 0; r < MC; ++r) {
            const int64_t xo = (m0 + r) * K + 32 * b;
            const __m256i t = _mm256_sub_epi32(_mm256_add_epi32(
                _mm256_slli_epi32(_mm256_dpbusd_epi32(
                    z, _mm256_loadu_si256((const __m256i*)(xqu + xo)), w), 8),
                _mm256_dpbusd_epi32(z, _mm256_loadu_si256((const __m256i*)(xru + xo)), w)),
                off);
            const float* xar = xa + 2 * (m0 + r) * blocks;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(s0 * xar[2 * b]),
                                     acc[r]);
        }
    }
    for (int r = 0; r < MC; ++r) out[(m0 + r) * N + n] = ae_hsum8(acc[r]);
}

template <bool PER_BLOCK>
static inline void ae_q8_all_rows_vnni(const int8_t* qn, const float* sn, const uint8_t* xqu,
                                       const uint8_t* xru, const float* xa, float* out,
                                       int64_t M, int64_t n, int64_t N, int64_t K) {
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8)
        ae_q8_rows_vnni<8, PER_BLOCK>(qn, sn, xqu, xru, xa, out, m0, n, N, K);
    switch (M - m0) {
#define AE_CASE(c) case c: ae_q8_rows_vnni<c, PER_BLOCK>(qn, sn, xqu, xru, xa, out, m0, n, N, \
                                                         K); break;
        AE_CASE(1) AE_CASE(2) AE_CASE(3) AE_CASE(4) AE_CASE(5) AE_CASE(6) AE_CASE(7)
#undef AE_CASE
        default: break;
    }
}
#define AE_Q8_BYTE_ROWS 16
#else
#define AE_Q8_BYTE_ROWS 8
#endif

// x: float [M, K]; q: int8 [N, K]; scales: float [N, K/group]; out: float [M, N].
// Fewer than AE_Q8_BYTE_ROWS input rows (8; 16 with AVX-512 VNNI, whose rows cost about half;
// decode, verification rows), a scale per block of 32 or per row: byte dot products against the rounded activations, as in int4.cpp. Otherwise each
// weight row is dequantized into L1 and multiplied in float32; from 4 input rows on, two
// weight rows at a time share each input load.
extern "C" void kernel(const float* x, const int8_t* q, const float* scales, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t group) {
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);  // e.g. a logits head
    const int64_t groups = K / group;
    if (M < AE_Q8_BYTE_ROWS && (group == 32 || group == K) && K % 32 == 0) {
        const int64_t blocks = K / 32;
        const ae_rounded rows = ae_round_rows(x, M, K);
        const int8_t* xq = rows.xq;
        const int8_t* xr = rows.xr;
        const float* xa = rows.xa;
#ifdef AE_Q8_VNNI
        if (M > 1) {  // several rows (a batch, or verification rows): VNNI, same results
            static thread_local ae_vec<uint8_t> xu;
            if ((int64_t)xu.size() < 2 * M * K) xu.resize(2 * M * K);
            for (int64_t i = 0; i < 2 * M * K; ++i) xu[i] = (uint8_t)(xq[i] ^ 0x80);
            const uint8_t* xqu = xu.data();
            const uint8_t* xru = xu.data() + M * K;  // xr follows xq in ae_round_rows
            #pragma omp parallel for schedule(static)
            for (int64_t n = 0; n < N; ++n) {
                if (group == 32)
                    ae_q8_all_rows_vnni<true>(q + n * K, scales + n * groups, xqu, xru, xa,
                                              out, M, n, N, K);
                else
                    ae_q8_all_rows_vnni<false>(q + n * K, scales + n * groups, xqu, xru, xa,
                                               out, M, n, N, K);
            }
            return;
        }
#endif
        #pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const int8_t* qn = q + n * K;
#ifdef AE_AVX2
            if (n + 4 < N) {  // a few rows ahead into the cache
                const char* p = (const char*)(qn + 4 * K);
                for (int64_t o = 0; o < K; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
            }
#endif
            for (int64_t m = 0; m < M; ++m)
                out[m * N + n] = group == 32
                    ? ae_q8_dot<true>(qn, scales + n * groups, xq + m * K, xr + m * K,
                                      xa + 2 * m * blocks, blocks)
                    : ae_q8_dot<false>(qn, scales + n * groups, xq + m * K, xr + m * K,
                                       xa + 2 * m * blocks, blocks);
        }
        return;
    }
    const int64_t step = M >= 4 ? 2 : 1;
    #pragma omp parallel
    {
        ae_vec<float> wbuf(2 * K);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < (N + step - 1) / step; ++i) {
            const int64_t n = i * step;
            ae_dequant_q8(q + n * K, scales + n * groups, wbuf.data(), K, group);
            if (step == 2 && n + 1 < N) {
                ae_dequant_q8(q + (n + 1) * K, scales + (n + 1) * groups, wbuf.data() + K, K,
                              group);
                ae_dots2(wbuf.data(), wbuf.data() + K, x, out + n, M, N, K);
            } else {
                ae_dots(wbuf.data(), x, out + n, M, N, K);
            }
        }
    }
}
