#include "common.h"

// Greedy tokens through an int8 screen and an exact check: ids[r] = argmax_v (x[r] . w[v] +
// bias[v]) for x float [N, K], with the vocabulary screened in int8 and only the few ids that
// can still be the maximum computed exactly (in double). Python prepares the weight once
// (sampler/greedy_head.py, Int8Head): per vocabulary row v its scale s_v = max |w[v]| / 127,
// q_w = round(w[v] / s_v) packed as [V/16][K/4][16][4] int8, sum_q[v] = sum_i q_w[v][i] and
// l1w[v] = sum_i |w[v][i]|; arrays padded to whole blocks of 16.
//
// Per input row, s_r = max |x[r]| / 127 and u = round(x / s_r) + 128 (uint8, for VNNI's u8 x s8
// products); then sum_i q_x q_w = dpbusd(u, q_w) - 128 sum_q[v] exactly, in int32. With
// x^ = s_r q_x and w^ = s_v q_w: x.w - x^.w^ = (x - x^).w + x^.(w - w^), each element of
// x - x^ within s_r / 2 and of w - w^ within s_v / 2, so the true logit lies within
//     B = (s_r l1w[v] + s_v |x^|_1) / 2     (plus a margin for float rounding)
// of the screened one, a = s_r s_v (sum q_x q_w) + bias[v]. The maximum is at least
// L = max_v (a - B), so only ids with a + B >= L can be it. Each thread keeps, per row, its L
// so far and the ids that passed (a few: the test fails for almost every block once L is
// known); at the end the ids of all threads that pass the final L are checked exactly, ties
// to the lowest id as argmax's. A row whose candidates overflow their buffer, or whose input
// is not finite, is flagged (fallback[r] = 1) and left to the float kernel.
#define AE_I8_CAP 24  // candidates kept per row and thread

struct ae_cand {
    int32_t id;
    float hi;
};

struct ae_i8_row {  // one thread's state for one row
    float L;
    int32_t n;
    int32_t overflow;
    ae_cand c[AE_I8_CAP];
};

// Offer lanes of one block: hi/lo per lane, valid lanes only. Keeps L the max of lo seen and
// the lanes whose hi reaches it.
static inline void ae_i8_offer(ae_i8_row& st, const float* hi, const float* lo, int64_t v0,
                               int nvalid) {
    float L = st.L;
    for (int j = 0; j < nvalid; ++j) L = std::max(L, lo[j]);
    st.L = L;
    for (int j = 0; j < nvalid; ++j) {
        if (!(hi[j] >= L)) continue;
        if (st.n == AE_I8_CAP) {  // compact against the current L
            int32_t m = 0;
            for (int32_t i = 0; i < st.n; ++i)
                if (st.c[i].hi >= L) st.c[m++] = st.c[i];
            st.n = m;
            if (m == AE_I8_CAP) { st.overflow = 1; return; }
        }
        st.c[st.n++] = {(int32_t)(v0 + j), hi[j]};
    }
}

// Relative margin on B, and on |p| + |bias| for a = p + bias, for the float roundings of a and
// B (conversions, products, the bias add, the quantizers' divisions, which may move a
// quantized element by ~1e-5 of a step): errors of a few ulp of the terms, 1e-4 covers them.
#define AE_I8_REL 1e-4f

