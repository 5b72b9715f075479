/* The host forward's compiled kernels (float32; weights float32 or bfloat16; x86-64 with AVX2 and
 * FMA): products of a few rows by a weight packed in column panels, and attention of a few queries
 * over a sequence's cache.
 *
 * Products. Why: on the CPUs this project is measured on, MKL's and OpenBLAS's float32 GEMM of a few rows by
 * a weight matrix runs at about a quarter of the core's arithmetic rate and far under its memory
 * rate: the bundled target's matrices cost 2.5 ms for 1 row but 6-7 ms for 5 rows (docs/ENGINE.md,
 * "Panel products"). So every token a draft adds to the target's pass cost a large share of a
 * whole step. Here the weight is read once, as one sequential stream, and each of its values is
 * used for every row while it sits in a register: 5 rows cost little more than 1.
 *
 * Layout: a weight W of shape (K, N) (the lean forward's transposed copy, y = x @ W) is packed as
 * panels of PANEL = 16 columns, (ceil(N / 16), K, 16), zero-padded on the right (PanelWeight in
 * gbv/engine/host_kernels.py packs it), in float32 or in bfloat16 (half the bytes to stream; each
 * value widened to its float32 in registers, so the sums are those of float32 panels of the same
 * values). For each panel (or group of panels), rows are taken a tile at a time; the panels stay in
 * the L1/L2 cache while every row tile reads them, so the weight crosses the memory bus once.
 *
 * Each output is sum_k x[r, k] * W[k, c] accumulated in order of k in float32 (one fused
 * multiply-add per term) in every tile, then added to y when accumulating: the same sum as any GEMM,
 * in another order, and the same bits for a row whatever the product's row count (a step, a tree
 * pass, a batch), and whatever the threads (set_threads: a product's columns are split among them).
 *
 * Where the CPU has AMX, bfloat16 weights are packed for its tiles instead (amx_pairs below), and
 * those products round x to bfloat16 first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
/* The kinds of packed weights (the products' `bf16` argument; host_kernels.py, PanelWeight.kind) */
#define PANELS_F32 0
#define PANELS_BF16 1
#define PANELS_AMX 2
#define PANELS_F16 3

/* Bytes of a (K, N) weight packed as `kind` (float32 or bfloat16 panels of 16 columns; the AMX kind's
 * panels in pairs and K padded to a multiple of 32: see amx_pairs). */
static Py_ssize_t panels_bytes(int kind, Py_ssize_t K, Py_ssize_t N) {
    if (kind == PANELS_AMX) return (N + 2 * PANEL - 1) / (2 * PANEL) * ((K + 31) / 32 * 32) * 2 * PANEL * 2;
    return (N + PANEL - 1) / PANEL * K * PANEL * (kind == PANELS_F32 ? 4 : 2);
}
#define TILE_ROWS 6
/* Panel rows (64 bytes each in float32) are prefetched 16 rows (this many bytes) ahead,
 * non-temporally (_MM_HINT_NTA: a weight streamed once per pass should not push the other model's
 * weights out of the shared L3). Measured on the bundled pair against no prefetch: the target's
 * 1-token step 2.58 -> 1.9 ms, its 5-token pass 4.3 -> 3.9 ms, and a draft step taken between target
 * passes 0.63 -> 0.52 ms. (_MM_HINT_T0 gained only on the 5-token pass; 8, 16, 32 and 64 rows ahead
 * are within the noise of each other.) bfloat16 panels (32-byte rows) are prefetched as many bytes
 * ahead, once per 64-byte line in tiles with an even number of sets (one row of bf16 panels:
 * 0.36-0.38 -> 0.34-0.36 ms with four sets; a prefetch per panel row issued twice as many). */
#define PREFETCH_BYTES 1024

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GBV_PANELS_X86 1
#include <immintrin.h>

/* Loading one panel row (16 weights) as two vectors of 8 float32 columns, lo (0-7) and hi (8-15).
 * float32 panels: two loads. bfloat16 panels (the upper half of a float32's bits): one 32-byte load
 * and two interleaves with zeros, which turn each 16-bit value into the float32 it stands for
 * exactly. The interleave takes words 0-3 and 8-11 into lo and 4-7 and 12-15 into hi, so
 * host_kernels.py stores each bf16 panel row in the column order 0-3, 8-11, 4-7, 12-15. float16 panels
 * (a float16 model's weights, PANELS_F16): two 16-byte loads, each widened by F16C's conversion, exact
 * (every float16 value is a float32 value), in column order. */
#define LOAD_F32(p, k, lo, hi)                                                                      \
    do {                                                                                            \
        lo = _mm256_loadu_ps((p) + (k) * PANEL);                                                    \
        hi = _mm256_loadu_ps((p) + (k) * PANEL + 8);                                                \
    } while (0)
#define LOAD_BF16(p, k, lo, hi)                                                                     \
    do {                                                                                            \
        const __m256i raw_ = _mm256_loadu_si256((const __m256i *)((p) + (k) * PANEL));              \
        lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), raw_));              \
        hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), raw_));              \
    } while (0)
#define LOAD_F16(p, k, lo, hi)                                                                      \
    do {                                                                                            \
        lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p) + (k) * PANEL)));                \
        hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p) + (k) * PANEL + 8)));            \
    } while (0)
/* Non-temporal (the default, above) or into every cache level (set_prefetch_temporal): on an Intel Xeon
 * with AVX-512 and a large L3 the non-temporal hint kept the weights out of the L3, and the bundled
 * target's float32 step took 3.74 ms against 1.21 ms with _MM_HINT_T0 (scripts/bench_prefetch_hint.py;
 * gbv.engine.lean_host.choose_cpu_forward measures which one this machine wants). A well-predicted
 * branch per prefetch. A tile of P panels and fewer than 8 rows prefetches each panel's stream
 * PREFETCH_BYTES / P ahead, so that as many lines are in flight as for one panel: with PREFETCH_BYTES
 * in each of 4 streams, the one-row tiles of 4 panels took a float32 target step in 5.0 ms against 4.2
 * for the one-panel tile before them, non-temporally on the Xeon (1.15x; 1.35x on the AVX2 tiles),
 * and with the distance shared, 2.1 ms (0.51x; 0.69x on AVX2); a 3-row pass 1.39x with the full
 * distance, 0.76x shared. Tiles of 8 rows or more (two panels, compute-bound) keep the full distance
 * per stream, as before: shared, a 1,000-token prefill took 1.32x. Prefetching into every level, the
 * distance changed nothing measurable (docs/ENGINE.md, "One sum order for every pass"). That is the AVX-512
 * tiles' rule still; the AVX2 tiles of several rows prefetch further ahead since the forty-sixth session
 * (AVX2_AHEAD). */
static int prefetch_temporal = 0;
#define PREFETCH(p, k) PREFETCH_AHEAD(p, k, PREFETCH_BYTES)
#define PREFETCH_AHEAD(p, k, ahead)                                                                 \
    do {                                                                                            \
        const char *at_ = (const char *)((p) + (k) * PANEL) + (ahead);                              \
        if (prefetch_temporal)                                                                      \
            _mm_prefetch(at_, _MM_HINT_T0);                                                         \
        else                                                                                        \
            _mm_prefetch(at_, _MM_HINT_NTA);                                                        \
    } while (0)

/* y's row `out`: `width` of the panel's 16 columns, from lo (columns 0-7) and hi (8-15), added to what
 * it holds when accumulating. */
__attribute__((target("avx2,fma"))) static inline void store_panel_row(float *out, __m256 lo, __m256 hi, int width,
                                                                      int accumulate) {
    if (width == PANEL) {
        if (accumulate) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(out));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(out + 8));
        }
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
    } else { /* the last panel of a width that is not a multiple of 16 */
        float sums[PANEL];
        _mm256_storeu_ps(sums, lo);
        _mm256_storeu_ps(sums + 8, hi);
        for (int c = 0; c < width; c++) out[c] = accumulate ? out[c] + sums[c] : sums[c];
    }
}

/* One tile: R rows of x (row stride xs) by P adjacent panels of WTYPE weights (panel p at
 * panel_bytes + p K PANEL values), into R rows of y (row stride ys); `width` is the last panel's width
 * (the others are whole). R and P are constants in each copy, so that the accumulators stay in
 * registers: every loop over them is unrolled. (Without the unroll pragmas GCC kept the arrays in
 * memory and stored ten accumulators to the stack at every k: 20 store micro-ops against 12 fused
 * multiply-adds, and the 6-row tile ran at 0.57 of this core's one 8-wide FMA per cycle; unrolled,
 * 0.95.)
 *
 * Each output's sum runs over k in one accumulator, in order of k (one fused multiply-add per term),
 * in every tile of every height and panel count, here and in the AVX-512 tiles below. So a row's
 * products do not depend on how many rows the product has, nor on which tile takes it: a token's
 * logits are the same in a 1-token step, a 25-node tree pass and a batch of 16 sequences (docs/ENGINE.md,
 * "One sum order for every pass"). A chain of fused multiply-adds waits on its own latency (4-5 cycles
 * on the machines measured), so a tile needs about 8 independent sums to keep two FMA units busy: a
 * tile of few rows takes them from several panels at once (P), not from splitting k (which made a
 * row's sums depend on its tile's height). */
/* (F16C for the float16 panels' loads: every CPU with AVX2 and FMA has it, and the float32 and bfloat16
 * tiles use none of its instructions; kind_error asks the CPU before float16 panels are multiplied.) */
#define AVX2_TILE_TARGET "avx2,fma,f16c"
/* Whether a tile of R rows by P panels loads x's broadcasts again for each panel: where its 2 R P
 * accumulators, its R broadcasts and a panel row's 2 vectors pass the 16 AVX2 registers. GCC loaded
 * each broadcast once per k for all P panels, and for 3 rows by 2 panels (17 registers) kept one
 * accumulator on the stack: a store and a load in that sum's chain at every k. The tile ran at 0.88
 * fused multiply-adds a cycle on a Zen 3 core (weights in the L1), below the 1.5 of the one-panel tile
 * of 3 rows. An empty asm that clobbers memory after each panel makes GCC load the broadcasts again
 * (from the L1: x is a few rows) and keep every sum in a register: 1.47-1.93 FMAs a cycle for float32,
 * bfloat16 and float16 panels (scripts/tile_fma.c; docs/ENGINE.md, "The AVX2 tile of 3 rows"). Only the
 * loads change: every sum is the same, bit for bit. */
#define RELOAD_X(R, P) ((P) > 1 && 2 * (R) * (P) + (R) + 2 > 16)
/* How far ahead, in bytes, a tile of R rows by P panels prefetches each panel's stream: PREFETCH_BYTES / P
 * for one row (the streams share the distance: see PREFETCH_AHEAD), 2 R PREFETCH_BYTES for a one-panel tile of
 * R >= 2 rows (4-6 rows, and the panels left over), 16 R PREFETCH_BYTES / 2 for the two-panel tiles of 2 and 3
 * rows. Why: a tile of R rows spends about R times as long on each panel row as a one-row tile, so the same
 * bytes ahead are R times fewer nanoseconds ahead of its loads. With the one-row distance at every height, the
 * float32 target's passes of a few tokens on a Zen 3 core took about as long as their stream plus their
 * arithmetic, one after the other: 5 rows of products 1.75 ms, one row 0.97 ms, the 5 rows' arithmetic
 * alone 0.78 ms (scripts/pass_products.py). Against that distance, on that core (1 thread, bundled pair;
 * scripts/bench_prefetch_distance.py; docs/ENGINE.md, "Prefetching further ahead in taller tiles"):
 *   - after 4 steps of the draft, as decoding runs them (--after-draft): passes of 2-3 tokens 0.93-0.95x the
 *     time in float32 and 0.74-0.85x in bfloat16, of 5-9 tokens 1.0x in float32 and 0.93-0.94x in bfloat16;
 *   - passes back to back (the target's weights partly in the L3): float32 passes of 2-5 tokens 0.77-0.89x, of
 *     8-12 0.91-0.94x, bfloat16 ones of 2-12 tokens 0.76-0.97x (scripts/bench_kernels_ab.py);
 *   - 1, 4 and 8 times R PREFETCH_BYTES did no better for one-panel tiles. The two-panel tiles gained nothing
 *     at 2 and want more: after draft steps, bfloat16 passes of 2-3 tokens took 0.90-0.98x the time of 2's
 *     at 8 and 0.91-0.92x at 16;
 *   - the draft, whose weights stay in the caches, pays for it: its float32 passes of 3-9 rows took 1.04-1.07x
 *     the time of the one-row distance's (at 4 for every tile, 1.03-1.09x the kept distances').
 * A one-row tile keeps its distance, and the hint stays non-temporal: probes of other one-row distances and of
 * _MM_HINT_T0, T1 and T2 for the taller tiles gained nothing. The AVX-512 tiles keep theirs (no machine with
 * AVX-512 to measure on since). Only prefetches move: every sum is the same, bit for bit. */
#define AHEAD_ONE_PANEL 2 /* tiles of R >= 2 rows by one panel: 2 R PREFETCH_BYTES ahead */
#define AHEAD_PANELS 16   /* tiles of 2-3 rows by 2 panels: 16 R PREFETCH_BYTES / 2 in each stream */
#define AVX2_AHEAD(R, P) \
    ((R) == 1 ? PREFETCH_BYTES / (P) : ((P) > 1 ? AHEAD_PANELS : AHEAD_ONE_PANEL) * PREFETCH_BYTES * (R) / (P))
#define DEFINE_TILE(R, P, NAME, WTYPE, LOAD, UNROLL)                                                \
    __attribute__((target(AVX2_TILE_TARGET))) static void tile##P##_##NAME##_##R(                         \
        const float *x, Py_ssize_t xs, const void *panel_bytes, Py_ssize_t K, float *y, Py_ssize_t ys, \
        int width, int accumulate) {                                                                \
        const WTYPE *panel = (const WTYPE *)panel_bytes;                                            \
        __m256 lo[P][R], hi[P][R];                                                                  \
        _Pragma("GCC unroll 4") for (int p = 0; p < P; p++)                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
                lo[p][r] = _mm256_setzero_ps();                                                     \
                hi[p][r] = _mm256_setzero_ps();                                                     \
            }                                                                                       \
        PRAGMA(GCC unroll UNROLL) for (Py_ssize_t k = 0; k < K; k++) {                              \
            _Pragma("GCC unroll 4") for (int p = 0; p < P; p++) {                                   \
                const WTYPE *this_panel = panel + p * K * PANEL;                                    \
                if (sizeof(WTYPE) == 4 || k % 2 == 0) /* once per 64-byte line */                   \
                    PREFETCH_AHEAD(this_panel, k, AVX2_AHEAD(R, P));                               \
                __m256 w_lo, w_hi;                                                                  \
                LOAD(this_panel, k, w_lo, w_hi);                                                    \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                    const __m256 b = _mm256_broadcast_ss(x + r * xs + k);                           \
                    lo[p][r] = _mm256_fmadd_ps(b, w_lo, lo[p][r]);                                  \
                    hi[p][r] = _mm256_fmadd_ps(b, w_hi, hi[p][r]);                                  \
                }                                                                                   \
                if (RELOAD_X(R, P)) __asm__ volatile("" ::: "memory");                               \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 4") for (int p = 0; p < P; p++)                                         \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                     \
                store_panel_row(y + r * ys + p * PANEL, lo[p][r], hi[p][r], p == P - 1 ? width : PANEL, \
                                accumulate);                                                        \
    }

/* The AVX2 tiles: P panels by R rows, about 8 sums each (2 R P: the lo and hi halves of each panel
 * row); the one-panel tiles take the panels left over.
 *
 * The loop over k is unrolled U times: twice for float32 panels, once for bfloat16 and float16 ones,
 * whose one-panel tiles of 4 rows ran at 1.52-1.72 FMAs a cycle unrolled twice and 1.74-1.91 once on a
 * Zen 3 core (the tile of 2 rows by 2 panels 1.5 against 1.5-1.7, the others within noise; weights in
 * the L1, scripts/tile_fma.c). The tile of 3 rows by 2 panels keeps 2 in every kind (1.78-1.93 against
 * 1.73-1.76 once for 16-bit panels). In the engine, bfloat16 passes of 4, 8 and 9 tokens and trees of
 * 13 nodes took 0.93-0.96x the time (scripts/bench_kernels_ab.py). The sums are the same either way. */
#define PRAGMA(text) _Pragma(#text)
#define DEFINE_TILES(NAME, WTYPE, LOAD, U)                                                          \
    DEFINE_TILE(1, 4, NAME, WTYPE, LOAD, U)                                                         \
    DEFINE_TILE(2, 2, NAME, WTYPE, LOAD, U)                                                         \
    DEFINE_TILE(3, 2, NAME, WTYPE, LOAD, 2)                                                         \
    DEFINE_TILE(1, 1, NAME, WTYPE, LOAD, U)                                                         \
    DEFINE_TILE(2, 1, NAME, WTYPE, LOAD, U)                                                         \
    DEFINE_TILE(3, 1, NAME, WTYPE, LOAD, U)                                                         \
    DEFINE_TILE(4, 1, NAME, WTYPE, LOAD, U)                                                         \
    DEFINE_TILE(5, 1, NAME, WTYPE, LOAD, U)                                                         \
    DEFINE_TILE(6, 1, NAME, WTYPE, LOAD, U)

DEFINE_TILES(f32, float, LOAD_F32, 2)
DEFINE_TILES(bf16, uint16_t, LOAD_BF16, 1)
DEFINE_TILES(f16, uint16_t, LOAD_F16, 1)

typedef void (*tile_fn)(const float *, Py_ssize_t, const void *, Py_ssize_t, float *, Py_ssize_t, int, int);
static const tile_fn TILES_F32[TILE_ROWS + 1] = {NULL, tile1_f32_1, tile1_f32_2, tile1_f32_3, tile1_f32_4,
                                                 tile1_f32_5, tile1_f32_6};
static const tile_fn TILES_BF16[TILE_ROWS + 1] = {NULL, tile1_bf16_1, tile1_bf16_2, tile1_bf16_3, tile1_bf16_4,
                                                  tile1_bf16_5, tile1_bf16_6};
static const tile_fn TILES_F16[TILE_ROWS + 1] = {NULL, tile1_f16_1, tile1_f16_2, tile1_f16_3, tile1_f16_4,
                                                 tile1_f16_5, tile1_f16_6};
/* Multi-panel AVX2 tiles by rows (products of 1 to 3 rows): the tile and its panel count. */
static const tile_fn TILESP_F32[4] = {NULL, tile4_f32_1, tile2_f32_2, tile2_f32_3};
static const tile_fn TILESP_BF16[4] = {NULL, tile4_bf16_1, tile2_bf16_2, tile2_bf16_3};
static const tile_fn TILESP_F16[4] = {NULL, tile4_f16_1, tile2_f16_2, tile2_f16_3};
static const int TILESP_PANELS[4] = {0, 4, 2, 2};

/* AVX-512 tiles, for products where the CPU has AVX-512F (set_avx512). Why: a pass of several rows
 * (the target's pass over a block or a tree) is bound by the fused multiply-adds, not by the weight's
 * bytes: on an Intel Xeon with AVX-512 the bundled target's 25-node pass took 4.3x a 1-token step in
 * float32. One 16-wide vector holds a whole panel row, so a tile does half the FMAs of two 8-wide
 * ones, loads each panel row once for all its rows, and reads the panel from the L1 / L2 half as many
 * times. bfloat16 panel rows (in the column order 0-3, 8-11, 4-7, 12-15 of the AVX2 loads) are
 * widened in that order and put back in column order once, at the store, so that float32 and bfloat16
 * panels of the same values still give the same sums, bit for bit.
 *
 * P adjacent panels by R rows, each output's sum over k in one accumulator, in order (as the AVX2
 * tiles: the same sums, bit for bit). Several panels share each broadcast of x: R + P loads for R P
 * FMAs. (With one panel, the broadcast load per FMA bound a pass of many rows to the load ports: a
 * prompt's prefill made ~90 GFLOP/s here where torch's GEMM makes 160-170.) Tiles of 8 rows or more
 * take two panels (2 x 14 accumulators, 2 panel rows and a broadcast fit the 32 registers; split as
 * evenly as they come, 8 rows or more give tiles of 7 to 14 rows: 15 = 8 + 7), fewer rows take more
 * panels for about 8 independent sums (two FMA units, latency 4), and one-panel tiles take the panels
 * left over. ``width`` is the last panel's (the others are whole). */
#define TILE512_ROWS 16
#define LOAD512_F32(p, k) _mm512_loadu_ps((p) + (k) * PANEL)
#define LOAD512_BF16(p, k)                                                                          \
    _mm512_castsi512_ps(                                                                            \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((p) + (k) * PANEL))), 16))
#define LOAD512_F16(p, k) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((p) + (k) * PANEL)))
#define DEFINE_TILE512(R, P, NAME, WTYPE, LOAD, BF16)                                               \
    __attribute__((target("avx512f"))) static void tile512x##P##_##NAME##_##R(                      \
        const float *x, Py_ssize_t xs, const void *panel_bytes, Py_ssize_t K, float *y, Py_ssize_t ys, \
        int width, int accumulate) {                                                                \
        const WTYPE *panel = (const WTYPE *)panel_bytes;                                            \
        __m512 acc[P][R];                                                                           \
        _Pragma("GCC unroll 4") for (int p = 0; p < P; p++)                                         \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[p][r] = _mm512_setzero_ps();   \
        _Pragma("GCC unroll 2") for (Py_ssize_t k = 0; k < K; k++) {                                \
            __m512 w[P];                                                                            \
            _Pragma("GCC unroll 4") for (int p = 0; p < P; p++) {                                   \
                if (sizeof(WTYPE) == 4 || k % 2 == 0) /* once per 64-byte line */                   \
                    PREFETCH_AHEAD(panel + p * K * PANEL, k, R < 8 ? PREFETCH_BYTES / P : PREFETCH_BYTES); \
                w[p] = LOAD(panel + p * K * PANEL, k);                                              \
            }                                                                                       \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                  \
                const __m512 b = _mm512_set1_ps(x[r * xs + k]);                                     \
                _Pragma("GCC unroll 4") for (int p = 0; p < P; p++)                                 \
                    acc[p][r] = _mm512_fmadd_ps(b, w[p], acc[p][r]);                                \
            }                                                                                       \
        }                                                                                           \
        const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15); \
        const __mmask16 lanes = (__mmask16)((1u << width) - 1u);                                    \
        _Pragma("GCC unroll 4") for (int p = 0; p < P; p++)                                         \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                  \
                __m512 sums = acc[p][r];                                                            \
                if (BF16) sums = _mm512_permutexvar_ps(order, sums); /* back to column order */     \
                float *out = y + r * ys + p * PANEL;                                                \
                if (p < P - 1 || width == PANEL) {                                                  \
                    if (accumulate) sums = _mm512_add_ps(sums, _mm512_loadu_ps(out));               \
                    _mm512_storeu_ps(out, sums);                                                    \
                } else { /* the last panel of a width that is not a multiple of 16 */               \
                    if (accumulate) sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(lanes, out));  \
                    _mm512_mask_storeu_ps(out, lanes, sums);                                        \
                }                                                                                   \
            }                                                                                       \
    }
