#include "common.h"
#include "kv_fp8.h"
#include <vector>

// s[g * BS + j] = dot(q[g], k_j) for the n keys k_j = kb + j * kv_row of one block. Eight
// keys at a time: eight independent FMA chains, reduced into one vector of eight scores.
static inline void ae_scores(const float* q, const ae_kv_t* kb, float* s, int64_t G, int64_t D,
                             int64_t n, int64_t BS, int64_t kv_row) {
    for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float* sg = s + g * BS;
        int64_t j = 0;
#ifdef AE_AVX2
        if (D % 8 == 0) {
            for (; j + 8 <= n; j += 8) {
                __m256 a[8];
                for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
                const ae_kv_t* k0 = kb + j * kv_row;
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 qd = _mm256_loadu_ps(qg + d);
                    #pragma GCC unroll 8
                    for (int i = 0; i < 8; ++i)
                        a[i] = _mm256_fmadd_ps(qd, ae_kv_load8(k0 + i * kv_row + d), a[i]);
                }
                const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]),
                                                 _mm256_hadd_ps(a[2], a[3]));
                const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]),
                                                 _mm256_hadd_ps(a[6], a[7]));
                _mm256_storeu_ps(sg + j, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                                       _mm256_permute2f128_ps(u0, u1, 0x31)));
            }
        }
#endif
        for (; j < n; ++j) {
            const ae_kv_t* kj = kb + j * kv_row;
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * ae_kv_get(kj + d);
            sg[j] = dot;
        }
    }
}

// acc[d] += sum_j w[j] v_j[d] over the n values v_j = vb + j * kv_row of one block; 32
// outputs at a time in registers (four independent chains).
static inline void ae_accumulate(float* acc, const float* w, const ae_kv_t* vb, int64_t D,
                                 int64_t n, int64_t kv_row) {
    int64_t d = 0;
#ifdef AE_AVX2
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int64_t j = 0; j < n; ++j) {
            const ae_kv_t* v = vb + j * kv_row + d;
            const __m256 wj = _mm256_set1_ps(w[j]);
            a0 = _mm256_fmadd_ps(wj, ae_kv_load8(v), a0);
            a1 = _mm256_fmadd_ps(wj, ae_kv_load8(v + 8), a1);
            a2 = _mm256_fmadd_ps(wj, ae_kv_load8(v + 16), a2);
            a3 = _mm256_fmadd_ps(wj, ae_kv_load8(v + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0); _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2); _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d + 8 <= D; d += 8) {  // small heads (D = 8, 16, 24) and the rest of others
        __m256 a0 = _mm256_loadu_ps(acc + d);
        for (int64_t j = 0; j < n; ++j)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), ae_kv_load8(vb + j * kv_row + d), a0);
        _mm256_storeu_ps(acc + d, a0);
    }
#endif
    for (; d < D; ++d) {
        float a = acc[d];
        for (int64_t j = 0; j < n; ++j) a += w[j] * ae_kv_get(vb + j * kv_row + d);
        acc[d] = a;
    }
}


// Positions per work item of a request with `len` keys. split > 0: that many, for every
// request. split < 0 encodes a per-request rule, -split = divisor << 20 | min_split
// (layer_ops.decode_split): the span a request would get alone in a step, whatever the batch
// beside it: max(min_split, ceil(len * KVH / divisor)) (the whole request where KVH >=
// divisor), at most len, rounded up to whole blocks. A request's partition of its positions
// then depends on its own length only, so its result does too: a verification row is
// computed as the one-token step at its position computes it (greedy output is the same
// with and without speculative decoding), and a request's output does not depend on which
// others share its steps.
static inline int64_t ae_split_of(int64_t split, int64_t len, int64_t KVH, int64_t BS) {
    if (split > 0) return split;
    const int64_t code = -split, min_split = code & 0xfffff, divisor = code >> 20;
    int64_t s = KVH >= divisor ? len : std::max(min_split, (len * KVH + divisor - 1) / divisor);
    s = std::max<int64_t>(1, std::min(s, len));
    return (s + BS - 1) / BS * BS;
}

#if defined(__AVX512F__)
#define AE_ATTN512 1
// Heads of up to AE_ATTN_D512 elements (a multiple of 16) take these: each key and value row
// is loaded (and widened from bfloat16) once for all G query heads of its KV head.
#define AE_ATTN_D512 256

