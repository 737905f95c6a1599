/* cuda/pool.c - the pinned host pool: size classes, leases, exports, events.
 *
 * Memory comes in slabs: memfd-backed shared mappings (so the same bytes can
 * be mapped by another process), pinned once through the pool's pinner and
 * released only when the pool dies: nothing here unpins or unmaps on a hot
 * path. Blocks are carved from slabs by class and then only move between
 * three places: a class free list, a holder (lease and/or exports), and the
 * waiting list (no holder, stream work pending). See device.h for the
 * contract; the comments below say how.
 */
#define _GNU_SOURCE
#include "cuda_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static LOOM_PARAM(PinnedLimitMB, "NNLOOM_PINNED_LIMIT_MB", 4096)
static LOOM_PARAM(PinnedSlabMB, "NNLOOM_PINNED_SLAB_MB", 64)

enum { BLOCK_FREE, BLOCK_HELD, BLOCK_WAITING };

typedef struct loom_cuda__defer {
    void (*fn)(void *);            /* run once the block's events completed */
    void *arg;                     /* passed to fn */
    struct loom_cuda__defer *next;
} loom_cuda__defer;

typedef struct loom_cuda__slab {
    uint8_t *base;                 /* mapping start, page aligned */
    size_t size;                   /* bytes mapped (and pinned) */
    size_t used;                   /* carved so far */
    int fd;                        /* memfd, or -1 for an anonymous mapping */
    struct loom_cuda__slab *next;
} loom_cuda__slab;

struct loom_cuda_block {
    uint8_t *ptr;                  /* block start, 4 KiB aligned */
    size_t size;                   /* class bytes */
    loom_cuda_pool *pool;          /* owner */
    loom_cuda__slab *slab;         /* where the bytes live */
    int cls;                       /* log2(size) */
    int state;                     /* BLOCK_* */
    int leased;                    /* 0 or 1 */
    int exports;                   /* live exports */
    int n_ev;                      /* pending markers */
    void *ev_stream[LOOM_CUDA_BLOCK_STREAMS]; /* stream of each marker */
    void *ev[LOOM_CUDA_BLOCK_STREAMS];        /* marker, owned by the source */
    loom_cuda__defer *defer;       /* callbacks waiting for the markers */
    loom_cuda_block *next, *prev;  /* free list (next only) or waiting list */
    loom_cuda_block *all_next;     /* every block of the pool */
};

struct loom_cuda_pool {
    pthread_mutex_t lock;
    int refs;                                   /* owner + held blocks */
    size_t limit;                               /* bound on bytes_pinned */
    size_t slab_bytes;                          /* small-class slab size */
    const loom_cuda_event_source *events;       /* borrowed */
    const loom_cuda_pinner *pinner;             /* borrowed, may be NULL */
    loom_cuda_block *free_[LOOM_CUDA_MAX_CLASS + 1]; /* per class, LIFO */
    loom_cuda_block *waiting;                   /* doubly linked */
    loom_cuda__slab *slabs;                     /* all mappings */
    loom_cuda__slab *current;                   /* slab small classes carve from */
    loom_cuda_block *all;                       /* every block record */
    loom_cuda_pool_stats st;                    /* counters */
};

/* ------------------------------------------------------------------------ */
/* CPU event source: nothing is ever pending                                  */
/* ------------------------------------------------------------------------ */

static loom_status cpu_record(void *ctx, void *stream, void **event) {
    (void)ctx, (void)stream;
    *event = NULL;
    return LOOM_OK;
}
static int cpu_query(void *ctx, void *event) { return (void)ctx, (void)event, 1; }
static loom_status cpu_wait(void *ctx, void *event) { return (void)ctx, (void)event, LOOM_OK; }
static void cpu_release(void *ctx, void *event) { (void)ctx, (void)event; }
static const loom_cuda_event_source cpu_events = {NULL, cpu_record, cpu_query, cpu_wait,
                                                  cpu_release};

const loom_cuda_event_source *loom_cuda_cpu_events(void) { return &cpu_events; }

/* ------------------------------------------------------------------------ */
/* Classes                                                                    */
/* ------------------------------------------------------------------------ */

static int class_of(size_t n) {
    if (n <= ((size_t)1 << LOOM_CUDA_MIN_CLASS)) return LOOM_CUDA_MIN_CLASS;
    int c = 64 - __builtin_clzll((unsigned long long)(n - 1));
    return c;
}

