// speculant: batch-invariant multi-token matmul kernels (see speculant-mm.h).
//
// Each kernel computes every output element with one fixed sequence of float operations, that of one of ggml's
// one-token kernels (ggml's AVX2 dot products for the plain layout: ggml_vec_dot_q4_K_q8_K, _q5_K_q8_K,
// _q6_K_q8_K, _q3_K_q8_K, _q2_K_q8_K, _iq4_xs_q8_K, _iq2_xxs_q8_K, _iq2_xs_q8_K, _iq2_s_q8_K, _iq3_xxs_q8_K,
// _iq3_s_q8_K, _iq1_s_q8_K, _iq1_m_q8_K, _q8_0_q8_0, _q5_0_q8_0, _q4_0_q8_0, _q4_1_q8_1, _q5_1_q8_1, _iq4_nl_q8_0, _mxfp4_q8_0, _tq2_0_q8_K; ggml_gemv_q4_K_8x8_q8_K,
// ggml_gemv_q4_0_8x8_q8_0, ggml_gemv_iq4_nl_8x8_q8_0 and ggml_gemv_mxfp4_8x8_q8_0 for the repacked layout), whatever the number of tokens
// in the pass. Only integer sums are shared between tokens (the weights are unpacked once for up to
// SPECULANT_MM_COLS of them; REPACKED_COLS, 8 with AVX-512, for repacked rows, Q3_K, Q5_K and IQ4_XS; IQ_GRID_COLS for the
// IQ1/IQ2/IQ3 types; every token of a pass for repacked Q4_K in AMX tile products), and integer sums are exact however
// they are formed (VNNI or not, 256 or 512 bits, AMX or not), so every ISA level gives the same bits.
//
// Attention products (F16 K, and V transposed, against the queries; flash attention stays off) keep ggml's own
// per-element operations (ggml_vec_dot_f16's) and only share work between the columns that read the same row:
// speculant_mm_f16_chunk, at the end.
#define GGML_COMMON_DECL_C
#define GGML_COMMON_IMPL_C  // the IQ1/IQ2/IQ3 grids
#include "ggml-common.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "simd-mappings.h"
#include "vec.h"  // ggml_float, for the attention products

#include "speculant-mm.h"

#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECULANT_MM_HAVE_KERNELS 1
#endif

#if defined(__AVX512F__)
// 16 x 16 transpose: r[i] lane c -> r[c] lane i
static inline void transpose16_ps(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + m], 128-bit lane k: column 4k + m of rows 4i .. 4i + 3
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int m = 0; m < 4; ++m) {
        t[m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
        t[4 + m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);
        t[8 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
        t[12 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
    }
    for (int m = 0; m < 4; ++m) {
        r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
        r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
        r[4 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xdd);
    }
}
#endif

static int64_t max_rows = -1;

int64_t speculant_mm_max_rows(void) {
    if (max_rows < 0) {
        const char * env = getenv("SPECULANT_INVARIANT_ROWS");
        max_rows = env ? atoll(env) : 64;
    }
    return max_rows;
}

void speculant_mm_set_max_rows(int64_t rows) {
    max_rows = rows;
}

// Software prefetch of the weight stream (and of the KV cache rows the attention products read), PREFETCH_AHEAD
// bytes ahead of the block a kernel reads. One core left to the hardware prefetchers streamed weights at a third of
// what it can read: a Q5_K row loop read 4.7 GB/s from DRAM where a plain read loop reads 15 (Sapphire Rapids);
// a Qwen 1.5B Q4_K_M one-token pass 46 -> 40 ms, Q5_K_M 63 -> 49. Prefetching changes no result.
// SPECULANT_PREFETCH=<bytes> sets the distance (0: off, for A/B runs).
#define PREFETCH_AHEAD 2048  // 1536-2560 read alike (Qwen 1.5B Q4_K_M and Q5_K_M, 0.5B Q4_0); 4096 slower
static int prefetch_ahead = PREFETCH_AHEAD;

// the cache lines `bytes` (>= 1) of a block cover, prefetch_ahead bytes further on (blocks under 64 bytes, read in
// order, need one line each: every line gets at least one)
static inline __attribute__((always_inline)) void prefetch_stream(const void * block, size_t bytes) {
    if (prefetch_ahead == 0) return;
    const char * p = (const char *) block + prefetch_ahead;
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);  // prefetcht0
}

// A second, farther prefetch into L2 only (prefetcht2), for the kernel that reads fastest: the repacked Q4_0 one,
// whose loop (AVX-512) waited on prefetcht0 with every L1 fill buffer taken. L2 requests go through L2's own, deeper
// queue. One-token passes, Sapphire Rapids: the 0.5B Q4_0 draft 14.2 -> 11.4-12.5 ms, Qwen 1.5B Q4_0 39-41 -> 35;
// 5 and 8 tokens unchanged. No gain for the other kernels (less memory-bound: Q4_K, Q6_K, Q5_K, Q3_K, IQ4_XS, Q4_1,
// Q5_0/Q8_0), nor for the AVX2 Q4_0 kernel on the same CPU, so the AVX2 builds leave it off by default; AMD CPUs
// were not measured. SPECULANT_PREFETCH_L2=<bytes> sets the distance (0: off), e.g. for scripts/prefetch_bench.py.
#if defined(__AVX512F__)
#define PREFETCH_L2_AHEAD 4096  // 4096-16384 read alike for the draft
#else
#define PREFETCH_L2_AHEAD 0
#endif
static int prefetch_l2_ahead = PREFETCH_L2_AHEAD;

// a distance in bytes from the environment (unset: `fallback`; <= 0: off), read once, at load
static int env_bytes(const char * name, int fallback) {
    const char * env = getenv(name);
    if (!env) return fallback;
    const int bytes = atoi(env);
    return bytes > 0 ? bytes : 0;
}

__attribute__((constructor)) static void prefetch_distances_from_env(void) {
    prefetch_ahead = env_bytes("SPECULANT_PREFETCH", PREFETCH_AHEAD);
    prefetch_l2_ahead = env_bytes("SPECULANT_PREFETCH_L2", PREFETCH_L2_AHEAD);
}

static inline __attribute__((always_inline)) void prefetch_stream_l2(const void * block, size_t bytes) {
    if (prefetch_ahead == 0 || prefetch_l2_ahead == 0) return;  // SPECULANT_PREFETCH=0 turns both off
    const char * p = (const char *) block + prefetch_l2_ahead;
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);  // prefetcht2
}

static int64_t chunk_rows_env = -1;  // SPECULANT_CHUNK_ROWS: fixed rows per chunk (0: the default split)

int64_t speculant_mm_chunk_rows(int64_t nrows, int nth, int64_t multiple) {
    if (chunk_rows_env < 0) {
        const char * env = getenv("SPECULANT_CHUNK_ROWS");
        chunk_rows_env = env ? atoll(env) : 0;
    }
    // A few long runs of rows per thread, as ggml splits its own matmuls: with 64-row chunks a 2-thread decode
    // pass of Qwen 1.5B claimed ~12000 chunks and took 10% longer on Zen 4 (the threads' streams interleave).
    const int64_t per_thread = 4;
    int64_t rows = chunk_rows_env > 0 ? chunk_rows_env : (nrows + per_thread * nth - 1) / (per_thread * nth);
    rows = (rows + multiple - 1) / multiple * multiple;
    return rows > 0 ? rows : multiple;
}

void speculant_mm_set_chunk_rows(int64_t rows) {
    chunk_rows_env = rows;
}

void speculant_mm_q6_Kx8_reorder(void * block) {
    enum { HEAD = 16 + 128, LOW = 1024, HIGH = 512 };  // d[8] and scales[128]; then ggml's low and high bits
    uint8_t * q = (uint8_t *) block + HEAD;
    uint8_t ggml_order[LOW + HIGH];
    memcpy(ggml_order, q, sizeof(ggml_order));
    for (int h = 0; h < 2; ++h) {
        for (int kk = 0; kk < 4; ++kk) {
            uint8_t * step = q + 192 * (4 * h + kk);
            memcpy(step, ggml_order + 64 * (8 * h + kk), 64);
            memcpy(step + 64, ggml_order + 64 * (8 * h + 4 + kk), 64);
            memcpy(step + 128, ggml_order + LOW + 64 * (4 * h + kk), 64);
        }
    }
}

bool speculant_mm_small_pass(const struct ggml_tensor * src0, const struct ggml_tensor * src1) {
    (void) src0;
    return src1->ne[1] * src1->ne[2] * src1->ne[3] <= speculant_mm_max_rows();
}

bool speculant_mm_few_tokens(const struct ggml_tensor * src1) {
    return src1->ne[1] <= speculant_mm_max_rows();
}

#ifdef SPECULANT_MM_HAVE_KERNELS

// per-call scratch kept on the stack up to this size (a pass calls the kernels once per chunk of rows)
#define SCRATCH_BYTES (48 * 1024)
// tokens per weight unpacking in the repacked kernels: their per-token state (3 registers) fits 8 tokens in
// AVX-512's 32 vector registers; AVX2's 16 hold 4
#if defined(__AVX512F__)
#define REPACKED_COLS 8
#else
#define REPACKED_COLS SPECULANT_MM_COLS
#endif

// exact either way; F16C converts in a register, where ggml's table costs a load from a 256 KB table per block
static inline float fp16_to_fp32(ggml_fp16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return GGML_CPU_FP16_TO_FP32(h);
#endif
}

// acc + d * (float) lanes, one fused multiply-add per lane: how every kernel here folds a block's int32 lanes in
static inline __m256 fma_lanes(float d, __m256i lanes, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc);
}

static inline float hsum8(const __m256 x) {
    __m128 r = _mm256_extractf128_ps(x, 1);
    r = _mm_add_ps(r, _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define Q0_UNSIGNED 1  // VNNI multiplies unsigned by signed bytes into int32 lanes, without saturation

// acc + (sum of u[4m + t] * y[4m + t], t < 4) in each int32 lane m (u unsigned bytes, y signed)
static inline __m256i q0_dpbusd(__m256i acc, __m256i u, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, y);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, y);
#endif
}

// acc + a[2m] * b[2m] + a[2m+1] * b[2m+1] in each int32 lane m (int16 a, b)
static inline __m256i vnni_dpwssd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#endif
}
#endif

// Q4_K / Q5_K's 12 bytes of 8 six-bit scales and 8 six-bit mins, unpacked to bytes: scales in u[0..1], mins in
// u[2..3] (as ggml's kernels unpack them)
static inline void k_scales_mins64(const uint8_t * packed, uint64_t * scales, uint64_t * mins) {
    uint32_t a, b, c;
    memcpy(&a, packed, 4);
    memcpy(&b, packed + 4, 4);
    memcpy(&c, packed + 8, 4);
    *scales = (a & 0x3f3f3f3f) | (uint64_t) ((c & 0x0f0f0f0f) | (((a >> 6) & 0x03030303) << 4)) << 32;
    *mins = (b & 0x3f3f3f3f) | (uint64_t) (((c >> 4) & 0x0f0f0f0f) | (((b >> 6) & 0x03030303) << 4)) << 32;
}

// The same as dwords: u[0..1] the scales, u[2..3] the mins. (The AMX kernel keeps the qwords in registers: loads of
// qwords stored as dwords stall on store forwarding.)
static inline void k_scales_mins(const uint8_t * packed, uint32_t u[4]) {
    uint64_t scales, mins;
    k_scales_mins64(packed, &scales, &mins);
    memcpy(u, &scales, 8);
    memcpy(u + 2, &mins, 8);
}

// The integers of Q4_K superblock x against NC columns' superblocks y[c] + i, as ggml's kernels form them: per
// column the 8 int32 lanes of the scaled products (sumi) and the 4 of the mins' products (mins_prod). Shared by
// dot_q4_K and q4_K_rep (which differ in their float steps only).
static inline __attribute__((always_inline)) void q4_K_isums(const int NC, const block_q4_K * x,
                                                            const block_q8_K * const * y, const int i,
                                                            __m256i * sumi, __m128i * mins_prod) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    // weights: 8 six-bit scales and 8 mins (K-quant packing), the same int16 vectors as ggml's
    uint32_t u[4];
    k_scales_mins(x->scales, u);
    const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
    const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
    const uint8_t * sc = (const uint8_t *) u;  // sc[0..7]: scales
    for (int c = 0; c < NC; ++c) {
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[c][i].bsums);
        const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
        mins_prod[c] = _mm_madd_epi16(mins, q8s);
        sumi[c] = _mm256_setzero_si256();
    }
    for (int j = 0; j < QK_K / 64; ++j) {
        const __m256i scale_l = _mm256_set1_epi16(sc[2 * j + 0]);
        const __m256i scale_h = _mm256_set1_epi16(sc[2 * j + 1]);
        const __m256i q4bits = _mm256_loadu_si256((const __m256i *) (x->qs + 32 * j));
        const __m256i q4l = _mm256_and_si256(q4bits, m4);
        const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
        for (int c = 0; c < NC; ++c) {
            const int8_t * q8 = y[c][i].qs + 64 * j;
            const __m256i p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, _mm256_loadu_si256((const __m256i *) q8)));
            const __m256i p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, _mm256_loadu_si256((const __m256i *) (q8 + 32))));
            sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(p16l, p16h));
        }
    }
}

// Q4_K x q8_K for NC columns. y[c] is column c's q8_K row. `order` lists the superblocks in the order they
// are summed (the identity, except in the test that proves a reordered sum is seen).
static inline __attribute__((always_inline)) void dot_q4_K(const int NC, const int nb, const block_q4_K * x,
                                                          const block_q8_K * const * y, const int * order,
                                                          float * out) {
    __m256 acc[SPECULANT_MM_COLS];
    __m128 acc_m[SPECULANT_MM_COLS];
    for (int c = 0; c < NC; ++c) { acc[c] = _mm256_setzero_ps(); acc_m[c] = _mm_setzero_ps(); }

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        const float xd = fp16_to_fp32(x[i].d);
        const float xdmin = fp16_to_fp32(x[i].dmin);
        __m256i sumi[SPECULANT_MM_COLS];
        __m128i mins_prod[SPECULANT_MM_COLS];
        q4_K_isums(NC, x + i, y, i, sumi, mins_prod);
        for (int c = 0; c < NC; ++c) {
            const float dmin = -y[c][i].d * xdmin;
            acc_m[c] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mins_prod[c]), acc_m[c]);
            const float d = y[c][i].d * xd;
            acc[c] = fma_lanes(d, sumi[c], acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) {
        __m128 m = acc_m[c];
        m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[c] = hsum8(acc[c]) + _mm_cvtss_f32(m);
    }
}

// Q5_K x q8_K for NC columns: dot_q4_K with each value's fifth bit from qh, and the mins' products summed as
// ggml_vec_dot_q5_K_q8_K sums them (an int32 total per superblock, times dmin, into a float added last). Up to 8
// columns where AVX-512's 32 registers hold them (a 5-token verify pass then unpacks each row once). With VNNI, a
// lane's 4 values x q8 by dpbusd, then times the scale by dpwssd (the scale in each lane's low 16 bits; 4 x 31 x 128
// fits 16 bits): the integers of ggml's maddubs and madd.
static inline __attribute__((always_inline)) void dot_q5_K(const int NC, const int nb, const block_q5_K * x,
                                                          const block_q8_K * const * y, const int * order,
                                                          float * out) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    __m256 acc[REPACKED_COLS];
    float summs[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) { acc[c] = _mm256_setzero_ps(); summs[c] = 0.0f; }

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        uint32_t u[4];  // 8 six-bit scales and 8 mins, as in dot_q4_K
        k_scales_mins(x[i].scales, u);
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
        const uint8_t * sc = (const uint8_t *) u;
        const float xd = fp16_to_fp32(x[i].d);
        const float xdmin = fp16_to_fp32(x[i].dmin);

        __m256i sumi[REPACKED_COLS];
        for (int c = 0; c < NC; ++c) {
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[c][i].bsums);
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            const __m128i prod = _mm_madd_epi16(mins, q8s);
            const __m128i total = _mm_hadd_epi32(_mm_hadd_epi32(prod, _mm_setzero_si128()), _mm_setzero_si128());
            const float dmin = -y[c][i].d * xdmin;
            summs[c] += dmin * _mm_extract_epi32(total, 0);  // ggml's scalar expression (and its contraction, if any)
            sumi[c] = _mm256_setzero_si256();
        }
        const uint8_t * q5 = x[i].qs;
        const __m256i hbits = _mm256_loadu_si256((const __m256i *) x[i].qh);  // bit b of byte l: value 32b + l
        for (int j = 0; j < QK_K / 64; ++j) {
#ifdef Q0_UNSIGNED  // in each int32 lane's low 16 bits
            const __m256i scale_l = _mm256_set1_epi32(sc[2 * j + 0]);
            const __m256i scale_h = _mm256_set1_epi32(sc[2 * j + 1]);
#else
            const __m256i scale_l = _mm256_set1_epi16(sc[2 * j + 0]);
            const __m256i scale_h = _mm256_set1_epi16(sc[2 * j + 1]);
#endif
            const __m256i q5bits = _mm256_loadu_si256((const __m256i *) (q5 + 32 * j));
            // the fifth bits 2j and 2j+1 moved to bit 4 of each byte
            const __m256i hl = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * j), 4), bit4);
            const __m256i hh = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * j + 1), 4), bit4);
            const __m256i q5l = _mm256_or_si256(_mm256_and_si256(q5bits, m4), hl);
            const __m256i q5h = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4), hh);
            for (int c = 0; c < NC; ++c) {
                const int8_t * q8 = y[c][i].qs + 64 * j;
#ifdef Q0_UNSIGNED
                const __m256i zero = _mm256_setzero_si256();
                sumi[c] = vnni_dpwssd(sumi[c], q0_dpbusd(zero, q5l, _mm256_loadu_si256((const __m256i *) q8)), scale_l);
                sumi[c] = vnni_dpwssd(sumi[c], q0_dpbusd(zero, q5h, _mm256_loadu_si256((const __m256i *) (q8 + 32))), scale_h);
#else
                const __m256i p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q5l, _mm256_loadu_si256((const __m256i *) q8)));
                const __m256i p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q5h, _mm256_loadu_si256((const __m256i *) (q8 + 32))));
                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(p16l, p16h));
#endif
            }
        }
        for (int c = 0; c < NC; ++c) {
            const float d = y[c][i].d * xd;
            acc[c] = fma_lanes(d, sumi[c], acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) out[c] = hsum8(acc[c]) + summs[c];
}

// the 16-bit scales 8j..8j+7 of a superblock's 16 (Q2_K, Q3_K), in both 128-bit lanes
static inline __m256i k_scales_half(__m256i all_scales, int j) {
    const __m128i half = j == 0 ? _mm256_castsi256_si128(all_scales) : _mm256_extracti128_si256(all_scales, 1);
    return _mm256_set_m128i(half, half);
}

// of 8 int16 scales in both 128-bit lanes (scales_j), the two of 32 values 32k..32k+31 (16 each) as int16 pairs:
// scale 2k in the low lane, 2k+1 in the high one (ggml's get_scale_shuffle_q3k)
static inline __m256i k_scale_pairs(__m256i scales_j, int k) {
    return _mm256_shuffle_epi8(scales_j, _mm256_set_epi8(
        4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2,
        4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2,
        4 * k + 1, 4 * k + 0, 4 * k + 1, 4 * k + 0, 4 * k + 1, 4 * k + 0, 4 * k + 1, 4 * k + 0,
        4 * k + 1, 4 * k + 0, 4 * k + 1, 4 * k + 0, 4 * k + 1, 4 * k + 0, 4 * k + 1, 4 * k + 0));
}

// Q2_K x q8_K for NC columns, in ggml_vec_dot_q2_K_q8_K's integer lanes: each value's two bits times q8, per 16
// values times their four-bit scale; and its float sequence: per superblock, the four-bit mins times q8_K's
// block sums fused in by -y.d * x.dmin, then the lanes by y.d * x.d.
static inline __attribute__((always_inline)) void dot_q2_K(const int NC, const int nb, const block_q2_K * x,
                                                          const block_q8_K * const * y, const int * order,
                                                          float * out) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc[SPECULANT_MM_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        const float xd = fp16_to_fp32(x[i].d);
        const float xdmin = fp16_to_fp32(x[i].dmin);
        const __m128i mins_and_scales = _mm_loadu_si128((const __m128i *) x[i].scales);  // scale low, min high
        const __m256i mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16(mins_and_scales, 4), m4));
        const __m256i all_scales = _mm256_cvtepi8_epi16(_mm_and_si128(mins_and_scales, m4));
        __m256i sumi[SPECULANT_MM_COLS];
        for (int c = 0; c < NC; ++c) {
            const __m256i prod = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *) y[c][i].bsums));
            acc[c] = fma_lanes(-y[c][i].d * xdmin, prod, acc[c]);
            sumi[c] = _mm256_setzero_si256();
        }
        for (int j = 0; j < QK_K / 128; ++j) {
            const __m256i scales_j = k_scales_half(all_scales, j);
            const __m256i q2bits = _mm256_loadu_si256((const __m256i *) (x[i].qs + 32 * j));
            for (int k = 0; k < 4; ++k) {
                const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(q2bits, 2 * k), m3);
                const __m256i scale = k_scale_pairs(scales_j, k);
                for (int c = 0; c < NC; ++c) {
                    const __m256i q8 = _mm256_loadu_si256((const __m256i *) (y[c][i].qs + 128 * j + 32 * k));
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(scale, _mm256_maddubs_epi16(q2, q8)));
                }
            }
        }
        for (int c = 0; c < NC; ++c) {
            acc[c] = fma_lanes(y[c][i].d * xd, sumi[c], acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) out[c] = hsum8(acc[c]);
}

// TQ2_0 (ternary, BitNet b1.58's) x q8_K for NC columns, as ggml_vec_dot_tq2_0_q8_K forms it: each value's two
// bits (0, 1, 2) times q8 in 16-bit lanes, the column's block sums taken off (the -1 of every value), lanes paired
// into 32 bits, then a float multiply and add (not fused in its source: the same expression here). The four
// shifted copies of a block's bits are made once for every column.
static inline __attribute__((always_inline)) void dot_tq2_0(const int NC, const int nb, const block_tq2_0 * x,
                                                           const block_q8_K * const * y, const int * order,
                                                           float * out) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[SPECULANT_MM_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        __m256i q[2][4];  // [32-byte half of qs][bits 2k, 2k+1 of each byte]
        for (int j = 0; j < 2; ++j) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *) (x[i].qs + 32 * j));
            for (int k = 0; k < 4; ++k) q[j][k] = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), m3);
        }
        const float xd = fp16_to_fp32(x[i].d);
        for (int c = 0; c < NC; ++c) {
            __m256i sumi0 = _mm256_setzero_si256(), sumi1 = _mm256_setzero_si256();  // 16-bit: 256 * 127 fits
            for (int j = 0; j < 2; ++j) {
                const int8_t * q8 = y[c][i].qs + 128 * j;
                __m256i p[4];
                for (int k = 0; k < 4; ++k) {
                    p[k] = _mm256_maddubs_epi16(q[j][k], _mm256_loadu_si256((const __m256i *) (q8 + 32 * k)));
                }
                sumi0 = _mm256_add_epi16(sumi0, _mm256_add_epi16(p[0], p[1]));
                sumi1 = _mm256_add_epi16(sumi1, _mm256_add_epi16(p[2], p[3]));
            }
            __m256i sumi = _mm256_sub_epi16(_mm256_add_epi16(sumi0, sumi1),
                                            _mm256_loadu_si256((const __m256i *) y[c][i].bsums));
            sumi = _mm256_madd_epi16(sumi, ones);
            const __m256 d = _mm256_set1_ps(y[c][i].d * xd);
            acc[c] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sumi), d), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) out[c] = hsum8(acc[c]);
}

// IQ4_XS's 16 non-linear 4-bit values (the format's table, as ggml's kvalues_iq4nl)
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IQ4_XS x q8_K for NC columns, in ggml_vec_dot_iq4_xs_q8_K's integer lanes: table values times q8 as its
// sign trick forms them (|w| times q8 with w's sign), per 32 values times their signed six-bit scale. Up to 8
// columns where AVX-512's 32 registers hold them.
static inline __attribute__((always_inline)) void dot_iq4_xs(const int NC, const int nb, const block_iq4_xs * x,
                                                            const block_q8_K * const * y, const int * order,
                                                            float * out) {
    const __m128i values128 = _mm_loadu_si128((const __m128i *) iq4_values);
    const __m128i m4b = _mm_set1_epi8(0x0f);
    __m256 acc[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        const float xd = fp16_to_fp32(x[i].d);
        __m256i sumi[REPACKED_COLS];
        for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
        for (int b = 0; b < QK_K / 32; ++b) {
            const __m128i q4bits = _mm_loadu_si128((const __m128i *) (x[i].qs + 16 * b));
            const __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(values128, _mm_and_si128(_mm_srli_epi16(q4bits, 4), m4b)),
                                               _mm_shuffle_epi8(values128, _mm_and_si128(q4bits, m4b)));
            const __m256i wabs = _mm256_sign_epi8(w, w);
            const int16_t ls = (int16_t) ((((x[i].scales_l[b / 2] >> (4 * (b % 2))) & 0xf)
                                           | (((x[i].scales_h >> (2 * b)) & 3) << 4)) - 32);
            const __m256i scale = _mm256_set1_epi16(ls);
            for (int c = 0; c < NC; ++c) {
                const __m256i q8 = _mm256_loadu_si256((const __m256i *) (y[c][i].qs + 32 * b));
                const __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(q8, w));
                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(p16, scale));
            }
        }
        for (int c = 0; c < NC; ++c) {
            const float d = xd * y[c][i].d;
            acc[c] = fma_lanes(d, sumi[c], acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) out[c] = hsum8(acc[c]);
}

// The IQ2 and IQ3 types: each 32 values are a row of bytes from the type's grid (unsigned), a sign per value,
// and a scale per 16 or 32 values. Unpacked into these once for all the columns of a pass, every type's
// one-token AVX2 kernel (ggml_vec_dot_iq2_xxs_q8_K, _iq2_xs_, _iq2_s_, _iq3_xxs_, _iq3_s_) forms the same
// integer lanes, summed over the superblock: scale * maddubs(grid, q8 with the signs applied), per 4 values.
typedef struct {
    __m256i grid;    // 32 unsigned grid values
    __m256i signs;   // +1 or -1 per value
    __m256i scales;  // 16 int16: the scale of each pair of products (2 * four-bit scale + 1)
} iq_grid32;

// 32 sign bits, bit k for value k, as +1 / -1 bytes
static inline __m256i iq_signs(uint32_t bits) {
    const __m256i byte_of_bit = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                  0x0101010101010101, 0x0000000000000000);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i set = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int) bits), byte_of_bit), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(set, bit), _mm256_set1_epi8(1));
}

// four groups of 7 sign bits (IQ2_XXS, IQ3_XXS, IQ2_XS), each completed by an eighth that makes its count of
// minus signs even, as +1 / -1 bytes (ggml-common's ksigns64: 0xff where minus)
static inline __m256i iq_even_signs(uint32_t g0, uint32_t g1, uint32_t g2, uint32_t g3) {
    return _mm256_or_si256(_mm256_set_epi64x(ksigns64[g3], ksigns64[g2], ksigns64[g1], ksigns64[g0]),
                           _mm256_set1_epi8(1));
}

static inline __m256i iq_scales32(int ls) {  // one four-bit scale for all 32 values
    return _mm256_set1_epi16((int16_t) (2 * ls + 1));
}

static inline __m256i iq_scales16(int ls_lo, int ls_hi) {  // values 0..15 and 16..31
    return _mm256_set_m128i(_mm_set1_epi16((int16_t) (2 * ls_hi + 1)), _mm_set1_epi16((int16_t) (2 * ls_lo + 1)));
}

// values 32b .. 32b+31 of an IQ2/IQ3 superblock
static inline __attribute__((always_inline)) iq_grid32 iq_unpack(const enum ggml_type type, const void * block, int b) {
    iq_grid32 w;
    if (type == GGML_TYPE_IQ2_XXS) {
        const block_iq2_xxs * x = block;
        uint32_t aux[2];  // four grid indices; four 7-bit sign groups and the scale in the top four bits
        memcpy(aux, x->qs + 4 * b, 8);
        const uint8_t * idx = (const uint8_t *) aux;
        w.grid = _mm256_set_epi64x(iq2xxs_grid[idx[3]], iq2xxs_grid[idx[2]], iq2xxs_grid[idx[1]], iq2xxs_grid[idx[0]]);
        w.signs = iq_even_signs(aux[1] & 127, (aux[1] >> 7) & 127, (aux[1] >> 14) & 127, (aux[1] >> 21) & 127);
        w.scales = iq_scales32(aux[1] >> 28);
    } else if (type == GGML_TYPE_IQ2_XS) {
        const block_iq2_xs * x = block;
        const uint16_t * q = x->qs + 4 * b;  // per 8 values: a 9-bit grid index, 7 sign bits
        w.grid = _mm256_set_epi64x(iq2xs_grid[q[3] & 511], iq2xs_grid[q[2] & 511], iq2xs_grid[q[1] & 511],
                                   iq2xs_grid[q[0] & 511]);
        w.signs = iq_even_signs(q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9);
        w.scales = iq_scales16(x->scales[b] & 15, x->scales[b] >> 4);
    } else if (type == GGML_TYPE_IQ2_S) {
        const block_iq2_s * x = block;
        const uint8_t * q = x->qs + 4 * b;  // per 8 values: 8 index bits here, 2 more in qh
        const int h = x->qh[b];
        w.grid = _mm256_set_epi64x(iq2s_grid[q[3] | ((h << 2) & 0x300)], iq2s_grid[q[2] | ((h << 4) & 0x300)],
                                   iq2s_grid[q[1] | ((h << 6) & 0x300)], iq2s_grid[q[0] | ((h << 8) & 0x300)]);
        uint32_t bits;
        memcpy(&bits, x->qs + QK_K / 8 + 4 * b, 4);
        w.signs = iq_signs(bits);
        w.scales = iq_scales16(x->scales[b] & 15, x->scales[b] >> 4);
    } else if (type == GGML_TYPE_IQ3_XXS) {
        const block_iq3_xxs * x = block;
        const uint8_t * q = x->qs + 8 * b;  // per 4 values a grid index
        w.grid = _mm256_set_epi32(iq3xxs_grid[q[7]], iq3xxs_grid[q[6]], iq3xxs_grid[q[5]], iq3xxs_grid[q[4]],
                                  iq3xxs_grid[q[3]], iq3xxs_grid[q[2]], iq3xxs_grid[q[1]], iq3xxs_grid[q[0]]);
        uint32_t aux;  // four 7-bit sign groups, the scale in the top four bits
        memcpy(&aux, x->qs + QK_K / 4 + 4 * b, 4);
        w.signs = iq_even_signs(aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127);
        w.scales = iq_scales32(aux >> 28);
    } else {  // IQ3_S
        const block_iq3_s * x = block;
        const uint8_t * q = x->qs + 8 * b;  // per 4 values 8 index bits here, the ninth in qh
        const int h = x->qh[b];
#define IQ3S_GRID(k) iq3s_grid[q[k] | ((h << (8 - (k))) & 256)]
        w.grid = _mm256_set_epi32(IQ3S_GRID(7), IQ3S_GRID(6), IQ3S_GRID(5), IQ3S_GRID(4), IQ3S_GRID(3), IQ3S_GRID(2),
                                  IQ3S_GRID(1), IQ3S_GRID(0));
#undef IQ3S_GRID
        uint32_t bits;
        memcpy(&bits, x->signs + 4 * b, 4);
        w.signs = iq_signs(bits);
        w.scales = iq_scales32((x->scales[b / 2] >> (4 * (b % 2))) & 15);
    }
    return w;
}

