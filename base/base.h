/* base/base.h - the ground floor every other folder stands on.
 *
 * One status enum (from one X-macro), its names and messages; a thread-local
 * "last error" message so a status can carry a sentence up to the binding layer;
 * swappable host allocation (tests replace it to inject failures); branch hints;
 * environment knobs declared once and cached.
 *
 * Pure C: nothing here includes Python, CUDA or any other folder.
 */
#ifndef LOOM_BASE_H
#define LOOM_BASE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Status codes                                                              */
/* ------------------------------------------------------------------------ */

/* X(name, python exception class name, message). The Python layer maps each
 * code to the class named in the second column, in one table. */
#define LOOM_STATUS_MAP(X)                                                     \
    X(OK, "", "success")                                                       \
    X(ERR_NOMEM, "MemoryError", "out of host memory")                          \
    X(ERR_INVALID, "ValueError", "invalid argument")                           \
    X(ERR_STATE, "RuntimeError", "operation not valid in the current state")   \
    X(ERR_OUT_OF_ORDER, "OutOfOrderError", "request out of forward order")     \
    X(ERR_MISSED, "OutOfOrderError", "request never served by the forward")    \
    X(ERR_SHAPE, "ValueError", "shape mismatch")                               \
    X(ERR_FULL, "PoolExhaustedError", "resource bound reached")                \
    X(ERR_TIMEOUT, "TimeoutError", "timed out")                                \
    X(ERR_UNSAFE, "UnsafePayloadError", "payload refers to a forbidden object")\
    X(ERR_CORRUPT, "PayloadError", "payload is malformed")                     \
    X(ERR_CUDA, "DeviceError", "CUDA call failed")                             \
    X(ERR_NCCL, "DeviceError", "NCCL call failed")                             \
    X(ERR_UNAVAILABLE, "DeviceError", "feature not available in this build")   \
    X(ERR_PYTHON, "", "a Python exception is set")

typedef enum {
#define LOOM__ENUM(name, cls, msg) LOOM_##name,
    LOOM_STATUS_MAP(LOOM__ENUM)
#undef LOOM__ENUM
    LOOM_STATUS_COUNT
} loom_status;

/* "LOOM_ERR_OUT_OF_ORDER"; static storage, never NULL. */
const char *loom_status_name(loom_status s);
/* Generic one-line message for the code; static storage, never NULL. */
const char *loom_strerror(loom_status s);
/* Python exception class name for the code ("" for OK / ERR_PYTHON). */
const char *loom_status_pyclass(loom_status s);

/* Thread-local detail for the last error: set by the function that fails,
 * read by the binding layer. Returns `s` so callers can `return
 * loom_fail(LOOM_ERR_X, "...", ...)`. */
loom_status loom_fail(loom_status s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Borrowed, valid until the next loom_fail on this thread. "" when none. */
const char *loom_last_error(void);
void loom_clear_error(void);

/* ------------------------------------------------------------------------ */
/* Hints and checks                                                          */
/* ------------------------------------------------------------------------ */

#define LOOM_LIKELY(x) __builtin_expect(!!(x), 1)
#define LOOM_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define LOOM_NOINLINE __attribute__((noinline))
#define LOOM_HIDDEN __attribute__((visibility("hidden")))

/* Propagate a non-OK status; never exits. */
#define LOOM_CHECK(cmd)                                                        \
    do {                                                                       \
        loom_status loom__s = (cmd);                                           \
        if (LOOM_UNLIKELY(loom__s != LOOM_OK)) return loom__s;                 \
    } while (0)

#define LOOM_CHECK_GOTO(cmd, ret, label)                                       \
    do {                                                                       \
        (ret) = (cmd);                                                         \
        if (LOOM_UNLIKELY((ret) != LOOM_OK)) goto label;                       \
    } while (0)

/* ------------------------------------------------------------------------ */
/* Host allocation (swappable for tests)                                      */
/* ------------------------------------------------------------------------ */

typedef struct {
    void *(*malloc_fn)(size_t n);
    void *(*calloc_fn)(size_t count, size_t n);
    void *(*realloc_fn)(void *p, size_t n);
    void (*free_fn)(void *p);
} loom_allocator;

void *loom_malloc(size_t n);
void *loom_calloc(size_t count, size_t n);
void *loom_realloc(void *p, size_t n);
void loom_free(void *p);
/* Install `a` (NULL restores libc). Not thread-safe: call before use. */
void loom_set_allocator(const loom_allocator *a);

/* ------------------------------------------------------------------------ */
/* Environment knobs                                                          */
/* ------------------------------------------------------------------------ */

/* LOOM_PARAM(Debug, "NNLOOM_DEBUG", 0) defines `int64_t loom_param_Debug(void)`
 * that reads the variable once and caches it. */
#define LOOM_PARAM(name, env, deflt)                                           \
    int64_t loom_param_##name(void) {                                          \
        static int64_t loom__value;                                            \
        static int loom__ready;                                                \
        if (LOOM_UNLIKELY(!__atomic_load_n(&loom__ready, __ATOMIC_ACQUIRE))) { \
            loom__value = loom_env_int64(env, deflt);                          \
            __atomic_store_n(&loom__ready, 1, __ATOMIC_RELEASE);               \
        }                                                                      \
        return loom__value;                                                    \
    }

int64_t loom_env_int64(const char *name, int64_t deflt);

#ifdef __cplusplus
}
#endif
#endif /* LOOM_BASE_H */
