/* base/base.c - status table, thread-local error detail, allocator, knobs. */
#include "base.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* ------------------------------------------------------------------------ */
/* Status table                                                               */
/* ------------------------------------------------------------------------ */

static const char *const loom__names[] = {
#define LOOM__NAME(name, cls, msg) "LOOM_" #name,
    LOOM_STATUS_MAP(LOOM__NAME)
#undef LOOM__NAME
};
static const char *const loom__msgs[] = {
#define LOOM__MSG(name, cls, msg) msg,
    LOOM_STATUS_MAP(LOOM__MSG)
#undef LOOM__MSG
};
static const char *const loom__classes[] = {
#define LOOM__CLS(name, cls, msg) cls,
    LOOM_STATUS_MAP(LOOM__CLS)
#undef LOOM__CLS
};

const char *loom_status_name(loom_status s) {
    if ((unsigned)s >= LOOM_STATUS_COUNT) return "LOOM_UNKNOWN";
    return loom__names[s];
}

const char *loom_strerror(loom_status s) {
    if ((unsigned)s >= LOOM_STATUS_COUNT) return "unknown status";
    return loom__msgs[s];
}

const char *loom_status_pyclass(loom_status s) {
    if ((unsigned)s >= LOOM_STATUS_COUNT) return "RuntimeError";
    return loom__classes[s];
}

/* ------------------------------------------------------------------------ */
/* Last error detail                                                          */
/* ------------------------------------------------------------------------ */

static _Thread_local char loom__last[512];

loom_status loom_fail(loom_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(loom__last, sizeof loom__last, fmt, ap);
    va_end(ap);
    return s;
}

const char *loom_last_error(void) { return loom__last; }

void loom_clear_error(void) { loom__last[0] = '\0'; }

/* ------------------------------------------------------------------------ */
/* Allocation                                                                 */
/* ------------------------------------------------------------------------ */

static loom_allocator loom__alloc = {malloc, calloc, realloc, free};

void *loom_malloc(size_t n) { return loom__alloc.malloc_fn(n ? n : 1); }
void *loom_calloc(size_t count, size_t n) {
    return loom__alloc.calloc_fn(count ? count : 1, n ? n : 1);
}
void *loom_realloc(void *p, size_t n) { return loom__alloc.realloc_fn(p, n ? n : 1); }
void loom_free(void *p) { loom__alloc.free_fn(p); }

void loom_set_allocator(const loom_allocator *a) {
    static const loom_allocator libc = {malloc, calloc, realloc, free};
    loom__alloc = a ? *a : libc;
}

/* ------------------------------------------------------------------------ */
/* Knobs                                                                      */
/* ------------------------------------------------------------------------ */

int64_t loom_env_int64(const char *name, int64_t deflt) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') return deflt;
    char *end = NULL;
    long long x = strtoll(v, &end, 0);
    if (end == v) return deflt;
    return (int64_t)x;
}
