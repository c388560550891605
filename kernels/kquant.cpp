#include "common.h"
#include "kquant.h"
#include <vector>

// out[m * ldo + n] = dot(x[m], dequant(w[n])) for a GGUF matrix kept as the file stores it:
// x float [M, K]; w: N rows of kq_row_bytes(type, K) bytes; out: float with row stride ldo
// (a part of a fused projection writes its own columns of the shared output).
//
// Each weight row is dequantized once per call into a buffer that stays in L1 (bit-exact,
// kquant.h) and multiplied in float32 against every input row; from two input rows on, two
// weight rows share each input load (ae_dots2). The weights are read once per call whatever
// M; results equal x @ dequant(w).T up to float32 summation order.
extern "C" void kernel(const float* x, const uint8_t* w, float* out, int64_t M, int64_t N,
                       int64_t K, int64_t ldo, int64_t type) {
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);
    const int64_t rb = kq_row_bytes(type, K);
    if (rb == 0) return;
    #pragma omp parallel
    {
        std::vector<float> buf(2 * K);
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
