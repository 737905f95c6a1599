/* interleave/il_py.c - the Python half of the scheduler: the Interleaver.
 *
 * An Interleaver runs one trace: it owns one greenlet per mediator (invoke),
 * starts each body until it parks on its first request, calls the model, and
 * at every module boundary the hooks report (loom_il_boundary) hands each
 * waiting mediator its rows of the live value, resumes it, and splices back
 * what it assigned. After the forward it tells every mediator still waiting
 * that its request was missed, and it never leaves a greenlet parked.
 *
 * Switching stacks uses greenlet's C API (the reference way to switch Python
 * stacks safely on CPython 3.10-3.13). greenlet's header keeps its API table
 * in a static per translation unit, so every greenlet call lives in this file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <structmember.h>

#include <greenlet/greenlet.h>

#include "../base/pybase.h"
#include "../cuda/device.h"
#include "interleave.h"

/* ------------------------------------------------------------------------ */
/* Types                                                                      */
/* ------------------------------------------------------------------------ */

/* Selector of what a body reads or writes at a boundary. */
enum { LOOM_SEL_OUTPUT = 0, LOOM_SEL_INPUTS = 1, LOOM_SEL_INPUT = 2 };

typedef struct {
    PyObject *greenlet;    /* the body's coroutine, NULL before start */
    PyObject *code;        /* code object of the body */
    PyObject *ns;          /* dict: globals the body runs in */
    PyObject *name;        /* str: "invoke 0", for messages */
    PyObject *served;      /* value handed out for the current key (SERVED), or NULL */
    PyObject *replacement; /* value assigned for the current key, or NULL */
    PyObject *skip;        /* output to use instead of running the module, or NULL */
    int32_t skip_module;   /* module index `skip` is for */
    int64_t start;         /* first row of the invoke's group; -1 = whole batch */
    int64_t size;          /* rows in the group */
    int blocked;           /* 0; LOOM__BLOCKED parked on a barrier; LOOM__READY released */
    int finished;          /* the worker ended the body (outcome in exc_*) */
    PyObject *exc_type;    /* the body's exception, recorded by its worker, or NULL */
    PyObject *exc_value;
    PyObject *exc_tb;
    loom_status pending;   /* error to raise in the body when it resumes */
    loom_key pending_key;  /* the request `pending` is about */
} loom__med;

struct loom_il {
    PyObject_HEAD
    loom_sched *sched;    /* bookkeeping, owned; built by run() with the final mediator count */
    int64_t batch;        /* rows of the combined batch */
    PyObject *tree;       /* opaque token of the wrapped tree (strong) */
    PyObject *paths;      /* list[str]: module path by index (strong) */
    PyObject *home;       /* greenlet that runs the forward, during run() */
    loom_il *prev;        /* interleaver active before this one on the thread */
    loom__med *meds;      /* [cap] per mediator */
    int32_t n_meds;       /* mediators added */
    int32_t cap;          /* mediators allocated */
    int32_t current;      /* mediator whose user code runs now, -1 if none */
    int running;          /* inside run() */
    int aborting;         /* tearing mediators down */
    int stopped;          /* a body called stop() */
    int32_t n_ready;      /* mediators a barrier released, not yet resumed */
    PyObject *tile;       /* list[int]: row-group sizes when the groups tile the batch in order, else NULL */
    int32_t *tile_pos;    /* [cap] mediator -> its index in `tile`, -1 if it has no rows */
    PyObject *splits;     /* dict id(tensor) -> (tensor, its views by group), this boundary only */
    PyObject *weakreflist;
};

/* The interleaver of this thread's running trace. Borrowed: run() sets it and
 * restores the previous one before it returns, so it never dangles. */
static _Thread_local loom_il *loom__tls_il;

loom_il *loom_il_active(void) { return loom__tls_il; }

bool loom_il_in_user_code(void) {
    loom_il *il = loom__tls_il;
    return il != NULL && il->current >= 0;
}

PyObject *loom_il_tree(const loom_il *il) { return il->tree; }
loom_sched *loom_il_sched(const loom_il *il) { return il->sched; }

/* ------------------------------------------------------------------------ */
/* Messages                                                                   */
/* ------------------------------------------------------------------------ */

static const char *loom__kind_name(int32_t kind) {
    return kind == LOOM_KIND_OUTPUT ? "output" : "input";
}

/* New reference: "'model.layers.3.output.i0'". */
static PyObject *loom__key_repr(loom_il *il, loom_key k) {
    PyObject *path = PyList_GetItem(il->paths, k.module); /* borrowed */
    if (path == NULL) return NULL;
    return PyUnicode_FromFormat("'%U.%s.i%d'", path, loom__kind_name(k.kind), (int)k.call);
}

/* Raise OutOfOrderError for mediator `med` about `k`: `missed` says whether the
 * forward ended without serving it. Returns NULL. */
static PyObject *loom__raise_order(loom_il *il, int32_t med, loom_key k, int missed) {
    loom_modstate *st = loom_state_of((PyObject *)il);
    PyObject *what = loom__key_repr(il, k);
    if (what == NULL) return NULL;
    PyObject *path = PyList_GET_ITEM(il->paths, k.module);
    int32_t ran = loom_sched_calls(il->sched, k.module, k.kind);
    PyObject *who = il->meds[med].name;
    if (!missed || ran > 0)
        PyErr_Format(st->OutOfOrderError,
                     "%U was requested but the model already ran past it (%U: module '%U' "
                     "gave its %s %d time(s) in this forward; modules must be requested in "
                     "the order the forward runs them)",
                     what, who, path, loom__kind_name(k.kind), (int)ran);
    else
        PyErr_Format(st->OutOfOrderError,
                     "%U was requested but the forward never reached it (%U: module '%U' was "
                     "not called in this forward)",
                     what, who, path);
    Py_DECREF(what);
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                  */
/* ------------------------------------------------------------------------ */

static void loom__med_clear(loom__med *m) {
    Py_CLEAR(m->greenlet);
    Py_CLEAR(m->code);
    Py_CLEAR(m->ns);
    Py_CLEAR(m->name);
    Py_CLEAR(m->served);
    Py_CLEAR(m->replacement);
    Py_CLEAR(m->skip);
    Py_CLEAR(m->exc_type);
    Py_CLEAR(m->exc_value);
    Py_CLEAR(m->exc_tb);
}

static int il_traverse(loom_il *il, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(il));
    Py_VISIT(il->tile);
    Py_VISIT(il->splits);
    Py_VISIT(il->tree);
    Py_VISIT(il->paths);
    Py_VISIT(il->home);
    for (int32_t i = 0; i < il->n_meds; i++) {
        loom__med *m = &il->meds[i];
        Py_VISIT(m->greenlet);
        Py_VISIT(m->code);
        Py_VISIT(m->ns);
        Py_VISIT(m->name);
        Py_VISIT(m->served);
        Py_VISIT(m->replacement);
        Py_VISIT(m->skip);
        Py_VISIT(m->exc_type);
        Py_VISIT(m->exc_value);
        Py_VISIT(m->exc_tb);
    }
    return 0;
}

static int il_clear(loom_il *il) {
    Py_CLEAR(il->tile);
    Py_CLEAR(il->splits);
    Py_CLEAR(il->tree);
    Py_CLEAR(il->paths);
    Py_CLEAR(il->home);
    for (int32_t i = 0; i < il->n_meds; i++) loom__med_clear(&il->meds[i]);
    return 0;
}

