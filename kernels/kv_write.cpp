#include "common.h"
#include "kv_fp8.h"

// The step's new K and V rows into their cache slots: row t of k (stride k_stride elements)
// goes to slot slots[t] of the K cache kc ([num_slots, W]), likewise v to the V cache at
// kc + v_off; a negative slot is skipped. The cache's elements are ae_kv_t (kv_fp8.h): the
// rows copied, or rounded to float8.
extern "C" void kernel(const ae_t* k, const ae_t* v, ae_kv_t* kc, const int64_t* slots,
                       int64_t T, int64_t W, int64_t k_stride, int64_t v_stride,
                       int64_t v_off) {
    ae_kv_t* vc = kc + v_off;
    #pragma omp parallel for schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        ae_kv_put_row(kc + slot * W, k + t * k_stride, W);
        ae_kv_put_row(vc + slot * W, v + t * v_stride, W);
    }
}
