#include "common.h"
#include <vector>

// Batched LoRA: every row of a step adds its own adapter's low-rank update in place,
//   y[t] += B[s]^T (A[s] x[t])    with s = slots[t]; slot 0 is the base model (no update).
// x: [T, K] (row stride xs), y: [T, N] (row stride ys), both ae_t. A: [S, R, K] and
// B: [S, R, N] float32, the adapter of slot s in its first rows[s] rows (the rest zero and
// skipped). The rows of one step share few adapters, so A[s] and B[s] stay in cache across
// the rows that use them; threads take rows. The update is summed in float32 and added to y
// with one rounding.
extern "C" void kernel(const ae_t* x, ae_t* y, const float* A, const float* B,
                       const int64_t* slots, const int64_t* rows, int64_t T, int64_t K,
                       int64_t N, int64_t R, int64_t xs, int64_t ys) {
    #pragma omp parallel for schedule(static) if (T * R * (K + N) >= (1 << 18))
    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        if (s <= 0) continue;
        const int64_t n = rows[s] < R ? rows[s] : R;
        if (n <= 0) continue;
        static thread_local std::vector<float> xa, acc;
        xa.resize(n);
        acc.assign(N, 0.f);
        const ae_t* xt = x + t * xs;
        const float* As = A + s * R * K;
        for (int64_t r = 0; r < n; ++r) {
            const float* a = As + r * K;
            float sum = 0.f;
            #pragma omp simd reduction(+ : sum)
            for (int64_t k = 0; k < K; ++k) sum += a[k] * ae_get(xt + k);
            xa[r] = sum;
        }
        const float* Bs = B + s * R * N;
        float* c = acc.data();
        int64_t r = 0;
        for (; r + 4 <= n; r += 4) {  // four ranks per pass over the row
            const float* b0 = Bs + r * N; const float* b1 = b0 + N;
            const float* b2 = b1 + N; const float* b3 = b2 + N;
            const float c0 = xa[r], c1 = xa[r + 1], c2 = xa[r + 2], c3 = xa[r + 3];
            #pragma omp simd
            for (int64_t j = 0; j < N; ++j)
                c[j] += c0 * b0[j] + c1 * b1[j] + c2 * b2[j] + c3 * b3[j];
        }
        for (; r < n; ++r) {
            const float* b = Bs + r * N;
            const float cr = xa[r];
            #pragma omp simd
            for (int64_t j = 0; j < N; ++j) c[j] += cr * b[j];
        }
        ae_t* yt = y + t * ys;
        for (int64_t j = 0; j < N; ++j) ae_put(yt + j, ae_get(yt + j) + c[j]);
    }
}
