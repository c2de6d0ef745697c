"""Plumbing of the vocab-parallel op, in the style of Megatron's own tests.

A fake TP group and a recording ``torch.distributed.all_reduce`` prove that the passed group is the
one used, that the forward issues exactly two all-reduces (one MAX of 2 floats per token, one SUM of
4 floats per token) and the backward none, and that no global process-group state is read.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ntl_scale


class FakeGroup:
    """Stands for a TP group of size 2; never a real ProcessGroup."""


@pytest.fixture
def recorder(monkeypatch):
    calls = []
    group = FakeGroup()

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append({"op": op, "group": group, "shape": tuple(tensor.shape), "dtype": tensor.dtype})

    def no_global_state(*args, **kwargs):
        raise AssertionError("the library read global process-group state")

    def world_size(group_arg=None):
        if group_arg is not group:
            raise AssertionError(f"get_world_size called with {group_arg!r}, not the passed group")
        return 2

    def rank(group_arg=None):
        if group_arg is not group:
            raise AssertionError(f"get_rank called with {group_arg!r}, not the passed group")
        return 1

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", world_size)
    monkeypatch.setattr(dist, "get_rank", rank)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", no_global_state)
    monkeypatch.setattr(dist, "is_initialized", no_global_state)
    return calls, group


def _inputs():
    tokens = ["a", "b", "."] + [str(d) for d in range(10)] + [f"w{i}" for i in range(19)]
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens)  # 32 columns, TP=2 -> 16 per rank
    labels = torch.tensor([[3, 4, 20, -100, 12], [5, 6, 7, 0, 1]])
    shard = torch.randn(2, 5, 16, requires_grad=True)
    return vocab, labels, shard


@pytest.mark.parametrize("loss", ntl_scale.LOSS_KINDS)
@pytest.mark.parametrize("reweigh", [False, True])
def test_forward_two_all_reduces_backward_none(recorder, loss, reweigh):
    calls, group = recorder
    vocab, labels, shard = _inputs()
    ce, ntl, _ = ntl_scale.vocab_parallel_ce_ntl(
        shard, labels, vocab, loss=loss, reweigh=reweigh, tp_group=group, check_finite=False
    )
    assert [c["op"] for c in calls] == [dist.ReduceOp.MAX, dist.ReduceOp.SUM]
    assert all(c["group"] is group for c in calls)
    assert [c["shape"] for c in calls] == [(10, 2), (10, 4)]  # 2 + 4 floats per token
    assert all(c["dtype"] == torch.float32 for c in calls)
    forward_calls = len(calls)
    (ce.sum() + ntl.sum()).backward()
    assert len(calls) == forward_calls  # the backward communicates nothing
    assert shard.grad is not None and shard.grad.shape == shard.shape


def test_ce_with_ntl_uses_the_group(recorder):
    calls, group = recorder
    vocab, labels, shard = _inputs()
    out = ntl_scale.ce_with_ntl(shard, labels, vocab, tp_group=group, check_finite=False)
    out.loss.backward()
    assert len(calls) == 2 and all(c["group"] is group for c in calls)


def test_no_group_means_no_collective(recorder):
    calls, _ = recorder
    vocab, labels, _ = _inputs()
    full = torch.randn(2, 5, 32, requires_grad=True)
    out = ntl_scale.ce_with_ntl(full, labels, vocab)
    out.loss.backward()
    assert calls == []


@pytest.mark.parametrize("need_ce", [True, False])
def test_chunked_op_two_all_reduces_per_chunk_backward_none(recorder, need_ce):
    """``linear_ce_ntl``: the same MAX/SUM pair per chunk of tokens (once when only the number columns
    are read), on the passed group; none in the backward."""
    calls, group = recorder
    vocab, labels, _ = _inputs()
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)  # this rank's 16 of 32 rows
    terms = ntl_scale.linear_ce_ntl(hidden, weight, labels, vocab, tp_group=group, chunk_tokens=4, need_ce=need_ce)
    chunks = [(4, 2), (4, 2), (2, 2)] if need_ce else [(10, 2)]
    assert [c["op"] for c in calls] == [dist.ReduceOp.MAX, dist.ReduceOp.SUM] * len(chunks)
    assert [c["shape"] for c in calls[::2]] == chunks and all(c["group"] is group for c in calls)
    forward_calls = len(calls)
    (terms.ce.sum() + terms.ntl.sum()).backward()
    assert len(calls) == forward_calls


def test_collectives_are_written_in_the_logits_op_only():
    """The TP all-reduces of the loss are called in ``ops/logits.py`` only (its named helpers), not in the
    other modules of the loss path; the Triton kernels (``ops/triton_*.py``) hold per-shard math: no collective
    and no import of ``ops/logits.py`` (no import cycle). (Step counts, ``normalization.py``, have their own
    all-reduce.)"""
    import ast
    import pathlib

    root = pathlib.Path(ntl_scale.__file__).parent
    loss_path = ["options.py", "_validation.py", "ops/shards.py", "ops/shard_math.py", "ops/logits.py",
                 "ops/chunked_linear.py", "terms.py", "reductions.py", "losses.py", "linear.py",
                 "number_vocab.py"]  # fmt: skip
    kernels = sorted(root.glob("ops/triton_*.py"))
    assert kernels, "no Triton kernel module found under ops/"
    callers = {}
    for path in [*(root / name for name in loss_path), *kernels]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and "reduce" in node.func.attr:
                if node.func.attr in ("all_reduce", "reduce", "reduce_scatter", "all_reduce_coalesced"):
                    callers.setdefault(path.name, []).append(node.lineno)
            if path in kernels and isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                names += [a.name for a in node.names]
                assert not any("logits" in n or "distributed" in n for n in names), (path.name, names)
    assert set(callers) == {"logits.py"}, callers
    assert len(callers["logits.py"]) == 2  # all_reduce_max and all_reduce_sums
