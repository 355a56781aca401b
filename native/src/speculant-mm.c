// speculant: batch-invariant multi-token matmul kernels (see speculant-mm.h).
//
// Per output element and per 256-value superblock, the float operations are exactly those of ggml's AVX2
// dot products (ggml_vec_dot_q4_K_q8_K / ggml_vec_dot_q6_K_q8_K): d = y.d * x.d, one fused multiply-add of
// the eight int32 lane sums into an 8-lane accumulator (and, for Q4_K, of the four min lanes into a
// 4-lane one), and the same horizontal sum at the end. The int32 lane sums are computed with the same lane
// layout (maddubs + madd), so each lane holds the same integer however many tokens share the weights.
#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "simd-mappings.h"

#include "speculant-mm.h"

#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECULANT_MM_HAVE_KERNELS 1
#endif

int64_t speculant_mm_max_rows(void) {
    static int64_t max_rows = -1;
    if (max_rows < 0) {
        const char * env = getenv("SPECULANT_INVARIANT_ROWS");
        max_rows = env ? atoll(env) : 64;
    }
    return max_rows;
}

bool speculant_mm_small_pass(const struct ggml_tensor * src0, const struct ggml_tensor * src1) {
    (void) src0;
    return src1->ne[1] * src1->ne[2] * src1->ne[3] <= speculant_mm_max_rows();
}

bool speculant_mm_supported(const struct ggml_tensor * src0, const struct ggml_tensor * src1) {
#ifdef SPECULANT_MM_HAVE_KERNELS
    return (src0->type == GGML_TYPE_Q4_K || src0->type == GGML_TYPE_Q6_K) && src1->type == GGML_TYPE_F32
        && src0->ne[2] == 1 && src0->ne[3] == 1 && src1->ne[2] == 1 && src1->ne[3] == 1
        && ggml_is_contiguous(src1) && src0->ne[0] % QK_K == 0;
#else
    (void) src0; (void) src1;
    return false;
#endif
}

#ifdef SPECULANT_MM_HAVE_KERNELS

static inline float hsum8(const __m256 x) {
    __m128 r = _mm256_extractf128_ps(x, 1);
    r = _mm_add_ps(r, _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// Q4_K x q8_K for NC columns. y[c] is column c's q8_K row. `order` lists the superblocks in the order they
// are summed (the identity, except in the test that proves a reordered sum is seen).
static inline __attribute__((always_inline)) void dot_q4_K(const int NC, const int nb, const block_q4_K * x,
                                                          const block_q8_K * const * y, const int * order,
                                                          float * out) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[SPECULANT_MM_COLS];
    __m128 acc_m[SPECULANT_MM_COLS];
    for (int c = 0; c < NC; ++c) { acc[c] = _mm256_setzero_ps(); acc_m[c] = _mm_setzero_ps(); }

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        // weights: 8 six-bit scales and 8 mins (K-quant packing), the same int16 vectors as ggml's
        uint32_t u[4];
        memcpy(u, x[i].scales, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t u1 = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = u1;
        u[0] &= 0x3f3f3f3f;
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
        const uint8_t * sc = (const uint8_t *) u;  // sc[0..7]: scales
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float xdmin = GGML_CPU_FP16_TO_FP32(x[i].dmin);

        __m256i sumi[SPECULANT_MM_COLS];
        for (int c = 0; c < NC; ++c) {
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[c][i].bsums);
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            const __m128i prod = _mm_madd_epi16(mins, q8s);
            const float dmin = -y[c][i].d * xdmin;
            acc_m[c] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[c]);
            sumi[c] = _mm256_setzero_si256();
        }
        const uint8_t * q4 = x[i].qs;
        for (int j = 0; j < QK_K / 64; ++j) {
            const __m256i scale_l = _mm256_set1_epi16(sc[2 * j + 0]);
            const __m256i scale_h = _mm256_set1_epi16(sc[2 * j + 1]);
            const __m256i q4bits = _mm256_loadu_si256((const __m256i *) (q4 + 32 * j));
            const __m256i q4l = _mm256_and_si256(q4bits, m4);
            const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
            for (int c = 0; c < NC; ++c) {
                const int8_t * q8 = y[c][i].qs + 64 * j;
                const __m256i p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, _mm256_loadu_si256((const __m256i *) q8)));
                const __m256i p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, _mm256_loadu_si256((const __m256i *) (q8 + 32))));
                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(p16l, p16h));
            }
        }
        for (int c = 0; c < NC; ++c) {
            const float d = y[c][i].d * xd;
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) {
        __m128 m = acc_m[c];
        m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[c] = hsum8(acc[c]) + _mm_cvtss_f32(m);
    }
}

