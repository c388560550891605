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

// Grouped mode, when it applies: every row one span (no window), and some consecutive rows
// with the same blocks. Returns false (nothing written) otherwise.
static inline bool ae_attend_grouped(const ae_t* q, const ae_kv_t* kc, const int64_t* tables,
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
    const ae_kv_t* vc = kc + v_off;
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
            for (int64_t r = 0; r < R; ++r)
                ae_scale_query(q + rows[b0 + r] * q_stride + kh * G * D, qv + r * G * D, G * D,
                               scale);
            ae_attend_rows(qv, kc, vc, tables + gr[grp] * table_stride, 0, lens + b0, R, kh, G,
                           D, BS, kv_row, soft_cap, acc, m, l, s, part);
            for (int64_t r = 0; r < R; ++r) {
                ae_t* o = out + ((b0 + r) * H + kh * G) * D;
                for (int64_t g = 0; g < G; ++g)
                    ae_put_scaled(o + g * D, acc + (r * G + g) * D, AE_KV_WIDEN / l[r * G + g],
                                  D);
            }
        }
    }
    return true;
}
