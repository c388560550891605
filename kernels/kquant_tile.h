// Many input rows (AE_TILE_MIN_ROWS and up: decode batches, short prefill chunks) on CPUs with
// AVX-512 BF16: the tiled path of kquants.py (weights dequantized to bfloat16, multiplied
// against the activations rounded to bfloat16, float32 sums) fused into one call, so that no
// dequantized tile ever leaves L1 / L2 and no Python runs per tile.
//
// AE_TILE_W weight rows at a time are dequantized (kquant.h, bit-exact, then rounded to
// bfloat16 to nearest even, as torch's .to(bfloat16)) into a buffer of the calling thread;
// then a register tile of AE_TILE_W weight rows x AE_TILE_X input rows costs one vdpbf16ps
// per 32 weights per input row, the lanes running along K (each accumulator summed across
// its lanes once at the end): no transposed copy of the weights is needed.
//
// Why not byte dot products here: on the Zen 5 of docs/benchmarks.md a 32-row call of the
// 4 x 4 register-blocked VNNI kernel (activations rounded to int8 twice per block: two
// vpdpbusd, a shift, a conversion, a multiply and an FMA per 64 weights per input row) took
// 2.8 ms for the Q5_0 4864x896 gate against 1.6 ms for Python's dequantized bfloat16 tiles;
// bfloat16 needs one instruction per 32 weights and no per-block float work.
#pragma once
#include "kquant_small.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define AE_KQ_BF16 1
#define AE_TILE_W 4
#define AE_TILE_X 4
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

// One weight row of `type` as bfloat16: the blocks of 32 straight from their quants in
// registers (kquant_small.h's kq_quants32; d (q - off), d q + m, as kquant.h's kq_block32
// computes them, then rounded), the other types through kq_dequant_row's float32 row `tmp`.
static inline void kq_row_bf16(int64_t type, const uint8_t* src, uint16_t* dst, int64_t K,
                               float* tmp) {
    const bool q32 = type == KQ_Q4_0 || type == KQ_Q4_1 || type == KQ_Q5_0 || type == KQ_Q5_1
                     || type == KQ_Q8_0;
    if (!q32) {
        kq_dequant_row(type, src, tmp, K);
        kq_to_bf16(tmp, dst, K);
        return;
    }
    const bool has_min = type == KQ_Q4_1 || type == KQ_Q5_1;
    const int off = type == KQ_Q4_0 ? 8 : type == KQ_Q5_0 ? 16 : 0;
    const int64_t bb = kq_row_bytes(type, 32);
    for (int64_t b = 0; b < K / 32; ++b) {
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
    static thread_local std::vector<uint16_t> xs;  // x in bfloat16, kept between calls
    if ((int64_t)xs.size() < M * K) xs.resize(M * K);
    uint16_t* xb = xs.data();
    kq_to_bf16(x, xb, M * K);
    const int64_t tiles = (N + AE_TILE_W - 1) / AE_TILE_W, steps = K / 32;
    #pragma omp parallel
    {
        std::vector<float> fbuf(K);
        std::vector<uint16_t> wbuf(AE_TILE_W * K);
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
                for (int i = 0; i < nw; ++i)
                    for (int r = 0; r < nx; ++r)
                        out[(r0 + r) * ldo + n0 + i] = _mm512_reduce_add_ps(acc[i][r]);
            }
        }
    }
}
#endif
