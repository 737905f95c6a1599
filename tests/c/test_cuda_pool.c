/* tests/c/test_cuda_pool.c - the pinned pool with a fake event source and a
 * counting pinner: classes, reuse, waiting on events, exports, the bound,
 * deferred callbacks, pool lifetime, allocation failures. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../cuda/device.h"

/* ---- fake events: done only when the test says so ---- */
#define MAX_FAKE 1024
static int fake_done[MAX_FAKE + 1]; /* by id */
static int fake_next = 1, fake_live;

static loom_status f_record(void *ctx, void *stream, void **ev) {
    (void)ctx, (void)stream;
    if (fake_next > MAX_FAKE) return loom_fail(LOOM_ERR_FULL, "fake events exhausted");
    fake_done[fake_next] = 0;
    *ev = (void *)(intptr_t)fake_next++;
    fake_live++;
    return LOOM_OK;
}
static int f_query(void *ctx, void *ev) { return (void)ctx, fake_done[(intptr_t)ev]; }
static loom_status f_wait(void *ctx, void *ev) {
    (void)ctx;
    fake_done[(intptr_t)ev] = 1; /* "the device caught up" */
    return LOOM_OK;
}
static void f_release(void *ctx, void *ev) { (void)ctx, (void)ev, fake_live--; }
static const loom_cuda_event_source fake = {NULL, f_record, f_query, f_wait, f_release};
static void complete(intptr_t id) { fake_done[id] = 1; }
static void complete_all(void) {
    for (int i = 1; i < fake_next; i++) fake_done[i] = 1;
}

/* ---- pinner that counts ---- */
static int pins, unpins;
static size_t pinned_bytes;
static loom_status p_pin(void *ctx, void *p, size_t n) {
    (void)ctx, (void)p;
    pins++;
    pinned_bytes += n;
    return LOOM_OK;
}
static void p_unpin(void *ctx, void *p, size_t n) {
    (void)ctx, (void)p;
    unpins++;
    pinned_bytes -= n;
}
static const loom_cuda_pinner pinner = {NULL, p_pin, p_unpin};

static loom_cuda_pool *make_pool(size_t limit, size_t slab) {
    loom_cuda_pool_config cfg = {limit, slab, &fake, &pinner};
    loom_cuda_pool *p = NULL;
    assert_int_equal(loom_cuda_pool_create(&cfg, &p), LOOM_OK);
    return p;
}

static int setup(void **state) {
    (void)state;
    pins = unpins = 0;
    pinned_bytes = 0;
    fake_live = 0;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    /* every pool destroyed: everything unpinned, every event given back */
    assert_int_equal(pins, unpins);
    assert_int_equal(pinned_bytes, 0);
    assert_int_equal(fake_live, 0);
    return 0;
}

static loom_cuda_pool_stats stats(loom_cuda_pool *p) {
    loom_cuda_pool_stats s;
    loom_cuda_pool_stats_get(p, &s);
    return s;
}

static void test_classes(void **state) {
    (void)state;
    assert_int_equal(loom_cuda_class_bytes(1), 4096);
    assert_int_equal(loom_cuda_class_bytes(4096), 4096);
    assert_int_equal(loom_cuda_class_bytes(4097), 8192);
    assert_int_equal(loom_cuda_class_bytes(3u << 20), 4u << 20);
    assert_int_equal(loom_cuda_class_bytes(0), 0);
}

static void test_lease_reuse(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 1u << 20);
    loom_cuda_block *a = NULL, *b = NULL;
    assert_int_equal(loom_cuda_pool_lease(p, 5000, &a), LOOM_OK);
    assert_int_equal(loom_cuda_block_size(a), 8192);
    assert_int_equal((uintptr_t)loom_cuda_block_data(a) % 4096, 0);
    memset(loom_cuda_block_data(a), 0xab, 5000); /* writable */
    size_t off = 0;
    int fd = loom_cuda_block_shm(a, &off);
    assert_true(fd >= -1);
    loom_cuda_pool_stats s = stats(p);
    assert_int_equal(s.bytes_pinned, 1u << 20);
    assert_int_equal(s.bytes_leased, 8192);
    assert_int_equal(s.leases_live, 1);
    assert_int_equal(pins, 1);
    void *ptr = loom_cuda_block_data(a);
    loom_cuda_block_end_lease(a);
    s = stats(p);
    assert_int_equal(s.bytes_leased, 0);
    assert_int_equal(s.bytes_free, 8192);
    assert_int_equal(loom_cuda_pool_lease(p, 8000, &b), LOOM_OK); /* same class: reused */
    assert_ptr_equal(loom_cuda_block_data(b), ptr);
    assert_int_equal(stats(p).reuses, 1);
    loom_cuda_block_end_lease(b);
    assert_int_equal(stats(p).slabs, 1); /* nothing new was pinned */
    loom_cuda_pool_release(p);
}