// columns per unpacking of IQ1/IQ2/IQ3 weights: their grid lookups cost several times the products, so every
// column of a verify pass shares them
#define IQ_GRID_COLS 16

static bool iq1_type(enum ggml_type type) {
    return type == GGML_TYPE_IQ1_S || type == GGML_TYPE_IQ1_M;
}

static bool iq_grid_type(enum ggml_type type) {
    return type == GGML_TYPE_IQ2_XXS || type == GGML_TYPE_IQ2_XS || type == GGML_TYPE_IQ2_S || type == GGML_TYPE_IQ3_XXS
        || type == GGML_TYPE_IQ3_S || iq1_type(type);
}

// IQ1_S and IQ1_M: each 8 values a row of -1 / 0 / +1 from iq1s_grid (an 11-bit index) and a shift of all 8 by
// plus or minus the type's delta; a three-bit scale per 32 (IQ1_S) or 16 (IQ1_M) values; a scale per superblock
// (IQ1_S: d; IQ1_M: an fp16 spread over the top nibbles of its scales). ggml's AVX2 kernels
// (ggml_vec_dot_iq1_s_q8_K, _iq1_m_) sum scale * maddubs(|grid|, q8 with grid's signs) per 4 values in integer
// lanes; the shifts, IQ1_S's from the q8 block sums in a scalar, IQ1_M's per 4 values in lanes of their own.
typedef struct {
    __m256i magnitude;  // |grid|: 0 or 1 per value
    __m256i grid;       // -1, 0 or +1 per value (the signs applied to q8)
    __m256i scales;     // 16 int16: the scale of each pair of products (2 * three-bit scale + 1)
    __m256i shift_scales;  // IQ1_M: the scales times the shift's sign (one per 8 values)
} iq1_32;

// values 32b .. 32b+31 of an IQ1_S or IQ1_M superblock
// IQ1_M's 16 three-bit scales of a superblock as 2 * s + 1, int16 lane 4k + j holding scales[j] >> (0, 6, 3, 9)[k]:
// values 32b .. 32b+15 take lane b / 2 + 4 (b % 2), values 32b+16 .. 32b+31 lane 8 + b / 2 + 4 (b % 2)
static inline __m256i iq1_m_scales(const block_iq1_m * x) {
    uint64_t sc;
    memcpy(&sc, x->scales, 8);
    const __m256i s = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((int64_t) sc), _mm256_set_epi64x(9, 3, 6, 0)),
                                       _mm256_set1_epi16(7));
    return _mm256_add_epi16(_mm256_slli_epi16(s, 1), _mm256_set1_epi16(1));
}

// values 32b .. 32b+31 of an IQ1_S or IQ1_M superblock (IQ1_M: its scales from iq1_m_scales)
static inline __attribute__((always_inline)) iq1_32 iq1_unpack(const enum ggml_type type, const void * block, int b,
                                                              const __m256i m_scales) {
    iq1_32 w;
    if (type == GGML_TYPE_IQ1_S) {
        const block_iq1_s * x = block;
        const uint8_t * q = x->qs + 4 * b;  // per 8 values 8 index bits here, 3 more in qh, 3 bits each
        const int h = x->qh[b];  // bits 0-11 the index bits, 12-14 the scale, 15 the shift's sign
        w.grid = _mm256_set_epi64x(iq1s_grid[q[3] | ((h >> 1) & 0x700)], iq1s_grid[q[2] | ((h << 2) & 0x700)],
                                   iq1s_grid[q[1] | ((h << 5) & 0x700)], iq1s_grid[q[0] | ((h << 8) & 0x700)]);
        w.scales = iq_scales32((h >> 12) & 7);
        w.shift_scales = _mm256_setzero_si256();  // IQ1_S's shifts: iq1_s_shifts, once per superblock
    } else {
        const block_iq1_m * x = block;
        const uint8_t * q = x->qs + 4 * b;
        const uint8_t * h = x->qh + 2 * b;
        uint16_t hh;  // per 8 values a nibble: 3 index bits and the shift's sign (bits 3, 7, 11, 15)
        memcpy(&hh, h, 2);
        w.grid = _mm256_set_epi64x(iq1s_grid[q[3] | (((uint16_t) h[1] << 4) & 0x700)],
                                   iq1s_grid[q[2] | (((uint16_t) h[1] << 8) & 0x700)],
                                   iq1s_grid[q[1] | (((uint16_t) h[0] << 4) & 0x700)],
                                   iq1s_grid[q[0] | (((uint16_t) h[0] << 8) & 0x700)]);
        const int lane = b / 2 + 4 * (b % 2);  // in each 128-bit half: its int16 lane, spread to all 8
        w.scales = _mm256_shuffle_epi8(m_scales, _mm256_set1_epi16((int16_t) (2 * lane | (2 * lane + 1) << 8)));
        const __m256i bit = _mm256_set_epi64x(0x8000800080008000, 0x0800080008000800, 0x0080008000800080,
                                              0x0008000800080008);
        const __m256i minus = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((int16_t) hh), bit), bit);
        w.shift_scales = _mm256_sign_epi16(w.scales, _mm256_or_si256(minus, _mm256_set1_epi16(1)));
    }
    w.magnitude = _mm256_sign_epi8(w.grid, w.grid);
    return w;
}

// IQ1_S's shift signs times scales, per 32 values, each twice: 16 int16 to madd with the q8 block sums
// (one per 16 values), so the sum of a superblock's shifts is one product and a sum per column
static inline __m256i iq1_s_shifts(const block_iq1_s * x) {
    const __m128i h = _mm_loadu_si128((const __m128i *) x->qh);
    const __m128i ls = _mm_add_epi16(_mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 12), _mm_set1_epi16(7)), 1),
                                     _mm_set1_epi16(1));
    const __m128i minus = _mm_srai_epi16(h, 15);  // 0xffff where bit 15 is set
    const __m128i s = _mm_sub_epi16(_mm_xor_si128(ls, minus), minus);
    return _mm256_set_m128i(_mm_unpackhi_epi16(s, s), _mm_unpacklo_epi16(s, s));
}

static inline int hsum_epi32(const __m256i x) {
    __m128i r = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
    r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 1));
    return _mm_cvtsi128_si32(r);
}

static inline float iq1_m_scale(const block_iq1_m * x) {
    uint16_t sc[4];
    memcpy(sc, x->scales, 8);
    const uint16_t bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
    return fp16_to_fp32((ggml_fp16_t) bits);
}

// IQ1_S, IQ1_M x q8_K for NC <= IQ_GRID_COLS columns, in ggml's float sequence: per superblock the lanes (and
// IQ1_M's shift lanes) fused in by scale * y.d, IQ1_S's shift sum added as a scalar; the shift sums times the
// delta added to the lanes' sum at the end.
static inline __attribute__((always_inline)) void dot_iq1(const int NC, const enum ggml_type type, const int nb,
                                                         const void * vx, const block_q8_K * const * y,
                                                         const int * order, float * out) {
    const size_t block_bytes = ggml_type_size(type);
    const __m256i ones = _mm256_set1_epi8(1);
    __m256 acc[IQ_GRID_COLS], acc_shift[IQ_GRID_COLS];
    float acc_shift1[IQ_GRID_COLS];
    for (int c = 0; c < NC; ++c) {
        acc[c] = acc_shift[c] = _mm256_setzero_ps();
        acc_shift1[c] = 0.0f;
    }
    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        const void * xb = (const char *) vx + i * block_bytes;
        prefetch_stream(xb, block_bytes);
        __m256i sumi[IQ_GRID_COLS], sumi_shift[IQ_GRID_COLS];
        int sumi_shift1[IQ_GRID_COLS];
        const __m256i m_scales = type == GGML_TYPE_IQ1_M ? iq1_m_scales(xb) : _mm256_setzero_si256();
        for (int c = 0; c < NC; ++c) {
            sumi[c] = sumi_shift[c] = _mm256_setzero_si256();
            sumi_shift1[c] = 0;
        }
        for (int b = 0; b < QK_K / 32; ++b) {
            const iq1_32 w = iq1_unpack(type, xb, b, m_scales);
            for (int c = 0; c < NC; ++c) {
                const __m256i q8 = _mm256_loadu_si256((const __m256i *) (y[c][i].qs + 32 * b));
                const __m256i p16 = _mm256_maddubs_epi16(w.magnitude, _mm256_sign_epi8(q8, w.grid));
                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(p16, w.scales));
                if (type == GGML_TYPE_IQ1_M) {  // the shift's sign goes with the scale: the same integers
                    const __m256i pairs = _mm256_maddubs_epi16(ones, q8);
                    sumi_shift[c] = _mm256_add_epi32(sumi_shift[c], _mm256_madd_epi16(pairs, w.shift_scales));
                }
            }
        }
        if (type == GGML_TYPE_IQ1_S) {
            const __m256i shifts = iq1_s_shifts(xb);
            const float xd = fp16_to_fp32(((const block_iq1_s *) xb)->d);
            for (int c = 0; c < NC; ++c) {
                // the integer ggml sums per 32 values in a scalar, from the q8 block sums
                const __m256i bsums = _mm256_loadu_si256((const __m256i *) y[c][i].bsums);
                sumi_shift1[c] = hsum_epi32(_mm256_madd_epi16(bsums, shifts));
                const float d = y[c][i].d * xd;
                acc[c] = fma_lanes(d, sumi[c], acc[c]);
                acc_shift1[c] += d * sumi_shift1[c];
            }
        } else {
            const float xd = iq1_m_scale(xb);
            for (int c = 0; c < NC; ++c) {
                const float d = y[c][i].d * xd;
                acc[c] = fma_lanes(d, sumi[c], acc[c]);
                acc_shift[c] = fma_lanes(d, sumi_shift[c], acc_shift[c]);
            }
        }
    }
    for (int c = 0; c < NC; ++c) {
        out[c] = type == GGML_TYPE_IQ1_S ? hsum8(acc[c]) + IQ1S_DELTA * acc_shift1[c]
                                         : hsum8(acc[c]) + IQ1M_DELTA * hsum8(acc_shift[c]);
    }
}

// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S x q8_K for NC <= IQ_GRID_COLS columns (a constant up to 4: their sums
// in registers); the float sequence of ggml's kernels: per superblock the lanes fused in by x.d * y.d, the
// lanes' sum times the type's constant at the end.
static inline __attribute__((always_inline)) void dot_iq_grid(const int NC, const enum ggml_type type, const int nb,
                                                             const void * vx, const block_q8_K * const * y,
                                                             const int * order, float * out) {
    const size_t block_bytes = ggml_type_size(type);
    __m256 acc[IQ_GRID_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        const void * xb = (const char *) vx + i * block_bytes;
        prefetch_stream(xb, block_bytes);
        __m256i sumi[IQ_GRID_COLS];
        for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
        for (int b = 0; b < QK_K / 32; ++b) {
            const iq_grid32 w = iq_unpack(type, xb, b);
            for (int c = 0; c < NC; ++c) {
                const __m256i q8 = _mm256_loadu_si256((const __m256i *) (y[c][i].qs + 32 * b));
                const __m256i p16 = _mm256_maddubs_epi16(w.grid, _mm256_sign_epi8(q8, w.signs));
                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(p16, w.scales));
            }
        }
        const float xd = fp16_to_fp32(*(const ggml_fp16_t *) xb);  // every one of these blocks starts with d
        for (int c = 0; c < NC; ++c) {
            acc[c] = fma_lanes(xd * y[c][i].d, sumi[c], acc[c]);
        }
    }
    const float factor = type == GGML_TYPE_IQ3_XXS ? 0.25f : type == GGML_TYPE_IQ3_S ? 1.0f : 0.125f;
    for (int c = 0; c < NC; ++c) out[c] = factor * hsum8(acc[c]);
}

#define IQ_GRID_BY_NC(type, nc, ...)                                     \
    switch (nc) {                                                        \
        case 1: dot_iq_grid(1, type, __VA_ARGS__); break;                \
        case 2: dot_iq_grid(2, type, __VA_ARGS__); break;                \
        case 3: dot_iq_grid(3, type, __VA_ARGS__); break;                \
        case 4: dot_iq_grid(4, type, __VA_ARGS__); break;                \
        default: dot_iq_grid(nc, type, __VA_ARGS__); break;              \
    }

#define IQ1_BY_NC(type, nc, ...)                                         \
    switch (nc) {                                                        \
        case 1: dot_iq1(1, type, __VA_ARGS__); break;                    \
        case 2: dot_iq1(2, type, __VA_ARGS__); break;                    \
        case 3: dot_iq1(3, type, __VA_ARGS__); break;                    \
        case 4: dot_iq1(4, type, __VA_ARGS__); break;                    \
        default: dot_iq1(nc, type, __VA_ARGS__); break;                  \
    }

// IQ1_M's two sums per column fit registers for 4 columns at a time, and only then pay (8 columns unpacked once
// cost more than twice 4 in a C loop: the sums go through memory)
static void iq1_m_cols(int nc, int nb, const void * xrow, const block_q8_K * const * y, const int * order,
                       float * out) {
    for (int c = 0; c < nc; c += 4) {
        const int n4 = nc - c < 4 ? nc - c : 4;
        switch (n4) {
            case 1: dot_iq1(1, GGML_TYPE_IQ1_M, nb, xrow, y + c, order, out + c); break;
            case 2: dot_iq1(2, GGML_TYPE_IQ1_M, nb, xrow, y + c, order, out + c); break;
            case 3: dot_iq1(3, GGML_TYPE_IQ1_M, nb, xrow, y + c, order, out + c); break;
            default: dot_iq1(4, GGML_TYPE_IQ1_M, nb, xrow, y + c, order, out + c); break;
        }
    }
}

// one IQ1/IQ2/IQ3 weight row against ncols q8_K columns, `group` (<= IQ_GRID_COLS) columns per weight unpacking
static void iq_grid_row(enum ggml_type type, int n, const void * xrow, const char * ycols, size_t row_size,
                        int ncols, int group, const int * order, float * out) {
    const int nb = n / QK_K;
    for (int c0 = 0; c0 < ncols; c0 += group) {
        const int nc = ncols - c0 < group ? ncols - c0 : group;
        const block_q8_K * y[IQ_GRID_COLS];
        for (int c = 0; c < nc; ++c) y[c] = (const block_q8_K *) (ycols + (size_t) (c0 + c) * row_size);
        switch (type) {
            case GGML_TYPE_IQ2_XXS: IQ_GRID_BY_NC(GGML_TYPE_IQ2_XXS, nc, nb, xrow, y, order, out + c0); break;
            case GGML_TYPE_IQ2_XS:  IQ_GRID_BY_NC(GGML_TYPE_IQ2_XS, nc, nb, xrow, y, order, out + c0); break;
            case GGML_TYPE_IQ2_S:   IQ_GRID_BY_NC(GGML_TYPE_IQ2_S, nc, nb, xrow, y, order, out + c0); break;
            case GGML_TYPE_IQ3_XXS: IQ_GRID_BY_NC(GGML_TYPE_IQ3_XXS, nc, nb, xrow, y, order, out + c0); break;
            case GGML_TYPE_IQ1_S:   IQ1_BY_NC(GGML_TYPE_IQ1_S, nc, nb, xrow, y, order, out + c0); break;
            case GGML_TYPE_IQ1_M:   iq1_m_cols(nc, nb, xrow, y, order, out + c0); break;
            default:                IQ_GRID_BY_NC(GGML_TYPE_IQ3_S, nc, nb, xrow, y, order, out + c0); break;
        }
    }
}

// Q6_K values 128j .. 128j+127 of a block, as unsigned bytes 0..63: q6[k] holds values 128j + 32k .. + 31
static inline __attribute__((always_inline)) void q6_K_values(const block_q6_K * x, int j, __m256i q6[4]) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    const __m256i bits1 = _mm256_loadu_si256((const __m256i *) (x->ql + 64 * j));
    const __m256i bits2 = _mm256_loadu_si256((const __m256i *) (x->ql + 64 * j + 32));
    const __m256i bitsH = _mm256_loadu_si256((const __m256i *) (x->qh + 32 * j));
    q6[0] = _mm256_or_si256(_mm256_and_si256(bits1, m15), _mm256_slli_epi16(_mm256_and_si256(bitsH, m3), 4));
    q6[1] = _mm256_or_si256(_mm256_and_si256(bits2, m15), _mm256_slli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(12)), 2));
    q6[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m15), _mm256_and_si256(bitsH, _mm256_set1_epi8(48)));
    q6[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m15),
                            _mm256_srli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(-64)), 2));
}

// The integers of Q6_K superblock x against NC columns' superblocks y[c] + i, as ggml's kernels form them: per
// column 8 int32 lanes, the -32 offset of every 6-bit value folded in (see q4_K_isums).
static inline __attribute__((always_inline)) void q6_K_isums(const int NC, const block_q6_K * x,
                                                            const block_q8_K * const * y, const int i, __m256i * sumi) {
    const __m256i scales_16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x->scales));
    for (int c = 0; c < NC; ++c) {
        // the -32 offset of every 6-bit value, per pair of 16-value groups
        const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[c][i].bsums);
        sumi[c] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5));
    }
    for (int j = 0; j < QK_K / 128; ++j) {
        __m256i q6[4];
        q6_K_values(x, j, q6);
        __m256i scale[4];
        for (int k = 0; k < 4; ++k) {
            const int m = 4 * j + k;  // 32 values: groups 2m (low 16) and 2m+1 (high 16)
            scale[k] = _mm256_set_m128i(_mm_set1_epi16(x->scales[2 * m + 1]), _mm_set1_epi16(x->scales[2 * m]));
        }
        for (int c = 0; c < NC; ++c) {
            const int8_t * q8 = y[c][i].qs + 128 * j;
            __m256i s = sumi[c];
            for (int k = 0; k < 4; ++k) {
                const __m256i p16 = _mm256_maddubs_epi16(q6[k], _mm256_loadu_si256((const __m256i *) (q8 + 32 * k)));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(scale[k], p16));
            }
            sumi[c] = s;
        }
    }
}

// Q6_K x q8_K for NC columns (see dot_q4_K).
static inline __attribute__((always_inline)) void dot_q6_K(const int NC, const int nb, const block_q6_K * x,
                                                          const block_q8_K * const * y, const int * order,
                                                          float * out) {
    __m256 acc[SPECULANT_MM_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        const float xd = fp16_to_fp32(x[i].d);
        __m256i sumi[SPECULANT_MM_COLS];
        q6_K_isums(NC, x + i, y, i, sumi);
        for (int c = 0; c < NC; ++c) {
            const float d = y[c][i].d * xd;
            acc[c] = fma_lanes(d, sumi[c], acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) out[c] = hsum8(acc[c]);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX-512: two columns per 512-bit register (column 2p in the low half, 2p+1 in the high half). The integer
// lane sums of each half are those of the 256-bit kernels above, and the float part is the same per column,
// so these give the very bits dot_q4_K / dot_q6_K give (and every ISA level gives the same logits).
#define SPECULANT_MM_HAVE_512 1

static inline __m512i pair_load(const void * lo, const void * hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) lo)),
                              _mm256_loadu_si256((const __m256i *) hi), 1);
}

static inline __m512i both_halves(__m256i v) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
}

static inline __attribute__((always_inline)) void dot_q4_K_pairs(const int NP, const int nb, const block_q4_K * x,
                                                                const block_q8_K * const * y, const int * order,
                                                                float * out) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    __m256 acc[SPECULANT_MM_COLS];
    __m128 acc_m[SPECULANT_MM_COLS];
    for (int c = 0; c < 2 * NP; ++c) { acc[c] = _mm256_setzero_ps(); acc_m[c] = _mm_setzero_ps(); }

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        uint32_t u[4];
        k_scales_mins(x[i].scales, u);
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
        const uint8_t * sc = (const uint8_t *) u;
        const float xd = fp16_to_fp32(x[i].d);
        const float xdmin = fp16_to_fp32(x[i].dmin);

        for (int c = 0; c < 2 * NP; ++c) {
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[c][i].bsums);
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            const __m128i prod = _mm_madd_epi16(mins, q8s);
            const float dmin = -y[c][i].d * xdmin;
            acc_m[c] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[c]);
        }
        __m512i sumi[SPECULANT_MM_COLS / 2];
        for (int p = 0; p < NP; ++p) sumi[p] = _mm512_setzero_si512();
        const uint8_t * q4 = x[i].qs;
        for (int j = 0; j < QK_K / 64; ++j) {
            const __m512i scale_l = _mm512_set1_epi16(sc[2 * j + 0]);
            const __m512i scale_h = _mm512_set1_epi16(sc[2 * j + 1]);
            const __m512i q4bits = both_halves(_mm256_loadu_si256((const __m256i *) (q4 + 32 * j)));
            const __m512i q4l = _mm512_and_si512(q4bits, m4);
            const __m512i q4h = _mm512_and_si512(_mm512_srli_epi16(q4bits, 4), m4);
            for (int p = 0; p < NP; ++p) {
                const int8_t * a = y[2 * p][i].qs + 64 * j;
                const int8_t * b = y[2 * p + 1][i].qs + 64 * j;
                const __m512i p16l = _mm512_madd_epi16(scale_l, _mm512_maddubs_epi16(q4l, pair_load(a, b)));
                const __m512i p16h = _mm512_madd_epi16(scale_h, _mm512_maddubs_epi16(q4h, pair_load(a + 32, b + 32)));
                sumi[p] = _mm512_add_epi32(sumi[p], _mm512_add_epi32(p16l, p16h));
            }
        }
        for (int p = 0; p < NP; ++p) {
            const float d0 = y[2 * p][i].d * xd;
            const float d1 = y[2 * p + 1][i].d * xd;
            acc[2 * p] = fma_lanes(d0, _mm512_castsi512_si256(sumi[p]), acc[2 * p]);
            acc[2 * p + 1] = fma_lanes(d1, _mm512_extracti64x4_epi64(sumi[p], 1), acc[2 * p + 1]);
        }
    }
    for (int c = 0; c < 2 * NP; ++c) {
        __m128 m = acc_m[c];
        m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[c] = hsum8(acc[c]) + _mm_cvtss_f32(m);
    }
}

static inline __attribute__((always_inline)) void dot_q6_K_pairs(const int NP, const int nb, const block_q6_K * x,
                                                                const block_q8_K * const * y, const int * order,
                                                                float * out) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256 acc[SPECULANT_MM_COLS];
    for (int c = 0; c < 2 * NP; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        const float xd = fp16_to_fp32(x[i].d);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x[i].scales));
        __m512i sumi[SPECULANT_MM_COLS / 2];
        for (int p = 0; p < NP; ++p) {
            __m256i off[2];
            for (int h = 0; h < 2; ++h) {
                const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[2 * p + h][i].bsums);
                off[h] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5));
            }
            sumi[p] = _mm512_inserti64x4(_mm512_castsi256_si512(off[0]), off[1], 1);
        }
        const uint8_t * ql = x[i].ql;
        const uint8_t * qh = x[i].qh;
        for (int j = 0; j < QK_K / 128; ++j) {
            const __m256i bits1 = _mm256_loadu_si256((const __m256i *) (ql + 64 * j));
            const __m256i bits2 = _mm256_loadu_si256((const __m256i *) (ql + 64 * j + 32));
            const __m256i bitsH = _mm256_loadu_si256((const __m256i *) (qh + 32 * j));
            __m512i q6[4];
            q6[0] = both_halves(_mm256_or_si256(_mm256_and_si256(bits1, m15), _mm256_slli_epi16(_mm256_and_si256(bitsH, m3), 4)));
            q6[1] = both_halves(_mm256_or_si256(_mm256_and_si256(bits2, m15), _mm256_slli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(12)), 2)));
            q6[2] = both_halves(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m15), _mm256_and_si256(bitsH, _mm256_set1_epi8(48))));
            q6[3] = both_halves(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m15),
                                                _mm256_srli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(-64)), 2)));
            __m512i scale[4];
            for (int k = 0; k < 4; ++k) {
                const int m = 4 * j + k;
                scale[k] = both_halves(_mm256_set_m128i(_mm_set1_epi16(x[i].scales[2 * m + 1]), _mm_set1_epi16(x[i].scales[2 * m])));
            }
            for (int p = 0; p < NP; ++p) {
                const int8_t * a = y[2 * p][i].qs + 128 * j;
                const int8_t * b = y[2 * p + 1][i].qs + 128 * j;
                __m512i s = sumi[p];
                for (int k = 0; k < 4; ++k) {
                    const __m512i p16 = _mm512_maddubs_epi16(q6[k], pair_load(a + 32 * k, b + 32 * k));
                    s = _mm512_add_epi32(s, _mm512_madd_epi16(scale[k], p16));
                }
                sumi[p] = s;
            }
        }
        for (int p = 0; p < NP; ++p) {
            const float d0 = y[2 * p][i].d * xd;
            const float d1 = y[2 * p + 1][i].d * xd;
            acc[2 * p] = fma_lanes(d0, _mm512_castsi512_si256(sumi[p]), acc[2 * p]);
            acc[2 * p + 1] = fma_lanes(d1, _mm512_extracti64x4_epi64(sumi[p], 1), acc[2 * p + 1]);
        }
    }
    for (int c = 0; c < 2 * NP; ++c) out[c] = hsum8(acc[c]);
}
#endif

// -- Q4_K repacked by ggml (block_q4_Kx8: 8 rows interleaved 8 bytes at a time) ------------------------------
//
// Decode and verify passes on a target loaded with repacking (llama.cpp's default, and its fastest layout on x86).
// Per output element and superblock the float operations are those of ggml_gemv_q4_K_8x8_q8_K, ggml's one-token
// kernel for this layout: the superblock's integer sum and min sum, each converted to float and added with one
// fused multiply-add, times x.d * y.d and x.dmin * y.d, into two accumulators; their difference at the end.
// The integer sums are exact, so how they are formed (VNNI or not, how many tokens share the unpacked weights)
// cannot change a bit.

typedef struct {
    ggml_half d[8];
    ggml_half dmin[8];
    uint8_t scales[96];  // per sub-block j, 12 bytes: the 6-bit scales and mins of the 8 rows (K-quant packing)
    uint8_t qs[1024];    // 8-byte chunk k (of 128) holds bytes 8(k/8)..+7 of row k%8
} q4_Kx8;

_Static_assert(sizeof(q4_Kx8) == 8 * sizeof(block_q4_K), "block_q4_Kx8 layout");

// the 8 scales (bytes 0..7, row order) and 8 mins (bytes 8..15) of sub-block j of a q4_Kx8 block
static inline void q4_Kx8_scales(const q4_Kx8 * x, int j, uint32_t u[4]) {
    k_scales_mins(x->scales + 12 * j, u);
}

static inline int64_t load64(const int8_t * p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

#if defined(SPECULANT_MM_HAVE_512)
// 16 int32 lanes: row r's bytes 0-3 of a chunk in lane 2r, bytes 4-7 in lane 2r+1
#if defined(__AVX512VNNI__)
#define Q4KX8_VNNI 1
#endif

static inline __attribute__((always_inline)) void q4_Kx8_cols(const int NC, const int nb, const q4_Kx8 * x,
                                                             const block_q8_K * const * y, const int * order,
                                                             float * const * out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m128i dup2 = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
#ifndef Q4KX8_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    __m256 acc[REPACKED_COLS], acc_min[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) { acc[c] = _mm256_setzero_ps(); acc_min[c] = _mm256_setzero_ps(); }

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, offsetof(q4_Kx8, qs));
        const q4_Kx8 * xb = x + i;
        uint32_t u[8][4];
        for (int j = 0; j < 8; ++j) q4_Kx8_scales(xb, j, u[j]);

        __m512i isum[REPACKED_COLS];
        for (int c = 0; c < NC; ++c) isum[c] = _mm512_setzero_si512();
        for (int sb = 0; sb < 4; ++sb) {  // 64 values: sub-block 2sb in the low nibbles, 2sb+1 in the high ones
            prefetch_stream(xb->qs + 256 * sb, 256);
            __m512i raw[4];
            for (int k = 0; k < 4; ++k) raw[k] = _mm512_loadu_si512((const void *) (xb->qs + 256 * sb + 64 * k));
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * sb + h;
                __m512i w[4];
                for (int k = 0; k < 4; ++k) w[k] = _mm512_and_si512(h ? _mm512_srli_epi16(raw[k], 4) : raw[k], m4);
                // each lane's row scale, as an int32 (high int16 zero): madd of an int16 sum by it is a product
                const __m512i scale = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *) u[j]), dup2));
                for (int c = 0; c < NC; ++c) {
                    const int8_t * q8 = y[c][i].qs + 64 * sb + 32 * h;
                    __m512i s = _mm512_setzero_si512();
                    for (int k = 0; k < 4; ++k) {  // |s| <= 16 * 15 * 128 < 2^15 per lane
                        const __m512i a = _mm512_set1_epi64(load64(q8 + 8 * k));
#ifdef Q4KX8_VNNI
                        s = _mm512_dpbusd_epi32(s, w[k], a);
#else
                        s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(w[k], a), ones));
#endif
                    }
#ifdef Q4KX8_VNNI
                    isum[c] = _mm512_dpwssd_epi32(isum[c], s, scale);
#else
                    isum[c] = _mm512_add_epi32(isum[c], _mm512_madd_epi16(s, scale));
