#include "common.h"

// ids [M] = argmax of each row of x float32 [M, V], as torch.argmax(dim=-1) gives it: the
// first index of the largest value; a row with a NaN gives its first NaN's index (argmax
// treats NaN as the largest). The greedy sampler's argmax over the vocabulary, where
// PyTorch's CPU argmax, a scalar loop per row, took 27 / 135 us at 1 / 9 rows of 49,152 ids
// (2 threads) against its amax's 5 / 15: 16 lanes here each keep their first largest value and
// its index, then the lanes' smallest index among the largest values wins.
//
// no_token >= 0 is ignored; below 0 (the sampler's NO_TOKEN), a row whose largest value is
// not finite (a NaN, +inf, or every value -inf) gets no_token instead: the greedy sampler's
// whole answer in one pass.
extern "C" void kernel(const float* x, int64_t* ids, int64_t M, int64_t V, int64_t no_token) {
    const int64_t work = M * V;
    #pragma omp parallel for schedule(static) if (M > 1 && work >= (1 << 16))
    for (int64_t r = 0; r < M; ++r) {
        const float* xr = x + r * V;
        int64_t j = 0, best = 0;
        float top = -INFINITY;
        bool nan = false;
#ifdef __AVX512F__
        if (V >= 16) {
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            __m512i vidx = _mm512_setzero_si512();
            __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const __m512i step = _mm512_set1_epi32(16);
            __mmask16 unordered = 0;
            for (; j + 16 <= V; j += 16) {
                const __m512 v = _mm512_loadu_ps(xr + j);
                unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
                vmax = _mm512_mask_mov_ps(vmax, gt, v);
                vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
                idx = _mm512_add_epi32(idx, step);
            }
            nan = unordered != 0;
            top = _mm512_reduce_max_ps(vmax);
            // the smallest index among the lanes holding the largest value (-inf rows: 0)
            const __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
            best = _mm512_mask_reduce_min_epi32(at, vidx);
        }
#endif
        for (; j < V && !nan; ++j) {
            if (xr[j] != xr[j]) nan = true;
            else if (xr[j] > top) { top = xr[j]; best = j; }
        }
        if (nan) {  // the first NaN (rare: a broken row, reported as no token downstream)
            for (j = 0; j < V; ++j)
                if (xr[j] != xr[j]) break;
            best = j;
        }
        ids[r] = (no_token < 0 && (nan || !std::isfinite(top))) ? no_token : best;
    }
}