size_t loom_cuda_class_bytes(size_t n) {
    if (n == 0) return 0;
    int c = class_of(n);
    return c > LOOM_CUDA_MAX_CLASS ? 0 : (size_t)1 << c;
}

/* ------------------------------------------------------------------------ */
/* Create / destroy                                                           */
/* ------------------------------------------------------------------------ */

loom_status loom_cuda_pool_create(const loom_cuda_pool_config *cfg, loom_cuda_pool **out) {
    *out = NULL;
    loom_cuda_pool *p = loom_calloc(1, sizeof *p);
    if (p == NULL) return loom_fail(LOOM_ERR_NOMEM, "pinned pool");
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    p->limit = cfg && cfg->limit_bytes ? cfg->limit_bytes
                                       : (size_t)loom_param_PinnedLimitMB() << 20;
    p->slab_bytes = cfg && cfg->slab_bytes ? cfg->slab_bytes
                                           : (size_t)loom_param_PinnedSlabMB() << 20;
    /* slabs hold whole small blocks: a power of two >= 4 KiB and >= a page */
    size_t s = (size_t)1 << LOOM_CUDA_MIN_CLASS;
    while (s < p->slab_bytes || s < page) s <<= 1;
    p->slab_bytes = s;
    p->events = cfg && cfg->events ? cfg->events : &cpu_events;
    p->pinner = cfg ? cfg->pinner : NULL;
    p->refs = 1;
    p->st.limit_bytes = p->limit;
    pthread_mutex_init(&p->lock, NULL);
    *out = p;
    return LOOM_OK;
}

static void run_defers(loom_cuda__defer *d) {
    while (d != NULL) {
        loom_cuda__defer *next = d->next;
        d->fn(d->arg);
        loom_free(d);
        d = next;
    }
}

static void pool_destroy(loom_cuda_pool *p) {
    /* teardown: wait for what is still in flight, then give everything back */
    for (loom_cuda_block *b = p->all; b != NULL;) {
        for (int i = 0; i < b->n_ev; i++) {
            if (p->events->wait(p->events->ctx, b->ev[i]) != LOOM_OK)
                fprintf(stderr, "nnloom: pinned pool teardown: %s\n", loom_last_error());
            p->events->release(p->events->ctx, b->ev[i]);
        }
        run_defers(b->defer);
        loom_cuda_block *next = b->all_next;
        loom_free(b);
        b = next;
    }
    for (loom_cuda__slab *s = p->slabs; s != NULL;) {
        if (p->pinner) p->pinner->unpin(p->pinner->ctx, s->base, s->size);
        munmap(s->base, s->size);
        if (s->fd >= 0) close(s->fd);
        loom_cuda__slab *next = s->next;
        loom_free(s);
        s = next;
    }
    pthread_mutex_destroy(&p->lock);
    loom_free(p);
}

void loom_cuda_pool_retain(loom_cuda_pool *pool) {
    __atomic_add_fetch(&pool->refs, 1, __ATOMIC_RELAXED);
}

void loom_cuda_pool_release(loom_cuda_pool *pool) {
    if (pool != NULL && __atomic_sub_fetch(&pool->refs, 1, __ATOMIC_ACQ_REL) == 0)
        pool_destroy(pool);
}

/* ------------------------------------------------------------------------ */
/* Slow path: slabs and carving                                               */
/* ------------------------------------------------------------------------ */

/* Map and pin a slab of `size` bytes (within the bound). Lock held. */
static LOOM_NOINLINE loom_status slab_new(loom_cuda_pool *p, size_t size, loom_cuda__slab **out) {
    if (p->st.bytes_pinned + size > p->limit)
        return loom_fail(LOOM_ERR_FULL,
                         "pinned pool bound reached: %zu bytes more would pass the limit of "
                         "%zu (pinned %llu, leased %llu, waiting %llu; NNLOOM_PINNED_LIMIT_MB)",
                         size, p->limit, (unsigned long long)p->st.bytes_pinned,
                         (unsigned long long)p->st.bytes_leased,
                         (unsigned long long)p->st.bytes_waiting);
    loom_status ret = LOOM_OK;
    loom_cuda__slab *s = loom_calloc(1, sizeof *s);
    if (s == NULL) return loom_fail(LOOM_ERR_NOMEM, "slab record");
    s->size = size;
    s->fd = memfd_create("nnloom-pinned", MFD_CLOEXEC);
    void *base = MAP_FAILED;
    if (s->fd >= 0 && ftruncate(s->fd, (off_t)size) == 0)
        base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (base == MAP_FAILED) { /* no memfd: an anonymous shared mapping still works */
        if (s->fd >= 0) close(s->fd);
        s->fd = -1;
        base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    }
    if (base == MAP_FAILED) {
        ret = loom_fail(LOOM_ERR_NOMEM, "mmap of a %zu-byte slab: %s", size, strerror(errno));
        goto fail;
    }
    s->base = base;
    if (p->pinner) LOOM_CHECK_GOTO(p->pinner->pin(p->pinner->ctx, base, size), ret, fail);
    s->next = p->slabs;
    p->slabs = s;
    p->st.bytes_pinned += size;
    p->st.slabs++;
    *out = s;
    return LOOM_OK;
fail:
    if (s->base) munmap(s->base, size);
    if (s->fd >= 0) close(s->fd);
    loom_free(s);
    return ret;
}