static void il_dealloc(loom_il *il) {
    PyTypeObject *tp = Py_TYPE(il);
    PyObject_GC_UnTrack(il);
    if (il->weakreflist != NULL) PyObject_ClearWeakRefs((PyObject *)il);
    il_clear(il);
    loom_sched_destroy(il->sched);
    PyMem_Free(il->meds);
    PyMem_Free(il->tile_pos);
    tp->tp_free((PyObject *)il);
    Py_DECREF(tp);
}

/* Interleaver(tree, paths: list[str], batch: int) */
static PyObject *il_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *tree, *paths;
    Py_ssize_t batch;
    static char *kwlist[] = {"tree", "paths", "batch", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!n:Interleaver", kwlist, &tree, &PyList_Type,
                                     &paths, &batch))
        return NULL;
    loom_il *il = (loom_il *)type->tp_alloc(type, 0);
    if (il == NULL) return NULL;
    il->current = -1;
    il->tree = Py_NewRef(tree);
    il->paths = Py_NewRef(paths);
    il->batch = batch;
    return (PyObject *)il;
}

/* il.add(code, ns, start, size, name) -> index. Before run() only. */
static PyObject *il_add(loom_il *il, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "add(code, ns, start, size, name)");
        return NULL;
    }
    if (!PyCode_Check(args[0]) || !PyDict_Check(args[1]) || !PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "add(code: code, ns: dict, start, size, name: str)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    Py_ssize_t size = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (il->running) {
        PyErr_SetString(PyExc_ValueError, "cannot add an invoke while the model runs");
        return NULL;
    }
    /* grow mediators and rebuild the scheduler with the new count */
    if (il->n_meds == il->cap) {
        int32_t cap = il->cap ? il->cap * 2 : 4;
        loom__med *p = PyMem_Realloc(il->meds, (size_t)cap * sizeof *p);
        if (p == NULL) return PyErr_NoMemory();
        memset(p + il->cap, 0, (size_t)(cap - il->cap) * sizeof *p);
        il->meds = p;
        il->cap = cap;
    }
    loom__med *m = &il->meds[il->n_meds];
    memset(m, 0, sizeof *m);
    m->code = Py_NewRef(args[0]);
    m->ns = Py_NewRef(args[1]);
    m->name = Py_NewRef(args[4]);
    m->skip_module = -1;
    m->start = start; /* -1: whole batch (an empty invoke or the only one) */
    m->size = size;
    m->pending = LOOM_OK;
    il->n_meds++;
    return PyLong_FromLong(il->n_meds - 1);
}

/* ------------------------------------------------------------------------ */
/* Narrowing and splicing                                                     */
/* ------------------------------------------------------------------------ */

static int loom__is_tensor(loom_modstate *st, PyObject *v) {
    return PyObject_TypeCheck(v, (PyTypeObject *)st->tensor_type);
}

/* Leading size of tensor `t`, or -1 for a 0-dim tensor; -2 on error. */
static Py_ssize_t loom__dim0(loom_modstate *st, PyObject *t) {
    PyObject *shape = PyObject_GetAttr(t, st->str_shape);
    if (shape == NULL) return -2;
    Py_ssize_t d = -1;
    if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0) {
        d = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, 0));
        if (d == -1 && PyErr_Occurred()) d = -2;
    }
    Py_DECREF(shape);
    return d;
}

/* New reference to t.narrow(0, lo, len). */
static PyObject *loom__narrow_tensor(loom_modstate *st, PyObject *t, int64_t lo, int64_t len) {
    PyObject *a[4] = {t, NULL, NULL, NULL};
    a[1] = PyLong_FromLong(0);
    a[2] = PyLong_FromLongLong(lo);
    a[3] = PyLong_FromLongLong(len);
    PyObject *r = NULL;
    if (a[1] && a[2] && a[3])
        r = PyObject_VectorcallMethod(st->str_narrow, a, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_XDECREF(a[1]);
    Py_XDECREF(a[2]);
    Py_XDECREF(a[3]);
    return r;
}

/* New reference: med's rows of tensor `t` (leading size `d0` = k * batch),
 * taken from one split of `t` into every invoke's rows, made once per tensor
 * per boundary. When many invokes wait on one boundary this is one torch
 * call instead of one narrow each. Only used with autograd off (see
 * loom__boundary_splits): split gives multi-output views, which autograd
 * would not let a body edit in place. */
static PyObject *loom__split_view(loom_il *il, PyObject *t, Py_ssize_t d0, int32_t med) {
    PyObject *key = PyLong_FromVoidPtr(t);
    if (key == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(il->splits, key); /* borrowed */
    if (entry == NULL) {
        if (PyErr_Occurred()) goto fail;
        Py_ssize_t k = d0 / il->batch, n = PyList_GET_SIZE(il->tile);
        PyObject *sizes = PyList_New(n);
        if (sizes == NULL) goto fail;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *sz = PyLong_FromSsize_t(PyLong_AsSsize_t(PyList_GET_ITEM(il->tile, i)) * k);
            if (sz == NULL) {
                Py_DECREF(sizes);
                goto fail;
            }
            PyList_SET_ITEM(sizes, i, sz);
        }
        PyObject *parts = PyObject_CallMethod(t, "split", "O", sizes);
        Py_DECREF(sizes);
        if (parts == NULL) goto fail;
        entry = PyTuple_Pack(2, t, parts); /* the tensor stays alive: its id stays its own */
        Py_DECREF(parts);
        if (entry == NULL || PyDict_SetItem(il->splits, key, entry) < 0) {
            Py_XDECREF(entry);
            goto fail;
        }
        Py_DECREF(entry); /* the dict holds it */
    }
    Py_DECREF(key);
    PyObject *parts = PyTuple_GET_ITEM(entry, 1);
    return PySequence_GetItem(parts, il->tile_pos[med]);
fail:
    Py_DECREF(key);
    return NULL;
}

static int loom__is_namedtuple(PyObject *v) {
    return PyTuple_Check(v) && !PyTuple_CheckExact(v) &&
           PyObject_HasAttrString((PyObject *)Py_TYPE(v), "_fields");
}

/* New reference: `v` with every narrowable tensor narrowed to `med`'s rows.
 * Containers (tuple, list, dict, namedtuple) are rebuilt only when something
 * inside changed; other values are passed whole. */
static PyObject *loom__narrow(loom_il *il, loom_modstate *st, int32_t med, PyObject *v,
                              int depth) {
    if (depth > 32) return Py_NewRef(v);
    if (loom__is_tensor(st, v)) {
        Py_ssize_t d0 = loom__dim0(st, v);
        if (d0 == -2) return NULL;
        int64_t lo, len;
        if (d0 < 0 || !loom_sched_rows_for(il->sched, med, d0, &lo, &len)) return Py_NewRef(v);
        if (il->splits != NULL && il->tile_pos[med] >= 0) return loom__split_view(il, v, d0, med);
        return loom__narrow_tensor(st, v, lo, len);
    }
    if (PyTuple_Check(v) || PyList_Check(v)) {
        int is_tuple = PyTuple_Check(v);
        if (is_tuple && !PyTuple_CheckExact(v) && !loom__is_namedtuple(v)) return Py_NewRef(v);
        if (!is_tuple && !PyList_CheckExact(v)) return Py_NewRef(v);
        Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(v) : PyList_GET_SIZE(v);
        PyObject *out = PyList_New(n);
        if (out == NULL) return NULL;
        int changed = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *e = is_tuple ? PyTuple_GET_ITEM(v, i) : PyList_GET_ITEM(v, i);
            PyObject *ne = loom__narrow(il, st, med, e, depth + 1);
            if (ne == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            changed |= ne != e;
            PyList_SET_ITEM(out, i, ne);
        }
        if (!changed) {
            Py_DECREF(out);
            return Py_NewRef(v);
        }
        if (!is_tuple) return out;
        PyObject *t = PyList_AsTuple(out);
        Py_DECREF(out);
        if (t == NULL || PyTuple_CheckExact(v)) return t;
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)Py_TYPE(v), st->str_make, t);
        Py_DECREF(t);
        return r;
    }
    if (PyDict_CheckExact(v)) {
        PyObject *out = PyDict_New();
        if (out == NULL) return NULL;
        PyObject *k, *e;
        Py_ssize_t pos = 0;
        int changed = 0;
        while (PyDict_Next(v, &pos, &k, &e)) {
            PyObject *ne = loom__narrow(il, st, med, e, depth + 1);
            if (ne == NULL || PyDict_SetItem(out, k, ne) < 0) {
                Py_XDECREF(ne);
                Py_DECREF(out);
                return NULL;
            }
            changed |= ne != e;
            Py_DECREF(ne);
        }
        if (!changed) {
            Py_DECREF(out);
            return Py_NewRef(v);
        }
        return out;
    }
    return Py_NewRef(v);
}

