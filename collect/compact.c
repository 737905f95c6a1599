/* collect/compact.c - copy the elements of a strided view into a row-major
 * block, and tell when no copy is needed.
 *
 * dumps_compact writes every tensor as only its own elements. A row of a
 * contiguous batch is already one block (is_dense says so and the pickler
 * writes it straight from the tensor's memory); a column slice or a strided
 * view needs a gather, which is this file. Dimensions are first coalesced
 * (adjacent dims whose strides chain are merged) so the inner loop is one
 * memcpy per contiguous run, or a fixed-width element loop when the innermost
 * dimension is itself strided.
 */
#include "collect.h"

#include <string.h>

int64_t loom_collect_numel(const loom_collect_layout *l) {
    int64_t n = 1;
    for (int d = 0; d < l->ndim; d++) n *= l->shape[d];
    return n;
}

bool loom_collect_is_dense(const loom_collect_layout *l) {
    int64_t size[LOOM_COLLECT_MAX_DIMS], stride[LOOM_COLLECT_MAX_DIMS];
    int n = 0;
    if (l->ndim < 0 || l->ndim > LOOM_COLLECT_MAX_DIMS) return false;
    for (int d = 0; d < l->ndim; d++) {
        if (l->shape[d] == 0) return true; /* no elements: nothing to lay out */
        if (l->shape[d] == 1) continue;
        /* insertion by ascending stride */
        int k = n++;
        while (k > 0 && stride[k - 1] > l->stride[d]) {
            stride[k] = stride[k - 1];
            size[k] = size[k - 1];
            k--;
        }
        stride[k] = l->stride[d];
        size[k] = l->shape[d];
    }
    int64_t expect = 1;
    for (int k = 0; k < n; k++) {
        if (stride[k] != expect) return false;
        expect *= size[k];
    }
    return true;
}

/* Merge dimension d into d+1 (the inner one) wherever stride[d] ==
 * shape[d+1] * stride[d+1]; drop size-1 dims. Writes at most ndim dims, the
 * innermost last. Returns the new count (>= 1). */
static int loom_collect__coalesce(const loom_collect_layout *l, int64_t *shape, int64_t *stride) {
    int n = 0;
    for (int d = 0; d < l->ndim; d++) {
        if (l->shape[d] == 1) continue;
        if (n > 0 && stride[n - 1] == l->shape[d] * l->stride[d]) {
            shape[n - 1] *= l->shape[d];
            stride[n - 1] = l->stride[d];
            continue;
        }
        shape[n] = l->shape[d];
        stride[n] = l->stride[d];
        n++;
    }
    if (n == 0) {
        shape[0] = 1;
        stride[0] = 1;
        n = 1;
    }
    return n;
}

/* One innermost run of `count` elements `step` bytes apart. */
static inline void loom_collect__gather_run(char *dst, const char *src, int64_t count,
                                            int64_t step, size_t itemsize) {
    switch (itemsize) {
#define LOOM__RUN(T)                                                                              \
    for (int64_t i = 0; i < count; i++) {                                                         \
        T v;                                                                                      \
        memcpy(&v, src + i * step, sizeof v);                                                     \
        memcpy(dst + i * (int64_t)sizeof v, &v, sizeof v);                                        \
    }                                                                                             \
    break;
    case 1: LOOM__RUN(uint8_t)
    case 2: LOOM__RUN(uint16_t)
    case 4: LOOM__RUN(uint32_t)
    case 8: LOOM__RUN(uint64_t)
#undef LOOM__RUN
    default:
        for (int64_t i = 0; i < count; i++)
            memcpy(dst + i * (int64_t)itemsize, src + i * step, itemsize);
    }
}

loom_status loom_collect_compact_copy(void *dst, size_t dst_len, const void *src,
                                      const loom_collect_layout *l) {
    if (l->ndim < 0 || l->ndim > LOOM_COLLECT_MAX_DIMS || l->itemsize == 0)
        return loom_fail(LOOM_ERR_INVALID, "compact copy: %d dims, itemsize %zu", l->ndim,
                         l->itemsize);
    for (int d = 0; d < l->ndim; d++)
        if (l->shape[d] < 0 || l->stride[d] < 0)
            return loom_fail(LOOM_ERR_INVALID, "compact copy: negative size or stride in dim %d",
                             d);
    int64_t numel = loom_collect_numel(l);
    if ((uint64_t)numel * l->itemsize != dst_len)
        return loom_fail(LOOM_ERR_INVALID, "compact copy: %zu bytes given for %lld elements of %zu",
                         dst_len, (long long)numel, l->itemsize);
    if (numel == 0) return LOOM_OK;

    int64_t shape[LOOM_COLLECT_MAX_DIMS], stride[LOOM_COLLECT_MAX_DIMS];
    int n = loom_collect__coalesce(l, shape, stride);
    const int64_t isz = (int64_t)l->itemsize;
    const int64_t inner = shape[n - 1];
    const int64_t inner_step = stride[n - 1] * isz; /* bytes */
    const bool inner_block = stride[n - 1] == 1;
    const int64_t run_bytes = inner * isz;

    int64_t idx[LOOM_COLLECT_MAX_DIMS] = {0}; /* odometer over the outer n-1 dims */
    const char *s = (const char *)src;
    char *o = (char *)dst;
    int64_t runs = numel / inner;
    for (int64_t r = 0; r < runs; r++) {
        if (inner_block) memcpy(o, s, (size_t)run_bytes);
        else loom_collect__gather_run(o, s, inner, inner_step, l->itemsize);
        o += run_bytes;
        /* advance the odometer, innermost outer dim first */
        for (int d = n - 2; d >= 0; d--) {
            s += stride[d] * isz;
            if (++idx[d] < shape[d]) break;
            s -= shape[d] * stride[d] * isz;
            idx[d] = 0;
        }
    }
    return LOOM_OK;
}