// ae_scores for D % 16 == 0, D <= AE_ATTN_D512: 16 keys at a time, each key widened once and
// multiplied against the G queries; each (key, head)'s 16 partial sums go to `part`, and
// 16 keys' are summed together (ae_sum16). part: G * 256 floats.
template <int DVT>  // D / 16 when known at compile time (the common head sizes), else 0
static inline void ae_scores512_t(const float* q, const ae_kv_t* kb, float* s, int64_t G,
                                  int64_t D, int64_t n, int64_t BS, int64_t kv_row,
                                  float* part) {
    const int64_t DV = DVT > 0 ? DVT : D / 16;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t nj = std::min<int64_t>(16, n - j0);
        for (int64_t i = 0; i < 16; ++i) {
            if (i >= nj) {
                for (int64_t g = 0; g < G; ++g)
                    _mm512_store_ps(part + (g * 16 + i) * 16, _mm512_setzero_ps());
                continue;
            }
            const ae_kv_t* k = kb + (j0 + i) * kv_row;
            __m512 kv[DVT > 0 ? DVT : AE_ATTN_D512 / 16];
            for (int64_t dv = 0; dv < DV; ++dv) kv[dv] = ae_kv_load16(k + 16 * dv);
            for (int64_t g = 0; g < G; ++g) {
                const float* qg = q + g * D;
                __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
                __m512 a1 = _mm512_setzero_ps();
                for (int64_t dv = 1; dv < DV; ++dv) {
                    if (dv & 1) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * dv), kv[dv], a1);
                    else a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * dv), kv[dv], a0);
                }
                _mm512_store_ps(part + (g * 16 + i) * 16, _mm512_add_ps(a0, a1));
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            const __m512* pv = (const __m512*)(part + g * 256);
            _mm512_mask_storeu_ps(s + g * BS + j0, (__mmask16)((1u << nj) - 1), ae_sum16(pv));
        }
    }
}

static inline void ae_scores512(const float* q, const ae_kv_t* kb, float* s, int64_t G,
                                int64_t D, int64_t n, int64_t BS, int64_t kv_row,
                                float* part) {
    if (D == 64) ae_scores512_t<4>(q, kb, s, G, D, n, BS, kv_row, part);
    else if (D == 128) ae_scores512_t<8>(q, kb, s, G, D, n, BS, kv_row, part);
    else ae_scores512_t<0>(q, kb, s, G, D, n, BS, kv_row, part);
}

// acc[g][d] += sum_j w[g][j] v_j[d] for the G heads at once (w = s, row stride BS): 64
// outputs of up to 4 heads in registers, each value row widened once per 64 outputs.
template <int GG, int NV>  // NV vectors of 16 outputs
static inline void ae_accumulate512_gv(float* acc, const float* w, const ae_kv_t* vb, int64_t D,
                                   int64_t d, int64_t n, int64_t BS, int64_t kv_row) {
    constexpr int64_t nv = NV;
    __m512 a[GG][NV];
    for (int g = 0; g < GG; ++g)
        for (int64_t v = 0; v < nv; ++v) a[g][v] = _mm512_loadu_ps(acc + g * D + d + 16 * v);
    for (int64_t j = 0; j < n; ++j) {
        const ae_kv_t* vr = vb + j * kv_row + d;
        __m512 x[NV];
        for (int64_t v = 0; v < nv; ++v) x[v] = ae_kv_load16(vr + 16 * v);
        for (int g = 0; g < GG; ++g) {
            const __m512 wj = _mm512_set1_ps(w[g * BS + j]);
            for (int64_t v = 0; v < nv; ++v) a[g][v] = _mm512_fmadd_ps(wj, x[v], a[g][v]);
        }
    }
    for (int g = 0; g < GG; ++g)
        for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(acc + g * D + d + 16 * v, a[g][v]);
}

