/* collect/collect_py.c - the Python half of collect/: its context object and
 * the module-level functions (dumps_compact); the pickler lives in
 * pickle_py.c, the arena types in arena_py.c.
 *
 * The context is one heap-type instance holding every Python object collect/
 * needs (types it created, torch callables, interned names). The module
 * state keeps it (field `collect`), so the module's GC traversal reaches all
 * of it and no Python object sits in a C global.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "collect_internal.h"

/* ------------------------------------------------------------------------ */
/* The context object                                                         */
/* ------------------------------------------------------------------------ */

static int ctx_traverse(PyObject *self, visitproc visit, void *arg) {
    loom_collect__ctx *ctx = (loom_collect__ctx *)self;
    Py_VISIT(Py_TYPE(self));
    for (int i = 0; i < LOOM_COLLECT__NREFS; i++) Py_VISIT(ctx->ref[i]);
    return 0;
}

static int ctx_clear(PyObject *self) {
    loom_collect__ctx *ctx = (loom_collect__ctx *)self;
    for (int i = 0; i < LOOM_COLLECT__NREFS; i++) Py_CLEAR(ctx->ref[i]);
    return 0;
}

static void ctx_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    ctx_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot ctx_slots[] = {
    {Py_tp_traverse, ctx_traverse},
    {Py_tp_clear, ctx_clear},
    {Py_tp_dealloc, ctx_dealloc},
    {Py_tp_doc, "collect/'s references (internal)."},
    {0, NULL},
};

static PyType_Spec ctx_spec = {
    .name = "nnloom._C._CollectContext",
    .basicsize = sizeof(loom_collect__ctx),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = ctx_slots,
};

loom_collect__ctx *loom_collect__ctx_of(PyTypeObject *defining_class) {
    loom_modstate *st = (loom_modstate *)PyType_GetModuleState(defining_class);
    if (st == NULL) return NULL;
    if (st->collect == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnloom._C: collect/ is not initialised");
        return NULL;
    }
    return (loom_collect__ctx *)st->collect;
}

/* ------------------------------------------------------------------------ */
/* Module functions                                                           */
/* ------------------------------------------------------------------------ */

/* dumps_compact(value, substitutes=None): `substitutes` maps id(tensor) to a
 * host tensor already holding its compact bytes (staged through cuda/'s
 * pinned pool), written instead of copying the tensor again. */
static PyObject *loom_collect_dumps_compact_py(PyObject *m, PyObject *const *args,
                                               Py_ssize_t nargs) {
    loom_modstate *st = loom_state(m);
    if (st->collect == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnloom._C: collect/ is not initialised");
        return NULL;
    }
    if (nargs < 1 || nargs > 2 || (nargs == 2 && args[1] != Py_None && !PyDict_Check(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "dumps_compact(value, substitutes: dict | None = None)");
        return NULL;
    }
    PyObject *outer = loom_collect__substitutes;
    loom_collect__substitutes = nargs == 2 && args[1] != Py_None ? args[1] : NULL;
    PyObject *r = loom_collect__dumps_compact((loom_collect__ctx *)st->collect, args[0]);
    loom_collect__substitutes = outer;
    return r;
}

static PyMethodDef loom_collect__functions[] = {
    {"dumps_compact", (PyCFunction)(void (*)(void))loom_collect_dumps_compact_py, METH_FASTCALL,
     "dumps_compact(value) -> bytes: pickle value, each tensor as a compact copy of its own "
     "elements."},
    {NULL, NULL, 0, NULL},
};

int loom_collect_module_init(PyObject *m) {
    loom_modstate *st = loom_state(m);
    PyTypeObject *tp = (PyTypeObject *)PyType_FromModuleAndSpec(m, &ctx_spec, NULL);
    if (tp == NULL) return -1;
    loom_collect__ctx *ctx = PyObject_GC_New(loom_collect__ctx, tp);
    Py_DECREF(tp); /* the instance holds its type */
    if (ctx == NULL) return -1;
    memset(ctx->ref, 0, sizeof ctx->ref);
    PyObject_GC_Track((PyObject *)ctx);
    Py_XSETREF(st->collect, (PyObject *)ctx);
    if (loom_collect__pickle_init(m, ctx) < 0) return -1;
    if (PyModule_AddFunctions(m, loom_collect__functions) < 0) return -1;
    if (loom_collect__arena_init(m, ctx) < 0) return -1;
    if (loom_collect__merge_init(m) < 0) return -1;
    return 0;
}
