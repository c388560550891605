#include "common.h"

// The experts of one mixture-of-experts layer, every expert in one call: tokens sorted by
// expert, each expert's rows multiplied as one group (a grouped matmul), never a loop over
// tokens. Weights float32, int8 (int8.cpp's layout) or packed int4 (int4.cpp's layout), per
// expert stacked: w13 [E, 2 I, K] (gate rows, then up rows), w2 [E, K, I].
//
//   xs[r]  = x[rows[r]]                                   gather, rows sorted by expert
//   a[r]   = silu(gate_e xs[r]) * (up_e xs[r])   for r in expert e's rows [offs[e], offs[e+1])
//   out[rows[r]] += wts[r] * (w2[e] a[r])
//
// Two phases over the OpenMP threads, one barrier between them (on a loaded machine every
// barrier waits for the slowest thread to be scheduled): first by (expert, gate row i with
// up row I + i, 8 columns an item), so each item ends in its columns of a; then by output
// columns, each thread over every active expert, so each thread owns its columns of `out` and
// no two threads add to one value. Every weight row is read once per call whatever the number
// of tokens routed to its expert: a tile of a few weight rows is multiplied against all of
// them, 4 at a time.
//
// With AVX-512 and VNNI (moe512.h) the tiles are 512-bit: float32 FMAs; int8 experts as int16
// and int4 experts as byte dot products against the input rows rounded once per call (each
// token once for every expert it goes to), so that a quantized expert costs its bytes, not a
// dequantization into float. Elsewhere (AVX2 or plain C++) each quantized row is dequantized
// once into L1 and multiplied against the group's rows. int8 scales: one per row
// (--quantization int8) or per block of 32 (a GGUF file's Q8_0 experts). bfloat16 experts
// (the CPU's default dtype where it has bfloat16 dot products) take the 512-bit tiles only.
#pragma push_macro("kernel")  // included by the decode stack under its own name
#undef kernel
#define kernel ae_int4_mm
#include "int4.cpp"
#undef kernel
#define kernel ae_int8_mm
#include "int8.cpp"
#undef kernel
#pragma pop_macro("kernel")
#include "moe512.h"

enum { AE_MOE_F32 = 0, AE_MOE_INT8 = 1, AE_MOE_INT4 = 2, AE_MOE_BF16 = 3 };
#ifndef AE_MOE_TEAM_MIN
#define AE_MOE_TEAM_MIN (1 << 22)
#endif

// One expert's weight matrix [N, K] in one of the layouts; `row` gives row n as floats.
struct AeExpertMat {
    int64_t kind, N, K, group;
    const uint8_t* w;  // expert 0's weights; expert e at e * N * row_bytes
    const uint8_t* s;  // int8: float scales [E, N, K / group]; int4: float16 [E, N, K / 32, 2]

    // Row n of expert e as floats: a pointer into the weights (float32) or into `buf`.
    const float* row(int64_t e, int64_t n, float* buf) const {
        const int64_t r = e * N + n;
        if (kind == AE_MOE_F32) return reinterpret_cast<const float*>(w) + r * K;
        if (kind == AE_MOE_INT8) {
            ae_dequant_q8(reinterpret_cast<const int8_t*>(w) + r * K,
                          reinterpret_cast<const float*>(s) + r * (K / group), buf, K, group);
        } else {
            ae_dequant_q4(w + r * (K / 2), reinterpret_cast<const uint16_t*>(s) + r * (K / 16),
                          buf, K / 32);
        }
        return buf;
    }
};

// a[r][i] = silu(g[r][i]) * u[r][i] for 8 columns i of M rows (gu: [8][M][2], gate and up
// of column c, row r at gu + 2 (c M + r)); a: row stride I.
static inline void ae_moe_silu8(const float* gu, float* a, int64_t M, int64_t I) {
    for (int64_t r = 0; r < M; ++r) {
        float g[8], u[8];
        for (int c = 0; c < 8; ++c) {
            g[c] = gu[2 * (c * M + r)];
            u[c] = gu[2 * (c * M + r) + 1];
        }
#ifdef AE_AVX2
        const __m256 gv = _mm256_loadu_ps(g);
        const __m256 ex = ae_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(a + r * I, _mm256_mul_ps(
            _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), ex)), _mm256_loadu_ps(u)));
#else
        for (int c = 0; c < 8; ++c) a[r * I + c] = g[c] / (1.f + std::exp(-g[c])) * u[c];
#endif
    }
}