/* Raise a shape error about assigning `nv` where `old` was served. */
static int loom__shape_error(loom_il *il, int32_t med, PyObject *old, PyObject *nv) {
    loom_modstate *st = loom_state_of((PyObject *)il);
    loom_key k = loom_sched_key(il->sched, med);
    PyObject *what = loom__key_repr(il, k);
    PyObject *s1 = PyObject_GetAttr(old, st->str_shape);
    PyObject *s2 = PyObject_GetAttr(nv, st->str_shape);
    if (what && s1 && s2)
        PyErr_Format(PyExc_ValueError,
                     "cannot assign to %U in %U: the new value has shape %R but the value "
                     "it replaces has shape %R",
                     what, il->meds[med].name, s2, s1);
    Py_XDECREF(what);
    Py_XDECREF(s1);
    Py_XDECREF(s2);
    return -1;
}

/* Compare shapes of two tensors: 1 equal, 0 different, -1 error. */
static int loom__same_shape(loom_modstate *st, PyObject *a, PyObject *b) {
    PyObject *s1 = PyObject_GetAttr(a, st->str_shape);
    if (s1 == NULL) return -1;
    PyObject *s2 = PyObject_GetAttr(b, st->str_shape);
    if (s2 == NULL) {
        Py_DECREF(s1);
        return -1;
    }
    int r = PyObject_RichCompareBool(s1, s2, Py_EQ);
    Py_DECREF(s1);
    Py_DECREF(s2);
    return r;
}

/* New reference: `whole` with `nv` (what the body assigned for its view
 * `served`) written into med's rows. Tensors narrowed for the body are written
 * in place (view.copy_(nv)); values passed whole are replaced. */
