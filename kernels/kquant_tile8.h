// Many input rows (decode batches of AE_TILE_MIN_ROWS and up, prefill chunks) over the blocks
// of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the k-quants (Q4_K, Q5_K, Q6_K) with AVX-512 VNNI:
// byte dot products whose lanes run across 16 weight rows (output columns), not along K.
//
// kquant_tile.h's bfloat16 tiles need one vdpbf16ps per 32 weights per input row. A vpdpbusd
// does 64 byte products, but along K each 32-weight block has its own scale, so byte dot
// products with lanes along K pay a conversion, a multiply and an FMA per block per weight
// row per input row (the 4 x 4 VNNI tile tried first lost to bfloat16). With the lanes across
// 16 weight rows instead, one input row's four activation bytes are broadcast to all lanes,
// and a block of 16 weight rows x 32 costs that input row 8 vpdpbusd, then one conversion, a
// multiply by the 16 rows' scales and an FMA by the activations' block scale: 11 instructions
// for 512 products against bfloat16's 16, and no bfloat16 weights to make.
//
// The 16 rows' blocks are brought into that layout (lane c: 4 bytes of weight row c) by
// 128-bit loads and a transposition (kquant_tile8_unpack.h; gathers cost more than the dot
// products here), once per call (per panel of rows), into a buffer of the thread that stays
// in L1 / L2 while every input row goes by; the next 16 rows' bytes are prefetched meanwhile.
// The quants stay unsigned (Q8_0's shifted by 128) and the activations are rounded to int8
// once per block (x ~= dx xq, dx = max|x| / 127, as llama.cpp's Q8_0 activations), so each
// block's sum is exact in int32, the offset (-off sum(xq)) its starting value; Q4_1 / Q5_1 /
// Q4_K / Q5_K's min term is m times the block's float sum of x. The rounding of the
// activations is the only approximation, and a row's result does not depend on the rows
// beside it.
#pragma once
#include "kquant_small.h"
#include "kquant_q32.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BITALG__)
#define AE_KQ_TILE8 1

// Rows of input taken together over one block of weights (their sums stay in registers).
#define AE_TILE8_ROWS 8

// Not a GGML type: int4.cpp's split layout (q [N, K / 2] nibbles as Q4_1's, sm [N, K / 32, 2]
// float16 scale and min: Q4_1's d and m), the int4 layers' prefill chunks (int4_tile8.cpp).
#define KQ_INT4_SPLIT 1000
// Nor this: int8_bf16.cpp's layout (q int8 [N, K], float32 scales [N, groups], groups 1 per
// row or K / 32 per block), the int8 layers' and logits head's decode steps of many requests
// (int8_tile8.cpp). The quants shifted by 128, as Q8_0's.
#define KQ_INT8_SPLIT 1001

// The types a call takes here: the blocks of 32 and the k-quants.
static inline bool kq_tile8_type(int64_t type) {
    return type == KQ_Q4_0 || type == KQ_Q4_1 || type == KQ_Q5_0 || type == KQ_Q5_1
           || type == KQ_Q8_0 || type == KQ_Q4_K || type == KQ_Q5_K || type == KQ_Q6_K;
}

// Per type: the quants' offset (taken off in int32: the block's dot products start at -off
// sum(xq)), whether a min term (m times the float sum of x) follows, whether each block of
// 32 has two factors (Q6_K: one per 16), and how many blocks of 32 one unpacking fills.
template <int TYPE>
struct kq_t8 {
    static constexpr int off = TYPE == KQ_Q4_0 || TYPE == KQ_Q4_1 || TYPE == KQ_Q4_K
                               || TYPE == KQ_INT4_SPLIT ? 8
                             : TYPE == KQ_Q5_0 || TYPE == KQ_Q5_1 || TYPE == KQ_Q5_K ? 16
                             : TYPE == KQ_Q6_K ? 32 : 128;
    static constexpr bool has_min = TYPE == KQ_Q4_1 || TYPE == KQ_Q5_1 || TYPE == KQ_Q4_K
                                    || TYPE == KQ_Q5_K || TYPE == KQ_INT4_SPLIT;
    static constexpr bool halves = TYPE == KQ_Q6_K;
    static constexpr int per_unpack = TYPE == KQ_Q4_K || TYPE == KQ_Q5_K || TYPE == KQ_Q6_K
                                      ? 8 : 1;
};

// One block of 16 weight rows in lanes: g[j] lane c = the unsigned quants 4 j .. 4 j + 3 of
// row c's block; d lane c its scale, m its min (Q4_1 / Q5_1).
struct kq_strip_block {
    __m512i g[8];
    __m512 d, m;
};

#include "kquant_tile8_unpack.h"

// Cache lines to fetch ahead: `lines` of 64 bytes from `at`.
struct kq_prefetch {
    const char* at;
    int64_t lines;
};

