/* collect/arena_py.c - the arena's Python types: ArenaReader (the parent's
 * end, creates the shared region), ArenaWriter (a worker's end) and the
 * buffer exporter behind every zero-copy view.
 *
 * Lifetime of a zero-copy view: read_binary creates one _ArenaBlock, which
 * pins its unit's segment for as long as the block object lives and holds the
 * reader (so the mapping outlives it). The memoryview returned is an export
 * of the block: slices and casts of it, numpy arrays built on it (their base
 * chain ends in the memoryview) and torch.frombuffer storages all hold that
 * export, hence the block, hence the pin. Ending the unit is only logical; the
 * segment goes back to the writer when the unit is ended and the last block
 * is gone. In ring mode (zero_copy=False) read_binary copies the bytes into a
 * private bytearray and pins nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <structmember.h>

#include "collect_internal.h"

typedef struct {
    PyObject_HEAD
    loom_collect_arena *arena; /* owned; NULL after close() without live blocks */
    Py_ssize_t blocks;         /* live _ArenaBlock objects */
    int closed;                /* close() called */
    int zero_copy;             /* segment pool (1) or ring (0) */
} loom_collect__reader;

typedef struct {
    PyObject_HEAD
    loom_collect_arena *arena; /* owned */
    double timeout;            /* seconds a write waits for a free segment */
} loom_collect__writer;

typedef struct {
    PyObject_HEAD
    PyObject *reader;    /* the ArenaReader (strong) */
    char *ptr;           /* first byte, inside the reader's mapping */
    Py_ssize_t len;      /* bytes */
    uint64_t span;       /* unit pinned by this block */
    Py_ssize_t exports;  /* live buffer exports */
} loom_collect__block;

/* Module state from an instance of one of our types or of a Python subclass
 * of one (PyType_GetModuleState only knows the defining class). Borrowed;
 * NULL if none (loom_raise then falls back to RuntimeError). */
static loom_modstate *arena_state(PyObject *self) {
    PyObject *mro = Py_TYPE(self)->tp_mro;
    for (Py_ssize_t i = 0; mro && i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *t = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (!(t->tp_flags & Py_TPFLAGS_HEAPTYPE)) continue;
        PyObject *m = PyType_GetModule(t);
        if (m == NULL) {
            PyErr_Clear();
            continue;
        }
        if (PyModule_GetDef(m) == &loom_moduledef) return loom_state(m);
    }
    return NULL;
}

static PyObject *arena_raise(PyObject *self, loom_status s) {
    return loom_raise(arena_state(self), s);
}

/* ------------------------------------------------------------------------ */
/* _ArenaBlock                                                                */
/* ------------------------------------------------------------------------ */

static int block_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    loom_collect__block *b = (loom_collect__block *)self;
    if (PyBuffer_FillInfo(view, self, b->ptr, b->len, 0, flags) < 0) return -1;
    b->exports++;
    return 0;
}

static void block_releasebuffer(PyObject *self, Py_buffer *view) {
    (void)view;
    ((loom_collect__block *)self)->exports--;
}

static void block_dealloc(PyObject *self) {
    loom_collect__block *b = (loom_collect__block *)self;
    PyTypeObject *tp = Py_TYPE(self);
    loom_collect__reader *r = (loom_collect__reader *)b->reader;
    if (r != NULL) {
        if (r->arena) loom_collect_arena_unpin(r->arena, b->span);
        r->blocks--;
        if (r->closed && r->blocks == 0 && r->arena) {
            loom_collect_arena_close(r->arena);
            r->arena = NULL;
        }
        Py_DECREF(b->reader);
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef block_members[] = {
    {"exports", T_PYSSIZET, offsetof(loom_collect__block, exports), READONLY,
     "live buffer exports of this block"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot block_slots[] = {
    {Py_bf_getbuffer, block_getbuffer},
    {Py_bf_releasebuffer, block_releasebuffer},
    {Py_tp_dealloc, block_dealloc},
    {Py_tp_members, block_members},
    {Py_tp_doc, "Bytes of one binary in a shared-memory arena unit (pins the unit)."},
    {0, NULL},
};

static PyType_Spec block_spec = {
    .name = "nnloom._C._ArenaBlock",
    .basicsize = sizeof(loom_collect__block),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = block_slots,
};

/* ------------------------------------------------------------------------ */
/* ArenaReader                                                                */
/* ------------------------------------------------------------------------ */

static PyObject *reader_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"slots", "slot_size", "zero_copy", "name", NULL};
    unsigned int slots = 4;
    unsigned long long slot_size = 64ull << 20;
    int zero_copy = 1;
    const char *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|IKpz:ArenaReader", kwlist, &slots, &slot_size,
                                     &zero_copy, &name))
        return NULL;
    loom_collect__reader *r = (loom_collect__reader *)tp->tp_alloc(tp, 0);
    if (r == NULL) return NULL;
    r->zero_copy = zero_copy;
    loom_status s = loom_collect_arena_create(name, slots, slot_size, !zero_copy, &r->arena);
    if (s != LOOM_OK) {
        arena_raise((PyObject *)r, s);
        Py_DECREF(r);
        return NULL;
    }
    return (PyObject *)r;
}

