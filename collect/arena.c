/* collect/arena.c - the shared-memory arena's bookkeeping (see collect.h).
 *
 * Why it exists: a worker's payload reaches its parent without a pipe copy;
 * the parent reads the binaries in place (segment pool) or copies them out
 * (ring), and a segment is handed back to the writer only when nothing in the
 * parent still looks at it. This file is pure C: the region, the per-segment
 * state machine in shared memory, waits with timeouts and peer-death checks,
 * and the reader's private pin counts. The Python half (arena_py.c) turns
 * pins into buffer-protocol exports.
 */
#define _GNU_SOURCE
#include "collect.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define LOOM_ARENA_MAGIC 0x6e6e6c6f6f6d4152ull /* "nnloomAR" */
#define LOOM_ARENA_ALIGN 4096u

enum { SLOT_FREE = 0, SLOT_WRITING = 1, SLOT_COMMITTED = 2, SLOT_READING = 3 };

/* In shared memory: the header, then `nslots` slot records, then the data. */
typedef struct {
    uint64_t magic;       /* LOOM_ARENA_MAGIC once initialised */
    uint32_t nslots;      /* segments */
    uint32_t ring;        /* 1: segments used strictly in order */
    uint64_t slot_size;   /* bytes per segment */
    uint64_t data_offset; /* where segment 0 starts, from the region start */
    int32_t reader_pid;   /* creator */
    int32_t writer_pid;   /* last attached writer, 0 before */
    uint64_t commits;     /* units committed so far */
} loom_arena_header;

typedef struct {
    uint32_t state; /* SLOT_*, atomic */
    uint32_t pad;
    uint64_t used;  /* bytes written in the unit */
    uint64_t seq;   /* commit number (1-based) of the unit it holds */
} loom_arena_slot;

struct loom_collect_arena {
    char name[64];           /* shm name */
    int creator;             /* 1: reader side, unlinks */
    int linked;              /* name not yet unlinked */
    uint8_t *base;           /* mapping */
    size_t map_len;          /* bytes mapped */
    loom_arena_header *hdr;  /* = base */
    loom_arena_slot *slots;  /* [nslots] */
    /* writer */
    int64_t open_slot;       /* unit being written, -1 if none */
    uint32_t ring_next;      /* next segment in ring order */
    /* reader */
    uint64_t next_seq;       /* commit number next_unit waits for */
    uint32_t *pins;          /* [nslots] live exports per segment */
    uint8_t *ended;          /* [nslots] unit ended by the reader */
};

/* ------------------------------------------------------------------------ */
/* Helpers                                                                    */
/* ------------------------------------------------------------------------ */

static uint32_t slot_state(const loom_arena_slot *s) {
    return __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
}
static void slot_set(loom_arena_slot *s, uint32_t v) {
    __atomic_store_n(&s->state, v, __ATOMIC_RELEASE);
}

