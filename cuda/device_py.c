/* cuda/device_py.c - the Python half of cuda/: pinned pools, retained
 * handles exported through DLPack, compact staging of saved tensors, NVTX
 * ranges.
 *
 * Types (heap types on nnloom._C):
 *   PinnedPool  owns a reference to a C pool; lease(), stage(), stats().
 *   Retained    a handle over a container that is either one pooled block
 *               (holding its lease) or a caller-owned tensor; clone() shares
 *               the container, never copies; __dlpack__ exports the pooled
 *               bytes with a deleter that releases the export.
 *   Staged      the result of stage(): one pooled block holding the compact
 *               copies, their dtypes, shapes and offsets; tensors() waits
 *               for the copy stream's event (the only host wait) and returns
 *               torch tensors viewing the block.
 *   nvtx_range  a context manager pushing/popping one range.
 * Tensor facts are read in C from torch's DLPack export, one call per tensor.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "../base/pybase.h"
#include "cuda_internal.h"
#include "device.h"
#include "dlpack_abi.h"

/* ======================================================================== */
/* Containers: what retained handles share                                   */
/* ======================================================================== */

typedef struct {
    int refs;             /* handles and Staged objects sharing it (GIL held) */
    loom_cuda_block *blk; /* pooled: holds the block's lease; else NULL */
    PyObject *owned;      /* caller-owned tensor (strong); else NULL */
} container;

/* New container with one reference; steals nothing. NULL + MemoryError. */
static container *container_new(loom_cuda_block *blk, PyObject *owned) {
    container *c = loom_malloc(sizeof *c);
    if (c == NULL) return (container *)PyErr_NoMemory();
    c->refs = 1;
    c->blk = blk;
    c->owned = Py_XNewRef(owned);
    return c;
}

/* Drop one reference (GIL held): the last one ends the lease or lets the
 * caller's tensor go. */
static void container_decref(container *c) {
    if (c == NULL || --c->refs > 0) return;
    if (c->blk) loom_cuda_block_end_lease(c->blk);
    Py_XDECREF(c->owned);
    loom_free(c);
}

/* ======================================================================== */
/* DLPack export of pooled bytes                                             */
/* ======================================================================== */

typedef struct {
    loom_dl_managed m;                /* handed to the consumer */
    int64_t shape[LOOM_CUDA_MAX_DIMS];
    int64_t strides[LOOM_CUDA_MAX_DIMS];
    loom_cuda_block *blk;             /* one export of it */
} export_ctx;

/* Runs once, from the consumer (any thread, maybe without the GIL): pure C. */
static void export_deleter(loom_dl_managed *m) {
    export_ctx *x = (export_ctx *)m;
    loom_cuda_block_unexport(x->blk);
    loom_free(x);
}

static void capsule_destructor(PyObject *cap) {
    /* never consumed: the capsule still owns the tensor */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        loom_dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
        if (m && m->deleter) m->deleter(m);
    }
}

/* A "dltensor" capsule viewing blk at `offset` as (dtype, shape); the
 * export keeps the block held. Returns a new reference. */
static PyObject *export_capsule(loom_cuda_block *blk, size_t offset, loom_dl_dtype dtype, int ndim,
                                const int64_t *shape) {
    export_ctx *x = loom_calloc(1, sizeof *x);
    if (x == NULL) return PyErr_NoMemory();
    int64_t st = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        x->shape[d] = shape[d];
        x->strides[d] = st;
        st *= shape[d] > 0 ? shape[d] : 1;
    }
    x->blk = blk;
    x->m.dl_tensor.data = loom_cuda_block_data(blk);
    x->m.dl_tensor.byte_offset = offset;
    x->m.dl_tensor.device.device_type = LOOM_DL_CPU; /* pinned host bytes read as CPU memory */
    x->m.dl_tensor.device.device_id = 0;
    x->m.dl_tensor.ndim = ndim;
    x->m.dl_tensor.dtype = dtype;
    x->m.dl_tensor.shape = x->shape;
    x->m.dl_tensor.strides = x->strides;
    x->m.manager_ctx = x;
    x->m.deleter = export_deleter;
    loom_cuda_block_export(blk);
    PyObject *cap = PyCapsule_New(&x->m, "dltensor", capsule_destructor);
    if (cap == NULL) export_deleter(&x->m);
    return cap;
}

/* Host-wait for the block's copies, without the GIL. -1 with an exception. */
static int wait_block(loom_modstate *st, loom_cuda_block *blk) {
    loom_status s;
    if (loom_cuda_block_ready(blk)) return 0;
    Py_BEGIN_ALLOW_THREADS
    s = loom_cuda_block_wait(blk);
    Py_END_ALLOW_THREADS
    if (s != LOOM_OK) {
        loom_raise(st, s);
        return -1;
    }
    return 0;
}