#define DEFINE_TILES512(NAME, WTYPE, LOAD, BF16)                                                    \
    DEFINE_TILE512(1, 4, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(2, 4, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(3, 4, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(4, 2, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(5, 2, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(6, 2, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(7, 2, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(8, 2, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(9, 2, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(10, 2, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(11, 2, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(12, 2, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(13, 2, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(14, 2, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(1, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(2, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(3, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(4, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(5, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(6, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(7, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(8, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(9, 1, NAME, WTYPE, LOAD, BF16)                                                   \
    DEFINE_TILE512(10, 1, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(11, 1, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(12, 1, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(13, 1, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(14, 1, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(15, 1, NAME, WTYPE, LOAD, BF16)                                                  \
    DEFINE_TILE512(16, 1, NAME, WTYPE, LOAD, BF16)

DEFINE_TILES512(f32, float, LOAD512_F32, 0)
DEFINE_TILES512(bf16, uint16_t, LOAD512_BF16, 1)
DEFINE_TILES512(f16, uint16_t, LOAD512_F16, 0)

static const tile_fn TILES512_F32[TILE512_ROWS + 1] = {
    NULL, tile512x1_f32_1, tile512x1_f32_2, tile512x1_f32_3, tile512x1_f32_4, tile512x1_f32_5, tile512x1_f32_6,
    tile512x1_f32_7, tile512x1_f32_8, tile512x1_f32_9, tile512x1_f32_10, tile512x1_f32_11, tile512x1_f32_12,
    tile512x1_f32_13, tile512x1_f32_14, tile512x1_f32_15, tile512x1_f32_16};
static const tile_fn TILES512_BF16[TILE512_ROWS + 1] = {
    NULL, tile512x1_bf16_1, tile512x1_bf16_2, tile512x1_bf16_3, tile512x1_bf16_4, tile512x1_bf16_5,
    tile512x1_bf16_6, tile512x1_bf16_7, tile512x1_bf16_8, tile512x1_bf16_9, tile512x1_bf16_10, tile512x1_bf16_11,
    tile512x1_bf16_12, tile512x1_bf16_13, tile512x1_bf16_14, tile512x1_bf16_15, tile512x1_bf16_16};
static const tile_fn TILES512_F16[TILE512_ROWS + 1] = {
    NULL, tile512x1_f16_1, tile512x1_f16_2, tile512x1_f16_3, tile512x1_f16_4, tile512x1_f16_5, tile512x1_f16_6,
    tile512x1_f16_7, tile512x1_f16_8, tile512x1_f16_9, tile512x1_f16_10, tile512x1_f16_11, tile512x1_f16_12,
    tile512x1_f16_13, tile512x1_f16_14, tile512x1_f16_15, tile512x1_f16_16};
/* Multi-panel AVX-512 tiles by rows: four panels for 1-3 rows, two for 4-14 (rows 8 and more are split
 * into tiles of at most TILE512X2_ROWS). */
#define TILE512X2_ROWS 14
#define TILE512X2_MIN_ROWS 8
static const tile_fn TILES512P_F32[TILE512X2_ROWS + 1] = {
    NULL, tile512x4_f32_1, tile512x4_f32_2, tile512x4_f32_3, tile512x2_f32_4, tile512x2_f32_5, tile512x2_f32_6,
    tile512x2_f32_7, tile512x2_f32_8, tile512x2_f32_9, tile512x2_f32_10, tile512x2_f32_11, tile512x2_f32_12,
    tile512x2_f32_13, tile512x2_f32_14};
static const tile_fn TILES512P_BF16[TILE512X2_ROWS + 1] = {
    NULL, tile512x4_bf16_1, tile512x4_bf16_2, tile512x4_bf16_3, tile512x2_bf16_4, tile512x2_bf16_5,
    tile512x2_bf16_6, tile512x2_bf16_7, tile512x2_bf16_8, tile512x2_bf16_9, tile512x2_bf16_10, tile512x2_bf16_11,
    tile512x2_bf16_12, tile512x2_bf16_13, tile512x2_bf16_14};
static const tile_fn TILES512P_F16[TILE512X2_ROWS + 1] = {
    NULL, tile512x4_f16_1, tile512x4_f16_2, tile512x4_f16_3, tile512x2_f16_4, tile512x2_f16_5, tile512x2_f16_6,
    tile512x2_f16_7, tile512x2_f16_8, tile512x2_f16_9, tile512x2_f16_10, tile512x2_f16_11, tile512x2_f16_12,
    tile512x2_f16_13, tile512x2_f16_14};
static const int TILES512P_PANELS[TILE512X2_ROWS + 1] = {0, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
/* Whether products of TILE512X2_MIN_ROWS rows or more take the two-panel tiles (where the AVX-512 tiles
 * run); set_two_panel_tiles (GBV_HOST_TWO_PANEL=0 in gbv/engine/host_kernels.py) turns them off. */
static int two_panel_tiles = 1;

/* Whether products of 2 rows or more take the AVX-512 tiles (and attend_tiles its AVX-512 score tiles
 * and weighted sums): -1 until decided (the CPU's AVX-512F), then 0 or 1; set_avx512 overrides it
 * (GBV_HOST_AVX512=0 in gbv/engine/host_kernels.py). */
static int avx512_tiles = -1;

static int avx512_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

static int use_avx512(void) {
    if (avx512_tiles < 0)
        avx512_tiles = avx512_supported();
    return avx512_tiles;
}

/* ---------------------------------------------------------------------------------------------
 * AMX products (panels of kind PANELS_AMX): bfloat16 weights times x rounded to bfloat16.
 *
 * Why: on a CPU with AMX (Intel Xeon, Sapphire Rapids on), one tile instruction multiplies 16 rows of
 * 32 bfloat16 inputs by a 32 x 16 block of weights. The AVX-512 tiles above run a bfloat16 model's
 * products of many rows at the rate of their float32 multiply-adds: a 25-query pass of the bundled
 * target cost 2.5 ms of products against 0.56 ms for one row, where the weights' bytes set the cost.
 * Here the arithmetic of 25 rows, or of a 100-token prompt, costs little next to reading the weights.
 *
 * The price: the tile multiplies bfloat16 by bfloat16, so each row of x is rounded to bfloat16 (to
 * nearest even) first, as Hugging Face's bfloat16 forward rounds every activation. Everything else
 * (the residual stream, norms, attention, softmax) stays float32. Each output is the float32 sum of
 * the exact products bf16(x[r, k]) * W[k, c] (docs/ENGINE.md, "AMX products").
 *
 * Layout (host_kernels.py packs it): the columns in panels of 16, the panels in pairs (an odd last
 * panel paired with zeros), K padded with zeros to a multiple of 32. For each pair, for each step of
 * 32 values of k, two 1 KB blocks, one per panel, of 16 rows of (W[k, c], W[k + 1, c]) for c in the
 * panel's 16 columns: the B operand of the tile instruction (the "VNNI" order), read as one stream.
 * Rows of x go 16 at a time (two such tiles at once where there are more than 16 rows left), the
 * last tile padded with zero rows, or as one tile of M rows up to 16; the tile results are copied (or
 * added) into y column by column. One row is a tile of one row too: a row's products then do not depend
 * on how many rows the product has (bit for bit; AVX512-BF16 dot products, which one row took before,
 * give other sums than the tiles: the tiles' rounding within a block is not that of chained fused
 * multiply-adds), at ~3% of a bfloat16 1-token step (docs/ENGINE.md, "One sum order for every pass").
 * ------------------------------------------------------------------------------------------- */
/* (compilers that know the AMX intrinsics, on Linux, where the tile data is asked for by arch_prctl) */
#if defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define GBV_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define AMX_ROWS 16                                     /* rows of a tile */
#define AMX_STEP 32                                     /* values of k per tile instruction */
#define AMX_BLOCK (AMX_ROWS * AMX_STEP)                 /* bfloat16 values of one panel's block */
#define AMX_K(K) (((K) + AMX_STEP - 1) / AMX_STEP * AMX_STEP)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The tile configuration (palette 1): tiles of up to 16 rows of 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} amx_config;

#ifndef GBV_AMX
static int amx_supported(void) { return 0; }
/* (never called: kind_error refuses AMX panels where amx_supported is 0) */
static const uint16_t *amx_rounded(const float *x, Py_ssize_t M, Py_ssize_t K) { return NULL; }
static void amx_pairs(const uint16_t *x16, const uint16_t *panels, float *y, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N,
                      int accumulate, Py_ssize_t first_pair, Py_ssize_t end_pair) {}
#else
/* Whether the AMX products can run: -1 until asked (the CPU's AMX-TILE, AMX-BF16 and AVX512-BF16, and
 * the kernel's permission to use the tile data, asked once per process), then 0 or 1. (Whether they do
 * is how the weights are packed: host_kernels.py, set_amx_products.) */
static int amx_permitted = -1;

static int amx_supported(void) {
    if (amx_permitted < 0) {
        unsigned a, b, c, d;
        int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1) && (b >> 16 & 1);
        cpu = cpu && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1); /* AVX512-BF16 */
        /* Linux hands out the tile state only on request (arch_prctl since 5.16); 0: granted */
        amx_permitted = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_permitted;
}

/* x rounded to bfloat16, in whole tiles of rows, K padded with zeros: per thread, grown as needed. */
static __thread uint16_t *amx_x;
static __thread size_t amx_x_values;

/* rows (M, K) float32 -> out (rows_padded, K32) bfloat16 bits, to nearest even; zeros after. */
__attribute__((target("avx512f,avx512bf16"))) static void amx_round_rows(const float *x, Py_ssize_t M,
                                                                        Py_ssize_t K, Py_ssize_t rows_padded,
                                                                        uint16_t *out) {
    const Py_ssize_t K32 = AMX_K(K);
    for (Py_ssize_t r = 0; r < M; r++) {
        const float *row = x + r * K;
        uint16_t *o = out + r * K32;
        Py_ssize_t k = 0;
        for (; k + 16 <= K; k += 16)
            _mm256_storeu_si256((__m256i *)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
        if (k < K) {
            const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);
            const __m512 last = _mm512_maskz_loadu_ps(tail, row + k); /* (zeros past K) */
            _mm256_storeu_si256((__m256i *)(o + k), (__m256i)_mm512_cvtneps_pbh(last));
            k += 16;
        }
        if (k < K32) memset(o + k, 0, (size_t)(K32 - k) * sizeof(uint16_t));
    }
    memset(out + M * K32, 0, (size_t)((rows_padded - M) * K32) * sizeof(uint16_t));
}

/* y[r, c0 .. c0 + width) = [y +] the tile result c (16 x 16 float32) for rows r0 .. r0 + rows. */
__attribute__((target("avx512f"))) static void amx_write(const float *c, float *y, Py_ssize_t N, Py_ssize_t r0,
                                                         int rows, Py_ssize_t c0, int width, int accumulate) {
    if (width <= 0) return;
    const __mmask16 mask = (__mmask16)(width >= 16 ? 0xFFFF : (1u << width) - 1);
    for (int r = 0; r < rows; r++) {
        float *out = y + (r0 + r) * N + c0;
        __m512 v = _mm512_loadu_ps(c + r * AMX_ROWS);
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, out));
        _mm512_mask_storeu_ps(out, mask, v);
    }
}

/* x (M, K) rounded to bfloat16 for amx_pairs, in this thread's buffer (amx_x; NULL: out of memory). */
static const uint16_t *amx_rounded(const float *x, Py_ssize_t M, Py_ssize_t K) {
    const Py_ssize_t K32 = AMX_K(K), row_tiles = (M + AMX_ROWS - 1) / AMX_ROWS;
    const size_t values = (size_t)(row_tiles * AMX_ROWS * K32);
    if (values > amx_x_values) {
        free(amx_x);
        amx_x = (uint16_t *)aligned_alloc(64, values * sizeof(uint16_t));
        amx_x_values = amx_x == NULL ? 0 : values;
        if (amx_x == NULL) return NULL;
    }
    amx_round_rows(x, M, K, row_tiles == 1 ? M : row_tiles * AMX_ROWS, amx_x);
    return amx_x;
}

/* Pairs first_pair .. end_pair - 1 of y (M, N) = [y +] x16 @ W, x16 the rows amx_rounded gave (M >= 1),
 * W packed as above. Each thread that runs a range configures its own tiles. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) static void amx_pairs(
    const uint16_t *x16, const uint16_t *panels, float *y, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N, int accumulate,
    Py_ssize_t first_pair, Py_ssize_t end_pair) {
    const Py_ssize_t K32 = AMX_K(K), steps = K32 / AMX_STEP, row_tiles = (M + AMX_ROWS - 1) / AMX_ROWS;
    /* Up to 16 rows (a step, a draft's step, a block's pass): tiles of x and of sums of M rows, as
     * configured, rather than 16 with zero rows (bf16 target forwards of 1-12 tokens 0.986-0.997x the
     * time: scripts/bench_kernels_ab.py). More: tiles of 16 rows, the last padded with zero rows. */
    const int rows = row_tiles == 1 ? (int)M : AMX_ROWS;
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t < 6 ? rows : AMX_ROWS; /* (tiles 0-3: sums, 4-5: x, 6-7: weights) */
        config.bytes_per_row[t] = AMX_STEP * sizeof(uint16_t);
    }
    _tile_loadconfig(&config);
    float c[4][AMX_ROWS * AMX_ROWS] __attribute__((aligned(64)));
    const Py_ssize_t a_stride = K32 * (Py_ssize_t)sizeof(uint16_t), b_stride = 2 * PANEL * sizeof(uint16_t);
    for (Py_ssize_t p = first_pair; p < end_pair; p++) {
        const uint16_t *pair = panels + p * K32 * 2 * PANEL;
        const Py_ssize_t c0 = 2 * p * PANEL;
        const int width0 = (int)(N - c0 < PANEL ? N - c0 : PANEL);
        const int width1 = (int)(N - c0 - PANEL < PANEL ? N - c0 - PANEL : PANEL);
        for (Py_ssize_t t = 0; t < row_tiles; t += 2) {
            const uint16_t *a = x16 + t * AMX_ROWS * K32;
            const Py_ssize_t r0 = t * AMX_ROWS;
            _tile_zero(0);
            _tile_zero(1);
            if (t + 1 < row_tiles) { /* two tiles of rows: each block of weights feeds four products */
                _tile_zero(2);
                _tile_zero(3);
                for (Py_ssize_t s = 0; s < steps; s++) {
                    _tile_loadd(4, a + s * AMX_STEP, a_stride);
                    _tile_loadd(5, a + AMX_ROWS * K32 + s * AMX_STEP, a_stride);
                    _tile_loadd(6, pair + 2 * s * AMX_BLOCK, b_stride);
                    _tile_loadd(7, pair + (2 * s + 1) * AMX_BLOCK, b_stride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(2, c[2], AMX_ROWS * sizeof(float));
                _tile_stored(3, c[3], AMX_ROWS * sizeof(float));
            } else {
                for (Py_ssize_t s = 0; s < steps; s++) {
                    _tile_loadd(4, a + s * AMX_STEP, a_stride);
                    _tile_loadd(6, pair + 2 * s * AMX_BLOCK, b_stride);
                    _tile_loadd(7, pair + (2 * s + 1) * AMX_BLOCK, b_stride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
            }
            _tile_stored(0, c[0], AMX_ROWS * sizeof(float));
            _tile_stored(1, c[1], AMX_ROWS * sizeof(float));
            const int rows0 = (int)(M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS);
            amx_write(c[0], y, N, r0, rows0, c0, width0, accumulate);
            amx_write(c[1], y, N, r0, rows0, c0 + PANEL, width1, accumulate);
            if (t + 1 < row_tiles) {
                const int rows1 = (int)(M - r0 - AMX_ROWS < AMX_ROWS ? M - r0 - AMX_ROWS : AMX_ROWS);
                amx_write(c[2], y, N, r0 + AMX_ROWS, rows1, c0, width0, accumulate);
                amx_write(c[3], y, N, r0 + AMX_ROWS, rows1, c0 + PANEL, width1, accumulate);
            }
        }
    }
    _tile_release();
}
#endif /* GBV_AMX */

/* One panel (or pair of panels) of y = [y +] x @ W for all M rows of x, by ``tiles`` of at most
 * ``max_rows`` rows, as even as they come (25 = 13 + 12). */
static void rows_in_tiles(const tile_fn *tiles, Py_ssize_t max_rows, const float *x, Py_ssize_t M, Py_ssize_t K,
                          const void *panel, float *y, Py_ssize_t N, int width, int accumulate) {
    const Py_ssize_t num_tiles = (M + max_rows - 1) / max_rows;
    for (Py_ssize_t t = 0, r = 0; t < num_tiles; t++) {
        const int rows = (int)((M - r) / (num_tiles - t) + ((M - r) % (num_tiles - t) != 0));
        tiles[rows](x + r * K, K, panel, K, y + r * N, N, width, accumulate);
        r += rows;
    }
}

/* Each kind's tiles (by kind: PANELS_F32, PANELS_BF16, none for PANELS_AMX, PANELS_F16). */
static const tile_fn *const KIND_TILES[4] = {TILES_F32, TILES_BF16, NULL, TILES_F16};
static const tile_fn *const KIND_TILESP[4] = {TILESP_F32, TILESP_BF16, NULL, TILESP_F16};
static const tile_fn *const KIND_TILES512[4] = {TILES512_F32, TILES512_BF16, NULL, TILES512_F16};
static const tile_fn *const KIND_TILES512P[4] = {TILES512P_F32, TILES512P_BF16, NULL, TILES512P_F16};

/* Panels first_panel .. end_panel - 1 of y (M, N) = [y +] x (M, K) @ W (K, N), W as panels of float32
 * (kind PANELS_F32), of bfloat16 (PANELS_BF16) or of float16 (PANELS_F16): the columns 16 * first_panel ..
 * 16 * end_panel - 1. */
static void panel_range(const float *x, const void *panels, int kind, float *y, Py_ssize_t M, Py_ssize_t K,
                        Py_ssize_t N, int accumulate, Py_ssize_t first_panel, Py_ssize_t end_panel) {
    const Py_ssize_t panel_bytes = K * PANEL * (kind == PANELS_F32 ? 4 : 2);
    Py_ssize_t p = first_panel; /* the first panel the one-panel tiles take */
    if (use_avx512()) {
        const tile_fn *multi = KIND_TILES512P[kind];
        if (M < TILE512X2_MIN_ROWS) { /* one tile of M rows by P panels, then the panels left over */
            const int P = TILES512P_PANELS[M];
            for (; p + P <= end_panel; p += P) {
                const int width = (int)(N - (p + P - 1) * PANEL < PANEL ? N - (p + P - 1) * PANEL : PANEL);
                multi[M](x, K, (const char *)panels + p * panel_bytes, K, y + p * PANEL, N, width, accumulate);
            }
        } else if (two_panel_tiles) { /* pairs of panels; a last odd one below */
            for (; p + 1 < end_panel; p += 2) {
                const int width = (int)(N - (p + 1) * PANEL < PANEL ? N - (p + 1) * PANEL : PANEL);
                rows_in_tiles(multi, TILE512X2_ROWS, x, M, K, (const char *)panels + p * panel_bytes, y + p * PANEL,
                              N, width, accumulate);
            }
        }
        for (; p < end_panel; p++) {
            const int width = (int)(N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
            rows_in_tiles(KIND_TILES512[kind], TILE512_ROWS, x, M, K,
                          (const char *)panels + p * panel_bytes, y + p * PANEL, N, width, accumulate);
        }
        return;
    }
    if (M < 4) { /* one tile of M rows by P panels, then the panels left over */
        const int P = TILESP_PANELS[M];
        const tile_fn tile = KIND_TILESP[kind][M];
        for (; p + P <= end_panel; p += P) {
            const int width = (int)(N - (p + P - 1) * PANEL < PANEL ? N - (p + P - 1) * PANEL : PANEL);
            tile(x, K, (const char *)panels + p * panel_bytes, K, y + p * PANEL, N, width, accumulate);
        }
    }
    for (; p < end_panel; p++) {
        const int width = (int)(N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
        rows_in_tiles(KIND_TILES[kind], TILE_ROWS, x, M, K, (const char *)panels + p * panel_bytes,
                      y + p * PANEL, N, width, accumulate);
    }
}

/* One panel row of float16 panels: `width` float32 values (float16 values: the caller checks) as float16,
 * zeros after them to 16. */
__attribute__((target("avx,f16c"))) static void pack_f16_row(const float *row, Py_ssize_t width, uint16_t *o) {
    float values[PANEL] = {0};
    memcpy(values, row, (size_t)width * sizeof(float));
    _mm_storeu_si128((__m128i *)o, _mm256_cvtps_ph(_mm256_loadu_ps(values), _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i *)(o + 8), _mm256_cvtps_ph(_mm256_loadu_ps(values + 8), _MM_FROUND_TO_NEAREST_INT));
}

/* Whether every one of the n float32 values is a float16 value (it survives the round trip through float16,
 * bit for bit): a float16 model's weights, widened. */
__attribute__((target("avx2,f16c"))) static int float16_values_only(const float *w, Py_ssize_t n) {
    __m256i differ = _mm256_setzero_si256();
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(w + i);
        const __m256 back = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        differ = _mm256_or_si256(differ, _mm256_xor_si256(_mm256_castps_si256(v), _mm256_castps_si256(back)));
    }
    if (!_mm256_testz_si256(differ, differ)) return 0;
    for (; i < n; i++) {
        const float back = _cvtsh_ss(_cvtss_sh(w[i], _MM_FROUND_TO_NEAREST_INT));
        if (memcmp(&back, w + i, sizeof back) != 0) return 0;
    }
    return 1;
}

/* The n float16 values at src as float32, exactly, into out (a float16 embedding's row). */
__attribute__((target("avx,f16c"))) static void widen_f16(const uint16_t *src, Py_ssize_t n, float *out) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(src[i]);
}

/* Panels (pairs for AMX) first .. end - 1 of a (K, N) float32 weight w packed as `kind` into out
 * (panels_bytes(kind, K, N) bytes; host_kernels.PanelWeight says the layouts): float32 panels (ceil(N / 16),
 * K, 16); bfloat16 ones the same, each row in the column order 0-3, 8-11, 4-7, 12-15 (LOAD_BF16's); float16
 * ones as float32's; AMX ones (pairs, K / 32, 2 panels, 16, 16 columns, 2 values of k). Zeros past N (and
 * past K for AMX). A bfloat16 value is a float32's upper half (the caller checks the lower halves are zero),
 * and a float16 one is exact in float16 (the caller checks that too). */
#define PACK_ROWS 64
static void pack_range(const float *w, Py_ssize_t K, Py_ssize_t N, int kind, void *out, Py_ssize_t first,
                       Py_ssize_t end) {
    static const int order[PANEL] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    if (kind == PANELS_AMX) {
        const Py_ssize_t K32 = AMX_K(K);
        for (Py_ssize_t pair = first; pair < end; pair++) {
            uint16_t *o = (uint16_t *)out + pair * K32 * 2 * PANEL;
            for (Py_ssize_t s = 0; s < K32 / AMX_STEP; s++)
                for (int pp = 0; pp < 2; pp++)
                    for (int i = 0; i < AMX_ROWS; i++)
                        for (int c = 0; c < PANEL; c++)
                            for (int t = 0; t < 2; t++) {
                                const Py_ssize_t k = s * AMX_STEP + 2 * i + t, col = (2 * pair + pp) * PANEL + c;
                                uint32_t bits = 0;
                                if (k < K && col < N) memcpy(&bits, w + k * N + col, sizeof bits);
                                *o++ = (uint16_t)(bits >> 16);
                            }
        }
        return;
    }
    /* Blocks of PACK_ROWS rows of k: within one, each panel's rows are written in order (a page of them), and
     * the block's rows of w (PACK_ROWS x N values) stay in the cache while every panel reads its columns.
     * (Panel by panel, or row by row, one side went strided across the whole matrix: 2.4 s for a 405M pair.) */
    for (Py_ssize_t k0 = 0; k0 < K; k0 += PACK_ROWS)
        for (Py_ssize_t p = first; p < end; p++)
            for (Py_ssize_t k = k0; k < K && k < k0 + PACK_ROWS; k++) {
            const float *row = w + k * N;
            const Py_ssize_t c0 = p * PANEL, width = N - c0 < PANEL ? N - c0 : PANEL;
            if (kind == PANELS_F32) {
                float *o = (float *)out + (p * K + k) * PANEL;
                memcpy(o, row + c0, (size_t)width * sizeof(float));
                if (width < PANEL) memset(o + width, 0, (size_t)(PANEL - width) * sizeof(float));
                continue;
            }
            uint16_t *o = (uint16_t *)out + (p * K + k) * PANEL;
            if (kind == PANELS_F16) {
                pack_f16_row(row + c0, width, o);
                continue;
            }
            for (int j = 0; j < PANEL; j++) {
                uint32_t bits = 0;
                if (order[j] < width) memcpy(&bits, row + c0 + order[j], sizeof bits);
                o[j] = (uint16_t)(bits >> 16);
            }
            }
}

/* ---------------------------------------------------------------------------------------------
 * Threads for the products (set_threads; host_kernels.py sets torch's intra-op count).
 *
 * Why: a model of hundreds of millions of parameters streams its weights from memory in every step, and
 * one core reads only part of what the memory delivers (a 360M-parameter bfloat16 step: 48 ms on one
 * thread against a floor of about half that on two). The products are split by columns: a product's
 * panels (pairs for AMX) go in chunks to whichever thread takes them next, the calling thread too. A
 * column's sum is the same whichever thread computes it, so the outputs are the bits of one thread.
 *
 * Why not OpenMP: its threads wait for each other at the end of every parallel region, and where another
 * process holds a core those waits made two threads 80x slower than one (docs/ENGINE.md, "Threads").
 * Here the caller never waits for a chunk nobody took: a worker that is not running takes none, and
 * the caller does them all. It waits only for chunks a worker has begun. Workers spin briefly between
 * products (a step's products follow each other within microseconds), then sleep on a condition
 * variable.
 *
 * Each job sits in one of POOL_SLOTS slots, tagged with its number. A worker that saw job g marks the
 * slot busy, then checks the tag is still g; the caller clears the tag and waits for no worker to be busy
 * before it reuses a slot (the two seq_cst pairs make one of them see the other). A late worker thus
 * never runs a job whose slot is being rewritten.
 * ------------------------------------------------------------------------------------------- */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define POOL_SLOTS 4
/* Spins of a waiting worker (_mm_pause, ~40-140 cycles each) before it sleeps: some tens of microseconds. */
#define POOL_SPINS 20000
/* A product is split only where it streams at least this many bytes of weights: below, the threads'
 * handshakes (~1-5 us) cost more than half the product saves. */
#define POOL_MIN_BYTES (256 * 1024)

typedef struct attend_job attend_job; /* (an attention job: attend_batch, below) */
static void attend_units(attend_job *job, Py_ssize_t first, Py_ssize_t end_unit);

typedef struct {
    attend_job *attend;  /* non-NULL: units of attention (attend_units), not of a product */
    void *packed;        /* non-NULL: a weight x (K, N) packed into this (pack_range), not a product */
    const float *x;
    const uint16_t *x16; /* (AMX: x rounded, by the caller) */
    const void *panels;
    float *y;
    Py_ssize_t M, K, N, units, chunk; /* units: panels (pairs for AMX), taken chunk at a time */
    int kind, accumulate;
} product_job;

typedef struct {
    atomic_uint tag;    /* the job's number, 0 while the slot is being written */
    atomic_int busy;    /* workers inside the slot */
    atomic_long next;   /* the next chunk to take */
    atomic_long done;   /* chunks finished */
    long chunks;
    product_job job;
} pool_slot;

static pool_slot pool_ring[POOL_SLOTS];
static atomic_uint pool_latest;   /* the latest job's number */
static atomic_int pool_sleepers;  /* workers asleep on pool_wake */
static atomic_int pool_wanted = 1; /* threads a product may use, the caller's included (set_threads) */
static int pool_started;          /* workers created in this process */
static unsigned pool_count;       /* jobs posted (the caller's side: under pool_caller) */
static pthread_mutex_t pool_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
/* One caller at a time posts jobs (two models decoding in two Python threads); the other multiplies on
 * its own thread meanwhile. */
static pthread_mutex_t pool_caller = PTHREAD_MUTEX_INITIALIZER;

static void product_chunk(const product_job *job, long chunk) {
    const Py_ssize_t first = chunk * job->chunk;
    const Py_ssize_t end = first + job->chunk < job->units ? first + job->chunk : job->units;
    if (job->attend != NULL)
        attend_units(job->attend, first, end);
    else if (job->packed != NULL)
        pack_range(job->x, job->K, job->N, job->kind, job->packed, first, end);
    else if (job->kind == PANELS_AMX)
        amx_pairs(job->x16, (const uint16_t *)job->panels, job->y, job->M, job->K, job->N, job->accumulate, first, end);
    else
        panel_range(job->x, job->panels, job->kind, job->y, job->M, job->K, job->N, job->accumulate, first, end);
}

/* Runs chunks of the slot's job until none is left to take; returns how many this thread ran. */
static long take_chunks(pool_slot *slot) {
    long chunk, taken = 0;
    while ((chunk = atomic_fetch_add(&slot->next, 1)) < slot->chunks) {
        product_chunk(&slot->job, chunk);
        atomic_fetch_add(&slot->done, 1);
        taken++;
    }
    return taken;
}

/* Whether the threads pay, judged by the caller (under pool_caller) over windows of pooled jobs.
 *
 * Why: where another process holds a core, a worker loses it now and then inside a chunk, and the caller
 * waits for that chunk (a scheduler's time slice, milliseconds, against tens to hundreds of microseconds a
 * product): a 360M-parameter bfloat16 pair decoded at 0.87-0.92x of its speed on one thread, with a process
 * spinning on one of the two cores.
 *
 * How: per pooled job, its time from posting to the last chunk's end, against the caller's estimate of
 * running it alone: its own time per chunk times the job's chunks (a little high, since two threads share
 * the memory's rate: a step on two threads takes 0.50-0.55x one thread's). Where a window's jobs took more
 * than pool_worth of their estimate, the next pool_backoff jobs run alone (workers asleep); the backoff
 * doubles at each verdict against the threads, up to POOL_BACKOFF_MAX, and is reset by one for them. An idle
 * machine's windows take about half their estimate, so there the threads run throughout. The bits are the
 * same either way. Why a share of 1: at 0.9 a Pythia-70m-shaped pair, whose threads still paid 1.07-1.10x
 * with a process spinning, was judged against them now and then and lost part of that. */
#define POOL_WINDOW 64
#define POOL_WORTH 1.0
#define POOL_BACKOFF_MIN 256
#define POOL_BACKOFF_MAX 16384
static double pool_worth = POOL_WORTH;
static int pool_window = POOL_WINDOW;
static int pool_window_jobs;
static double pool_window_ns, pool_window_alone_ns;
static long pool_alone_left, pool_backoff = POOL_BACKOFF_MIN;
static unsigned long pool_verdicts_against;

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return 1e9 * (double)t.tv_sec + (double)t.tv_nsec;
}

static void pool_judge(double job_ns, double alone_ns) {
    pool_window_ns += job_ns;
    pool_window_alone_ns += alone_ns;
    if (++pool_window_jobs < pool_window) return;
    if (pool_window_ns > pool_worth * pool_window_alone_ns) {
        pool_alone_left = pool_backoff;
        pool_backoff = 2 * pool_backoff < POOL_BACKOFF_MAX ? 2 * pool_backoff : POOL_BACKOFF_MAX;
        pool_verdicts_against++;
    } else {
        pool_backoff = POOL_BACKOFF_MIN;
    }
    pool_window_jobs = 0;
    pool_window_ns = pool_window_alone_ns = 0.0;
}

static void *pool_worker(void *arg) {
    const int index = (int)(intptr_t)arg; /* workers 1 .. pool_wanted - 1 take chunks */
    unsigned seen = atomic_load(&pool_latest);
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load(&pool_latest)) == seen) {
            if (++spins < POOL_SPINS) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool_mutex);
            atomic_fetch_add(&pool_sleepers, 1);
            while (atomic_load(&pool_latest) == seen) pthread_cond_wait(&pool_wake, &pool_mutex);
            atomic_fetch_sub(&pool_sleepers, 1);
            pthread_mutex_unlock(&pool_mutex);
            spins = 0;
        }
        seen = g;
        if (index >= atomic_load(&pool_wanted)) continue;
        pool_slot *slot = &pool_ring[g % POOL_SLOTS];
        atomic_fetch_add(&slot->busy, 1);
        if (atomic_load(&slot->tag) == g) take_chunks(slot);
        atomic_fetch_sub(&slot->busy, 1);
    }
    return NULL;
}

/* After a fork, the child has none of the workers: none is inside a slot, none is asleep, and no caller
 * holds the pool. */
static void pool_after_fork(void) {
    pool_started = 0;
    for (int i = 0; i < POOL_SLOTS; i++) {
        atomic_store(&pool_ring[i].busy, 0);
        atomic_store(&pool_ring[i].tag, 0);
    }
    pthread_mutex_init(&pool_mutex, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pthread_mutex_init(&pool_caller, NULL);
    atomic_store(&pool_sleepers, 0);
    pool_window_jobs = 0;
    pool_window_ns = pool_window_alone_ns = 0.0;
    pool_alone_left = 0;
    pool_backoff = POOL_BACKOFF_MIN;
}

/* Workers for `threads` threads in all, created once (0 where none could be: one thread then). */
static int pool_start(int threads) {
    static int fork_handler;
    if (!fork_handler) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        fork_handler = 1;
    }
    for (; pool_started < threads - 1; pool_started++) {
        pthread_t worker;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&worker, &attr, pool_worker, (void *)(intptr_t)(pool_started + 1));
        pthread_attr_destroy(&attr);
        if (failed) return 0;
    }
    return 1;
}

/* Runs every chunk of `job`: the workers take what they reach, the caller the rest. 0 where it ran; -1
 * where no job could be posted (another caller posting, no workers, or the threads judged not to pay just
 * now: pool_judge): the caller then runs it alone. */
static int pool_run(const product_job *job) {
    const int threads = atomic_load(&pool_wanted);
    if (threads < 2 || pthread_mutex_trylock(&pool_caller) != 0) return -1;
    if (pool_alone_left > 0 || !pool_start(threads)) {
        if (pool_alone_left > 0) pool_alone_left--;
        pthread_mutex_unlock(&pool_caller);
        return -1;
    }
    unsigned g = ++pool_count;
    if (g == 0) g = ++pool_count; /* (0 marks a slot being written) */
    pool_slot *slot = &pool_ring[g % POOL_SLOTS];
    atomic_store(&slot->tag, 0);
    while (atomic_load(&slot->busy) != 0) _mm_pause(); /* a late worker of the slot's last job */
    slot->job = *job;
    slot->chunks = (long)((job->units + job->chunk - 1) / job->chunk);
    atomic_store(&slot->next, 0);
    atomic_store(&slot->done, 0);
    atomic_store(&slot->tag, g);
    atomic_store(&pool_latest, g);
    if (atomic_load(&pool_sleepers) > 0) {
        pthread_mutex_lock(&pool_mutex);
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_mutex);
    }
    const double began = now_ns();
    const long mine = take_chunks(slot);
    const double own_ns = now_ns() - began;
    /* chunks a worker has begun: spin, then yield the core (to that worker, where it shares this one) */
    for (long spins = 0; atomic_load(&slot->done) < slot->chunks; spins++) {
        if (spins < POOL_SPINS)
            _mm_pause();
        else
            sched_yield();
    }
    if (mine > 0) pool_judge(now_ns() - began, own_ns / (double)mine * (double)slot->chunks);
    pthread_mutex_unlock(&pool_caller);
    return 0;
}

/* Runs every unit of a job on a (K, N) weight of job->kind (its panels; pairs for AMX): on the pool where the
 * weight streams at least POOL_MIN_BYTES, in about four chunks a thread (so that one late thread leaves
 * little to the others) of whole groups of four panels (the widest tiles': a column's sum is the same in any
 * tile), else alone. */
static void run_on_panels(product_job *job) {
    job->units = job->kind == PANELS_AMX ? (job->N + 2 * PANEL - 1) / (2 * PANEL) : (job->N + PANEL - 1) / PANEL;
    const int threads = atomic_load(&pool_wanted);
    if (threads > 1 && panels_bytes(job->kind, job->K, job->N) >= POOL_MIN_BYTES) {
        job->chunk = (job->units + 4 * threads - 1) / (4 * threads);
        if (job->kind != PANELS_AMX) job->chunk = (job->chunk + 3) / 4 * 4;
        if (job->chunk < job->units && pool_run(job) == 0) return;
    }
    job->chunk = job->units;
    product_chunk(job, 0);
}

/* y (M, N) = [y +] x (M, K) @ W (K, N), W as panels of float32 (kind PANELS_F32), of bfloat16
 * (PANELS_BF16), of float16 (PANELS_F16) or of bfloat16 for the AMX products (PANELS_AMX: x rounded to
 * bfloat16), on up to
 * set_threads' threads where W is large enough (run_on_panels). 0 where done, -1 out of memory (the AMX
 * products' rounded copy of x). */
static int panel_product(const float *x, const void *panels, int kind, float *y, Py_ssize_t M, Py_ssize_t K,
                         Py_ssize_t N, int accumulate) {
    if (M == 0) return 0;
    product_job job = {NULL, NULL, x, NULL, panels, y, M, K, N, 0, 0, kind, accumulate};
    if (kind == PANELS_AMX && (job.x16 = amx_rounded(x, M, K)) == NULL) return -1;
    run_on_panels(&job);
    return 0;
}

/* Packs the (K, N) float32 weight w as `kind` into out (pack_range), on the products' threads where it is
 * large (a 405M-parameter model's packing took 4.5 s of numpy copies on one thread). */
static void pack_panels(const float *w, Py_ssize_t K, Py_ssize_t N, int kind, void *out) {
    product_job job = {NULL, out, w, NULL, NULL, NULL, 0, K, N, 0, 0, kind, 0};
    run_on_panels(&job);
}
/* The cache's keys and values are float32, or bfloat16 (kv_bf16: the upper half of a float32's bits,
 * what a bfloat16 model's cache holds, at half the bytes). Why bfloat16: attention of one query reads
 * every cached key and value once, cold (the weights streamed in between push them out of the cache):
 * 16 KB a slot for the bundled target in float32, 4 MB a step at 250 slots against its 15.7 MB of
 * bf16 weights, so a step grew by ~30% from 16 to 256 slots. Widening a bf16 value is exact (a shift
 * of its bits), so the sums below are those of float32 keys and values of the same values. KV8_*:
 * eight of them loaded as float32. */
#define KV8_F32(p) _mm256_loadu_ps(p)
#define KV8_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

/* float32 -> bfloat16 bits, rounded to nearest even (NaN: 0x7FC0), as torch's .to(torch.bfloat16): a
 * value this kernel writes to the cache is the one torch's forward writes for the same float32. */
static inline uint16_t bf16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* The sums of eight vectors a0..a7, one per key, as one vector: pairwise sums within 128-bit lanes,
 * then the two lanes of each key added (two 128-bit halves added and joined: on this CPU a cross-lane
 * permute is 8 micro-ops). */
__attribute__((target("avx2,fma"))) static inline __m256 key_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                                                                 __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    const __m128 low = _mm_add_ps(_mm256_castps256_ps128(t0), _mm256_extractf128_ps(t0, 1));
    const __m128 high = _mm_add_ps(_mm256_castps256_ps128(t1), _mm256_extractf128_ps(t1, 1));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(low), high, 1);
}

/* The eight lanes of one key's partial sums s as key_sums adds them: ((s0 + s1) + (s2 + s3)) + ((s4 + s5) +
 * (s6 + s7)). (A key's score is the same whether it is scored alone or among eight, and whichever
 * slot it sits in.) */
__attribute__((target("avx2,fma"))) static inline float lane_tree(__m256 sum) {
    float s[8];
    _mm256_storeu_ps(s, sum);
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* sum_d a[d] * b[d] over D values (D a multiple of 8: eight partial sums, over d mod 8, then added as
 * key_sums adds them). */
__attribute__((target("avx2,fma"))) static inline float dot8_f32(const float *a, const float *b, int D) {
    __m256 sum = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), sum);
    return lane_tree(sum);
}

/* The dot products of q with eight consecutive keys (rows of D floats), as one vector. */
__attribute__((target("avx2,fma"))) static inline __m256 dot8x8_f32(const float *q, const float *k, int D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + D + d), a1);
        a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 3 * D + d), a3);
        a4 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 4 * D + d), a4);
        a5 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 5 * D + d), a5);
        a6 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 6 * D + d), a6);
        a7 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 7 * D + d), a7);
    }
    return key_sums(a0, a1, a2, a3, a4, a5, a6, a7);
}

/* bfloat16 keys read straight from the cache. Sixteen values are widened by one load and two
 * interleaves with zeros (LOAD_BF16, as the bf16 panels), which give values 0-3 and 8-11 in one vector
 * and 4-7 and 12-15 in the other: half the instructions of widening eight in order (zero-extension and
 * a shift), with which one query over a warm cache (the draft's) cost 3% more than over float32. So the
 * query is taken in that order too (permute_query); the last 8 values of a head_dim that is an odd
 * multiple of 8 are widened in order. */
static const int PERM16[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

static inline void permute_query(const float *q, int D, float *qp) {
    int d = 0;
    for (; d + 16 <= D; d += 16)
        for (int i = 0; i < 16; i++) qp[d + i] = q[d + PERM16[i]];
    for (; d < D; d++) qp[d] = q[d];
}

/* dot8_f32 and dot8x8_f32 of a permuted query qp (permute_query) with bfloat16 keys. */
__attribute__((target("avx2,fma"))) static inline float dot8_bf16(const float *qp, const uint16_t *k, int D) {
    __m256 sum = _mm256_setzero_ps(), lo, hi;
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        LOAD_BF16(k + d, 0, lo, hi);
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(qp + d), lo, sum);
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(qp + d + 8), hi, sum);
    }
    if (d < D) sum = _mm256_fmadd_ps(_mm256_loadu_ps(qp + d), KV8_BF16(k + d), sum);
    return lane_tree(sum);
}

__attribute__((target("avx2,fma"))) static inline __m256 dot8x8_bf16(const float *qp, const uint16_t *k, int D) {
    __m256 a[8];
    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        const __m256 q_lo = _mm256_loadu_ps(qp + d), q_hi = _mm256_loadu_ps(qp + d + 8);
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) {
            __m256 lo, hi;
            LOAD_BF16(k + r * D + d, 0, lo, hi);
            a[r] = _mm256_fmadd_ps(q_hi, hi, _mm256_fmadd_ps(q_lo, lo, a[r]));
        }
    }
    if (d < D) {
        const __m256 qd = _mm256_loadu_ps(qp + d);
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qd, KV8_BF16(k + r * D + d), a[r]);
    }
    return key_sums(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
}

