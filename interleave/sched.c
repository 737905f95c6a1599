/* interleave/sched.c - pure C bookkeeping of the scheduler.
 *
 * Holds, per trace: for every (module, kind) boundary how many occurrences
 * already completed and how many mediators wait on it; for every mediator its
 * state, the key it waits for, its row group and the next occurrence it will
 * ask for of each boundary it touched. No Python here: the handoff itself
 * lives in il_py.c.
 */
#include <string.h>

#include "interleave.h"

typedef struct {
    int32_t module;
    int32_t kind;
    int32_t next; /* next occurrence this mediator will ask for */
} loom__seen;

typedef struct {
    loom_med_state state;
    loom_key key;      /* valid in WAITING and SERVED */
    int64_t start;     /* first row of the group */
    int64_t size;      /* rows in the group; -1 = whole batch */
    int32_t base;      /* occurrence a first request of a boundary asks for (iteration) */
    int32_t n_seen;    /* entries used in `seen` */
    int32_t cap_seen;  /* entries allocated */
    loom__seen *seen;  /* [cap_seen] boundaries touched, small: scanned linearly */
} loom__med;

struct loom_sched {
    struct loom_sched_public pub; /* first: read by the inline fast path */
    int64_t batch;                /* total rows of the combined batch */
    loom__med *meds;              /* [n_meds] */
};

#define LOOM__IDX(s, m, k) ((k) * (s)->pub.n_modules + (m))

loom_status loom_sched_create(int32_t n_modules, int32_t n_meds, int64_t batch,
                              loom_sched **out) {
    loom_status ret = LOOM_OK;
    loom_sched *s = NULL;
    *out = NULL;
    if (n_modules < 0 || n_meds < 0)
        return loom_fail(LOOM_ERR_INVALID, "negative scheduler size (%d modules, %d mediators)",
                         (int)n_modules, (int)n_meds);
    s = loom_calloc(1, sizeof *s);
    if (s == NULL) goto nomem;
    s->pub.n_modules = n_modules;
    s->pub.n_meds = n_meds;
    s->batch = batch;
    /* one allocation carved in two: waiting then calls */
    s->pub.waiting = loom_calloc((size_t)LOOM_KIND_COUNT * 2 * (size_t)n_modules, sizeof(int32_t));
    if (s->pub.waiting == NULL) goto nomem;
    s->pub.calls = s->pub.waiting + (size_t)LOOM_KIND_COUNT * (size_t)n_modules;
    s->meds = loom_calloc((size_t)n_meds, sizeof *s->meds);
    if (s->meds == NULL) goto nomem;
    for (int32_t i = 0; i < n_meds; i++) s->meds[i].size = -1;
    *out = s;
    return ret;
nomem:
    ret = loom_fail(LOOM_ERR_NOMEM, "scheduler for %d modules and %d mediators", (int)n_modules,
                    (int)n_meds);
    loom_sched_destroy(s);
    return ret;
}

void loom_sched_destroy(loom_sched *s) {
    if (s == NULL) return;
    if (s->meds != NULL)
        for (int32_t i = 0; i < s->pub.n_meds; i++) loom_free(s->meds[i].seen);
    loom_free(s->meds);
    loom_free(s->pub.waiting);
    loom_free(s);
}

static loom_status loom__check_med(const loom_sched *s, int32_t med) {
    if (LOOM_UNLIKELY(med < 0 || med >= s->pub.n_meds))
        return loom_fail(LOOM_ERR_INVALID, "mediator %d out of range [0, %d)", (int)med,
                         (int)s->pub.n_meds);
    return LOOM_OK;
}

static loom_status loom__check_boundary(const loom_sched *s, int32_t module, int32_t kind) {
    if (LOOM_UNLIKELY(module < 0 || module >= s->pub.n_modules || kind < 0 ||
                      kind >= LOOM_KIND_COUNT))
        return loom_fail(LOOM_ERR_INVALID, "boundary (%d, %d) out of range", (int)module,
                         (int)kind);
    return LOOM_OK;
}

/* ------------------------------------------------------------------------ */
/* Row groups                                                                 */
/* ------------------------------------------------------------------------ */

loom_status loom_sched_set_rows(loom_sched *s, int32_t med, int64_t start, int64_t size) {
    LOOM_CHECK(loom__check_med(s, med));
    if (start < 0 || size < 0 || start + size > s->batch)
        return loom_fail(LOOM_ERR_INVALID, "row group [%lld, %lld) outside a batch of %lld rows",
                         (long long)start, (long long)(start + size), (long long)s->batch);
    s->meds[med].start = start;
    s->meds[med].size = size;
    return LOOM_OK;
}

