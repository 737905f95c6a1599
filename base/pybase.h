/* base/pybase.h - the Python side of the ground floor: module state and the
 * one bridge from loom_status to Python exceptions.
 *
 * Every binding file (the halves of interleave/, hooks/, collect/ that touch
 * PyObject) includes this after Python.h. Module state follows PEP 489/630:
 * reached from a module object or from a heap type the module created; no
 * Python object lives in a C global.
 */
#ifndef LOOM_PYBASE_H
#define LOOM_PYBASE_H

#ifndef Py_PYTHON_H
#error "include Python.h before base/pybase.h"
#endif

#include "base.h"

typedef struct {
    PyObject *exc[LOOM_STATUS_COUNT]; /* exception class per status (strong) */
    PyObject *Error;                  /* nnloom.NNloomError, base of our classes */
    PyObject *OutOfOrderError;        /* raised for out-of-order and missed requests */
    PyObject *StopTrace;              /* BaseException: tracer.stop() unwinding */
    PyObject *tensor_type;            /* torch.Tensor */
    PyTypeObject *il_type;            /* interleave: Interleaver */
    PyTypeObject *hook_type;          /* hooks: forward wrapper */
    PyTypeObject *tree_type;          /* hooks: wrapped module tree */
    PyObject *str_narrow;             /* interned "narrow" */
    PyObject *str_shape;              /* interned "shape" */
    PyObject *str_copy_;              /* interned "copy_" */
    PyObject *str_make;               /* interned "_make" */
    PyObject *save_descr;             /* our `object.save` descriptor */
    PyObject *save_fallback;          /* the `object.save` we displaced (another library's), or NULL */
    PyObject *collect;                /* collect/: its context object (strong) */
} loom_modstate;

/* The module definition (bind/module.c). */
extern PyModuleDef loom_moduledef;

/* State from a module object. */
static inline loom_modstate *loom_state(PyObject *module) {
    return (loom_modstate *)PyModule_GetState(module);
}

/* State from an instance of one of our heap types. */
static inline loom_modstate *loom_state_of(PyObject *obj) {
    return (loom_modstate *)PyType_GetModuleState(Py_TYPE(obj));
}

/* Raise the exception mapped from `s` with loom_last_error() (or the generic
 * message) as its text. Returns NULL for convenience. LOOM_ERR_PYTHON leaves the
 * pending exception as it is. */
PyObject *loom_raise(loom_modstate *st, loom_status s);

#endif /* LOOM_PYBASE_H */
