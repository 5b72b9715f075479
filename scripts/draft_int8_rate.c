/* The bundled draft's one-row products (its layer's four and its head: 2.0 M weights) on bfloat16 panels, as the
 * engine packs them, against int8 panels of the same shapes (an int8 value per weight, widened by a sign
 * extension and a conversion to float32 in the tile: the kernels' one-row, four-panel AVX2 tile with that load),
 * after streaming E MB of other data through the caches (E = 0: the draft's weights stay in the L2 / L3, as
 * between a path's steps; 16: about the bundled target's bfloat16 weights, as after a target pass). Why: half the
 * bytes a draft step reads, if a step is bound by them. The int8 panels' scales are left out (a multiply per
 * column at the store): this measures the stream and the widening alone. docs/ENGINE.md, "A drafted path in one
 * compiled call", "Tried and not kept".
 *
 *     gcc -O3 -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 *         scripts/draft_int8_rate.c -o /tmp/draft_int8_rate $(python3-config --ldflags --embed)
 *     for e in 0 16 24; do /tmp/draft_int8_rate $e; done
 */
#include "../gbv/engine/_host_kernels.c"

#include <stdlib.h>
#include <time.h>

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* 16 int8 weights of a panel row as two vectors of 8 float32 (columns 0-7, 8-15) */
#define LOAD_I8(p, k, lo, hi)                                                                                  \
    do {                                                                                                       \
        lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((p) + (k) * PANEL))));     \
        hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((p) + (k) * PANEL + 8)))); \
    } while (0)
DEFINE_TILE(1, 4, i8, int8_t, LOAD_I8, 1)

static void i8_product(const float *x, const void *panels, float *y, Py_ssize_t K, Py_ssize_t N) {
    for (Py_ssize_t p = 0; p < N / PANEL; p += 4)
        tile4_i8_1(x, K, (const char *)panels + p * K * PANEL, K, y + p * PANEL, N, PANEL, 0);
}

int main(int argc, char **argv) {
    /* the bundled draft's products: q/k/v, o, gate/up, down, head (hidden 256, intermediate 768, vocab 4096) */
    const Py_ssize_t shapes[5][2] = {{256, 768}, {256, 256}, {256, 1536}, {768, 256}, {256, 4096}};
    void *bf16[5], *i8[5];
    float *x = calloc(1024, sizeof(float)), *y = calloc(8192, sizeof(float));
    for (int i = 0; i < 1024; i++) x[i] = 0.01f * (float)(i % 7);
    for (int s = 0; s < 5; s++) {
        const Py_ssize_t K = shapes[s][0], N = shapes[s][1];
        bf16[s] = aligned_alloc(64, (size_t)panels_bytes(PANELS_BF16, K, N));
        memset(bf16[s], 1, (size_t)panels_bytes(PANELS_BF16, K, N));
        i8[s] = aligned_alloc(64, (size_t)(K * N));
        memset(i8[s], 1, (size_t)(K * N));
    }
    const long megabytes = argc > 1 ? atol(argv[1]) : 16;
    const size_t evict = (size_t)megabytes << 20;
    char *other = malloc(evict + 64);
    memset(other, 1, evict + 64);
    double bf16_seconds = 0.0, i8_seconds = 0.0;
    volatile long sink = 0;
    const int rounds = 400;
    for (int r = 0; r < rounds; r++) {
        for (size_t i = 0; i < evict; i += 64) sink += other[i];
        double start = seconds_now();
        for (int s = 0; s < 5; s++) panel_product(x, bf16[s], PANELS_BF16, y, 1, shapes[s][0], shapes[s][1], 0);
        bf16_seconds += seconds_now() - start;
        for (size_t i = 0; i < evict; i += 64) sink += other[i];
        start = seconds_now();
        for (int s = 0; s < 5; s++) i8_product(x, i8[s], y, shapes[s][0], shapes[s][1]);
        i8_seconds += seconds_now() - start;
    }
    printf("%ld MB streamed between: bfloat16 panels %.1f us, int8 panels %.1f us (%.2fx)\n", megabytes,
           bf16_seconds / rounds * 1e6, i8_seconds / rounds * 1e6, i8_seconds / bf16_seconds);
    return 0;
}
