#include "common.h"
#include "stack_layout.h"

// A decode step through every decoder layer in one call, for any family the model's
// description gives (the layer loop at the end follows models/decoder.py): the layer kernels
// of this folder, called in sequence from C++ instead of ~15 Python / PyTorch calls per layer.
// Each is the same kernel the per-op path calls (included here under its own name), with the
// same arguments, so the result is the per-op path's to the bit. T decode tokens (one per
// request, rows 0 .. T-1 in order). Its parameters: the structs of stack_layout.h.
// Activations in the layer kernels' element type ae_t (common.h): float32 or bfloat16.
//
// Each projection carries its weight format (AeProj.kind), dispatched per matmul by
// ae_stack_mm, each as the per-op path's module multiplies it: int4 (Int4Linear: int4.cpp,
// a bfloat16 model's through int4_bf16.cpp and, for steps of many requests, int4_tile8.cpp's
// byte tiles) or GGUF blocks kept packed (GGUFLinear: kquant.cpp, a fused projection's parts
// in their own types, a bias).
#define kernel ae_int4_mm
#include "int4.cpp"
#undef kernel
#if AE_DTYPE != 0
#define kernel ae_int4_bf16_mm
#include "int4_bf16.cpp"
#undef kernel
#endif
// kquant.cpp brings kquant_tile8.h's kq_tile8 too (AE_KQ_TILE8, where it is compiled in)
#define kernel ae_kquant_mm
#include "kquant.cpp"
#undef kernel
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
#define kernel ae_moe
#include "moe.cpp"
#undef kernel
#define kernel ae_moe_route
#include "moe_route.cpp"
#undef kernel

// ae_t rows x [T, K] as float32, in scratch of the calling thread (a float32 model: x).
static inline const float* ae_stack_widen(const ae_t* x, int64_t n) {
#if AE_DTYPE == 0
    (void)n;
    return x;
#else
    static thread_local ae_vec<float> buf;
    if ((int64_t)buf.size() < n) buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = ae_get(x + i);
    return buf.data();
#endif
}

// float32 results yf [T, N] (+ bias, in float32) to y in ae_t, each rounded once.
static inline void ae_stack_finish(const AeProj& p, float* yf, ae_t* y, int64_t T) {
    const int64_t N = p.n;
    const ae_t* bias = reinterpret_cast<const ae_t*>(p.bias);
    if (bias != nullptr) {
        for (int64_t t = 0; t < T; ++t) {
            float* yt = yf + t * N;
            #pragma omp simd
            for (int64_t n = 0; n < N; ++n) yt[n] += ae_get(bias + n);
        }
    }
#if AE_DTYPE != 0
    int64_t i = 0;
#ifdef AE_AVX2
    for (; i + 8 <= T * N; i += 8) ae_store8(y + i, _mm256_loadu_ps(yf + i));
#endif
    for (; i < T * N; ++i) ae_put(y + i, yf[i]);
#else
    (void)y;
#endif
}

// Scratch of the calling thread for a projection's float32 results (a float32 model: y).
static inline float* ae_stack_out(ae_t* y, int64_t n) {
#if AE_DTYPE == 0
    (void)n;
    return y;
#else
    static thread_local ae_vec<float> buf;
    if ((int64_t)buf.size() < n) buf.resize(n);
    return buf.data();
#endif
}

