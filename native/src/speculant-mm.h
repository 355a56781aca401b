// speculant: batch-invariant multi-token matmul kernels for ggml's CPU backend (Q4_K, Q6_K weights; Q4_K
// repacked).
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

// true when src1 holds at most speculant_mm_max_rows() tokens (its ne[1]; an attention product's heads are its
// ne[2]): llamafile's sgemm, whose rounding depends on the shape, serves only longer passes
bool speculant_mm_few_tokens(const struct ggml_tensor * src1);

// true when the kernels below handle src0's type on this build (AVX2 and up)
bool speculant_mm_supported(const struct ggml_tensor * src0, const struct ggml_tensor * src1);

// dst rows [ir0, ir1) of src0 x every column of the quantized src1 (q8_K rows of row_size bytes at wdata)
void speculant_mm_rows(const struct ggml_tensor * src0, const void * wdata, size_t row_size,
                       struct ggml_tensor * dst, int64_t ir0, int64_t ir1);

// Weights repacked 8 rows at a time (ggml's block_q4_Kx8; block_q6_Kx8, which ggml repacks on x86 only in our
// build; interleave/rows: the repack's INTER_SIZE and NB_COLS): true when speculant_mm_repacked_rows handles them
bool speculant_mm_repacked_supported(enum ggml_type type, int interleave, int rows);

// nrows (a multiple of 8) repacked rows starting at x, times ncols q8_K columns (row_size bytes apart at wdata);
// column c's results at dst + c * dst_stride. Q4_K: per column the bits of ggml_gemv_q4_K_8x8_q8_K. Q6_K: every
// pass, of any size, takes this kernel (ggml has no x86 kernels for the layout).
void speculant_mm_repacked_rows(enum ggml_type type, int n, const void * x, int64_t nrows, const void * wdata,
                                size_t row_size, int ncols, float * dst, size_t dst_stride);

// for tests: 8 plain Q4_K rows (x: row after row, n values each) repacked as ggml does, against ncols q8_K rows,
// `group` columns at a time; out[8c + r] is row r x column c. out_ggml (may be NULL) gets ggml's gemv per column.
GGML_BACKEND_API int speculant_mm_test_q4_Kx8(int n, const void * x, const void * y, size_t row_size, int ncols,
                                              int group, int reorder, float * out, float * out_ggml);

// for tests: as speculant_mm_test_q4_Kx8, for Q6_K (no ggml reference on x86)
GGML_BACKEND_API int speculant_mm_test_q6_Kx8(int n, const void * x, const void * y, size_t row_size, int ncols,
                                              int group, int reorder, float * out);

// for tests: one weight row (n values of `type`) against ncols q8_K rows (y, row_size bytes apart), columns
// taken `group` at a time (1..SPECULANT_MM_COLS); reorder != 0 deliberately sums blocks in another order
// (a test must be able to see that). Returns 0, or -1 for an unsupported type or build.
GGML_BACKEND_API int speculant_mm_test_dot(int type, int n, const void * x, const void * y, size_t row_size,
                                           int ncols, int group, int reorder, float * out);

#ifdef __cplusplus
}
#endif
