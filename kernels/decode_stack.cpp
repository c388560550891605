#include "common.h"
#include "stack_layout.h"

// A Llama-family decode step through every decoder layer in one call: the layer kernels of
// this folder, called in sequence from C++ instead of ~15 Python / PyTorch calls per layer.
// Each is the same kernel the per-op path calls (included here under its own name), with the
// same arguments, so the result is the per-op path's to the bit. T decode tokens (one per
// request, rows 0 .. T-1 in order). Its parameters: the structs of stack_layout.h. The
// matmuls: int4 weights (int4.cpp's layout; a bfloat16 model's through int4_bf16.cpp, as
// Int4Linear's) here; decode_stack_kq.cpp defines AE_STACK_KQ and its own ae_stack_mm (GGUF
// blocks kept packed, kquant.cpp, with a bias) and then includes this file.
// Activations in the layer kernels' element type ae_t (common.h): float32 or bfloat16 (the
// GGUF stack's matmuls then take float32 copies, as GGUFLinear's forward does).
#ifndef AE_STACK_KQ
#if AE_DTYPE == 0
#define kernel ae_int4_mm
#include "int4.cpp"
#undef kernel
#else  // a bfloat16 model: Int4Linear's bfloat16 kernel (AVX-512 BF16; Python checks it runs)
#define kernel ae_int4_bf16_mm
#include "int4_bf16.cpp"
#undef kernel
// ... and, for steps of many requests, int4_tile8.cpp's byte tiles (AE_KQ_TILE8 where the
// CPU has AVX-512 VNNI and BITALG)
#include "kquant.h"
#include "kquant_small.h"
#include "kquant_q32.h"
#include "kquant_tile8.h"
#endif
#endif
#define kernel ae_rms_norm
#include "rms_norm.cpp"
#undef kernel
#define kernel ae_rope
#include "rope.cpp"
#undef kernel
#define AE_SILU_TEAM_MIN 4096  // the stack's threads are hot: a few rows are worth sharing
#define kernel ae_silu_mul
#include "silu_mul.cpp"
#undef kernel
#define kernel ae_kv_write
#include "kv_write.cpp"
#undef kernel
// Between the stack's kernels the OpenMP threads are still spinning from the matmul before,
// so a team costs ~1 us here: even a few hundred positions are split over the threads
// (decode_step.py --batch 1 --prompt-len 300: best 9.2-9.8 ms a step, 12.4-13.1 without).
#define AE_ATTN_TEAM_MIN 0
#define kernel ae_decode_attention
#include "decode_attention.cpp"
#undef kernel
#define kernel ae_lora
#include "lora.cpp"
#undef kernel

#ifndef AE_STACK_KQ
// y [T, N] = x [T, K] @ W.T for int4 projection p (int4.cpp's packed rows data[0], float16
// (scale, min) aux[0]). A bfloat16 model: the float32 result rounded once to bfloat16, as
// Int4Linear's forward does (int4_bf16_mm(x).to(bfloat16)); where `tiles` (a step of
// int4.TILE_REQUESTS requests or more), int4_tile8.cpp's byte tiles over activations rounded
// to int8, as Int4Linear's forward takes them for such a step.
static inline void ae_stack_mm(const AeProj& p, const ae_t* x, ae_t* y, int64_t T, bool tiles) {
    const int64_t N = p.n, K = p.k;
    const uint8_t* q = reinterpret_cast<const uint8_t*>(p.data[0]);
    const uint16_t* sm = reinterpret_cast<const uint16_t*>(p.aux[0]);
#if AE_DTYPE == 0
    (void)tiles;
    ae_int4_mm(x, q, sm, y, T, N, K);
#else
#ifdef AE_KQ_TILE8
    if (tiles) {
        kq_tile8<KQ_INT4_SPLIT>(x, true, q, y, true, T, N, K, N, K / 2, sm);
        return;
    }
#else
    (void)tiles;
#endif
    static thread_local ae_vec<float> ybuf;
    if ((int64_t)ybuf.size() < T * N) ybuf.resize(T * N);
    float* yf = ybuf.data();
    ae_int4_bf16_mm(x, q, sm, yf, T, N, K);
    int64_t i = 0;
#ifdef AE_AVX2
    for (; i + 8 <= T * N; i += 8) ae_store8(y + i, _mm256_loadu_ps(yf + i));
#endif
    for (; i < T * N; ++i) ae_put(y + i, yf[i]);
#endif
}
#endif

template <typename P>
static inline P* ae_ptr(int64_t address) { return reinterpret_cast<P*>(address); }