extern "C" void kernel(const float* x, const float* w, const float* bias, const int8_t* packed,
                       const float* s_v, const int32_t* sum_q, const float* l1w, int64_t* ids,
                       int64_t* fallback, int64_t N, int64_t K, int64_t V, int64_t has_bias,
                       int64_t no_token) {
    if (N == 0) {  // the query: whether the AVX-512 VNNI screen is compiled in
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
        ids[0] = 1;
#else
        ids[0] = 0;
#endif
        return;
    }
    const AeWithoutGil released(N * K * V >= AE_RELEASE_GIL_ELEMENTS);
    const int64_t K4 = K / 4, blocks = (V + 15) / 16;
    // Quantized rows.
    ae_vec<uint8_t> u((size_t)(N * K));
    ae_vec<float> s_r(N), l1x(N);
    for (int64_t r = 0; r < N; ++r) {
        const float* xr = x + r * K;
        float m = 0.f;
        bool finite = true;
        for (int64_t i = 0; i < K; ++i) {
            finite &= std::isfinite(xr[i]);
            m = std::max(m, std::fabs(xr[i]));
        }
        fallback[r] = !finite;
        const float s = finite ? m / 127.f : 0.f;
        const float inv = s > 0.f ? 1.f / s : 0.f;
        int64_t l1 = 0;
        for (int64_t i = 0; i < K; ++i) {
            int q = (int)std::lrint(xr[i] * inv);
            q = std::min(127, std::max(-127, q));
            u[r * K + i] = (uint8_t)(q + 128);
            l1 += q < 0 ? -q : q;
        }
        s_r[r] = s;
        l1x[r] = s * (float)l1;
    }
    const int64_t max_threads = ae_max_threads();
    std::vector<ae_i8_row> state((size_t)(max_threads * N));
    for (auto& st : state) { st.L = -INFINITY; st.n = 0; st.overflow = 0; }
    const int64_t chunk = std::max<int64_t>(1, blocks / (32 * max_threads));
    int64_t threads = 1;
    #pragma omp parallel
    {
        const int64_t t = ae_thread_num();
        #pragma omp single nowait
        threads = ae_team_size();
        ae_i8_row* mine = state.data() + t * N;
        alignas(64) float hi[16], lo[16];
        #pragma omp for schedule(monotonic: dynamic, chunk) nowait
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t v0 = b * 16;
            const int nvalid = (int)std::min<int64_t>(16, V - v0);
            const int8_t* wb = packed + b * K4 * 64;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
            const __m512 sv = _mm512_loadu_ps(s_v + v0);
            const __m512 l1 = _mm512_loadu_ps(l1w + v0);
            const __m512 bs = has_bias ? _mm512_loadu_ps(bias + v0) : _mm512_setzero_ps();
            const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(sum_q + v0), 7);
            const __m512 half = _mm512_set1_ps(0.5f * (1.f + AE_I8_REL));
            const __m512 rel = _mm512_set1_ps(AE_I8_REL);
            int64_t r = 0;
            for (; r < N; r += 8) {
                const int R = (int)std::min<int64_t>(8, N - r);
                __m512i acc[8];
                for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_si512();
                const uint8_t* ur = u.data() + r * K;
                if (R == 8) {
                    for (int64_t k = 0; k < K4; ++k) {
                        const __m512i wv = _mm512_loadu_si512(wb + k * 64);
                        for (int i = 0; i < 8; ++i) {
                            int32_t four;
                            std::memcpy(&four, ur + i * K + 4 * k, 4);
                            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(four), wv);
                        }
                    }
                } else {
                    for (int64_t k = 0; k < K4; ++k) {
                        const __m512i wv = _mm512_loadu_si512(wb + k * 64);
                        for (int i = 0; i < R; ++i) {
                            int32_t four;
                            std::memcpy(&four, ur + i * K + 4 * k, 4);
                            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(four), wv);
                        }
                    }
                }
                for (int i = 0; i < R; ++i) {
                    ae_i8_row& st = mine[r + i];
                    if (st.overflow) continue;
                    const float sr = s_r[r + i];
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], corr));
                    const __m512 p = _mm512_mul_ps(dot, _mm512_mul_ps(sv, _mm512_set1_ps(sr)));
                    const __m512 a = _mm512_add_ps(p, bs);
                    // B with its margin, plus the margin for the roundings of p and p + bias
                    __m512 B = _mm512_mul_ps(half, _mm512_fmadd_ps(
                        l1, _mm512_set1_ps(sr), _mm512_mul_ps(sv, _mm512_set1_ps(l1x[r + i]))));
                    B = _mm512_fmadd_ps(rel, _mm512_add_ps(_mm512_abs_ps(p), _mm512_abs_ps(bs)),
                                        B);
                    const __m512 h = _mm512_add_ps(a, B);
                    const __mmask16 pass = _mm512_cmp_ps_mask(h, _mm512_set1_ps(st.L), _CMP_GE_OQ)
                        & (__mmask16)((1u << nvalid) - 1u);
                    if (pass) {  // rare once L is known
                        _mm512_store_ps(hi, h);
                        _mm512_store_ps(lo, _mm512_sub_ps(a, B));
                        ae_i8_offer(st, hi, lo, v0, nvalid);
                    }
                }
            }
#else
            for (int64_t r = 0; r < N; ++r) {
                ae_i8_row& st = mine[r];
                if (st.overflow) continue;
                const uint8_t* ur = u.data() + r * K;
                const float sr = s_r[r];
                for (int j = 0; j < nvalid; ++j) {
                    int32_t acc = 0;
                    for (int64_t k = 0; k < K4; ++k)
                        for (int e = 0; e < 4; ++e)
                            acc += (int32_t)ur[4 * k + e] * (int32_t)wb[(k * 16 + j) * 4 + e];
                    const float dot = (float)(acc - 128 * sum_q[v0 + j]);
                    const float p = dot * (s_v[v0 + j] * sr);
                    const float bj = has_bias ? bias[v0 + j] : 0.f;
                    const float a = p + bj;
                    float B = 0.5f * (1.f + AE_I8_REL) *
                              (l1w[v0 + j] * sr + s_v[v0 + j] * l1x[r]);
                    B += AE_I8_REL * (std::fabs(p) + std::fabs(bj));
                    hi[j] = a + B;
                    lo[j] = a - B;
                }
                ae_i8_offer(st, hi, lo, v0, nvalid);
            }
#endif
        }
    }
    // The exact check of the ids that pass every thread's final L.
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; ++r) {
        if (fallback[r]) continue;
        float L = -INFINITY;
        for (int64_t t = 0; t < threads; ++t) {
            const ae_i8_row& st = state[t * N + r];
            if (st.overflow) fallback[r] = 1;
            L = std::max(L, st.L);
        }
        if (fallback[r]) continue;
        const float* xr = x + r * K;
        double best = -INFINITY;
        int64_t best_id = -1;
        for (int64_t t = 0; t < threads; ++t) {
            const ae_i8_row& st = state[t * N + r];
            for (int32_t i = 0; i < st.n; ++i) {
                if (!(st.c[i].hi >= L)) continue;
                const int64_t v = st.c[i].id;
                const float* wv = w + v * K;
                double s = has_bias ? (double)bias[v] : 0.0;
                for (int64_t k = 0; k < K; ++k) s += (double)xr[k] * (double)wv[k];
                if (s > best || (s == best && v < best_id)) { best = s; best_id = v; }
            }
        }
        if (best_id < 0) { fallback[r] = 1; continue; }  // cannot happen with finite inputs
        ids[r] = std::isfinite((float)best) ? best_id : no_token;
    }
}
