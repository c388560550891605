#include "common.h"

// Greedy tokens straight from the hidden states: ids[r] = argmax_v (x[r] . w[v] + bias[v]),
// with the logits never written to memory. x: float [N, K]; w: float [V, K] (the head's own
// layout); bias: float [V] when has_bias; ids: int64 [N].
//
// The threads take chunks of the vocabulary as they come free (a dynamic schedule: a thread
// that loses its core to another of the process holds back one chunk, not half the call),
// each in increasing vocabulary order, and keep a best (value, id) per row over the chunks
// they took, replaced only by a strictly greater logit. The bests merge by (greater value, or
// equal value and lower id), in any order: ties go to the lowest id, as argmax's do. A row
// that meets a NaN logit, or whose maximum is not finite, gets no_token.
//
// Three inner loops (which shapes take which: ae_head_mode; figures: sampler/greedy_head.py):
// - rows in lanes (ae_head_xl): the rows, transposed once per call into groups of 16 ([K][16],
//   rows past N as 0); per k 2 loads of a group + broadcasts of 6 vocabulary rows' weights, read
//   in place, feeding 12 FMA accumulators (16 rows x 6 ids). A row's running best is one lane
//   of its group's, updated by compares and blends: no horizontal reduction, no scalar compare
//   per logit, no copy of the weight. The next 6 rows' weights are prefetched meanwhile.
// - broadcast (ae_head_bcast): for row counts that would leave many lanes of the last group
//   idle. A block of vocabulary rows is packed, transposed, into thread-local tiles [K][16]
//   (16 vocabulary rows a k step: 2 aligned loads), then groups of 6 input rows run over it,
//   per k 2 loads + 6 broadcasts feeding 12 FMA accumulators; the 16-lane logits of a row
//   update its 16-lane running best (lanes: vocabulary row mod 16), merged at the end. While
//   the first group runs, the next block's weights are prefetched (a cache line a k step).
// - dots (ae_head_dots): tiles of 3 input rows x 4 vocabulary rows as dot products along K,
//   reduced by horizontal adds and offered one by one. Below 4 rows, and without AVX2.
#define AE_HEAD_BLOCK 64  // vocabulary rows per block of the dots loop (64 K floats, L1 or L2)
#define AE_HEAD_ROWS 6    // input rows per group of the broadcast loop

struct ae_best {
    float value;
    int64_t id;
    int64_t nan;
};

static inline void ae_offer(ae_best& b, float v, int64_t id) {
    if (v > b.value) { b.value = v; b.id = id; }
    else if (v != v) b.nan = 1;
}

// Order-independent merge of two bests (of disjoint vocabulary ranges or lanes).
static inline void ae_merge(ae_best& m, float v, int64_t id, int64_t nan) {
    if (v > m.value || (v == m.value && id < m.id)) { m.value = v; m.id = id; }
    m.nan |= nan;
}

// ---- dots: the logits of input rows r0 .. r0 + R - 1 against vocabulary rows v .. v + 3,
// offered to each row's best.
template <int R>
static inline void ae_head_tile(const float* x, const float* w, const float* bias, int64_t K,
                                int64_t r0, int64_t v, ae_best* best) {
    float out[R][4];
#ifdef AE_AVX2
    if (K % 8 == 0) {
        __m256 a[R][4];
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_ps();
        const float* xr = x + r0 * K;
        const float* wv = w + v * K;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 xv[R];
            for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(xr + r * K + k);
            #pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const __m256 wj = _mm256_loadu_ps(wv + j * K + k);
                for (int r = 0; r < R; ++r) a[r][j] = _mm256_fmadd_ps(xv[r], wj, a[r][j]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]),
                                            _mm256_hadd_ps(a[r][2], a[r][3]));
            _mm_storeu_ps(out[r], _mm_add_ps(_mm256_castps256_ps128(h),
                                             _mm256_extractf128_ps(h, 1)));
        }
    } else
