// decode_attention.cpp's rows of one sequence attended together: a verification's draft rows
// and a prefill chunk's tokens are rows with the same block table and lengths one apart. Run
// one at a time, each row loads and widens the same keys and values again; here a group of up
// to AE_ATTN_ROWS such rows is one work item per KV head, whose keys and values are loaded
// once for all the rows' query heads (R * G of them).
//
// To the bit what each row computes alone (ae_attend_span over [0, len) as one span): the
// same blocks of positions (segments) from position 0, each (query, key) score as alone (the
// 16-key path scores each key by itself; the 8-key one, which groups a block's keys by
// their count, runs per row with the row's own count),
// and per row its own count of valid positions in each segment for the max, the exponentials,
// their sum and the rescaling; a row's weights past its end are zero, and adding 0 * v to its
// accumulator leaves it as it was. So a row's result does not depend on the rows grouped with
// it: greedy output stays the same with and without speculative decoding.
//
// Used where every row is one span (no window, its length within its split) and some rows
// share a table; else the per-row path.

#ifndef AE_ATTN_ROWS
#define AE_ATTN_ROWS 16
#endif

// Rows [0, R) of one group, KV head kh: qv [R * G, D] (scaled); ends [R] each row's keys.
// acc [R * G, D], m, l [R * G], s [R * G, SP]; part: ae_scores512's, R * G * 256 floats.
static inline void ae_attend_rows(const float* qv, const ae_t* kc, const ae_t* vc,
                                  const int64_t* table, const int64_t* ends, int64_t R,
                                  int64_t kh, int64_t G, int64_t D, int64_t BS, int64_t kv_row,
                                  float soft_cap, float* acc, float* m, float* l, float* s,
                                  float* part) {
    const int64_t SP = AE_ATTN_SPAN_BLOCKS * BS, RG = R * G;
    int64_t seg_base[AE_ATTN_SPAN_BLOCKS], seg_n[AE_ATTN_SPAN_BLOCKS];
    int64_t seg_at[AE_ATTN_SPAN_BLOCKS];
    int64_t end = 0;
    for (int64_t r = 0; r < R; ++r) end = std::max(end, ends[r]);
#ifdef AE_ATTN512
    const bool wide = D % 16 == 0 && D <= AE_ATTN_D512;
#else
    (void)part;
#endif
    for (int64_t i = 0; i < RG * D; ++i) acc[i] = 0.f;
    for (int64_t g = 0; g < RG; ++g) { m[g] = -INFINITY; l[g] = 0.f; }
    for (int64_t p0 = 0; p0 < end;) {
        const int64_t first = p0;  // the segment's first position
        int64_t nseg = 0, n = 0;
        while (p0 < end && nseg < AE_ATTN_SPAN_BLOCKS) {
            const int64_t k = std::min(BS - p0 % BS, end - p0);
            if (n + k > SP) break;
            seg_base[nseg] = (table[p0 / BS] * BS + p0 % BS) * kv_row + kh * D;
            seg_n[nseg] = k;
            seg_at[nseg++] = n;
            n += k;
            p0 += k;
        }
        for (int64_t i = 0; i < nseg; ++i) {
#ifdef AE_ATTN512
            if (wide) {  // each key's score alone: all rows' query heads at once
                ae_scores512(qv, kc + seg_base[i], s + seg_at[i], RG, D, seg_n[i], SP, kv_row,
                             part);
                continue;
            }
#endif
            // the 8-key path groups a block's keys by its count: each row its own count there
            for (int64_t r = 0; r < R; ++r) {
                const int64_t valid = std::min(seg_n[i], ends[r] - first - seg_at[i]);
                if (valid > 0)
                    ae_scores(qv + r * G * D, kc + seg_base[i], s + r * G * SP + seg_at[i], G, D,
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
        for (int64_t i = 0; i < nseg; ++i) {
#ifdef AE_ATTN512
            if (wide) ae_accumulate512(acc, s + seg_at[i], vc + seg_base[i], RG, D, seg_n[i],
                                       SP, kv_row);
            else
#endif
            for (int64_t g = 0; g < RG; ++g)
                ae_accumulate(acc + g * D, s + g * SP + seg_at[i], vc + seg_base[i], D,
                              seg_n[i], kv_row);
        }
    }
}

// Grouped mode, when it applies: every row one span (no window), and some consecutive rows
// with the same blocks. Returns false (nothing written) otherwise.
static inline bool ae_attend_grouped(const ae_t* q, const ae_t* kc, const int64_t* tables,
                                     const int64_t* lens, const int64_t* rows, ae_t* out,
                                     int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                     int64_t table_stride, int64_t q_stride, int64_t split,
                                     float scale, int64_t v_off, float soft_cap) {
    if (B < 2) return false;
    for (int64_t b = 0; b < B; ++b)
        if (ae_split_of(split, lens[b], KVH, BS) < lens[b]) return false;
    // Runs of rows with the same blocks (row b's blocks equal to its run's first row's).
    static thread_local std::vector<int64_t> run_at, group_at, group_run;
    run_at.assign(1, 0);
    for (int64_t b = 1; b < B; ++b) {
        const int64_t f = run_at.back();
        const int64_t nb = (lens[b] + BS - 1) / BS;
        if (std::memcmp(tables + b * table_stride, tables + f * table_stride,
                        nb * sizeof(int64_t)))
            run_at.push_back(b);
    }
    if ((int64_t)run_at.size() == B) return false;  // no two rows share: the per-row path
    run_at.push_back(B);
    // Each run cut into near-equal groups of at most AE_ATTN_ROWS rows, enough of them that
    // the (group, KV head) items keep the threads busy.
    const int64_t threads = ae_max_threads();
    group_at.clear();
    group_run.clear();
    for (size_t i = 0; i + 1 < run_at.size(); ++i) {
        const int64_t b0 = run_at[i], n = run_at[i + 1] - b0;
        int64_t c = std::max((n + AE_ATTN_ROWS - 1) / AE_ATTN_ROWS,
                             (2 * threads + KVH - 1) / KVH);
        c = std::min(c, n);
        for (int64_t j = 0; j < c; ++j) {
            group_at.push_back(b0 + j * n / c);
            group_run.push_back(b0);  // its table has every block of the run's rows
        }
    }
    group_at.push_back(B);
    const int64_t groups = (int64_t)group_at.size() - 1, units = groups * KVH;
    const int64_t G = H / KVH, kv_row = KVH * D;
    const int64_t* const ga = group_at.data();
    const int64_t* const gr = group_run.data();
    const ae_t* vc = kc + v_off;
    #pragma omp parallel if (units > 1)
    {
        static thread_local ae_vec<float> scratch;
        const int64_t SP = AE_ATTN_SPAN_BLOCKS * BS, RG = AE_ATTN_ROWS * G;
        const int64_t need = RG * (2 * D + 2 + SP) + RG * 256 + 16;
        if ((int64_t)scratch.size() < need) scratch.resize(need);
        float* qv = scratch.data();
        float* acc = qv + RG * D;
        float* m = acc + RG * D;
        float* l = m + RG;
        float* s = l + RG;
        float* part = (float*)(((uintptr_t)(s + RG * SP) + 63) & ~(uintptr_t)63);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t grp = u / KVH, kh = u % KVH, b0 = ga[grp], R = ga[grp + 1] - b0;
            for (int64_t r = 0; r < R; ++r) {
                const ae_t* qrow = q + rows[b0 + r] * q_stride + kh * G * D;
                float* qr = qv + r * G * D;
                int64_t i = 0;
#ifdef AE_AVX2
                for (const __m256 vs = _mm256_set1_ps(scale); i + 8 <= G * D; i += 8)
                    _mm256_storeu_ps(qr + i, _mm256_mul_ps(ae_load8(qrow + i), vs));
#endif
                for (; i < G * D; ++i) qr[i] = ae_get(qrow + i) * scale;
            }
            ae_attend_rows(qv, kc, vc, tables + gr[grp] * table_stride, lens + b0, R, kh, G, D, BS,
                           kv_row, soft_cap, acc, m, l, s, part);
            for (int64_t r = 0; r < R; ++r) {
                ae_t* o = out + ((b0 + r) * H + kh * G) * D;
                for (int64_t g = 0; g < G; ++g)
                    ae_put_scaled(o + g * D, acc + (r * G + g) * D, 1.f / l[r * G + g], D);
            }
        }
    }
    return true;
}