#endif
                }
            }
        }
        const __m256 xd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->d));
        const __m256 xdmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->dmin));
        __m256i mins[4];  // sub-blocks 2q and 2q+1: the int16 pairs (min_2q, min_2q+1) of each row
        for (int q = 0; q < 4; ++q) {
            mins[q] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) &u[2 * q][2]),
                                                             _mm_loadl_epi64((const __m128i *) &u[2 * q + 1][2])));
        }
        for (int c = 0; c < NC; ++c) {
            const __m128i bsums = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *) y[c][i].bsums),
                                                 _mm_loadu_si128((const __m128i *) (y[c][i].bsums + 8)));
            __m256i imin = _mm256_setzero_si256();
            for (int q = 0; q < 4; ++q) {
                imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mins[q], _mm256_set1_epi32(_mm_extract_epi32(bsums, q))));
            }
            // lanes 2r and 2r+1 -> row r
            const __m256i irow = _mm512_cvtepi64_epi32(_mm512_add_epi32(isum[c], _mm512_srli_epi64(isum[c], 32)));
            const __m256 yd = _mm256_set1_ps(y[c][i].d);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(irow), _mm256_mul_ps(xd, yd), acc[c]);
            acc_min[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(xdmin, yd), acc_min[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], _mm256_sub_ps(acc[c], acc_min[c]));
}

#else  // AVX2: rows 0-3 and 4-7 of a chunk in two 256-bit halves, int16 pair sums then madd by the scales

static inline __attribute__((always_inline)) void q4_Kx8_cols(const int NC, const int nb, const q4_Kx8 * x,
                                                             const block_q8_K * const * y, const int * order,
                                                             float * const * out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m128i dup4 = _mm_set_epi8(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m256i row_order = _mm256_set_epi32(7, 6, 3, 2, 5, 4, 1, 0);
    __m256 acc[REPACKED_COLS], acc_min[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) { acc[c] = _mm256_setzero_ps(); acc_min[c] = _mm256_setzero_ps(); }

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, offsetof(q4_Kx8, qs));
        const q4_Kx8 * xb = x + i;
        uint32_t u[8][4];
        for (int j = 0; j < 8; ++j) q4_Kx8_scales(xb, j, u[j]);

        __m256i isum[REPACKED_COLS][2];
        for (int c = 0; c < NC; ++c) isum[c][0] = isum[c][1] = _mm256_setzero_si256();
        for (int sb = 0; sb < 4; ++sb) {
            prefetch_stream(xb->qs + 256 * sb, 256);
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * sb + h;
                const uint8_t * scb = (const uint8_t *) u[j];
                for (int half = 0; half < 2; ++half) {  // rows 4*half .. 4*half+3
                    __m256i w[4];
                    for (int k = 0; k < 4; ++k) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *) (xb->qs + 256 * sb + 64 * k + 32 * half));
                        w[k] = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, m4);
                    }
                    uint32_t sc4;
                    memcpy(&sc4, scb + 4 * half, 4);
                    // int16 lanes: each row's scale in both halves of its two int32 lanes
                    const __m256i scale = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi32_si128((int) sc4), dup4));
                    for (int c = 0; c < NC; ++c) {
                        const int8_t * q8 = y[c][i].qs + 64 * sb + 32 * h;
                        __m256i p = _mm256_setzero_si256();
                        for (int k = 0; k < 4; ++k) {  // int16 lanes: |p| <= 8 * 15 * 128 < 2^15
                            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[k], _mm256_set1_epi64x(load64(q8 + 8 * k))));
                        }
                        isum[c][half] = _mm256_add_epi32(isum[c][half], _mm256_madd_epi16(p, scale));
                    }
                }
            }
        }
        const __m256 xd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->d));
        const __m256 xdmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->dmin));
        __m256i mins[4];
        for (int q = 0; q < 4; ++q) {
            mins[q] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) &u[2 * q][2]),
                                                             _mm_loadl_epi64((const __m128i *) &u[2 * q + 1][2])));
        }
        for (int c = 0; c < NC; ++c) {
            const __m128i bsums = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *) y[c][i].bsums),
                                                 _mm_loadu_si128((const __m128i *) (y[c][i].bsums + 8)));
            __m256i imin = _mm256_setzero_si256();
            for (int q = 0; q < 4; ++q) {
                imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mins[q], _mm256_set1_epi32(_mm_extract_epi32(bsums, q))));
            }
            // [r0 r1 r4 r5 | r2 r3 r6 r7] -> row order
            const __m256i irow = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(isum[c][0], isum[c][1]), row_order);
            const __m256 yd = _mm256_set1_ps(y[c][i].d);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(irow), _mm256_mul_ps(xd, yd), acc[c]);
            acc_min[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(xdmin, yd), acc_min[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], _mm256_sub_ps(acc[c], acc_min[c]));
}
#endif

// -- Q2_K repacked (block_q2_Kx8: llama.cpp repacks Q2_K 8 rows at a time on AVX-512 CPUs only) --
//
// ggml_gemv_q2_K_8x8_q8_K, per output element and superblock: the exact integer sum of scale x (2-bit values . q8)
// over the 16 sub-blocks, and of min x (q8 block sum), each converted to float and added with one fused
// multiply-add, by x.d * y.d and x.dmin * y.d into two accumulators; the second subtracted from the first at the
// end. The integers are exact however they are formed, so all 8 rows go in one 512-bit register here.
#if defined(SPECULANT_MM_HAVE_512)
#define SPECULANT_MM_HAVE_Q2_KX8 1

typedef struct {
    ggml_half d[8];
    ggml_half dmin[8];
    uint8_t scales[128];  // 16 bytes per pair of sub-blocks (2p, 2p+1): row r's scale | min << 4 at 2r and 2r+1
    uint8_t qs[512];      // 8-byte chunk k (of 64) holds bytes 8(k/8)..+7 of row k%8
} q2_Kx8;

_Static_assert(sizeof(q2_Kx8) == 8 * sizeof(block_q2_K), "block_q2_Kx8 layout");

static inline __attribute__((always_inline)) void q2_Kx8_cols(const int NC, const int nb, const q2_Kx8 * x,
                                                             const block_q8_K * const * y, const int * order,
                                                             float * const * out) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    // a sub-block's scale byte of each row (odd sub-blocks: +1) into both int16 halves' bytes of lanes 2r, 2r+1
    const __m128i dup_even = _mm_set_epi8(14, 14, 12, 12, 10, 10, 8, 8, 6, 6, 4, 4, 2, 2, 0, 0);
    const __m128i dup_odd = _mm_add_epi8(dup_even, _mm_set1_epi8(1));
#ifndef Q4KX8_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    __m256 acc[REPACKED_COLS], acc_min[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) { acc[c] = _mm256_setzero_ps(); acc_min[c] = _mm256_setzero_ps(); }

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        const q2_Kx8 * xb = x + i;
        __m512i isum[REPACKED_COLS];
        for (int c = 0; c < NC; ++c) isum[c] = _mm512_setzero_si512();
        // bytes 16p + 32h .. +15 of each row (two chunks): value (byte >> 2j) & 3 is value 128h + 32j + 16p + l,
        // of sub-block 8h + 2j + p
        for (int h = 0; h < 2; ++h) {
            for (int p = 0; p < 2; ++p) {
                const __m512i raw0 = _mm512_loadu_si512((const void *) (xb->qs + 64 * (4 * h + 2 * p)));
                const __m512i raw1 = _mm512_loadu_si512((const void *) (xb->qs + 64 * (4 * h + 2 * p + 1)));
                for (int j = 0; j < 4; ++j) {
                    const int sub = 8 * h + 2 * j + p;
                    const __m512i w0 = _mm512_and_si512(_mm512_srli_epi16(raw0, 2 * j), m3);
                    const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw1, 2 * j), m3);
                    // each lane's row scale, as an int32 (high int16 zero): madd of an int16 sum by it is a product
                    const __m128i pair = _mm_and_si128(_mm_loadu_si128((const __m128i *) (xb->scales + 16 * (sub / 2))), m4);
                    const __m512i scale = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(pair, sub % 2 ? dup_odd : dup_even));
                    for (int c = 0; c < NC; ++c) {
                        const int8_t * q8 = y[c][i].qs + 128 * h + 32 * j + 16 * p;
                        const __m512i a0 = _mm512_set1_epi64(load64(q8)), a1 = _mm512_set1_epi64(load64(q8 + 8));
#ifdef Q4KX8_VNNI  // |s| <= 8 * 3 * 128 < 2^15 per lane
                        const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, a0), w1, a1);
                        isum[c] = _mm512_dpwssd_epi32(isum[c], s, scale);
#else
                        const __m512i s = _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(w0, a0),
                                                                             _mm512_maddubs_epi16(w1, a1)), ones);
                        isum[c] = _mm512_add_epi32(isum[c], _mm512_madd_epi16(s, scale));
#endif
                    }
                }
            }
        }
        const __m256 xd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->d));
        const __m256 xdmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->dmin));
        __m256i mins[8];  // sub-blocks 2q and 2q+1: the int16 pairs (min_2q, min_2q+1) of each row
        for (int q = 0; q < 8; ++q) {
            const __m128i pair = _mm_loadu_si128((const __m128i *) (xb->scales + 16 * q));
            mins[q] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(pair, 4), m4));
        }
        for (int c = 0; c < NC; ++c) {
            __m256i imin = _mm256_setzero_si256();
            for (int q = 0; q < 8; ++q) {
                int32_t bsum_pair;  // the q8 block sums of sub-blocks 2q and 2q+1, as an int16 pair
                memcpy(&bsum_pair, y[c][i].bsums + 2 * q, sizeof(bsum_pair));
                imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mins[q], _mm256_set1_epi32(bsum_pair)));
            }
            // lanes 2r and 2r+1 -> row r
            const __m256i irow = _mm512_cvtepi64_epi32(_mm512_add_epi32(isum[c], _mm512_srli_epi64(isum[c], 32)));
            const __m256 yd = _mm256_set1_ps(y[c][i].d);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(irow), _mm256_mul_ps(xd, yd), acc[c]);
            acc_min[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_mul_ps(xdmin, yd), acc_min[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], _mm256_sub_ps(acc[c], acc_min[c]));
}
#endif

// -- Q6_K repacked (block_q6_Kx8; ggml repacks Q6_K on x86 only in our build, and every pass takes this kernel) --
//
// Per output element and superblock: the superblock's integer sum (the -32 offset of every 6-bit value folded in
// through the q8_K block sums) converted to float, times x.d * y.d, added with one fused multiply-add.

typedef struct {
    ggml_half d[8];
    int8_t scales[128];  // scale g (of 16) of row r at 8g + r
    uint8_t q[1536];     // in the order the kernel reads them (speculant_mm_q6_Kx8_reorder): 192 bytes a step
} q6_Kx8;

#define Q6KX8_LOW_A(xb, h, kk) ((xb)->q + 192 * (4 * (h) + (kk)))  // low bits of values 128h + 8kk + 0..7, 64 + ..
#define Q6KX8_LOW_B(xb, h, kk) (Q6KX8_LOW_A(xb, h, kk) + 64)         // .. of values 128h + 32 + 8kk + 0..7, 96 + ..
#define Q6KX8_HIGH(xb, h, kk) (Q6KX8_LOW_A(xb, h, kk) + 128)         // .. and the high bits of all four

_Static_assert(sizeof(q6_Kx8) == 8 * sizeof(block_q6_K), "block_q6_Kx8 layout");

#if defined(SPECULANT_MM_HAVE_512)
static inline __attribute__((always_inline)) void q6_Kx8_cols(const int NC, const int nb, const q6_Kx8 * x,
                                                             const block_q8_K * const * y, const int * order,
                                                             float * const * out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i m6 = _mm512_set1_epi8(0x3F);
    const __m128i dup2 = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
#ifndef Q4KX8_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    __m256 acc[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, offsetof(q6_Kx8, q));
        const q6_Kx8 * xb = x + i;
        __m512i isum[REPACKED_COLS];
        for (int c = 0; c < NC; ++c) isum[c] = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {            // values 128h ..
            for (int p = 0; p < 2; ++p) {        // .. + {0, 32, 64, 96} + 16p + 0..15: group g = 8h + 2m + p
                prefetch_stream(Q6KX8_LOW_A(xb, h, 2 * p), 2 * 192);
                __m512i q[2][4];
                for (int t = 0; t < 2; ++t) {    // 8 values each: chunk kk = 2p + t
                    const int kk = 2 * p + t;
                    const __m512i ql_a = _mm512_loadu_si512((const void *) (Q6KX8_LOW_A(xb, h, kk)));
                    const __m512i ql_b = _mm512_loadu_si512((const void *) (Q6KX8_LOW_B(xb, h, kk)));
                    const __m512i qh = _mm512_loadu_si512((const void *) (Q6KX8_HIGH(xb, h, kk)));
                    // each byte: its low 4 bits from the ql nibble, bits 4-5 from the qh pair (a bitwise select
                    // on 0x0F, 0xCA: m4 ? ql : qh), bits 6-7 cleared; the 16-bit shifts move bits across bytes
                    // only where the select or the mask drops them
                    q[t][0] = _mm512_and_si512(_mm512_ternarylogic_epi32(m4, ql_a, _mm512_slli_epi16(qh, 4), 0xCA), m6);
                    q[t][1] = _mm512_and_si512(_mm512_ternarylogic_epi32(m4, ql_b, _mm512_slli_epi16(qh, 2), 0xCA), m6);
                    q[t][2] = _mm512_and_si512(_mm512_ternarylogic_epi32(m4, _mm512_srli_epi16(ql_a, 4), qh, 0xCA), m6);
                    q[t][3] = _mm512_and_si512(_mm512_ternarylogic_epi32(m4, _mm512_srli_epi16(ql_b, 4), _mm512_srli_epi16(qh, 2), 0xCA), m6);
                }
                for (int m = 0; m < 4; ++m) {
                    // int32 lanes (high int16 zero): the row's scale of this group of 16 values
                    const int g = 8 * h + 2 * m + p;
                    const __m512i scale = _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *) (xb->scales + 8 * g)), dup2)), lo16);
                    for (int c = 0; c < NC; ++c) {
                        const int8_t * q8 = y[c][i].qs + 128 * h + 32 * m + 16 * p;
                        for (int t = 0; t < 2; ++t) {  // |s| <= 4 * 63 * 128 < 2^15 per lane
                            const __m512i a = _mm512_set1_epi64(load64(q8 + 8 * t));
#ifdef Q4KX8_VNNI
                            isum[c] = _mm512_dpwssd_epi32(isum[c], _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[t][m], a), scale);
#else
                            isum[c] = _mm512_add_epi32(isum[c], _mm512_madd_epi16(_mm512_madd_epi16(_mm512_maddubs_epi16(q[t][m], a), ones), scale));
#endif
                        }
                    }
                }
            }
        }
        // the -32 offsets: 32 * sum over groups g of scale_g * (sum of the group's 16 q8 values)
        __m256i scales_pair[8];  // groups 2p, 2p+1: the int16 pairs (scale_2p, scale_2p+1) of each row
        for (int p = 0; p < 8; ++p) {
            scales_pair[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) (xb->scales + 16 * p)),
                                                                    _mm_loadl_epi64((const __m128i *) (xb->scales + 16 * p + 8))));
        }
        const __m256 xd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->d));
        for (int c = 0; c < NC; ++c) {
            __m256i ioff = _mm256_setzero_si256();
            for (int p = 0; p < 8; ++p) {
                int32_t pair;
                memcpy(&pair, y[c][i].bsums + 2 * p, 4);
                ioff = _mm256_add_epi32(ioff, _mm256_madd_epi16(scales_pair[p], _mm256_set1_epi32(pair)));
            }
            const __m256i irow = _mm512_cvtepi64_epi32(_mm512_add_epi32(isum[c], _mm512_srli_epi64(isum[c], 32)));
            const __m256i itotal = _mm256_sub_epi32(irow, _mm256_slli_epi32(ioff, 5));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(itotal), _mm256_mul_ps(xd, _mm256_set1_ps(y[c][i].d)), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], acc[c]);
}

#else  // AVX2: rows 0-3 and 4-7 in two halves; int16 pair products, then madd by the scales

static inline __attribute__((always_inline)) void q6_Kx8_cols(const int NC, const int nb, const q6_Kx8 * x,
                                                             const block_q8_K * const * y, const int * order,
                                                             float * const * out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    const __m128i dup4 = _mm_set_epi8(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m256i row_order = _mm256_set_epi32(7, 6, 3, 2, 5, 4, 1, 0);
    __m256 acc[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, offsetof(q6_Kx8, q));
        const q6_Kx8 * xb = x + i;
        __m256i isum[REPACKED_COLS][2];
        for (int c = 0; c < NC; ++c) isum[c][0] = isum[c][1] = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {
            for (int kp = 0; kp < 2; ++kp) {  // chunks kk = 2kp, 2kp+1 share their groups' scales
                prefetch_stream(Q6KX8_LOW_A(xb, h, 2 * kp), 2 * 192);
                for (int half = 0; half < 2; ++half) {
                    __m256i scale[4];  // int16 lanes: each row's scale in all four lanes of its 8 bytes
                    for (int m = 0; m < 4; ++m) {
                        const int g = 8 * h + 2 * m + kp;
                        int32_t sc4;
                        memcpy(&sc4, xb->scales + 8 * g + 4 * half, 4);
                        scale[m] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_cvtsi32_si128(sc4), dup4));
                    }
                    for (int kk = 2 * kp; kk < 2 * kp + 2; ++kk) {
                        const __m256i ql_a = _mm256_loadu_si256((const __m256i *) (Q6KX8_LOW_A(xb, h, kk) + 32 * half));
                        const __m256i ql_b = _mm256_loadu_si256((const __m256i *) (Q6KX8_LOW_B(xb, h, kk) + 32 * half));
                        const __m256i qh = _mm256_loadu_si256((const __m256i *) (Q6KX8_HIGH(xb, h, kk) + 32 * half));
                        // bits 4-5 of each byte from its qh pair, shifted into place and masked (0x30); the 16-bit
                        // shifts move bits across bytes only where the masks drop them
                        __m256i q[4];
                        q[0] = _mm256_or_si256(_mm256_and_si256(ql_a, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
                        q[1] = _mm256_or_si256(_mm256_and_si256(ql_b, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
                        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql_a, 4), m4), _mm256_and_si256(qh, m30));
                        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql_b, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
                        for (int c = 0; c < NC; ++c) {
                            const int8_t * q8 = y[c][i].qs + 128 * h + 8 * kk;
                            for (int m = 0; m < 4; ++m) {  // int16 lanes: |p| <= 2 * 63 * 128 < 2^15
                                const __m256i p = _mm256_maddubs_epi16(q[m], _mm256_set1_epi64x(load64(q8 + 32 * m)));
                                isum[c][half] = _mm256_add_epi32(isum[c][half], _mm256_madd_epi16(p, scale[m]));
                            }
                        }
                    }
                }
            }
        }
        __m256i scales_pair[8];
        for (int p = 0; p < 8; ++p) {
            scales_pair[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *) (xb->scales + 16 * p)),
                                                                    _mm_loadl_epi64((const __m128i *) (xb->scales + 16 * p + 8))));
        }
        const __m256 xd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->d));
        for (int c = 0; c < NC; ++c) {
            __m256i ioff = _mm256_setzero_si256();
            for (int p = 0; p < 8; ++p) {
                int32_t pair;
                memcpy(&pair, y[c][i].bsums + 2 * p, 4);
                ioff = _mm256_add_epi32(ioff, _mm256_madd_epi16(scales_pair[p], _mm256_set1_epi32(pair)));
            }
            const __m256i irow = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(isum[c][0], isum[c][1]), row_order);
            const __m256i itotal = _mm256_sub_epi32(irow, _mm256_slli_epi32(ioff, 5));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(itotal), _mm256_mul_ps(xd, _mm256_set1_ps(y[c][i].d)), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], acc[c]);
}
#endif


// -- Q4_0 repacked (block_q4_0x8, llama.cpp's layout for Q4_0 on x86) --
//
// Per output element and block: the block's integer sum converted to float, times x.d * y.d, added with one fused
// multiply-add: the float operations of ggml_gemv_q4_0_8x8_q8_0. ggml sign-extends the stored 4-bit values; here
// they are read as unsigned (0..15) and 8 times the column's block sum is taken off: the same integer.

typedef struct {
    ggml_half d[8];
    uint8_t qs[128];  // 8-byte chunk k holds bytes 8(k/8)..+7 of row k%8, each nibble XOR 8 (so signed)
} q4_0x8;

_Static_assert(sizeof(q4_0x8) == 8 * sizeof(block_q4_0), "block_q4_0x8 layout");

#if defined(SPECULANT_MM_HAVE_512)
// one 512-bit register holds 8 values of all 8 rows: row r's 4-byte groups in int32 lanes 2r and 2r+1
static inline __attribute__((always_inline)) void q4_0x8_cols(const int NC, const int nb, const q4_0x8 * x,
                                                             const block_q8_0 * const * y, const int32_t * const * ysum,
                                                             const int * order, float * const * out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i unsign = _mm512_set1_epi8((char) 0x88);
#ifndef Q4KX8_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    __m256 acc[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        prefetch_stream_l2(x + i, sizeof(*x));
        const q4_0x8 * xb = x + i;
        const __m512i lo = _mm512_xor_si512(_mm512_loadu_si512((const void *) xb->qs), unsign);         // bytes 0-7
        const __m512i hi = _mm512_xor_si512(_mm512_loadu_si512((const void *) (xb->qs + 64)), unsign);  // bytes 8-15
        // values 0-7, 8-15, 16-23 and 24-31 of every row, 0..15
        const __m512i w[4] = {_mm512_and_si512(lo, m4), _mm512_and_si512(hi, m4),
                              _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4), _mm512_and_si512(_mm512_srli_epi16(hi, 4), m4)};
        const __m256 xd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->d));
        for (int c = 0; c < NC; ++c) {
            const int8_t * q8 = y[c][i].qs;
#ifdef Q4KX8_VNNI
            __m512i s = _mm512_setzero_si512();
            for (int k = 0; k < 4; ++k) s = _mm512_dpbusd_epi32(s, w[k], _mm512_set1_epi64(load64(q8 + 8 * k)));
#else
            __m512i p = _mm512_setzero_si512();  // int16 lanes: |p| <= 4 * 2 * 15 * 128 < 2^15
            for (int k = 0; k < 4; ++k) p = _mm512_add_epi16(p, _mm512_maddubs_epi16(w[k], _mm512_set1_epi64(load64(q8 + 8 * k))));
            const __m512i s = _mm512_madd_epi16(p, ones);
#endif
            const __m256i irow = _mm512_cvtepi64_epi32(_mm512_add_epi32(s, _mm512_srli_epi64(s, 32)));
            const __m256i isum = _mm256_sub_epi32(irow, _mm256_set1_epi32(8 * ysum[c][i]));
            const __m256 yd = _mm256_set1_ps(fp16_to_fp32(y[c][i].d));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(xd, yd), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], acc[c]);
}

#else  // AVX2: rows 0-3 and 4-7 in two 256-bit halves

static inline __attribute__((always_inline)) void q4_0x8_cols(const int NC, const int nb, const q4_0x8 * x,
                                                             const block_q8_0 * const * y, const int32_t * const * ysum,
                                                             const int * order, float * const * out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i unsign = _mm256_set1_epi8((char) 0x88);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i row_order = _mm256_set_epi32(7, 6, 3, 2, 5, 4, 1, 0);
    __m256 acc[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        prefetch_stream(x + i, sizeof(*x));
        prefetch_stream_l2(x + i, sizeof(*x));
        const q4_0x8 * xb = x + i;
        __m256i w[2][4];
        for (int half = 0; half < 2; ++half) {  // rows 4*half .. 4*half+3
            const __m256i lo = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) (xb->qs + 32 * half)), unsign);
            const __m256i hi = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) (xb->qs + 64 + 32 * half)), unsign);
            w[half][0] = _mm256_and_si256(lo, m4);
            w[half][1] = _mm256_and_si256(hi, m4);
            w[half][2] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
            w[half][3] = _mm256_and_si256(_mm256_srli_epi16(hi, 4), m4);
        }
        const __m256 xd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) xb->d));
        for (int c = 0; c < NC; ++c) {
            const int8_t * q8 = y[c][i].qs;
            __m256i a[4];
            for (int k = 0; k < 4; ++k) a[k] = _mm256_set1_epi64x(load64(q8 + 8 * k));
            __m256i s[2];
            for (int half = 0; half < 2; ++half) {
                __m256i p = _mm256_setzero_si256();
                for (int k = 0; k < 4; ++k) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[half][k], a[k]));
                s[half] = _mm256_madd_epi16(p, ones);
            }
            // [r0 r1 r4 r5 | r2 r3 r6 r7] -> row order
            const __m256i irow = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(s[0], s[1]), row_order);
            const __m256i isum = _mm256_sub_epi32(irow, _mm256_set1_epi32(8 * ysum[c][i]));
            const __m256 yd = _mm256_set1_ps(fp16_to_fp32(y[c][i].d));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(xd, yd), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], acc[c]);
}
#endif

// IQ4_NL and MXFP4 rows as ggml repacks them on AVX2 (block_iq4_nlx8: q4_0x8's layout, table indices without the
// XOR; block_mxfp4x8: the same quants after an E8M0 exponent per row), in the lanes of ggml_gemv_iq4_nl_8x8_q8_0
// and ggml_gemv_mxfp4_8x8_q8_0 (one template): per block and row, the table values times q8 summed exactly, one
// fused multiply-add by x's scale times y.d. AVX-512 with VNNI: all 8 rows in one register, each table value plus
// 128 as an unsigned byte times q8, less 128 x the column's block sum. Otherwise 256-bit: |w| times q8 carrying
// w's sign, which keeps maddubs from saturating. Every way, the same integers and the same float operations.
typedef q4_0x8 iq4_nlx8;

typedef struct {
    uint8_t e[8];     // each row's E8M0 exponent (the scale is GGML_CPU_E8M0_TO_FP32_HALF of it)
    uint8_t qs[128];  // as q4_0x8's, table indices
} mxfp4x8;

static inline __m256 lut4x8_scales(const bool mx, const uint8_t * xb) {
    if (mx) {
        const uint8_t * e = ((const mxfp4x8 *) xb)->e;
        return _mm256_set_ps(GGML_CPU_E8M0_TO_FP32_HALF(e[7]), GGML_CPU_E8M0_TO_FP32_HALF(e[6]),
                             GGML_CPU_E8M0_TO_FP32_HALF(e[5]), GGML_CPU_E8M0_TO_FP32_HALF(e[4]),
                             GGML_CPU_E8M0_TO_FP32_HALF(e[3]), GGML_CPU_E8M0_TO_FP32_HALF(e[2]),
                             GGML_CPU_E8M0_TO_FP32_HALF(e[1]), GGML_CPU_E8M0_TO_FP32_HALF(e[0]));
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const iq4_nlx8 *) xb)->d));
}

#if defined(SPECULANT_MM_HAVE_512) && defined(Q4KX8_VNNI)
#define LUT4X8_SUMS 1  // the kernel takes the columns' q8_0 block sums

// mx: MXFP4 (kvalues_fp4, E8M0 scales) rather than IQ4_NL (iq4_values, fp16 scales); a constant at every call
static inline __attribute__((always_inline)) void lut4x8_cols(const int NC, const bool mx, const int nb,
                                                              const void * x, const block_q8_0 * const * y,
                                                              const int32_t * const * ysum, const int * order,
                                                              float * const * out) {
    const __m128i values = _mm_loadu_si128((const __m128i *) (mx ? kvalues_fp4 : iq4_values));
    const __m512i table = _mm512_broadcast_i32x4(_mm_xor_si128(values, _mm_set1_epi8((char) 0x80)));  // w + 128
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const size_t block_bytes = mx ? sizeof(mxfp4x8) : sizeof(iq4_nlx8);
    __m256 acc[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        const uint8_t * xb = (const uint8_t *) x + i * block_bytes;
        prefetch_stream(xb, block_bytes);
        const uint8_t * qs = mx ? ((const mxfp4x8 *) xb)->qs : ((const iq4_nlx8 *) xb)->qs;
        const __m512i lo = _mm512_loadu_si512((const void *) qs);         // bytes 0-7 of every row
        const __m512i hi = _mm512_loadu_si512((const void *) (qs + 64));  // bytes 8-15
        // values 0-7, 8-15, 16-23 and 24-31 of every row, plus 128
        const __m512i w[4] = {_mm512_shuffle_epi8(table, _mm512_and_si512(lo, m4)),
                              _mm512_shuffle_epi8(table, _mm512_and_si512(hi, m4)),
                              _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4)),
                              _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(hi, 4), m4))};
        const __m256 xd = lut4x8_scales(mx, xb);
        for (int c = 0; c < NC; ++c) {
            const int8_t * q8 = y[c][i].qs;
            __m512i s = _mm512_setzero_si512();
            for (int k = 0; k < 4; ++k) s = _mm512_dpbusd_epi32(s, w[k], _mm512_set1_epi64(load64(q8 + 8 * k)));
            const __m256i irow = _mm512_cvtepi64_epi32(_mm512_add_epi32(s, _mm512_srli_epi64(s, 32)));
            const __m256i isum = _mm256_sub_epi32(irow, _mm256_set1_epi32(128 * ysum[c][i]));
            const __m256 yd = _mm256_set1_ps(fp16_to_fp32(y[c][i].d));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(xd, yd), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], acc[c]);
}

#else

static inline __attribute__((always_inline)) void lut4x8_cols(const int NC, const bool mx, const int nb,
                                                              const void * x, const block_q8_0 * const * y,
                                                              const int32_t * const * ysum, const int * order,
                                                              float * const * out) {
    (void) ysum;
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) (mx ? kvalues_fp4 : iq4_values)));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i row_order = _mm256_set_epi32(7, 6, 3, 2, 5, 4, 1, 0);
    const size_t block_bytes = mx ? sizeof(mxfp4x8) : sizeof(iq4_nlx8);
    __m256 acc[REPACKED_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        const uint8_t * xb = (const uint8_t *) x + i * block_bytes;
        prefetch_stream(xb, block_bytes);
        const uint8_t * qs = mx ? ((const mxfp4x8 *) xb)->qs : ((const iq4_nlx8 *) xb)->qs;
        __m256i w[2][4], wabs[2][4];  // [rows 4*half .. 4*half+3][values 8k .. 8k+7]
        for (int half = 0; half < 2; ++half) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *) (qs + 32 * half));       // bytes 0-7
            const __m256i hi = _mm256_loadu_si256((const __m256i *) (qs + 64 + 32 * half));  // bytes 8-15
            w[half][0] = _mm256_shuffle_epi8(table, _mm256_and_si256(lo, m4));
            w[half][1] = _mm256_shuffle_epi8(table, _mm256_and_si256(hi, m4));
            w[half][2] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4));
            w[half][3] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(hi, 4), m4));
            for (int k = 0; k < 4; ++k) wabs[half][k] = _mm256_sign_epi8(w[half][k], w[half][k]);
        }
        const __m256 xd = lut4x8_scales(mx, xb);
        for (int c = 0; c < NC; ++c) {
            const int8_t * q8 = y[c][i].qs;
            __m256i s[2];
            for (int half = 0; half < 2; ++half) {
                s[half] = _mm256_setzero_si256();
                for (int k = 0; k < 4; ++k) {
                    const __m256i a = _mm256_set1_epi64x(load64(q8 + 8 * k));
                    const __m256i p = _mm256_maddubs_epi16(wabs[half][k], _mm256_sign_epi8(a, w[half][k]));
                    s[half] = _mm256_add_epi32(s[half], _mm256_madd_epi16(p, ones));
                }
            }
            // [r0 r1 r4 r5 | r2 r3 r6 r7] -> row order
            const __m256i irow = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(s[0], s[1]), row_order);
            const __m256 yd = _mm256_set1_ps(fp16_to_fp32(y[c][i].d));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(irow), _mm256_mul_ps(xd, yd), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out[c], acc[c]);
}
#endif

