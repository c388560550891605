#include "common.h"
#include "kquant.h"

// Rows ids[0..n) of a GGUF matrix w (rows of kq_row_bytes(type, K) bytes) into float32
// out [n, K], bit-exact with the `gguf` package's dequantize (kquant.h): an embedding
// lookup dequantizes only the rows it looks up; a prefill chunk a tile of rows at a time.
extern "C" void kernel(const uint8_t* w, const int64_t* ids, float* out, int64_t n, int64_t K,
                       int64_t type) {
    const AeWithoutGil released(n * K >= AE_RELEASE_GIL_ELEMENTS);
    const int64_t rb = kq_row_bytes(type, K);
    #pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; ++i) kq_dequant_row(type, w + ids[i] * rb, out + i * K, K);
}
