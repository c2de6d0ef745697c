"""A naive, independent reference: full-vocabulary softmax in float64 with plain autograd.

Written for clarity, not speed: Python dictionaries for the number table, loops for number-level
assembly. The library's fused code shares nothing with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _table(vocab):
    return {int(i): float(v) for i, v in zip(vocab.ids.tolist(), vocab.values.tolist())}


def _distance(values_row: torch.Tensor, target: float, all_values: list[float], squash: float | None):
    diff = (values_row - target).abs()
    if squash is None:
        return diff
    pairs = torch.tensor([abs(a - b) for a in all_values for b in all_values], dtype=torch.float64)
    smallest = pairs[pairs > 0].min()
    largest = pairs.max()
    scaled = 1 + (diff - smallest) * (squash - 1) / (largest - smallest)
    return torch.where(diff == 0, torch.zeros_like(diff), scaled)


def naive_per_token(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab,
    *,
    loss: str = "was",
    squash_factor: float | None = None,
    reweigh: bool = False,
    huber_delta: float = 1.0,
    float_level: bool = False,
    ignore_index: int = -100,
):
    """Per-token ``(ce, ntl, mask)`` like ``vocab_parallel_ce_ntl``, computed the obvious way.

    ``logits`` ``[..., V]`` (any float dtype; upcast to float64 here), ``labels`` ``[...]``.
    """
    table = _table(vocab)
    ids = torch.tensor(sorted(table))
    values = torch.tensor([table[i] for i in sorted(table)], dtype=torch.float64)
    z = logits.to(torch.float64)
    shape = labels.shape
    z = z.reshape(-1, z.shape[-1])
    flat = labels.reshape(-1)
    valid = flat != ignore_index
    safe = torch.where(valid, flat, torch.zeros_like(flat))
    ce = -F.log_softmax(z, dim=-1).gather(1, safe.unsqueeze(1)).squeeze(1)
    ce = torch.where(valid, ce, torch.zeros_like(ce))
    p = F.softmax(z[:, ids], dim=-1)
    mass = F.softmax(z, dim=-1)[:, ids].sum(-1)
    yhat = (p * values).sum(-1)
    is_num = torch.tensor([bool(v) and int(t) in table for t, v in zip(flat.tolist(), valid.tolist())])
    target = torch.tensor([table.get(int(t), 0.0) for t in flat.tolist()], dtype=torch.float64)

    vals = values.tolist()
    if loss == "was":
        per = []
        for i in range(flat.numel()):
            if is_num[i]:
                per.append((p[i] * _distance(values, target[i].item(), vals, squash_factor)).sum())
            else:
                per.append(z.new_zeros(()))
        ntl = torch.stack(per) if per else z.new_zeros(0)
        max_loss = float(max(_distance(values, v, vals, squash_factor).max() for v in vals))
        mask = is_num
    elif loss in ("mse", "mae", "huber"):
        if loss == "mse":
            ntl = (yhat - target) ** 2
            max_loss = (max(vals) - min(vals)) ** 2
        elif loss == "mae":
            ntl = (yhat - target).abs()
            max_loss = max(vals) - min(vals)
        else:
            ntl = F.huber_loss(yhat, target, reduction="none", delta=huber_delta)
            gap = max(vals) - min(vals)
            max_loss = 0.5 * gap**2 if gap < huber_delta else huber_delta * (gap - 0.5 * huber_delta)
        mask = is_num
    else:
        seq = shape[-1]
        dot = vocab.decimal_point_id
        numbers_pred, numbers_true, mask_list = [], [], []
        for row in range(flat.numel() // seq):
            lo = row * seq
            j = 0
            while j < seq:
                if not is_num[lo + j]:
                    numbers_pred.append(z.new_zeros(()))
                    numbers_true.append(0.0)
                    mask_list.append(False)
                    j += 1
                    continue
                run = [lo + j]
                k = j + 1
                while k < seq:
                    if is_num[lo + k]:
                        run.append(lo + k)
                        k += 1
                    elif (
                        float_level
                        and valid[lo + k]
                        and int(flat[lo + k]) == dot
                        and k + 1 < seq
                        and is_num[lo + k + 1]
                    ):
                        k += 1
                    else:
                        break
                pred = sum(yhat[pos] * 10.0 ** (len(run) - 1 - n) for n, pos in enumerate(run))
                true = sum(target[pos].item() * 10.0 ** (len(run) - 1 - n) for n, pos in enumerate(run))
                numbers_pred.append(pred)
                numbers_true.append(true)
                mask_list.append(True)
                for _ in range(k - j - 1):
                    numbers_pred.append(z.new_zeros(()))
                    numbers_true.append(0.0)
                    mask_list.append(False)
                j = k
        npred = torch.stack(numbers_pred)
        ntrue = torch.tensor(numbers_true, dtype=torch.float64)
        eps = float(torch.finfo(torch.float32).eps)
        ntl = (npred - ntrue).abs() / (npred.abs() + ntrue.abs() + eps)
        mask = torch.tensor(mask_list)
        max_loss = 1.0
    if reweigh:
        ntl = ntl * mass + 1.01 * max_loss * (1 - mass)
    ntl = torch.where(mask, ntl, torch.zeros_like(ntl))
    return ce.view(shape), ntl.view(shape), mask.view(shape)


def naive_reduce(per_token, mask, weights, reduction):
    """Reference reduction: weighted mean over the mask (0 when empty), sum, or per position."""
    w = mask.to(torch.float64) if weights is None else torch.where(mask, weights.to(torch.float64), 0.0)
    if reduction == "none":
        return per_token * w
    total = (per_token * w).sum()
    if reduction == "sum":
        return total
    return total / w.sum() if float(w.sum()) > 0 else total * 0


def dense_per_token(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    *,
    loss: str = "was",
    reweigh: bool = False,
    ignore_index: int = -100,
):
    """Per-token ``(ce, ntl, is_number)`` in float64 without Python loops, for GPU-sized inputs.

    The definitions of :func:`naive_per_token` for NTL-WAS (plain distance) and NTL-MSE, written as whole-tensor
    ops so that 8192 x 128256 logits take seconds on a GPU (the naive loops take minutes there).
    ``logits [T, V]``, ``labels [T]``, ``ids``/``values``: the number table (ids ascending).
    """
    if loss not in ("was", "mse"):
        raise ValueError(f"dense_per_token supports loss='was' or 'mse', got {loss!r}")
    z = logits.to(torch.float64)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    log_p = F.log_softmax(z, dim=-1)
    ce = torch.where(valid, -log_p.gather(1, safe[:, None])[:, 0], torch.zeros((), dtype=z.dtype, device=z.device))
    ids = ids.to(z.device)
    values = values.to(z.device, torch.float64)
    by_id = torch.full((z.shape[-1],), float("nan"), dtype=torch.float64, device=z.device)
    by_id[ids] = values
    target = by_id[safe]
    is_number = valid & ~torch.isnan(target)
    target = torch.where(is_number, target, torch.zeros_like(target))
    p = F.softmax(z[:, ids], dim=-1)
    gap = float(values.max() - values.min())
    if loss == "was":
        ntl = (p * (values[None, :] - target[:, None]).abs()).sum(-1)
        max_loss = gap
    else:
        ntl = ((p * values[None, :]).sum(-1) - target) ** 2
        max_loss = gap**2
    if reweigh:
        mass = log_p[:, ids].exp().sum(-1)
        ntl = ntl * mass + 1.01 * max_loss * (1 - mass)
    ntl = torch.where(is_number, ntl, torch.zeros_like(ntl))
    return ce, ntl, is_number


def reference_ce_features(z, labels, *, label_smoothing=0.0, z_loss_weight=0.0, logit_softcap=None, ignore_index=-100):
    """Per-token CE term and log-sum-exp of ``[T, V]`` full logits from the definitions, in float64.

    Soft-capping ``c * tanh(z / c)`` first; torch's ``F.cross_entropy(label_smoothing=)`` (the target
    ``(1 - eps) onehot + eps / V`` over the whole vocabulary); plus the z-loss ``w * logsumexp(z)**2`` on
    the non-ignored labels. Returns ``(ce_term, lse)``, each ``[T]``.
    """
    z = z.to(torch.float64)
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    ce = F.cross_entropy(z, labels, label_smoothing=label_smoothing, reduction="none", ignore_index=ignore_index)
    lse = torch.logsumexp(z, dim=-1)
    return ce + torch.where(labels != ignore_index, z_loss_weight * lse**2, 0), lse
