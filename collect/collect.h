/* collect/collect.h - what leaves a trace: compact pickles, restricted loading,
 * merging of per-request saves, the shared-memory arena.
 *
 * (Being built: see the collect issue. The Python half registers itself through
 * loom_collect_module_init.)
 */
#ifndef LOOM_COLLECT_H
#define LOOM_COLLECT_H

#include "../base/base.h"

#ifdef Py_PYTHON_H
/* Register collect's types and functions on the extension module `m`.
 * -1 with an exception set. */
int loom_collect_module_init(PyObject *m);
#endif

#endif /* LOOM_COLLECT_H */
