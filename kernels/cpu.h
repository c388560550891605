// What the CPU offers, decided at compile time from the compiler's target macros (inductor
// compiles with -march=native-like flags): AE_AVX2 (AVX2 + FMA + F16C) or a portable loop;
// the AVX-512 extensions are tested where used (__AVX512F__, __AVX512BF16__, ...). And the
// scratch buffers' allocator.
#pragma once
#include <Python.h>  // first, as Python asks
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <new>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AE_AVX2 1
#endif

// Scratch buffers start on a cache line: the kernels read them with unaligned vector loads, and
// a 64-byte load that straddles two lines costs more. malloc's 16-byte alignment left that to
// chance, per process and per buffer size: int4_bf16.cpp's reordered rows at 16 / 32 / 48 bytes
// past a line made a 6-row SmolLM2 3072 x 576 matmul 63 us against 49 us (M = 1 unaffected).
template <class T>
struct AeAlign64 {
    using value_type = T;
    AeAlign64() = default;
    template <class U>
    AeAlign64(const AeAlign64<U>&) {}
    T* allocate(std::size_t n) {
        return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
    }
    void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U>
    bool operator==(const AeAlign64<U>&) const { return true; }
    template <class U>
    bool operator!=(const AeAlign64<U>&) const { return false; }
};
template <class T>
using ae_vec = std::vector<T, AeAlign64<T>>;

// Software prefetch in the row kernels (int4_bf16.cpp, int8_bf16.cpp) when two or more input
// rows share each pass over a weight row: the weights AE_PREFETCH_ROWS rows ahead. With one
// row the loop is short enough for the hardware prefetcher; with more, each weight line is
// worked on longer and its stream falls behind: a decode step's weights come from memory, not
// the cache, and a 9-row verification step waited on them (a 1 + 8 row step of SmolLM2: its
// gate_up / down matmuls 98 / 55 -> 71 / 36 us a layer, the int8 head 1.27 -> 0.88 ms; the
// step 10.1 -> 8.4 ms, decode_step.py --drafts 8). Prefetches change no result.
#define AE_PREFETCH_ROWS 8