// the sum of each q8_0 block's 32 values, for ncols columns of nb blocks: sums[c * nb + i]
static void q8_0_block_sums(int nb, const char * ycols, size_t row_size, int ncols, int32_t * sums) {
    const __m256i bias = _mm256_set1_epi8((char) 0x80);  // as unsigned bytes: value + 128
    for (int c = 0; c < ncols; ++c) {
        const block_q8_0 * y = (const block_q8_0 *) (ycols + (size_t) c * row_size);
        for (int i = 0; i < nb; ++i) {
            const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *) y[i].qs), bias),
                                                _mm256_setzero_si256());
            const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
            sums[(size_t) c * nb + i] = (int32_t) (_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
        }
    }
}

// -- every repacked type: one group of 8 rows against ncols columns --

// kernel(NC, ...) with NC a constant: each case compiles to its own unrolled kernel
#if REPACKED_COLS == 8
#define SPECULANT_BY_NC_REPACKED(nc, kernel, ...)         \
    switch (nc) {                                         \
        case 1: kernel(1, __VA_ARGS__); break;            \
        case 2: kernel(2, __VA_ARGS__); break;            \
        case 3: kernel(3, __VA_ARGS__); break;            \
        case 4: kernel(4, __VA_ARGS__); break;            \
        case 5: kernel(5, __VA_ARGS__); break;            \
        case 6: kernel(6, __VA_ARGS__); break;            \
        case 7: kernel(7, __VA_ARGS__); break;            \
        default: kernel(8, __VA_ARGS__); break;           \
    }
#else
#define SPECULANT_BY_NC_REPACKED SPECULANT_BY_NC
#endif
#define SPECULANT_BY_NC(nc, kernel, ...)                  \
    switch (nc) {                                         \
        case 1: kernel(1, __VA_ARGS__); break;            \
        case 2: kernel(2, __VA_ARGS__); break;            \
        case 3: kernel(3, __VA_ARGS__); break;            \
        default: kernel(4, __VA_ARGS__); break;           \
    }

// -- Q4_K and Q6_K repacked, many tokens: AMX tiles (Sapphire Rapids and later) -----------------------------------
//
// The same bits as q4_Kx8_cols and q6_Kx8_cols: per output element and superblock, those kernels' float operations
// on those kernels' integers. Only the integers are formed differently, and integer sums are exact. A tile product
// multiplies bytes, and a superblock's integer sum weights each value by its sub-block's scale: so each weight is
// multiplied by its scale first, in 16-bit words, and the product split as lo + 256 hi, lo its low byte (0..255) and
// hi the rest; the superblock's sum is then P_lo + 256 P_hi, two tile products over its 256 values, with no step per
// sub-block. Q4_K: scale (0..63) x q (0..15), hi 0..3; its mins' sum stays a vector product over the q8 block sums.
// Q6_K: scale (-128..127) x (q - 32), in [-4064, 4096], hi -16..16, the -32 offset folded in.
//
// The weights are the products' B operand, 16 rows a tile: a tile row holds 4 consecutive values of each row, so
// the repacked layouts' 8 values of each of 8 rows (a 64-byte vector) make two tile rows with one permute per pair
// of 8-row groups. The tokens are the A operand, 16 a tile, their q8_K values as stored (64 a tile row). Neither side
// is transposed, and the products come out token by token, as the output is laid out. Each 16-row superblock is
// unpacked once for every token of the pass. Taken where the CPU has AMX-INT8 and Linux grants its tile state
// (SPECULANT_AMX=0: never), for passes of at least amx_min_cols tokens.
#if defined(SPECULANT_MM_HAVE_512) && defined(__x86_64__) && defined(__linux__) \
    && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define SPECULANT_MM_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
// Q4_K and Q6_K: from 8 tokens on a pass takes the tile products (Qwen 1.5B: 8 tokens 71.8 ms against 76.6 on the
// VNNI kernels, 7: 69.5 / 68.9; BENCHMARKS.md)
#define AMX_MIN_COLS 8
// Rows of 32-value blocks (Q4_0, IQ4_NL, MXFP4) take one product and one float step per block, while their VNNI
// kernels' cost grows faster with the tokens: the tiles win from 6 tokens on (Q4_0, whole model, BENCHMARKS.md)
#define AMX_MIN_COLS_32 6
#define AMX_COLS 16  // tokens per tile

// Types of 32-value blocks with a scale each (lut4x8_amx_rows), rather than K-quant superblocks
static inline bool amx_32_type(enum ggml_type type) {
    return type == GGML_TYPE_Q4_0 || type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_MXFP4;
}

// Tokens in tile t of a pass of ncols
static inline int amx_tile_cols(int ncols, int t) {
    return ncols - AMX_COLS * t < AMX_COLS ? ncols - AMX_COLS * t : AMX_COLS;
}

static int amx_state = -1;  // -1: not asked yet; 0: no AMX; 1: granted
static int64_t amx_min_cols = 0;  // 0: each type's default
// pshufb indices over a broadcast qword of 8 row scales (bytes): [0] words (scale_r, 0), [1] words (0, scale_r),
// where qword r of the vector (lane r / 2) is row r's
static uint8_t amx_scale_pick[2][64] __attribute__((aligned(64)));

__attribute__((constructor)) static void amx_tables(void) {
    for (int j = 0; j < 64; ++j) {
        const uint8_t row = (uint8_t) (j / 8);  // byte j of the vector is in row j / 8's qword
        amx_scale_pick[0][j] = j % 2 ? 0x80 : row;
        amx_scale_pick[1][j] = j % 2 ? row : 0x80;
    }
}

static bool amx_ready(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state < 0) {
        unsigned a, b, c, d;
        const char * env = getenv("SPECULANT_AMX");
        state = 0;
        if ((!env || atoi(env) != 0) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1)) {
            // the tile data is an XSAVE feature Linux hands out per process on request (ARCH_REQ_XCOMP_PERM)
            state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        }
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state == 1;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

// Tiles 0..n-1 as rows x colsb bytes (palette 1)
AMX_TARGET static void amx_config(int n, const uint8_t * rows, const uint16_t * colsb) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < n; ++t) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = colsb[t];
    }
    _tile_loadconfig(&cfg);
}

// The K-quants' tiles. 0, 1: the two products (m tokens x 16 rows, int32); 2, 3: the weights' lo and hi parts (16
// tile rows of 4 values of 16 rows); 4: 64 values of m tokens. m: the tokens per tile (a product's time grows with
// its rows: a pass of fewer than 16 tokens multiplies only those)
AMX_TARGET static void amx_config_k(int m) {
    const uint8_t rows[5] = {m, m, 16, 16, m};
    const uint16_t colsb[5] = {64, 64, 64, 64, 64};
    amx_config(5, rows, colsb);
}

// 16 tokens' q8_K superblock as A tiles: window w holds values 64w..64w+63 of each token; the sums of sub-blocks
// 2p and 2p+1 (32 values each) as an int16 pair, as madd takes them (Q4_K's mins); d. Tokens past the pass are zero.
typedef struct {
    int8_t q[4][AMX_COLS][64];
    int16_t bsums[AMX_COLS][4][2];
    float d[AMX_COLS];
} amx_tokens;

static void amx_tokens_fill(int nb, const char * ycols, size_t row_size, int ncols, amx_tokens * out) {
    const int ntiles = (ncols + AMX_COLS - 1) / AMX_COLS;
    memset(out, 0, sizeof(amx_tokens) * (size_t) ntiles * nb);
    for (int c = 0; c < ncols; ++c) {
        const block_q8_K * y = (const block_q8_K *) (ycols + (size_t) c * row_size);
        for (int i = 0; i < nb; ++i) {
            amx_tokens * o = out + (size_t) (c / AMX_COLS) * nb + i;
            const int k = c % AMX_COLS;
            for (int w = 0; w < 4; ++w) memcpy(o->q[w][k], y[i].qs + 64 * w, 64);
            for (int p = 0; p < 4; ++p) {
                o->bsums[k][p][0] = (int16_t) (y[i].bsums[4 * p] + y[i].bsums[4 * p + 1]);
                o->bsums[k][p][1] = (int16_t) (y[i].bsums[4 * p + 2] + y[i].bsums[4 * p + 3]);
            }
            o->d[k] = y[i].d;
        }
    }
}

// Scratch per tile of tokens: a superblock's two products ([token][row], int32), the accumulators.
typedef struct {
    int32_t prod[2][AMX_COLS][16];
    float acc[AMX_COLS][16], acc_min[AMX_COLS][16];
} amx_scratch;

// The B tiles of one 16-row superblock: b[w][half][kr][4r + e] = half (0: lo, 1: hi) of row r's scaled value
// 64w + 4kr + e.
typedef uint8_t amx_weights[4][2][16][64];

// Row r's 8 scaled values, in qword r of q (8 rows x 8 values 0..63) times the scales in words (scale_r, 0) and
// (0, scale_r), less off (words: 0, or 32 scale_r): their lo and hi bytes, in value order
AMX_TARGET static inline __attribute__((always_inline)) void amx_scale_split(__m512i q, __m512i y_even, __m512i y_odd,
                                                                             __m512i off, bool with_off, __m512i * lo,
                                                                             __m512i * hi) {
    const __m512i low_byte = _mm512_set1_epi16(0x00FF);
    __m512i even = _mm512_maddubs_epi16(q, y_even), odd = _mm512_maddubs_epi16(q, y_odd);  // |.| <= 8064: exact
    if (with_off) {
        even = _mm512_sub_epi16(even, off);
        odd = _mm512_sub_epi16(odd, off);
    }
    *lo = _mm512_ternarylogic_epi32(low_byte, even, _mm512_slli_epi16(odd, 8), 0xCA);  // low_byte ? even : odd << 8
    *hi = _mm512_ternarylogic_epi32(low_byte, _mm512_srai_epi16(even, 8), odd, 0xCA);
}

// Two 8-row groups' lo / hi vectors (value v + 0..7 of row r in qword r) as tile rows kr, kr + 1 (values v + 0..3,
// v + 4..7 of rows 0..15)
AMX_TARGET static inline __attribute__((always_inline)) void amx_store_rows(__m512i g0, __m512i g1, uint8_t rows[2][64]) {
    const __m512i even_dwords = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd_dwords = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    _mm512_store_si512((void *) rows[0], _mm512_permutex2var_epi32(g0, even_dwords, g1));
    _mm512_store_si512((void *) rows[1], _mm512_permutex2var_epi32(g0, odd_dwords, g1));
}

// Step `step` of `steps` in prefetching both groups' next superblocks (of `bytes` each), a few lines a step: one
// burst would take every L1 fill buffer and stall until they drained
static inline __attribute__((always_inline)) void amx_prefetch_next(const void * g0, const void * g1, size_t bytes,
                                                                    int step, int steps) {
    if (prefetch_ahead) {
        const size_t lines = (bytes / 64 + steps) / steps;  // per step: every line of a superblock, or more
        for (int k = 0; k < 2; ++k) {
            for (size_t l = 0; l < lines; ++l) {
                __builtin_prefetch((const char *) (k ? g1 : g0) + bytes + 64 * (lines * step + l), 0, 3);
            }
        }
    }
}

// One superblock of 16 repacked Q4_K rows (groups x0: rows 0-7, x1: rows 8-15) as B tiles: scale x q. sc8: each
// group's 8 scales of each sub-block, a byte a row (k_scales_mins64).
AMX_TARGET static inline __attribute__((always_inline)) void q4_Kx8_amx_unpack(const q4_Kx8 * x0, const q4_Kx8 * x1,
                                                                               const uint64_t sc8[2][8], amx_weights b) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const __m512i pick_even = _mm512_load_si512((const void *) amx_scale_pick[0]);
    const __m512i pick_odd = _mm512_load_si512((const void *) amx_scale_pick[1]);
    const q4_Kx8 * xs[2] = {x0, x1};
    for (int sb = 0; sb < 4; ++sb) {  // values 64sb + 0..63: sub-block 2sb in the low nibbles, 2sb + 1 in the high
#pragma GCC unroll 2
        for (int hh = 0; hh < 2; ++hh) {
            amx_prefetch_next(x0, x1, sizeof(q4_Kx8), 2 * sb + hh, 8);
            __m512i y_even[2], y_odd[2];
            for (int k = 0; k < 2; ++k) {
                const __m512i sc = _mm512_set1_epi64((long long) sc8[k][2 * sb + hh]);
                y_even[k] = _mm512_shuffle_epi8(sc, pick_even);
                y_odd[k] = _mm512_shuffle_epi8(sc, pick_odd);
            }
            for (int kk = 0; kk < 4; ++kk) {  // bytes 32sb + 8kk + 0..7 of each row: values 64sb + 32hh + 8kk + 0..7
                __m512i lo[2], hi[2];
                for (int k = 0; k < 2; ++k) {
                    const __m512i raw = _mm512_loadu_si512((const void *) (xs[k]->qs + 256 * sb + 64 * kk));
                    const __m512i q = _mm512_and_si512(hh ? _mm512_srli_epi16(raw, 4) : raw, m4);
                    amx_scale_split(q, y_even[k], y_odd[k], zero, false, &lo[k], &hi[k]);
                }
                amx_store_rows(lo[0], lo[1], b[sb][0] + 8 * hh + 2 * kk);
                amx_store_rows(hi[0], hi[1], b[sb][1] + 8 * hh + 2 * kk);
            }
        }
    }
}

// One superblock of 16 repacked Q6_K rows (groups x0: rows 0-7, x1: rows 8-15) as B tiles: scale x (q - 32).
AMX_TARGET static inline __attribute__((always_inline)) void q6_Kx8_amx_unpack(const q6_Kx8 * x0, const q6_Kx8 * x1,
                                                                               amx_weights b) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m6 = _mm512_set1_epi8(0x3F);
    const __m512i pick_even = _mm512_load_si512((const void *) amx_scale_pick[0]);
    const __m512i pick_odd = _mm512_load_si512((const void *) amx_scale_pick[1]);
    const q6_Kx8 * xs[2] = {x0, x1};
    for (int h = 0; h < 2; ++h) {
        for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 4
            for (int m = 0; m < 4; ++m) {  // group g = 8h + 2m + p: values 128h + 32m + 16p + 0..15
                const int g = 8 * h + 2 * m + p;
                amx_prefetch_next(x0, x1, sizeof(q6_Kx8), 8 * h + 4 * p + m, 16);
                __m512i y_even[2], y_odd[2], off[2];
                for (int k = 0; k < 2; ++k) {
                    const __m512i sc = _mm512_set1_epi64(load64(xs[k]->scales + 8 * g));
                    y_even[k] = _mm512_shuffle_epi8(sc, pick_even);
                    y_odd[k] = _mm512_shuffle_epi8(sc, pick_odd);
                    off[k] = _mm512_srai_epi16(y_odd[k], 3);  // 32 scale_r
                }
                for (int t = 0; t < 2; ++t) {  // 8 values each: chunk kk
                    const int kk = 2 * p + t;
                    __m512i lo[2], hi[2];
                    for (int k = 0; k < 2; ++k) {
                        // row r's 8 values 128h + 32m + 8kk + 0..7 in qword r, as q6_Kx8_cols unpacks them
                        const uint8_t * ql = m & 1 ? Q6KX8_LOW_B(xs[k], h, kk) : Q6KX8_LOW_A(xs[k], h, kk);
                        const __m512i l = _mm512_loadu_si512((const void *) ql);
                        const __m512i qh = _mm512_loadu_si512((const void *) Q6KX8_HIGH(xs[k], h, kk));
                        const __m512i lq = m < 2 ? l : _mm512_srli_epi16(l, 4);
                        const __m512i hq = m == 0 ? _mm512_slli_epi16(qh, 4) : m == 1 ? _mm512_slli_epi16(qh, 2)
                                         : m == 2 ? qh : _mm512_srli_epi16(qh, 2);
                        const __m512i q = _mm512_and_si512(_mm512_ternarylogic_epi32(m4, lq, hq, 0xCA), m6);
                        amx_scale_split(q, y_even[k], y_odd[k], off[k], true, &lo[k], &hi[k]);
                    }
                    // values 128h + 32m + 8kk + 0..7 = 64w + 4kr + 0..7
                    const int w = 2 * h + m / 2, kr = 8 * (m % 2) + 2 * kk;
                    amx_store_rows(lo[0], lo[1], b[w][0] + kr);
                    amx_store_rows(hi[0], hi[1], b[w][1] + kr);
                }
            }
        }
    }
}

// Every token tile's two products of one superblock (P_lo, P_hi: [token][row]) into its scratch
AMX_TARGET static inline __attribute__((always_inline)) void amx_products(amx_weights b, const amx_tokens * toks, int nb,
                                                                          int ntiles, amx_scratch * scratch) {
    for (int t = 0; t < ntiles; ++t) {
        const amx_tokens * y = toks + (size_t) t * nb;
        _tile_zero(0);
        _tile_zero(1);
        for (int w = 0; w < 4; ++w) {
            _tile_loadd(4, y->q[w], 64);
            _tile_loadd(2, b[w][0], 64);
            _tile_dpbsud(0, 4, 2);  // tokens signed, lo unsigned
            _tile_loadd(3, b[w][1], 64);
            _tile_dpbssd(1, 4, 3);  // hi signed (Q4_K's 0..3 too)
        }
        _tile_stored(0, scratch[t].prod[0], 64);
        _tile_stored(1, scratch[t].prod[1], 64);
    }
}

// 16 repacked rows at a time (pairs of 8-row groups, group g at x + g * nb superblocks) against every token;
// token c's result for row r at out[c * out_stride + r]. Returns how many rows it did (a multiple of 16).
AMX_TARGET static int64_t q4_Kx8_amx_rows(int nb, const q4_Kx8 * x, int64_t nrows, const amx_tokens * toks,
                                         int ncols, float * out, size_t out_stride, amx_scratch * scratch) {
    const int ntiles = (ncols + AMX_COLS - 1) / AMX_COLS;
    amx_config_k(ntiles == 1 ? ncols : AMX_COLS);
    amx_weights b __attribute__((aligned(64)));
    for (int64_t p = 0; p < nrows / 16; ++p) {
        const q4_Kx8 * x0 = x + 2 * p * nb, * x1 = x0 + nb;
        for (int i = 0; i < nb; ++i) {
            uint64_t sc8[2][8], mn8[2][8];  // [group][sub-block]: 8 rows' 6-bit scales, mins
            for (int j = 0; j < 8; ++j) {
                k_scales_mins64(x0[i].scales + 12 * j, &sc8[0][j], &mn8[0][j]);
                k_scales_mins64(x1[i].scales + 12 * j, &sc8[1][j], &mn8[1][j]);
            }
            q4_Kx8_amx_unpack(x0 + i, x1 + i, (const uint64_t (*)[8]) sc8, b);
            amx_products(b, toks + i, nb, ntiles, scratch);
            const __m512 xd = _mm512_cvtph_ps(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) x0[i].d)), _mm_loadu_si128((const __m128i *) x1[i].d), 1));
            const __m512 xdmin = _mm512_cvtph_ps(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) x0[i].dmin)), _mm_loadu_si128((const __m128i *) x1[i].dmin), 1));
            __m512i mins[4];  // sub-blocks 2q and 2q+1: each row's int16 pair (min_2q, min_2q+1)
            for (int q = 0; q < 4; ++q) {
                __m256i m8[2];
                for (int k = 0; k < 2; ++k) {
                    m8[k] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128((long long) mn8[k][2 * q]),
                                                                   _mm_cvtsi64_si128((long long) mn8[k][2 * q + 1])));
                }
                mins[q] = _mm512_inserti64x4(_mm512_castsi256_si512(m8[0]), m8[1], 1);
            }
            for (int t = 0; t < ntiles; ++t) {
                const amx_tokens * y = toks + (size_t) t * nb + i;
                amx_scratch * st = scratch + t;
                const int nc = amx_tile_cols(ncols, t);
                for (int c = 0; c < nc; ++c) {
                    const __m512i isum = _mm512_add_epi32(_mm512_load_si512((const void *) st->prod[0][c]),
                                                          _mm512_slli_epi32(_mm512_load_si512((const void *) st->prod[1][c]), 8));
                    int32_t pair[4];
                    memcpy(pair, y->bsums[c], sizeof(pair));
                    __m512i imin = _mm512_madd_epi16(mins[0], _mm512_set1_epi32(pair[0]));
                    for (int q = 1; q < 4; ++q) imin = _mm512_add_epi32(imin, _mm512_madd_epi16(mins[q], _mm512_set1_epi32(pair[q])));
                    // the accumulators start at +0, as q4_Kx8_cols's do
                    const __m512 yd = _mm512_set1_ps(y->d[c]);
                    const __m512 prev = i ? _mm512_load_ps(st->acc[c]) : _mm512_setzero_ps();
                    const __m512 prev_min = i ? _mm512_load_ps(st->acc_min[c]) : _mm512_setzero_ps();
                    _mm512_store_ps(st->acc[c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(xd, yd), prev));
                    _mm512_store_ps(st->acc_min[c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(xdmin, yd), prev_min));
                }
            }
        }
        for (int c = 0; c < ncols; ++c) {
            const amx_scratch * st = scratch + c / AMX_COLS;
            _mm512_storeu_ps(out + (size_t) c * out_stride + 16 * p,
                             _mm512_sub_ps(_mm512_load_ps(st->acc[c % AMX_COLS]), _mm512_load_ps(st->acc_min[c % AMX_COLS])));
        }
    }
    _tile_release();
    return nrows / 16 * 16;
}

// The same for Q6_K (no mins)
AMX_TARGET static int64_t q6_Kx8_amx_rows(int nb, const q6_Kx8 * x, int64_t nrows, const amx_tokens * toks,
                                         int ncols, float * out, size_t out_stride, amx_scratch * scratch) {
    const int ntiles = (ncols + AMX_COLS - 1) / AMX_COLS;
    amx_config_k(ntiles == 1 ? ncols : AMX_COLS);
    amx_weights b __attribute__((aligned(64)));
    for (int64_t p = 0; p < nrows / 16; ++p) {
        const q6_Kx8 * x0 = x + 2 * p * nb, * x1 = x0 + nb;
        for (int i = 0; i < nb; ++i) {
            q6_Kx8_amx_unpack(x0 + i, x1 + i, b);
            amx_products(b, toks + i, nb, ntiles, scratch);
            const __m512 xd = _mm512_cvtph_ps(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) x0[i].d)), _mm_loadu_si128((const __m128i *) x1[i].d), 1));
            for (int t = 0; t < ntiles; ++t) {
                const amx_tokens * y = toks + (size_t) t * nb + i;
                amx_scratch * st = scratch + t;
                const int nc = amx_tile_cols(ncols, t);
                for (int c = 0; c < nc; ++c) {
                    const __m512i isum = _mm512_add_epi32(_mm512_load_si512((const void *) st->prod[0][c]),
                                                          _mm512_slli_epi32(_mm512_load_si512((const void *) st->prod[1][c]), 8));
                    // the accumulators start at +0, as q6_Kx8_cols's do
                    const __m512 prev = i ? _mm512_load_ps(st->acc[c]) : _mm512_setzero_ps();
                    _mm512_store_ps(st->acc[c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                                                                _mm512_mul_ps(xd, _mm512_set1_ps(y->d[c])), prev));
                }
            }
        }
        for (int c = 0; c < ncols; ++c) {
            _mm512_storeu_ps(out + (size_t) c * out_stride + 16 * p, _mm512_load_ps(scratch[c / AMX_COLS].acc[c % AMX_COLS]));
        }
    }
    _tile_release();
    return nrows / 16 * 16;
}

// -- Q4_0, IQ4_NL and MXFP4 (repacked 8 rows x 32 values a block) on tiles: one product per block, since each block
// has its own scale --
//
// A block's integer sum of w x y, w the signed value a nibble stands for (Q4_0: q - 8; IQ4_NL and MXFP4: their
// tables), is what q4_0x8_cols and lut4x8_cols form (with unsigned values, less the offset x the block sum), and each
// output's float step per block is their fmadd(isum, xd x yd, acc), so the bits are the VNNI kernels'. The weights
// go in as signed bytes: no scale split and no block sums.

// 16 tokens' q8_0 block (32 values) as an A tile (16 rows of 32 bytes) and their scales as floats
typedef struct {
    int8_t q[AMX_COLS][QK8_0];
    float d[AMX_COLS];
} amx_tokens_32;

static void amx_tokens_32_fill(int nb, const char * ycols, size_t row_size, int ncols, amx_tokens_32 * out) {
    const int ntiles = (ncols + AMX_COLS - 1) / AMX_COLS;
    memset(out, 0, sizeof(amx_tokens_32) * (size_t) ntiles * nb);
    for (int c = 0; c < ncols; ++c) {
        const block_q8_0 * y = (const block_q8_0 *) (ycols + (size_t) c * row_size);
        for (int i = 0; i < nb; ++i) {
            amx_tokens_32 * o = out + (size_t) (c / AMX_COLS) * nb + i;
            memcpy(o->q[c % AMX_COLS], y[i].qs, QK8_0);
            o->d[c % AMX_COLS] = fp16_to_fp32(y[i].d);
        }
    }
}

// The 32-value types' tiles. 0, 1 and 2, 3: two rounds' products of two blocks (m tokens x 16 rows, int32); 4, 5:
// tokens (m x 32 values); 6, 7: weights (8 tile rows of 4 values of 16 rows). m as amx_config_k's
AMX_TARGET static void amx_config_32(int m) {
    const uint8_t rows[8] = {m, m, m, m, m, m, QK8_0 / 4, QK8_0 / 4};
    const uint16_t colsb[8] = {64, 64, 64, 64, QK8_0, QK8_0, 64, 64};
    amx_config(8, rows, colsb);
}

// Q4_0's stored nibble is q ^ 8 (q4_0x8_pack): the value it stands for, q - 8, by nibble
static const int8_t q4_0x8_values[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};

// One block of 16 repacked rows (groups x0: rows 0-7, x1: rows 8-15, each block_bytes, its 128 nibble bytes at qs)
// as a B tile of the values the nibbles stand for (table); returns the rows' scales (lut4x8_scales)
AMX_TARGET static inline __attribute__((always_inline)) __m512 lut4x8_amx_unpack(const uint8_t * x0, const uint8_t * x1,
                                                                                 bool mx, __m512i table,
                                                                                 uint8_t b[QK8_0 / 4][64]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint8_t * xs[2] = {x0, x1};
    __m512i w[2][4];
    for (int k = 0; k < 2; ++k) {
        // as q4_0x8_cols reads them: qword r holds 8 values of row r
        const uint8_t * qs = mx ? ((const mxfp4x8 *) xs[k])->qs : ((const q4_0x8 *) xs[k])->qs;
        const __m512i lo = _mm512_loadu_si512((const void *) qs), hi = _mm512_loadu_si512((const void *) (qs + 64));
        w[k][0] = _mm512_shuffle_epi8(table, _mm512_and_si512(lo, m4));
        w[k][1] = _mm512_shuffle_epi8(table, _mm512_and_si512(hi, m4));
        w[k][2] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4));
        w[k][3] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(hi, 4), m4));
    }
    for (int j = 0; j < 4; ++j) amx_store_rows(w[0][j], w[1][j], b + 2 * j);  // values 8j + 0..7
    return _mm512_insertf32x8(_mm512_castps256_ps512(lut4x8_scales(mx, x0)), lut4x8_scales(mx, x1), 1);
}

// One block's products (prod: [token][row]) into the accumulators of the tile's nc tokens: fmadd(isum, xd x yd, acc)
static inline __attribute__((always_inline)) void amx_32_step(const int32_t prod[AMX_COLS][16], __m512 xd,
                                                             const float * yd, float acc[AMX_COLS][16], int nc,
                                                             bool first) {
    for (int c = 0; c < nc; ++c) {
        const __m512 prev = first ? _mm512_setzero_ps() : _mm512_load_ps(acc[c]);
        _mm512_store_ps(acc[c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *) prod[c])),
                                                _mm512_mul_ps(xd, _mm512_set1_ps(yd[c])), prev));
    }
}

// A round issued but not yet summed: one or two blocks of one tile of tokens
typedef struct {
    const amx_tokens_32 * y;
    float (*acc)[16];
    __m512 xd[2];
    int nc, two, first;
} amx_32_round;

#define AMX_32_ISSUE(C0, C1, y, b, two) do {                                                              \
        _tile_zero(C0); _tile_loadd(4, (y)[0].q, QK8_0); _tile_loadd(6, (b)[0], 64); _tile_dpbssd(C0, 4, 6); \
        if (two) { _tile_zero(C1); _tile_loadd(5, (y)[1].q, QK8_0); _tile_loadd(7, (b)[1], 64); _tile_dpbssd(C1, 5, 7); } \
    } while (0)

#define AMX_32_SUM(C0, C1, r, prod) do {                                                                       \
        _tile_stored(C0, (prod)[0], 64);                                                                    \
        amx_32_step((const int32_t (*)[16]) (prod)[0], (r).xd[0], (r).y[0].d, (r).acc, (r).nc, (r).first);     \
        if ((r).two) {                                                                                      \
            _tile_stored(C1, (prod)[1], 64);                                                                \
            amx_32_step((const int32_t (*)[16]) (prod)[1], (r).xd[1], (r).y[1].d, (r).acc, (r).nc, false);   \
        }                                                                                                   \
    } while (0)