// LoRA (--enable-lora), when the step has adapter rows (lora_slots: each token's slot): the
// projection's slot tables A, B, their rows and spans (lora.cpp's), r wide, added right after
// its matmul, as the per-op path's hooks do.
static inline void ae_stack_lora(const AeProj& p, const int64_t* lora_slots, const ae_t* x,
                                 ae_t* y, int64_t T) {
    if (lora_slots == nullptr || p.lora_a == 0) return;
    ae_lora(x, y, ae_ptr<const float>(p.lora_a), ae_ptr<const float>(p.lora_b), lora_slots,
            ae_ptr<const int64_t>(p.lora_rows), ae_ptr<const int64_t>(p.lora_span), T, p.k, p.n,
            p.lora_r, p.k, p.n);
}

// model: the address of the AeModel (stack_layout.h) of the model's layers, built once; step:
// this step's AeStep. With `layout` (not 0): only the structs' layout written there (int64s),
// for Python to check against its reading of stack_layout.h.
extern "C" void kernel(uintptr_t model, uintptr_t step, uintptr_t layout) {
    if (layout != 0) {
        ae_stack_layout(reinterpret_cast<int64_t*>(layout));
        return;
    }
    const AeModel& m = *reinterpret_cast<const AeModel*>(model);
    const AeStep& s = *reinterpret_cast<const AeStep*>(step);
    const AeLayer* layers = ae_ptr<const AeLayer>(m.layers);
    const int64_t T = s.tokens, HD = m.hidden, H = m.heads, KVH = m.kv_heads, D = m.head_dim;
    const int64_t I = m.intermediate;
    const float eps = (float)m.eps;
    const int64_t* lora_slots = ae_ptr<const int64_t>(s.lora_slots);
    const bool tiles = s.tiles != 0;
    const ae_t* cos = ae_ptr<const ae_t>(s.cos);
    const ae_t* sin = ae_ptr<const ae_t>(s.sin);
    const int64_t* slots = ae_ptr<const int64_t>(s.slots);
    const int64_t* tables = ae_ptr<const int64_t>(s.tables);
    const int64_t* lens = ae_ptr<const int64_t>(s.lens);
    const int64_t* rows = ae_ptr<const int64_t>(s.rows);
    const AeWithoutGil released;  // milliseconds of work: the event loop runs meanwhile
    const int64_t QKV = (H + 2 * KVH) * D;
    static thread_local ae_vec<ae_t> buf;
    const int64_t need = T * (3 * HD + QKV + H * D + 3 * I);
    if ((int64_t)buf.size() < need) buf.resize(need);
    ae_t* residual = buf.data();
    ae_t* x = residual + T * HD;       // a norm's output, the next matmul's input
    ae_t* hs = x + T * HD;             // a sublayer's output
    ae_t* qkv = hs + T * HD;
    ae_t* att = qkv + T * QKV;
    ae_t* gu = att + T * H * D;
    ae_t* act = gu + T * 2 * I;
    const ae_t* h = ae_ptr<const ae_t>(s.h);
    std::memcpy(residual, h, T * HD * sizeof(ae_t));
    for (int64_t l = 0; l < m.num_layers; ++l) {
        const AeLayer& w = layers[l];
        ae_kv_t* kv = ae_ptr<ae_kv_t>(w.kv);
        if (l == 0)
            ae_rms_norm(h, residual, ae_ptr<const ae_t>(w.in_norm.w), x, T, HD, HD, 0, eps);
        else  // residual += h; x = norm(residual)
            ae_rms_norm(hs, residual, ae_ptr<const ae_t>(w.in_norm.w), x, T, HD, HD, 1, eps);
        ae_stack_mm(w.qkv, x, qkv, T, tiles);
        ae_stack_lora(w.qkv, lora_slots, x, qkv, T);
        ae_rope(qkv, cos, sin, T, H + KVH, D, QKV);  // q and k heads, in place
        ae_kv_write(qkv + H * D, qkv + (H + KVH) * D, kv, slots, T, KVH * D, QKV, QKV, s.v_off);
        ae_decode_attention(qkv, kv, tables, lens, rows, att, T, H, KVH, D, s.block_size,
                            s.table_stride, QKV, s.split, (float)w.scale, s.v_off, 0, 0.f);
        ae_stack_mm(w.o, att, hs, T, tiles);
        ae_stack_lora(w.o, lora_slots, att, hs, T);
        ae_rms_norm(hs, residual, ae_ptr<const ae_t>(w.post_attn_norm.w), x, T, HD, HD, 1, eps);
        ae_stack_mm(w.gate_up, x, gu, T, tiles);
        ae_stack_lora(w.gate_up, lora_slots, x, gu, T);
        ae_silu_mul(gu, act, T, I);
        ae_stack_mm(w.down, act, hs, T, tiles);
        ae_stack_lora(w.down, lora_slots, act, hs, T);
    }
    ae_rms_norm(hs, residual, ae_ptr<const ae_t>(m.final_norm.w), ae_ptr<ae_t>(s.out), T, HD, HD,
                1, eps);
}
