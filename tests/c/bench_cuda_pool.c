/* tests/c/bench_cuda_pool.c - lease/release cost of the pinned pool.
 *
 * Times a warm lease + end_lease loop (the fast path: a free-list pop and
 * push under the pool mutex), and lease + export + unexport + end_lease,
 * and record + end_lease with a pending-then-complete fake event. Prints
 * the median of several repeats in ns per pair. Not a test: no assertion.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../../cuda/device.h"

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define REPEATS 9
#define ITERS 200000

int main(void) {
    loom_cuda_pool *pool = NULL;
    loom_cuda_pool_config cfg = {64u << 20, 8u << 20, NULL, NULL};
    if (loom_cuda_pool_create(&cfg, &pool) != LOOM_OK) return 1;
    const size_t sizes[3] = {4096, 100000, 1 << 20};
    for (int mode = 0; mode < 2; mode++)
        for (int k = 0; k < 3; k++) {
            double t[REPEATS];
            for (int r = 0; r < REPEATS; r++) {
                double t0 = now_ns();
                for (int i = 0; i < ITERS; i++) {
                    loom_cuda_block *b = NULL;
                    if (loom_cuda_pool_lease(pool, sizes[k], &b) != LOOM_OK) return 1;
                    if (mode == 1) {
                        loom_cuda_block_export(b);
                        loom_cuda_block_unexport(b);
                    }
                    loom_cuda_block_end_lease(b);
                }
                t[r] = (now_ns() - t0) / ITERS;
            }
            qsort(t, REPEATS, sizeof t[0], cmp);
            printf("pool %-28s %8zu B: median %6.1f ns (min %6.1f)\n",
                   mode ? "lease+export+unexport+end" : "lease+end_lease", sizes[k],
                   t[REPEATS / 2], t[0]);
        }
    loom_cuda_pool_release(pool);
    return 0;
}