static PyObject *loom__splice(loom_il *il, loom_modstate *st, int32_t med, PyObject *whole,
                              PyObject *served, PyObject *nv, int depth) {
    if (nv == served) return Py_NewRef(whole);
    if (loom__is_tensor(st, whole)) {
        Py_ssize_t d0 = loom__dim0(st, whole);
        if (d0 == -2) return NULL;
        int64_t lo, len;
        int narrowed = d0 >= 0 && loom_sched_rows_for(il->sched, med, d0, &lo, &len);
        if (!loom__is_tensor(st, nv)) {
            if (!narrowed) return Py_NewRef(nv);
            PyErr_Format(PyExc_TypeError,
                         "cannot assign a %.100s to rows of a batched tensor in %U; assign a "
                         "tensor of the invoke's shape",
                         Py_TYPE(nv)->tp_name, il->meds[med].name);
            return NULL;
        }
        int same = loom__same_shape(st, served, nv);
        if (same < 0) return NULL;
        if (!same) {
            loom__shape_error(il, med, served, nv);
            return NULL;
        }
        if (!narrowed) return Py_NewRef(nv);
        PyObject *view = loom__narrow_tensor(st, whole, lo, len);
        if (view == NULL) return NULL;
        PyObject *r = PyObject_CallMethodOneArg(view, st->str_copy_, nv);
        Py_DECREF(view);
        if (r == NULL) return NULL;
        Py_DECREF(r);
        return Py_NewRef(whole);
    }
    if ((PyTuple_Check(whole) || PyList_Check(whole)) && Py_TYPE(nv) == Py_TYPE(whole) &&
        Py_TYPE(served) == Py_TYPE(whole) && depth < 32) {
        int is_tuple = PyTuple_Check(whole);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(whole);
        if (PySequence_Fast_GET_SIZE(nv) == n && PySequence_Fast_GET_SIZE(served) == n) {
            PyObject *out = PyList_New(n);
            if (out == NULL) return NULL;
            for (Py_ssize_t i = 0; i < n; i++) {
                PyObject *e = loom__splice(il, st, med, PySequence_Fast_GET_ITEM(whole, i),
                                           PySequence_Fast_GET_ITEM(served, i),
                                           PySequence_Fast_GET_ITEM(nv, i), depth + 1);
                if (e == NULL) {
                    Py_DECREF(out);
                    return NULL;
                }
                PyList_SET_ITEM(out, i, e);
            }
            if (!is_tuple) return out;
            PyObject *t = PyList_AsTuple(out);
            Py_DECREF(out);
            if (t == NULL || PyTuple_CheckExact(whole)) return t;
            PyObject *r = PyObject_CallMethodOneArg((PyObject *)Py_TYPE(whole), st->str_make, t);
            Py_DECREF(t);
            return r;
        }
    }
    if (PyDict_CheckExact(whole) && PyDict_CheckExact(nv) && PyDict_CheckExact(served) &&
        depth < 32) {
        PyObject *out = PyDict_New();
        if (out == NULL) return NULL;
        PyObject *k, *e;
        Py_ssize_t pos = 0;
        while (PyDict_Next(nv, &pos, &k, &e)) {
            PyObject *w = PyDict_GetItemWithError(whole, k);
            PyObject *sv = w ? PyDict_GetItemWithError(served, k) : NULL;
            PyObject *ne = (w && sv) ? loom__splice(il, st, med, w, sv, e, depth + 1)
                                     : (PyErr_Occurred() ? NULL : Py_NewRef(e));
            if (ne == NULL || PyDict_SetItem(out, k, ne) < 0) {
                Py_XDECREF(ne);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(ne);
        }
        return out;
    }
    return Py_NewRef(nv);
}

/* ------------------------------------------------------------------------ */
/* Handoff                                                                    */
/* ------------------------------------------------------------------------ */

/* ---- worker greenlets ------------------------------------------------------
 *
 * A body runs on a *worker*: a greenlet that loops forever, taking one body at
 * a time. Starting a fresh greenlet on a Python function costs ~10 us (a new
 * frame stack), a switch to a parked one ~0.6 us, so workers are pooled per
 * thread (in the thread state dict) and reused across traces. A worker never
 * lets an exception escape: it records the body's outcome on the mediator and
 * switches back to the trace's home greenlet.
 */

#define LOOM__POOL_KEY "nnloom.worker_pool"
#define LOOM__POOL_MAX 512

static PyObject *loom__worker_main(PyObject *self, PyObject *unused);
static PyMethodDef loom__worker_def = {"_nnloom_worker", loom__worker_main, METH_NOARGS, NULL};

/* Borrowed: this thread's list of idle workers, created on first use. */
static PyObject *loom__pool(void) {
    PyObject *d = PyThreadState_GetDict();
    if (d == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnloom: no thread state dict");
        return NULL;
    }
    PyObject *pool = PyDict_GetItemString(d, LOOM__POOL_KEY);
    if (pool != NULL) return pool;
    pool = PyList_New(0);
    if (pool == NULL) return NULL;
    int rc = PyDict_SetItemString(d, LOOM__POOL_KEY, pool);
    Py_DECREF(pool);
    return rc < 0 ? NULL : pool;
}

/* New reference to an idle worker (pooled or new), or NULL. */
static PyObject *loom__worker_take(void) {
    PyObject *pool = loom__pool();
    if (pool == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(pool);
    if (n > 0) {
        PyObject *w = Py_NewRef(PyList_GET_ITEM(pool, n - 1));
        if (PyList_SetSlice(pool, n - 1, n, NULL) < 0) {
            Py_DECREF(w);
            return NULL;
        }
        return w;
    }
    PyObject *run = PyCFunction_New(&loom__worker_def, NULL);
    if (run == NULL) return NULL;
    PyObject *w = (PyObject *)PyGreenlet_New(run, NULL);
    Py_DECREF(run);
    return w;
}

/* Give an idle worker back (steals `w`). */
static void loom__worker_give(PyObject *w) {
    PyObject *pool = loom__pool();
    if (pool != NULL && PyList_GET_SIZE(pool) < LOOM__POOL_MAX &&
        PyGreenlet_ACTIVE((PyGreenlet *)w))
        (void)PyList_Append(pool, w);
    PyErr_Clear();
    Py_DECREF(w);
}

/* The worker loop: run the body of il->current, record how it ended, report
 * to home, wait for the next body. Returns only when the worker is killed
 * while idle (thread exit, pool cleared). */
static PyObject *loom__worker_main(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    for (;;) {
        loom_il *il = loom__tls_il;
        if (il == NULL || il->current < 0) {
            PyErr_SetString(PyExc_RuntimeError, "nnloom: worker started outside a trace");
            return NULL;
        }
        int32_t med = il->current;
        loom__med *m = &il->meds[med];
        PyObject *code = Py_NewRef(m->code), *ns = Py_NewRef(m->ns);
        PyObject *r = PyEval_EvalCode(code, ns, ns);
        Py_DECREF(code);
        Py_DECREF(ns);
        /* the trace may have moved on; re-read it */
        il = loom__tls_il;
        m = &il->meds[med];
        if (r == NULL) {
            PyErr_Fetch(&m->exc_type, &m->exc_value, &m->exc_tb);
        } else {
            Py_DECREF(r);
        }
        m->finished = 1;
        PyObject *home = Py_NewRef(il->home);
        r = PyGreenlet_Switch((PyGreenlet *)home, NULL, NULL);
        Py_DECREF(home);
        if (r == NULL) return NULL; /* killed while idle */
        Py_DECREF(r);
    }
}

enum { LOOM__RESUMED = 0, LOOM__STOP = 1 };
enum { LOOM__BLOCKED = 1, LOOM__READY = 2 };

/* The body of `med` ended: release its worker and turn its recorded outcome
 * into a state (and the pending exception, for -1). */
static int loom__finish(loom_il *il, int32_t med) {
    loom__med *m = &il->meds[med];
    loom_modstate *st = loom_state_of((PyObject *)il);
    PyObject *w = m->greenlet;
    m->greenlet = NULL;
    m->finished = 0;
    loom__worker_give(w);
    if (m->exc_type == NULL) {
        loom_sched_set_state(il->sched, med, LOOM_MED_DONE);
        return LOOM__RESUMED;
    }
    PyObject *et = m->exc_type, *ev = m->exc_value, *etb = m->exc_tb;
    m->exc_type = m->exc_value = m->exc_tb = NULL;
    if (PyErr_GivenExceptionMatches(et, st->StopTrace)) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(etb);
        loom_sched_set_state(il->sched, med, LOOM_MED_STOPPED);
        il->stopped = 1;
        return LOOM__STOP;
    }
    loom_sched_set_state(il->sched, med, LOOM_MED_FAILED);
    PyErr_Restore(et, ev, etb);
    return -1;
}

/* Switch into mediator `med` and run its user code until it parks or ends.
 * Returns LOOM__RESUMED, LOOM__STOP when the body called stop(), or -1 with the
 * body's exception set. */
static int loom__resume(loom_il *il, int32_t med) {
    loom__med *m = &il->meds[med];
    loom_modstate *st = loom_state_of((PyObject *)il);
    if (m->greenlet == NULL) {
        m->greenlet = loom__worker_take();
        if (m->greenlet == NULL) return -1;
        if (loom_sched_set_state(il->sched, med, LOOM_MED_RUNNING) != LOOM_OK)
            return loom_raise(st, LOOM_ERR_STATE), -1;
    }
    int32_t outer = il->current;
    il->current = med;
    loom_cuda_range_push("nnloom.invoke");
    PyObject *r = PyGreenlet_Switch((PyGreenlet *)m->greenlet, NULL, NULL);
    loom_cuda_range_pop();
    il->current = outer;
    if (r == NULL) {
        /* the worker itself broke (it never lets a body's error escape) */
        Py_CLEAR(m->greenlet);
        loom_sched_set_state(il->sched, med, LOOM_MED_FAILED);
        return -1;
    }
    Py_DECREF(r);
    if (m->finished) return loom__finish(il, med);
    return LOOM__RESUMED;
}

/* Resume, in invoke order, every mediator a barrier released, until none is
 * left. Returns how many ran (>= 0), or -1 / -2 - LOOM__STOP like resume. */
static int loom__run_ready(loom_il *il) {
    int ran = 0;
    if (LOOM_LIKELY(il->n_ready == 0)) return 0;
    for (int again = 1; again;) {
        again = 0;
        for (int32_t i = 0; i < il->n_meds; i++) {
            if (il->meds[i].blocked != LOOM__READY) continue;
            il->meds[i].blocked = 0;
            il->n_ready--;
            int r = loom__resume(il, i);
            if (r < 0) return -1;
            if (r == LOOM__STOP) return -2 - LOOM__STOP;
            ran++;
            again = 1;
        }
    }
    return ran;
}

/* Park the running mediator until the forward serves its request (or the
 * trace tells it otherwise). Runs on the mediator's greenlet. 0 or -1. */
static int loom__park(loom_il *il, int32_t med) {
    PyObject *r = PyGreenlet_Switch((PyGreenlet *)il->home, NULL, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    loom__med *m = &il->meds[med];
    if (LOOM_UNLIKELY(il->aborting)) {
        PyErr_SetNone(PyExc_GreenletExit);
        return -1;
    }
    if (LOOM_UNLIKELY(m->pending != LOOM_OK)) {
        loom_status p = m->pending;
        m->pending = LOOM_OK;
        if (p == LOOM_ERR_STATE)
            PyErr_Format(PyExc_RuntimeError,
                         "%U waited at a barrier that the other invokes never reached before "
                         "the forward ended (check the barrier's count and that every invoke "
                         "calls it)",
                         m->name);
        else
            loom__raise_order(il, med, m->pending_key, p == LOOM_ERR_MISSED);
        return -1;
    }
    return 0;
}

/* Whether this boundary may hand out rows from one split per tensor: the
 * row groups tile the batch, several invokes wait here, and autograd is off
 * (torch.is_grad_enabled() is False). */
static int loom__boundary_splits(loom_il *il, int32_t module, int32_t kind, int32_t call) {
    if (il->tile == NULL) return 0;
    int32_t first = loom_sched_next_waiter(il->sched, module, kind, call, 0);
    if (first < 0 || loom_sched_next_waiter(il->sched, module, kind, call, first + 1) < 0)
        return 0;
    PyObject *torch = PyImport_AddModule("torch"); /* borrowed; imported at init */
    PyObject *on = torch ? PyObject_CallMethod(torch, "is_grad_enabled", NULL) : NULL;
    if (on == NULL) {
        PyErr_Clear();
        return 0;
    }
    int grad = PyObject_IsTrue(on);
    Py_DECREF(on);
    if (grad != 0) {
        PyErr_Clear();
        return 0;
    }
    il->splits = PyDict_New();
    if (il->splits == NULL) PyErr_Clear();
    return il->splits != NULL;
}

int loom_il_boundary(loom_il *il, int32_t module, int32_t kind, PyObject **value) {
    loom_sched *s = il->sched;
    loom_modstate *st = loom_state_of((PyObject *)il);
    int32_t call = loom_sched_begin(s, module, kind);
    loom__boundary_splits(il, module, kind, call);
    for (int32_t i = loom_sched_next_waiter(s, module, kind, call, 0); i >= 0;
         i = loom_sched_next_waiter(s, module, kind, call, i + 1)) {
        loom__med *m = &il->meds[i];
        if (loom_sched_serve(s, i) != LOOM_OK) goto fail_status;
        m->served = loom_sched_is_whole(s, i) ? Py_NewRef(*value)
                                              : loom__narrow(il, st, i, *value, 0);
        if (m->served == NULL) goto fail;
        PyObject *served = Py_NewRef(m->served); /* what the body was first handed */
        if (loom_cuda_nvtx_enabled()) {
            const char *path = PyUnicode_AsUTF8(PyList_GET_ITEM(il->paths, module));
            loom_cuda_range_push(path ? path : "nnloom.handoff");
            PyErr_Clear();
        } else {
            loom_cuda_range_push("nnloom.handoff");
        }
        int rc = loom__resume(il, i);
        loom_cuda_range_pop();
        if (m->replacement != NULL && rc >= 0) {
            PyObject *nv = loom__splice(il, st, i, *value, served, m->replacement, 0);
            if (nv == NULL) rc = -1;
            else Py_SETREF(*value, nv);
        }
        Py_DECREF(served);
        Py_CLEAR(m->served);
        Py_CLEAR(m->replacement);
        if (rc < 0) goto fail;
        if (rc == LOOM__STOP) {
            PyErr_SetNone(st->StopTrace);
            goto fail;
        }
        /* a barrier this body reached may have released others: they run now,
         * still inside this boundary, and may wait for it too */
        int ran = loom__run_ready(il);
        if (ran == -1) goto fail;
        if (ran < -1) {
            PyErr_SetNone(st->StopTrace);
            goto fail;
        }
        if (ran > 0) i = -1; /* rescan: next_waiter(i + 1) starts at 0 */
    }
    Py_CLEAR(il->splits);
    loom_sched_end(s, module, kind);
    return 0;
fail_status:
    loom_raise(st, LOOM_ERR_STATE);
fail:
    Py_CLEAR(il->splits);
    loom_sched_end(s, module, kind);
    Py_CLEAR(*value);
    return -1;
}

PyObject *loom_il_take_skip(loom_il *il, int32_t module) {
    int32_t n_skip = 0, whole = -1;
    for (int32_t i = 0; i < il->n_meds; i++) {
        loom__med *m = &il->meds[i];
        if (m->skip == NULL || m->skip_module != module) continue;
        n_skip++;
        if (loom_sched_is_whole(il->sched, i)) whole = i; /* the last such wins */
    }
    if (n_skip == 0) return NULL;
    PyObject *found = NULL;
    if (whole >= 0) {
        /* an invoke that sees the whole batch gave the whole output */
        found = Py_NewRef(il->meds[whole].skip);
    } else if (n_skip == il->n_meds) {
        /* every invoke gave its rows: join them in row order (invokes are in
         * row order: the batcher lays their inputs out that way) */
        PyObject *parts = PyList_New(0), *cat = NULL, *torch = NULL;
        for (int32_t i = 0; parts != NULL && i < il->n_meds; i++)
            if (PyList_Append(parts, il->meds[i].skip) < 0) Py_CLEAR(parts);
        if (parts != NULL && (torch = PyImport_ImportModule("torch")) != NULL &&
            (cat = PyObject_GetAttrString(torch, "cat")) != NULL)
            found = PyObject_CallOneArg(cat, parts);
        Py_XDECREF(cat);
        Py_XDECREF(torch);
        Py_XDECREF(parts);
    }
    int ok = found != NULL;
    for (int32_t i = 0; i < il->n_meds; i++) {
        if (il->meds[i].skip_module != module) continue;
        Py_CLEAR(il->meds[i].skip);
        il->meds[i].skip_module = -1;
    }
    if (ok) return found;
    if (PyErr_Occurred()) return NULL;
    PyErr_Format(PyExc_ValueError,
                 "module '%U' was skipped by %d of %d invokes; in a batched trace every "
                 "invoke must skip it (or none)",
                 PyList_GET_ITEM(il->paths, module), (int)n_skip, (int)il->n_meds);
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Requests from bodies                                                       */
/* ------------------------------------------------------------------------ */

/* The interleaver and mediator running user code on this thread for `tree`,
 * or NULL with ValueError naming `what`. */
static loom_il *loom__caller(PyObject *tree, int32_t module, const char *what) {
    loom_il *il = loom__tls_il;
    if (il == NULL || il->current < 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s can only be used inside the body of a trace (with model.trace(...):)",
                     what);
        return NULL;
    }
    if (il->tree != tree) {
        PyErr_Format(PyExc_ValueError,
                     "%s: this module belongs to a different model than the one being traced",
                     what);
        return NULL;
    }
    if (module < 0 || module >= (int32_t)PyList_GET_SIZE(il->paths)) {
        PyErr_Format(PyExc_ValueError, "%s: unknown module index %d", what, (int)module);
        return NULL;
    }
    if (il->aborting) {
        PyErr_SetNone(PyExc_GreenletExit);
        return NULL;
    }
    return il;
}

/* Make the caller SERVED at (module, kind): the same occurrence if it already
 * is (unless `fresh`), else park until the next one. 0 or -1. */
static int loom__acquire(loom_il *il, int32_t med, int32_t module, int32_t kind, int fresh) {
    loom_sched *s = il->sched;
    if (!fresh && loom_sched_state(s, med) == LOOM_MED_SERVED) {
        loom_key k = loom_sched_key(s, med);
        if (k.module == module && k.kind == kind) return 0;
    }
    loom_key key;
    loom_status rc = loom_sched_request(s, med, module, kind, &key);
    if (rc == LOOM_ERR_OUT_OF_ORDER) {
        loom__raise_order(il, med, key, 0);
        return -1;
    }
    if (rc != LOOM_OK) return loom_raise(loom_state_of((PyObject *)il), rc), -1;
    /* the greenlet switch may resume us after the forward ended (missed) */
    return loom__park(il, med);
}

/* New reference: the part of a served value that `sel` names. */
static PyObject *loom__select(PyObject *served, int sel) {
    if (sel == LOOM_SEL_OUTPUT || sel == LOOM_SEL_INPUTS) return Py_NewRef(served);
    /* input: first positional argument, else the first keyword argument */
    PyObject *args = PyTuple_GET_ITEM(served, 0), *kwargs = PyTuple_GET_ITEM(served, 1);
    if (PyTuple_GET_SIZE(args) > 0) return Py_NewRef(PyTuple_GET_ITEM(args, 0));
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    if (PyDict_Next(kwargs, &pos, &k, &v)) return Py_NewRef(v);
    Py_RETURN_NONE;
}

/* Selector argument: sel | LOOM_SEL_FRESH asks for the next occurrence even
 * while the current one is being served (Envoy.next()). */
#define LOOM_SEL_FRESH 8

static int loom__parse_req(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                           int32_t *module, int *sel, int *fresh) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    long m = PyLong_AsLong(args[1]);
    long s = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) return -1;
    *fresh = (s & LOOM_SEL_FRESH) != 0;
    s &= ~LOOM_SEL_FRESH;
    if (s < 0 || s > 2) {
        PyErr_Format(PyExc_ValueError, "bad selector %ld", s);
        return -1;
    }
    *module = (int32_t)m;
    *sel = (int)s;
    return 0;
}

