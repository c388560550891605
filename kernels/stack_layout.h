// The decode stack's parameters (decode_stack.cpp), declared once: each struct is a list of
// fields in an X-macro, from which C++ declares the struct and reports its layout
// (ae_stack_layout), and which asyncengine/executor/paths/stack_layout.py reads from this
// file to build the same structs in Python; it checks the reported layout against its own at
// load and refuses a mismatch. Every field is 8 bytes (int64_t or double), so no padding:
// F(type, name) a field, A(type, name, count) an array, S(struct, name) a nested struct.
// Addresses are int64_t (0: none). The constants below are read by Python too.
#pragma once
#include <cstddef>
#include <cstdint>

#define AE_STACK_PARTS 3  // a projection's parts at most (a GGUF fused q/k/v: 3)
#define AE_STACK_ROPES 4  // RoPE tables at most (Gemma 3: local and global)

// A projection's weight format (AeProj.kind).
#define AE_W_NONE 0  // no such projection in this layer
#define AE_W_INT4 1  // int4.cpp's packed rows (data[0]) and float16 (scale, min) (aux[0])
#define AE_W_GGUF 2  // GGUF parts kept as stored (kquant.cpp): data[i] rows, aux[i] type | flag
// AeProj.flags of an int4 projection, as Int4Linear takes its bfloat16 rows.
#define AE_INT4_BF16 1   // int4_bf16.cpp's row kernel (Int4Linear._bf16)
#define AE_INT4_TILE8 2  // int4_tile8.cpp's byte tiles for steps with AeStep.tiles (_tile8)

// y [T, n] = x [T, k] @ W.T (+ bias) (+ the step's LoRA updates).
#define AE_PROJ_FIELDS(F, A, S) \
    F(int64_t, kind) \
    F(int64_t, n) \
    F(int64_t, k) \
    F(int64_t, flags) \
    F(int64_t, bias)      /* ae_t [n] */ \
    F(int64_t, parts)     /* GGUF: parts, each writing its `rows` columns of y in order */ \
    A(int64_t, data, AE_STACK_PARTS) \
    A(int64_t, aux, AE_STACK_PARTS) \
    A(int64_t, rows, AE_STACK_PARTS) \
    F(int64_t, lora_a)    /* lora.cpp's slot tables A, B, their rows and spans; r wide */ \
    F(int64_t, lora_b) \
    F(int64_t, lora_rows) \
    F(int64_t, lora_span) \
    F(int64_t, lora_r)

// RMSNorm: w * x / rms(x) (offset 0), or round(x / rms(x) * (offset + w)) (Gemma's 1 + w).
#define AE_NORM_FIELDS(F, A, S) \
    F(int64_t, w)         /* ae_t [dim] */ \
    F(double, offset)

#define AE_LAYER_FIELDS(F, A, S) \
    S(AeNorm, in_norm) \
    S(AeNorm, post_attn_norm) \
    S(AeNorm, pre_ff_norm)    /* sandwich norms: after attention, before and after the MLP */ \
    S(AeNorm, post_ff_norm) \
    S(AeNorm, q_norm)         /* per-head q / k norms (w 0: none) */ \
    S(AeNorm, k_norm) \
    S(AeProj, qkv) \
    S(AeProj, o) \
    S(AeProj, gate_up)        /* the dense MLP, or a mixture's shared expert */ \
    S(AeProj, down) \
    F(int64_t, rope)          /* index of the layer's RoPE table in AeStep.cos / sin */ \
    F(int64_t, window)        /* attend the last `window` keys (0: all) */ \
    F(double, soft_cap)       /* scores capped by cap * tanh(s / cap) (0: none) */ \
    F(double, scale) \
    F(int64_t, kv)            /* the layer's KV cache [2, blocks, BS, KVH, D] of ae_kv_t */ \
    F(int64_t, router)        /* a mixture's router ae_t [E, HD] (0: a dense MLP) */ \
    F(int64_t, w13)           /* its experts (moe.cpp): weights and scales */ \
    F(int64_t, s13) \
    F(int64_t, w2) \
    F(int64_t, s2) \
    F(int64_t, shared_gate)   /* the shared expert's gate ae_t [HD] (0: none) */

