/* collect/collect_internal.h - shared between collect/'s files only.
 *
 * The Python half keeps every Python object it needs on one context object (a
 * heap type instance, reached from the module state's `collect` field), so
 * nothing lives in a C global and the module's GC sees all of it.
 */
#ifndef LOOM_COLLECT_INTERNAL_H
#define LOOM_COLLECT_INTERNAL_H

#ifndef Py_PYTHON_H
#error "include Python.h before collect/collect_internal.h"
#endif

#include "../base/pybase.h"
#include "collect.h"

/* X(field): strong references held by the context, set at module init. */
#define LOOM_COLLECT__REFS(X)                                                  \
    X(pickler_type)   /* nnloom._C.CompactPickler (subclass of _pickle.Pickler) */ \
    X(deferred_type)  /* nnloom._C._Deferred */                                \
    X(block_type)     /* nnloom._C._ArenaBlock */                              \
    X(bytesio)        /* io.BytesIO */                                         \
    X(picklebuffer)   /* pickle.PickleBuffer */                                \
    X(from_buffer)    /* torch.UntypedStorage.from_buffer */                   \
    X(byte_tensor)    /* torch.ByteTensor */                                   \
    X(m_view)         /* torch.Tensor.view */                                  \
    X(m_as_strided)   /* torch.Tensor.as_strided */                            \
    X(m_requires_grad_) /* torch.Tensor.requires_grad_ */                      \
    X(parameter_type) /* torch.nn.Parameter */                                 \
    X(uint8)          /* torch.uint8 */                                        \
    X(strided)        /* torch.strided */                                      \
    X(s_native)       /* "native" */                                           \
    X(s_cpu)          /* "cpu" */                                              \
    X(a_device) X(a_type) X(a_cpu) X(a_layout) X(a_is_quantized) X(a_is_conj)  \
    X(a_is_neg) X(a_resolve_conj) X(a_resolve_neg) X(a_dtype) X(a_shape)       \
    X(a_stride) X(a_element_size) X(a_data_ptr) X(a_requires_grad) X(a_dump)   \
    X(a_getvalue)

enum {
#define LOOM__IDX(f) LOOM_COLLECT__REF_##f,
    LOOM_COLLECT__REFS(LOOM__IDX)
#undef LOOM__IDX
    LOOM_COLLECT__NREFS
};

typedef struct {
    PyObject_HEAD
    PyObject *ref[LOOM_COLLECT__NREFS]; /* see LOOM_COLLECT__REFS; all strong */
} loom_collect__ctx;

#define LOOM_CREF(ctx, f) ((ctx)->ref[LOOM_COLLECT__REF_##f])

/* The context of the module that defined `type` (borrowed, lives as long as
 * the module). NULL with an exception set if the module is gone. */
loom_collect__ctx *loom_collect__ctx_of(PyTypeObject *defining_class);

/* pickle_py.c: create the pickler types, fill their refs in `ctx`, add
 * dumps_compact's helpers to `m`. -1 with an exception set. */
int loom_collect__pickle_init(PyObject *m, loom_collect__ctx *ctx);

/* dumps_compact(value) -> bytes. Returns a new reference, NULL with an
 * exception set. `ctx` borrowed. */
PyObject *loom_collect__dumps_compact(loom_collect__ctx *ctx, PyObject *value);

/* arena_py.c: register the arena types on `m`, keep the block type in
 * `ctx`. -1 with an exception set. */
int loom_collect__arena_init(PyObject *m, loom_collect__ctx *ctx);

/* During one dumps_compact call on this thread: id(tensor) -> host tensor
 * holding its compact bytes (borrowed dict), or NULL. */
extern _Thread_local PyObject *loom_collect__substitutes;

/* Register merge_all (merge_py.c). -1 with an exception set. */
int loom_collect__merge_init(PyObject *m);

#endif /* LOOM_COLLECT_INTERNAL_H */
