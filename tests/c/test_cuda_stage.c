/* tests/c/test_cuda_stage.c - compact staging: planning, the host copies,
 * and the device path driven through a fake CUDA runtime whose "device
 * memory" is host memory (memcpy-backed copies, a host-run gather kernel),
 * so every branch of loom_cuda_stage_device runs on the CPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../cuda/cuda_internal.h"

/* ---- views ---- */

static loom_cuda_tview view(const void *base, int itemsize, int ndim, const int64_t *shape,
                            const int64_t *strides, int64_t offset_elems, int device) {
    loom_cuda_tview v;
    memset(&v, 0, sizeof v);
    v.data = (const uint8_t *)base + offset_elems * itemsize;
    v.itemsize = itemsize;
    v.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        v.shape[d] = shape[d];
        v.strides[d] = strides[d];
    }
    v.device = device;
    return v;
}

/* Reference: element-by-element in row-major order. */
static void reference(const loom_cuda_tview *v, uint8_t *out) {
    int64_t idx[LOOM_CUDA_MAX_DIMS] = {0};
    int64_t n = 1;
    for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
    for (int64_t i = 0; i < n; i++) {
        int64_t off = 0;
        for (int d = 0; d < v->ndim; d++) off += idx[d] * v->strides[d];
        memcpy(out + i * v->itemsize, (const uint8_t *)v->data + off * v->itemsize,
               (size_t)v->itemsize);
        for (int d = v->ndim - 1; d >= 0; d--) {
            if (++idx[d] < v->shape[d]) break;
            idx[d] = 0;
        }
    }
}

static uint8_t *batch(size_t nbytes) {
    uint8_t *b = malloc(nbytes);
    for (size_t i = 0; i < nbytes; i++) b[i] = (uint8_t)(i * 131 + 7);
    return b;
}

/* A [B=8, S=5, H=12] batch and views of it, as a trace narrows them. */
#define B 8
#define S 5
#define H 12

typedef struct {
    loom_cuda_tview v;
    loom_cuda_copy_kind host_kind;
} case_t;

static int make_cases(const uint8_t *buf, int itemsize, int device, case_t *c) {
    int n = 0;
    int64_t s3[3] = {S * H, H, 1}, sh[3];
    /* rows 2..4 of [B, S, H]: contiguous */
    sh[0] = 3, sh[1] = S, sh[2] = H;
    c[n++] = (case_t){view(buf, itemsize, 3, sh, s3, 2 * S * H, device), LOOM_CUDA_COPY_CONTIG};
    /* [S, B, H] layout narrowed on dim 1: equal rows at a pitch */
    int64_t sbh[3] = {B * H, H, 1};
    sh[0] = S, sh[1] = 3, sh[2] = H;
    c[n++] = (case_t){view(buf, itemsize, 3, sh, sbh, 4 * H, device), LOOM_CUDA_COPY_ROWS};
    /* every other hidden unit of two rows: scattered */
    int64_t sc[3] = {S * H, H, 2};
    sh[0] = 2, sh[1] = S, sh[2] = H / 2;
    c[n++] = (case_t){view(buf, itemsize, 3, sh, sc, 1 * S * H + 1, device), LOOM_CUDA_COPY_GATHER};
    /* a transposed row: [H, S] view of one batch row */
    int64_t tr[2] = {1, H};
    sh[0] = H, sh[1] = S;
    c[n++] = (case_t){view(buf, itemsize, 2, sh, tr, 3 * S * H, device), LOOM_CUDA_COPY_GATHER};
    /* one element, and an empty view */
    sh[0] = 1, sh[1] = 1, sh[2] = 1;
    c[n++] = (case_t){view(buf, itemsize, 3, sh, s3, 17, device), LOOM_CUDA_COPY_CONTIG};
    sh[0] = 0, sh[1] = S, sh[2] = H;
    c[n++] = (case_t){view(buf, itemsize, 3, sh, s3, 0, device), LOOM_CUDA_COPY_EMPTY};
    return n;
}

static void check_staged(const case_t *c, int n, const loom_cuda_copy_plan *plans,
                         const uint8_t *dst) {
    for (int i = 0; i < n; i++) {
        size_t nb = plans[i].nbytes;
        uint8_t *want = malloc(nb + 1);
        reference(&c[i].v, want);
        assert_memory_equal(dst + plans[i].offset, want, nb);
        free(want);
    }
}