/* exp(x) for x <= 0, eight at a time (Cephes' expf: x = n ln 2 + r, a degree-5 polynomial for e^r,
 * about 1 ulp); exactly 0 below -87, where float32's normal range ends, and for -inf. */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)));
}

/* tanh(x), eight at a time (Cephes' tanhf, about 2 ulp): below |x| = 0.625 x + x z P(z), z = x^2, a degree-4
 * polynomial (no cancellation near 0); from there (1 - e) / (1 + e) with e = exp(-2 |x|) (exp8's range), and x's
 * sign. */
__attribute__((target("avx2,fma"))) static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(x, z), p, x);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_or_ps(x, sign))); /* exp(-2|x|) */
    const __m256 large = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)),
                                      _mm256_and_ps(x, sign));
    return _mm256_blendv_ps(large, small, _mm256_cmp_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

/* x = cap * tanh(x / cap) over n values in place: Gemma 2's soft cap of attention scores and of logits. */
__attribute__((target("avx2,fma"))) static void soft_cap(float *x, Py_ssize_t n, float cap) {
    const __m256 cap8 = _mm256_set1_ps(cap);
    Py_ssize_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(x + j, _mm256_mul_ps(tanh8(_mm256_div_ps(_mm256_loadu_ps(x + j), cap8)), cap8));
    if (j < n) { /* (the tail through the same vector code: one value's bits do not hang on its place) */
        float tail[8] = {0};
        memcpy(tail, x + j, (size_t)(n - j) * sizeof(float));
        _mm256_storeu_ps(tail, _mm256_mul_ps(tanh8(_mm256_div_ps(_mm256_loadu_ps(tail), cap8)), cap8));
        memcpy(x + j, tail, (size_t)(n - j) * sizeof(float));
    }
}

/* out[0 : 8 CH] = sum_{j < limit} weight_j v_j[0 : 8 CH] * inverse, where v_j = v + j * D: 8 CH
 * columns of the values (of type T) in registers, two slots a step (two sets of sums, even and odd
 * entries of the list of attended slots: each waits on its own fused multiply-adds only). CH is a
 * constant in each copy, so that the sums stay in registers (with a run-time count GCC kept them on
 * the stack: a load and a store around every multiply-add). */
#define DEFINE_WEIGHTED(CH, S, T, KV8)                                                              \
    __attribute__((target("avx2,fma"))) static inline void weighted_##S##_##CH(                     \
        const float *weights, const T *v, int D, Py_ssize_t limit, float inverse, float *out,       \
        float *partials) {                                                                          \
        __m256 even[CH], odd[CH];                                                                   \
        _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++) even[k] = odd[k] = _mm256_setzero_ps(); \
        Py_ssize_t j = 0;                                                                           \
        for (; j + 2 <= limit; j += 2) {                                                            \
            const __m256 w_even = _mm256_broadcast_ss(weights + j);                                 \
            const __m256 w_odd = _mm256_broadcast_ss(weights + j + 1);                              \
            const T *row = v + j * D;                                                               \
            _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++) {                                  \
                even[k] = _mm256_fmadd_ps(w_even, KV8(row + 8 * k), even[k]);                       \
                odd[k] = _mm256_fmadd_ps(w_odd, KV8(row + D + 8 * k), odd[k]);                      \
            }                                                                                       \
        }                                                                                           \
        if (j < limit) {                                                                            \
            const __m256 w_even = _mm256_broadcast_ss(weights + j);                                 \
            _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++)                                    \
                even[k] = _mm256_fmadd_ps(w_even, KV8(v + j * D + 8 * k), even[k]);                 \
        }                                                                                           \
        if (partials) { /* the two sets' sums, to be continued (weighted_continue_*) */             \
            _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++) {                                  \
                _mm256_storeu_ps(partials + 8 * k, even[k]);                                        \
                _mm256_storeu_ps(partials + D + 8 * k, odd[k]);                                     \
            }                                                                                       \
            return;                                                                                 \
        }                                                                                           \
        const __m256 factor = _mm256_set1_ps(inverse);                                              \
        _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++)                                        \
            _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(_mm256_add_ps(even[k], odd[k]), factor));   \
    }
DEFINE_WEIGHTED(1, f32, float, KV8_F32)
DEFINE_WEIGHTED(2, f32, float, KV8_F32)
DEFINE_WEIGHTED(3, f32, float, KV8_F32)
DEFINE_WEIGHTED(4, f32, float, KV8_F32)
DEFINE_WEIGHTED(1, bf16, uint16_t, KV8_BF16) /* (the last 8 columns of an odd multiple of 8) */

/* out[0 : D] = sum_{j < limit} weight_j v_j * inverse, 32 columns at a time; with `partials`, the two
 * sets' sums there instead (even slots in partials[0 : D], odd ones in partials[D : 2 D]). */
__attribute__((target("avx2,fma"))) static inline void weighted_sum_f32(const float *weights, const float *v, int D,
                                                                Py_ssize_t limit, float inverse, float *out,
                                                                float *partials) {
    for (int c = 0; c < D; c += 32) {
        float *part = partials ? partials + c : NULL;
        switch ((D - c) >= 32 ? 4 : (D - c) / 8) {
        case 4: weighted_f32_4(weights, v + c, D, limit, inverse, out + c, part); break;
        case 3: weighted_f32_3(weights, v + c, D, limit, inverse, out + c, part); break;
        case 2: weighted_f32_2(weights, v + c, D, limit, inverse, out + c, part); break;
        default: weighted_f32_1(weights, v + c, D, limit, inverse, out + c, part);
        }
    }
}

/* weighted_f32_CH over bfloat16 values, 16 C16 columns, each 16 widened as LOAD_BF16 gives them (0-3
 * and 8-11 in `lo`, 4-7 and 12-15 in `hi`) and put back in order as they are stored. */
#define DEFINE_WEIGHTED_BF16(C16)                                                                   \
    __attribute__((target("avx2,fma"))) static inline void weighted16_bf16_##C16(                   \
        const float *weights, const uint16_t *v, int D, Py_ssize_t limit, float inverse, float *out, \
        float *partials) {                                                                          \
        __m256 lo_even[C16], hi_even[C16], lo_odd[C16], hi_odd[C16], lo, hi;                       \
        _Pragma("GCC unroll 2") for (int k = 0; k < C16; k++)                                       \
            lo_even[k] = hi_even[k] = lo_odd[k] = hi_odd[k] = _mm256_setzero_ps();                  \
        Py_ssize_t j = 0;                                                                           \
        for (; j + 2 <= limit; j += 2) {                                                            \
            const __m256 w_even = _mm256_broadcast_ss(weights + j);                                 \
            const __m256 w_odd = _mm256_broadcast_ss(weights + j + 1);                              \
            const uint16_t *row = v + j * D;                                                        \
            _Pragma("GCC unroll 2") for (int k = 0; k < C16; k++) {                                 \
                LOAD_BF16(row + 16 * k, 0, lo, hi);                                                 \
                lo_even[k] = _mm256_fmadd_ps(w_even, lo, lo_even[k]);                               \
                hi_even[k] = _mm256_fmadd_ps(w_even, hi, hi_even[k]);                               \
                LOAD_BF16(row + D + 16 * k, 0, lo, hi);                                             \
                lo_odd[k] = _mm256_fmadd_ps(w_odd, lo, lo_odd[k]);                                  \
                hi_odd[k] = _mm256_fmadd_ps(w_odd, hi, hi_odd[k]);                                  \
            }                                                                                       \
        }                                                                                           \
        if (j < limit) {                                                                            \
            const __m256 w_even = _mm256_broadcast_ss(weights + j);                                 \
            _Pragma("GCC unroll 2") for (int k = 0; k < C16; k++) {                                 \
                LOAD_BF16(v + j * D + 16 * k, 0, lo, hi);                                           \
                lo_even[k] = _mm256_fmadd_ps(w_even, lo, lo_even[k]);                               \
                hi_even[k] = _mm256_fmadd_ps(w_even, hi, hi_even[k]);                               \
            }                                                                                       \
        }                                                                                           \
        if (partials) { /* the two sets' sums in column order, to be continued */                   \
            _Pragma("GCC unroll 2") for (int k = 0; k < C16; k++) {                                 \
                _mm256_storeu_ps(partials + 16 * k, _mm256_permute2f128_ps(lo_even[k], hi_even[k], 0x20)); \
                _mm256_storeu_ps(partials + 16 * k + 8, _mm256_permute2f128_ps(lo_even[k], hi_even[k], 0x31)); \
                _mm256_storeu_ps(partials + D + 16 * k, _mm256_permute2f128_ps(lo_odd[k], hi_odd[k], 0x20)); \
                _mm256_storeu_ps(partials + D + 16 * k + 8, _mm256_permute2f128_ps(lo_odd[k], hi_odd[k], 0x31)); \
            }                                                                                       \
            return;                                                                                 \
        }                                                                                           \
        const __m256 factor = _mm256_set1_ps(inverse);                                              \
        _Pragma("GCC unroll 2") for (int k = 0; k < C16; k++) {                                     \
            lo = _mm256_mul_ps(_mm256_add_ps(lo_even[k], lo_odd[k]), factor); /* 0-3, 8-11 */       \
            hi = _mm256_mul_ps(_mm256_add_ps(hi_even[k], hi_odd[k]), factor); /* 4-7, 12-15 */      \
            _mm256_storeu_ps(out + 16 * k, _mm256_permute2f128_ps(lo, hi, 0x20));                   \
            _mm256_storeu_ps(out + 16 * k + 8, _mm256_permute2f128_ps(lo, hi, 0x31));               \
        }                                                                                           \
    }
DEFINE_WEIGHTED_BF16(1)
DEFINE_WEIGHTED_BF16(2)

__attribute__((target("avx2,fma"))) static void weighted_sum_bf16(const float *weights, const uint16_t *v, int D,
                                                                 Py_ssize_t limit, float inverse, float *out,
                                                                 float *partials) {
    int c = 0;
    for (; c + 32 <= D; c += 32)
        weighted16_bf16_2(weights, v + c, D, limit, inverse, out + c, partials ? partials + c : NULL);
    if (c + 16 <= D) {
        weighted16_bf16_1(weights, v + c, D, limit, inverse, out + c, partials ? partials + c : NULL);
        c += 16;
    }
    if (c < D) weighted_bf16_1(weights, v + c, D, limit, inverse, out + c, partials ? partials + c : NULL);
}

/* The weighted sums continued over the slots t0 <= t < m of a compacted list (compact_allowed): slot
 * t's weight weights[t], its value row v + rows[t - t0] D (v + t D where rows is NULL), added to the
 * even set's sums (partials[0 : D]) or the odd set's (partials[D : 2 D]) by the parity of t, in order:
 * the sums weighted_sum_* would have made over the whole list. */
#define DEFINE_WEIGHTED_CONTINUE_CH(CH, S, T, KV8)                                                  \
    __attribute__((target("avx2,fma"))) static inline void weighted_continue_##S##_##CH(            \
        const float *weights, const T *v, int D, Py_ssize_t t0, Py_ssize_t m, const int32_t *rows,  \
        float *partials) {                                                                          \
        __m256 even[CH], odd[CH];                                                                   \
        _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++) {                                      \
            even[k] = _mm256_loadu_ps(partials + 8 * k);                                            \
            odd[k] = _mm256_loadu_ps(partials + D + 8 * k);                                         \
        }                                                                                           \
        Py_ssize_t t = t0;                                                                          \
        if (t < m && (t & 1)) { /* an odd first entry */                                            \
            const T *row = v + (rows ? (Py_ssize_t)rows[t - t0] : t) * D;                           \
            const __m256 w = _mm256_broadcast_ss(weights + t);                                      \
            _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++)                                    \
                odd[k] = _mm256_fmadd_ps(w, KV8(row + 8 * k), odd[k]);                              \
            t++;                                                                                    \
        }                                                                                           \
        for (; t + 2 <= m; t += 2) {                                                                \
            const T *row_even = v + (rows ? (Py_ssize_t)rows[t - t0] : t) * D;                      \
            const T *row_odd = v + (rows ? (Py_ssize_t)rows[t + 1 - t0] : t + 1) * D;               \
            const __m256 w_even = _mm256_broadcast_ss(weights + t);                                 \
            const __m256 w_odd = _mm256_broadcast_ss(weights + t + 1);                              \
            _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++) {                                  \
                even[k] = _mm256_fmadd_ps(w_even, KV8(row_even + 8 * k), even[k]);                  \
                odd[k] = _mm256_fmadd_ps(w_odd, KV8(row_odd + 8 * k), odd[k]);                      \
            }                                                                                       \
        }                                                                                           \
        if (t < m) { /* an even last entry */                                                       \
            const T *row = v + (rows ? (Py_ssize_t)rows[t - t0] : t) * D;                           \
            const __m256 w = _mm256_broadcast_ss(weights + t);                                      \
            _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++)                                    \
                even[k] = _mm256_fmadd_ps(w, KV8(row + 8 * k), even[k]);                            \
        }                                                                                           \
        _Pragma("GCC unroll 4") for (int k = 0; k < CH; k++) {                                      \
            _mm256_storeu_ps(partials + 8 * k, even[k]);                                            \
            _mm256_storeu_ps(partials + D + 8 * k, odd[k]);                                         \
        }                                                                                           \
    }
DEFINE_WEIGHTED_CONTINUE_CH(4, f32, float, KV8_F32)
DEFINE_WEIGHTED_CONTINUE_CH(1, f32, float, KV8_F32)
DEFINE_WEIGHTED_CONTINUE_CH(4, bf16, uint16_t, KV8_BF16)
DEFINE_WEIGHTED_CONTINUE_CH(1, bf16, uint16_t, KV8_BF16)
#define DEFINE_WEIGHTED_CONTINUE(S, T)                                                              \
    __attribute__((target("avx2,fma"))) static void weighted_continue_##S(                          \
        const float *weights, const T *v, int D, Py_ssize_t t0, Py_ssize_t m, const int32_t *rows,  \
        float *partials) {                                                                          \
        if (t0 >= m) return;                                                                        \
        int c = 0; /* 32 columns at a time, then 8 (each column's two sums as before) */            \
        for (; c + 32 <= D; c += 32) weighted_continue_##S##_4(weights, v + c, D, t0, m, rows, partials + c); \
        for (; c < D; c += 8) weighted_continue_##S##_1(weights, v + c, D, t0, m, rows, partials + c); \
    }
DEFINE_WEIGHTED_CONTINUE(f32, float)
DEFINE_WEIGHTED_CONTINUE(bf16, uint16_t)

/* out[0 : D] = (even + odd) * inverse from the two sets' sums, as weighted_sum_* ends. */
__attribute__((target("avx2,fma"))) static void weighted_finish(const float *partials, int D, float inverse,
                                                                float *out) {
    const __m256 factor = _mm256_set1_ps(inverse);
    for (int c = 0; c < D; c += 8)
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(partials + c),
                                                              _mm256_loadu_ps(partials + D + c)), factor));
}

/* out[0 : D] = the weighted sum over a query's whole list of m attended slots (compact_allowed: the
 * first `prefix` are slots 0 .. prefix - 1, entry t >= prefix is slot rows[t - prefix]) times inverse:
 * weighted_sum_* where the list has no gap, else its sums over the prefix continued over the rest
 * (`partials`: room for 2 D floats). */
#define DEFINE_WEIGHTED_LIST(S, T)                                                                  \
    __attribute__((target("avx2,fma"))) static void weighted_list_##S(                              \
        const float *weights, const T *v, int D, Py_ssize_t prefix, Py_ssize_t m, const int32_t *rows, \
        float inverse, float *out, float *partials) {                                               \
        if (m == prefix) {                                                                          \
            weighted_sum_##S(weights, v, D, m, inverse, out, NULL);                                 \
            return;                                                                                 \
        }                                                                                           \
        weighted_sum_##S(weights, v, D, prefix, 0.0f, NULL, partials);                              \
        weighted_continue_##S(weights, v, D, prefix, m, rows, partials);                            \
        weighted_finish(partials, D, inverse, out);                                                 \
    }
DEFINE_WEIGHTED_LIST(f32, float)
DEFINE_WEIGHTED_LIST(bf16, uint16_t)

/* The slots a query attends, as one list in order of slot: scores[0 : limit) compacted in place to
 * the allowed ones (allowed[j] non-zero), their count returned. *prefix: the slots before the first
 * one not allowed (the list's first *prefix entries are slots 0 .. *prefix - 1); rows[t - *prefix]:
 * the slot of entry t for the rest. Why: the softmax and the weighted sums then run over the list,
 * whose order and parity do not depend on where in the cache the attended slots sit, nor on slots
 * not attended between them (a tree's nodes after a gap, a batch row's nodes after other rows'
 * longer prefixes): a query's attention is the same, bit for bit, as that of the same token in a
 * chain with no gaps (docs/ENGINE.md, "One sum order for every pass"). */