// Q6_K x q8_K for NC columns (see dot_q4_K).
static inline __attribute__((always_inline)) void dot_q6_K(const int NC, const int nb, const block_q6_K * x,
                                                          const block_q8_K * const * y, const int * order,
                                                          float * out) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256 acc[SPECULANT_MM_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();

    for (int ii = 0; ii < nb; ++ii) {
        const int i = order ? order[ii] : ii;
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x[i].scales));
        __m256i sumi[SPECULANT_MM_COLS];
        for (int c = 0; c < NC; ++c) {
            // the -32 offset of every 6-bit value, per pair of 16-value groups
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[c][i].bsums);
            sumi[c] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5));
        }
        const uint8_t * ql = x[i].ql;
        const uint8_t * qh = x[i].qh;
        for (int j = 0; j < QK_K / 128; ++j) {
            const __m256i bits1 = _mm256_loadu_si256((const __m256i *) (ql + 64 * j));
            const __m256i bits2 = _mm256_loadu_si256((const __m256i *) (ql + 64 * j + 32));
            const __m256i bitsH = _mm256_loadu_si256((const __m256i *) (qh + 32 * j));
            __m256i q6[4];
            q6[0] = _mm256_or_si256(_mm256_and_si256(bits1, m15), _mm256_slli_epi16(_mm256_and_si256(bitsH, m3), 4));
            q6[1] = _mm256_or_si256(_mm256_and_si256(bits2, m15), _mm256_slli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(12)), 2));
            q6[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m15), _mm256_and_si256(bitsH, _mm256_set1_epi8(48)));
            q6[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m15),
                                    _mm256_srli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(-64)), 2));
            __m256i scale[4];
            for (int k = 0; k < 4; ++k) {
                const int m = 4 * j + k;  // 32 values: groups 2m (low 16) and 2m+1 (high 16)
                scale[k] = _mm256_set_m128i(_mm_set1_epi16(x[i].scales[2 * m + 1]), _mm_set1_epi16(x[i].scales[2 * m]));
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
        for (int c = 0; c < NC; ++c) {
            const float d = y[c][i].d * xd;
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
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
        uint32_t u[4];
        memcpy(u, x[i].scales, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t u1 = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = u1;
        u[0] &= 0x3f3f3f3f;
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
        const uint8_t * sc = (const uint8_t *) u;
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float xdmin = GGML_CPU_FP16_TO_FP32(x[i].dmin);

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
            acc[2 * p] = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(_mm512_castsi512_si256(sumi[p])), acc[2 * p]);
            acc[2 * p + 1] = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(sumi[p], 1)),
                                             acc[2 * p + 1]);
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
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
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
            acc[2 * p] = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(_mm512_castsi512_si256(sumi[p])), acc[2 * p]);
            acc[2 * p + 1] = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(sumi[p], 1)),
                                             acc[2 * p + 1]);
        }
    }
    for (int c = 0; c < 2 * NP; ++c) out[c] = hsum8(acc[c]);
}
#endif

