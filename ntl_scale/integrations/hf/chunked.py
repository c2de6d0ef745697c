"""Hugging Face route 2: CE + NTL from a causal LM's final hidden states; the training forward builds no logits.

:func:`ntl_scale.integrations.hf.apply_ntl_to_hf_model` with ``chunked=True`` installs this on a model
(:func:`install_linear_loss_head` on its output layer, :func:`chunked_forward` as its forward);
:class:`ChunkedLossCausalLM` wraps a model for ``launch/train.py``'s own loop. In training mode
with labels, the model's forward runs its decoder (``model.base_model``) to the final hidden states
and calls the output layer with the targets; that layer's forward computes the per-token CE and NTL
chunk by chunk (:func:`ntl_scale.linear_ce_ntl`), so the ``[tokens, vocab]`` logits never exist.
Everything else (evaluation, ``generate``, a call without labels) is the model's own forward.

The loss is computed inside the output layer's ``forward``, so DeepSpeed ZeRO-3 gathers the
partitioned weight there (and again for the backward) as for any layer. Under torch's FSDP2
(``fully_shard``; accelerate's ``fsdp_version: 2``) the output layer's weight is a ``Shard(0)`` DTensor
between steps and the whole weight inside the model's forward (FSDP2's pre-forward hook gathers it):
the loss sees the whole weight, and its gradient goes to FSDP2's reduce-scatter as any layer's.
:func:`apply_ntl_to_hf_model` may be called before or after the model is sharded.

What the model does between its last hidden state and its logits must be reproducible on the hidden
states: known conventions are Granite's ``logits_scaling`` (divides the logits), Cohere's
``logit_scale`` and Falcon-H1's ``lm_head_multiplier`` (multiply them), all linear, and Gemma 2/3's
``final_logit_softcapping``, taken as the loss's ``logit_softcap`` (:func:`head_options`). When the
weights are materialised, :func:`check_head` compares the model's own logits with ``head(hidden) *
multiplier`` (capped) on a few tokens and refuses any other transform (an unknown multiplier, a bias, a
custom head).
"""

from __future__ import annotations

import dataclasses
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
    """The factor a model applies to ``head(hidden)`` to get its logits; refuses non-linear transforms.

    Soft-capping (``final_logit_softcapping``) is not a factor: :func:`head_options` carries it.

    Raises:
        ValueError: a scaling attribute that is not a number.
    """
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
    """``options`` with the model's own soft-capping (:func:`model_softcap`) as ``logit_softcap``, so the
    hidden-state loss caps the logits as the model's forward does.

    Raises:
        ValueError: ``options.logit_softcap`` set for a model that caps its logits itself (they would be
            capped twice, on the logits path too).
    """
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
    """Real weights here (not on the meta device, not partitioned by DeepSpeed ZeRO-3 or sharded by FSDP2)."""
    return all(
        p.device.type != "meta" and p.numel() > 0 and not hasattr(p, "ds_id") and not is_dtensor(p)
        for p in module.parameters()
    )


