/* tests/c/test_base.c - status table, error detail, allocator swap, knobs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../base/base.h"

static void test_status_names(void **state) {
    (void)state;
    assert_string_equal(loom_status_name(LOOM_OK), "LOOM_OK");
    assert_string_equal(loom_status_name(LOOM_ERR_OUT_OF_ORDER), "LOOM_ERR_OUT_OF_ORDER");
    assert_string_equal(loom_status_pyclass(LOOM_ERR_MISSED), "OutOfOrderError");
    assert_string_equal(loom_status_name((loom_status)9999), "LOOM_UNKNOWN");
    for (int s = 0; s < LOOM_STATUS_COUNT; s++) assert_non_null(loom_strerror((loom_status)s));
}

static void test_last_error(void **state) {
    (void)state;
    loom_clear_error();
    assert_string_equal(loom_last_error(), "");
    assert_int_equal(loom_fail(LOOM_ERR_INVALID, "bad %d", 7), LOOM_ERR_INVALID);
    assert_string_equal(loom_last_error(), "bad 7");
}

static int n_allocs;
static void *count_malloc(size_t n) { n_allocs++; return malloc(n); }
static void *count_calloc(size_t c, size_t n) { n_allocs++; return calloc(c, n); }
static void *count_realloc(void *p, size_t n) { n_allocs++; return realloc(p, n); }

static void test_allocator_swap(void **state) {
    (void)state;
    loom_allocator a = {count_malloc, count_calloc, count_realloc, free};
    loom_set_allocator(&a);
    n_allocs = 0;
    void *p = loom_malloc(16);
    p = loom_realloc(p, 32);
    loom_free(p);
    loom_free(loom_calloc(2, 8));
    assert_int_equal(n_allocs, 3);
    loom_set_allocator(NULL);
}

static LOOM_PARAM(TestKnob, "NNLOOM_TEST_KNOB", 5)

static void test_param_cached(void **state) {
    (void)state;
    setenv("NNLOOM_TEST_KNOB", "12", 1);
    assert_int_equal(loom_param_TestKnob(), 12);
    setenv("NNLOOM_TEST_KNOB", "99", 1);
    assert_int_equal(loom_param_TestKnob(), 12); /* read once */
    assert_int_equal(loom_env_int64("NNLOOM_UNSET_FOR_TEST", -3), -3);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_names),
        cmocka_unit_test(test_last_error),
        cmocka_unit_test(test_allocator_swap),
        cmocka_unit_test(test_param_cached),
    };
    return cmocka_run_group_tests_name("base", tests, NULL, NULL);
}
