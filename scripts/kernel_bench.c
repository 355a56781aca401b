// One thread, one weight matrix larger than L3 (65536 rows x 1536 values): GB/s of our repacked kernels
// (native/src/speculant-mm.c) against ggml's own kernels in the same libggml-cpu variant, for n tokens at once.
// Ours: speculant_mm_repacked_rows over Q6_K / Q4_K in the 8-row layout. ggml: vec_dot_q6_K_q8_K row by row
// over plain Q6_K (what llama.cpp runs for Q6_K on x86) and gemv_q4_K_8x8_q8_K (its repacked Q4_K), once per
// token. The weights are random bytes with unit scales: timing only, the bits are tested in tests/test_native.py.
// Ours runs AMX tile products where the CPU has them and the pass has 8+ tokens; "no AMX" is the same call with them
// switched off (speculant_mm_set_amx_min_cols): below 8 the two are the same call, and what separates them is their
// place in the round.
//
//   gcc -O2 -o /tmp/kernel_bench scripts/kernel_bench.c -ldl
//   L=.venv/lib/python3.11/site-packages/llama_cpp/lib
//   LD_LIBRARY_PATH=$L /tmp/kernel_bench $L/libggml-cpu-zen4.so 1     # variant, tokens (1-64); median of 64 rounds
//                                                                     # (16 from 9 tokens on)
//
// Read the median: a kernel that waits on memory can still post a fast best round (on Zen 4 the old Q6_K layout
// had a best of 3.8 ms and a median of 7.6 in the same run).
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { Q4_K = 12, Q6_K = 14 };  // ggml type ids
enum { N = 1536, NB = N / 256, MAX_ROUNDS = 64 };
static const int64_t R = 65536;
static const size_t Q6_BYTES = 210, Q4_BYTES = 144, Q8K_BYTES = 4 + 256 + 32;  // block_q6_K, block_q4_K, block_q8_K

typedef void (*rows_fn)(int type, int n, const void * x, int64_t nrows, const void * wdata, size_t row_size,
                        int ncols, float * dst, size_t dst_stride);
typedef void (*vec_dot_fn)(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc);
typedef void (*gemv_fn)(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
struct type_traits_cpu { void * from_float; vec_dot_fn vec_dot; int vec_dot_type; int64_t nrows; };  // ggml-cpu.h

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void fill(uint8_t * p, size_t n) {
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < n; ++i) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; p[i] = (uint8_t) s; }
}

static int by_value(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static void * need(void * h, const char * name) {
    void * f = dlsym(h, name);
    if (!f) { fprintf(stderr, "%s: not in this library\n", name); exit(1); }
    return f;
}

int main(int argc, char ** argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s libggml-cpu-VARIANT.so [tokens]\n", argv[0]); return 2; }
    void * h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    const int nc = argc > 2 ? atoi(argv[2]) : 1;
    if (nc < 1 || nc > 64) { fprintf(stderr, "tokens: 1-64\n"); return 2; }
    const int ROUNDS = nc > 8 ? 16 : MAX_ROUNDS;
    void (*set_amx_min_cols)(int64_t) = dlsym(h, "speculant_mm_set_amx_min_cols");  // absent before AMX: no A/B
    rows_fn ours = (rows_fn) need(h, "speculant_mm_repacked_rows");
    ((void (*)(void)) need(h, "ggml_cpu_init"))();
    const struct type_traits_cpu * (*traits)(int) = need(h, "ggml_get_type_traits_cpu");
    gemv_fn gemv_q4 = (gemv_fn) need(h, "ggml_gemv_q4_K_8x8_q8_K");
    vec_dot_fn vec_dot_q6 = traits(Q6_K)->vec_dot;

    uint8_t * x6 = aligned_alloc(64, R * NB * Q6_BYTES), * x4 = aligned_alloc(64, R * NB * Q4_BYTES);
    uint8_t * y = aligned_alloc(64, nc * NB * Q8K_BYTES);
    float * out = malloc(sizeof(float) * R * nc);
    fill(x6, R * NB * Q6_BYTES); fill(x4, R * NB * Q4_BYTES); fill(y, nc * NB * Q8K_BYTES);
    for (int64_t g = 0; g < R / 8 * NB; ++g) {  // fp16 1.0 scales: q6_Kx8.d[8], q4_Kx8.d[8] and .dmin[8]
        for (int k = 0; k < 8; ++k) ((uint16_t *) (x6 + g * 8 * Q6_BYTES))[k] = 0x3C00;
        for (int k = 0; k < 16; ++k) ((uint16_t *) (x4 + g * 8 * Q4_BYTES))[k] = 0x3C00;
    }
    for (int i = 0; i < nc * NB; ++i) { const float one = 1.0f; memcpy(y + i * Q8K_BYTES, &one, 4); }

    static double times[6][MAX_ROUNDS];
    for (int round = 0; round < ROUNDS; ++round) {
        double t[7];
        t[0] = now();
        ours(Q6_K, N, x6, R, y, NB * Q8K_BYTES, nc, out, R);
        t[1] = now();
        for (int64_t r = 0; r < R; ++r)
            for (int c = 0; c < nc; ++c) vec_dot_q6(N, out + r, 0, x6 + r * NB * Q6_BYTES, 0, y + c * NB * Q8K_BYTES, 0, 1);
        t[2] = now();
        ours(Q4_K, N, x4, R, y, NB * Q8K_BYTES, nc, out, R);
        t[3] = now();
        for (int c = 0; c < nc; ++c) gemv_q4(N, out, R, x4, y + c * NB * Q8K_BYTES, 1, (int) R);
        t[4] = now();
        if (set_amx_min_cols) set_amx_min_cols(INT64_MAX);
        ours(Q4_K, N, x4, R, y, NB * Q8K_BYTES, nc, out, R);
        t[5] = now();
        ours(Q6_K, N, x6, R, y, NB * Q8K_BYTES, nc, out, R);
        if (set_amx_min_cols) set_amx_min_cols(0);  // the defaults
        t[6] = now();
        for (int k = 0; k < 6; ++k) times[k][round] = t[k + 1] - t[k];
    }
    double best[6], med[6];
    for (int k = 0; k < 6; ++k) {
        qsort(times[k], ROUNDS, sizeof(double), by_value);
        best[k] = times[k][0];
        med[k] = times[k][ROUNDS / 2];
    }
    const double gb6 = R * NB * Q6_BYTES / 1e9, gb4 = R * NB * Q4_BYTES / 1e9;
    printf("%d token(s), ms, median of %d rounds (best): Q6_K ours %.1f (%.1f), %.1f GB/s; no AMX %.1f (%.1f); ggml "
           "vec_dot %.1f (%.1f), %.1f GB/s | Q4_K ours %.1f (%.1f), %.1f GB/s; no AMX %.1f (%.1f); ggml gemv %.1f (%.1f), "
           "%.1f GB/s\n", nc, ROUNDS, med[0] * 1e3, best[0] * 1e3, gb6 / med[0], med[5] * 1e3, best[5] * 1e3,
           med[1] * 1e3, best[1] * 1e3, gb6 / med[1],
           med[2] * 1e3, best[2] * 1e3, gb4 / med[2], med[4] * 1e3, best[4] * 1e3, med[3] * 1e3, best[3] * 1e3,
           gb4 / med[3]);
    return 0;
}