static loom_cuda_block *block_new(loom_cuda_pool *p, loom_cuda__slab *s, int cls) {
    loom_cuda_block *b = loom_calloc(1, sizeof *b);
    if (b == NULL) return NULL;
    b->size = (size_t)1 << cls;
    b->ptr = s->base + s->used;
    s->used += b->size;
    b->slab = s;
    b->cls = cls;
    b->pool = p;
    b->all_next = p->all;
    p->all = b;
    p->st.blocks++;
    return b;
}

static void push_free(loom_cuda_pool *p, loom_cuda_block *b) {
    b->state = BLOCK_FREE;
    b->next = p->free_[b->cls];
    b->prev = NULL;
    p->free_[b->cls] = b;
    p->st.bytes_free += b->size;
}

/* Carve a fresh block of class `cls`. Lock held. */
static LOOM_NOINLINE loom_status carve(loom_cuda_pool *p, int cls, loom_cuda_block **out) {
    size_t size = (size_t)1 << cls;
    loom_cuda__slab *s = NULL;
    if (size >= p->slab_bytes) {
        LOOM_CHECK(slab_new(p, size, &s)); /* a slab of its own */
    } else if (p->current && p->current->size - p->current->used >= size) {
        s = p->current;
    } else {
        LOOM_CHECK(slab_new(p, p->slab_bytes, &s));
        /* the old slab's tail becomes free blocks of the classes that fit */
        loom_cuda__slab *old = p->current;
        while (old && old->size - old->used >= ((size_t)1 << LOOM_CUDA_MIN_CLASS)) {
            size_t rest = old->size - old->used;
            int c = 63 - __builtin_clzll((unsigned long long)rest);
            loom_cuda_block *tail = block_new(p, old, c);
            if (tail == NULL) break; /* the bytes stay mapped, just unused */
            push_free(p, tail);
        }
        p->current = s;
    }
    loom_cuda_block *b = block_new(p, s, cls);
    if (b == NULL) return loom_fail(LOOM_ERR_NOMEM, "block record");
    *out = b;
    return LOOM_OK;
}

/* ------------------------------------------------------------------------ */
/* Events on a block                                                          */
/* ------------------------------------------------------------------------ */

/* Drop completed markers; 1 when none is pending. Lock held. */
static int drop_done(loom_cuda_pool *p, loom_cuda_block *b) {
    int k = 0;
    for (int i = 0; i < b->n_ev; i++) {
        if (p->events->query(p->events->ctx, b->ev[i]) != 0) { /* done, or failed */
            p->events->release(p->events->ctx, b->ev[i]);
        } else {
            b->ev[k] = b->ev[i];
            b->ev_stream[k] = b->ev_stream[i];
            k++;
        }
    }
    b->n_ev = k;
    return k == 0;
}

/* Move the block's callbacks to *list (run them after unlocking). */
static void take_defers(loom_cuda_block *b, loom_cuda__defer **list) {
    loom_cuda__defer *d = b->defer;
    while (d != NULL) {
        loom_cuda__defer *next = d->next;
        d->next = *list;
        *list = d;
        d = next;
    }
    b->defer = NULL;
}

static void unlink_waiting(loom_cuda_pool *p, loom_cuda_block *b) {
    if (b->prev) b->prev->next = b->next;
    else p->waiting = b->next;
    if (b->next) b->next->prev = b->prev;
    b->next = b->prev = NULL;
    p->st.bytes_waiting -= b->size;
}

static size_t reclaim_locked(loom_cuda_pool *p, loom_cuda__defer **defers) {
    size_t n = 0;
    for (loom_cuda_block *b = p->waiting; b != NULL;) {
        loom_cuda_block *next = b->next;
        if (drop_done(p, b)) {
            unlink_waiting(p, b);
            take_defers(b, defers);
            push_free(p, b);
            n++;
        }
        b = next;
    }
    return n;
}

