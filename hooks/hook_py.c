/* hooks/hook_py.c - forward wrappers and the wrapped module tree.
 *
 * Tree(modules, paths) installs a wrapper on every module and numbers them in
 * the order given (module index = position); tree.uninstall() puts every
 * `forward` back. A wrapper never holds its module strongly (a weak reference
 * plus the class's function), so wrapping creates no reference cycle and a
 * dropped model frees its memory without the garbage collector.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "../base/pybase.h"
#include "../interleave/interleave.h"
#include "hooks.h"

/* ------------------------------------------------------------------------ */
/* Forward wrapper                                                            */
/* ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *func;     /* class-level forward (needs self) or a callable already bound */
    PyObject *self_ref; /* weakref to the module when `func` needs self, else NULL */
    PyObject *tree;     /* the Tree this wrapper belongs to (strong; the tree holds no wrapper) */
    int32_t id;         /* module index in the tree */
} loom_hook;

/* New reference to the module, or NULL with an exception set. */
static PyObject *loom__hook_self(loom_hook *h) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *self = NULL;
    if (PyWeakref_GetRef(h->self_ref, &self) < 0) return NULL;
#else
    PyObject *self = PyWeakref_GetObject(h->self_ref);
    if (self == NULL) return NULL;
    if (self == Py_None) self = NULL;
    else Py_INCREF(self);
#endif
    if (self == NULL) PyErr_SetString(PyExc_ReferenceError, "nnloom: the wrapped module is gone");
    return self;
}

