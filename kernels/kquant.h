// GGUF blocks as stored in the file, one row at a time into float32: the arithmetic of the
// `gguf` package's reference `dequantize` (and ggml's), operation for operation, so that
// the weights are bit-exact (tests/executor/test_kquants.py). The compiler flags have
// -ffp-contract=off: `a * b - c` stays two roundings, as numpy's. The loops are plain
// C++ marked `omp simd`, vectorized for the CPU at hand (AVX2, AVX-512 under -march=native).
//
// Type ids are GGML's (gguf.GGMLQuantizationType). Rows hold K weights, K a multiple of
// the type's block (32, or 256 for the k-quants and IQ4_XS).
#pragma once
#include "common.h"
// The build passes -fno-tree-loop-vectorize (inductor's flags), which also leaves the `omp
// simd` loops below scalar: vectorizing is turned back on for what follows.
#pragma GCC optimize("tree-loop-vectorize")

#define KQ_F32 0
#define KQ_F16 1
#define KQ_Q4_0 2
#define KQ_Q4_1 3
#define KQ_Q5_0 6
#define KQ_Q5_1 7
#define KQ_Q8_0 8
#define KQ_Q4_K 12
#define KQ_Q5_K 13
#define KQ_Q6_K 14
#define KQ_IQ4_XS 23
#define KQ_BF16 30

static inline float kq_f16(const uint8_t* p) {
    uint16_t h; std::memcpy(&h, p, 2); return ae_half(h);
}

// Q4_K / Q5_K's eight 6-bit scales and mins from their 12 bytes.
static inline void kq_scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
    for (int i = 0; i < 4; ++i) {
        sc[i] = s[i] & 63;
        mn[i] = s[4 + i] & 63;
        sc[4 + i] = (s[8 + i] & 0x0f) | ((s[i] >> 2) & 0x30);
        mn[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
    }
}

static const int8_t kq_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1, 13, 25, 38, 53, 69, 89, 113};

// Blocks of 32: d (f16) [, m (f16)] [, qh (4 bytes)], 16 bytes of nibbles: element j < 16 is
// the low nibble of byte j, element 16 + j its high nibble; the fifth bit j of qh.
template <int TYPE>
static inline void kq_block32(const uint8_t* b, float* y) {
    const float d = kq_f16(b);
    if (TYPE == KQ_Q8_0) {
        const int8_t* q = (const int8_t*)(b + 2);
        #pragma omp simd
        for (int j = 0; j < 32; ++j) y[j] = d * (float)q[j];
        return;
    }
    const bool has_min = TYPE == KQ_Q4_1 || TYPE == KQ_Q5_1;
    const bool five = TYPE == KQ_Q5_0 || TYPE == KQ_Q5_1;
    const float m = has_min ? kq_f16(b + 2) : 0.f;
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
    const uint8_t* qs = b + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
    const int off = five ? 16 : 8;
    #pragma omp simd
    for (int j = 0; j < 16; ++j) {
        int lo = qs[j] & 0x0f, hi = qs[j] >> 4;
        if (five) { lo |= ((qh >> j) & 1) << 4; hi |= ((qh >> (j + 16)) & 1) << 4; }
        if (has_min) {
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        } else {
            y[j] = d * (float)(lo - off);
            y[j + 16] = d * (float)(hi - off);
        }
    }
}

// Q4_K (144 bytes per 256): d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of
// nibbles: bytes [32 c, 32 c + 32) hold sub-block 2 c in their low nibbles and 2 c + 1 in
// their high ones. y = (d sc) q - (dmin m). Q5_K (176): the same plus 32 bytes qh before the
// nibbles, bit s of qh[j] the fifth bit of element j of sub-block s.
template <bool FIVE>
static inline void kq_block_k45(const uint8_t* b, float* y) {
    const float d = kq_f16(b), dmin = kq_f16(b + 2);
    uint8_t sc[8], mn[8];
    kq_scale_min(b + 4, sc, mn);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 16 + (FIVE ? 32 : 0);
    for (int c = 0; c < 4; ++c) {
        const float d0 = d * (float)sc[2 * c], m0 = dmin * (float)mn[2 * c];
        const float d1 = d * (float)sc[2 * c + 1], m1 = dmin * (float)mn[2 * c + 1];
        const uint8_t* q = qs + 32 * c;
        float* y0 = y + 64 * c;
        #pragma omp simd
        for (int j = 0; j < 32; ++j) {
            int lo = q[j] & 0x0f, hi = q[j] >> 4;
            if (FIVE) {
                lo |= ((qh[j] >> (2 * c)) & 1) << 4;
                hi |= ((qh[j] >> (2 * c + 1)) & 1) << 4;
            }
            y0[j] = d0 * (float)lo - m0;
            y0[32 + j] = d1 * (float)hi - m1;
        }
    }
}

