/* The verifiers' host-form helpers, compiled (C; an AVX2 form of the masked sums, chosen at run time on
 * x86-64 with GCC or clang, the scalar form elsewhere; optional, see setup.py). Each replaces numpy code
 * that is mostly fixed cost per call -- and right after a forward, every call runs from a cold cache, so
 * one call for ten is what pays -- and gives its results: the same bits, or the same values up to
 * rounding where the sums run in another order (tests/verify/test_verify_kernels.py).
 * gbv.verify.common.compiled_kernels switches them all.
 *
 * - node_weights: gbv-adaptive's weight search at one node (gbv_adaptive.node_weights). It finds the
 *   weight lam_n that maximises the one-step acceptance F(lam) = sum_x min(p_x, q_x + lam d_x),
 *   d = g_n - q, over a row cut to the tokens that matter (a sharp row's ~150 tokens, or a flat row's
 *   few hundred occupied key buckets): one pass per n and a selection of the crossing breakpoint (no
 *   sort of the row). Any weight keeps gbv-adaptive lossless (it is a function of the node's rows).
 * - adaptive_node, adaptive_step: gbv-adaptive's whole node before its coin (keys, cut or buckets,
 *   weights) and after it (W of the chosen token, the on-path law, the update of the counts).
 * - select_path, mass_below_keyed: GBV's selection, and the masked sums of its walk with the keys
 *   computed where they are compared.
 * - split_row, residual_dist: BV's bucketed residual mass and its correction row at one node of a rank
 *   law (GBV's q_G or gbv-adaptive's q_A: RankLaw below).
 * - positive_part: BV's and token-level sampling's (w p - q)+ and its sum.
 * - single_path: BV and token-level sampling on one path, whole (the coins' uniforms from the caller's
 *   random source, drawn where the numpy code draws them).
 * - spectr_rho: SpecTr's root search at one node.
 * - bucket_masses, mass_below_among, mass_below_at: gbv.verify.ranking's key-bucket masses, exact
 *   ranks among some tokens (a radix sort from RADIX_MIN tokens up), and masked sums of the q-mass
 *   ranked below a token.
 * - draw_row: gbv.verify.common.TorchRandom.sample's inverse-CDF draw on one row.
 *
 * Compiled with -ffp-contract=off so that the arithmetic is the numpy code's, operation for operation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Key buckets, as gbv.verify.ranking: the float32 bits of a key >= 0 shifted right by 19 (negative
 * bits clamp to bucket 0), up to +inf. */
#define BUCKET_SHIFT 19
#define NUM_BUCKETS ((0x7F800000 >> BUCKET_SHIFT) + 1)
/* A float32 key's bucket from its bits: negative bits (-0.0, -1) clamp to bucket 0; bits above +inf
 * (a NaN, which the keys never are) to the last bucket, so that no key writes outside the arrays. */
static int32_t bucket_of(int32_t bits) {
    int32_t b = bits >> BUCKET_SHIFT;  /* (arithmetic shift: negative bits stay negative) */
    return b < 0 ? 0 : (b >= NUM_BUCKETS ? NUM_BUCKETS - 1 : b);
}

/* Below this many breakpoints the crossing is found by an insertion sort and a running sum. */
#define SMALL 24

/* gbv.verify.ranking.ranking_key of one float32 token: p / q in float32 (+inf where q = 0 < p), -1
 * (ZERO_ZERO_KEY) where p = q = 0. The same IEEE division as numpy's on float32 rows. */
static float key_of(float p, float q) {
    float key = p / q;
    return isnan(key) ? -1.0f : key;
}

static void swap2(double *t, double *w, Py_ssize_t i, Py_ssize_t j) {
    double a = t[i], b = w[i];
    t[i] = t[j];
    w[i] = w[j];
    t[j] = a;
    w[j] = b;
}

/* The first breakpoint, in increasing t, at which the running sum of the drops w reaches slope (> 0);
 * 1 if it never does. t and w are reordered. A quickselect on t: each round splits the breakpoints
 * into those below, at and above a pivot (median of three) and keeps the side where the crossing lies,
 * so the expected work is linear in m, not m log m. */
static double crossing(double *t, double *w, Py_ssize_t m, double slope) {
    Py_ssize_t lo = 0, hi = m;
    while (hi - lo > SMALL) {
        double a = t[lo], b = t[lo + (hi - lo) / 2], c = t[hi - 1];
        double pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        Py_ssize_t less = lo, i = lo, more = hi;
        double sum_less = 0.0, sum_equal = 0.0;
        while (i < more) {  /* [lo, less) < pivot, [less, i) == pivot, [more, hi) > pivot */
            if (t[i] < pivot) {
                sum_less += w[i];
                swap2(t, w, less++, i++);
            } else if (t[i] > pivot) {
                swap2(t, w, i, --more);
            } else {
                sum_equal += w[i++];
            }
        }
        if (sum_less >= slope) {
            hi = less;
        } else if (sum_less + sum_equal >= slope) {
            return pivot;
        } else {
            slope -= sum_less + sum_equal;
            lo = more;
        }
    }
    for (Py_ssize_t i = lo + 1; i < hi; i++) {  /* insertion sort of what is left */
        double ti = t[i], wi = w[i];
        Py_ssize_t j = i;
        for (; j > lo && t[j - 1] > ti; j--) {
            t[j] = t[j - 1];
            w[j] = w[j - 1];
        }
        t[j] = ti;
        w[j] = wi;
    }
    double run = 0.0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        run += w[i];
        if (run >= slope) return t[i];
    }
    return 1.0;
}

static int float64_rows(Py_buffer *views, int count, Py_ssize_t *m) {
    *m = views[0].len / (Py_ssize_t)sizeof(double);
    for (int i = 0; i < count; i++) {
        if (views[i].len != *m * (Py_ssize_t)sizeof(double)) {
            PyErr_SetString(PyExc_ValueError, "the rows must be float64 and of one length");
            return 0;
        }
    }
    return 1;
}

/* The weight search on m tokens (or buckets): float64 p, q and W; writes lam_2 .. lam_K into
 * lams[2 .. paths] (lams[0] = lams[1] = 0). work holds 4 m + 1 doubles. */
static void weights_core(const double *p, const double *q, const double *below, Py_ssize_t m, Py_ssize_t paths,
                         double *lams, double *work) {
    lams[0] = lams[1] = 0.0;
    double *s = work, *x_pow = work + m, *t = work + 2 * m, *w = work + 3 * m;
    for (Py_ssize_t x = 0; x < m; x++) {
        double sum = below[x] + q[x];  /* W + q */
        x_pow[x] = sum;
        s[x] = below[x] + sum;  /* S_2 = W S_1 + x, S_1 = 1 */
    }
    for (Py_ssize_t n = 2; n <= paths; n++) {
        if (n > 2) {
            for (Py_ssize_t x = 0; x < m; x++) {  /* S_n = W S_{n-1} + x^(n-1) */
                x_pow[x] = x_pow[x] * (below[x] + q[x]);
                s[x] = s[x] * below[x] + x_pow[x];
            }
        }
        /* d = q (S_n - 1). Right slope of F at 0: d where p > q, min(d, 0) where p = q. Breakpoints
         * t = (p - q) / d in (0, 1) with their drops |d| (none where p = q). */
        double slope = 0.0;
        Py_ssize_t count = 0;
        for (Py_ssize_t x = 0; x < m; x++) {
            double d = (s[x] - 1.0) * q[x], diff = p[x] - q[x];
            if (diff > 0.0) slope += d;
            else if (diff == 0.0) {
                if (d < 0.0) slope += d;
                continue;
            }
            double tx = diff / d;
            if (tx > 0.0 && tx < 1.0) {
                t[count] = tx;
                w[count++] = fabs(d);
            }
        }
        lams[n] = slope > 0.0 ? crossing(t, w, count, slope) : 0.0;
    }
}

