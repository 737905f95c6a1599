/* bind/module.c - the nnloom._C extension module: init, the status-to-
 * exception bridge, save() and the few frame helpers the tracer needs.
 *
 * This is the binding layer: it may include every folder; nothing includes it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <string.h>

#include "../base/pybase.h"
#include "../collect/collect.h"
#include "../cuda/device.h"
#include "../hooks/hooks.h"
#include "../interleave/interleave.h"

/* ------------------------------------------------------------------------ */
/* Status -> exception                                                        */
/* ------------------------------------------------------------------------ */

PyObject *loom_raise(loom_modstate *st, loom_status s) {
    if (s == LOOM_ERR_PYTHON && PyErr_Occurred()) return NULL;
    PyObject *cls = (st && (unsigned)s < LOOM_STATUS_COUNT && st->exc[s]) ? st->exc[s]
                                                                         : PyExc_RuntimeError;
    const char *detail = loom_last_error();
    if (detail[0]) PyErr_Format(cls, "%s: %s", loom_strerror(s), detail);
    else PyErr_SetString(cls, loom_strerror(s));
    loom_clear_error();
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* save()                                                                     */
/* ------------------------------------------------------------------------ */

/* Per thread: the stack of save scopes (dicts id -> object) of the traces
 * running on it. Borrowed: each Tracer holds its dict while its scope is
 * entered and pops it before releasing it. */
#define LOOM_SAVE_DEPTH 64
static _Thread_local PyObject *loom__scopes[LOOM_SAVE_DEPTH];
static _Thread_local int loom__n_scopes;

static PyObject *loom__save_impl(PyObject *obj) {
    if (LOOM_UNLIKELY(loom__n_scopes == 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "save() can only be called inside a trace (with model.trace(...):); "
                        "outside one there is nothing to hand the value back to");
        return NULL;
    }
    PyObject *d = loom__scopes[loom__n_scopes - 1];
    PyObject *key = PyLong_FromVoidPtr(obj);
    if (key == NULL) return NULL;
    int rc = PyDict_SetItem(d, key, obj);
    Py_DECREF(key);
    if (rc < 0) return NULL;
    return Py_NewRef(obj);
}

/* save(obj) -> obj, marked to be returned after the outermost trace. */
static PyObject *loom_save(PyObject *mod, PyObject *obj) {
    (void)mod;
    return loom__save_impl(obj);
}

/* _save_method(obj) -> obj: what `obj.save()` calls. Inside an nnloom trace it
 * saves; outside one it hands over to the `object.save` another library
 * (nnsight) had mounted, so both can be imported in one process. */
static PyObject *loom_save_bound(PyObject *mod, PyObject *obj) {
    if (loom__n_scopes > 0) return loom__save_impl(obj);
    loom_modstate *st = loom_state(mod);
    if (st->save_fallback != NULL) {
        PyObject *bound;
        descrgetfunc get = Py_TYPE(st->save_fallback)->tp_descr_get;
        if (get != NULL) bound = get(st->save_fallback, obj, (PyObject *)Py_TYPE(obj));
        else bound = Py_NewRef(st->save_fallback);
        if (bound == NULL) return NULL;
        PyObject *r = PyObject_CallNoArgs(bound);
        Py_DECREF(bound);
        return r;
    }
    return loom__save_impl(obj); /* raises: not in a trace */
}

/* SaveDescr: the descriptor mounted as `object.save`; binds the instance to
 * a function that can reach this module's state. */
typedef struct {
    PyObject_HEAD
    PyObject *func; /* builtin function _save_method(obj), bound to the module */
} loom_save_descr;

static PyObject *savedescr_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)type;
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(((loom_save_descr *)self)->func, obj);
}

static int savedescr_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(((loom_save_descr *)self)->func);
    return 0;
}

static int savedescr_clear(PyObject *self) {
    Py_CLEAR(((loom_save_descr *)self)->func);
    return 0;
}

static void savedescr_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    savedescr_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot savedescr_slots[] = {
    {Py_tp_descr_get, savedescr_get},
    {Py_tp_traverse, savedescr_traverse},
    {Py_tp_clear, savedescr_clear},
    {Py_tp_dealloc, savedescr_dealloc},
    {Py_tp_doc, "save() -> self: mark this object to be returned after the trace (nnloom)."},
    {0, NULL},
};

