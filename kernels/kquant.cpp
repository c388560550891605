#include "common.h"
#include "kquant.h"
#include <vector>

#include "kquant_small.h"
#include "kquant_q32.h"
#include "kquant_tile.h"
#include "kquant_tile8.h"

// kernel()'s types that ask whether kq_tile / kq_tile8 are compiled in (out[0] = 1 or 0)
#define KQ_ASK_BF16_TILE -1
#define KQ_ASK_INT8_TILE -2
#ifdef AE_KQ_BF16
#define KQ_HAS_BF16_TILE 1
#else
#define KQ_HAS_BF16_TILE 0
#endif
#if defined(AE_KQ_TILE8) && defined(AE_KQ_BF16)  // (kq_tile8 is taken only beside kq_tile)
#define KQ_HAS_INT8_TILE 1
#else
#define KQ_HAS_INT8_TILE 0
#endif
// A flag on kernel()'s type: from AE_TILE_MIN_ROWS rows, the bfloat16 tiles (kq_tile) even
// where the int8 ones (kq_tile8) take the type (the tests check both on one CPU).
#define KQ_BF16_TILES 0x100
// A flag on kernel()'s type: x is bfloat16 [M, K] (kq_tile8 reads it as it is; any other
// path gets it widened to float32 first).
#define KQ_X_BF16 0x200
// A flag on kernel()'s type: out is bfloat16 (row stride ldo), written by kq_tile8 as it
// rounds its sums; only the calls kq_tile8 takes may set it.
#define KQ_OUT_BF16 0x400
// A flag on kernel()'s type: kq_tile8 from AE_TILE8_FEW_ROWS rows instead of
// AE_TILE_MIN_ROWS. Rows below AE_TILE_MIN_ROWS then no longer give each row the same result
// at any row count (speculative verification needs that; kquants.py sets the flag without it).
#define KQ_TILE8_FEW 0x800
#ifndef AE_TILE8_FEW_ROWS
#define AE_TILE8_FEW_ROWS 3
#endif

#ifdef AE_AVX2
// G floats from p as the low lanes of a vector (the rest zero).
template <int G>
static inline __m256 kq_lanes(const float* p) {
    if (G == 8) return _mm256_loadu_ps(p);
    if (G == 4) return _mm256_zextps128_ps256(_mm_loadu_ps(p));
    return _mm256_zextps128_ps256(_mm_set_ss(p[0]));
}

// Blocks [b0, b0 + G) of one weight row against every input row (kq_small_q32): the blocks'
// quants unpacked once, each row's sums in registers over the group (two FMA chains).
template <int TYPE, int G>
static inline void kq_q32_group(const uint8_t* row, int64_t bb, int64_t b0,
                                const ae_rounded& rx, const float* dx, const float* sx,
                                int64_t M, int64_t blocks, __m256* acc) {
    constexpr bool has_min = TYPE == KQ_Q4_1 || TYPE == KQ_Q5_1;
    constexpr float off = TYPE == KQ_Q4_0 ? -8.f : TYPE == KQ_Q5_0 ? -16.f : 0.f;
    constexpr bool q8 = TYPE == KQ_Q8_0;
    __m256i u[G], sg[G];
    float d[G], m[G];
    #pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
        const uint8_t* blk = row + (b0 + j) * bb;
        d[j] = kq_f16(blk);
        m[j] = has_min ? kq_f16(blk + 2) : off * d[j];
        if (q8) {
            // signed quants: |q| times x with q's sign (vpmaddubsw wants one operand
            // unsigned; |q| <= 128 and |x| <= 127 keep the pair sums inside int16)
            sg[j] = _mm256_loadu_si256((const __m256i*)(blk + 2));
            u[j] = _mm256_sign_epi8(sg[j], sg[j]);
        } else {
            sg[j] = _mm256_setzero_si256();
            u[j] = kq_quants32(blk, TYPE);
        }
    }
    const __m256 mv = kq_lanes<G>(m);
    for (int64_t r = 0; r < M; ++r) {
        const int64_t i0 = r * blocks + b0;
        const int8_t* xq = rx.xq + 32 * i0;
        const int8_t* xr = rx.xr + 32 * i0;
        __m256 a[2] = {_mm256_fmadd_ps(mv, kq_lanes<G>(sx + i0), acc[r]), _mm256_setzero_ps()};
        #pragma GCC unroll 8
        for (int j = 0; j < G; ++j) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + 32 * j));
            __m256i rv = _mm256_loadu_si256((const __m256i*)(xr + 32 * j));
            if (q8) { xv = _mm256_sign_epi8(xv, sg[j]); rv = _mm256_sign_epi8(rv, sg[j]); }
            const __m256i t = kq_dot32(u[j], xv, rv);
            a[j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d[j] * dx[i0 + j]),
                                       a[j & 1]);
        }
        acc[r] = _mm256_add_ps(a[0], a[1]);
    }
}