static void test_big_block_own_slab(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 1u << 20);
    loom_cuda_block *a = NULL;
    assert_int_equal(loom_cuda_pool_lease(p, 3u << 20, &a), LOOM_OK);
    assert_int_equal(loom_cuda_block_size(a), 4u << 20);
    assert_int_equal(stats(p).bytes_pinned, 4u << 20);
    loom_cuda_block_end_lease(a);
    loom_cuda_pool_release(p);
    assert_int_equal(unpins, 1);
}

static void test_slab_tail_not_wasted(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 64u << 10); /* 64 KiB slabs */
    loom_cuda_block *a, *b;
    assert_int_equal(loom_cuda_pool_lease(p, 40u << 10, &a), LOOM_OK); /* 64 KiB class? no: 64K */
    assert_int_equal(loom_cuda_block_size(a), 64u << 10); /* a slab of its own */
    assert_int_equal(loom_cuda_pool_lease(p, 20u << 10, &b), LOOM_OK); /* 32 KiB from a slab */
    loom_cuda_block *c;
    assert_int_equal(loom_cuda_pool_lease(p, 20u << 10, &c), LOOM_OK); /* the other half */
    assert_int_equal(stats(p).slabs, 2);
    loom_cuda_block *d;
    assert_int_equal(loom_cuda_pool_lease(p, 16u << 10, &d), LOOM_OK); /* new slab */
    loom_cuda_block *e;
    assert_int_equal(loom_cuda_pool_lease(p, 32u << 10, &e), LOOM_OK); /* 48 KiB left: fits */
    assert_int_equal(stats(p).slabs, 3);
    loom_cuda_block *f;
    assert_int_equal(loom_cuda_pool_lease(p, 32u << 10, &f), LOOM_OK); /* 16 KiB tail freed */
    loom_cuda_pool_stats s = stats(p);
    assert_int_equal(s.slabs, 4);
    assert_int_equal(s.bytes_free, 16u << 10); /* the old tail became a free block */
    loom_cuda_block *g;
    assert_int_equal(loom_cuda_pool_lease(p, 10u << 10, &g), LOOM_OK); /* 16 KiB: the tail */
    assert_int_equal(stats(p).reuses, 1);
    loom_cuda_block *all[] = {a, b, c, d, e, f, g};
    for (int i = 0; i < 7; i++) loom_cuda_block_end_lease(all[i]);
    loom_cuda_pool_release(p);
}

static void test_waits_for_events(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 1u << 20);
    loom_cuda_block *a = NULL, *b = NULL, *c = NULL;
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &a), LOOM_OK);
    int first = fake_next;
    assert_int_equal(loom_cuda_block_record(a, (void *)0x10), LOOM_OK);
    assert_int_equal(loom_cuda_block_record(a, (void *)0x20), LOOM_OK);
    assert_int_equal(loom_cuda_block_ready(a), 0);
    void *ptr = loom_cuda_block_data(a);
    loom_cuda_block_end_lease(a);
    loom_cuda_pool_stats s = stats(p);
    assert_int_equal(s.bytes_waiting, 4096);
    assert_int_equal(s.bytes_leased, 0);
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &b), LOOM_OK); /* not reused: pending */
    assert_ptr_not_equal(loom_cuda_block_data(b), ptr);
    complete(first); /* one stream done, the other not */
    assert_int_equal(loom_cuda_pool_reclaim(p), 0);
    complete(first + 1);
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &c), LOOM_OK); /* reclaimed on lease */
    assert_ptr_equal(loom_cuda_block_data(c), ptr);
    assert_int_equal(stats(p).bytes_waiting, 0);
    loom_cuda_block_end_lease(b);
    loom_cuda_block_end_lease(c);
    loom_cuda_pool_release(p);
}

