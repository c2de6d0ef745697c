"""NTL alone does the least work: what the NTL-only paths allocate, read and import (issue 43, item 3).

Sections:
1. Logits: ``number_token_loss`` without reweighing reads the logits once, through the number columns,
   and allocates one logits-sized buffer, the gradient autograd needs (a zero fill and the number
   columns added into it), counted op by op with a ``TorchDispatchMode``, for contiguous and shifted
   (non-contiguous) logits, which are not copied; its loss and gradient are the float64 reference's.
   That gradient reaches the logits as a tensor of their shape, not through
   a view, so that autograd adds another loss's gradient (``F.cross_entropy``'s) into it in place.
2. Hidden states: the chunked op's NTL-only path makes no ``[T, V]`` tensor at all.
3. Imports: a first call of each loss in a fresh process does not import ``torch.distributed.tensor``
   (sympy and some 500 modules: 1.4 s and 30-45 MiB of resident memory on the CPU, paid by every
   process's first step before the fix).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ntl_scale
from tests.helpers.data import random_labels, random_logits
from tests.helpers.reference import naive_per_token, naive_reduce

ROOT = Path(__file__).resolve().parents[2]
# ops that only re-describe a tensor (no element is read or written)
_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "alias", "detach", "as_strided", "expand", "slice", "t"}


class _BigTensors(TorchDispatchMode):
    """Records every aten op that reads or writes a tensor whose storage holds at least ``nbytes``,
    and each new storage of that size (``known``: the storages that existed before, by address)."""

    def __init__(self, nbytes: int, known: set[int]) -> None:
        super().__init__()
        self.nbytes, self.known = nbytes, set(known)
        self.ops: list[str] = []
        self.new: list[str] = []

    def _big(self, tree: object) -> list[torch.Tensor]:
        leaves = tree_leaves(tree)
        return [
            t
            for t in leaves
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().nbytes() >= self.nbytes
        ]  # a meta tensor (the chunked op's shape-only stand-in for its logits) holds no memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        touched = self._big((args, kwargs)) + self._big(out)
        for t in self._big(out):
            if t.untyped_storage().data_ptr() not in self.known:
                self.known.add(t.untyped_storage().data_ptr())
                self.new.append(name)
        if touched and name not in _VIEWS:
            self.ops.append(name)
        return out


def _vocab(size: int) -> ntl_scale.NumberVocab:
    return ntl_scale.NumberVocab.from_id_to_token([f"w{i}" for i in range(5)] + [str(d) for d in range(10)] +
                                                  [f"w{i}" for i in range(15, size)])  # fmt: skip


# ------------------------------------------------------------------------------------------ 1. logits


@pytest.mark.parametrize("shifted", [False, True], ids=["contiguous", "shifted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ntl_alone_reads_the_number_columns_once_and_allocates_only_the_gradient(dtype, shifted):
    vocab, shape = _vocab(700), (3, 40, 700)
    labels = random_labels(vocab, shape[:-1], shape[-1], seed=1)
    # shifted: the logits of positions 0..S-2 of a longer sequence, a non-contiguous view (as after the
    # causal shift), which must not be copied; its slicing's own backward is the caller's
    full = random_logits((3, 41, 700) if shifted else shape, seed=2, dtype=dtype).requires_grad_()
    logits = full[:, :-1] if shifted else full
    ntl_scale.number_token_loss(logits, labels, vocab).backward()  # caches (tables on the device) built
    full.grad = None
    mode = _BigTensors(logits.numel() * logits.element_size(), {full.untyped_storage().data_ptr()})
    with mode:
        loss = ntl_scale.number_token_loss(logits, labels, vocab)
        loss.backward()
    # one read of the logits (the number columns), then the gradient: a zero fill and the number
    # columns' part added in; nothing else touches a logits-sized tensor
    caller = ["slice_backward"] if shifted else []
    assert mode.ops == ["index_select", "zeros", "index_add_", *caller], mode.ops
    assert mode.new == ["zeros", *caller], mode.new

    ref_full = full.detach().to(torch.float64).requires_grad_()
    _, ntl, mask = naive_per_token(ref_full[:, :-1] if shifted else ref_full, labels, vocab)
    ref = naive_reduce(ntl, mask, None, "mean")
    ref.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(loss.detach().to(torch.float64), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(full.grad.to(torch.float64), ref_full.grad, rtol=tol, atol=tol)
    others = torch.ones(shape[-1], dtype=torch.bool)
    others[vocab.ids] = False
    assert not full.grad[..., others].any()  # the gradient is the number columns' alone


def test_ntl_gradient_reaches_the_logits_without_a_view():
    # A view between the logits and the loss (reshape to [T, V]) hands autograd a gradient whose base
    # is still alive: it then adds CE's gradient out of place, one more logits-sized buffer and pass
    vocab, shape = _vocab(300), (2, 5, 300)
    labels = random_labels(vocab, shape[:-1], shape[-1], seed=6)
    logits = random_logits(shape, seed=7, dtype=torch.float32).requires_grad_()
    loss = ntl_scale.number_token_loss(logits, labels, vocab)
    nodes, stack = [], [loss.grad_fn]
    while stack:  # the nodes whose gradient goes straight to the logits
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if getattr(child, "variable", None) is logits:
                nodes.append(node)
            else:
                stack.append(child)
    assert [type(n).__name__ for n in nodes] == ["_NumberColumnsNTLBackward"], nodes
    grads = []
    nodes[0].register_hook(lambda grad_inputs, _: grads.append(grad_inputs[0]))
    loss.backward()
    assert grads[0].shape == logits.shape and grads[0]._base is None


# ----------------------------------------------------------------------------------- 2. hidden states


def test_chunked_ntl_alone_makes_no_logits():
    vocab, tokens, width, hidden_size = _vocab(900), 64, 900, 8
    labels = random_labels(vocab, (tokens,), width, seed=3)
    hidden = random_logits((tokens, hidden_size), seed=4, dtype=torch.float32, scale=1.0).requires_grad_()
    weight = random_logits((width, hidden_size), seed=5, dtype=torch.float32, scale=1.0).requires_grad_()
    options = ntl_scale.NTLOptions()

    def step() -> torch.Tensor:
        terms = ntl_scale.linear_ce_ntl(hidden, weight, labels, vocab, options, need_ce=False)
        loss = terms.ntl.sum() / terms.number_mask.sum()
        loss.backward()
        return loss

    step()
    hidden.grad = weight.grad = None
    logits_bytes = tokens * width * 4  # 7x the weight: only a [T, V] tensor reaches it
    mode = _BigTensors(logits_bytes, set())
    with mode:
        loss = step()
    assert mode.ops == [] and mode.new == [], (mode.ops, mode.new)

    ref_h, ref_w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    _, ntl, mask = naive_per_token(ref_h @ ref_w.t(), labels, vocab)
    ref = naive_reduce(ntl, mask, None, "mean")
    ref.backward()
    torch.testing.assert_close(loss.detach().double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad.double(), ref_h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), ref_w.grad, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------ 3. imports


def test_first_call_of_each_loss_imports_no_dtensor_machinery():
    code = (
        "import sys, torch, ntl_scale\n"
        "v = ntl_scale.NumberVocab.from_id_to_token([str(d) for d in range(10)] + ['x', 'y'])\n"
        "z = torch.randn(2, 3, 12, requires_grad=True)\n"
        "y = torch.tensor([[0, 10, 3], [11, 7, -100]])\n"
        "ntl_scale.number_token_loss(z, y, v).backward()\n"
        "ntl_scale.number_token_loss(z, y, v, reweigh=True).backward()\n"
        "ntl_scale.ce_with_ntl(z, y, v).loss.backward()\n"
        "h, w = torch.randn(6, 4, requires_grad=True), torch.randn(12, 4, requires_grad=True)\n"
        "ntl_scale.linear_ce_with_ntl(h, w, y.reshape(-1), v).loss.backward()\n"
        "ntl_scale.linear_ce_ntl(h, w, y.reshape(-1), v, need_ce=False).ntl.sum().backward()\n"
        "print(sorted(m for m in ('torch.distributed.tensor', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
