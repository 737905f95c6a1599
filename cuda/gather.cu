/* cuda/gather.cu - the gather kernel: compacts a strided view into a dense
 * buffer, one element per thread (grid-stride), for rows too narrow or too
 * scattered for a 2-D copy. Built by nvcc into a fatbin embedded in
 * nnloom._C and launched through the driver API (cuda/rt.c): the argument
 * block is loom_cuda__gather_args (cuda/gather_args.h).
 */
#include "gather_args.h"

template <typename T>
__device__ __forceinline__ void move(const char *src, char *dst, int64_t soff, int64_t i) {
    *reinterpret_cast<T *>(dst + i * (int64_t)sizeof(T)) =
        *reinterpret_cast<const T *>(src + soff);
}

extern "C" __global__ void loom_cuda_gather_kernel(const char *__restrict__ src,
                                                   char *__restrict__ dst,
                                                   const loom_cuda__gather_args a) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.n_elems; i += step) {
        int64_t rem = i, soff = 0;
        for (int d = a.ndim - 1; d >= 0; d--) { /* linear index -> strided offset */
            const int64_t n = a.shape[d];
            soff += (rem % n) * a.stride_b[d];
            rem /= n;
        }
        switch (a.itemsize) {
        case 1: move<uint8_t>(src, dst, soff, i); break;
        case 2: move<uint16_t>(src, dst, soff, i); break;
        case 4: move<uint32_t>(src, dst, soff, i); break;
        case 8: move<uint64_t>(src, dst, soff, i); break;
        default: move<ulonglong2>(src, dst, soff, i); break; /* 16 bytes, 16-aligned */
        }
    }
}
