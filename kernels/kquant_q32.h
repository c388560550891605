// Blocks of 32 (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0) for few input rows (decode) with AVX-512
// VNNI. Q5_0 is what most of a Q4_K_M file falls back to where a row length is not a multiple
// of 256 (Qwen2.5-0.5B's q/k/o/gate/up: hidden 896), about half of a batch-1 token, and Q8_0
// is its tied embedding and head, another quarter. Unpacking each block on its own, 256 bits
// at a time, with the scales stored to memory and read back as a vector (a store-forwarding
// stall per group), ran Q5_0 at ~16 GB/s on one Zen 5 core whether the weights streamed or
// sat in cache. Here the two blocks of a pair are unpacked together, in registers:
//   - their 2 x 16 bytes of nibbles as one 256-bit vector, the high nibbles shifted into the
//     upper half, one 128-bit lane shuffle into element order (b0 0..31, b1 0..31); Q8_0's
//     2 x 32 signed bytes as they are, |q| with x taking q's signs under a mask;
//   - Q5's 2 x 32 fifth bits as one 64-bit mask (the two qh words side by side), added as
//     0x10 under it;
//   - their two f16 scales (and Q4_1 / Q5_1's mins) converted together and spread over the
//     pair's 8 + 8 lanes.
// The arithmetic is the generic byte dot products' (kquant.cpp: activations rounded twice per
// block, common.h; w = d (q - off) as d q plus the exact -off d sum(x), or d q + m), and each
// input row's sums are formed the same way whatever the row count, so a row's result does not
// depend on the batch.
#pragma once
#include "kquant_small.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Byte sizes and offsets of the blocks of 32: the quants' offset qs, Q5's fifth bits' qh.
template <int TYPE>
struct kq_q32_layout {
    static constexpr bool has_min = TYPE == KQ_Q4_1 || TYPE == KQ_Q5_1;
    static constexpr bool five = TYPE == KQ_Q5_0 || TYPE == KQ_Q5_1;
    static constexpr int bb = TYPE == KQ_Q4_0 ? 18 : TYPE == KQ_Q4_1 ? 20 : TYPE == KQ_Q5_0 ? 22
                            : TYPE == KQ_Q5_1 ? 24 : 34;
    static constexpr int qs = 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
    static constexpr int qh = has_min ? 4 : 2;
};

// The unsigned quants of the Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks b0 and b1 as 64 bytes in
// element order (b0's 0..31, then b1's).
template <int TYPE>
static inline __m512i kq_pair_quants(const uint8_t* b0, const uint8_t* b1) {
    using L = kq_q32_layout<TYPE>;
    const __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(b0 + L::qs))),
        _mm_loadu_si128((const __m128i*)(b1 + L::qs)), 1);
    // 128-bit lanes: b0 0..15, b1 0..15, b0 16..31, b1 16..31 -> element order
    __m512i u = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
        _mm512_set1_epi8(0x0f));
    u = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));
    if (L::five) {
        uint32_t h0, h1;
        std::memcpy(&h0, b0 + L::qh, 4);
        std::memcpy(&h1, b1 + L::qh, 4);
        u = _mm512_mask_add_epi8(u, _cvtu64_mask64((uint64_t)h0 | ((uint64_t)h1 << 32)), u,
                                 _mm512_set1_epi8(0x10));
    }
    return u;
}
#endif

