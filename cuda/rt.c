/* cuda/rt.c - the CUDA runtime and driver, reached at run time.
 *
 * Resolves the entry points nnloom uses from the libcudart torch already
 * loaded (see device.h for why nothing links CUDA), and builds on them: the
 * cudaEvent-backed event source (events recycled, never created on the hot
 * path once warm), the cudaHostRegister pinner, one copy stream per device,
 * and the launcher of the embedded gather kernel.
 */
#define _GNU_SOURCE
#include "cuda_internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef LOOM_CUDA_HAVE_HEADERS
/* The constants in cuda_internal.h are ABI values; check them when we can. */
#include <cuda_runtime_api.h>
_Static_assert(LOOM_CUDA__NOT_READY == cudaErrorNotReady, "cudaErrorNotReady");
_Static_assert(LOOM_CUDA__D2H == cudaMemcpyDeviceToHost, "cudaMemcpyDeviceToHost");
_Static_assert(LOOM_CUDA__D2D == cudaMemcpyDeviceToDevice, "cudaMemcpyDeviceToDevice");
_Static_assert(LOOM_CUDA__EVENT_NO_TIMING == cudaEventDisableTiming, "cudaEventDisableTiming");
_Static_assert(LOOM_CUDA__STREAM_NON_BLOCKING == cudaStreamNonBlocking, "cudaStreamNonBlocking");
_Static_assert(LOOM_CUDA__HOST_REGISTER_PORTABLE == cudaHostRegisterPortable,
               "cudaHostRegisterPortable");
#endif

#define LOOM_CUDA__MAX_DEVICES 64

/* ------------------------------------------------------------------------ */
/* Resolution                                                                 */
/* ------------------------------------------------------------------------ */

static pthread_mutex_t rt_lock = PTHREAD_MUTEX_INITIALIZER;
static loom_cuda__rt_table rt_real;         /* filled once */
static const loom_cuda__rt_table *rt_active; /* NULL until resolved */
static int rt_resolved;                      /* 1 after the first attempt */
static int rt_devices;
static char rt_reason[256];
static void *copy_streams[LOOM_CUDA__MAX_DEVICES];
static void *gather_fn[LOOM_CUDA__MAX_DEVICES]; /* CUfunction per device */

static void *open_first(const char *const *names, const char *env) {
    const char *path = env ? getenv(env) : NULL;
    if (path && *path) {
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h) return h;
    }
    for (const char *const *n = names; *n; n++) { /* the copy already mapped */
        void *h = dlopen(*n, RTLD_NOW | RTLD_NOLOAD);
        if (h) return h;
    }
    for (const char *const *n = names; *n; n++) {
        void *h = dlopen(*n, RTLD_NOW | RTLD_LOCAL);
        if (h) return h;
    }
    return NULL;
}

/* Fill `t` from the two libraries; 0 ok, -1 with rt_reason set. */
static int resolve(loom_cuda__rt_table *t) {
    static const char *const cudart_names[] = {"libcudart.so.13", "libcudart.so.12", NULL};
    static const char *const driver_names[] = {"libcuda.so.1", NULL};
    void *rt = open_first(cudart_names, "NNLOOM_CUDART");
    if (rt == NULL) {
        snprintf(rt_reason, sizeof rt_reason, "no CUDA runtime library loaded or found");
        return -1;
    }
#define LOOM__SYM(lib, field, name)                                             \
    do {                                                                       \
        *(void **)(&t->field) = dlsym(lib, name);                              \
        if (t->field == NULL) {                                                \
            snprintf(rt_reason, sizeof rt_reason, "CUDA entry point %s missing", name); \
            return -1;                                                         \
        }                                                                      \
    } while (0)
    LOOM__SYM(rt, GetDeviceCount, "cudaGetDeviceCount");
    LOOM__SYM(rt, GetDevice, "cudaGetDevice");
    LOOM__SYM(rt, SetDevice, "cudaSetDevice");
    LOOM__SYM(rt, GetLastError, "cudaGetLastError");
    LOOM__SYM(rt, GetErrorString, "cudaGetErrorString");
    LOOM__SYM(rt, HostRegister, "cudaHostRegister");
    LOOM__SYM(rt, HostUnregister, "cudaHostUnregister");
    LOOM__SYM(rt, StreamCreateWithFlags, "cudaStreamCreateWithFlags");
    LOOM__SYM(rt, StreamWaitEvent, "cudaStreamWaitEvent");
    LOOM__SYM(rt, EventCreateWithFlags, "cudaEventCreateWithFlags");
    LOOM__SYM(rt, EventRecord, "cudaEventRecord");
    LOOM__SYM(rt, EventQuery, "cudaEventQuery");
    LOOM__SYM(rt, EventSynchronize, "cudaEventSynchronize");
    LOOM__SYM(rt, EventDestroy, "cudaEventDestroy");
    LOOM__SYM(rt, MemcpyAsync, "cudaMemcpyAsync");
    LOOM__SYM(rt, Memcpy2DAsync, "cudaMemcpy2DAsync");
    LOOM__SYM(rt, MallocAsync, "cudaMallocAsync");
    LOOM__SYM(rt, FreeAsync, "cudaFreeAsync");
    void *drv = open_first(driver_names, NULL);
    if (drv != NULL) { /* optional: only the gather kernel needs it */
        *(void **)(&t->cuModuleLoadData) = dlsym(drv, "cuModuleLoadData");
        *(void **)(&t->cuModuleGetFunction) = dlsym(drv, "cuModuleGetFunction");
        *(void **)(&t->cuLaunchKernel) = dlsym(drv, "cuLaunchKernel");
    }
#undef LOOM__SYM
    return 0;
}

