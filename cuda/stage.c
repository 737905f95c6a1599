/* cuda/stage.c - compact staging: copy only a view's own elements into one
 * pinned block.
 *
 * A saved value is usually a row-narrowed view of a batch buffer. Planning
 * collapses the view's dims (drops size-1 dims, merges dims that are
 * contiguous with each other) and sorts it into one of three copy kinds:
 * CONTIG (one linear copy), ROWS (equal rows at a fixed pitch: a 2-D copy)
 * or GATHER (anything else). On the host, the same plan drives memcpy and a
 * strided gather; on a device, the copy stream runs cudaMemcpyAsync,
 * cudaMemcpy2DAsync or the gather kernel into device scratch followed by a
 * single copy of the scratch.
 */
#include "cuda_internal.h"

#include <string.h>

static LOOM_PARAM(Copy2DMinRow, "NNLOOM_COPY2D_MIN_ROW", 2048)

int64_t loom_cuda_copy2d_min_row(void) { return loom_param_Copy2DMinRow(); }

#define LOOM_CUDA__ALIGN 256

/* ------------------------------------------------------------------------ */
/* Planning                                                                   */
/* ------------------------------------------------------------------------ */

/* Collapse v into p (kind, ndim, shape, stride_b, nbytes). */
static loom_status plan_one(const loom_cuda_tview *v, loom_cuda_copy_plan *p) {
    memset(p, 0, sizeof *p);
    if (v->ndim < 0 || v->ndim > LOOM_CUDA_MAX_DIMS)
        return loom_fail(LOOM_ERR_INVALID, "tensor with %d dims (at most %d)", v->ndim,
                         LOOM_CUDA_MAX_DIMS);
    if (v->itemsize != 1 && v->itemsize != 2 && v->itemsize != 4 && v->itemsize != 8 &&
        v->itemsize != 16)
        return loom_fail(LOOM_ERR_INVALID, "element size %d not supported", v->itemsize);
    p->itemsize = v->itemsize;
    int64_t numel = 1;
    for (int d = 0; d < v->ndim; d++) {
        if (v->shape[d] < 0) return loom_fail(LOOM_ERR_INVALID, "negative size");
        numel *= v->shape[d];
    }
    p->nbytes = (size_t)numel * (size_t)v->itemsize;
    if (numel == 0) {
        p->kind = LOOM_CUDA_COPY_EMPTY;
        return LOOM_OK;
    }
    /* walk innermost-out, merging a dim into the one inside it when
     * stride[outer] == stride[inner] * shape[inner] */
    int64_t sh[LOOM_CUDA_MAX_DIMS], st[LOOM_CUDA_MAX_DIMS];
    int n = 0;
    for (int d = v->ndim - 1; d >= 0; d--) {
        if (v->shape[d] == 1) continue;
        int64_t sb = v->strides[d] * v->itemsize;
        if (n > 0 && sb == st[n - 1] * sh[n - 1]) {
            sh[n - 1] *= v->shape[d];
        } else {
            sh[n] = v->shape[d];
            st[n] = sb;
            n++;
        }
    }
    if (n == 0) { /* a single element */
        sh[0] = 1;
        st[0] = v->itemsize;
        n = 1;
    }
    p->ndim = n;
    for (int i = 0; i < n; i++) { /* back to outermost-first */
        p->shape[i] = sh[n - 1 - i];
        p->stride_b[i] = st[n - 1 - i];
    }
    int64_t inner = p->stride_b[n - 1];
    if (n == 1 && inner == v->itemsize) p->kind = LOOM_CUDA_COPY_CONTIG;
    else if (n == 2 && inner == v->itemsize && p->stride_b[0] >= p->shape[1] * v->itemsize)
        p->kind = LOOM_CUDA_COPY_ROWS;
    else p->kind = LOOM_CUDA_COPY_GATHER;
    return LOOM_OK;
}

/* On a device, narrow ROWS go through the gather kernel (when present). */
static int device_gathers(const loom_cuda_copy_plan *p) {
    if (p->kind == LOOM_CUDA_COPY_GATHER) return loom_cuda_have_kernels();
    if (p->kind == LOOM_CUDA_COPY_ROWS)
        return loom_cuda_have_kernels() &&
               p->shape[1] * p->itemsize < loom_cuda_copy2d_min_row();
    return 0;
}

