#include "common.h"

// A Llama-family decode step through every decoder layer in one call: the layer kernels of
// this folder, called in sequence from C++ instead of ~15 Python / PyTorch calls per layer.
// Each is the same kernel the per-op path calls (included here under its own name), with the
// same arguments, so the result is the per-op path's to the bit. T decode tokens (one per
// request, rows 0 .. T-1 in order). The matmuls: int4 weights (int4.cpp's layout; a bfloat16
// model's through int4_bf16.cpp, as Int4Linear's) here; decode_stack_kq.cpp defines AE_STACK_KQ and its own ae_stack_mm
// (GGUF blocks kept packed, kquant.cpp, with a bias) and then includes this file.
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
// Per layer, AE_STACK_PTRS addresses (int64) in `layers` [L, AE_STACK_PTRS]:
enum {
    AE_IN_NORM,      // input_layernorm weight [HD]
    AE_QKV_Q,        // qkv_proj int4 [(H + 2 KVH) D, HD / 2] and (scale, min) float16
    AE_QKV_SM,
    AE_O_Q,          // o_proj [HD, H D / 2]
    AE_O_SM,
    AE_POST_NORM,    // post_attention_layernorm weight [HD]
    AE_GU_Q,         // gate_up_proj [2 I, HD / 2]
    AE_GU_SM,
    AE_DOWN_Q,       // down_proj [HD, I / 2]
    AE_DOWN_SM,
    AE_KV,           // the layer's KV cache [2, blocks, BS, KVH, D] of ae_kv_t; V at + v_off
    AE_STACK_PTRS
};
#define AE_QKV AE_QKV_Q
#define AE_O AE_O_Q
#define AE_GU AE_GU_Q
#define AE_DOWN AE_DOWN_Q

// y [T, N] = x [T, K] @ W.T for the projection whose addresses start at layer[at]. A
// bfloat16 model: the float32 result rounded once to bfloat16, as Int4Linear's forward does
// (int4_bf16_mm(x).to(bfloat16)); where `tiles` (a step of int4.TILE_REQUESTS requests or
// more), int4_tile8.cpp's byte tiles over activations rounded to int8, as Int4Linear's
// forward takes them for such a step.
static inline void ae_stack_mm(const int64_t* layer, int at, const ae_t* x, ae_t* y,
                               int64_t T, int64_t N, int64_t K, bool tiles) {
    const uint8_t* q = reinterpret_cast<const uint8_t*>(layer[at]);
    const uint16_t* sm = reinterpret_cast<const uint16_t*>(layer[at + 1]);
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
static inline P* ae_ptr(const int64_t* layer, int i) { return reinterpret_cast<P*>(layer[i]); }

// LoRA (--enable-lora), when lora_slots is not null: per layer, for qkv, o, gate_up, down in
// that order, the addresses of the slot tables A, B, their rows and spans (lora.cpp's), 16
// int64s in lora [L, 16]; lora_r [4] the tables' widths; lora_slots [T] each token's slot.
// Each projection's update is added right after its matmul, as the per-op path's hooks do.
enum { AE_LORA_QKV, AE_LORA_O, AE_LORA_GU, AE_LORA_DOWN };

static inline void ae_stack_lora(const int64_t* lora, const int64_t* lora_r,
                                 const int64_t* lora_slots, int64_t l, int m, const ae_t* x,
                                 ae_t* y, int64_t T, int64_t K, int64_t N) {
    if (lora_slots == nullptr) return;
    const int64_t* p = lora + l * 16 + m * 4;
    ae_lora(x, y, reinterpret_cast<const float*>(p[0]), reinterpret_cast<const float*>(p[1]),
            lora_slots, reinterpret_cast<const int64_t*>(p[2]),
            reinterpret_cast<const int64_t*>(p[3]), T, K, N, lora_r[m], K, N);
}

// h: [T, HD] the token embeddings; out: [T, HD] the final normed hidden states (final_norm).
// cos, sin: [T, D] (RotaryEmbedding's); slots: int64 [T] cache slots of the new tokens;
// tables, lens, rows, split: decode_attention.cpp's (lens include the new token).
// use_tiles: a bfloat16 int4 stack's matmuls through the byte tiles (ae_stack_mm).
extern "C" void kernel(const ae_t* h, ae_t* out, const int64_t* layers, const ae_t* final_norm,
                       const ae_t* cos, const ae_t* sin, const int64_t* slots,
                       const int64_t* tables, const int64_t* lens, const int64_t* rows,
                       int64_t L, int64_t T, int64_t HD, int64_t H, int64_t KVH, int64_t D,
                       int64_t I, int64_t BS, int64_t table_stride, int64_t split,
                       int64_t v_off, float scale, float eps, const int64_t* lora,
                       const int64_t* lora_r, const int64_t* lora_slots, int64_t use_lora,
                       int64_t use_tiles) {
    if (!use_lora) lora_slots = nullptr;
    const bool tiles = use_tiles != 0;
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
    std::memcpy(residual, h, T * HD * sizeof(ae_t));
    for (int64_t l = 0; l < L; ++l) {
        const int64_t* w = layers + l * AE_STACK_PTRS;
        ae_kv_t* kv = ae_ptr<ae_kv_t>(w, AE_KV);
        if (l == 0)
            ae_rms_norm(h, residual, ae_ptr<const ae_t>(w, AE_IN_NORM), x, T, HD, HD, 0, eps);
        else  // residual += h; x = norm(residual)
            ae_rms_norm(hs, residual, ae_ptr<const ae_t>(w, AE_IN_NORM), x, T, HD, HD, 1,
                        eps);
        ae_stack_mm(w, AE_QKV, x, qkv, T, QKV, HD, tiles);
        ae_stack_lora(lora, lora_r, lora_slots, l, AE_LORA_QKV, x, qkv, T, HD, QKV);
        ae_rope(qkv, cos, sin, T, H + KVH, D, QKV);  // q and k heads, in place
        ae_kv_write(qkv + H * D, qkv + (H + KVH) * D, kv, slots, T, KVH * D, QKV, QKV, v_off);
        ae_decode_attention(qkv, kv, tables, lens, rows, att, T, H, KVH, D, BS, table_stride,
                            QKV, split, scale, v_off, 0, 0.f);
        ae_stack_mm(w, AE_O, att, hs, T, HD, H * D, tiles);
        ae_stack_lora(lora, lora_r, lora_slots, l, AE_LORA_O, att, hs, T, H * D, HD);
        ae_rms_norm(hs, residual, ae_ptr<const ae_t>(w, AE_POST_NORM), x, T, HD, HD, 1, eps);
        ae_stack_mm(w, AE_GU, x, gu, T, 2 * I, HD, tiles);
        ae_stack_lora(lora, lora_r, lora_slots, l, AE_LORA_GU, x, gu, T, HD, 2 * I);
        ae_silu_mul(gu, act, T, I);
        ae_stack_mm(w, AE_DOWN, act, hs, T, HD, I, tiles);
        ae_stack_lora(lora, lora_r, lora_slots, l, AE_LORA_DOWN, act, hs, T, I, HD);
    }
    ae_rms_norm(hs, residual, final_norm, out, T, HD, HD, 1, eps);
}
