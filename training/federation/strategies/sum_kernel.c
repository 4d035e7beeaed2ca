/* Two loops over float32 values, compiled: the mean family's inner step, adding deltas' values (up to four at
 * a time), each times its weight, into the float64 sums of a block of coordinates (training/federation/strategies/flat.py,
 * flat_weighted_sum); and the sum of squares verification takes a delta's norm from
 * (training/federation/delta_contents.py).
 *
 * Each element is  sums[i] = sums[i] + weight * (double)values[i]:  the value widened to float64 (exact), the
 * product rounded to float64, the sum rounded to float64. Two roundings, never one fused multiply-add: the
 * build passes -ffp-contract=off (pyproject.toml), so the vectorised loop and any tail compute exactly what
 * numpy's multiply then add compute, which is flat.py's fallback when this module is not built. Workers with
 * and without it give the same bytes.
 *
 * Why compiled: torch's add_ of a float32 tensor into a float64 one, and numpy's multiply and add, each pass
 * over the block more than once in memory (a widened copy, then the addition); this loop reads each value once
 * and keeps the block's sums in the cache. bench/README.md ("Measured: the sum compiled") has the figures.
 *
 * The AVX2 version is chosen at load time where the CPU has it (GCC's target_clones), the plain one elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Up to GROUP deltas added into the block in one pass over it: for each element, the deltas in the order given,
 * each as sums[i] + weight * (double)values[i] rounded (the same arithmetic as adding them one at a time; read
 * and written once rather than once per delta). */
#define GROUP 4

CLONES static void add_weighted_loop(double *restrict sums, const float *const *values, const double *weights,
                                     int deltas, Py_ssize_t count) {
    const float *restrict x0 = values[0];
    const double w0 = weights[0];
    if (deltas == 1) {
        for (Py_ssize_t i = 0; i < count; i++) {
            sums[i] = sums[i] + w0 * (double)x0[i];
        }
        return;
    }
    const float *restrict x1 = values[1];
    const double w1 = weights[1];
    if (deltas == 2) {
        for (Py_ssize_t i = 0; i < count; i++) {
            sums[i] = (sums[i] + w0 * (double)x0[i]) + w1 * (double)x1[i];
        }
        return;
    }
    const float *restrict x2 = values[2];
    const double w2 = weights[2];
    if (deltas == 3) {
        for (Py_ssize_t i = 0; i < count; i++) {
            sums[i] = ((sums[i] + w0 * (double)x0[i]) + w1 * (double)x1[i]) + w2 * (double)x2[i];
        }
        return;
    }
    const float *restrict x3 = values[3];
    const double w3 = weights[3];
    for (Py_ssize_t i = 0; i < count; i++) {
        sums[i] = (((sums[i] + w0 * (double)x0[i]) + w1 * (double)x1[i]) + w2 * (double)x2[i]) + w3 * (double)x3[i];
    }
}

/* The sum of the squares of count float32 values, in float64: each square is exact (a float32 value's square
 * fits float64's 53 bits), added into eight running sums, value i into sum i % 8, then the eight added in order.
 * Fixed arithmetic, whether the loop runs as vectors (one lane per sum) or not. Finite exactly when every value
 * is: a float32 value's square is at most 1.2e77, so no count of them reaches float64's range. */
CLONES static double squares_loop(const float *restrict values, Py_ssize_t count) {
    double sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    Py_ssize_t i = 0;
    for (; i + 8 <= count; i += 8) {
        for (int lane = 0; lane < 8; lane++) {
            double value = (double)values[i + lane];
            sums[lane] += value * value;
        }
    }
    for (int lane = 0; i < count; i++, lane++) {
        double value = (double)values[i];
        sums[lane] += value * value;
    }
    return ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
}

/* A buffer's struct format is one native or little-endian item of the given code ("d", "<d", "=d", ...). */
static int has_format(const Py_buffer *view, char code) {
    const char *format = view->format ? view->format : "B";
    if (*format == '@' || *format == '=' || *format == '<') {
        format++;
    }
    return format[0] == code && format[1] == '\0';
}

