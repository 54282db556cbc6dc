"""One vertex formatter for every message, a one-line repr and a short text dump of a MemGraph."""

from __future__ import annotations

import pytest
import torch
from turnip.bench.models.mlp import MLP
from turnip.ir.describe import describe_vertex, format_task_vertex, format_vertex, short_name
from turnip.ir.memgraph import Kind

from turnip import memgraph


@pytest.fixture(scope="module")
def mg():
    torch.manual_seed(0)
    model = MLP(8, 16, 4, depth=8)
    batch = (torch.randn(64, 8), torch.randn(64, 4))

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    return memgraph.compile(model, loss_fn, batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            budget=0.5, device="cpu")


def test_repr_is_one_short_line(mg):
    text = repr(mg)
    assert "\n" not in text and len(text) < 300
    assert f"{len(mg.vertices)} vertices" in text and "compute" in text and str(mg.arena_bytes) in text


def test_dump_lists_vertices_in_serial_order_with_places(mg):
    text = memgraph.dump(mg, limit=5)
    lines = text.splitlines()
    assert len(lines) == 1 + 5 + 1 and lines[0].startswith("MemGraph on cpu")
    first = mg.serial[0]
    assert lines[1].startswith(f"  vertex {first} (")
    assert f"{len(mg.vertices) - 5} more" in lines[-1]
    assert len(memgraph.dump(mg, limit=len(mg.vertices)).splitlines()) == 1 + len(mg.vertices)


def test_compute_vertex_names_op_module_and_inputs(mg):
    vid = next(v.id for v in mg.vertices if v.kind is Kind.COMPUTE
               and mg.taskgraph.vertices[v.task_vertex].op.startswith("aten::addmm"))
    tv = mg.taskgraph.vertices[mg.vertices[vid].task_vertex]
    text = format_vertex(mg, vid)
    assert text.startswith(f"vertex {vid} (compute {tv.op}) in module '{tv.module}' reading [value ")
    assert tv.module and short_name(mg, vid) == tv.op
    info = describe_vertex(mg, vid)
    assert [v for v, _, _ in info.inputs] == tv.inputs()
    assert format_task_vertex(mg.taskgraph, tv.id) == f"vertex {tv.id} ({tv.op}, module '{tv.module}')"


def test_transfer_vertex_names_the_value_it_moves(mg):
    moved = [v for v in mg.vertices if v.kind in (Kind.OFFLOAD, Kind.RELOAD, Kind.INPUT)]
    assert moved
    for mv in moved:
        assert format_vertex(mg, mv.id, inputs=False) == f"vertex {mv.id} ({mv.kind.value}) of value {mv.value}"
        assert short_name(mg, mv.id) == f"{mv.kind.value} v{mv.value}"
