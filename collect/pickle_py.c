/* collect/pickle_py.c - dumps_compact: a pickle in which every tensor carries
 * only its own elements.
 *
 * How it hooks into pickle. We subclass the C pickler (_pickle.Pickler) and
 * give it a `reducer_override`. Of the hooks pickle offers this is the one
 * that fits all three requirements at once:
 *  - persistent_id would need a matching persistent_load on the reading
 *    side, so the bytes would not load with plain pickle.loads;
 *  - a copyreg / dispatch_table entry for torch.Tensor is consulted only for
 *    the exact type and would have to be installed process-wide or per
 *    pickler as a dict walk; reducer_override sees every object the pickler
 *    meets that is not a built-in atom or container, wherever it sits
 *    (dataclass state, namedtuple fields, ModelOutput items, instance dicts);
 *  - it runs after pickle's memo check, so an object reachable under two
 *    names is written once and loads as one object.
 * The override is a C function stored on the subclass's dict (not a method):
 * the pickler then holds no bound method of itself, so a dump leaves no
 * reference cycle that would keep the saved tensors alive until a GC pass.
 *
 * What a tensor becomes. Plain pickle has no way to pass keyword arguments
 * to a callable, and torch's own tensor pickle routes storages through
 * torch.load (slow, and it would have to be allowed by the restricted
 * loader, which would make it unsafe). We emit a short chain of torch
 * callables that take positional arguments only:
 *
 *   as_strided(view(ByteTensor(UntypedStorage.from_buffer(BYTES, "native",
 *              -1, 0, uint8)), dtype), shape, stride, 0)  [.requires_grad_(True)]
 *
 * BYTES are the tensor's own elements: a dense view (any permutation of a
 * row-major layout: contiguous, channels-last, transposed) is written straight
 * from its memory and keeps its strides; any other view is gathered into a
 * row-major block first (compact.c). Each inner call is a `_Deferred` object
 * whose reduce value is the call: the pickler writes it like any other
 * object. The chain's globals are exactly those collect.loads accepts.
 *
 * Device tensors are brought to the host here with a plain copy; this is the
 * point where cuda/'s compact staging into pinned memory (stream-ordered, one
 * event per payload) plugs in (see LOOM_COLLECT__STAGE below). They load as
 * CPU tensors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "collect_internal.h"

/* Sizes at which the copy releases the GIL. */
#define LOOM_COLLECT__NOGIL_BYTES (1 << 20)

/* ------------------------------------------------------------------------ */
/* _Deferred: one call in a tensor's rebuild chain                            */
/* ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *reduce; /* (callable, args): what the pickler writes (strong) */
    PyObject *keep;   /* object whose memory `reduce` points into, or NULL (strong) */
} loom_collect__deferred;

static int deferred_traverse(PyObject *self, visitproc visit, void *arg) {
    loom_collect__deferred *d = (loom_collect__deferred *)self;
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(d->reduce);
    Py_VISIT(d->keep);
    return 0;
}

static int deferred_clear(PyObject *self) {
    loom_collect__deferred *d = (loom_collect__deferred *)self;
    Py_CLEAR(d->reduce);
    Py_CLEAR(d->keep);
    return 0;
}

static void deferred_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    deferred_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot deferred_slots[] = {
    {Py_tp_traverse, deferred_traverse},
    {Py_tp_clear, deferred_clear},
    {Py_tp_dealloc, deferred_dealloc},
    {Py_tp_doc, "One call of a tensor's rebuild chain inside a compact pickle (internal)."},
    {0, NULL},
};

static PyType_Spec deferred_spec = {
    .name = "nnloom._C._Deferred",
    .basicsize = sizeof(loom_collect__deferred),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = deferred_slots,
};

/* A _Deferred writing `callable(*args)`. Steals `args`; borrows the others.
 * Returns a new reference, NULL with an exception set (args released). */
static PyObject *loom_collect__defer(loom_collect__ctx *ctx, PyObject *callable, PyObject *args,
                                     PyObject *keep) {
    PyObject *out = NULL;
    PyObject *reduce = NULL;
    if (args == NULL) return NULL;
    reduce = PyTuple_Pack(2, callable, args);
    if (reduce == NULL) goto exit;
    PyTypeObject *tp = (PyTypeObject *)LOOM_CREF(ctx, deferred_type);
    loom_collect__deferred *d = PyObject_GC_New(loom_collect__deferred, tp);
    if (d == NULL) goto exit;
    d->reduce = Py_NewRef(reduce);
    d->keep = Py_XNewRef(keep);
    PyObject_GC_Track((PyObject *)d);
    out = (PyObject *)d;
exit:
    Py_XDECREF(reduce);
    Py_DECREF(args);
    return out;
}