static Py_ssize_t compact_allowed(float *scores, Py_ssize_t limit, const unsigned char *allowed, int32_t *rows,
                                  Py_ssize_t *prefix) {
    const unsigned char *first_out = (const unsigned char *)memchr(allowed, 0, (size_t)limit);
    Py_ssize_t j = first_out == NULL ? limit : first_out - allowed;
    *prefix = j;
    Py_ssize_t t = j;
    for (; j < limit; j++)
        if (allowed[j]) {
            scores[t] = scores[j];
            rows[t - *prefix] = (int32_t)j;
            t++;
        }
    return t;
}

/* Queries whose scores are computed together from the transposed keys (attend()), and the fewest
 * queries of a call that take that path: transposing a kv head's keys costs about as much as scoring
 * a few queries from the cache rows. Measured on 8 heads of 32 over 150 slots against the per-query
 * path: 1.32x its time at 2 queries, 1.17x at 3, 1.0x at 4-5, 0.98x at 6, 0.89x at 8-9, 0.87x at 12,
 * 0.80x at 25. (With the AVX-512 score tiles and weighted sums, on the Xeon: from 3 queries on, 1.12x
 * the time at 3 and 1.00x at 5, so the limit stays.) */
#define QUERY_TILE 4
#define TILE_MIN_QUERIES 6

/* Floats of attend()'s scratch for `end` slots and head_dim D: the keys of one kv head transposed
 * (D rows of the slots rounded up to 16) and the scores of QUERY_TILE queries over as many slots (the
 * per-query paths use the first slots + D: one query's scores, and its permuted copy for bf16), then
 * attend_lists: QUERY_TILE lists of as many slots and QUERY_TILE x 2 D sums. */
static size_t attend_scratch_floats(Py_ssize_t end, int D) {
    return (size_t)((end + 15) / 16 * 16) * (size_t)(D + 2 * QUERY_TILE) + (size_t)(2 * D * QUERY_TILE);
}

/* Softmax of one query's scores over slots j < limit (those not `allowed`, where given, and those from
 * limit to the next multiple of 8 set to -inf here), in place, unnormalised: the weights
 * exp(score - max); returns 1 / their total (the weighted sum of the values multiplies by it). `softcap` > 0
 * (Gemma 2): the scores capped first, softcap * tanh(score / softcap) (soft_cap). */
__attribute__((target("avx2,fma"))) static float softmax_scores(float *scores, Py_ssize_t limit,
                                                               const unsigned char *allowed, float softcap) {
    const Py_ssize_t padded = (limit + 7) / 8 * 8;
    Py_ssize_t j;
    if (softcap > 0.0f) soft_cap(scores, limit, softcap);
    if (allowed)
        for (j = 0; j < limit; j++)
            if (!allowed[j]) scores[j] = -INFINITY;
    for (j = limit; j < padded; j++) scores[j] = -INFINITY;
    /* their maximum */
    __m256 maxima = _mm256_set1_ps(-INFINITY);
    for (j = 0; j < padded; j += 8) maxima = _mm256_max_ps(maxima, _mm256_loadu_ps(scores + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, maxima);
    float best = lanes[0];
    for (int l = 1; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    /* weights exp(score - best), in place, and their total */
    const __m256 shift = _mm256_set1_ps(best);
    __m256 totals = _mm256_setzero_ps();
    for (j = 0; j < padded; j += 8) {
        const __m256 weight = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
        _mm256_storeu_ps(scores + j, weight);
        totals = _mm256_add_ps(totals, weight);
    }
    _mm256_storeu_ps(lanes, totals);
    return 1.0f / (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
}

/* Scores of R queries (rows q_r = q + r * q_stride, D values each) over slots [0, slots), slots a
 * multiple of 8 (AVX2) or 16 (AVX-512), from keys transposed as kt[d * kt_stride + j]:
 * scores[r * s_stride + j] = scale * (the sum of q_r[d] kt[d][j] over d) in the order of the per-query
 * path (dot8x8_*): eight partial sums, chain l over the values of d in order[l U .. l U + U) (U = D / 8:
 * the values of d that its lane l takes, in its order), added as key_sums adds them, ((s0 + s1) + (s2 +
 * s3)) + ((s4 + s5) + (s6 + s7)). So a query's scores are the same, bit for bit, whether its call
 * takes this path or the per-query one, which a call's query count decides (TILE_MIN_QUERIES). Eight
 * (sixteen) slots by R queries a step, no sums across lanes; C chains at a time, about 8 independent
 * sums with the R queries (a chain of U fused multiply-adds waits on its own latency: one chain at a
 * time ran the 25-query tiles at ~1.3x the time of the tiles before, which summed over d in one
 * chain). */
#define SCORE_CHAINS(R, C, VEC, ZERO, FMA, ADD, SET1, LOAD, WIDTH)                                   \
    for (Py_ssize_t j = first_slot; j < slots; j += WIDTH) {                                        \
        VEC a[R], b[R], p[C][R];                                                                    \
        _Pragma("GCC unroll 4") for (int g = 0; g < 8 / C; g++) { /* chains g C .. g C + C - 1 */   \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++)                                     \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) p[c][r] = ZERO();               \
            for (int u = 0; u < U; u++) {                                                           \
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                               \
                    const int d = order[(g * C + c) * U + u];                                       \
                    const VEC key = LOAD(kt + d * kt_stride + j);                                   \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                             \
                        p[c][r] = FMA(SET1(q[r * q_stride + d]), key, p[c][r]);                     \
                }                                                                                   \
            }                                                                                       \
            /* ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), as far as these chains reach (the  \
             * indices mod C only keep the branches for other C within p's bounds) */             \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                   \
                if (C == 8) {                                                                       \
                    a[r] = ADD(ADD(ADD(p[0][r], p[1 % C][r]), ADD(p[2 % C][r], p[3 % C][r])),       \
                               ADD(ADD(p[4 % C][r], p[5 % C][r]), ADD(p[6 % C][r], p[7 % C][r])));  \
                } else if (C == 4) {                                                                \
                    const VEC half = ADD(ADD(p[0][r], p[1 % C][r]), ADD(p[2 % C][r], p[3 % C][r]));  \
                    a[r] = g == 0 ? half : ADD(a[r], half);                                         \
                } else {                                                                            \
                    const VEC pair = ADD(p[0][r], p[1 % C][r]);                                     \
                    if (g == 0) a[r] = pair;                                                        \
                    else if (g == 1) a[r] = ADD(a[r], pair);                                        \
                    else if (g == 2) b[r] = pair;                                                   \
                    else a[r] = ADD(a[r], ADD(b[r], pair));                                         \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) STORE(scores + r * s_stride + j, a[r]); \
    }
/* SCORE_CHAINS over two vectors of slots a step (2 WIDTH), two chains at a time, with the first half
 * of each score's tree, (s0 + s1) + (s2 + s3), kept in the scores row until the second half is added:
 * each broadcast of a q value then serves twice the slots, and the accumulators (2 x R x 2, and the
 * second half's pair sums) fit the 32 AVX-512 registers for 3-4 queries. The same sums. Advances
 * first_slot past the slots it scores. */
#define SCORE_CHAINS_WIDE(R, VEC, ZERO, FMA, ADD, SET1, LOAD, STOREU, WIDTH)                        \
    for (; first_slot + 2 * WIDTH <= slots; first_slot += 2 * WIDTH) {                              \
        const Py_ssize_t j = first_slot;                                                            \
        VEC b[R][2], p[2][R][2];                                                                    \
        _Pragma("GCC unroll 4") for (int g = 0; g < 4; g++) { /* chains 2 g and 2 g + 1 */          \
            _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++)                                     \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) p[c][r][0] = p[c][r][1] = ZERO(); \
            for (int u = 0; u < U; u++) {                                                           \
                _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++) {                               \
                    const int d = order[(2 * g + c) * U + u];                                       \
                    const VEC key0 = LOAD(kt + d * kt_stride + j);                                  \
                    const VEC key1 = LOAD(kt + d * kt_stride + j + WIDTH);                          \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                           \
                        const VEC qd = SET1(q[r * q_stride + d]);                                   \
                        p[c][r][0] = FMA(qd, key0, p[c][r][0]);                                     \
                        p[c][r][1] = FMA(qd, key1, p[c][r][1]);                                     \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                     \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                               \
                    float *at = scores + r * s_stride + j + h * WIDTH;                              \
                    const VEC pair = ADD(p[0][r][h], p[1][r][h]);                                   \
                    if (g == 0) STOREU(at, pair);                                                   \
                    else if (g == 1) STOREU(at, ADD(LOAD(at), pair));                               \
                    else if (g == 2) b[r][h] = pair;                                                \
                    else STORE(at, ADD(LOAD(at), ADD(b[r][h], pair)));                              \
                }                                                                                   \
        }                                                                                           \
    }
#define DEFINE_SCORE_TILE(R, NAME, TARGET, VEC, WIDTH, ZERO, FMA, ADD, SET1, LOAD)                     \
    __attribute__((target(TARGET))) static void NAME##_##R(                                         \
        const float *q, Py_ssize_t q_stride, const float *kt, Py_ssize_t kt_stride, int D, const int *order, \
        Py_ssize_t slots, float scale, float *scores, Py_ssize_t s_stride) {                        \
        const int U = D / 8;                                                                        \
        const VEC scale_v = SET1(scale);                                                            \
        Py_ssize_t first_slot = 0;                                                                  \
        WIDE(R)                                                                                     \
        SCORE_CHAINS(R, (R == 1 ? 8 : R == 2 ? 4 : 2), VEC, ZERO, FMA, ADD, SET1, LOAD, WIDTH)      \
    }
/* AVX2: eight slots a step; AVX-512 (score_tile512_R): sixteen, the same sums. */
#define STORE(at, sums) _mm256_storeu_ps((at), _mm256_mul_ps((sums), scale_v))
#define WIDE(R) /* (none: with 16 registers the wide step's accumulators would spill) */
#define DEFINE_SCORE_TILE_AVX2(R)                                                                   \
    DEFINE_SCORE_TILE(R, score_tile, "avx2,fma", __m256, 8, _mm256_setzero_ps, _mm256_fmadd_ps, _mm256_add_ps, \
                      _mm256_set1_ps, _mm256_loadu_ps)
DEFINE_SCORE_TILE_AVX2(1)
DEFINE_SCORE_TILE_AVX2(2)
DEFINE_SCORE_TILE_AVX2(3)
DEFINE_SCORE_TILE_AVX2(4)
#undef WIDE
#undef STORE
#define STORE(at, sums) _mm512_storeu_ps((at), _mm512_mul_ps((sums), scale_v))
#define WIDE(R)                                                                                     \
    if (R >= 3)                                                                                     \
        SCORE_CHAINS_WIDE(R, __m512, _mm512_setzero_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_set1_ps, \
                          _mm512_loadu_ps, _mm512_storeu_ps, 16)
#define DEFINE_SCORE_TILE512(R)                                                                     \
    DEFINE_SCORE_TILE(R, score_tile512, "avx512f", __m512, 16, _mm512_setzero_ps, _mm512_fmadd_ps, \
                      _mm512_add_ps, _mm512_set1_ps, _mm512_loadu_ps)
DEFINE_SCORE_TILE512(1)
DEFINE_SCORE_TILE512(2)
DEFINE_SCORE_TILE512(3)
DEFINE_SCORE_TILE512(4)
#undef WIDE
#undef STORE

/* The order in which the per-query path's key dots (dot8x8_*, dot8_*) add the D values of d, as eight
 * chains of D / 8: order[l * D / 8 + u] is the u-th value of d that lane l takes. float32 keys: d = l,
 * l + 8, ... bfloat16 keys, read sixteen at a time in the order 0-3, 8-11 (lo) and 4-7, 12-15 (hi),
 * and a last eight in order: lane l takes PERM16[l], then PERM16[l + 8], of each sixteen. */
static void key_dot_order(int D, int kv_bf16, int *order) {
    const int U = D / 8;
    for (int l = 0; l < 8; l++) {
        int u = 0, d = 0;
        if (kv_bf16)
            for (; d + 16 <= D; d += 16) {
                order[l * U + u++] = d + PERM16[l];
                order[l * U + u++] = d + PERM16[l + 8];
            }
        for (; d < D; d += 8) order[l * U + u++] = d + l;
    }
}

/* Where a step's keys and values do not stay in the caches between steps (many batch rows over long
 * contexts: layer_into's prefetch_values, which gbv.engine.lean_host sets where the step's keys and
 * values pass host_kernels.KV_PREFETCH_MIN_BYTES), they come from memory, and each head's weighted sum
 * waits for its values after the scores. So the first query of each head prefetches, as it scores eight
 * keys, the values of those eight slots into every cache level (in tiles of queries, as it transposes
 * them). On the Xeon, bundled pair, 16 rows over 700-830 slots: a batched generation (prefills
 * included) in 0.80-0.95x the time in bfloat16 and 0.94-0.98x in float32 (scripts/bench_kv_prefetch.py).
 * Prefetching the keys ahead too, or the values into the L2 only, gained less in a probe of the
 * attention alone; where the keys and values stay in the caches, the prefetches cost up to 4%. The
 * per-query path with them is a function apart: as a branch in its loop they cost it 2-4% where they
 * do not run. No sum changes. */
static inline void prefetch_lines(const void *at, Py_ssize_t bytes) {
    for (Py_ssize_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)at + b, _MM_HINT_T0);
}
/* kt[d * slots + j] = k[j * D + d] (widened to float32) for slots j < end, 0 for end <= j < slots (D a
 * multiple of 8): eight slots by eight columns at a time, each 8 x 8 block as two 4 x 4 transposes per
 * 128-bit lane (halves of rows j and j + 4 loaded into the two lanes: no cross-lane permutes, 8
 * micro-ops each on this CPU). Keys of type T, four loaded by LOAD4 and one by LOAD1. */
#define TWO_LANES(low, high) _mm256_insertf128_ps(_mm256_castps128_ps256(low), (high), 1)
#define DEFINE_TRANSPOSE_KEYS(S, T, LOAD4, LOAD1)                                                   \
    __attribute__((target("avx2,fma"))) static void transpose_keys_##S(const T *k, Py_ssize_t end, int D, \
                                                                       float *kt, Py_ssize_t slots, \
                                                                       const T *prefetch_v) {       \
        Py_ssize_t j = 0;                                                                           \
        for (; j + 8 <= end; j += 8) {                                                              \
            const T *r = k + j * D;                                                                 \
            if (prefetch_v) /* (the values of these slots: see prefetch_lines) */                   \
                prefetch_lines(prefetch_v + j * D, 8 * D * (Py_ssize_t)sizeof(T));                  \
            for (int d = 0; d < D; d += 8) {                                                        \
                for (int half = 0; half < 8; half += 4) { /* columns d + half .. d + half + 3 */    \
                    const T *c = r + d + half;                                                      \
                    const __m256 a0 = TWO_LANES(LOAD4(c), LOAD4(c + 4 * D));                        \
                    const __m256 a1 = TWO_LANES(LOAD4(c + D), LOAD4(c + 5 * D));                    \
                    const __m256 a2 = TWO_LANES(LOAD4(c + 2 * D), LOAD4(c + 6 * D));                \
                    const __m256 a3 = TWO_LANES(LOAD4(c + 3 * D), LOAD4(c + 7 * D));                \
                    const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);  \
                    const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);  \
                    float *o = kt + (Py_ssize_t)(d + half) * slots + j;                             \
                    _mm256_storeu_ps(o, _mm256_shuffle_ps(t0, t2, 0x44));                           \
                    _mm256_storeu_ps(o + slots, _mm256_shuffle_ps(t0, t2, 0xEE));                   \
                    _mm256_storeu_ps(o + 2 * slots, _mm256_shuffle_ps(t1, t3, 0x44));               \
                    _mm256_storeu_ps(o + 3 * slots, _mm256_shuffle_ps(t1, t3, 0xEE));               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int d = 0; d < D; d++) {                                                               \
            for (Py_ssize_t t = j; t < end; t++) kt[d * slots + t] = LOAD1(k + t * D + d);          \
            for (Py_ssize_t t = end; t < slots; t++) kt[d * slots + t] = 0.0f;                      \
        }                                                                                           \
    }
#define LOAD4_F32(p) _mm_loadu_ps(p)
#define LOAD1_F32(p) (*(p))
/* four bfloat16 values in order: one interleave with zeros (one micro-op in 128 bits on this CPU) */
#define LOAD4_BF16(p) _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)(p))))
#define LOAD1_BF16(p) bf16_value(*(p))
static inline float bf16_value(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}
DEFINE_TRANSPOSE_KEYS(f32, float, LOAD4_F32, LOAD1_F32)
DEFINE_TRANSPOSE_KEYS(bf16, uint16_t, LOAD4_BF16, LOAD1_BF16)

/* The weighted sums of the R queries of a tile at once, on AVX-512 (D a multiple of 32): out_r[0 : D] =
 * sum_{j < limit} weights_r[j] v_j * inverse_r over slots every query of the tile attends (the first
 * `limit` of each one's list), each value row v_j read and widened once for the R queries
 * (weighted_sum_* reads it once per query); with `partials`, each query's two sets' sums there
 * instead, to be continued over its own list (weighted_continue_*). Each sum as weighted_sum_* adds it:
 * over even and over odd slots apart, in order, then the two added and multiplied by inverse_r. Why:
 * the per-query sums were a third of a 25-query pass's attention, two loads and two interleaves per
 * slot and query for 16 columns. */
