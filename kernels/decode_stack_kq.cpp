#include "common.h"

// decode_stack.cpp's layer loop over GGUF matrices kept as the file stores them (kquant.cpp,
// the kernel GGUFLinear calls), float32 or bfloat16 activations (AE_DTYPE), each projection
// with an optional bias in that type (Qwen2's q/k/v) added after its matmul as GGUFLinear
// adds it, and made of parts that may differ in type (a fused q/k/v of Q5_0, Q5_0, Q8_0;
// AE_STACK_PARTS at most): each part writes its own columns of the projection's output, as
// GGUFLinear's parts do. Result: the per-op path's, to the bit.
#define AE_STACK_KQ 1
#define kernel ae_kquant_mm
#include "kquant.cpp"
#undef kernel

#include "stack_layout.h"

// y [T, N] = x [T, K] @ W.T (+ bias) for GGUF projection p: its parts (data[i]: rows[i] rows
// of GGML type | flag aux[i]) write their columns of y in order. A bfloat16 model: x widened
// to float32, the matmul and the bias add in float32, y rounded to bfloat16 once, as
// GGUFLinear's forward does (x.float(), out += bias.float(), out.to(bfloat16)).
static inline void ae_stack_mm(const AeProj& p, const ae_t* x, ae_t* y, int64_t T, bool tiles) {
    (void)tiles;  // each part's type carries its own choice (cpu_stack.py's projections)
    const int64_t N = p.n, K = p.k;
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
    for (int64_t i = 0; i < p.parts; ++i) {
        ae_kquant_mm(xf, reinterpret_cast<const uint8_t*>(p.data[i]), yf + col, T, p.rows[i], K,
                     N, p.aux[i]);
        col += p.rows[i];
    }
    const ae_t* bias = reinterpret_cast<const ae_t*>(p.bias);
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