#endif
    {
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < 4; ++j) {
                float s = 0.f;
                for (int64_t k = 0; k < K; ++k) s += x[(r0 + r) * K + k] * w[(v + j) * K + k];
                out[r][j] = s;
            }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j)
            ae_offer(best[r0 + r], bias ? out[r][j] + bias[v + j] : out[r][j], v + j);
}

// The dots loop over the vocabulary rows [c, c_end) into this thread's bests.
static void ae_head_dots(const float* x, const float* w, const float* b, int64_t N, int64_t K,
                         int64_t c, int64_t c_end, ae_best* best) {
    const int64_t c_quads = c + (c_end - c) / 4 * 4;
    int64_t r = 0;
    for (; r + 3 <= N; r += 3)
        for (int64_t v = c; v < c_quads; v += 4) ae_head_tile<3>(x, w, b, K, r, v, best);
    for (; r + 2 <= N; r += 2)
        for (int64_t v = c; v < c_quads; v += 4) ae_head_tile<2>(x, w, b, K, r, v, best);
    if (r < N)
        for (int64_t v = c; v < c_quads; v += 4) ae_head_tile<1>(x, w, b, K, r, v, best);
    for (int64_t v = c_quads; v < c_end; ++v)  // the vocabulary's last < 4 rows
        for (r = 0; r < N; ++r) {
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * w[v * K + k];
            ae_offer(best[r], b ? s + b[v] : s, v);
        }
}

#ifdef AE_AVX2
// ---- broadcast: one row's running best, per lane (vocabulary row mod 16) of the tiles.
struct alignas(32) ae_lanes {
    float value[16];
    int32_t id[16];
    int32_t nan[8];  // all-ones in a lane that met a NaN logit
};

// A packed tile: [K][16] floats, then its 16 biases (-inf in the lanes past the vocabulary:
// their weights are packed as 0, so those logits are -inf and never win).
static inline int64_t ae_tile_floats(int64_t K) { return K * 16 + 16; }

// Vocabulary rows v .. v + 15 of w (those below V) into the tile at p.
static void ae_pack_tile(const float* w, const float* bias, int64_t K, int64_t V, int64_t v,
                         float* p) {
    const int64_t n = std::min<int64_t>(16, V - v);
    if (n == 16) {
        for (int half = 0; half < 2; ++half) {
            const float* wr = w + (v + half * 8) * K;
            float* ph = p + half * 8;
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {  // an 8 x 8 block, transposed in registers
                __m256 r[8], t[8];
                for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(wr + i * K + k);
                for (int i = 0; i < 8; i += 2) {
                    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
                }
                for (int i = 0; i < 8; i += 4) {
                    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
                    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
                }
                for (int i = 0; i < 4; ++i) {
                    _mm256_store_ps(ph + (k + i) * 16,
                                    _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
                    _mm256_store_ps(ph + (k + i + 4) * 16,
                                    _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
                }
            }
            for (; k < K; ++k)
                for (int i = 0; i < 8; ++i) ph[k * 16 + i] = wr[i * K + k];
        }
    } else {
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < 16; ++j) p[k * 16 + j] = j < n ? w[(v + j) * K + k] : 0.f;
    }
    for (int64_t j = 0; j < 16; ++j)
        p[K * 16 + j] = j < n ? (bias ? bias[v + j] : 0.f) : -INFINITY;
}

// The logits of input rows x[0 .. R - 1] against the packed tile p (vocabulary rows from v),
// into those rows' lanes; with `pf`, a cache line of it is prefetched a k step.
template <int R>
static inline void ae_head_bcast(const float* x, int64_t K, const float* p, int32_t v,
                                 ae_lanes* best, const float* pf) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; ++k) {
        if (pf) _mm_prefetch((const char*)(pf + k * 16), _MM_HINT_T0);
        const __m256 w0 = _mm256_load_ps(p + k * 16), w1 = _mm256_load_ps(p + k * 16 + 8);
        for (int r = 0; r < R; ++r) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
        }
    }
    const __m256 b0 = _mm256_load_ps(p + K * 16), b1 = _mm256_load_ps(p + K * 16 + 8);
    const __m256i id0 = _mm256_add_epi32(_mm256_set1_epi32(v),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i id1 = _mm256_add_epi32(id0, _mm256_set1_epi32(8));
    for (int r = 0; r < R; ++r) {
        ae_lanes& s = best[r];
        const __m256 l0 = _mm256_add_ps(a0[r], b0), l1 = _mm256_add_ps(a1[r], b1);
        const __m256 v0 = _mm256_load_ps(s.value), v1 = _mm256_load_ps(s.value + 8);
        const __m256 m0 = _mm256_cmp_ps(l0, v0, _CMP_GT_OQ), m1 = _mm256_cmp_ps(l1, v1, _CMP_GT_OQ);
        _mm256_store_ps(s.value, _mm256_blendv_ps(v0, l0, m0));
        _mm256_store_ps(s.value + 8, _mm256_blendv_ps(v1, l1, m1));
        __m256* ids = (__m256*)s.id;
        ids[0] = _mm256_blendv_ps(ids[0], _mm256_castsi256_ps(id0), m0);
        ids[1] = _mm256_blendv_ps(ids[1], _mm256_castsi256_ps(id1), m1);
        __m256* nan = (__m256*)s.nan;
        *nan = _mm256_or_ps(*nan, _mm256_cmp_ps(l0, l1, _CMP_UNORD_Q));
    }
}