static void test_plan_kinds(void **state) {
    (void)state;
    uint8_t *buf = batch(B * S * H * 4);
    case_t c[8];
    int n = make_cases(buf, 4, -1, c);
    loom_cuda_copy_plan plans[8];
    loom_cuda_tview v[8] = {{0}};
    for (int i = 0; i < n; i++) v[i] = c[i].v;
    size_t total = 0;
    assert_int_equal(loom_cuda_stage_plan(v, (size_t)n, plans, &total), LOOM_OK);
    size_t sum = 0;
    for (int i = 0; i < n; i++) {
        assert_int_equal(plans[i].kind, c[i].host_kind);
        assert_int_equal(plans[i].offset % 256, 0);
        sum += plans[i].nbytes;
    }
    assert_int_equal(plans[0].nbytes, 3 * S * H * 4);
    assert_int_equal(plans[1].ndim, 2); /* [S, 3*H] rows */
    assert_int_equal(plans[1].shape[1], 3 * H);
    assert_true(total >= sum && total <= sum + (size_t)n * 256);
    /* bad element size */
    v[0].itemsize = 3;
    assert_int_equal(loom_cuda_stage_plan(v, 1, plans, &total), LOOM_ERR_INVALID);
    free(buf);
}

static void run_host(int itemsize) {
    uint8_t *buf = batch((size_t)B * S * H * itemsize);
    case_t c[8];
    int n = make_cases(buf, itemsize, -1, c);
    loom_cuda_copy_plan plans[8];
    loom_cuda_tview v[8] = {{0}};
    for (int i = 0; i < n; i++) v[i] = c[i].v;
    size_t total = 0;
    assert_int_equal(loom_cuda_stage_plan(v, (size_t)n, plans, &total), LOOM_OK);
    uint8_t *dst = calloc(1, total);
    assert_int_equal(loom_cuda_stage_cpu(v, plans, (size_t)n, dst), LOOM_OK);
    check_staged(c, n, plans, dst);
    assert_int_equal(loom_cuda_range_depth(), 0);
    free(dst);
    free(buf);
}

static void test_host_bitwise(void **state) {
    (void)state;
    run_host(1);
    run_host(2);
    run_host(4);
    run_host(8);
    run_host(16);
}

/* ---- fake CUDA runtime ---- */

static int calls_memcpy, calls_2d, calls_launch, calls_malloc, calls_free, calls_lasterror;
static int fail_memcpy; /* make MemcpyAsync fail once when set */
static int live_events;

static loom_cuda__err f_count(int *n) { return *n = 1, 0; }
static loom_cuda__err f_getdev(int *d) { return *d = 0, 0; }
static loom_cuda__err f_setdev(int d) { return (void)d, 0; }
static loom_cuda__err f_lasterr(void) { return calls_lasterror++, 0; }
static const char *f_errstr(loom_cuda__err e) { return e ? "fake failure" : "no error"; }
static loom_cuda__err f_reg(void *p, size_t n, unsigned f) { return (void)p, (void)n, (void)f, 0; }
static loom_cuda__err f_unreg(void *p) { return (void)p, 0; }
static loom_cuda__err f_stream(void **s, unsigned f) { return (void)f, *s = (void *)0x5, 0; }
static loom_cuda__err f_wait(void *s, void *e, unsigned f) { return (void)s, (void)e, (void)f, 0; }
static loom_cuda__err f_evcreate(void **e, unsigned f) {
    (void)f;
    *e = malloc(1);
    live_events++;
    return 0;
}
static loom_cuda__err f_evrecord(void *e, void *s) { return (void)e, (void)s, 0; }
static loom_cuda__err f_evquery(void *e) { return (void)e, 0; }
static loom_cuda__err f_evsync(void *e) { return (void)e, 0; }
static loom_cuda__err f_evdestroy(void *e) {
    free(e);
    live_events--;
    return 0;
}
static loom_cuda__err f_memcpy(void *d, const void *s, size_t n, int k, void *st) {
    (void)st;
    assert_int_equal(k, LOOM_CUDA__D2H);
    if (fail_memcpy) {
        fail_memcpy = 0;
        return 1;
    }
    calls_memcpy++;
    memcpy(d, s, n);
    return 0;
}
static loom_cuda__err f_memcpy2d(void *d, size_t dp, const void *s, size_t sp, size_t w, size_t h,
                                 int k, void *st) {
    (void)st, (void)k;
    calls_2d++;
    for (size_t r = 0; r < h; r++) memcpy((uint8_t *)d + r * dp, (const uint8_t *)s + r * sp, w);
    return 0;
}
static loom_cuda__err f_malloc(void **p, size_t n, void *s) {
    (void)s;
    calls_malloc++;
    *p = malloc(n);
    return 0;
}
static loom_cuda__err f_free(void *p, void *s) {
    (void)s;
    calls_free++;
    free(p);
    return 0;
}
static loom_cuda__err f_modload(void **m, const void *img) { return (void)img, *m = (void *)0x1, 0; }
static loom_cuda__err f_getfn(void **fn, void *m, const char *name) {
    (void)m;
    assert_string_equal(name, "loom_cuda_gather_kernel");
    *fn = (void *)0x2;
    return 0;
}
/* the kernel, run on the host from its launch parameters */
static loom_cuda__err f_launch(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shmem, void *stream,
                               void **params, void **extra) {
    (void)fn, (void)gy, (void)gz, (void)by, (void)bz, (void)shmem, (void)stream, (void)extra;
    calls_launch++;
    const uint8_t *src = *(const uint8_t **)params[0];
    uint8_t *dst = *(uint8_t **)params[1];
    const loom_cuda__gather_args *a = params[2];
    assert_true((int64_t)gx * bx >= 1);
    for (int64_t i = 0; i < a->n_elems; i++) {
        int64_t rem = i, off = 0;
        for (int d = a->ndim - 1; d >= 0; d--) {
            off += (rem % a->shape[d]) * a->stride_b[d];
            rem /= a->shape[d];
        }
        memcpy(dst + i * a->itemsize, src + off, (size_t)a->itemsize);
    }
    return 0;
}

