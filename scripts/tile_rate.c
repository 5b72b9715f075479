/* The panel kernel's rate in cache, in FMAs per cycle, without Python around each call: the tiles of
 * gbv/engine/_host_kernels.c (the file itself is included) on a (K, N) weight that stays in L1/L2.
 * Compare with scripts/fma_peak.c (the core's rate). docs/ENGINE.md, "Products at the FMA rate".
 *
 *     gcc -O3 -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 *         scripts/tile_rate.c -o /tmp/tile_rate $(python3-config --ldflags --embed)
 *     /tmp/tile_rate                  # K = N = 256, rows 1-6, 12, 24, float32 and bf16 panels
 *     /tmp/tile_rate 2.47             # with the clock in GHz (fma_peak prints it): FMA/cycle too
 *
 * (To measure an earlier version, build it from `git show REV:gbv/engine/_host_kernels.c` saved as
 * gbv/engine/_host_kernels.c in a checkout of REV.) The panels hold zeros: the rate does not depend on
 * the values. */
#include "../gbv/engine/_host_kernels.c"

#include <stdlib.h>
#include <time.h>

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const double ghz = argc > 1 ? atof(argv[1]) : 0.0;
    const Py_ssize_t K = 256, N = 256;
    const int rows[] = {1, 2, 3, 4, 5, 6, 12, 24};
    float *x = calloc(24 * K, sizeof(float)), *y = calloc(24 * N, sizeof(float));
    void *panels = calloc(K * N, sizeof(float));
    for (Py_ssize_t i = 0; i < 24 * K; i++) x[i] = (float)(i % 7) * 0.01f;
    printf("| rows | float32 panels GFLOP/s | bf16 panels GFLOP/s |%s\n|---:|---:|---:|%s\n",
           ghz > 0 ? " float32 FMA/cycle | bf16 FMA/cycle |" : "", ghz > 0 ? "---:|---:|" : "");
    for (size_t t = 0; t < sizeof rows / sizeof rows[0]; t++) {
        const int M = rows[t];
        double rate[2];
        for (int bf16 = 0; bf16 < 2; bf16++) {
            const long repeats = 40000 / M;
            panel_product(x, panels, bf16, y, M, K, N, 0);
            double best = 1e30; /* the best of 7 timings: on a shared machine the others carry its load */
            for (int round = 0; round < 7; round++) {
                const double start = seconds_now();
                for (long r = 0; r < repeats; r++) panel_product(x, panels, bf16, y, M, K, N, 0);
                const double seconds = seconds_now() - start;
                best = seconds < best ? seconds : best;
            }
            rate[bf16] = 2.0 * M * K * N * repeats / best / 1e9;
        }
        printf("| %d | %.1f | %.1f |", M, rate[0], rate[1]);
        if (ghz > 0) printf(" %.2f | %.2f |", rate[0] / 16 / ghz, rate[1] / 16 / ghz);
        printf("\n");
    }
    free(x);
    free(y);
    free(panels);
    return 0;
}