/* Call the original forward with the vectorcall arguments as given. */
static PyObject *loom__call_orig(loom_hook *h, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    if (h->self_ref == NULL) return PyObject_Vectorcall(h->func, args, nargsf, kwnames);
    PyObject *self = loom__hook_self(h);
    if (self == NULL) return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *r;
    if (nargsf & PY_VECTORCALL_ARGUMENTS_OFFSET) {
        /* the caller lent us args[-1]: put self there, no copy */
        PyObject **shifted = (PyObject **)args - 1;
        PyObject *saved = shifted[0];
        shifted[0] = self;
        r = PyObject_Vectorcall(h->func, shifted, (size_t)(nargs + 1), kwnames);
        shifted[0] = saved;
    } else {
        PyObject *small[16];
        PyObject **buf = total + 1 <= 16 ? small : PyMem_Malloc((size_t)(total + 1) * sizeof(PyObject *));
        if (buf == NULL) {
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
        buf[0] = self;
        memcpy(buf + 1, args, (size_t)total * sizeof(PyObject *));
        r = PyObject_Vectorcall(h->func, buf, (size_t)(nargs + 1), kwnames);
        if (buf != small) PyMem_Free(buf);
    }
    Py_DECREF(self);
    return r;
}

/* Call the original forward with (args, kwargs) objects. */
static PyObject *loom__call_orig_pair(loom_hook *h, PyObject *pair) {
    PyObject *args = PyTuple_GET_ITEM(pair, 0), *kwargs = PyTuple_GET_ITEM(pair, 1);
    if (h->self_ref == NULL) return PyObject_Call(h->func, args, kwargs);
    PyObject *self = loom__hook_self(h);
    if (self == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *full = PyTuple_New(n + 1);
    if (full == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    PyTuple_SET_ITEM(full, 0, self);
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(full, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    PyObject *r = PyObject_Call(h->func, full, kwargs);
    Py_DECREF(full);
    return r;
}

/* New reference: (args tuple, kwargs dict) from vectorcall arguments. */
static PyObject *loom__pack_inputs(PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *a = PyTuple_New(nargs);
    if (a == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) PyTuple_SET_ITEM(a, i, Py_NewRef(args[i]));
    PyObject *kw = PyDict_New();
    if (kw == NULL) {
        Py_DECREF(a);
        return NULL;
    }
    if (kwnames != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
            if (PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
                Py_DECREF(a);
                Py_DECREF(kw);
                return NULL;
            }
    }
    PyObject *pair = PyTuple_Pack(2, a, kw);
    Py_DECREF(a);
    Py_DECREF(kw);
    return pair;
}

/* A trace runs on this thread: count the call, serve the bodies that wait. */
static LOOM_NOINLINE PyObject *loom__hook_traced(loom_hook *h, loom_il *il, PyObject *const *args,
                                                 size_t nargsf, PyObject *kwnames) {
    loom_sched *s = loom_il_sched(il);
    int32_t id = h->id;
    PyObject *out = NULL, *skip;
    if (LOOM_UNLIKELY(loom_sched_has_waiters(s, id, LOOM_KIND_INPUT))) {
        PyObject *pair = loom__pack_inputs(args, nargsf, kwnames);
        if (pair == NULL) return NULL;
        PyObject *orig_pair = pair;
        Py_INCREF(orig_pair);
        if (loom_il_boundary(il, id, LOOM_KIND_INPUT, &pair) < 0) {
            Py_DECREF(orig_pair);
            return NULL;
        }
        skip = loom_il_take_skip(il, id);
        if (skip == NULL && PyErr_Occurred()) {
            Py_DECREF(orig_pair);
            Py_DECREF(pair);
            return NULL;
        }
        if (skip != NULL) out = skip;
        else if (pair == orig_pair) out = loom__call_orig(h, args, nargsf, kwnames);
        else out = loom__call_orig_pair(h, pair);
        Py_DECREF(orig_pair);
        Py_DECREF(pair);
    } else {
        loom_sched_end(s, id, LOOM_KIND_INPUT);
        out = loom__call_orig(h, args, nargsf, kwnames);
    }
    if (out == NULL) return NULL;
    if (LOOM_UNLIKELY(loom_sched_has_waiters(s, id, LOOM_KIND_OUTPUT))) {
        if (loom_il_boundary(il, id, LOOM_KIND_OUTPUT, &out) < 0) return NULL;
    } else {
        loom_sched_end(s, id, LOOM_KIND_OUTPUT);
    }
    return out;
}

static PyObject *hook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    loom_hook *h = (loom_hook *)op;
    loom_il *il = loom_il_active();
    /* no trace on this thread, a trace of another model, or a module the
     * body calls itself: run the module as it is */
    if (LOOM_LIKELY(il == NULL) || loom_il_tree(il) != h->tree || loom_il_in_user_code())
        return loom__call_orig(h, args, nargsf, kwnames);
    return loom__hook_traced(h, il, args, nargsf, kwnames);
}

static int hook_traverse(loom_hook *h, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(h));
    Py_VISIT(h->func);
    Py_VISIT(h->self_ref);
    Py_VISIT(h->tree);
    return 0;
}

static int hook_clear(loom_hook *h) {
    Py_CLEAR(h->func);
    Py_CLEAR(h->self_ref);
    Py_CLEAR(h->tree);
    return 0;
}

static void hook_dealloc(loom_hook *h) {
    PyTypeObject *tp = Py_TYPE(h);
    PyObject_GC_UnTrack(h);
    hook_clear(h);
    tp->tp_free((PyObject *)h);
    Py_DECREF(tp);
}

/* __wrapped__: the original forward, bound like `module.forward` was. */
static PyObject *hook_get_wrapped(loom_hook *h, void *closure) {
    (void)closure;
    if (h->self_ref == NULL) return Py_NewRef(h->func);
    PyObject *self = loom__hook_self(h);
    if (self == NULL) return NULL;
    PyObject *m = PyMethod_New(h->func, self);
    Py_DECREF(self);
    return m;
}

static PyObject *hook_get_self(loom_hook *h, void *closure) {
    (void)closure;
    if (h->self_ref == NULL) return PyObject_GetAttrString(h->func, "__self__");
    return loom__hook_self(h);
}

static PyObject *hook_get_id(loom_hook *h, void *closure) {
    (void)closure;
    return PyLong_FromLong(h->id);
}

/* Anything else (__name__, __doc__, __func__, ...) comes from the original. */
static PyObject *hook_getattro(PyObject *op, PyObject *name) {
    PyObject *r = PyObject_GenericGetAttr(op, name);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) return r;
    PyErr_Clear();
    PyObject *w = hook_get_wrapped((loom_hook *)op, NULL);
    if (w == NULL) return NULL;
    r = PyObject_GetAttr(w, name);
    Py_DECREF(w);
    return r;
}

static PyObject *hook_repr(loom_hook *h) {
    return PyUnicode_FromFormat("<nnloom forward wrapper #%d of %R>", (int)h->id, h->func);
}

static PyGetSetDef hook_getset[] = {
    {"__wrapped__", (getter)hook_get_wrapped, NULL, "the original forward", NULL},
    {"__self__", (getter)hook_get_self, NULL, "the module", NULL},
    {"_nnloom_id", (getter)hook_get_id, NULL, "module index in its tree", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef hook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(loom_hook, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot hook_slots[] = {
    {Py_tp_dealloc, hook_dealloc},
    {Py_tp_traverse, hook_traverse},
    {Py_tp_clear, hook_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_getattro, hook_getattro},
    {Py_tp_getset, hook_getset},
    {Py_tp_members, hook_members},
    {Py_tp_repr, hook_repr},
    {Py_tp_doc, "nnloom's wrapper around a module's forward (see hooks/hooks.h)."},
    {0, NULL},
};

static PyType_Spec hook_spec = {
    .name = "nnloom._C.ForwardHook",
    .basicsize = sizeof(loom_hook),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = hook_slots,
};

/* ------------------------------------------------------------------------ */
/* Tree                                                                       */
/* ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *refs;  /* list[weakref]: the modules, by index */
    PyObject *saved; /* list: each module's own `forward` instance attribute, or NULL marker None */
    PyObject *had;   /* bytes: 1 where the module had an instance-level forward */
    PyObject *paths; /* list[str] */
    int installed;
} loom_tree;

/* New reference to the module's instance dict. */
static PyObject *loom__dict_of(PyObject *module) {
    return PyObject_GenericGetDict(module, NULL);
}

/* Uninstall what is installed; keeps going on errors, keeps the first. */
static int loom__tree_uninstall(loom_tree *t, PyTypeObject *hook_type) {
    int ret = 0;
    if (!t->installed) return 0;
    Py_ssize_t n = PyList_GET_SIZE(t->refs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *mod = NULL;
#if PY_VERSION_HEX >= 0x030D0000
        if (PyWeakref_GetRef(PyList_GET_ITEM(t->refs, i), &mod) < 0) { ret = -1; PyErr_Clear(); continue; }
#else
        mod = PyWeakref_GetObject(PyList_GET_ITEM(t->refs, i));
        if (mod == Py_None) mod = NULL;
        else Py_XINCREF(mod);
#endif
        if (mod == NULL) continue;
        PyObject *d = loom__dict_of(mod);
        PyObject *cur = d ? PyDict_GetItemString(d, "forward") : NULL;
        if (d != NULL && cur != NULL && Py_TYPE(cur) == hook_type &&
            ((loom_hook *)cur)->tree == (PyObject *)t) {
            int rc;
            if (PyBytes_AS_STRING(t->had)[i])
                rc = PyDict_SetItemString(d, "forward", PyList_GET_ITEM(t->saved, i));
            else
                rc = PyDict_DelItemString(d, "forward");
            if (rc < 0 && ret == 0) ret = -1;
        }
        Py_XDECREF(d);
        Py_DECREF(mod);
    }
    t->installed = 0;
    return ret;
}

static int tree_traverse(loom_tree *t, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(t));
    Py_VISIT(t->refs);
    Py_VISIT(t->saved);
    Py_VISIT(t->had);
    Py_VISIT(t->paths);
    return 0;
}

static int tree_clear(loom_tree *t) {
    Py_CLEAR(t->refs);
    Py_CLEAR(t->saved);
    Py_CLEAR(t->had);
    Py_CLEAR(t->paths);
    return 0;
}

static void tree_dealloc(loom_tree *t) {
    PyTypeObject *tp = Py_TYPE(t);
    PyObject_GC_UnTrack(t);
    tree_clear(t);
    tp->tp_free((PyObject *)t);
    Py_DECREF(tp);
}

/* Tree(modules: list[Module], paths: list[str]): wrap every module's forward. */
static PyObject *tree_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *mods, *paths;
    static char *kwlist[] = {"modules", "paths", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!:Tree", kwlist, &PyList_Type, &mods,
                                     &PyList_Type, &paths))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(mods);
    if (PyList_GET_SIZE(paths) != n) {
        PyErr_SetString(PyExc_ValueError, "Tree: modules and paths differ in length");
        return NULL;
    }
    loom_modstate *st = (loom_modstate *)PyType_GetModuleState(type);
    loom_tree *t = (loom_tree *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->refs = PyList_New(n);
    t->saved = PyList_New(n);
    t->had = PyBytes_FromStringAndSize(NULL, n);
    t->paths = Py_NewRef(paths);
    if (t->refs == NULL || t->saved == NULL || t->had == NULL) goto fail;
    memset(PyBytes_AS_STRING(t->had), 0, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SET_ITEM(t->saved, i, Py_NewRef(Py_None));
        PyList_SET_ITEM(t->refs, i, Py_NewRef(Py_None));
    }
    t->installed = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *mod = PyList_GET_ITEM(mods, i);
        PyObject *ref = PyWeakref_NewRef(mod, NULL);
        if (ref == NULL) goto fail;
        PyList_SetItem(t->refs, i, ref);
        PyObject *d = loom__dict_of(mod);
        if (d == NULL) goto fail;
        Py_DECREF(d); /* the module keeps it alive */
        loom_hook *h = PyObject_GC_New(loom_hook, st->hook_type);
        if (h == NULL) goto fail;
        h->vectorcall = hook_vectorcall;
        h->func = NULL;
        h->self_ref = NULL;
        h->tree = Py_NewRef((PyObject *)t);
        h->id = (int32_t)i;
        PyObject *own = PyDict_GetItemString(d, "forward"); /* borrowed */
        if (own != NULL) {
            /* an instance-level forward (another wrapper, a patch): keep it */
            PyBytes_AS_STRING(t->had)[i] = 1;
            PyList_SetItem(t->saved, i, Py_NewRef(own));
            h->func = Py_NewRef(own);
        } else {
            PyObject *cls_fwd = PyObject_GetAttrString((PyObject *)Py_TYPE(mod), "forward");
            if (cls_fwd == NULL) {
                Py_DECREF(h);
                goto fail;
            }
            if (PyFunction_Check(cls_fwd)) {
                h->func = cls_fwd;
                h->self_ref = Py_NewRef(ref);
            } else {
                Py_DECREF(cls_fwd);
                h->func = PyObject_GetAttrString(mod, "forward");
                if (h->func == NULL) {
                    Py_DECREF(h);
                    goto fail;
                }
            }
        }
        PyObject_GC_Track(h);
        int rc = PyDict_SetItemString(d, "forward", (PyObject *)h);
        Py_DECREF(h);
        if (rc < 0) goto fail;
    }
    return (PyObject *)t;
fail: {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    if (t->refs && t->saved && t->had) loom__tree_uninstall(t, st->hook_type);
    PyErr_Restore(et, ev, etb);
    Py_DECREF(t);
    return NULL;
}
}

