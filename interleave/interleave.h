/* interleave/interleave.h - the scheduler: who waits for which module boundary.
 *
 * A trace runs one mediator per invoke. Each mediator's body is ordinary Python
 * running as a coroutine on the model's own thread; it parks when it needs a
 * value ("the output of model.layers.3, first call") and is resumed when the
 * forward reaches that boundary. This header has two halves:
 *
 *   1. loom_sched_*: pure C bookkeeping (request keys, per-mediator state,
 *      occurrence counting, out-of-order detection, row groups). No Python;
 *      tested by cmocka.
 *   2. loom_il_*: the Python half (greenlet handoff, narrowing values to an
 *      invoke's rows, splicing assignments back). Visible only to files that
 *      include Python.h first.
 *
 * The scheduler knows module boundaries only as small integers; what a module
 * is, and how values are intercepted, belongs to hooks/.
 */
#ifndef LOOM_INTERLEAVE_H
#define LOOM_INTERLEAVE_H

#include <stdbool.h>
#include <stdint.h>

#include "../base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================== */
/* 1. Pure C scheduler                                                        */
/* ======================================================================== */

typedef enum {
    LOOM_KIND_INPUT = 0,  /* before the module runs: (args, kwargs) */
    LOOM_KIND_OUTPUT = 1, /* after the module ran: its return value */
    LOOM_KIND_COUNT = 2
} loom_kind;

/* One request: occurrence `call` of boundary `kind` of module `module`.
 * Printed as "<path>.output.i<call>". */
typedef struct {
    int32_t module; /* module index in the wrapped tree */
    int32_t kind;   /* loom_kind */
    int32_t call;   /* occurrence within this forward, from 0 */
} loom_key;

typedef enum {
    LOOM_MED_NEW = 0, /* created, body not started */
    LOOM_MED_RUNNING, /* running user code, nothing served */
    LOOM_MED_WAITING, /* parked on `key` */
    LOOM_MED_SERVED,  /* running user code inside the boundary of `key` */
    LOOM_MED_DONE,    /* body finished */
    LOOM_MED_FAILED,  /* body raised */
    LOOM_MED_STOPPED  /* body ended the forward early (tracer.stop()) */
} loom_med_state;

typedef struct loom_sched loom_sched;

/* Create a scheduler for `n_modules` boundaries and `n_meds` mediators whose
 * row groups split a batch of `batch` rows. On success *out owns the result;
 * free with loom_sched_destroy. */
loom_status loom_sched_create(int32_t n_modules, int32_t n_meds, int64_t batch,
                              loom_sched **out);
void loom_sched_destroy(loom_sched *s);

/* Row group of mediator `med`: rows [start, start+size) of the batch. A
 * mediator whose group is the whole batch (the default) sees values whole. */
loom_status loom_sched_set_rows(loom_sched *s, int32_t med, int64_t start, int64_t size);
int64_t loom_sched_batch(const loom_sched *s);
void loom_sched_set_batch(loom_sched *s, int64_t batch);

/* Whether `med` sees the whole batch (values handed over as they are). */
bool loom_sched_is_whole(const loom_sched *s, int32_t med);

/* Narrowing rule for one tensor of leading size `dim0` seen by `med`:
 * returns true and the row range [*lo, *lo + *len) when the tensor must be
 * narrowed (dim0 == batch * k, k >= 1, and the group is not the whole batch),
 * false when the value is passed whole. */
bool loom_sched_rows_for(const loom_sched *s, int32_t med, int64_t dim0, int64_t *lo,
                         int64_t *len);

loom_med_state loom_sched_state(const loom_sched *s, int32_t med);
/* Set directly: NEW -> RUNNING when a body starts; -> DONE/FAILED/STOPPED when
 * it ends. Returns ERR_STATE for a transition that cannot happen. */
loom_status loom_sched_set_state(loom_sched *s, int32_t med, loom_med_state st);

/* The mediator asks for the next occurrence of (module, kind) it has not
 * seen yet. On OK the mediator is WAITING and *key says what for. Returns
 * ERR_OUT_OF_ORDER (and *key = the occurrence that already passed) when the
 * forward ran past it. */
loom_status loom_sched_request(loom_sched *s, int32_t med, int32_t module, int32_t kind,
                               loom_key *key);

/* The key a WAITING or SERVED mediator refers to. */
loom_key loom_sched_key(const loom_sched *s, int32_t med);