static void resolve_once_locked(void) {
    if (rt_resolved) return;
    rt_resolved = 1;
    if (resolve(&rt_real) < 0) return;
    int n = 0;
    loom_cuda__err e = rt_real.GetDeviceCount(&n);
    if (e != LOOM_CUDA__SUCCESS || n <= 0) {
        rt_real.GetLastError(); /* clear the sticky error "no device" */
        snprintf(rt_reason, sizeof rt_reason, "CUDA runtime reports no device (%s)",
                 e != LOOM_CUDA__SUCCESS ? rt_real.GetErrorString(e) : "0 devices");
        return;
    }
    rt_devices = n > LOOM_CUDA__MAX_DEVICES ? LOOM_CUDA__MAX_DEVICES : n;
    rt_active = &rt_real;
}

const loom_cuda__rt_table *loom_cuda__rt(void) {
    const loom_cuda__rt_table *t = __atomic_load_n(&rt_active, __ATOMIC_ACQUIRE);
    if (LOOM_LIKELY(t != NULL)) return t;
    pthread_mutex_lock(&rt_lock);
    resolve_once_locked();
    t = rt_active;
    pthread_mutex_unlock(&rt_lock);
    return t;
}

void loom_cuda__rt_override(const loom_cuda__rt_table *t, int device_count) {
    pthread_mutex_lock(&rt_lock);
    memset(copy_streams, 0, sizeof copy_streams);
    memset(gather_fn, 0, sizeof gather_fn);
    if (t != NULL) {
        rt_active = t;
        rt_devices = device_count;
        rt_resolved = 1;
    } else {
        rt_active = NULL;
        rt_devices = 0;
        rt_resolved = 0;
    }
    pthread_mutex_unlock(&rt_lock);
}

loom_status loom_cuda_runtime(void) {
    if (loom_cuda__rt() != NULL) return LOOM_OK;
    return loom_fail(LOOM_ERR_UNAVAILABLE, "%s", rt_reason[0] ? rt_reason : "CUDA unavailable");
}

int loom_cuda_device_count(void) { return loom_cuda__rt() ? rt_devices : 0; }

loom_status loom_cuda__fail(loom_cuda__err e, const char *what, const char *file, int line) {
    const loom_cuda__rt_table *t = __atomic_load_n(&rt_active, __ATOMIC_ACQUIRE);
    const char *msg = "unknown error";
    if (t != NULL) {
        t->GetLastError(); /* clear the sticky error so later calls start clean */
        if (t->GetErrorString) msg = t->GetErrorString(e);
    }
    fprintf(stderr, "nnloom: %s:%d: %s failed: %s (%d)\n", file, line, what, msg, e);
    return loom_fail(LOOM_ERR_CUDA, "%s failed: %s (%d) at %s:%d", what, msg, e, file, line);
}

/* ------------------------------------------------------------------------ */
/* Copy streams                                                               */
/* ------------------------------------------------------------------------ */