static PyObject *float_list(const double *values, Py_ssize_t count) {
    PyObject *list = PyList_New(count);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyFloat_FromDouble(values[i]);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *node_weights(PyObject *self, PyObject *args) {
    Py_buffer views[3];
    Py_ssize_t paths, m;
    if (!PyArg_ParseTuple(args, "y*y*y*n", &views[0], &views[1], &views[2], &paths)) return NULL;
    PyObject *result = NULL;
    double *work = NULL;
    if (!float64_rows(views, 3, &m)) goto done;
    if (paths < 1 || paths > 64) {
        PyErr_SetString(PyExc_ValueError, "node_weights: 1 <= num_paths <= 64");
        goto done;
    }
    double lams[65] = {0.0};
    if (paths >= 2) {
        work = PyMem_RawMalloc((size_t)(4 * m + 1) * sizeof(double));
        if (work == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        weights_core(views[0].buf, views[1].buf, views[2].buf, m, paths, lams, work);
    }
    result = float_list(lams, paths + 1 > 2 ? paths + 1 : 2);
done:
    PyMem_RawFree(work);
    for (int i = 0; i < 3; i++) PyBuffer_Release(&views[i]);
    return result;
}

/* gbv.verify.ranking.occupied_bucket_masses on float32 keys: the q- and p-mass of each key bucket,
 * summed in token order (bincount's order: the same bits), then over the occupied buckets (q + p > 0)
 * in increasing key order, the q-mass of the buckets below. Returns the number of occupied buckets B;
 * the first B entries of mass_q, mass_p and below hold them (and of ids, when given, their bucket ids). */
static PyObject *bucket_masses(PyObject *self, PyObject *args) {
    Py_buffer key, rows[2], out[3], ids = {0};
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*|w*", &key, &rows[0], &rows[1], &out[0], &out[1], &out[2], &ids))
        return NULL;
    PyObject *result = NULL;
    double *mass = NULL;
    Py_ssize_t m = key.len / (Py_ssize_t)sizeof(float);
    int64_t *out_ids = ids.obj != NULL ? ids.buf : NULL;  /* optional: the occupied buckets' ids */
    if (rows[0].len != m * (Py_ssize_t)sizeof(double) || rows[1].len != m * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "keys must be float32, q and p float64, all of one length");
        goto done;
    }
    for (int i = 0; i < 3; i++) {
        if (out[i].len < m * (Py_ssize_t)sizeof(double) && out[i].len < NUM_BUCKETS * (Py_ssize_t)sizeof(double)) {
            PyErr_SetString(PyExc_ValueError, "each output needs min(V, buckets) float64 entries");
            goto done;
        }
    }
    if (out_ids != NULL && ids.len < m * (Py_ssize_t)sizeof(int64_t) && ids.len < NUM_BUCKETS * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "the bucket ids need min(V, buckets) int64 entries");
        goto done;
    }
    mass = PyMem_RawCalloc(2 * NUM_BUCKETS, sizeof(double));
    if (mass == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int32_t *bits = key.buf;
    const double *q = rows[0].buf, *p = rows[1].buf;
    double *mass_q = mass, *mass_p = mass + NUM_BUCKETS;
    int32_t low = NUM_BUCKETS, high = 0;
    for (Py_ssize_t x = 0; x < m; x++) {
        int32_t bucket = bucket_of(bits[x]);
        mass_q[bucket] += q[x];
        mass_p[bucket] += p[x];
        if (bucket < low) low = bucket;
        if (bucket > high) high = bucket;
    }
    double *out_q = out[0].buf, *out_p = out[1].buf, *out_below = out[2].buf;
    Py_ssize_t occupied = 0;
    double running = 0.0;
    for (int32_t b = low; b <= high; b++) {
        if (mass_q[b] + mass_p[b] > 0.0) {
            if (out_ids != NULL) out_ids[occupied] = b;
            out_q[occupied] = mass_q[b];
            out_p[occupied] = mass_p[b];
            out_below[occupied++] = running;
            running += mass_q[b];
        }
    }
    result = PyLong_FromSsize_t(occupied);
done:
    PyMem_RawFree(mass);
    PyBuffer_Release(&key);
    for (int i = 0; i < 2; i++) PyBuffer_Release(&rows[i]);
    for (int i = 0; i < 3; i++) PyBuffer_Release(&out[i]);
    if (ids.obj != NULL) PyBuffer_Release(&ids);
    return result;
}

/* Ascending sort of distinct uint64 values: quicksort (median of three) down to runs of SMALL,
 * then one insertion sort. */
static void sort_u64(uint64_t *a, Py_ssize_t m) {
    Py_ssize_t stack[128], top = 0, lo = 0, hi = m;  /* [lo, hi); the larger part is pushed, so depth < 64 */
    for (;;) {
        while (hi - lo > SMALL) {
            uint64_t x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];
            uint64_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
            Py_ssize_t i = lo, j = hi - 1;
            for (;;) {  /* Hoare partition: [lo, j] <= pivot <= [j + 1, hi) */
                while (a[i] < pivot) i++;
                while (a[j] > pivot) j--;
                if (i >= j) break;
                uint64_t tmp = a[i];
                a[i++] = a[j];
                a[j--] = tmp;
            }
            if (j + 1 - lo < hi - j - 1) {
                stack[top++] = j + 1;
                stack[top++] = hi;
                hi = j + 1;
            } else {
                stack[top++] = lo;
                stack[top++] = j + 1;
                lo = j + 1;
            }
        }
        if (top == 0) break;
        hi = stack[--top];
        lo = stack[--top];
    }
    for (Py_ssize_t i = 1; i < m; i++) {
        uint64_t v = a[i];
        Py_ssize_t j = i;
        for (; j > 0 && a[j - 1] > v; j--) a[j] = a[j - 1];
        a[j] = v;
    }
}

/* A float32 key's bits, mapped so that unsigned order is the float order (-0.0 as +0.0). */
static uint32_t ordered_bits(float key) {
    float k = key + 0.0f;  /* -0.0 -> +0.0: equal keys, equal bits */
    int32_t bits;
    memcpy(&bits, &k, sizeof bits);
    bits ^= (bits >> 31) & 0x7FFFFFFF;  /* signed order of these = float order */
    return (uint32_t)bits ^ 0x80000000u;  /* and unsigned order */
}

/* Up to this many tokens the packed values are sorted by sort_u64, more by radix_u64. */
#define RADIX_MIN 128

/* Ascending sort of distinct uint64 values (ordered key bits << 32 | low bits) by their high 32 bits,
 * given in increasing order of their low 32 bits (then the result is the full ascending order: a
 * stable sort keeps equal keys in that order). Least significant digit first, 8 bits a pass; a pass
 * whose digit is the same for every value is skipped (keys near one share their high bytes). scratch
 * holds m values. Linear in m: 20-30 us at 4,096 tokens against ~115 us for numpy's sort of the packed
 * values and ~140 us for sort_u64. */
static void radix_u64(uint64_t *a, uint64_t *scratch, Py_ssize_t m) {
    Py_ssize_t counts[4][256];
    memset(counts, 0, sizeof counts);
    for (Py_ssize_t i = 0; i < m; i++) {
        uint32_t key = (uint32_t)(a[i] >> 32);
        counts[0][key & 0xFF]++;
        counts[1][(key >> 8) & 0xFF]++;
        counts[2][(key >> 16) & 0xFF]++;
        counts[3][key >> 24]++;
    }
    uint64_t *src = a, *dst = scratch;
    for (int pass = 0; pass < 4; pass++) {
        int shift = 32 + 8 * pass;
        Py_ssize_t *count = counts[pass];
        if (count[(src[0] >> shift) & 0xFF] == m) continue;
        Py_ssize_t start = 0;
        for (int d = 0; d < 256; d++) {
            Py_ssize_t c = count[d];
            count[d] = start;
            start += c;
        }
        for (Py_ssize_t i = 0; i < m; i++) dst[count[(src[i] >> shift) & 0xFF]++] = src[i];
        uint64_t *tmp = src;
        src = dst;
        dst = tmp;
    }
    if (src != a) memcpy(a, src, (size_t)m * sizeof(uint64_t));
}

/* The worst-first order of m float32 keys (key ascending, ties by the larger index): packed[i] holds
 * (ordered bits << 32) | (2^32 - 1 - index) of the i-th worst. scratch: m more values. */
static void worst_first(const float *keys, Py_ssize_t m, uint64_t *packed, uint64_t *scratch) {
    /* listed from the last index down: increasing low bits, as radix_u64 wants */
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t x = m - 1 - i;
        packed[i] = ((uint64_t)ordered_bits(keys[x]) << 32) | (uint32_t)(0xFFFFFFFFu - (uint32_t)x);
    }
    if (m > RADIX_MIN) radix_u64(packed, scratch, m);
    else sort_u64(packed, m);
}

/* gbv.verify.ranking.mass_below_among on float32 keys: the q-mass ranked strictly below each listed
 * token among the listed ones. The order worst first (key ascending, ties by the larger index) is one
 * sort of the distinct values (order-preserving bits of the key) * 2^32 + (2^32 - 1 - index); the
 * exclusive running sum of q in that order is numpy's cumsum, term for term (the same bits). */
static PyObject *mass_below_among(PyObject *self, PyObject *args) {
    Py_buffer key, q, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &key, &q, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t m = key.len / (Py_ssize_t)sizeof(float);
    uint64_t *packed = NULL;
    if (q.len != m * (Py_ssize_t)sizeof(double) || out.len != q.len || m >= ((Py_ssize_t)1 << 32)) {
        PyErr_SetString(PyExc_ValueError, "keys must be float32, q and out float64, all of one length");
        goto done;
    }
    packed = PyMem_RawMalloc((size_t)(m > 0 ? 2 * m : 1) * sizeof(uint64_t));
    if (packed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    worst_first(key.buf, m, packed, packed + m);
    const double *mass = q.buf;
    double *below = out.buf, running = 0.0;
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t x = (Py_ssize_t)(0xFFFFFFFFu - (uint32_t)(packed[i] & 0xFFFFFFFFu));
        below[x] = running;
        running += mass[x];
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyMem_RawFree(packed);
    PyBuffer_Release(&key);
    PyBuffer_Release(&q);
    PyBuffer_Release(&out);
    return result;
}

/* gbv.verify.common.TorchRandom.sample's rule on one float32 or float64 row: the first index whose
 * float64 running sum exceeds u * (total * below_one), total the running sum's last value; else the
 * last index. numpy's cumsum adds in order, so the sums and the index are the same bits; one pass for
 * the total and one that stops at the index, against cumsum's ~5.5 ns an element here (23 us at
 * V = 4096). */
static Py_ssize_t draw_index(const void *dist, int is_double, Py_ssize_t m, double u, double below_one) {
    double total = 0.0, running = 0.0;
    if (is_double) {
        const double *row = dist;
        for (Py_ssize_t x = 0; x < m; x++) total += row[x];
        double point = u * (total * below_one);
        for (Py_ssize_t x = 0; x < m - 1; x++) {
            running += row[x];
            if (running > point) return x;
        }
    } else {
        const float *row = dist;
        for (Py_ssize_t x = 0; x < m; x++) total += (double)row[x];
        double point = u * (total * below_one);
        for (Py_ssize_t x = 0; x < m - 1; x++) {
            running += (double)row[x];
            if (running > point) return x;
        }
    }
    return m - 1;
}

static PyObject *draw_row(PyObject *self, PyObject *args) {
    Py_buffer dist;
    double u, below_one;
    int is_double;
    if (!PyArg_ParseTuple(args, "y*pdd", &dist, &is_double, &u, &below_one)) return NULL;
    Py_ssize_t width = is_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    Py_ssize_t m = dist.len / width;
    if (m < 1 || dist.len != m * width) {
        PyBuffer_Release(&dist);
        PyErr_SetString(PyExc_ValueError, "draw_row needs a non-empty contiguous float32 or float64 row");
        return NULL;
    }
    Py_ssize_t index = draw_index(dist.buf, is_double, m, u, below_one);
    PyBuffer_Release(&dist);
    return PyLong_FromSsize_t(index);
}

/* The masked sum of mass_below_at / mass_below_keyed on one row: the q-mass of the tokens ranked below
 * y (a smaller key, or an equal key and a larger index), in four running sums, token x into sum x mod 4,
 * added as (sum 0 + sum 1) + (sum 2 + sum 3). keys given, or computed from float32 p and q (key_of); q
 * float32 (q32) or float64 (q64). */
static double masked_sum_scalar(const float *keys, const float *p, const float *q32, const double *q64,
                                Py_ssize_t m, Py_ssize_t y, float k_y, Py_ssize_t start, const double *sums) {
    double sum[4] = {sums[0], sums[1], sums[2], sums[3]};  /* (locals: the sums stay in registers) */
    /* The test is a 0/1 factor, not a branch: random keys made the branch mispredict half the time.
     * One loop per case (the cases decided outside the loops). */
#define MASKED_LOOP(KEY, Q)                                                                      \
    for (Py_ssize_t x = start; x < m; x++) {                                                    \
        float k = (KEY);                                                                        \
        sum[x & 3] += (double)((k < k_y) | ((k == k_y) & (x > y))) * (Q);                       \
    }
    if (keys != NULL && q64 != NULL) MASKED_LOOP(keys[x], q64[x])
    else if (keys != NULL) MASKED_LOOP(keys[x], (double)q32[x])
    else if (q64 != NULL) MASKED_LOOP(key_of(p[x], q32[x]), q64[x])
    else MASKED_LOOP(key_of(p[x], q32[x]), (double)q32[x])
#undef MASKED_LOOP
    return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* The same sums with AVX2: the four running sums are the four lanes of one vector (token x in lane
 * x mod 4, eight tokens a step: the first four, then the next four, as the scalar loop adds them), and
 * a masked-off token adds +0.0 as the scalar loop's 0 * q does: the same bits. Without FMA (no
 * contraction). ~0.3 ns a token against ~1.6 for the scalar loop here. */
__attribute__((target("avx2"))) static double masked_sum_avx2(const float *keys, const float *p, const float *q32,
                                                             const double *q64, Py_ssize_t m, Py_ssize_t y, float k_y) {
    __m256d acc = _mm256_setzero_pd();
    const __m256 key_y = _mm256_set1_ps(k_y), minus_one = _mm256_set1_ps(-1.0f);
    const __m256i index_y = _mm256_set1_epi32((int)y), eight = _mm256_set1_epi32(8);
    __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    Py_ssize_t x = 0;
    for (; x + 8 <= m; x += 8) {
        __m256 k;
        if (keys != NULL) {
            k = _mm256_loadu_ps(keys + x);
        } else {
            __m256 ratio = _mm256_div_ps(_mm256_loadu_ps(p + x), _mm256_loadu_ps(q32 + x));
            k = _mm256_blendv_ps(ratio, minus_one, _mm256_cmp_ps(ratio, ratio, _CMP_UNORD_Q));
        }
        __m256 later = _mm256_castsi256_ps(_mm256_cmpgt_epi32(index, index_y));
        __m256i below = _mm256_castps_si256(_mm256_or_ps(
            _mm256_cmp_ps(k, key_y, _CMP_LT_OQ), _mm256_and_ps(_mm256_cmp_ps(k, key_y, _CMP_EQ_OQ), later)));
        __m256d q_lo, q_hi;
        if (q64 != NULL) {
            q_lo = _mm256_loadu_pd(q64 + x);
            q_hi = _mm256_loadu_pd(q64 + x + 4);
        } else {
            __m256 q_f = _mm256_loadu_ps(q32 + x);
            q_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(q_f));
            q_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(q_f, 1));
        }
        __m256d mask_lo = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(below)));
        __m256d mask_hi = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(below, 1)));
        acc = _mm256_add_pd(acc, _mm256_and_pd(q_lo, mask_lo));
        acc = _mm256_add_pd(acc, _mm256_and_pd(q_hi, mask_hi));
        index = _mm256_add_epi32(index, eight);
    }
    double sum[4];
    _mm256_storeu_pd(sum, acc);
    return masked_sum_scalar(keys, p, q32, q64, m, y, k_y, x, sum);
}