int64_t loom_sched_batch(const loom_sched *s) { return s->batch; }
void loom_sched_set_batch(loom_sched *s, int64_t batch) { s->batch = batch; }

bool loom_sched_is_whole(const loom_sched *s, int32_t med) {
    const loom__med *m = &s->meds[med];
    return m->size < 0 || (m->start == 0 && m->size == s->batch);
}

bool loom_sched_rows_for(const loom_sched *s, int32_t med, int64_t dim0, int64_t *lo,
                         int64_t *len) {
    const loom__med *m = &s->meds[med];
    if (loom_sched_is_whole(s, med)) return false;
    if (s->batch <= 0 || dim0 <= 0 || dim0 % s->batch != 0) return false;
    int64_t k = dim0 / s->batch;
    *lo = m->start * k;
    *len = m->size * k;
    return true;
}

/* ------------------------------------------------------------------------ */
/* States                                                                     */
/* ------------------------------------------------------------------------ */

loom_med_state loom_sched_state(const loom_sched *s, int32_t med) { return s->meds[med].state; }

static bool loom__is_final(loom_med_state st) {
    return st == LOOM_MED_DONE || st == LOOM_MED_FAILED || st == LOOM_MED_STOPPED;
}

static void loom__unwait(loom_sched *s, loom__med *m) {
    if (m->state == LOOM_MED_WAITING) s->pub.waiting[LOOM__IDX(s, m->key.module, m->key.kind)]--;
}

loom_status loom_sched_set_state(loom_sched *s, int32_t med, loom_med_state st) {
    LOOM_CHECK(loom__check_med(s, med));
    loom__med *m = &s->meds[med];
    switch (st) {
    case LOOM_MED_RUNNING:
        if (m->state != LOOM_MED_NEW)
            return loom_fail(LOOM_ERR_STATE, "mediator %d started twice", (int)med);
        break;
    case LOOM_MED_DONE:
    case LOOM_MED_FAILED:
    case LOOM_MED_STOPPED:
        if (loom__is_final(m->state))
            return loom_fail(LOOM_ERR_STATE, "mediator %d finished twice", (int)med);
        loom__unwait(s, m);
        break;
    default:
        return loom_fail(LOOM_ERR_STATE, "state %d is entered through request/serve", (int)st);
    }
    m->state = st;
    return LOOM_OK;
}

/* ------------------------------------------------------------------------ */
/* Requests                                                                   */
/* ------------------------------------------------------------------------ */

static LOOM_NOINLINE loom__seen *loom__seen_grow(loom__med *m) {
    int32_t cap = m->cap_seen ? m->cap_seen * 2 : 8;
    loom__seen *p = loom_realloc(m->seen, (size_t)cap * sizeof *p);
    if (p == NULL) return NULL;
    m->seen = p;
    m->cap_seen = cap;
    return p;
}

/* The entry of (module, kind) for `m`, created at occurrence 0 when missing;
 * NULL when out of memory. */
static loom__seen *loom__seen_get(loom__med *m, int32_t module, int32_t kind) {
    for (int32_t i = m->n_seen - 1; i >= 0; i--)
        if (m->seen[i].module == module && m->seen[i].kind == kind) return &m->seen[i];
    if (m->n_seen == m->cap_seen && loom__seen_grow(m) == NULL) return NULL;
    loom__seen *e = &m->seen[m->n_seen++];
    e->module = module;
    e->kind = kind;
    e->next = m->base;
    return e;
}

loom_status loom_sched_request(loom_sched *s, int32_t med, int32_t module, int32_t kind,
                               loom_key *key) {
    LOOM_CHECK(loom__check_med(s, med));
    LOOM_CHECK(loom__check_boundary(s, module, kind));
    loom__med *m = &s->meds[med];
    if (m->state != LOOM_MED_RUNNING && m->state != LOOM_MED_SERVED)
        return loom_fail(LOOM_ERR_STATE, "mediator %d cannot request in state %d", (int)med,
                         (int)m->state);
    loom__seen *e = loom__seen_get(m, module, kind);
    if (e == NULL) return loom_fail(LOOM_ERR_NOMEM, "request table of mediator %d", (int)med);
    key->module = module;
    key->kind = kind;
    key->call = e->next;
    if (e->next < s->pub.calls[LOOM__IDX(s, module, kind)]) return LOOM_ERR_OUT_OF_ORDER;
    m->key = *key;
    m->state = LOOM_MED_WAITING;
    s->pub.waiting[LOOM__IDX(s, module, kind)]++;
    return LOOM_OK;
}