static PyObject *tree_uninstall(loom_tree *t, PyObject *unused) {
    (void)unused;
    if (loom__tree_uninstall(t, loom_state_of((PyObject *)t)->hook_type) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *tree_get_installed(loom_tree *t, void *closure) {
    (void)closure;
    return PyBool_FromLong(t->installed);
}

static PyObject *tree_get_paths(loom_tree *t, void *closure) {
    (void)closure;
    return Py_NewRef(t->paths);
}

static PyMethodDef tree_methods[] = {
    {"uninstall", (PyCFunction)tree_uninstall, METH_NOARGS,
     "uninstall(): put every module's forward back as it was"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef tree_getset[] = {
    {"installed", (getter)tree_get_installed, NULL, "wrappers in place", NULL},
    {"paths", (getter)tree_get_paths, NULL, "module paths by index", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot tree_slots[] = {
    {Py_tp_new, tree_new},
    {Py_tp_dealloc, tree_dealloc},
    {Py_tp_traverse, tree_traverse},
    {Py_tp_clear, tree_clear},
    {Py_tp_methods, tree_methods},
    {Py_tp_getset, tree_getset},
    {Py_tp_doc, "Tree(modules, paths): forward wrappers installed on a module tree."},
    {0, NULL},
};

static PyType_Spec tree_spec = {
    .name = "nnloom._C.Tree",
    .basicsize = sizeof(loom_tree),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = tree_slots,
};

int loom_hook_module_init(PyObject *m) {
    loom_modstate *st = loom_state(m);
    st->hook_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &hook_spec, NULL);
    if (st->hook_type == NULL) return -1;
    st->tree_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &tree_spec, NULL);
    if (st->tree_type == NULL) return -1;
    if (PyModule_AddObjectRef(m, "ForwardHook", (PyObject *)st->hook_type) < 0) return -1;
    return PyModule_AddObjectRef(m, "Tree", (PyObject *)st->tree_type);
}
