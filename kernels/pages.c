/* The page allocator's and the radix tree's loops over page ids, as one pass each.
 *
 * A CPython extension (module _radixkv_pages) over int32 buffers (numpy arrays). Every
 * request admits, evicts, allocates and publishes hundreds of pages at page size 1;
 * numpy's put/take cost 3-5 ns per id plus a microsecond per call, and checking a list
 * takes several of them. These loops check and write in one call, leave the arrays
 * exactly as they were when they refuse, and return a status the caller turns into its
 * error message. kernels/pages.py holds the numpy twin with the same contract (used
 * without a C compiler; the tests run both).
 *
 * Status codes (negative; 0 or a count is success):
 *   OUT_OF_RANGE  an id is negative or >= the array's length
 *   HELD          hold: an id is held already
 *   TWICE         an id is listed twice
 *   NOT_OWNED     hold: an id's reference count is 0
 *   NOT_SOLE      free_sole: an id's reference count is not 1
 *   NO_ROOM       free_sole: the free stack cannot take them (a broken caller)
 * kernels/pages.py holds the same codes by name for both implementations.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { OUT_OF_RANGE = -1, HELD = -2, TWICE = -3, NOT_OWNED = -4, NOT_SOLE = -5, NO_ROOM = -6 };

/* A 1-D C-contiguous buffer of 4-byte integers (int32 or uint32). */
static int get_ids(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    size_t n = strlen(f);
    if (view->itemsize != 4 || view->ndim != 1 || n == 0 || (f[n - 1] != 'i' && f[n - 1] != 'I')) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D contiguous int32 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *fn) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", fn, want, nargs);
    return -1;
}

/* The id buffers args[at[i]] into views[i] for i < n (writable where writable[i]); on
 * failure the ones already taken are released and -1 returned. */
static int get_all(PyObject *const *args, const int *at, const int *writable, const char *const *names, int n,
                   Py_buffer *views) {
    for (int i = 0; i < n; i++) {
        if (get_ids(args[at[i]], &views[i], writable[i], names[i]) < 0) {
            while (i--) PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static void release_all(Py_buffer *views, int n) {
    while (n--) PyBuffer_Release(&views[n]);
}

/* fill(arr, ids, value) -> 0 | OUT_OF_RANGE: arr[ids] = value, nothing written on refusal. */
static PyObject *fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 1}, writable[] = {1, 0};
    static const char *const names[] = {"arr", "ids"};
    Py_buffer b[2];
    if (check_nargs(nargs, 3, "fill") < 0) return NULL;
    long value = PyLong_AsLong(args[2]);
    if (value == -1 && PyErr_Occurred()) return NULL;
    if (get_all(args, at, writable, names, 2, b) < 0) return NULL;
    int32_t *arr = b[0].buf;
    const uint32_t *p = b[1].buf;
    uint64_t size = (uint64_t)b[0].shape[0], n = (uint64_t)b[1].shape[0];
    long status = 0;
    for (uint64_t i = 0; i < n; i++)
        if (p[i] >= size) { status = OUT_OF_RANGE; break; }
    if (!status)
        for (uint64_t i = 0; i < n; i++) arr[p[i]] = (int32_t)value;
    release_all(b, 2);
    return PyLong_FromLong(status);
}

/* hold(held, refs, ids, owned) -> 0 | OUT_OF_RANGE | HELD | NOT_OWNED | TWICE:
 * mark ids held (held[id] = 1) if each is in range, not held yet, listed once, and
 * (when owned is true) has a reference count above 0. */
static PyObject *hold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 1, 2}, writable[] = {1, 0, 0};
    static const char *const names[] = {"held", "refs", "ids"};
    Py_buffer b[3];
    if (check_nargs(nargs, 4, "hold") < 0) return NULL;
    int owned = PyObject_IsTrue(args[3]);
    if (owned < 0) return NULL;
    if (get_all(args, at, writable, names, 3, b) < 0) return NULL;
    int32_t *held = b[0].buf;
    const int32_t *refs = b[1].buf;
    const uint32_t *p = b[2].buf;
    uint64_t size = (uint64_t)b[0].shape[0], n = (uint64_t)b[2].shape[0];
    long status = 0;
    if ((uint64_t)b[1].shape[0] < size) size = (uint64_t)b[1].shape[0];
    /* One pass per check, so that the first failing check is the one reported. */
    for (uint64_t i = 0; i < n && !status; i++)
        if (p[i] >= size) status = OUT_OF_RANGE;
    for (uint64_t i = 0; i < n && !status; i++)
        if (held[p[i]]) status = HELD;
    for (uint64_t i = 0; i < n && !status && owned; i++)
        if (refs[p[i]] <= 0) status = NOT_OWNED;
    for (uint64_t i = 0; i < n && !status; i++) {
        if (held[p[i]]) {  /* marked earlier in this call: listed twice; every id was unheld */
            for (uint64_t j = 0; j < i; j++) held[p[j]] = 0;
            status = TWICE;
        } else {
            held[p[i]] = 1;
        }
    }
    release_all(b, 3);
    return PyLong_FromLong(status);
}