static const char *loom__sel_name(int sel) {
    return sel == LOOM_SEL_OUTPUT ? ".output" : sel == LOOM_SEL_INPUTS ? ".inputs" : ".input";
}

/* The common start of request() and assign(): parse (tree, module, sel, ...)
 * and make the calling body SERVED at that boundary. Returns the interleaver
 * (the body's mediator in *med, the selector in *sel), or NULL with an
 * exception set. */
static loom_il *loom__serve_caller(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                                   int *sel, int32_t *med) {
    int32_t module;
    int fresh;
    if (loom__parse_req(args, nargs, want, &module, sel, &fresh) < 0) return NULL;
    loom_il *il = loom__caller(args[0], module, loom__sel_name(*sel));
    if (il == NULL) return NULL;
    *med = il->current;
    int32_t kind = *sel == LOOM_SEL_OUTPUT ? LOOM_KIND_OUTPUT : LOOM_KIND_INPUT;
    if (loom__acquire(il, *med, module, kind, fresh) < 0) return NULL;
    return il;
}

/* request(tree, module, sel) -> the live value (narrowed to the invoke). */
static PyObject *loom_request(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    int sel;
    int32_t med;
    loom_il *il = loom__serve_caller(args, nargs, 3, &sel, &med);
    if (il == NULL) return NULL;
    return loom__select(il->meds[med].served, sel);
}