static bool pid_alive(int32_t pid) {
    if (pid <= 0) return true; /* not known yet */
    return kill(pid, 0) == 0 || errno != ESRCH;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Sleep a little longer each round, up to 1 ms. */
static void backoff(unsigned *round) {
    long ns = 2000L << (*round < 9 ? *round : 9);
    if (ns > 1000000L) ns = 1000000L;
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
    (*round)++;
}

static loom_status map_region(loom_collect_arena *a, int fd, size_t len) {
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return loom_fail(LOOM_ERR_NOMEM, "arena: mmap %zu bytes: %s", len,
                                          strerror(errno));
    a->base = p;
    a->map_len = len;
    a->hdr = (loom_arena_header *)p;
    a->slots = (loom_arena_slot *)(a->base + sizeof(loom_arena_header));
    return LOOM_OK;
}

static loom_collect_arena *arena_new(const char *name) {
    loom_collect_arena *a = loom_calloc(1, sizeof *a);
    if (a == NULL) return NULL;
    snprintf(a->name, sizeof a->name, "%s", name);
    a->open_slot = -1;
    a->next_seq = 1;
    return a;
}

/* ------------------------------------------------------------------------ */
/* Create, attach, close                                                      */
/* ------------------------------------------------------------------------ */

loom_status loom_collect_arena_create(const char *name, uint32_t nslots, uint64_t slot_size,
                                      bool ring, loom_collect_arena **out) {
    loom_status ret = LOOM_OK;
    int fd = -1;
    char auto_name[64];
    loom_collect_arena *a = NULL;
    *out = NULL;
    if (nslots == 0 || nslots > 4096 || slot_size == 0 || slot_size > (1ull << 40))
        return loom_fail(LOOM_ERR_INVALID, "arena: %u segments of %llu bytes", nslots,
                         (unsigned long long)slot_size);
    if (name == NULL) {
        static uint32_t counter;
        snprintf(auto_name, sizeof auto_name, "/nnloom-%d-%u", (int)getpid(),
                 __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED));
        name = auto_name;
    }
    if (strlen(name) >= sizeof a->name || name[0] != '/')
        return loom_fail(LOOM_ERR_INVALID, "arena: bad name '%s'", name);
    slot_size = (slot_size + LOOM_ARENA_ALIGN - 1) / LOOM_ARENA_ALIGN * LOOM_ARENA_ALIGN;
    uint64_t meta = sizeof(loom_arena_header) + (uint64_t)nslots * sizeof(loom_arena_slot);
    uint64_t data_offset = (meta + LOOM_ARENA_ALIGN - 1) / LOOM_ARENA_ALIGN * LOOM_ARENA_ALIGN;
    size_t len = (size_t)(data_offset + (uint64_t)nslots * slot_size);

    if ((a = arena_new(name)) == NULL) return loom_fail(LOOM_ERR_NOMEM, "arena: handle");
    a->pins = loom_calloc(nslots, sizeof *a->pins);
    a->ended = loom_calloc(nslots, sizeof *a->ended);
    if (a->pins == NULL || a->ended == NULL) {
        ret = loom_fail(LOOM_ERR_NOMEM, "arena: bookkeeping");
        goto fail;
    }
    fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        ret = loom_fail(LOOM_ERR_STATE, "arena: shm_open %s: %s", name, strerror(errno));
        goto fail;
    }
    a->creator = 1;
    a->linked = 1;
    if (ftruncate(fd, (off_t)len) < 0) {
        ret = loom_fail(LOOM_ERR_NOMEM, "arena: size %s to %zu bytes: %s", name, len,
                        strerror(errno));
        goto fail;
    }
    LOOM_CHECK_GOTO(map_region(a, fd, len), ret, fail);
    a->hdr->nslots = nslots;
    a->hdr->ring = ring;
    a->hdr->slot_size = slot_size;
    a->hdr->data_offset = data_offset;
    a->hdr->reader_pid = (int32_t)getpid();
    __atomic_store_n(&a->hdr->magic, LOOM_ARENA_MAGIC, __ATOMIC_RELEASE);
    *out = a;
exit:
    if (fd >= 0) close(fd);
    return ret;
fail:
    loom_collect_arena_close(a);
    goto exit;
}

loom_status loom_collect_arena_attach(const char *name, loom_collect_arena **out) {
    loom_status ret = LOOM_OK;
    loom_collect_arena *a = NULL;
    struct stat sb;
    *out = NULL;
    if (name == NULL || strlen(name) >= sizeof a->name)
        return loom_fail(LOOM_ERR_INVALID, "arena: bad name");
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) return loom_fail(LOOM_ERR_STATE, "arena: attach %s: %s", name, strerror(errno));
    if ((a = arena_new(name)) == NULL) {
        ret = loom_fail(LOOM_ERR_NOMEM, "arena: handle");
        goto fail;
    }
    if (fstat(fd, &sb) < 0 || (size_t)sb.st_size < sizeof(loom_arena_header)) {
        ret = loom_fail(LOOM_ERR_CORRUPT, "arena: %s is not an arena", name);
        goto fail;
    }
    LOOM_CHECK_GOTO(map_region(a, fd, (size_t)sb.st_size), ret, fail);
    loom_arena_header *h = a->hdr;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != LOOM_ARENA_MAGIC ||
        h->data_offset + (uint64_t)h->nslots * h->slot_size > (uint64_t)sb.st_size) {
        ret = loom_fail(LOOM_ERR_CORRUPT, "arena: %s is not an arena", name);
        goto fail;
    }
    __atomic_store_n(&h->writer_pid, (int32_t)getpid(), __ATOMIC_RELEASE);
    *out = a;
exit:
    close(fd);
    return ret;
