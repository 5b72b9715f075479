/* Each AVX2 tile of gbv/engine/_host_kernels.c alone (the file itself is included), with its weights in the
 * L1 (4 panels of 128 x 16 values): fused multiply-adds of 8 lanes per cycle, against the core's 2
 * (scripts/fma_peak.c prints the clock and the peak). docs/ENGINE.md, "The AVX2 tile of 3 rows".
 *
 *     gcc -O3 -I"$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 *         scripts/tile_fma.c -o /tmp/tile_fma $(python3-config --ldflags --embed)
 *     /tmp/tile_fma 3.17              # the clock in GHz, as fma_peak prints it
 *
 * Each figure is the best of 5 timings (a shared machine's load slows single ones). The panels hold zeros:
 * the rate does not depend on the values. */
#include "../gbv/engine/_host_kernels.c"

#include <stdlib.h>
#include <time.h>

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    const char *name;
    tile_fn tile;
    int rows, panels;
} tile_case;

#define CASES(KIND)                                                                                 \
    {#KIND " 1x4", tile4_##KIND##_1, 1, 4}, {#KIND " 2x2", tile2_##KIND##_2, 2, 2},                 \
        {#KIND " 3x2", tile2_##KIND##_3, 3, 2}, {#KIND " 1x1", tile1_##KIND##_1, 1, 1},             \
        {#KIND " 2x1", tile1_##KIND##_2, 2, 1}, {#KIND " 3x1", tile1_##KIND##_3, 3, 1},             \
        {#KIND " 4x1", tile1_##KIND##_4, 4, 1}, {#KIND " 5x1", tile1_##KIND##_5, 5, 1},             \
        {#KIND " 6x1", tile1_##KIND##_6, 6, 1}

int main(int argc, char **argv) {
    const double ghz = argc > 1 ? atof(argv[1]) : 3.0;
    const Py_ssize_t K = 128;
    float *x = calloc(8 * K, sizeof(float)), *y = calloc(8 * 4 * PANEL, sizeof(float));
    void *panels = calloc(4 * K * PANEL, sizeof(float));
    const tile_case cases[] = {CASES(f32), CASES(bf16), CASES(f16)};
    printf("| tile (kind, rows x panels) | FMAs a cycle |\n|---|---:|\n");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const tile_case t = cases[c];
        const long repeats = 400000 / t.rows;
        double best = 1e30;
        for (int round = 0; round < 5; round++) {
            const double start = seconds_now();
            for (long r = 0; r < repeats; r++) t.tile(x, K, panels, K, y, 4 * PANEL, PANEL, 0);
            const double seconds = seconds_now() - start;
            best = seconds < best ? seconds : best;
        }
        const double fmas = (double)repeats * K * t.rows * t.panels * 2; /* 8-lane FMAs: lo and hi */
        printf("| %s | %.2f |\n", t.name, fmas / best / (ghz * 1e9));
    }
    free(x);
    free(y);
    free(panels);
    return 0;
}