/* assign(tree, module, sel, value): replace the value for the rest of the
 * forward (spliced into the invoke's rows). */
static PyObject *loom_assign(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    int sel;
    int32_t med;
    loom_il *il = loom__serve_caller(args, nargs, 4, &sel, &med);
    if (il == NULL) return NULL;
    loom__med *m = &il->meds[med];
    PyObject *v = args[3], *nv = NULL;
    if (sel == LOOM_SEL_OUTPUT) {
        nv = Py_NewRef(v);
    } else if (sel == LOOM_SEL_INPUTS) {
        if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(v, 0)) ||
            !PyDict_Check(PyTuple_GET_ITEM(v, 1))) {
            PyErr_SetString(PyExc_TypeError,
                            ".inputs must be assigned a pair (args: tuple, kwargs: dict)");
            return NULL;
        }
        nv = Py_NewRef(v);
    } else {
        PyObject *a = PyTuple_GET_ITEM(m->served, 0), *kw = PyTuple_GET_ITEM(m->served, 1);
        if (PyTuple_GET_SIZE(a) > 0) {
            Py_ssize_t n = PyTuple_GET_SIZE(a);
            PyObject *na = PyTuple_New(n);
            if (na == NULL) return NULL;
            PyTuple_SET_ITEM(na, 0, Py_NewRef(v));
            for (Py_ssize_t j = 1; j < n; j++) PyTuple_SET_ITEM(na, j, Py_NewRef(PyTuple_GET_ITEM(a, j)));
            nv = PyTuple_Pack(2, na, kw);
            Py_DECREF(na);
        } else {
            PyObject *k, *old;
            Py_ssize_t pos = 0;
            if (!PyDict_Next(kw, &pos, &k, &old)) {
                PyErr_SetString(PyExc_ValueError, "the module was called without arguments; "
                                                  "there is no .input to assign");
                return NULL;
            }
            PyObject *nkw = PyDict_Copy(kw);
            if (nkw == NULL || PyDict_SetItem(nkw, k, v) < 0) {
                Py_XDECREF(nkw);
                return NULL;
            }
            nv = PyTuple_Pack(2, a, nkw);
            Py_DECREF(nkw);
        }
        if (nv == NULL) return NULL;
    }
    /* tensors keep their shape: check now, at the user's line */
    loom_modstate *st = loom_state_of((PyObject *)il);
    PyObject *old_leaf = loom__select(m->served, sel);
    PyObject *new_leaf = loom__select(nv, sel);
    int bad = 0;
    if (old_leaf && new_leaf && loom__is_tensor(st, old_leaf) && loom__is_tensor(st, new_leaf)) {
        int same = loom__same_shape(st, old_leaf, new_leaf);
        if (same < 0) bad = 1;
        else if (!same) bad = 1, loom__shape_error(il, med, old_leaf, new_leaf);
    }
    Py_XDECREF(old_leaf);
    Py_XDECREF(new_leaf);
    if (bad) {
        Py_DECREF(nv);
        return NULL;
    }
    Py_XSETREF(m->replacement, Py_NewRef(nv));
    Py_SETREF(m->served, nv); /* later reads in this boundary see the new value */
    Py_RETURN_NONE;
}

/* skip(tree, module, value): do not run the module; `value` is its output. */
static PyObject *loom_skip(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "skip(tree, module, value)");
        return NULL;
    }
    long module = PyLong_AsLong(args[1]);
    if (module == -1 && PyErr_Occurred()) return NULL;
    loom_il *il = loom__caller(args[0], (int32_t)module, ".skip()");
    if (il == NULL) return NULL;
    int32_t med = il->current;
    if (loom__acquire(il, med, (int32_t)module, LOOM_KIND_INPUT, 0) < 0) return NULL;
    loom__med *m = &il->meds[med];
    Py_XSETREF(m->skip, Py_NewRef(args[2]));
    m->skip_module = (int32_t)module;
    Py_RETURN_NONE;
}

