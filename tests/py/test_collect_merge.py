"""merge_shared_saves: request-mode payloads merge into what a local run gives."""

import dataclasses

import torch

from nnloom import collect


@dataclasses.dataclass
class Med:
    presaved: set
    scope: dict = dataclasses.field(default_factory=dict)


def _local_and_requests(program, n):
    """Run `program(i, shared)` for every invoke locally (one shared dict) and
    in request mode (each request a deep copy of the initial state)."""
    import copy

    def init():
        return {"rows": [None] * n, "by_key": {}, "nested": {"a": [None] * n, "b": {}}}

    local = init()
    for i in range(n):
        program(i, local)
    requests = []
    for i in range(n):
        mine = copy.deepcopy(init())
        program(i, mine)
        requests.append(mine)
    return local, requests


def test_slot_lists_and_dicts_equal_local_run():
    def program(i, s):
        s["rows"][i] = torch.full((2,), float(i))
        s["by_key"][f"p{i}"] = i
        s["nested"]["a"][i] = [i, None]
        s["nested"]["b"].setdefault("seen", []).append(i)  # conflict: later wins

    local, requests = _local_and_requests(program, 3)
    meds = [Med({"rows", "by_key", "nested"}) for _ in range(3)]
    merged = collect.merge_shared_saves(meds, requests)
    assert set(merged) == {"rows", "by_key", "nested"}
    for i in range(3):
        assert torch.equal(merged["rows"][i], local["rows"][i])
    assert merged["by_key"] == local["by_key"]
    assert merged["nested"]["a"] == local["nested"]["a"]
    assert merged["nested"]["b"] == {"seen": [2]}  # several wrote it: the later copy
    for med in meds:
        assert med.scope["rows"] is merged["rows"]
        assert med.scope["nested"] is merged["nested"]


def test_none_is_unwritten_and_conflicts_keep_later():
    meds = [Med({"x"}), Med({"x"})]
    merged = collect.merge_shared_saves(
        meds, [{"x": [1, None, 3, None]}, {"x": [None, 2, 30, None]}]
    )
    assert merged["x"] == [1, 2, 30, None]


def test_lengths_or_types_differ_keep_later():
    meds = [Med({"x", "y", "z"})]
    merged = collect.merge_shared_saves(
        meds,
        [{"x": [1, None], "y": {"a": 1}, "z": 5}, {"x": [None, 2, 3], "y": [1], "z": 6}],
    )
    assert merged == {"x": [None, 2, 3], "y": [1], "z": 6}


def test_tuples_slotwise_and_dict_key_union_order():
    meds = [Med({"t", "d"})]
    merged = collect.merge_shared_saves(
        meds,
        [{"t": ([1, None], None), "d": {"a": 1, "b": {"k": 1}}},
         {"t": ([None, 2], "x"), "d": {"c": 3, "b": {"j": 2}}}],
    )
    assert merged["t"] == ([1, 2], "x") and type(merged["t"]) is tuple
    assert list(merged["d"]) == ["a", "b", "c"]
    assert merged["d"]["b"] == {"k": 1, "j": 2}


def test_per_invoke_names_not_merged():
    h0, h1 = torch.zeros(2), torch.ones(2)
    meds = [Med({"rows"}, {}), Med({"rows"}, {})]
    saves = [{"rows": [h0, None], "h": h0}, {"rows": [None, h1], "h": h1}]
    merged = collect.merge_shared_saves(meds, saves)
    assert set(merged) == {"rows"}
    assert "h" not in meds[0].scope and "h" not in meds[1].scope
    assert saves[0]["h"] is h0 and saves[1]["h"] is h1  # inputs untouched


def test_single_request_name_not_merged():
    meds = [Med({"rows"}), Med({"rows"})]
    merged = collect.merge_shared_saves(meds, [{"rows": [1, None]}, {}])
    assert merged == {} and meds[0].scope == {}


def test_inputs_not_mutated_and_new_containers():
    a, b = [1, None], [None, 2]
    meds = [Med({"x"})]
    merged = collect.merge_shared_saves(meds, [{"x": a}, {"x": b}])
    assert merged["x"] == [1, 2] and merged["x"] is not a and merged["x"] is not b
    assert a == [1, None] and b == [None, 2]


def test_three_requests_in_order():
    meds = [Med({"x"}) for _ in range(3)]
    merged = collect.merge_shared_saves(
        meds, [{"x": {"k": 1, "a": 0}}, {"x": {"k": 2}}, {"x": {"k": 3, "z": 9}}]
    )
    assert merged["x"] == {"k": 3, "a": 0, "z": 9}


def test_merge_all_equals_pairwise_fold():
    """The C fold (merge_all) gives what folding the reference pairwise merge
    over the copies gives, on generated nested values."""
    import random

    from nnloom import _C

    rng = random.Random(7)

    def value(depth=0):
        k = rng.random()
        if depth < 3 and k < 0.3:
            return [value(depth + 1) if rng.random() < 0.5 else None for _ in range(3)]
        if depth < 3 and k < 0.45:
            return tuple(value(depth + 1) if rng.random() < 0.5 else None for _ in range(2))
        if depth < 3 and k < 0.65:
            return {rng.choice("abc"): value(depth + 1) for _ in range(rng.randint(0, 3))}
        return rng.choice([None, 1, 2.5, "s", (1,), [None]])

    for _ in range(400):
        shape = value()
        copies = [value() if rng.random() < 0.3 else _mutate(shape, rng) for _ in range(rng.randint(1, 6))]
        want = copies[0]
        for later in copies[1:]:
            want = _merge(want, later)
        assert _C.merge_all(list(copies)) == want, copies


def _mutate(v, rng):
    if isinstance(v, list):
        return [_mutate(x, rng) if rng.random() < 0.5 else None for x in v]
    if isinstance(v, tuple):
        return tuple(_mutate(x, rng) if rng.random() < 0.5 else None for x in v)
    if isinstance(v, dict):
        return {k: _mutate(x, rng) for k, x in v.items() if rng.random() < 0.7}
    return rng.choice([v, None, 9])


def _merge(early, late):
    """The merge rule of reference/collect.md written plainly: one value from
    two requests' copies, the later winning conflicts (the oracle for merge_all)."""
    import collections

    if type(early) is type(late) and type(late) in (list, tuple) and len(early) == len(late):
        out = [a if b is None else b if a is None else _merge(a, b) for a, b in zip(early, late)]
        return out if type(late) is list else tuple(out)
    if type(early) is type(late) and type(late) in (dict, collections.OrderedDict):
        out = type(late)(early)
        for key, b in late.items():
            out[key] = _merge(out[key], b) if key in out else b
        return out
    return late
