// Many input rows (AE_TILE_MIN_ROWS and up: decode batches, short prefill chunks) on CPUs with
// AVX-512 BF16: the tiled path of kquants.py (weights dequantized to bfloat16, multiplied
// against the activations rounded to bfloat16, float32 sums) fused into one call, so that no
// dequantized tile ever leaves L1 / L2 and no Python runs per tile.
//
// AE_TILE_W weight rows at a time are dequantized (kquant.h, bit-exact, then rounded to
// bfloat16 to nearest even, as torch's .to(bfloat16)) into a buffer of the calling thread;
// then a register tile of AE_TILE_W weight rows x AE_TILE_X input rows costs one vdpbf16ps
// per 32 weights per input row, the lanes running along K (the tile's 16 accumulators summed
// across their lanes together at the end, ae_sum16): no transposed copy of the weights is
// needed.
//
// Why not byte dot products here: on the Zen 5 of docs/benchmarks.md a 32-row call of the
// 4 x 4 register-blocked VNNI kernel (activations rounded to int8 twice per block: two
// vpdpbusd, a shift, a conversion, a multiply and an FMA per 64 weights per input row) took
// 2.8 ms for the Q5_0 4864x896 gate against 1.6 ms for Python's dequantized bfloat16 tiles;
// bfloat16 needs one instruction per 32 weights and no per-block float work.
#pragma once
#include "kquant_small.h"
#include "kquant_q32.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define AE_KQ_BF16 1
#ifndef AE_TILE_W
#define AE_TILE_W 4  // AE_TILE_W x AE_TILE_X = 16: ae_sum16's
#define AE_TILE_X 4
#endif
// From this many input rows kquant.cpp's kernel takes kq_tile (kquants.TILE_ROWS).
#define AE_TILE_MIN_ROWS 16

// n floats to bfloat16, to nearest even (K a multiple of 32).
static inline void kq_to_bf16(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16),
                                               _mm512_loadu_ps(src + i));
        _mm512_storeu_si512(dst + i, (__m512i)v);
    }
}

// 32 bytes of quants q (unsigned, or signed when `sgn`) times s, minus m when `sub`, as 32
// bfloat16 (the float32 products and differences kquant.h forms, then rounded).
static inline void kq_bf16_32(__m256i q, bool sgn, __m512 s0, __m512 s1, __m512 m0, __m512 m1,
                              bool sub, uint16_t* dst) {
    const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
    __m512 f0 = _mm512_mul_ps(s0, _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(a)
                                                          : _mm512_cvtepu8_epi32(a)));
    __m512 f1 = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(b)
                                                          : _mm512_cvtepu8_epi32(b)));
    if (sub) {
        f0 = _mm512_sub_ps(f0, m0);
        f1 = _mm512_sub_ps(f1, m1);
    }
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
}

// A Q4_K / Q5_K super-block as 256 bfloat16: kquant.h's kq_block_k45, (d sc) q - (dmin m),
// with the quants unpacked 32 at a time in registers.
static inline void kq_k45_bf16(const uint8_t* b, bool five, uint16_t* dst) {
    const float d = kq_f16(b), dmin = kq_f16(b + 2);
    uint8_t sc[8], mn[8];
    kq_scale_min(b + 4, sc, mn);
    const uint8_t* qs = b + 16 + (five ? 32 : 0);
    const __m256i m4 = _mm256_set1_epi8(0x0f), b5 = _mm256_set1_epi8(0x10);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i*)(b + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
        __m256i q[2] = {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)};
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * c + h;
            if (five)  // bit j of qh[l]: the fifth bit of element l of sub-block j
                q[h] = _mm256_mask_add_epi8(
                    q[h], _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << j))), q[h], b5);
            const __m512 s = _mm512_set1_ps(d * (float)sc[j]);
            const __m512 m = _mm512_set1_ps(dmin * (float)mn[j]);
            kq_bf16_32(q[h], false, s, s, m, m, true, dst + 32 * j);
        }
    }
}

