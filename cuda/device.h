/* cuda/device.h - everything device-specific, behind one header: the pinned
 * host pool, retained blocks, compact device-to-host staging, streams and
 * events, NVTX ranges. Every part has a CPU implementation behind the same
 * declarations; the CPU tests drive that one.
 *
 * How CUDA is reached (and why)
 * -----------------------------
 * nnloom._C never links libcudart, libcuda or NCCL. The CUDA runtime and
 * driver entry points are resolved at run time (cuda/rt.c): dlopen with
 * RTLD_NOLOAD of the sonames torch has already loaded into the process
 * (libcudart.so.13, then .12), then a plain dlopen of the same sonames,
 * then NNLOOM_CUDART as an explicit path; dlsym fills one table of function
 * pointers that the rest of cuda/ calls through. Reasons:
 *   - `import nnloom` must work on machines without a GPU or toolkit: a
 *     missing library only makes loom_cuda_runtime() report
 *     LOOM_ERR_UNAVAILABLE, it never stops the extension from loading;
 *   - torch brings its own cudart: using the copy already mapped means one
 *     runtime, one primary context, one set of stream handles (torch's
 *     cudaStream_t values are usable as they are);
 *   - CPU tests replace the table (loom_cuda_rt_override) instead of
 *     needing --wrap tricks, and the same binary runs everywhere.
 * The only device code (the gather kernel, cuda/gather.cu) is compiled by
 * nvcc into a fatbin (sm_90 + PTX) embedded in the library and loaded with
 * the driver API on first use; a build without nvcc falls back to strided
 * 2-D copies for scattered rows (correct, slower).
 * CUDA types appear here as opaque pointers (void *stream, void *event).
 *
 * Ownership words: "owned" = the caller must release; "borrowed" = valid
 * while its owner lives.
 */
#ifndef LOOM_DEVICE_H
#define LOOM_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================== */
/* Events                                                                     */
/* ======================================================================== */

/* Where completion markers come from. The CUDA source records cudaEvents on
 * streams; the CPU source has nothing asynchronous (every marker is done);
 * tests install a fake whose query answers under their control. */
typedef struct loom_cuda_event_source {
    void *ctx; /* passed back to every callback */
    /* Record a marker after the work queued so far on `stream`; *event is
     * owned by the source until `release`. NULL *event means "already done". */
    loom_status (*record)(void *ctx, void *stream, void **event);
    /* 1 done, 0 pending, < 0 failed (loom_fail detail set; treated as done
     * so a broken device cannot pin memory forever). */
    int (*query)(void *ctx, void *event);
    /* Block the host until done. */
    loom_status (*wait)(void *ctx, void *event);
    /* Give the marker back (it may be recycled). */
    void (*release)(void *ctx, void *event);
} loom_cuda_event_source;

/* Static storage: every marker is done at once. */
const loom_cuda_event_source *loom_cuda_cpu_events(void);

/* Pins and unpins host memory. NULL pinner = pageable (CPU builds). */
typedef struct loom_cuda_pinner {
    void *ctx;
    loom_status (*pin)(void *ctx, void *ptr, size_t nbytes);
    void (*unpin)(void *ctx, void *ptr, size_t nbytes);
} loom_cuda_pinner;

/* ======================================================================== */
/* Pinned host pool                                                           */
/* ======================================================================== */

/* Blocks come in power-of-two size classes from 4 KiB. Small classes are
 * carved from big slabs (memfd-backed shared mappings, pinned once); a block
 * at least as big as a slab gets a slab of its own. Slabs are unpinned and
 * unmapped only when the pool is destroyed. A block is in one of three
 * states:
 *   free    - on its class's free list, reusable;
 *   held    - leased and/or exported (DLPack, handles);
 *   waiting - no holder left, but a stream that used it has not finished.
 * It goes back to free only when it has no lease, no export, and every
 * recorded event completed. Pinned bytes never exceed the limit: a lease
 * that would pass it first reclaims waiting blocks, then fails with
 * LOOM_ERR_FULL. All functions are thread-safe (one mutex per pool). */

typedef struct loom_cuda_pool loom_cuda_pool;
typedef struct loom_cuda_block loom_cuda_block;

#define LOOM_CUDA_MIN_CLASS 12 /* 4 KiB */
#define LOOM_CUDA_MAX_CLASS 40 /* 1 TiB: larger leases are invalid */
#define LOOM_CUDA_BLOCK_STREAMS 4 /* distinct streams pending per block */

