// speculant: batch-invariant multi-token matmul kernels for ggml's CPU backend (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_XS, IQ4_NL, MXFP4, TQ2_0, Q8_0, Q5_0, Q4_0, Q5_1, Q4_1, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
// weights; Q4_K, Q6_K, Q4_0, IQ4_NL and MXFP4 repacked 8 rows at a time).
//
// A pass over n tokens must give every output the bits a one-token pass gives it, or speculative
// verification would not be exact. These kernels compute each output element with one fixed sequence of
// float operations (the one a ggml one-token kernel uses), whatever the number of tokens, while unpacking
// each weight block once for up to SPECULANT_MM_COLS tokens (repacked rows on AVX-512: 8; IQ1/IQ2/IQ3 rows: 16). Only the integer part is shared between tokens,
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

// Sets that limit in this process (0: every pass takes ggml's own kernels, as in llama.cpp's build; not exact).
// For A/B runs of the kernels over the same weights in memory.
GGML_BACKEND_API void speculant_mm_set_max_rows(int64_t rows);

// Weight rows per chunk when nth threads split a small pass's matmul of nrows rows (a multiple of `multiple`;
// the threads claim chunks in turn). SPECULANT_CHUNK_ROWS overrides with a fixed count.
int64_t speculant_mm_chunk_rows(int64_t nrows, int nth, int64_t multiple);

// Sets that override in this process (0: the default split). For A/B runs over the same weights in memory.
GGML_BACKEND_API void speculant_mm_set_chunk_rows(int64_t rows);

// true when this matmul is a small pass (<= speculant_mm_max_rows() tokens)
bool speculant_mm_small_pass(const struct ggml_tensor * src0, const struct ggml_tensor * src1);

// true when src1 holds at most speculant_mm_max_rows() tokens (its ne[1]; an attention product's heads are its
// ne[2]): llamafile's sgemm, whose rounding depends on the shape, serves only longer passes
bool speculant_mm_few_tokens(const struct ggml_tensor * src1);

// true when the kernels below handle src0's type on this build (AVX2 and up); false for a one-token pass over
// Q2_K, Q3_K, Q5_K, IQ4_XS, IQ4_NL, MXFP4, TQ2_0 or IQ1/IQ2/IQ3 weights (ggml's own loop: the same bits, a little
// faster)
bool speculant_mm_supported(const struct ggml_tensor * src0, const struct ggml_tensor * src1);

// dst rows [ir0, ir1) of src0 x every column of the quantized src1 (q8_K rows of row_size bytes at wdata)
void speculant_mm_rows(const struct ggml_tensor * src0, const void * wdata, size_t row_size,
                       struct ggml_tensor * dst, int64_t ir0, int64_t ir1);

// on != 0: from now on plain rows of a type llama.cpp repacks on this CPU (Q4_K, Q6_K, Q4_0, IQ4_NL, MXFP4; Q2_K with
// AVX-512), in matrices of a multiple of 8 rows, get the bits of the repacked kernels (speculant_mm_repacked_rows)
// instead of ggml's dot products', so the layout does not change a model's logits (RPC workers cannot repack their
// layers). 0 (the default): ggml's arithmetic, as in a stock build. Process-wide; set it before any pass.
GGML_BACKEND_API void speculant_mm_set_plain_as_repacked(int64_t on);

// Mixture-of-experts matrices (ggml's mul_mat_id): true when speculant_mm_expert_rows handles src0's type, plain
// or repacked (interleave/rows as for speculant_mm_repacked_supported; 0/0 for plain rows)
bool speculant_mm_expert_supported(enum ggml_type type, int interleave, int rows);

// Rows [ir0, ir1) of one expert's matrix x (its row 0; plain rows x_stride bytes apart, or repacked 8 at a time)
// times the columns of the ntok tokens that chose it. map: (slot, token) per token, ggml's mmid_row_mapping;
// token k's quantized column at ycols + (slot % ne11 + token * ne11) * row_size, its results at
// dst + slot * nb1 + token * nb2. Per column the bits of the one-token pass (vec_dot per element for plain rows,
// gemv for repacked ones), while each weight unpacking serves up to SPECULANT_MM_COLS (REPACKED_COLS, IQ_GRID_COLS)
// of the expert's tokens.
void speculant_mm_expert_rows(enum ggml_type type, int repacked, int n, const char * x, size_t x_stride, int64_t ir0,
                              int64_t ir1, const int32_t * map, int64_t ntok, const char * ycols, size_t row_size,
                              int64_t ne11, char * dst, size_t nb1, size_t nb2);

// Weights repacked 8 rows at a time (ggml's block_q4_Kx8 and block_q4_0x8; block_q6_Kx8, which ggml repacks on
// x86 only in our build; interleave/rows: the repack's INTER_SIZE and NB_COLS): true when
// speculant_mm_repacked_rows handles them
bool speculant_mm_repacked_supported(enum ggml_type type, int interleave, int rows);

// nrows (a multiple of 8) repacked rows starting at x, times ncols quantized columns (row_size bytes apart at
// wdata: q8_K for the K-quants, q8_0 for Q4_0); column c's results at dst + c * dst_stride. Per column the bits
// of ggml's one-token kernel for the layout (Q4_K, Q4_0). Q6_K: every pass, of any size, takes this kernel
// (ggml has no x86 kernel for the layout).
void speculant_mm_repacked_rows(enum ggml_type type, int n, const void * x, int64_t nrows, const void * wdata,
                                size_t row_size, int ncols, float * dst, size_t dst_stride);

