/* tests/c/test_sched.c - the scheduler's matching and state machine, no Python. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "../../interleave/interleave.h"

enum { IN = LOOM_KIND_INPUT, OUT = LOOM_KIND_OUTPUT };

static int setup(void **state) {
    loom_sched *s = NULL;
    assert_int_equal(loom_sched_create(8, 3, 6, &s), LOOM_OK);
    *state = s;
    return 0;
}

static int teardown(void **state) {
    loom_sched_destroy(*state);
    return 0;
}

/* Run one boundary, serving waiters; returns how many were served and writes
 * their indices to `order`. */
static int boundary(loom_sched *s, int32_t m, int32_t k, int32_t *order) {
    int n = 0;
    int32_t c = loom_sched_begin(s, m, k);
    for (int32_t i = loom_sched_next_waiter(s, m, k, c, 0); i >= 0;
         i = loom_sched_next_waiter(s, m, k, c, i + 1)) {
        assert_int_equal(loom_sched_serve(s, i), LOOM_OK);
        if (order) order[n] = i;
        n++;
    }
    loom_sched_end(s, m, k);
    return n;
}

static void test_request_then_serve(void **state) {
    loom_sched *s = *state;
    loom_key key;
    assert_int_equal(loom_sched_set_state(s, 0, LOOM_MED_RUNNING), LOOM_OK);
    assert_int_equal(loom_sched_request(s, 0, 3, OUT, &key), LOOM_OK);
    assert_int_equal(key.module, 3);
    assert_int_equal(key.kind, OUT);
    assert_int_equal(key.call, 0);
    assert_int_equal(loom_sched_state(s, 0), LOOM_MED_WAITING);
    assert_true(loom_sched_has_waiters(s, 3, OUT));
    assert_false(loom_sched_has_waiters(s, 3, IN));
    assert_false(loom_sched_has_waiters(s, 2, OUT));
    /* modules before it pass untouched */
    assert_int_equal(boundary(s, 2, OUT, NULL), 0);
    assert_int_equal(boundary(s, 3, IN, NULL), 0);
    int32_t order[3];
    assert_int_equal(boundary(s, 3, OUT, order), 1);
    assert_int_equal(order[0], 0);
    assert_int_equal(loom_sched_state(s, 0), LOOM_MED_SERVED);
    assert_false(loom_sched_has_waiters(s, 3, OUT));
    assert_int_equal(loom_sched_calls(s, 3, OUT), 1);
    assert_int_equal(loom_sched_unserve(s, 0), LOOM_OK);
    assert_int_equal(loom_sched_state(s, 0), LOOM_MED_RUNNING);
}

static void test_out_of_order(void **state) {
    loom_sched *s = *state;
    loom_key key;
    loom_sched_set_state(s, 0, LOOM_MED_RUNNING);
    assert_int_equal(loom_sched_request(s, 0, 5, OUT, &key), LOOM_OK);
    for (int m = 0; m < 5; m++) {
        boundary(s, m, IN, NULL);
        boundary(s, m, OUT, NULL);
    }
    boundary(s, 5, IN, NULL);
    assert_int_equal(boundary(s, 5, OUT, NULL), 1);
    /* now ask for layer 2, which already ran */
    assert_int_equal(loom_sched_request(s, 0, 2, OUT, &key), LOOM_ERR_OUT_OF_ORDER);
    assert_int_equal(key.module, 2);
    assert_int_equal(key.call, 0);
    assert_int_equal(loom_sched_state(s, 0), LOOM_MED_SERVED); /* unchanged */
    /* the input of the module being served already passed too */
    assert_int_equal(loom_sched_request(s, 0, 5, IN, &key), LOOM_ERR_OUT_OF_ORDER);
    /* a later module is fine */
    assert_int_equal(loom_sched_request(s, 0, 6, IN, &key), LOOM_OK);
}