static PyObject *add_weighted(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add_weighted(sums, values, weights) takes 3 arguments");
        return NULL;
    }
    PyObject *values_seq = PySequence_Fast(args[1], "values must be a sequence of float32 arrays");
    if (values_seq == NULL) {
        return NULL;
    }
    PyObject *weights_seq = PySequence_Fast(args[2], "weights must be a sequence of numbers");
    if (weights_seq == NULL) {
        Py_DECREF(values_seq);
        return NULL;
    }
    Py_ssize_t deltas = PySequence_Fast_GET_SIZE(values_seq);
    Py_buffer sums, views[GROUP];
    int held = 0, have_sums = 0;
    double weights[GROUP];
    const float *pointers[GROUP];
    const char *problem = NULL;
    if (deltas < 1 || deltas > GROUP) {
        problem = "values must hold 1 to 4 arrays";
    } else if (PySequence_Fast_GET_SIZE(weights_seq) != deltas) {
        problem = "values and weights must be as many";
    }
    for (Py_ssize_t k = 0; problem == NULL && k < deltas; k++) {
        weights[k] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(weights_seq, k));
        if (weights[k] == -1.0 && PyErr_Occurred()) {
            goto failed;
        }
    }
    if (problem == NULL) {
        if (PyObject_GetBuffer(args[0], &sums, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            goto failed;
        }
        have_sums = 1;
        if (sums.itemsize != 8 || !has_format(&sums, 'd') || (uintptr_t)sums.buf % 8 != 0) {
            problem = "sums must be contiguous aligned float64";
        }
    }
    for (Py_ssize_t k = 0; problem == NULL && k < deltas; k++) {
        PyObject *item = PySequence_Fast_GET_ITEM(values_seq, k);
        if (PyObject_GetBuffer(item, &views[k], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            goto failed;
        }
        held++;
        if (views[k].itemsize != 4 || !has_format(&views[k], 'f') || (uintptr_t)views[k].buf % 4 != 0) {
            problem = "values must be contiguous aligned float32";
        } else if (views[k].len / 4 != sums.len / 8) {
            problem = "sums and each of values must hold as many items";
        }
        pointers[k] = (const float *)views[k].buf;
    }
    if (problem == NULL) {
        Py_BEGIN_ALLOW_THREADS
        add_weighted_loop((double *)sums.buf, pointers, weights, (int)deltas, sums.len / 8);
        Py_END_ALLOW_THREADS
    }
    goto done;
failed:
    problem = NULL;  /* the Python error set above is the answer */
    deltas = -1;
done:
    for (int k = 0; k < held; k++) {
        PyBuffer_Release(&views[k]);
    }
    if (have_sums) {
        PyBuffer_Release(&sums);
    }
    Py_DECREF(weights_seq);
    Py_DECREF(values_seq);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    if (deltas < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *squares(PyObject *module, PyObject *values_object) {
    (void)module;
    Py_buffer values;
    if (PyObject_GetBuffer(values_object, &values, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    if (values.itemsize != 4 || !has_format(&values, 'f') || (uintptr_t)values.buf % 4 != 0) {
        PyBuffer_Release(&values);
        PyErr_SetString(PyExc_ValueError, "values must be contiguous aligned float32");
        return NULL;
    }
    double total;
    Py_BEGIN_ALLOW_THREADS
    total = squares_loop((const float *)values.buf, values.len / 4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&values);
    return PyFloat_FromDouble(total);
}

static PyMethodDef methods[] = {
    {"squares", squares, METH_O,
     "squares(values): the sum of the squares of float32 values in float64 (eight running sums, value i into "
     "sum i % 8, added in order); finite exactly when every value is."},
    {"add_weighted", (PyCFunction)(void (*)(void))add_weighted, METH_FASTCALL,
     "add_weighted(sums, values, weights): for each of values (1 to 4 float32 arrays as long as sums) in order, "
     "sums[i] += weight * float64(value[i]) in place, each product and sum rounded to float64 (no fused "
     "multiply-add): the bytes of adding them one at a time. sums: writable contiguous float64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sum_kernel", "The mean family's weighted sum, compiled (see sum_kernel.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_sum_kernel(void) { return PyModule_Create(&module); }
