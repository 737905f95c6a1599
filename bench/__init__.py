"""nnloom's benchmarks: each scenario measures nnloom next to its anchors (a bare
forward, raw ``register_forward_hook`` closures, nnsight 0.8) in one process and
reports ratios against the performance targets of DESIGN.md.

Run ``python bench/run.py [--quick] [--only NAME] [--device cuda]``.
"""
