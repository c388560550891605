#include "common.h"

// A mixture-of-experts layer's routing, in the form moe.cpp takes it (models/moe.py, and the
// decode stack, call this one kernel so that both route alike):
//   logits[t][e] = x[t] . router[e]   summed in float32, rounded to the element type (a
//                                     linear layer in the model's dtype)
//   p[t] = softmax(logits[t])         in float32
//   the top_k experts of each token   the larger p first, the lower expert among equals
//   their weights p                   divided by their sum if renormalize
// and the T top_k assignments sorted by expert, stably (tokens in order within an expert):
// rows[i] the token of assignment i, wts[i] its weight, offs [E + 1] where each expert's
// assignments start. With `shared` (Qwen2-MoE's shared expert): gate[t] =
// sigmoid(x[t] . shared_gate), the dot rounded to the element type, the result too.
// x: [T, H]; router: [E, H]; shared_gate: [H].

// x . w over H elements of ae_t, summed in float32 (8 lanes, then across).
static inline float ae_route_dot(const ae_t* x, const ae_t* w, int64_t H) {
    int64_t i = 0;
    float s = 0.f;
#ifdef AE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= H; i += 8) acc = _mm256_fmadd_ps(ae_load8(x + i), ae_load8(w + i), acc);
    s = ae_hsum8(acc);
#endif
    for (; i < H; ++i) s += ae_get(x + i) * ae_get(w + i);
    return s;
}

static inline float ae_route_round(float v) {  // to the element type and back
    ae_t r;
    ae_put(&r, v);
    return ae_get(&r);
}

extern "C" void kernel(const ae_t* x, const ae_t* router, const ae_t* shared_gate,
                       int64_t* rows, int64_t* offs, float* wts, ae_t* gate, int64_t T,
                       int64_t H, int64_t E, int64_t k, int64_t renormalize, int64_t shared) {
    static thread_local std::vector<int64_t> chosen_buf;
    static thread_local std::vector<float> weight_buf;
    chosen_buf.resize(T * k);
    weight_buf.resize(T * k);
    int64_t* chosen = chosen_buf.data();  // the calling thread's, for the whole team
    float* weight = weight_buf.data();
    #pragma omp parallel for schedule(static) if (T * E * H >= (1 << 18))
    for (int64_t t = 0; t < T; ++t) {
        const ae_t* xt = x + t * H;
        std::vector<float> p(E);
        float top = -INFINITY;
        for (int64_t e = 0; e < E; ++e) {
            p[e] = ae_route_round(ae_route_dot(xt, router + e * H, H));
            top = std::max(top, p[e]);
        }
        float sum = 0.f;
        for (int64_t e = 0; e < E; ++e) {
            p[e] = std::exp(p[e] - top);
            sum += p[e];
        }
        for (int64_t e = 0; e < E; ++e) p[e] /= sum;
        int64_t* ct = chosen + t * k;
        float* wt = weight + t * k;
        float picked = 0.f;
        for (int64_t j = 0; j < k; ++j) {  // k is small: k passes over the experts
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e) {
                bool taken = false;
                for (int64_t i = 0; i < j; ++i) taken |= ct[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            ct[j] = best;
            wt[j] = p[best];
            picked += p[best];
        }
        if (renormalize)
            for (int64_t j = 0; j < k; ++j) wt[j] /= picked;
        if (shared) {
            const float g = ae_route_round(ae_route_dot(xt, shared_gate, H));
            ae_put(gate + t, 1.f / (1.f + std::exp(-g)));
        }
    }
    for (int64_t e = 0; e <= E; ++e) offs[e] = 0;
    for (int64_t i = 0; i < T * k; ++i) ++offs[chosen[i] + 1];
    for (int64_t e = 0; e < E; ++e) offs[e + 1] += offs[e];
    std::vector<int64_t> next(offs, offs + E);
    for (int64_t i = 0; i < T * k; ++i) {
        const int64_t at = next[chosen[i]]++;
        rows[at] = i / k;
        wts[at] = weight[i];
    }
}