// ggml's block_q6_Kx8 (made by its repack) rearranged in place into the order our kernel reads it: per step s =
// 4h + kk, 192 bytes: the 64-byte low-bit chunks 8h+kk and 8h+4+kk, then the high-bit chunk 4h+kk (chunk j: bytes
// 8j..8j+7 of each of the 8 rows). Read so, a block streams front to back, which hardware prefetchers follow. In
// ggml's order the kernel needed software prefetches, and on Zen 4 ran at full speed or half of it depending on
// where the build happened to place its code.
void speculant_mm_q6_Kx8_reorder(void * block);

// For tests: 8 weight rows of n values of `type` (x: row after row; with repacked == 1 the test repacks them as
// ggml does; repacked == 2: the plain rows as speculant_mm_rows computes a type llama.cpp repacks with
// speculant_mm_set_plain_as_repacked on: the repacked kernels' bits, and no ggml kernel to compare with) against ncols (<= 64) quantized columns (y, row_size
// bytes apart), `group` columns per weight
// unpacking (1..speculant_mm_max_group(type, repacked)); reorder != 0 deliberately sums the blocks in another order
// (a test must be able to see that). out[8c + r] is row r x column c; out_ggml (may be NULL) gets ggml's own one-token kernel.
// Returns 0; 1 when ggml has no kernel to compare with (repacked Q6_K); -1 for an unsupported type or build.
GGML_BACKEND_API int speculant_mm_test(int type, int repacked, int n, const void * x, const void * y,
                                       size_t row_size, int ncols, int group, int reorder, float * out,
                                       float * out_ggml);

// Tokens per weight unpacking in this build's kernels for rows of `type`: repacked (8 on AVX-512, 4 on AVX2) or
// plain (4; the IQ1/IQ2/IQ3 types 16; Q3_K, Q5_K and IQ4_XS 8 with AVX-512); 0 when the build has no kernels.
GGML_BACKEND_API int speculant_mm_max_group(int type, int repacked);

// dst rows [ir0_start, ir0_end) x flattened columns [ir1_start, ir1_end) of a matmul of an F16 src0 (an attention
// product's K, or V transposed) by an F32 src1 whose f16 rows are in wdata (row_size bytes each), as ggml's
// mul_mat_one_chunk indexes them: each element by the operations of ggml_vec_dot_f16, but every src0 row is
// dotted with all the columns that share it (a query head group's heads and tokens) while it is converted once.
// false when this build has no such kernel (then ggml's loop runs).
// 0: ggml's loop computes the attention products, and ggml's scalar loop the softmax's maximum, instead (the
// same bits); 1: speculant_mm_f16_chunk and speculant_vec_max_f32 (default).
// For A/B runs over the same weights and cache in memory.
GGML_BACKEND_API void speculant_mm_set_shared_attention(int64_t on);

// quantize_row_q8_K's bits (x86 ggml runs the scalar reference), 16 (AVX-512) or 8 (AVX2) values at once:
// the from_float of the rows that K-quant weights are dotted with. k: a multiple of QK_K (256).
GGML_BACKEND_API void speculant_quantize_row_q8_K(const float * x, void * y, int64_t k);

// The largest of x[0 .. n) (no NaN: ggml asserts none), as ggml_vec_max_f32 finds it but 16 (AVX-512) or 8
// (AVX2) lanes at once: a maximum does not depend on the order it is taken in, except for the sign of a zero
// maximum, which the softmax's exp(x - max) cannot see. ggml's loop is one dependent compare per score.
GGML_BACKEND_API float speculant_vec_max_f32(int n, const float * x);

// The fewest query columns of one K plane in a chunk that take the lanes kernel for dots of 64-256 values (16
// K rows in the lanes of a vector, transposed once for those columns; AVX-512), 0: never (the same bits either
// way). For A/B runs.
GGML_BACKEND_API void speculant_mm_set_lanes_min_cols(int64_t n);

// AMX (where the CPU has AMX-INT8 and Linux grants its tile state; SPECULANT_AMX=0: never): repacked Q4_K and Q6_K
// rows in passes of at least 8 tokens, and Q4_0, IQ4_NL and MXFP4 rows in passes of at least 6, go through tile
// products, with the same bits. speculant_mm_set_amx_min_cols: n for every type (0: the defaults), for A/B runs and
// tests. speculant_mm_amx: 1 where they are taken. speculant_mm_amx_test: nrows (a multiple of 16) plain rows of one
// of those types against ncols q8_K (32-value types: q8_0) columns, the AMX
// kernel's results and the VNNI kernel's, both [ncols][nrows]; -1 without AMX, -2 out of memory.
GGML_BACKEND_API void speculant_mm_set_amx_min_cols(int64_t n);
GGML_BACKEND_API int speculant_mm_amx(void);
GGML_BACKEND_API int speculant_mm_amx_test(int type, int n, int nrows, const void * x, const void * y, size_t row_size,
                                           int ncols, float * out_amx, float * out_ref);

// true where that kernel takes this attention product's scores: its chunks then span every query column (16 K
// rows each), so a transposition serves all the columns that read those rows
bool speculant_mm_f16_wide_chunks(const struct ggml_tensor * src0);

bool speculant_mm_f16_chunk(const struct ggml_tensor * dst, const void * wdata, size_t row_size, int64_t ir0_start,
                            int64_t ir0_end, int64_t ir1_start, int64_t ir1_end);

#ifdef __cplusplus
}
#endif