// The broadcast loop over the packed tiles [0, tiles) (vocabulary rows from v) for all rows;
// the first group of rows prefetches `next` (tiles * 16 * K floats, or none when null).
static void ae_head_bcast_rows(const float* x, int64_t N, int64_t K, const float* p,
                               int64_t tiles, int64_t v, ae_lanes* best, const float* next) {
    const int64_t tf = ae_tile_floats(K);
    for (int64_t r = 0; r < N; r += AE_HEAD_ROWS) {
        const float* xr = x + r * K;
        for (int64_t t = 0; t < tiles; ++t) {
            const float* pt = p + t * tf;
            const float* pf = next && r == 0 ? next + t * 16 * K : nullptr;
            const int32_t vt = v + t * 16;
            switch (std::min<int64_t>(AE_HEAD_ROWS, N - r)) {
                case 6: ae_head_bcast<6>(xr, K, pt, vt, best + r, pf); break;
                case 5: ae_head_bcast<5>(xr, K, pt, vt, best + r, pf); break;
                case 4: ae_head_bcast<4>(xr, K, pt, vt, best + r, pf); break;
                case 3: ae_head_bcast<3>(xr, K, pt, vt, best + r, pf); break;
                case 2: ae_head_bcast<2>(xr, K, pt, vt, best + r, pf); break;
                default: ae_head_bcast<1>(xr, K, pt, vt, best + r, pf); break;
            }
        }
    }
}

// ---- rows in lanes: the running bests of a group of 16 rows, a lane a row.
struct alignas(32) ae_rows16 {
    float value[16];
    int32_t id[16];
    int32_t nan[16];
};