// int4 (data[0] packed rows, aux[0] float16 (scale, min)), as Int4Linear's forward takes
// the step's rows: a bfloat16 model's through int4_bf16.cpp (AE_INT4_BF16), rounded once to
// bfloat16, or, for a step of int4.TILE_REQUESTS requests or more (`tiles`), int4_tile8.cpp's
// byte tiles over activations rounded to int8 (AE_INT4_TILE8); otherwise, and with a bias,
// int4.cpp on float32 rows, the bias added in float32, rounded once (int4_linear(x.float())
// + bias).
static inline void ae_stack_int4(const AeProj& p, const ae_t* x, ae_t* y, int64_t T,
                                 bool tiles) {
    const int64_t N = p.n, K = p.k;
    const uint8_t* q = reinterpret_cast<const uint8_t*>(p.data[0]);
    const uint16_t* sm = reinterpret_cast<const uint16_t*>(p.aux[0]);
    float* yf = ae_stack_out(y, T * N);
#if AE_DTYPE != 0
#ifdef AE_KQ_TILE8
    if (tiles && (p.flags & AE_INT4_TILE8)) {
        kq_tile8<KQ_INT4_SPLIT>(x, true, q, y, true, T, N, K, N, K / 2, sm);
        return;
    }
#endif
    if (p.flags & AE_INT4_BF16) {
        ae_int4_bf16_mm(x, q, sm, yf, T, N, K);
        ae_stack_finish(p, yf, y, T);
        return;
    }
#endif
    (void)tiles;
    ae_int4_mm(ae_stack_widen(x, T * K), q, sm, yf, T, N, K);
    ae_stack_finish(p, yf, y, T);
}

// GGUF parts (data[i]: rows[i] rows of GGML type | flag aux[i]), each writing its columns of
// y in order, as GGUFLinear's forward multiplies them: float32 rows, the bias added in
// float32, rounded once (x.float(), out += bias.float(), out.to(bfloat16)).
static inline void ae_stack_gguf(const AeProj& p, const ae_t* x, ae_t* y, int64_t T) {
    const int64_t N = p.n, K = p.k;
    const float* xf = ae_stack_widen(x, T * K);
    float* yf = ae_stack_out(y, T * N);
    int64_t col = 0;
    for (int64_t i = 0; i < p.parts; ++i) {
        ae_kquant_mm(xf, reinterpret_cast<const uint8_t*>(p.data[i]), yf + col, T, p.rows[i], K,
                     N, p.aux[i]);
        col += p.rows[i];
    }
    ae_stack_finish(p, yf, y, T);
}

// y [T, n] = x [T, k] @ W.T (+ bias) for projection p, by its weight format.
static inline void ae_stack_mm(const AeProj& p, const ae_t* x, ae_t* y, int64_t T, bool tiles) {
    switch (p.kind) {
        case AE_W_INT4: ae_stack_int4(p, x, y, T, tiles); return;
        case AE_W_GGUF: ae_stack_gguf(p, x, y, T); return;
        default: return;  // Python checks every projection has a format
    }
}

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

// out = norm(x) (residual null), or residual += x, out = norm(residual); T tokens.
static inline void ae_stack_norm(const AeNorm& n, const ae_t* x, ae_t* residual, ae_t* out,
                                 int64_t T, int64_t N, float eps) {
    ae_rms_norm(x, residual, ae_ptr<const ae_t>(n.w), out, T, N, N, residual != nullptr, eps, 1,
                (float)n.offset);
}

