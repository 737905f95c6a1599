"""collect.loads: the restricted loader accepts results and refuses code."""

import collections
import copyreg
import dataclasses
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import nnloom
from nnloom import collect


@dataclasses.dataclass
class Probe:
    name: str
    hidden: torch.Tensor


Pair = collections.namedtuple("Pair", "left right")


class Plain:
    pass


def _marker(tmp_path):
    path = tmp_path / "pwned"
    assert not path.exists()
    return str(path)


# ---------------------------------------------------------------------------
# What results contain loads
# ---------------------------------------------------------------------------


def test_results_load():
    batch = torch.randn(6, 4, 5)
    value = {
        "rows": [batch[0], None, batch[2, :, ::2]],
        "pair": Pair(batch[1].t(), 3),
        "probe": Probe("p", batch[3]),
        "misc": (None, True, 1, 2.5, 1 - 1j, "s", b"b", bytearray(b"x"), {1, 2}, frozenset({3})),
        "od": collections.OrderedDict(a=1),
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "dtype": torch.bfloat16,
        "grad": torch.randn(3, requires_grad=True),
    }
    got = collect.loads(collect.dumps_compact(value), allow=(Pair, Probe))
    assert torch.equal(got["rows"][2], batch[2, :, ::2]) and got["rows"][1] is None
    assert isinstance(got["pair"], Pair) and torch.equal(got["pair"].left, batch[1].t())
    assert got["pair"].left.stride() == batch[1].t().stride()
    assert isinstance(got["probe"], Probe) and torch.equal(got["probe"].hidden, batch[3])
    assert got["misc"] == value["misc"]
    assert got["od"] == value["od"] and type(got["od"]) is collections.OrderedDict
    assert got["size"] == torch.Size([2, 3]) and got["device"] == torch.device("cpu")
    assert got["dtype"] is torch.bfloat16
    assert got["grad"].requires_grad and torch.equal(got["grad"].detach(), value["grad"].detach())


def test_classes_must_be_allowed():
    data = collect.dumps_compact(Probe("p", torch.zeros(2)))
    with pytest.raises(nnloom._C.UnsafePayloadError) as info:
        collect.loads(data)
    assert str(info.value) == f"payload refers to a forbidden object: {__name__}.Probe"
    assert isinstance(collect.loads(data, allow=[Probe]), Probe)
    with pytest.raises(TypeError, match="allow takes classes"):
        collect.loads(data, allow=["Probe"])


def test_error_classes():
    assert collect.UnsafePayloadError is nnloom._C.UnsafePayloadError
    assert issubclass(collect.UnsafePayloadError, nnloom.NNloomError)
    assert issubclass(collect.PayloadError, nnloom.NNloomError)
    with pytest.raises(TypeError, match="bytes-like"):
        collect.loads("not bytes")


# ---------------------------------------------------------------------------
# Hostile payloads: refused, never executed
# ---------------------------------------------------------------------------


class Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _hostile(marker):
    """name -> (payload bytes, the global the error must name)."""
    touch = f"touch {marker}"
    py = f"open({marker!r}, 'w').close()"
    out = {}
    sysmod = os.system.__module__  # 'posix' on Linux
    out["reduce os.system"] = (pickle.dumps(Reduce(os.system, touch)), f"{sysmod}.system")
    out["reduce exec"] = (pickle.dumps(Reduce(exec, py)), "builtins.exec")
    out["reduce eval"] = (pickle.dumps(Reduce(eval, py)), "builtins.eval")
    out["popen"] = (pickle.dumps(Reduce(subprocess.Popen, ["touch", marker])), "subprocess.Popen")
    out["nested"] = (
        pickle.dumps({"ok": [1, torch.zeros(1)], "bad": [(Reduce(os.system, touch),)]}),
        "torch._utils._rebuild_tensor_v2",  # torch's own tensor pickle comes first
    )
    out["nested compact"] = (
        collect.dumps_compact({"ok": [torch.zeros(2)], "bad": [(Reduce(os.system, touch),)]}),
        f"{sysmod}.system",
    )
    # protocol 0/1 object pickles go through copyreg._reconstructor
    out["copyreg"] = (pickle.dumps(Plain(), protocol=0), "copy_reg._reconstructor")
    # INST and OBJ opcodes name the class/callable directly
    out["INST"] = (
        b"(S'" + touch.encode() + b"'\nios\nsystem\n.",
        "os.system",
    )
    out["OBJ"] = (
        b"\x80\x02(cos\nsystem\nX" + len(touch).to_bytes(4, "little") + touch.encode() + b"o.",
        "os.system",
    )
    out["NEWOBJ"] = (
        b"\x80\x02csubprocess\nPopen\n]X\x05\x00\x00\x00touchaX"
        + len(marker).to_bytes(4, "little") + marker.encode() + b"a\x85\x81.",
        "subprocess.Popen",
    )
    # BUILD: on an allowed class itself (rewriting a class attribute) ...
    out["BUILD on class"] = (
        b"\x80\x04c" + __name__.encode() + b"\nProbe\nN}X\x08\x00\x00\x00__repr__c"
        b"builtins\ngetattr\ns\x86b.",
        "BUILD on a global",
    )
    # ... on an allowed class's instance, smuggling a __setstate__ then calling it
    probe = collect.dumps_compact(Probe("p", None))[:-1]  # drop STOP
    out["__setstate__ trick"] = (
        probe + b"}X\x0c\x00\x00\x00__setstate__cos\nsystem\nsbX"
        + len(touch).to_bytes(4, "little") + touch.encode() + b"b.",
        "os.system",
    )
    # getattr beyond the tensor rebuild methods
    out["getattr escape"] = (
        b"\x80\x04cbuiltins\ngetattr\nctorch._C\nTensorBase\nX\x09\x00\x00\x00__class__\x86R.",
        "torch.Tensor.__class__",
    )
    out["getattr on str"] = (
        b"\x80\x04cbuiltins\ngetattr\nX\x01\x00\x00\x00sX\x04\x00\x00\x00join\x86R.",
        "builtins.getattr('s', 'join')",
    )
    out["dotted global"] = (
        b"\x80\x04\x8c\x05torch\x8c\x14Tensor.view.__self__\x93.",
        "torch.Tensor.view.__self__",
    )
    out["torch.load path"] = (pickle.dumps(torch.zeros(3)), "torch._utils._rebuild_tensor_v2")
    out["bytearray size"] = (
        b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\xe4\x0bT\x02\x85R.",
        "builtins.bytearray(int)",
    )
    out["ByteTensor size"] = (b"\x80\x02ctorch\nByteTensor\nK\x10\x85R.", "torch.ByteTensor(int)")
    return out


def test_hostile_corpus_refused(tmp_path):
    marker = _marker(tmp_path)
    repr_before = Probe.__dict__["__repr__"]
    for name, (data, culprit) in _hostile(marker).items():
        with pytest.raises(collect.UnsafePayloadError) as info:
            collect.loads(data, allow=(Probe,))
        assert str(info.value) == f"payload refers to a forbidden object: {culprit}", name
        assert not os.path.exists(marker), name
    assert Probe.__dict__["__repr__"] is repr_before  # the class was not rewritten


def test_extension_registry(tmp_path):
    marker = _marker(tmp_path)
    touch = f"touch {marker}".encode()
    data = b"\x80\x02\x83\xd2\x04X" + len(touch).to_bytes(4, "little") + touch + b"\x85R."
    with pytest.raises(collect.PayloadError, match="unregistered extension code"):
        collect.loads(data)
    copyreg.add_extension("os", "system", 1234)
    try:
        with pytest.raises(collect.UnsafePayloadError, match="forbidden object: os.system"):
            collect.loads(data)
    finally:
        copyreg.remove_extension("os", "system", 1234)
    assert not os.path.exists(marker)


def test_persistent_id_refused():
    with pytest.raises(collect.PayloadError, match="persistent"):
        collect.loads(b"\x80\x04X\x01\x00\x00\x00xQ.")


