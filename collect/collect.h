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

/* ------------------------------------------------------------------------ */
/* Shared-memory arena (arena.c)                                             */
/* ------------------------------------------------------------------------ */

/* A POSIX shared-memory region cut into `nslots` segments of `slot_size`
 * bytes. One unit (the binaries of one payload) fills one segment. The
 * reader (the parent) creates the region and unlinks it; the writer (a
 * worker) attaches by name. A segment moves FREE -> WRITING (writer) ->
 * COMMITTED -> READING (reader) -> FREE, the last step only once the reader
 * has ended the unit AND released every pin (live export) on it. The writer
 * never overwrites: with no free segment it waits, up to a timeout, and gives
 * up early if the reader process is gone; a reader waiting for a unit gives
 * up if the writer is gone. Waits poll with a short sleep: a lock or futex
 * held by a killed process would never be released. */
typedef struct loom_collect_arena loom_collect_arena;

/* Reader side: create region `name` ("/nnloom-..."; NULL picks one). `ring`
 * hands segments out strictly in order (the copy-out backend); otherwise any
 * free segment is used (the zero-copy pool). *out is owned by the caller:
 * loom_collect_arena_close. */
loom_status loom_collect_arena_create(const char *name, uint32_t nslots, uint64_t slot_size,
                                      bool ring, loom_collect_arena **out);
/* Writer side: attach to region `name`. *out owned by the caller. */
loom_status loom_collect_arena_attach(const char *name, loom_collect_arena **out);
/* Unmap; the creator also unlinks the name. Takes ownership of `a`. */
void loom_collect_arena_close(loom_collect_arena *a);
/* The region's name; borrowed, valid until close. */
const char *loom_collect_arena_name(const loom_collect_arena *a);
uint32_t loom_collect_arena_nslots(const loom_collect_arena *a);
uint64_t loom_collect_arena_slot_size(const loom_collect_arena *a);
bool loom_collect_arena_is_ring(const loom_collect_arena *a);
/* Remove the region's name now (the mapping stays valid). Idempotent. */
void loom_collect_arena_unlink(loom_collect_arena *a);

/* Writer: copy n bytes into the open unit (opening one, waiting up to
 * timeout_s for a free segment). *offset: physical offset in the region.
 * LOOM_ERR_TIMEOUT when the arena stays full, LOOM_ERR_STATE when the reader
 * is gone, LOOM_ERR_FULL when the unit would outgrow a segment. */
loom_status loom_collect_arena_write(loom_collect_arena *a, const void *p, uint64_t n,
                                     double timeout_s, uint64_t *offset);
/* Writer: publish the open unit (an empty one if none is open, waiting like
 * write). *span identifies it for the reader. */
loom_status loom_collect_arena_commit(loom_collect_arena *a, double timeout_s, uint64_t *span);

/* Reader: wait up to timeout_s for the next committed unit, in commit order.
 * LOOM_ERR_TIMEOUT, or LOOM_ERR_STATE when the writer is gone. */
loom_status loom_collect_arena_next_unit(loom_collect_arena *a, double timeout_s, uint64_t *span,
                                         uint64_t *nbytes);
/* Reader: address of [offset, offset + n) inside a unit being read. *ptr
 * borrowed: valid while the unit is pinned or not yet ended. */
loom_status loom_collect_arena_locate(loom_collect_arena *a, uint64_t offset, uint64_t n,
                                      void **ptr, uint64_t *span);
/* Reader: a live export of unit `span` begins / ends. */
loom_status loom_collect_arena_pin(loom_collect_arena *a, uint64_t span);
void loom_collect_arena_unpin(loom_collect_arena *a, uint64_t span);
/* Reader: the unit is logically done (read, failed or skipped). Its segment
 * is freed now if unpinned, else when the last pin goes. */
loom_status loom_collect_arena_end_unit(loom_collect_arena *a, uint64_t span);
/* Reader: end every unit taken by next_unit and not yet ended. */
void loom_collect_arena_end_all(loom_collect_arena *a);
/* Segments currently FREE (for tests and diagnostics). */
uint32_t loom_collect_arena_free_slots(const loom_collect_arena *a);

#ifdef __cplusplus
}
#endif

#ifdef Py_PYTHON_H
/* Register collect's types and functions on the extension module `m`.
 * -1 with an exception set. */
int loom_collect_module_init(PyObject *m);
#endif

#endif /* LOOM_COLLECT_H */
