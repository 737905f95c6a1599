/* cuda/device.h - everything device-specific, behind one header: pinned host
 * pool, compact device-to-host staging, streams and events, NVTX ranges, NCCL.
 * Each part has a CPU implementation behind the same declarations.
 *
 * (Being built: see the cuda issue.)
 */
#ifndef LOOM_DEVICE_H
#define LOOM_DEVICE_H

#include "../base/base.h"

#ifdef Py_PYTHON_H
/* Register cuda/'s types and functions on the extension module `m`.
 * -1 with an exception set. */
int loom_cuda_module_init(PyObject *m);
#endif

#endif /* LOOM_DEVICE_H */