// Q6_K (210 bytes per 256): ql[128], qh[64], 16 int8 scales, d (f16). Per half h of 128:
// element 32 i + l (i in 0..3) is nibble (i / 2) of ql[64 h + 32 (i % 2) + l] with bits
// 2 i of qh[32 h + l] on top, minus 32; y = (d scale[e / 16]) q.
static inline void kq_block_q6k(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = (const int8_t*)(b + 192);
    const float d = kq_f16(b + 208);
    for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 4; ++i) {
            const uint8_t* l4 = ql + 64 * h + 32 * (i % 2);
            const uint8_t* hb = qh + 32 * h;
            float* yi = y + 128 * h + 32 * i;
            const float s0 = d * (float)sc[8 * h + 2 * i], s1 = d * (float)sc[8 * h + 2 * i + 1];
            const int shift = 4 * (i / 2);
            #pragma omp simd
            for (int l = 0; l < 32; ++l) {
                const int q = (((l4[l] >> shift) & 0x0f) | (((hb[l] >> (2 * i)) & 3) << 4)) - 32;
                yi[l] = (l < 16 ? s0 : s1) * (float)q;
            }
        }
    }
}

// IQ4_XS (136 bytes per 256): d (f16), scales_h (u16), scales_l[4], qs[128]; sub-block s
// has the 6-bit scale ls = low nibble s of scales_l | 2 bits s of scales_h, dl = d (ls - 32),
// and 16 bytes of nibbles (low: elements 0..15, high: 16..31) indexing IQ4_NL's values.
static inline void kq_block_iq4xs(const uint8_t* b, float* y) {
    const float d = kq_f16(b);
    uint16_t sh; std::memcpy(&sh, b + 2, 2);
    const uint8_t* sl = b + 4;
    const uint8_t* qs = b + 8;
    for (int s = 0; s < 8; ++s) {
        const int ls = ((sl[s / 2] >> (4 * (s % 2))) & 0x0f) | (((sh >> (2 * s)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        const uint8_t* q = qs + 16 * s;
        float* ys = y + 32 * s;
        for (int j = 0; j < 16; ++j) {
            ys[j] = dl * (float)kq_iq4nl_values[q[j] & 0x0f];
            ys[j + 16] = dl * (float)kq_iq4nl_values[q[j] >> 4];
        }
    }
}

// Bytes per row of K weights of `type` (0 for a type this file does not know).
static inline int64_t kq_row_bytes(int64_t type, int64_t K) {
    switch (type) {
        case KQ_F32: return 4 * K;
        case KQ_F16: case KQ_BF16: return 2 * K;
        case KQ_Q4_0: return K / 32 * 18;
        case KQ_Q4_1: return K / 32 * 20;
        case KQ_Q5_0: return K / 32 * 22;
        case KQ_Q5_1: return K / 32 * 24;
        case KQ_Q8_0: return K / 32 * 34;
        case KQ_Q4_K: return K / 256 * 144;
        case KQ_Q5_K: return K / 256 * 176;
        case KQ_Q6_K: return K / 256 * 210;
        case KQ_IQ4_XS: return K / 256 * 136;
        default: return 0;
    }
}

// One row of K weights of `type` from its bytes `src` into `y`.
static inline void kq_dequant_row(int64_t type, const uint8_t* src, float* y, int64_t K) {
    switch (type) {
        case KQ_F32: std::memcpy(y, src, 4 * K); return;
        case KQ_F16: {
            const uint16_t* h = (const uint16_t*)src;
            int64_t k = 0;
#ifdef AE_AVX2
            for (; k + 8 <= K; k += 8)
                _mm256_storeu_ps(y + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + k))));
#endif
            for (; k < K; ++k) y[k] = ae_half(h[k]);
            return;
        }
        case KQ_BF16: {
            const uint16_t* h = (const uint16_t*)src;
            uint32_t* o = (uint32_t*)y;
            #pragma omp simd
            for (int64_t k = 0; k < K; ++k) o[k] = (uint32_t)h[k] << 16;
            return;
        }
        case KQ_Q4_0:
            for (int64_t b = 0; b < K / 32; ++b) kq_block32<KQ_Q4_0>(src + 18 * b, y + 32 * b);
            return;
        case KQ_Q4_1:
            for (int64_t b = 0; b < K / 32; ++b) kq_block32<KQ_Q4_1>(src + 20 * b, y + 32 * b);
            return;
        case KQ_Q5_0:
            for (int64_t b = 0; b < K / 32; ++b) kq_block32<KQ_Q5_0>(src + 22 * b, y + 32 * b);
            return;
        case KQ_Q5_1:
            for (int64_t b = 0; b < K / 32; ++b) kq_block32<KQ_Q5_1>(src + 24 * b, y + 32 * b);
            return;
        case KQ_Q8_0:
            for (int64_t b = 0; b < K / 32; ++b) kq_block32<KQ_Q8_0>(src + 34 * b, y + 32 * b);
            return;
        case KQ_Q4_K:
            for (int64_t b = 0; b < K / 256; ++b) kq_block_k45<false>(src + 144 * b, y + 256 * b);
            return;
        case KQ_Q5_K:
            for (int64_t b = 0; b < K / 256; ++b) kq_block_k45<true>(src + 176 * b, y + 256 * b);
            return;
        case KQ_Q6_K:
            for (int64_t b = 0; b < K / 256; ++b) kq_block_q6k(src + 210 * b, y + 256 * b);
            return;
        case KQ_IQ4_XS:
            for (int64_t b = 0; b < K / 256; ++b) kq_block_iq4xs(src + 136 * b, y + 256 * b);
            return;
        default: return;
    }
}
