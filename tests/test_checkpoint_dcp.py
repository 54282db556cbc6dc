"""memgraph.save_checkpoint / load_checkpoint (memgraph/checkpoint.py): a MemGraph's state through
torch.distributed.checkpoint, each rank writing its share in the layout of torch's own
get_model_state_dict / get_optimizer_state_dict. A run resumed from it, by turnip (on as many ranks,
or in one process over as many devices) or by an eager model and torch's AdamW, goes on bitwise as if
it had not stopped (CPU, fp32)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cases import make_case
from test_devices import adamw
from test_ranks import data_parallel_steps, eager_step, run_ranks
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from turnip.bench.models import mlp

from turnip import engine, memgraph

RANKS = 2
# torch.distributed.checkpoint warns, in a process without a process group, that it reads and writes alone
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def eager_from_checkpoint(model, make_opt, checkpoint):
    """A copy of ``model`` and an optimizer over it, loaded from ``checkpoint`` with torch's own helpers."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return model, opt


def assert_same_state(model_state: dict, optimizer_state: dict, want: dict, want_opt: dict) -> None:
    """A model's and an optimizer's state dicts (torch's forms) bitwise equal to ``want`` and ``want_opt``."""
    assert sorted(model_state) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(model_state[key], tensor), key
    assert sorted(optimizer_state["state"]) == sorted(want_opt["state"])
    for index, entry in want_opt["state"].items():
        for key, value in entry.items():
            assert torch.equal(optimizer_state["state"][index][key].to(value.dtype), value), (index, key)


def _resumes_from_checkpoint(rank: int, ranks: int, checkpoint: str, want: dict, want_opt: dict) -> str:
    model, loss_fn, batches = make_case("gpt")
    steps = data_parallel_steps(batches, ranks)
    mine = copy.deepcopy(model)
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu", budget=0.6,
                          verbose=False)
    engine.run(mg, steps[0][rank])
    memgraph.save_checkpoint(mg, checkpoint)
    mg.release(keep=False)
    fresh = copy.deepcopy(model)  # as a new process would: compiled from the initial weights, then loaded
    resumed = memgraph.compile(fresh, loss_fn, batches[0], optimizer=adamw(fresh.parameters()), device="cpu",
                               budget=0.6, verbose=False)
    memgraph.load_checkpoint(resumed, checkpoint)
    engine.run(resumed, steps[1][rank])
    # refused on every rank alike (none left waiting for the others in dcp.load), the state kept
    with pytest.raises(ValueError, match="rank 0: not a readable checkpoint"):
        memgraph.load_checkpoint(resumed, checkpoint + "-missing")
    state = memgraph.gather_state_dict(resumed)
    optimizer = memgraph.gather_optimizer_state_dict(resumed)
    if rank != 0:
        return "ok"
    assert_same_state(state, optimizer, want, want_opt)
    return "ok"


@pytest.fixture(scope="module")
def eager_run():
    """The gpt case's two steps in eager over RANKS micro-batches each, averaged as DDP: its model's and
    AdamW's state dicts."""
    model, loss_fn, batches = make_case("gpt")
    eager = copy.deepcopy(model)
    opt = adamw(eager.parameters())
    for micro in data_parallel_steps(batches, RANKS):
        eager_step(eager, opt, loss_fn, micro)
    return eager.state_dict(), opt.state_dict()


@pytest.fixture(scope="module")
def checkpoint_of_ranks(tmp_path_factory, eager_run):
    """A checkpoint the ranks saved after their first step, and each rank's report of its resumed run."""
    folder = tmp_path_factory.mktemp("ranks")
    checkpoint = folder / "checkpoint"
    return checkpoint, run_ranks(_resumes_from_checkpoint, RANKS, folder, str(checkpoint), *eager_run)


def test_ranks_resumed_from_their_sharded_checkpoint_go_on_bitwise(checkpoint_of_ranks):
    _, reports = checkpoint_of_ranks
    for rank, text in enumerate(reports):
        assert text.startswith("ok"), f"rank {rank}: {text}"