/* free_sole(refs, stack, top, ids) -> new top | OUT_OF_RANGE | NOT_SOLE | TWICE | NO_ROOM:
 * ids whose reference count is 1, each listed once, go to 0 and onto the free stack
 * stack[top:], pushed last id first so that the first listed is on top. */
static PyObject *free_sole(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const int at[] = {0, 1, 3}, writable[] = {1, 1, 0};
    static const char *const names[] = {"refs", "stack", "ids"};
    Py_buffer b[3];
    if (check_nargs(nargs, 4, "free_sole") < 0) return NULL;
    Py_ssize_t top = PyLong_AsSsize_t(args[2]);
    if (top == -1 && PyErr_Occurred()) return NULL;
    if (get_all(args, at, writable, names, 3, b) < 0) return NULL;
    int32_t *refs = b[0].buf, *stack = b[1].buf;
    const uint32_t *p = b[2].buf;
    uint64_t size = (uint64_t)b[0].shape[0], n = (uint64_t)b[2].shape[0];
    long long status = 0;
    if (top < 0 || (uint64_t)top + n > (uint64_t)b[1].shape[0]) status = NO_ROOM;
    for (uint64_t i = 0; i < n && !status; i++)
        if (p[i] >= size) status = OUT_OF_RANGE;
    for (uint64_t i = 0; i < n && !status; i++)
        if (refs[p[i]] != 1) status = NOT_SOLE;
    for (uint64_t i = 0; i < n && !status; i++) {
        if (refs[p[i]] == 0) {  /* zeroed earlier in this call: listed twice; every count was 1 */
            for (uint64_t j = 0; j < i; j++) refs[p[j]] = 1;
            status = TWICE;
        } else {
            refs[p[i]] = 0;
        }
    }
    if (!status) {
        for (uint64_t i = 0; i < n; i++) stack[top + (Py_ssize_t)(n - 1 - i)] = (int32_t)p[i];
        status = (long long)top + (long long)n;
    }
    release_all(b, 3);
    return PyLong_FromLongLong(status);
}

static PyMethodDef methods[] = {
    {"fill", (PyCFunction)(void (*)(void))fill, METH_FASTCALL, "fill(arr, ids, value): arr[ids] = value"},
    {"hold", (PyCFunction)(void (*)(void))hold, METH_FASTCALL, "hold(held, refs, ids, owned): mark ids held"},
    {"free_sole", (PyCFunction)(void (*)(void))free_sole, METH_FASTCALL,
     "free_sole(refs, stack, top, ids): free sole-owned ids onto the stack; the new top"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_radixkv_pages", NULL, -1, methods};

PyMODINIT_FUNC PyInit__radixkv_pages(void) { return PyModule_Create(&module); }