// one weight row against ncols columns, `group` columns per weight unpacking
static void dot_row(enum ggml_type type, int n, const void * xrow, const char * ycols, size_t row_size,
                    int ncols, int group, const int * order, float * out) {
    const int nb = n / QK_K;
    for (int c0 = 0; c0 < ncols; c0 += group) {
        int nc = ncols - c0 < group ? ncols - c0 : group;
        const block_q8_K * y[SPECULANT_MM_COLS];
        for (int c = 0; c < nc; ++c) y[c] = (const block_q8_K *) (ycols + (size_t) (c0 + c) * row_size);
        float * o = out + c0;
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
            const block_q4_K * x = xrow;
            switch (nc) {  // constant NC: each case compiles to its own unrolled kernel
                case 1: dot_q4_K(1, nb, x, y, order, o); break;
                case 2: dot_q4_K(2, nb, x, y, order, o); break;
                case 3: dot_q4_K(3, nb, x, y, order, o); break;
                default: dot_q4_K(4, nb, x, y, order, o); break;
            }
        } else {
            const block_q6_K * x = xrow;
            switch (nc) {
                case 1: dot_q6_K(1, nb, x, y, order, o); break;
                case 2: dot_q6_K(2, nb, x, y, order, o); break;
                case 3: dot_q6_K(3, nb, x, y, order, o); break;
                default: dot_q6_K(4, nb, x, y, order, o); break;
            }
        }
    }
}

void speculant_mm_rows(const struct ggml_tensor * src0, const void * wdata, size_t row_size,
                       struct ggml_tensor * dst, int64_t ir0, int64_t ir1) {
    const int64_t ne00 = src0->ne[0];
    const int64_t ncols = dst->ne[1];
    float tmp[SPECULANT_MM_COLS];
    for (int64_t r = ir0; r < ir1; ++r) {
        const void * xrow = (const char *) src0->data + r * src0->nb[1];
        for (int64_t c0 = 0; c0 < ncols; c0 += SPECULANT_MM_COLS) {
            const int nc = (int) (ncols - c0 < SPECULANT_MM_COLS ? ncols - c0 : SPECULANT_MM_COLS);
            dot_row(src0->type, (int) ne00, xrow, (const char *) wdata + c0 * row_size, row_size, nc,
                    SPECULANT_MM_COLS, NULL, tmp);
            for (int c = 0; c < nc; ++c) {
                *(float *) ((char *) dst->data + (c0 + c) * dst->nb[1] + r * dst->nb[0]) = tmp[c];
            }
        }
    }
}

int speculant_mm_test_dot(int type, int n, const void * x, const void * y, size_t row_size, int ncols, int group,
                          int reorder, float * out) {
    if ((type != GGML_TYPE_Q4_K && type != GGML_TYPE_Q6_K) || n % QK_K || group < 1 || group > SPECULANT_MM_COLS) {
        return -1;
    }
    const int nb = n / QK_K;
    int * order = NULL;
    if (reorder && group > 1) {  // the wrong kernel: multi-column passes sum the superblocks backwards
        order = malloc(sizeof(int) * nb);
        for (int i = 0; i < nb; ++i) order[i] = nb - 1 - i;
    }
    dot_row((enum ggml_type) type, n, x, y, row_size, ncols, group, order, out);
    free(order);
    return 0;
}

#else  // no AVX2: ggml's own dot products run every pass (still invariant, one column at a time)

void speculant_mm_rows(const struct ggml_tensor * src0, const void * wdata, size_t row_size,
                       struct ggml_tensor * dst, int64_t ir0, int64_t ir1) {
    (void) src0; (void) wdata; (void) row_size; (void) dst; (void) ir0; (void) ir1;
    abort();  // speculant_mm_supported() is false on this build
}

int speculant_mm_test_dot(int type, int n, const void * x, const void * y, size_t row_size, int ncols, int group,
                          int reorder, float * out) {
    (void) type; (void) n; (void) x; (void) y; (void) row_size; (void) ncols; (void) group; (void) reorder; (void) out;
    return -1;
}

#endif
