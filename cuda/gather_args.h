/* cuda/gather_args.h - the gather kernel's argument block, shared by the host
 * side that launches it (cuda/rt.c, plain C) and the kernel (cuda/gather.cu,
 * nvcc): one definition, so their layouts cannot drift apart. Includes
 * nothing but <stdint.h> so nvcc can take it as it is. */
#ifndef LOOM_CUDA_GATHER_ARGS_H
#define LOOM_CUDA_GATHER_ARGS_H

#include <stdint.h>

#ifndef LOOM_CUDA_MAX_DIMS
#define LOOM_CUDA_MAX_DIMS 8
#endif

typedef struct {
    int64_t shape[LOOM_CUDA_MAX_DIMS];    /* collapsed, outermost first */
    int64_t stride_b[LOOM_CUDA_MAX_DIMS]; /* bytes */
    int64_t n_elems;
    int32_t ndim;
    int32_t itemsize;
} loom_cuda__gather_args;

#endif /* LOOM_CUDA_GATHER_ARGS_H */
