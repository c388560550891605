#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

// Greedy tokens straight from the hidden states: ids[r] = argmax_v (x[r] . w[v] + bias[v]),
// with the logits never written to memory. x: float [N, K]; w: float [V, K] (the head's own
// layout); bias: float [V] when has_bias; ids: int64 [N].
//
// The threads split the vocabulary, and each keeps a best (value, id) per row over its range.
// The ranges are merged in vocabulary order, so ties go to the lowest id, as argmax's do.
// Inside a range: chunks of 64 vocabulary rows (64 K floats, in L1 or L2) against every input
// row, in tiles of up to 3 input rows x 4 vocabulary rows (twelve accumulators fed by
// 3 + 4 loads per 8 inputs), each tile reduced by horizontal adds. A row that meets a NaN
// logit, or whose maximum is not finite, gets no_token. MKL's sgemm is weak at these shapes
// (few rows, K = 64 .. 1k): see sampler/greedy_head.py for the figures.
#define AE_HEAD_CHUNK 64

struct ae_best {
    float value;
    int64_t id;
    int64_t nan;
};

static inline void ae_offer(ae_best& b, float v, int64_t id) {
    if (v > b.value) { b.value = v; b.id = id; }
    else if (v != v) b.nan = 1;
}

// The logits of input rows r0 .. r0 + R - 1 against vocabulary rows v .. v + 3, offered to
// each row's best.
template <int R>
static inline void ae_head_tile(const float* x, const float* w, const float* bias, int64_t K,
                                int64_t r0, int64_t v, ae_best* best) {
    float out[R][4];
#ifdef AE_AVX2
    if (K % 8 == 0) {
        __m256 a[R][4];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_ps();
        const float* xr = x + r0 * K;
        const float* wv = w + v * K;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 xv[R];
            for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(xr + r * K + k);
            #pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const __m256 wj = _mm256_loadu_ps(wv + j * K + k);
                for (int r = 0; r < R; ++r) a[r][j] = _mm256_fmadd_ps(xv[r], wj, a[r][j]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]),
                                            _mm256_hadd_ps(a[r][2], a[r][3]));
            _mm_storeu_ps(out[r], _mm_add_ps(_mm256_castps256_ps128(h),
                                             _mm256_extractf128_ps(h, 1)));
        }
    } else
#endif
    {
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 4; ++j) {
                float s = 0.f;
                for (int64_t k = 0; k < K; ++k) s += x[(r0 + r) * K + k] * w[(v + j) * K + k];
                out[r][j] = s;
            }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j)
            ae_offer(best[r0 + r], bias ? out[r][j] + bias[v + j] : out[r][j], v + j);
}

extern "C" void kernel(const float* x, const float* w, const float* bias, int64_t* ids,
                       int64_t N, int64_t K, int64_t V, int64_t has_bias, int64_t no_token) {
    const AeWithoutGil released(N * K * V >= AE_RELEASE_GIL_ELEMENTS);
    const float* b = has_bias ? bias : nullptr;
#ifdef _OPENMP
    const int64_t max_threads = omp_get_max_threads();
#else
    const int64_t max_threads = 1;
#endif
    // Per thread and row, the best so far; the team reads the calling thread's vector.
    static thread_local std::vector<ae_best> all;
    all.assign(max_threads * N, ae_best{-INFINITY, 0, 0});
    ae_best* const base = all.data();
    int64_t threads = 1;
    #pragma omp parallel
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num();
        #pragma omp single
        threads = omp_get_num_threads();
#else
        const int64_t t = 0;
#endif
        ae_best* best = base + t * N;  // this thread's range, in whole quads:
        const int64_t quads = V / 4, per = (quads + threads - 1) / threads;
        const int64_t v_begin = std::min(quads, t * per) * 4;
        const int64_t v_end = t == threads - 1 ? V : std::min(quads, (t + 1) * per) * 4;
        for (int64_t c = v_begin; c < v_end; c += AE_HEAD_CHUNK) {
            const int64_t c_end = std::min(v_end, c + AE_HEAD_CHUNK);
            const int64_t c_quads = c + (c_end - c) / 4 * 4;
            int64_t r = 0;
            for (; r + 3 <= N; r += 3)
                for (int64_t v = c; v < c_quads; v += 4) ae_head_tile<3>(x, w, b, K, r, v, best);
            for (; r + 2 <= N; r += 2)
                for (int64_t v = c; v < c_quads; v += 4) ae_head_tile<2>(x, w, b, K, r, v, best);
            if (r < N)
                for (int64_t v = c; v < c_quads; v += 4) ae_head_tile<1>(x, w, b, K, r, v, best);
            for (int64_t v = c_quads; v < c_end; ++v)  // the vocabulary's last < 4 rows
                for (r = 0; r < N; ++r) {
                    float s = 0.f;
                    for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * w[v * K + k];
                    ae_offer(best[r], b ? s + b[v] : s, v);
                }
        }
    }
    for (int64_t r = 0; r < N; ++r) {
        ae_best m = base[r];
        for (int64_t t = 1; t < threads; ++t) {
            const ae_best& o = base[t * N + r];
            if (o.value > m.value) { m.value = o.value; m.id = o.id; }
            m.nan |= o.nan;
        }
        ids[r] = (m.nan || !std::isfinite(m.value)) ? no_token : m.id;
    }
}