#define AE_MODEL_FIELDS(F, A, S) \
    F(int64_t, num_layers) \
    F(int64_t, layers)        /* AeLayer [num_layers] */ \
    F(int64_t, elem_size)     /* sizeof(ae_t) the stack was built for */ \
    F(int64_t, hidden) \
    F(int64_t, heads) \
    F(int64_t, kv_heads) \
    F(int64_t, head_dim) \
    F(int64_t, rotary_dim)    /* the first rotary_dim of each head turn */ \
    F(int64_t, intermediate)  /* the widest dense MLP or shared expert of any layer */ \
    F(int64_t, gelu)          /* the MLP's activation: GELU-tanh (1) or SiLU (0) */ \
    F(int64_t, sandwich)      /* Gemma's norms after attention and around the MLP */ \
    F(double, eps) \
    S(AeNorm, final_norm) \
    F(int64_t, experts)       /* a mixture: E experts, top_k a token, moe.cpp's kind */ \
    F(int64_t, top_k) \
    F(int64_t, expert_inter) \
    F(int64_t, renormalize) \
    F(int64_t, expert_kind) \
    F(int64_t, g13) \
    F(int64_t, g2)

#define AE_STEP_FIELDS(F, A, S) \
    F(int64_t, h)             /* ae_t [T, HD]: the embeddings */ \
    F(int64_t, out)           /* ae_t [T, HD]: the final normed hidden states */ \
    F(int64_t, tokens)        /* T, one decode token per request, rows in order */ \
    A(int64_t, cos, AE_STACK_ROPES) /* ae_t [T, rotary_dim] per RoPE table */ \
    A(int64_t, sin, AE_STACK_ROPES) \
    F(int64_t, slots)         /* int64 [T]: the new tokens' cache slots */ \
    F(int64_t, tables)        /* decode_attention.cpp's block tables, lens, rows, split */ \
    F(int64_t, lens) \
    F(int64_t, rows) \
    F(int64_t, table_stride) \
    F(int64_t, split) \
    F(int64_t, block_size) \
    F(int64_t, v_off)         /* V's offset from K in a layer's cache, in elements */ \
    F(int64_t, tiles)         /* int4 in bfloat16: this step takes the byte tiles */ \
    F(int64_t, lora_slots)    /* int64 [T]: each token's adapter slot (0: no adapters) */

#define AE_DECL_F(t, n) t n;
#define AE_DECL_A(t, n, c) t n[c];
#define AE_DECL_S(t, n) t n;
struct AeNorm { AE_NORM_FIELDS(AE_DECL_F, AE_DECL_A, AE_DECL_S) };
struct AeProj { AE_PROJ_FIELDS(AE_DECL_F, AE_DECL_A, AE_DECL_S) };
struct AeLayer { AE_LAYER_FIELDS(AE_DECL_F, AE_DECL_A, AE_DECL_S) };
struct AeModel { AE_MODEL_FIELDS(AE_DECL_F, AE_DECL_A, AE_DECL_S) };
struct AeStep { AE_STEP_FIELDS(AE_DECL_F, AE_DECL_A, AE_DECL_S) };

// The layout as compiled: per struct in the order above, its size, then per field a hash of
// its declaration ("type name" or "type name[count]", FNV-1a) and its offset.
static inline int64_t ae_fnv(const char* s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; ++s) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return (int64_t)h;
}
#define AE_OFF_F(t, n) out[i++] = ae_fnv(#t " " #n); out[i++] = (int64_t)offsetof(AE_CUR, n);
#define AE_OFF_A(t, n, c) \
    out[i++] = ae_fnv(#t " " #n "[" #c "]"); out[i++] = (int64_t)offsetof(AE_CUR, n);
#define AE_FIELDS_OF(X) X(AE_OFF_F, AE_OFF_A, AE_OFF_F)
static inline int64_t ae_stack_layout(int64_t* out) {
    int64_t i = 0;
#define AE_CUR AeNorm
    out[i++] = sizeof(AE_CUR);
    AE_FIELDS_OF(AE_NORM_FIELDS)
#undef AE_CUR
#define AE_CUR AeProj
    out[i++] = sizeof(AE_CUR);
    AE_FIELDS_OF(AE_PROJ_FIELDS)
#undef AE_CUR
#define AE_CUR AeLayer
    out[i++] = sizeof(AE_CUR);
    AE_FIELDS_OF(AE_LAYER_FIELDS)
#undef AE_CUR
#define AE_CUR AeModel
    out[i++] = sizeof(AE_CUR);
    AE_FIELDS_OF(AE_MODEL_FIELDS)
#undef AE_CUR
#define AE_CUR AeStep
    out[i++] = sizeof(AE_CUR);
    AE_FIELDS_OF(AE_STEP_FIELDS)
#undef AE_CUR
    return i;
}
