/* tests/c/test_collect_arena.c - the arena's bookkeeping in one process: two
 * handles on one region (reader creates, writer attaches), segment states,
 * pins, timeouts, and a dead peer (a forked child that exits). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../collect/collect.h"

typedef struct {
    loom_collect_arena *r, *w;
} pair;

static int setup(void **state) {
    pair *p = calloc(1, sizeof *p);
    assert_int_equal(loom_collect_arena_create(NULL, 2, 100, false, &p->r), LOOM_OK);
    assert_int_equal(loom_collect_arena_attach(loom_collect_arena_name(p->r), &p->w), LOOM_OK);
    *state = p;
    return 0;
}

static int teardown(void **state) {
    pair *p = *state;
    char name[64];
    snprintf(name, sizeof name, "/dev/shm%s", loom_collect_arena_name(p->r));
    loom_collect_arena_close(p->w);
    loom_collect_arena_close(p->r);
    assert_int_equal(access(name, F_OK), -1); /* unlinked */
    free(p);
    return 0;
}

static void test_round_trip(void **state) {
    pair *p = *state;
    assert_int_equal(loom_collect_arena_slot_size(p->r), 4096); /* rounded to pages */
    uint64_t o1, o2, span, got, n;
    assert_int_equal(loom_collect_arena_write(p->w, "hello", 5, 0.1, &o1), LOOM_OK);
    assert_int_equal(loom_collect_arena_write(p->w, "world", 5, 0.1, &o2), LOOM_OK);
    assert_int_equal(o2, o1 + 5);
    assert_int_equal(loom_collect_arena_commit(p->w, 0.1, &span), LOOM_OK);
    assert_int_equal(loom_collect_arena_next_unit(p->r, 0.1, &got, &n), LOOM_OK);
    assert_int_equal(got, span);
    assert_int_equal(n, 10);
    void *ptr;
    uint64_t s2;
    assert_int_equal(loom_collect_arena_locate(p->r, o2, 5, &ptr, &s2), LOOM_OK);
    assert_memory_equal(ptr, "world", 5);
    assert_int_equal(loom_collect_arena_locate(p->r, o2, 6, &ptr, &s2), LOOM_ERR_INVALID);
    assert_int_equal(loom_collect_arena_free_slots(p->r), 1);
    assert_int_equal(loom_collect_arena_end_unit(p->r, span), LOOM_OK);
    assert_int_equal(loom_collect_arena_free_slots(p->r), 2);
}

static void test_pins_delay_reuse(void **state) {
    pair *p = *state;
    uint64_t off, span, got, n;
    assert_int_equal(loom_collect_arena_write(p->w, "a", 1, 0.1, &off), LOOM_OK);
    assert_int_equal(loom_collect_arena_commit(p->w, 0.1, &span), LOOM_OK);
    assert_int_equal(loom_collect_arena_next_unit(p->r, 0.1, &got, &n), LOOM_OK);
    assert_int_equal(loom_collect_arena_pin(p->r, span), LOOM_OK);
    assert_int_equal(loom_collect_arena_pin(p->r, span), LOOM_OK);
    assert_int_equal(loom_collect_arena_end_unit(p->r, span), LOOM_OK);
    assert_int_equal(loom_collect_arena_end_unit(p->r, span), LOOM_ERR_STATE);
    loom_collect_arena_unpin(p->r, span);
    assert_int_equal(loom_collect_arena_free_slots(p->r), 1);
    loom_collect_arena_unpin(p->r, span);
    assert_int_equal(loom_collect_arena_free_slots(p->r), 2);
}

static void test_full_times_out_and_never_overwrites(void **state) {
    pair *p = *state;
    uint64_t off, span;
    for (int i = 0; i < 2; i++) {
        assert_int_equal(loom_collect_arena_write(p->w, "x", 1, 0.1, &off), LOOM_OK);
        assert_int_equal(loom_collect_arena_commit(p->w, 0.1, &span), LOOM_OK);
    }
    loom_clear_error();
    assert_int_equal(loom_collect_arena_write(p->w, "y", 1, 0.05, &off), LOOM_ERR_TIMEOUT);
    assert_non_null(strstr(loom_last_error(), "full: no free segment after 0.05 s"));
    char big[5000] = {0};
    uint64_t got, n;
    assert_int_equal(loom_collect_arena_next_unit(p->r, 0.1, &got, &n), LOOM_OK);
    assert_int_equal(loom_collect_arena_end_unit(p->r, got), LOOM_OK);
    assert_int_equal(loom_collect_arena_write(p->w, big, sizeof big, 0.1, &off), LOOM_ERR_FULL);
}

static void test_ring_order(void **state) {
    (void)state;
    loom_collect_arena *r, *w;
    assert_int_equal(loom_collect_arena_create(NULL, 3, 4096, true, &r), LOOM_OK);
    assert_true(loom_collect_arena_is_ring(r));
    assert_int_equal(loom_collect_arena_attach(loom_collect_arena_name(r), &w), LOOM_OK);
    uint64_t off, span, got, n;
    for (uint64_t i = 0; i < 5; i++) {
        assert_int_equal(loom_collect_arena_write(w, "r", 1, 0.1, &off), LOOM_OK);
        assert_int_equal(loom_collect_arena_commit(w, 0.1, &span), LOOM_OK);
        assert_int_equal(span, i % 3);
        assert_int_equal(loom_collect_arena_next_unit(r, 0.1, &got, &n), LOOM_OK);
        assert_int_equal(got, span);
        assert_int_equal(loom_collect_arena_end_unit(r, got), LOOM_OK);
    }
    loom_collect_arena_close(w);
    loom_collect_arena_close(r);
}

static void test_dead_writer(void **state) {
    pair *p = *state;
    pid_t child = fork();
    if (child == 0) {
        loom_collect_arena *w;
        _exit(loom_collect_arena_attach(loom_collect_arena_name(p->r), &w) == LOOM_OK ? 0 : 1);
    }
    int status;
    waitpid(child, &status, 0);
    assert_int_equal(WEXITSTATUS(status), 0);
    uint64_t got, n;
    loom_clear_error();
    assert_int_equal(loom_collect_arena_next_unit(p->r, 5.0, &got, &n), LOOM_ERR_STATE);
    assert_non_null(strstr(loom_last_error(), "the writer"));
}

static void test_bad_arguments(void **state) {
    (void)state;
    loom_collect_arena *a = NULL;
    assert_int_equal(loom_collect_arena_create(NULL, 0, 4096, false, &a), LOOM_ERR_INVALID);
    assert_int_equal(loom_collect_arena_create("no-slash", 1, 4096, false, &a), LOOM_ERR_INVALID);
    assert_int_equal(loom_collect_arena_attach("/nnloom-does-not-exist", &a), LOOM_ERR_STATE);
    assert_null(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pins_delay_reuse, setup, teardown),
        cmocka_unit_test_setup_teardown(test_full_times_out_and_never_overwrites, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dead_writer, setup, teardown),
        cmocka_unit_test(test_ring_order),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
