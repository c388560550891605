#include "common.h"
#include "kquant.h"
#include "kquant_small.h"
#include "kquant_q32.h"
#include "kquant_tile8.h"

// x: bfloat16 [M, K]; q: int8 [N, K]; scales: float32 [N, groups], groups 1 (one per row) or
// K / 32 (one per block of 32: GGUF's Q8_0); out: float32 [M, N]. int8_bf16.cpp's weights
// through kquant_tile8.h's byte dot products (lanes across 16 weight rows; the activations
// rounded to int8 once per block of 32, as llama.cpp's Q8_0 activations): an int8 layer's or
// logits head's decode steps of int4.TILE_REQUESTS requests or more. The embedded SmolLM2's
// 49,152 x 576 head at 32 rows: see benchmarks/packed_matmul.py --bfloat16. A row's result
// does not depend on the rows beside it.
//
// M == 0 is a query: out[0] = 1 where the kernel is compiled in (AVX-512 VNNI and BITALG),
// else 0.
extern "C" void kernel(const uint16_t* x, const int8_t* q, const float* scales, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t groups) {
#ifdef AE_KQ_TILE8
    if (M == 0) { out[0] = 1; return; }
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);
    kq_tile8<KQ_INT8_SPLIT>(x, true, reinterpret_cast<const uint8_t*>(q), out, false, M, N, K,
                            N, K, nullptr, scales, groups);
#else
    (void)x; (void)q; (void)scales; (void)M; (void)N; (void)K; (void)groups;
    out[0] = 0;
#endif
}
