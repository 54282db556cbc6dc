"""MemGraph files: JSON + safetensors in a zip, exact round trips, and refusals that run no code."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import zipfile

import pytest
import torch
import torch.utils._pytree as pytree
from cases import OPTIMIZERS, make_case, trainable
from torch.fx.immutable_collections import immutable_list
from turnip.ir import MemGraph, Plan, TaskGraph, TensorRef, ValueKind
from turnip.ir.serialize import FORMAT, GRAPH_MEMBER, STATE_MEMBER, VERSION
from turnip.ir.taskgraph import ScalarRef
from turnip.trace.optimizer_update import OptimizerSpec

from turnip import engine, memgraph


def assert_same(a, b, path="mg"):
    """Field by field, with exact types (list vs tuple), tensors bit for bit with their strides, nan == nan."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), path
        assert torch.equal(a, b), path
    elif isinstance(a, pytree.TreeSpec):  # a dataclass too, but compared as a whole
        assert a == b, path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    else:
        assert a == b, path


def compiled(name: str, opt: str) -> MemGraph:
    model, loss_fn, batches = make_case(name, dropout=0.1)
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS[opt](trainable(model)),
                          budget=0.5, device="cpu")
    return mg, batches


@pytest.mark.parametrize("name, opt", [("gpt", "adam"), ("hf_gpt2", "sgd")])
def test_traced_memgraph_round_trips_every_field(tmp_path, name, opt):
    mg, batches = compiled(name, opt)
    mg.save(tmp_path / "step.mg")
    back = memgraph.load(tmp_path / "step.mg")
    assert_same(mg, back)
    assert back.runtime is None
    # what traced templates hold survives with its type (the tracer's immutable lists, torch constants)
    kinds = {type(x) for v in back.taskgraph.vertices for x in [*v.args, *v.kwargs.values()]}
    assert {TensorRef, ScalarRef, immutable_list, torch.dtype} <= kinds
    assert isinstance(back.taskgraph.optimizer, OptimizerSpec)
    # a tensor held by both the MemGraph and its TaskGraph is stored once and shared again
    vid = next(iter(mg.initial_state))
    assert back.initial_state[vid] is back.taskgraph.initial_state[vid]
    # and it runs the same step
    torch.manual_seed(7)
    want = engine.run(mg, batches[0])["loss"]
    torch.manual_seed(7)
    assert torch.equal(engine.run(back, batches[0])["loss"], want)


def test_file_is_json_and_safetensors(tmp_path):
    mg, _ = compiled("mlp", "adamw")
    mg.save(tmp_path / "step.mg")
    with zipfile.ZipFile(tmp_path / "step.mg") as zf:
        assert sorted(zf.namelist()) == sorted([GRAPH_MEMBER, STATE_MEMBER])
        doc = json.loads(zf.read(GRAPH_MEMBER))
        state = zf.read(STATE_MEMBER)
    assert (doc["format"], doc["version"]) == (FORMAT, VERSION)
    from safetensors.torch import load as load_tensors
    assert len(load_tensors(state)) == len({id(t) for t in mg.initial_state.values()})
    assert not list(tmp_path.glob("*.partial"))


def hand_made(args=(), kwargs=None, state=None) -> MemGraph:
    """A one-vertex MemGraph built by hand: the file format takes any MemGraph, built or not."""
    tg = TaskGraph()
    w = tg.add_value((2, 3), (3, 1), torch.float32, 24, ValueKind.PARAMETER, name="param:w")
    out = tg.add_value((2, 3), (3, 1), torch.float32, 24)
    tg.add_vertex("aten::weird.default", args or (TensorRef(w, (2, 3), (3, 1)),), kwargs or {}, (out,),
                  module="m", phase="forward", time=1.5e-6)
    tg.initial_state = state if state is not None else {w: torch.arange(6.0).reshape(2, 3)}
    tg.batch_spec = pytree.tree_flatten({"x": [1, (2, 3)]})[1]
    return MemGraph(taskgraph=tg, plan=Plan(gpu_budget=1 << 20, offload={5, 1, 3}, stats={"gap": float("nan")}),
                    initial_state=dict(tg.initial_state))


def test_template_constants_round_trip_with_their_types(tmp_path):
    ref = TensorRef(0, (2, 3), (3, 1))
    args = (ref, [ref, 1, 2.5], (True, None, "tanh"), float("inf"), float("-inf"), float("nan"), -0.0, 10**30,
            torch.Size([2, 3]), immutable_list([4, 5]), 1 + 2j, ScalarRef("g0.lr"))
    kwargs = {"dtype": torch.bfloat16, "device": torch.device("cuda", 1), "layout": torch.strided,
              "memory_format": torch.channels_last, "pin_memory": False, "nested": {"a": [()], "b": ([],)},
              "empty_list": [], "empty_tuple": ()}
    base = torch.arange(24.0).reshape(4, 6)
    state = {0: base.t()[1:, ::2], 1: torch.zeros(3).expand(4, 3), 2: base[0], 3: torch.tensor(True),
             4: torch.zeros(0, 5, dtype=torch.float16)}  # strided, overlapping, sharing storage, 0-dim, empty
    mg = hand_made(args, kwargs, state)
    mg.taskgraph.optimizer = OptimizerSpec("adam", [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                     "weight_decay": 0.0, "foreach": None}], initial_step=3)
    mg.stats["step"] = 3
    mg.save(tmp_path / "step.mg")
    back = memgraph.load(tmp_path / "step.mg")
    assert_same(mg, back)
    assert back.plan.offload == {1, 3, 5}


