/* collect/arena_py.c - placeholder replaced by the arena types. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "collect_internal.h"

int loom_collect__arena_init(PyObject *m) {
    (void)m;
    return 0;
}