loom_status loom_cuda_stage_plan(const loom_cuda_tview *views, size_t n,
                                 loom_cuda_copy_plan *plans, size_t *total) {
    *total = 0;
    for (size_t i = 0; i < n; i++) {
        loom_status s = plan_one(&views[i], &plans[i]);
        if (s != LOOM_OK) return loom_fail(s, "tensor %zu: %s", i, loom_last_error());
    }
    /* device gathers first (one scratch region, one copy), then the rest */
    size_t off = 0;
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < n; i++) {
            int g = views[i].device >= 0 && device_gathers(&plans[i]);
            if (g != (pass == 0)) continue;
            plans[i].offset = off;
            off += (plans[i].nbytes + LOOM_CUDA__ALIGN - 1) & ~(size_t)(LOOM_CUDA__ALIGN - 1);
        }
    *total = off;
    return LOOM_OK;
}

/* ------------------------------------------------------------------------ */
/* Host                                                                       */
/* ------------------------------------------------------------------------ */

/* Gather dims [d, ndim) of p from src into dst; returns the end of dst. */
static uint8_t *gather_host(const loom_cuda_copy_plan *p, int d, const uint8_t *src, uint8_t *dst) {
    int64_t n = p->shape[d], sb = p->stride_b[d];
    if (d == p->ndim - 1) {
        size_t w = (size_t)p->itemsize;
        if (sb == (int64_t)w) { /* contiguous run */
            memcpy(dst, src, (size_t)n * w);
            return dst + (size_t)n * w;
        }
        switch (w) { /* fixed-size moves the compiler turns into loads/stores */
        case 1: for (int64_t i = 0; i < n; i++) dst[i] = src[i * sb]; break;
        case 2: for (int64_t i = 0; i < n; i++) memcpy(dst + 2 * i, src + i * sb, 2); break;
        case 4: for (int64_t i = 0; i < n; i++) memcpy(dst + 4 * i, src + i * sb, 4); break;
        case 8: for (int64_t i = 0; i < n; i++) memcpy(dst + 8 * i, src + i * sb, 8); break;
        default: for (int64_t i = 0; i < n; i++) memcpy(dst + 16 * i, src + i * sb, 16); break;
        }
        return dst + (size_t)n * w;
    }
    for (int64_t i = 0; i < n; i++) dst = gather_host(p, d + 1, src + i * sb, dst);
    return dst;
}

loom_status loom_cuda_stage_cpu(const loom_cuda_tview *views, const loom_cuda_copy_plan *plans,
                                size_t n, void *dst) {
    loom_cuda_range_push("nnloom.compact");
    for (size_t i = 0; i < n; i++) {
        const loom_cuda_copy_plan *p = &plans[i];
        uint8_t *out = (uint8_t *)dst + p->offset;
        const uint8_t *src = views[i].data;
        switch (p->kind) {
        case LOOM_CUDA_COPY_EMPTY: break;
        case LOOM_CUDA_COPY_CONTIG: memcpy(out, src, p->nbytes); break;
        case LOOM_CUDA_COPY_ROWS: {
            size_t w = (size_t)(p->shape[1] * p->itemsize);
            for (int64_t r = 0; r < p->shape[0]; r++)
                memcpy(out + (size_t)r * w, src + r * p->stride_b[0], w);
            break;
        }
        case LOOM_CUDA_COPY_GATHER: gather_host(p, 0, src, out); break;
        }
    }
    loom_cuda_range_pop();
    return LOOM_OK;
}

/* ------------------------------------------------------------------------ */
/* Device                                                                     */
/* ------------------------------------------------------------------------ */

/* Without the kernel: a strided copy as 2-D copies over its outer dims
 * (each 2-D copy moves the innermost dim as `height` rows of one element
 * at pitch stride, or as one row when it is contiguous). */
static loom_status copy_strided_2d(const loom_cuda__rt_table *t, const loom_cuda_copy_plan *p,
                                   const uint8_t *src, uint8_t *dst, void *stream) {
    int last = p->ndim - 1;
    int64_t inner = p->shape[last], isb = p->stride_b[last];
    size_t w = (size_t)p->itemsize;
    int64_t outer = 1;
    for (int d = 0; d < last; d++) outer *= p->shape[d];
    for (int64_t o = 0; o < outer; o++) {
        int64_t rem = o, soff = 0;
        for (int d = last - 1; d >= 0; d--) {
            soff += (rem % p->shape[d]) * p->stride_b[d];
            rem /= p->shape[d];
        }
        uint8_t *out = dst + (size_t)o * (size_t)inner * w;
        if (isb == (int64_t)w)
            LOOM_CUDA_CHECK(t, MemcpyAsync(out, src + soff, (size_t)inner * w, LOOM_CUDA__D2H,
                                           stream));
        else
            LOOM_CUDA_CHECK(t, Memcpy2DAsync(out, w, src + soff, (size_t)isb, w, (size_t)inner,
                                             LOOM_CUDA__D2H, stream));
    }
    return LOOM_OK;
}