// A Q6_K super-block as 256 bfloat16: kquant.h's kq_block_q6k, (d scale) (q - 32).
static inline void kq_q6k_bf16(const uint8_t* b, uint16_t* dst) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = (const int8_t*)(b + 192);
    const float d = kq_f16(b + 208);
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30);
    const __m256i c32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + 32 * h));
        auto part = [&](__m256i lo4, __m256i hi2) {  // 4 low bits | 2 high bits as bits 4-5
            return _mm256_or_si256(_mm256_and_si256(lo4, m4), _mm256_and_si256(hi2, m2));
        };
        const __m256i q[4] = {part(l0, _mm256_slli_epi16(hb, 4)),
                              part(l1, _mm256_slli_epi16(hb, 2)),
                              part(_mm256_srli_epi16(l0, 4), hb),
                              part(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(hb, 2))};
        for (int i = 0; i < 4; ++i) {
            const __m512 s0 = _mm512_set1_ps(d * (float)sc[8 * h + 2 * i]);
            const __m512 s1 = _mm512_set1_ps(d * (float)sc[8 * h + 2 * i + 1]);
            kq_bf16_32(_mm256_sub_epi8(q[i], c32), true, s0, s1, s0, s1, false,
                       dst + 128 * h + 32 * i);
        }
    }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 rows as bfloat16 by table: a block's 16 or 32 possible values
// (kquant.h's d (q - off) or d q + m for every q, in float32, rounded once) looked up by its
// quants (vpermw), the blocks unpacked in pairs (kquant_q32.h). An odd last block is left
// for kq_row_bf16's per-block loop to finish: the number of blocks done.
template <int TYPE>
static inline int64_t kq_row_bf16_table(const uint8_t* src, uint16_t* dst, int64_t K) {
    using L = kq_q32_layout<TYPE>;
    constexpr float off = TYPE == KQ_Q4_0 ? 8.f : TYPE == KQ_Q5_0 ? 16.f : 0.f;
    const __m512 q0 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lo = _mm512_sub_ps(q0, _mm512_set1_ps(off));  // q - off, exact
    const __m512 hi = _mm512_add_ps(lo, _mm512_set1_ps(16.f));
    const int64_t blocks = K / 32;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        const uint8_t* b0 = src + L::bb * b;
        const __m512i u = kq_pair_quants<TYPE>(b0, b0 + L::bb);
        for (int h = 0; h < 2; ++h) {
            const uint8_t* blk = b0 + h * L::bb;
            const __m512 d = _mm512_set1_ps(kq_f16(blk));
            __m512 t0 = _mm512_mul_ps(d, lo), t1 = _mm512_mul_ps(d, hi);
            if (L::has_min) {
                const __m512 m = _mm512_set1_ps(kq_f16(blk + 2));
                t0 = _mm512_add_ps(t0, m);
                t1 = _mm512_add_ps(t1, m);
            }
            const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
            const __m512i idx = _mm512_cvtepu8_epi16(h == 0 ? _mm512_castsi512_si256(u)
                                                            : _mm512_extracti64x4_epi64(u, 1));
            _mm512_storeu_si512(dst + 32 * (b + h), _mm512_permutexvar_epi16(idx, table));
        }
    }
    return b;
}

