/* This core's rate of 8-wide float32 fused multiply-adds, against which the panel kernel's tiles
 * (gbv/engine/_host_kernels.c) are measured (docs/ENGINE.md, "Products at the FMA rate").
 *
 *     gcc -O2 -mavx2 -mfma scripts/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 *
 * Prints the clock (a chain of dependent integer adds, one per cycle), the latency of one FMA, and
 * the FMAs per cycle of 6, 10 and 14 independent chains (registers only: no memory traffic). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define FMA(a) "vfmadd231ps %[b], %[b], %[" #a "]\n"

int main(void) {
    const long n = 200000000L;
    long x = 0;
    double t = now();
    for (long i = 0; i < n / 4; i++) __asm__ volatile("add $1, %0\nadd $1, %0\nadd $1, %0\nadd $1, %0" : "+r"(x));
    const double hz = n / (now() - t);
    printf("clock: %.2f GHz\n", hz / 1e9);

    __m256 a0 = _mm256_set1_ps(1e-3f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0;
    const __m256 b = _mm256_set1_ps(0.999f);
    t = now();
    for (long i = 0; i < n / 8; i++) __asm__ volatile(FMA(a0) FMA(a0) FMA(a0) FMA(a0) : [a0] "+x"(a0) : [b] "x"(b));
    printf("FMA latency: %.1f cycles\n", (now() - t) * hz / (n / 2));

    t = now();
    for (long i = 0; i < n / 6; i++)
        __asm__ volatile(FMA(a0) FMA(a1) FMA(a2) FMA(a3) FMA(a4) FMA(a5)
                         : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5)
                         : [b] "x"(b));
    printf("6 chains: %.2f FMA/cycle\n", (n / 6 * 6) / ((now() - t) * hz));
    t = now();
    for (long i = 0; i < n / 10; i++)
        __asm__ volatile(FMA(a0) FMA(a1) FMA(a2) FMA(a3) FMA(a4) FMA(a5) FMA(a6) FMA(a7) FMA(a8) FMA(a9)
                         : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5),
                           [a6] "+x"(a6), [a7] "+x"(a7), [a8] "+x"(a8), [a9] "+x"(a9)
                         : [b] "x"(b));
    printf("10 chains: %.2f FMA/cycle\n", (n / 10 * 10) / ((now() - t) * hz));
    t = now();
    for (long i = 0; i < n / 14; i++)
        __asm__ volatile(FMA(a0) FMA(a1) FMA(a2) FMA(a3) FMA(a4) FMA(a5) FMA(a6) FMA(a7) FMA(a8) FMA(a9) FMA(a10)
                             FMA(a11) FMA(a12) FMA(a13)
                         : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5),
                           [a6] "+x"(a6), [a7] "+x"(a7), [a8] "+x"(a8), [a9] "+x"(a9), [a10] "+x"(a10),
                           [a11] "+x"(a11), [a12] "+x"(a12), [a13] "+x"(a13)
                         : [b] "x"(b));
    const double seconds = now() - t;
    printf("14 chains: %.2f FMA/cycle = %.1f GFLOP/s\n", (n / 14 * 14) / (seconds * hz), n / 14 * 14 * 16.0 / seconds / 1e9);
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a9), a13));
    return out[0] == 12345.0f; /* (keeps the sums alive) */
}