/* ------------------------------------------------------------------------ */
/* The tensor reducer                                                         */
/* ------------------------------------------------------------------------ */

/* Tuple of Python ints -> int64 array of at most LOOM_COLLECT_MAX_DIMS. -1
 * with an exception set. */
static int loom_collect__int_tuple(PyObject *seq, int64_t *out, int *n) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (fast == NULL) return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    int rc = 0;
    if (len > LOOM_COLLECT_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "dumps_compact: %zd dimensions (at most %d)", len,
                     LOOM_COLLECT_MAX_DIMS);
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < len; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) rc = -1;
        out[i] = v;
    }
    *n = (int)len;
    Py_DECREF(fast);
    return rc;
}

/* Truthiness of obj.<name>() or obj.<name>. -1 with an exception set. */
static int loom_collect__flag(PyObject *obj, PyObject *name, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* obj.<name>() as a C integer. -1 with an exception set (check PyErr_Occurred). */
static long long loom_collect__int_method(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_CallMethodNoArgs(obj, name);
    if (v == NULL) return -1;
    long long r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return r;
}

/* Bring a non-CPU tensor to the host. Returns a new reference.
 *
 * LOOM_COLLECT__STAGE: this is where cuda/'s compact staging plugs in. The
 * device path will lease a pinned block for the whole payload, enqueue one
 * compact device-to-host copy per tensor on the collect stream (rows of a
 * contiguous batch are one cudaMemcpyAsync), record one event, and hand back
 * a host view of the block; the pickler then waits on that event once, before
 * the first byte is written, instead of one synchronous copy per tensor. */
_Thread_local PyObject *loom_collect__substitutes;

/* A device tensor nobody staged ahead: a plain (synchronous) copy. */
static PyObject *loom_collect__stage_to_host(loom_collect__ctx *ctx, PyObject *t) {
    return PyObject_CallMethodNoArgs(t, LOOM_CREF(ctx, a_cpu));
}

/* The reduce value of tensor `t`, or Py_NotImplemented (new reference) for a
 * tensor we leave to torch's own pickling (sparse, quantized, other layouts).
 * Returns a new reference, NULL with an exception set. */
static PyObject *loom_collect__reduce_tensor(loom_collect__ctx *ctx, PyObject *t) {
    PyObject *ret = NULL;
    PyObject *src = Py_NewRef(t); /* the host tensor whose bytes we write */
    PyObject *tmp = NULL, *dtype = NULL, *shape = NULL, *stride = NULL, *payload = NULL;
    PyObject *out_stride = NULL, *chain = NULL, *args = NULL;

    /* layout and kind: anything but a plain strided tensor goes to torch */
    tmp = PyObject_GetAttr(t, LOOM_CREF(ctx, a_layout));
    if (tmp == NULL) goto fail;
    int strided = tmp == LOOM_CREF(ctx, strided);
    Py_CLEAR(tmp);
    int quant = strided ? loom_collect__flag(t, LOOM_CREF(ctx, a_is_quantized), 0) : 0;
    if (quant < 0) goto fail;
    if (!strided || quant) {
        ret = Py_NewRef(Py_NotImplemented);
        goto exit;
    }

    /* staged ahead (cuda/'s pinned pool, one event per payload): write that */
    if (loom_collect__substitutes != NULL) {
        PyObject *key = PyLong_FromVoidPtr(t);
        if (key == NULL) goto fail;
        PyObject *host = PyDict_GetItemWithError(loom_collect__substitutes, key); /* borrowed */
        Py_DECREF(key);
        if (host == NULL && PyErr_Occurred()) goto fail;
        if (host != NULL) {
            Py_SETREF(src, Py_NewRef(host));
            goto on_host;
        }
    }
    /* device: bring to the host */
    tmp = PyObject_GetAttr(t, LOOM_CREF(ctx, a_device));
    if (tmp == NULL) goto fail;
    PyObject *dev_type = PyObject_GetAttr(tmp, LOOM_CREF(ctx, a_type));
    Py_CLEAR(tmp);
    if (dev_type == NULL) goto fail;
    int on_cpu = PyUnicode_Compare(dev_type, LOOM_CREF(ctx, s_cpu)) == 0;
    Py_DECREF(dev_type);
    if (!on_cpu) {
        Py_SETREF(src, loom_collect__stage_to_host(ctx, t));
        if (src == NULL) goto fail;
    }
on_host:;
    /* lazy conjugate / negative bits: write the values they stand for */
    int conj = loom_collect__flag(src, LOOM_CREF(ctx, a_is_conj), 1);
    int neg = conj < 0 ? -1 : loom_collect__flag(src, LOOM_CREF(ctx, a_is_neg), 1);
    if (neg < 0) goto fail;
    if (conj) Py_SETREF(src, PyObject_CallMethodNoArgs(src, LOOM_CREF(ctx, a_resolve_conj)));
    if (src != NULL && neg)
        Py_SETREF(src, PyObject_CallMethodNoArgs(src, LOOM_CREF(ctx, a_resolve_neg)));
    if (src == NULL) goto fail;

    int rg = loom_collect__flag(t, LOOM_CREF(ctx, a_requires_grad), 0);
    if (rg < 0) goto fail;
    if ((dtype = PyObject_GetAttr(src, LOOM_CREF(ctx, a_dtype))) == NULL) goto fail;
    if ((shape = PyObject_GetAttr(src, LOOM_CREF(ctx, a_shape))) == NULL) goto fail;
    if ((stride = PyObject_CallMethodNoArgs(src, LOOM_CREF(ctx, a_stride))) == NULL) goto fail;

    int64_t dims[LOOM_COLLECT_MAX_DIMS], steps[LOOM_COLLECT_MAX_DIMS];
    int nd = 0, ns = 0;
    if (loom_collect__int_tuple(shape, dims, &nd) < 0) goto fail;
    if (loom_collect__int_tuple(stride, steps, &ns) < 0) goto fail;
    long long itemsize = loom_collect__int_method(src, LOOM_CREF(ctx, a_element_size));
    if (itemsize <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dumps_compact: bad itemsize");
        goto fail;
    }
    long long ptr = loom_collect__int_method(src, LOOM_CREF(ctx, a_data_ptr));
    if (ptr == -1 && PyErr_Occurred()) goto fail;
    loom_collect_layout lay = {nd, dims, steps, (size_t)itemsize};
    int64_t numel = loom_collect_numel(&lay);
    Py_ssize_t nbytes = (Py_ssize_t)(numel * itemsize);

    if (numel == 0) {
        payload = PyBytes_FromStringAndSize(NULL, 0);
        out_stride = Py_NewRef(stride);
    } else if (loom_collect_is_dense(&lay)) {
        /* one block straight from the tensor's memory; `src` is kept alive by
         * the innermost _Deferred until the pickler has written it */
        PyObject *mv = PyMemoryView_FromMemory((char *)(intptr_t)ptr, nbytes, PyBUF_READ);
        if (mv == NULL) goto fail;
        payload = PyObject_CallOneArg(LOOM_CREF(ctx, picklebuffer), mv);
        Py_DECREF(mv);
        out_stride = Py_NewRef(stride);
    } else {
        payload = PyByteArray_FromStringAndSize(NULL, nbytes);
        if (payload == NULL) goto fail;
        loom_status s;
        if (nbytes >= LOOM_COLLECT__NOGIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            s = loom_collect_compact_copy(PyByteArray_AS_STRING(payload), (size_t)nbytes,
                                          (const void *)(intptr_t)ptr, &lay);
            Py_END_ALLOW_THREADS
        } else {
            s = loom_collect_compact_copy(PyByteArray_AS_STRING(payload), (size_t)nbytes,
                                          (const void *)(intptr_t)ptr, &lay);
        }
        if (s != LOOM_OK) {
            loom_raise(loom_state_of((PyObject *)ctx), s);
            goto fail;
        }
        out_stride = PyTuple_New(nd);
        if (out_stride == NULL) goto fail;
        int64_t step = 1;
        for (int d = nd - 1; d >= 0; d--) {
            PyObject *v = PyLong_FromLongLong(step);
            if (v == NULL) goto fail;
            PyTuple_SET_ITEM(out_stride, d, v);
            step *= dims[d] > 1 ? dims[d] : 1;
        }
    }
    if (payload == NULL) goto fail;

    /* the chain, innermost first */
    chain = loom_collect__defer(ctx, LOOM_CREF(ctx, from_buffer),
                                Py_BuildValue("(OOiiO)", payload, LOOM_CREF(ctx, s_native), -1, 0,
                                              LOOM_CREF(ctx, uint8)),
                                src);
    if (chain == NULL) goto fail;
    Py_SETREF(chain, loom_collect__defer(ctx, LOOM_CREF(ctx, byte_tensor), PyTuple_Pack(1, chain),
                                         NULL));
    if (chain == NULL) goto fail;
    if (dtype != LOOM_CREF(ctx, uint8)) {
        Py_SETREF(chain, loom_collect__defer(ctx, LOOM_CREF(ctx, m_view),
                                             PyTuple_Pack(2, chain, dtype), NULL));
        if (chain == NULL) goto fail;
    }
    PyObject *shape_tuple = PySequence_Tuple(shape); /* plain tuple, not torch.Size */
    if (shape_tuple == NULL) goto fail;
    args = Py_BuildValue("(ONOi)", chain, shape_tuple, out_stride, 0);
    if (args == NULL) goto fail;
    if (rg) {
        chain = loom_collect__defer(ctx, LOOM_CREF(ctx, m_as_strided), args, NULL);
        args = NULL; /* stolen */
        if (chain == NULL) goto fail;
        ret = Py_BuildValue("(O(OO))", LOOM_CREF(ctx, m_requires_grad_), chain, Py_True);
        Py_CLEAR(chain);
    } else {
        ret = PyTuple_Pack(2, LOOM_CREF(ctx, m_as_strided), args);
    }
    if (ret == NULL) goto fail;
exit:
    Py_XDECREF(args);
    Py_XDECREF(chain);
    Py_XDECREF(out_stride);
    Py_XDECREF(payload);
    Py_XDECREF(stride);
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(tmp);
    Py_XDECREF(src);
    return ret;
fail:
    Py_CLEAR(ret);
    goto exit;
}

/* reducer_override(obj): stored on CompactPickler's dict as a builtin bound
 * to the context (so `self` here is the context, not the pickler). Returns a
 * new reference, NULL with an exception set. */
static PyObject *loom_collect__reducer_override(PyObject *self, PyObject *obj) {
    loom_collect__ctx *ctx = (loom_collect__ctx *)self;
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp == (PyTypeObject *)LOOM_CREF(ctx, deferred_type))
        return Py_NewRef(((loom_collect__deferred *)obj)->reduce);
    loom_modstate *st = loom_state_of(self);
    if ((PyObject *)tp == st->tensor_type || (PyObject *)tp == LOOM_CREF(ctx, parameter_type))
        return loom_collect__reduce_tensor(ctx, obj);
    Py_RETURN_NOTIMPLEMENTED;
}

