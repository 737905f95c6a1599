"""Smoke test for bench/: the benchmark modules import, and one scenario's
correctness check (every system reproduces the reference) passes. Nothing is
timed here and no timing is asserted."""

import os
import sys

import pytest

pytest.importorskip("nnsight")
torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import scenarios  # noqa: E402
from bench.harness import FAILED, OK, Config, ScenarioResult, check_case  # noqa: E402


def test_every_scenario_is_registered():
    assert set(scenarios.SCENARIOS) == {
        "empty_trace", "saves", "patch", "untouched", "invokes", "generate", "payload"}


def test_patch_scenario_values_match_the_reference():
    """Scenario 3 (activation patch), correctness only: raw hooks, nnsight and
    nnloom all give the hand-computed patched output."""
    case = scenarios.patch_case(Config.make(quick=True, device="cpu"))
    res = ScenarioResult("patch", "", "", "")
    with torch.no_grad():
        rows = check_case(case, res)
    status = {r.system: r.status for r in rows}
    assert not res.failures, "\n".join(res.failures)
    assert status["raw hooks"] == OK and status["nnsight"] == OK and status["nnloom"] == OK
    assert FAILED not in status.values()