#define LOAD16_F32(p) _mm512_loadu_ps(p)
#define LOAD16_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define DEFINE_WEIGHTED_TILE(S, T, LOAD16)                                                          \
    __attribute__((target("avx512f"))) static void weighted_tile_##S(                               \
        const float *weights, Py_ssize_t w_stride, int R, const T *v, int D, Py_ssize_t limit,      \
        const float *inverse, float *out, Py_ssize_t out_stride, float *partials) {                 \
        for (int c = 0; c < D; c += 32) {                                                           \
            __m512 even[QUERY_TILE][2], odd[QUERY_TILE][2];                                         \
            _Pragma("GCC unroll 4") for (int r = 0; r < QUERY_TILE; r++)                            \
                even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();              \
            Py_ssize_t j = 0;                                                                       \
            for (; j + 2 <= limit; j += 2) {                                                        \
                const T *row = v + j * D + c;                                                       \
                const __m512 e0 = LOAD16(row), e1 = LOAD16(row + 16);                               \
                const __m512 o0 = LOAD16(row + D), o1 = LOAD16(row + D + 16);                       \
                _Pragma("GCC unroll 4") for (int r = 0; r < QUERY_TILE; r++) {                      \
                    if (r < R) {                                                                    \
                        const __m512 we = _mm512_set1_ps(weights[r * w_stride + j]);                \
                        const __m512 wo = _mm512_set1_ps(weights[r * w_stride + j + 1]);            \
                        even[r][0] = _mm512_fmadd_ps(we, e0, even[r][0]);                           \
                        even[r][1] = _mm512_fmadd_ps(we, e1, even[r][1]);                           \
                        odd[r][0] = _mm512_fmadd_ps(wo, o0, odd[r][0]);                             \
                        odd[r][1] = _mm512_fmadd_ps(wo, o1, odd[r][1]);                             \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            if (j < limit) {                                                                        \
                const T *row = v + j * D + c;                                                       \
                const __m512 e0 = LOAD16(row), e1 = LOAD16(row + 16);                               \
                _Pragma("GCC unroll 4") for (int r = 0; r < QUERY_TILE; r++) {                      \
                    if (r < R) {                                                                    \
                        const __m512 we = _mm512_set1_ps(weights[r * w_stride + j]);                \
                        even[r][0] = _mm512_fmadd_ps(we, e0, even[r][0]);                           \
                        even[r][1] = _mm512_fmadd_ps(we, e1, even[r][1]);                           \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            if (partials) { /* query r's two sets' sums at partials + 2 D r, to be continued */      \
                _Pragma("GCC unroll 4") for (int r = 0; r < QUERY_TILE; r++) {                      \
                    if (r < R) {                                                                    \
                        float *part = partials + 2 * D * r + c;                                     \
                        _mm512_storeu_ps(part, even[r][0]);                                         \
                        _mm512_storeu_ps(part + 16, even[r][1]);                                    \
                        _mm512_storeu_ps(part + D, odd[r][0]);                                      \
                        _mm512_storeu_ps(part + D + 16, odd[r][1]);                                 \
                    }                                                                               \
                }                                                                                   \
                continue;                                                                           \
            }                                                                                       \
            _Pragma("GCC unroll 4") for (int r = 0; r < QUERY_TILE; r++) {                          \
                if (r < R) {                                                                        \
                    const __m512 factor = _mm512_set1_ps(inverse[r]);                               \
                    float *o = out + r * out_stride + c;                                            \
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_add_ps(even[r][0], odd[r][0]), factor));      \
                    _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_add_ps(even[r][1], odd[r][1]), factor)); \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }
DEFINE_WEIGHTED_TILE(f32, float, LOAD16_F32)
DEFINE_WEIGHTED_TILE(bf16, uint16_t, LOAD16_BF16)

/* Scratch of attend() beyond the scores: the compacted lists' slots (compact_allowed) and the weighted
 * sums' two sets (weighted_continue_*), QUERY_TILE queries' worth (per_query_* uses the first). */
typedef struct {
    int32_t *rows;     /* QUERY_TILE lists of up to `slots` slots */
    float *partials;   /* QUERY_TILE x 2 D */
} attend_lists;

/* The scores of n queries (n >= TILE_MIN_QUERIES) of heads first_head .. first_head + group - 1 from
 * one kv head's keys transposed into kt (transpose_keys_*), up to QUERY_TILE queries at a time
 * (score_tile_R), then each query's softmax and weighted sum of the values vg (float32, or bfloat16
 * where v_bf16) over its compacted list of attended slots (compact_allowed), into `tile` (QUERY_TILE
 * rows of `slots` scores). On AVX-512 the slots every query of a tile attends from slot 0 on are
 * summed for the tile at once (weighted_tile_*) and each query's list continued alone. */
__attribute__((target("avx2,fma"), noinline)) static void attend_tiles(
    const float *q, Py_ssize_t q_stride, const float *kt, Py_ssize_t slots, const void *vg, int v_bf16, float *out,
    Py_ssize_t out_stride, const unsigned char *mask, Py_ssize_t n, int first_head, int group, int D, Py_ssize_t start,
    Py_ssize_t end, float scale, float *tile, const int *order, attend_lists lists, float softcap) {
    for (int h = first_head; h < first_head + group; h++) {
        /* tiles of queries as even as they come (6 = 3 + 3, 25 = 4 + 4 + 4 + 4 + 3 + 3 + 3): from
         * TILE_MIN_QUERIES on, every tile has 3 or 4 queries, which score 32 slots a step on AVX-512
         * (a tile of 2, as 6 = 4 + 2 gave, took ~1.3x the time of two of 3) */
        const Py_ssize_t num_tiles = (n + QUERY_TILE - 1) / QUERY_TILE;
        Py_ssize_t i0 = 0;
        int rows = 0;
        for (Py_ssize_t t = 0; t < num_tiles; t++, i0 += rows) {
            rows = (int)((n - i0) / (num_tiles - t) + ((n - i0) % (num_tiles - t) != 0));
            /* the slots any query of the tile attends: up to the last one's limit */
            const Py_ssize_t last = mask ? end : start + i0 + rows;
            const Py_ssize_t tile_slots = (last + 15) / 16 * 16;
            const float *qh = q + i0 * q_stride + (Py_ssize_t)h * D;
            if (use_avx512()) {
                switch (rows) {
                case 4: score_tile512_4(qh, q_stride, kt, slots, D, order, tile_slots, scale, tile, slots); break;
                case 3: score_tile512_3(qh, q_stride, kt, slots, D, order, tile_slots, scale, tile, slots); break;
                case 2: score_tile512_2(qh, q_stride, kt, slots, D, order, tile_slots, scale, tile, slots); break;
                default: score_tile512_1(qh, q_stride, kt, slots, D, order, tile_slots, scale, tile, slots);
                }
            } else {
                switch (rows) {
                case 4: score_tile_4(qh, q_stride, kt, slots, D, order, tile_slots, scale, tile, slots); break;
                case 3: score_tile_3(qh, q_stride, kt, slots, D, order, tile_slots, scale, tile, slots); break;
                case 2: score_tile_2(qh, q_stride, kt, slots, D, order, tile_slots, scale, tile, slots); break;
                default: score_tile_1(qh, q_stride, kt, slots, D, order, tile_slots, scale, tile, slots);
                }
            }
            /* each query's list: m[r] slots, the first prefix[r] of them slots 0 .. prefix[r] - 1 */
            Py_ssize_t m[QUERY_TILE], prefix[QUERY_TILE], shared = last;
            float inverse[QUERY_TILE];
            for (int r = 0; r < rows; r++) {
                const Py_ssize_t i = i0 + r, limit = mask ? end : start + i + 1;
                float *weights = tile + r * slots;
                if (mask)
                    m[r] = compact_allowed(weights, limit, mask + i * end, lists.rows + r * slots, &prefix[r]);
                else
                    m[r] = prefix[r] = limit;
                inverse[r] = softmax_scores(weights, m[r], NULL, softcap);
                shared = prefix[r] < shared ? prefix[r] : shared;
            }
            float *o = out + i0 * out_stride + (Py_ssize_t)h * D;
            if (!(D % 32 == 0 && use_avx512())) { /* each query's list alone */
                for (int r = 0; r < rows; r++) {
                    float *weights = tile + r * slots, *part = lists.partials + 2 * D * r, *o_r = o + r * out_stride;
                    if (v_bf16)
                        weighted_list_bf16(weights, (const uint16_t *)vg, D, prefix[r], m[r], lists.rows + r * slots,
                                           inverse[r], o_r, part);
                    else
                        weighted_list_f32(weights, (const float *)vg, D, prefix[r], m[r], lists.rows + r * slots,
                                          inverse[r], o_r, part);
                }
                continue;
            }
            /* the shared slots' sums for the tile at once, then each query's own slots: up to its prefix in
             * place, then its listed ones */
            int whole = 1; /* every list ends within the shared slots */
            for (int r = 0; r < rows; r++) whole = whole && m[r] == shared;
            if (v_bf16)
                weighted_tile_bf16(tile, slots, rows, (const uint16_t *)vg, D, shared, inverse, o, out_stride,
                                   whole ? NULL : lists.partials);
            else
                weighted_tile_f32(tile, slots, rows, (const float *)vg, D, shared, inverse, o, out_stride,
                                  whole ? NULL : lists.partials);
            if (whole) continue;
            for (int r = 0; r < rows; r++) {
                float *weights = tile + r * slots, *part = lists.partials + 2 * D * r;
                const int32_t *listed = lists.rows + r * slots;
                if (v_bf16) {
                    weighted_continue_bf16(weights, (const uint16_t *)vg, D, shared, prefix[r], NULL, part);
                    weighted_continue_bf16(weights, (const uint16_t *)vg, D, prefix[r], m[r], listed, part);
                } else {
                    weighted_continue_f32(weights, (const float *)vg, D, shared, prefix[r], NULL, part);
                    weighted_continue_f32(weights, (const float *)vg, D, prefix[r], m[r], listed, part);
                }
                weighted_finish(part, D, inverse[r], o + r * out_stride);
            }
        }
    }
}

/* The per-query path (fewer than TILE_MIN_QUERIES queries) of heads first_head .. first_head + group - 1,
 * which read one kv head's keys kg and values vg (rows of D, of type T): for each head and query, the
 * scores eight keys at a time from the cache rows (dot8x8_S), the softmax and the weighted sum of the
 * values (weighted_sum_S). Heads outside, queries inside: a head's keys and values stay in the cache
 * for all its queries. QUERY(qh, D, qp) gives the query as the key dots take it: as it is for float32
 * keys, permuted into qp (the scratch after the scores) for bfloat16 ones (permute_query).
 * (noinline, as attend_tiles: inlined into attend(), the per-query path over a float32 cache ran
 * 11-15% slower, 1-5 queries over 150 slots, against the C file before the bf16 cache.) */
#define QUERY_AS_IS(qh, D, qp) (qh)
#define QUERY_PERMUTED(qh, D, qp) (permute_query((qh), (D), (qp)), (const float *)(qp))
#define DEFINE_PER_QUERY(NAME, S, T, QUERY, PREFETCH)                                                \
    __attribute__((target("avx2,fma"), noinline)) static void NAME(                                 \
        const float *q, Py_ssize_t q_stride, const T *kg, const T *vg, float *out, Py_ssize_t out_stride, \
        const unsigned char *mask, Py_ssize_t n, int first_head, int group, int D, Py_ssize_t start, \
        Py_ssize_t end, float scale, float *scratch, attend_lists lists, float softcap) {           \
        const __m256 scale8 = _mm256_set1_ps(scale);                                                \
        float *qp = scratch + (end + 15) / 16 * 16;                                                 \
        (void)qp;                                                                                   \
        for (int h = first_head; h < first_head + group; h++) {                                     \
            for (Py_ssize_t i = 0; i < n; i++) {                                                    \
                const Py_ssize_t limit = mask ? end : start + i + 1; /* slots j < limit may be attended */ \
                const float *qh = QUERY(q + i * q_stride + (Py_ssize_t)h * D, D, qp);               \
                Py_ssize_t j = 0;                                                                   \
                if (PREFETCH && i == 0) /* (see prefetch_lines) */                                  \
                    for (; j + 8 <= limit; j += 8) {                                                \
                        prefetch_lines(vg + j * D, 8 * D * (Py_ssize_t)sizeof(T));                  \
                        _mm256_storeu_ps(scratch + j, _mm256_mul_ps(dot8x8_##S(qh, kg + j * D, D), scale8)); \
                    }                                                                               \
                for (; j + 8 <= limit; j += 8)                                                      \
                    _mm256_storeu_ps(scratch + j, _mm256_mul_ps(dot8x8_##S(qh, kg + j * D, D), scale8)); \
                for (; j < limit; j++) scratch[j] = dot8_##S(qh, kg + j * D, D) * scale;            \
                float *o = out + i * out_stride + (Py_ssize_t)h * D;                                \
                Py_ssize_t prefix = limit, m = limit; /* the attended slots' list (compact_allowed) */ \
                if (mask) m = compact_allowed(scratch, limit, mask + i * end, lists.rows, &prefix); \
                const float inverse = softmax_scores(scratch, m, NULL, softcap);                    \
                weighted_list_##S(scratch, vg, D, prefix, m, lists.rows, inverse, o, lists.partials); \
            }                                                                                       \
        }                                                                                           \
    }
DEFINE_PER_QUERY(per_query_f32, f32, float, QUERY_AS_IS, 0)
DEFINE_PER_QUERY(per_query_bf16, bf16, uint16_t, QUERY_PERMUTED, 0)
/* (with the values' prefetches: see prefetch_lines) */
DEFINE_PER_QUERY(per_query_prefetching_f32, f32, float, QUERY_AS_IS, 1)
DEFINE_PER_QUERY(per_query_prefetching_bf16, bf16, uint16_t, QUERY_PERMUTED, 1)

/* Attention of n queries of one sequence over its cached keys and values (head_dim D a multiple of 8).
 *
 * Why: torch's scaled_dot_product_attention costs 50-80 us a call here for one query over a few
 * hundred slots (8 heads of 32), about a sixth of a bundled-target step, for some 10 us of arithmetic.
 *
 * q: n rows of q_stride floats, the heads * D query values at the start of each row. keys, values:
 * (kv_heads, capacity, D), float32 (kv_bf16 = 0) or bfloat16. out: (n, heads * D). Query i attends
 * slot j < end where mask[i * end + j] is non-zero, or, with no mask, where j <= start + i (a causal
 * chain after `start` cached slots; one query attends every slot). Head h reads kv head
 * h / (heads / kv_heads). Softmax in float32 with the maximum subtracted. `scratch` is room for
 * attend_scratch_floats(end, D) floats.
 *
 * One order for every call: a query's scores are summed over d in the per-query path's order
 * (key_dot_order; the tiles follow it), and its softmax and weighted sums run over the list of the
 * slots it attends, in order of slot (compact_allowed), so its output is the same bits whichever path
 * its call takes (by query count), and wherever in the cache its attended slots sit: a tree node's
 * attention equals that of the same token in a chain, and a batch row's that of its lone run.
 *
 * Fewer than TILE_MIN_QUERIES queries: each one's scores eight keys at a time from the cache rows
 * (dot8x8). More: each kv head's keys are transposed once into the scratch, and the scores of up to
 * QUERY_TILE queries are summed together from it, sixteen slots a step (score_tile_R): no sums across
 * lanes, and each key value is loaded once for the tile. (Measured on the bundled target's 8 heads of
 * 32 over ~150 slots: the per-key lane sums were about a quarter of the attention's time.)
 *
 * A bfloat16 cache is read as it is: fewer than TILE_MIN_QUERIES queries by per_query_bf16, more in
 * tiles over the keys widened as they are transposed, and the values widened where the weighted sums
 * read them. (Widening a kv head's keys and values into a float32 copy first, and then
 * attending as over float32, cost more than it saved: 9 queries over 300 slots 0.96-0.99x the float32
 * cache's forward.) */
__attribute__((target("avx2,fma"))) static void attend_groups(
    const float *q, Py_ssize_t q_stride, const void *keys, const void *values, int kv_bf16, Py_ssize_t capacity,
    float *out, const unsigned char *mask, Py_ssize_t n, int heads, int kv_heads, int D, Py_ssize_t start,
    Py_ssize_t end, float scale, float *scratch, int prefetch_values, int first_group, int end_group, float softcap) {
    const int group = heads / kv_heads;
    const Py_ssize_t out_stride = (Py_ssize_t)heads * D, head_values = capacity * D;
    const Py_ssize_t slots = (end + 15) / 16 * 16;
    int order[D]; /* the key dots' order of d (key_dot_order), which the score tiles follow */
    key_dot_order(D, kv_bf16, order);
    attend_lists lists;
    lists.rows = (int32_t *)(scratch + slots * (D + QUERY_TILE));
    lists.partials = scratch + slots * (D + 2 * QUERY_TILE);
    for (int g = first_group; g < end_group; g++) {
        const float *kf = (const float *)keys + g * head_values, *vf = (const float *)values + g * head_values;
        const uint16_t *kb = (const uint16_t *)keys + g * head_values, *vb = (const uint16_t *)values + g * head_values;
        if (n < TILE_MIN_QUERIES) {
            if (kv_bf16)
                (prefetch_values ? per_query_prefetching_bf16 : per_query_bf16)(
                    q, q_stride, kb, vb, out, out_stride, mask, n, g * group, group, D, start, end, scale, scratch,
                    lists, softcap);
            else
                (prefetch_values ? per_query_prefetching_f32 : per_query_f32)(
                    q, q_stride, kf, vf, out, out_stride, mask, n, g * group, group, D, start, end, scale, scratch,
                    lists, softcap);
            continue;
        }
        if (kv_bf16)
            transpose_keys_bf16(kb, end, D, scratch, slots, prefetch_values ? vb : NULL);
        else
            transpose_keys_f32(kf, end, D, scratch, slots, prefetch_values ? vf : NULL);
        attend_tiles(q, q_stride, scratch, slots, kv_bf16 ? (const void *)vb : (const void *)vf, kv_bf16, out,
                     out_stride, mask, n, g * group, group, D, start, end, scale, scratch + (Py_ssize_t)D * slots,
                     order, lists, softcap);
    }
}

/* Every kv head's group of heads (attend_groups). */
static void attend(const float *q, Py_ssize_t q_stride, const void *keys, const void *values, int kv_bf16,
                   Py_ssize_t capacity, float *out, const unsigned char *mask, Py_ssize_t n, int heads, int kv_heads,
                   int D, Py_ssize_t start, Py_ssize_t end, float scale, float *scratch, int prefetch_values,
                   float softcap) {
    attend_groups(q, q_stride, keys, values, kv_bf16, capacity, out, mask, n, heads, kv_heads, D, start, end, scale,
                  scratch, prefetch_values, 0, kv_heads, softcap);
}

/* The attention of a layer's `batch` sequences (each over its own cache row, under its own mask), split
 * among the products' threads by (sequence, kv head) where it reads enough of the cache
 * (POOL_MIN_BYTES): a long context, or a batch. Each unit is computed whole by one thread, in the order
 * attend() computes it, so the outputs are one thread's bits. Workers use scratch of their own. */
struct attend_job {
    const float *qkv;
    const char *keys, *values;
    float *attn, *scratch; /* scratch: the caller's, where it runs the whole job alone */
    const unsigned char *mask;
    Py_ssize_t width, capacity, sequence, n, start, end;
    int kv_bf16, heads, kv_heads, D, prefetch_values;
    float scale, softcap; /* softcap: Gemma 2's cap of the scores (0: none) */
    atomic_int failed; /* a worker's scratch could not be allocated */
};

static __thread float *unit_scratch;
static __thread size_t unit_scratch_floats;

/* Kv heads first_group .. end_group - 1 of sequence b of the job (attend_groups over its cache row and mask). */
static void attend_sequence(const attend_job *job, Py_ssize_t b, float *scratch, int first_group, int end_group) {
    const Py_ssize_t kv_size = job->kv_bf16 ? 2 : 4;
    attend_groups(job->qkv + b * job->n * job->width, job->width, job->keys + b * job->sequence * kv_size,
                  job->values + b * job->sequence * kv_size, job->kv_bf16, job->capacity,
                  job->attn + b * job->n * job->heads * job->D, job->mask ? job->mask + b * job->n * job->end : NULL,
                  job->n, job->heads, job->kv_heads, job->D, job->start, job->end, job->scale, scratch,
                  job->prefetch_values, first_group, end_group, job->softcap);
}

/* Units first .. end_unit - 1 of a pooled job (unit u: sequence u / kv_heads, kv head u % kv_heads), on this
 * thread's scratch. */
static void attend_units(attend_job *job, Py_ssize_t first, Py_ssize_t end_unit) {
    const size_t floats = attend_scratch_floats(job->end, job->D);
    if (floats > unit_scratch_floats) {
        free(unit_scratch);
        unit_scratch = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        unit_scratch_floats = unit_scratch == NULL ? 0 : floats;
    }
    if (unit_scratch == NULL) {
        atomic_store(&job->failed, 1);
        return;
    }
    for (Py_ssize_t u = first; u < end_unit; u++) {
        const int g = (int)(u % job->kv_heads);
        attend_sequence(job, u / job->kv_heads, unit_scratch, g, g + 1);
    }
}

/* 0 where done; -1 where a worker's scratch could not be allocated. */
static int attend_batch(attend_job *job, Py_ssize_t batch) {
    const Py_ssize_t units = batch * job->kv_heads;
    const Py_ssize_t cache_bytes = 2 * batch * job->kv_heads * job->end * job->D * (job->kv_bf16 ? 2 : 4);
    const int threads = atomic_load(&pool_wanted);
    atomic_store(&job->failed, 0);
    if (threads > 1 && units > 1 && cache_bytes >= POOL_MIN_BYTES) {
        product_job pooled;
        memset(&pooled, 0, sizeof pooled);
        pooled.attend = job;
        pooled.units = units;
        pooled.chunk = 1;
        if (pool_run(&pooled) == 0) return atomic_load(&job->failed) ? -1 : 0;
    }
    /* alone: each sequence's kv heads in one call, on the caller's scratch (as before the threads) */
    for (Py_ssize_t b = 0; b < batch; b++) attend_sequence(job, b, job->scratch, 0, job->kv_heads);
    return 0;
}

/* The sum over a row of H values, in eight float64 lanes: of the values (square 0), or of their squares
 * about `centre`, (x - centre)^2. Why lanes: one chain of dependent additions (4 cycles each) made the
 * norms a third of a 25-query bundled-target pass's work outside its products and attention, once the
 * AMX products had made those cheap. */
__attribute__((target("avx2,fma"))) static inline double row_sum(const float *row, Py_ssize_t H, double centre,
                                                                 int square) {
    const __m256d centre4 = _mm256_set1_pd(centre);
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    Py_ssize_t h = 0;
    for (; h + 8 <= H; h += 8) {
        const __m256 v = _mm256_loadu_ps(row + h);
        const __m256d a = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), centre4);
        const __m256d b = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), centre4);
        low = square ? _mm256_fmadd_pd(a, a, low) : _mm256_add_pd(low, a);
        high = square ? _mm256_fmadd_pd(b, b, high) : _mm256_add_pd(high, b);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(low, high));
    double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; h < H; h++) sum += square ? ((double)row[h] - centre) * ((double)row[h] - centre) : (double)row[h];
    return sum;
}

/* The layers' norm per row of H values, its weight (and a LayerNorm's bias) folded into the next matrix:
 * an RMSNorm's out = x / sqrt(eps + mean(x^2)), or (layer_norm) a LayerNorm's out = (x - mean(x)) /
 * sqrt(eps + var(x)), the variance from the centred values (a second pass). The sums in float64
 * (row_sum), each value rounded once; an RMSNorm's centre is 0, which leaves its bits as they were. */
__attribute__((target("avx2,fma"))) static void norm_rows(const float *x, float *out, Py_ssize_t n, Py_ssize_t H,
                                                         double eps, int layer_norm) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *row = x + i * H;
        const double mean = layer_norm ? row_sum(row, H, 0.0, 0) / (double)H : 0.0;
        const double scale = 1.0 / sqrt(eps + row_sum(row, H, mean, 1) / (double)H);
        const __m256d scale4 = _mm256_set1_pd(scale), mean4 = _mm256_set1_pd(mean);
        Py_ssize_t h = 0;
        for (; h + 4 <= H; h += 4) /* (as the scalar form: a float64 product, rounded once) */
            _mm_storeu_ps(out + i * H + h, _mm256_cvtpd_ps(_mm256_mul_pd(
                                               _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(row + h)), mean4), scale4)));
        for (; h < H; h++) out[i * H + h] = (float)(((double)row[h] - mean) * scale);
    }
}

/* out = silu(gate) * up = gate * sigmoid(gate) * up over I columns, eight at a time. The sigmoid from
 * e = exp(-|gate|) <= 1 (exp8's range, never an overflow): 1 / (1 + e) for gate >= 0, e / (1 + e)
 * below. Why: libm's expf one value at a time was 3% of a 5-row bundled-target pass (perf), as much
 * as a third of the layer's work outside the products and the attention. About 1 ulp from the
 * scalar form. */
__attribute__((target("avx2,fma"))) static void silu_times(const float *gate, const float *up, float *out, int I) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    int c = 0;
    for (; c + 8 <= I; c += 8) {
        const __m256 g = _mm256_loadu_ps(gate + c);
        const __m256 e = exp8(_mm256_or_ps(g, sign)); /* exp(-|g|) */
        const __m256 inverse = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sigmoid = _mm256_blendv_ps(inverse, _mm256_mul_ps(e, inverse), g); /* sign of g picks */
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + c)));
    }
    for (; c < I; c++) out[c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
}

/* y[r] += b for each of n rows of N values (a product's bias; NULL: none). */
static void add_bias_rows(float *y, const float *b, Py_ssize_t n, Py_ssize_t N) {
    if (b == NULL) return;
    for (Py_ssize_t r = 0; r < n; r++)
        for (Py_ssize_t c = 0; c < N; c++) y[r * N + c] += b[c];
}

/* The MLPs of the host layers (STYLE_MLP of a layer's style): SiLU(gate) * up (the Llama family) or GELU's
 * tanh form of the gate times up (Gemma), or an activation of the up projection alone: GELU (GPT-NeoX),
 * GELU's tanh form (GPT-2's and Phi's gelu_new, GPT-BigCode, StarCoder2, GPT-J) or ReLU (OPT). */
enum { MLP_SILU_GATED = 0, MLP_GELU = 1, MLP_GELU_TANH = 2, MLP_RELU = 3, MLP_GELU_TANH_GATED = 4 };
/* Whether an MLP has a gate: act(gate) * up, gate_up (rows, 2 I) (SiLU: the Llama family; GELU's tanh form:
 * Gemma). */
static inline int mlp_gated(int mlp) { return mlp == MLP_SILU_GATED || mlp == MLP_GELU_TANH_GATED; }

/* out = act(x) over I columns, eight at a time (act one of the ungated MLPs' above). GELU as
 * 0.5 x (1 + erf(x / sqrt 2)), erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7: the form
 * torch's own vectorised CPU erf takes); the tanh form as 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715
 * x^3), tanh(|u|) = (1 - e) / (1 + e) with e = exp(-2 |u|) (exp8's range). Both within a few ulp of torch's. */
__attribute__((target("avx2,fma"))) static void activate(const float *x, float *out, int I, int mlp) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
    int c = 0;
    if (mlp == MLP_RELU) {
        for (; c + 8 <= I; c += 8) _mm256_storeu_ps(out + c, _mm256_max_ps(_mm256_loadu_ps(x + c), _mm256_setzero_ps()));
        for (; c < I; c++) out[c] = x[c] > 0.0f ? x[c] : 0.0f;
        return;
    }
    if (mlp == MLP_GELU_TANH) {
        const __m256 k = _mm256_set1_ps(0.7978845608028654f), cubic = _mm256_set1_ps(0.044715f);
        for (; c + 8 <= I; c += 8) {
            const __m256 v = _mm256_loadu_ps(x + c);
            const __m256 u = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(cubic, v), _mm256_mul_ps(v, v), v));
            const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_or_ps(u, sign))); /* exp(-2|u|) */
            const __m256 magnitude = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
            const __m256 t = _mm256_or_ps(magnitude, _mm256_and_ps(u, sign)); /* tanh(u), u's sign */
            _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, t)));
        }
        for (; c < I; c++) {
            const float v = x[c];
            out[c] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
        }
        return;
    }
    /* MLP_GELU */
    const __m256 p = _mm256_set1_ps(0.3275911f), root_half = _mm256_set1_ps(0.70710678118654752f);
    const __m256 a1 = _mm256_set1_ps(0.254829592f), a2 = _mm256_set1_ps(-0.284496736f),
                 a3 = _mm256_set1_ps(1.421413741f), a4 = _mm256_set1_ps(-1.453152027f), a5 = _mm256_set1_ps(1.061405429f);
    for (; c + 8 <= I; c += 8) {
        const __m256 v = _mm256_loadu_ps(x + c);
        const __m256 z = _mm256_mul_ps(v, root_half);
        const __m256 negative = _mm256_or_ps(z, sign); /* -|z| */
        const __m256 t = _mm256_div_ps(one, _mm256_fnmadd_ps(p, negative, one)); /* 1 / (1 + p |z|) */
        __m256 poly = _mm256_fmadd_ps(a5, t, a4);
        poly = _mm256_fmadd_ps(poly, t, a3);
        poly = _mm256_fmadd_ps(poly, t, a2);
        poly = _mm256_fmadd_ps(poly, t, a1);
        poly = _mm256_mul_ps(poly, t);
        const __m256 e = exp8(_mm256_mul_ps(negative, _mm256_andnot_ps(sign, z))); /* exp(-z^2) */
        const __m256 magnitude = _mm256_fnmadd_ps(poly, e, one);                  /* erf(|z|) */
        const __m256 erf_z = _mm256_or_ps(magnitude, _mm256_and_ps(z, sign));
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, erf_z)));
    }
    for (; c < I; c++) out[c] = 0.5f * x[c] * (1.0f + erff(x[c] * 0.70710678118654752f));
}

/* How a layer differs from the Llama family's (all zero and NULL: a Llama layer). */
typedef struct {
    int layer_norm; /* LayerNorms rather than RMSNorms (GPT-NeoX, GPT-2, OPT, ...) */
    int mlp;        /* MLP_SILU_GATED, MLP_GELU, MLP_GELU_TANH or MLP_RELU */
    int parallel;   /* LAYER_SEQUENTIAL, LAYER_PARALLEL (attention and the MLP each norm the layer's input:
                     * GPT-NeoX) or LAYER_PARALLEL_SHARED (the MLP reads attention's norm: Phi, GPT-J) */
    const float *b_o, *b_up, *b_down; /* the products' biases (NULL: none) */
    const float *qk_norm; /* Qwen3's q and k norms, each head's D values: the q weights, then the k weights
                           * (each in the rows' interleaved order; NULL: none) */
    double qk_eps;
    /* Gemma 2 / 3 and OLMo 2 / 3: each block's output RMS-normed and scaled (these weights, H values) before
     * its residual add (NULL: added as it is) */
    const float *attn_out_norm, *mlp_out_norm;
    double attn_out_eps, mlp_out_eps;
    int qk_all_heads; /* OLMo 2 / 3: q normed over all its heads' values at once and k over all of its own
                       * (qk_norm then heads * D q weights, then kv_heads * D k weights) */
    float softcap;    /* Gemma 2: the attention scores capped, softcap * tanh(s / softcap) (0: not capped) */
    float clip;       /* OLMo 1.7: q, k and v clamped to [-clip, clip] after their product (0: not clamped) */
} layer_style;
enum { LAYER_SEQUENTIAL = 0, LAYER_PARALLEL = 1, LAYER_PARALLEL_SHARED = 2 };
/* A style's bits as Python packs them (host_kernels.layer_style): norm, parallel, MLP. */
#define STYLE_LAYER_NORM(bits) ((bits) & 1)
#define STYLE_PARALLEL(bits) (((bits) >> 1) & 3)
#define STYLE_MLP(bits) (((bits) >> 3) & 7)

/* Whether a layer's norms after its blocks fit it (Gemma 2 / 3, OLMo 2 / 3): both blocks' outputs normed or
 * neither, and only in sequence (the one check of the `layer` binding and of each of forward()'s layers). */
static int out_norms_fit(int attn_out_norm, int mlp_out_norm, int parallel) {
    return attn_out_norm == mlp_out_norm && (!attn_out_norm || parallel == LAYER_SEQUENTIAL);
}

/* The error of a style's bits, NULL where they name one. */
static const char *style_error(int bits) {
    if (bits < 0 || bits >= 64 || STYLE_PARALLEL(bits) > LAYER_PARALLEL_SHARED || STYLE_MLP(bits) > MLP_GELU_TANH_GATED)
        return "a layer's style must be norm | parallel << 1 | mlp << 3 (host_kernels.layer_style)";
    return NULL;
}

/* v = w * (v / sqrt(mean(v^2) + eps)) over one head's D values, as the lean view's _rms_norm computes a q or k
 * norm (Qwen3's, over the head dimension) to float32 rounding: the sum of squares in float64. (Also over all
 * heads' values at once, OLMo 2's q/k norms, and over a row of H, a block output's norm: add_normed.) */
static void rms_head(float *v, int D, const float *w, double eps) {
    double sum = 0.0;
    for (int d = 0; d < D; d++) sum += (double)v[d] * (double)v[d];
    const float scale = (float)(1.0 / sqrt(sum / D + eps));
    for (int d = 0; d < D; d++) v[d] = w[d] * (v[d] * scale);
}

/* hidden += w * rms(y) per row of H values (y: a block's output, normed in place): Gemma 2 / 3's and OLMo 2 /
 * 3's residual add, the lean view's `residual + _rms_norm(y, w, eps)`. */
__attribute__((target("avx2,fma"))) static void add_normed(float *hidden, float *y, Py_ssize_t rows, int H,
                                                          const float *w, double eps) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        rms_head(y + r * H, H, w, eps);
        for (int h = 0; h < H; h++) hidden[r * H + h] += y[r * H + h];
    }
}

/* The layers' norm of `hidden` into `normed`, or (eps < 0: no norm there, OLMo 2 / 3) a copy of it. */
static void norm_or_copy(const float *hidden, float *normed, Py_ssize_t rows, Py_ssize_t H, double eps, int ln) {
    if (eps < 0.0)
        memcpy(normed, hidden, (size_t)(rows * H) * sizeof(float));
    else
        norm_rows(hidden, normed, rows, H, eps, ln);
}

/* One decoder layer for n rows of each of `batch` sequences, in place on `hidden` (batch * n, H): what
 * the host forward does per layer (lean_host.py), in one call instead of some twenty (a batch: the
 * norms, products and SiLU over all batch * n rows at once; sequence b's keys and values in its own
 * cache row, `keys` + b * kv_heads * capacity * D values, and its attention under its own mask,
 * `mask` + b * n * (start + n)).
 *
 * Why: on the bundled pair a layer's numpy and torch calls between the products cost 60-100 us
 * (about 0.7 ms of a 2.8 ms target step, 0.2 ms of a 0.6 ms draft step); here they cost a few.
 *
 * The layer (Llama family as the lean view holds it: the norms' weights folded into the next
 * matrix, q/k/v and gate/up fused, each head's rotary pairs interleaved as complex numbers):
 *   normed = rms(hidden); qkv = normed @ W_qkv (+ bias); q, k rotated by `rotation` (n, D/2 complex);
 *   k, v written to cache slots start .. start+n-1; attn = attention (see attend());
 *   hidden += attn @ W_o; normed = rms(hidden); gate_up = normed @ W_gate_up;
 *   act = silu(gate) * up; hidden += act @ W_down.
 * `style` names the other families' layers (GPT-NeoX, GPT-2, OPT, GPT-BigCode, Phi, GPT-J; see layer_style):
 * LayerNorms for the RMSNorms (weights and biases folded likewise, a bias into the next matrix's), biases
 * after the o, up and down products, an MLP of the up projection alone (act(x W_up + b_up): GELU, its tanh
 * form or ReLU; gate_up then (rows, I), w_gate_up (H, I)), attention and the MLP both reading the layer's
 * input (hidden += attn @ W_o + mlp(norm'(hidden)), norm' the MLP's own norm or attention's), and rotation
 * NULL for models without one (learned positions, added to the embedding rows by the caller); and, where
 * style->qk_norm is given (Qwen3, Gemma 3), each q and k head RMS-normed and scaled before the rotation
 * (rms_head; with style->qk_all_heads, OLMo 2 / 3, q over all its heads at once and k likewise); where
 * style->attn_out_norm and mlp_out_norm are given (Gemma 2 / 3, OLMo 2 / 3), each block's output RMS-normed
 * and scaled before its residual add (add_normed); eps_in or eps_post below 0: no norm before that block
 * (OLMo 2 / 3: the block reads the residual as it is). attend_first > 0 (a windowed layer past its window):
 * no query attends a slot before it, and `mask` (required then) covers slots attend_first .. start + n - 1 only,
 * n * (start + n - attend_first) bytes a sequence: attention reads the cache from that slot on.
 * normed, qkv, attn, gate_up, act are work buffers of n rows. The four weights are packed as one kind
 * (bf16: PANELS_F32, PANELS_BF16, PANELS_AMX or PANELS_F16, see panel_product); the cache's keys and values are
 * float32 (kv_bf16 = 0) or bfloat16, rounded to nearest even as they are written (bf16_bits);
 * everything else is float32. 0 where done, -1 out of memory (panel_product). */