size_t loom_cuda_pool_reclaim(loom_cuda_pool *pool) {
    loom_cuda__defer *defers = NULL;
    pthread_mutex_lock(&pool->lock);
    size_t n = reclaim_locked(pool, &defers);
    pthread_mutex_unlock(&pool->lock);
    run_defers(defers);
    return n;
}

/* ------------------------------------------------------------------------ */
/* Lease / release                                                            */
/* ------------------------------------------------------------------------ */

loom_status loom_cuda_pool_lease(loom_cuda_pool *pool, size_t nbytes, loom_cuda_block **out) {
    *out = NULL;
    if (LOOM_UNLIKELY(nbytes == 0 || loom_cuda_class_bytes(nbytes) == 0))
        return loom_fail(LOOM_ERR_INVALID, "pinned lease of %zu bytes", nbytes);
    int cls = class_of(nbytes);
    loom_status ret = LOOM_OK;
    loom_cuda__defer *defers = NULL;
    pthread_mutex_lock(&pool->lock);
    loom_cuda_block *b = pool->free_[cls];
    if (LOOM_LIKELY(b != NULL)) {
        pool->free_[cls] = b->next;
        pool->st.bytes_free -= b->size;
        pool->st.reuses++;
    } else {
        /* slow path: finished waiting blocks first, then fresh memory */
        if (pool->waiting && reclaim_locked(pool, &defers) && (b = pool->free_[cls]) != NULL) {
            pool->free_[cls] = b->next;
            pool->st.bytes_free -= b->size;
            pool->st.reuses++;
        } else {
            LOOM_CHECK_GOTO(carve(pool, cls, &b), ret, exit);
        }
    }
    b->next = b->prev = NULL;
    b->state = BLOCK_HELD;
    b->leased = 1;
    pool->st.bytes_leased += b->size;
    pool->st.leases_live++;
    pool->st.leases_total++;
    __atomic_add_fetch(&pool->refs, 1, __ATOMIC_RELAXED); /* a held block keeps its pool */
    *out = b;
exit:
    pthread_mutex_unlock(&pool->lock);
    run_defers(defers);
    return ret;
}

/* The last holder left: free or waiting. Lock held. */
static void unhold(loom_cuda_pool *p, loom_cuda_block *b, loom_cuda__defer **defers) {
    p->st.bytes_leased -= b->size;
    if (drop_done(p, b)) {
        take_defers(b, defers);
        push_free(p, b);
    } else {
        b->state = BLOCK_WAITING;
        b->prev = NULL;
        b->next = p->waiting;
        if (p->waiting) p->waiting->prev = b;
        p->waiting = b;
        p->st.bytes_waiting += b->size;
    }
}

static void maybe_unhold(loom_cuda_block *b, loom_cuda__defer *defers, int unheld) {
    loom_cuda_pool *p = b->pool;
    run_defers(defers);
    if (unheld) loom_cuda_pool_release(p); /* after unlocking: may destroy the pool */
}

void loom_cuda_block_end_lease(loom_cuda_block *b) {
    loom_cuda_pool *p = b->pool;
    loom_cuda__defer *defers = NULL;
    int unheld = 0;
    pthread_mutex_lock(&p->lock);
    if (b->leased) {
        b->leased = 0;
        p->st.leases_live--;
        if (b->exports == 0) {
            unhold(p, b, &defers);
            unheld = 1;
        }
    } else {
        fprintf(stderr, "nnloom: pinned block %p: lease ended twice\n", (void *)b->ptr);
    }
    pthread_mutex_unlock(&p->lock);
    maybe_unhold(b, defers, unheld);
}

void loom_cuda_block_export(loom_cuda_block *b) {
    pthread_mutex_lock(&b->pool->lock);
    b->exports++;
    b->pool->st.exports_live++;
    pthread_mutex_unlock(&b->pool->lock);
}

void loom_cuda_block_unexport(loom_cuda_block *b) {
    loom_cuda_pool *p = b->pool;
    loom_cuda__defer *defers = NULL;
    int unheld = 0;
    pthread_mutex_lock(&p->lock);
    if (b->exports > 0) {
        b->exports--;
        p->st.exports_live--;
        if (b->exports == 0 && !b->leased) {
            unhold(p, b, &defers);
            unheld = 1;
        }
    } else {
        fprintf(stderr, "nnloom: pinned block %p: export released twice\n", (void *)b->ptr);
    }
    pthread_mutex_unlock(&p->lock);
    maybe_unhold(b, defers, unheld);
}