// The experts routed at least one token (offs: [E + 1] row offsets), in order, into `active`;
// returns the most rows any expert has.
static inline int64_t ae_active_experts(const int64_t* offs, int64_t E,
                                        std::vector<int64_t>& active) {
    int64_t max_rows = 0;
    for (int64_t e = 0; e < E; ++e) {
        if (offs[e + 1] > offs[e]) active.push_back(e);
        max_rows = std::max(max_rows, offs[e + 1] - offs[e]);
    }
    return max_rows;
}

#ifdef AE_MOE_512
#include <type_traits>
#ifndef AE_MOE_AHEAD
#define AE_MOE_AHEAD 8  // weight rows fetched ahead of the tile
#endif
// res[4 m + j] = row n + j of expert e of `mat` . input row idx[m], for j < 4, m < mr (<= 4).
static inline void ae_moe_tile(const AeExpertMat& mat, int64_t e, int64_t n, const AeTileIn& in,
                               const int64_t* idx, int mr, float* res) {
    const int64_t row = e * mat.N + n, K = mat.K;
    auto by_rows = [mr](auto f) {
        switch (mr) {
            case 4: f(std::integral_constant<int, 4>{}); break;
            case 3: f(std::integral_constant<int, 3>{}); break;
            case 2: f(std::integral_constant<int, 2>{}); break;
            default: f(std::integral_constant<int, 1>{}); break;
        }
    };
    float fac[4];
    for (int m = 0; m < mr; ++m) fac[m] = in.fac ? in.fac[idx[m]] : 0.f;
    if (mat.kind == AE_MOE_F32) {
        const float* x[4];
        for (int m = 0; m < mr; ++m) x[m] = in.f + idx[m] * in.stride;
        const float* w = reinterpret_cast<const float*>(mat.w) + row * K;
        by_rows([&](auto c) {
            ae_tile_f32<decltype(c)::value>(w, K, x, w + AE_MOE_AHEAD * K, res);
        });
    } else if (mat.kind == AE_MOE_BF16) {
        const uint16_t* w = reinterpret_cast<const uint16_t*>(mat.w) + row * K;
#ifdef AE_MOE_DPBF16
        if (in.b) {
            const uint16_t* x[4];
            for (int m = 0; m < mr; ++m) x[m] = in.b + idx[m] * in.stride;
            by_rows([&](auto c) {
                ae_tile_dpbf16<decltype(c)::value>(w, K, x, w + AE_MOE_AHEAD * K, res);
            });
            return;
        }
#endif
        const float* x[4];
        for (int m = 0; m < mr; ++m) x[m] = in.f + idx[m] * in.stride;
        by_rows([&](auto c) {
            ae_tile_bf16<decltype(c)::value>(w, K, x, w + AE_MOE_AHEAD * K, res);
        });
    } else if (mat.kind == AE_MOE_INT8) {
        const int16_t* x[4];
        for (int m = 0; m < mr; ++m) x[m] = in.h + idx[m] * in.stride;
        const int8_t* w = reinterpret_cast<const int8_t*>(mat.w) + row * K;
        const float* s = reinterpret_cast<const float*>(mat.s) + row * (K / mat.group);
        if (mat.group == K)
            by_rows([&](auto c) {
                ae_tile_q8<decltype(c)::value, false>(w, s, K, x, fac, w + AE_MOE_AHEAD * K, res);
            });
        else
            by_rows([&](auto c) {
                ae_tile_q8<decltype(c)::value, true>(w, s, K, x, fac, w + AE_MOE_AHEAD * K, res);
            });
    } else {
        const int8_t* q[4];
        const int8_t* r[4];
        const float* xb[4];
        for (int m = 0; m < mr; ++m) {
            q[m] = in.q + idx[m] * in.stride;
            r[m] = in.r + idx[m] * in.stride;
            xb[m] = in.xb + idx[m] * in.xb_stride;
        }
        const uint8_t* w = mat.w + row * (K / 2);
        const uint16_t* sm = reinterpret_cast<const uint16_t*>(mat.s) + row * (K / 16);
        by_rows([&](auto c) {
            ae_tile_q4<decltype(c)::value>(w, sm, K, q, r, xb, fac, w + AE_MOE_AHEAD * (K / 2),
                                           res);
        });
    }
}