static void reader_dealloc(PyObject *self) {
    loom_collect__reader *r = (loom_collect__reader *)self;
    PyTypeObject *tp = Py_TYPE(self);
    /* blocks hold the reader, so none is alive here */
    loom_collect_arena_close(r->arena);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static loom_collect_arena *reader_arena(loom_collect__reader *r) {
    if (r->closed || r->arena == NULL) {
        PyErr_SetString(PyExc_ValueError, "ArenaReader is closed");
        return NULL;
    }
    return r->arena;
}

static PyObject *reader_next_unit(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    double timeout = 10.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|d:next_unit", kwlist, &timeout)) return NULL;
    loom_collect_arena *a = reader_arena((loom_collect__reader *)self);
    if (a == NULL) return NULL;
    uint64_t span = 0, nbytes = 0;
    loom_status s;
    Py_BEGIN_ALLOW_THREADS
    s = loom_collect_arena_next_unit(a, timeout, &span, &nbytes);
    Py_END_ALLOW_THREADS
    if (s != LOOM_OK) return arena_raise(self, s);
    return Py_BuildValue("(KK)", (unsigned long long)span, (unsigned long long)nbytes);
}

static PyObject *reader_read_binary(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    loom_collect__reader *r = (loom_collect__reader *)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_binary(offset, nbytes)");
        return NULL;
    }
    unsigned long long offset = PyLong_AsUnsignedLongLong(args[0]);
    if (offset == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long nbytes = PyLong_AsUnsignedLongLong(args[1]);
    if (nbytes == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    loom_collect_arena *a = reader_arena(r);
    if (a == NULL) return NULL;
    void *ptr = NULL;
    uint64_t span = 0;
    loom_status s = loom_collect_arena_locate(a, offset, nbytes, &ptr, &span);
    if (s != LOOM_OK) return arena_raise(self, s);
    if (!r->zero_copy) {
        PyObject *copy = PyByteArray_FromStringAndSize(ptr, (Py_ssize_t)nbytes);
        if (copy == NULL) return NULL;
        PyObject *mv = PyMemoryView_FromObject(copy);
        Py_DECREF(copy);
        return mv;
    }
    loom_modstate *st = arena_state(self);
    if (st == NULL || st->collect == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "nnloom._C: collect/ is not initialised");
        return NULL;
    }
    loom_collect__ctx *ctx = (loom_collect__ctx *)st->collect;
    loom_collect__block *b =
        PyObject_New(loom_collect__block, (PyTypeObject *)LOOM_CREF(ctx, block_type));
    if (b == NULL) return NULL;
    b->reader = NULL;
    if ((s = loom_collect_arena_pin(a, span)) != LOOM_OK) {
        Py_DECREF(b);
        return arena_raise(self, s);
    }
    b->reader = Py_NewRef(self);
    b->ptr = ptr;
    b->len = (Py_ssize_t)nbytes;
    b->span = span;
    b->exports = 0;
    r->blocks++;
    PyObject *mv = PyMemoryView_FromObject((PyObject *)b);
    Py_DECREF(b); /* the memoryview's export holds it */
    return mv;
}

static PyObject *reader_end_unit(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"span", "anchors", NULL};
    unsigned long long span;
    PyObject *anchors = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|O:end_unit", kwlist, &span, &anchors))
        return NULL;
    (void)anchors; /* exports retain their own backing; anchors need no handling */
    loom_collect_arena *a = reader_arena((loom_collect__reader *)self);
    if (a == NULL) return NULL;
    loom_status s = loom_collect_arena_end_unit(a, span);
    if (s != LOOM_OK) return arena_raise(self, s);
    Py_RETURN_NONE;
}