def test_a_checkpoint_of_ranks_loads_into_eager_which_goes_on_bitwise(checkpoint_of_ranks, eager_run):
    checkpoint, _ = checkpoint_of_ranks
    model, loss_fn, batches = make_case("gpt")
    eager, opt = eager_from_checkpoint(model, adamw, checkpoint)
    eager_step(eager, opt, loss_fn, data_parallel_steps(batches, RANKS)[1])
    assert_same_state(eager.state_dict(), opt.state_dict(), *eager_run)


def test_a_checkpoint_of_ranks_loads_into_one_process_over_as_many_devices(checkpoint_of_ranks, eager_run):
    """Entries are keyed by parameter name, not by rank: the same accumulation over the devices of one
    process (its replicas of every weight read from the checkpoint too) goes on bitwise."""
    checkpoint, _ = checkpoint_of_ranks
    model, loss_fn, batches = make_case("gpt")
    mine = copy.deepcopy(model)
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu",
                          devices=RANKS, verbose=False)
    memgraph.load_checkpoint(mg, checkpoint)
    engine.run(mg, data_parallel_steps(batches, RANKS)[1])
    assert_same_state(mg.state_dict(), mg.optimizer.state_dict(), *eager_run)


def test_one_process_checkpoint_loads_into_eager_which_goes_on_as_turnip_does(tmp_path):
    model, loss_fn, batches = make_case("gpt")
    mine = copy.deepcopy(model)
    mg = memgraph.compile(mine, loss_fn, batches[0], optimizer=adamw(mine.parameters()), device="cpu", budget=0.6,
                          verbose=False)
    engine.run(mg, batches[0])
    memgraph.save_checkpoint(mg, tmp_path / "checkpoint")
    engine.run(mg, batches[1])
    eager, opt = eager_from_checkpoint(model, adamw, tmp_path / "checkpoint")
    eager_step(eager, opt, loss_fn, [batches[1]])
    assert_same_state(eager.state_dict(), opt.state_dict(), mg.state_dict(), mg.optimizer.state_dict())


def small_mlp(hidden: int = 16, depth: int = 3):
    torch.manual_seed(0)
    return mlp.MLP(hidden=hidden, depth=depth), mlp.mlp_loss, [mlp.example_batch(batch=8, seed=i) for i in range(2)]


def compiled_mlp(model, loss_fn, batch, make_opt=adamw, **options):
    model = copy.deepcopy(model)
    return memgraph.compile(model, loss_fn, batch, optimizer=make_opt(model.parameters()), device="cpu", verbose=False,
                            **options)


@pytest.mark.parametrize("hidden, depth, names", [
    (24, 3, "entry 'model.layers.0.weight' is [16, 32] float32, expected [24, 32] float32"),
    (16, 4, "no entry 'model.layers.2.weight'"),
    (16, 2, "holds 'model.layers.1.bias', which this MemGraph's model does not have"),
], ids=["another shape", "an entry less", "an entry more"])
def test_a_checkpoint_of_another_model_is_refused_naming_the_entry_and_nothing_changes(tmp_path, hidden, depth,
                                                                                       names):
    model, loss_fn, batches = small_mlp()
    saved = compiled_mlp(model, loss_fn, batches[0])
    engine.run(saved, batches[0])
    memgraph.save_checkpoint(saved, tmp_path / "checkpoint")
    other, loss_fn, batches = small_mlp(hidden, depth)
    mg = compiled_mlp(other, loss_fn, batches[0])
    engine.run(mg, batches[1])
    state, optimizer = mg.state_dict(), mg.optimizer.state_dict()
    with pytest.raises(ValueError, match=re.escape(f"checkpoint {tmp_path / 'checkpoint'}: ") + ".*" + re.escape(names)):
        memgraph.load_checkpoint(mg, tmp_path / "checkpoint")
    assert mg.runtime is not None and mg.optimizer.steps_taken() == 1
    assert_same_state(mg.state_dict(), mg.optimizer.state_dict(), state, optimizer)


