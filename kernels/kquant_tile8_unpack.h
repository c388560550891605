// kquant_tile8.h's strips: 16 weight rows' blocks brought into lanes (kq_strip_block: lane
// c holds weight row c), each block of 32 with its float factors, so that the byte dot
// products run the same for every type.
//   - The blocks of 32 (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0): 16 rows' bytes loaded four rows to
//     a vector and transposed (kq_rows_t4), the nibbles split, Q5's fifth bits placed by
//     vpshufbitqmb (BITALG), Q8_0's signed quants shifted by 128.
//   - The k-quants: a super-block of 256 of 16 rows unpacked into eight blocks of 32.
//     Q4_K / Q5_K: sub-block s is w = (d sc_s) q - dmin mn_s (kquant.h's kq_block_k45), taken
//     as (d sc_s) (q - c) + (c d sc_s - dmin mn_s) with c the middle of q's range (8, 16):
//     the block's factor `d` and its min term `m` (times the float sum of the block's x).
//     Q6_K: the 32 elements of a block have two int8 scales (elements 0-15, 16-31), w = (d
//     sc) (q - 32): `d` and `m` hold the two factors, and the block's byte dot products are
//     summed in two halves (kquant_tile8.h's kq_strip_rows).
#pragma once

#ifdef AE_KQ_TILE8
// Q[j] lane c = dword j (j < NJ, NJ 2 or 4) of the 16 bytes at p[c] + at: 16 rows' bytes
// loaded four rows to a vector, then transposed (four vpermt2d, four 128-bit lane shuffles).
template <int NJ>
static inline void kq_rows_t4(const uint8_t* const* p, int64_t at, __m512i* Q) {
    __m512i A[4];
    for (int q = 0; q < 4; ++q) {
        __m512i a = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(p[4 * q] + at)));
        a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(p[4 * q + 1] + at)), 1);
        a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(p[4 * q + 2] + at)), 2);
        A[q] = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i*)(p[4 * q + 3] + at)), 3);
    }
    // A[q] dword 4 l + j: row 4 q + l's dword j. Lanes 0..7 <- dword j of 8 rows, 8..15 <-
    // dword j + 1 (the second source's indices from 16).
    const __m512i i01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28,
                                          1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i T0 = _mm512_permutex2var_epi32(A[0], i01, A[1]);
    const __m512i U0 = _mm512_permutex2var_epi32(A[2], i01, A[3]);
    Q[0] = _mm512_shuffle_i64x2(T0, U0, 0x44);
    Q[1] = _mm512_shuffle_i64x2(T0, U0, 0xEE);
    if (NJ == 4) {
        const __m512i i23 = _mm512_add_epi32(i01, _mm512_set1_epi32(2));
        const __m512i T1 = _mm512_permutex2var_epi32(A[0], i23, A[1]);
        const __m512i U1 = _mm512_permutex2var_epi32(A[2], i23, A[3]);
        Q[2] = _mm512_shuffle_i64x2(T1, U1, 0x44);
        Q[3] = _mm512_shuffle_i64x2(T1, U1, 0xEE);
    }
}

// The block at byte `at` of 16 weight rows p[0..15], unpacked into `dst`.
template <int TYPE>
static inline void kq_strip_unpack(const uint8_t* const* p, int64_t at, kq_strip_block* dst) {
    using L = kq_q32_layout<TYPE>;
    __m512i H[2];  // the block's first 8 bytes: d (| m << 16), then Q5_0 / Q5_1's qh
    kq_rows_t4<2>(p, at, H);
    dst->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(H[0]));
    if (L::has_min)  // d q + m = d (q - c) + (m + c d), c the middle of q's range
        dst->m = _mm512_fmadd_ps(dst->d, _mm512_set1_ps(L::five ? 16.f : 8.f),
                                 _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
                                     _mm512_srli_epi32(H[0], 16))));
    __m512i Q[4];
    if (TYPE == KQ_Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);  // q + 128, unsigned
        for (int h = 0; h < 2; ++h) {
            kq_rows_t4<4>(p, at + 2 + 16 * h, Q);
            for (int j = 0; j < 4; ++j) dst->g[4 * h + j] = _mm512_xor_si512(Q[j], flip);
        }
        return;
    }
    kq_rows_t4<4>(p, at + L::qs, Q);
    // Q5_0: qh is bytes 2..5 (the halves of two dwords), Q5_1: bytes 4..7
    const __m512i qh = TYPE == KQ_Q5_0 ? _mm512_shrdi_epi32(H[0], H[1], 16) : H[1];
    const __m512i m4 = _mm512_set1_epi8(0x0f), five = _mm512_set1_epi8(0x10);
    // byte t of lane c (two lanes a qword): bit 4 j + t of the lane's qh (+ 16: high nibbles)
    const __m512i sel = _mm512_set1_epi64(0x2322212003020100LL);
    for (int j = 0; j < 4; ++j) {
        __m512i lo = _mm512_and_si512(Q[j], m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi32(Q[j], 4), m4);
        if (L::five) {
            const __m512i s = _mm512_add_epi8(sel, _mm512_set1_epi8((char)(4 * j)));
            lo = _mm512_mask_add_epi8(lo, _mm512_bitshuffle_epi64_mask(qh, s), lo, five);
            hi = _mm512_mask_add_epi8(
                hi, _mm512_bitshuffle_epi64_mask(qh, _mm512_add_epi8(s, _mm512_set1_epi8(16))),
                hi, five);
        }
        dst->g[j] = lo;
        dst->g[4 + j] = hi;
    }
}

