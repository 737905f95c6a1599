/* collect/collect.h - what leaves a trace: compact pickles, restricted loading,
 * merging of per-request saves, the shared-memory arena.
 *
 * The pure C half (this header without Python.h) is what the cmocka tests
 * reach: the compact copy of strided bytes (compact.c) and the arena's
 * bookkeeping over shared memory (arena.c). The Python half registers its types
 * and functions on the extension through loom_collect_module_init.
 */
#ifndef LOOM_COLLECT_H
#define LOOM_COLLECT_H

#include <stdbool.h>

#include "../base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Compact copy of strided elements (compact.c)                              */
/* ------------------------------------------------------------------------ */

#define LOOM_COLLECT_MAX_DIMS 64

/* A strided view over host memory, as torch describes it. Borrowed arrays. */
typedef struct {
    int ndim;              /* number of dimensions, 0..LOOM_COLLECT_MAX_DIMS */
    const int64_t *shape;  /* [ndim] elements per dimension, >= 0 */
    const int64_t *stride; /* [ndim] step per dimension, in elements, >= 0 */
    size_t itemsize;       /* bytes per element, >= 1 */
} loom_collect_layout;

/* Number of elements (product of shape; 1 for ndim 0). */
int64_t loom_collect_numel(const loom_collect_layout *l);

/* True when the view covers exactly numel consecutive elements starting at
 * its first element (a permutation of a row-major layout, size-1 dimensions
 * ignored): its bytes can be taken as one block and its strides kept. */
bool loom_collect_is_dense(const loom_collect_layout *l);

/* Copy the elements of the view starting at `src` into `dst` in row-major
 * order. `dst_len` must be numel * itemsize. Borrows both buffers; they must
 * not overlap. LOOM_ERR_INVALID on a bad layout or length. */
loom_status loom_collect_compact_copy(void *dst, size_t dst_len, const void *src,
                                      const loom_collect_layout *l);

#ifdef __cplusplus
}
#endif

#ifdef Py_PYTHON_H
/* Register collect's types and functions on the extension module `m`.
 * -1 with an exception set. */
int loom_collect_module_init(PyObject *m);
#endif

#endif /* LOOM_COLLECT_H */
