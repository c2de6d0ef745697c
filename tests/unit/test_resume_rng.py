"""A resumed run continues every random generator of every rank: ``Checkpointer.save`` / ``.load``.

DeepSpeed's engine is replaced by a stand-in that, like DeepSpeed under ZeRO stages 1 and 2, stores the
client state from rank 0 only (the data-parallel writer), and the accelerator by ``FakeAccelerator``
(tests/helpers/fake_accelerator.py), whose device generators are observable CPU generators. Two ranks
are simulated one after the other in this process (the CPU, Python and NumPy generators are
process-wide: each simulated rank sets them).

The reference is what the uninterrupted process would draw next, recorded at the checkpoint through
the fake and the generators themselves, never through the code under test.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from tests.helpers.fake_accelerator import FakeAccelerator

deepspeed = pytest.importorskip("deepspeed")

from deepspeed.accelerator import real_accelerator  # noqa: E402

from ntl_scale.integrations.deepspeed.checkpointer import Checkpointer  # noqa: E402
from ntl_scale.integrations.deepspeed.resume_layout import Layout  # noqa: E402
from ntl_scale.training import collectives  # noqa: E402

SEED = 1234  # train.seed: what every restarted process seeds its generators with


class CheckpointEngine:
    """DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` (ZeRO 1 and 2) as far as the client state
    goes: rank 0 writes it into ``<tag>/mp_rank_00_model_states.pt``; every rank reads that file back."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        if self.rank == 0:
            torch.save(client_state, os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))

    def load_checkpoint(self, load_dir):
        with open(os.path.join(load_dir, "latest")) as f:
            path = os.path.join(load_dir, f.read().strip(), "mp_rank_00_model_states.pt")
        return path, torch.load(path, weights_only=True)


POSITION = 48  # the data position stored with the checkpoint


def _checkpointer(run_dir, rank: int, world: int, resume: str | None = None) -> Checkpointer:
    checkpointer = Checkpointer(str(run_dir), Layout(world, 1, 16), save_every=0, rank=rank, device=torch.device("cpu"))
    checkpointer.resume = resume  # what plan() decides (a universal resume would convert here first)
    return checkpointer


def _process(seed: int) -> None:
    """A process's global generators: seeded (a fresh start) or moved to another state (a rank that drew)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _draws(accelerator: FakeAccelerator) -> dict:
    """What the process draws next from every generator."""
    return {
        "device": [accelerator.draw(i) for i in range(accelerator.device_count())],
        "cpu": torch.rand(4).tolist(),
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.rand(3).tolist(),
    }


@pytest.fixture
def no_barrier(monkeypatch):
    monkeypatch.setattr(collectives.dist, "barrier", lambda *args, **kwargs: None)


def _use(monkeypatch, accelerator) -> None:
    """``deepspeed.get_accelerator()`` answers ``accelerator`` (DeepSpeed's own override slot)."""
    monkeypatch.setattr(real_accelerator, "ds_accelerator", accelerator)


def _save_two_ranks(run_dir, monkeypatch) -> dict[int, dict]:
    """Ranks 0 and 1 (2 devices each) drew differently, then checkpoint at step 3: per rank, the device
    states at the checkpoint, its CPU state, and what the uninterrupted process draws next."""
    saved = {}
    for rank in (0, 1):
        accelerator = FakeAccelerator(2, seed=SEED)
        _use(monkeypatch, accelerator)
        _process(100 + rank)
        for device in range(2):
            accelerator.draw(device, n=5 + 3 * rank + device)  # dropout masks of this rank's own sizes
        states = [accelerator.get_rng_state(i).clone() for i in range(2)]
        cpu = torch.get_rng_state().clone()
        _checkpointer(run_dir, rank, 2).save(CheckpointEngine(rank), 3, POSITION)
        saved[rank] = {"device": states, "cpu": cpu, "next": _draws(accelerator)}
    return saved


def test_each_rank_resumes_every_generator_it_saved(tmp_path, monkeypatch, no_barrier, capsys):
    saved = _save_two_ranks(tmp_path, monkeypatch)
    assert not torch.equal(saved[0]["device"][0], saved[1]["device"][0])  # the ranks' states differ
    for rank in (1, 0):
        restarted = FakeAccelerator(2, seed=SEED)  # a new process: its devices seeded from train.seed
        _use(monkeypatch, restarted)
        _process(SEED)
        assert _checkpointer(tmp_path, rank, 2).plan() == "same"  # the layout the checkpoint records
        assert _checkpointer(tmp_path, rank, 2, resume="same").load(CheckpointEngine(rank)) == (3, POSITION)
        for device in range(2):
            assert torch.equal(restarted.get_rng_state(device), saved[rank]["device"][device]), (rank, device)
        assert torch.equal(torch.get_rng_state(), saved[rank]["cpu"]), rank
        assert _draws(restarted) == saved[rank]["next"], rank
    assert capsys.readouterr().out.strip() == "resumed from step 3"  # exact: no note


def test_a_checkpoint_without_generator_files_loads_as_before(tmp_path, monkeypatch, no_barrier, capsys):
    """Written before per-rank states (client state only): it loads; the CPU generator takes the client
    state (rank 0's), the device generators keep their train.seed state, and the log says so."""
    _process(7)
    cpu = torch.get_rng_state().clone()
    ckpt = tmp_path / "checkpoints"
    CheckpointEngine(0).save_checkpoint(str(ckpt), "step3", {"step": 3, "examples_consumed": 48, "rng": cpu}, False)
    (ckpt / "latest").write_text("step3")
    restarted, seeded = FakeAccelerator(2, seed=SEED), FakeAccelerator(2, seed=SEED)
    _use(monkeypatch, restarted)
    _process(SEED)
    assert _checkpointer(tmp_path, 1, 2).plan() == "same"  # no recorded layout (older run): as written
    assert _checkpointer(tmp_path, 1, 2, resume="same").load(CheckpointEngine(1)) == (3, 48)
    assert torch.equal(torch.get_rng_state(), cpu)
    for device in range(2):
        assert torch.equal(restarted.get_rng_state(device), seeded.get_rng_state(device))
    _checkpointer(tmp_path, 0, 2, resume="same").load(CheckpointEngine(0))
    out = capsys.readouterr().out
    assert "resumed from step 3" in out and "has no per-rank generator states" in out
    assert "device generators restart from train.seed" in out


def test_another_layout_restores_the_cpu_generator_of_rank_0_only(tmp_path, monkeypatch, no_barrier, capsys):
    """Resumed on 1 rank (a universal checkpoint): rank 0's CPU state, device generators from the seed."""
    saved = _save_two_ranks(tmp_path, monkeypatch)
    restarted, seeded = FakeAccelerator(2, seed=SEED), FakeAccelerator(2, seed=SEED)
    _use(monkeypatch, restarted)
    _process(SEED)
    _checkpointer(tmp_path, 0, 1, resume="universal").load(CheckpointEngine(0))
    assert torch.equal(torch.get_rng_state(), saved[0]["cpu"])
    for device in range(2):
        assert torch.equal(restarted.get_rng_state(device), seeded.get_rng_state(device))
    assert "is of another layout" in capsys.readouterr().out


@pytest.mark.parametrize("devices_now", [1, 3])
def test_another_number_of_devices_restores_those_present(devices_now):
    from ntl_scale.integrations.deepspeed.resume_layout import restore_rng, rng_state

    before = FakeAccelerator(2, seed=5)
    before.draw(0, n=3), before.draw(1, n=7)
    states = [before.get_rng_state(i).clone() for i in range(2)]
    state = rng_state(before)
    now, seeded = FakeAccelerator(devices_now, seed=SEED), FakeAccelerator(devices_now, seed=SEED)
    note = restore_rng(state, now)
    assert note is not None and f"holds 2 fake generator state(s), this process has {devices_now}" in note
    for device in range(min(2, devices_now)):
        assert torch.equal(now.get_rng_state(device), states[device])
    for device in range(2, devices_now):  # no saved state: left as it was
        assert torch.equal(now.get_rng_state(device), seeded.get_rng_state(device))


def test_the_cpu_accelerator_has_no_device_generators_of_its_own():
    """DeepSpeed's CPU accelerator answers the CPU generator for every device index: nothing is saved
    twice, and its ``set_rng_state(state, index)`` (which torch.set_rng_state cannot take) is never called."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from ntl_scale.integrations.deepspeed.resume_layout import restore_rng, rng_state

    _process(11)
    state = rng_state(CPU_Accelerator())
    expected = torch.rand(5)
    _process(12)
    assert state["device"] == [] and restore_rng(state, CPU_Accelerator()) is None
    assert torch.equal(torch.rand(5), expected)
