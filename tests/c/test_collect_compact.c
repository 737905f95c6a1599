/* tests/c/test_collect_compact.c - the compact copy of strided views and the
 * density test that decides when no copy is needed (collect/compact.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../collect/collect.h"

/* Reference gather: element by element through the strides. */
static void naive(uint8_t *dst, const uint8_t *src, const loom_collect_layout *l) {
    int64_t idx[LOOM_COLLECT_MAX_DIMS] = {0};
    int64_t n = loom_collect_numel(l);
    for (int64_t e = 0; e < n; e++) {
        int64_t off = 0;
        for (int d = 0; d < l->ndim; d++) off += idx[d] * l->stride[d];
        memcpy(dst + e * (int64_t)l->itemsize, src + off * (int64_t)l->itemsize, l->itemsize);
        for (int d = l->ndim - 1; d >= 0; d--) {
            if (++idx[d] < l->shape[d]) break;
            idx[d] = 0;
        }
    }
}

static uint8_t *pattern(size_t n) {
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(i * 131u + 7u);
    return p;
}

static void check_copy(int ndim, const int64_t *shape, const int64_t *stride, size_t itemsize,
                       size_t src_elems) {
    loom_collect_layout l = {ndim, shape, stride, itemsize};
    size_t n = (size_t)loom_collect_numel(&l) * itemsize;
    uint8_t *src = pattern(src_elems * itemsize);
    uint8_t *got = malloc(n + 1), *want = malloc(n + 1);
    assert_int_equal(loom_collect_compact_copy(got, n, src, &l), LOOM_OK);
    naive(want, src, &l);
    assert_memory_equal(got, want, n);
    free(src);
    free(got);
    free(want);
}

static void test_row_of_batch(void **state) {
    (void)state;
    /* x[3] of a [8, 4, 6] float32 batch: one dense block */
    int64_t shape[] = {4, 6}, stride[] = {6, 1};
    loom_collect_layout l = {2, shape, stride, 4};
    assert_true(loom_collect_is_dense(&l));
    check_copy(2, shape, stride, 4, 24);
}

static void test_column_slice(void **state) {
    (void)state;
    int64_t shape[] = {5, 3}, stride[] = {8, 1}; /* x[:, 2:5] of [5, 8] */
    loom_collect_layout l = {2, shape, stride, 2};
    assert_false(loom_collect_is_dense(&l));
    check_copy(2, shape, stride, 2, 40);
}

static void test_every_other_element(void **state) {
    (void)state;
    for (size_t isz = 1; isz <= 16; isz *= 2) {
        int64_t shape[] = {3, 4, 5}, stride[] = {60, 10, 2}; /* [..., ::2] */
        loom_collect_layout l = {3, shape, stride, isz};
        assert_false(loom_collect_is_dense(&l));
        check_copy(3, shape, stride, isz, 180);
    }
    int64_t shape[] = {7}, stride[] = {3}; /* odd itemsize takes the generic loop */
    check_copy(1, shape, stride, 3, 21);
}

static void test_transposed_is_dense(void **state) {
    (void)state;
    int64_t shape[] = {4, 3}, stride[] = {1, 4}; /* .t() of [3, 4] */
    loom_collect_layout l = {2, shape, stride, 4};
    assert_true(loom_collect_is_dense(&l));
    int64_t cl_shape[] = {2, 3, 4, 5}, cl_stride[] = {60, 1, 15, 3}; /* channels last */
    loom_collect_layout cl = {4, cl_shape, cl_stride, 4};
    assert_true(loom_collect_is_dense(&cl));
    check_copy(4, cl_shape, cl_stride, 4, 120);
}

static void test_size_one_and_empty(void **state) {
    (void)state;
    int64_t shape[] = {1, 4, 1}, stride[] = {999, 1, 77};
    loom_collect_layout l = {3, shape, stride, 8};
    assert_true(loom_collect_is_dense(&l));
    check_copy(3, shape, stride, 8, 4);
    int64_t eshape[] = {3, 0}, estride[] = {5, 1};
    loom_collect_layout e = {2, eshape, estride, 4};
    assert_true(loom_collect_is_dense(&e));
    uint8_t dummy;
    assert_int_equal(loom_collect_compact_copy(&dummy, 0, &dummy, &e), LOOM_OK);
    loom_collect_layout scalar = {0, NULL, NULL, 4};
    assert_int_equal(loom_collect_numel(&scalar), 1);
    assert_true(loom_collect_is_dense(&scalar));
    float f = 2.5f, g = 0;
    assert_int_equal(loom_collect_compact_copy(&g, 4, &f, &scalar), LOOM_OK);
    assert_true(g == 2.5f);
}

static void test_broadcast_is_not_dense(void **state) {
    (void)state;
    int64_t shape[] = {4, 3}, stride[] = {0, 1}; /* expand() */
    loom_collect_layout l = {2, shape, stride, 4};
    assert_false(loom_collect_is_dense(&l));
    check_copy(2, shape, stride, 4, 3);
}

static void test_bad_arguments(void **state) {
    (void)state;
    int64_t shape[] = {2, 2}, stride[] = {2, 1}, neg[] = {-1, 1};
    uint8_t buf[16];
    loom_collect_layout l = {2, shape, stride, 4};
    loom_clear_error();
    assert_int_equal(loom_collect_compact_copy(buf, 15, buf, &l), LOOM_ERR_INVALID);
    assert_string_equal(loom_last_error(), "compact copy: 15 bytes given for 4 elements of 4");
    loom_collect_layout n = {2, shape, neg, 4};
    assert_int_equal(loom_collect_compact_copy(buf, 16, buf, &n), LOOM_ERR_INVALID);
    loom_collect_layout z = {2, shape, stride, 0};
    assert_int_equal(loom_collect_compact_copy(buf, 0, buf, &z), LOOM_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_row_of_batch),
        cmocka_unit_test(test_column_slice),
        cmocka_unit_test(test_every_other_element),
        cmocka_unit_test(test_transposed_is_dense),
        cmocka_unit_test(test_size_one_and_empty),
        cmocka_unit_test(test_broadcast_is_not_dense),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
