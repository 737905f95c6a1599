/* collect/merge_py.c - the element-wise merge behind merge_shared_saves.
 *
 * A name bound and saved above the invokes comes back once per request; the
 * copies merge into one value: same-type, same-length lists/tuples slot by
 * slot (None = not written), dicts by key union, nested containers
 * recursively, and anything else (and any slot several requests wrote) keeps
 * the later request's copy. With a thousand requests each returning a
 * thousand-slot list, merging pair by pair in Python allocates a list per
 * step; here the copies of one name merge into one result list, read copy by
 * copy, slot by slot.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "collect_internal.h"

static int loom_collect__slotted(PyObject *v) {
    return PyList_CheckExact(v) || PyTuple_CheckExact(v);
}

static PyObject *loom_collect__merge2(PyObject *early, PyObject *late, int depth);

/* New reference: dict `early` updated with `late` (same type), merging keys
 * present in both. */
static PyObject *loom_collect__merge_dicts(PyObject *early, PyObject *late, int depth) {
    PyObject *out = PyDict_CheckExact(late) ? PyDict_Copy(early)
                                            : PyObject_CallOneArg((PyObject *)Py_TYPE(late), early);
    if (out == NULL) return NULL;
    PyObject *key, *b;
    Py_ssize_t pos = 0;
    while (PyDict_Next(late, &pos, &key, &b)) {
        PyObject *a = PyDict_GetItemWithError(out, key); /* borrowed */
        PyObject *v;
        if (a != NULL) v = loom_collect__merge2(a, b, depth + 1);
        else if (PyErr_Occurred()) v = NULL;
        else v = Py_NewRef(b);
        if (v == NULL || PyObject_SetItem(out, key, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

/* New reference: one value from two requests' copies, the later winning. */
static PyObject *loom_collect__merge2(PyObject *early, PyObject *late, int depth) {
    if (depth > 64 || Py_TYPE(early) != Py_TYPE(late)) return Py_NewRef(late);
    if (loom_collect__slotted(late)) {
        Py_ssize_t n = Py_SIZE(late);
        if (Py_SIZE(early) != n) return Py_NewRef(late);
        PyObject *out = PyList_New(n);
        if (out == NULL) return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *a = PySequence_Fast_GET_ITEM(early, i);
            PyObject *b = PySequence_Fast_GET_ITEM(late, i);
            PyObject *v = b == Py_None ? Py_NewRef(a)
                          : a == Py_None ? Py_NewRef(b)
                                         : loom_collect__merge2(a, b, depth + 1);
            if (v == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(out, i, v);
        }
        if (PyList_CheckExact(late)) return out;
        PyObject *t = PyList_AsTuple(out);
        Py_DECREF(out);
        return t;
    }
    if (PyDict_Check(late) && (PyDict_CheckExact(late) ||
                               strcmp(Py_TYPE(late)->tp_name, "collections.OrderedDict") == 0))
        return loom_collect__merge_dicts(early, late, depth);
    return Py_NewRef(late);
}

/* merge_all(copies: list) -> the copies of one name merged in request order.
 * Lists/tuples of one type and length merge into one result list (no
 * intermediate list per request); dicts into one dict. */
static PyObject *loom_collect_merge_all(PyObject *mod, PyObject *copies) {
    (void)mod;
    if (!PyList_Check(copies) || PyList_GET_SIZE(copies) == 0) {
        PyErr_SetString(PyExc_TypeError, "merge_all(copies: non-empty list)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(copies);
    PyObject *first = PyList_GET_ITEM(copies, 0);
    int columns = loom_collect__slotted(first);
    Py_ssize_t len = columns ? Py_SIZE(first) : 0;
    for (Py_ssize_t r = 1; columns && r < n; r++) {
        PyObject *c = PyList_GET_ITEM(copies, r);
        columns = Py_TYPE(c) == Py_TYPE(first) && Py_SIZE(c) == len;
    }
    if (!columns && PyDict_CheckExact(first)) {
        int dicts = 1;
        for (Py_ssize_t r = 1; dicts && r < n; r++) dicts = PyDict_CheckExact(PyList_GET_ITEM(copies, r));
        if (dicts) {
            /* key union into one dict, merging keys several copies hold */
            PyObject *out = PyDict_New();
            if (out == NULL) return NULL;
            for (Py_ssize_t r = 0; r < n; r++) {
                PyObject *key, *b;
                Py_ssize_t pos = 0;
                while (PyDict_Next(PyList_GET_ITEM(copies, r), &pos, &key, &b)) {
                    PyObject *a = PyDict_GetItemWithError(out, key); /* borrowed */
                    PyObject *v = a != NULL          ? loom_collect__merge2(a, b, 1)
                                  : PyErr_Occurred() ? NULL
                                                     : Py_NewRef(b);
                    if (v == NULL || PyDict_SetItem(out, key, v) < 0) {
                        Py_XDECREF(v);
                        Py_DECREF(out);
                        return NULL;
                    }
                    Py_DECREF(v);
                }
            }
            return out;
        }
    }
    if (!columns) {
        PyObject *v = Py_NewRef(first);
        for (Py_ssize_t r = 1; r < n; r++) {
            PyObject *nv = loom_collect__merge2(v, PyList_GET_ITEM(copies, r), 0);
            Py_DECREF(v);
            if (nv == NULL) return NULL;
            v = nv;
        }
        return v;
    }
    /* request by request, slot by slot (each copy read front to back) */
    PyObject *out = PyList_New(len);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < len; i++) PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *c = PyList_GET_ITEM(copies, r);
        PyObject **items = PySequence_Fast_ITEMS(c);
        for (Py_ssize_t i = 0; i < len; i++) {
            PyObject *b = items[i];
            if (b == Py_None) continue;
            PyObject *a = PyList_GET_ITEM(out, i);
            PyObject *v = a == Py_None ? Py_NewRef(b) : loom_collect__merge2(a, b, 1);
            if (v == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(out, i, v);
            Py_DECREF(a);
        }
    }
    if (PyList_CheckExact(first)) return out;
    PyObject *t = PyList_AsTuple(out);
    Py_DECREF(out);
    return t;
}

static PyMethodDef loom_collect__merge_functions[] = {
    {"merge_all", loom_collect_merge_all, METH_O,
     "merge_all(copies) -> one value from the copies of a shared name, in request order"},
    {NULL, NULL, 0, NULL},
};

int loom_collect__merge_init(PyObject *m) {
    return PyModule_AddFunctions(m, loom_collect__merge_functions);
}
