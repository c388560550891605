// Few input rows (decode) over the 256-element Q4_K / Q5_K / Q6_K / IQ4_XS: byte dot products
// instead of dequantizing each weight row to float (kquant.cpp's float path).
//
// The activations are rounded as for kq_small_q32 (common.h's ae_round_rows): per block of 32,
// x ~= dx (xq + xr / 256), exact to ~1.5e-5 of the block maximum. Each super-block's weights
// are unpacked once per call into eight vectors of 32 unsigned quants u (Q4_K 0..15, Q5_K
// 0..31, Q6_K 0..63, the layouts of kquant.h) with, per group of 16 elements, a float factor f
// and an offset o, w = f u + o:
//   Q4_K / Q5_K: f = d sc_j, o = -dmin m_j (sub-block j of 32: both its groups share them);
//   Q6_K: f = d sc_g, o = -32 d sc_g (signed 8-bit scale per group of 16).
//   IQ4_XS: signed table values v, u = |v| with x taking v's signs, f = d (ls_j - 32), o = 0.
// A sub-block of 32 against an input row then costs one integer sum per 4 elements,
//   t = sum u (256 xq + xr)     (AVX2: two vpmaddubsw, two vpmaddwd; VNNI: two vpdpbusd),
// and one float FMA by f dx / 256 (lanes 0-3 hold group 2j's elements, 4-7 group 2j + 1's).
// The offsets are exact: o times the group's float sum of x (16-element sums computed once
// per call), two FMAs per super-block. u <= 63 and |xq|, |xr| <= 127 keep vpmaddubsw's pair
// sums inside int16, and t inside int32.
#pragma once
#include <type_traits>
#include "kquant.h"

// Input rows of one pass of the byte dot products (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K /
// Q5_K / Q6_K): each weight block is unpacked once per pass.
#define AE_SMALL_ROWS 8

// f(std::integral_constant<int, M>) for 1 <= M <= AE_SMALL_ROWS: a kernel templated on its row
// count, each count its own unrolled loops with the rows' accumulators in registers.
template <typename F>
static inline void kq_by_rows(int64_t M, F&& f) {
    switch (M) {
#define KQ_CASE(c) case c: f(std::integral_constant<int, c>{}); return;
        KQ_CASE(1) KQ_CASE(2) KQ_CASE(3) KQ_CASE(4) KQ_CASE(5) KQ_CASE(6) KQ_CASE(7) KQ_CASE(8)
#undef KQ_CASE
        default: return;
    }
}

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

// A super-block's unpacked weights: u[j] the quants of sub-block j, F[j] its per-lane factors,
// O[0..1] the offsets of groups 0..7 and 8..15.
// IQ4_XS: its signed table values as sg[j] (u = |sg|, x takes sg's signs), O zero.
struct kq_sb { __m256i u[8]; __m256 F[8]; __m256 O[2]; __m256i sg[8]; };

static inline void kq_unpack_k45(const uint8_t* b, bool five, kq_sb& s) {
    const float d = kq_f16(b), dmin = kq_f16(b + 2);
    const uint8_t* qs = b + 16 + (five ? 32 : 0);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
        s.u[2 * c] = _mm256_and_si256(v, m4);
        s.u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    if (five) {  // bit j of qh[l] is the fifth bit of element l of sub-block j
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 16));
        const __m256i b5 = _mm256_set1_epi8(0x10);
        for (int j = 0; j < 8; ++j) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << j));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            s.u[j] = _mm256_or_si256(s.u[j], _mm256_and_si256(set, b5));
        }
    }
    // kq_scale_min's bytes in 32-bit registers (no byte stores read back as a vector):
    // sc = s[0..3] & 63, then s[8..11]'s low nibbles | s[0..3]'s top bits as bits 4-5;
    // mn = s[4..7] & 63, then s[8..11]'s high nibbles | s[4..7]'s top bits
    uint32_t a0, a1, a2;
    std::memcpy(&a0, b + 4, 4); std::memcpy(&a1, b + 8, 4); std::memcpy(&a2, b + 12, 4);
    const uint64_t sc = (a0 & 0x3f3f3f3fu)
        | (uint64_t)((a2 & 0x0f0f0f0fu) | ((a0 >> 2) & 0x30303030u)) << 32;
    const uint64_t mn = (a1 & 0x3f3f3f3fu)
        | (uint64_t)(((a2 >> 4) & 0x0f0f0f0fu) | ((a1 >> 2) & 0x30303030u)) << 32;
    const __m256 scf = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
    const __m256 mnf = _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
    for (int j = 0; j < 8; ++j) s.F[j] = _mm256_permutevar8x32_ps(scf, _mm256_set1_epi32(j));
    s.O[0] = _mm256_permutevar8x32_ps(mnf, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    s.O[1] = _mm256_permutevar8x32_ps(mnf, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}

static inline void kq_unpack_q6k(const uint8_t* b, kq_sb& s) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const float d = kq_f16(b + 208);
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
        // element 128 h + 32 i + l: nibble i / 2 of ql[64 h + 32 (i % 2) + l], bits 2 i of
        // qh[32 h + l] as bits 4-5 (the 16-bit shifts' spill is masked off)
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + 32 * h));
        s.u[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                     _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2));
        s.u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                         _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2));
        s.u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                         _mm256_and_si256(hb, m2));
        s.u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2));
    }
    const __m128i sc = _mm_loadu_si128((const __m128i*)(b + 192));
    const __m256 dv = _mm256_set1_ps(d);
    const __m256 f0 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    const __m256 f1 = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    const __m256 m32 = _mm256_set1_ps(-32.f);
    s.O[0] = _mm256_mul_ps(f0, m32);
    s.O[1] = _mm256_mul_ps(f1, m32);
    for (int j = 0; j < 4; ++j) {
        const __m256i idx = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j,
                                              2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
        s.F[j] = _mm256_permutevar8x32_ps(f0, idx);
        s.F[4 + j] = _mm256_permutevar8x32_ps(f1, idx);
    }
}

