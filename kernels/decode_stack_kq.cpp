#include "common.h"

// decode_stack.cpp's layer loop over GGUF matrices kept as the file stores them (kquant.cpp,
// the kernel GGUFLinear calls), float32 or bfloat16 activations (AE_DTYPE), each projection
// with an optional bias in that type (Qwen2's q/k/v)
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

// y [T, N] = x [T, K] @ W.T (+ bias) for the projection at layer[at]. A bfloat16 model: x
// widened to float32, the matmul and the bias add in float32, y rounded to bfloat16 once, as
// GGUFLinear's forward does (x.float(), out += bias.float(), out.to(bfloat16)).
static inline void ae_stack_mm(const int64_t* layer, int at, const ae_t* x, ae_t* y,
                               int64_t T, int64_t N, int64_t K, bool tiles) {
    (void)tiles;  // each part's type carries its own choice (decode_stack.py's _kq_proj)
    const int64_t* p = layer + at;
#if AE_DTYPE == 0
    const float* xf = x;
    float* yf = y;
#else
    static thread_local ae_vec<float> xbuf, ybuf;
    if ((int64_t)xbuf.size() < T * K) xbuf.resize(T * K);
    if ((int64_t)ybuf.size() < T * N) ybuf.resize(T * N);
    float* xw = xbuf.data();
    for (int64_t i = 0; i < T * K; ++i) xw[i] = ae_get(x + i);
    const float* xf = xw;
    float* yf = ybuf.data();
#endif
    int64_t col = 0;
    for (int64_t i = 0; i < p[1]; ++i) {
        const int64_t* part = p + 2 + 3 * i;
        ae_kquant_mm(xf, reinterpret_cast<const uint8_t*>(part[0]), yf + col, T, part[2], K, N,
                     part[1]);
        col += part[2];
    }
    const ae_t* bias = reinterpret_cast<const ae_t*>(p[0]);
    for (int64_t t = 0; t < T; ++t) {
        float* yt = yf + t * N;
        if (bias != nullptr) {
            #pragma omp simd
            for (int64_t n = 0; n < N; ++n) yt[n] += ae_get(bias + n);
        }
#if AE_DTYPE != 0
        for (int64_t n = 0; n < N; ++n) ae_put(y + t * N + n, yt[n]);
#endif
    }
}

#include "decode_stack.cpp"