static const loom_cuda__rt_table fake_rt = {
    f_count,    f_getdev,   f_setdev,   f_lasterr,  f_errstr, f_reg,     f_unreg,
    f_stream,   f_wait,     f_evcreate, f_evrecord, f_evquery, f_evsync, f_evdestroy,
    f_memcpy,   f_memcpy2d, f_malloc,   f_free,     f_modload, f_getfn,  f_launch,
};


static int fake_setup(void **state) {
    (void)state;
    loom_cuda__rt_override(&fake_rt, 1);
    calls_memcpy = calls_2d = calls_launch = calls_malloc = calls_free = calls_lasterror = 0;
    return 0;
}

static int fake_teardown(void **state) {
    (void)state;
    loom_cuda__rt_override(NULL, 0);
    return 0;
}

static void run_device(int itemsize) {
    uint8_t *buf = batch((size_t)B * S * H * itemsize);
    case_t c[8];
    int n = make_cases(buf, itemsize, 0, c);
    loom_cuda_copy_plan plans[8];
    loom_cuda_tview v[8] = {{0}};
    for (int i = 0; i < n; i++) v[i] = c[i].v;
    size_t total = 0;
    assert_int_equal(loom_cuda_stage_plan(v, (size_t)n, plans, &total), LOOM_OK);
    loom_cuda_pool_config cfg = {64u << 20, 1u << 20, loom_cuda_device_events(),
                                 loom_cuda_device_pinner()};
    assert_non_null(cfg.events);
    loom_cuda_pool *pool = NULL;
    assert_int_equal(loom_cuda_pool_create(&cfg, &pool), LOOM_OK);
    loom_cuda_block *blk = NULL;
    assert_int_equal(loom_cuda_pool_lease(pool, total, &blk), LOOM_OK);
    int m0 = calls_memcpy, l0 = calls_launch, d0 = calls_2d;
    assert_int_equal(loom_cuda_stage_device(v, plans, (size_t)n, blk, (void *)0x7), LOOM_OK);
    assert_int_equal(loom_cuda_block_wait(blk), LOOM_OK);
    check_staged(c, n, plans, loom_cuda_block_data(blk));
    if (loom_cuda_have_kernels()) {
        /* two scattered views + the narrow rows: kernels, then ONE copy of
         * the scratch; the contiguous view and the single element: copies */
        assert_int_equal(calls_launch - l0, 3);
        assert_int_equal(calls_memcpy - m0, 1 + 2);
        assert_int_equal(calls_2d - d0, 0);
        assert_int_equal(calls_malloc, calls_free);
    } else {
        assert_int_equal(calls_launch - l0, 0);
        assert_true(calls_2d - d0 >= 2);
    }
    assert_int_equal(loom_cuda_range_depth(), 0);
    loom_cuda_block_end_lease(blk);
    loom_cuda_pool_release(pool);
    free(buf);
}

static void test_device_bitwise(void **state) {
    (void)state;
    run_device(1);
    run_device(2);
    run_device(4);
    run_device(8);
}