// A mixture-of-experts MLP, as models/moe.py's SparseMoE computes it on the CPU: routed by
// moe_route.cpp, the experts by moe.cpp over float32 rows, the sum rounded to ae_t; with a
// shared expert (gate_up, down) weighted by its gate: out + gate * shared, each product and
// sum rounded to ae_t as PyTorch's elementwise ops round them.
static inline void ae_stack_moe(const AeModel& m, const AeLayer& w, const ae_t* x, ae_t* y,
                                ae_t* gu, ae_t* act, int64_t T, bool tiles) {
    const int64_t HD = m.hidden, E = m.experts, k = m.top_k;
    static thread_local std::vector<int64_t> ibuf;
    static thread_local ae_vec<float> fbuf;
    static thread_local ae_vec<ae_t> gbuf;
    ibuf.resize(T * k + E + 1);
    fbuf.resize(T * k + T * HD);
    gbuf.resize(T + T * HD);
    int64_t* rows = ibuf.data();
    int64_t* offs = rows + T * k;
    float* wts = fbuf.data();
    float* outf = wts + T * k;
    ae_t* gate = gbuf.data();
    ae_t* shared = gate + T;
    const bool has_shared = w.shared_gate != 0;
    ae_moe_route(x, ae_ptr<const ae_t>(w.router), ae_ptr<const ae_t>(w.shared_gate), rows, offs,
                 wts, gate, T, HD, E, k, m.renormalize, has_shared);
    ae_moe(ae_stack_widen(x, T * HD), rows, offs, wts, ae_ptr<const uint8_t>(w.w13),
           ae_ptr<const uint8_t>(w.s13), ae_ptr<const uint8_t>(w.w2), ae_ptr<const uint8_t>(w.s2),
           outf, T, k, E, HD, m.expert_inter, m.expert_kind, m.g13, m.g2);
    if (!has_shared) {
        for (int64_t i = 0; i < T * HD; ++i) ae_put(y + i, outf[i]);
        return;
    }
    ae_stack_mm(w.gate_up, x, gu, T, tiles);
    ae_silu_mul(gu, act, T, w.gate_up.n / 2, 0);
    ae_stack_mm(w.down, act, shared, T, tiles);
    for (int64_t t = 0; t < T; ++t) {
        const float g = ae_get(gate + t);
        for (int64_t i = t * HD; i < (t + 1) * HD; ++i) {
            ae_t o, p;
            ae_put(&o, outf[i]);
            ae_put(&p, g * ae_get(shared + i));
            ae_put(y + i, ae_get(&o) + ae_get(&p));
        }
    }
}

