#include "common.h"
#include "kquant.h"
#include <vector>

// Input rows up to which Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K take the byte
// dot products (the Python side sends fewer than kquants.TILE_ROWS = 8 rows here).
#define AE_SMALL_ROWS 8
#include "kquant_small.h"

#ifdef AE_AVX2
// The 32 quants of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block as bytes in element order (0..31): low
// nibbles then high nibbles, the fifth bit (0x10) of element j from bit j of qh.
static inline __m256i kq_quants32(const uint8_t* blk, int64_t type) {
    const bool has_min = type == KQ_Q4_1 || type == KQ_Q5_1;
    const bool five = type == KQ_Q5_0 || type == KQ_Q5_1;
    const __m128i bytes = _mm_loadu_si128(
        (const __m128i*)(blk + 2 + (has_min ? 2 : 0) + (five ? 4 : 0)));
    const __m128i m16 = _mm_set1_epi8(0x0f);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), m16),
                                 _mm_and_si128(bytes, m16));
    if (five) {
        uint32_t qh; std::memcpy(&qh, blk + (has_min ? 4 : 2), 4);
        // byte j <- byte j / 8 of qh, then its bit j % 8
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return q;
}

// Few input rows (decode) over Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: these blocks are all
// w = d q + m with q in [0, 31] (Q4_0: m = -8 d, Q5_0: m = -16 d) or, Q8_0, signed q and
// m = 0, so int4.cpp's / int8.cpp's byte dot products apply: the activations rounded to
// int8 per block, twice (x ~= dx (xq + xr / 256), exact to ~1.5e-5 of the block maximum,
// common.h), a block costs two vpmaddubsw and one FMA, and the min term is exact (m sum x).
static void kq_small_q32(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                         int64_t K, int64_t ldo, int64_t type, int64_t rb) {
    const int64_t blocks = K / 32, bb = rb / blocks;
    const ae_rounded rx = ae_round_rows(x, M, K);
    const bool has_min = type == KQ_Q4_1 || type == KQ_Q5_1;
    const float off = type == KQ_Q4_0 ? -8.f : type == KQ_Q5_0 ? -16.f : 0.f;
    const bool q8 = type == KQ_Q8_0;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = w + n * rb;
        __m256 acc[AE_SMALL_ROWS];
        float mins[AE_SMALL_ROWS];
        for (int64_t r = 0; r < M; ++r) { acc[r] = _mm256_setzero_ps(); mins[r] = 0.f; }
        const __m256i c256 = _mm256_set1_epi16(256), ones = _mm256_set1_epi16(1);
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* blk = row + b * bb;
            // Q8_0's signed quants: |q| times x with q's sign (vpmaddubsw wants one operand
            // unsigned; |q| <= 128 and |x| <= 127 keep the pair sums inside int16)
            const __m256i s8 = q8 ? _mm256_loadu_si256((const __m256i*)(blk + 2))
                                  : _mm256_setzero_si256();
            const __m256i q = q8 ? _mm256_sign_epi8(s8, s8) : kq_quants32(blk, type);
            const float d = kq_f16(blk), m = has_min ? kq_f16(blk + 2) : off * d;
            for (int64_t r = 0; r < M; ++r) {
                const int64_t i = r * blocks + b;
                __m256i xv = _mm256_loadu_si256((const __m256i*)(rx.xq + 32 * i));
                __m256i rv = _mm256_loadu_si256((const __m256i*)(rx.xr + 32 * i));
                if (q8) { xv = _mm256_sign_epi8(xv, s8); rv = _mm256_sign_epi8(rv, s8); }
                const __m256i t = _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), c256),
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q, rv), ones));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                                         _mm256_set1_ps(d * rx.xa[2 * i]), acc[r]);
                mins[r] += m * rx.xb[2 * i + 1];
            }
        }
        for (int64_t r = 0; r < M; ++r) out[r * ldo + n] = ae_hsum8(acc[r]) + mins[r];
    }
}
#endif

// out[m * ldo + n] = dot(x[m], dequant(w[n])) for a GGUF matrix kept as the file stores it:
// x float [M, K]; w: N rows of kq_row_bytes(type, K) bytes; out: float with row stride ldo
// (a part of a fused projection writes its own columns of the shared output).
//
// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K at few input rows: byte dot products
// over int8-rounded activations (kq_small_q32, kquant_small.h's kq_small_k; exact to that
// rounding, ~1.5e-5 of each block's maximum).
// Otherwise each weight row is dequantized once per call into a buffer that stays in L1
// (bit-exact, kquant.h) and multiplied in float32 against every input row; from two input
// rows on, two weight rows share each input load (ae_dots2). The weights
// are read once per call whatever M; the float path's results equal x @ dequant(w).T up to
// float32 summation order.
extern "C" void kernel(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                       int64_t K, int64_t ldo, int64_t type) {
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);
    const int64_t rb = kq_row_bytes(type, K);
    if (rb == 0) return;
#ifdef AE_AVX2
    if (M <= AE_SMALL_ROWS && (type == KQ_Q4_0 || type == KQ_Q4_1 || type == KQ_Q5_0
                               || type == KQ_Q5_1 || type == KQ_Q8_0)) {
        kq_small_q32(x, w, out, M, N, K, ldo, type, rb);
        return;
    }
    if (M <= AE_SMALL_ROWS && (type == KQ_Q4_K || type == KQ_Q5_K || type == KQ_Q6_K)) {
        kq_small_k(x, w, out, M, N, K, ldo, type, rb);
        return;
    }
#endif
    #pragma omp parallel
    {
        std::vector<float> buf(2 * K);
        if (M < 2) {
            #pragma omp for schedule(static)
            for (int64_t n = 0; n < N; ++n) {
                kq_dequant_row(type, w + n * rb, buf.data(), K);
                ae_dots(buf.data(), x, out + n, M, ldo, K);
            }
        } else {
            #pragma omp for schedule(static)
            for (int64_t n2 = 0; n2 < (N + 1) / 2; ++n2) {
                const int64_t n = 2 * n2;
                kq_dequant_row(type, w + n * rb, buf.data(), K);
                if (n + 1 < N) {
                    kq_dequant_row(type, w + (n + 1) * rb, buf.data() + K, K);
                    ae_dots2(buf.data(), buf.data() + K, x, out + n, M, ldo, K);
                } else {
                    ae_dots(buf.data(), x, out + n, M, ldo, K);
                }
            }
        }
    }
}