static void test_device_wide_rows_use_2d(void **state) {
    (void)state;
    /* [S, B, Hwide] narrowed on B: rows of 3*Hw*4 bytes >= the 2-D threshold */
    const int Hw = 512;
    uint8_t *buf = batch((size_t)S * B * Hw * 4);
    int64_t sh[3] = {S, 3, Hw}, st[3] = {B * Hw, Hw, 1};
    loom_cuda_tview v = view(buf, 4, 3, sh, st, 2 * Hw, 0);
    loom_cuda_copy_plan plan;
    size_t total = 0;
    assert_int_equal(loom_cuda_stage_plan(&v, 1, &plan, &total), LOOM_OK);
    assert_int_equal(plan.kind, LOOM_CUDA_COPY_ROWS);
    loom_cuda_pool_config cfg = {64u << 20, 1u << 20, loom_cuda_device_events(), NULL};
    loom_cuda_pool *pool = NULL;
    assert_int_equal(loom_cuda_pool_create(&cfg, &pool), LOOM_OK);
    loom_cuda_block *blk = NULL;
    assert_int_equal(loom_cuda_pool_lease(pool, total, &blk), LOOM_OK);
    assert_int_equal(loom_cuda_stage_device(&v, &plan, 1, blk, NULL), LOOM_OK);
    assert_int_equal(calls_2d, 1);
    assert_int_equal(calls_launch, 0);
    uint8_t *want = malloc(plan.nbytes);
    reference(&v, want);
    assert_memory_equal(loom_cuda_block_data(blk), want, plan.nbytes);
    free(want);
    loom_cuda_block_end_lease(blk);
    loom_cuda_pool_release(pool);
    free(buf);
}

static void test_device_error_is_clean(void **state) {
    (void)state;
    uint8_t *buf = batch(B * S * H * 4);
    case_t c[8];
    int n = make_cases(buf, 4, 0, c);
    loom_cuda_copy_plan plans[8];
    loom_cuda_tview v[8] = {{0}};
    for (int i = 0; i < n; i++) v[i] = c[i].v;
    size_t total = 0;
    assert_int_equal(loom_cuda_stage_plan(v, (size_t)n, plans, &total), LOOM_OK);
    loom_cuda_pool_config cfg = {64u << 20, 1u << 20, loom_cuda_device_events(), NULL};
    loom_cuda_pool *pool = NULL;
    assert_int_equal(loom_cuda_pool_create(&cfg, &pool), LOOM_OK);
    loom_cuda_block *blk = NULL;
    assert_int_equal(loom_cuda_pool_lease(pool, total, &blk), LOOM_OK);
    fail_memcpy = 1;
    int le = calls_lasterror;
    assert_int_equal(loom_cuda_stage_device(v, plans, (size_t)n, blk, NULL), LOOM_ERR_CUDA);
    assert_true(calls_lasterror > le); /* sticky error cleared */
    assert_non_null(strstr(loom_last_error(), "MemcpyAsync"));
    assert_int_equal(loom_cuda_range_depth(), 0); /* ranges balanced on the error path */
    assert_int_equal(calls_malloc, calls_free);   /* scratch given back */
    /* mixed devices are refused before anything is queued */
    v[1].device = 1;
    assert_int_equal(loom_cuda_stage_device(v, plans, (size_t)n, blk, NULL), LOOM_ERR_INVALID);
    assert_int_equal(loom_cuda_range_depth(), 0);
    loom_cuda_block_end_lease(blk);
    loom_cuda_pool_release(pool);
    free(buf);
}

static void test_no_runtime(void **state) {
    (void)state;
    loom_cuda__rt_override(NULL, 0);
    setenv("NNLOOM_CUDART", "/nonexistent/libcudart.so", 1);
    /* on a machine with a GPU this resolves; without one it must say why */
    loom_status s = loom_cuda_runtime();
    if (s != LOOM_OK) {
        assert_int_equal(s, LOOM_ERR_UNAVAILABLE);
        assert_true(strlen(loom_last_error()) > 0);
        assert_null(loom_cuda_device_events());
        assert_int_equal(loom_cuda_device_count(), 0);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_kinds),
        cmocka_unit_test(test_host_bitwise),
        cmocka_unit_test_setup_teardown(test_device_bitwise, fake_setup, fake_teardown),
        cmocka_unit_test_setup_teardown(test_device_wide_rows_use_2d, fake_setup, fake_teardown),
        cmocka_unit_test_setup_teardown(test_device_error_is_clean, fake_setup, fake_teardown),
        cmocka_unit_test(test_no_runtime),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
