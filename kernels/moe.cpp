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
// columns, two an item,
// each item over every active expert, so each thread owns its columns of `out` and no two
// threads add to one value. Every weight row is read once per call whatever the number of
// tokens routed to its expert (a quantized row is dequantized once into L1 and multiplied
// against all of them).
#define kernel ae_int4_mm
#include "int4.cpp"
#undef kernel
#define kernel ae_int8_mm
#include "int8.cpp"
#undef kernel

enum { AE_MOE_F32 = 0, AE_MOE_INT8 = 1, AE_MOE_INT4 = 2 };
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

// x: float [T, K]; rows: int64 [R] (R = T * k) token of each assignment sorted by expert;
// offs: int64 [E + 1]; wts: float [R] each sorted assignment's routing weight. w13/s13,
// w2/s2: the expert weights (kind: 0 float32, 1 int8 with groups g13 / g2 of inputs per
// scale, 2 int4). out: float [T, K].
extern "C" void kernel(const float* x, const int64_t* rows, const int64_t* offs,
                       const float* wts, const uint8_t* w13, const uint8_t* s13,
                       const uint8_t* w2, const uint8_t* s2, float* out, int64_t T, int64_t k,
                       int64_t E, int64_t K, int64_t I, int64_t kind, int64_t g13, int64_t g2) {
    const int64_t R = T * k;
    std::vector<int64_t> active;
    int64_t max_rows = 0;
    for (int64_t e = 0; e < E; ++e) {
        if (offs[e + 1] > offs[e]) active.push_back(e);
        max_rows = std::max(max_rows, offs[e + 1] - offs[e]);
    }
    const int64_t n_active = (int64_t)active.size();
    const AeExpertMat m13{kind, 2 * I, K, g13, w13, s13};
    const AeExpertMat m2{kind, K, I, g2, w2, s2};
    std::vector<float> xs(R * K), a(R * I);
    for (int64_t r = 0; r < R; ++r)
        std::memcpy(xs.data() + r * K, x + rows[r] * K, K * sizeof(float));
    std::memset(out, 0, T * K * sizeof(float));
    const int64_t work = n_active * 3 * I * K;  // weights read
    const AeWithoutGil released(work >= AE_RELEASE_GIL_ELEMENTS);
    // A decode step of a few tokens reads a few MB: on a loaded 2-core machine waking the
    // team's other thread cost more than it saved (benchmarks/moe.py, docs/benchmarks.md).
    #pragma omp parallel if (work >= AE_MOE_TEAM_MIN)
    {
        std::vector<float> buf(2 * std::max(K, I)), gu(16 * max_rows), y(2 * max_rows);
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