/* ======================================================================== */
/* Fake events (tests drive completion from Python)                           */
/* ======================================================================== */

static uint64_t fake_next = 1; /* id of the next marker */
static uint64_t fake_done;     /* markers with id <= this are complete */
static uint64_t fake_live;     /* recorded and not yet released */

static loom_status fake_record(void *ctx, void *stream, void **event) {
    (void)ctx, (void)stream;
    *event = (void *)(uintptr_t)__atomic_fetch_add(&fake_next, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&fake_live, 1, __ATOMIC_RELAXED);
    return LOOM_OK;
}
static int fake_query(void *ctx, void *event) {
    (void)ctx;
    return (uint64_t)(uintptr_t)event <= __atomic_load_n(&fake_done, __ATOMIC_ACQUIRE);
}
static loom_status fake_wait(void *ctx, void *event) {
    (void)ctx;
    if (!fake_query(NULL, event))
        return loom_fail(LOOM_ERR_TIMEOUT, "fake event %llu never completed",
                         (unsigned long long)(uintptr_t)event);
    return LOOM_OK;
}
static void fake_release(void *ctx, void *event) {
    (void)ctx, (void)event;
    __atomic_sub_fetch(&fake_live, 1, __ATOMIC_RELAXED);
}
static const loom_cuda_event_source fake_events = {NULL, fake_record, fake_query, fake_wait,
                                                   fake_release};

/* ======================================================================== */
/* Helpers                                                                    */
/* ======================================================================== */

/* Borrowed type object registered on the module under `name`. */
static PyTypeObject *cuda_type(PyObject *obj, const char *name) {
    PyObject *m = PyType_GetModule(Py_TYPE(obj));
    if (m == NULL) return NULL;
    PyObject *t = PyDict_GetItemString(PyModule_GetDict(m), name);
    if (t == NULL) PyErr_Format(PyExc_RuntimeError, "nnloom._C.%s missing", name);
    return (PyTypeObject *)t;
}

static PyObject *shape_tuple(int ndim, const int64_t *shape) {
    PyObject *t = PyTuple_New(ndim);
    if (t == NULL) return NULL;
    for (int d = 0; d < ndim; d++) {
        PyObject *v = PyLong_FromLongLong(shape[d]);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, d, v);
    }
    return t;
}

/* ======================================================================== */
/* Retained                                                                   */
/* ======================================================================== */

typedef struct {
    PyObject_HEAD
    container *c;                      /* shared, one reference */
    size_t offset;                     /* pooled: bytes into the block */
    loom_dl_dtype dtype;               /* pooled: element type */
    int ndim;
    int64_t shape[LOOM_CUDA_MAX_DIMS]; /* pooled: compact shape */
} RetainedObject;

/* New handle sharing `c` (takes a new reference on it). */
static PyObject *retained_make(PyTypeObject *tp, container *c, size_t offset, loom_dl_dtype dtype,
                               int ndim, const int64_t *shape) {
    RetainedObject *r = (RetainedObject *)tp->tp_alloc(tp, 0);
    if (r == NULL) return NULL;
    c->refs++;
    r->c = c;
    r->offset = offset;
    r->dtype = dtype;
    r->ndim = ndim;
    if (ndim) memcpy(r->shape, shape, (size_t)ndim * sizeof *shape);
    return (PyObject *)r;
}