static void test_same_stream_replaces(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 1u << 20);
    loom_cuda_block *a = NULL;
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &a), LOOM_OK);
    int live0 = fake_live;
    for (int i = 0; i < 10; i++) assert_int_equal(loom_cuda_block_record(a, (void *)0x10), LOOM_OK);
    assert_int_equal(fake_live, live0 + 1); /* one marker per stream */
    for (int s = 2; s <= LOOM_CUDA_BLOCK_STREAMS; s++)
        assert_int_equal(loom_cuda_block_record(a, (void *)(intptr_t)(0x10 * s)), LOOM_OK);
    assert_int_equal(loom_cuda_block_record(a, (void *)0x999), LOOM_ERR_FULL);
    complete_all();
    assert_int_equal(loom_cuda_block_record(a, (void *)0x999), LOOM_OK); /* done ones dropped */
    assert_int_equal(loom_cuda_block_wait(a), LOOM_OK);
    assert_int_equal(loom_cuda_block_ready(a), 1);
    loom_cuda_block_end_lease(a);
    loom_cuda_pool_release(p);
}

static void test_exports_hold(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 1u << 20);
    loom_cuda_block *a = NULL, *b = NULL;
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &a), LOOM_OK);
    void *ptr = loom_cuda_block_data(a);
    loom_cuda_block_export(a);
    loom_cuda_block_export(a);
    loom_cuda_block_end_lease(a);
    loom_cuda_pool_stats s = stats(p);
    assert_int_equal(s.bytes_leased, 4096); /* exports still hold it */
    assert_int_equal(s.exports_live, 2);
    assert_int_equal(s.leases_live, 0);
    loom_cuda_block_unexport(a);
    assert_int_equal(stats(p).bytes_free, 0);
    assert_int_equal(loom_cuda_block_record(a, (void *)0x10), LOOM_OK);
    loom_cuda_block_unexport(a); /* last holder, but the stream is pending */
    s = stats(p);
    assert_int_equal(s.bytes_waiting, 4096);
    assert_int_equal(s.exports_live, 0);
    complete_all();
    assert_int_equal(loom_cuda_pool_reclaim(p), 1);
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &b), LOOM_OK);
    assert_ptr_equal(loom_cuda_block_data(b), ptr);
    loom_cuda_block_end_lease(b);
    loom_cuda_pool_release(p);
}

static void test_bound(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(2u << 20, 1u << 20); /* two slabs at most */
    loom_cuda_block *a, *b, *c;
    assert_int_equal(loom_cuda_pool_lease(p, 1u << 20, &a), LOOM_OK);
    assert_int_equal(loom_cuda_pool_lease(p, 1u << 20, &b), LOOM_OK);
    loom_clear_error();
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &c), LOOM_ERR_FULL);
    assert_non_null(strstr(loom_last_error(), "limit"));
    assert_null(c);
    assert_int_equal(stats(p).bytes_pinned, 2u << 20); /* never past the bound */
    assert_int_equal(loom_cuda_block_record(a, (void *)0x10), LOOM_OK);
    loom_cuda_block_end_lease(a); /* waiting: still not leasable */
    assert_int_equal(loom_cuda_pool_lease(p, 1u << 20, &c), LOOM_ERR_FULL);
    complete_all(); /* the lease's reclaim finds it */
    assert_int_equal(loom_cuda_pool_lease(p, 1u << 20, &c), LOOM_OK);
    assert_int_equal(loom_cuda_pool_lease(p, 0, &a), LOOM_ERR_INVALID);
    loom_cuda_block_end_lease(b);
    loom_cuda_block_end_lease(c);
    loom_cuda_pool_release(p);
}

static int deferred_runs;
static void on_done(void *arg) { deferred_runs += (int)(intptr_t)arg; }