template <int GG>
static inline void ae_accumulate512_g(float* acc, const float* w, const ae_kv_t* vb, int64_t D,
                                      int64_t n, int64_t BS, int64_t kv_row) {
    for (int64_t d = 0; d < D; d += 64) {
        switch (std::min<int64_t>(4, (D - d) / 16)) {
            case 4: ae_accumulate512_gv<GG, 4>(acc, w, vb, D, d, n, BS, kv_row); break;
            case 3: ae_accumulate512_gv<GG, 3>(acc, w, vb, D, d, n, BS, kv_row); break;
            case 2: ae_accumulate512_gv<GG, 2>(acc, w, vb, D, d, n, BS, kv_row); break;
            default: ae_accumulate512_gv<GG, 1>(acc, w, vb, D, d, n, BS, kv_row); break;
        }
    }
}

static inline void ae_accumulate512(float* acc, const float* w, const ae_kv_t* vb, int64_t G,
                                    int64_t D, int64_t n, int64_t BS, int64_t kv_row) {
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) ae_accumulate512_g<4>(acc + g * D, w + g * BS, vb, D, n, BS, kv_row);
    switch (G - g) {
        case 3: ae_accumulate512_g<3>(acc + g * D, w + g * BS, vb, D, n, BS, kv_row); break;
        case 2: ae_accumulate512_g<2>(acc + g * D, w + g * BS, vb, D, n, BS, kv_row); break;
        case 1: ae_accumulate512_g<1>(acc + g * D, w + g * BS, vb, D, n, BS, kv_row); break;
        default: break;
    }
}
#endif

// Blocks of keys scored before one online-softmax update (its max, exponentials and
// rescaling of the partial output cost the same for 16 keys as for 128).
#ifndef AE_ATTN_SPAN_BLOCKS
#define AE_ATTN_SPAN_BLOCKS 8
#endif

// One online-softmax update of one query head by the n scores sg of a segment (turned into
// their weights in place): m, l its running max and sum, ag [D] its output accumulator.
static inline void ae_softmax_update(float* sg, int64_t n, float* m, float* l, float* ag,
                                     int64_t D) {
    float mx = *m;
    int64_t j0 = 0;
#ifdef AE_AVX2
    if (n >= 8) {  // eight lanes at a time (a small head makes these count)
        __m256 vm = _mm256_loadu_ps(sg);
        for (j0 = 8; j0 + 8 <= n; j0 += 8)
            vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + j0));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm),
                              _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        mx = std::max(mx, _mm_cvtss_f32(h));
    }
#endif
    for (int64_t j = j0; j < n; ++j) mx = std::max(mx, sg[j]);
    const float corr = std::exp(*m - mx);  // 0 on the first block
    int64_t j1 = 0;
    float sum = 0.f;
#ifdef AE_AVX2
    {
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vs = _mm256_setzero_ps();
#ifdef AE_EXP16
        // 16 lanes at a time: the same exps (ae_exp16), summed into vs in the same
        // order as eight at a time
        const __m512 vmx16 = _mm512_set1_ps(mx);
        for (; j1 + 16 <= n; j1 += 16) {
            const __m512 e = ae_exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j1), vmx16));
            _mm512_storeu_ps(sg + j1, e);
            vs = _mm256_add_ps(vs, _mm512_castps512_ps256(e));
            vs = _mm256_add_ps(vs, _mm512_extractf32x8_ps(e, 1));
        }
#endif
        for (; j1 + 8 <= n; j1 += 8) {
            const __m256 e = ae_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j1), vmx));
            _mm256_storeu_ps(sg + j1, e);
            vs = _mm256_add_ps(vs, e);
        }
        sum = ae_hsum8(vs);
    }
#endif
    for (int64_t j = j1; j < n; ++j) sg[j] -= mx;
    ae_exp_n(sg + j1, n - j1);
    for (int64_t j = j1; j < n; ++j) sum += sg[j];
    *l = *l * corr + sum;
    *m = mx;
    if (corr != 1.f)
        for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
}