static void retained_dealloc(PyObject *self) {
    RetainedObject *r = (RetainedObject *)self;
    PyTypeObject *tp = Py_TYPE(self);
    container_decref(r->c);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *retained_clone(PyObject *self, PyObject *unused) {
    (void)unused;
    RetainedObject *r = (RetainedObject *)self;
    return retained_make(Py_TYPE(self), r->c, r->offset, r->dtype, r->ndim, r->shape);
}

/* from_tensor(t): retain a caller-owned tensor (never copied, never pooled). */
static PyObject *retained_from_tensor(PyObject *cls, PyObject *t) {
    loom_modstate *st = PyType_GetModuleState((PyTypeObject *)cls);
    if (st == NULL) return NULL;
    if (!PyObject_TypeCheck(t, (PyTypeObject *)st->tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "Retained.from_tensor expects a torch.Tensor");
        return NULL;
    }
    container *c = container_new(NULL, t);
    if (c == NULL) return NULL;
    PyObject *r = retained_make((PyTypeObject *)cls, c, 0, (loom_dl_dtype){0, 0, 0}, 0, NULL);
    container_decref(c);
    return r;
}

static PyObject *retained_dlpack(PyObject *self, PyObject *args, PyObject *kw) {
    (void)args, (void)kw; /* stream: the bytes are on the host and complete once waited for */
    RetainedObject *r = (RetainedObject *)self;
    if (r->c->owned) return PyObject_CallMethod(r->c->owned, "__dlpack__", NULL);
    if (wait_block(loom_state_of(self), r->c->blk) < 0) return NULL;
    return export_capsule(r->c->blk, r->offset, r->dtype, r->ndim, r->shape);
}

static PyObject *retained_dlpack_device(PyObject *self, PyObject *unused) {
    (void)unused;
    RetainedObject *r = (RetainedObject *)self;
    if (r->c->owned) return PyObject_CallMethod(r->c->owned, "__dlpack_device__", NULL);
    return Py_BuildValue("(ii)", LOOM_DL_CPU, 0);
}

/* tensor(): pooled -> a torch tensor viewing the block; caller-owned -> the
 * caller's own tensor object. */
static PyObject *retained_tensor(PyObject *self, PyObject *unused) {
    (void)unused;
    RetainedObject *r = (RetainedObject *)self;
    if (r->c->owned) return Py_NewRef(r->c->owned);
    PyObject *cap = retained_dlpack(self, NULL, NULL);
    if (cap == NULL) return NULL;
    PyObject *torch_c = PyImport_ImportModule("torch._C");
    PyObject *t = NULL;
    if (torch_c != NULL) {
        t = PyObject_CallMethod(torch_c, "_from_dlpack", "O", cap);
        Py_DECREF(torch_c);
    }
    Py_DECREF(cap);
    return t;
}

/* _record(stream: int): mark the block used by `stream` (tests, fake events). */
static PyObject *retained_record(PyObject *self, PyObject *stream) {
    RetainedObject *r = (RetainedObject *)self;
    if (r->c->blk == NULL) {
        PyErr_SetString(PyExc_ValueError, "caller-owned handles have no pooled block");
        return NULL;
    }
    void *s = PyLong_AsVoidPtr(stream);
    if (s == NULL && PyErr_Occurred()) return NULL;
    loom_status rc = loom_cuda_block_record(r->c->blk, s);
    if (rc != LOOM_OK) return loom_raise(loom_state_of(self), rc);
    Py_RETURN_NONE;
}

static PyObject *retained_get_pooled(PyObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(((RetainedObject *)self)->c->blk != NULL);
}
static PyObject *retained_get_refcount(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(((RetainedObject *)self)->c->refs);
}
static PyObject *retained_get_data_ptr(PyObject *self, void *c) {
    (void)c;
    RetainedObject *r = (RetainedObject *)self;
    if (r->c->owned) return PyObject_CallMethod(r->c->owned, "data_ptr", NULL);
    return PyLong_FromVoidPtr((char *)loom_cuda_block_data(r->c->blk) + r->offset);
}
static PyObject *retained_get_shape(PyObject *self, void *c) {
    (void)c;
    RetainedObject *r = (RetainedObject *)self;
    if (r->c->owned) return PyObject_GetAttrString(r->c->owned, "shape");
    return shape_tuple(r->ndim, r->shape);
}
static PyObject *retained_get_block_bytes(PyObject *self, void *c) {
    (void)c;
    RetainedObject *r = (RetainedObject *)self;
    return PyLong_FromSize_t(r->c->blk ? loom_cuda_block_size(r->c->blk) : 0);
}

static PyMethodDef retained_methods[] = {
    {"clone", retained_clone, METH_NOARGS, "clone() -> Retained sharing the same storage (no copy)"},
    {"from_tensor", retained_from_tensor, METH_O | METH_CLASS,
     "from_tensor(t) -> Retained holding a caller-owned tensor"},
    {"tensor", retained_tensor, METH_NOARGS, "tensor() -> torch.Tensor over the retained storage"},
    {"__dlpack__", (PyCFunction)(void (*)(void))retained_dlpack, METH_VARARGS | METH_KEYWORDS,
     "DLPack export (waits for pending copies; the export keeps the block)"},
    {"__dlpack_device__", retained_dlpack_device, METH_NOARGS, "DLPack device"},
    {"_record", retained_record, METH_O, "_record(stream): the block is used by stream"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef retained_getset[] = {
    {"pooled", retained_get_pooled, NULL, "True for pooled storage, False for caller-owned", NULL},
    {"refcount", retained_get_refcount, NULL, "handles sharing this storage", NULL},
    {"data_ptr", retained_get_data_ptr, NULL, "address of the first byte", NULL},
    {"shape", retained_get_shape, NULL, "shape of the retained value", NULL},
    {"block_bytes", retained_get_block_bytes, NULL, "size of the pooled block (0 if none)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot retained_slots[] = {
    {Py_tp_dealloc, retained_dealloc},
    {Py_tp_methods, retained_methods},
    {Py_tp_getset, retained_getset},
    {Py_tp_doc, "A retained handle over pooled pinned bytes or a caller-owned tensor."},
    {0, NULL},
};

static PyType_Spec retained_spec = {
    .name = "nnloom._C.Retained",
    .basicsize = sizeof(RetainedObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = retained_slots,
};

/* ======================================================================== */
/* Staged                                                                     */
/* ======================================================================== */

typedef struct {
    size_t offset;                     /* in the block */
    size_t nbytes;                     /* compact bytes */
    loom_dl_dtype dtype;
    int ndim;
    int64_t shape[LOOM_CUDA_MAX_DIMS];
} staged_entry;

typedef struct {
    PyObject_HEAD
    container *c;       /* the pooled block, one reference */
    Py_ssize_t n;       /* entries */
    size_t payload;     /* sum of compact bytes */
    staged_entry *e;    /* [n], owned */
} StagedObject;

static void staged_dealloc(PyObject *self) {
    StagedObject *s = (StagedObject *)self;
    PyTypeObject *tp = Py_TYPE(self);
    if (s->c) {
        loom_cuda_pool *pool = s->c->blk ? loom_cuda_block_pool(s->c->blk) : NULL;
        if (pool) loom_cuda_pool_retain(pool);
        container_decref(s->c);
        if (pool) { /* let finished copies give their sources back */
            loom_cuda_pool_reclaim(pool);
            loom_cuda_pool_release(pool);
        }
    }
    loom_free(s->e);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *staged_ready(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(loom_cuda_block_ready(((StagedObject *)self)->c->blk));
}

static PyObject *staged_wait(PyObject *self, PyObject *unused) {
    (void)unused;
    if (wait_block(loom_state_of(self), ((StagedObject *)self)->c->blk) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *staged_handles(PyObject *self, PyObject *unused) {
    (void)unused;
    StagedObject *s = (StagedObject *)self;
    PyTypeObject *tp = cuda_type(self, "Retained");
    if (tp == NULL) return NULL;
    PyObject *out = PyList_New(s->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < s->n; i++) {
        staged_entry *e = &s->e[i];
        PyObject *h = retained_make(tp, s->c, e->offset, e->dtype, e->ndim, e->shape);
        if (h == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, h);
    }
    return out;
}

static PyObject *staged_tensors(PyObject *self, PyObject *unused) {
    (void)unused;
    StagedObject *s = (StagedObject *)self;
    if (wait_block(loom_state_of(self), s->c->blk) < 0) return NULL;
    PyObject *torch_c = PyImport_ImportModule("torch._C");
    if (torch_c == NULL) return NULL;
    PyObject *from = PyObject_GetAttrString(torch_c, "_from_dlpack");
    Py_DECREF(torch_c);
    if (from == NULL) return NULL;
    PyObject *out = PyList_New(s->n);
    for (Py_ssize_t i = 0; out != NULL && i < s->n; i++) {
        staged_entry *e = &s->e[i];
        PyObject *cap = export_capsule(s->c->blk, e->offset, e->dtype, e->ndim, e->shape);
        PyObject *t = cap ? PyObject_CallOneArg(from, cap) : NULL;
        Py_XDECREF(cap);
        if (t == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, t);
    }
    Py_DECREF(from);
    return out;
}

static PyObject *staged_get_payload(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(((StagedObject *)self)->payload);
}
static PyObject *staged_get_block_bytes(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(loom_cuda_block_size(((StagedObject *)self)->c->blk));
}
static Py_ssize_t staged_len(PyObject *self) { return ((StagedObject *)self)->n; }

static PyMethodDef staged_methods[] = {
    {"ready", staged_ready, METH_NOARGS, "ready() -> True when the copies completed (no wait)"},
    {"wait", staged_wait, METH_NOARGS, "wait(): block until the copies completed"},
    {"tensors", staged_tensors, METH_NOARGS,
     "tensors() -> [torch.Tensor]: wait, then compact host tensors viewing the block"},
    {"handles", staged_handles, METH_NOARGS, "handles() -> [Retained], one per staged tensor"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef staged_getset[] = {
    {"payload_bytes", staged_get_payload, NULL, "sum of the compact tensors' bytes", NULL},
    {"block_bytes", staged_get_block_bytes, NULL, "size of the leased block", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot staged_slots[] = {
    {Py_tp_dealloc, staged_dealloc},
    {Py_tp_methods, staged_methods},
    {Py_tp_getset, staged_getset},
    {Py_sq_length, staged_len},
    {Py_tp_doc, "Compact copies of saved tensors in one pinned block."},
    {0, NULL},
};

static PyType_Spec staged_spec = {
    .name = "nnloom._C.Staged",
    .basicsize = sizeof(StagedObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = staged_slots,
};

/* ======================================================================== */
/* PinnedPool                                                                 */
/* ======================================================================== */

typedef struct {
    PyObject_HEAD
    loom_cuda_pool *pool; /* one reference */
    int device;           /* 1 when backed by CUDA events and pinning */
    PyObject *to_dlpack;  /* torch._C._to_dlpack */
} PoolObject;

static PyObject *pool_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"limit_bytes", "slab_bytes", "events", NULL};
    unsigned long long limit = 0, slab = 0;
    const char *events = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|KKs:PinnedPool", kwlist, &limit, &slab, &events))
        return NULL;
    loom_modstate *st = PyType_GetModuleState(tp);
    loom_cuda_pool_config cfg = {(size_t)limit, (size_t)slab, NULL, NULL};
    int device = 0;
    if (strcmp(events, "fake") == 0) {
        cfg.events = &fake_events;
    } else if (strcmp(events, "cuda") == 0 || strcmp(events, "auto") == 0) {
        if (loom_cuda_runtime() == LOOM_OK) {
            cfg.events = loom_cuda_device_events();
            cfg.pinner = loom_cuda_device_pinner();
            device = 1;
        } else if (events[0] == 'c') {
            return loom_raise(st, LOOM_ERR_UNAVAILABLE);
        }
        loom_clear_error();
    } else if (strcmp(events, "cpu") != 0) {
        PyErr_Format(PyExc_ValueError, "events must be auto, cuda, cpu or fake, not %s", events);
        return NULL;
    }
    PyObject *torch_c = PyImport_ImportModule("torch._C");
    if (torch_c == NULL) return NULL;
    PyObject *to = PyObject_GetAttrString(torch_c, "_to_dlpack");
    Py_DECREF(torch_c);
    if (to == NULL) return NULL;
    PoolObject *p = (PoolObject *)tp->tp_alloc(tp, 0);
    if (p == NULL) {
        Py_DECREF(to);
        return NULL;
    }
    p->to_dlpack = to;
    p->device = device;
    loom_status s = loom_cuda_pool_create(&cfg, &p->pool);
    if (s != LOOM_OK) {
        Py_DECREF(p);
        return loom_raise(st, s);
    }
    return (PyObject *)p;
}

static int pool_traverse(PyObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(((PoolObject *)self)->to_dlpack);
    return 0;
}

static int pool_clear(PyObject *self) {
    Py_CLEAR(((PoolObject *)self)->to_dlpack);
    return 0;
}

static void pool_dealloc(PyObject *self) {
    PoolObject *p = (PoolObject *)self;
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    pool_clear(self);
    loom_cuda_pool_release(p->pool); /* held blocks keep the C pool alive */
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *pool_lease(PyObject *self, PyObject *arg) {
    PoolObject *p = (PoolObject *)self;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0 && PyErr_Occurred()) return NULL;
    if (n <= 0) {
        PyErr_SetString(PyExc_ValueError, "lease(nbytes) needs nbytes > 0");
        return NULL;
    }
    PyTypeObject *tp = cuda_type(self, "Retained");
    if (tp == NULL) return NULL;
    loom_cuda_block *blk = NULL;
    loom_status s = loom_cuda_pool_lease(p->pool, (size_t)n, &blk);
    if (s != LOOM_OK) return loom_raise(loom_state_of(self), s);
    container *c = container_new(blk, NULL);
    if (c == NULL) {
        loom_cuda_block_end_lease(blk);
        return NULL;
    }
    int64_t shape[1] = {n};
    PyObject *r = retained_make(tp, c, 0, (loom_dl_dtype){LOOM_DL_UINT, 8, 1}, 1, shape);
    container_decref(c);
    return r;
}

static PyObject *pool_stats(PyObject *self, PyObject *unused) {
    (void)unused;
    loom_cuda_pool_stats s;
    loom_cuda_pool_stats_get(((PoolObject *)self)->pool, &s);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsK}", "bytes_pinned", s.bytes_pinned,
                         "bytes_leased", s.bytes_leased, "bytes_waiting", s.bytes_waiting,
                         "bytes_free", s.bytes_free, "limit_bytes", s.limit_bytes, "slabs",
                         s.slabs, "blocks", s.blocks, "leases_live", s.leases_live,
                         "exports_live", s.exports_live, "leases_total", s.leases_total,
                         "reuses", s.reuses);
}

static PyObject *pool_reclaim(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromSize_t(loom_cuda_pool_reclaim(((PoolObject *)self)->pool));
}

/* Sources of a device staging: released once the copy stream passed them. */
typedef struct {
    size_t n;
    loom_dl_managed *m[]; /* [n], each owned */
} source_list;

static void release_sources(void *arg) {
    source_list *l = arg;
    for (size_t i = 0; i < l->n; i++)
        if (l->m[i] && l->m[i]->deleter) l->m[i]->deleter(l->m[i]);
    loom_free(l);
}

/* The current stream of `device` as torch sees it (one Python call). */
static int current_stream(int device, void **out) {
    PyObject *cuda = PyImport_ImportModule("torch.cuda");
    if (cuda == NULL) return -1;
    PyObject *s = PyObject_CallMethod(cuda, "current_stream", "i", device);
    Py_DECREF(cuda);
    if (s == NULL) return -1;
    PyObject *h = PyObject_GetAttrString(s, "cuda_stream");
    Py_DECREF(s);
    if (h == NULL) return -1;
    *out = PyLong_AsVoidPtr(h);
    Py_DECREF(h);
    return PyErr_Occurred() ? -1 : 0;
}

/* stage(tensors, stream=None) -> Staged. */
static PyObject *pool_stage(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"tensors", "stream", NULL};
    PyObject *seq, *stream_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:stage", kwlist, &seq, &stream_obj)) return NULL;
    PoolObject *p = (PoolObject *)self;
    loom_modstate *st = loom_state_of(self);
    PyTypeObject *staged_tp = cuda_type(self, "Staged");
    if (staged_tp == NULL) return NULL;
    PyObject *fast = PySequence_Fast(seq, "stage() expects a sequence of tensors");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);

    PyObject *result = NULL;
    loom_status s = LOOM_OK;
    loom_cuda_block *blk = NULL;
    container *c = NULL;
    size_t total = 0, payload = 0;
    int device = -2; /* -2: none yet */
    size_t n_dev = 0;
    loom_cuda_tview *views = loom_calloc((size_t)n + 1, sizeof *views);
    loom_cuda_copy_plan *plans = loom_calloc((size_t)n + 1, sizeof *plans);
    staged_entry *entries = loom_calloc((size_t)n + 1, sizeof *entries);
    source_list *src = loom_calloc(1, sizeof *src + ((size_t)n + 1) * sizeof(loom_dl_managed *));
    loom_cuda_tview *dviews = NULL;
    loom_cuda_copy_plan *dplans = NULL;
    if (!views || !plans || !entries || !src) {
        PyErr_NoMemory();
        goto fail;
    }
    /* ---- read each tensor through DLPack ---- */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyObject_TypeCheck(items[i], (PyTypeObject *)st->tensor_type)) {
            PyErr_Format(PyExc_TypeError, "stage(): item %zd is %.100s, not a tensor", i,
                         Py_TYPE(items[i])->tp_name);
            goto fail;
        }
        PyObject *cap = PyObject_CallOneArg(p->to_dlpack, items[i]);
        if (cap == NULL) goto fail;
        loom_dl_managed *m = PyCapsule_GetPointer(cap, "dltensor");
        if (m == NULL || PyCapsule_SetName(cap, "used_dltensor") < 0) { /* now ours */
            Py_DECREF(cap);
            goto fail;
        }
        Py_DECREF(cap);
        src->m[src->n++] = m;
        const loom_dl_tensor *t = &m->dl_tensor;
        if (t->ndim > LOOM_CUDA_MAX_DIMS || t->dtype.lanes != 1 || t->dtype.bits % 8) {
            PyErr_Format(PyExc_ValueError, "stage(): item %zd has an unsupported layout", i);
            goto fail;
        }
        loom_cuda_tview *v = &views[i];
        v->data = (const char *)t->data + t->byte_offset;
        v->ndim = t->ndim;
        v->itemsize = t->dtype.bits / 8;
        int64_t stride = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            v->shape[d] = t->shape[d];
            v->strides[d] = t->strides ? t->strides[d] : stride;
            stride *= t->shape[d];
        }
        if (t->device.device_type == LOOM_DL_CUDA) {
            v->device = t->device.device_id;
            if (device >= 0 && device != v->device) {
                PyErr_SetString(PyExc_ValueError, "stage(): tensors on several CUDA devices");
                goto fail;
            }
            device = v->device;
            n_dev++;
        } else if (t->device.device_type == LOOM_DL_CPU || t->device.device_type == LOOM_DL_CUDA_HOST) {
            v->device = -1;
        } else {
            PyErr_Format(PyExc_ValueError, "stage(): item %zd on unsupported device type %d", i,
                         t->device.device_type);
            goto fail;
        }
        entries[i].dtype = t->dtype;
        entries[i].ndim = t->ndim;
        memcpy(entries[i].shape, v->shape, (size_t)t->ndim * sizeof(int64_t));
    }
    /* ---- plan, lease, copy ---- */
    s = loom_cuda_stage_plan(views, (size_t)n, plans, &total);
    if (s != LOOM_OK) goto fail_status;
    if (n_dev > 0 && !p->device) {
        PyErr_SetString(PyExc_ValueError, "stage(): CUDA tensors need a pool with CUDA events");
        goto fail;
    }
    s = loom_cuda_pool_lease(p->pool, total ? total : 1, &blk);
    if (s != LOOM_OK) goto fail_status;
    c = container_new(blk, NULL);
    if (c == NULL) {
        loom_cuda_block_end_lease(blk);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        entries[i].offset = plans[i].offset;
        entries[i].nbytes = plans[i].nbytes;
        payload += plans[i].nbytes;
    }
    if (n_dev > 0) {
        void *stream = NULL;
        if (stream_obj != Py_None) {
            stream = PyLong_AsVoidPtr(stream_obj);
            if (stream == NULL && PyErr_Occurred()) goto fail;
        } else if (current_stream(device, &stream) < 0) {
            goto fail;
        }
        dviews = loom_malloc(n_dev * sizeof *dviews);
        dplans = loom_malloc(n_dev * sizeof *dplans);
        if (!dviews || !dplans) {
            PyErr_NoMemory();
            goto fail;
        }
        size_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (views[i].device >= 0) {
                dviews[k] = views[i];
                dplans[k++] = plans[i];
            }
        s = loom_cuda_stage_device(dviews, dplans, n_dev, blk, stream);
        if (s != LOOM_OK) goto fail_status;
    }
    if (n_dev < (size_t)n) {
        /* host tensors: packed to the front of views/plans, one call */
        size_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (views[i].device < 0) {
                views[k] = views[i];
                plans[k++] = plans[i];
            }
        uint8_t *dst = loom_cuda_block_data(blk);
        Py_BEGIN_ALLOW_THREADS
        s = loom_cuda_stage_cpu(views, plans, k, dst);
        Py_END_ALLOW_THREADS
        if (s != LOOM_OK) goto fail_status;
    }
    /* sources stay alive until the copy stream has read them */
    if (loom_cuda_block_defer(blk, release_sources, src) != LOOM_OK) {
        /* cannot defer: wait now rather than free memory a copy still reads */
        loom_status w;
        Py_BEGIN_ALLOW_THREADS
        w = loom_cuda_block_wait(blk);
        Py_END_ALLOW_THREADS
        release_sources(src);
        src = NULL;
        if (w != LOOM_OK) {
            s = w;
            goto fail_status;
        }
    }
    src = NULL;
    StagedObject *out = (StagedObject *)staged_tp->tp_alloc(staged_tp, 0);
    if (out == NULL) goto fail;
    out->c = c;
    out->n = n;
    out->payload = payload;
    out->e = entries;
    c = NULL;
    entries = NULL;
    result = (PyObject *)out;
    goto exit;
fail_status:
    loom_raise(st, s);
fail:
    if (src != NULL && blk != NULL && n_dev > 0) {
        /* copies may be queued: keep the sources until the block is done */
        Py_BEGIN_ALLOW_THREADS
        loom_cuda_block_wait(blk);
        Py_END_ALLOW_THREADS
    }
exit:
    if (src != NULL) release_sources(src);
    container_decref(c);
    loom_free(dviews);
    loom_free(dplans);
    loom_free(entries);
    loom_free(plans);
    loom_free(views);
    Py_DECREF(fast);
    return result;
}

static PyObject *pool_get_device(PyObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(((PoolObject *)self)->device);
}

static PyMethodDef pool_methods[] = {
    {"lease", pool_lease, METH_O, "lease(nbytes) -> Retained over one pooled block"},
    {"stage", (PyCFunction)(void (*)(void))pool_stage, METH_VARARGS | METH_KEYWORDS,
     "stage(tensors, stream=None) -> Staged: compact copies of the tensors in one block"},
    {"stats", pool_stats, METH_NOARGS, "stats() -> dict of byte and block counters"},
    {"reclaim", pool_reclaim, METH_NOARGS, "reclaim() -> blocks whose streams finished, freed"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"device", pool_get_device, NULL, "True when pinned and ordered by CUDA events", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot pool_slots[] = {
    {Py_tp_new, pool_new},
    {Py_tp_dealloc, pool_dealloc},
    {Py_tp_traverse, pool_traverse},
    {Py_tp_clear, pool_clear},
    {Py_tp_methods, pool_methods},
    {Py_tp_getset, pool_getset},
    {Py_tp_doc, "PinnedPool(limit_bytes=0, slab_bytes=0, events='auto'): pinned host blocks."},
    {0, NULL},
};

static PyType_Spec pool_spec = {
    .name = "nnloom._C.PinnedPool",
    .basicsize = sizeof(PoolObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = pool_slots,
};

/* ======================================================================== */
/* NVTX                                                                       */
/* ======================================================================== */

typedef struct {
    PyObject_HEAD
    PyObject *name; /* str */
    int open;       /* pushed and not yet popped */
} RangeObject;

static PyObject *range_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    PyObject *name;
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "nvtx_range(name) takes no keywords");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "U:nvtx_range", &name)) return NULL;
    RangeObject *r = (RangeObject *)tp->tp_alloc(tp, 0);
    if (r == NULL) return NULL;
    r->name = Py_NewRef(name);
    return (PyObject *)r;
}

static void range_dealloc(PyObject *self) {
    RangeObject *r = (RangeObject *)self;
    PyTypeObject *tp = Py_TYPE(self);
    if (r->open) loom_cuda_range_pop(); /* never leave a range open */
    Py_XDECREF(r->name);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *range_enter(PyObject *self, PyObject *unused) {
    (void)unused;
    RangeObject *r = (RangeObject *)self;
    const char *name = PyUnicode_AsUTF8(r->name);
    if (name == NULL) return NULL;
    if (r->open) {
        PyErr_SetString(PyExc_RuntimeError, "nvtx_range entered twice");
        return NULL;
    }
    loom_cuda_range_push(name);
    r->open = 1;
    return Py_NewRef(self);
}

static PyObject *range_exit(PyObject *self, PyObject *args) {
    (void)args;
    RangeObject *r = (RangeObject *)self;
    if (r->open) {
        loom_cuda_range_pop();
        r->open = 0;
    }
    Py_RETURN_FALSE;
}

static PyMethodDef range_methods[] = {
    {"__enter__", range_enter, METH_NOARGS, "push the range"},
    {"__exit__", range_exit, METH_VARARGS, "pop the range (also on errors)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot range_slots[] = {
    {Py_tp_new, range_new},
    {Py_tp_dealloc, range_dealloc},
    {Py_tp_methods, range_methods},
    {Py_tp_doc, "with nvtx_range(name): an NVTX range in the nnloom domain."},
    {0, NULL},
};

static PyType_Spec range_spec = {
    .name = "nnloom._C.nvtx_range",
    .basicsize = sizeof(RangeObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = range_slots,
};

/* ======================================================================== */
/* Module functions                                                           */
/* ======================================================================== */

static PyObject *py_nvtx_push(PyObject *m, PyObject *name) {
    (void)m;
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL) return NULL;
    loom_cuda_range_push(s);
    Py_RETURN_NONE;
}

static PyObject *py_nvtx_pop(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    loom_cuda_range_pop();
    Py_RETURN_NONE;
}

static PyObject *py_nvtx_depth(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyLong_FromLong(loom_cuda_range_depth());
}

static PyObject *py_nvtx_enabled(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyBool_FromLong(loom_cuda_nvtx_enabled());
}

static PyObject *py_cuda_available(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    int ok = loom_cuda_runtime() == LOOM_OK;
    loom_clear_error();
    return PyBool_FromLong(ok);
}

static PyObject *py_cuda_have_kernels(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    return PyBool_FromLong(loom_cuda_have_kernels());
}

static PyObject *py_fake_complete(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    __atomic_store_n(&fake_done, __atomic_load_n(&fake_next, __ATOMIC_RELAXED) - 1,
                     __ATOMIC_RELEASE);
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&fake_live, __ATOMIC_RELAXED));
}

static PyMethodDef cuda_functions[] = {
    {"nvtx_push", py_nvtx_push, METH_O, "nvtx_push(name): open a range (pair with nvtx_pop)"},
    {"nvtx_pop", py_nvtx_pop, METH_NOARGS, "nvtx_pop(): close the innermost range"},
    {"nvtx_depth", py_nvtx_depth, METH_NOARGS, "nvtx_depth() -> ranges open on this thread"},
    {"nvtx_enabled", py_nvtx_enabled, METH_NOARGS, "nvtx_enabled() -> ranges are emitted"},
    {"cuda_available", py_cuda_available, METH_NOARGS,
     "cuda_available() -> the CUDA runtime was found and reports a device"},
    {"cuda_have_kernels", py_cuda_have_kernels, METH_NOARGS,
     "cuda_have_kernels() -> the gather kernel was compiled in"},
    {"_fake_events_complete", py_fake_complete, METH_NOARGS,
     "tests: complete every fake event recorded so far; returns fake events still held"},
    {NULL, NULL, 0, NULL},
};

static int add_type(PyObject *m, PyType_Spec *spec) {
    PyObject *t = PyType_FromModuleAndSpec(m, spec, NULL);
    if (t == NULL) return -1;
    int rc = PyModule_AddType(m, (PyTypeObject *)t);
    Py_DECREF(t);
    return rc;
}

int loom_cuda_module_init(PyObject *m) {
    if (add_type(m, &pool_spec) < 0) return -1;
    if (add_type(m, &retained_spec) < 0) return -1;
    if (add_type(m, &staged_spec) < 0) return -1;
    if (add_type(m, &range_spec) < 0) return -1;
    return PyModule_AddFunctions(m, cuda_functions);
}