static PyMethodDef loom_collect__override_def = {
    "reducer_override", loom_collect__reducer_override, METH_O,
    "Write tensors as compact copies of their own elements (nnloom)."};

/* ------------------------------------------------------------------------ */
/* CompactPickler                                                             */
/* ------------------------------------------------------------------------ */

/* The base is _pickle.Pickler: a static type before 3.12, a heap type after.
 * A heap subclass of a static type must hold and visit its own type; when the
 * base is a heap type the base's dealloc and traverse already do. */
static int cp_traverse(PyObject *self, visitproc visit, void *arg) {
    PyTypeObject *base = Py_TYPE(self)->tp_base;
    if (!(base->tp_flags & Py_TPFLAGS_HEAPTYPE)) Py_VISIT(Py_TYPE(self));
    return base->tp_traverse(self, visit, arg);
}

static void cp_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyTypeObject *base = tp->tp_base;
    base->tp_dealloc(self);
    if (!(base->tp_flags & Py_TPFLAGS_HEAPTYPE)) Py_DECREF(tp);
}

static PyType_Slot cp_slots[] = {
    {Py_tp_traverse, cp_traverse},
    {Py_tp_dealloc, cp_dealloc},
    {Py_tp_doc, "CompactPickler(file, protocol=5): a pickle.Pickler that writes every tensor "
                "as a compact copy of its own elements (see nnloom.collect.dumps_compact)."},
    {0, NULL},
};