typedef struct {
    size_t limit_bytes;                   /* bound on pinned bytes; 0: NNLOOM_PINNED_LIMIT_MB (4096) */
    size_t slab_bytes;                    /* slab size; 0: NNLOOM_PINNED_SLAB_MB (64) */
    const loom_cuda_event_source *events; /* borrowed for the pool's life; NULL: CPU */
    const loom_cuda_pinner *pinner;       /* borrowed for the pool's life; NULL: none */
} loom_cuda_pool_config;

typedef struct {
    uint64_t bytes_pinned;  /* mapped (and pinned when a pinner is set) */
    uint64_t bytes_leased;  /* in held blocks */
    uint64_t bytes_waiting; /* released, streams pending */
    uint64_t bytes_free;    /* reusable now */
    uint64_t limit_bytes;   /* the bound */
    uint64_t slabs;         /* mappings */
    uint64_t blocks;        /* block records (any state) */
    uint64_t leases_live;   /* blocks currently leased */
    uint64_t exports_live;  /* exports not yet released, all blocks */
    uint64_t leases_total;  /* leases granted since creation */
    uint64_t reuses;        /* leases served from a free list */
} loom_cuda_pool_stats;

/* Create a pool with one owner reference. *out owned: drop with
 * loom_cuda_pool_release. */
loom_status loom_cuda_pool_create(const loom_cuda_pool_config *cfg, loom_cuda_pool **out);
/* Reference counting. The pool is destroyed (pending events waited for,
 * slabs unpinned and unmapped) when the last reference goes; every held
 * block holds one reference, so a pool outlives its leases and exports. */
void loom_cuda_pool_retain(loom_cuda_pool *pool);
void loom_cuda_pool_release(loom_cuda_pool *pool);

/* Lease a block of at least `nbytes` (> 0). *out is held by one lease. */
loom_status loom_cuda_pool_lease(loom_cuda_pool *pool, size_t nbytes, loom_cuda_block **out);
/* Move waiting blocks whose events completed to the free lists and run
 * their deferred callbacks. Returns how many blocks were freed. */
size_t loom_cuda_pool_reclaim(loom_cuda_pool *pool);
void loom_cuda_pool_stats_get(loom_cuda_pool *pool, loom_cuda_pool_stats *out);
/* Bytes of the class a request of nbytes lands in (0 when too big). */
size_t loom_cuda_class_bytes(size_t nbytes);

/* Borrowed while held. */
void *loom_cuda_block_data(const loom_cuda_block *blk);
size_t loom_cuda_block_size(const loom_cuda_block *blk);
/* Borrowed while the block is held. */
loom_cuda_pool *loom_cuda_block_pool(const loom_cuda_block *blk);
/* Memory-file descriptor of the slab the block lives in (-1 when the slab
 * is an anonymous mapping) and the block's offset in it: another process
 * can map the same bytes. Borrowed: the pool owns the descriptor. */
int loom_cuda_block_shm(const loom_cuda_block *blk, size_t *offset);

/* Record that `stream` used the block (the block is not reusable before
 * this point of that stream completes). Same stream again replaces the
 * older marker. LOOM_ERR_FULL past LOOM_CUDA_BLOCK_STREAMS pending streams. */
loom_status loom_cuda_block_record(loom_cuda_block *blk, void *stream);
/* 1 when every recorded event completed, else 0. Runs deferred callbacks
 * once done. */
int loom_cuda_block_ready(loom_cuda_block *blk);
/* Host-wait for every recorded event (the only place the host blocks),
 * then run deferred callbacks. */
loom_status loom_cuda_block_wait(loom_cuda_block *blk);
/* Run fn(arg) once the block's current events completed (at once when none
 * pending): how staging keeps source tensors alive until their copy ran.
 * The callback must not call back into the pool. */
loom_status loom_cuda_block_defer(loom_cuda_block *blk, void (*fn)(void *), void *arg);

/* One more export (a DLPack tensor, a handle) keeps the block held. */
void loom_cuda_block_export(loom_cuda_block *blk);
/* Drop an export; the block may go back to the pool. */
void loom_cuda_block_unexport(loom_cuda_block *blk);
/* Drop the lease (once); the block may go back to the pool. */
void loom_cuda_block_end_lease(loom_cuda_block *blk);

/* ======================================================================== */
/* Compact staging                                                           */
/* ======================================================================== */

#define LOOM_CUDA_MAX_DIMS 8