// Software prefetches (into L2) of the cache rows a segment reads next. A step's cache is
// read once, from memory (at 32 requests of 1,000 positions a layer's K and V are 24 MB in
// bfloat16, a step's 700 MB): the keys and values of one KV head are rows of D elements
// every KVH * D, block after block, which the hardware prefetchers follow poorly, so the
// kernel waited on memory at a third of its bandwidth. Measured (benchmarks/decode_step.py
// --batch 32 --prompt-len 1000, 2 threads, the embedded model, alternated with
// AE_ATTN_PREFETCH 0): a step 52 -> 41 ms with a bfloat16 cache, 51-55 -> 33 ms with a
// float8 one; 1 request of 300 positions, 32 of 100 and a 1 + 8 row verification unchanged.
// (Prefetching a whole segment at once gained a third as much.) AE_ATTN_PREFETCH 0 turns
// them off.
#ifndef AE_ATTN_PREFETCH
#define AE_ATTN_PREFETCH 1
#endif
static inline void ae_prefetch_rows(const ae_kv_t* row, int64_t n, int64_t kv_row, int64_t D) {
    const int64_t bytes = D * (int64_t)sizeof(ae_kv_t);
    for (int64_t j = 0; j < n; ++j, row += kv_row)
        for (int64_t b = 0; b < bytes; b += 64)
            __builtin_prefetch((const char*)row + b, 0, 2);  // for reading, into L2
}

// One segment of a (request, KV head)'s positions: up to AE_ATTN_SPAN_BLOCKS consecutive
// blocks from position `first`, at most SP positions: block i's first row at element base[i]
// of the cache (its head's), n[i] positions, at[i] the offset of its scores; `last` the
// position after the segment. count 0: no positions left.
struct AeSegment {
    int64_t base[AE_ATTN_SPAN_BLOCKS], n[AE_ATTN_SPAN_BLOCKS], at[AE_ATTN_SPAN_BLOCKS];
    int64_t count, total, first, last;
};

static inline void ae_segment(const int64_t* table, int64_t p, int64_t end, int64_t BS,
                              int64_t SP, int64_t kv_row, int64_t head_off, AeSegment* seg) {
    seg->first = p;
    seg->count = seg->total = 0;
    while (p < end && seg->count < AE_ATTN_SPAN_BLOCKS) {
        const int64_t off = p % BS;  // 0 except at a window's first block
        const int64_t k = std::min(BS - off, end - p);
        if (seg->total + k > SP) break;
        seg->base[seg->count] = (table[p / BS] * BS + off) * kv_row + head_off;
        seg->n[seg->count] = k;
        seg->at[seg->count++] = seg->total;
        seg->total += k;
        p += k;
    }
    seg->last = p;
}