__attribute__((target("avx2,fma"))) static int layer_forward(
    float *hidden, float *normed, float *qkv, float *attn, float *gate_up, float *act, const void *w_qkv,
    const float *b_qkv, const void *w_o, const void *w_gate_up, const void *w_down, int bf16, Py_ssize_t n, int H,
    int heads, int kv_heads, int D, int I, double eps_in, double eps_post, const float *rotation, void *keys,
    void *values, int kv_bf16, Py_ssize_t capacity, const unsigned char *mask, Py_ssize_t start, float scale,
    float *scores, Py_ssize_t batch, int prefetch_values, const layer_style *style, Py_ssize_t attend_first) {
    const Py_ssize_t width = (Py_ssize_t)(heads + 2 * kv_heads) * D;
    const Py_ssize_t rows = batch * n, sequence = (Py_ssize_t)kv_heads * capacity * D; /* (values a cache row) */
    const int ln = style->layer_norm, gated = mlp_gated(style->mlp);
    const Py_ssize_t up_width = gated ? 2 * (Py_ssize_t)I : I;
    norm_or_copy(hidden, normed, rows, H, eps_in, ln);
    if (panel_product(normed, w_qkv, bf16, qkv, rows, H, width, 0)) return -1;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const Py_ssize_t i = r % n, first = (r / n) * sequence; /* query i of sequence r / n */
        float *row = qkv + r * width;
        add_bias_rows(row, b_qkv, 1, width);
        if (style->clip > 0.0f) /* (OLMo 1.7's clip_qkv: as torch's clamp, a NaN stays NaN) */
            for (Py_ssize_t c = 0; c < width; c++)
                row[c] = row[c] > style->clip ? style->clip : row[c] < -style->clip ? -style->clip : row[c];
        if (style->qk_norm && style->qk_all_heads) { /* (q over all its heads' values, k likewise: OLMo 2 / 3) */
            rms_head(row, heads * D, style->qk_norm, style->qk_eps);
            rms_head(row + (Py_ssize_t)heads * D, kv_heads * D, style->qk_norm + (Py_ssize_t)heads * D, style->qk_eps);
        } else if (style->qk_norm) { /* (each q and k head RMS-normed over its D values, then scaled: Qwen3) */
            for (int head = 0; head < heads + kv_heads; head++)
                rms_head(row + (Py_ssize_t)head * D, D, style->qk_norm + (head < heads ? 0 : D), style->qk_eps);
        }
        if (rotation) { /* (NULL: no rotation) */
            const float *rot = rotation + r * D; /* D/2 (cos, sin) pairs */
            for (int head = 0; head < heads + kv_heads; head++) {
                float *v = row + (Py_ssize_t)head * D;
                for (int j = 0; j < D; j += 2) {
                    const float re = v[j], im = v[j + 1], c = rot[j], s = rot[j + 1];
                    v[j] = re * c - im * s;
                    v[j + 1] = re * s + im * c;
                }
            }
        }
        for (int g = 0; g < kv_heads; g++) {
            const Py_ssize_t slot = first + ((Py_ssize_t)g * capacity + start + i) * D;
            const float *k = row + (Py_ssize_t)(heads + g) * D, *v = row + (Py_ssize_t)(heads + kv_heads + g) * D;
            if (kv_bf16) {
                for (int d = 0; d < D; d++) {
                    ((uint16_t *)keys)[slot + d] = bf16_bits(k[d]);
                    ((uint16_t *)values)[slot + d] = bf16_bits(v[d]);
                }
            } else {
                memcpy((float *)keys + slot, k, (size_t)D * sizeof(float));
                memcpy((float *)values + slot, v, (size_t)D * sizeof(float));
            }
        }
    }
    /* each sequence over its own cache row, under its own mask (on the products' threads where it is long) */
    /* (from attend_first on: every kv head's slots shifted alike, the mask's columns from there) */
    const Py_ssize_t shift = attend_first * D * (kv_bf16 ? 2 : 4);
    attend_job job = {qkv, (const char *)keys + shift, (const char *)values + shift, attn, scores, mask, width,
                      capacity, sequence, n, start - attend_first, start + n - attend_first, kv_bf16, heads, kv_heads,
                      D, prefetch_values, scale, style->softcap};
    if (attend_batch(&job, batch)) return -1;
    /* In parallel, the MLP reads the layer's input: its own norm of it is taken before attention's output
     * joins the residual (LAYER_PARALLEL_SHARED: `normed` is attention's norm still); in sequence, the norm
     * of the residual with attention's output. */
    if (style->parallel == LAYER_PARALLEL) norm_rows(hidden, normed, rows, H, eps_post, ln);
    if (style->attn_out_norm) { /* (sequential only: the output normed in `normed`, free until the next norm) */
        if (panel_product(attn, w_o, bf16, normed, rows, (Py_ssize_t)heads * D, H, 0)) return -1;
        add_bias_rows(normed, style->b_o, rows, H);
        add_normed(hidden, normed, rows, H, style->attn_out_norm, style->attn_out_eps);
    } else {
        if (panel_product(attn, w_o, bf16, hidden, rows, (Py_ssize_t)heads * D, H, 1)) return -1;
        add_bias_rows(hidden, style->b_o, rows, H);
    }
    if (style->parallel == LAYER_SEQUENTIAL) norm_or_copy(hidden, normed, rows, H, eps_post, ln);
    if (panel_product(normed, w_gate_up, bf16, gate_up, rows, H, up_width, 0)) return -1;
    add_bias_rows(gate_up, style->b_up, rows, up_width);
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (style->mlp == MLP_SILU_GATED) {
            silu_times(gate_up + r * 2 * I, gate_up + r * 2 * I + I, act + r * I, I);
        } else if (gated) { /* (Gemma: gelu_tanh(gate), then times up, as its module's two ops round) */
            float *out = act + r * I;
            const float *up = gate_up + r * 2 * I + I;
            activate(gate_up + r * 2 * I, out, I, MLP_GELU_TANH);
            for (int c = 0; c < I; c++) out[c] *= up[c];
        } else {
            activate(gate_up + r * I, act + r * I, I, style->mlp);
        }
    }
    if (style->mlp_out_norm) { /* (`normed`: read by the gate/up product, free again) */
        if (panel_product(act, w_down, bf16, normed, rows, I, H, 0)) return -1;
        add_bias_rows(normed, style->b_down, rows, H);
        add_normed(hidden, normed, rows, H, style->mlp_out_norm, style->mlp_out_eps);
        return 0;
    }
    if (panel_product(act, w_down, bf16, hidden, rows, I, H, 1)) return -1;
    add_bias_rows(hidden, style->b_down, rows, H);
    return 0;
}
#endif

/* Whether AMX panels (PANELS_AMX) can be multiplied here. */
static int amx_runs(void) {
#ifdef GBV_PANELS_X86
    return amx_supported();
#else
    return 0;
#endif
}

/* Whether float16 panels (PANELS_F16) can be multiplied here: the CPU's F16C, asked once (kind_error asks on
 * every product call). */
static int f16_supported = -1;

static int f16_runs(void) {
#ifdef GBV_PANELS_X86
    if (f16_supported < 0) {
        __builtin_cpu_init();
        f16_supported = __builtin_cpu_supports("f16c") != 0;
    }
    return f16_supported;
#else
    return 0;
#endif
}

#define F16_ERROR "float16 panels need a CPU with F16C"
#define KIND_RANGE_ERROR \
    "the panels' kind must be 0 (float32), 1 (bfloat16), 2 (bfloat16 for the AMX products) or 3 (float16)"

/* NULL where panels of `kind` can be multiplied here, else why not. */
static const char *kind_error(int kind) {
    if (kind < PANELS_F32 || kind > PANELS_F16)
        return KIND_RANGE_ERROR;
    if (kind == PANELS_AMX && !amx_runs())
        return "AMX panels need a CPU with AMX-BF16 (and the kernel's permission to use it)";
    if (kind == PANELS_F16 && !f16_runs())
        return F16_ERROR;
    return NULL;
}

static int cpu_supported(void) {
#ifdef GBV_PANELS_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static PyObject *set_prefetch_temporal(PyObject *self, PyObject *args) {
    int temporal;
    if (!PyArg_ParseTuple(args, "p", &temporal))
        return NULL;
#ifdef GBV_PANELS_X86
    prefetch_temporal = temporal;
#endif
    Py_RETURN_NONE;
}

/* Threads a product may use, the caller's included (1: none beside it; at most 64). */
static PyObject *set_threads(PyObject *self, PyObject *args) {
    int threads;
    if (!PyArg_ParseTuple(args, "i", &threads))
        return NULL;
    if (threads < 1 || threads > 64) {
        PyErr_SetString(PyExc_ValueError, "the products' threads must be 1 to 64");
        return NULL;
    }
#ifdef GBV_PANELS_X86
    atomic_store(&pool_wanted, threads);
#endif
    Py_RETURN_NONE;
}

static PyObject *threads(PyObject *self, PyObject *unused) {
#ifdef GBV_PANELS_X86
    return PyLong_FromLong(atomic_load(&pool_wanted));
#else
    return PyLong_FromLong(1);
#endif
}

static PyObject *split_products(PyObject *self, PyObject *unused) {
#ifdef GBV_PANELS_X86
    return PyLong_FromUnsignedLong(pool_count);
#else
    return PyLong_FromLong(0);
#endif
}

/* (worth, window): pool_judge's share and window (the tests make a verdict certain with 0 or a large share). */
static PyObject *set_pool_verdict(PyObject *self, PyObject *args) {
    double worth;
    int window;
    if (!PyArg_ParseTuple(args, "di", &worth, &window))
        return NULL;
    if (!(worth >= 0.0) || window < 1) {
        PyErr_SetString(PyExc_ValueError, "the verdict's share must be >= 0 and its window >= 1 job");
        return NULL;
    }
#ifdef GBV_PANELS_X86
    pthread_mutex_lock(&pool_caller);
    pool_worth = worth;
    pool_window = window;
    pool_window_jobs = 0;
    pool_window_ns = pool_window_alone_ns = 0.0;
    pool_alone_left = 0;
    pool_backoff = POOL_BACKOFF_MIN;
    pthread_mutex_unlock(&pool_caller);
#endif
    Py_RETURN_NONE;
}

static PyObject *pool_verdicts(PyObject *self, PyObject *unused) {
#ifdef GBV_PANELS_X86
    pthread_mutex_lock(&pool_caller);
    PyObject *result = Py_BuildValue("(kl)", pool_verdicts_against, pool_alone_left);
    pthread_mutex_unlock(&pool_caller);
    return result;
#else
    return Py_BuildValue("(kl)", 0UL, 0L);
#endif
}

