/* collect/collect_py.c - the Python half of collect/ (registration). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../base/pybase.h"
#include "collect.h"

int loom_collect_module_init(PyObject *m) {
    (void)m;
    return 0;
}