// The logits of a group's rows (xt: [K][16]) against vocabulary rows v .. v + J - 1 (w: their
// weights), offered in that order to the group's bests; J * K floats from `pf` are prefetched
// meanwhile, a cache line every 16 / J k steps.
template <int J>
static inline void ae_head_xl(const float* xt, int64_t K, const float* w, const float* bias,
                              int32_t v, ae_rows16& s, const float* pf) {
    __m256 a0[J], a1[J];
    for (int j = 0; j < J; ++j) { a0[j] = _mm256_setzero_ps(); a1[j] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; ++k) {
        _mm_prefetch((const char*)(pf + k * J), _MM_HINT_T0);
        const __m256 x0 = _mm256_load_ps(xt + k * 16), x1 = _mm256_load_ps(xt + k * 16 + 8);
        for (int j = 0; j < J; ++j) {
            const __m256 wb = _mm256_broadcast_ss(w + j * K + k);
            a0[j] = _mm256_fmadd_ps(x0, wb, a0[j]);
            a1[j] = _mm256_fmadd_ps(x1, wb, a1[j]);
        }
    }
    __m256 v0 = _mm256_load_ps(s.value), v1 = _mm256_load_ps(s.value + 8);
    __m256 i0 = _mm256_load_ps((const float*)s.id), i1 = _mm256_load_ps((const float*)s.id + 8);
    __m256 n0 = _mm256_load_ps((const float*)s.nan), n1 = _mm256_load_ps((const float*)s.nan + 8);
    #pragma GCC unroll 6
    for (int j = 0; j < J; ++j) {  // unrolled: the accumulators stay registers
        __m256 l0 = a0[j], l1 = a1[j];
        if (bias) {
            const __m256 bj = _mm256_set1_ps(bias[v + j]);
            l0 = _mm256_add_ps(l0, bj);
            l1 = _mm256_add_ps(l1, bj);
        }
        const __m256 m0 = _mm256_cmp_ps(l0, v0, _CMP_GT_OQ), m1 = _mm256_cmp_ps(l1, v1, _CMP_GT_OQ);
        v0 = _mm256_blendv_ps(v0, l0, m0);
        v1 = _mm256_blendv_ps(v1, l1, m1);
        const __m256 id = _mm256_castsi256_ps(_mm256_set1_epi32(v + j));
        i0 = _mm256_blendv_ps(i0, id, m0);
        i1 = _mm256_blendv_ps(i1, id, m1);
        n0 = _mm256_or_ps(n0, _mm256_cmp_ps(l0, l0, _CMP_UNORD_Q));
        n1 = _mm256_or_ps(n1, _mm256_cmp_ps(l1, l1, _CMP_UNORD_Q));
    }
    _mm256_store_ps(s.value, v0);
    _mm256_store_ps(s.value + 8, v1);
    _mm256_store_ps((float*)s.id, i0);
    _mm256_store_ps((float*)s.id + 8, i1);
    _mm256_store_ps((float*)s.nan, n0);
    _mm256_store_ps((float*)s.nan + 8, n1);
}

// Vocabulary rows [v, v_end) against every group; the first group prefetches the rows after.
// Not inlined: in the kernel's body GCC kept values of its own in the registers the
// accumulators need.
__attribute__((noinline)) static void ae_head_xl_rows(const float* xt, int64_t groups,
                                                      int64_t K, const float* w,
                                                      const float* bias, int64_t v,
                                                      int64_t v_end, int64_t V,
                                                      ae_rows16* best) {
    for (; v < v_end; v += 6) {
        const float* wv = w + v * K;
        for (int64_t g = 0; g < groups; ++g) {
            const float* xg = xt + g * K * 16;
            // (the others prefetch this tile's own rows again: in cache, no-ops)
            const float* pf = g == 0 && v + 12 <= V ? wv + 6 * K : wv;
            switch (std::min<int64_t>(6, v_end - v)) {
                case 6: ae_head_xl<6>(xg, K, wv, bias, v, best[g], pf); break;
                case 5: ae_head_xl<5>(xg, K, wv, bias, v, best[g], pf); break;
                case 4: ae_head_xl<4>(xg, K, wv, bias, v, best[g], pf); break;
                case 3: ae_head_xl<3>(xg, K, wv, bias, v, best[g], pf); break;
                case 2: ae_head_xl<2>(xg, K, wv, bias, v, best[g], pf); break;
                default: ae_head_xl<1>(xg, K, wv, bias, v, best[g], pf); break;
            }
        }
    }
}
#endif

