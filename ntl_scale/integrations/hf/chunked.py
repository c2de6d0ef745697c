"""Hugging Face route 2: CE + NTL from a causal LM's final hidden states; the training forward builds no logits.

``apply_ntl_to_hf_model(chunked=True)`` installs :func:`install_linear_loss_head` on the output layer and
:func:`chunked_forward` as the model's forward; :class:`ChunkedLossCausalLM` wraps a model for
``launch/train.py``'s loop. In training with labels the decoder runs to its final hidden states and the
output layer, called with the targets, computes CE and NTL chunk by chunk (:func:`ntl_scale.linear_ce_ntl`);
anything else is the model's own forward. The loss runs inside the layer's ``forward``, so ZeRO-3 and FSDP2
gather its weight there as for any layer.

Known transforms between hidden state and logits are reproduced: ``logits_scaling``, ``logit_scale``,
``lm_head_multiplier`` (:func:`logit_multiplier`) and ``final_logit_softcapping`` (:func:`head_options`);
:func:`check_head` refuses any other where the weights are materialised.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ...linear import linear_ce_ntl
from ...number_vocab import NumberVocab
from ...ops.shards import is_dtensor
from ...options import NTLOptions, check_option
from ...terms import PerTokenTerms

__all__ = [
    "ChunkedLossCausalLM",
    "check_head",
    "chunked_forward",
    "framework_forward",
    "install_linear_loss_head",
    "linear_head",
    "logit_multiplier",
    "remove_linear_loss_head",
]


def _text_config(model: Any) -> Any:
    config = model.config
    return getattr(config, "text_config", None) or config


def logit_multiplier(model: Any) -> float:
    """The factor a model applies to ``head(hidden)`` to get its logits (soft-capping aside)."""
    config = _text_config(model)
    multiplier = 1.0
    for name, invert in (("logits_scaling", True), ("logit_scale", False), ("lm_head_multiplier", False)):
        value = getattr(config, name, None)
        if value is None:
            continue
        if not isinstance(value, numbers.Real) or value == 0:
            raise ValueError(f"{type(model).__name__}: config.{name}={value!r} is not a non-zero number")
        multiplier = multiplier / float(value) if invert else multiplier * float(value)
    return multiplier


def model_softcap(model: Any) -> float | None:
    """The model's own soft-capping of its logits (Gemma 2/3 ``final_logit_softcapping``), or None."""
    cap = getattr(_text_config(model), "final_logit_softcapping", None)
    if cap is None or cap == 0:
        return None
    if not isinstance(cap, numbers.Real):
        raise ValueError(f"{type(model).__name__}: config.final_logit_softcapping={cap!r} is not a number")
    return float(cap)


def head_options(model: Any, options: NTLOptions) -> NTLOptions:
    """``options`` with the model's own soft-capping as ``logit_softcap``; refuses capping twice."""
    cap = model_softcap(model)
    if cap is None:
        return options
    if options.logit_softcap is not None:
        raise ValueError(
            f"{type(model).__name__} soft-caps its logits itself (final_logit_softcapping={cap:g}); "
            f"options.logit_softcap={options.logit_softcap!r} would cap them twice: leave it None (the chunked "
            "route takes the model's cap)"
        )
    return dataclasses.replace(options, logit_softcap=cap)


def _materialised(module: torch.nn.Module) -> bool:
    """Real weights here (not meta, not partitioned by ZeRO-3, not sharded by FSDP2)."""
    return all(
        p.device.type != "meta" and p.numel() > 0 and not hasattr(p, "ds_id") and not is_dtensor(p)
        for p in module.parameters()
    )