#ifdef AE_KQ512
template <int TYPE, int M>
static void kq_small_pairs(const float* x, const uint8_t* w, float* out, int64_t N, int64_t K,
                           int64_t ldo, int64_t rb) {
    constexpr bool q8 = TYPE == KQ_Q8_0;
    constexpr bool has_min = kq_q32_layout<TYPE>::has_min;
    constexpr int bb = kq_q32_layout<TYPE>::bb;
    // the min term: m sum(x) (Q4_1 / Q5_1), -off d sum(x) (Q4_0 / Q5_0), none (Q8_0)
    constexpr float off = TYPE == KQ_Q4_0 ? 8.f : TYPE == KQ_Q5_0 ? 16.f : 0.f;
    const int64_t blocks = K / 32, pairs = blocks / 2;
    const ae_rounded rx = ae_round_rows(x, M, K);
    // per input row: each pair's activation scales spread [dx(2p) x 8, dx(2p + 1) x 8] (dx =
    // the block's scale / 256), and each block's float sum of x
    static thread_local ae_vec<float> fs;
    const int64_t nd = M * (pairs + 1) * 16;
    if ((int64_t)fs.size() < nd + M * blocks) fs.resize(nd + M * blocks);
    float* DX = fs.data();
    float* SX = DX + nd;
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t i = r * blocks + b;
            float* dst = DX + (r * (pairs + 1) + b / 2) * 16 + 8 * (b % 2);
            for (int l = 0; l < 8; ++l) dst[l] = rx.xa[2 * i];
            SX[i] = rx.xb[2 * i + 1];
        }
    const __m512i zero = _mm512_setzero_si512();
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    auto halves = [](const uint8_t* b0, const uint8_t* b1, int at) {  // two f16 as floats
        uint16_t s0, s1;
        std::memcpy(&s0, b0 + at, 2);
        std::memcpy(&s1, b1 + at, 2);
        return _mm_cvtph_ps(_mm_cvtsi32_si128((int)(s0 | ((uint32_t)s1 << 16))));
    };
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = w + n * rb;
        __m512 acc[M];
        __m128 mn[M];  // lanes 0-1: the min term's sums, m sum(x) or d sum(x)
        #pragma GCC unroll 8
        for (int r = 0; r < M; ++r) { acc[r] = _mm512_setzero_ps(); mn[r] = _mm_setzero_ps(); }
        for (int64_t p = 0; p < pairs; ++p) {
            const uint8_t* b0 = row + 2 * bb * p;
            const uint8_t* b1 = b0 + bb;
            __m512i u;
            __mmask64 neg = 0;
            if (q8) {
                const __m512i q = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b0 + 2))),
                    _mm256_loadu_si256((const __m256i*)(b1 + 2)), 1);
                neg = _mm512_movepi8_mask(q);
                u = _mm512_abs_epi8(q);  // -128 -> 0x80, 128 as unsigned
            } else {
                u = kq_pair_quants<TYPE>(b0, b1);
            }
            const __m128 d2 = halves(b0, b1, 0);
            const __m128 m2 = has_min ? halves(b0, b1, 2) : d2;
            const __m512 D = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d2));
            #pragma GCC unroll 8
            for (int r = 0; r < M; ++r) {
                const int64_t i0 = r * blocks + 2 * p;
                __m512i xv = _mm512_loadu_si512(rx.xq + 32 * i0);
                __m512i rv = _mm512_loadu_si512(rx.xr + 32 * i0);
                if (q8) {
                    xv = _mm512_mask_sub_epi8(xv, neg, zero, xv);
                    rv = _mm512_mask_sub_epi8(rv, neg, zero, rv);
                }
                const __m512i t = kq_dot64(u, xv, rv);
                const __m512 f = _mm512_mul_ps(D, _mm512_loadu_ps(DX + (r * (pairs + 1) + p) * 16));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), f, acc[r]);
                if (!q8)
                    mn[r] = _mm_fmadd_ps(m2, _mm_castpd_ps(_mm_load_sd((const double*)(SX + i0))),
                                         mn[r]);
            }
        }
        if (blocks % 2) {  // an odd last block, 256 bits wide
            const int64_t b = blocks - 1;
            const uint8_t* blk = row + bb * b;
            const __m256i sg = q8 ? _mm256_loadu_si256((const __m256i*)(blk + 2))
                                  : _mm256_setzero_si256();
            const __m256i u = q8 ? _mm256_sign_epi8(sg, sg) : kq_quants32(blk, TYPE);
            const float d = kq_f16(blk), m = has_min ? kq_f16(blk + 2) : d;
            for (int r = 0; r < M; ++r) {
                const int64_t i = r * blocks + b;
                __m256i xv = _mm256_loadu_si256((const __m256i*)(rx.xq + 32 * i));
                __m256i rv = _mm256_loadu_si256((const __m256i*)(rx.xr + 32 * i));
                if (q8) { xv = _mm256_sign_epi8(xv, sg); rv = _mm256_sign_epi8(rv, sg); }
                const __m256i t = kq_dot32(u, xv, rv);
                acc[r] = kq_acc_add8(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(t),
                                                           _mm256_set1_ps(d * rx.xa[2 * i])));
                if (!q8) mn[r] = _mm_add_ss(mn[r], _mm_set_ss(m * SX[i]));
            }
        }
        for (int r = 0; r < M; ++r) {
            const float m = _mm_cvtss_f32(_mm_add_ss(mn[r], _mm_movehdup_ps(mn[r])));
            const float v = _mm512_reduce_add_ps(acc[r]);
            out[r * ldo + n] = has_min ? v + m : v - off * m;
        }
    }
}

// kq_small_pairs for M <= AE_SMALL_ROWS input rows (kquant_small.h's kq_by_rows)
template <int TYPE>
static void kq_small_pairs(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                           int64_t K, int64_t ldo, int64_t rb) {
    kq_by_rows(M, [&](auto rows) {
        kq_small_pairs<TYPE, decltype(rows)::value>(x, w, out, N, K, ldo, rb);
    });
}
#endif