/* ------------------------------------------------------------------------ */
/* Block accessors and events                                                 */
/* ------------------------------------------------------------------------ */

void *loom_cuda_block_data(const loom_cuda_block *b) { return b->ptr; }
size_t loom_cuda_block_size(const loom_cuda_block *b) { return b->size; }
loom_cuda_pool *loom_cuda_block_pool(const loom_cuda_block *b) { return b->pool; }

int loom_cuda_block_shm(const loom_cuda_block *b, size_t *offset) {
    *offset = (size_t)(b->ptr - b->slab->base);
    return b->slab->fd;
}

loom_status loom_cuda_block_record(loom_cuda_block *b, void *stream) {
    loom_cuda_pool *p = b->pool;
    loom_status ret = LOOM_OK;
    void *ev = NULL;
    pthread_mutex_lock(&p->lock);
    int slot = -1;
    for (int i = 0; i < b->n_ev; i++)
        if (b->ev_stream[i] == stream) slot = i;
    if (slot < 0 && b->n_ev == LOOM_CUDA_BLOCK_STREAMS && drop_done(p, b) == 0 &&
        b->n_ev == LOOM_CUDA_BLOCK_STREAMS) {
        ret = loom_fail(LOOM_ERR_FULL, "pinned block used by more than %d pending streams",
                        LOOM_CUDA_BLOCK_STREAMS);
        goto exit;
    }
    LOOM_CHECK_GOTO(p->events->record(p->events->ctx, stream, &ev), ret, exit);
    if (ev == NULL) goto exit; /* nothing asynchronous */
    if (slot >= 0) { /* stream order: the new marker covers the old one */
        p->events->release(p->events->ctx, b->ev[slot]);
        b->ev[slot] = ev;
    } else {
        b->ev[b->n_ev] = ev;
        b->ev_stream[b->n_ev] = stream;
        b->n_ev++;
    }
exit:
    pthread_mutex_unlock(&p->lock);
    return ret;
}

int loom_cuda_block_ready(loom_cuda_block *b) {
    loom_cuda_pool *p = b->pool;
    loom_cuda__defer *defers = NULL;
    pthread_mutex_lock(&p->lock);
    int done = drop_done(p, b);
    if (done) take_defers(b, &defers);
    pthread_mutex_unlock(&p->lock);
    run_defers(defers);
    return done;
}

loom_status loom_cuda_block_wait(loom_cuda_block *b) {
    loom_cuda_pool *p = b->pool;
    loom_status ret = LOOM_OK;
    void *ev[LOOM_CUDA_BLOCK_STREAMS];
    loom_cuda__defer *defers = NULL;
    pthread_mutex_lock(&p->lock);
    int n = b->n_ev; /* take the markers out: never wait with the pool locked */
    memcpy(ev, b->ev, sizeof ev);
    b->n_ev = 0;
    pthread_mutex_unlock(&p->lock);
    for (int i = 0; i < n; i++) {
        loom_status s = p->events->wait(p->events->ctx, ev[i]);
        if (s != LOOM_OK && ret == LOOM_OK) ret = s; /* keep the first error, release all */
        p->events->release(p->events->ctx, ev[i]);
    }
    pthread_mutex_lock(&p->lock);
    if (b->n_ev == 0) take_defers(b, &defers);
    pthread_mutex_unlock(&p->lock);
    run_defers(defers);
    return ret;
}

loom_status loom_cuda_block_defer(loom_cuda_block *b, void (*fn)(void *), void *arg) {
    loom_cuda_pool *p = b->pool;
    pthread_mutex_lock(&p->lock);
    int now = drop_done(p, b);
    if (!now) {
        loom_cuda__defer *d = loom_malloc(sizeof *d);
        if (d == NULL) {
            pthread_mutex_unlock(&p->lock);
            return loom_fail(LOOM_ERR_NOMEM, "deferred release");
        }
        d->fn = fn;
        d->arg = arg;
        d->next = b->defer;
        b->defer = d;
    }
    pthread_mutex_unlock(&p->lock);
    if (now) fn(arg);
    return LOOM_OK;
}

void loom_cuda_pool_stats_get(loom_cuda_pool *pool, loom_cuda_pool_stats *out) {
    pthread_mutex_lock(&pool->lock);
    *out = pool->st;
    pthread_mutex_unlock(&pool->lock);
}
