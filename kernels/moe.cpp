#include "common.h"

// The experts of one mixture-of-experts layer, every expert in one call: tokens sorted by
// expert, each expert's rows multiplied as one group (a grouped matmul), never a loop over
// tokens. Weights float32, int8 (int8.cpp's layout) or packed int4 (int4.cpp's layout), per
// expert stacked: w13 [E, 2 I, K] (gate rows, then up rows), w2 [E, K, I].
//
//   xs[r]  = x[rows[r]]                                   gather, rows sorted by expert
//   h[r]   = w13[e] xs[r]        for r in expert e's rows [offs[e], offs[e + 1])
//   a[r]   = silu(h[r][:I]) * h[r][I:]
//   y[r]   = w2[e] a[r]
//   out[t] = sum_j wts[t k + j] y[pos[t k + j]]           in slot order j (deterministic)
//
// Work is split across the OpenMP threads by weight rows of the active experts: every weight
// row is read once per call whatever the number of tokens routed to its expert (a quantized
// row is dequantized once into L1 and multiplied against all of them). One parallel region,
// its phases separated by the barriers of `omp for`.
#define kernel ae_int4_mm
#include "int4.cpp"
#undef kernel
#define kernel ae_int8_mm
#include "int8.cpp"
#undef kernel

enum { AE_MOE_F32 = 0, AE_MOE_INT8 = 1, AE_MOE_INT4 = 2 };

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

// out[r][n] for the rows of the active experts, `in` [R, K] -> `res` [R, N], items of two
// weight rows (N even) over the team (called inside a parallel region).
static inline void ae_moe_grouped(const AeExpertMat& m, const int64_t* active, int64_t n_active,
                                  const int64_t* offs, const float* in, float* res,
                                  float* buf) {
    const int64_t pairs = m.N / 2;
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < n_active * pairs; ++item) {
        const int64_t e = active[item / pairs], n = 2 * (item % pairs);
        const int64_t r0 = offs[e], M = offs[e + 1] - r0;
        const float* w0 = m.row(e, n, buf);
        const float* w1 = m.row(e, n + 1, buf + m.K);
        if (M >= 4) {
            ae_dots2(w0, w1, in + r0 * m.K, res + r0 * m.N + n, M, m.N, m.K);
        } else {
            ae_dots(w0, in + r0 * m.K, res + r0 * m.N + n, M, m.N, m.K);
            ae_dots(w1, in + r0 * m.K, res + r0 * m.N + n + 1, M, m.N, m.K);
        }
    }
}

// x: float [T, K]; rows: int64 [R] (R = T * k) token of each sorted assignment; offs: int64
// [E + 1]; pos: int64 [T * k] sorted row of assignment (t, j); wts: float [T * k] its
// routing weight. w13/s13, w2/s2: the expert weights (kind: 0 float32, 1 int8 with groups
// g13 / g2 of inputs per scale, 2 int4). out: float [T, K].
extern "C" void kernel(const float* x, const int64_t* rows, const int64_t* offs,
                       const int64_t* pos, const float* wts, const uint8_t* w13,
                       const uint8_t* s13, const uint8_t* w2, const uint8_t* s2, float* out,
                       int64_t T, int64_t k, int64_t E, int64_t K, int64_t I, int64_t kind,
                       int64_t g13, int64_t g2) {
    const int64_t R = T * k;
    std::vector<int64_t> active;
    for (int64_t e = 0; e < E; ++e)
        if (offs[e + 1] > offs[e]) active.push_back(e);
    const int64_t n_active = (int64_t)active.size();
    const AeExpertMat m13{kind, 2 * I, K, g13, w13, s13};
    const AeExpertMat m2{kind, K, I, g2, w2, s2};
    std::vector<float> xs(R * K), h(R * 2 * I), a(R * I), y(R * K);
    const AeWithoutGil released(n_active * 3 * I * K >= AE_RELEASE_GIL_ELEMENTS / 4);
    #pragma omp parallel
    {
        std::vector<float> buf(2 * std::max(K, I));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r)
            std::memcpy(xs.data() + r * K, x + rows[r] * K, K * sizeof(float));
        ae_moe_grouped(m13, active.data(), n_active, offs, xs.data(), h.data(), buf.data());
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {  // silu(gate) * up
            const float* g = h.data() + r * 2 * I;
            const float* u = g + I;
            float* o = a.data() + r * I;
            int64_t i = 0;
#ifdef AE_AVX2
            const __m256 one = _mm256_set1_ps(1.f);
            for (; i + 8 <= I; i += 8) {
                const __m256 gv = _mm256_loadu_ps(g + i);
                const __m256 ex = ae_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, ex)),
                                                      _mm256_loadu_ps(u + i)));
            }
#endif
            for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
        }
        ae_moe_grouped(m2, active.data(), n_active, offs, a.data(), y.data(), buf.data());
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            float* o = out + t * K;
            for (int64_t c = 0; c < K; ++c) o[c] = 0.f;
            for (int64_t j = 0; j < k; ++j) {
                const float wt = wts[t * k + j];
                const float* yr = y.data() + pos[t * k + j] * K;
                int64_t c = 0;
#ifdef AE_AVX2
                const __m256 wv = _mm256_set1_ps(wt);
                for (; c + 8 <= K; c += 8)
                    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(wv, _mm256_loadu_ps(yr + c),
                                                            _mm256_loadu_ps(o + c)));
#endif
                for (; c < K; ++c) o[c] += wt * yr[c];
            }
        }
    }
}