static int use_avx2 = -1;  /* decided at the first call; set_simd switches it (tests) */

/* Whether the AVX2 loops run: the CPU's AVX2, asked at the first call, unless set_simd said otherwise. */
static int avx2_loops(void) {
    if (use_avx2 < 0) use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    return use_avx2;
}

/* keys_and_support on AVX2: eight tokens a step, the same IEEE division and the same comparisons in
 * float64 (each q widened exactly), so the same keys and count. */
__attribute__((target("avx2,popcnt"))) static Py_ssize_t keys_and_support_avx2(const float *p, const float *q,
                                                                               float *keys, Py_ssize_t m,
                                                                               double cut, Py_ssize_t *done) {
    const __m256 minus_one = _mm256_set1_ps(-1.0f);
    const __m256d cut4 = _mm256_set1_pd(cut);
    Py_ssize_t support = 0, x = 0;
    for (; x + 8 <= m; x += 8) {
        const __m256 q8 = _mm256_loadu_ps(q + x);
        const __m256 ratio = _mm256_div_ps(_mm256_loadu_ps(p + x), q8);
        _mm256_storeu_ps(keys + x, _mm256_blendv_ps(ratio, minus_one, _mm256_cmp_ps(ratio, ratio, _CMP_UNORD_Q)));
        const __m256d low = _mm256_cmp_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(q8)), cut4, _CMP_GT_OQ);
        const __m256d high = _mm256_cmp_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(q8, 1)), cut4, _CMP_GT_OQ);
        support += __builtin_popcount((unsigned)(_mm256_movemask_pd(low) | _mm256_movemask_pd(high) << 4));
    }
    *done = x;
    return support;
}

/* The tokens of q > cut (float64 comparisons, as the scalar loop's), in order: their p and q widened
 * to float64 and their keys. Eight tokens tested a step; returns how far it got. */
__attribute__((target("avx2"))) static Py_ssize_t gather_support_avx2(const float *p, const float *q,
                                                                     const float *keys, Py_ssize_t m, double cut,
                                                                     double *row_p, double *row_q, float *cut_keys,
                                                                     Py_ssize_t *count) {
    const __m256d cut4 = _mm256_set1_pd(cut);
    Py_ssize_t x = 0, c = 0;
    for (; x + 8 <= m; x += 8) {
        const __m256 q8 = _mm256_loadu_ps(q + x);
        const __m256d low = _mm256_cmp_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(q8)), cut4, _CMP_GT_OQ);
        const __m256d high = _mm256_cmp_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(q8, 1)), cut4, _CMP_GT_OQ);
        for (unsigned bits = (unsigned)(_mm256_movemask_pd(low) | _mm256_movemask_pd(high) << 4); bits;
             bits &= bits - 1) {
            const Py_ssize_t t = x + __builtin_ctz(bits);
            row_p[c] = (double)p[t];
            row_q[c] = (double)q[t];
            cut_keys[c++] = keys[t];
        }
    }
    *count = c;
    return x;
}
#endif

/* The sharp case's gather (adaptive_node): the tokens of q > cut, in order. */
static Py_ssize_t gather_support(const float *p, const float *q, const float *keys, Py_ssize_t m, double cut,
                                 double *row_p, double *row_q, float *cut_keys) {
    Py_ssize_t count = 0, x = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (avx2_loops()) x = gather_support_avx2(p, q, keys, m, cut, row_p, row_q, cut_keys, &count);
#endif
    for (; x < m; x++) {
        if ((double)q[x] > cut) {
            row_p[count] = (double)p[x];
            row_q[count] = (double)q[x];
            cut_keys[count++] = keys[x];
        }
    }
    return count;
}

/* gbv_adaptive's node keys (key_of) of m tokens into keys, and how many have q > cut (in float64). Why
 * vectorised: the scalar loop (a division and a NaN test a token) was most of a node's ~17 us at
 * V = 4096, four nodes a verify call at L = 4. */
static Py_ssize_t keys_and_support(const float *p, const float *q, float *keys, Py_ssize_t m, double cut) {
    Py_ssize_t support = 0, x = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (avx2_loops()) support = keys_and_support_avx2(p, q, keys, m, cut, &x);
#endif
    for (; x < m; x++) {
        keys[x] = key_of(p[x], q[x]);
        support += (double)q[x] > cut;
    }
    return support;
}

static double masked_sum(const float *keys, const float *p, const float *q32, const double *q64, Py_ssize_t m,
                         Py_ssize_t y, float k_y) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (avx2_loops() && m < ((Py_ssize_t)1 << 31)) return masked_sum_avx2(keys, p, q32, q64, m, y, k_y);
#endif
    double sum[4] = {0.0, 0.0, 0.0, 0.0};
    return masked_sum_scalar(keys, p, q32, q64, m, y, k_y, 0, sum);
}

/* set_simd(on) -> whether the AVX2 masked sums run from now on (on and the CPU has AVX2): the tests
 * compare both forms. */
static PyObject *set_simd(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    use_avx2 = on && __builtin_cpu_supports("avx2") ? 1 : 0;
    return PyBool_FromLong(use_avx2);
#else
    return PyBool_FromLong(0);
#endif
}

/* gbv.verify.ranking.mass_below_array on float32 keys: for each row r and its token y_r, the q-mass
 * ranked strictly below y_r (a smaller key, or an equal key and a larger index), q float32 or float64,
 * summed in float64 in four interleaved running sums, one pass per row (numpy: three passes and a dot
 * product, which sums in its own order). */
static PyObject *mass_below_at(PyObject *self, PyObject *args) {
    Py_buffer key, q, tokens, out;
    Py_ssize_t rows, m;
    int q_double;
    if (!PyArg_ParseTuple(args, "y*y*py*w*nn", &key, &q, &q_double, &tokens, &out, &rows, &m)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t q_width = q_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    if (key.len != rows * m * (Py_ssize_t)sizeof(float) || q.len != rows * m * q_width
        || tokens.len != rows * (Py_ssize_t)sizeof(int64_t) || out.len != rows * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "mass_below_at: float32 keys and q of (rows, V), int64 tokens, float64 out");
        goto done;
    }
    const int64_t *token = tokens.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (token[r] < 0 || token[r] >= m) {
            PyErr_SetString(PyExc_IndexError, "mass_below_at: a token outside the row");
            goto done;
        }
    }
    double *below = out.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *k = (const float *)key.buf + r * m;
        Py_ssize_t y = (Py_ssize_t)token[r];
        /* Four running sums (index mod 4), added at the end: one chain of dependent additions would
         * cost an addition's latency per token. */
        below[r] = q_double ? masked_sum(k, NULL, NULL, (const double *)q.buf + r * m, m, y, k[y])
                            : masked_sum(k, NULL, (const float *)q.buf + r * m, NULL, m, y, k[y]);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&q);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&out);
    return result;
}

/* gbv.verify.gbv.select_path on float32 rows: (K, L) int64 tokens, (K, L, V) q and (K, L', V) p (L' >= L,
 * contiguous) -> the smallest index among the paths equal to the best sequence. Depth by depth, the
 * alive paths' tokens are compared by key (each read from its own rows, as select_path_host), ties by
 * the smaller id, and the paths not carrying the best token drop out. */