static PyObject *reader_reset(PyObject *self, PyObject *unused) {
    (void)unused;
    loom_collect_arena *a = reader_arena((loom_collect__reader *)self);
    if (a == NULL) return NULL;
    loom_collect_arena_end_all(a);
    Py_RETURN_NONE;
}

static PyObject *reader_close(PyObject *self, PyObject *unused) {
    (void)unused;
    loom_collect__reader *r = (loom_collect__reader *)self;
    if (r->closed) Py_RETURN_NONE;
    r->closed = 1;
    if (r->arena == NULL) Py_RETURN_NONE;
    loom_collect_arena_unlink(r->arena); /* the name goes now, the mapping with the last view */
    if (r->blocks == 0) {
        loom_collect_arena_close(r->arena);
        r->arena = NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *reader_enter(PyObject *self, PyObject *unused) {
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *reader_exit(PyObject *self, PyObject *args) {
    (void)args;
    return reader_close(self, NULL);
}

static PyObject *reader_get_name(PyObject *self, void *c) {
    (void)c;
    loom_collect__reader *r = (loom_collect__reader *)self;
    if (r->arena == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(loom_collect_arena_name(r->arena));
}

static PyObject *reader_get_zero_copy(PyObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(((loom_collect__reader *)self)->zero_copy);
}

static PyObject *reader_get_free(PyObject *self, void *c) {
    (void)c;
    loom_collect__reader *r = (loom_collect__reader *)self;
    if (r->arena == NULL) return PyLong_FromLong(0);
    return PyLong_FromUnsignedLong(loom_collect_arena_free_slots(r->arena));
}

static PyObject *reader_get_blocks(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromSsize_t(((loom_collect__reader *)self)->blocks);
}

static PyMethodDef reader_methods[] = {
    {"next_unit", (PyCFunction)(void (*)(void))reader_next_unit, METH_VARARGS | METH_KEYWORDS,
     "next_unit(timeout=10.0) -> (span, nbytes): wait for the next committed unit."},
    {"read_binary", (PyCFunction)(void (*)(void))reader_read_binary, METH_FASTCALL,
     "read_binary(offset, nbytes) -> memoryview of exactly nbytes."},
    {"end_unit", (PyCFunction)(void (*)(void))reader_end_unit, METH_VARARGS | METH_KEYWORDS,
     "end_unit(span, anchors=None): the unit is done (read, failed or skipped)."},
    {"reset", reader_reset, METH_NOARGS,
     "reset(): new iteration; ends units taken but not ended (live views stay valid)."},
    {"close", reader_close, METH_NOARGS,
     "close(): unlink the region; the mapping goes with the last live view."},
    {"__enter__", reader_enter, METH_NOARGS, NULL},
    {"__exit__", reader_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef reader_getset[] = {
    {"name", reader_get_name, NULL, "shared-memory name the writer attaches to", NULL},
    {"zero_copy", reader_get_zero_copy, NULL,
     "True: views alias shared memory (segment pool); False: private copies (ring)", NULL},
    {"free_segments", reader_get_free, NULL, "segments the writer may fill now", NULL},
    {"live_blocks", reader_get_blocks, NULL, "zero-copy blocks still alive", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot reader_slots[] = {
    {Py_tp_new, reader_new},
    {Py_tp_dealloc, reader_dealloc},
    {Py_tp_methods, reader_methods},
    {Py_tp_getset, reader_getset},
    {Py_tp_doc, "ArenaReader(slots=4, slot_size=64 MiB, zero_copy=True, name=None): the "
                "parent's end of a shared-memory arena; creates and unlinks the region."},
    {0, NULL},
};

static PyType_Spec reader_spec = {
    .name = "nnloom._C.ArenaReader",
    .basicsize = sizeof(loom_collect__reader),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = reader_slots,
};

/* ------------------------------------------------------------------------ */
/* ArenaWriter                                                                */
/* ------------------------------------------------------------------------ */

static PyObject *writer_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name", "timeout", NULL};
    const char *name;
    double timeout = 10.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|d:ArenaWriter", kwlist, &name, &timeout))
        return NULL;
    loom_collect__writer *w = (loom_collect__writer *)tp->tp_alloc(tp, 0);
    if (w == NULL) return NULL;
    w->timeout = timeout;
    loom_status s = loom_collect_arena_attach(name, &w->arena);
    if (s != LOOM_OK) {
        arena_raise((PyObject *)w, s);
        Py_DECREF(w);
        return NULL;
    }
    return (PyObject *)w;
}

static void writer_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    loom_collect_arena_close(((loom_collect__writer *)self)->arena);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static loom_collect_arena *writer_arena(loom_collect__writer *w) {
    if (w->arena == NULL) PyErr_SetString(PyExc_ValueError, "ArenaWriter is closed");
    return w->arena;
}

static PyObject *writer_write_binary(PyObject *self, PyObject *data) {
    loom_collect__writer *w = (loom_collect__writer *)self;
    loom_collect_arena *a = writer_arena(w);
    if (a == NULL) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    uint64_t offset = 0;
    loom_status s;
    Py_BEGIN_ALLOW_THREADS
    s = loom_collect_arena_write(a, view.buf, (uint64_t)view.len, w->timeout, &offset);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (s != LOOM_OK) return arena_raise(self, s);
    return PyLong_FromUnsignedLongLong(offset);
}

static PyObject *writer_commit_unit(PyObject *self, PyObject *unused) {
    (void)unused;
    loom_collect__writer *w = (loom_collect__writer *)self;
    loom_collect_arena *a = writer_arena(w);
    if (a == NULL) return NULL;
    uint64_t span = 0;
    loom_status s;
    Py_BEGIN_ALLOW_THREADS
    s = loom_collect_arena_commit(a, w->timeout, &span);
    Py_END_ALLOW_THREADS
    if (s != LOOM_OK) return arena_raise(self, s);
    return PyLong_FromUnsignedLongLong(span);
}

static PyObject *writer_close(PyObject *self, PyObject *unused) {
    (void)unused;
    loom_collect__writer *w = (loom_collect__writer *)self;
    loom_collect_arena_close(w->arena);
    w->arena = NULL;
    Py_RETURN_NONE;
}

static PyMethodDef writer_methods[] = {
    {"write_binary", writer_write_binary, METH_O,
     "write_binary(data) -> offset: copy a bytes-like object into the open unit (waits, up to "
     "the timeout, for a free segment)."},
    {"commit_unit", writer_commit_unit, METH_NOARGS,
     "commit_unit() -> span: publish the open unit to the reader."},
    {"close", writer_close, METH_NOARGS, "close(): detach."},
    {"__enter__", reader_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))writer_close, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot writer_slots[] = {
    {Py_tp_new, writer_new},
    {Py_tp_dealloc, writer_dealloc},
    {Py_tp_methods, writer_methods},
    {Py_tp_doc, "ArenaWriter(name, timeout=10.0): a worker's end of a shared-memory arena."},
    {0, NULL},
};

static PyType_Spec writer_spec = {
    .name = "nnloom._C.ArenaWriter",
    .basicsize = sizeof(loom_collect__writer),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = writer_slots,
};

int loom_collect__arena_init(PyObject *m, loom_collect__ctx *ctx) {
    PyType_Spec *specs[] = {&block_spec, &reader_spec, &writer_spec};
    const char *names[] = {"_ArenaBlock", "ArenaReader", "ArenaWriter"};
    for (int i = 0; i < 3; i++) {
        PyObject *tp = PyType_FromModuleAndSpec(m, specs[i], NULL);
        if (tp == NULL) return -1;
        if (i == 0) LOOM_CREF(ctx, block_type) = Py_NewRef(tp);
        int rc = PyModule_AddObjectRef(m, names[i], tp);
        Py_DECREF(tp);
        if (rc < 0) return -1;
    }
    return 0;
}