// 16 repacked Q4_0, IQ4_NL or MXFP4 rows at a time against every token, as q4_Kx8_amx_rows. Rounds of two blocks x
// one tile of tokens alternate between two pairs of product tiles: a round's products are issued before the previous
// round's are stored and summed, so the float steps run while the tile unit multiplies.
AMX_TARGET static int64_t lut4x8_amx_rows(enum ggml_type type, int nb, const void * x, int64_t nrows,
                                          const amx_tokens_32 * toks, int ncols, float * out, size_t out_stride,
                                          amx_scratch * scratch) {
    const int ntiles = (ncols + AMX_COLS - 1) / AMX_COLS;
    const bool mx = type == GGML_TYPE_MXFP4;
    const size_t block_bytes = mx ? sizeof(mxfp4x8) : sizeof(q4_0x8);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) (
        type == GGML_TYPE_Q4_0 ? q4_0x8_values : mx ? kvalues_fp4 : iq4_values)));
    amx_config_32(ntiles == 1 ? ncols : AMX_COLS);
    uint8_t b[2][QK8_0 / 4][64] __attribute__((aligned(64)));
    int32_t prod[2][2][AMX_COLS][16] __attribute__((aligned(64)));  // [round parity][block]
    for (int64_t p = 0; p < nrows / 16; ++p) {
        const uint8_t * x0 = (const uint8_t *) x + 2 * p * nb * block_bytes, * x1 = x0 + nb * block_bytes;
        amx_32_round prev = {0};
        int n_rounds = 0;
        for (int i = 0; i < nb; i += 2) {
            const int two = i + 1 < nb;  // a second block in this round
            __m512 xd[2];
            for (int k = 0; k <= two; ++k) {
                const uint8_t * g0 = x0 + (i + k) * block_bytes, * g1 = x1 + (i + k) * block_bytes;
                prefetch_stream(g0, block_bytes);
                prefetch_stream(g1, block_bytes);
                prefetch_stream_l2(g0, block_bytes);
                prefetch_stream_l2(g1, block_bytes);
                xd[k] = lut4x8_amx_unpack(g0, g1, mx, table, b[k]);
            }
            for (int t = 0; t < ntiles; ++t) {
                const amx_32_round r = {toks + (size_t) t * nb + i, scratch[t].acc, {xd[0], xd[1]},
                                        amx_tile_cols(ncols, t), two, i == 0};
                if (n_rounds % 2 == 0) {
                    AMX_32_ISSUE(0, 1, r.y, b, two);
                    if (n_rounds) AMX_32_SUM(2, 3, prev, prod[1]);
                } else {
                    AMX_32_ISSUE(2, 3, r.y, b, two);
                    AMX_32_SUM(0, 1, prev, prod[0]);
                }
                prev = r;
                ++n_rounds;
            }
        }
        if (n_rounds % 2) {
            AMX_32_SUM(0, 1, prev, prod[0]);
        } else {
            AMX_32_SUM(2, 3, prev, prod[1]);
        }
        for (int c = 0; c < ncols; ++c) {
            _mm512_storeu_ps(out + (size_t) c * out_stride + 16 * p, _mm512_load_ps(scratch[c / AMX_COLS].acc[c % AMX_COLS]));
        }
    }
    _tile_release();
    return nrows / 16 * 16;
}

// Repacked Q4_K, Q6_K, Q4_0, IQ4_NL or MXFP4 rows through AMX tile products, the tokens laid out as tiles first
// (q8_K superblocks, or q8_0 blocks for the 32-value types); returns the rows done
// (a multiple of 16; 0 out of memory, where the VNNI kernel does every row). The caller checks amx_ready().
static int64_t amx_run(enum ggml_type type, int n, const void * x, int64_t nrows, const char * ycols, size_t row_size,
                       int ncols, float * dst, size_t dst_stride) {
    const int ntiles = (ncols + AMX_COLS - 1) / AMX_COLS;
    const bool q0 = amx_32_type(type);
    const int nb = q0 ? n / QK8_0 : n / QK_K;
    void * toks = aligned_alloc(64, (q0 ? sizeof(amx_tokens_32) : sizeof(amx_tokens)) * (size_t) nb * ntiles);
    amx_scratch * scratch = aligned_alloc(64, sizeof(amx_scratch) * (size_t) ntiles);
    int64_t done = 0;
    if (toks && scratch) {
        if (q0) {
            amx_tokens_32_fill(nb, ycols, row_size, ncols, toks);
            done = lut4x8_amx_rows(type, nb, x, nrows, toks, ncols, dst, dst_stride, scratch);
        } else {
            amx_tokens_fill(nb, ycols, row_size, ncols, toks);
            done = type == GGML_TYPE_Q4_K ? q4_Kx8_amx_rows(nb, x, nrows, toks, ncols, dst, dst_stride, scratch)
                                          : q6_Kx8_amx_rows(nb, x, nrows, toks, ncols, dst, dst_stride, scratch);
        }
    }
    free(toks);
    free(scratch);
    return done;
}

// ... where it pays
static int64_t amx_rows(enum ggml_type type, int n, const void * x, int64_t nrows, const char * ycols, size_t row_size,
                        int ncols, float * dst, size_t dst_stride) {
    const bool k_quant = type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K;
    const int64_t min_cols = amx_min_cols ? amx_min_cols : k_quant ? AMX_MIN_COLS : AMX_MIN_COLS_32;
    if (!(k_quant || amx_32_type(type)) || ncols < min_cols || nrows < 16 || !amx_ready()) {
        return 0;
    }
    return amx_run(type, n, x, nrows, ycols, row_size, ncols, dst, dst_stride);
}

#endif

static size_t repacked_group_bytes(enum ggml_type type, int n) {
    switch (type) {
        case GGML_TYPE_Q4_K: return (size_t) (n / QK_K) * sizeof(q4_Kx8);
        case GGML_TYPE_Q6_K: return (size_t) (n / QK_K) * sizeof(q6_Kx8);
        case GGML_TYPE_MXFP4: return (size_t) (n / QK8_0) * sizeof(mxfp4x8);
#ifdef SPECULANT_MM_HAVE_Q2_KX8
        case GGML_TYPE_Q2_K: return (size_t) (n / QK_K) * sizeof(q2_Kx8);
#endif
        default:             return (size_t) (n / QK8_0) * sizeof(q4_0x8);
    }
}

// 8 repacked rows (x) against ncols columns, `group` columns per weight unpacking; column c's 8 results at
// out + c * out_stride. ysums: the q8_0 block sums of the columns (Q4_0; IQ4_NL and MXFP4 where LUT4X8_SUMS).
static void repacked_group(enum ggml_type type, int n, const void * x, const char * ycols, size_t row_size, int ncols,
                           int group, const int32_t * ysums, const int * order, float * out, size_t out_stride) {
    for (int c0 = 0; c0 < ncols; c0 += group) {
        const int nc = ncols - c0 < group ? ncols - c0 : group;
        const block_q8_K * yk[REPACKED_COLS] = {0};
        const block_q8_0 * y0[REPACKED_COLS] = {0};
        const int32_t * ys[REPACKED_COLS] = {0};
        float * o[REPACKED_COLS] = {0};
        for (int c = 0; c < nc; ++c) {
            yk[c] = (const block_q8_K *) (ycols + (size_t) (c0 + c) * row_size);
            y0[c] = (const block_q8_0 *) (ycols + (size_t) (c0 + c) * row_size);
            ys[c] = ysums ? ysums + (size_t) (c0 + c) * (n / QK8_0) : NULL;
            o[c] = out + (size_t) (c0 + c) * out_stride;
        }
        switch (type) {
            case GGML_TYPE_Q4_K: SPECULANT_BY_NC_REPACKED(nc, q4_Kx8_cols, n / QK_K, x, yk, order, o); break;
            case GGML_TYPE_Q6_K: SPECULANT_BY_NC_REPACKED(nc, q6_Kx8_cols, n / QK_K, x, yk, order, o); break;
#ifdef SPECULANT_MM_HAVE_Q2_KX8
            case GGML_TYPE_Q2_K: SPECULANT_BY_NC_REPACKED(nc, q2_Kx8_cols, n / QK_K, x, yk, order, o); break;
#endif
            case GGML_TYPE_IQ4_NL: SPECULANT_BY_NC_REPACKED(nc, lut4x8_cols, false, n / QK8_0, x, y0, ys, order, o); break;
            case GGML_TYPE_MXFP4:  SPECULANT_BY_NC_REPACKED(nc, lut4x8_cols, true, n / QK8_0, x, y0, ys, order, o); break;
            default:             SPECULANT_BY_NC_REPACKED(nc, q4_0x8_cols, n / QK8_0, x, y0, ys, order, o); break;
        }
    }
}

bool speculant_mm_repacked_supported(enum ggml_type type, int interleave, int rows) {
#ifdef SPECULANT_MM_HAVE_Q2_KX8
    const bool q2_K = type == GGML_TYPE_Q2_K;  // repacked by llama.cpp where AVX-512 is, and only there
#else
    const bool q2_K = false;
#endif
    return (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K || type == GGML_TYPE_Q4_0 || type == GGML_TYPE_IQ4_NL
            || type == GGML_TYPE_MXFP4 || q2_K)
        && interleave == 8 && rows == 8;
}

void ggml_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_0_8x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_iq4_nl_8x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_mxfp4_8x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q2_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

// the q8_0 block sums of the columns where the repacked kernel of `type` reads them (Q4_0; IQ4_NL and MXFP4 where
// LUT4X8_SUMS), in `stack` if `stack_len` holds them, else in a malloc'ed array (the caller frees what is not stack);
// NULL for the other types
static int32_t * repacked_ysums(enum ggml_type type, int n, const char * ycols, size_t row_size, int ncols,
                                int32_t * stack, size_t stack_len) {
#ifdef LUT4X8_SUMS
    const bool sums = type == GGML_TYPE_Q4_0 || type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_MXFP4;
#else
    const bool sums = type == GGML_TYPE_Q4_0;
#endif
    if (!sums) {
        return NULL;
    }
    const size_t need = (size_t) ncols * (n / QK8_0);
    int32_t * ysums = need <= stack_len ? stack : malloc(sizeof(int32_t) * need);
    GGML_ASSERT(ysums);
    q8_0_block_sums(n / QK8_0, ycols, row_size, ncols, ysums);
    return ysums;
}

static void repacked_rows(enum ggml_type type, int n, const void * x, int64_t nrows, const void * wdata,
                          size_t row_size, int ncols, int group, const int * order, float * dst, size_t dst_stride) {
    if ((type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_MXFP4 || type == GGML_TYPE_Q2_K) && ncols == 1 && !order) {
        // one token: ggml's own gemv, the same bits as our kernel and 1.5% faster per decode step in paired A/Bs
        // on a whole model (AVX2, 2 threads; IQ4_NL, whose template MXFP4's shares); Q2_K's decode steps as before
        switch (type) {
            case GGML_TYPE_IQ4_NL: ggml_gemv_iq4_nl_8x8_q8_0(n, dst, 0, x, wdata, 1, (int) nrows); break;
            case GGML_TYPE_MXFP4:  ggml_gemv_mxfp4_8x8_q8_0(n, dst, 0, x, wdata, 1, (int) nrows); break;
            default:               ggml_gemv_q2_K_8x8_q8_K(n, dst, 0, x, wdata, 1, (int) nrows); break;
        }
        return;
    }
    int32_t stack_sums[SCRATCH_BYTES / sizeof(int32_t)];  // this runs per chunk of rows: no allocation if it fits
    int32_t * ysums = repacked_ysums(type, n, wdata, row_size, ncols, stack_sums, sizeof(stack_sums) / sizeof(int32_t));
    const size_t group_bytes = repacked_group_bytes(type, n);
#ifdef SPECULANT_MM_AMX
    if (!order) {  // tile products for 16 rows at a time, where amx_rows takes the type and pass
        const int64_t done = amx_rows(type, n, x, nrows, wdata, row_size, ncols, dst, dst_stride);
        x = (const char *) x + done / 8 * group_bytes;
        dst += done;
        nrows -= done;
    }
#endif
    for (int64_t g = 0; g < nrows / 8; ++g) {
        repacked_group(type, n, (const char *) x + g * group_bytes, wdata, row_size, ncols, group, ysums, order,
                       dst + 8 * g, dst_stride);
    }
    if (ysums != stack_sums) {
        free(ysums);
    }
}

void speculant_mm_repacked_rows(enum ggml_type type, int n, const void * x, int64_t nrows, const void * wdata,
                                size_t row_size, int ncols, float * dst, size_t dst_stride) {
    repacked_rows(type, n, x, nrows, wdata, row_size, ncols, REPACKED_COLS, NULL, dst, dst_stride);
}

// -- ggml's own layout changes (repack.cpp), for tests that start from plain rows --

static void q6_Kx8_pack(const block_q6_K * rows, int nb, q6_Kx8 * out) {
    for (int i = 0; i < nb; ++i) {
        q6_Kx8 * o = out + i;
        uint8_t * ql = o->q, * qh = o->q + 1024;  // ggml's layout (make_block_q6_Kx8), then ours, as the repack does
        for (int r = 0; r < 8; ++r) {
            const block_q6_K * in = rows + (size_t) r * nb + i;
            o->d[r] = in->d;
            for (int g = 0; g < 16; ++g) o->scales[8 * g + r] = in->scales[g];
            for (int k = 0; k < 16; ++k) memcpy(ql + 64 * k + 8 * r, in->ql + 8 * k, 8);
            for (int k = 0; k < 8; ++k) memcpy(qh + 64 * k + 8 * r, in->qh + 8 * k, 8);
        }
        speculant_mm_q6_Kx8_reorder(o);
    }
}

// ggml's own layout change (repack.cpp, make_block_q4_Kx8), for tests that start from plain Q4_K rows
static void q4_Kx8_pack(const block_q4_K * rows, int nb, q4_Kx8 * out) {
    for (int i = 0; i < nb; ++i) {
        const block_q4_K * in[8];
        for (int r = 0; r < 8; ++r) in[r] = rows + (size_t) r * nb + i;
        q4_Kx8 * o = out + i;
        for (int r = 0; r < 8; ++r) { o->d[r] = in[r]->d; o->dmin[r] = in[r]->dmin; }
        for (int k = 0; k < 128; ++k) memcpy(o->qs + 8 * k, in[k % 8]->qs + 8 * (k / 8), 8);
        for (int j = 0; j < 8; ++j) {  // every row's scale and min of sub-block j, packed as K-quants pack 8 of them
            uint8_t s[8], m[8];
            for (int r = 0; r < 8; ++r) {
                const uint8_t * q = in[r]->scales;
                if (j < 4) {
                    s[r] = q[j] & 63;
                    m[r] = q[j + 4] & 63;
                } else {
                    s[r] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
                    m[r] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
                }
            }
            uint8_t * p = o->scales + 12 * j;
            for (int r = 0; r < 4; ++r) {
                p[r] = s[r] | ((s[r + 4] >> 4) << 6);
                p[r + 4] = m[r] | ((m[r + 4] >> 4) << 6);
                p[r + 8] = (s[r + 4] & 0xF) | ((m[r + 4] & 0xF) << 4);
            }
        }
    }
}


// make_block_q4_0x8: chunk k of 8 bytes is bytes 8(k/8)..+7 of row k%8, XOR 0x88 (make_block_iq4_nlx8: no XOR;
// block_iq4_nl has block_q4_0's layout)
static void q4_0x8_pack(const block_q4_0 * rows, int nb, uint8_t xor_mask, q4_0x8 * out) {
    for (int i = 0; i < nb; ++i) {
        q4_0x8 * o = out + i;
        for (int r = 0; r < 8; ++r) o->d[r] = rows[(size_t) r * nb + i].d;
        for (int k = 0; k < 16; ++k) {
            const uint8_t * src = rows[(size_t) (k % 8) * nb + i].qs + 8 * (k / 8);
            for (int b = 0; b < 8; ++b) o->qs[8 * k + b] = src[b] ^ xor_mask;
        }
    }
}

_Static_assert(sizeof(block_iq4_nl) == sizeof(block_q4_0), "block_iq4_nl has block_q4_0's layout");

// make_block_mxfp4x8: the exponents, then q4_0x8's chunks without the XOR
#ifdef SPECULANT_MM_HAVE_Q2_KX8
static void q2_Kx8_pack(const block_q2_K * rows, int nb, q2_Kx8 * out) {
    for (int i = 0; i < nb; ++i) {
        q2_Kx8 * o = out + i;
        for (int r = 0; r < 8; ++r) {
            o->d[r] = rows[(size_t) r * nb + i].d;
            o->dmin[r] = rows[(size_t) r * nb + i].dmin;
        }
        for (int k = 0; k < 64; ++k) memcpy(o->qs + 8 * k, rows[(size_t) (k % 8) * nb + i].qs + 8 * (k / 8), 8);
        for (int k = 0; k < 128; ++k) o->scales[k] = rows[(size_t) ((k % 16) / 2) * nb + i].scales[2 * (k / 16) + k % 2];
    }
}
#endif

static void mxfp4x8_pack(const block_mxfp4 * rows, int nb, mxfp4x8 * out);

// 8 plain rows of nb blocks (x) in the repacked layout of their type, as llama.cpp lays them out
static void repack_group(enum ggml_type type, const void * x, int nb, void * out) {
    switch (type) {
        case GGML_TYPE_Q4_K: q4_Kx8_pack(x, nb, out); break;
        case GGML_TYPE_Q6_K: q6_Kx8_pack(x, nb, out); break;
        case GGML_TYPE_IQ4_NL: q4_0x8_pack(x, nb, 0, out); break;
        case GGML_TYPE_MXFP4: mxfp4x8_pack(x, nb, out); break;
#ifdef SPECULANT_MM_HAVE_Q2_KX8
        case GGML_TYPE_Q2_K: q2_Kx8_pack(x, nb, out); break;
#endif
        default:             q4_0x8_pack(x, nb, 0x88, out); break;
    }
}

// -- the same layouts, made per pass from plain rows (plain_repacked_rows): word moves and bit tricks instead of
// the byte loops above, whose Q4_K scale packing alone cost more than a one-token pass over the rows --

// a[r] byte j -> a[j] byte r
static inline void transpose8x8_bytes(uint64_t a[8]) {
    for (int r = 0; r < 8; r += 2) {
        const uint64_t t = ((a[r] >> 8) ^ a[r + 1]) & 0x00FF00FF00FF00FFull;
        a[r + 1] ^= t;
        a[r] ^= t << 8;
    }
    for (int r = 0; r < 8; r += (r % 4 == 1) ? 3 : 1) {  // 0, 1, 4, 5
        const uint64_t t = ((a[r] >> 16) ^ a[r + 2]) & 0x0000FFFF0000FFFFull;
        a[r + 2] ^= t;
        a[r] ^= t << 16;
    }
    for (int r = 0; r < 4; ++r) {
        const uint64_t t = ((a[r] >> 32) ^ a[r + 4]) & 0x00000000FFFFFFFFull;
        a[r + 4] ^= t;
        a[r] ^= t << 32;
    }
}

static inline uint64_t load_u64(const void * p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

// Each reads its 8 rows one after the other, front to back (one block of memory, which hardware prefetchers follow:
// reading the 8 rows side by side ran at a quarter of the memory's speed on Zen 4), and scatters them into the group.
#define PACK_MAX_BLOCKS 64  // superblocks per row whose scales are gathered on the stack (16384 values); more: in parts

static void q4_Kx8_pack_fast(const block_q4_K * rows, int nb, q4_Kx8 * out) {
    for (int i0 = 0; i0 < nb; i0 += PACK_MAX_BLOCKS) {
        const int n = nb - i0 < PACK_MAX_BLOCKS ? nb - i0 : PACK_MAX_BLOCKS;
        uint64_t s[PACK_MAX_BLOCKS][8], m[PACK_MAX_BLOCKS][8];  // [i][r] byte j: row r's scale (min) of sub-block j
        for (int r = 0; r < 8; ++r) {
            for (int i = 0; i < n; ++i) {
                const block_q4_K * in = rows + (size_t) r * nb + i0 + i;
                prefetch_stream(in, sizeof(*in));  // on into the next rows and group: one stream
                prefetch_stream_l2(in, sizeof(*in));
                q4_Kx8 * o = out + i0 + i;
                o->d[r] = in->d;
                o->dmin[r] = in->dmin;
                k_scales_mins64(in->scales, &s[i][r], &m[i][r]);
                for (int k = 0; k < 16; ++k) memcpy(o->qs + 64 * k + 8 * r, in->qs + 8 * k, 8);
            }
        }
        for (int i = 0; i < n; ++i) {
            transpose8x8_bytes(s[i]);  // s[i][j] byte r
            transpose8x8_bytes(m[i]);
            for (int j = 0; j < 8; ++j) {  // q4_Kx8_pack's packing, 4 rows per 32-bit word (every value < 64)
                const uint32_t slo = (uint32_t) s[i][j], shi = (uint32_t) (s[i][j] >> 32);
                const uint32_t mlo = (uint32_t) m[i][j], mhi = (uint32_t) (m[i][j] >> 32);
                const uint32_t p[3] = {slo | (((shi >> 4) & 0x03030303u) << 6), mlo | (((mhi >> 4) & 0x03030303u) << 6),
                                       (shi & 0x0F0F0F0Fu) | ((mhi & 0x0F0F0F0Fu) << 4)};
                memcpy(out[i0 + i].scales + 12 * j, p, 12);
            }
        }
    }
}

// q6_Kx8_pack followed by speculant_mm_q6_Kx8_reorder, written in the final order at once
static void q6_Kx8_pack_fast(const block_q6_K * rows, int nb, q6_Kx8 * out) {
    for (int r = 0; r < 8; ++r) {
        for (int i = 0; i < nb; ++i) {
            const block_q6_K * in = rows + (size_t) r * nb + i;
            q6_Kx8 * o = out + i;
            for (int h = 0; h < 2; ++h) {
                for (int kk = 0; kk < 4; ++kk) {
                    uint8_t * step = o->q + 192 * (4 * h + kk) + 8 * r;
                    memcpy(step, in->ql + 8 * (8 * h + kk), 8);
                    memcpy(step + 64, in->ql + 8 * (8 * h + 4 + kk), 8);
                    memcpy(step + 128, in->qh + 8 * (4 * h + kk), 8);
                }
            }
            // scales[8g + r]: row r's scale g (transposed below), d[r]
            memcpy(o->scales + 8 * r, in->scales, 8);
            memcpy(o->scales + 64 + 8 * r, in->scales + 8, 8);
            o->d[r] = in->d;
        }
    }
    for (int i = 0; i < nb; ++i) {
        uint64_t lo[8], hi[8];  // lo[r]: row r's scales 0..7, as copied above
        memcpy(lo, out[i].scales, 64);
        memcpy(hi, out[i].scales + 64, 64);
        transpose8x8_bytes(lo);
        transpose8x8_bytes(hi);
        memcpy(out[i].scales, lo, 64);
        memcpy(out[i].scales + 64, hi, 64);
    }
}

static void q4_0x8_pack_fast(const block_q4_0 * rows, int nb, uint64_t xor_mask, q4_0x8 * out) {
    for (int r = 0; r < 8; ++r) {
        for (int i = 0; i < nb; ++i) {
            const block_q4_0 * in = rows + (size_t) r * nb + i;
            prefetch_stream(in, sizeof(*in));
            prefetch_stream_l2(in, sizeof(*in));
            out[i].d[r] = in->d;
            for (int b = 0; b < 2; ++b) {  // chunk 8b + r: bytes 8b..8b+7 of row r
                const uint64_t v = load_u64(in->qs + 8 * b) ^ xor_mask;
                memcpy(out[i].qs + 8 * (8 * b + r), &v, 8);
            }
        }
    }
}

// repack_group's layouts, faster
static void repack_group_fast(enum ggml_type type, const void * x, int nb, void * out) {
    switch (type) {
        case GGML_TYPE_Q4_K: q4_Kx8_pack_fast(x, nb, out); break;
        case GGML_TYPE_Q6_K: q6_Kx8_pack_fast(x, nb, out); break;
        case GGML_TYPE_Q4_0: q4_0x8_pack_fast(x, nb, 0x8888888888888888ull, out); break;
        case GGML_TYPE_IQ4_NL: q4_0x8_pack_fast(x, nb, 0, out); break;
        default: repack_group(type, x, nb, out); break;
    }
}

static void mxfp4x8_pack(const block_mxfp4 * rows, int nb, mxfp4x8 * out) {
    for (int i = 0; i < nb; ++i) {
        mxfp4x8 * o = out + i;
        for (int r = 0; r < 8; ++r) o->e[r] = rows[(size_t) r * nb + i].e;
        for (int k = 0; k < 16; ++k) memcpy(o->qs + 8 * k, rows[(size_t) (k % 8) * nb + i].qs + 8 * (k / 8), 8);
    }
}

// -- plain layout, 32-value blocks: Q8_0, Q5_0, Q4_0 against q8_0 columns; Q4_1, Q5_1 against q8_1 --
//
// Per output element the float operations of ggml's AVX2 dot products (ggml_vec_dot_q8_0_q8_0 and its Q5_0 and
// Q4_0 siblings; ggml_vec_dot_q4_1_q8_1, _q5_1_q8_1): per block, eight int32 lane sums of 4 products each,
// converted to float, one fused multiply-add by x.d * y.d into an 8-lane accumulator; the same horizontal sum at
// the end. Q4_1 and Q5_1 blocks also carry a minimum m, and the column's q8_1 block the sum s of its values (times
// its d): their products are summed in a float of their own and added last, as ggml does. The block's 32 values
// are unpacked (and their absolute values taken) once for all columns.

// true for the types with a minimum (Q4_1, Q5_1), whose columns are q8_1 rows
static inline bool q0_has_min(enum ggml_type type) {
    return type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1;
}

// what is added to a block's values to make them unsigned bytes (Q4_1 and Q5_1 values are unsigned already)
static inline int q0_offset(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q8_0: return 128;
        case GGML_TYPE_Q5_0: return 16;
        case GGML_TYPE_Q4_0: return 8;
        default:             return 0;
    }
}

// column block i's values, d and s (s: q8_1 columns only)
static inline const int8_t * q0_col_qs(enum ggml_type type, const void * y, int i) {
    return q0_has_min(type) ? ((const block_q8_1 *) y)[i].qs : ((const block_q8_0 *) y)[i].qs;
}

static inline float q0_col_d(enum ggml_type type, const void * y, int i) {
    return fp16_to_fp32(q0_has_min(type) ? ((const block_q8_1 *) y)[i].d : ((const block_q8_0 *) y)[i].d);
}

static inline float q0_col_s(const void * y, int i) {
    return fp16_to_fp32(((const block_q8_1 *) y)[i].s);
}

// Rows taken RM at a time (RM > 1) are RM streams side by side: prefetching each row prefetch_ahead bytes on runs
// into the next row, which its own stream is reading already, and the next group of rows starts cold (Q8_0 rows of
// 1536 values are 1632 bytes: a 2-token pass of Qwen 1.5B Q8_0 cost 1.40 one-token passes, waiting on its loads).
// So each stream prefetches where it will read: prefetch_ahead bytes on in its row, or past the row's end, in the
// row RM further on (the same stream's next row). One line per block (these blocks are under 64 bytes).
static inline __attribute__((always_inline)) void q0_prefetch_rows(const char * x, size_t x_stride, int RM, int r,
                                                                  size_t block_offset) {
    if (prefetch_ahead == 0) return;
    const size_t t = block_offset + (size_t) prefetch_ahead;
    __builtin_prefetch(t < x_stride ? x + r * x_stride + t : x + (r + RM) * x_stride + (t - x_stride), 0, 3);
}

static inline size_t q0_block_bytes(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q8_0: return sizeof(block_q8_0);
        case GGML_TYPE_Q5_0: return sizeof(block_q5_0);
        case GGML_TYPE_Q4_1: return sizeof(block_q4_1);
        case GGML_TYPE_Q5_1: return sizeof(block_q5_1);
        default:             return sizeof(block_q4_0);
    }
}

// the 32 values of block i plus q0_offset(type), value j in byte j (0..255); pf: prefetch along the row (a kernel
// that reads one row at a time), else the caller prefetches (q0_prefetch_rows)
static inline __m256i q0_unsigned_pf(enum ggml_type type, const void * x, int i, const bool pf) {
    if (type == GGML_TYPE_Q8_0) {
        if (pf) prefetch_stream((const block_q8_0 *) x + i, 1);
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) ((const block_q8_0 *) x)[i].qs),
                                _mm256_set1_epi8((char) 0x80));
    }
    const uint8_t * qs;
    switch (type) {
        case GGML_TYPE_Q4_0: qs = ((const block_q4_0 *) x)[i].qs; break;
        case GGML_TYPE_Q5_0: qs = ((const block_q5_0 *) x)[i].qs; break;
        case GGML_TYPE_Q4_1: qs = ((const block_q4_1 *) x)[i].qs; break;
        default:             qs = ((const block_q5_1 *) x)[i].qs; break;
    }
    if (pf) prefetch_stream(qs, 1);
    const __m128i packed = _mm_loadu_si128((const __m128i *) qs);  // value j in the low nibble of byte j, j+16 high
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0xF));
    if (type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1) {
        return nibbles;
    }
    uint32_t qh;  // Q5_0, Q5_1: bit j is value j's fifth bit
    memcpy(&qh, type == GGML_TYPE_Q5_0 ? ((const block_q5_0 *) x)[i].qh : ((const block_q5_1 *) x)[i].qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int) qh),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x((int64_t) 0x8040201008040201);
    return _mm256_or_si256(nibbles, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                                     _mm256_set1_epi8(0x10)));
}

static inline float q0_scale(enum ggml_type type, const void * x, int i) {
    switch (type) {
        case GGML_TYPE_Q8_0: return fp16_to_fp32(((const block_q8_0 *) x)[i].d);
        case GGML_TYPE_Q5_0: return fp16_to_fp32(((const block_q5_0 *) x)[i].d);
        case GGML_TYPE_Q4_1: return fp16_to_fp32(((const block_q4_1 *) x)[i].d);
        case GGML_TYPE_Q5_1: return fp16_to_fp32(((const block_q5_1 *) x)[i].d);
        default:             return fp16_to_fp32(((const block_q4_0 *) x)[i].d);
    }
}

// Q4_1, Q5_1: block i's minimum
static inline float q0_min(enum ggml_type type, const void * x, int i) {
    return fp16_to_fp32(type == GGML_TYPE_Q4_1 ? ((const block_q4_1 *) x)[i].m : ((const block_q5_1 *) x)[i].m);
}

// per column and block, what the kernels need besides its values: -offset x (sums of 4 adjacent values), the
// int32 lanes that make the unsigned dot product the signed one, and y.d as a float
typedef struct {
    int32_t corr[8];
    float d;
} q0_col;

// Rows per kernel call: each streams from memory on its own, and several streams keep more loads in flight than
// one (a block of one row is soon consumed). The accumulators of RM rows x 4 tokens must fit in the registers.
#if defined(__AVX512VL__)
#define Q0_RM 4
#else
#define Q0_RM 2
#endif

#ifdef Q0_UNSIGNED