static PyObject *select_path(PyObject *self, PyObject *args) {
    Py_buffer tokens, q, p;
    Py_ssize_t paths, block, p_block, m;
    if (!PyArg_ParseTuple(args, "y*y*y*nnnn", &tokens, &q, &p, &paths, &block, &p_block, &m)) return NULL;
    PyObject *result = NULL;
    if (paths < 1 || paths > 64 || block < 1 || p_block < block
        || tokens.len != paths * block * (Py_ssize_t)sizeof(int64_t)
        || q.len != paths * block * m * (Py_ssize_t)sizeof(float)
        || p.len != paths * p_block * m * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "select_path: int64 tokens (K, L), float32 q (K, L, V) and p (K, L', V), "
                        "1 <= K <= 64, L' >= L");
        goto done;
    }
    const int64_t *token = tokens.buf;
    for (Py_ssize_t i = 0; i < paths * block; i++) {
        if (token[i] < 0 || token[i] >= m) {
            PyErr_SetString(PyExc_IndexError, "select_path: a token outside the vocabulary");
            goto done;
        }
    }
    const float *q_rows = q.buf, *p_rows = p.buf;
    uint64_t alive = paths == 64 ? ~(uint64_t)0 : (((uint64_t)1 << paths) - 1);
    for (Py_ssize_t d = 0; d < block && (alive & (alive - 1)); d++) {
        int64_t best = -1;
        float best_key = 0.0f;
        for (Py_ssize_t k = 0; k < paths; k++) {
            if (!(alive >> k & 1)) continue;
            int64_t y = token[k * block + d];
            float key = key_of(p_rows[(k * p_block + d) * m + y], q_rows[(k * block + d) * m + y]);
            if (best < 0 || key > best_key || (key == best_key && y < best)) {
                best = y;
                best_key = key;
            }
        }
        for (Py_ssize_t k = 0; k < paths; k++)
            if (token[k * block + d] != best) alive &= ~((uint64_t)1 << k);
    }
    Py_ssize_t first = 0;
    while (!(alive >> first & 1)) first++;
    result = PyLong_FromSsize_t(first);
done:
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&q);
    PyBuffer_Release(&p);
    return result;
}

/* mass_below_at with the keys computed on the way (key_of of float32 p and q rows, (rows, V) each): the
 * same comparisons on the same keys, so the same sums, without the (rows, V) key array. */
static PyObject *mass_below_keyed(PyObject *self, PyObject *args) {
    Py_buffer p, q, tokens, out;
    Py_ssize_t rows, m;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nn", &p, &q, &tokens, &out, &rows, &m)) return NULL;
    PyObject *result = NULL;
    if (p.len != rows * m * (Py_ssize_t)sizeof(float) || q.len != rows * m * (Py_ssize_t)sizeof(float)
        || tokens.len != rows * (Py_ssize_t)sizeof(int64_t) || out.len != rows * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "mass_below_keyed: float32 p and q of (rows, V), int64 tokens, float64 out");
        goto done;
    }
    const int64_t *token = tokens.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (token[r] < 0 || token[r] >= m) {
            PyErr_SetString(PyExc_IndexError, "mass_below_keyed: a token outside the row");
            goto done;
        }
    }
    double *below = out.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *p_row = (const float *)p.buf + r * m, *q_row = (const float *)q.buf + r * m;
        Py_ssize_t y = (Py_ssize_t)token[r];
        below[r] = masked_sum(NULL, p_row, q_row, NULL, m, y, key_of(p_row[y], q_row[y]));  /* as mass_below_at */
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&p);
    PyBuffer_Release(&q);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&out);
    return result;
}

/* The rank laws of gbv.verify.ranking.RankLaw at one node, law(y) = q_y R(W_y + q_y, W_y), in the
 * numpy code's operations and order (the same bits):
 * - kind 0, GBV's SkewedLaw: c = {v, u, denom}, law = q S_K(u + v (W + q), u + v W) / denom;
 * - kind 1, gbv-adaptive's AdaptiveLaw: c = {c_0, g_1, ..., g_{K-1}}, R(x, z) = c_0 + sum_{n >= 2}
 *   g_{n-1} S_n(x, z) (c_0 = sum_n a(n) (1 - lam_n) + g_0, g_n = a(n+1) lam_{n+1}: AdaptiveLaw._ratio). */
typedef struct {
    int kind;
    Py_ssize_t k;
    const double *c;
} RankLaw;

static double power_sum(double x, double z, Py_ssize_t n) {  /* ranking.power_sum */
    double total = 1.0, x_pow = 1.0;
    for (Py_ssize_t i = 0; i < n - 1; i++) {
        x_pow *= x;
        total = total * z + x_pow;
    }
    return total;
}

static double adaptive_ratio(const RankLaw *law, double x, double z) {
    double total = law->c[0];
    if (law->k == 1) return total + 0.0 * x;
    double x_pow = x, s_n = z + x;
    total = total + law->c[1] * s_n;
    for (Py_ssize_t n = 3; n <= law->k; n++) {
        x_pow = x_pow * x;
        s_n = s_n * z + x_pow;
        total = total + law->c[n - 1] * s_n;
    }
    return total;
}

static double law_of(const RankLaw *law, double below, double q) {  /* token_law, and block_law of a run */
    if (law->kind == 0) {
        double v = law->c[0], u = law->c[1];
        return q * power_sum(u + v * (below + q), u + v * below, law->k) / law->c[2];
    }
    return q * adaptive_ratio(law, below + q, below);
}

static double skewed_bound(const RankLaw *law, double w) {  /* k (u + v w)^(k-1) / denom: numpy's ** */
    double y = law->c[1] + law->c[0] * w, e = (double)(law->k - 1);
    double power = e == 2.0 ? y * y : (e == 1.0 ? y : (e == 0.0 ? 1.0 : pow(y, e)));
    return (double)law->k * power / law->c[2];
}

static void ratio_bounds(const RankLaw *law, double low, double high, double *r_low, double *r_high) {
    if (law->kind == 0) {
        *r_low = skewed_bound(law, low);
        *r_high = skewed_bound(law, high);
    } else {
        *r_low = adaptive_ratio(law, low, low);
        *r_high = adaptive_ratio(law, high, high);
    }
}

/* gbv.verify.ranking's bucket split of one node's residual mass sum_x (s p_x - law_x)+ (_split_buckets
 * with rows = 1, then _BucketSplit.unsettled_exact): float32 keys, q and p rows (float32 or float64
 * together), the scale s, a rank law (kind, K, its float64 constants), the buckets' float64 key bounds.
 * Returns (settled, low, high, unsettled): the settled buckets' exact part, the bounds of the whole
 * mass, and with exact the unsettled buckets' exact part (else nan; the mass is settled + unsettled).
 * The same sums in the same order as the numpy code: the same bits. */