def _fully_sharded(model: Any) -> bool:
    """``model`` is sharded by FSDP2 (its forward gathers the output layer's weight)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@torch.no_grad()
def check_head(model: Any, multiplier: float, head: torch.nn.Linear) -> bool:
    """Refuses a model whose logits are not ``head(last hidden state) * multiplier`` on four tokens.

    Returns False (skipped) where the weights are not materialised, e.g. under ZeRO-3.
    """
    if not _materialised(model):
        return False
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = torch.arange(4, device=device).reshape(1, 4) % max(int(getattr(model.config, "vocab_size", 4) or 4), 1)
        logits = model(input_ids=ids, use_cache=False).logits
        hidden = model.base_model(input_ids=ids, use_cache=False)[0]
        rebuilt = F.linear(hidden * multiplier if multiplier != 1.0 else hidden, head.weight)
        cap = model_softcap(model)
        if cap is not None:
            rebuilt = cap * torch.tanh(rebuilt / cap)
    finally:
        model.train(was_training)
    if logits.shape != rebuilt.shape or not torch.allclose(logits.float(), rebuilt.float(), rtol=1e-3, atol=1e-4):
        raise ValueError(
            f"{type(model).__name__}'s logits are not its output layer applied to the final hidden states (times "
            f"{multiplier:g}): it transforms them in a way the hidden-state loss does not know. Use the logits path "
            "(apply_ntl_to_hf_model(model, vocab) without chunked=True) and open an issue naming the model."
        )
    return True


def linear_head(model: Any) -> torch.nn.Linear:
    """The model's output layer; refuses anything but a bias-free ``nn.Linear``."""
    head = model.get_output_embeddings()
    if is_dtensor(getattr(head, "weight", None)) and not _fully_sharded(model):
        raise ValueError(
            f"{type(model).__name__} is split by Hugging Face tensor parallelism (tp_plan): its output layer holds a "
            "DTensor, which the hidden-state loss does not take. Use the logits path "
            "(apply_ntl_to_hf_model(model, vocab) "
            "without chunked=True), which works under tp_plan, or ntl_scale's vocab-parallel ops in your own loop"
        )
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(
            f"the hidden-state loss needs a bias-free nn.Linear output layer, {type(model).__name__} has "
            f"{type(head).__name__}{' with a bias' if isinstance(head, torch.nn.Linear) else ''}; use the logits path"
        )
    return head