static void test_occurrences(void **state) {
    loom_sched *s = *state;
    loom_key key;
    loom_sched_set_state(s, 1, LOOM_MED_RUNNING);
    assert_int_equal(loom_sched_request(s, 1, 4, OUT, &key), LOOM_OK);
    assert_int_equal(key.call, 0);
    assert_int_equal(boundary(s, 4, OUT, NULL), 1);
    /* the same module again: the next occurrence */
    assert_int_equal(loom_sched_request(s, 1, 4, OUT, &key), LOOM_OK);
    assert_int_equal(key.call, 1);
    assert_int_equal(boundary(s, 4, OUT, NULL), 1);
    assert_int_equal(loom_sched_calls(s, 4, OUT), 2);
    /* a request of occurrence 2 that never comes is missed */
    assert_int_equal(loom_sched_request(s, 1, 4, OUT, &key), LOOM_OK);
    assert_int_equal(key.call, 2);
    assert_int_equal(loom_sched_next_missed(s, 0), 1);
    assert_int_equal(loom_sched_cancel(s, 1), LOOM_OK);
    assert_int_equal(loom_sched_next_missed(s, 0), -1);
    assert_false(loom_sched_has_waiters(s, 4, OUT));
}

static void test_pin(void **state) {
    loom_sched *s = *state;
    loom_key key;
    loom_sched_set_state(s, 0, LOOM_MED_RUNNING);
    assert_int_equal(loom_sched_pin(s, 0, 1, OUT, 3), LOOM_OK);
    assert_int_equal(loom_sched_request(s, 0, 1, OUT, &key), LOOM_OK);
    assert_int_equal(key.call, 3);
    for (int i = 0; i < 3; i++) assert_int_equal(boundary(s, 1, OUT, NULL), 0);
    assert_int_equal(boundary(s, 1, OUT, NULL), 1);
}

static void test_iteration(void **state) {
    loom_sched *s = *state;
    loom_key key;
    loom_sched_set_state(s, 0, LOOM_MED_RUNNING);
    for (int step = 0; step < 3; step++) {
        assert_int_equal(loom_sched_set_iteration(s, 0, step), LOOM_OK);
        /* a boundary never touched before also starts at the iteration */
        assert_int_equal(loom_sched_request(s, 0, step == 2 ? 5 : 2, OUT, &key), LOOM_OK);
        assert_int_equal(key.call, step == 2 ? 2 : step);
        if (step < 2) {
            assert_int_equal(boundary(s, 2, OUT, NULL), 1);
        }
    }
    assert_int_equal(loom_sched_cancel(s, 0), LOOM_OK);
    /* going back to a step that passed is out of order */
    assert_int_equal(loom_sched_set_iteration(s, 0, 0), LOOM_OK);
    assert_int_equal(loom_sched_request(s, 0, 2, OUT, &key), LOOM_ERR_OUT_OF_ORDER);
    assert_int_equal(loom_sched_set_iteration(s, 0, -1), LOOM_ERR_INVALID);
}

static void test_serve_in_invoke_order(void **state) {
    loom_sched *s = *state;
    loom_key key;
    for (int i = 0; i < 3; i++) loom_sched_set_state(s, i, LOOM_MED_RUNNING);
    /* requests arrive 2, 0, 1 */
    assert_int_equal(loom_sched_request(s, 2, 6, OUT, &key), LOOM_OK);
    assert_int_equal(loom_sched_request(s, 0, 6, OUT, &key), LOOM_OK);
    assert_int_equal(loom_sched_request(s, 1, 6, OUT, &key), LOOM_OK);
    int32_t order[3];
    assert_int_equal(boundary(s, 6, OUT, order), 3);
    assert_int_equal(order[0], 0);
    assert_int_equal(order[1], 1);
    assert_int_equal(order[2], 2);
}

static void test_states(void **state) {
    loom_sched *s = *state;
    loom_key key;
    /* requesting before starting is a state error */
    assert_int_equal(loom_sched_request(s, 0, 1, OUT, &key), LOOM_ERR_STATE);
    assert_int_equal(loom_sched_set_state(s, 0, LOOM_MED_RUNNING), LOOM_OK);
    assert_int_equal(loom_sched_set_state(s, 0, LOOM_MED_RUNNING), LOOM_ERR_STATE);
    assert_int_equal(loom_sched_request(s, 0, 1, OUT, &key), LOOM_OK);
    /* finishing while waiting drops the waiter count */
    assert_int_equal(loom_sched_set_state(s, 0, LOOM_MED_STOPPED), LOOM_OK);
    assert_false(loom_sched_has_waiters(s, 1, OUT));
    assert_int_equal(loom_sched_set_state(s, 0, LOOM_MED_DONE), LOOM_ERR_STATE);
    assert_int_equal(loom_sched_serve(s, 1), LOOM_ERR_STATE); /* not waiting */
    assert_int_equal(loom_sched_cancel(s, 1), LOOM_ERR_STATE);
    assert_int_equal(loom_sched_unserve(s, 1), LOOM_ERR_STATE);
    /* bad indices */
    assert_int_equal(loom_sched_request(s, 7, 1, OUT, &key), LOOM_ERR_INVALID);
    loom_sched_set_state(s, 1, LOOM_MED_RUNNING);
    assert_int_equal(loom_sched_request(s, 1, 8, OUT, &key), LOOM_ERR_INVALID);
    assert_int_equal(loom_sched_request(s, 1, 1, 2, &key), LOOM_ERR_INVALID);
}