static PyObject *split_row(PyObject *self, PyObject *args) {
    Py_buffer key, q, p, params, key_lo, key_hi;
    int rows_double, kind, exact;
    double scale;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*y*y*pdiny*y*y*p", &key, &q, &p, &rows_double, &scale, &kind, &k, &params,
                          &key_lo, &key_hi, &exact)) return NULL;
    PyObject *result = NULL;
    double *mass = NULL;
    uint64_t *packed = NULL;
    Py_ssize_t m = key.len / (Py_ssize_t)sizeof(float);
    Py_ssize_t width = rows_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    if (q.len != m * width || p.len != m * width || (kind != 0 && kind != 1) || k < 1
        || params.len != (kind == 0 ? 3 : k) * (Py_ssize_t)sizeof(double) || m >= ((Py_ssize_t)1 << 32)
        || key_lo.len != NUM_BUCKETS * (Py_ssize_t)sizeof(double) || key_hi.len != key_lo.len) {
        PyErr_SetString(PyExc_ValueError, "split_row: float32 keys, q and p rows of one dtype and length, a law "
                        "(kind 0: 3 constants, kind 1: K), float64 key bounds of every bucket");
        goto done;
    }
    RankLaw law = {kind, k, params.buf};
    /* per bucket: q-mass, p-mass, q-mass below, and the unsettled flag (1.0) */
    mass = PyMem_RawCalloc(4 * NUM_BUCKETS, sizeof(double));
    if (mass == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    double *mass_q = mass, *mass_p = mass + NUM_BUCKETS, *below = mass + 2 * NUM_BUCKETS;
    double *unsettled = mass + 3 * NUM_BUCKETS;
    const int32_t *bits = key.buf;
    int32_t low_bucket = NUM_BUCKETS, high_bucket = 0;
#define ROW_AT(view, x) (rows_double ? ((const double *)(view).buf)[x] : (double)((const float *)(view).buf)[x])
    for (Py_ssize_t x = 0; x < m; x++) {
        int32_t b = bucket_of(bits[x]);
        mass_q[b] += ROW_AT(q, x);
        mass_p[b] += ROW_AT(p, x);
        if (b < low_bucket) low_bucket = b;
        if (b > high_bucket) high_bucket = b;
    }
    const double *lo = key_lo.buf, *hi = key_hi.buf;
    double running = 0.0, settled = 0.0, low_part = 0.0, high_part = 0.0;
    int any_unsettled = 0;
    for (int32_t b = low_bucket; b <= high_bucket; b++) {
        double mass_b = mass_q[b], target = mass_p[b];
        if (!(mass_b + target > 0.0)) continue;
        double below_b = running;
        below[b] = below_b;
        running += mass_b;
        double r_low, r_high;
        ratio_bounds(&law, below_b, below_b + mass_b, &r_low, &r_high);
        int positive = (scale * lo[b] >= r_high) | (mass_b == 0.0);
        int zero = (scale * hi[b] <= r_low) & !positive;  /* (0 * inf is nan: compares false) */
        double s_target = scale * target;
        double net = s_target - law_of(&law, below_b, mass_b);
        settled += positive ? net : 0.0;
        if (!positive && !zero) {
            unsettled[b] = 1.0;
            any_unsettled = 1;
            low_part += net > 0.0 ? net : 0.0;
            high_part += s_target;
        }
    }
    double exact_part = NAN;
    if (exact) {
        exact_part = 0.0;
        if (any_unsettled) {
            /* the unsettled buckets' tokens, worst first (key ascending, ties by the larger index: the
             * buckets are runs of that order), each with its exact W: the bucket's below plus the mass of
             * the worse tokens in it, from one running sum over all of them (numpy's cumsum) */
            Py_ssize_t count = 0;
            /* 2 m packed values, m member ids, m member keys */
            packed = PyMem_RawMalloc((size_t)(m > 0 ? m : 1) * (3 * sizeof(uint64_t) + sizeof(float)));
            if (packed == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            uint64_t *member_ids = packed + 2 * m;
            float *member_keys = (float *)(packed + 3 * m);
            const float *keys = key.buf;
            for (Py_ssize_t x = 0; x < m; x++) {
                int32_t b = bucket_of(bits[x]);
                if (unsettled[b] != 0.0) {
                    member_keys[count] = keys[x];
                    member_ids[count++] = (uint64_t)x;
                }
            }
            worst_first(member_keys, count, packed, packed + count);
            double csum = 0.0, seg_csum = 0.0, seg_q = 0.0;
            int32_t seg_bucket = -1;
            for (Py_ssize_t i = 0; i < count; i++) {
                Py_ssize_t x = member_ids[(Py_ssize_t)(0xFFFFFFFFu - (uint32_t)(packed[i] & 0xFFFFFFFFu))];
                int32_t b = bucket_of(bits[x]);
                double q_x = ROW_AT(q, x);
                csum += q_x;
                if (b != seg_bucket) {  /* the first (worst) token of its bucket */
                    seg_bucket = b;
                    seg_csum = csum;
                    seg_q = q_x;
                }
                double within = csum - q_x - (seg_csum - seg_q);
                double term = scale * ROW_AT(p, x) - law_of(&law, below[b] + within, q_x);
                exact_part += term > 0.0 ? term : 0.0;
            }
        }
    }
#undef ROW_AT
    result = Py_BuildValue("dddd", settled, settled + low_part, settled + high_part, exact_part);
done:
    PyMem_RawFree(mass);
    PyMem_RawFree(packed);
    PyBuffer_Release(&key);
    PyBuffer_Release(&q);
    PyBuffer_Release(&p);
    PyBuffer_Release(&params);
    PyBuffer_Release(&key_lo);
    PyBuffer_Release(&key_hi);
    return result;
}

/* gbv.verify.ranking.residual_row at one node of a rank law: BV's correction distribution
 * norm((w p - law)+), written into the float64 out (V entries, 0 off the candidates); returns its total
 * before normalising (the caller falls back to p where it is not > 0: round-off only). The candidates
 * are the tokens whose float32 key exceeds r_min / w lowered by margin (compared in float32, the
 * threshold rounded to float32: numpy's comparison of a float32 row with a Python float), r_min the
 * law's ratio at W = 0; only they are ranked (worst_first), their W the others' q-mass plus their own
 * ranks' (the others' mass in four running sums: numpy's masked sum to rounding; the terms' total in
 * order: numpy's pairwise sum to rounding). One call for about twenty numpy calls and a sort. */
static PyObject *residual_dist(PyObject *self, PyObject *args) {
    Py_buffer key, q, p, params, out;
    int q_double, kind;
    double w, margin;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*y*py*ddiny*w*", &key, &q, &q_double, &p, &w, &margin, &kind, &k, &params, &out))
        return NULL;
    PyObject *result = NULL;
    uint64_t *packed = NULL;
    Py_ssize_t m = key.len / (Py_ssize_t)sizeof(float);
    Py_ssize_t q_width = q_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    if (q.len != m * q_width || p.len != m * (Py_ssize_t)sizeof(float) || m >= ((Py_ssize_t)1 << 32)
        || out.len != m * (Py_ssize_t)sizeof(double) || (kind != 0 && kind != 1) || k < 1
        || params.len != (kind == 0 ? 3 : k) * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "residual_dist: float32 keys and p, float32 or float64 q, a float64 out, "
                        "all of one length V; a law (kind 0: 3 constants, kind 1: K)");
        goto done;
    }
    RankLaw law = {kind, k, params.buf};
    double r_min, r_unused;
    ratio_bounds(&law, 0.0, 1.0, &r_min, &r_unused);
    double threshold = w > 0.0 ? r_min / w * (1.0 - margin) : INFINITY;
    /* per token: packed order values (2 m), then candidate ids (m), candidate keys (m floats) */
    packed = PyMem_RawMalloc((size_t)(m > 0 ? m : 1) * (3 * sizeof(uint64_t) + sizeof(float)));
    if (packed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *ids = packed + 2 * m;
    float *cand_keys = (float *)(packed + 3 * m);
    const float *keys = key.buf, *p_row = p.buf;
    const float limit = (float)threshold;
    double *dist = out.buf;
    double outside[4] = {0.0, 0.0, 0.0, 0.0};
    Py_ssize_t count = 0;
    for (Py_ssize_t x = 0; x < m; x++) {
        double q_x = q_double ? ((const double *)q.buf)[x] : (double)((const float *)q.buf)[x];
        dist[x] = 0.0;
        if (keys[x] > limit) {
            ids[count] = (uint64_t)x;
            cand_keys[count++] = keys[x];
        } else {
            outside[x & 3] += q_x;
        }
    }
    double others = (outside[0] + outside[1]) + (outside[2] + outside[3]);
    worst_first(cand_keys, count, packed, packed + count);
    /* dist holds each candidate's W (the others' mass + the running sum of the worse candidates'), then
     * its term */
    double running = 0.0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t x = (Py_ssize_t)ids[(Py_ssize_t)(0xFFFFFFFFu - (uint32_t)(packed[i] & 0xFFFFFFFFu))];
        double q_x = q_double ? ((const double *)q.buf)[x] : (double)((const float *)q.buf)[x];
        double term = w * (double)p_row[x] - law_of(&law, running + others, q_x);
        dist[x] = term > 0.0 ? term : 0.0;
        running += q_x;
    }
    double total = 0.0;
    for (Py_ssize_t i = 0; i < count; i++) total += dist[ids[i]];
    if (total > 0.0)
        for (Py_ssize_t i = 0; i < count; i++) dist[ids[i]] /= total;
    result = PyFloat_FromDouble(total);
done:
    PyMem_RawFree(packed);
    PyBuffer_Release(&key);
    PyBuffer_Release(&q);
    PyBuffer_Release(&p);
    PyBuffer_Release(&params);
    PyBuffer_Release(&out);
    return result;
}

static int node_lams(const float *p_row, const float *q_row, float *keys, Py_ssize_t m, Py_ssize_t paths, double cut,
                     double *lams) {
    /* adaptive_node's work (below), into lams[0 .. 64]; 0, or -1 with an exception set */
    double *rows = NULL, *work = NULL;
    uint64_t *packed = NULL;
    int failed = 0;
    const Py_ssize_t support = keys_and_support(p_row, q_row, keys, m, cut);
    for (int n = 0; n < 65; n++) lams[n] = 0.0;
    if (paths >= 2) {
        int sharp = 2 * support < m;
        Py_ssize_t size = sharp ? support : (m < NUM_BUCKETS ? m : NUM_BUCKETS);
        rows = PyMem_RawMalloc((size_t)(3 * size + 1) * sizeof(double));
        work = PyMem_RawMalloc((size_t)(4 * size + 1) * sizeof(double));
        if (sharp)  /* the sort's packed values and scratch, and the cut tokens' keys */
            packed = PyMem_RawMalloc((size_t)(2 * support + 1) * sizeof(uint64_t)
                                     + (size_t)(support + 1) * sizeof(float));
        if (rows == NULL || work == NULL || (sharp && packed == NULL)) {
            PyErr_NoMemory();
            goto fail;
        }
        double *row_p = rows, *row_q = rows + size, *below = rows + 2 * size;
        Py_ssize_t count = 0;
        if (sharp) {  /* the tokens of non-negligible q, exact ranks among them */
            float *cut_keys = (float *)(packed + 2 * support + 1);
            count = gather_support(p_row, q_row, keys, m, cut, row_p, row_q, cut_keys);
            worst_first(cut_keys, count, packed, packed + count);
            double running = 0.0;
            for (Py_ssize_t i = 0; i < count; i++) {
                Py_ssize_t c = (Py_ssize_t)(0xFFFFFFFFu - (uint32_t)(packed[i] & 0xFFFFFFFFu));
                below[c] = running;
                running += row_q[c];
            }
        } else {  /* flat: the occupied key buckets stand for the tokens */
            double *mass = PyMem_RawCalloc(2 * NUM_BUCKETS, sizeof(double));
            if (mass == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            double *mass_q = mass, *mass_p = mass + NUM_BUCKETS, running = 0.0;
            int32_t low = NUM_BUCKETS, high = 0;
            const int32_t *bits = (const int32_t *)keys;
            for (Py_ssize_t x = 0; x < m; x++) {
                int32_t b = bucket_of(bits[x]);
                mass_q[b] += (double)q_row[x];
                mass_p[b] += (double)p_row[x];
                if (b < low) low = b;
                if (b > high) high = b;
            }
            for (int32_t b = low; b <= high; b++) {
                if (mass_q[b] + mass_p[b] > 0.0) {
                    row_q[count] = mass_q[b];
                    row_p[count] = mass_p[b];
                    below[count++] = running;
                    running += mass_q[b];
                }
            }
            PyMem_RawFree(mass);
        }
        weights_core(row_p, row_q, below, count, paths, lams, work);
    }
    goto done;
fail:
    failed = 1;
done:
    PyMem_RawFree(rows);
    PyMem_RawFree(work);
    PyMem_RawFree(packed);
    return failed ? -1 : 0;
}

/* gbv_adaptive's per-node work before its coin, from V = BUCKET_MIN_VOCAB up: the node's float32 keys
 * (ranking_key of float32 rows) into key_out, and host_node_weights' weights: a sharp row (fewer than
 * V / 2 tokens with q > cut) cut to those tokens and ranked exactly among them (mass_below_among's
 * order and sums), else the occupied key buckets (bucket_masses' sums); then the weight search. The
 * same inputs to the search as the numpy code, so the same weights as node_weights on them. */
static PyObject *adaptive_node(PyObject *self, PyObject *args) {
    Py_buffer p, q, key_out;
    Py_ssize_t paths;
    double cut;
    if (!PyArg_ParseTuple(args, "y*y*w*nd", &p, &q, &key_out, &paths, &cut)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t m = p.len / (Py_ssize_t)sizeof(float);
    double lams[65];
    if (q.len != p.len || key_out.len != p.len || m < 1 || m >= ((Py_ssize_t)1 << 32) || paths < 1 || paths > 64)
        PyErr_SetString(PyExc_ValueError, "adaptive_node: float32 p, q and key rows of one length, 1 <= K <= 64");
    else if (node_lams(p.buf, q.buf, key_out.buf, m, paths, cut, lams) == 0)
        result = float_list(lams, paths + 1 > 2 ? paths + 1 : 2);
    PyBuffer_Release(&p);
    PyBuffer_Release(&q);
    PyBuffer_Release(&key_out);
    return result;
}

/* gbv_adaptive's per-node work after its coin, in the Python code's float operations and order (the
 * same bits): the chosen token's W (mass_below_at's masked sum), its q and p, the on-path law q_A(s) =
 * q_s sum_n a(n) (lam_n S_n(W + q_s, W) + 1 - lam_n) (Python's sum from 0 over the n with a(n) > 0),
 * and update_counts' new a(k) (binomials exact in 64 bits, then rounded to double as Python's
 * int * float; pow as Python's float ** int). counts and lams: K + 1 floats each (index 0 unused), K <= 32.
 * Returns (W, q_s, p_s, q_A(s), counts). */
/* adaptive_step's arithmetic (below) on C arrays: counts[0 .. K] updated in place; the chosen token's W,
 * q, p and law into the four outputs. */
static void step_core(const float *keys, const float *q32, const double *q64, const float *p32, Py_ssize_t m,
                      Py_ssize_t chosen, Py_ssize_t paths, double *counts, const double *lams, double *below_out,
                      double *q_out, double *p_out, double *law_out) {
    double fresh[64];
    for (Py_ssize_t n = 0; n <= paths; n++) fresh[n] = 0.0;
    double below_s = masked_sum(keys, NULL, q32, q64, m, chosen, keys[chosen]);
    double q_s = q64 != NULL ? q64[chosen] : (double)q32[chosen], p_s = (double)p32[chosen];
    double ratio = 0.0;
    for (Py_ssize_t n = 1; n <= paths; n++)
        if (counts[n] > 0.0)
            ratio += counts[n] * (lams[n] * power_sum(below_s + q_s, below_s, n) + (1.0 - lams[n]));
    for (Py_ssize_t n = 1; n <= paths; n++) {
        if (counts[n] == 0.0) continue;
        double lam = lams[n];
        uint64_t comb_n = 1, comb_n1 = 1;  /* C(n, k) and C(n - 1, k - 1), from k = 1 up */
        comb_n = (uint64_t)n;
        for (Py_ssize_t k = 1; k <= n; k++) {
            if (k > 1) {
                comb_n = comb_n * (uint64_t)(n - k + 1) / (uint64_t)k;
                comb_n1 = comb_n1 * (uint64_t)(n - k + 1) / (uint64_t)(k - 1);
            }
            double kg = (double)comb_n * pow(q_s, (double)k) * pow(below_s, (double)(n - k));
            double ku = (double)comb_n1 * pow(q_s, (double)k) * pow(1.0 - q_s, (double)(n - k));
            fresh[k] += counts[n] * (lam * kg + (1.0 - lam) * ku);
        }
    }
    double total = 0.0;
    for (Py_ssize_t n = 0; n <= paths; n++) total += fresh[n];
    if (total > 0.0)
        for (Py_ssize_t n = 0; n <= paths; n++) counts[n] = fresh[n] / total;
    *below_out = below_s;
    *q_out = q_s;
    *p_out = p_s;
    *law_out = q_s * ratio;
}

static PyObject *adaptive_step(PyObject *self, PyObject *args) {
    Py_buffer key, q, p;
    int q_double;
    Py_ssize_t chosen;
    PyObject *counts_in, *lams_in;
    if (!PyArg_ParseTuple(args, "y*y*py*nOO", &key, &q, &q_double, &p, &chosen, &counts_in, &lams_in)) return NULL;
    PyObject *result = NULL, *counts_seq = NULL, *lams_seq = NULL;
    Py_ssize_t m = key.len / (Py_ssize_t)sizeof(float);
    Py_ssize_t q_width = q_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    counts_seq = PySequence_Fast(counts_in, "adaptive_step: counts must be a sequence");
    lams_seq = PySequence_Fast(lams_in, "adaptive_step: lams must be a sequence");
    if (counts_seq == NULL || lams_seq == NULL) goto done;
    Py_ssize_t paths = PySequence_Fast_GET_SIZE(counts_seq) - 1;
    if (q.len != m * q_width || p.len != m * (Py_ssize_t)sizeof(float) || chosen < 0 || chosen >= m || paths < 1
        || paths > 32 || PySequence_Fast_GET_SIZE(lams_seq) != paths + 1) {
        PyErr_SetString(PyExc_ValueError, "adaptive_step: float32 key and p rows, a float32 or float64 q row of one "
                        "length, a token in the row, K + 1 counts and weights, 1 <= K <= 32");
        goto done;
    }
    double counts[64], lams[64];
    for (Py_ssize_t n = 0; n <= paths; n++) {
        counts[n] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(counts_seq, n));
        lams[n] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(lams_seq, n));
    }
    if (PyErr_Occurred()) goto done;
    double below_s, q_s, p_s, law_s;
    step_core(key.buf, q_double ? NULL : q.buf, q_double ? q.buf : NULL, p.buf, m, chosen, paths, counts, lams,
              &below_s, &q_s, &p_s, &law_s);
    PyObject *updated = float_list(counts, paths + 1);
    if (updated == NULL) goto done;
    result = Py_BuildValue("ddddN", below_s, q_s, p_s, law_s, updated);
done:
    Py_XDECREF(counts_seq);
    Py_XDECREF(lams_seq);
    PyBuffer_Release(&key);
    PyBuffer_Release(&q);
    PyBuffer_Release(&p);
    return result;
}