/* A strided tensor as DLPack describes it (read in C from __dlpack__). */
typedef struct {
    const void *data;                    /* first element (byte_offset applied) */
    int32_t ndim;                        /* <= LOOM_CUDA_MAX_DIMS */
    int32_t itemsize;                    /* bytes per element: 1, 2, 4, 8 or 16 */
    int64_t shape[LOOM_CUDA_MAX_DIMS];   /* elements per dim */
    int64_t strides[LOOM_CUDA_MAX_DIMS]; /* in elements, may be 0 (broadcast) */
    int32_t device;                      /* -1: host memory; >= 0: CUDA ordinal */
} loom_cuda_tview;

typedef enum {
    LOOM_CUDA_COPY_EMPTY,  /* no elements */
    LOOM_CUDA_COPY_CONTIG, /* one linear copy */
    LOOM_CUDA_COPY_ROWS,   /* uniform rows: 2-D copy (width, height, pitch) */
    LOOM_CUDA_COPY_GATHER, /* anything else: element gather */
} loom_cuda_copy_kind;

/* How one tensor is compacted: its layout with mergeable dims collapsed. */
typedef struct {
    loom_cuda_copy_kind kind;
    size_t offset;                       /* in the destination block, bytes */
    size_t nbytes;                       /* compact size */
    int32_t ndim;                        /* collapsed dims */
    int32_t itemsize;
    int64_t shape[LOOM_CUDA_MAX_DIMS];   /* collapsed */
    int64_t stride_b[LOOM_CUDA_MAX_DIMS];/* collapsed strides in bytes */
} loom_cuda_copy_plan;

/* Plan n tensors into one compact block: plans[i] gets kind and offset;
 * *total the bytes to lease. Offsets are 256-byte aligned; gathered
 * tensors come first so one copy moves all of them from device scratch. */
loom_status loom_cuda_stage_plan(const loom_cuda_tview *views, size_t n,
                                 loom_cuda_copy_plan *plans, size_t *total);
/* Host sources: do the compact copies into dst (the leased block). */
loom_status loom_cuda_stage_cpu(const loom_cuda_tview *views, const loom_cuda_copy_plan *plans,
                                size_t n, void *dst);
/* Device sources (all on one device): enqueue the compaction on the copy
 * stream of that device after the work already on `compute_stream`, record
 * the block's event on the copy stream. Nothing waits on the host. The
 * caller keeps the sources alive until the block is ready (see
 * loom_cuda_block_defer). */
loom_status loom_cuda_stage_device(const loom_cuda_tview *views, const loom_cuda_copy_plan *plans,
                                   size_t n, loom_cuda_block *blk, void *compute_stream);
/* Rows narrower than this go through the gather kernel rather than a 2-D
 * copy (NNLOOM_COPY2D_MIN_ROW, bytes, default 2048). */
int64_t loom_cuda_copy2d_min_row(void);

/* ======================================================================== */
/* CUDA runtime (resolved at run time)                                        */
/* ======================================================================== */

/* LOOM_OK when the CUDA runtime was found and reports a device; else
 * LOOM_ERR_UNAVAILABLE with the reason as the error detail. Resolves once. */
loom_status loom_cuda_runtime(void);
/* Number of devices (0 without the runtime). */
int loom_cuda_device_count(void);
/* The event source backed by cudaEvents (static storage); NULL without the
 * runtime. */
const loom_cuda_event_source *loom_cuda_device_events(void);
/* The pinner backed by cudaHostRegister (static storage); NULL without the
 * runtime. */
const loom_cuda_pinner *loom_cuda_device_pinner(void);
/* Whether the gather kernel is compiled in (nvcc found at build time). */
bool loom_cuda_have_kernels(void);

/* ======================================================================== */
/* NVTX ranges                                                               */
/* ======================================================================== */

/* Push/pop a range in the "nnloom" domain. No-ops when built without NVTX
 * or when NNLOOM_NVTX=0. Every push must be matched by a pop on every path
 * of the calling function. `name` borrowed for the call. */
void loom_cuda_range_push(const char *name);
void loom_cuda_range_pop(void);
/* Ranges this thread has open (counted even when NVTX is off, so tests can
 * check balance in any build). */
int loom_cuda_range_depth(void);
/* Whether ranges are emitted (build option and NNLOOM_NVTX). */
bool loom_cuda_nvtx_enabled(void);

#ifdef Py_PYTHON_H
/* Register cuda/'s types and functions on the extension module `m`.
 * -1 with an exception set. */
int loom_cuda_module_init(PyObject *m);
#endif

#ifdef __cplusplus
}
#endif
#endif /* LOOM_DEVICE_H */