// RM rows (x_stride bytes apart) x NC columns; out[r * SPECULANT_MM_COLS + c]. The int32 lanes: sums of 4 adjacent
// products (x + offset) * y, less offset * (sums of 4 adjacent y): the lanes of ggml's x * y.
static inline __attribute__((always_inline)) void dot_q0(const int NC, const enum ggml_type type, const int RM,
                                                        const int nb, const char * x, size_t x_stride,
                                                        const void * const * y, const q0_col * const * cols,
                                                        const int * order, float * out) {
    __m256 acc[Q0_RM][SPECULANT_MM_COLS];
    float summs[Q0_RM][SPECULANT_MM_COLS];  // Q4_1, Q5_1: the sum of x.m * y.s
    for (int r = 0; r < RM; ++r) for (int c = 0; c < NC; ++c) { acc[r][c] = _mm256_setzero_ps(); summs[r][c] = 0.0f; }
    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        __m256i u[Q0_RM];
        __m256 dx[Q0_RM];
        float mx[Q0_RM];
        for (int r = 0; r < RM; ++r) {
            const bool rows_pf = RM > 1 && !q0_has_min(type);  // Q4_1, Q5_1 (SmolLM2's rows) not measured faster
            if (rows_pf) q0_prefetch_rows(x, x_stride, RM, r, (size_t) i * q0_block_bytes(type));
            u[r] = q0_unsigned_pf(type, x + r * x_stride, i, !rows_pf);
            dx[r] = _mm256_set1_ps(q0_scale(type, x + r * x_stride, i));
            mx[r] = q0_has_min(type) ? q0_min(type, x + r * x_stride, i) : 0.0f;
        }
        for (int c = 0; c < NC; ++c) {
            const q0_col * col = cols[c] + i;
            // no correction where the values are unsigned already
            const __m256i corr = q0_has_min(type) ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *) col->corr);
            const __m256i yq = _mm256_loadu_si256((const __m256i *) q0_col_qs(type, y[c], i));
            const __m256 dy = _mm256_broadcast_ss(&col->d);
            const float sy = q0_has_min(type) ? q0_col_s(y[c], i) : 0.0f;
            for (int r = 0; r < RM; ++r) {
                if (q0_has_min(type)) {
                    summs[r][c] += mx[r] * sy;  // ggml's scalar expression (and its contraction, if any)
                }
                const __m256 d = _mm256_mul_ps(dx[r], dy);  // x.d * y.d, as ggml's scalar product
                acc[r][c] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q0_dpbusd(corr, u[r], yq)), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < RM; ++r) {
        for (int c = 0; c < NC; ++c) {
            out[r * SPECULANT_MM_COLS + c] = q0_has_min(type) ? hsum8(acc[r][c]) + summs[r][c] : hsum8(acc[r][c]);
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// Q8_0, Q5_0 and Q4_0 rows against up to 8 columns with AVX-512: two columns to a 512-bit register, each 256-bit half
// doing exactly dot_q0's operations for its column (the same int32 lanes, the same x.d * y.d, the same fused
// multiply-add, the same horizontal sum), so the bits are dot_q0's. It takes passes of 5-8 tokens in one pass over
// the weights, where dot_q0 (4 at a time) read them twice: Qwen 1.5B Q8_0, 8 tokens 196 -> 131 ms. Up to 4 tokens
// dot_q0 is as fast (3 tokens faster: a pair would go half empty).
#define Q0_WIDE_COLS 8
#define Q0_WIDE_RM 4

static inline bool q0_wide_type(enum ggml_type type) {
    return type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q4_0;
}

// 32 bytes at a in the low half, 32 at b in the high half
static inline __m512i q0_pair(const void * a, const void * b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) a)),
                              _mm256_loadu_si256((const __m256i *) b), 1);
}

// RM rows (x_stride bytes apart) x NC columns (2 <= NC <= 8; q0_rows sends 5-8); out[r * Q0_WIDE_COLS + c]. An odd last column is
// paired with itself and its second result dropped.
static inline __attribute__((always_inline)) void dot_q0_wide(const int NC, const enum ggml_type type, const int RM,
                                                             const int nb, const char * x, size_t x_stride,
                                                             const void * const * y, const q0_col * const * cols,
                                                             const int * order, float * out) {
    const int NP = (NC + 1) / 2;
    __m512 acc[Q0_WIDE_RM][Q0_WIDE_COLS / 2];
    for (int r = 0; r < RM; ++r) for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        __m512i u[Q0_WIDE_RM];
        __m512 dx[Q0_WIDE_RM];
        for (int r = 0; r < RM; ++r) {
            if (RM > 1) q0_prefetch_rows(x, x_stride, RM, r, (size_t) i * q0_block_bytes(type));
            u[r] = _mm512_broadcast_i64x4(q0_unsigned_pf(type, x + r * x_stride, i, RM == 1));
            dx[r] = _mm512_set1_ps(q0_scale(type, x + r * x_stride, i));
        }
        for (int p = 0; p < NP; ++p) {
            const int c0 = 2 * p, c1 = 2 * p + 1 < NC ? 2 * p + 1 : 2 * p;
            const q0_col * a = cols[c0] + i, * b = cols[c1] + i;
            const __m512i corr = q0_pair(a->corr, b->corr);
            const __m512i yq = q0_pair(q0_col_qs(type, y[c0], i), q0_col_qs(type, y[c1], i));
            const __m512 dy = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a->d), _mm512_set1_ps(b->d));
            for (int r = 0; r < RM; ++r) {
                const __m512 d = _mm512_mul_ps(dx[r], dy);  // x.d * y.d per half, as dot_q0
                acc[r][p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, u[r], yq)), acc[r][p]);
            }
        }
    }
    for (int r = 0; r < RM; ++r) {
        for (int p = 0; p < NP; ++p) {
            out[r * Q0_WIDE_COLS + 2 * p] = hsum8(_mm512_castps512_ps256(acc[r][p]));
            if (2 * p + 1 < NC) {
                out[r * Q0_WIDE_COLS + 2 * p + 1] =
                    hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][p]), 1)));
            }
        }
    }
}

#define Q0_BY_NC8(nc, kernel, ...)                        \
    switch (nc) {                                         \
        case 5: kernel(5, __VA_ARGS__); break;            \
        case 6: kernel(6, __VA_ARGS__); break;            \
        case 7: kernel(7, __VA_ARGS__); break;            \
        default: kernel(8, __VA_ARGS__); break;           \
    }
#endif

static void q0_columns(enum ggml_type type, int nb, const void * const * y, int nc, q0_col * cols) {
    const __m256i offset = _mm256_set1_epi8((char) q0_offset(type));
    for (int c = 0; c < nc; ++c) {
        for (int i = 0; i < nb; ++i) {
            const __m256i yq = _mm256_loadu_si256((const __m256i *) q0_col_qs(type, y[c], i));
            const __m256i sums = q0_dpbusd(_mm256_setzero_si256(), offset, yq);
            _mm256_storeu_si256((__m256i *) cols[(size_t) c * nb + i].corr, _mm256_sub_epi32(_mm256_setzero_si256(), sums));
            cols[(size_t) c * nb + i].d = q0_col_d(type, y[c], i);
        }
    }
}

#else  // no VNNI: |x| times (y signed by x), maddubs + madd, exactly as ggml forms the lanes

// (Q4_1, Q5_1: their unsigned values times y, as ggml's mul_sum_us8_pairs_float)
static inline __attribute__((always_inline)) void dot_q0(const int NC, const enum ggml_type type, const int RM,
                                                        const int nb, const char * x, size_t x_stride,
                                                        const void * const * y, const q0_col * const * cols,
                                                        const int * order, float * out) {
    (void) cols;
    __m256 acc[Q0_RM][SPECULANT_MM_COLS];
    float summs[Q0_RM][SPECULANT_MM_COLS];  // Q4_1, Q5_1: the sum of x.m * y.s
    for (int r = 0; r < RM; ++r) for (int c = 0; c < NC; ++c) { acc[r][c] = _mm256_setzero_ps(); summs[r][c] = 0.0f; }
    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        __m256i qx[Q0_RM], ax[Q0_RM];
        float dx[Q0_RM], mx[Q0_RM];
        for (int r = 0; r < RM; ++r) {
            if (RM > 1) q0_prefetch_rows(x, x_stride, RM, r, (size_t) i * q0_block_bytes(type));
            if (q0_has_min(type)) {
                ax[r] = q0_unsigned_pf(type, x + r * x_stride, i, RM == 1);
                mx[r] = q0_min(type, x + r * x_stride, i);
            } else {
                qx[r] = _mm256_sub_epi8(q0_unsigned_pf(type, x + r * x_stride, i, RM == 1),
                                        _mm256_set1_epi8((char) q0_offset(type)));
                ax[r] = _mm256_sign_epi8(qx[r], qx[r]);
            }
            dx[r] = q0_scale(type, x + r * x_stride, i);
        }
        for (int c = 0; c < NC; ++c) {
            const __m256i yq = _mm256_loadu_si256((const __m256i *) q0_col_qs(type, y[c], i));
            const float dy = q0_col_d(type, y[c], i);
            const float sy = q0_has_min(type) ? q0_col_s(y[c], i) : 0.0f;
            for (int r = 0; r < RM; ++r) {
                const __m256i sy8 = q0_has_min(type) ? yq : _mm256_sign_epi8(yq, qx[r]);
                const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[r], sy8), _mm256_set1_epi16(1));
                if (q0_has_min(type)) {
                    summs[r][c] += mx[r] * sy;  // ggml's scalar expression (and its contraction, if any)
                }
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dx[r] * dy), _mm256_cvtepi32_ps(lanes), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < RM; ++r) {
        for (int c = 0; c < NC; ++c) {
            out[r * SPECULANT_MM_COLS + c] = q0_has_min(type) ? hsum8(acc[r][c]) + summs[r][c] : hsum8(acc[r][c]);
        }
    }
}
#endif

// IQ4_NL (MXFP4) x q8_0 for NC columns, as ggml_vec_dot_iq4_nl_q8_0 (ggml_vec_dot_mxfp4_q8_0) forms it on AVX2:
// the table values times q8 in its sign-trick lanes, blocks 0, 2, 4, ... fused into one accumulator and 1, 3, 5,
// ... into another, the two summed at the end; an odd last block is added in scalar float. 256-bit on every
// level, as for the repacked rows. mx: MXFP4 (kvalues_fp4, an E8M0 scale) rather than IQ4_NL (iq4_values, fp16),
// a constant at every call.
static inline __attribute__((always_inline)) float lut4_scale(const bool mx, const uint8_t * block) {
    return mx ? GGML_CPU_E8M0_TO_FP32_HALF(((const block_mxfp4 *) block)->e)
              : fp16_to_fp32(((const block_iq4_nl *) block)->d);
}

// sumf (the vector part's sum) plus an odd last block i, as ggml's scalar tail adds it: the same expression (and
// its contraction, if any)
static inline __attribute__((always_inline)) float lut4_tail(float sumf, const bool mx, const void * x,
                                                            const block_q8_0 * y, int i) {
    const int8_t * values = mx ? kvalues_fp4 : iq4_values;
    const uint8_t * xb = (const uint8_t *) x + i * (mx ? sizeof(block_mxfp4) : sizeof(block_iq4_nl));
    const uint8_t * qs = xb + (mx ? offsetof(block_mxfp4, qs) : offsetof(block_iq4_nl, qs));
    int sumi1 = 0, sumi2 = 0;
    for (int j = 0; j < QK8_0 / 2; ++j) {
        sumi1 += y[i].qs[j] * values[qs[j] & 0xf];
        sumi2 += y[i].qs[j + QK8_0 / 2] * values[qs[j] >> 4];
    }
    const float d = fp16_to_fp32(y[i].d) * lut4_scale(mx, xb);
    sumf += d * (sumi1 + sumi2);
    return sumf;
}

static inline __attribute__((always_inline)) void dot_lut4(const int NC, const bool mx, const int nb, const void * x,
                                                          const block_q8_0 * const * y, const int * order,
                                                          float * out) {
    const int8_t * values = mx ? kvalues_fp4 : iq4_values;
    const size_t block_bytes = mx ? sizeof(block_mxfp4) : sizeof(block_iq4_nl);
    const size_t qs_offset = mx ? offsetof(block_mxfp4, qs) : offsetof(block_iq4_nl, qs);
    const __m128i values128 = _mm_loadu_si128((const __m128i *) values);
    const __m128i m4b = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][SPECULANT_MM_COLS];
    for (int c = 0; c < NC; ++c) acc[0][c] = acc[1][c] = _mm256_setzero_ps();
    const int paired = nb & ~1;
    for (int ii = 0; ii < paired; ++ii) {
        const int i = order ? order[ii] : ii;
        const uint8_t * xb = (const uint8_t *) x + i * block_bytes;
        prefetch_stream(xb, 1);
        const __m128i q4bits = _mm_loadu_si128((const __m128i *) (xb + qs_offset));
        const __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(values128, _mm_and_si128(_mm_srli_epi16(q4bits, 4), m4b)),
                                           _mm_shuffle_epi8(values128, _mm_and_si128(q4bits, m4b)));
        const __m256i wabs = _mm256_sign_epi8(w, w);
        const float xd = lut4_scale(mx, xb);
        for (int c = 0; c < NC; ++c) {
            const __m256i q8 = _mm256_loadu_si256((const __m256i *) y[c][i].qs);
            const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(q8, w)), ones);
            const float d = fp16_to_fp32(y[c][i].d) * xd;
            acc[ii & 1][c] = fma_lanes(d, lanes, acc[ii & 1][c]);
        }
    }
    for (int c = 0; c < NC; ++c) {
        const float sumf = hsum8(_mm256_add_ps(acc[0][c], acc[1][c]));
        out[c] = paired < nb ? lut4_tail(sumf, mx, x, y[c], order ? order[paired] : paired) : sumf;
    }
}

#ifdef Q0_UNSIGNED
// With VNNI, RM rows at a time: each table value plus 128 as an unsigned byte times q8 (dpbusd), less 128 x the
// sums of 4 adjacent q8 (the column's corr lanes, from q0_columns) is exactly the sign-trick lane (neither
// saturates); the float part is dot_lut4's. out[r * SPECULANT_MM_COLS + c].
#define LUT4_RM (Q0_RM / 2)  // 2 x RM x NC accumulators (even and odd blocks) must fit in the registers

static inline __attribute__((always_inline)) void dot_lut4_vnni(const int NC, const bool mx, const int RM, const int nb,
                                                               const char * x, size_t x_stride,
                                                               const block_q8_0 * const * y,
                                                               const q0_col * const * cols, const int * order,
                                                               float * out) {
    const int8_t * values = mx ? kvalues_fp4 : iq4_values;
    const size_t block_bytes = mx ? sizeof(block_mxfp4) : sizeof(block_iq4_nl);
    const size_t qs_offset = mx ? offsetof(block_mxfp4, qs) : offsetof(block_iq4_nl, qs);
    const __m128i table = _mm_xor_si128(_mm_loadu_si128((const __m128i *) values), _mm_set1_epi8((char) 0x80));
    const __m128i m4b = _mm_set1_epi8(0x0f);
    __m256 acc[2][LUT4_RM][SPECULANT_MM_COLS];
    for (int r = 0; r < RM; ++r) for (int c = 0; c < NC; ++c) acc[0][r][c] = acc[1][r][c] = _mm256_setzero_ps();
    const int paired = nb & ~1;
    for (int ii = 0; ii < paired; ++ii) {
        const int i = order ? order[ii] : ii;
        __m256i u[LUT4_RM];
        float xd[LUT4_RM];
        for (int r = 0; r < RM; ++r) {
            const uint8_t * xb = (const uint8_t *) x + r * x_stride + i * block_bytes;
            prefetch_stream(xb, 1);
            const __m128i q4bits = _mm_loadu_si128((const __m128i *) (xb + qs_offset));
            u[r] = _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q4bits, 4), m4b)),
                                    _mm_shuffle_epi8(table, _mm_and_si128(q4bits, m4b)));
            xd[r] = lut4_scale(mx, xb);
        }
        for (int c = 0; c < NC; ++c) {
            const q0_col * col = cols[c] + i;
            const __m256i corr = _mm256_loadu_si256((const __m256i *) col->corr);
            const __m256i q8 = _mm256_loadu_si256((const __m256i *) y[c][i].qs);
            for (int r = 0; r < RM; ++r) {
                acc[ii & 1][r][c] = fma_lanes(col->d * xd[r], q0_dpbusd(corr, u[r], q8), acc[ii & 1][r][c]);
            }
        }
    }
    for (int r = 0; r < RM; ++r) {
        for (int c = 0; c < NC; ++c) {
            const float sumf = hsum8(_mm256_add_ps(acc[0][r][c], acc[1][r][c]));
            out[r * SPECULANT_MM_COLS + c] =
                paired < nb ? lut4_tail(sumf, mx, x + r * x_stride, y[c], order ? order[paired] : paired) : sumf;
        }
    }
}
#endif

// nrows rows of a 32-value type (x_stride bytes apart) against ncols q8_0 (q8_1) columns, `group` columns per weight
// unpacking; row r x column c at out[r * row_stride + c * col_stride]
// plain IQ4_NL and MXFP4 rows: dot_lut4 (dot_lut4_vnni) takes q8_0 columns (256-bit lanes on every level)
static void lut4_rows(const bool mx, int n, const char * x, size_t x_stride, int64_t nrows, const char * ycols,
                      size_t row_size, int ncols, int group, const int * order, float * out, size_t row_stride,
                      size_t col_stride) {
    const int nb = n / QK8_0;
#ifdef Q0_UNSIGNED
    q0_col stack_cols[SCRATCH_BYTES / sizeof(q0_col)];  // this runs per chunk of rows: no allocation if it fits
    const size_t need = (size_t) nb * group;
    q0_col * cols = need <= sizeof(stack_cols) / sizeof(q0_col) ? stack_cols : malloc(sizeof(q0_col) * need);
#endif
    for (int c0 = 0; c0 < ncols; c0 += group) {
        const int nc = ncols - c0 < group ? ncols - c0 : group;
        const block_q8_0 * y[SPECULANT_MM_COLS] = {0};
        for (int c = 0; c < nc; ++c) y[c] = (const block_q8_0 *) (ycols + (size_t) (c0 + c) * row_size);
#ifdef Q0_UNSIGNED
        const q0_col * cc[SPECULANT_MM_COLS] = {0};
        for (int c = 0; c < nc; ++c) cc[c] = cols + (size_t) c * nb;
        q0_columns(GGML_TYPE_Q8_0, nb, (const void * const *) y, nc, cols);  // q8_0 columns, offset 128
        for (int64_t r0 = 0; r0 < nrows;) {
            const int rm = nc > 1 && nrows - r0 >= LUT4_RM ? LUT4_RM : 1;
            const char * xr = x + r0 * x_stride;
            float tmp[LUT4_RM * SPECULANT_MM_COLS];
            if (mx) {
                if (rm == LUT4_RM) {
                    SPECULANT_BY_NC(nc, dot_lut4_vnni, true, LUT4_RM, nb, xr, x_stride, y, cc, order, tmp);
                } else {
                    SPECULANT_BY_NC(nc, dot_lut4_vnni, true, 1, nb, xr, x_stride, y, cc, order, tmp);
                }
            } else {
                if (rm == LUT4_RM) {
                    SPECULANT_BY_NC(nc, dot_lut4_vnni, false, LUT4_RM, nb, xr, x_stride, y, cc, order, tmp);
                } else {
                    SPECULANT_BY_NC(nc, dot_lut4_vnni, false, 1, nb, xr, x_stride, y, cc, order, tmp);
                }
            }
            for (int r = 0; r < rm; ++r) {
                for (int c = 0; c < nc; ++c) out[(r0 + r) * row_stride + (c0 + c) * col_stride] = tmp[r * SPECULANT_MM_COLS + c];
            }
            r0 += rm;
        }
#else
        for (int64_t r = 0; r < nrows; ++r) {
            float tmp[SPECULANT_MM_COLS];
            if (mx) {
                SPECULANT_BY_NC(nc, dot_lut4, true, nb, x + r * x_stride, y, order, tmp);
            } else {
                SPECULANT_BY_NC(nc, dot_lut4, false, nb, x + r * x_stride, y, order, tmp);
            }
            for (int c = 0; c < nc; ++c) out[r * row_stride + (c0 + c) * col_stride] = tmp[c];
        }
#endif
    }
#ifdef Q0_UNSIGNED
    if (cols != stack_cols) {
        free(cols);
    }
#endif
}

#ifdef Q0_WIDE_COLS
// q0_rows' columns c0 .. c0 + nc - 1 (5 <= nc <= 8) through dot_q0_wide. A function of its own: inlined into q0_rows,
// its 42 kernel instances made GCC allocate q0_rows' registers worse, and every other type's kernel there slowed
// (SmolLM2's Q4_1 layers: a 4-token pass 14.8 -> 18.5 ms).
static __attribute__((noinline)) void q0_wide_rows(enum ggml_type type, int nb, const char * x, size_t x_stride,
                                                   int64_t nrows, const void * const * y, const q0_col * const * cc,
                                                   int nc, int c0, const int * order, float * out, size_t row_stride,
                                                   size_t col_stride) {
    for (int64_t r0 = 0; r0 < nrows;) {
        const int rm = nrows - r0 >= Q0_WIDE_RM ? Q0_WIDE_RM : 1;
        const char * xr = x + r0 * x_stride;
        float tmp[Q0_WIDE_RM * Q0_WIDE_COLS];
#define Q0_WIDE_ROWS(RM)                                                                                                \
        switch (type) {                                                                                                 \
            case GGML_TYPE_Q8_0: Q0_BY_NC8(nc, dot_q0_wide, GGML_TYPE_Q8_0, RM, nb, xr, x_stride, y, cc, order, tmp); break; \
            case GGML_TYPE_Q5_0: Q0_BY_NC8(nc, dot_q0_wide, GGML_TYPE_Q5_0, RM, nb, xr, x_stride, y, cc, order, tmp); break; \
            default:             Q0_BY_NC8(nc, dot_q0_wide, GGML_TYPE_Q4_0, RM, nb, xr, x_stride, y, cc, order, tmp); break; \
        }
        if (rm == Q0_WIDE_RM) {
            Q0_WIDE_ROWS(Q0_WIDE_RM)
        } else {
            Q0_WIDE_ROWS(1)
        }
#undef Q0_WIDE_ROWS
        for (int r = 0; r < rm; ++r) {
            for (int c = 0; c < nc; ++c) out[(r0 + r) * row_stride + (c0 + c) * col_stride] = tmp[r * Q0_WIDE_COLS + c];
        }
        r0 += rm;
    }
}
#endif

#ifdef Q0_WIDE_COLS
#define Q0_MAX_COLS Q0_WIDE_COLS
#else
#define Q0_MAX_COLS SPECULANT_MM_COLS
#endif

static void q0_rows(enum ggml_type type, int n, const char * x, size_t x_stride, int64_t nrows, const char * ycols,
                    size_t row_size, int ncols, int group, const int * order, float * out, size_t row_stride,
                    size_t col_stride) {
    const int nb = n / QK8_0;
    if (type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_MXFP4) {
        lut4_rows(type == GGML_TYPE_MXFP4, n, x, x_stride, nrows, ycols, row_size, ncols, group, order, out,
                  row_stride, col_stride);
        return;
    }
#ifdef Q0_UNSIGNED
    q0_col stack_cols[SCRATCH_BYTES / sizeof(q0_col)];  // this runs per chunk of rows: no allocation if it fits
    const size_t need = (size_t) nb * group;
    q0_col * cols = need <= sizeof(stack_cols) / sizeof(q0_col) ? stack_cols : malloc(sizeof(q0_col) * need);
#else
    q0_col * cols = NULL;
#endif
    for (int c0 = 0; c0 < ncols; c0 += group) {
        const int nc = ncols - c0 < group ? ncols - c0 : group;
        const void * y[Q0_MAX_COLS] = {0};
        const q0_col * cc[Q0_MAX_COLS] = {0};
        for (int c = 0; c < nc; ++c) {
            y[c] = ycols + (size_t) (c0 + c) * row_size;
            cc[c] = cols ? cols + (size_t) c * nb : NULL;
        }
#ifdef Q0_UNSIGNED
        q0_columns(type, nb, y, nc, cols);
#endif
#ifdef Q0_WIDE_COLS
        if (nc > SPECULANT_MM_COLS && q0_wide_type(type)) {  // up to 4 tokens dot_q0 is as fast (3: faster)
            q0_wide_rows(type, nb, x, x_stride, nrows, y, cc, nc, c0, order, out, row_stride, col_stride);
            continue;
        }
#endif
        for (int64_t r0 = 0; r0 < nrows;) {
            const int rm = nc > 1 && nrows - r0 >= Q0_RM ? Q0_RM : 1;
            const char * xr = x + r0 * x_stride;
            float tmp[Q0_RM * SPECULANT_MM_COLS];
#define Q0_ROWS(RM)                                                                                              \
            switch (type) {                                                                                      \
                case GGML_TYPE_Q8_0: SPECULANT_BY_NC(nc, dot_q0, GGML_TYPE_Q8_0, RM, nb, xr, x_stride, y, cc, order, tmp); break; \
                case GGML_TYPE_Q5_0: SPECULANT_BY_NC(nc, dot_q0, GGML_TYPE_Q5_0, RM, nb, xr, x_stride, y, cc, order, tmp); break; \
                case GGML_TYPE_Q4_1: SPECULANT_BY_NC(nc, dot_q0, GGML_TYPE_Q4_1, RM, nb, xr, x_stride, y, cc, order, tmp); break; \
                case GGML_TYPE_Q5_1: SPECULANT_BY_NC(nc, dot_q0, GGML_TYPE_Q5_1, RM, nb, xr, x_stride, y, cc, order, tmp); break; \
                default:             SPECULANT_BY_NC(nc, dot_q0, GGML_TYPE_Q4_0, RM, nb, xr, x_stride, y, cc, order, tmp); break; \
            }
            if (rm == Q0_RM) {
                Q0_ROWS(Q0_RM)
            } else {
                Q0_ROWS(1)
            }
#undef Q0_ROWS
            for (int r = 0; r < rm; ++r) {
                for (int c = 0; c < nc; ++c) out[(r0 + r) * row_stride + (c0 + c) * col_stride] = tmp[r * SPECULANT_MM_COLS + c];
            }
            r0 += rm;
        }
    }
#ifdef Q0_UNSIGNED
    if (cols != stack_cols) {
        free(cols);
    }
#endif
}

// Q3_K x q8_K, in ggml_vec_dot_q3_K_q8_K's integer lanes (each int32 lane: 4 adjacent values x q8, times their 16
// values' signed six-bit scale), formed from each value's three bits read as one unsigned byte u = low two bits +
// 4 x high bit (0..7: the value plus 4), where ggml takes two maddubs and a subtraction:
// - VNNI: u x q8 by dpbusd onto the column's -4 x (sums of 4 adjacent q8): the lane's value x q8; times the scale
//   by dpwssd (the scale in each lane's low 16 bits, 0 in its high ones; |lane| <= 4 x 4 x 128 fits 16 bits);
// - otherwise: u x q8 by maddubs, less the column's 4 x (sums of 2 adjacent q8); times the scale by madd.
// Every lane holds ggml's integer, so the float steps of ggml's (per superblock, a fused multiply-add by
// y.d * x.d) give its bits.
// Tokens per unpacking: 8 where AVX-512's 32 registers hold their sums and accumulators (a 5-token verify pass then
// unpacks each row once, not for 4 tokens and again for 1); there, up to 4 tokens take 2 rows per call.
#define Q3K_COLS REPACKED_COLS
#if defined(__AVX512VL__)
#define Q3K_RM 2
#else
#define Q3K_RM 1
#endif

// per column and superblock, the correction of every 32 values (32 bytes each: 8 int32 lanes with VNNI, 16 int16
// pairs without): at corr + (size_t) (c * nb + i) * QK_K + 32 * chunk
static void q3_K_columns(int nb, const char * ycols, size_t row_size, int ncols, char * corr) {
    const __m256i four = _mm256_set1_epi8(4);
    for (int c = 0; c < ncols; ++c) {
        const block_q8_K * y = (const block_q8_K *) (ycols + (size_t) c * row_size);
        for (int i = 0; i < nb; ++i) {
            for (int chunk = 0; chunk < QK_K / 32; ++chunk) {
                const __m256i q8 = _mm256_loadu_si256((const __m256i *) (y[i].qs + 32 * chunk));
#ifdef Q0_UNSIGNED
                const __m256i lanes = _mm256_sub_epi32(_mm256_setzero_si256(), q0_dpbusd(_mm256_setzero_si256(), four, q8));
#else
                const __m256i lanes = _mm256_maddubs_epi16(four, q8);
#endif
                _mm256_storeu_si256((__m256i *) (corr + ((size_t) c * nb + i) * QK_K + 32 * chunk), lanes);
            }
        }
    }
}

// one chunk of 32 values of one row (u, its scales) x one column (q8, corr) into the row's sums
static inline __m256i q3_K_chunk(__m256i sumi, __m256i u, __m256i scale, __m256i q8, __m256i corr) {
#ifdef Q0_UNSIGNED
    return vnni_dpwssd(sumi, q0_dpbusd(corr, u, q8), scale);
#else
    return _mm256_add_epi32(sumi, _mm256_madd_epi16(scale, _mm256_sub_epi16(_mm256_maddubs_epi16(u, q8), corr)));
#endif
}