def install_linear_loss_head(
    head: torch.nn.Linear, vocab: NumberVocab, options: NTLOptions, chunk_tokens: int | None = None
) -> None:
    """Makes a whole ``nn.Linear`` output layer compute the loss: ``head(hidden, targets)`` returns the per-token
    terms chunk by chunk (the evaluation ones under no grad); ``head(hidden)`` is unchanged.

    Undone by :func:`remove_linear_loss_head`; for AutoTP's shard see
    :func:`~ntl_scale.integrations.deepspeed.install_vocab_parallel_loss_head`.
    """
    check_option("chunk_tokens", chunk_tokens)  # refused when installed, not at the first training step

    def head_forward(layer: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        if targets is None:
            return F.linear(hidden, layer.weight)
        if is_dtensor(layer.weight):
            # FSDP2's dim-0 shard is over ranks with other tokens, not a vocabulary split
            raise ValueError(
                "the output layer's weight is a DTensor shard here (FSDP2 gathers it only inside the model's "
                "forward); compute the loss through the model's forward (model(input_ids, labels=...)), not by "
                "calling the output layer directly"
            )
        # the callers sum CE over the valid targets: the backward may reuse the forward's weight gradient
        terms = linear_ce_ntl(
            hidden,
            layer.weight,
            targets,
            vocab,
            options if torch.is_grad_enabled() else options.for_evaluation(),
            chunk_tokens=chunk_tokens,
            proportional_grad=not options.reweigh,
        )
        return tuple(terms)  # a plain tuple: ZeRO-3 hooks walk it to re-gather for the backward

    head.forward = types.MethodType(head_forward, head)  # type: ignore[method-assign]


def remove_linear_loss_head(head: torch.nn.Module) -> None:
    """Gives the output layer its class's ``forward`` back."""
    head.__dict__.pop("forward", None)


def hidden_state_terms(model: Any, multiplier: float, targets: torch.Tensor, **decoder_kwargs: Any) -> tuple:
    """Runs the decoder and the loss-computing head: ``(PerTokenTerms, decoder outputs)``."""
    out = model.base_model(**decoder_kwargs)
    hidden = out[0]
    if multiplier != 1.0:
        hidden = hidden * multiplier
    return PerTokenTerms(*model.get_output_embeddings()(hidden, targets)), out


def chunked_forward(original: Callable, loss: Any, multiplier: float) -> Callable:
    """The hidden-state loss in training with labels, else ``original``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # transformers 5.24 renamed past_key_values to cache
    cache = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"

    def forward(
        self: Any,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        if not self.training or (labels is None and shift_labels is None):
            passed = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            kwargs.update({name: value for name, value in passed.items() if value is not None})
            return original(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        targets = _targets(loss, labels, shift_labels, kwargs.pop("ignore_index", loss.options.ignore_index))
        kwargs.pop("logits_to_keep", None)
        as_tuple = kwargs.pop("return_dict", None) is False
        if input_ids is not None:
            targets = targets.to(input_ids.device)
        terms, out = hidden_state_terms(
            self, multiplier, targets, input_ids=input_ids, attention_mask=attention_mask, **kwargs
        )
        value = loss.reduce(terms, targets, num_items_in_batch, loss.options.ignore_index)
        output = CausalLMOutputWithPast(
            loss=value,
            logits=None,
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
            **{cache: getattr(out, cache, None)},
        )
        return output.to_tuple() if as_tuple else output

    return forward


def _targets(loss: Any, labels: Any, shift_labels: Any, ignore_index: int) -> torch.Tensor:
    """Next-token targets, the caller's ``ignore_index`` written as the options' (the one NTL and the head read)."""
    targets = shift_labels if shift_labels is not None else loss.targets(labels, ignore_index)
    return targets.masked_fill(targets == ignore_index, loss.options.ignore_index)


def framework_forward(original: Callable, loss: Any, multiplier: float, chunk_tokens: int | None) -> Callable:
    """``chunked=True`` with ``ce_kernel="framework"``: in training with labels ``original`` (transformers', or
    Liger's fused linear CE) computes the CE sum from a decoder hook's hidden states and output weight: NTL's
    passthrough (:func:`ntl_scale.linear_beside_ce`), run before that CE, so its gradients join the CE's in place."""

    def forward(self: Any, *args: Any, labels: Any = None, shift_labels: Any = None, **kwargs: Any) -> Any:
        if not self.training or (labels is None and shift_labels is None):
            return original(*args, labels=labels, shift_labels=shift_labels, **kwargs)
        head = self.get_output_embeddings()
        if _fully_sharded(head) or not _materialised(head):  # ZeRO-3, FSDP2's unit: the weight whole in its forward
            raise ValueError(
                f"{type(self).__name__}'s output weight is partitioned (ZeRO-3) or sharded (FSDP2 unit) outside its "
                "layer's forward, where ce_kernel='framework' with chunked=True reads it: use chunked=False or "
                "ce_kernel='ntl_scale'"
            )
        weight, terms = head.weight, []
        ignore_index = kwargs.get("ignore_index", loss.options.ignore_index)  # the model's CE reads the labels
        targets = _targets(loss, labels, shift_labels, ignore_index).to(weight.device)
        num_items_in_batch, as_tuple = kwargs.pop("num_items_in_batch", None), kwargs.pop("return_dict", None) is False

        def beside(_module: Any, _inputs: Any, out: Any) -> Any:
            through: list[torch.Tensor] = []
            hidden = out[0] * multiplier if multiplier != 1.0 else out[0]
            terms.append(linear_ce_ntl(hidden, weight, targets, loss.vocab, loss.options, chunk_tokens=chunk_tokens,
                                       need_ce=False, passthrough=through))  # fmt: skip
            head._parameters["weight"] = through[1]  # what the model's CE reads, till restored
            h_ce = through[0] / multiplier if multiplier != 1.0 else through[0]
            return (h_ce, *out[1:]) if isinstance(out, tuple) else type(out)(**{**out, next(iter(out)): h_ce})

        hook = self.base_model.register_forward_hook(beside)
        installed = self.loss_function  # transformers' forward calls it on the logits: the model's own, the CE sum
        self.loss_function = functools.partial(loss.framework_loss, ignore_index=ignore_index)
        try:
            out = original(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=1, return_dict=True, **kwargs
            )
        finally:
            hook.remove()
            self.loss_function, head._parameters["weight"] = installed, weight
        out.loss = loss.reduce(terms[-1], targets, num_items_in_batch, loss.options.ignore_index, ce_sum=out.loss)
        return out.to_tuple() if as_tuple else out

    return forward


class ChunkedLossCausalLM(torch.nn.Module):
    """A causal LM whose ``forward(input_ids, attention_mask, targets)`` returns per-token CE and NTL, never the
    logits (:func:`install_linear_loss_head`); pass it to ``deepspeed.initialize``. ``.model`` gives logits.

    Args:
        model: a ``*ForCausalLM`` with a bias-free linear output layer.
        vocab: the number-token table.
        options: the NTL variant.
        chunk_tokens: tokens per chunk (default: about 2**26 logits per chunk).
    """

    def __init__(
        self, model: Any, vocab: NumberVocab, options: NTLOptions | None = None, chunk_tokens: int | None = None
    ) -> None:
        super().__init__()
        self.model: Any = model
        self.multiplier = logit_multiplier(model)
        install_linear_loss_head(linear_head(model), vocab, head_options(model, options or NTLOptions()), chunk_tokens)

    @property
    def loss_function(self) -> Any:
        """The wrapped model's ``loss_function`` (AutoTP sets it on the module it is given)."""
        return self.model.loss_function

    @loss_function.setter
    def loss_function(self, value: Any) -> None:
        self.model.loss_function = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        **decoder_kwargs: Any,
    ) -> PerTokenTerms:
        """Per-token terms for ``targets`` aligned with ``input_ids`` (already shifted)."""
        if targets is None:
            raise ValueError("ChunkedLossCausalLM.forward needs targets; call .model for logits or generation")
        terms, _ = hidden_state_terms(
            self.model, self.multiplier, targets, input_ids=input_ids, attention_mask=attention_mask, **decoder_kwargs
        )
        return terms