def test_malformed_is_payload_error():
    good = collect.dumps_compact({"t": torch.arange(4.0)})
    for bad in (b"", good[:-1], good[: len(good) // 2], b"\x80\x05\xff", b"garbage"):
        with pytest.raises(collect.PayloadError):
            collect.loads(bad)
    # an allowed call with bad arguments: torch's error, wrapped
    bad_strides = good.replace(b"K\x04\x85\x94K\x01\x85", b"K\x09\x85\x94K\x01\x85")
    assert bad_strides != good
    with pytest.raises(collect.PayloadError, match="RuntimeError"):
        collect.loads(bad_strides)


def test_refcounts_stable():
    data = collect.dumps_compact({"t": torch.arange(4.0), "l": [1, 2]})
    collect.loads(data)
    before = sys.getrefcount(data)
    for _ in range(50):
        collect.loads(data)
    assert sys.getrefcount(data) == before


# ---------------------------------------------------------------------------
# Fuzz: mutated valid payloads load or fail cleanly (in a child: a crash or a
# hang fails the test instead of killing the run)
# ---------------------------------------------------------------------------

FUZZ = textwrap.dedent(
    """
    import collections, random, sys, time, torch
    from nnloom import collect
    Pair = collections.namedtuple("Pair", "left right")
    batch = torch.randn(4, 3, 5)
    seeds = [
        collect.dumps_compact({"rows": [batch[0], None, batch[1, :, ::2]], "n": 3}),
        collect.dumps_compact(Pair(batch[2].t(), [1.5, "s", b"b", {1}])),
        collect.dumps_compact([torch.ones(2, dtype=torch.bfloat16, requires_grad=True), (1, 2)]),
    ]
    rng = random.Random(int(sys.argv[1]))
    deadline = time.monotonic() + float(sys.argv[2])
    counts = collections.Counter()
    while time.monotonic() < deadline:
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            kind = rng.randrange(5)
            i = rng.randrange(len(data))
            if kind == 0:
                data[i] = rng.randrange(256)
            elif kind == 1:
                data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            elif kind == 2:
                del data[i:i + rng.randint(1, 8)]
            elif kind == 3:
                data = data[:i]
            else:
                other = rng.choice(seeds)
                j = rng.randrange(len(other))
                data[i:i + 16] = other[j:j + 16]
            if not data:
                data = bytearray(b"\\x80")
        try:
            collect.loads(bytes(data), allow=(Pair,))
            counts["value"] += 1
        except (collect.PayloadError, collect.UnsafePayloadError) as exc:
            counts[type(exc).__name__] += 1
    print(dict(counts))
    """
)


def test_fuzz_mutated_payloads(tmp_path):
    script = tmp_path / "fuzz.py"
    script.write_text(FUZZ)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), "20240611", "3"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = eval(proc.stdout.strip().splitlines()[-1], {})
    assert sum(counts.values()) > 500, counts
    assert counts.get("PayloadError", 0) > 0
    assert time.monotonic() - start < 60
    assert not (tmp_path / "pwned").exists()


def test_builtin_constructors_across_protocols():
    values = [{1, 2}, frozenset({(1, 2)}), collections.OrderedDict(a=1), torch.Size([2, 3]),
              torch.device("cpu"), 1 + 2j, bytearray(b"x")]
    for proto in (3, 4, 5):
        for v in values:
            got = collect.loads(pickle.dumps(v, proto))
            assert got == v and type(got) is type(v), (v, proto)


def test_allowed_constructors_refuse_odd_arguments():
    # set() over a tensor view would iterate it element by element
    data = b"\x80\x04cbuiltins\nset\nctorch\nSize\n]K\x02a\x85R\x85R."
    with pytest.raises(collect.UnsafePayloadError, match=r"builtins.set\(Size\)"):
        collect.loads(data)


def test_forged_memo_index_refused():
    data = b"\x80\x04K\x01r\x00\x00\x00\x50."  # LONG_BINPUT 0x50000000
    with pytest.raises(collect.PayloadError, match="memo index"):
        collect.loads(data)
