// Q5_0 for few input rows (decode) with AVX-512 VNNI: the type most of a Q4_K_M file falls
// back to where a row length is not a multiple of 256 (Qwen2.5-0.5B's q/k/o/gate/up: hidden
// 896), so about half of a batch-1 token. The generic byte dot products (kq_q32_group512)
// unpack each block on its own, 256 bits at a time, and then pair two blocks: ~35 vector
// instructions per 64 weights, ~16 GB/s on one Zen 5 core whether the weights stream or sit
// in cache. Here the two blocks of a pair are unpacked together:
//   - their 2 x 16 bytes of nibbles as one 256-bit vector, the high nibbles shifted into the
//     upper half, one 128-bit lane shuffle into element order (b0 0..31, b1 0..31);
//   - their 2 x 32 fifth bits as one 64-bit mask (the two qh words side by side), added as
//     0x10 under the mask;
//   - their two f16 scales converted together and spread over the pair's 8 + 8 lanes;
// so a pair costs ~8 instructions plus ~7 per input row (two vpdpbusd, shift, convert, two
// multiplies and the min term's FMA). The arithmetic is kq_q32_group512's (activations
// rounded twice per block, common.h; w = d (q - 16) as d q plus the exact -16 d sum(x)), and
// each input row's sums are formed the same way whatever the row count, so a row's result
// does not depend on the batch.
#pragma once
#include "kquant_small.h"

#ifdef AE_KQ512
template <int M>
static void kq_small_q5_0(const float* x, const uint8_t* w, float* out, int64_t N, int64_t K,
                          int64_t ldo, int64_t rb) {
    const int64_t blocks = K / 32, pairs = blocks / 2;
    const ae_rounded rx = ae_round_rows(x, M, K);
    // per input row: each pair's activation scales spread [dx(2p) x 8, dx(2p + 1) x 8] (dx =
    // the block's scale / 256), and each block's float sum of x
    static thread_local std::vector<float> fs;
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
    const __m512i m4 = _mm512_set1_epi8(0x0f), b5 = _mm512_set1_epi8(0x10);
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = w + n * rb;
        __m512 acc[M];
        __m128 mn[M];  // lanes 0-1: sum d sum(x), the min term over -16
        #pragma GCC unroll 8
        for (int r = 0; r < M; ++r) { acc[r] = _mm512_setzero_ps(); mn[r] = _mm_setzero_ps(); }
        for (int64_t p = 0; p < pairs; ++p) {
            const uint8_t* b0 = row + 44 * p;
            const uint8_t* b1 = b0 + 22;
            const __m256i v = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(b0 + 6))),
                _mm_loadu_si128((const __m128i*)(b1 + 6)), 1);
            // 128-bit lanes: b0 0..15, b1 0..15, b0 16..31, b1 16..31 -> element order
            __m512i u = _mm512_and_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), m4);
            u = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));
            uint32_t h0, h1;
            std::memcpy(&h0, b0 + 2, 4);
            std::memcpy(&h1, b1 + 2, 4);
            u = _mm512_mask_add_epi8(u, _cvtu64_mask64((uint64_t)h0 | ((uint64_t)h1 << 32)), u,
                                     b5);
            uint16_t s0, s1;
            std::memcpy(&s0, b0, 2);
            std::memcpy(&s1, b1, 2);
            const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(s0 | ((uint32_t)s1 << 16))));
            const __m512 D = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d2));
            #pragma GCC unroll 8
            for (int r = 0; r < M; ++r) {
                const int64_t i0 = r * blocks + 2 * p;
                const __m512i t = kq_dot64(u, _mm512_loadu_si512(rx.xq + 32 * i0),
                                           _mm512_loadu_si512(rx.xr + 32 * i0));
                const __m512 f = _mm512_mul_ps(D, _mm512_loadu_ps(DX + (r * (pairs + 1) + p) * 16));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), f, acc[r]);
                mn[r] = _mm_fmadd_ps(d2, _mm_castpd_ps(_mm_load_sd((const double*)(SX + i0))),
                                     mn[r]);
            }
        }
        if (blocks % 2) {  // an odd last block, 256 bits wide
            const int64_t b = blocks - 1;
            const uint8_t* blk = row + 22 * b;
            const __m256i u = kq_quants32(blk, KQ_Q5_0);
            const float d = kq_f16(blk);
            for (int64_t r = 0; r < M; ++r) {
                const int64_t i = r * blocks + b;
                const __m256i t = kq_dot32(u, _mm256_loadu_si256((const __m256i*)(rx.xq + 32 * i)),
                                           _mm256_loadu_si256((const __m256i*)(rx.xr + 32 * i)));
                acc[r] = kq_acc_add8(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(t),
                                                           _mm256_set1_ps(d * rx.xa[2 * i])));
                mn[r] = _mm_add_ss(mn[r], _mm_set_ss(d * SX[i]));
            }
        }
        for (int64_t r = 0; r < M; ++r) {
            const __m128 m = _mm_add_ss(mn[r], _mm_movehdup_ps(mn[r]));
            out[r * ldo + n] = _mm512_reduce_add_ps(acc[r]) - 16.f * _mm_cvtss_f32(m);
        }
    }
}

// kq_small_q5_0 for M <= AE_SMALL_ROWS input rows (each count its own unrolled loop)
static void kq_small_q5_0(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                          int64_t K, int64_t ldo, int64_t rb) {
    switch (M) {
#define KQ_CASE(c) case c: kq_small_q5_0<c>(x, w, out, N, K, ldo, rb); return;
        KQ_CASE(1) KQ_CASE(2) KQ_CASE(3) KQ_CASE(4) KQ_CASE(5) KQ_CASE(6) KQ_CASE(7) KQ_CASE(8)
#undef KQ_CASE
        default: return;
    }
}
#endif
