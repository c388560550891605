#include "common.h"
#include "kquant.h"
#include "kquant_small.h"
#include "kquant_q32.h"
#include "kquant_tile8.h"

// x: bfloat16 [M, K]; q: uint8 [N, K / 2], sm: float16 [N, K / 32, 2] (int4.cpp's layout: w =
// q * scale + min); out: bfloat16 [M, N]. The prefill chunks of a bfloat16 int4 model, and
// its decode steps of int4.TILE_REQUESTS requests or more (decode_stack.cpp calls kq_tile8 for
// those itself), through kquant_tile8.h's byte dot products (lanes across 16 weight rows; the activations rounded to
// int8 once per block of 32, as llama.cpp's Q8_1 activations against Q4_1): the weights read
// as they are, with no bfloat16 copy of them made per call. SmolLM2's four matmuls of a
// layer at 95 rows, 2 threads: 0.68 ms against 1.05 for the dequantization and PyTorch's
// bfloat16 GEMM.
//
// M == 0 is a query: out[0] = 1 where the kernel is compiled in (AVX-512 VNNI and BITALG),
// else 0.
extern "C" void kernel(const uint16_t* x, const uint8_t* q, const uint16_t* sm, uint16_t* out,
                       int64_t M, int64_t N, int64_t K) {
#ifdef AE_KQ_TILE8
    if (M == 0) { out[0] = 1; return; }
    const AeWithoutGil released(N * K >= AE_RELEASE_GIL_ELEMENTS);
    kq_tile8<KQ_INT4_SPLIT>(x, true, q, out, true, M, N, K, N, K / 2, sm);
#else
    (void)x; (void)q; (void)sm; (void)M; (void)N; (void)K;
    out[0] = 0;
#endif
}