class Opaque:
    pass


@pytest.mark.parametrize("constant", [Opaque(), torch.Generator(), slice(1, 2), b"bytes", {1, Opaque()}])
def test_unsupported_constant_refused_at_save_naming_the_vertex(tmp_path, constant):
    mg = hand_made(kwargs={"alpha": [1, constant]})
    with pytest.raises(TypeError) as info:
        mg.save(tmp_path / "step.mg")
    message = str(info.value)
    assert "vertex 0, aten::weird.default" in message
    assert "taskgraph.vertices[0].kwargs['alpha'][1]" in message
    assert not list(tmp_path.iterdir())  # nothing written, not even part of a file


def test_unsupported_dataclass_refused(tmp_path):
    @dataclasses.dataclass
    class Hyper:
        lr: float

    mg = hand_made()
    mg.taskgraph.optimizer = Hyper(0.1)
    with pytest.raises(TypeError, match=r"Hyper.*at MemGraph\.taskgraph\.optimizer"):
        mg.save(tmp_path / "step.mg")


# -- refusals: loading never unpickles -------------------------------------------------------------------
EXECUTED = []


class Payload:
    """Unpickling this would call EXECUTED.append: the test fails if it happens."""

    def __reduce__(self):
        return EXECUTED.append, ("ran",)


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    EXECUTED.clear()
    yield
    assert not EXECUTED


def rewrite(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def members_of(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def test_pickle_file_refused(tmp_path, no_unpickling):
    path = tmp_path / "step.mg"
    # what the pickle-based save of format version 1 wrote, with a payload inside
    path.write_bytes(pickle.dumps({"format": "turnip.memgraph", "version": 1, "state": Payload()}))
    with pytest.raises(ValueError, match=f"{path} is not a turnip MemGraph file.*pickles"):
        memgraph.load(path)


def test_extra_pickle_member_refused(tmp_path, no_unpickling):
    path = tmp_path / "step.mg"
    hand_made().save(path)
    rewrite(path, {**members_of(path), "data.pkl": pickle.dumps(Payload())})
    with pytest.raises(ValueError, match=f"{path}.*data.pkl"):
        memgraph.load(path)


@pytest.mark.parametrize("change, error", [
    (lambda doc: doc.update(format="pickle"), "format 'pickle', expected 'turnip.memgraph'"),
    (lambda doc: doc.update(version=1), "version 1, this turnip reads 4"),
    (lambda doc: doc.update(version=3), "version 3, this turnip reads 4"),
    (lambda doc: doc["memgraph"].update(t="Popen"), "unknown type 'Popen'"),
    (lambda doc: doc["memgraph"]["v"]["taskgraph"]["v"]["vertices"][0]["v"].update(op={"t": "pickle", "v": "x"}),
     "unknown type 'pickle'"),
    (lambda doc: doc["memgraph"]["v"].pop("plan"), "MemGraph has fields"),
    (lambda doc: doc["memgraph"]["v"]["taskgraph"]["v"]["values"][0]["v"].update(dtype={"t": "dtype", "v": "load"}),
     "torch.load is not a dtype"),
    (lambda doc: doc["memgraph"]["v"]["initial_state"]["v"][0][1].update(v="99"), "tensor '99'"),
])
def test_wrong_or_corrupted_graph_refused(tmp_path, no_unpickling, change, error):
    path = tmp_path / "step.mg"
    hand_made().save(path)
    members = members_of(path)
    doc = json.loads(members[GRAPH_MEMBER])
    change(doc)
    rewrite(path, {**members, GRAPH_MEMBER: json.dumps(doc).encode()})
    with pytest.raises(ValueError, match=str(path)) as info:
        memgraph.load(path)
    assert error in str(info.value)


@pytest.mark.parametrize("damage", ["truncate", "state", "json"])
def test_damaged_file_refused(tmp_path, no_unpickling, damage):
    path = tmp_path / "step.mg"
    hand_made().save(path)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-40])
    else:
        members = members_of(path)
        member = STATE_MEMBER if damage == "state" else GRAPH_MEMBER
        rewrite(path, {**members, member: members[member][:-3]})
    with pytest.raises(ValueError, match=str(path)):
        memgraph.load(path)
