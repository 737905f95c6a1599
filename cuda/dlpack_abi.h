/* cuda/dlpack_abi.h - the DLPack structures nnloom reads and produces.
 *
 * DLPack is a stable C ABI for handing strided tensors between frameworks;
 * these are its unversioned ("dltensor" capsule) structures, written from
 * the published layout so cuda/ needs no extra header at build time.
 */
#ifndef LOOM_CUDA_DLPACK_ABI_H
#define LOOM_CUDA_DLPACK_ABI_H

#include <stdint.h>

enum {
    LOOM_DL_CPU = 1,       /* kDLCPU */
    LOOM_DL_CUDA = 2,      /* kDLCUDA */
    LOOM_DL_CUDA_HOST = 3, /* kDLCUDAHost: pinned host memory */
};

enum { LOOM_DL_INT = 0, LOOM_DL_UINT = 1, LOOM_DL_FLOAT = 2, LOOM_DL_BFLOAT = 4 };

typedef struct {
    int32_t device_type; /* LOOM_DL_* */
    int32_t device_id;
} loom_dl_device;

typedef struct {
    uint8_t code;   /* LOOM_DL_INT ... */
    uint8_t bits;   /* per lane */
    uint16_t lanes; /* 1 for scalars */
} loom_dl_dtype;

typedef struct {
    void *data;             /* base pointer */
    loom_dl_device device;
    int32_t ndim;
    loom_dl_dtype dtype;
    int64_t *shape;         /* [ndim] */
    int64_t *strides;       /* [ndim] in elements, or NULL for compact row-major */
    uint64_t byte_offset;   /* added to data */
} loom_dl_tensor;

typedef struct loom_dl_managed {
    loom_dl_tensor dl_tensor;
    void *manager_ctx;                            /* producer's */
    void (*deleter)(struct loom_dl_managed *self); /* called once by the consumer */
} loom_dl_managed;

#endif /* LOOM_CUDA_DLPACK_ABI_H */