// R input rows against one strip (16 weight rows, all blocks in `S`): out columns n0.. of
// rows r0..r0 + R - 1, the first `nw` columns stored.
template <int TYPE, int R>
static inline void kq_strip_rows(const kq_strip_block* S, int64_t blocks, const int8_t* xq,
                                 const int32_t* x0, const float* dx, const float* sx,
                                 int64_t K, void* out, bool obf, int64_t ldo, __mmask16 keep,
                                 kq_prefetch pf) {
    const int64_t per = pf.at ? (pf.lines + blocks - 1) / blocks : 0;
    using T8 = kq_t8<TYPE>;
    __m512 acc[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const kq_strip_block& B = S[b];
        for (int64_t i = b * per; i < std::min(pf.lines, (b + 1) * per); ++i)
            _mm_prefetch(pf.at + 64 * i, _MM_HINT_T0);
        __m512i s[R];
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) s[r] = _mm512_set1_epi32(x0[2 * (r * blocks + b)]);
        #pragma GCC unroll 8
        for (int j = 0; j < (T8::halves ? 4 : 8); ++j) {
            #pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
                s[r] = _mm512_dpbusd_epi32(s[r], B.g[j], _mm512_set1_epi32(
                    ((const int32_t*)(xq + r * K + 32 * b))[j]));
        }
        if (T8::halves) {  // Q6_K: elements 16-31 have their own factor (B.m)
            __m512i s2[R];
            #pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
                s2[r] = _mm512_set1_epi32(x0[2 * (r * blocks + b) + 1]);
            #pragma GCC unroll 8
            for (int j = 4; j < 8; ++j) {
                #pragma GCC unroll 8
                for (int r = 0; r < R; ++r)
                    s2[r] = _mm512_dpbusd_epi32(s2[r], B.g[j], _mm512_set1_epi32(
                        ((const int32_t*)(xq + r * K + 32 * b))[j]));
            }
            #pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2[r]), B.m,
                                                 _mm512_mul_ps(_mm512_cvtepi32_ps(s[r]), B.d));
                acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(dx[r * blocks + b]), acc[r]);
            }
            continue;
        }
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const int64_t i = r * blocks + b;
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r]), B.d),
                                     _mm512_set1_ps(dx[i]), acc[r]);
            if (T8::has_min) acc[r] = _mm512_fmadd_ps(B.m, _mm512_set1_ps(sx[i]), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
        if (obf)  // bfloat16, rounded to nearest even as torch's .to(bfloat16)
            _mm256_mask_storeu_epi16((uint16_t*)out + r * ldo, keep,
                                     (__m256i)_mm512_cvtneps_pbh(acc[r]));
        else
            _mm512_mask_storeu_ps((float*)out + r * ldo, keep, acc[r]);
    }
}

// The activations of a call, rounded once per block of 32 (common.h's first rounding, the
// same bits: d = max|x| / 127, x / d to nearest even): xq [M, K]; per block i of row-major
// blocks, dx[i] = d, sx[i] = the float sum of x, x0[2 i] / x0[2 i + 1] the dot products'
// starting values, -off times the sum of xq (Q6_K: over elements 0-15 and 16-31 apart).
struct kq_t8_rows {
    int8_t* xq;
    float* dx;
    float* sx;
    int32_t* x0;
};