static PyType_Spec savedescr_spec = {
    .name = "nnloom._C.SaveDescriptor",
    .basicsize = sizeof(loom_save_descr),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = savedescr_slots,
};

static PyMethodDef loom__save_bound_def = {
    "_save_method", loom_save_bound, METH_O,
    "obj.save() as mounted on object: save inside an nnloom trace."};

static int loom__mount_save(loom_modstate *st);

/* The cyclic GC is paused while any trace runs (process-wide count, changed
 * only under the GIL): a trace allocates a burst of short-lived containers
 * (namespaces, argument tuples, views) that refcounting frees at its end; a
 * collection in the middle would only promote them to older generations and
 * trigger full collections of the whole heap later. NNLOOM_GC_PAUSE=0 keeps
 * the GC running. */
static LOOM_PARAM(GcPause, "NNLOOM_GC_PAUSE", 1)
static int loom__traces_running;
static int loom__gc_was_enabled;

/* scope_enter(d): saves go to dict `d` until scope_exit(d). */
static PyObject *loom_scope_enter(PyObject *mod, PyObject *d) {
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "scope_enter(dict)");
        return NULL;
    }
    if (loom__n_scopes == LOOM_SAVE_DEPTH) {
        PyErr_SetString(PyExc_RecursionError, "traces nested too deeply");
        return NULL;
    }
    if (loom__mount_save(loom_state(mod)) < 0) return NULL;
    loom__scopes[loom__n_scopes++] = d;
    if (loom__traces_running++ == 0 && loom_param_GcPause())
        loom__gc_was_enabled = PyGC_Disable();
    Py_RETURN_NONE;
}

static PyObject *loom_scope_exit(PyObject *mod, PyObject *d) {
    (void)mod;
    if (loom__n_scopes == 0 || loom__scopes[loom__n_scopes - 1] != d) {
        PyErr_SetString(PyExc_RuntimeError, "nnloom: save scopes exited out of order");
        return NULL;
    }
    loom__scopes[--loom__n_scopes] = NULL;
    if (--loom__traces_running == 0 && loom__gc_was_enabled) {
        loom__gc_was_enabled = 0;
        PyGC_Enable();
    }
    Py_RETURN_NONE;
}

static PyObject *loom_scope_depth(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    return PyLong_FromLong(loom__n_scopes);
}

/* Borrowed dict of `object` (new reference on 3.12+ handled by the caller). */
static PyObject *loom__object_dict(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyType_GetDict(&PyBaseObject_Type); /* new reference */
#else
    return Py_XNewRef(PyBaseObject_Type.tp_dict);
#endif
}

/* Make `object.save` ours, remembering whatever another library mounted there
 * as the fallback for saves outside nnloom's traces. Cheap when already ours
 * (one dict lookup), so it runs at every trace start: a library imported
 * after nnloom (nnsight mounts its own `object.save`) cannot take it over.
 * Invalidating the type cache of every class is the slow part, done only on a
 * change. */
static int loom__mount_save(loom_modstate *st) {
    PyObject *dict = loom__object_dict();
    if (dict == NULL) return -1;
    int rc = 0;
    PyObject *cur = PyDict_GetItemString(dict, "save"); /* borrowed */
    if (cur != st->save_descr) {
        if (cur != NULL) Py_XSETREF(st->save_fallback, Py_NewRef(cur));
        rc = PyDict_SetItemString(dict, "save", st->save_descr);
        if (rc == 0) PyType_Modified(&PyBaseObject_Type);
    }
    Py_DECREF(dict);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Frames                                                                     */
/* ------------------------------------------------------------------------ */

/* frame_set(frame, names: dict): bind each name in a frame of the caller. On
 * 3.13+ frame.f_locals writes through (PEP 667); before, the snapshot dict is
 * written and copied back into the fast locals. */
static PyObject *loom_frame_set(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 2 || !PyFrame_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "frame_set(frame, names: dict)");
        return NULL;
    }
    PyFrameObject *f = (PyFrameObject *)args[0];
    PyObject *locals = PyObject_GetAttrString((PyObject *)f, "f_locals");
    if (locals == NULL) return NULL;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(args[1], &pos, &k, &v))
        if (PyObject_SetItem(locals, k, v) < 0) {
            Py_DECREF(locals);
            return NULL;
        }