loom_status loom_sched_pin(loom_sched *s, int32_t med, int32_t module, int32_t kind,
                           int32_t call) {
    LOOM_CHECK(loom__check_med(s, med));
    LOOM_CHECK(loom__check_boundary(s, module, kind));
    loom__seen *e = loom__seen_get(&s->meds[med], module, kind);
    if (e == NULL) return loom_fail(LOOM_ERR_NOMEM, "request table of mediator %d", (int)med);
    e->next = call;
    return LOOM_OK;
}

loom_key loom_sched_key(const loom_sched *s, int32_t med) { return s->meds[med].key; }

/* ------------------------------------------------------------------------ */
/* Boundaries                                                                 */
/* ------------------------------------------------------------------------ */

int32_t loom_sched_begin(const loom_sched *s, int32_t module, int32_t kind) {
    return s->pub.calls[LOOM__IDX(s, module, kind)];
}

int32_t loom_sched_next_waiter(const loom_sched *s, int32_t module, int32_t kind, int32_t call,
                               int32_t from) {
    if (s->pub.waiting[LOOM__IDX(s, module, kind)] == 0) return -1;
    for (int32_t i = from < 0 ? 0 : from; i < s->pub.n_meds; i++) {
        const loom__med *m = &s->meds[i];
        if (m->state == LOOM_MED_WAITING && m->key.module == module && m->key.kind == kind &&
            m->key.call == call)
            return i;
    }
    return -1;
}

loom_status loom_sched_serve(loom_sched *s, int32_t med) {
    LOOM_CHECK(loom__check_med(s, med));
    loom__med *m = &s->meds[med];
    if (m->state != LOOM_MED_WAITING)
        return loom_fail(LOOM_ERR_STATE, "mediator %d served while not waiting", (int)med);
    loom__seen *e = loom__seen_get(m, m->key.module, m->key.kind);
    if (e == NULL) return loom_fail(LOOM_ERR_NOMEM, "request table of mediator %d", (int)med);
    s->pub.waiting[LOOM__IDX(s, m->key.module, m->key.kind)]--;
    e->next = m->key.call + 1;
    m->state = LOOM_MED_SERVED;
    return LOOM_OK;
}

void loom_sched_end(loom_sched *s, int32_t module, int32_t kind) {
    s->pub.calls[LOOM__IDX(s, module, kind)]++;
}

int32_t loom_sched_calls(const loom_sched *s, int32_t module, int32_t kind) {
    return s->pub.calls[LOOM__IDX(s, module, kind)];
}

int32_t loom_sched_next_missed(const loom_sched *s, int32_t from) {
    for (int32_t i = from < 0 ? 0 : from; i < s->pub.n_meds; i++)
        if (s->meds[i].state == LOOM_MED_WAITING) return i;
    return -1;
}

loom_status loom_sched_cancel(loom_sched *s, int32_t med) {
    LOOM_CHECK(loom__check_med(s, med));
    loom__med *m = &s->meds[med];
    if (m->state != LOOM_MED_WAITING)
        return loom_fail(LOOM_ERR_STATE, "mediator %d cancelled while not waiting", (int)med);
    loom__unwait(s, m);
    m->state = LOOM_MED_RUNNING;
    return LOOM_OK;
}

loom_status loom_sched_unserve(loom_sched *s, int32_t med) {
    LOOM_CHECK(loom__check_med(s, med));
    loom__med *m = &s->meds[med];
    if (m->state != LOOM_MED_SERVED)
        return loom_fail(LOOM_ERR_STATE, "mediator %d left a boundary it was not in", (int)med);
    m->state = LOOM_MED_RUNNING;
    return LOOM_OK;
}

loom_status loom_sched_set_iteration(loom_sched *s, int32_t med, int32_t call) {
    LOOM_CHECK(loom__check_med(s, med));
    if (call < 0) return loom_fail(LOOM_ERR_INVALID, "negative iteration %d", (int)call);
    loom__med *m = &s->meds[med];
    m->base = call;
    for (int32_t i = 0; i < m->n_seen; i++) m->seen[i].next = call;
    return LOOM_OK;
}