/* gbv_adaptive's whole top-down selection in one call (verify_gbv_adaptive's loop, its float operations in its
 * order: the same bits): at each depth the lead path's node (adaptive_node: keys into key_rows[depth] and
 * the weights), the candidates' best-ranked token (largest key, ties -> smaller id) against the lead's,
 * taken with probability lam_n (n = paths alive) by accept(lam) where they differ (the caller's random
 * source, as choose_next calls it), the survivors, and adaptive_step's law and counts. q (K, L, V) and
 * p (K, L + 1, V) float32, tokens (K, L) int64, 2 <= K <= 32. Returns (path, leads, counts rows, weight
 * rows, law on path, p on path) as the loop builds them. Why: the loop's ~10 Python calls a depth ran
 * from a cold cache right after the forward, ~30 us a verify at K = 3, L = 4. */
static PyObject *adaptive_select(PyObject *self, PyObject *args) {
    Py_buffer q, p, tokens_buffer, key_rows;
    Py_ssize_t paths, length, m;
    double cut;
    PyObject *accept;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnndO", &q, &p, &tokens_buffer, &key_rows, &paths, &length, &m, &cut,
                          &accept))
        return NULL;
    PyObject *result = NULL, *leads = NULL, *counts_rows = NULL, *lams_rows = NULL, *law_on = NULL, *p_on = NULL;
    const long long *tokens = tokens_buffer.buf;
    if (paths < 2 || paths > 32 || length < 1 || m < 1 || m >= ((Py_ssize_t)1 << 32) ||
        q.len != paths * length * m * (Py_ssize_t)sizeof(float) ||
        p.len != paths * (length + 1) * m * (Py_ssize_t)sizeof(float) ||
        tokens_buffer.len != paths * length * (Py_ssize_t)sizeof(long long) ||
        key_rows.len != length * m * (Py_ssize_t)sizeof(float) || !PyCallable_Check(accept)) {
        PyErr_SetString(PyExc_ValueError, "adaptive_select: float32 q (K, L, V) and p (K, L + 1, V), int64 tokens "
                        "(K, L), float32 key rows (L, V), 2 <= K <= 32, and a callable accept");
        goto done;
    }
    for (Py_ssize_t i = 0; i < paths * length; i++)
        if (tokens[i] < 0 || tokens[i] >= m) {
            PyErr_SetString(PyExc_ValueError, "adaptive_select: a drafted token outside the vocabulary");
            goto done;
        }
    leads = PyList_New(0), counts_rows = PyList_New(0), lams_rows = PyList_New(0);
    law_on = PyList_New(0), p_on = PyList_New(0);
    if (leads == NULL || counts_rows == NULL || lams_rows == NULL || law_on == NULL || p_on == NULL) goto done;
    Py_ssize_t alive[32], alive_count = paths;
    for (Py_ssize_t k = 0; k < paths; k++) alive[k] = k;
    double counts[64] = {0.0}, lams[65];
    counts[paths] = 1.0;
    for (Py_ssize_t depth = 0; depth < length; depth++) {
        const Py_ssize_t lead = alive[0];
        const float *q_row = (const float *)q.buf + (lead * length + depth) * m;
        const float *p_row = (const float *)p.buf + (lead * (length + 1) + depth) * m;
        float *keys = (float *)key_rows.buf + depth * m;
        if (node_lams(p_row, q_row, keys, m, paths, cut, lams) != 0) goto done;
        /* choose_next: the best-ranked candidate, against the lead's token */
        long long first = tokens[lead * length + depth], best = first;
        float best_key = keys[first];
        for (Py_ssize_t i = 1; i < alive_count; i++) {
            long long token = tokens[alive[i] * length + depth];
            if (keys[token] > best_key || (keys[token] == best_key && token < best)) {
                best = token;
                best_key = keys[token];
            }
        }
        long long chosen = best;
        if (best != first) {
            PyObject *prob = PyFloat_FromDouble(lams[alive_count]);
            PyObject *answer = prob == NULL ? NULL : PyObject_CallOneArg(accept, prob);
            Py_XDECREF(prob);
            if (answer == NULL) goto done;
            const int taken = PyObject_IsTrue(answer);
            Py_DECREF(answer);
            if (taken < 0) goto done;
            chosen = taken ? best : first;
        }
        Py_ssize_t survivors = 0;
        for (Py_ssize_t i = 0; i < alive_count; i++)
            if (tokens[alive[i] * length + depth] == chosen) alive[survivors++] = alive[i];
        alive_count = survivors;
        PyObject *lead_item = PyLong_FromSsize_t(lead), *counts_item = float_list(counts + 1, paths),
                 *lams_item = float_list(lams + 1, paths);
        int appended = lead_item != NULL && counts_item != NULL && lams_item != NULL &&
                       PyList_Append(leads, lead_item) == 0 && PyList_Append(counts_rows, counts_item) == 0 &&
                       PyList_Append(lams_rows, lams_item) == 0;
        Py_XDECREF(lead_item);
        Py_XDECREF(counts_item);
        Py_XDECREF(lams_item);
        if (!appended) goto done;
        double below_s, q_s, p_s, law_s;
        step_core(keys, q_row, NULL, p_row, m, (Py_ssize_t)chosen, paths, counts, lams, &below_s, &q_s, &p_s, &law_s);
        PyObject *law_item = PyFloat_FromDouble(law_s), *p_item = PyFloat_FromDouble(p_s);
        appended = law_item != NULL && p_item != NULL && PyList_Append(law_on, law_item) == 0 &&
                   PyList_Append(p_on, p_item) == 0;
        Py_XDECREF(law_item);
        Py_XDECREF(p_item);
        if (!appended) goto done;
    }
    result = Py_BuildValue("nOOOOO", alive[0], leads, counts_rows, lams_rows, law_on, p_on);
done:
    Py_XDECREF(leads);
    Py_XDECREF(counts_rows);
    Py_XDECREF(lams_rows);
    Py_XDECREF(law_on);
    Py_XDECREF(p_on);
    PyBuffer_Release(&q);
    PyBuffer_Release(&p);
    PyBuffer_Release(&tokens_buffer);
    PyBuffer_Release(&key_rows);
    return result;
}