// IQ4_XS (kquant.h's kq_block_iq4xs): sub-block j's 16 bytes of nibbles index IQ4_NL's signed
// values (a byte shuffle), factor d (ls_j - 32), no offset.
static inline void kq_unpack_iq4xs(const uint8_t* b, kq_sb& s) {
    const float d = kq_f16(b);
    uint16_t sh; std::memcpy(&sh, b + 2, 2);
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i*)kq_iq4nl_values));
    const __m128i m4 = _mm_set1_epi8(0x0f);
    for (int j = 0; j < 8; ++j) {
        const __m128i q = _mm_loadu_si128((const __m128i*)(b + 8 + 16 * j));
        const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4),
                                             _mm_and_si128(q, m4));
        s.sg[j] = _mm256_shuffle_epi8(table, idx);
        s.u[j] = _mm256_sign_epi8(s.sg[j], s.sg[j]);
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0x0f) | (((sh >> (2 * j)) & 3) << 4);
        s.F[j] = _mm256_set1_ps(d * (float)(ls - 32));
    }
    s.O[0] = s.O[1] = _mm256_setzero_ps();
}

// t = sum u (256 xq + xr) per group of 4 bytes.
static inline __m256i kq_dot32(__m256i u, __m256i xq, __m256i xr) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i hi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xq);
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(hi, 8), u, xr);
#elif defined(__AVXVNNI__)
    const __m256i hi = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, xq);
    return _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(hi, 8), u, xr);
#else
    return _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), _mm256_set1_epi16(256)),
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, xr), _mm256_set1_epi16(1)));
#endif
}

// AVX-512 (BW + VNNI): two blocks of 32 per instruction, half the instructions per weight.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define AE_KQ512 1
typedef __m512 kq_acc;
static inline __m512i kq_pair(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline __m512 kq_pairf(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
static inline __m512i kq_dot64(__m512i u, __m512i xq, __m512i xr) {
    const __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xq);
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(hi, 8), u, xr);
}
// [v[2 p] x 8, v[2 p + 1] x 8] of the 8 floats v
static inline __m512 kq_spread(__m512 v, int p) {
    const __m512i idx = _mm512_set_epi32(2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                         2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p, 2 * p, 2 * p,
                                         2 * p, 2 * p, 2 * p, 2 * p, 2 * p);
    return _mm512_permutexvar_ps(idx, v);
}
static inline kq_acc kq_acc_zero() { return _mm512_setzero_ps(); }
static inline kq_acc kq_acc_add8(kq_acc a, __m256 v) {
    return _mm512_add_ps(a, _mm512_zextps256_ps512(v));
}
static inline float kq_acc_sum(kq_acc a) { return _mm512_reduce_add_ps(a); }
#else
typedef __m256 kq_acc;
static inline kq_acc kq_acc_zero() { return _mm256_setzero_ps(); }
static inline kq_acc kq_acc_add8(kq_acc a, __m256 v) { return _mm256_add_ps(a, v); }
static inline float kq_acc_sum(kq_acc a) { return ae_hsum8(a); }
#endif

// out[r * ldo + n] for r < M <= AE_SMALL_ROWS, n < N: x [M, K] float, w N rows of rb bytes.
// M is a template parameter (kq_small_k below picks it): each row count its own unrolled
// loops, the rows' accumulators in registers.
template <int TYPE, int M>
static void kq_small_k_rows(const float* x, const uint8_t* w, float* out, int64_t N, int64_t K,
                            int64_t ldo, int64_t rb) {
    const int64_t sbs = K / 256, bb = rb / sbs, blocks = K / 32, groups = K / 16;
    const ae_rounded rx = ae_round_rows(x, M, K);
    static thread_local ae_vec<float> sums;  // [M, K / 16]: the float sums of x
    if ((int64_t)sums.size() < M * groups) sums.resize(M * groups);
    float* s16 = sums.data();
    for (int64_t g = 0; g < M * groups; ++g) {
        const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x + 16 * g),
                                       _mm256_loadu_ps(x + 16 * g + 8));
        s16[g] = ae_hsum8(a);
    }