// Lane c: the element index min(c, nw - 1) * stride + off of a strip's per-row array (a short
// strip repeats its last row), for a gather.
static inline __m512i kq_lane_at(int64_t nw, int64_t stride, int64_t off) {
    const __m512i rows = _mm512_min_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)(nw - 1)));
    return _mm512_add_epi32(_mm512_mullo_epi32(rows, _mm512_set1_epi32((int)stride)),
                            _mm512_set1_epi32((int)off));
}

// Block b of 16 rows in int4.cpp's split layout: the nibbles at p[c] + 16 b (Q4_1's order),
// the float16 (scale, min) of row c at ps[c * stride + 2 b] (c < nw; a short strip repeats its
// last row), gathered: a 128-bit load there would read past the matrix's last row.
static inline void kq_strip_unpack_int4(const uint8_t* const* p, const uint16_t* ps,
                                        int64_t stride, int64_t nw, int64_t b,
                                        kq_strip_block* dst) {
    const __m512i at = kq_lane_at(nw, stride, 2 * b);
    const __m512i h = _mm512_i32gather_epi32(at, (const int*)ps, 2);  // scale | min << 16
    dst->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
    // d q + m = d (q - 8) + (m + 8 d), as Q4_1's
    dst->m = _mm512_fmadd_ps(dst->d, _mm512_set1_ps(8.f), _mm512_cvtph_ps(
        _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16))));
    __m512i Q[4];
    kq_rows_t4<4>(p, 16 * b, Q);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {
        dst->g[j] = _mm512_and_si512(Q[j], m4);
        dst->g[4 + j] = _mm512_and_si512(_mm512_srli_epi32(Q[j], 4), m4);
    }
}

// Block b of 16 rows of int8 weights in int8_bf16.cpp's layout: the signed bytes at p[c] +
// 32 b shifted by 128 (unsigned, as Q8_0's), the float32 scale of row c at sf[c * groups + b]
// (a scale per block of 32) or sf[c] (groups 1: per row); c < nw, a short strip repeats its
// last row (gathered, as kq_strip_unpack_int4's scales).
static inline void kq_strip_unpack_int8(const uint8_t* const* p, const float* sf,
                                        int64_t groups, int64_t nw, int64_t b,
                                        kq_strip_block* dst) {
    dst->d = _mm512_i32gather_ps(kq_lane_at(nw, groups, groups == 1 ? 0 : b), sf, 4);
    const __m512i flip = _mm512_set1_epi8((char)0x80);  // q + 128, unsigned
    __m512i Q[4];
    for (int h = 0; h < 2; ++h) {
        kq_rows_t4<4>(p, 32 * b + 16 * h, Q);
        for (int j = 0; j < 4; ++j) dst->g[4 * h + j] = _mm512_xor_si512(Q[j], flip);
    }
}

// Byte j of every lane of v as a signed or unsigned 32-bit integer.
static inline __m512i kq_lane_byte(__m512i v, int j, bool sgn) {
    const __m512i top = _mm512_slli_epi32(v, 24 - 8 * j);
    return sgn ? _mm512_srai_epi32(top, 24) : _mm512_srli_epi32(top, 24);
}

