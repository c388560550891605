// Threads: OpenMP (or one thread without it) and the GIL released around long calls.
#pragma once
#include "cpu.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// OpenMP, or one thread without it: the calls a kernel's parallel region makes.
static inline int64_t ae_max_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
static inline int64_t ae_thread_num() {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static inline int64_t ae_team_size() {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

// The GIL released for a long call (a millisecond or more), when `release` and the calling
// thread holds it (a kernel called from another kernel's call has it released already): the
// event loop's thread runs Python meanwhile instead of waiting for this call to return.
struct AeWithoutGil {
    PyThreadState* state;
    explicit AeWithoutGil(bool release = true)
        : state(release && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
    ~AeWithoutGil() { if (state) PyEval_RestoreThread(state); }
};
// Weights of at least this many elements make a matmul long enough to release the GIL.
#define AE_RELEASE_GIL_ELEMENTS (1 << 22)