#ifdef AE_KQ512
    static thread_local ae_vec<float> dxs;  // [M, K / 32]: dx / 256, contiguous
    if ((int64_t)dxs.size() < M * blocks) dxs.resize(M * blocks);
    float* dx = dxs.data();
    for (int64_t i = 0; i < M * blocks; ++i) dx[i] = rx.xa[2 * i];
#endif
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = w + n * rb;
        kq_acc acc[M];
        for (int r = 0; r < M; ++r) acc[r] = kq_acc_zero();
        kq_sb s;
        for (int64_t b = 0; b < sbs; ++b) {
            const uint8_t* blk = row + b * bb;
            if (TYPE == KQ_Q6_K) kq_unpack_q6k(blk, s);
            else if (TYPE == KQ_IQ4_XS) kq_unpack_iq4xs(blk, s);
            else kq_unpack_k45(blk, TYPE == KQ_Q5_K, s);
#ifdef AE_KQ512
            __m512i u2[4];
            __m512 F2[4];
            __mmask64 neg[4];
            for (int p = 0; p < 4; ++p) {
                u2[p] = kq_pair(s.u[2 * p], s.u[2 * p + 1]);
                F2[p] = kq_pairf(s.F[2 * p], s.F[2 * p + 1]);
                neg[p] = TYPE == KQ_IQ4_XS
                    ? _mm512_movepi8_mask(kq_pair(s.sg[2 * p], s.sg[2 * p + 1])) : 0;
            }
            const __m512 O2 = kq_pairf(s.O[0], s.O[1]);
            #pragma GCC unroll 8
            for (int r = 0; r < M; ++r) {
                const int64_t i0 = r * blocks + 8 * b;
                const int8_t* xq = rx.xq + 32 * i0;
                const int8_t* xr = rx.xr + 32 * i0;
                const __m512 dv = _mm512_zextps256_ps512(_mm256_loadu_ps(dx + i0));
                __m512 a[2] = {_mm512_fmadd_ps(O2, _mm512_loadu_ps(s16 + r * groups + 16 * b),
                                               acc[r]), _mm512_setzero_ps()};
                #pragma GCC unroll 4
                for (int p = 0; p < 4; ++p) {
                    __m512i xv = _mm512_loadu_si512(xq + 64 * p);
                    __m512i rv = _mm512_loadu_si512(xr + 64 * p);
                    if (TYPE == KQ_IQ4_XS) {  // x takes the signs of the table values
                        xv = _mm512_mask_sub_epi8(xv, neg[p], _mm512_setzero_si512(), xv);
                        rv = _mm512_mask_sub_epi8(rv, neg[p], _mm512_setzero_si512(), rv);
                    }
                    const __m512i t = kq_dot64(u2[p], xv, rv);
                    a[p & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t),
                                               _mm512_mul_ps(F2[p], kq_spread(dv, p)), a[p & 1]);
                }
                acc[r] = _mm512_add_ps(a[0], a[1]);
            }
#else
            #pragma GCC unroll 8
            for (int r = 0; r < M; ++r) {
                const int64_t i0 = r * blocks + 8 * b;
                const int8_t* xq = rx.xq + 32 * i0;
                const int8_t* xr = rx.xr + 32 * i0;
                const float* sr = s16 + r * groups + 16 * b;
                // two chains of FMAs (their latency, not their count, bounds one row)
                __m256 a[2] = {_mm256_fmadd_ps(s.O[0], _mm256_loadu_ps(sr), acc[r]),
                               _mm256_mul_ps(s.O[1], _mm256_loadu_ps(sr + 8))};
                #pragma GCC unroll 8
                for (int j = 0; j < 8; ++j) {
                    __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + 32 * j));
                    __m256i rv = _mm256_loadu_si256((const __m256i*)(xr + 32 * j));
                    if (TYPE == KQ_IQ4_XS) {  // x takes the signs of the table values
                        xv = _mm256_sign_epi8(xv, s.sg[j]);
                        rv = _mm256_sign_epi8(rv, s.sg[j]);
                    }
                    const __m256i t = kq_dot32(s.u[j], xv, rv);
                    const __m256 f = _mm256_mul_ps(s.F[j], _mm256_set1_ps(rx.xa[2 * (i0 + j)]));
                    a[j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), f, a[j & 1]);
                }
                acc[r] = _mm256_add_ps(a[0], a[1]);
            }
#endif
        }
        for (int r = 0; r < M; ++r) out[r * ldo + n] = kq_acc_sum(acc[r]);
    }
}

template <int TYPE>
static void kq_small_k(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                       int64_t K, int64_t ldo, int64_t rb) {
    kq_by_rows(M, [&](auto rows) {
        kq_small_k_rows<TYPE, decltype(rows)::value>(x, w, out, N, K, ldo, rb);
    });
}
#endif