// model: the address of the AeModel (stack_layout.h) of the model's layers, built once; step:
// this step's AeStep. With `layout` (not 0): only the structs' layout written there (int64s),
// for Python to check against its reading of stack_layout.h.
//
// Per layer, as models/decoder.py's DecoderLayer (each norm fused with the residual add
// before it):
//   x = in_norm(residual += h)
//   qkv = qkv_proj(x); q, k heads normed (q_norm, k_norm), then RoPE on their first
//   rotary_dim (the layer's table); K, V into the cache; attention (window, soft cap)
//   h = o_proj(attention)
//   x = post_attn_norm(residual += h), or, with sandwich norms,
//       x = pre_ff_norm(residual += post_attn_norm(h))
//   h = down(act(gate_up(x))), or the mixture's experts; sandwich: h = post_ff_norm(h)
// and at the end out = final_norm(residual += h).
extern "C" void kernel(uintptr_t model, uintptr_t step, uintptr_t layout) {
    if (layout != 0) {
        ae_stack_layout(reinterpret_cast<int64_t*>(layout));
        return;
    }
    const AeModel& m = *reinterpret_cast<const AeModel*>(model);
    const AeStep& s = *reinterpret_cast<const AeStep*>(step);
    const AeLayer* layers = ae_ptr<const AeLayer>(m.layers);
    const int64_t T = s.tokens, HD = m.hidden, H = m.heads, KVH = m.kv_heads, D = m.head_dim;
    const int64_t I = m.intermediate, R = m.rotary_dim;
    const float eps = (float)m.eps;
    const int64_t* lora_slots = ae_ptr<const int64_t>(s.lora_slots);
    const bool tiles = s.tiles != 0;
    const int64_t* slots = ae_ptr<const int64_t>(s.slots);
    const int64_t* tables = ae_ptr<const int64_t>(s.tables);
    const int64_t* lens = ae_ptr<const int64_t>(s.lens);
    const int64_t* rows = ae_ptr<const int64_t>(s.rows);
    const AeWithoutGil released;  // milliseconds of work: the event loop runs meanwhile
    const int64_t QKV = (H + 2 * KVH) * D;
    static thread_local ae_vec<ae_t> buf;
    const int64_t need = T * (4 * HD + 2 * QKV + H * D + 3 * I);
    if ((int64_t)buf.size() < need) buf.resize(need);
    ae_t* residual = buf.data();
    ae_t* x = residual + T * HD;       // a norm's output, the next matmul's input
    ae_t* hs = x + T * HD;             // a sublayer's output
    ae_t* hn = hs + T * HD;            // its norm (sandwich norms)
    ae_t* qkv = hn + T * HD;
    ae_t* qk = qkv + T * QKV;          // q and k heads normed (q_norm, k_norm): [T, H + KVH, D]
    ae_t* att = qk + T * QKV;
    ae_t* gu = att + T * H * D;
    ae_t* act = gu + T * 2 * I;
    const ae_t* h = ae_ptr<const ae_t>(s.h);
    std::memcpy(residual, h, T * HD * sizeof(ae_t));
    for (int64_t l = 0; l < m.num_layers; ++l) {
        const AeLayer& w = layers[l];
        ae_kv_t* kv = ae_ptr<ae_kv_t>(w.kv);
        const ae_t* cos = ae_ptr<const ae_t>(s.cos[w.rope]);
        const ae_t* sin = ae_ptr<const ae_t>(s.sin[w.rope]);
        if (l == 0)
            ae_stack_norm(w.in_norm, h, nullptr, x, T, HD, eps);
        else  // residual += h; x = norm(residual)
            ae_stack_norm(w.in_norm, hs, residual, x, T, HD, eps);
        ae_stack_mm(w.qkv, x, qkv, T, tiles);
        ae_stack_lora(w.qkv, lora_slots, x, qkv, T);
        const ae_t* q = qkv;  // the queries, q_stride apart, and the new keys and values
        const ae_t* k = qkv + H * D;
        const ae_t* v = qkv + (H + KVH) * D;
        int64_t q_stride = QKV, k_stride = QKV;
        if (w.q_norm.w != 0) {  // per-head norms into their own rows, as the module's
            ae_t* qn = qk;
            ae_t* kn = qk + T * H * D;
            ae_rms_norm(qkv, nullptr, ae_ptr<const ae_t>(w.q_norm.w), qn, T, D, QKV, 0, eps, H,
                        (float)w.q_norm.offset);
            ae_rms_norm(qkv + H * D, nullptr, ae_ptr<const ae_t>(w.k_norm.w), kn, T, D, QKV, 0,
                        eps, KVH, (float)w.k_norm.offset);
            ae_rope(qn, cos, sin, T, H, D, H * D, R);
            ae_rope(kn, cos, sin, T, KVH, D, KVH * D, R);
            q = qn, k = kn, q_stride = H * D, k_stride = KVH * D;
        } else {
            ae_rope(qkv, cos, sin, T, H + KVH, D, QKV, R);  // q and k heads, in place
        }
        ae_kv_write(k, v, kv, slots, T, KVH * D, k_stride, QKV, s.v_off);
        ae_decode_attention(q, kv, tables, lens, rows, att, T, H, KVH, D, s.block_size,
                            s.table_stride, q_stride, s.split, (float)w.scale, s.v_off,
                            w.window, (float)w.soft_cap);
        ae_stack_mm(w.o, att, hs, T, tiles);
        ae_stack_lora(w.o, lora_slots, att, hs, T);
        if (m.sandwich) {  // residual += post_attn_norm(h); x = pre_ff_norm(residual)
            ae_stack_norm(w.post_attn_norm, hs, nullptr, hn, T, HD, eps);
            ae_stack_norm(w.pre_ff_norm, hn, residual, x, T, HD, eps);
        } else {
            ae_stack_norm(w.post_attn_norm, hs, residual, x, T, HD, eps);
        }
        ae_t* mlp_out = m.sandwich ? hn : hs;
        if (w.router != 0) {
            ae_stack_moe(m, w, x, mlp_out, gu, act, T, tiles);
        } else {
            ae_stack_mm(w.gate_up, x, gu, T, tiles);
            ae_stack_lora(w.gate_up, lora_slots, x, gu, T);
            ae_silu_mul(gu, act, T, w.gate_up.n / 2, m.gelu);
            ae_stack_mm(w.down, act, mlp_out, T, tiles);
            ae_stack_lora(w.down, lora_slots, act, mlp_out, T);
        }
        if (m.sandwich) ae_stack_norm(w.post_ff_norm, hn, nullptr, hs, T, HD, eps);
    }
    ae_stack_norm(m.final_norm, hs, residual, ae_ptr<ae_t>(s.out), T, HD, eps);
}