// RM rows (x_stride bytes apart) x NC columns; out[r * Q3K_COLS + c]
static inline __attribute__((always_inline)) void dot_q3_K(const int NC, const int RM, const int nb, const char * x,
                                                          size_t x_stride, const block_q8_K * const * y,
                                                          const char * const * corr, const int * order, float * out) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m4 = _mm256_set1_epi8(4);
    const uint32_t kmask1 = 0x03030303;
    const uint32_t kmask2 = 0x0f0f0f0f;
    __m256 acc[Q3K_RM][Q3K_COLS];
    for (int r = 0; r < RM; ++r) for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        const block_q3_K * xb[Q3K_RM];
        __m256i all_scales[Q3K_RM], hbits[Q3K_RM];
        __m256i sumi[Q3K_RM][Q3K_COLS];
        for (int r = 0; r < RM; ++r) {
            xb[r] = (const block_q3_K *) (x + r * x_stride) + i;
            prefetch_stream(xb[r], sizeof(block_q3_K));
            uint32_t aux[3];  // 16 six-bit scales: low four bits in aux[0..1], high two in aux[2]
            memcpy(aux, xb[r]->scales, 12);
            const __m128i scales128 = _mm_sub_epi8(
                _mm_set_epi32(((aux[1] >> 4) & kmask2) | (((aux[2] >> 6) & kmask1) << 4),
                              ((aux[0] >> 4) & kmask2) | (((aux[2] >> 4) & kmask1) << 4),
                              (aux[1] & kmask2) | (((aux[2] >> 2) & kmask1) << 4),
                              (aux[0] & kmask2) | (((aux[2] >> 0) & kmask1) << 4)),
                _mm_set1_epi8(32));
            all_scales[r] = _mm256_cvtepi8_epi16(scales128);
            hbits[r] = _mm256_loadu_si256((const __m256i *) xb[r]->hmask);  // bit b of byte l: value 32b + l
            for (int c = 0; c < NC; ++c) sumi[r][c] = _mm256_setzero_si256();
        }
        for (int j = 0; j < QK_K / 128; ++j) {
            __m256i q3bits[Q3K_RM], scales_j[Q3K_RM];
            for (int r = 0; r < RM; ++r) {
                q3bits[r] = _mm256_loadu_si256((const __m256i *) (xb[r]->qs + 32 * j));
                scales_j[r] = k_scales_half(all_scales[r], j);
            }
            for (int k = 0; k < 4; ++k) {
                const int bit = 4 * j + k;
                __m256i u[Q3K_RM], scale[Q3K_RM];
                for (int r = 0; r < RM; ++r) {
                    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q3bits[r], 2 * k), m3);
                    // the high bit (bit `bit` of each hmask byte) moved to bit 2
                    const __m256i high = bit >= 2 ? _mm256_srli_epi16(hbits[r], bit - 2) : _mm256_slli_epi16(hbits[r], 2 - bit);
                    u[r] = _mm256_or_si256(low, _mm256_and_si256(high, m4));
#ifdef Q0_UNSIGNED  // the scales 2k (low 128 bits) and 2k+1 (high) in each int32 lane's low 16 bits
                    scale[r] = _mm256_shuffle_epi8(scales_j[r], _mm256_set_epi8(
                        -1, -1, 4 * k + 3, 4 * k + 2, -1, -1, 4 * k + 3, 4 * k + 2,
                        -1, -1, 4 * k + 3, 4 * k + 2, -1, -1, 4 * k + 3, 4 * k + 2,
                        -1, -1, 4 * k + 1, 4 * k + 0, -1, -1, 4 * k + 1, 4 * k + 0,
                        -1, -1, 4 * k + 1, 4 * k + 0, -1, -1, 4 * k + 1, 4 * k + 0));
#else
                    scale[r] = k_scale_pairs(scales_j[r], k);
#endif
                }
                for (int c = 0; c < NC; ++c) {
                    const __m256i q8 = _mm256_loadu_si256((const __m256i *) (y[c][i].qs + 128 * j + 32 * k));
                    const __m256i cr = _mm256_loadu_si256((const __m256i *) (corr[c] + (size_t) i * QK_K + 32 * bit));
                    for (int r = 0; r < RM; ++r) sumi[r][c] = q3_K_chunk(sumi[r][c], u[r], scale[r], q8, cr);
                }
            }
        }
        for (int r = 0; r < RM; ++r) {
            const float xd = fp16_to_fp32(xb[r]->d);
            for (int c = 0; c < NC; ++c) acc[r][c] = fma_lanes(y[c][i].d * xd, sumi[r][c], acc[r][c]);
        }
    }
    for (int r = 0; r < RM; ++r) for (int c = 0; c < NC; ++c) out[r * Q3K_COLS + c] = hsum8(acc[r][c]);
}

static _Thread_local char * q3_corr;  // per thread, kept: every Q3_K matrix of a pass needs one
static _Thread_local size_t q3_corr_bytes;

static void q3_K_rows(int n, const char * x, size_t x_stride, int64_t nrows, const char * ycols, size_t row_size,
                      int ncols, int group, const int * order, float * out, size_t row_stride, size_t col_stride) {
    const int nb = n / QK_K;
    const size_t need = (size_t) ncols * nb * QK_K;  // bytes: 256 per superblock and column
    if (q3_corr_bytes < need) {
        free(q3_corr);
        q3_corr = malloc(need);
        GGML_ASSERT(q3_corr);
        q3_corr_bytes = need;
    }
    q3_K_columns(nb, ycols, row_size, ncols, q3_corr);
    const int rm = Q3K_RM > 1 && group <= 4 && nrows >= 2 ? 2 : 1;  // rows per call (and a one-row tail)
    for (int64_t r0 = 0; r0 < nrows; r0 += rm) {
        const char * xr = x + r0 * x_stride;
        for (int c0 = 0; c0 < ncols; c0 += group) {
            const int nc = ncols - c0 < group ? ncols - c0 : group;
            const block_q8_K * y[Q3K_COLS] = {0};
            const char * cc[Q3K_COLS] = {0};
            for (int c = 0; c < nc; ++c) {
                y[c] = (const block_q8_K *) (ycols + (size_t) (c0 + c) * row_size);
                cc[c] = q3_corr + (size_t) (c0 + c) * nb * QK_K;
            }
            float tmp[Q3K_RM * Q3K_COLS];
            const int rows = nrows - r0 >= rm ? rm : 1;
#if Q3K_RM > 1
            if (rows == 2) {
                SPECULANT_BY_NC(nc, dot_q3_K, 2, nb, xr, x_stride, y, cc, order, tmp);
            } else
#endif
            {
                SPECULANT_BY_NC_REPACKED(nc, dot_q3_K, 1, nb, xr, x_stride, y, cc, order, tmp);
            }
            for (int r = 0; r < rows; ++r) {
                for (int c = 0; c < nc; ++c) out[(r0 + r) * row_stride + (c0 + c) * col_stride] = tmp[r * Q3K_COLS + c];
            }
        }
    }
}

static bool plain_supported(enum ggml_type type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K || type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q5_0
        || type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1 || type == GGML_TYPE_Q5_K
        || type == GGML_TYPE_Q3_K || type == GGML_TYPE_IQ4_XS || type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_Q2_K
        || type == GGML_TYPE_MXFP4 || type == GGML_TYPE_TQ2_0 || iq_grid_type(type);
}

// one weight row of a type with 256-value superblocks (Q2_K, Q4_K, Q5_K, Q6_K, IQ4_XS, TQ2_0, IQ1/IQ2/IQ3; Q3_K: q3_K_rows)
// against ncols q8_K columns,
// `group` columns per weight unpacking
static void dot_row(enum ggml_type type, int n, const void * xrow, const char * ycols, size_t row_size,
                    int ncols, int group, const int * order, float * out) {
    if (iq_grid_type(type)) {
        iq_grid_row(type, n, xrow, ycols, row_size, ncols, group, order, out);
        return;
    }
    const int nb = n / QK_K;
    for (int c0 = 0; c0 < ncols; c0 += group) {
        int nc = ncols - c0 < group ? ncols - c0 : group;
        const block_q8_K * y[REPACKED_COLS] = {0};
        for (int c = 0; c < nc; ++c) y[c] = (const block_q8_K *) (ycols + (size_t) (c0 + c) * row_size);
        float * o = out + c0;
        switch (type) {  // 256-bit on every level
            case GGML_TYPE_Q5_K:   SPECULANT_BY_NC_REPACKED(nc, dot_q5_K, nb, xrow, y, order, o); continue;
            case GGML_TYPE_Q2_K:   SPECULANT_BY_NC(nc, dot_q2_K, nb, xrow, y, order, o); continue;
            case GGML_TYPE_IQ4_XS: SPECULANT_BY_NC_REPACKED(nc, dot_iq4_xs, nb, xrow, y, order, o); continue;
            case GGML_TYPE_TQ2_0:  SPECULANT_BY_NC(nc, dot_tq2_0, nb, xrow, y, order, o); continue;
            default: break;
        }
#ifdef SPECULANT_MM_HAVE_512
        if (nc >= 2) {  // pairs of columns in 512-bit registers; an odd one left over takes the 256-bit kernel
            const int np = nc / 2;
            if (type == GGML_TYPE_Q4_K) {
                if (np == 1) dot_q4_K_pairs(1, nb, xrow, y, order, o); else dot_q4_K_pairs(2, nb, xrow, y, order, o);
            } else {
                if (np == 1) dot_q6_K_pairs(1, nb, xrow, y, order, o); else dot_q6_K_pairs(2, nb, xrow, y, order, o);
            }
            if (nc % 2 == 0) {
                continue;
            }
            o += nc - 1;
            y[0] = y[nc - 1];
            nc = 1;
        }
#endif
        if (type == GGML_TYPE_Q4_K) {
            SPECULANT_BY_NC(nc, dot_q4_K, nb, xrow, y, order, o);
        } else {
            SPECULANT_BY_NC(nc, dot_q6_K, nb, xrow, y, order, o);
        }
    }
}

// tokens per weight unpacking in plain rows
static int plain_group(enum ggml_type type) {
    if (type == GGML_TYPE_Q3_K) {
        return Q3K_COLS;
    }
    if (type == GGML_TYPE_Q5_K || type == GGML_TYPE_IQ4_XS) {
        return REPACKED_COLS;  // where AVX-512's 32 registers hold 8 tokens' sums
    }
#ifdef Q0_WIDE_COLS
    if (q0_wide_type(type)) {
        return Q0_WIDE_COLS;
    }
#endif
    return iq_grid_type(type) ? IQ_GRID_COLS : SPECULANT_MM_COLS;
}

// rows of a type with 256-value superblocks: row r x column c at out[r * row_stride + c * col_stride]
static void k_rows(enum ggml_type type, int n, const char * x, size_t x_stride, int64_t nrows, const char * ycols,
                   size_t row_size, int ncols, int group, const int * order, float * out, size_t row_stride,
                   size_t col_stride) {
    if (type == GGML_TYPE_Q3_K) {
        q3_K_rows(n, x, x_stride, nrows, ycols, row_size, ncols, group, order, out, row_stride, col_stride);
        return;
    }
    float tmp[IQ_GRID_COLS];
    for (int64_t r = 0; r < nrows; ++r) {
        for (int c0 = 0; c0 < ncols; c0 += group) {
            const int nc = ncols - c0 < group ? ncols - c0 : group;
            dot_row(type, n, x + r * x_stride, ycols + (size_t) c0 * row_size, row_size, nc, group, order, tmp);
            for (int c = 0; c < nc; ++c) out[r * row_stride + (c0 + c) * col_stride] = tmp[c];
        }
    }
}

bool speculant_mm_supported(const struct ggml_tensor * src0, const struct ggml_tensor * src1) {
    // one token too: the same bits as ggml's loop over its dot product, which was slower even before we prefetched
    // (a Q5_K_M target's one-token pass: ggml's loop 98-104 ms, ours 61-64 without prefetching, 49 with it; IQ4_XS
    // 104-108 -> 46, Q3_K_M 56-57 -> 40; Sapphire Rapids, also on its AVX2 variant)
    return plain_supported(src0->type) && src1->type == GGML_TYPE_F32
        && src0->ne[2] == 1 && src0->ne[3] == 1 && src1->ne[2] == 1 && src1->ne[3] == 1
        && ggml_is_contiguous(src1) && src0->ne[0] % ggml_blck_size(src0->type) == 0;
}

// -- a few tokens over plain Q4_K and Q6_K rows with the repacked kernels' float steps (plain_as_repacked) --
//
// Per superblock and column the integer totals (Q4_K: of the scaled products and of the mins' products; Q6_K: of the
// scaled products, its -32 offset folded in), converted to float and added with one fused multiply-add by x.d * y.d
// (and x.dmin * y.d) in superblock order: q4_Kx8_cols's and q6_Kx8_cols's operations. The integers are the plain
// kernels' (q4_K_isums, q6_K_isums: each row unpacked once for all REP_COLS columns). Eight superblocks' lane sums
// are reduced together (a tree of horizontal adds), which a total per superblock would make cost as much as the
// products.

enum { REP_BATCH = 8, REP_COLS = 4 };

// the totals of 8 vectors of 8 int32 lanes, in order
static inline __m256i sum8x8_epi32(const __m256i v[REP_BATCH]) {
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

// the totals of 8 vectors of 4 int32 lanes, in order
static inline __m256i sum8x4_epi32(const __m128i v[REP_BATCH]) {
    const __m128i lo = _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]));
    const __m128i hi = _mm_hadd_epi32(_mm_hadd_epi32(v[4], v[5]), _mm_hadd_epi32(v[6], v[7]));
    return _mm256_set_m128i(hi, lo);
}

// one plain Q4_K (is_q4) or Q6_K row of nb superblocks x NC columns y[c], the repacked bits in out[c]
static inline __attribute__((always_inline)) void k_rep(const int NC, const bool is_q4, const int nb, const void * row,
                                                       const block_q8_K * const * y, float * out) {
    const block_q4_K * x4 = row;
    const block_q6_K * x6 = row;
    float acc[REP_COLS], acc_min[REP_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = acc_min[c] = 0.0f;
    for (int i0 = 0; i0 < nb; i0 += REP_BATCH) {
        const int n = nb - i0 < REP_BATCH ? nb - i0 : REP_BATCH;
        __m256i sums[REP_COLS][REP_BATCH];
        __m128i mins_sums[REP_COLS][REP_BATCH];
        float xd[REP_BATCH], xdmin[REP_BATCH];
        for (int k = 0; k < REP_BATCH; ++k) {
            __m256i sumi[REP_COLS];
            __m128i mins_prod[REP_COLS];
            if (k >= n) {
                for (int c = 0; c < NC; ++c) { sumi[c] = _mm256_setzero_si256(); mins_prod[c] = _mm_setzero_si128(); }
            } else if (is_q4) {
                prefetch_stream(x4 + i0 + k, sizeof(*x4));
                q4_K_isums(NC, x4 + i0 + k, y, i0 + k, sumi, mins_prod);
                xd[k] = fp16_to_fp32(x4[i0 + k].d);
                xdmin[k] = fp16_to_fp32(x4[i0 + k].dmin);
            } else {
                prefetch_stream(x6 + i0 + k, sizeof(*x6));
                q6_K_isums(NC, x6 + i0 + k, y, i0 + k, sumi);
                xd[k] = fp16_to_fp32(x6[i0 + k].d);
            }
            for (int c = 0; c < NC; ++c) {
                sums[c][k] = sumi[c];
                if (is_q4) mins_sums[c][k] = mins_prod[c];
            }
        }
        for (int c = 0; c < NC; ++c) {
            float total[REP_BATCH], total_min[REP_BATCH];
            _mm256_storeu_ps(total, _mm256_cvtepi32_ps(sum8x8_epi32(sums[c])));
            if (is_q4) _mm256_storeu_ps(total_min, _mm256_cvtepi32_ps(sum8x4_epi32(mins_sums[c])));
            for (int k = 0; k < n; ++k) {
                const float yd = y[c][i0 + k].d;
                acc[c] = fmaf(total[k], xd[k] * yd, acc[c]);
                if (is_q4) acc_min[c] = fmaf(total_min[k], xdmin[k] * yd, acc_min[c]);
            }
        }
    }
    for (int c = 0; c < NC; ++c) out[c] = acc[c] - acc_min[c];
}

#define K_REP_BY_NC(is_q4, nc, nb, row, y, out) do { \
    switch (nc) { \
        case 1:  k_rep(1, is_q4, nb, row, y, out); break; \
        case 2:  k_rep(2, is_q4, nb, row, y, out); break; \
        case 3:  k_rep(3, is_q4, nb, row, y, out); break; \
        default: k_rep(4, is_q4, nb, row, y, out); break; \
    } \
} while (0)

// nrows plain Q4_K or Q6_K rows x ncols columns (q8_K, row_size bytes apart), up to REP_COLS columns per unpacking
// of a row (the row stays in cache for the others), with the repacked kernels' bits; column c's results at
// out + c * out_stride
static void rep_rows(enum ggml_type type, int n, const char * x, size_t x_stride, int64_t nrows, const char * ycols,
                     size_t row_size, int ncols, float * out, size_t out_stride) {
    const int nb = n / QK_K;
    for (int64_t r = 0; r < nrows; ++r) {
        const void * row = x + r * x_stride;
        for (int c0 = 0; c0 < ncols; c0 += REP_COLS) {
            const int nc = ncols - c0 < REP_COLS ? ncols - c0 : REP_COLS;
            const block_q8_K * y[REP_COLS];
            for (int c = 0; c < nc; ++c) y[c] = (const block_q8_K *) (ycols + (size_t) (c0 + c) * row_size);
            float res[REP_COLS];
            if (type == GGML_TYPE_Q4_K) {
                K_REP_BY_NC(true, nc, nb, row, y, res);
            } else {
                K_REP_BY_NC(false, nc, nb, row, y, res);
            }
            for (int c = 0; c < nc; ++c) out[(c0 + c) * out_stride + r] = res[c];
        }
    }
}

// Where switched on (speculant_mm_set_plain_as_repacked: RPC workers, which hold their layers plain, and the process
// that drives them), plain rows of a type llama.cpp repacks on this CPU take the repacked layout's arithmetic, so a
// split target gives a local run's bits. Up to REP_COLS tokens over Q4_K or Q6_K rows take rep_rows (each row
// unpacked once for all of them). More tokens, or other types: each group of 8 rows is laid out as the repack does,
// in a per-thread buffer that stays in cache for all its tokens, and the repacked kernels run on it (the copy repays
// itself from 5 tokens on; below, it cost Qwen 1.5B's Q4_K/Q6_K passes up to 1.8x rep_rows: BENCHMARKS.md,
// thirty-fourth session). Off, the default, plain rows keep ggml's dot-product arithmetic (a local
// SPECULANT_REPACK=0 run, as before).
static int64_t plain_as_repacked_on = 0;

void speculant_mm_set_plain_as_repacked(int64_t on) {
    plain_as_repacked_on = on;
}

static _Thread_local char * plain_group_buf;  // one group of 8 rows, repacked (kept: every matrix of a pass needs one)
static _Thread_local size_t plain_group_buf_bytes;

static bool plain_as_repacked(const struct ggml_tensor * src0) {
    return plain_as_repacked_on && speculant_mm_repacked_supported(src0->type, 8, 8) && src0->ne[1] % 8 == 0
        && src0->nb[1] == ggml_row_size(src0->type, src0->ne[0]);
}

// nrows (a multiple of 8) plain rows at x (x_stride bytes apart) x ncols columns, with the repacked kernels' bits;
// `group` columns per weight unpacking, column c's results at out + c * out_stride
static void plain_repacked_rows(enum ggml_type type, int n, const char * x, size_t x_stride, int64_t nrows,
                                const char * ycols, size_t row_size, int ncols, int group, const int * order,
                                float * out, size_t out_stride) {
    // a few tokens over Q4_K or Q6_K rows: without the copy, which they do not repay; the test's reordered sum takes
    // the copy
    if ((type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K) && ncols <= REP_COLS && !order) {
        rep_rows(type, n, x, x_stride, nrows, ycols, row_size, ncols, out, out_stride);
        return;
    }
    const size_t group_bytes = repacked_group_bytes(type, n);
    if (plain_group_buf_bytes < group_bytes) {
        free(plain_group_buf);
        plain_group_buf = aligned_alloc(64, (group_bytes + 63) / 64 * 64);
        GGML_ASSERT(plain_group_buf);
        plain_group_buf_bytes = group_bytes;
    }
    int32_t stack_sums[SCRATCH_BYTES / sizeof(int32_t)];
    int32_t * ysums = repacked_ysums(type, n, ycols, row_size, ncols, stack_sums, sizeof(stack_sums) / sizeof(int32_t));
    const int nb = n / ggml_blck_size(type);
    for (int64_t g = 0; g < nrows / 8; ++g) {
        repack_group_fast(type, x + 8 * g * x_stride, nb, plain_group_buf);
        repacked_group(type, n, plain_group_buf, ycols, row_size, ncols, group, ysums, order, out + 8 * g, out_stride);
    }
    if (ysums != stack_sums) {
        free(ysums);
    }
}

void speculant_mm_rows(const struct ggml_tensor * src0, const void * wdata, size_t row_size,
                       struct ggml_tensor * dst, int64_t ir0, int64_t ir1) {
    const int64_t ne00 = src0->ne[0];
    const int64_t ncols = dst->ne[1];
    if (plain_as_repacked(src0)) {  // ir0, ir1: multiples of 8 (speculant_mm_chunk_rows)
        plain_repacked_rows(src0->type, (int) ne00, (const char *) src0->data + ir0 * src0->nb[1], src0->nb[1],
                            ir1 - ir0, wdata, row_size, (int) ncols, REPACKED_COLS, NULL,
                            (float *) ((char *) dst->data + ir0 * dst->nb[0]), dst->nb[1] / sizeof(float));
        return;
    }
    if (ggml_blck_size(src0->type) == QK8_0) {
        q0_rows(src0->type, (int) ne00, (const char *) src0->data + ir0 * src0->nb[1], src0->nb[1], ir1 - ir0, wdata,
                row_size, (int) ncols, plain_group(src0->type), NULL, (float *) ((char *) dst->data + ir0 * dst->nb[0]),
                dst->nb[0] / sizeof(float), dst->nb[1] / sizeof(float));
        return;
    }
    k_rows(src0->type, (int) ne00, (const char *) src0->data + ir0 * src0->nb[1], src0->nb[1], ir1 - ir0, wdata,
           row_size, (int) ncols, plain_group(src0->type), NULL, (float *) ((char *) dst->data + ir0 * dst->nb[0]),
           dst->nb[0] / sizeof(float), dst->nb[1] / sizeof(float));
}

bool speculant_mm_expert_supported(enum ggml_type type, int interleave, int rows) {
    return interleave || rows ? speculant_mm_repacked_supported(type, interleave, rows) : plain_supported(type);
}

#define EXPERT_COLS 64   // tokens gathered at a time
#define EXPERT_ROWS 128  // weight rows per block of results

static _Thread_local char * gathered;  // EXPERT_COLS gathered columns, per thread (kept: every layer needs one)
static _Thread_local size_t gathered_bytes;

void speculant_mm_expert_rows(enum ggml_type type, int repacked, int n, const char * x, size_t x_stride, int64_t ir0,
                              int64_t ir1, const int32_t * map, int64_t ntok, const char * ycols, size_t row_size,
                              int64_t ne11, char * dst, size_t nb1, size_t nb2) {
    if (gathered_bytes < EXPERT_COLS * row_size) {
        free(gathered);
        gathered_bytes = EXPERT_COLS * row_size;
        gathered = malloc(gathered_bytes);
        GGML_ASSERT(gathered);
    }
    const int group = plain_group(type);  // columns per unpacking (plain rows)
    float out[EXPERT_COLS * EXPERT_ROWS];  // out[c * EXPERT_ROWS + r]: row r0 + r of gathered column c
    for (int64_t k0 = 0; k0 < ntok; k0 += EXPERT_COLS) {
        const int nc = (int) (ntok - k0 < EXPERT_COLS ? ntok - k0 : EXPERT_COLS);
        for (int c = 0; c < nc; ++c) {  // the expert's tokens' columns, side by side as the kernels read them
            const int32_t slot = map[2 * (k0 + c)], token = map[2 * (k0 + c) + 1];
            memcpy(gathered + c * row_size, ycols + (slot % ne11 + token * ne11) * row_size, row_size);
        }
        for (int64_t r0 = ir0; r0 < ir1; r0 += EXPERT_ROWS) {
            const int64_t nr = ir1 - r0 < EXPERT_ROWS ? ir1 - r0 : EXPERT_ROWS;
            const char * xr = x + r0 * x_stride;
            if (repacked) {  // r0 and nr are multiples of 8: whole groups of repacked rows
                repacked_rows(type, n, xr, nr, gathered, row_size, nc, REPACKED_COLS, NULL, out, EXPERT_ROWS);
            } else if (ggml_blck_size(type) == QK8_0) {
                q0_rows(type, n, xr, x_stride, nr, gathered, row_size, nc, group, NULL, out, 1, EXPERT_ROWS);
            } else {
                k_rows(type, n, xr, x_stride, nr, gathered, row_size, nc, group, NULL, out, 1, EXPERT_ROWS);
            }
            for (int c = 0; c < nc; ++c) {
                const int32_t slot = map[2 * (k0 + c)], token = map[2 * (k0 + c) + 1];
                memcpy((float *) (dst + slot * nb1 + token * nb2) + r0, out + c * EXPERT_ROWS, nr * sizeof(float));
            }
        }
    }
}

#ifdef SPECULANT_MM_AMX
// speculant_mm_amx_test: nrows (a multiple of 16) plain Q4_K, Q6_K, Q4_0, IQ4_NL or MXFP4 rows (x) repacked as llama.cpp does, against
// ncols columns; the AMX kernel's results in out_amx and the VNNI kernel's (REPACKED_COLS tokens per unpacking) in
// out_ref, both [ncols][nrows]. -1 where this CPU or build has no AMX (or another type), -2 out of memory.
static int amx_test(enum ggml_type type, int n, int nrows, const void * x, const void * y, size_t row_size, int ncols,
                    float * out_amx, float * out_ref) {
    const bool q0 = amx_32_type(type);
    if (!amx_ready() || n % (q0 ? QK8_0 : QK_K) || nrows % 16
        || (type != GGML_TYPE_Q4_K && type != GGML_TYPE_Q6_K && !q0)) return -1;
    const int nb = n / (q0 ? QK8_0 : QK_K), ngroups = nrows / 8;
    const size_t group_bytes = repacked_group_bytes(type, n);
    char * packed = malloc(group_bytes * ngroups);
    int32_t * ysums = q0 ? malloc(sizeof(int32_t) * ncols * nb) : NULL;
    if (q0) q8_0_block_sums(nb, y, row_size, ncols, ysums);
    const size_t row_bytes = ggml_row_size(type, n);
    for (int g = 0; g < ngroups; ++g) {
        repack_group(type, (const char *) x + (size_t) 8 * g * row_bytes, nb, packed + g * group_bytes);
    }
    const int64_t done = amx_run(type, n, packed, nrows, y, row_size, ncols, out_amx, nrows);
    for (int g = 0; g < ngroups; ++g) {
        repacked_group(type, n, packed + g * group_bytes, y, row_size, ncols, REPACKED_COLS, ysums, NULL, out_ref + 8 * g,
                       nrows);
    }
    free(packed);
    free(ysums);
    return done == nrows ? 0 : -2;
}
#endif

int speculant_mm_max_group(int type, int repacked) {
    return repacked ? REPACKED_COLS : plain_group((enum ggml_type) type);
}

int speculant_mm_test(int type, int repacked, int n, const void * x, const void * y, size_t row_size, int ncols,
                      int group, int reorder, float * out, float * out_ggml) {
    const enum ggml_type t = (enum ggml_type) type;
    const int max_group = speculant_mm_max_group(type, repacked != 0);
    if (!(repacked ? speculant_mm_repacked_supported(t, 8, 8) : plain_supported(t)) || group < 1 || group > max_group
        || n % ggml_blck_size(t) || repacked < 0 || repacked > 2) {
        return -1;
    }
    const int nb = n / ggml_blck_size(t);
    int * order = NULL;
    if (reorder && group > 1) {  // the wrong kernel: multi-column passes sum the blocks backwards
        order = malloc(sizeof(int) * nb);
        for (int i = 0; i < nb; ++i) order[i] = nb - 1 - i;
    }
    int rc = 0;
    if (repacked == 2) {  // plain rows as speculant_mm_rows takes them (plain_as_repacked): no ggml kernel to compare
        plain_repacked_rows(t, n, x, ggml_row_size(t, n), 8, y, row_size, ncols, group, order, out, 8);
        rc = 1;
    } else if (!repacked) {  // 8 plain rows, row after row
        const size_t x_stride = ggml_row_size(t, n);
        if (ggml_blck_size(t) == QK8_0) {
            q0_rows(t, n, x, x_stride, 8, y, row_size, ncols, group, order, out, 1, 8);
        } else {
            // 7 rows and then 1: kernels that take rows in pairs run their one-row tail too
            k_rows(t, n, x, x_stride, 7, y, row_size, ncols, group, order, out, 1, 8);
            k_rows(t, n, (const char *) x + 7 * x_stride, x_stride, 1, y, row_size, ncols, group, order, out + 7, 1, 8);
        }
        const ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(t)->vec_dot;
        for (int c = 0; out_ggml && c < ncols; ++c) {
            for (int r = 0; r < 8; ++r) {
                vec_dot(n, out_ggml + 8 * c + r, 0, (const char *) x + r * x_stride, 0, (const char *) y + c * row_size, 0, 1);
            }
        }
    } else {
        void * packed = malloc(repacked_group_bytes(t, n));
        repack_group(t, x, nb, packed);
        repacked_rows(t, n, packed, 8, y, row_size, ncols, group, order, out, 8);
        for (int c = 0; out_ggml && c < ncols; ++c) {
            const char * yc = (const char *) y + c * row_size;
            switch (t) {  // ggml has no x86 kernel for repacked Q6_K
                case GGML_TYPE_Q4_K: ggml_gemv_q4_K_8x8_q8_K(n, out_ggml + 8 * c, 8, packed, yc, 1, 8); break;
                case GGML_TYPE_Q4_0: ggml_gemv_q4_0_8x8_q8_0(n, out_ggml + 8 * c, 8, packed, yc, 1, 8); break;
                case GGML_TYPE_IQ4_NL: ggml_gemv_iq4_nl_8x8_q8_0(n, out_ggml + 8 * c, 8, packed, yc, 1, 8); break;
                case GGML_TYPE_MXFP4: ggml_gemv_mxfp4_8x8_q8_0(n, out_ggml + 8 * c, 8, packed, yc, 1, 8); break;
                case GGML_TYPE_Q2_K: ggml_gemv_q2_K_8x8_q8_K(n, out_ggml + 8 * c, 8, packed, yc, 1, 8); break;
                default: rc = 1; break;
            }
        }
        free(packed);
    }
    free(order);
    return rc;
}

#else  // no AVX2: ggml's own dot products run every pass (still invariant, one column at a time)

bool speculant_mm_supported(const struct ggml_tensor * src0, const struct ggml_tensor * src1) {
    (void) src0; (void) src1;
    return false;
}

bool speculant_mm_repacked_supported(enum ggml_type type, int interleave, int rows) {
    (void) type; (void) interleave; (void) rows;
    return false;
}

void speculant_mm_repacked_rows(enum ggml_type type, int n, const void * x, int64_t nrows, const void * wdata,
                                size_t row_size, int ncols, float * dst, size_t dst_stride) {
    (void) type; (void) n; (void) x; (void) nrows; (void) wdata; (void) row_size; (void) ncols; (void) dst; (void) dst_stride;
    abort();  // speculant_mm_repacked_supported() is false on this build
}

void speculant_mm_rows(const struct ggml_tensor * src0, const void * wdata, size_t row_size,
                       struct ggml_tensor * dst, int64_t ir0, int64_t ir1) {
    (void) src0; (void) wdata; (void) row_size; (void) dst; (void) ir0; (void) ir1;
    abort();  // speculant_mm_supported() is false on this build
}

void speculant_mm_set_plain_as_repacked(int64_t on) {
    (void) on;  // no kernels, no plain rows of ours
}

bool speculant_mm_expert_supported(enum ggml_type type, int interleave, int rows) {
    (void) type; (void) interleave; (void) rows;
    return false;
}