// Which loop runs: dots below 4 rows; rows in lanes where its padding to whole groups of 16
// wastes at most a quarter of the lanes, or up to 16 rows at K >= 256 (the weight comes from
// memory, and packing it costs more than idle lanes); else broadcast. Measured: see
// sampler/greedy_head.py. AE_HEAD_MODE, defined, fixes it (for benchmarks).
#define AE_HEAD_DOTS 0
#define AE_HEAD_BCAST 1
#define AE_HEAD_XL 2
static inline int ae_head_mode(int64_t N, int64_t K, int64_t V) {
#if defined(AE_HEAD_MODE)
    (void)N; (void)K; (void)V;
    return AE_HEAD_MODE;
#elif defined(AE_AVX2)
    if (N < 4 || V >= INT32_MAX - 32) return AE_HEAD_DOTS;
    const int64_t padded = (N + 15) / 16 * 16;
    return 3 * padded <= 4 * N || (K >= 256 && N <= 16) ? AE_HEAD_XL : AE_HEAD_BCAST;
#else
    (void)N; (void)K; (void)V;
    return AE_HEAD_DOTS;
#endif
}

extern "C" void kernel(const float* x, const float* w, const float* bias, int64_t* ids,
                       int64_t N, int64_t K, int64_t V, int64_t has_bias, int64_t no_token) {
    const AeWithoutGil released(N * K * V >= AE_RELEASE_GIL_ELEMENTS);
    const float* b = has_bias ? bias : nullptr;
    const int64_t max_threads = ae_max_threads();
    const int mode = ae_head_mode(N, K, V);
    [[maybe_unused]] const int64_t groups = (N + 15) / 16;  // of the rows-in-lanes loop
    // Per thread, the bests so far (per row an ae_best or ae_lanes, per group an ae_rows16),
    // in scratch of the calling thread kept between calls; the team reads it through `base`.
    static thread_local ae_vec<char> scratch;
    size_t thread_bytes = N * sizeof(ae_best);
#ifdef AE_AVX2
    if (mode == AE_HEAD_BCAST) thread_bytes = N * sizeof(ae_lanes);
    if (mode == AE_HEAD_XL) thread_bytes = groups * sizeof(ae_rows16) + groups * K * 64;
#endif
    thread_bytes = (thread_bytes + 63) / 64 * 64;
    if (scratch.size() < max_threads * thread_bytes + 64)
        scratch.resize(max_threads * thread_bytes + 64);
    char* const base = (char*)(((uintptr_t)scratch.data() + 63) & ~(uintptr_t)63);
    // A block: the broadcast loop packs that many whole tiles at a time, within about half of
    // L1 (one tile from K = 256); the rows-in-lanes loop runs 6 vocabulary rows at a time. A
    // chunk, the unit the threads take, is whole blocks, about 32 a thread: each costs one
    // atomic, and a preempted thread holds back one.
    const int64_t block_tiles = std::max<int64_t>(1, 16384 / (64 * std::max<int64_t>(1, K)));
    const int64_t block = mode == AE_HEAD_BCAST ? block_tiles * 16
                          : mode == AE_HEAD_XL ? 6 : AE_HEAD_BLOCK;
    const int64_t blocks = (V + block - 1) / block;
    const int64_t chunk_blocks = std::max<int64_t>(1, blocks / (32 * max_threads));
    const int64_t chunks = (blocks + chunk_blocks - 1) / chunk_blocks;
    int64_t threads = 1;
    #pragma omp parallel
    {
        const int64_t t = ae_thread_num();
        #pragma omp single nowait
        threads = ae_team_size();
        char* const mine = base + t * thread_bytes;
        if (mode == AE_HEAD_DOTS) {
            ae_best* best = (ae_best*)mine;
            for (int64_t r = 0; r < N; ++r) best[r] = ae_best{-INFINITY, 0, 0};
            #pragma omp for schedule(monotonic: dynamic) nowait
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t c_end = std::min(V, (c + 1) * chunk_blocks * block);
                for (int64_t v = c * chunk_blocks * block; v < c_end; v += block)
                    ae_head_dots(x, w, b, N, K, v, std::min(c_end, v + block), best);
            }
        }
#ifdef AE_AVX2
        else if (mode == AE_HEAD_BCAST) {
            ae_lanes* best = (ae_lanes*)mine;
            for (int64_t r = 0; r < N; ++r) {
                for (int j = 0; j < 16; ++j) { best[r].value[j] = -INFINITY; best[r].id[j] = 0; }
                for (int j = 0; j < 8; ++j) best[r].nan[j] = 0;
            }
            // The packed block, in scratch of this thread kept between calls.
            static thread_local ae_vec<float> packed;
            const int64_t tf = ae_tile_floats(K);
            if ((int64_t)packed.size() < block_tiles * tf + 16)
                packed.resize(block_tiles * tf + 16);
            float* const p = (float*)(((uintptr_t)packed.data() + 63) & ~(uintptr_t)63);
            #pragma omp for schedule(monotonic: dynamic) nowait
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t c_end = std::min(V, (c + 1) * chunk_blocks * block);
                for (int64_t v = c * chunk_blocks * block; v < c_end; v += block) {
                    const int64_t tiles = (std::min(c_end, v + block) - v + 15) / 16;
                    for (int64_t i = 0; i < tiles; ++i)
                        ae_pack_tile(w, b, K, V, v + i * 16, p + i * tf);
                    // The next block's weights come in while this one runs, when whole.
                    const float* next = v + 2 * block <= c_end ? w + (v + block) * K : nullptr;
                    ae_head_bcast_rows(x, N, K, p, tiles, v, best, next);
                }
            }
        } else {
            ae_rows16* best = (ae_rows16*)mine;
            for (int64_t g = 0; g < groups; ++g)
                for (int j = 0; j < 16; ++j) {
                    best[g].value[j] = -INFINITY; best[g].id[j] = 0; best[g].nan[j] = 0;
                }
            // This thread's copy of the rows, transposed by groups (a few KB to ~100 KB).
            float* const xt = (float*)(mine + groups * sizeof(ae_rows16));
            for (int64_t g = 0; g < groups; ++g)
                for (int64_t k = 0; k < K; ++k)
                    for (int64_t l = 0; l < 16; ++l)
                        xt[(g * K + k) * 16 + l] = g * 16 + l < N ? x[(g * 16 + l) * K + k] : 0.f;
            #pragma omp for schedule(monotonic: dynamic) nowait
            for (int64_t c = 0; c < chunks; ++c)
                ae_head_xl_rows(xt, groups, K, w, b, c * chunk_blocks * block,
                                std::min(V, (c + 1) * chunk_blocks * block), V, best);
        }
#endif
    }
    for (int64_t r = 0; r < N; ++r) {
        ae_best m{-INFINITY, 0, 0};
        for (int64_t t = 0; t < threads; ++t) {
            char* const theirs = base + t * thread_bytes;
            if (mode == AE_HEAD_DOTS) {
                const ae_best& o = ((ae_best*)theirs)[r];
                ae_merge(m, o.value, o.id, o.nan);
            }
#ifdef AE_AVX2
            else if (mode == AE_HEAD_BCAST) {
                const ae_lanes& o = ((ae_lanes*)theirs)[r];
                for (int j = 0; j < 16; ++j) ae_merge(m, o.value[j], o.id[j], 0);
                for (int j = 0; j < 8; ++j) m.nan |= o.nan[j] != 0;
            } else {
                const ae_rows16& o = ((ae_rows16*)theirs)[r / 16];
                ae_merge(m, o.value[r % 16], o.id[r % 16], o.nan[r % 16] != 0);
            }
#endif
        }
        ids[r] = (m.nan || !std::isfinite(m.value)) ? no_token : m.id;
    }
}