static PyObject *set_avx512(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
#ifdef GBV_PANELS_X86
    if (on && !avx512_supported()) {
        PyErr_SetString(PyExc_ValueError, "this CPU has no AVX-512F: the AVX-512 tiles cannot run here");
        return NULL;
    }
    avx512_tiles = on;
#else
    if (on) {
        PyErr_SetString(PyExc_ValueError, "the AVX-512 tiles need an x86-64 CPU");
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *set_two_panel_tiles(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
#ifdef GBV_PANELS_X86
    two_panel_tiles = on;
#endif
    Py_RETURN_NONE;
}

static PyObject *avx512(PyObject *self, PyObject *unused) {
#ifdef GBV_PANELS_X86
    return PyBool_FromLong(use_avx512());
#else
    return PyBool_FromLong(0);
#endif
}

static PyObject *supported(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(cpu_supported());
}

static PyObject *matmul(PyObject *self, PyObject *args) {
    Py_buffer x, panels, y;
    Py_ssize_t M, K, N;
    int accumulate, kind, out_of_memory = 0;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnpi", &x, &panels, &y, &M, &K, &N, &accumulate, &kind))
        return NULL;
    const char *error = NULL;
    if (!cpu_supported())
        error = "panel products need an x86-64 CPU with AVX2 and FMA";
    else if ((error = kind_error(kind)) != NULL)
        ;
    else if (M < 0 || K < 1 || N < 1)
        error = "shapes must be M >= 0, K >= 1, N >= 1";
    else if (x.len != M * K * (Py_ssize_t)sizeof(float))
        error = "x must hold M * K float32 values";
    else if (panels.len != panels_bytes(kind, K, N))
        error = kind == PANELS_AMX ? "panels must hold ceil(N / 32) * ceil(K / 32) * 32 * 32 bfloat16 values"
                : kind == PANELS_BF16 ? "panels must hold ceil(N / 16) * K * 16 bfloat16 values"
                : kind == PANELS_F16  ? "panels must hold ceil(N / 16) * K * 16 float16 values"
                                      : "panels must hold ceil(N / 16) * K * 16 float32 values";
    else if (y.len != M * N * (Py_ssize_t)sizeof(float))
        error = "y must hold M * N float32 values";
    if (error == NULL) {
#ifdef GBV_PANELS_X86
        Py_BEGIN_ALLOW_THREADS
        out_of_memory = panel_product((const float *)x.buf, panels.buf, kind, (float *)y.buf, M, K, N, accumulate);
        Py_END_ALLOW_THREADS
#endif
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&panels);
    PyBuffer_Release(&y);
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    if (out_of_memory) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Whether every one of the n words has a zero lower half: float32 values that are bfloat16 values. */
static int upper_halves_only(const uint32_t *words, Py_ssize_t n) {
    uint32_t low = 0;
    for (Py_ssize_t i = 0; i < n; i++) low |= words[i];
    return (low & 0xFFFFu) == 0;
}

static PyObject *pack(PyObject *self, PyObject *args) {
    Py_buffer w, out;
    Py_ssize_t K, N;
    int kind;
    if (!PyArg_ParseTuple(args, "y*w*nni", &w, &out, &K, &N, &kind))
        return NULL;
    const char *error = NULL;
    if (!cpu_supported())
        error = "packing panels needs an x86-64 CPU with AVX2 and FMA";
    else if (kind < PANELS_F32 || kind > PANELS_F16)
        error = KIND_RANGE_ERROR;
    else if (kind == PANELS_F16 && !f16_runs()) /* (AMX panels are packed anywhere) */
        error = F16_ERROR;
    else if (K < 1 || N < 1)
        error = "shapes must be K >= 1, N >= 1";
    else if (w.len != K * N * (Py_ssize_t)sizeof(float))
        error = "w must hold K * N float32 values";
    else if (out.len != panels_bytes(kind, K, N))
        error = "out must hold the panels' bytes";
    if (error == NULL) {
#ifdef GBV_PANELS_X86
        Py_BEGIN_ALLOW_THREADS
        /* bfloat16 panels hold each value's upper half: refused, before anything is written, where a lower
         * half is not zero (numpy's check, a masked copy of the whole matrix, took 1.8 s of a 360M-parameter
         * bfloat16 pair's first call: scripts/bench_first_call.py --profile; this one pass reads it once) */
        if ((kind == PANELS_BF16 || kind == PANELS_AMX) && !upper_halves_only((const uint32_t *)w.buf, K * N))
            error = "bf16 panels need weights that are bfloat16 values (round them first)";
        else if (kind == PANELS_F16 && !float16_values_only((const float *)w.buf, K * N))
            error = "float16 panels need weights that are float16 values";
        else
            pack_panels((const float *)w.buf, K, N, kind, out.buf);
        Py_END_ALLOW_THREADS
#endif
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *amx(PyObject *self, PyObject *unused) { return PyBool_FromLong(amx_runs()); }

static PyObject *f16(PyObject *self, PyObject *unused) { return PyBool_FromLong(f16_runs()); }

static PyObject *attention(PyObject *self, PyObject *args) {
    Py_buffer q, keys, values, out, mask = {0};
    PyObject *mask_object;
    Py_ssize_t q_stride, n, start, end;
    int heads, kv_heads, D, kv_bf16 = 0;
    double scale, softcap = 0.0;
    if (!PyArg_ParseTuple(args, "y*ny*y*w*Oniiinnd|pd", &q, &q_stride, &keys, &values, &out, &mask_object, &n,
                          &heads, &kv_heads, &D, &start, &end, &scale, &kv_bf16, &softcap))
        return NULL;
    int have_mask = mask_object != Py_None;
    if (have_mask && PyObject_GetBuffer(mask_object, &mask, PyBUF_SIMPLE) != 0) {
        PyBuffer_Release(&q);
        PyBuffer_Release(&keys);
        PyBuffer_Release(&values);
        PyBuffer_Release(&out);
        return NULL;
    }
    const char *error = NULL;
    const Py_ssize_t per_kv = (Py_ssize_t)kv_heads * D * (kv_bf16 ? 2 : 4);
    const Py_ssize_t capacity = per_kv > 0 ? keys.len / per_kv : 0;
    if (!cpu_supported())
        error = "host attention needs an x86-64 CPU with AVX2 and FMA";
    else if (n < 1 || heads < 1 || kv_heads < 1 || D < 8 || D % 8 != 0 || heads % kv_heads != 0)
        error = "need n, heads, kv_heads >= 1, head_dim a multiple of 8 and heads a multiple of kv_heads";
    else if (keys.len != capacity * per_kv || values.len != keys.len)
        error = kv_bf16 ? "keys and values must both be (kv_heads, capacity, head_dim) bfloat16 (uint16)"
                        : "keys and values must both be (kv_heads, capacity, head_dim) float32";
    else if (end < 1 || end > capacity || (!have_mask && start + n > end) || start < 0)
        error = "slots out of range: need start + n <= end <= capacity";
    else if (q_stride < (Py_ssize_t)heads * D || q.len < ((n - 1) * q_stride + (Py_ssize_t)heads * D) * (Py_ssize_t)sizeof(float))
        error = "q must hold n rows of q_stride float32 values, heads * head_dim of them used";
    else if (out.len != n * (Py_ssize_t)heads * D * (Py_ssize_t)sizeof(float))
        error = "out must hold n * heads * head_dim float32 values";
    else if (have_mask && mask.len != n * end)
        error = "mask must hold n * end bytes";
    float *scores = NULL;
    if (error == NULL) {
        scores = (float *)PyMem_RawMalloc(attend_scratch_floats(end, D) * sizeof(float));
        if (scores == NULL) error = "out of memory";
    }
    if (error == NULL) {
#ifdef GBV_PANELS_X86
        Py_BEGIN_ALLOW_THREADS
        attend((const float *)q.buf, q_stride, keys.buf, values.buf, kv_bf16, capacity,
               (float *)out.buf, have_mask ? (const unsigned char *)mask.buf : NULL, n, heads, kv_heads, D,
               start, end, (float)scale, scores, 0, (float)softcap);
        Py_END_ALLOW_THREADS
#endif
    }
    PyMem_RawFree(scores);
    PyBuffer_Release(&q);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    if (have_mask) PyBuffer_Release(&mask);
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* One inverse-CDF draw per row, the rule of gbv.verify.common.draw_rows on given uniforms: row r's
 * token is the first whose cumulative mass (float64, summed in order, as torch's cumsum) exceeds
 * u[r] * (total * below_one), the last token if none does.
 *
 * Why: draw_rows' six tensor calls cost 60-75 us a row at V = 4096 here, against ~10 us for the two
 * passes below; the engine draws once per drafted depth and once per plain target step. */
static void draw(const float *probs, const double *u, long long *out, Py_ssize_t rows, Py_ssize_t V,
                 double below_one) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = probs + r * V;
        double total = 0.0;
        for (Py_ssize_t v = 0; v < V; v++) total += (double)row[v];
        const double point = u[r] * (total * below_one);
        double cumulative = 0.0;
        Py_ssize_t token = V - 1;
        for (Py_ssize_t v = 0; v < V; v++) {
            cumulative += (double)row[v];
            if (cumulative > point) {
                token = v;
                break;
            }
        }
        out[r] = token;
    }
}

/* The end of a call over one to three buffers (`second`, `third` may be NULL): release them, then None, or a
 * ValueError of `error` where it is set. */
static PyObject *released(Py_buffer *first, Py_buffer *second, Py_buffer *third, const char *error) {
    PyBuffer_Release(first);
    if (second != NULL) PyBuffer_Release(second);
    if (third != NULL) PyBuffer_Release(third);
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *draw_rows(PyObject *self, PyObject *args) {
    Py_buffer probs, u, out;
    Py_ssize_t rows, V;
    double below_one;
    if (!PyArg_ParseTuple(args, "y*y*w*nnd", &probs, &u, &out, &rows, &V, &below_one)) return NULL;
    const char *error = NULL;
    if (rows < 0 || V < 1)
        error = "need rows >= 0 and V >= 1";
    else if (probs.len != rows * V * (Py_ssize_t)sizeof(float))
        error = "probs must hold rows * V float32 values";
    else if (u.len != rows * (Py_ssize_t)sizeof(double))
        error = "u must hold rows float64 values";
    else if (out.len != rows * (Py_ssize_t)sizeof(long long))
        error = "out must hold rows int64 values";
    if (error == NULL) {
        Py_BEGIN_ALLOW_THREADS
        draw((const float *)probs.buf, (const double *)u.buf, (long long *)out.buf, rows, V, below_one);
        Py_END_ALLOW_THREADS
    }
    return released(&probs, &u, &out, error);
}

static PyObject *activation(PyObject *self, PyObject *args) {
    Py_buffer x, out;
    Py_ssize_t count;
    int mlp;
    if (!PyArg_ParseTuple(args, "y*w*ni", &x, &out, &count, &mlp)) return NULL;
    const char *error = NULL;
    if (count < 0 || count > INT_MAX)
        error = "need 0 <= count <= INT_MAX";
    else if (mlp < MLP_GELU || mlp > MLP_RELU)
        error = "mlp must be 1 (GELU), 2 (GELU's tanh form) or 3 (ReLU)";
    else if (x.len != count * (Py_ssize_t)sizeof(float) || out.len != x.len)
        error = "x and out must hold count float32 values";
    else if (!cpu_supported())
        error = "the activations need an x86-64 CPU with AVX2 and FMA";
#ifdef GBV_PANELS_X86
    if (error == NULL) {
        Py_BEGIN_ALLOW_THREADS
        activate((const float *)x.buf, (float *)out.buf, (int)count, mlp);
        Py_END_ALLOW_THREADS
    }
#endif
    return released(&x, &out, NULL, error);
}

static PyObject *rms(PyObject *self, PyObject *args) {
    Py_buffer x, out;
    Py_ssize_t rows, H;
    double eps;
    int layer_norm = 0;
    if (!PyArg_ParseTuple(args, "y*w*nnd|p", &x, &out, &rows, &H, &eps, &layer_norm)) return NULL;
    const char *error = NULL;
    if (rows < 0 || H < 1)
        error = "need rows >= 0 and H >= 1";
    else if (x.len != rows * H * (Py_ssize_t)sizeof(float) || out.len != x.len)
        error = "x and out must hold rows * H float32 values";
    if (error == NULL) {
        Py_BEGIN_ALLOW_THREADS
        norm_rows((const float *)x.buf, (float *)out.buf, rows, H, eps, layer_norm);
        Py_END_ALLOW_THREADS
    }
    return released(&x, &out, NULL, error);
}

static PyObject *soft_cap_binding(PyObject *self, PyObject *args) {
    Py_buffer x;
    double cap;
    if (!PyArg_ParseTuple(args, "w*d", &x, &cap)) return NULL;
    const char *error = NULL;
    if (!(cap > 0.0))
        error = "the cap must be above 0";
    else if (x.len % (Py_ssize_t)sizeof(float))
        error = "x must hold float32 values";
    else if (!cpu_supported())
        error = "the soft cap needs an x86-64 CPU with AVX2 and FMA";
#ifdef GBV_PANELS_X86
    if (error == NULL) {
        Py_BEGIN_ALLOW_THREADS
        soft_cap((float *)x.buf, x.len / (Py_ssize_t)sizeof(float), (float)cap);
        Py_END_ALLOW_THREADS
    }
#endif
    return released(&x, NULL, NULL, error);
}

/* The buffer behind `object` (None: no buffer, *given = 0), writable or not; checks its byte size. */
static int get_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t bytes, const char *name,
                      int *given) {
    *given = 0;
    if (object == Py_None) {
        if (bytes >= 0) {
            PyErr_Format(PyExc_ValueError, "%s is required", name);
            return -1;
        }
        return 0;
    }
    if (PyObject_GetBuffer(object, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) return -1;
    *given = 1;
    if (bytes >= 0 && view->len != bytes) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd bytes, got %zd", name, bytes, view->len);
        return -1;
    }
    return 0;
}

static PyObject *layer(PyObject *self, PyObject *args) {
    enum { OBJECTS = 21 };
    PyObject *objects[OBJECTS];
    Py_ssize_t n, start, batch = 1;
    int H, heads, kv_heads, D, I, bf16, kv_bf16 = 0, prefetch_values = 0, out_of_memory = 0, style_bits = 0;
    int qk_all_heads = 0;
    Py_ssize_t attend_first = 0;
    double eps_in, eps_post, scale, qk_eps = 0.0, attn_out_eps = 0.0, mlp_out_eps = 0.0, softcap = 0.0, clip = 0.0;
    for (int b = 15; b < OBJECTS; b++) objects[b] = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOOniiiiindddi|pnpOOOiOdOdOdpdnd", &objects[0], &objects[1], &objects[2],
                          &objects[3], &objects[4], &objects[5], &objects[6], &objects[7], &objects[8], &objects[9],
                          &objects[10], &objects[11], &objects[12], &objects[13], &objects[14], &n, &H, &heads,
                          &kv_heads, &D, &I, &start, &eps_in, &eps_post, &scale, &bf16, &kv_bf16, &batch,
                          &prefetch_values, &objects[15], &objects[16], &objects[17], &style_bits, &objects[18],
                          &qk_eps, &objects[19], &attn_out_eps, &objects[20], &mlp_out_eps, &qk_all_heads, &softcap,
                          &attend_first, &clip))
        return NULL;
    if (style_error(style_bits) != NULL) {
        PyErr_SetString(PyExc_ValueError, style_error(style_bits));
        return NULL;
    }
    const Py_ssize_t up_width = mlp_gated(STYLE_MLP(style_bits)) ? 2 * (Py_ssize_t)I : I;
    if (!cpu_supported()) {
        PyErr_SetString(PyExc_ValueError, "the host layer needs an x86-64 CPU with AVX2 and FMA");
        return NULL;
    }
    if (kind_error(bf16) != NULL) {
        PyErr_SetString(PyExc_ValueError, kind_error(bf16));
        return NULL;
    }
    if (batch < 1 || n < 1 || H < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || D < 8 || D % 8 || I < 1 ||
        start < 0 || attend_first < 0 || attend_first > start || (attend_first > 0 && objects[14] == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "need batch, n, H, I >= 1, head_dim a multiple of 8, heads a multiple of "
                                          "kv_heads, start >= 0 and 0 <= attend_first <= start (past 0 with a mask)");
        return NULL;
    }
    const Py_ssize_t f = (Py_ssize_t)sizeof(float), width = (Py_ssize_t)(heads + 2 * kv_heads) * D;
    const Py_ssize_t end = start + n, rows = batch * n; /* (batch sequences of n queries each) */
#define PANELS(K, N) panels_bytes(bf16, K, N)
    /* hidden normed qkv attn gate_up act w_qkv b_qkv w_o w_gate_up w_down rotation keys values mask b_o b_up b_down
     * qk_norm attn_out_norm mlp_out_norm */
    const Py_ssize_t sizes[OBJECTS] = {rows * H * f, rows * H * f, rows * width * f, rows * heads * D * f,
                                       rows * up_width * f, rows * I * f, PANELS(H, width), width * f,
                                       PANELS((Py_ssize_t)heads * D, H), PANELS(H, up_width), PANELS((Py_ssize_t)I, H),
                                       rows * D * f, -1, -1, rows * (end - attend_first), H * f, up_width * f, H * f,
                                       (qk_all_heads ? (Py_ssize_t)(heads + kv_heads) * D : 2 * D) * f, H * f, H * f};
#undef PANELS
    static const char *names[OBJECTS] = {"hidden", "normed", "qkv", "attn", "gate_up", "act", "w_qkv", "b_qkv",
                                         "w_o", "w_gate_up", "w_down", "rotation", "keys", "values", "mask", "b_o",
                                         "b_up", "b_down", "qk_norm", "attn_out_norm", "mlp_out_norm"};
    static const int writable[OBJECTS] = {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0};
    Py_buffer views[OBJECTS];
    int given[OBJECTS] = {0};
    int failed = 0;
    if (!out_norms_fit(objects[19] != Py_None, objects[20] != Py_None, STYLE_PARALLEL(style_bits))) {
        PyErr_SetString(PyExc_ValueError, "a layer norms both blocks' outputs or neither, and only in sequence");
        return NULL;
    }
    for (int b = 0; b < OBJECTS && !failed; b++) {
        /* the biases, the rotation (none: a model without one), the mask and the q/k norms may be None; the rest
         * must be there */
        const int optional = b == 7 || b == 11 || b >= 14;
        const Py_ssize_t bytes = optional && objects[b] == Py_None ? -1 : sizes[b];
        failed = get_buffer(objects[b], &views[b], writable[b], bytes, names[b], &given[b]) != 0;
    }
    Py_ssize_t capacity = 0;
    if (!failed) {
        const Py_ssize_t kv = kv_bf16 ? 2 : 4; /* bytes of a cached value */
        capacity = views[12].len / (batch * kv_heads * D * kv);
        if (views[12].len != batch * capacity * kv_heads * D * kv || views[13].len != views[12].len) {
            PyErr_SetString(PyExc_ValueError, kv_bf16 ? "keys and values must both be ([batch,] kv_heads, capacity, "
                                                        "head_dim) bfloat16 (uint16)"
                                                      : "keys and values must both be ([batch,] kv_heads, capacity, "
                                                        "head_dim) float32");
            failed = 1;
        } else if (end > capacity) {
            PyErr_SetString(PyExc_ValueError, "slots out of range: need start + n <= capacity");
            failed = 1;
        }
    }
    float *scores = NULL;
    if (!failed) {
        scores = (float *)PyMem_RawMalloc(attend_scratch_floats(end, D) * sizeof(float));
        if (scores == NULL) {
            PyErr_NoMemory();
            failed = 1;
        }
    }
    if (!failed) {
#ifdef GBV_PANELS_X86
        const layer_style style = {STYLE_LAYER_NORM(style_bits), STYLE_MLP(style_bits), STYLE_PARALLEL(style_bits),
                                   given[15] ? (const float *)views[15].buf : NULL,
                                   given[16] ? (const float *)views[16].buf : NULL,
                                   given[17] ? (const float *)views[17].buf : NULL,
                                   given[18] ? (const float *)views[18].buf : NULL, qk_eps,
                                   given[19] ? (const float *)views[19].buf : NULL,
                                   given[20] ? (const float *)views[20].buf : NULL, attn_out_eps, mlp_out_eps,
                                   qk_all_heads, (float)softcap, (float)clip};
        Py_BEGIN_ALLOW_THREADS
        out_of_memory = layer_forward(
            (float *)views[0].buf, (float *)views[1].buf, (float *)views[2].buf, (float *)views[3].buf,
            (float *)views[4].buf, (float *)views[5].buf, views[6].buf, given[7] ? (const float *)views[7].buf : NULL,
            views[8].buf, views[9].buf, views[10].buf, bf16, n, H, heads, kv_heads, D, I, eps_in, eps_post,
            given[11] ? (const float *)views[11].buf : NULL, views[12].buf, views[13].buf, kv_bf16, capacity,
            given[14] ? (const unsigned char *)views[14].buf : NULL, start, (float)scale, scores, batch,
            prefetch_values, &style, attend_first);
        Py_END_ALLOW_THREADS
#endif
    }
    PyMem_RawFree(scores);
    for (int b = 0; b < OBJECTS; b++)
        if (given[b]) PyBuffer_Release(&views[b]);
    if (out_of_memory) PyErr_NoMemory();
    if (failed || out_of_memory) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Softmax and draw in one call, and a whole forward of one sequence in one call.
 *
 * Why: between two forwards that stream tens of MB of weights, Python and torch run from a cold
 * cache. On the bundled pair (bfloat16 target, 1 thread) a plain target step spent ~250 us outside
 * its forward (the ids tensor ~60, softmax ~40, the draw ~130, reading the token ~13) and ~165 us
 * inside it around the layer calls, against ~1.3 ms in the kernels. */

#ifdef GBV_PANELS_X86
/* out[v] = softmax(logits / temperature)[v] over V values (temperature 1: no division, as
 * sampling.process_logits): x = logits / t rounded to float32, e = exp(x - max x), sum in float64,
 * out = e * (1 / sum) in float32 (exp8: the attention's exponential, for x <= 0). */
__attribute__((target("avx2,fma"))) static void softmax_row(const float *logits, Py_ssize_t V, float temperature,
                                                           float *out) {
    const int divide = temperature != 1.0f;
    const __m256 t = _mm256_set1_ps(temperature);
    __m256 most = _mm256_set1_ps(-INFINITY);
    Py_ssize_t v = 0;
    for (; v + 8 <= V; v += 8) {
        __m256 x = _mm256_loadu_ps(logits + v);
        if (divide) x = _mm256_div_ps(x, t);
        _mm256_storeu_ps(out + v, x);
        most = _mm256_max_ps(most, x);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, most);
    float top = -INFINITY;
    for (int k = 0; k < 8; k++) top = lanes[k] > top ? lanes[k] : top;
    for (; v < V; v++) {
        out[v] = divide ? logits[v] / temperature : logits[v];
        top = out[v] > top ? out[v] : top;
    }
    const __m256 shift = _mm256_set1_ps(top);
    __m256d sum_low = _mm256_setzero_pd(), sum_high = _mm256_setzero_pd();
    for (v = 0; v + 8 <= V; v += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(out + v), shift));
        _mm256_storeu_ps(out + v, e);
        sum_low = _mm256_add_pd(sum_low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        sum_high = _mm256_add_pd(sum_high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double parts[4];
    _mm256_storeu_pd(parts, _mm256_add_pd(sum_low, sum_high));
    double total = parts[0] + parts[1] + parts[2] + parts[3];
    for (; v < V; v++) {
        float tail[8] = {out[v] - top, 0, 0, 0, 0, 0, 0, 0}, e[8];
        _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(tail)));
        out[v] = e[0];
        total += (double)e[0];
    }
    const float inverse = (float)(1.0 / total);
    const __m256 factor = _mm256_set1_ps(inverse);
    for (v = 0; v + 8 <= V; v += 8) _mm256_storeu_ps(out + v, _mm256_mul_ps(_mm256_loadu_ps(out + v), factor));
    for (; v < V; v++) out[v] *= inverse;
}

/* One row of sampling: out = process_logits(row) over V values (temperature 0: greedy, a one-hot row at
 * the first largest logit), and, where token is given, its draw by draw_rows' rule with *u (greedy: the
 * argmax; u unused, may be NULL). */
__attribute__((target("avx2,fma"))) static void sample_row(const float *row, Py_ssize_t V, double temperature,
                                                          float *out, const double *u, long long *token,
                                                          double below_one) {
    if (temperature > 0.0) {
        softmax_row(row, V, (float)temperature, out);
        if (token != NULL && u != NULL) draw(out, u, token, 1, V, below_one);
        return;
    }
    Py_ssize_t best = 0;
    for (Py_ssize_t v = 1; v < V; v++) best = row[v] > row[best] ? v : best;
    memset(out, 0, (size_t)V * sizeof(float));
    out[best] = 1.0f;
    if (token != NULL) *token = best;
}
#endif

/* A (rows, V) float32 buffer whose values are contiguous along V (rows may be strided, as the
 * logits of the first V of a wider vocabulary are): its row stride in floats, or -1 with an error. */
static Py_ssize_t row_stride(PyObject *object, Py_buffer *view, int writable, Py_ssize_t rows, Py_ssize_t V,
                             const char *name) {
    if (PyObject_GetBuffer(object, view, PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0)
        return -1;
    Py_ssize_t stride = -1;
    const int is_float = view->format != NULL && strcmp(view->format, "f") == 0 && view->itemsize == 4;
    if (is_float && view->ndim == 2 && view->shape[0] == rows && view->shape[1] == V && view->strides[1] == 4 &&
        view->strides[0] % 4 == 0 && view->strides[0] >= 4 * V)
        stride = view->strides[0] / 4;
    else if (is_float && view->ndim == 1 && rows == 1 && view->shape[0] == V && view->strides[0] == 4)
        stride = V;
    if (stride < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be (%zd, %zd) float32, contiguous along its last axis", name,
                     rows, V);
        PyBuffer_Release(view);
    }
    return stride;
}

static PyObject *softmax_draw(PyObject *self, PyObject *args) {
    PyObject *logits_object, *probs_object, *u_object, *tokens_object;
    Py_ssize_t rows, V;
    double temperature, below_one;
    if (!PyArg_ParseTuple(args, "OOOOnndd", &logits_object, &probs_object, &u_object, &tokens_object, &rows, &V,
                          &temperature, &below_one))
        return NULL;
    if (!cpu_supported()) {
        PyErr_SetString(PyExc_ValueError, "softmax_draw needs an x86-64 CPU with AVX2 and FMA");
        return NULL;
    }
    if (rows < 1 || V < 1 || !(temperature > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "need rows, V >= 1 and temperature > 0");
        return NULL;
    }
    Py_buffer logits, probs, u, tokens;
    int have_probs = 0, have_u = 0, have_tokens = 0, failed = 0;
    const Py_ssize_t logits_stride = row_stride(logits_object, &logits, 0, rows, V, "logits");
    if (logits_stride < 0) return NULL;
    Py_ssize_t probs_stride = V;
    if (probs_object != Py_None) {
        probs_stride = row_stride(probs_object, &probs, 1, rows, V, "probs");
        failed = probs_stride < 0;
        have_probs = !failed;
    }
    double single_u = 0.0;
    long long single_token = -1;
    const int u_is_float = u_object != Py_None && PyFloat_Check(u_object) && rows == 1 && tokens_object == Py_None;
    if (u_is_float) single_u = PyFloat_AS_DOUBLE(u_object);
    if (!failed && !u_is_float && (u_object == Py_None) != (tokens_object == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "give u and tokens together (to draw), or neither");
        failed = 1;
    }
    if (!failed && !u_is_float && u_object != Py_None) {
        failed = get_buffer(u_object, &u, 0, rows * (Py_ssize_t)sizeof(double), "u", &have_u) != 0;
        if (!failed)
            failed = get_buffer(tokens_object, &tokens, 1, rows * (Py_ssize_t)sizeof(long long), "tokens",
                                &have_tokens) != 0;
    }
    float *scratch = NULL;
    if (!failed && !have_probs) {
        scratch = (float *)PyMem_RawMalloc((size_t)(rows * V) * sizeof(float));
        if (scratch == NULL) {
            PyErr_NoMemory();
            failed = 1;
        }
    }
    if (!failed) {
#ifdef GBV_PANELS_X86
        float *out = have_probs ? (float *)probs.buf : scratch;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < rows; r++) {
            sample_row((const float *)logits.buf + r * logits_stride, V, temperature, out + r * probs_stride,
                       have_u ? (const double *)u.buf + r : (u_is_float ? &single_u : NULL),
                       have_u ? (long long *)tokens.buf + r : (u_is_float ? &single_token : NULL), below_one);
        }
        Py_END_ALLOW_THREADS
#endif
    }
    PyMem_RawFree(scratch);
    PyBuffer_Release(&logits);
    if (have_probs) PyBuffer_Release(&probs);
    if (have_u) PyBuffer_Release(&u);
    if (have_tokens) PyBuffer_Release(&tokens);
    if (failed) return NULL;
    if (single_token >= 0) return PyLong_FromLongLong(single_token);
    Py_RETURN_NONE;
}

#define NO_BAD_TOKEN (-0x7fffffffffffffffLL)
/* Query i's row of the one-call forward: its token's embedding row (float32, or bfloat16 bits / float16 widened,
 * embed_kind 1 / 2) times embed_scale, plus its learned position row where given, into hidden_row (H floats), and
 * its rotation row of each of the num_tables tables (table t's row at rotation + (t n + i) D). The caller has
 * checked the token and the position against the tables. */
static void query_row(const Py_buffer *embed, int embed_kind, int H, long long token, double embed_scale,
                      const float *position_row, const Py_buffer *tables, Py_ssize_t num_tables, long long position,
                      Py_ssize_t n, Py_ssize_t i, int D, float *hidden_row, float *rotation) {
    if (embed_kind == 1) {
        const uint16_t *embed_row = (const uint16_t *)embed->buf + token * H;
        for (int h = 0; h < H; h++) hidden_row[h] = bf16_value(embed_row[h]);
    } else if (embed_kind == 2) {
        widen_f16((const uint16_t *)embed->buf + token * H, H, hidden_row);
    } else {
        memcpy(hidden_row, (const float *)embed->buf + token * H, (size_t)H * sizeof(float));
    }
    if (embed_scale != 1.0) /* (Gemma, Granite: the rows times the scale in float32, as the torch forward) */
        for (int h = 0; h < H; h++) hidden_row[h] *= (float)embed_scale;
    if (position_row != NULL)
        for (int h = 0; h < H; h++) hidden_row[h] += position_row[h];
    for (Py_ssize_t t = 0; t < num_tables; t++)
        memcpy(rotation + (t * n + i) * D, (const float *)tables[t].buf + position * D, (size_t)D * sizeof(float));
}

/* The whole host forward of one sequence (host_kernels.forward_into says what each argument is):
 * the embedding rows, every layer as layer_forward, the final norm and the head, in one call. */
static PyObject *forward(PyObject *self, PyObject *args) {
    PyObject *objects[13]; /* tokens positions embed rotary hidden normed qkv attn gate_up act head logits mask */
    PyObject *layers, *keys_list, *values_list, *u_object, *probs_object, *drawn_object;
    PyObject *position_object = Py_None, *head_bias_object = Py_None, *window_mask_object = Py_None;
    PyObject *stop_object = Py_None; /* (steps > 1: the tokens after whose draw the steps stop; None: none) */
    double logits_softcap = 0.0, embed_scale = 1.0;
    Py_ssize_t window_first = 0; /* (the windowed layers' first slot: their mask's columns start there) */
    Py_ssize_t first_row, capacity, start, n, vocab, draw_vocab, position_offset = 0;
    Py_ssize_t steps = 1; /* (sampled steps, each feeding the token the one before drew: see the check below) */
    int H, heads, kv_heads, D, I, bf16, last_only, kv_bf16 = 0, out_of_memory = 0, final_layer_norm = 0;
    int embed_kind = 0; /* (the embedding's rows: 0 float32, 1 bfloat16 bits, 2 float16; widened as read) */
    double final_eps, temperature, below_one;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnOnOOOOOOOOniiiiindipndOOOd|pOnpOOddninO", &objects[0], &objects[1], &objects[2],
                          &objects[3], &layers, &keys_list, &values_list, &first_row, &capacity, &objects[12],
                          &start, &objects[4], &objects[5], &objects[6], &objects[7], &objects[8], &objects[9],
                          &objects[10], &objects[11], &n, &H, &heads, &kv_heads, &D, &I, &vocab, &final_eps, &bf16,
                          &last_only, &draw_vocab, &temperature, &u_object, &probs_object, &drawn_object,
                          &below_one, &kv_bf16, &position_object, &position_offset, &final_layer_norm,
                          &head_bias_object, &window_mask_object, &logits_softcap, &embed_scale, &window_first,
                          &embed_kind, &steps, &stop_object))
        return NULL;
    if (!cpu_supported()) {
        PyErr_SetString(PyExc_ValueError, "the host forward needs an x86-64 CPU with AVX2 and FMA");
        return NULL;
    }
    if (kind_error(bf16) != NULL) {
        PyErr_SetString(PyExc_ValueError, kind_error(bf16));
        return NULL;
    }
    if (embed_kind < 0 || embed_kind > 2 || (embed_kind == 2 && !f16_runs())) {
        PyErr_SetString(PyExc_ValueError, embed_kind == 2 ? "a float16 embedding needs a CPU with F16C"
                                                          : "embed_kind must be 0 (float32), 1 (bfloat16) or 2 (float16)");
        return NULL;
    }
    if (!PyTuple_Check(layers) || !PyTuple_Check(keys_list) || !PyTuple_Check(values_list) ||
        PyTuple_GET_SIZE(keys_list) != PyTuple_GET_SIZE(layers) ||
        PyTuple_GET_SIZE(values_list) != PyTuple_GET_SIZE(layers)) {
        PyErr_SetString(PyExc_ValueError, "layers, keys and values must be tuples of one entry per layer");
        return NULL;
    }
    if (n < 1 || H < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || D < 8 || D % 8 || I < 1 || start < 0 ||
        first_row < 0 || vocab < 1 || start + n > capacity || draw_vocab < 0 || draw_vocab > vocab ||
        temperature < 0.0) {
        PyErr_SetString(PyExc_ValueError, "need n, H, I, vocab >= 1, head_dim a multiple of 8, heads a multiple "
                                          "of kv_heads, start >= 0, start + n <= capacity, 0 <= draw_vocab <= vocab "
                                          "and temperature >= 0");
        return NULL;
    }
    /* steps > 1: after the call's own queries, steps - 1 more forwards of one query each, query s the token
     * that step s - 1 drew, at the next position and slot, as many calls of one query would run them (the
     * same sums), their laws into probs row s and their tokens into tokens[s], drawn with u[s]. Why: a
     * drafted path's steps were one call each, and the draft's own arithmetic is a few tens of microseconds
     * a step: each call's Python and its arguments' checks were a fifth of a bundled-draft step. For the
     * causal chain of one sequence with one output row, no window mask, and every step's draw.
     * stop (an int64 buffer, or None): the steps end after one draws a token in it (an EOS of plain
     * decoding's runs: a generation ends there, so the steps after it would be thrown away, at a whole
     * target step each); the call then returns how many steps ran. */
    if (steps < 1 || (steps > 1 && (objects[12] != Py_None || window_mask_object != Py_None || draw_vocab < 1 ||
                                    (!last_only && n != 1) || start + n + steps - 1 > capacity ||
                                    drawn_object == Py_None || (temperature > 0.0 && u_object == Py_None))) ||
        (stop_object != Py_None && steps < 2)) {
        PyErr_SetString(PyExc_ValueError, "steps > 1 needs the causal chain (no mask, no window mask), one output "
                                          "row, a draw with tokens (and u unless greedy) for every step, and "
                                          "start + n + steps - 1 <= capacity; stop tokens need steps > 1");
        return NULL;
    }
    const Py_ssize_t num_layers = PyTuple_GET_SIZE(layers), f = (Py_ssize_t)sizeof(float);
    /* a layer's entry: w_qkv b_qkv w_o w_gate_up w_down eps_in eps_post scale, then for layers other than the
     * Llama family's b_o b_up b_down style (STYLED), for Qwen3's qk_norm qk_eps (QK), and for Gemma 2 / 3's,
     * OLMo 2 / 3's, SmolLM3's and the windowed ones attn_out_norm attn_out_eps mlp_out_norm mlp_out_eps flags
     * rotary softcap (EXTRA: flags LAYER_QK_ALL_HEADS | LAYER_WINDOWED; rotary the index of its table in
     * `rotary`, a tuple of them there, or -1 for none; softcap Gemma 2's cap of the scores, 0 for none) */
    enum { LLAMA_ENTRY = 8, STYLED_ENTRY = 12, QK_ENTRY = 14, EXTRA_ENTRY = 21, CLIP_ENTRY = 22 };
    enum { LAYER_QK_ALL_HEADS = 1, LAYER_WINDOWED = 2, MAX_TABLES = 8 };
    for (Py_ssize_t l = 0; l < num_layers; l++) {
        PyObject *entry = PyTuple_GET_ITEM(layers, l);
        const Py_ssize_t size = PyTuple_Check(entry) ? PyTuple_GET_SIZE(entry) : 0;
        if ((size != LLAMA_ENTRY && size != STYLED_ENTRY && size != QK_ENTRY && size != EXTRA_ENTRY &&
             size != CLIP_ENTRY) ||
            (size >= STYLED_ENTRY && !PyLong_Check(PyTuple_GET_ITEM(entry, 11))) ||
            (size >= EXTRA_ENTRY && (!PyLong_Check(PyTuple_GET_ITEM(entry, 18)) ||
                                     !PyLong_Check(PyTuple_GET_ITEM(entry, 19))))) {
            PyErr_SetString(PyExc_ValueError, "each layer must be (w_qkv, b_qkv, w_o, w_gate_up, w_down, eps_in, "
                                              "eps_post, scale[, b_o, b_up, b_down, style[, qk_norm, qk_eps[, "
                                              "attn_out_norm, attn_out_eps, mlp_out_norm, mlp_out_eps, flags, "
                                              "rotary, softcap[, clip]]]])");
            return NULL;
        }
        if (size >= STYLED_ENTRY) {
            const long bits = PyLong_AsLong(PyTuple_GET_ITEM(entry, 11));
            if (style_error(bits < 0 || bits > 63 ? -1 : (int)bits) != NULL) {
                PyErr_SetString(PyExc_ValueError, style_error(-1));
                return NULL;
            }
        }
    }
#define ENTRY_STYLE(entry) (PyTuple_GET_SIZE(entry) >= STYLED_ENTRY ? PyLong_AsLong(PyTuple_GET_ITEM(entry, 11)) : 0)
#define ENTRY_BIAS(entry, index) (PyTuple_GET_SIZE(entry) > (index) ? PyTuple_GET_ITEM(entry, index) : Py_None)
    /* every layer's MLP gated or none (the gate_up buffer's width) */
    const long first_style = num_layers ? ENTRY_STYLE(PyTuple_GET_ITEM(layers, 0)) : 0;
    const int gated = mlp_gated(STYLE_MLP(first_style));
    const Py_ssize_t up_width = gated ? 2 * (Py_ssize_t)I : I;
    const Py_ssize_t width = (Py_ssize_t)(heads + 2 * kv_heads) * D, end = start + n, rows_out = last_only ? 1 : n;
    const Py_ssize_t sequence = (Py_ssize_t)kv_heads * capacity * D; /* values of one cache row */
    const Py_ssize_t kv = kv_bf16 ? 2 : 4;                          /* bytes of a cached value */
#define PANELS(K, N) panels_bytes(bf16, K, N)
    /* the rotation tables: `rotary` one (P, D/2) complex64 table, or a tuple of them (a layer's entry names
     * its own, EXTRA_ENTRY), or None */
    const int table_tuple = PyTuple_Check(objects[3]);
    const Py_ssize_t num_tables = table_tuple ? PyTuple_GET_SIZE(objects[3]) : objects[3] != Py_None;
    if (num_tables > MAX_TABLES) {
        PyErr_SetString(PyExc_ValueError, "at most 8 rotation tables");
        return NULL;
    }
    const Py_ssize_t sizes[13] = {n * 8, n * 8, -1, -1, n * H * f, n * H * f, n * width * f,
                                  n * (Py_ssize_t)heads * D * f, n * up_width * f, n * I * f, PANELS(H, vocab),
                                  rows_out * vocab * f, n * end};
    static const char *names[13] = {"tokens", "positions", "embed", "rotary", "hidden", "normed", "qkv", "attn",
                                    "gate_up", "act", "head", "logits", "mask"};
    static const int writable[13] = {0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 0};
    Py_buffer fixed[13];
    int fixed_given[13] = {0};
    /* per layer: w_qkv b_qkv w_o w_gate_up w_down keys values b_o b_up b_down qk_norm attn_out_norm mlp_out_norm,
     * then eps_in eps_post scale qk_eps attn_out_eps mlp_out_eps softcap clip */
    enum { PER_LAYER = 13, CONSTANTS = 8 };
    Py_buffer *views = (Py_buffer *)PyMem_Calloc((size_t)(num_layers * PER_LAYER) + 1, sizeof(Py_buffer));
    int *given = (int *)PyMem_Calloc((size_t)(num_layers * PER_LAYER) + 1, sizeof(int));
    double *constants = (double *)PyMem_Calloc((size_t)(CONSTANTS * num_layers) + 1, sizeof(double));
    layer_style *styles = (layer_style *)PyMem_Calloc((size_t)num_layers + 1, sizeof(layer_style));
    float *rotation = (float *)PyMem_RawMalloc((size_t)((num_tables ? num_tables : 1) * n * D) * sizeof(float));
    int *layer_tables = (int *)PyMem_Calloc((size_t)num_layers + 1, sizeof(int)); /* per layer: -1 none */
    int *windowed = (int *)PyMem_Calloc((size_t)num_layers + 1, sizeof(int));
    float *scores = (float *)PyMem_RawMalloc(attend_scratch_floats(end + steps - 1, D) * sizeof(float));
    int failed = 0;
    if (views == NULL || given == NULL || constants == NULL || styles == NULL || rotation == NULL || scores == NULL ||
        layer_tables == NULL || windowed == NULL) {
        PyErr_NoMemory();
        failed = 1;
    }
    for (int b = 0; b < 13 && !failed; b++) {
        if ((b == 3 || b == 12) && objects[b] == Py_None) continue; /* no rotation; no mask: the causal chain */
        if (b == 3 && table_tuple) continue;                          /* (the tables: below) */
        failed = get_buffer(objects[b], &fixed[b], writable[b], sizes[b], names[b], &fixed_given[b]) != 0;
    }
    Py_buffer tables[MAX_TABLES], window_mask;
    int tables_given[MAX_TABLES] = {0}, have_window_mask = 0;
    Py_ssize_t table_rows[MAX_TABLES] = {0};
    for (Py_ssize_t t = 0; t < num_tables && !failed; t++) {
        if (table_tuple)
            failed = get_buffer(PyTuple_GET_ITEM(objects[3], t), &tables[t], 0, -1, "rotary", &tables_given[t]) != 0;
        else
            tables[t] = fixed[3];
        const Py_ssize_t length = (table_tuple ? tables_given[t] : fixed_given[3]) ? tables[t].len : -1;
        table_rows[t] = length / (D * f);
        if (!failed && (length <= 0 || length != table_rows[t] * D * f)) {
            PyErr_SetString(PyExc_ValueError, "rotary tables must be (P, head_dim / 2) complex64");
            failed = 1;
        }
    }
    if (!failed && (window_first < 0 || window_first > start || (window_first > 0 && window_mask_object == Py_None))) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= window_first <= start, and a window mask past 0");
        failed = 1;
    }
    if (!failed)
        failed = get_buffer(window_mask_object, &window_mask, 0,
                            window_mask_object == Py_None ? -1 : n * (end - window_first), "window mask",
                            &have_window_mask) != 0;
    /* the learned position rows (GPT-2, OPT: row position + position_offset added to the token's) and the
     * head's bias, where given */
    Py_buffer position_rows, head_bias;
    int have_positions = 0, have_head_bias = 0;
    if (!failed)
        failed = get_buffer(position_object, &position_rows, 0, -1, "position rows", &have_positions) != 0;
    if (!failed)
        failed = get_buffer(head_bias_object, &head_bias, 0, head_bias_object == Py_None ? -1 : vocab * f, "head bias",
                            &have_head_bias) != 0;
    Py_ssize_t vocab_rows = 0, position_count = 0;
    if (!failed) {
        const Py_ssize_t embed_size = embed_kind ? 2 : f;
        vocab_rows = fixed[2].len / (H * embed_size);
        position_count = have_positions ? position_rows.len / (H * f) : 0;
        if (fixed[2].len != vocab_rows * H * embed_size ||
            (have_positions && position_rows.len != position_count * H * f)) {
            PyErr_SetString(PyExc_ValueError, "embed and position rows must be (V, H) (float32, or bfloat16 bits "
                                              "with embed_kind 1, or float16 with 2) and (P, H) float32, rotary "
                                              "(P, head_dim / 2) complex64");
            failed = 1;
        }
    }
    if (!failed) { /* the embedding rows (with their positions' rows) and each query's rotation row */
        const long long *tokens = (const long long *)fixed[0].buf, *positions = (const long long *)fixed[1].buf;
        for (Py_ssize_t i = 0; i < n + steps - 1 && !failed; i++) { /* (past n: the later steps' positions) */
            const long long token = i < n ? tokens[i] : 0; /* (a later step's token: checked as it is drawn) */
            const long long position = i < n ? positions[i] : positions[n - 1] + (i - n + 1);
            const long long row = position + position_offset;
            int beyond = 0;
            for (Py_ssize_t t = 0; t < num_tables; t++) beyond = beyond || position >= table_rows[t];
            if (token < 0 || token >= vocab_rows || position < 0 || beyond || (have_positions && row >= position_count)) {
                PyErr_Format(PyExc_ValueError, "token %lld or position %lld out of range", token, position);
                failed = 1;
                break;
            }
            if (i < n)
                query_row(&fixed[2], embed_kind, H, token, embed_scale,
                          have_positions ? (const float *)position_rows.buf + row * H : NULL, tables, num_tables,
                          position, n, i, D, (float *)fixed[4].buf + i * H, rotation);
        }
    }
    for (Py_ssize_t l = 0; l < num_layers && !failed; l++) {
        PyObject *entry = PyTuple_GET_ITEM(layers, l);
        const long bits = ENTRY_STYLE(entry);
        if (mlp_gated(STYLE_MLP(bits)) != gated) { /* (each style checked above) */
            PyErr_SetString(PyExc_ValueError, "every layer's MLP must be gated, or none");
            failed = 1;
            break;
        }
        const int extra = PyTuple_GET_SIZE(entry) >= EXTRA_ENTRY;
        const long flags = extra ? PyLong_AsLong(PyTuple_GET_ITEM(entry, 18)) : 0;
        const long table = extra ? PyLong_AsLong(PyTuple_GET_ITEM(entry, 19)) : num_tables ? 0 : -1;
        if (flags < 0 || flags > (LAYER_QK_ALL_HEADS | LAYER_WINDOWED) || table < -1 || table >= num_tables ||
            !out_norms_fit(ENTRY_BIAS(entry, 14) != Py_None, ENTRY_BIAS(entry, 16) != Py_None, STYLE_PARALLEL(bits))) {
            PyErr_SetString(PyExc_ValueError, "a layer's flags must be LAYER_QK_ALL_HEADS | LAYER_WINDOWED, its "
                                              "rotary -1 or a table's index, and it norms both blocks' outputs or "
                                              "neither, in sequence only");
            failed = 1;
            break;
        }
        layer_tables[l] = (int)table;
        windowed[l] = (flags & LAYER_WINDOWED) != 0;
        const Py_ssize_t qk_values = flags & LAYER_QK_ALL_HEADS ? (Py_ssize_t)(heads + kv_heads) * D : 2 * D;
        PyObject *parts[PER_LAYER] = {PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1),
                                      PyTuple_GET_ITEM(entry, 2), PyTuple_GET_ITEM(entry, 3),
                                      PyTuple_GET_ITEM(entry, 4), PyTuple_GET_ITEM(keys_list, l),
                                      PyTuple_GET_ITEM(values_list, l), ENTRY_BIAS(entry, 8),
                                      ENTRY_BIAS(entry, 9), ENTRY_BIAS(entry, 10), ENTRY_BIAS(entry, 12),
                                      ENTRY_BIAS(entry, 14), ENTRY_BIAS(entry, 16)};