static PyType_Spec cp_spec = {
    .name = "nnloom._C.CompactPickler",
    .basicsize = 0, /* the base's layout */
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = cp_slots,
};

PyObject *loom_collect__dumps_compact(loom_collect__ctx *ctx, PyObject *value) {
    PyObject *ret = NULL, *file = NULL, *pickler = NULL, *r = NULL;
    if ((file = PyObject_CallNoArgs(LOOM_CREF(ctx, bytesio))) == NULL) goto exit;
    PyObject *pargs[2] = {file, NULL};
    if ((pargs[1] = PyLong_FromLong(5)) == NULL) goto exit;
    pickler = PyObject_Vectorcall(LOOM_CREF(ctx, pickler_type), pargs, 2, NULL);
    Py_DECREF(pargs[1]);
    if (pickler == NULL) goto exit;
    if ((r = PyObject_CallMethodOneArg(pickler, LOOM_CREF(ctx, a_dump), value)) == NULL) goto exit;
    ret = PyObject_CallMethodNoArgs(file, LOOM_CREF(ctx, a_getvalue));
exit:
    Py_XDECREF(r);
    Py_XDECREF(pickler);
    Py_XDECREF(file);
    return ret;
}

/* ------------------------------------------------------------------------ */
/* Init                                                                       */
/* ------------------------------------------------------------------------ */