fail:
    loom_collect_arena_close(a);
    goto exit;
}

void loom_collect_arena_unlink(loom_collect_arena *a) {
    if (a->linked) {
        shm_unlink(a->name);
        a->linked = 0;
    }
}

void loom_collect_arena_close(loom_collect_arena *a) {
    if (a == NULL) return;
    if (a->creator) loom_collect_arena_unlink(a);
    if (a->base) munmap(a->base, a->map_len);
    loom_free(a->pins);
    loom_free(a->ended);
    loom_free(a);
}

const char *loom_collect_arena_name(const loom_collect_arena *a) { return a->name; }
uint32_t loom_collect_arena_nslots(const loom_collect_arena *a) { return a->hdr->nslots; }
uint64_t loom_collect_arena_slot_size(const loom_collect_arena *a) { return a->hdr->slot_size; }
bool loom_collect_arena_is_ring(const loom_collect_arena *a) { return a->hdr->ring != 0; }

uint32_t loom_collect_arena_free_slots(const loom_collect_arena *a) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < a->hdr->nslots; i++) n += slot_state(&a->slots[i]) == SLOT_FREE;
    return n;
}

/* ------------------------------------------------------------------------ */
/* Writer                                                                     */
/* ------------------------------------------------------------------------ */

/* Claim a FREE segment for a new unit, waiting up to timeout_s. */
static loom_status open_unit(loom_collect_arena *a, double timeout_s) {
    loom_arena_header *h = a->hdr;
    double deadline = now_s() + timeout_s;
    unsigned round = 0;
    for (;;) {
        uint32_t first = h->ring ? a->ring_next : 0;
        uint32_t count = h->ring ? 1 : h->nslots;
        for (uint32_t k = 0; k < count; k++) {
            uint32_t i = (first + k) % h->nslots;
            uint32_t expect = SLOT_FREE;
            if (__atomic_compare_exchange_n(&a->slots[i].state, &expect, SLOT_WRITING, false,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                a->slots[i].used = 0;
                a->open_slot = i;
                a->ring_next = (i + 1) % h->nslots;
                return LOOM_OK;
            }
        }
        int32_t reader = __atomic_load_n(&h->reader_pid, __ATOMIC_ACQUIRE);
        if (!pid_alive(reader)) {
            shm_unlink(a->name); /* the orphaned region: nobody else will */
            return loom_fail(LOOM_ERR_STATE, "arena %s: the reader (pid %d) is gone", a->name,
                             (int)reader);
        }
        if (now_s() >= deadline)
            return loom_fail(LOOM_ERR_TIMEOUT,
                             "arena %s full: no free segment after %.3g s (%u segments held by "
                             "the reader)",
                             a->name, timeout_s, h->nslots);
        backoff(&round);
    }
}

loom_status loom_collect_arena_write(loom_collect_arena *a, const void *p, uint64_t n,
                                     double timeout_s, uint64_t *offset) {
    if (a->open_slot < 0) LOOM_CHECK(open_unit(a, timeout_s));
    loom_arena_slot *s = &a->slots[a->open_slot];
    uint64_t size = a->hdr->slot_size;
    if (n > size - s->used)
        return loom_fail(LOOM_ERR_FULL,
                         "arena %s: unit of %llu bytes does not fit a %llu-byte segment",
                         a->name, (unsigned long long)(s->used + n), (unsigned long long)size);
    uint64_t off = a->hdr->data_offset + (uint64_t)a->open_slot * size + s->used;
    memcpy(a->base + off, p, n);
    s->used += n;
    *offset = off;
    return LOOM_OK;
}

loom_status loom_collect_arena_commit(loom_collect_arena *a, double timeout_s, uint64_t *span) {
    if (a->open_slot < 0) LOOM_CHECK(open_unit(a, timeout_s));
    loom_arena_slot *s = &a->slots[a->open_slot];
    s->seq = __atomic_add_fetch(&a->hdr->commits, 1, __ATOMIC_ACQ_REL);
    slot_set(s, SLOT_COMMITTED);
    *span = (uint64_t)a->open_slot;
    a->open_slot = -1;
    return LOOM_OK;
}

/* ------------------------------------------------------------------------ */
/* Reader                                                                     */
/* ------------------------------------------------------------------------ */

loom_status loom_collect_arena_next_unit(loom_collect_arena *a, double timeout_s, uint64_t *span,
                                         uint64_t *nbytes) {
    loom_arena_header *h = a->hdr;
    double deadline = now_s() + timeout_s;
    unsigned round = 0;
    for (;;) {
        for (uint32_t i = 0; i < h->nslots; i++) {
            loom_arena_slot *s = &a->slots[i];
            if (slot_state(s) == SLOT_COMMITTED && s->seq == a->next_seq) {
                slot_set(s, SLOT_READING);
                a->ended[i] = 0;
                a->next_seq++;
                *span = i;
                *nbytes = s->used;
                return LOOM_OK;
            }
        }
        int32_t writer = __atomic_load_n(&h->writer_pid, __ATOMIC_ACQUIRE);
        if (!pid_alive(writer))
            return loom_fail(LOOM_ERR_STATE, "arena %s: the writer (pid %d) is gone", a->name,
                             (int)writer);
        if (now_s() >= deadline)
            return loom_fail(LOOM_ERR_TIMEOUT, "arena %s: no unit committed within %.3g s",
                             a->name, timeout_s);
        backoff(&round);
    }
}

static loom_status check_span(loom_collect_arena *a, uint64_t span) {
    if (a->pins == NULL) return loom_fail(LOOM_ERR_STATE, "arena %s: not the reader", a->name);
    if (span >= a->hdr->nslots || slot_state(&a->slots[span]) != SLOT_READING)
        return loom_fail(LOOM_ERR_INVALID, "arena %s: unit %llu is not being read", a->name,
                         (unsigned long long)span);
    return LOOM_OK;
}

loom_status loom_collect_arena_locate(loom_collect_arena *a, uint64_t offset, uint64_t n,
                                      void **ptr, uint64_t *span) {
    loom_arena_header *h = a->hdr;
    if (offset < h->data_offset)
        return loom_fail(LOOM_ERR_INVALID, "arena %s: offset %llu is not in a segment", a->name,
                         (unsigned long long)offset);
    uint64_t slot = (offset - h->data_offset) / h->slot_size;
    LOOM_CHECK(check_span(a, slot));
    uint64_t start = h->data_offset + slot * h->slot_size;
    if (a->ended[slot] || n > a->slots[slot].used || offset - start > a->slots[slot].used - n)
        return loom_fail(LOOM_ERR_INVALID,
                         "arena %s: [%llu, +%llu) is outside unit %llu (%llu bytes%s)", a->name,
                         (unsigned long long)offset, (unsigned long long)n,
                         (unsigned long long)slot, (unsigned long long)a->slots[slot].used,
                         a->ended[slot] ? ", ended" : "");
    *ptr = a->base + offset;
    *span = slot;
    return LOOM_OK;
}

/* Free the segment once ended and unpinned. */
static void maybe_free(loom_collect_arena *a, uint64_t span) {
    if (a->ended[span] && a->pins[span] == 0 && slot_state(&a->slots[span]) == SLOT_READING) {
        a->ended[span] = 0;
        slot_set(&a->slots[span], SLOT_FREE);
    }
}

loom_status loom_collect_arena_pin(loom_collect_arena *a, uint64_t span) {
    LOOM_CHECK(check_span(a, span));
    a->pins[span]++;
    return LOOM_OK;
}

void loom_collect_arena_unpin(loom_collect_arena *a, uint64_t span) {
    if (a->pins == NULL || span >= a->hdr->nslots || a->pins[span] == 0) return;
    a->pins[span]--;
    maybe_free(a, span);
}

loom_status loom_collect_arena_end_unit(loom_collect_arena *a, uint64_t span) {
    LOOM_CHECK(check_span(a, span));
    if (a->ended[span])
        return loom_fail(LOOM_ERR_STATE, "arena %s: unit %llu already ended", a->name,
                         (unsigned long long)span);
    a->ended[span] = 1;
    maybe_free(a, span);
    return LOOM_OK;
}

void loom_collect_arena_end_all(loom_collect_arena *a) {
    if (a->pins == NULL) return;
    for (uint32_t i = 0; i < a->hdr->nslots; i++)
        if (slot_state(&a->slots[i]) == SLOT_READING && !a->ended[i]) {
            a->ended[i] = 1;
            maybe_free(a, i);
        }
}