// Rows [0, R) of one sequence (one block table), KV head kh, positions [start, ends[r]) for
// row r, online softmax from a fresh state: qv [R * G, D] (the rows' query heads, scaled);
// acc [R * G, D], m, l [R * G], s [R * G, SP]; part: ae_scores512's, R * G * 256 floats,
// 64-byte aligned. The positions go in segments of up to AE_ATTN_SPAN_BLOCKS consecutive
// blocks: scores into s, one softmax update per row and head (with that row's count of
// positions in the segment), then the values (a row's weights past its end are zero). One
// row (R = 1) is one span of one request; more are attention_rows.h's groups, each row's
// result to the bit its own.
static inline void ae_attend_rows(const float* qv, const ae_kv_t* kc, const ae_kv_t* vc,
                                  const int64_t* table, int64_t start, const int64_t* ends,
                                  int64_t R,
                                  int64_t kh, int64_t G, int64_t D, int64_t BS, int64_t kv_row,
                                  float soft_cap, float* acc, float* m, float* l, float* s,
                                  float* part) {
    const int64_t SP = AE_ATTN_SPAN_BLOCKS * BS, RG = R * G;
    int64_t end = 0;
    for (int64_t r = 0; r < R; ++r) end = std::max(end, ends[r]);
#ifdef AE_ATTN512
    const bool wide = D % 16 == 0 && D <= AE_ATTN_D512;
#else
    (void)part;
#endif
    for (int64_t i = 0; i < RG * D; ++i) acc[i] = 0.f;
    for (int64_t g = 0; g < RG; ++g) { m[g] = -INFINITY; l[g] = 0.f; }
    AeSegment segs[2];  // this segment and the next
    int cur = 0;
    ae_segment(table, start, end, BS, SP, kv_row, kh * D, &segs[0]);
#if AE_ATTN_PREFETCH
    for (int64_t i = 0; i < segs[0].count; ++i)  // the first segment's values
        ae_prefetch_rows(vc + segs[0].base[i], segs[0].n[i], kv_row, D);
#endif
    while (segs[cur].count > 0) {
        const AeSegment& S = segs[cur];
        AeSegment& next = segs[cur ^ 1];
        ae_segment(table, S.last, end, BS, SP, kv_row, kh * D, &next);
        const int64_t first = S.first, n = S.total;
        // The next segment's blocks are prefetched while this segment's block of the same
        // index is read (its keys while scoring, its values while accumulating): the
        // requests spread over the segment, one segment ahead.
        for (int64_t i = 0; i < S.count; ++i) {
#if AE_ATTN_PREFETCH
            if (i < next.count) ae_prefetch_rows(kc + next.base[i], next.n[i], kv_row, D);
#endif
#ifdef AE_ATTN512
            if (wide) {  // each key's score alone: all rows' query heads at once
                ae_scores512(qv, kc + S.base[i], s + S.at[i], RG, D, S.n[i], SP, kv_row, part);
                continue;
            }
#endif
            // the 8-key path groups a block's keys by its count: each row its own count there
            for (int64_t r = 0; r < R; ++r) {
                const int64_t valid = std::min(S.n[i], ends[r] - first - S.at[i]);
                if (valid > 0)
                    ae_scores(qv + r * G * D, kc + S.base[i], s + r * G * SP + S.at[i], G, D,
                              valid, SP, kv_row);
            }
        }
        for (int64_t r = 0; r < R; ++r) {
            // the row's valid positions: a prefix of the segment
            const int64_t nr = std::max<int64_t>(0, std::min(n, ends[r] - first));
            for (int64_t g = r * G; g < (r + 1) * G; ++g) {
                float* sg = s + g * SP;
                if (nr > 0) {
                    if (soft_cap > 0.f) {
                        const float inv = 1.f / soft_cap;
                        for (int64_t j = 0; j < nr; ++j)
                            sg[j] = soft_cap * std::tanh(sg[j] * inv);
                    }
                    ae_softmax_update(sg, nr, m + g, l + g, acc + g * D, D);
                }
                for (int64_t j = nr; j < n; ++j) sg[j] = 0.f;
            }
        }
        for (int64_t i = 0; i < S.count; ++i) {
#if AE_ATTN_PREFETCH
            if (i < next.count) ae_prefetch_rows(vc + next.base[i], next.n[i], kv_row, D);
#endif
#ifdef AE_ATTN512
            if (wide) ae_accumulate512(acc, s + S.at[i], vc + S.base[i], RG, D, S.n[i], SP,
                                       kv_row);
            else
#endif
            for (int64_t g = 0; g < RG; ++g)
                ae_accumulate(acc + g * D, s + g * SP + S.at[i], vc + S.base[i], D, S.n[i],
                              kv_row);
        }
        cur ^= 1;
    }
}

// One span of one (request, KV head): positions [start, end).
static inline void ae_attend_span(const float* qv, const ae_kv_t* kc, const ae_kv_t* vc,
                                  const int64_t* table, int64_t start, int64_t end,
                                  int64_t kh, int64_t G, int64_t D, int64_t BS, int64_t kv_row,
                                  float soft_cap, float* acc, float* m, float* l, float* s,
                                  float* part) {
    ae_attend_rows(qv, kc, vc, table, start, &end, 1, kh, G, D, BS, kv_row, soft_cap, acc, m,
                   l, s, part);
}

// o[i] = a[i] * inv rounded to the element type, eight at a time (ae_store8: ae_put's bits).
static inline void ae_put_scaled(ae_t* o, const float* a, float inv, int64_t n) {
    int64_t i = 0;
#ifdef AE_AVX2
    const __m256 v = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8) ae_store8(o + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), v));
#endif
    for (; i < n; ++i) ae_put(o + i, a[i] * inv);
}

// out[i] = q[i] * scale as float32, eight at a time: a KV head's query heads, scaled.
static inline void ae_scale_query(const ae_t* q, float* out, int64_t n, float scale) {
    int64_t i = 0;
#ifdef AE_AVX2
    for (const __m256 vs = _mm256_set1_ps(scale); i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(ae_load8(q + i), vs));
#endif
    for (; i < n; ++i) out[i] = ae_get(q + i) * scale;
}