loom_status loom_cuda_stage_device(const loom_cuda_tview *views, const loom_cuda_copy_plan *plans,
                                   size_t n, loom_cuda_block *blk, void *compute_stream) {
    const loom_cuda__rt_table *t = loom_cuda__rt();
    if (t == NULL) return loom_cuda_runtime();
    if (n == 0) return LOOM_OK;
    loom_status ret = LOOM_OK;
    int device = views[0].device, prev = -1;
    void *copy = NULL, *ready = NULL, *scratch = NULL;
    uint8_t *host = loom_cuda_block_data(blk);
    size_t gather_end = 0;
    for (size_t i = 0; i < n; i++) {
        if (views[i].device != device)
            return loom_fail(LOOM_ERR_INVALID, "staging mixes devices %d and %d", device,
                             views[i].device);
        if (device_gathers(&plans[i]) && plans[i].nbytes) {
            size_t end = plans[i].offset + plans[i].nbytes;
            if (end > gather_end) gather_end = end;
        }
    }
    const loom_cuda_event_source *evs = loom_cuda_device_events();
    loom_cuda_range_push("nnloom.compact");
    LOOM_CUDA_CHECK_GOTO(t, GetDevice(&prev), ret, exit);
    LOOM_CUDA_CHECK_GOTO(t, SetDevice(device), ret, exit);
    LOOM_CHECK_GOTO(loom_cuda__copy_stream(device, &copy), ret, restore);
    /* the copy stream starts after what the compute stream has queued */
    LOOM_CHECK_GOTO(evs->record(evs->ctx, compute_stream, &ready), ret, restore);
    LOOM_CUDA_CHECK_GOTO(t, StreamWaitEvent(copy, ready, 0), ret, restore);
    if (gather_end > 0) {
        loom_cuda_range_push("nnloom.gather_kernel");
        LOOM_CUDA_CHECK_GOTO(t, MallocAsync(&scratch, gather_end, copy), ret, pop_gather);
        for (size_t i = 0; i < n; i++)
            if (device_gathers(&plans[i]) && plans[i].nbytes)
                LOOM_CHECK_GOTO(loom_cuda__launch_gather(device, views[i].data,
                                                         (uint8_t *)scratch + plans[i].offset,
                                                         &plans[i], copy),
                                ret, pop_gather);
        LOOM_CUDA_CHECK_GOTO(t, MemcpyAsync(host, scratch, gather_end, LOOM_CUDA__D2H, copy), ret,
                             pop_gather);
    pop_gather:
        loom_cuda_range_pop();
        if (ret != LOOM_OK) goto restore;
    }
    for (size_t i = 0; i < n; i++) {
        const loom_cuda_copy_plan *p = &plans[i];
        if (device_gathers(p) || p->kind == LOOM_CUDA_COPY_EMPTY) continue;
        uint8_t *out = host + p->offset;
        if (p->kind == LOOM_CUDA_COPY_CONTIG) {
            LOOM_CUDA_CHECK_GOTO(t, MemcpyAsync(out, views[i].data, p->nbytes, LOOM_CUDA__D2H, copy),
                                 ret, restore);
        } else if (p->kind == LOOM_CUDA_COPY_ROWS) {
            size_t w = (size_t)(p->shape[1] * p->itemsize);
            LOOM_CUDA_CHECK_GOTO(t, Memcpy2DAsync(out, w, views[i].data, (size_t)p->stride_b[0], w,
                                                  (size_t)p->shape[0], LOOM_CUDA__D2H, copy),
                                 ret, restore);
        } else {
            LOOM_CHECK_GOTO(copy_strided_2d(t, p, views[i].data, out, copy), ret, restore);
        }
    }
    LOOM_CHECK_GOTO(loom_cuda_block_record(blk, copy), ret, restore);
restore:
    if (scratch != NULL) { /* stream-ordered: freed after the copies queued before it */
        loom_cuda__err e = t->FreeAsync(scratch, copy);
        if (e != LOOM_CUDA__SUCCESS && ret == LOOM_OK)
            ret = loom_cuda__fail(e, "FreeAsync(scratch, copy)", __FILE__, __LINE__);
    }
    if (ready != NULL) evs->release(evs->ctx, ready); /* reusable once recorded again later */
    if (prev >= 0) {
        loom_cuda__err e = t->SetDevice(prev);
        if (e != LOOM_CUDA__SUCCESS && ret == LOOM_OK)
            ret = loom_cuda__fail(e, "SetDevice(prev)", __FILE__, __LINE__);
    }
exit:
    loom_cuda_range_pop();
    return ret;
}