def test_an_eager_checkpoint_loads_into_a_memgraph_which_goes_on_as_eager_does(tmp_path):
    model, loss_fn, batches = small_mlp()
    mg = compiled_mlp(model, loss_fn, batches[0])
    eager = copy.deepcopy(model)
    opt = adamw(eager.parameters())
    eager_step(eager, opt, loss_fn, [batches[0]])
    dcp.save({"model": get_model_state_dict(eager), "optim": get_optimizer_state_dict(eager, opt)},
             checkpoint_id=tmp_path / "checkpoint")
    memgraph.load_checkpoint(mg, tmp_path / "checkpoint")
    assert mg.optimizer.steps_taken() == 1  # read from the optimizer's per-parameter step: eager saves no other
    engine.run(mg, batches[1])
    eager_step(eager, opt, loss_fn, [batches[1]])
    assert_same_state(mg.state_dict(), mg.optimizer.state_dict(), eager.state_dict(), opt.state_dict())


def test_a_checkpoint_before_the_first_step_holds_no_optimizer_state_and_resumes(tmp_path):
    model, loss_fn, batches = small_mlp()
    mg = compiled_mlp(model, loss_fn, batches[0])
    memgraph.save_checkpoint(mg, tmp_path / "checkpoint")
    entries = dcp.FileSystemReader(tmp_path / "checkpoint").read_metadata().state_dict_metadata
    assert not any(key.startswith("optim.state.") for key in entries) and "model.out.weight" in entries
    resumed = compiled_mlp(model, loss_fn, batches[0])
    memgraph.load_checkpoint(resumed, tmp_path / "checkpoint")
    for batch in batches:
        engine.run(mg, batch)
        engine.run(resumed, batch)
    assert resumed.optimizer.steps_taken() == 2
    assert_same_state(resumed.state_dict(), resumed.optimizer.state_dict(), mg.state_dict(), mg.optimizer.state_dict())


def sgd_with_momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("make_opt, options", [(adamw, {"fused_optimizer": True}), (sgd_with_momentum, {})],
                         ids=["fused adamw", "sgd with momentum"])
def test_a_resumed_step_counts_on_from_the_saved_step(tmp_path, make_opt, options):
    """torch's fused Adam reads the step count from a device tensor the step keeps beside the weights;
    SGD's first update differs from the next ones, yet torch's state keeps no step for it."""
    model, loss_fn, batches = small_mlp()
    mg = compiled_mlp(model, loss_fn, batches[0], make_opt, **options)
    engine.run(mg, batches[0])
    memgraph.save_checkpoint(mg, tmp_path / "checkpoint")
    engine.run(mg, batches[1])
    resumed = compiled_mlp(model, loss_fn, batches[0], make_opt, **options)
    memgraph.load_checkpoint(resumed, tmp_path / "checkpoint")
    engine.run(resumed, batches[1])
    assert_same_state(resumed.state_dict(), resumed.optimizer.state_dict(), mg.state_dict(), mg.optimizer.state_dict())


def asgd(lr: float):
    return lambda params: torch.optim.ASGD(params, lr=lr, t0=0.0)


def test_host_states_resume_as_saved_even_when_the_lr_changed(tmp_path):
    """ASGD keeps its step size as torch's state, made from the lr of the step that set it: a resumed
    run takes it from the checkpoint, not from the lr it resumes with (an LR scheduler's next one)."""
    model, loss_fn, batches = small_mlp()
    mg = compiled_mlp(model, loss_fn, batches[0], asgd(0.1))
    engine.run(mg, batches[0])
    memgraph.save_checkpoint(mg, tmp_path / "checkpoint")
    resumed = compiled_mlp(model, loss_fn, batches[0], asgd(0.02))
    memgraph.load_checkpoint(resumed, tmp_path / "checkpoint")
    engine.run(resumed, batches[1])
    eager = copy.deepcopy(model)
    opt = asgd(0.1)(eager.parameters())
    eager_step(eager, opt, loss_fn, [batches[0]])
    opt.param_groups[0]["lr"] = 0.02
    eager_step(eager, opt, loss_fn, [batches[1]])
    assert_same_state(resumed.state_dict(), resumed.optimizer.state_dict(), eager.state_dict(), opt.state_dict())