#if PY_VERSION_HEX < 0x030D0000
    PyFrame_LocalsToFast(f, 0);
    /* the snapshot dict would keep every local (activations included) alive
     * after the user deletes them; the frame rebuilds it on the next read */
    if (!PyErr_Occurred() && PyDict_Check(locals)) PyDict_Clear(locals);
#endif
    Py_DECREF(locals);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* Trace exit trampoline                                                      */
/* ------------------------------------------------------------------------ */

/* A C base class whose __exit__ calls self._exit(...) and, when that raises,
 * replaces the traceback with self._user_traceback(exc): the with statement's
 * frame then shows the user's lines and no frame of ours, because a C method
 * adds no frame. */
static PyObject *tb_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__ takes 3 arguments");
        return NULL;
    }
    PyObject *call[4] = {self, args[0], args[1], args[2]};
    PyObject *name = PyUnicode_InternFromString("_exit");
    if (name == NULL) return NULL;
    PyObject *r = PyObject_VectorcallMethod(name, call, 4, NULL);
    Py_DECREF(name);
    if (r != NULL) return r;
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    if (ev != NULL) {
        if (etb != NULL) PyException_SetTraceback(ev, etb);
        PyObject *clean = PyObject_CallMethod(self, "_user_traceback", "O", ev);
        if (clean == NULL) PyErr_Clear(); /* keep the original traceback */
        else {
            if (clean != Py_None) {
                Py_XSETREF(etb, Py_NewRef(clean));
                PyException_SetTraceback(ev, clean);
            }
            Py_DECREF(clean);
        }
    }
    PyErr_Restore(et, ev, etb);
    return NULL;
}

