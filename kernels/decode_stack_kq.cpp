#include "common.h"

// decode_stack.cpp's layer loop over GGUF matrices kept as the file stores them (kquant.cpp,
// the kernel GGUFLinear calls), each projection with an optional float32 bias (Qwen2's q/k/v)
// added after its matmul as GGUFLinear adds it, and made of up to AE_KQ_PARTS parts that may
// differ in type (a fused q/k/v of Q5_0, Q5_0, Q8_0): each part writes its own columns of
// the projection's output, as GGUFLinear's parts do. Result: the per-op path's, to the bit.
#define AE_STACK_KQ 1
#define kernel ae_kquant_mm
#include "kquant.cpp"
#undef kernel

#define AE_KQ_PARTS 3
// A projection's addresses: its bias (0: none), its number of parts, then per part the
// address of its rows, its GGML type and its number of rows.
#define AE_KQ_PROJ (2 + 3 * AE_KQ_PARTS)
// Per layer, AE_STACK_PTRS int64s in `layers` [L, AE_STACK_PTRS]:
enum {
    AE_IN_NORM,      // input_layernorm weight [HD]
    AE_POST_NORM,    // post_attention_layernorm weight [HD]
    AE_QKV,          // qkv_proj [(H + 2 KVH) D, HD]
    AE_O = AE_QKV + AE_KQ_PROJ,         // o_proj [HD, H D]
    AE_GU = AE_O + AE_KQ_PROJ,          // gate_up_proj [2 I, HD]
    AE_DOWN = AE_GU + AE_KQ_PROJ,       // down_proj [HD, I]
    AE_KV = AE_DOWN + AE_KQ_PROJ,       // the layer's KV cache (decode_stack.cpp's)
    AE_STACK_PTRS
};

static inline void ae_stack_mm(const int64_t* layer, int at, const float* x, float* y,
                               int64_t T, int64_t N, int64_t K) {
    const int64_t* p = layer + at;
    int64_t col = 0;
    for (int64_t i = 0; i < p[1]; ++i) {
        const int64_t* part = p + 2 + 3 * i;
        ae_kquant_mm(x, reinterpret_cast<const uint8_t*>(part[0]), y + col, T, part[2], K, N,
                     part[1]);
        col += part[2];
    }
    if (p[0] != 0) {
        const float* bias = reinterpret_cast<const float*>(p[0]);
        for (int64_t t = 0; t < T; ++t) {
            float* yt = y + t * N;
            #pragma omp simd
            for (int64_t n = 0; n < N; ++n) yt[n] += bias[n];
        }
    }
}

#include "decode_stack.cpp"