static void test_defer(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 1u << 20);
    loom_cuda_block *a = NULL;
    deferred_runs = 0;
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &a), LOOM_OK);
    assert_int_equal(loom_cuda_block_defer(a, on_done, (void *)1), LOOM_OK);
    assert_int_equal(deferred_runs, 1); /* nothing pending: ran at once */
    assert_int_equal(loom_cuda_block_record(a, (void *)0x10), LOOM_OK);
    assert_int_equal(loom_cuda_block_defer(a, on_done, (void *)10), LOOM_OK);
    assert_int_equal(deferred_runs, 1);
    loom_cuda_block_end_lease(a); /* waiting */
    assert_int_equal(loom_cuda_pool_reclaim(p), 0);
    assert_int_equal(deferred_runs, 1);
    complete_all();
    assert_int_equal(loom_cuda_pool_reclaim(p), 1);
    assert_int_equal(deferred_runs, 11); /* exactly once */
    assert_int_equal(loom_cuda_pool_reclaim(p), 0);
    assert_int_equal(deferred_runs, 11);
    loom_cuda_pool_release(p);
}

static void test_pool_outlives_holders(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 1u << 20);
    loom_cuda_block *a = NULL;
    deferred_runs = 0;
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &a), LOOM_OK);
    loom_cuda_block_export(a);
    loom_cuda_pool_release(p); /* owner gone; the block keeps it */
    assert_int_equal(unpins, 0);
    memset(loom_cuda_block_data(a), 1, 4096);
    loom_cuda_block_end_lease(a);
    assert_int_equal(unpins, 0);
    assert_int_equal(loom_cuda_block_record(a, (void *)0x10), LOOM_OK);
    assert_int_equal(loom_cuda_block_defer(a, on_done, (void *)1), LOOM_OK);
    loom_cuda_block_unexport(a); /* last: pool destroyed, pending event waited */
    assert_int_equal(unpins, 1);
    assert_int_equal(deferred_runs, 1);
}

static int fail_after;
static void *failing_calloc(size_t c, size_t n) { return fail_after-- > 0 ? calloc(c, n) : NULL; }
static void *plain_malloc(size_t n) { return malloc(n); }
static void *plain_realloc(void *p, size_t n) { return realloc(p, n); }

static void test_nomem(void **state) {
    (void)state;
    loom_cuda_pool *p = make_pool(64u << 20, 1u << 20);
    loom_allocator a = {plain_malloc, failing_calloc, plain_realloc, free};
    loom_cuda_block *b = NULL;
    fail_after = 0; /* slab record fails */
    loom_set_allocator(&a);
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &b), LOOM_ERR_NOMEM);
    fail_after = 1; /* slab ok, block record fails: slab kept for later */
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &b), LOOM_ERR_NOMEM);
    loom_set_allocator(NULL);
    assert_int_equal(loom_cuda_pool_lease(p, 4096, &b), LOOM_OK);
    loom_cuda_pool_stats s = stats(p);
    assert_int_equal(s.slabs, 1);
    assert_int_equal(s.leases_live, 1);
    loom_cuda_block_end_lease(b);
    loom_cuda_pool_release(p);
}

static void test_cpu_events(void **state) {
    (void)state;
    loom_cuda_pool *p = NULL;
    assert_int_equal(loom_cuda_pool_create(NULL, &p), LOOM_OK); /* env defaults, CPU events */
    loom_cuda_block *a = NULL;
    assert_int_equal(loom_cuda_pool_lease(p, 100, &a), LOOM_OK);
    assert_int_equal(loom_cuda_block_record(a, (void *)0x10), LOOM_OK);
    assert_int_equal(loom_cuda_block_ready(a), 1);
    loom_cuda_block_end_lease(a);
    loom_cuda_pool_stats s = stats(p);
    assert_int_equal(s.bytes_waiting, 0);
    assert_int_equal(s.limit_bytes, (uint64_t)4096 << 20);
    loom_cuda_pool_release(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_classes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lease_reuse, setup, teardown),
        cmocka_unit_test_setup_teardown(test_big_block_own_slab, setup, teardown),
        cmocka_unit_test_setup_teardown(test_slab_tail_not_wasted, setup, teardown),
        cmocka_unit_test_setup_teardown(test_waits_for_events, setup, teardown),
        cmocka_unit_test_setup_teardown(test_same_stream_replaces, setup, teardown),
        cmocka_unit_test_setup_teardown(test_exports_hold, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bound, setup, teardown),
        cmocka_unit_test_setup_teardown(test_defer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pool_outlives_holders, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nomem, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cpu_events, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