// The Q4_K / Q5_K super-block at byte `at` of rows p[0..15], into S[0..7].
template <bool FIVE>
static inline void kq_strip_unpack_k45(const uint8_t* const* p, int64_t at, kq_strip_block* S) {
    __m512i H[4];  // d | dmin << 16, then the 12 bytes of 6-bit scales and mins
    kq_rows_t4<4>(p, at, H);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(H[0]));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(H[0], 16)));
    const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15);
    const __m512i m30 = _mm512_set1_epi32(0x30);
    __m512i sc[8], mn[8];  // kquant.h's kq_scale_min, in every lane
    for (int i = 0; i < 4; ++i) {
        sc[i] = _mm512_and_si512(_mm512_srli_epi32(H[1], 8 * i), m6);
        mn[i] = _mm512_and_si512(_mm512_srli_epi32(H[2], 8 * i), m6);
        sc[4 + i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(H[3], 8 * i), m4),
                                    _mm512_and_si512(_mm512_srli_epi32(H[1], 8 * i + 2), m30));
        mn[4 + i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(H[3], 8 * i + 4), m4),
                                    _mm512_and_si512(_mm512_srli_epi32(H[2], 8 * i + 2), m30));
    }
    __m512i qh[8];  // Q5_K: bit s of byte l, the fifth bit of element l of sub-block s
    if (FIVE) {
        kq_rows_t4<4>(p, at + 16, qh);
        kq_rows_t4<4>(p, at + 32, qh + 4);
    }
    const int64_t qs = at + 16 + (FIVE ? 32 : 0);
    const __m512i n4 = _mm512_set1_epi8(0x0f), five = _mm512_set1_epi8(0x10);
    const __m512 c = _mm512_set1_ps(FIVE ? 16.f : 8.f);
    for (int cc = 0; cc < 4; ++cc) {
        __m512i Q[8];  // bytes [32 cc, 32 cc + 32): sub-block 2 cc low, 2 cc + 1 high nibbles
        kq_rows_t4<4>(p, qs + 32 * cc, Q);
        kq_rows_t4<4>(p, qs + 32 * cc + 16, Q + 4);
        for (int h = 0; h < 2; ++h) {
            const int s = 2 * cc + h;
            kq_strip_block& B = S[s];
            for (int j = 0; j < 8; ++j) {
                __m512i g = _mm512_and_si512(h ? _mm512_srli_epi32(Q[j], 4) : Q[j], n4);
                if (FIVE)
                    g = _mm512_mask_add_epi8(
                        g, _mm512_test_epi8_mask(qh[j], _mm512_set1_epi8((char)(1 << s))), g,
                        five);
                B.g[j] = g;
            }
            B.d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc[s]));
            B.m = _mm512_fnmadd_ps(dmin, _mm512_cvtepi32_ps(mn[s]), _mm512_mul_ps(c, B.d));
        }
    }
}

// The Q6_K super-block at byte `at` of rows p[0..15], into S[0..7]: block 4 h + i is
// kquant.h's (h, i), element l from ql[64 h + 32 (i % 2) + l] (nibble i / 2) and bits 2 i of
// qh[32 h + l].
static inline void kq_strip_unpack_q6k(const uint8_t* const* p, int64_t at, kq_strip_block* S) {
    __m512i sc[4], tail[4];
    kq_rows_t4<4>(p, at + 192, sc);    // the 16 int8 scales
    kq_rows_t4<4>(p, at + 194, tail);  // bytes 206..209: d in the upper half of the last
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(tail[3], 16)));
    const __m512i n4 = _mm512_set1_epi8(0x0f), b45 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
        __m512i L[16], Hb[8];
        for (int q = 0; q < 4; ++q) kq_rows_t4<4>(p, at + 64 * h + 16 * q, L + 4 * q);
        kq_rows_t4<4>(p, at + 128 + 32 * h, Hb);
        kq_rows_t4<4>(p, at + 128 + 32 * h + 16, Hb + 4);
        for (int i = 0; i < 4; ++i) {
            kq_strip_block& B = S[4 * h + i];
            for (int j = 0; j < 8; ++j) {
                const __m512i lo = _mm512_and_si512(
                    _mm512_srli_epi32(L[8 * (i % 2) + j], 4 * (i / 2)), n4);
                const __m512i hb = i < 3 ? _mm512_slli_epi32(Hb[j], 4 - 2 * i)
                                         : _mm512_srli_epi32(Hb[j], 2);
                B.g[j] = _mm512_or_si512(lo, _mm512_and_si512(hb, b45));
            }
            const int k = 8 * h + 2 * i;  // the scales of elements 0-15 and 16-31
            B.d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(kq_lane_byte(sc[k / 4], k % 4, true)));
            B.m = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                kq_lane_byte(sc[(k + 1) / 4], (k + 1) % 4, true)));
        }
    }
}
#endif
