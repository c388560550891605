// What every kernel of this folder includes, by concern: the CPU's features and the scratch
// allocator (cpu.h), threads and the GIL (parallel.h), element types and float conversions
// (floats.h), the vector exp (exp.h), float dot products and reductions (dots.h), input rows
// rounded to int8 for byte dot products (round_rows.h).
#pragma once
#include "cpu.h"
#include "parallel.h"
#include "floats.h"
#include "exp.h"
#include "dots.h"
#include "round_rows.h"
