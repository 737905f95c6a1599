/* tests/c/test_cuda_nvtx.c - NVTX ranges through an injection library.
 *
 * main() points NVTX_INJECTION64_PATH at libnnloom_nvtx_inject.so (built
 * next to this executable) before the first NVTX call; the library appends
 * each create/push/pop to a log file the tests read back. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../cuda/device.h"

static char log_path[512];
static int have_inject;

static char *read_log(void) {
    FILE *f = fopen(log_path, "r");
    if (f == NULL) return strdup("");
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return strdup(buf);
}

static void test_depth_balanced(void **state) {
    (void)state;
    assert_int_equal(loom_cuda_range_depth(), 0);
    loom_cuda_range_push("a");
    loom_cuda_range_push("b");
    assert_int_equal(loom_cuda_range_depth(), 2);
    loom_cuda_range_pop();
    loom_cuda_range_pop();
    assert_int_equal(loom_cuda_range_depth(), 0);
    loom_cuda_range_pop(); /* an extra pop never goes negative */
    assert_int_equal(loom_cuda_range_depth(), 0);
}

static void test_ranges_recorded(void **state) {
    (void)state;
    if (!loom_cuda_nvtx_enabled() || !have_inject) skip();
    unlink(log_path);
    loom_cuda_range_push("nnloom.trace");
    loom_cuda_range_push("model.transformer.h.3");
    loom_cuda_range_pop();
    loom_cuda_range_pop();
    /* a staging call pushes and pops its own range */
    uint8_t src[64], dst[64];
    for (int i = 0; i < 64; i++) src[i] = (uint8_t)i;
    loom_cuda_tview v = {src, 1, 1, {64}, {1}, -1};
    loom_cuda_copy_plan p;
    size_t total;
    assert_int_equal(loom_cuda_stage_plan(&v, 1, &p, &total), LOOM_OK);
    assert_int_equal(loom_cuda_stage_cpu(&v, &p, 1, dst), LOOM_OK);
    char *log = read_log();
    const char *want = "push nnloom nnloom.trace\n"
                       "push nnloom model.transformer.h.3\n"
                       "pop nnloom\n"
                       "pop nnloom\n"
                       "push nnloom nnloom.compact\n"
                       "pop nnloom\n";
    assert_string_equal(log, want);
    free(log);
}

int main(void) {
    char exe[512];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) *slash = '\0';
        char lib[600];
        snprintf(lib, sizeof lib, "%s/libnnloom_nvtx_inject.so", exe);
        if (access(lib, R_OK) == 0) {
            setenv("NVTX_INJECTION64_PATH", lib, 1);
            have_inject = 1;
        }
    }
    snprintf(log_path, sizeof log_path, "/tmp/nnloom-nvtx-test-%d.log", (int)getpid());
    setenv("NNLOOM_NVTX_LOG", log_path, 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_depth_balanced),
        cmocka_unit_test(test_ranges_recorded),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    unlink(log_path);
    return rc;
}
