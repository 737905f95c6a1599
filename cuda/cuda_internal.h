/* cuda/cuda_internal.h - what the files of cuda/ share and nobody else sees:
 * the table of CUDA runtime/driver entry points resolved at run time, the
 * CHECK macros over it, and the few CUDA constants we use (stable ABI values;
 * rt.c checks them against the toolkit headers when those are present).
 */
#ifndef LOOM_CUDA_INTERNAL_H
#define LOOM_CUDA_INTERNAL_H

#include "device.h"

/* cudaError_t / CUresult are plain ints in the ABI; handles are pointers. */
typedef int loom_cuda__err;

#define LOOM_CUDA__SUCCESS 0
#define LOOM_CUDA__NOT_READY 600          /* cudaErrorNotReady */
#define LOOM_CUDA__D2H 2                  /* cudaMemcpyDeviceToHost */
#define LOOM_CUDA__D2D 3                  /* cudaMemcpyDeviceToDevice */
#define LOOM_CUDA__EVENT_NO_TIMING 0x02u  /* cudaEventDisableTiming */
#define LOOM_CUDA__STREAM_NON_BLOCKING 0x01u /* cudaStreamNonBlocking */
#define LOOM_CUDA__HOST_REGISTER_PORTABLE 0x01u /* cudaHostRegisterPortable */

/* Entry points, named after the CUDA functions they hold. */
typedef struct {
    /* runtime (libcudart) */
    loom_cuda__err (*GetDeviceCount)(int *count);
    loom_cuda__err (*GetDevice)(int *dev);
    loom_cuda__err (*SetDevice)(int dev);
    loom_cuda__err (*GetLastError)(void);
    const char *(*GetErrorString)(loom_cuda__err e);
    loom_cuda__err (*HostRegister)(void *p, size_t n, unsigned flags);
    loom_cuda__err (*HostUnregister)(void *p);
    loom_cuda__err (*StreamCreateWithFlags)(void **stream, unsigned flags);
    loom_cuda__err (*StreamWaitEvent)(void *stream, void *event, unsigned flags);
    loom_cuda__err (*EventCreateWithFlags)(void **event, unsigned flags);
    loom_cuda__err (*EventRecord)(void *event, void *stream);
    loom_cuda__err (*EventQuery)(void *event);
    loom_cuda__err (*EventSynchronize)(void *event);
    loom_cuda__err (*EventDestroy)(void *event);
    loom_cuda__err (*MemcpyAsync)(void *dst, const void *src, size_t n, int kind, void *stream);
    loom_cuda__err (*Memcpy2DAsync)(void *dst, size_t dpitch, const void *src, size_t spitch,
                                    size_t width, size_t height, int kind, void *stream);
    loom_cuda__err (*MallocAsync)(void **p, size_t n, void *stream);
    loom_cuda__err (*FreeAsync)(void *p, void *stream);
    /* driver (libcuda), for the embedded gather kernel */
    loom_cuda__err (*cuModuleLoadData)(void **module, const void *image);
    loom_cuda__err (*cuModuleGetFunction)(void **fn, void *module, const char *name);
    loom_cuda__err (*cuLaunchKernel)(void *fn, unsigned gx, unsigned gy, unsigned gz,
                                     unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                     void *stream, void **params, void **extra);
} loom_cuda__rt_table;

/* The resolved table; NULL when the runtime is unavailable. Borrowed,
 * static storage. */
const loom_cuda__rt_table *loom_cuda__rt(void);
/* Tests: use `t` (borrowed for the process) instead of the real runtime;
 * NULL goes back to run-time resolution. Also resets copy streams and the
 * kernel module cache. */
void loom_cuda__rt_override(const loom_cuda__rt_table *t, int device_count);

/* Log "file:line: what: message (code)" to stderr, clear CUDA's sticky
 * error, set the error detail; returns LOOM_ERR_CUDA. */
loom_status loom_cuda__fail(loom_cuda__err e, const char *what, const char *file, int line);

#define LOOM_CUDA_CHECK(rt, cmd)                                                \
    do {                                                                       \
        loom_cuda__err loom__e = (rt)->cmd;                                    \
        if (LOOM_UNLIKELY(loom__e != LOOM_CUDA__SUCCESS))                      \
            return loom_cuda__fail(loom__e, #cmd, __FILE__, __LINE__);         \
    } while (0)

#define LOOM_CUDA_CHECK_GOTO(rt, cmd, ret, label)                               \
    do {                                                                       \
        loom_cuda__err loom__e = (rt)->cmd;                                    \
        if (LOOM_UNLIKELY(loom__e != LOOM_CUDA__SUCCESS)) {                    \
            (ret) = loom_cuda__fail(loom__e, #cmd, __FILE__, __LINE__);        \
            goto label;                                                        \
        }                                                                      \
    } while (0)

/* The copy stream of `device` (created once, never destroyed). */
loom_status loom_cuda__copy_stream(int device, void **stream);

/* Launch the gather kernel (when compiled in) on `stream`: dst[i] = the
 * i-th element of the collapsed strided source `plan`, for every element.
 * LOOM_ERR_UNAVAILABLE when the build has no kernels. */
loom_status loom_cuda__launch_gather(int device, const void *src, void *dst,
                                     const loom_cuda_copy_plan *plan, void *stream);

/* The gather kernel's argument block. */
#include "gather_args.h"

/* The embedded fatbin (generated at build time when nvcc is found). */
extern const unsigned char loom_cuda__gather_fatbin[];
extern const size_t loom_cuda__gather_fatbin_size;

#endif /* LOOM_CUDA_INTERNAL_H */