// One weight row of `type` as bfloat16: the blocks of 32 straight from their quants in
// registers (kquant_small.h's kq_quants32; d (q - off), d q + m, as kquant.h's kq_block32
// computes them, then rounded), the other types through kq_dequant_row's float32 row `tmp`.
static inline void kq_row_bf16(int64_t type, const uint8_t* src, uint16_t* dst, int64_t K,
                               float* tmp) {
    const bool q32 = type == KQ_Q4_0 || type == KQ_Q4_1 || type == KQ_Q5_0 || type == KQ_Q5_1
                     || type == KQ_Q8_0;
    if (type == KQ_Q4_K || type == KQ_Q5_K || type == KQ_Q6_K) {
        const int64_t bb = kq_row_bytes(type, 256);
        for (int64_t b = 0; b < K / 256; ++b) {
            if (type == KQ_Q6_K) kq_q6k_bf16(src + b * bb, dst + 256 * b);
            else kq_k45_bf16(src + b * bb, type == KQ_Q5_K, dst + 256 * b);
        }
        return;
    }
    if (!q32) {
        kq_dequant_row(type, src, tmp, K);
        kq_to_bf16(tmp, dst, K);
        return;
    }
    const bool has_min = type == KQ_Q4_1 || type == KQ_Q5_1;
    const int off = type == KQ_Q4_0 ? 8 : type == KQ_Q5_0 ? 16 : 0;
    const int64_t bb = kq_row_bytes(type, 32);
    int64_t b = 0;  // Q4 / Q5: all but an odd last block by table
    switch (type) {
        case KQ_Q4_0: b = kq_row_bf16_table<KQ_Q4_0>(src, dst, K); break;
        case KQ_Q4_1: b = kq_row_bf16_table<KQ_Q4_1>(src, dst, K); break;
        case KQ_Q5_0: b = kq_row_bf16_table<KQ_Q5_0>(src, dst, K); break;
        case KQ_Q5_1: b = kq_row_bf16_table<KQ_Q5_1>(src, dst, K); break;
        default: break;
    }
    for (; b < K / 32; ++b) {
        const uint8_t* blk = src + b * bb;
        const __m512 d = _mm512_set1_ps(kq_f16(blk));
        __m256i q = type == KQ_Q8_0 ? _mm256_loadu_si256((const __m256i*)(blk + 2))
                                    : _mm256_sub_epi8(kq_quants32(blk, type),
                                                      _mm256_set1_epi8((char)off));
        __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
        if (has_min) {
            const __m512 m = _mm512_set1_ps(kq_f16(blk + 2));
            lo = _mm512_add_ps(lo, m);
            hi = _mm512_add_ps(hi, m);
        }
        _mm512_storeu_si512(dst + 32 * b, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// out[r * ldo + n] for r < M, n < N (x [M, K] float, w N rows of rb bytes of type `type`).
static void kq_tile(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                    int64_t K, int64_t ldo, int64_t type, int64_t rb) {
    static thread_local ae_vec<uint16_t> xs;  // x in bfloat16, kept between calls
    if ((int64_t)xs.size() < M * K) xs.resize(M * K);
    uint16_t* xb = xs.data();
    kq_to_bf16(x, xb, M * K);
    const int64_t tiles = (N + AE_TILE_W - 1) / AE_TILE_W, steps = K / 32;
    #pragma omp parallel
    {
        ae_vec<float> fbuf(K);
        ae_vec<uint16_t> wbuf(AE_TILE_W * K);
        uint16_t* W = wbuf.data();
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t n0 = t * AE_TILE_W;
            const int64_t nw = std::min<int64_t>(AE_TILE_W, N - n0);
            for (int64_t i = 0; i < AE_TILE_W; ++i) {  // a short tile repeats its last row
                kq_row_bf16(type, w + (n0 + std::min(i, nw - 1)) * rb, W + i * K, K,
                            fbuf.data());
            }
            if (t + 1 < tiles) {  // the next tile's bytes on their way while this one runs
                const char* next = (const char*)(w + (n0 + AE_TILE_W) * rb);
                const int64_t bytes = std::min<int64_t>(AE_TILE_W, N - n0 - AE_TILE_W) * rb;
                for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            }
            for (int64_t r0 = 0; r0 < M; r0 += AE_TILE_X) {
                const int64_t nx = std::min<int64_t>(AE_TILE_X, M - r0);
                const uint16_t* xr[AE_TILE_X];
                for (int r = 0; r < AE_TILE_X; ++r)
                    xr[r] = xb + (r0 + std::min<int64_t>(r, nx - 1)) * K;
                __m512 acc[AE_TILE_W][AE_TILE_X];
                for (int i = 0; i < AE_TILE_W; ++i)
                    for (int r = 0; r < AE_TILE_X; ++r) acc[i][r] = _mm512_setzero_ps();
                for (int64_t s = 0; s < steps; ++s) {
                    __m512bh wv[AE_TILE_W];
                    for (int i = 0; i < AE_TILE_W; ++i)
                        wv[i] = (__m512bh)_mm512_loadu_si512(W + i * K + 32 * s);
                    #pragma GCC unroll 16
                    for (int r = 0; r < AE_TILE_X; ++r) {
                        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[r] + 32 * s);
                        #pragma GCC unroll 16
                        for (int i = 0; i < AE_TILE_W; ++i)
                            acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv[i], xv);
                    }
                }
                // the 16 sums reduced together (lane W r + i: input row r, weight row i)
                __m512 v[16];
                for (int r = 0; r < AE_TILE_X; ++r)
                    for (int i = 0; i < AE_TILE_W; ++i) v[AE_TILE_W * r + i] = acc[i][r];
                const __m512 sums = ae_sum16(v);
                for (int r = 0; r < nx; ++r)
                    _mm512_mask_storeu_ps(out + (r0 + r) * ldo + n0 - AE_TILE_W * r,
                                          (__mmask16)(((1u << nw) - 1) << (AE_TILE_W * r)),
                                          sums);
            }
        }
    }
}
#endif
