/* The verifiers' host-form helpers, compiled (plain C, no intrinsics: it builds on any CPU; optional,
 * see setup.py). Each replaces a piece of numpy code that is mostly fixed cost per call, and gives its
 * results: the same bits, or the same values up to rounding where the sums run in another order
 * (tests/verify/test_verify_kernels.py). gbv.verify.common.compiled_kernels switches them all.
 *
 * - node_weights: gbv-adaptive's weight search at one node (gbv_adaptive.node_weights). It finds the
 *   weight lam_n that maximises the one-step acceptance F(lam) = sum_x min(p_x, q_x + lam d_x),
 *   d = g_n - q, over a row cut to the tokens that matter (a sharp row's ~150 tokens, or a flat row's
 *   few hundred occupied key buckets). In numpy that was ~25 calls per node, 0.1-0.2 ms, 8 nodes an
 *   iteration, a fifth of gbv-adaptive's wall time on the bundled pair; here one pass per n and a
 *   selection of the crossing breakpoint (no sort of the row). Any weight keeps gbv-adaptive lossless
 *   (it is a function of the node's rows only).
 * - bucket_masses, mass_below_among, mass_below_at: gbv.verify.ranking's key-bucket masses, exact
 *   ranks among a few tokens, and masked sums of the q-mass ranked below a token.
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
/* Below this many breakpoints the crossing is found by an insertion sort and a running sum. */
#define SMALL 24

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

static PyObject *node_weights(PyObject *self, PyObject *args) {
    Py_buffer views[3];
    Py_ssize_t paths, m;
    if (!PyArg_ParseTuple(args, "y*y*y*n", &views[0], &views[1], &views[2], &paths)) return NULL;
    PyObject *result = NULL;
    double *work = NULL;
    if (!float64_rows(views, 3, &m)) goto done;
    const double *p = views[0].buf, *q = views[1].buf, *below = views[2].buf;
    result = PyList_New(paths + 1 > 2 ? paths + 1 : 2);
    if (result == NULL) goto done;
    PyList_SET_ITEM(result, 0, PyFloat_FromDouble(0.0));
    PyList_SET_ITEM(result, 1, PyFloat_FromDouble(0.0));
    if (paths < 2) goto done;
    work = PyMem_RawMalloc((size_t)(4 * m + 1) * sizeof(double));
    if (work == NULL) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
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
        double lam = slope > 0.0 ? crossing(t, w, count, slope) : 0.0;
        PyList_SET_ITEM(result, n, PyFloat_FromDouble(lam));
    }
done:
    PyMem_RawFree(work);
    for (int i = 0; i < 3; i++) PyBuffer_Release(&views[i]);
    return result;
}

/* gbv.verify.ranking.occupied_bucket_masses on float32 keys: the q- and p-mass of each key bucket,
 * summed in token order (bincount's order: the same bits), then over the occupied buckets (q + p > 0)
 * in increasing key order, the q-mass of the buckets below. Returns the number of occupied buckets B;
 * the first B entries of mass_q, mass_p and below hold them. */
static PyObject *bucket_masses(PyObject *self, PyObject *args) {
    Py_buffer key, rows[2], out[3];
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*", &key, &rows[0], &rows[1], &out[0], &out[1], &out[2])) return NULL;
    PyObject *result = NULL;
    double *mass = NULL;
    Py_ssize_t m = key.len / (Py_ssize_t)sizeof(float);
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
        int32_t bucket = bits[x] >> BUCKET_SHIFT;  /* (arithmetic shift: negative bits stay negative) */
        if (bucket < 0) bucket = 0;
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
    packed = PyMem_RawMalloc((size_t)(m > 0 ? m : 1) * sizeof(uint64_t));
    if (packed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const float *keys = key.buf;
    for (Py_ssize_t x = 0; x < m; x++) {
        float k = keys[x] + 0.0f;  /* -0.0 -> +0.0: equal keys, equal bits */
        int32_t bits;
        memcpy(&bits, &k, sizeof bits);
        bits ^= (bits >> 31) & 0x7FFFFFFF;  /* signed order of these = float order */
        uint32_t ordered = (uint32_t)bits ^ 0x80000000u;  /* and unsigned order */
        packed[x] = ((uint64_t)ordered << 32) | (uint32_t)(0xFFFFFFFFu - (uint32_t)x);
    }
    sort_u64(packed, m);
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
    double total = 0.0, running = 0.0;
    Py_ssize_t index = m - 1;
    if (is_double) {
        const double *row = dist.buf;
        for (Py_ssize_t x = 0; x < m; x++) total += row[x];
        double point = u * (total * below_one);
        for (Py_ssize_t x = 0; x < m - 1; x++) {
            running += row[x];
            if (running > point) {
                index = x;
                break;
            }
        }
    } else {
        const float *row = dist.buf;
        for (Py_ssize_t x = 0; x < m; x++) total += (double)row[x];
        double point = u * (total * below_one);
        for (Py_ssize_t x = 0; x < m - 1; x++) {
            running += (double)row[x];
            if (running > point) {
                index = x;
                break;
            }
        }
    }
    PyBuffer_Release(&dist);
    return PyLong_FromSsize_t(index);
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
        float k_y = k[y];
        /* Four running sums (index mod 4), added at the end: one chain of dependent additions would
         * cost an addition's latency per token. The test is a 0/1 factor, not a branch: random keys
         * made the branch mispredict half the time (slower than numpy's three passes). */
        double sum[4] = {0.0, 0.0, 0.0, 0.0};
        if (q_double) {
            const double *row = (const double *)q.buf + r * m;
            for (Py_ssize_t x = 0; x < m; x++) sum[x & 3] += (double)((k[x] < k_y) | ((k[x] == k_y) & (x > y))) * row[x];
        } else {
            const float *row = (const float *)q.buf + r * m;
            for (Py_ssize_t x = 0; x < m; x++)
                sum[x & 3] += (double)((k[x] < k_y) | ((k[x] == k_y) & (x > y))) * (double)row[x];
        }
        below[r] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
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

static PyMethodDef METHODS[] = {
    {"node_weights", node_weights, METH_VARARGS,
     "node_weights(p64, q64, below, num_paths): gbv_adaptive.node_weights on C-contiguous float64 rows "
     "-> [0, 0, lam_2, ..., lam_K]."},
    {"bucket_masses", bucket_masses, METH_VARARGS,
     "bucket_masses(key32, q64, p64, mass_q, mass_p, below): ranking.occupied_bucket_masses into the three "
     "float64 outputs; returns the number of occupied buckets."},
    {"mass_below_among", mass_below_among, METH_VARARGS,
     "mass_below_among(key32, q64, out): ranking.mass_below_among of float32 keys into the float64 out."},
    {"draw_row", draw_row, METH_VARARGS,
     "draw_row(dist, is_float64, u, below_one): TorchRandom.sample's index for one contiguous row."},
    {"mass_below_at", mass_below_at, METH_VARARGS,
     "mass_below_at(key32, q, q_is_float64, tokens64, out, rows, V): ranking.mass_below_array into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_verify_kernels", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__verify_kernels(void) { return PyModule_Create(&MODULE); }