#include "attention_rows.h"

// The spans' partial (m, l, acc[D]) of one (request, KV head), per query head: pp + (it * G +
// g) * (D + 2) for its spans it in [first, last), merged in span order into o [G, D].
static inline void ae_merge_spans(const float* pt, int64_t first, int64_t last, int64_t G,
                                  int64_t D, float* acc, ae_t* o) {
    for (int64_t g = 0; g < G; ++g) {
        float mx = -INFINITY;
        for (int64_t it = first; it < last; ++it)
            mx = std::max(mx, pt[(it * G + g) * (D + 2)]);
        float l = 0.f;
        std::fill(acc, acc + D, 0.f);
        for (int64_t it = first; it < last; ++it) {
            const float* pp = pt + (it * G + g) * (D + 2);
            const float w = std::exp(pp[0] - mx);
            l += pp[1] * w;
            for (int64_t d = 0; d < D; ++d) acc[d] += pp[2 + d] * w;
        }
        const float inv = AE_KV_WIDEN / l;  // kv_fp8.h: values loaded / AE_KV_WIDEN
        ae_put_scaled(o + g * D, acc, inv, D);
    }
}

// Decode attention (one query token per request) over the paged KV cache, read in place: no
// gather copy, no padding, no mask. A key at position p of request b lives at row
// tables[b][p / BS] of the cache, slot p % BS.
//
// Each (request, KV head) is cut into spans of up to `split` consecutive positions (whole
// blocks; or a per-request count, ae_split_of). The query heads that share the KV head are
// handled together, so each key and value row is loaded once for all of them. Scores are
// taken a block at a time, then one online-softmax update per block:
//   m' = max(m, max_j s_j);  l' = l e^(m - m') + sum_j e^(s_j - m');
//   acc' = acc e^(m - m') + sum_j e^(s_j - m') v_j
// and the partial (m, l, acc) of a request's spans are merged the same way (flash-decoding).
// Work items are spans where the (request, KV head) pairs are too few to keep the threads
// busy (a long context's spans then run on different threads, merged after the parallel
// loop), else pairs (one thread takes a pair's spans in turn and merges them): the
// arithmetic is the same either way, so a request's result depends on its own spans only.
//
// q: rows of [H, D], row r of request b is rows[b], row stride q_stride (elements);
// kc: the K cache [num_blocks, BS, KVH, D], the V cache at kc + v_off; tables: int64
// [B, table_stride]; lens: int64 [B], the keys of each request (its new token's included);
// out: [B, H, D]. window > 0: only the last `window` keys of each request are attended
// (sliding-window attention); soft_cap > 0: scores become soft_cap * tanh(score / soft_cap).
extern "C" void kernel(const ae_t* q, const ae_kv_t* kc, const int64_t* tables,
                       const int64_t* lens, const int64_t* rows, ae_t* out, int64_t B,
                       int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t table_stride,
                       int64_t q_stride, int64_t split, float scale, int64_t v_off,
                       int64_t window, float soft_cap) {
    scale *= AE_KV_WIDEN;  // keys loaded / AE_KV_WIDEN (kv_fp8.h): exact, a power of two
    if (window <= 0 && ae_attend_grouped(q, kc, tables, lens, rows, out, B, H, KVH, D, BS,
                                         table_stride, q_stride, split, scale, v_off,
                                         soft_cap))
        return;  // rows sharing their blocks, attended together (attention_rows.h)
    const ae_kv_t* vc = kc + v_off;
    const int64_t G = H / KVH, kv_row = KVH * D, pairs = B * KVH;
    // Spans, in (b, kv head, span) order, so a request's spans are consecutive.
    // Scratch of the calling thread, kept between calls (no allocation per call).
    static thread_local std::vector<int64_t> first_item, item_bh;
    static thread_local ae_vec<float> part;
    first_item.resize(pairs + 1);
    int64_t items = 0;
    for (int64_t bh = 0; bh < pairs; ++bh) {
        first_item[bh] = items;
        const int64_t len = lens[bh / KVH];
        const int64_t keys = window > 0 ? std::min(len, window) : len;
        const int64_t sp = ae_split_of(split, len, KVH, BS);
        items += std::max<int64_t>(1, (keys + sp - 1) / sp);
    }
    first_item[pairs] = items;
    // Spans as work items only where the pairs alone leave threads idle.
    const bool by_span = items > pairs && pairs < 4 * (int64_t)ae_max_threads();
    const int64_t units = by_span ? items : pairs;
    if (by_span) {
        item_bh.resize(items);
        for (int64_t bh = 0; bh < pairs; ++bh)
            for (int64_t it = first_item[bh]; it < first_item[bh + 1]; ++it) item_bh[it] = bh;
    }
    // Partial results of the spans of split requests: per span and query head, (m, l, acc[D]).
    if (items > pairs && (int64_t)part.size() < items * G * (D + 2))
        part.resize(items * G * (D + 2));
    // Thread-locals are per thread: the team reads the calling thread's through these.
    const int64_t* const fi = first_item.data();
    const int64_t* const ib = item_bh.data();
    float* const pt = part.data();

    // A team costs more than it saves below a few thousand (position, head) scores.
#ifndef AE_ATTN_TEAM_MIN
#define AE_ATTN_TEAM_MIN 8192
#endif
    int64_t work = 0;
    for (int64_t b = 0; b < B; ++b) work += (window > 0 ? std::min(lens[b], window) : lens[b]) * H;
    #pragma omp parallel if (units > 1 && work >= AE_ATTN_TEAM_MIN)
    {
        static thread_local ae_vec<float> scratch;
        const int64_t SP = AE_ATTN_SPAN_BLOCKS * BS;
        const int64_t need = G * (2 * D + 2 + SP) + D + G * 256 + 16;
        if ((int64_t)scratch.size() < need) scratch.resize(need);
        float* qv = scratch.data();
        float* acc = qv + G * D;
        float* m = acc + G * D;
        float* l = m + G;
        float* s = l + G;
        float* macc = s + G * SP;  // the merge's accumulator
        // ae_scores512's partial sums, 64-byte aligned
        float* part = (float*)(((uintptr_t)(macc + D) + 63) & ~(uintptr_t)63);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t bh = by_span ? ib[u] : u, b = bh / KVH, kh = bh % KVH;
            const int64_t first = fi[bh], last = fi[bh + 1];
            // Keys [lo, lens[b]): lo > 0 under a window, not block-aligned in general.
            const int64_t lo = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
            const int64_t sp = ae_split_of(split, lens[b], KVH, BS);
            const int64_t* table = tables + b * table_stride;
            const ae_t* qrow = q + rows[b] * q_stride + kh * G * D;
            ae_scale_query(qrow, qv, G * D, scale);
            ae_t* o = out + (b * H + kh * G) * D;
            for (int64_t it = by_span ? u : first; it < (by_span ? u + 1 : last); ++it) {
                const int64_t start = lo + (it - first) * sp;
                const int64_t end = std::min(lens[b], start + sp);
                ae_attend_span(qv, kc, vc, table, start, end, kh, G, D, BS, kv_row, soft_cap,
                               acc, m, l, s, part);
                if (last - first == 1) {  // one span: the result
                    for (int64_t g = 0; g < G; ++g)
                        ae_put_scaled(o + g * D, acc + g * D, AE_KV_WIDEN / l[g], D);
                } else {
                    float* pp = pt + it * G * (D + 2);
                    for (int64_t g = 0; g < G; ++g) {
                        pp[g * (D + 2)] = m[g]; pp[g * (D + 2) + 1] = l[g];
                        std::memcpy(pp + g * (D + 2) + 2, acc + g * D, D * sizeof(float));
                    }
                }
            }
            if (!by_span && last - first > 1) ae_merge_spans(pt, first, last, G, D, macc, o);
        }
    }
    if (!by_span || items == pairs) return;
    #pragma omp parallel for schedule(static) if (pairs > 1)
    for (int64_t bh = 0; bh < pairs; ++bh) {
        const int64_t first = fi[bh], last = fi[bh + 1];
        if (last - first == 1) continue;  // written by its span
        static thread_local ae_vec<float> macc;
        macc.resize(D);
        const int64_t b = bh / KVH, kh = bh % KVH;
        ae_merge_spans(pt, first, last, G, D, macc.data(), out + (b * H + kh * G) * D);
    }
}
