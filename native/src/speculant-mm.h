// speculant: batch-invariant multi-token matmul kernels for ggml's CPU backend (Q4_K, Q6_K weights).
//
// A pass over n tokens must give every output the bits a one-token pass gives it, or speculative
// verification would not be exact. These kernels compute each output element with one fixed sequence of
// float operations (the one ggml's AVX2 dot product uses), whatever the number of tokens, while unpacking
// each weight block once for up to SPECULANT_MM_COLS tokens. Only the integer part is shared between tokens,
// and integer sums do not depend on their order.
#pragma once

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SPECULANT_MM_COLS 4  // tokens per weight unpacking

// Passes with at most this many tokens (rows of src1) take the invariant path (verify and decode passes);
// larger ones (prompt processing) may take ggml's fast batched kernels. SPECULANT_INVARIANT_ROWS overrides.
int64_t speculant_mm_max_rows(void);

// true when this matmul is a small pass (<= speculant_mm_max_rows() tokens)
bool speculant_mm_small_pass(const struct ggml_tensor * src0, const struct ggml_tensor * src1);

// true when the kernels below handle src0's type on this build (AVX2 and up)
bool speculant_mm_supported(const struct ggml_tensor * src0, const struct ggml_tensor * src1);

// dst rows [ir0, ir1) of src0 x every column of the quantized src1 (q8_K rows of row_size bytes at wdata)
void speculant_mm_rows(const struct ggml_tensor * src0, const void * wdata, size_t row_size,
                       struct ggml_tensor * dst, int64_t ir0, int64_t ir1);

// for tests: one weight row (n values of `type`) against ncols q8_K rows (y, row_size bytes apart), columns
// taken `group` at a time (1..SPECULANT_MM_COLS); reorder != 0 deliberately sums blocks in another order
// (a test must be able to see that). Returns 0, or -1 for an unsupported type or build.
GGML_BACKEND_API int speculant_mm_test_dot(int type, int n, const void * x, const void * y, size_t row_size,
                                           int ncols, int group, int reorder, float * out);

#ifdef __cplusplus
}
#endif