/* Fast check at a module boundary: does anybody wait for any occurrence? */
static inline bool loom_sched_has_waiters(const loom_sched *s, int32_t module,
                                          int32_t kind);

/* Boundary protocol, for every (module, kind) boundary the forward crosses:
 *   c = loom_sched_begin(s, m, k);
 *   for (i = loom_sched_next_waiter(s, m, k, c, 0); i >= 0;
 *        i = loom_sched_next_waiter(s, m, k, c, i + 1)) {
 *       loom_sched_serve(s, i);   ... resume mediator i ...
 *   }
 *   loom_sched_end(s, m, k);
 * Waiters are served in invoke order. */
int32_t loom_sched_begin(const loom_sched *s, int32_t module, int32_t kind);
int32_t loom_sched_next_waiter(const loom_sched *s, int32_t module, int32_t kind,
                               int32_t call, int32_t from);
loom_status loom_sched_serve(loom_sched *s, int32_t med);
void loom_sched_end(loom_sched *s, int32_t module, int32_t kind);

/* How many occurrences of (module, kind) completed in this forward. */
int32_t loom_sched_calls(const loom_sched *s, int32_t module, int32_t kind);

/* A WAITING mediator goes back to RUNNING without being served (the trace
 * is about to tell it its request was missed). */
loom_status loom_sched_cancel(loom_sched *s, int32_t med);

/* A SERVED mediator leaves its boundary without a new request (it blocks on
 * something else, e.g. a barrier): back to RUNNING. */
loom_status loom_sched_unserve(loom_sched *s, int32_t med);

/* After the forward: the first mediator at or after `from` still WAITING, or -1. */
int32_t loom_sched_next_missed(const loom_sched *s, int32_t from);

/* Pin the occurrence counter: every request of (module, kind) made from now on
 * by `med` asks for occurrence `call` onward (used by iteration/generation). */
loom_status loom_sched_pin(loom_sched *s, int32_t med, int32_t module, int32_t kind,
                           int32_t call);

/* Iteration (generation step) `call`: from now on every request of `med`, of
 * any boundary, asks for occurrence `call` (one call per module per step). */
loom_status loom_sched_set_iteration(loom_sched *s, int32_t med, int32_t call);

/* ---- inline fast path ---------------------------------------------------- */

struct loom_sched_public {
    int32_t n_modules;
    int32_t n_meds;
    int32_t *waiting; /* [LOOM_KIND_COUNT * n_modules] mediators parked on the boundary */
    int32_t *calls;   /* [LOOM_KIND_COUNT * n_modules] completed occurrences */
};

static inline bool loom_sched_has_waiters(const loom_sched *s, int32_t module,
                                          int32_t kind) {
    const struct loom_sched_public *p = (const struct loom_sched_public *)s;
    return p->waiting[kind * p->n_modules + module] != 0;
}

#ifdef __cplusplus
}
#endif

/* ======================================================================== */
/* 2. Python half                                                            */
/* ======================================================================== */
#ifdef Py_PYTHON_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct loom_il loom_il;

/* The interleaver running on this thread, or NULL. Borrowed. */
loom_il *loom_il_active(void);
/* True while a mediator's user code runs on this thread (so a module it calls
 * directly runs without interleaving). */
bool loom_il_in_user_code(void);
/* The opaque tree token the active interleaver was created for. */
PyObject *loom_il_tree(const loom_il *il);
/* Counts and waiters for the hooks' fast path. */
loom_sched *loom_il_sched(const loom_il *il);

/* Serve the waiters of boundary (module, kind). `*value` is a new reference
 * on entry; on return it is a new reference to the (possibly replaced) value.
 * For LOOM_KIND_INPUT the value is the pair (args: tuple, kwargs: dict).
 * Returns -1 with an exception set (the value is released then). */
int loom_il_boundary(loom_il *il, int32_t module, int32_t kind, PyObject **value);

/* A body asked for the module to be skipped: returns a new reference to the
 * replacement output, NULL without exception when nobody skips, or NULL with
 * an exception set. Called after the input boundary. */
PyObject *loom_il_take_skip(loom_il *il, int32_t module);

/* Module-level setup: import greenlet's C API, register types and functions
 * on `m`. Returns -1 with an exception set. */
int loom_il_module_init(PyObject *m);

#ifdef __cplusplus
}
#endif
#endif /* Py_PYTHON_H */

#endif /* LOOM_INTERLEAVE_H */
