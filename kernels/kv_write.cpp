#include "common.h"

// The step's new K and V rows into their cache slots: row t of k (stride k_stride elements)
// goes to slot slots[t] of the K cache kc ([num_slots, W]), likewise v to the V cache at
// kc + v_off; a negative slot is skipped.
extern "C" void kernel(const ae_t* k, const ae_t* v, ae_t* kc, const int64_t* slots, int64_t T,
                       int64_t W, int64_t k_stride, int64_t v_stride, int64_t v_off) {
    ae_t* vc = kc + v_off;
    #pragma omp parallel for schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        std::memcpy(kc + slot * W, k + t * k_stride, W * sizeof(ae_t));
        std::memcpy(vc + slot * W, v + t * v_stride, W * sizeof(ae_t));
    }
}