/* getattr(import(modname), attr) as a new reference; NULL with an exception. */
static PyObject *loom_collect__import_attr(const char *modname, const char *attr) {
    PyObject *mod = PyImport_ImportModule(modname);
    if (mod == NULL) return NULL;
    PyObject *v = PyObject_GetAttrString(mod, attr);
    Py_DECREF(mod);
    return v;
}

int loom_collect__pickle_init(PyObject *m, loom_collect__ctx *ctx) {
    int rc = -1;
    PyObject *base = NULL, *torch_tensor = NULL, *storage = NULL, *fn = NULL;
    PyObject **r = ctx->ref;

#define LOOM__SET(field, expr)                                                 \
    do {                                                                       \
        if ((r[LOOM_COLLECT__REF_##field] = (expr)) == NULL) goto exit;         \
    } while (0)
    LOOM__SET(deferred_type, PyType_FromModuleAndSpec(m, &deferred_spec, NULL));
    if ((base = loom_collect__import_attr("_pickle", "Pickler")) == NULL) goto exit;
    LOOM__SET(pickler_type, PyType_FromModuleAndSpec(m, &cp_spec, base));
    if ((fn = PyCFunction_New(&loom_collect__override_def, (PyObject *)ctx)) == NULL) goto exit;
    if (PyObject_SetAttrString(LOOM_CREF(ctx, pickler_type), "reducer_override", fn) < 0)
        goto exit;
    if (PyModule_AddObjectRef(m, "CompactPickler", LOOM_CREF(ctx, pickler_type)) < 0) goto exit;
    LOOM__SET(bytesio, loom_collect__import_attr("io", "BytesIO"));
    LOOM__SET(picklebuffer, loom_collect__import_attr("pickle", "PickleBuffer"));
    if ((storage = loom_collect__import_attr("torch", "UntypedStorage")) == NULL) goto exit;
    LOOM__SET(from_buffer, PyObject_GetAttrString(storage, "from_buffer"));
    LOOM__SET(byte_tensor, loom_collect__import_attr("torch", "ByteTensor"));
    if ((torch_tensor = loom_collect__import_attr("torch", "Tensor")) == NULL) goto exit;
    LOOM__SET(m_view, PyObject_GetAttrString(torch_tensor, "view"));
    LOOM__SET(m_as_strided, PyObject_GetAttrString(torch_tensor, "as_strided"));
    LOOM__SET(m_requires_grad_, PyObject_GetAttrString(torch_tensor, "requires_grad_"));
    LOOM__SET(parameter_type, loom_collect__import_attr("torch.nn", "Parameter"));
    LOOM__SET(uint8, loom_collect__import_attr("torch", "uint8"));
    LOOM__SET(strided, loom_collect__import_attr("torch", "strided"));
    LOOM__SET(s_native, PyUnicode_InternFromString("native"));
    LOOM__SET(s_cpu, PyUnicode_InternFromString("cpu"));
#define LOOM__NAME(field, s) LOOM__SET(field, PyUnicode_InternFromString(s))
    LOOM__NAME(a_device, "device");
    LOOM__NAME(a_type, "type");
    LOOM__NAME(a_cpu, "cpu");
    LOOM__NAME(a_layout, "layout");
    LOOM__NAME(a_is_quantized, "is_quantized");
    LOOM__NAME(a_is_conj, "is_conj");
    LOOM__NAME(a_is_neg, "is_neg");
    LOOM__NAME(a_resolve_conj, "resolve_conj");
    LOOM__NAME(a_resolve_neg, "resolve_neg");
    LOOM__NAME(a_dtype, "dtype");
    LOOM__NAME(a_shape, "shape");
    LOOM__NAME(a_stride, "stride");
    LOOM__NAME(a_element_size, "element_size");
    LOOM__NAME(a_data_ptr, "data_ptr");
    LOOM__NAME(a_requires_grad, "requires_grad");
    LOOM__NAME(a_dump, "dump");
    LOOM__NAME(a_getvalue, "getvalue");
#undef LOOM__NAME
#undef LOOM__SET
    rc = 0;
exit:
    Py_XDECREF(fn);
    Py_XDECREF(storage);
    Py_XDECREF(torch_tensor);
    Py_XDECREF(base);
    return rc;
}
