/* cuda/device_py.c - the Python half of cuda/ (registration). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../base/pybase.h"
#include "device.h"

int loom_cuda_module_init(PyObject *m) {
    (void)m;
    return 0;
}