static PyMethodDef tb_methods[] = {
    {"__exit__", (PyCFunction)(void (*)(void))tb_exit, METH_FASTCALL,
     "Run the captured body (see Tracer._exit); errors carry the user's traceback."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot tb_slots[] = {
    {Py_tp_methods, tb_methods},
    {Py_tp_doc, "Base of nnloom's context managers: __exit__ without a frame of its own."},
    {0, NULL},
};

static PyType_Spec tb_spec = {
    .name = "nnloom._C.ExitBase",
    .basicsize = 0,
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = tb_slots,
};

/* ------------------------------------------------------------------------ */
/* Module                                                                     */
/* ------------------------------------------------------------------------ */

static PyMethodDef loom_functions[] = {
    {"save", loom_save, METH_O, "save(obj) -> obj: mark obj to be returned after the trace"},
    {"scope_enter", loom_scope_enter, METH_O, "scope_enter(d): saves on this thread go to d"},
    {"scope_exit", loom_scope_exit, METH_O, "scope_exit(d): leave the scope entered with d"},
    {"scope_depth", loom_scope_depth, METH_NOARGS, "scope_depth() -> save scopes entered"},
    {"frame_set", (PyCFunction)(void (*)(void))loom_frame_set, METH_FASTCALL,
     "frame_set(frame, names): bind names in a running frame"},
    {NULL, NULL, 0, NULL},
};

static int loom_exec(PyObject *m) {
    loom_modstate *st = loom_state(m);
    PyObject *builtins = PyEval_GetBuiltins(); /* borrowed */

    st->Error = PyErr_NewExceptionWithDoc("nnloom.NNloomError", "Base of nnloom's errors.",
                                          PyExc_Exception, NULL);
    if (st->Error == NULL || PyModule_AddObjectRef(m, "NNloomError", st->Error) < 0) return -1;
    st->StopTrace = PyErr_NewExceptionWithDoc(
        "nnloom._StopTrace", "tracer.stop() unwinding the forward (never escapes a trace).",
        PyExc_BaseException, NULL);
    if (st->StopTrace == NULL || PyModule_AddObjectRef(m, "StopTrace", st->StopTrace) < 0)
        return -1;

    /* one class per name in the status table; builtins where named */
    for (int s = 0; s < LOOM_STATUS_COUNT; s++) {
        const char *cls = loom_status_pyclass((loom_status)s);
        if (cls[0] == '\0') continue;
        PyObject *obj = PyDict_GetItemString(builtins, cls);
        if (obj == NULL) obj = PyObject_GetAttrString(m, cls);
        else Py_INCREF(obj);
        if (obj == NULL) {
            PyErr_Clear();
            char full[128];
            snprintf(full, sizeof full, "nnloom.%s", cls);
            PyObject *bases = strcmp(cls, "DeviceError") == 0
                                  ? PyTuple_Pack(2, st->Error, PyExc_RuntimeError)
                                  : PyTuple_Pack(1, st->Error);
            if (bases == NULL) return -1;
            obj = PyErr_NewException(full, bases, NULL);
            Py_DECREF(bases);
            if (obj == NULL || PyModule_AddObjectRef(m, cls, obj) < 0) return -1;
        }
        st->exc[s] = obj;
    }
    st->OutOfOrderError = Py_NewRef(st->exc[LOOM_ERR_OUT_OF_ORDER]);
    if (PyModule_AddObjectRef(m, "MissedProviderError", st->OutOfOrderError) < 0) return -1;

    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) return -1;
    st->tensor_type = PyObject_GetAttrString(torch, "Tensor");
    Py_DECREF(torch);
    if (st->tensor_type == NULL) return -1;
    if ((st->str_narrow = PyUnicode_InternFromString("narrow")) == NULL) return -1;
    if ((st->str_shape = PyUnicode_InternFromString("shape")) == NULL) return -1;
    if ((st->str_copy_ = PyUnicode_InternFromString("copy_")) == NULL) return -1;
    if ((st->str_make = PyUnicode_InternFromString("_make")) == NULL) return -1;

    PyObject *tb = PyType_FromModuleAndSpec(m, &tb_spec, NULL);
    if (tb == NULL || PyModule_AddObjectRef(m, "ExitBase", tb) < 0) {
        Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(tb);
    if (loom_il_module_init(m) < 0) return -1;
    if (loom_hook_module_init(m) < 0) return -1;
    if (loom_collect_module_init(m) < 0) return -1;
    if (loom_cuda_module_init(m) < 0) return -1;
    PyObject *dtype = PyType_FromModuleAndSpec(m, &savedescr_spec, NULL);
    if (dtype == NULL) return -1;
    loom_save_descr *descr = PyObject_GC_New(loom_save_descr, (PyTypeObject *)dtype);
    Py_DECREF(dtype);
    if (descr == NULL) return -1;
    descr->func = PyCFunction_NewEx(&loom__save_bound_def, m, NULL);
    PyObject_GC_Track(descr);
    st->save_descr = (PyObject *)descr;
    if (descr->func == NULL) return -1;
    if (loom__mount_save(st) < 0) return -1;
    return 0;
}

static int loom_traverse(PyObject *m, visitproc visit, void *arg) {
    loom_modstate *st = loom_state(m);
    for (int s = 0; s < LOOM_STATUS_COUNT; s++) Py_VISIT(st->exc[s]);
    Py_VISIT(st->Error);
    Py_VISIT(st->OutOfOrderError);
    Py_VISIT(st->StopTrace);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->il_type);
    Py_VISIT(st->hook_type);
    Py_VISIT(st->tree_type);
    Py_VISIT(st->save_descr);
    Py_VISIT(st->save_fallback);
    Py_VISIT(st->collect);
    return 0;
}

static int loom_clear(PyObject *m) {
    loom_modstate *st = loom_state(m);
    for (int s = 0; s < LOOM_STATUS_COUNT; s++) Py_CLEAR(st->exc[s]);
    Py_CLEAR(st->Error);
    Py_CLEAR(st->OutOfOrderError);
    Py_CLEAR(st->StopTrace);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->il_type);
    Py_CLEAR(st->hook_type);
    Py_CLEAR(st->tree_type);
    Py_CLEAR(st->str_narrow);
    Py_CLEAR(st->str_shape);
    Py_CLEAR(st->str_copy_);
    Py_CLEAR(st->str_make);
    Py_CLEAR(st->save_descr);
    Py_CLEAR(st->save_fallback);
    Py_CLEAR(st->collect);
    return 0;
}

static void loom_free_module(void *m) { loom_clear((PyObject *)m); }

static PyModuleDef_Slot loom_slots[] = {
    {Py_mod_exec, loom_exec},
    {0, NULL},
};

PyModuleDef loom_moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nnloom._C",
    .m_doc = "nnloom's C core: scheduler, forward wrappers, save scopes.",
    .m_size = sizeof(loom_modstate),
    .m_methods = loom_functions,
    .m_slots = loom_slots,
    .m_traverse = loom_traverse,
    .m_clear = loom_clear,
    .m_free = loom_free_module,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&loom_moduledef); }