// Rows [0, n) of x [n, K] rounded for the tiles of `kind` (int8: int16; int4: twice to int8),
// into q / f, described by `in`.
static inline void ae_moe_round(const float* x, int64_t n, int64_t K, int64_t kind,
                                ae_vec<int8_t>& q, ae_vec<float>& f, AeTileIn& in) {
    in = AeTileIn{x, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, K, 0};
    if (kind == AE_MOE_F32) return;
    q.resize(2 * n * K);
    if (kind == AE_MOE_BF16) {
#ifdef AE_MOE_DPBF16
        static const bool dots = __builtin_cpu_supports("avx512bf16");
        if (dots) {
            uint16_t* b = reinterpret_cast<uint16_t*>(q.data());
            in.b = b;
            for (int64_t t = 0; t < n; ++t) ae_round_bf16_row(x + t * K, K, b + t * K);
        }
#endif
        return;
    }
    if (kind == AE_MOE_INT8) {
        f.resize(n);
        int16_t* h = reinterpret_cast<int16_t*>(q.data());
        in.h = h;
        in.fac = f.data();
        for (int64_t t = 0; t < n; ++t) ae_round16_row(x + t * K, K, h + t * K, f.data() + t);
        return;
    }
    const int64_t xbs = (K / 16 + 15) / 16 * 16;
    f.resize(n * (1 + xbs));
    in = AeTileIn{x, nullptr, nullptr, q.data(), q.data() + n * K, f.data(), f.data() + n, K,
                  xbs};
    for (int64_t t = 0; t < n; ++t)
        ae_round_row512(x + t * K, K, q.data() + t * K, q.data() + (n + t) * K, f.data() + t,
                        f.data() + n + t * xbs, xbs);
}

// The kernel below on 512-bit tiles (see the top of this file).
static void ae_moe512(const float* x, const int64_t* rows, const int64_t* offs, const float* wts,
                      const AeExpertMat& m13, const AeExpertMat& m2, float* out, int64_t T,
                      int64_t k, int64_t E) {
    const int64_t K = m13.K, I = m2.K, kind = m13.kind, R = T * k;
    std::vector<int64_t> active;
    const int64_t max_rows = ae_active_experts(offs, E, active);
    const int64_t n_active = (int64_t)active.size();
    ae_vec<int8_t> xq;
    ae_vec<float> xf, a(R * I);
    AeTileIn in13;
    ae_moe_round(x, T, K, kind, xq, xf, in13);  // int8 / int4: each token once
    std::memset(out, 0, T * K * sizeof(float));
    const int64_t work = n_active * 3 * I * K;
    const AeWithoutGil released(work >= AE_RELEASE_GIL_ELEMENTS);
    #pragma omp parallel if (work >= AE_MOE_TEAM_MIN)
    {
        ae_vec<float> h(16 * max_rows);  // per row: gate of 8 columns, then up
        float res[16];
        int64_t idx[4];
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < n_active * (I / 8); ++item) {
            const int64_t e = active[item / (I / 8)], i = item % (I / 8) * 8;
            const int64_t r0 = offs[e], M = offs[e + 1] - r0;
            for (int64_t half = 0; half < 2; ++half)
                for (int64_t j0 = 0; j0 < 8; j0 += 4)
                    for (int64_t m0 = 0; m0 < M; m0 += 4) {
                        const int mr = (int)std::min<int64_t>(4, M - m0);
                        for (int m = 0; m < mr; ++m) idx[m] = rows[r0 + m0 + m];
                        ae_moe_tile(m13, e, half * I + i + j0, in13, idx, mr, res);
                        for (int m = 0; m < mr; ++m)
                            _mm_storeu_ps(h.data() + (m0 + m) * 16 + half * 8 + j0,
                                          _mm_loadu_ps(res + 4 * m));
                    }
            for (int64_t r = 0; r < M; ++r) {
                const float* g = h.data() + r * 16;
                float* ar = a.data() + (r0 + r) * I + i;
                const __m256 gv = _mm256_loadu_ps(g);
                const __m256 ex = ae_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                _mm256_storeu_ps(ar, _mm256_mul_ps(
                    _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), ex)),
                    _mm256_loadu_ps(g + 8)));
            }
        }
        // (the barrier of `omp for`: every column of `a` is done); each thread its columns
        ae_vec<int8_t> aq;
        ae_vec<float> af;
        AeTileIn in2;
        ae_moe_round(a.data(), R, I, kind, aq, af, in2);
        const int64_t tiles = K / 4, nt = ae_team_size(), t = ae_thread_num();
        const int64_t c0 = tiles * t / nt * 4, c1 = tiles * (t + 1) / nt * 4;
        for (int64_t j = 0; j < n_active; ++j) {
            const int64_t e = active[j], r0 = offs[e], M = offs[e + 1] - r0;
            for (int64_t c = c0; c < c1; c += 4)
                for (int64_t m0 = 0; m0 < M; m0 += 4) {
                    const int mr = (int)std::min<int64_t>(4, M - m0);
                    for (int m = 0; m < mr; ++m) idx[m] = r0 + m0 + m;
                    ae_moe_tile(m2, e, c, in2, idx, mr, res);
                    for (int m = 0; m < mr; ++m) {
                        float* o = out + rows[r0 + m0 + m] * K + c;
                        _mm_storeu_ps(o, _mm_fmadd_ps(_mm_set1_ps(wts[r0 + m0 + m]),
                                                      _mm_loadu_ps(res + 4 * m), _mm_loadu_ps(o)));
                    }
                }
        }
    }
}
#endif

