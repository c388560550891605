#include "common.h"
#include <vector>

// Batched LoRA: every row of a step adds its own adapter's low-rank update in place,
//   y[t] += B[s]^T (A[s] x[t])    with s = slots[t]; slot 0 is the base model (no update).
// x: [T, K] (row stride xs), y: [T, N] (row stride ys), both ae_t. A: [S, R, K] and
// B: [S, R, N] float32, the adapter of slot s in its first rows[s] rows (the rest zero and
// skipped); span: [S, R, 2] int64, the columns [lo, hi) where row r of B[s] may be non-zero
// (a fused projection's shard: q's rows of B touch only q's outputs), the only ones read.
//
// Segmented: the rows are grouped by slot (a counting sort), and each group is cut into
// tiles of up to AE_LORA_TILE rows that read their adapter's A and B once for the whole
// tile (a row at a time would stream the adapter's weights once per row). Threads take
// tiles. The update is summed in float32 and added to y with one rounding.
#define AE_LORA_TILE 8

extern "C" void kernel(const ae_t* x, ae_t* y, const float* A, const float* B,
                       const int64_t* slots, const int64_t* rows, const int64_t* span,
                       int64_t T, int64_t K, int64_t N, int64_t R, int64_t xs, int64_t ys) {
    // Group the rows by slot (slot 0 and empty slots dropped).
    int64_t S = 0;
    for (int64_t t = 0; t < T; ++t) if (slots[t] + 1 > S) S = slots[t] + 1;
    std::vector<int64_t> count(S + 1, 0), order;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        if (s > 0 && rows[s] > 0) ++count[s + 1];
    }
    for (int64_t s = 0; s < S; ++s) count[s + 1] += count[s];
    order.resize(count[S]);
    {
        std::vector<int64_t> at(count.begin(), count.end() - 1);
        for (int64_t t = 0; t < T; ++t) {
            const int64_t s = slots[t];
            if (s > 0 && rows[s] > 0) order[at[s]++] = t;
        }
    }
    // Tiles: (slot, first index into order, rows).
    std::vector<int64_t> tiles;
    for (int64_t s = 1; s < S; ++s)
        for (int64_t i = count[s]; i < count[s + 1]; i += AE_LORA_TILE) {
            tiles.push_back(s);
            tiles.push_back(i);
            tiles.push_back(count[s + 1] - i < AE_LORA_TILE ? count[s + 1] - i : AE_LORA_TILE);
        }
    const int64_t num_tiles = (int64_t)tiles.size() / 3;
    const int64_t work = (int64_t)order.size() * R * (K + N);
    #pragma omp parallel for schedule(dynamic, 1) if (num_tiles > 1 && work >= (1 << 21))
    for (int64_t w = 0; w < num_tiles; ++w) {
        const int64_t s = tiles[3 * w], first = tiles[3 * w + 1], m = tiles[3 * w + 2];
        const int64_t n = rows[s] < R ? rows[s] : R;
        static thread_local ae_vec<float> acc, xf;
        acc.assign(m * N, 0.f);
        xf.resize(m * K);
        for (int64_t i = 0; i < m; ++i) {  // the tile's inputs, as float32
            const ae_t* xt = x + order[first + i] * xs;
            for (int64_t k = 0; k < K; ++k) xf[i * K + k] = ae_get(xt + k);
        }
        const float* As = A + s * R * K;
        const float* Bs = B + s * R * N;
        const int64_t* sp = span + s * R * 2;
        float xa[AE_LORA_TILE];
        for (int64_t r = 0; r < n; ++r) {
            const float* a = As + r * K;
#ifdef AE_AVX2
            if (K % 8 == 0) {
                ae_dots(a, xf.data(), xa, m, 1, K);  // xa[i] = dot(a, x_i)
            } else
#endif
            for (int64_t i = 0; i < m; ++i) {
                const float* xi = xf.data() + i * K;
                float sum = 0.f;
                for (int64_t k = 0; k < K; ++k) sum += a[k] * xi[k];
                xa[i] = sum;
            }
            const int64_t lo = sp[2 * r], hi = sp[2 * r + 1] < N ? sp[2 * r + 1] : N;
            const float* b = Bs + r * N;
            for (int64_t i = 0; i < m; ++i) {
                float* c = acc.data() + i * N;
                const float ci = xa[i];
                int64_t j = lo;
#ifdef AE_AVX2
                const __m256 cv = _mm256_set1_ps(ci);
                for (; j + 8 <= hi; j += 8)
                    _mm256_storeu_ps(c + j, _mm256_fmadd_ps(cv, _mm256_loadu_ps(b + j),
                                                            _mm256_loadu_ps(c + j)));
#endif
                for (; j < hi; ++j) c[j] += ci * b[j];
            }
        }
        for (int64_t i = 0; i < m; ++i) {
            ae_t* yt = y + order[first + i] * ys;
            const float* c = acc.data() + i * N;
            for (int64_t j = 0; j < N; ++j) ae_put(yt + j, ae_get(yt + j) + c[j]);
        }
    }
}