def _fully_sharded(model: Any) -> bool:
    """``model`` is sharded by torch's FSDP2 (``fully_shard``, accelerate's ``fsdp_version=2``): its forward
    gathers its parameters, the output layer's included, before the layers run."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@torch.no_grad()
def check_head(model: Any, multiplier: float, head: torch.nn.Linear) -> bool:
    """Refuses a model whose logits are not ``head(last hidden state) * multiplier``.

    Runs the model and its decoder on four tokens (eval mode, restored after). Skipped (returns False)
    when the weights are not materialised here, e.g. partitioned by ZeRO-3 before ``deepspeed.initialize``.
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
    """Makes a whole (unsharded) ``nn.Linear`` output layer compute the loss: ``head(hidden, targets)``
    returns the per-token (CE, NTL, number mask, hit, lse) chunk by chunk; ``head(hidden)`` is unchanged.

    With gradients enabled the terms are ``options``' (the training objective); under ``torch.no_grad()``
    (held-out evaluation) ``options.for_evaluation()``'s: CE is the model's plain cross entropy.

    Undone by :func:`remove_linear_loss_head`. For DeepSpeed AutoTP's vocabulary shard see
    :func:`ntl_scale.integrations.deepspeed.install_vocab_parallel_loss_head`.
    """
    check_option("chunk_tokens", chunk_tokens)  # refused when installed, not at the first training step

    def head_forward(layer: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        if targets is None:
            return F.linear(hidden, layer.weight)
        if is_dtensor(layer.weight):
            # FSDP2 shards the weight on dim 0 like a vocabulary split, but over data-parallel ranks that hold
            # other tokens: inside the model's forward it is gathered whole; a sharded one here is a misuse
            raise ValueError(
                "the output layer's weight is a DTensor shard here (FSDP2 gathers it only inside the model's "
                "forward); compute the loss through the model's forward (model(input_ids, labels=...)), not by "
                "calling the output layer directly"
            )
        # the callers (apply_ntl_to_hf_model's forward, ChunkedLossCausalLM with launch/train.py) sum CE over the valid
        # targets, so the backward may reuse the forward's weight gradient without a host-side check.
        # Under no_grad (held-out evaluation) the plain CE: no label smoothing, no z-loss (the cap stays).
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
    """The forward :func:`apply_ntl_to_hf_model` installs: the hidden-state loss in training with labels, else
    ``original``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # transformers 5.24 renamed the output's past_key_values to cache (the old name survives there as an alias)
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
            if labels is not None:
                kwargs["labels"] = labels
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return original(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        ignore_index = kwargs.pop("ignore_index", loss.options.ignore_index)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        targets = shift_labels if shift_labels is not None else loss.targets(labels, ignore_index)
        if input_ids is not None:
            targets = targets.to(input_ids.device)
        terms, out = hidden_state_terms(
            self, multiplier, targets, input_ids=input_ids, attention_mask=attention_mask, **kwargs
        )
        value = loss.reduce(terms, targets, num_items_in_batch, ignore_index)
        return CausalLMOutputWithPast(
            loss=value,
            logits=None,
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
            **{cache: getattr(out, cache, None)},
        )

    return forward


def framework_forward(original: Callable, loss: Any, multiplier: float, chunk_tokens: int | None) -> Callable:
    """The forward of ``apply_ntl_to_hf_model(chunked=True)`` with ``ce_kernel="framework"``: in training with
    labels the model's own forward (``original``: transformers' logits and loss, or Liger's fused linear CE
    where ``apply_liger_kernel_to_*`` patched the class first) computes the CE sum (``num_items_in_batch=1``);
    NTL comes from the decoder's final hidden states (a hook on ``model.base_model``) and the number rows of
    the output weight (:func:`ntl_scale.linear_ce_ntl` with ``need_ce=False``). Otherwise ``original``."""

    def forward(self: Any, *args: Any, labels: Any = None, shift_labels: Any = None, **kwargs: Any) -> Any:
        if not self.training or (labels is None and shift_labels is None):
            return original(*args, labels=labels, shift_labels=shift_labels, **kwargs)
        ignore_index = kwargs.get("ignore_index", loss.options.ignore_index)
        targets = shift_labels if shift_labels is not None else loss.targets(labels, ignore_index)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        seen: list[torch.Tensor] = []
        hook = self.base_model.register_forward_hook(lambda _m, _i, out: seen.append(out[0]))
        try:
            with loss.ce_only():  # transformers' forward calls the installed loss_function: the CE sum alone
                out = original(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=1, **kwargs)
        finally:
            hook.remove()
        hidden = seen[-1] * multiplier if multiplier != 1.0 else seen[-1]
        weight = self.get_output_embeddings().weight
        targets = targets.to(hidden.device)
        terms = linear_ce_ntl(
            hidden, weight, targets, loss.vocab, loss.options, chunk_tokens=chunk_tokens, need_ce=False
        )
        out.loss = loss.reduce(terms, targets, num_items_in_batch, ignore_index, ce_sum=out.loss)
        return out

    return forward


class ChunkedLossCausalLM(torch.nn.Module):
    """A Hugging Face causal LM whose training forward returns per-token CE and NTL, never the logits.

    ``forward(input_ids, attention_mask, targets)`` runs the decoder to its final hidden states and
    calls the output layer with the targets; that layer's forward is replaced by
    :func:`ntl_scale.linear_ce_ntl`, so the ``[tokens, vocab]`` logits are never materialised.
    Called without targets (generation, ``model.generate``) the output layer returns logits as before.

    The loss runs inside the output layer's own forward, so DeepSpeed ZeRO-3 gathers its partitioned
    weight there and again for the backward, as for any layer; pass this module to
    ``deepspeed.initialize``. Granite's ``logits_scaling`` is applied to the hidden states (the map is
    linear); Gemma's soft-capping is applied to each chunk's logits as the model's forward applies it
    (:func:`head_options`). Under ``torch.no_grad()`` the terms are the evaluation ones (plain CE, no label
    smoothing or z-loss: :meth:`ntl_scale.NTLOptions.for_evaluation`).

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
        """The wrapped model's ``loss_function`` hook (DeepSpeed AutoTP sets it on the module it is given)."""
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
        """Per-token terms for next-token ``targets`` aligned with ``input_ids`` (already shifted);
        ``decoder_kwargs`` (``position_ids``, ``use_cache``) go to the decoder."""
        if targets is None:
            raise ValueError("ChunkedLossCausalLM.forward needs targets; call .model for logits or generation")
        terms, _ = hidden_state_terms(
            self.model, self.multiplier, targets, input_ids=input_ids, attention_mask=attention_mask, **decoder_kwargs
        )
        return terms