loom_status loom_cuda__copy_stream(int device, void **stream) {
    const loom_cuda__rt_table *t = loom_cuda__rt();
    if (t == NULL) return loom_cuda_runtime();
    if (device < 0 || device >= rt_devices)
        return loom_fail(LOOM_ERR_INVALID, "CUDA device %d out of range", device);
    void *s = __atomic_load_n(&copy_streams[device], __ATOMIC_ACQUIRE);
    if (LOOM_LIKELY(s != NULL)) {
        *stream = s;
        return LOOM_OK;
    }
    loom_status ret = LOOM_OK;
    int prev = -1;
    pthread_mutex_lock(&rt_lock);
    if (copy_streams[device] == NULL) {
        LOOM_CUDA_CHECK_GOTO(t, GetDevice(&prev), ret, exit);
        LOOM_CUDA_CHECK_GOTO(t, SetDevice(device), ret, exit);
        LOOM_CUDA_CHECK_GOTO(t, StreamCreateWithFlags(&s, LOOM_CUDA__STREAM_NON_BLOCKING), ret,
                             restore);
        __atomic_store_n(&copy_streams[device], s, __ATOMIC_RELEASE);
    restore:
        if (t->SetDevice(prev) != LOOM_CUDA__SUCCESS && ret == LOOM_OK)
            ret = loom_cuda__fail(t->GetLastError(), "SetDevice(prev)", __FILE__, __LINE__);
    }
exit:
    *stream = copy_streams[device];
    pthread_mutex_unlock(&rt_lock);
    return ret;
}

/* ------------------------------------------------------------------------ */
/* Gather kernel                                                              */
/* ------------------------------------------------------------------------ */

bool loom_cuda_have_kernels(void) {
#ifdef LOOM_CUDA_HAVE_KERNELS
    return true;
#else
    return false;
#endif
}

#ifdef LOOM_CUDA_HAVE_KERNELS
/* The kernel's CUfunction on `device`, loading the module once per device
 * (the caller made the device current). */
static loom_status gather_function(const loom_cuda__rt_table *t, int device, void **fn) {
    void *f = __atomic_load_n(&gather_fn[device], __ATOMIC_ACQUIRE);
    if (LOOM_LIKELY(f != NULL)) {
        *fn = f;
        return LOOM_OK;
    }
    if (t->cuModuleLoadData == NULL || t->cuModuleGetFunction == NULL || t->cuLaunchKernel == NULL)
        return loom_fail(LOOM_ERR_UNAVAILABLE, "CUDA driver library (libcuda.so.1) not found");
    loom_status ret = LOOM_OK;
    void *mod = NULL;
    pthread_mutex_lock(&rt_lock);
    if (gather_fn[device] == NULL) {
        /* a module lives as long as its context: loaded once, never unloaded */
        LOOM_CUDA_CHECK_GOTO(t, cuModuleLoadData(&mod, loom_cuda__gather_fatbin), ret, exit);
        LOOM_CUDA_CHECK_GOTO(t, cuModuleGetFunction(&f, mod, "loom_cuda_gather_kernel"), ret, exit);
        __atomic_store_n(&gather_fn[device], f, __ATOMIC_RELEASE);
    }
exit:
    *fn = gather_fn[device];
    pthread_mutex_unlock(&rt_lock);
    return ret;
}
#endif

loom_status loom_cuda__launch_gather(int device, const void *src, void *dst,
                                     const loom_cuda_copy_plan *plan, void *stream) {
#ifdef LOOM_CUDA_HAVE_KERNELS
    const loom_cuda__rt_table *t = loom_cuda__rt();
    if (t == NULL) return loom_cuda_runtime();
    void *fn = NULL;
    LOOM_CHECK(gather_function(t, device, &fn));
    loom_cuda__gather_args a;
    memset(&a, 0, sizeof a);
    a.ndim = plan->ndim;
    a.itemsize = plan->itemsize;
    a.n_elems = (int64_t)(plan->nbytes / (size_t)plan->itemsize);
    for (int d = 0; d < plan->ndim; d++) {
        a.shape[d] = plan->shape[d];
        a.stride_b[d] = plan->stride_b[d];
    }
    const unsigned threads = 256;
    int64_t blocks = (a.n_elems + threads - 1) / threads;
    if (blocks > 65535 * 16) blocks = 65535 * 16; /* the kernel strides over the rest */
    const void *s = src;
    void *params[] = {(void *)&s, (void *)&dst, (void *)&a};
    LOOM_CUDA_CHECK(t, cuLaunchKernel(fn, (unsigned)blocks, 1, 1, threads, 1, 1, 0, stream, params,
                                      NULL));
    LOOM_CUDA_CHECK(t, GetLastError()); /* every launch checked */
    return LOOM_OK;
#else
    (void)device, (void)src, (void)dst, (void)plan, (void)stream;
    return loom_fail(LOOM_ERR_UNAVAILABLE, "built without nvcc: no gather kernel");
#endif
}

