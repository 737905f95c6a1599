/* hooks/hooks.h - the boundary with torch.nn.Module.
 *
 * Wrapping a model installs one forward wrapper ("hook") per module, once: the
 * module's `forward` attribute becomes a small C callable that, when no trace
 * runs on the thread, calls the original forward directly (one thread-local
 * load and a vectorcall). Inside a trace it counts the module's calls and,
 * only when a body waits for this module, builds the value and hands it to
 * interleave/. torch's own hooks still run (they sit in Module.__call__,
 * around `forward`), `inspect.signature(module.forward)` still sees the
 * original signature (`__wrapped__`), and unwrapping restores the module's
 * attributes exactly.
 */
#ifndef LOOM_HOOKS_H
#define LOOM_HOOKS_H

#ifdef Py_PYTHON_H

/* Register the Tree and hook types on module `m`. -1 with an exception set. */
int loom_hook_module_init(PyObject *m);

#endif
#endif /* LOOM_HOOKS_H */