#define OPTIONAL(index, bytes) (ENTRY_BIAS(entry, index) == Py_None ? -1 : (bytes))
        const Py_ssize_t part_sizes[PER_LAYER] = {PANELS(H, width), OPTIONAL(1, width * f),
                                                  PANELS((Py_ssize_t)heads * D, H), PANELS(H, up_width),
                                                  PANELS((Py_ssize_t)I, H), -1, -1, OPTIONAL(8, H * f),
                                                  OPTIONAL(9, up_width * f), OPTIONAL(10, H * f),
                                                  OPTIONAL(12, qk_values * f), OPTIONAL(14, H * f),
                                                  OPTIONAL(16, H * f)};
#undef OPTIONAL
        static const char *part_names[PER_LAYER] = {"w_qkv", "b_qkv", "w_o", "w_gate_up", "w_down", "keys", "values",
                                                    "b_o", "b_up", "b_down", "qk_norm", "attn_out_norm",
                                                    "mlp_out_norm"};
        for (int b = 0; b < PER_LAYER && !failed; b++)
            failed = get_buffer(parts[b], &views[l * PER_LAYER + b], b == 5 || b == 6, part_sizes[b], part_names[b],
                                &given[l * PER_LAYER + b]) != 0;
        if (failed) break;
        const Py_buffer *v = views + l * PER_LAYER;
        const int *g = given + l * PER_LAYER;
        styles[l] = (layer_style){STYLE_LAYER_NORM(bits), STYLE_MLP(bits), STYLE_PARALLEL(bits),
                                  g[7] ? (const float *)v[7].buf : NULL, g[8] ? (const float *)v[8].buf : NULL,
                                  g[9] ? (const float *)v[9].buf : NULL, g[10] ? (const float *)v[10].buf : NULL,
                                  0.0, g[11] ? (const float *)v[11].buf : NULL, g[12] ? (const float *)v[12].buf : NULL,
                                  0.0, 0.0, (flags & LAYER_QK_ALL_HEADS) != 0};
#undef ENTRY_STYLE
        if (views[l * PER_LAYER + 5].len < (first_row + 1) * sequence * kv ||
            views[l * PER_LAYER + 6].len != views[l * PER_LAYER + 5].len) {
            PyErr_SetString(PyExc_ValueError, kv_bf16 ? "keys and values must be (rows, kv_heads, capacity, head_dim) "
                                                        "bfloat16 (uint16) with first_row < rows"
                                                      : "keys and values must be (rows, kv_heads, capacity, head_dim) "
                                                        "float32 with first_row < rows");
            failed = 1;
            break;
        }
        /* (eps_in eps_post scale at 5-7; qk_eps at 13, attn_out_eps at 15, mlp_out_eps at 17, softcap at 20, clip
         * at 21, or 0) */
        static const int constant_at[CONSTANTS] = {5, 6, 7, 13, 15, 17, 20, 21};
        for (int c = 0; c < CONSTANTS && !failed; c++) {
            PyObject *value = c < 3 ? PyTuple_GET_ITEM(entry, constant_at[c]) : ENTRY_BIAS(entry, constant_at[c]);
            constants[CONSTANTS * l + c] = value == Py_None ? 0.0 : PyFloat_AsDouble(value);
            failed = constants[CONSTANTS * l + c] == -1.0 && PyErr_Occurred() != NULL;
        }
        styles[l].qk_eps = constants[CONSTANTS * l + 3];
        styles[l].attn_out_eps = constants[CONSTANTS * l + 4];
        styles[l].mlp_out_eps = constants[CONSTANTS * l + 5];
        styles[l].softcap = (float)constants[CONSTANTS * l + 6];
        styles[l].clip = (float)constants[CONSTANTS * l + 7];
#undef ENTRY_BIAS
    }
    /* the draw: uniforms, probabilities (or a scratch row) and tokens of the output rows; one output
     * row may take its uniform as a float and give its token back as the result */
    Py_buffer u, probs, drawn;
    int have_u = 0, have_probs = 0, have_drawn = 0, u_is_float = 0;
    double single_u = 0.0;
    long long single_token = -1;
    long long bad_token = NO_BAD_TOKEN; /* (a later step's query: a drawn token past the embedding's rows) */
    Py_ssize_t probs_stride = draw_vocab;
    float *scratch = NULL; /* (no probs: one step's rows, which every step reuses) */
    const Py_ssize_t draw_rows = rows_out * steps; /* (the output rows of every step) */
    Py_buffer stop;
    int have_stop = 0;
    Py_ssize_t num_stop = 0, ran = 0; /* (the stop tokens; the steps that ran) */
    if (!failed && stop_object != Py_None) {
        failed = get_buffer(stop_object, &stop, 0, -1, "stop", &have_stop) != 0;
        if (!failed && (stop.len % (Py_ssize_t)sizeof(long long)) != 0) {
            PyErr_SetString(PyExc_ValueError, "stop must be an int64 array");
            failed = 1;
        }
        num_stop = failed ? 0 : stop.len / (Py_ssize_t)sizeof(long long);
    }
    if (!failed && draw_vocab > 0) {
        if (probs_object != Py_None) {
            probs_stride = row_stride(probs_object, &probs, 1, draw_rows, draw_vocab, "probs");
            failed = probs_stride < 0;
            have_probs = !failed;
        } else if ((scratch = (float *)PyMem_RawMalloc((size_t)(rows_out * draw_vocab) * sizeof(float))) == NULL) {
            PyErr_NoMemory();
            failed = 1;
        }
        if (!failed && drawn_object != Py_None)
            failed = get_buffer(drawn_object, &drawn, 1, draw_rows * (Py_ssize_t)sizeof(long long), "tokens",
                                &have_drawn) != 0;
        if (!failed && temperature > 0.0 && u_object != Py_None) {
            if (PyFloat_Check(u_object) && draw_rows == 1) {
                single_u = PyFloat_AS_DOUBLE(u_object);
                u_is_float = 1;
            } else {
                failed = get_buffer(u_object, &u, 0, draw_rows * (Py_ssize_t)sizeof(double), "u", &have_u) != 0;
            }
        }
    }
    if (!failed) {
#ifdef GBV_PANELS_X86
        float *hidden = (float *)fixed[4].buf, *normed = (float *)fixed[5].buf;
        const long long *positions = (const long long *)fixed[1].buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t s = 0; s < steps && !out_of_memory; s++) {
            Py_ssize_t queries = n, first = start; /* this step's queries and its first slot */
            if (s > 0) { /* one query: the token the step before drew (checked against the embedding's rows) */
                const long long token = ((const long long *)drawn.buf)[s - 1], position = positions[n - 1] + s;
                if (token < 0 || token >= vocab_rows) {
                    bad_token = token;
                    break;
                }
                queries = 1;
                first = start + n + s - 1;
                query_row(&fixed[2], embed_kind, H, token, embed_scale,
                          have_positions ? (const float *)position_rows.buf + (position + position_offset) * H : NULL,
                          tables, num_tables, position, n, 0, D, hidden, rotation);
            }
            for (Py_ssize_t l = 0; l < num_layers && !out_of_memory; l++) {
                const Py_buffer *v = views + l * PER_LAYER;
                out_of_memory = layer_forward(
                    hidden, normed, (float *)fixed[6].buf, (float *)fixed[7].buf, (float *)fixed[8].buf,
                    (float *)fixed[9].buf, v[0].buf, given[l * PER_LAYER + 1] ? (const float *)v[1].buf : NULL,
                    v[2].buf, v[3].buf, v[4].buf, bf16, queries, H, heads, kv_heads, D, I, constants[CONSTANTS * l],
                    constants[CONSTANTS * l + 1],
                    layer_tables[l] < 0 ? NULL : rotation + layer_tables[l] * n * D,
                    (char *)v[5].buf + first_row * sequence * kv, (char *)v[6].buf + first_row * sequence * kv,
                    kv_bf16, capacity,
                    windowed[l] && have_window_mask ? (const unsigned char *)window_mask.buf
                    : fixed_given[12]               ? (const unsigned char *)fixed[12].buf
                                                    : NULL,
                    first,
                    (float)constants[CONSTANTS * l + 2],
                    scores, 1, 0, styles + l, windowed[l] && have_window_mask ? window_first : 0);
            }
            const float *last = hidden + (queries - rows_out) * H;
            norm_rows(last, normed, rows_out, H, final_eps, final_layer_norm);
            out_of_memory = out_of_memory || panel_product(normed, fixed[10].buf, bf16, (float *)fixed[11].buf,
                                                           rows_out, H, vocab, 0);
            if (!out_of_memory && have_head_bias)
                add_bias_rows((float *)fixed[11].buf, (const float *)head_bias.buf, rows_out, vocab);
            if (!out_of_memory && logits_softcap > 0.0) /* (Gemma 2) */
                soft_cap((float *)fixed[11].buf, rows_out * vocab, (float)logits_softcap);
            for (Py_ssize_t r = 0; r < rows_out && draw_vocab > 0 && !out_of_memory; r++) {
                const Py_ssize_t at = s * rows_out + r; /* (the output row among every step's) */
                const float *row = (const float *)fixed[11].buf + r * vocab;
                float *out = have_probs ? (float *)probs.buf + at * probs_stride : scratch + r * draw_vocab;
                long long *token = have_drawn ? (long long *)drawn.buf + at : (draw_rows == 1 ? &single_token : NULL);
                const double *uniform = have_u ? (const double *)u.buf + at : (u_is_float ? &single_u : NULL);
                /* (a token with no uniform is drawn only when greedy, which needs none) */
                sample_row(row, draw_vocab, temperature, out, uniform,
                           uniform != NULL || temperature == 0.0 ? token : NULL, below_one);
            }
            ran = s + 1;
            if (num_stop > 0 && !out_of_memory) { /* (one output row: steps > 1) */
                const long long token = ((const long long *)drawn.buf)[s];
                int stopped = 0;
                for (Py_ssize_t j = 0; j < num_stop && !stopped; j++)
                    stopped = ((const long long *)stop.buf)[j] == token;
                if (stopped) break;
            }
        }
        Py_END_ALLOW_THREADS
#endif
    }
#undef PANELS
    PyMem_RawFree(scratch);
    for (Py_ssize_t t = 0; t < num_tables; t++)
        if (tables_given[t]) PyBuffer_Release(&tables[t]);
    if (have_window_mask) PyBuffer_Release(&window_mask);
    if (have_positions) PyBuffer_Release(&position_rows);
    if (have_head_bias) PyBuffer_Release(&head_bias);
    if (have_u) PyBuffer_Release(&u);
    if (have_probs) PyBuffer_Release(&probs);
    if (have_drawn) PyBuffer_Release(&drawn);
    if (have_stop) PyBuffer_Release(&stop);
    for (int b = 0; b < 13; b++)
        if (fixed_given[b]) PyBuffer_Release(&fixed[b]);
    if (views != NULL && given != NULL)
        for (Py_ssize_t b = 0; b < num_layers * PER_LAYER; b++)
            if (given[b]) PyBuffer_Release(&views[b]);
    PyMem_Free(views);
    PyMem_Free(given);
    PyMem_Free(constants);
    PyMem_Free(styles);
    PyMem_RawFree(rotation);
    PyMem_RawFree(scores);
    PyMem_Free(layer_tables);
    PyMem_Free(windowed);
    if (out_of_memory) PyErr_NoMemory();
    if (!failed && !out_of_memory && bad_token != NO_BAD_TOKEN)
        PyErr_Format(PyExc_ValueError, "a step drew token %lld, which has no embedding row", bad_token);
    if (failed || out_of_memory || bad_token != NO_BAD_TOKEN) return NULL;
    if (single_token >= 0) return PyLong_FromLongLong(single_token);
    if (steps > 1) return PyLong_FromSsize_t(ran);
    Py_RETURN_NONE;
}

/* KVCache.move on the host in one call: copy slot src[j] of batch row rows[j] to slot dst[j] of the same row (j <
 * count; src and dst sequences of ints, rows one int for every pair or a sequence) in every array of `arrays` (a
 * tuple of writable buffers, each (batch, kv_heads, capacity, head_dim) values of `value_bytes` bytes: a layer's
 * keys or values). Every source slot of a head is read before any destination is written (through a scratch
 * copy), as numpy's fancy assignment does, so the pairs may overlap in any order. Why: a commit's move of the
 * bundled target's 16 arrays took ~60 us through numpy after 64 MB had streamed through the caches (the index
 * arrays' conversions and an assignment per array), ~22 us through this call from the same lists. */
static int slot_indices(PyObject *object, Py_ssize_t count, long long *out, const char *name) {
    if (PyLong_Check(object)) { /* rows: one for every pair */
        const long long value = PyLong_AsLongLong(object);
        for (Py_ssize_t j = 0; j < count; j++) out[j] = value;
        return value == -1 && PyErr_Occurred() ? -1 : 0;
    }
    PyObject *fast = PySequence_Fast(object, "move_slots: rows, src and dst must be ints or sequences of ints");
    if (fast == NULL) return -1;
    int failed = 0;
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        PyErr_Format(PyExc_ValueError, "move_slots: %s holds %zd indices, src %zd", name, PySequence_Fast_GET_SIZE(fast),
                     count);
        failed = 1;
    }
    for (Py_ssize_t j = 0; j < count && !failed; j++) {
        out[j] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, j));
        failed = out[j] == -1 && PyErr_Occurred();
    }
    Py_DECREF(fast);
    return failed ? -1 : 0;
}

static PyObject *move_slots(PyObject *self, PyObject *args) {
    PyObject *arrays, *rows_object, *src_object, *dst_object;
    Py_ssize_t batch, kv_heads, capacity, head_dim, value_bytes;
    if (!PyArg_ParseTuple(args, "OOOOnnnnn", &arrays, &rows_object, &src_object, &dst_object, &batch, &kv_heads,
                          &capacity, &head_dim, &value_bytes))
        return NULL;
    if (!PyTuple_Check(arrays) || batch < 1 || kv_heads < 1 || capacity < 1 || head_dim < 1 ||
        (value_bytes != 2 && value_bytes != 4)) {
        PyErr_SetString(PyExc_ValueError, "move_slots: a tuple of arrays, batch, kv_heads, capacity, head_dim >= 1 "
                                          "and 2- or 4-byte values");
        return NULL;
    }
    const Py_ssize_t count = PyObject_Length(src_object), slot = head_dim * value_bytes;
    if (count < 0) return NULL;
    long long *indices = (long long *)PyMem_RawMalloc((size_t)(3 * count + 1) * sizeof(long long));
    if (indices == NULL) return PyErr_NoMemory();
    long long *rows = indices, *from = indices + count, *to = indices + 2 * count;
    int failed = slot_indices(src_object, count, from, "src") || slot_indices(dst_object, count, to, "dst") ||
                 slot_indices(rows_object, count, rows, "rows");
    for (Py_ssize_t j = 0; j < count && !failed; j++)
        if (rows[j] < 0 || rows[j] >= batch || from[j] < 0 || from[j] >= capacity || to[j] < 0 || to[j] >= capacity) {
            PyErr_Format(PyExc_ValueError, "move_slots: row %lld, slot %lld -> %lld outside the cache (%zd rows, "
                         "capacity %zd)", rows[j], from[j], to[j], batch, capacity);
            failed = 1;
        }
    const Py_ssize_t num_arrays = PyTuple_GET_SIZE(arrays);
    const Py_ssize_t head_bytes = capacity * slot, row_bytes = kv_heads * head_bytes;
    char *scratch = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t viewed = 0;
    if (!failed && count > 0 && ((scratch = (char *)PyMem_RawMalloc((size_t)(count * slot))) == NULL ||
                                 (views = (Py_buffer *)PyMem_Calloc((size_t)num_arrays + 1, sizeof(Py_buffer))) == NULL)) {
        PyErr_NoMemory();
        failed = 1;
    }
    for (; viewed < num_arrays && !failed && count > 0; viewed++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, viewed), &views[viewed], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) {
            failed = 1;
            break;
        }
        if (views[viewed].len != batch * row_bytes) {
            PyErr_Format(PyExc_ValueError, "move_slots: array %zd holds %zd bytes, not %zd", viewed, views[viewed].len,
                         batch * row_bytes);
            failed = 1; /* (the loop's increment counts this view as taken: it is released below) */
        }
    }
    if (!failed && count > 0) {
        for (Py_ssize_t a = 0; a < num_arrays; a++) {
            char *base = (char *)views[a].buf;
            for (Py_ssize_t h = 0; h < kv_heads; h++) {
                for (Py_ssize_t j = 0; j < count; j++)
                    memcpy(scratch + j * slot, base + rows[j] * row_bytes + h * head_bytes + from[j] * slot, (size_t)slot);
                for (Py_ssize_t j = 0; j < count; j++)
                    memcpy(base + rows[j] * row_bytes + h * head_bytes + to[j] * slot, scratch + j * slot, (size_t)slot);
            }
        }
    }
    for (Py_ssize_t a = 0; a < viewed && views != NULL; a++) PyBuffer_Release(&views[a]);
    PyMem_Free(views);
    PyMem_RawFree(scratch);
    PyMem_RawFree(indices);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"supported", supported, METH_NOARGS, "True when this CPU runs the panel kernel (x86-64, AVX2, FMA)."},
    {"set_prefetch_temporal", set_prefetch_temporal, METH_VARARGS,
     "set_prefetch_temporal(flag): the panel kernel prefetches its weights into every cache level (True) "
     "or non-temporally (False, the default)."},
    {"set_two_panel_tiles", set_two_panel_tiles, METH_VARARGS,
     "set_two_panel_tiles(flag): products of 8 rows or more take AVX-512 tiles of two panels (True, the default) "
     "or of one (False); the same sums either way."},
    {"set_avx512", set_avx512, METH_VARARGS,
     "set_avx512(flag): products of 2 rows or more take the AVX-512 tiles (True; the default where the CPU has "
     "AVX-512F) or the AVX2 ones (False)."},
    {"avx512", avx512, METH_NOARGS, "Whether products of 2 rows or more take the AVX-512 tiles."},
    {"set_threads", set_threads, METH_VARARGS,
     "set_threads(n): products of large weights run on up to n threads, the caller's included (1, the default: "
     "none beside it); the same bits at any n (each output column is summed by one thread)."},
    {"threads", threads, METH_NOARGS, "The products' threads (set_threads)."},
    {"split_products", split_products, METH_NOARGS,
     "How many products this process has split among threads (a count for the tests)."},
    {"set_pool_verdict", set_pool_verdict, METH_VARARGS,
     "set_pool_verdict(worth, window): the split products run alone for a while where a window of `window` "
     "of them took more than `worth` of the caller's estimate of running them alone (defaults 1.0 and 64); "
     "resets the verdicts' state."},
    {"pool_verdicts", pool_verdicts, METH_NOARGS,
     "(verdicts against the threads so far, products left to run alone now): a count for the tests."},
    {"amx", amx, METH_NOARGS,
     "Whether AMX panels (kind 2) can be multiplied here: AMX-BF16 and AVX512-BF16, and the kernel's "
     "permission to use the tile data (asked on the first call)."},
    {"f16", f16, METH_NOARGS, "Whether float16 panels (kind 3) can be multiplied here: the CPU's F16C."},
    {"matmul", matmul, METH_VARARGS,
     "matmul(x, panels, y, M, K, N, accumulate, kind): y (M, N) = [y +] x (M, K) @ W (K, N), W packed as "
     "(ceil(N/16), K, 16) panels of float32 (kind 0), bfloat16 (1) or float16 (3), or for the AMX products (2: x "
     "rounded to bfloat16; host_kernels.PanelWeight); x and y C-contiguous float32."},
    {"pack", pack, METH_VARARGS,
     "pack(w, out, K, N, kind): the (K, N) C-contiguous float32 weight w packed into out as panels of kind (as "
     "matmul takes them; host_kernels.PanelWeight), on the products' threads where it is large."},
    {"attention", attention, METH_VARARGS,
     "attention(q, q_stride, keys, values, out, mask, n, heads, kv_heads, head_dim, start, end, scale): "
     "out (n, heads * head_dim) = softmax(scale * q k^T) v over one sequence's (kv_heads, capacity, "
     "head_dim) cache; mask: n * end bytes (non-zero = attend) or None for the causal chain after start."},
    {"layer", layer, METH_VARARGS,
     "layer(hidden, normed, qkv, attn, gate_up, act, w_qkv, b_qkv, w_o, w_gate_up, w_down, rotation, keys, "
     "values, mask, n, H, heads, kv_heads, head_dim, intermediate, start, eps_in, eps_post, scale, bf16[, kv_bf16, "
     "batch, prefetch_values, b_o, b_up, b_down, style, qk_norm, qk_eps]): one decoder layer of the host forward for "
     "n rows of one sequence (or of batch sequences), in place on hidden (bf16: the weights' kind, as matmul's; "
     "prefetch_values: see prefetch_lines; rotation None: none; style: host_kernels.layer_style; qk_norm: Qwen3's "
     "q and k norm weights, 2 * head_dim float32, or None)."},
    {"activation", activation, METH_VARARGS,
     "activation(x, out, count, mlp): out = act(x) over count float32 values, act the compiled layers' MLP "
     "activation mlp (host_kernels.MLP_GELU, MLP_GELU_TANH or MLP_RELU)."},
    {"soft_cap", soft_cap_binding, METH_VARARGS,
     "soft_cap(x, cap): x = cap * tanh(x / cap) over float32 values in place (Gemma 2's logits; the one-call "
     "forward's own)."},
    {"rms", rms, METH_VARARGS,
     "rms(x, out, rows, H, eps[, layer_norm]): out = x / sqrt(eps + mean(x^2)) per row of H float32 values (the "
     "layers' norm), or with layer_norm (x - mean(x)) / sqrt(eps + var(x))."},
    {"draw_rows", draw_rows, METH_VARARGS,
     "draw_rows(probs, u, out, rows, V, below_one): out[r] = the first token whose float64 cumulative "
     "mass exceeds u[r] * (total_r * below_one), else V - 1 (gbv.verify.common.draw_rows' rule)."},
    {"softmax_draw", softmax_draw, METH_VARARGS,
     "softmax_draw(logits, probs, u, tokens, rows, V, temperature, below_one): probs (rows, V) = "
     "softmax(logits / temperature) per row (probs None: a scratch row), and where u and tokens are given, "
     "tokens[r] drawn from probs row r by draw_rows' rule with u[r]; one row with u a float and no tokens: "
     "returns its token."},
    {"forward", forward, METH_VARARGS,
     "forward(tokens, positions, embed, rotary, layers, keys, values, first_row, capacity, mask, start, hidden, "
     "normed, qkv, attn, gate_up, act, head, logits, n, H, heads, kv_heads, head_dim, intermediate, vocab, "
     "final_eps, bf16, last_only, draw_vocab, temperature, u, probs, tokens, below_one[, kv_bf16, position_rows, "
     "position_offset, final_layer_norm, head_bias, window_mask, logits_softcap, embed_scale, window_first, "
     "embed_kind (0 float32, 1 bfloat16 bits, 2 float16), steps, stop]): the host forward of one "
     "sequence (host_kernels.forward_into), and with draw_vocab > 0 the softmax of its logits' first draw_vocab "
     "columns at temperature (0: greedy) into probs (or a scratch row) and, where tokens is given, one draw "
     "per output row with u (one output row with u a float and no tokens: returns its token). steps > 1: "
     "steps - 1 more one-query forwards of the causal chain, each of the token the step before drew, their "
     "laws into probs rows 1.. and their draws into tokens[1:] with u[1:]; the steps end after a draw in stop "
     "(int64 tokens, or None), and the call returns how many ran."},
    {"move_slots", move_slots, METH_VARARGS,
     "move_slots(arrays, rows, src, dst, batch, kv_heads, capacity, head_dim, value_bytes): in every (batch, "
     "kv_heads, capacity, head_dim) cache array of the tuple, slot src[j] of row rows[j] (an int: every pair's) -> "
     "slot dst[j] of the same row (sequences of ints), every source read before any destination is written "
     "(KVCache.move)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_host_kernels", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__host_kernels(void) { return PyModule_Create(&MODULE); }