/* ------------------------------------------------------------------------ */
/* cudaEvent source                                                           */
/* ------------------------------------------------------------------------ */

/* Completed events are kept for reuse (up to this many). */
#define LOOM_CUDA__EVENT_CACHE 256
static pthread_mutex_t ev_lock = PTHREAD_MUTEX_INITIALIZER;
static void *ev_cache[LOOM_CUDA__EVENT_CACHE];
static int ev_cached;

static loom_status ev_record(void *ctx, void *stream, void **event) {
    (void)ctx;
    const loom_cuda__rt_table *t = loom_cuda__rt();
    if (t == NULL) return loom_cuda_runtime();
    void *ev = NULL;
    pthread_mutex_lock(&ev_lock);
    if (ev_cached > 0) ev = ev_cache[--ev_cached];
    pthread_mutex_unlock(&ev_lock);
    if (ev == NULL) LOOM_CUDA_CHECK(t, EventCreateWithFlags(&ev, LOOM_CUDA__EVENT_NO_TIMING));
    loom_cuda__err e = t->EventRecord(ev, stream);
    if (e != LOOM_CUDA__SUCCESS) {
        t->EventDestroy(ev);
        return loom_cuda__fail(e, "EventRecord(ev, stream)", __FILE__, __LINE__);
    }
    *event = ev;
    return LOOM_OK;
}

static int ev_query(void *ctx, void *event) {
    (void)ctx;
    const loom_cuda__rt_table *t = loom_cuda__rt();
    loom_cuda__err e = t->EventQuery(event);
    if (e == LOOM_CUDA__SUCCESS) return 1;
    if (e == LOOM_CUDA__NOT_READY) {
        t->GetLastError(); /* not-ready is not sticky, but keep the slate clean */
        return 0;
    }
    loom_cuda__fail(e, "EventQuery(event)", __FILE__, __LINE__);
    return -1;
}

static loom_status ev_wait(void *ctx, void *event) {
    (void)ctx;
    const loom_cuda__rt_table *t = loom_cuda__rt();
    LOOM_CUDA_CHECK(t, EventSynchronize(event));
    return LOOM_OK;
}

static void ev_release(void *ctx, void *event) {
    (void)ctx;
    pthread_mutex_lock(&ev_lock);
    if (ev_cached < LOOM_CUDA__EVENT_CACHE) {
        ev_cache[ev_cached++] = event;
        event = NULL;
    }
    pthread_mutex_unlock(&ev_lock);
    if (event != NULL) loom_cuda__rt()->EventDestroy(event);
}

static const loom_cuda_event_source device_events = {NULL, ev_record, ev_query, ev_wait,
                                                     ev_release};

const loom_cuda_event_source *loom_cuda_device_events(void) {
    return loom_cuda__rt() ? &device_events : NULL;
}

/* ------------------------------------------------------------------------ */
/* cudaHostRegister pinner                                                    */
/* ------------------------------------------------------------------------ */

static loom_status pin_register(void *ctx, void *p, size_t n) {
    (void)ctx;
    const loom_cuda__rt_table *t = loom_cuda__rt();
    if (t == NULL) return loom_cuda_runtime();
    LOOM_CUDA_CHECK(t, HostRegister(p, n, LOOM_CUDA__HOST_REGISTER_PORTABLE));
    return LOOM_OK;
}

static void pin_unregister(void *ctx, void *p, size_t n) {
    (void)ctx, (void)n;
    const loom_cuda__rt_table *t = loom_cuda__rt();
    if (t == NULL) return;
    loom_cuda__err e = t->HostUnregister(p);
    if (e != LOOM_CUDA__SUCCESS) loom_cuda__fail(e, "HostUnregister(p)", __FILE__, __LINE__);
}

static const loom_cuda_pinner device_pinner = {NULL, pin_register, pin_unregister};

const loom_cuda_pinner *loom_cuda_device_pinner(void) {
    return loom_cuda__rt() ? &device_pinner : NULL;
}