// x: float32 [M, K], or bfloat16 where `bf16`.
static inline __m512 kq_t8_load16(const void* x, int64_t at, bool bf16) {
    if (!bf16) return _mm512_loadu_ps((const float*)x + at);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline kq_t8_rows kq_t8_quantize(const void* x, bool bf16, int64_t M, int64_t K,
                                        int off, bool halves) {
    static thread_local ae_vec<int8_t> q;
    static thread_local ae_vec<float> f;
    static thread_local std::vector<int32_t> z;
    const int64_t n = M * (K / 32);
    if ((int64_t)q.size() < M * K) q.resize(M * K);
    if ((int64_t)f.size() < 2 * n) f.resize(2 * n);
    if ((int64_t)z.size() < 2 * n) z.resize(2 * n);
    const kq_t8_rows r{q.data(), f.data(), f.data() + n, z.data()};
    const __m512 sign = _mm512_set1_ps(-0.f);
    #pragma omp parallel for schedule(static) if (n >= 4096)
    for (int64_t i = 0; i < n; ++i) {
        const __m512 v0 = kq_t8_load16(x, 32 * i, bf16), v1 = kq_t8_load16(x, 32 * i + 16, bf16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const __m512 iv = _mm512_set1_ps(inv);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(
            _mm512_mul_ps(v0, iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(
            _mm512_mul_ps(v1, iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128((__m128i*)(r.xq + 32 * i), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(r.xq + 32 * i + 16), _mm512_cvtepi32_epi8(q1));
        const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        r.dx[i] = d;
        r.sx[i] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        r.x0[2 * i] = -off * (halves ? s0 : s0 + s1);
        r.x0[2 * i + 1] = -off * s1;
    }
    return r;
}

// Input rows a pass over the weights takes (a prefill chunk goes in panels): their int8
// activations stay in L2 (128 x 4864 bytes) while each strip's unpacked blocks sit in L1.
#define AE_TILE8_PANEL 128

// out[r * ldo + n] for r < M, n < N: x [M, K] float32 (bfloat16 where `bf16`), w N rows of
// rb bytes of TYPE, out float32 (bfloat16 where `obf`). KQ_INT4_SPLIT: w the nibbles (rb = K /
// 2), sm the scales and mins.
template <int TYPE>
static void kq_tile8(const void* x, bool bf16, const uint8_t* w, void* out, bool obf,
                     int64_t M, int64_t N, int64_t K, int64_t ldo, int64_t rb,
                     const uint16_t* sm = nullptr, const float* sf = nullptr,
                     int64_t groups = 0) {
    const int64_t blocks = K / 32;
    const kq_t8_rows rx = kq_t8_quantize(x, bf16, M, K, kq_t8<TYPE>::off, kq_t8<TYPE>::halves);
    const int64_t strips = (N + 15) / 16;
    #pragma omp parallel
    {
        std::vector<kq_strip_block> buf(blocks);
        kq_strip_block* S = buf.data();
        for (int64_t p0 = 0; p0 < M; p0 += AE_TILE8_PANEL) {
        const int64_t p1 = std::min<int64_t>(M, p0 + AE_TILE8_PANEL);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < strips; ++t) {
            const int64_t n0 = 16 * t, nw = std::min<int64_t>(16, N - n0);
            // lane c: weight row n0 + c (a short strip repeats its last row)
            const uint8_t* p[16];
            for (int c = 0; c < 16; ++c) p[c] = w + (n0 + std::min<int64_t>(c, nw - 1)) * rb;
            if constexpr (TYPE == KQ_INT4_SPLIT) {
                const uint16_t* ps = sm + n0 * 2 * blocks;
                for (int64_t b = 0; b < blocks; ++b)
                    kq_strip_unpack_int4(p, ps, 2 * blocks, nw, b, S + b);
            } else if constexpr (TYPE == KQ_INT8_SPLIT) {
                for (int64_t b = 0; b < blocks; ++b)
                    kq_strip_unpack_int8(p, sf + n0 * groups, groups, nw, b, S + b);
            } else if constexpr (kq_t8<TYPE>::per_unpack == 8) {  // super-blocks of 256
                const int64_t bb = kq_row_bytes(TYPE, 256);
                for (int64_t b = 0; b < blocks; b += 8) {
                    if (TYPE == KQ_Q6_K) kq_strip_unpack_q6k(p, b / 8 * bb, S + b);
                    else kq_strip_unpack_k45<TYPE == KQ_Q5_K>(p, b / 8 * bb, S + b);
                }
            } else {
                for (int64_t b = 0; b < blocks; ++b)
                    kq_strip_unpack<TYPE>(p, b * kq_q32_layout<TYPE>::bb, S + b);
            }
            // the next strip's bytes (contiguous) fetched a few lines a block while the
            // first rows go by (all at once, the prefetches would queue behind each other)
            kq_prefetch pf{nullptr, 0};
            if (t + 1 < strips) {
                pf.at = (const char*)(w + (n0 + 16) * rb);
                pf.lines = (std::min<int64_t>(16, N - n0 - 16) * rb + 63) / 64;
            }
            const __mmask16 keep = (__mmask16)((1u << nw) - 1);
            auto rows = [&](auto R, int64_t r0) {
                kq_strip_rows<TYPE, decltype(R)::value>(
                    S, blocks, rx.xq + r0 * K, rx.x0 + 2 * r0 * blocks, rx.dx + r0 * blocks,
                    rx.sx + r0 * blocks, K,
                    obf ? (void*)((uint16_t*)out + r0 * ldo + n0)
                        : (void*)((float*)out + r0 * ldo + n0), obf, ldo, keep,
                    r0 == p0 ? pf : kq_prefetch{nullptr, 0});
            };
            int64_t r0 = p0;
            for (; r0 + AE_TILE8_ROWS <= p1; r0 += AE_TILE8_ROWS)
                rows(std::integral_constant<int, AE_TILE8_ROWS>{}, r0);
            if (r0 < p1) kq_by_rows(p1 - r0, [&](auto R) { rows(R, r0); });
        }
        }
    }
}

// kq_tile8 for a type of kq_tile8_type.
static inline void kq_tile8_any(const void* x, bool bf16, const uint8_t* w, void* out,
                                bool obf, int64_t M, int64_t N, int64_t K, int64_t ldo,
                                int64_t type, int64_t rb) {
    switch (type) {
#define KQ_T8(T) case T: kq_tile8<T>(x, bf16, w, out, obf, M, N, K, ldo, rb); return;
        KQ_T8(KQ_Q4_0) KQ_T8(KQ_Q4_1) KQ_T8(KQ_Q5_0) KQ_T8(KQ_Q5_1) KQ_T8(KQ_Q8_0)
        KQ_T8(KQ_Q4_K) KQ_T8(KQ_Q5_K) KQ_T8(KQ_Q6_K)
#undef KQ_T8
        default: return;
    }
}
#endif