static void test_rows(void **state) {
    loom_sched *s = *state; /* batch of 6 */
    int64_t lo = -1, len = -1;
    /* default: whole batch, never narrowed */
    assert_true(loom_sched_is_whole(s, 0));
    assert_false(loom_sched_rows_for(s, 0, 6, &lo, &len));
    assert_int_equal(loom_sched_set_rows(s, 0, 0, 6), LOOM_OK);
    assert_false(loom_sched_rows_for(s, 0, 6, &lo, &len));
    assert_int_equal(loom_sched_set_rows(s, 1, 2, 3), LOOM_OK);
    assert_false(loom_sched_is_whole(s, 1));
    assert_true(loom_sched_rows_for(s, 1, 6, &lo, &len));
    assert_int_equal(lo, 2);
    assert_int_equal(len, 3);
    /* flattened batch*seq: k = 4 */
    assert_true(loom_sched_rows_for(s, 1, 24, &lo, &len));
    assert_int_equal(lo, 8);
    assert_int_equal(len, 12);
    /* not a multiple: passed whole */
    assert_false(loom_sched_rows_for(s, 1, 7, &lo, &len));
    assert_false(loom_sched_rows_for(s, 1, 0, &lo, &len));
    /* out of range groups are refused */
    assert_int_equal(loom_sched_set_rows(s, 2, 5, 2), LOOM_ERR_INVALID);
    assert_int_equal(loom_sched_set_rows(s, 2, -1, 2), LOOM_ERR_INVALID);
}

/* allocation failure: every allocation point returns NOMEM and leaks nothing */
static int fail_after, allocs_live;
static void *f_malloc(size_t n) {
    if (fail_after-- <= 0) return NULL;
    allocs_live++;
    return malloc(n);
}
static void *f_calloc(size_t c, size_t n) {
    if (fail_after-- <= 0) return NULL;
    allocs_live++;
    return calloc(c, n);
}
static void *f_realloc(void *p, size_t n) {
    if (fail_after-- <= 0) return NULL;
    if (p == NULL) allocs_live++;
    return realloc(p, n);
}
static void f_free(void *p) {
    if (p != NULL) allocs_live--;
    free(p);
}

static void test_nomem(void **state) {
    (void)state;
    loom_allocator a = {f_malloc, f_calloc, f_realloc, f_free};
    loom_set_allocator(&a);
    for (int k = 0; k < 3; k++) {
        loom_sched *s = (loom_sched *)0x1;
        fail_after = k;
        allocs_live = 0;
        assert_int_equal(loom_sched_create(4, 2, 2, &s), LOOM_ERR_NOMEM);
        assert_null(s);
        assert_int_equal(allocs_live, 0);
    }
    /* the request table's growth fails cleanly */
    loom_sched *s = NULL;
    fail_after = 3;
    allocs_live = 0;
    assert_int_equal(loom_sched_create(4, 2, 2, &s), LOOM_OK);
    loom_sched_set_state(s, 0, LOOM_MED_RUNNING);
    loom_key key;
    assert_int_equal(loom_sched_request(s, 0, 1, OUT, &key), LOOM_ERR_NOMEM);
    assert_int_equal(loom_sched_state(s, 0), LOOM_MED_RUNNING);
    loom_sched_destroy(s);
    assert_int_equal(allocs_live, 0);
    loom_set_allocator(NULL);
    assert_int_equal(loom_sched_create(-1, 2, 2, &s), LOOM_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_request_then_serve, setup, teardown),
        cmocka_unit_test_setup_teardown(test_out_of_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_occurrences, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pin, setup, teardown),
        cmocka_unit_test_setup_teardown(test_iteration, setup, teardown),
        cmocka_unit_test_setup_teardown(test_serve_in_invoke_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_states, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rows, setup, teardown),
        cmocka_unit_test(test_nomem),
    };
    return cmocka_run_group_tests_name("sched", tests, NULL, NULL);
}