// Few input rows (decode) over Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: these blocks are all
// w = d q + m with q in [0, 31] (Q4_0: m = -8 d, Q5_0: m = -16 d) or, Q8_0, signed q and
// m = 0, so int4.cpp's / int8.cpp's byte dot products apply: the activations rounded to
// int8 per block, twice (x ~= dx (xq + xr / 256), exact to ~1.5e-5 of the block maximum,
// common.h), a block costs two byte dot products (kq_dot32, kquant_small.h) and one FMA, and
// the min term is exact (m times the block's float sum of x). Blocks go in groups of 8, then
// 4, then 1 (kq_q32_group). AVX2 only: with AVX-512 VNNI, kquant_q32.h's kq_small_pairs.
template <int TYPE>
static void kq_small_q32(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                         int64_t K, int64_t ldo, int64_t rb) {
    const int64_t blocks = K / 32, bb = rb / blocks;
    const ae_rounded rx = ae_round_rows(x, M, K);
    // per block of each row: dx / 256 and the float sum of x, contiguous
    static thread_local ae_vec<float> fs;
    if ((int64_t)fs.size() < 2 * M * blocks) fs.resize(2 * M * blocks);
    float* dx = fs.data();
    float* sx = dx + M * blocks;
    for (int64_t i = 0; i < M * blocks; ++i) { dx[i] = rx.xa[2 * i]; sx[i] = rx.xb[2 * i + 1]; }
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = w + n * rb;
        __m256 acc[AE_SMALL_ROWS];
        for (int64_t r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= blocks; b += 8)
            kq_q32_group<TYPE, 8>(row, bb, b, rx, dx, sx, M, blocks, acc);
        for (; b + 4 <= blocks; b += 4)
            kq_q32_group<TYPE, 4>(row, bb, b, rx, dx, sx, M, blocks, acc);
        for (; b < blocks; ++b) kq_q32_group<TYPE, 1>(row, bb, b, rx, dx, sx, M, blocks, acc);
        for (int64_t r = 0; r < M; ++r) out[r * ldo + n] = ae_hsum8(acc[r]);
    }
}
#endif

#ifdef AE_AVX2
// Input rows up to which a call takes the byte dot products (in chunks of AE_SMALL_ROWS).
#define AE_INT_ROWS 64

// The byte dot products for M <= AE_SMALL_ROWS rows; false for a type they do not cover.
static bool kq_small(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                     int64_t K, int64_t ldo, int64_t type, int64_t rb) {
    switch (type) {
#ifdef AE_KQ512
        case KQ_Q4_0: kq_small_pairs<KQ_Q4_0>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q4_1: kq_small_pairs<KQ_Q4_1>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q5_0: kq_small_pairs<KQ_Q5_0>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q5_1: kq_small_pairs<KQ_Q5_1>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q8_0: kq_small_pairs<KQ_Q8_0>(x, w, out, M, N, K, ldo, rb); return true;
#else
        case KQ_Q4_0: kq_small_q32<KQ_Q4_0>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q4_1: kq_small_q32<KQ_Q4_1>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q5_0: kq_small_q32<KQ_Q5_0>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q5_1: kq_small_q32<KQ_Q5_1>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q8_0: kq_small_q32<KQ_Q8_0>(x, w, out, M, N, K, ldo, rb); return true;
#endif
        case KQ_Q4_K: kq_small_k<KQ_Q4_K>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q5_K: kq_small_k<KQ_Q5_K>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_Q6_K: kq_small_k<KQ_Q6_K>(x, w, out, M, N, K, ldo, rb); return true;
        case KQ_IQ4_XS: kq_small_k<KQ_IQ4_XS>(x, w, out, M, N, K, ldo, rb); return true;
        default: return false;
    }
}
#endif