/* block(): park the running body until release(its index) is called. */
static PyObject *loom_block(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    loom_il *il = loom__tls_il;
    if (il == NULL || il->current < 0) {
        PyErr_SetString(PyExc_ValueError, "a barrier can only be waited on inside an invoke");
        return NULL;
    }
    int32_t med = il->current;
    if (loom_sched_state(il->sched, med) == LOOM_MED_SERVED) loom_sched_unserve(il->sched, med);
    il->meds[med].blocked = LOOM__BLOCKED;
    if (loom__park(il, med) < 0) {
        il->meds[med].blocked = 0;
        return NULL;
    }
    Py_RETURN_NONE;
}

/* release(i): let invoke i, blocked on a barrier, run again as soon as the
 * body calling this parks. */
static PyObject *loom_release(PyObject *mod, PyObject *arg) {
    (void)mod;
    loom_il *il = loom__tls_il;
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (il == NULL || i < 0 || i >= il->n_meds || il->meds[i].blocked != LOOM__BLOCKED) {
        PyErr_Format(PyExc_ValueError, "invoke %ld is not waiting at a barrier", i);
        return NULL;
    }
    il->meds[i].blocked = LOOM__READY;
    il->n_ready++;
    Py_RETURN_NONE;
}

/* set_iteration(step): the running body's requests from now on ask for the
 * occurrence of generation step `step`. */
static PyObject *loom_set_iteration(PyObject *mod, PyObject *arg) {
    loom_il *il = loom__tls_il;
    long step = PyLong_AsLong(arg);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (il == NULL || il->current < 0) {
        PyErr_SetString(PyExc_ValueError, "tracer.iter can only be used inside the body of a trace");
        return NULL;
    }
    int32_t med = il->current;
    if (loom_sched_state(il->sched, med) == LOOM_MED_SERVED) loom_sched_unserve(il->sched, med);
    loom_status rc = loom_sched_set_iteration(il->sched, med, (int32_t)step);
    if (rc != LOOM_OK) return loom_raise(loom_state(mod), rc);
    Py_RETURN_NONE;
}

/* stop(): end the forward early; everything saved so far is kept. */
static PyObject *loom_stop(PyObject *mod, PyObject *unused) {
    (void)unused;
    PyErr_SetNone(loom_state(mod)->StopTrace);
    return NULL;
}

/* current_invoke() -> index of the invoke whose body runs now, or -1. */
static PyObject *loom_current_invoke(PyObject *mod, PyObject *unused) {
    (void)mod;
    (void)unused;
    loom_il *il = loom__tls_il;
    return PyLong_FromLong(il ? il->current : -1);
}

/* ------------------------------------------------------------------------ */
/* The driver                                                                 */
/* ------------------------------------------------------------------------ */

/* Tear down every mediator that has not ended: raise GreenletExit at its
 * parking point so its frames unwind, then give its worker back. A body that
 * refuses to end (swallows GreenletExit and parks again) keeps its worker out
 * of the pool. Keeps the pending exception. */
static void loom__abort_all(loom_il *il) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    il->aborting = 1;
    for (int32_t i = 0; i < il->n_meds; i++) {
        loom__med *m = &il->meds[i];
        for (int tries = 0; tries < 3 && m->greenlet != NULL && !m->finished; tries++) {
            int32_t outer = il->current;
            il->current = i;
            PyObject *r = PyGreenlet_Throw((PyGreenlet *)m->greenlet, PyExc_GreenletExit, NULL,
                                           NULL);
            il->current = outer;
            if (r == NULL) {
                PyErr_Clear();
                Py_CLEAR(m->greenlet); /* the worker died: never reuse it */
            } else {
                Py_DECREF(r);
            }
        }
        if (m->greenlet != NULL && m->finished) {
            loom__finish(il, i);
            PyErr_Clear(); /* the GreenletExit (or whatever it ended with) */
        }
        Py_CLEAR(m->greenlet);
        loom_med_state s = loom_sched_state(il->sched, i);
        if (s != LOOM_MED_DONE && s != LOOM_MED_FAILED && s != LOOM_MED_STOPPED)
            loom_sched_set_state(il->sched, i, LOOM_MED_STOPPED);
    }
    il->aborting = 0;
    PyErr_Restore(et, ev, etb);
}

/* Drop what only the run needed (workers, served and assigned values, the
 * forward's greenlet); the namespaces stay: the caller reads the saves. */
static void loom__release(loom_il *il) {
    for (int32_t i = 0; i < il->n_meds; i++) {
        loom__med *m = &il->meds[i];
        Py_CLEAR(m->greenlet);
        Py_CLEAR(m->served);
        Py_CLEAR(m->replacement);
        Py_CLEAR(m->skip);
    }
    Py_CLEAR(il->home);
}

/* When the invokes' row groups, in invoke order, tile [0, batch) (the
 * batcher's layout), record their sizes and each invoke's place for
 * loom__split_view. 0, or -1 with an exception set. */
static int loom__tile(loom_il *il) {
    Py_CLEAR(il->tile);
    PyMem_Free(il->tile_pos);
    il->tile_pos = PyMem_Calloc((size_t)(il->n_meds ? il->n_meds : 1), sizeof(int32_t));
    if (il->tile_pos == NULL) return PyErr_NoMemory(), -1;
    for (int32_t i = 0; i < il->n_meds; i++) il->tile_pos[i] = -1;
    int64_t next = 0;
    int32_t n = 0;
    for (int32_t i = 0; i < il->n_meds; i++) {
        loom__med *m = &il->meds[i];
        if (m->start < 0) continue;
        if (m->start != next || m->size <= 0) return 0; /* not a tiling: narrow one by one */
        next += m->size;
        il->tile_pos[i] = n++;
    }
    if (n < 2 || next != il->batch) return 0;
    il->tile = PyList_New(n);
    if (il->tile == NULL) return -1;
    for (int32_t i = 0; i < il->n_meds; i++) {
        if (il->tile_pos[i] < 0) continue;
        PyObject *sz = PyLong_FromLongLong(il->meds[i].size);
        if (sz == NULL) return -1;
        PyList_SET_ITEM(il->tile, il->tile_pos[i], sz);
    }
    return 0;
}

/* il.run(fn, args: tuple, kwargs: dict, result_module=-1) -> fn's result, or
 * None when a body stopped the forward. Runs every body interleaved with
 * fn(*args, **kwargs); `result_module` is the boundary index that serves the
 * call's result to bodies asking for it (tracer.result). */