// x: float [T, K]; rows: int64 [R] (R = T * k) token of each assignment sorted by expert;
// offs: int64 [E + 1]; wts: float [R] each sorted assignment's routing weight. w13/s13,
// w2/s2: the expert weights (kind: 0 float32, 1 int8 with groups g13 / g2 of inputs per
// scale, 2 int4, 3 bfloat16: 512-bit tiles only). out: float [T, K].
extern "C" void kernel(const float* x, const int64_t* rows, const int64_t* offs,
                       const float* wts, const uint8_t* w13, const uint8_t* s13,
                       const uint8_t* w2, const uint8_t* s2, float* out, int64_t T, int64_t k,
                       int64_t E, int64_t K, int64_t I, int64_t kind, int64_t g13, int64_t g2) {
    if (T == 0) {  // the query: whether the 512-bit tiles are compiled in
#ifdef AE_MOE_512
        out[0] = 1.f;
#else
        out[0] = 0.f;
#endif
        return;
    }
#ifdef AE_MOE_512
    const bool blocks32 = K % 32 == 0 && I % 32 == 0;
    if (K % 4 == 0 && I % 8 == 0 &&
        (kind == AE_MOE_F32 || kind == AE_MOE_BF16 || (kind == AE_MOE_INT4 && blocks32) ||
         (kind == AE_MOE_INT8 && ((g13 == K && g2 == I) || (g13 == 32 && g2 == 32 && blocks32))))) {
        ae_moe512(x, rows, offs, wts, AeExpertMat{kind, 2 * I, K, g13, w13, s13},
                  AeExpertMat{kind, K, I, g2, w2, s2}, out, T, k, E);
        return;
    }
#endif
    if (kind == AE_MOE_BF16) return;  // 512-bit tiles only (the caller asks wide_tiles())
    const int64_t R = T * k;
    std::vector<int64_t> active;
    const int64_t max_rows = ae_active_experts(offs, E, active);
    const int64_t n_active = (int64_t)active.size();
    const AeExpertMat m13{kind, 2 * I, K, g13, w13, s13};
    const AeExpertMat m2{kind, K, I, g2, w2, s2};
    ae_vec<float> xs(R * K), a(R * I);
    for (int64_t r = 0; r < R; ++r)
        std::memcpy(xs.data() + r * K, x + rows[r] * K, K * sizeof(float));
    std::memset(out, 0, T * K * sizeof(float));
    const int64_t work = n_active * 3 * I * K;  // weights read
    const AeWithoutGil released(work >= AE_RELEASE_GIL_ELEMENTS);
    // A decode step of a few tokens reads a few MB: on a loaded 2-core machine waking the
    // team's other thread cost more than it saved (benchmarks/moe.py, docs/benchmarks.md).
    #pragma omp parallel if (work >= AE_MOE_TEAM_MIN)
    {
        ae_vec<float> buf(2 * std::max(K, I)), gu(16 * max_rows), y(2 * max_rows);
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < n_active * (I / 8); ++item) {
            const int64_t e = active[item / (I / 8)], i = item % (I / 8) * 8;
            const int64_t r0 = offs[e], M = offs[e + 1] - r0;
            const float* xe = xs.data() + r0 * K;
            for (int c = 0; c < 8; ++c)  // gate and up of columns i .. i + 7, sharing x loads
                ae_dots2(m13.row(e, i + c, buf.data()), m13.row(e, I + i + c, buf.data() + K),
                         xe, gu.data() + 2 * c * M, M, 2, K);
            ae_moe_silu8(gu.data(), a.data() + r0 * I + i, M, I);
        }
        // (the barrier of `omp for`: every column of `a` is done)
        #pragma omp for schedule(static)
        for (int64_t c2 = 0; c2 < K / 2; ++c2) {  // output columns c, c + 1
            const int64_t c = 2 * c2;
            for (int64_t j = 0; j < n_active; ++j) {
                const int64_t e = active[j], r0 = offs[e], M = offs[e + 1] - r0;
                ae_dots2(m2.row(e, c, buf.data()), m2.row(e, c + 1, buf.data() + I),
                         a.data() + r0 * I, y.data(), M, 2, I);
                for (int64_t r = 0; r < M; ++r) {
                    float* o = out + rows[r0 + r] * K + c;
                    o[0] += wts[r0 + r] * y[2 * r];
                    o[1] += wts[r0 + r] * y[2 * r + 1];
                }
            }
        }
    }
}