// out[m * ldo + n] = dot(x[m], dequant(w[n])) for a GGUF matrix kept as the file stores it:
// x float [M, K]; w: N rows of kq_row_bytes(type, K) bytes; out: float with row stride ldo
// (a part of a fused projection writes its own columns of the shared output).
//
// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_XS up to AE_INT_ROWS input rows:
// byte dot products over int8-rounded activations (kq_small_q32, kquant_small.h's kq_small_k;
// exact to that rounding, ~1.5e-5 of each block's maximum), AE_SMALL_ROWS rows per pass.
// Otherwise each weight row is dequantized once per call into a buffer that stays in L1
// (bit-exact, kquant.h) and multiplied in float32 against every input row; from two input
// rows on, two weight rows share each input load (ae_dots2). The weights
// are read once per call whatever M; the float path's results equal x @ dequant(w).T up to
// float32 summation order.
extern "C" void kernel(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                       int64_t K, int64_t ldo, int64_t type) {
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);
    if (type == KQ_ASK_BF16_TILE || type == KQ_ASK_INT8_TILE) {  // out[0] = 1 or 0
        out[0] = (float)(type == KQ_ASK_BF16_TILE ? KQ_HAS_BF16_TILE : KQ_HAS_INT8_TILE);
        return;
    }
    const bool bf16_tiles = type & KQ_BF16_TILES, x_bf16 = type & KQ_X_BF16;
    const bool out_bf16 = type & KQ_OUT_BF16, few = type & KQ_TILE8_FEW;
    type &= ~(int64_t)(KQ_BF16_TILES | KQ_X_BF16 | KQ_OUT_BF16 | KQ_TILE8_FEW);
    const int64_t rb = kq_row_bytes(type, K);
    if (rb == 0) return;
#if defined(AE_KQ_TILE8) && defined(AE_KQ_BF16)
    // from AE_TILE_MIN_ROWS rows, the blocks of 32 by byte dot products across 16 weight rows
    // (kquant_tile8.h), the other types by bfloat16 tiles
    if (M >= (few ? AE_TILE8_FEW_ROWS : AE_TILE_MIN_ROWS) && kq_tile8_type(type)
        && K % 32 == 0 && !bf16_tiles) {
        kq_tile8_any(x, x_bf16, w, out, out_bf16, M, N, K, ldo, type, rb);
        return;
    }
#endif
    if (out_bf16) {  // the other paths write float32: into scratch, then rounded
        ae_vec<float> f(M * N);
        kernel(x, w, f.data(), M, N, K, N, type | (x_bf16 ? KQ_X_BF16 : 0));
        uint16_t* o = (uint16_t*)out;
        for (int64_t r = 0; r < M; ++r)
            for (int64_t n = 0; n < N; ++n) {
                uint32_t bits;
                std::memcpy(&bits, &f[r * N + n], 4);
                bits += 0x7fff + ((bits >> 16) & 1);  // nearest even (finite sums)
                o[r * ldo + n] = (uint16_t)(bits >> 16);
            }
        return;
    }
    if (x_bf16) {  // the other paths read float32
        static thread_local ae_vec<float> xf;
        if ((int64_t)xf.size() < M * K) xf.resize(M * K);
        const uint16_t* h = (const uint16_t*)x;
        for (int64_t i = 0; i < M * K; ++i) {
            const uint32_t bits = (uint32_t)h[i] << 16;
            std::memcpy(&xf[i], &bits, 4);
        }
        x = xf.data();
    }
#ifdef AE_KQ_BF16
    // from AE_TILE_MIN_ROWS rows (a bfloat16 model: kquants.py sends them here only then),
    // dequantized bfloat16 tiles multiplied in place (kquant_tile.h)
    if (M >= AE_TILE_MIN_ROWS && K % 32 == 0) {
        kq_tile(x, w, out, M, N, K, ldo, type, rb);
        return;
    }
#endif
#ifdef AE_AVX2
    // byte dot products, AE_SMALL_ROWS input rows at a time (the Python side sends fewer than
    // kquants.TILE_ROWS rows here; from there, dequantized tiles through oneDNN win)
    if (M <= AE_INT_ROWS && kq_small(x, w, out, std::min<int64_t>(M, AE_SMALL_ROWS), N, K, ldo,
                                      type, rb)) {
        for (int64_t r0 = AE_SMALL_ROWS; r0 < M; r0 += AE_SMALL_ROWS)
            kq_small(x + r0 * K, w, out + r0 * ldo, std::min<int64_t>(M - r0, AE_SMALL_ROWS), N,
                     K, ldo, type, rb);
        return;
    }
#endif
    #pragma omp parallel
    {
        ae_vec<float> buf(2 * K);
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