void speculant_mm_expert_rows(enum ggml_type type, int repacked, int n, const char * x, size_t x_stride, int64_t ir0,
                              int64_t ir1, const int32_t * map, int64_t ntok, const char * ycols, size_t row_size,
                              int64_t ne11, char * dst, size_t nb1, size_t nb2) {
    (void) type; (void) repacked; (void) n; (void) x; (void) x_stride; (void) ir0; (void) ir1; (void) map; (void) ntok;
    (void) ycols; (void) row_size; (void) ne11; (void) dst; (void) nb1; (void) nb2;
    abort();  // speculant_mm_expert_supported() is false on this build
}

int speculant_mm_max_group(int type, int repacked) {
    (void) type; (void) repacked;
    return 0;
}

int speculant_mm_test(int type, int repacked, int n, const void * x, const void * y, size_t row_size, int ncols,
                      int group, int reorder, float * out, float * out_ggml) {
    (void) type; (void) repacked; (void) n; (void) x; (void) y; (void) row_size; (void) ncols; (void) group;
    (void) reorder; (void) out; (void) out_ggml;
    return -1;
}

#endif

// -- activations to Q8_K (the rows K-quant weights are dotted with) -------------------------------------------

#include "ggml-quants.h"  // quantize_row_q8_K_ref

// The bits of quantize_row_q8_K_ref, which is what x86 ggml runs, 16 (AVX-512) or 8 (AVX2) values at once: the
// largest magnitude (a maximum: exact in any order) and the first value that has it, the same scale -127/max,
// each value times it rounded to nearest-even (the ref's nearest_int, for these magnitudes <= 127), capped at
// 127, and integer block sums. The ref is one scalar step per value, ~3% of a prompt's processing.
void speculant_quantize_row_q8_K(const float * x, void * vy, int64_t k) {
#if defined(SPECULANT_MM_HAVE_KERNELS)
    block_q8_K * y = (block_q8_K *) vy;
    const int64_t nb = k / QK_K;
#if defined(__AVX512F__)
    enum { W = 16 };
    typedef __m512 fvec;
#define QK_ABS(v) _mm512_abs_ps(v)
#define QK_LOAD(p) _mm512_loadu_ps(p)
#define QK_MAX(a, b) _mm512_max_ps(a, b)
#define QK_ZERO _mm512_setzero_ps()
#else
    enum { W = 8 };
    typedef __m256 fvec;
    const __m256 sign = _mm256_set1_ps(-0.0f);
#define QK_ABS(v) _mm256_andnot_ps(sign, v)
#define QK_LOAD(p) _mm256_loadu_ps(p)
#define QK_MAX(a, b) _mm256_max_ps(a, b)
#define QK_ZERO _mm256_setzero_ps()
#endif
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        fvec m = QK_ZERO;  // max(a, m) is m where a is NaN: a NaN, which the ref skips, never gets in
        for (int j = 0; j < QK_K; j += W) m = QK_MAX(QK_ABS(QK_LOAD(x + j)), m);
        float lanes[W];
        memcpy(lanes, &m, sizeof(lanes));
        float amax = 0.0f;
        for (int l = 0; l < W; ++l) amax = MAX(amax, lanes[l]);
        if (!amax) {
            y[i].d = 0;
            memset(y[i].qs, 0, QK_K);
            memset(y[i].bsums, 0, sizeof(y[i].bsums));  // the ref leaves them as they were: nothing reads them
            continue;
        }
        int first = 0;
        while (first < QK_K && fabsf(x[first]) != amax) ++first;  // the ref keeps the first value of largest magnitude
        if (first == QK_K) {  // cannot happen; kept so that no input reads past the block
            quantize_row_q8_K_ref(x, &y[i], QK_K);
            continue;
        }
        const float iscale = -127.f / x[first];
#if defined(__AVX512F__)
        const __m512 s = _mm512_set1_ps(iscale);
        for (int j = 0; j < QK_K; j += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(s, _mm512_loadu_ps(x + j)));  // nearest, ties to even
            v = _mm512_min_epi32(v, _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *) (y[i].qs + j), _mm512_cvtepi32_epi8(v));     // in [-127, 127]
            y[i].bsums[j / 16] = (int16_t) _mm512_reduce_add_epi32(v);
        }
#else
        const __m256 s = _mm256_set1_ps(iscale);
        for (int j = 0; j < QK_K; j += 16) {
            __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(s, _mm256_loadu_ps(x + j)));
            __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(s, _mm256_loadu_ps(x + j + 8)));
            v0 = _mm256_min_epi32(v0, _mm256_set1_epi32(127));
            v1 = _mm256_min_epi32(v1, _mm256_set1_epi32(127));
            // int32 -> int8 (no saturation happens: |v| <= 127), in order: the packs interleave 128-bit lanes
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(v0, v1), 0xD8);  // 16 x int16
            const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *) (y[i].qs + j), b);
            const __m256i t = _mm256_add_epi32(v0, v1);
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
            y[i].bsums[j / 16] = (int16_t) _mm_cvtsi128_si32(h);
        }
#endif
        y[i].d = 1 / iscale;
    }
#undef QK_ABS
#undef QK_LOAD
#undef QK_MAX
#undef QK_ZERO
#else
    quantize_row_q8_K_ref(x, (block_q8_K *) vy, k);
#endif
}

// -- the softmax's maximum -----------------------------------------------------------------------------------

static int64_t shared_attention = 1;  // 0: ggml's own loops for the attention products and the softmax's max

void speculant_mm_set_shared_attention(int64_t on) {
    shared_attention = on;
}

float speculant_vec_max_f32(int n, const float * x) {
    float max = -INFINITY;
    int i = 0;
    if (shared_attention) {
#if defined(__AVX512F__) && defined(SPECULANT_MM_HAVE_KERNELS)
        __m512 m[4] = { _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                        _mm512_set1_ps(-INFINITY) };  // 4 chains: a max waits 4 cycles on the one before
        for (; i + 64 <= n; i += 64) {
            for (int k = 0; k < 4; ++k) m[k] = _mm512_max_ps(m[k], _mm512_loadu_ps(x + i + 16 * k));
        }
        for (; i + 16 <= n; i += 16) m[0] = _mm512_max_ps(m[0], _mm512_loadu_ps(x + i));
        max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
#elif defined(SPECULANT_MM_HAVE_KERNELS)  // AVX2
        __m256 m[4] = { _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                        _mm256_set1_ps(-INFINITY) };
        for (; i + 32 <= n; i += 32) {
            for (int k = 0; k < 4; ++k) m[k] = _mm256_max_ps(m[k], _mm256_loadu_ps(x + i + 8 * k));
        }
        for (; i + 8 <= n; i += 8) m[0] = _mm256_max_ps(m[0], _mm256_loadu_ps(x + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
        for (int k = 0; k < 8; ++k) max = MAX(max, lanes[k]);
#endif
    }
    for (; i < n; ++i) {
        max = MAX(max, x[i]);
    }
    return max;
}

// -- attention products: F16 K or V rows against the few query columns that share them ----------------------

#if defined(GGML_SIMD) && !defined(__AVX512FP16__) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)))
#if defined(__AVX512F__) && GGML_F16_DOT_ARR == 4
#define F16_BATCHED 1  // 16 reductions at once (f16_reduce16)
#define F16_COLS 8     // columns at a time: a Qwen2.5 head group (6 query heads per KV head) in one
#define F16_ROWS 4     // rows at a time (2 with more than 4 columns): at most 16 sums in 32 registers
#define F16_LANES 16   // the score products with 16 K rows in the lanes of a vector
#else
#define F16_COLS 4
#define F16_ROWS 2
#if defined(__AVX2__) && GGML_F16_DOT_ARR == 4 && GGML_F16_DOT_EPR == 8
#define F16_LANES 8    // 8 K rows in the lanes
#endif
#endif

#ifdef F16_BATCHED
// GGML_F16_DOT_VEC_REDUCE's last step for 16 sums at once: _mm512_reduce_add_ps's tree as GCC writes it (the
// 256-bit halves added, then the 128-bit halves, then lanes 0 + 2 and 1 + 3, then those two), lane-parallel:
// each add takes the same two values as in the one-at-a-time reduction, so out[p] has its bits
static inline void f16_reduce16(const __m512 v[16], float out[16]) {
    __m512 w[8];  // sums 2q and 2q+1: their 256-bit halves added, 8 lanes each
    for (int q = 0; q < 8; ++q) {
        w[q] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * q], v[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(v[2 * q], v[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    }
    __m512 z[4];  // sums 4m .. 4m+3: their 128-bit halves added (128-bit lane k: sum 4m + k)
    for (int m = 0; m < 4; ++m) {
        z[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    }
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(1, 0, 1, 0)),  // lanes 0+2, 1+3
                                     _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_ps(z[2], z[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(z[2], z[3], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),  // and those two
                                   _mm512_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
    float lanes[16];  // lane 4k + m: sum 4m + k
    _mm512_storeu_ps(lanes, t);
    for (int k = 0; k < 4; ++k) for (int m = 0; m < 4; ++m) out[4 * m + k] = lanes[4 * k + m];
}
#endif

// rows r < R of x (f16, stride xs bytes) . columns c < NC of y (f16): out[c][r], each the value ggml_vec_dot_f16
// gives, by its operations in its order: per lane group j of a step, FMAs over the steps in turn, then its
// reduction and its scalar tail. Looping j outside the steps lets R x NC sums share each converted vector.
static inline __attribute__((always_inline)) void f16_dots(const int NC, const int R, const int n, const char * x,
                                                          size_t xs, const ggml_fp16_t * const * y,
                                                          float out[F16_COLS][F16_ROWS]) {
    const int np = n & ~(GGML_F16_DOT_STEP - 1);
    GGML_F16_DOT_VEC sum[F16_ROWS][F16_COLS][GGML_F16_DOT_ARR];
    for (int j = 0; j < GGML_F16_DOT_ARR; ++j) {
        GGML_F16_DOT_VEC acc[F16_ROWS][F16_COLS];
        for (int r = 0; r < R; ++r) for (int c = 0; c < NC; ++c) acc[r][c] = GGML_F16_DOT_VEC_ZERO;
        for (int i = 0; i < np; i += GGML_F16_DOT_STEP) {
            GGML_F16_DOT_VEC ax[F16_ROWS], ay[F16_COLS];
            if (j == 0) {  // the first of the 4 passes over these rows reads them from memory, the others from cache
                for (int r = 0; r < R; ++r) {
                    prefetch_stream((const ggml_fp16_t *) (x + r * xs) + i, GGML_F16_DOT_STEP * sizeof(ggml_fp16_t));
                }
            }
            for (int r = 0; r < R; ++r) {
                ax[r] = GGML_F16_DOT_VEC_LOAD((const ggml_fp16_t *) (x + r * xs) + i + j * GGML_F16_DOT_EPR, j);
            }
            for (int c = 0; c < NC; ++c) ay[c] = GGML_F16_DOT_VEC_LOAD(y[c] + i + j * GGML_F16_DOT_EPR, j);
            for (int r = 0; r < R; ++r) {
                for (int c = 0; c < NC; ++c) acc[r][c] = GGML_F16_DOT_VEC_FMA(acc[r][c], ax[r], ay[c]);
            }
        }
        for (int r = 0; r < R; ++r) for (int c = 0; c < NC; ++c) sum[r][c][j] = acc[r][c];
    }
#ifdef F16_BATCHED
    __m512 v[16];  // the reduction's vector adds, as GGML_F32Cx16_REDUCE does them: (x0 + x2) + (x1 + x3)
    for (int p = 0; p < 16; ++p) {
        const int r = p / NC, c = p % NC;
        v[p] = p < R * NC ? _mm512_add_ps(_mm512_add_ps(sum[r][c][0], sum[r][c][2]),
                                          _mm512_add_ps(sum[r][c][1], sum[r][c][3]))
                          : _mm512_setzero_ps();
    }
    float reduced[16];
    f16_reduce16(v, reduced);
#endif
    for (int r = 0; r < R; ++r) {
        const ggml_fp16_t * xr = (const ggml_fp16_t *) (x + r * xs);
        for (int c = 0; c < NC; ++c) {
            ggml_float sumf = 0.0;
#ifdef F16_BATCHED
            sumf = (ggml_float) reduced[r * NC + c];
#else
            GGML_F16_DOT_VEC_REDUCE(sumf, sum[r][c]);
#endif
            for (int i = np; i < n; ++i) {
                sumf += (ggml_float) (GGML_CPU_FP16_TO_FP32(xr[i]) * GGML_CPU_FP16_TO_FP32(y[c][i]));
            }
            out[c][r] = (float) sumf;
        }
    }
}

// f16_dots over `rows` rows from x (stride xs), nc columns at once, into dst columns dcol[c][0 ..)
static inline __attribute__((always_inline)) void f16_rows(const int NC, const int R, int64_t rows, int n,
                                                          const char * x, size_t xs, const ggml_fp16_t * const * y,
                                                          float * const * dcol) {
    float out[F16_COLS][F16_ROWS];
    int64_t r0 = 0;
    for (; r0 + R <= rows; r0 += R) {
        f16_dots(NC, R, n, x + r0 * xs, xs, y, out);
        for (int c = 0; c < NC; ++c) for (int r = 0; r < R; ++r) dcol[c][r0 + r] = out[c][r];
    }
    for (; r0 < rows; ++r0) {
        f16_dots(NC, 1, n, x + r0 * xs, xs, y, out);
        for (int c = 0; c < NC; ++c) dcol[c][r0] = out[c][0];
    }
}

#if F16_COLS == 8
#define F16_BY_NC(nc, ...)                                           \
    switch (nc) {                                                    \
        case 1: f16_rows(1, F16_ROWS, __VA_ARGS__); break;           \
        case 2: f16_rows(2, F16_ROWS, __VA_ARGS__); break;           \
        case 3: f16_rows(3, F16_ROWS, __VA_ARGS__); break;           \
        case 4: f16_rows(4, F16_ROWS, __VA_ARGS__); break;           \
        case 5: f16_rows(5, F16_ROWS / 2, __VA_ARGS__); break;       \
        case 6: f16_rows(6, F16_ROWS / 2, __VA_ARGS__); break;       \
        case 7: f16_rows(7, F16_ROWS / 2, __VA_ARGS__); break;       \
        default: f16_rows(8, F16_ROWS / 2, __VA_ARGS__); break;      \
    }
#else
#define F16_BY_NC(nc, ...)                                           \
    switch (nc) {                                                    \
        case 1: f16_rows(1, F16_ROWS, __VA_ARGS__); break;           \
        case 2: f16_rows(2, F16_ROWS, __VA_ARGS__); break;           \
        case 3: f16_rows(3, F16_ROWS, __VA_ARGS__); break;           \
        default: f16_rows(4, F16_ROWS, __VA_ARGS__); break;          \
    }
#endif

#ifdef F16_LANES
#define F16_LANES_MAX_N 256
#define F16_LANES_COLS 16  // query columns per f16_lanes_block call (their f32 copies sit on the stack)
#define F16_LANES_ROWS 16  // K rows per f16_lanes_block call (AVX2: two blocks of 8)
#endif

#if F16_LANES == 16
// -- short dots (a head long: the attention scores) with 16 rows in the lanes ---------------------------------
// ggml_vec_dot_f16 over n = 64 S values (S <= 4, no scalar tail) is, per output: for each lane group j and lane l
// an FMA chain over the S steps, a_jl = x[64s + 16j + l] y[64s + 16j + l] + a_jl from 0; v_l = (a_0l + a_2l) +
// (a_1l + a_3l); then _mm512_reduce_add_ps's tree over l (f16_reduce16). Here each lane of a vector is one of 16 K
// rows, so those very operations run 16 outputs at once, with no horizontal step: the rows are transposed once
// and serve every query column that reads them.

// 16 rows of x (f16, stride xs bytes, n values) -> xt[d * 16 + r], f32 (exact)
static inline void f16_transpose_rows(const char * x, size_t xs, int n, float * xt) {
    for (int d0 = 0; d0 < n; d0 += 16) {
        __m512 v[16];
        for (int r = 0; r < 16; ++r) {
            v[r] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) ((const ggml_fp16_t *) (x + r * xs) + d0)));
        }
        transpose16_ps(v);
        for (int d = 0; d < 16; ++d) _mm512_store_ps(xt + (d0 + d) * 16, v[d]);
    }
}

// v_l for two columns y0, y1 at once (each xt load serves both)
static inline __attribute__((always_inline)) void f16_lanes_v(const float * xt, const float * y0, const float * y1,
                                                              int l, int S, __m512 * v0, __m512 * v1) {
    __m512 a0[4], a1[4];
    for (int j = 0; j < 4; ++j) {
        const int d = 16 * j + l;
        const __m512 x = _mm512_load_ps(xt + d * 16);
        a0[j] = _mm512_fmadd_ps(x, _mm512_set1_ps(y0[d]), _mm512_setzero_ps());
        a1[j] = _mm512_fmadd_ps(x, _mm512_set1_ps(y1[d]), _mm512_setzero_ps());
    }
    for (int s = 1; s < S; ++s) {
        for (int j = 0; j < 4; ++j) {
            const int d = 64 * s + 16 * j + l;
            const __m512 x = _mm512_load_ps(xt + d * 16);
            a0[j] = _mm512_fmadd_ps(x, _mm512_set1_ps(y0[d]), a0[j]);
            a1[j] = _mm512_fmadd_ps(x, _mm512_set1_ps(y1[d]), a1[j]);
        }
    }
    *v0 = _mm512_add_ps(_mm512_add_ps(a0[0], a0[2]), _mm512_add_ps(a0[1], a0[3]));
    *v1 = _mm512_add_ps(_mm512_add_ps(a1[0], a1[2]), _mm512_add_ps(a1[1], a1[3]));
}

// w_l = v_l + v_(l+8) for two columns
static inline __attribute__((always_inline)) void f16_lanes_w(const float * xt, const float * y0, const float * y1,
                                                              int l, int S, __m512 * w0, __m512 * w1) {
    __m512 a0, a1, b0, b1;
    f16_lanes_v(xt, y0, y1, l, S, &a0, &a1);
    f16_lanes_v(xt, y0, y1, l + 8, S, &b0, &b1);
    *w0 = _mm512_add_ps(a0, b0);
    *w1 = _mm512_add_ps(a1, b1);
}

// out0, out1: 16 rows' dots with columns y0, y1 (f32 copies of f16 values), each ggml_vec_dot_f16's value
static inline void f16_lanes_2cols(const float * xt, const float * y0, const float * y1, int S, float * out0,
                                   float * out1) {
    __m512 z0[4], z1[4];  // z_k = w_k + w_(k+4)
    for (int k = 0; k < 4; ++k) {
        __m512 a0, a1, b0, b1;
        f16_lanes_w(xt, y0, y1, k, S, &a0, &a1);
        f16_lanes_w(xt, y0, y1, k + 4, S, &b0, &b1);
        z0[k] = _mm512_add_ps(a0, b0);
        z1[k] = _mm512_add_ps(a1, b1);
    }
    // lanes 0 + 2 and 1 + 3, then those two
    _mm512_storeu_ps(out0, _mm512_add_ps(_mm512_add_ps(z0[0], z0[2]), _mm512_add_ps(z0[1], z0[3])));
    _mm512_storeu_ps(out1, _mm512_add_ps(_mm512_add_ps(z1[0], z1[2]), _mm512_add_ps(z1[1], z1[3])));
}

// 16 rows, transposed in xt (f16_transpose_rows) . nc columns (f16 rows, n values, n = 64 S) into dcol[c][0 .. 16)
static void f16_lanes_block(const float * xt, int n, int nc, const ggml_fp16_t * const * cols, float * const * dcol) {
    float y[F16_LANES_COLS][F16_LANES_MAX_N];
    for (int c = 0; c < nc; ++c) ggml_cpu_fp16_to_fp32(cols[c], y[c], n);
    const int S = n / 64;
    int c = 0;
    for (; c + 2 <= nc; c += 2) f16_lanes_2cols(xt, y[c], y[c + 1], S, dcol[c], dcol[c + 1]);
    if (c < nc) {  // an odd column: computed beside a copy of itself, its twin's result dropped
        float spare[16];
        f16_lanes_2cols(xt, y[c], y[c], S, dcol[c], spare);
    }
}
#elif F16_LANES == 8
// -- the same with 8 rows in the lanes (AVX2): ggml_vec_dot_f16 over n = 32 S values is, per output: for each lane
// group j and lane l an FMA chain over the S steps, a_jl = x[32s + 8j + l] y[32s + 8j + l] + a_jl from 0;
// v_l = (a_0l + a_2l) + (a_1l + a_3l) (GGML_F32x8_REDUCE's vector adds); then its horizontal step: the 128-bit
// halves added, w_k = v_k + v_(k+4), and two hadds, (w_0 + w_1) + (w_2 + w_3). The 16 rows of a chunk step are
// two blocks of 8.

// 8 x 8 transpose: r[i] lane c -> r[c] lane i
static inline void transpose8_ps(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {  // per 128-bit half: rows 2i, 2i+1 interleaved, columns (0, 1) and (2, 3)
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // u[4i + k]: rows 4i .. 4i + 3 of column k (low half) and k + 4 (high half)
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; ++k) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[k + 4] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

// 16 rows of x (f16, stride xs bytes, n values) -> two blocks of 8, xt[(b n + d) * 8 + r] = row 8b + r, f32 (exact)
static inline void f16_transpose_rows(const char * x, size_t xs, int n, float * xt) {
    for (int b = 0; b < 2; ++b) {
        for (int d0 = 0; d0 < n; d0 += 8) {
            __m256 v[8];
            for (int r = 0; r < 8; ++r) {
                v[r] = _mm256_cvtph_ps(_mm_loadu_si128(
                    (const __m128i *) ((const ggml_fp16_t *) (x + (8 * b + r) * xs) + d0)));
            }
            transpose8_ps(v);
            for (int d = 0; d < 8; ++d) _mm256_store_ps(xt + (b * n + d0 + d) * 8, v[d]);
        }
    }
}

// a_jl and a_(j+2)l for 4 columns (8 chains: enough to keep both FMA ports busy; each xt load serves 4 columns)
static inline __attribute__((always_inline)) void f16_lanes_chains(const float * xt, const float * const * y, int l,
                                                                   int j, int S, __m256 a[2][4]) {
    for (int h = 0; h < 2; ++h) {
        const int d = 8 * (j + 2 * h) + l;
        const __m256 x = _mm256_load_ps(xt + d * 8);
        for (int c = 0; c < 4; ++c) a[h][c] = _mm256_fmadd_ps(x, _mm256_set1_ps(y[c][d]), _mm256_setzero_ps());
    }
    for (int s = 1; s < S; ++s) {
        for (int h = 0; h < 2; ++h) {
            const int d = 32 * s + 8 * (j + 2 * h) + l;
            const __m256 x = _mm256_load_ps(xt + d * 8);
            for (int c = 0; c < 4; ++c) a[h][c] = _mm256_fmadd_ps(x, _mm256_set1_ps(y[c][d]), a[h][c]);
        }
    }
}

// out[c]: 8 rows' dots with columns y[c], c < 4 (f32 copies of f16 values), each ggml_vec_dot_f16's value
static inline void f16_lanes_4cols(const float * xt, const float * const * y, int S, float * const * out) {
    __m256 v[8][4];  // v_l of each column
    for (int l = 0; l < 8; ++l) {
        __m256 a02[2][4], a13[2][4];
        f16_lanes_chains(xt, y, l, 0, S, a02);
        f16_lanes_chains(xt, y, l, 1, S, a13);
        for (int c = 0; c < 4; ++c) {
            v[l][c] = _mm256_add_ps(_mm256_add_ps(a02[0][c], a02[1][c]), _mm256_add_ps(a13[0][c], a13[1][c]));
        }
    }
    for (int c = 0; c < 4; ++c) {
        __m256 w[4];  // w_k = v_k + v_(k+4)
        for (int k = 0; k < 4; ++k) w[k] = _mm256_add_ps(v[k][c], v[k + 4][c]);
        _mm256_storeu_ps(out[c], _mm256_add_ps(_mm256_add_ps(w[0], w[1]), _mm256_add_ps(w[2], w[3])));
    }
}

// 16 rows, transposed in xt (f16_transpose_rows) . nc columns (f16 rows, n values, n = 32 S) into dcol[c][0 .. 16)
static void f16_lanes_block(const float * xt, int n, int nc, const ggml_fp16_t * const * cols, float * const * dcol) {
    float y[F16_LANES_COLS][F16_LANES_MAX_N];
    for (int c = 0; c < nc; ++c) ggml_cpu_fp16_to_fp32(cols[c], y[c], n);
    const int S = n / 32;
    for (int b = 0; b < 2; ++b) {
        const float * xtb = xt + b * n * 8;
        for (int c0 = 0; c0 < nc; c0 += 4) {
            // a last group of fewer than 4 columns is filled with copies of its first; their results dropped
            float spare[3][8];
            const float * yc[4];
            float * oc[4];
            for (int c = 0; c < 4; ++c) {
                const bool real = c0 + c < nc;
                yc[c] = y[real ? c0 + c : c0];
                oc[c] = real ? dcol[c0 + c] + 8 * b : spare[c - 1];
            }
            f16_lanes_4cols(xtb, yc, S, oc);
        }
    }
}
#else
#define F16_LANES_COLS F16_COLS
#endif

// fewest query columns of one plane in a chunk for the lanes kernel (its transposition pays for itself); 0: off
static int64_t f16_lanes_min_cols = 16;

void speculant_mm_set_lanes_min_cols(int64_t n) {
    f16_lanes_min_cols = n;
}

// dots of n values the lanes kernel can take (when it is on)
static inline bool f16_lanes_fit(int64_t n) {
#ifdef F16_LANES
    return f16_lanes_min_cols > 0 && n % GGML_F16_DOT_STEP == 0 && n <= F16_LANES_MAX_N;
#else
    (void) n;
    return false;
#endif
}

bool speculant_mm_f16_wide_chunks(const struct ggml_tensor * src0) {
#ifdef F16_LANES
    return shared_attention && src0->type == GGML_TYPE_F16 && f16_lanes_fit(src0->ne[0]);
#else
    (void) src0;
    return false;
#endif
}

bool speculant_mm_f16_chunk(const struct ggml_tensor * dst, const void * wdata, size_t row_size, int64_t ir0_start,
                            int64_t ir0_end, int64_t ir1_start, int64_t ir1_end) {
    if (!shared_attention) {
        return false;
    }
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    if (src0->type != GGML_TYPE_F16 || src1->type != GGML_TYPE_F32) {  // F32 src1: wdata has its f16 rows
        return false;
    }
    GGML_TENSOR_BINARY_OP_LOCALS
    const int64_t r2 = ne12 / ne02;
    const int64_t r3 = ne13 / ne03;
    const bool lanes = f16_lanes_fit(ne00);
#ifdef F16_LANES
    float xt[F16_LANES_MAX_N * F16_LANES_ROWS] __attribute__((aligned(64)));  // the 16 rows of `transposed`
#endif
    for (int64_t iir0 = ir0_start; iir0 < ir0_end; iir0 += 16) {  // 16 rows at a time stay in cache (F16_LANES_ROWS)
        const int64_t rows = MIN(iir0 + 16, ir0_end) - iir0;
#ifdef F16_LANES
        const char * transposed = NULL;  // the plane whose rows xt holds
#endif
        for (int64_t ir1 = ir1_start; ir1 < ir1_end;) {
            // a run of up to F16_COLS columns that read the same src0 plane (a query head group's tokens; with
            // lanes, up to F16_LANES_COLS)
            const int64_t i13 = ir1 / (ne12 * ne1);
            const int64_t i12 = (ir1 - i13 * ne12 * ne1) / ne1;
            const char * plane = (const char *) src0->data + (i12 / r2) * nb02 + (i13 / r3) * nb03;
            const ggml_fp16_t * cols[F16_LANES_COLS];
            float * dcol[F16_LANES_COLS];
            const int max_nc = lanes && rows == 16 ? F16_LANES_COLS : F16_COLS;
            int nc = 0;
            for (; nc < max_nc && ir1 < ir1_end; ++nc, ++ir1) {
                const int64_t j13 = ir1 / (ne12 * ne1);
                const int64_t j12 = (ir1 - j13 * ne12 * ne1) / ne1;
                const int64_t j11 = ir1 - j13 * ne12 * ne1 - j12 * ne1;
                if (j12 / r2 != i12 / r2 || j13 / r3 != i13 / r3) {
                    break;
                }
                cols[nc] = (const ggml_fp16_t *) ((const char *) wdata + (j11 + j12 * ne11 + j13 * ne12 * ne11) * row_size);
                dcol[nc] = (float *) ((char *) dst->data + j11 * nb1 + j12 * nb2 + j13 * nb3) + iir0;
            }
#ifdef F16_LANES
            if (max_nc == F16_LANES_COLS && (nc >= f16_lanes_min_cols || plane == transposed)) {
                if (plane != transposed) {
                    f16_transpose_rows(plane + iir0 * nb01, nb01, (int) ne00, xt);
                    transposed = plane;
                }
                f16_lanes_block(xt, (int) ne00, nc, cols, dcol);
                continue;
            }
#endif
            for (int c0 = 0; c0 < nc; c0 += F16_COLS) {
                const int n = MIN(F16_COLS, nc - c0);
                F16_BY_NC(n, rows, (int) ne00, plane + iir0 * nb01, nb01, cols + c0, dcol + c0);
            }
        }
    }
    return true;
}

#else  // ggml's own loop (vec_dot_f16 per element)

void speculant_mm_set_lanes_min_cols(int64_t n) {
    (void) n;
}

bool speculant_mm_f16_wide_chunks(const struct ggml_tensor * src0) {
    (void) src0;
    return false;
}

bool speculant_mm_f16_chunk(const struct ggml_tensor * dst, const void * wdata, size_t row_size, int64_t ir0_start,
                            int64_t ir0_end, int64_t ir1_start, int64_t ir1_end) {
    (void) dst; (void) wdata; (void) row_size; (void) ir0_start; (void) ir0_end; (void) ir1_start; (void) ir1_end;
    return false;
}

#endif

// -- AMX switches (every build has them; they do nothing where there is no AMX kernel) --

// the fewest tokens of a pass that take tile products; 0 or less: the default
void speculant_mm_set_amx_min_cols(int64_t n) {
#ifdef SPECULANT_MM_AMX
    amx_min_cols = n > 0 ? n : 0;
#else
    (void) n;
#endif
}

int speculant_mm_amx(void) {
#ifdef SPECULANT_MM_AMX
    return amx_ready();
#else
    return 0;
#endif
}

int speculant_mm_amx_test(int type, int n, int nrows, const void * x, const void * y, size_t row_size, int ncols,
                          float * out_amx, float * out_ref) {
#ifdef SPECULANT_MM_AMX
    return amx_test((enum ggml_type) type, n, nrows, x, y, row_size, ncols, out_amx, out_ref);
#else
    (void) type; (void) n; (void) nrows; (void) x; (void) y; (void) row_size; (void) ncols; (void) out_amx; (void) out_ref;
    return -1;
#endif
}