/* (w p - q)+ of one float32 row pair into row, and its sum (four running sums, token x into sum x mod 4). */
static double positive_part_row32(const float *p_row, const float *q_row, double w, double *row, Py_ssize_t m) {
    double sum[4] = {0.0, 0.0, 0.0, 0.0};
    for (Py_ssize_t x = 0; x < m; x++) {
        double d = w * (double)p_row[x] - (double)q_row[x];
        row[x] = d > 0.0 ? d : 0.0;
        sum[x & 3] += row[x];
    }
    return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

/* gbv.verify.block.positive_part_and_sum: (w p - q)+ of one node's rows in float64 (p float32, q float32 or
 * float64: the numpy code's values, term for term) into out; returns their sum (four running sums: numpy's
 * pairwise sum to rounding). One pass for four numpy passes and their allocations, and the sum. */
static PyObject *positive_part(PyObject *self, PyObject *args) {
    Py_buffer p, q, out;
    int q_double;
    double w;
    if (!PyArg_ParseTuple(args, "y*y*pdw*", &p, &q, &q_double, &w, &out)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t m = p.len / (Py_ssize_t)sizeof(float);
    Py_ssize_t q_width = q_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    if (q.len != m * q_width || out.len != m * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "positive_part: a float32 p row, a float32 or float64 q row and a float64 "
                        "out, of one length");
        goto done;
    }
    const float *p_row = p.buf;
    double *row = out.buf, total;
    if (q_double) {
        double sum[4] = {0.0, 0.0, 0.0, 0.0};
        const double *q_row = q.buf;
        for (Py_ssize_t x = 0; x < m; x++) {
            double d = w * (double)p_row[x] - q_row[x];
            row[x] = d > 0.0 ? d : 0.0;
            sum[x & 3] += row[x];
        }
        total = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    } else {
        total = positive_part_row32(p_row, q.buf, w, row, m);
    }
    result = PyFloat_FromDouble(total);
done:
    PyBuffer_Release(&p);
    PyBuffer_Release(&q);
    PyBuffer_Release(&out);
    return result;
}

/* One uniform from the random source's bound method ``uniform`` (TorchRandom.uniform): the same stream
 * as the numpy code's rng.accept / rng.sample draws, one at a time and only where they draw one. */
static int next_uniform(PyObject *uniform, double *u) {
    PyObject *value = PyObject_CallNoArgs(uniform);
    if (value == NULL) return -1;
    *u = PyFloat_AsDouble(value);
    Py_DECREF(value);
    return (*u == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* row / total in place, then draw_index's rule on it: the division fused into the pass of the total
 * (the same quotients, summed in the same order). */
static Py_ssize_t draw_normalized(double *row, double total, Py_ssize_t m, double u, double below_one) {
    double sum = 0.0, running = 0.0;
    for (Py_ssize_t x = 0; x < m; x++) {
        row[x] /= total;
        sum += row[x];
    }
    double point = u * (sum * below_one);
    for (Py_ssize_t x = 0; x < m - 1; x++) {
        running += row[x];
        if (running > point) return x;
    }
    return m - 1;
}

/* python's min(1.0, value): 1.0 unless value < 1.0 (so a NaN gives 1.0, as in the numpy code). */
static double min_one(double value) { return value < 1.0 ? value : 1.0; }

/* block.block_verify_host (block = 1) or token.token_verify_host (block = 0) on one path of float32
 * rows, whole: the on-path ratios, BV's weights, the stop coins (or token-level's accept coins), the
 * residual masses they need, the correction row (into out, float64) and the draw of the next token,
 * with uniforms from ``uniform`` wherever the numpy code draws one (rng.accept draws none for a
 * probability <= 0 or >= 1; BV's rng.accept_within none where its upper bound is 0). Why: the numpy
 * form is ~25 Python, numpy and torch calls, each from a cold cache right after the target's forward
 * (0.15-0.2 ms a call here); this is one.
 *
 * The same results as the numpy code, bit for bit: the same float64 ratios and weights, the same
 * positive_part sums, the same draws. BV's coin at a node with w_i < 1 answers "no stop" for u >= the
 * upper bound stop_prob(w_i sum p_i (1 + margin)) and else compares u with h_i from the exact residual
 * mass, as the numpy code does; sum p_i runs in another order here, but both bounds are >= h_i (the
 * margin covers the rounding of the sums), so no coin decides otherwise. */
static PyObject *single_path(PyObject *self, PyObject *args) {
    Py_buffer q, p, tokens, out;
    Py_ssize_t L, V;
    int block;
    PyObject *uniform;
    double margin, below_one;
    if (!PyArg_ParseTuple(args, "y*y*y*nnpOw*dd", &q, &p, &tokens, &L, &V, &block, &uniform, &out, &margin,
                          &below_one))
        return NULL;
    PyObject *result = NULL;
    double *weights = NULL;
    if (L < 1 || V < 1 || q.len != L * V * (Py_ssize_t)sizeof(float) ||
        p.len != (L + 1) * V * (Py_ssize_t)sizeof(float) || tokens.len != L * (Py_ssize_t)sizeof(int64_t) ||
        out.len != V * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "single_path: float32 q (L, V) and p (L + 1, V), int64 tokens (L,) and a "
                        "float64 out (V,), contiguous");
        goto done;
    }
    const float *q_rows = q.buf, *p_rows = p.buf;
    const int64_t *drafted = tokens.buf;
    double *row = out.buf;
    weights = PyMem_Malloc((size_t)(L + 1) * sizeof(double));
    if (weights == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* on_path_host's ratios p_{i-1}(x_i) / q_{i-1}(x_i) in float64 (inf where only q is 0, 0 for 0 / 0);
     * BV's weights w_i = min(1, w_{i-1} ratio_i), w_0 = 1 (token-level sampling: min(1, ratio_i)). */
    weights[0] = 1.0;
    for (Py_ssize_t i = 1; i <= L; i++) {
        int64_t x = drafted[i - 1];
        if (x < 0 || x >= V) {
            PyErr_SetString(PyExc_ValueError, "single_path: a drafted token outside the vocabulary");
            goto done;
        }
        double pp = (double)p_rows[(i - 1) * V + x], qq = (double)q_rows[(i - 1) * V + x];
        double ratio = qq > 0.0 ? pp / qq : (pp > 0.0 ? INFINITY : 0.0);
        weights[i] = min_one(block ? weights[i - 1] * ratio : ratio);
    }
    Py_ssize_t tau = 0;  /* the accepted length */
    double u;
    int have_row = 0;    /* row holds (w_tau p_tau - q_tau)+ and total its sum */
    double total = 0.0;
    if (block) {
        /* The stop coins from i = L down: h_L = w_L (rng.accept), then h_i = r_i / (r_i + (1 - w_i)). */
        int stop = 0;
        double w = weights[L];
        if (w >= 1.0) stop = 1;
        else if (w > 0.0) {
            if (next_uniform(uniform, &u) < 0) goto done;
            stop = u < w;
        }
        if (stop) tau = L;
        for (Py_ssize_t i = L - 1; i >= 1 && !stop; i--) {
            w = weights[i];
            if (!(w < 1.0)) {  /* w_i = 1: h_i = 1, rng.accept(1.0) draws nothing */
                stop = 1;
                tau = i;
                break;
            }
            if (w <= 0.0) continue;  /* upper bound 0: rng.accept_within draws nothing */
            const float *p_row = p_rows + i * V;
            double mass[4] = {0.0, 0.0, 0.0, 0.0};
            for (Py_ssize_t x = 0; x < V; x++) mass[x & 3] += (double)p_row[x];
            double bound = w * ((mass[0] + mass[1]) + (mass[2] + mass[3])) * (1.0 + margin);
            if (bound <= 0.0) continue;  /* (p_i = 0: the bound is 0 too) */
            if (next_uniform(uniform, &u) < 0) goto done;
            /* The bound first, as the numpy form: no stop for u >= h(bound) >= h_i, without the exact
             * mass (its sum of p runs in another order; the margin covers the difference). */
            double bound_denom = bound + (1.0 - w);
            if (bound_denom > 0.0 && u >= bound / bound_denom) continue;
            total = positive_part_row32(p_row, q_rows + i * V, w, row, V);
            double denom = total + (1.0 - w);
            double h = denom <= 0.0 ? 1.0 : total / denom;
            if (u < h) {
                stop = 1;
                tau = i;
                have_row = 1;
            }
        }
    } else {
        while (tau < L) {  /* rng.accept(min(1, ratio)) per drafted token, until the first rejection */
            double prob = weights[tau + 1];
            int accepted = 1;
            if (!(prob >= 1.0)) {
                if (prob <= 0.0) accepted = 0;
                else {
                    if (next_uniform(uniform, &u) < 0) goto done;
                    accepted = u < prob;
                }
            }
            if (!accepted) break;
            tau++;
        }
    }
    Py_ssize_t next;
    if (tau == L) {  /* the whole block: the bonus token from p_L */
        if (next_uniform(uniform, &u) < 0) goto done;
        next = draw_index(p_rows + L * V, 0, V, u, below_one);
    } else {  /* norm((w_tau p_tau - q_tau)+), or p_tau where it has no mass (normalized_or) */
        double w = block ? weights[tau] : 1.0;
        if (!have_row) total = positive_part_row32(p_rows + tau * V, q_rows + tau * V, w, row, V);
        if (next_uniform(uniform, &u) < 0) goto done;
        next = total <= 0.0 ? draw_index(p_rows + tau * V, 0, V, u, below_one)
                            : draw_normalized(row, total, V, u, below_one);
    }
    result = Py_BuildValue("nn", tau, next);
done:
    PyMem_Free(weights);
    PyBuffer_Release(&q);
    PyBuffer_Release(&p);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&out);
    return result;
}

/* gbv.verify.spectr._smallest_rho on one node's rows (float32 or float64 together): the smallest rho in
 * [1, k] with rho beta(rho) >= 1 - (1 - beta(rho))^k, to RHO_TOLERANCE, as the numpy code finds it: the
 * breakpoints t = p / q in (1, k) sorted, f at each, the first segment where f >= 0, its closed form or
 * a bisection on it. The same steps on the same float64 values; the sums run in order (numpy's are
 * pairwise), so the value agrees to rounding. Any rho where the inequality holds keeps SpecTr lossless. */
typedef struct {
    double t, p, q;
} Breakpoint;

static inline void swap_breakpoints(Breakpoint *a, Breakpoint *b) {
    Breakpoint tmp = *a;
    *a = *b;
    *b = tmp;
}

static inline double median_of_three(double a, double b, double c) {
    if (a > b) { double tmp = a; a = b; b = tmp; }
    if (b > c) b = c;
    return a > b ? a : b;
}

/* f(t) = (1 - g / t)^k + g - 1 at a breakpoint t, from g = (p-mass of the tokens with ratio <= t) +
 * t (q-mass of those above), the K-SEQ inequality's excess there; nondecreasing in t. */
static inline double kseq_excess_at(double t, double mass_p_below, double mass_q_above, Py_ssize_t k) {
    double g = mass_p_below + t * mass_q_above;
    return pow(1.0 - g / t, (double)k) + g - 1.0;
}

static PyObject *spectr_rho(PyObject *self, PyObject *args) {
    Py_buffer p, q;
    int rows_double;
    Py_ssize_t k;
    double tolerance;
    Py_ssize_t max_steps;
    if (!PyArg_ParseTuple(args, "y*y*pndn", &p, &q, &rows_double, &k, &tolerance, &max_steps)) return NULL;
    PyObject *result = NULL;
    Breakpoint *inside = NULL;
    Py_ssize_t width = rows_double ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float);
    Py_ssize_t m = p.len / width;
    if (q.len != p.len || p.len != m * width) {
        PyErr_SetString(PyExc_ValueError, "spectr_rho: p and q rows of one length and dtype (float32 or float64)");
        goto done;
    }
    double rho = 1.0;
    if (k <= 1) goto found;  /* f == 0 identically for k = 1 */
    inside = PyMem_RawMalloc((size_t)(m > 0 ? m : 1) * sizeof(Breakpoint));
    if (inside == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* One pass: beta(1) = sum min(p, q), and the tokens by their ratio t = p / q: t <= 1 (one sum, "low";
     * q > 0 and p <= q), t in (1, k) (the breakpoints), the rest (t >= k, or q = 0: never in (1, k),
     * nothing to beta). The sums in the order of before; no division where p <= q. */
    double beta1 = 0.0, p_low = 0.0, q_low = 0.0, q_total = 0.0, kk = (double)k;
    int any_low = 0;
    Py_ssize_t count = 0;
#define CLASSIFY(TYPE)                                                                  \
    {                                                                                   \
        const TYPE *pv = (const TYPE *)p.buf, *qv = (const TYPE *)q.buf;                \
        for (Py_ssize_t x = 0; x < m; x++) {                                            \
            double px = pv[x], qx = qv[x];                                              \
            beta1 += px < qx ? px : qx;                                                 \
            q_total += qx;                                                              \
            if (px <= qx) {                                                             \
                if (qx > 0.0) {                                                         \
                    p_low += px;                                                        \
                    q_low += qx;                                                        \
                    any_low = 1;                                                        \
                }                                                                       \
            } else {                                                                    \
                double t = px / qx; /* q = 0: +inf, never in (1, k) */                 \
                if (t < kk) {                                                           \
                    inside[count].t = t;                                                \
                    inside[count].p = px;                                               \
                    inside[count++].q = qx;                                             \
                }                                                                       \
            }                                                                           \
        }                                                                               \
    }
    if (rows_double) CLASSIFY(double) else CLASSIFY(float)
#undef CLASSIFY
    if (beta1 - 1.0 + pow(1.0 - beta1, kk) >= 0.0) goto found;  /* beta(1) is 0 or 1 */
    /* The root lies in (lo, hi]: hi = the smallest breakpoint in (1, k) where the inequality holds
     * (f(t) >= 0), else k; lo = the largest breakpoint below it. Found by selection rather than a sort
     * (a sort of the ~500-2,000 breakpoints of an engine row cost 50-280 us): partition the breakpoints
     * around a pivot, evaluate f there from the masses below it, and keep the side that holds the
     * answer. The breakpoints of [first, last) are those not yet placed; every breakpoint below them
     * is in mass_p_below / mass_q_below (with the low tokens), every one above is at or above hi. */
    double mass_p_below = p_low, mass_q_below = q_low, hi = kk, lo_bound = 0.0;
    int have_lo = 0;
    Py_ssize_t first = 0, last = count;
    while (first < last) {
        double pivot = median_of_three(inside[first].t, inside[first + (last - first) / 2].t, inside[last - 1].t);
        /* three-way partition: [first, less) < pivot, [less, more) == pivot, [more, last) > pivot */
        Py_ssize_t less = first, at = first, more = last;
        double p_upto = 0.0, q_upto = 0.0;  /* masses of the breakpoints <= pivot in [first, last) */
        while (at < more) {
            double t = inside[at].t;
            if (t < pivot) {
                p_upto += inside[at].p;
                q_upto += inside[at].q;
                swap_breakpoints(&inside[less++], &inside[at++]);
            } else if (t > pivot) {
                swap_breakpoints(&inside[at], &inside[--more]);
            } else {
                p_upto += inside[at].p;
                q_upto += inside[at].q;
                at++;
            }
        }
        double p_with = mass_p_below + p_upto, q_with = mass_q_below + q_upto;
        if (kseq_excess_at(pivot, p_with, q_total - q_with, k) >= 0.0) {
            hi = pivot;  /* the answer is the pivot or a breakpoint below it */
            last = less;
        } else {
            mass_p_below = p_with;  /* the pivot and everything below it are below the root */
            mass_q_below = q_with;
            lo_bound = pivot;
            have_lo = 1;
            first = more;
        }
    }
    double lo_t, b, a;
    if (have_lo) {
        lo_t = lo_bound;
        b = mass_p_below;
        a = q_total - mass_q_below;
    } else if (any_low) {
        /* the largest ratio <= 1: only needed here, so its divisions run only here */
        double low_max = -INFINITY;
#define LOW_MAX(TYPE)                                                                   \
        {                                                                               \
            const TYPE *pv = (const TYPE *)p.buf, *qv = (const TYPE *)q.buf;            \
            for (Py_ssize_t x = 0; x < m; x++) {                                        \
                double px = pv[x], qx = qv[x];                                          \
                if (qx > 0.0 && px <= qx && px / qx > low_max) low_max = px / qx;       \
            }                                                                           \
        }
        if (rows_double) LOW_MAX(double) else LOW_MAX(float)
#undef LOW_MAX
        lo_t = low_max;
        b = p_low;
        a = q_total - q_low;
    } else {
        lo_t = 0.0;
        b = 0.0;
        a = q_total;
    }
    double lo = lo_t > 1.0 ? lo_t : 1.0;
#define EXCESS(r) (a * (r) + b - 1.0 + pow(1.0 - a - b / (r), (double)k))
    if (b <= 0.0 && 0.0 < a) {  /* no target mass below the segment: f is linear there */
        double root = (1.0 - pow(1.0 - a, (double)k)) / a;
        if (lo <= root && root <= hi && EXCESS(root) >= 0.0) {
            rho = root;
            goto found;
        }
    }
    for (Py_ssize_t step = 0; step < max_steps; step++) {
        if (hi - lo <= tolerance * hi) break;
        double mid = 0.5 * (lo + hi);
        if (EXCESS(mid) >= 0.0) hi = mid;
        else lo = mid;
    }
#undef EXCESS
    rho = hi;
found:
    result = PyFloat_FromDouble(rho);
done:
    PyMem_RawFree(inside);
    PyBuffer_Release(&p);
    PyBuffer_Release(&q);
    return result;
}

static PyMethodDef METHODS[] = {
    {"set_simd", set_simd, METH_VARARGS,
     "set_simd(on) -> whether the AVX2 form of the masked sums runs from now on (tests compare both forms)."},
    {"node_weights", node_weights, METH_VARARGS,
     "node_weights(p64, q64, below, num_paths): gbv_adaptive.node_weights on C-contiguous float64 rows "
     "-> [0, 0, lam_2, ..., lam_K]."},
    {"adaptive_node", adaptive_node, METH_VARARGS,
     "adaptive_node(p32, q32, key_out32, num_paths, cut): gbv_adaptive's node keys into key_out and "
     "host_node_weights' weights -> [0, 0, lam_2, ..., lam_K]."},
    {"adaptive_select", adaptive_select, METH_VARARGS,
     "adaptive_select(q32, p32, tokens64, key_rows, K, L, V, cut, accept): gbv_adaptive's top-down selection in one "
     "call -> (path, leads, counts rows, weight rows, law on path, p on path)"},
    {"adaptive_step", adaptive_step, METH_VARARGS,
     "adaptive_step(key32, q, q_is_float64, p32, chosen, counts, lams): gbv_adaptive's node after its coin -> "
     "(W, q_s, p_s, on-path law, updated counts)."},
    {"spectr_rho", spectr_rho, METH_VARARGS,
     "spectr_rho(p, q, rows_are_float64, k, tolerance, max_steps): spectr._smallest_rho of one node's rows."},
    {"single_path", single_path, METH_VARARGS,
     "single_path(q32, p32, tokens64, L, V, block, uniform, out64, margin, below_one): block_verify_host (block) or "
     "token_verify_host on one path -> (accepted_len, next_token)."},
    {"positive_part", positive_part, METH_VARARGS,
     "positive_part(p32, q, q_is_float64, w, out64): block.positive_part_row into out -> its sum."},
    {"bucket_masses", bucket_masses, METH_VARARGS,
     "bucket_masses(key32, q64, p64, mass_q, mass_p, below[, ids64]): ranking.occupied_bucket_masses into the "
     "three float64 outputs (and the buckets' ids); returns the number of occupied buckets."},
    {"mass_below_among", mass_below_among, METH_VARARGS,
     "mass_below_among(key32, q64, out): ranking.mass_below_among of float32 keys into the float64 out."},
    {"draw_row", draw_row, METH_VARARGS,
     "draw_row(dist, is_float64, u, below_one): TorchRandom.sample's index for one contiguous row."},
    {"residual_dist", residual_dist, METH_VARARGS,
     "residual_dist(key32, q, q_is_float64, p32, w, margin, law_kind, K, law_constants64, out64): "
     "ranking.residual_row's distribution into out -> its total before normalising."},
    {"split_row", split_row, METH_VARARGS,
     "split_row(key32, q, p, rows_are_float64, scale, law_kind, K, law_constants64, key_lo, key_hi, exact): "
     "ranking's bucket split of one node's residual mass -> (settled, low, high, unsettled exact or nan)."},
    {"select_path", select_path, METH_VARARGS,
     "select_path(tokens64, q32, p32, K, L, L_p, V): gbv.select_path's index on contiguous float32 rows."},
    {"mass_below_keyed", mass_below_keyed, METH_VARARGS,
     "mass_below_keyed(p32, q32, tokens64, out, rows, V): mass_below_at of the keys ranking_key(p, q)."},
    {"mass_below_at", mass_below_at, METH_VARARGS,
     "mass_below_at(key32, q, q_is_float64, tokens64, out, rows, V): ranking.mass_below_array into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_verify_kernels", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__verify_kernels(void) { return PyModule_Create(&MODULE); }