static PyObject *il_run(loom_il *il, PyObject *const *args, Py_ssize_t nargs) {
    long result_module = -1;
    if (nargs == 4 && (result_module = PyLong_AsLong(args[3])) == -1 && PyErr_Occurred())
        return NULL;
    if (nargs < 3 || nargs > 4 || !PyTuple_Check(args[1]) || !PyDict_Check(args[2]) ||
        result_module >= (long)PyList_GET_SIZE(il->paths)) {
        PyErr_SetString(PyExc_TypeError,
                        "run(fn, args: tuple, kwargs: dict, result_module: int = -1)");
        return NULL;
    }
    if (il->running || il->sched != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an Interleaver runs once");
        return NULL;
    }
    loom_modstate *st = loom_state_of((PyObject *)il);
    PyObject *result = NULL;

    /* the scheduler, now that the mediator count is final */
    loom_sched *s = NULL;
    loom_status rc = loom_sched_create((int32_t)PyList_GET_SIZE(il->paths), il->n_meds,
                                       il->batch, &s);
    if (rc != LOOM_OK) return loom_raise(st, rc);
    il->sched = s;
    for (int32_t i = 0; i < il->n_meds; i++) {
        loom__med *m = &il->meds[i];
        if (m->start >= 0 && (rc = loom_sched_set_rows(s, i, m->start, m->size)) != LOOM_OK)
            return loom_raise(st, rc);
    }
    if (loom__tile(il) < 0) return NULL;

    il->home = (PyObject *)PyGreenlet_GetCurrent();
    if (il->home == NULL) return NULL;
    il->prev = loom__tls_il;
    loom__tls_il = il;
    il->running = 1;
    loom_cuda_range_push("nnloom.trace");

    /* 1. run each body up to its first request */
    for (int32_t i = 0; i < il->n_meds && !il->stopped; i++) {
        int r = loom__resume(il, i);
        if (r < 0) goto fail;
        if (!il->stopped && loom__run_ready(il) == -1) goto fail;
    }
    /* 2. the forward */
    if (!il->stopped) {
        result = PyObject_Call(args[0], args[1], args[2]);
        if (result == NULL) {
            if (!(il->stopped && PyErr_ExceptionMatches(st->StopTrace))) goto fail;
            PyErr_Clear();
        }
    }
    if (result == NULL) result = Py_NewRef(Py_None);
    /* the whole call's result is one more boundary (tracer.result in a body) */
    else if (result_module >= 0 && !il->stopped &&
             loom_sched_has_waiters(s, (int32_t)result_module, LOOM_KIND_OUTPUT)) {
        if (loom_il_boundary(il, (int32_t)result_module, LOOM_KIND_OUTPUT, &result) < 0) {
            if (!(il->stopped && PyErr_ExceptionMatches(st->StopTrace))) goto fail;
            PyErr_Clear();
            result = Py_NewRef(Py_None);
        }
    }
    /* 3. requests the forward never served raise in their bodies */
    if (!il->stopped) {
        for (int32_t i = loom_sched_next_missed(s, 0), guard = 0; i >= 0 && guard < 4 * il->n_meds + 8;
             i = loom_sched_next_missed(s, i), guard++) {
            loom__med *m = &il->meds[i];
            m->pending = LOOM_ERR_MISSED;
            m->pending_key = loom_sched_key(s, i);
            /* back to RUNNING: the body sees the error at its request */
            loom_sched_cancel(s, i);
            int r = loom__resume(il, i);
            if (r < 0) goto fail;
            if (r == LOOM__STOP) break;
            if (loom__run_ready(il) == -1) goto fail;
        }
        /* bodies still parked on a barrier nobody completed */
        for (int32_t i = 0; i < il->n_meds && !il->stopped; i++) {
            if (il->meds[i].blocked != LOOM__BLOCKED) continue;
            il->meds[i].blocked = 0;
            il->meds[i].pending = LOOM_ERR_STATE;
            int r = loom__resume(il, i);
            if (r < 0) goto fail;
            if (loom__run_ready(il) == -1) goto fail;
        }
    }
    goto exit;
fail:
    Py_CLEAR(result);
exit:
    /* nothing stays parked, the range closes, the thread's previous trace
     * (if any) is active again; keeps the pending exception on failure */
    loom__abort_all(il);
    loom_cuda_range_pop();
    il->running = 0;
    loom__tls_il = il->prev;
    il->prev = NULL;
    loom__release(il);
    return result;
}

/* il.state(i) -> str: the scheduler state of mediator i (for tests). */
static PyObject *il_state(loom_il *il, PyObject *arg) {
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (il->sched == NULL) return PyUnicode_FromString("new");
    if (i < 0 || i >= il->n_meds) {
        PyErr_SetString(PyExc_IndexError, "mediator index out of range");
        return NULL;
    }
    static const char *names[] = {"new", "running", "waiting", "served",
                                  "done", "failed", "stopped"};
    return PyUnicode_FromString(names[loom_sched_state(il->sched, (int32_t)i)]);
}

static PyObject *il_get_live(loom_il *il, void *closure) {
    (void)closure;
    int32_t n = 0;
    for (int32_t i = 0; i < il->n_meds; i++) n += il->meds[i].greenlet != NULL;
    return PyLong_FromLong(n);
}

static PyMethodDef il_methods[] = {
    {"add", (PyCFunction)(void (*)(void))il_add, METH_FASTCALL,
     "add(code, ns, start, size, name) -> index of the new mediator"},
    {"run", (PyCFunction)(void (*)(void))il_run, METH_FASTCALL,
     "run(fn, args, kwargs) -> result of the forward, bodies interleaved"},
    {"state", (PyCFunction)il_state, METH_O, "state(i) -> scheduler state of mediator i"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef il_getset[] = {
    {"live_greenlets", (getter)il_get_live, NULL, "greenlets still held", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef il_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(loom_il, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot il_slots[] = {
    {Py_tp_new, il_new},
    {Py_tp_dealloc, il_dealloc},
    {Py_tp_traverse, il_traverse},
    {Py_tp_clear, il_clear},
    {Py_tp_methods, il_methods},
    {Py_tp_getset, il_getset},
    {Py_tp_members, il_members},
    {Py_tp_doc, "Interleaver(tree, paths, batch): runs one trace's bodies with a forward."},
    {0, NULL},
};

static PyType_Spec il_spec = {
    .name = "nnloom._C.Interleaver",
    .basicsize = sizeof(loom_il),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = il_slots,
};

static PyMethodDef il_functions[] = {
    {"request", (PyCFunction)(void (*)(void))loom_request, METH_FASTCALL,
     "request(tree, module, sel) -> live value for the running body"},
    {"assign", (PyCFunction)(void (*)(void))loom_assign, METH_FASTCALL,
     "assign(tree, module, sel, value): replace the value for the rest of the forward"},
    {"skip", (PyCFunction)(void (*)(void))loom_skip, METH_FASTCALL,
     "skip(tree, module, value): use value as the module's output without running it"},
    {"stop", loom_stop, METH_NOARGS, "stop(): end the forward early"},
    {"set_iteration", loom_set_iteration, METH_O,
     "set_iteration(step): pin the running body's requests to a generation step"},
    {"block", loom_block, METH_NOARGS, "block(): park the running invoke until released"},
    {"release", loom_release, METH_O, "release(i): wake invoke i from a barrier"},
    {"current_invoke", loom_current_invoke, METH_NOARGS,
     "current_invoke() -> index of the running invoke body, or -1"},
    {NULL, NULL, 0, NULL},
};

int loom_il_module_init(PyObject *m) {
    PyGreenlet_Import();
    if (_PyGreenlet_API == NULL) return -1;
    loom_modstate *st = loom_state(m);
    st->il_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &il_spec, NULL);
    if (st->il_type == NULL) return -1;
    if (PyModule_AddObjectRef(m, "Interleaver", (PyObject *)st->il_type) < 0) return -1;
    return PyModule_AddFunctions(m, il_functions);
}
