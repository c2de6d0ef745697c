"""Hugging Face route 1: NTL as the model's ``loss_function``: one line for ``Trainer``, TRL and custom loops.

:class:`NTLCausalLMLoss` has the signature of Hugging Face's ``ForCausalLMLoss`` and returns
``CE + weight * NTL``; :func:`apply_ntl_to_hf_model` installs it (idempotent, undone by :func:`remove_ntl`)::

    from ntl_scale.integrations.hf import apply_ntl_to_hf_model
    apply_ntl_to_hf_model(model, number_vocab, ntl_weight=0.3)     # model(..., labels=...).loss is now CE + 0.3 NTL

Normalisation follows what ``num_items_in_batch`` carries (``docs/normalization.md``): None, the batch
means; a ``[tokens, numbers]`` pair (``ntl_trainer_class`` counts the step), the step's exact means; a scalar
token count (a plain ``Trainer``), CE exact and NTL weighted by the micro-batch's share of the tokens.
A call under ``torch.no_grad()`` is evaluation: the plain CE (:meth:`ntl_scale.NTLOptions.for_evaluation`).
:func:`causal_lm_ce_with_ntl` is :func:`ntl_scale.ce_with_ntl` with causal-LM labels.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch

from ..._validation import check_table
from ...losses import ce_with_ntl
from ...normalization import micro_batch_sums, objective
from ...number_vocab import NumberVocab
from ...options import NTLOptions, check_chunk_route, check_option
from ...reductions import CENTLOutput
from ...terms import PerTokenTerms, per_token_ce_ntl
from ..beside import CHOICE, framework_ce

__all__ = [
    "TOTALS",
    "NTLCausalLMLoss",
    "apply_ntl_to_hf_model",
    "causal_lm_ce_with_ntl",
    "installed_loss",
    "is_chunked",
    "remove_ntl",
    "shift_labels",
]

_MARK = "_ntl_scale_loss"

TOTALS = ("ce_sum", "tokens", "ntl_sum", "numbers", "hits", "z_loss_sum")
"""The running sums of :class:`NTLCausalLMLoss` (``totals``, ``eval_totals``); ``ce_sum`` includes ``z_loss_sum``."""


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token labels ``labels[..., 1:]`` padded with ``ignore_index``: no slicing (copy) of the logits."""
    pad = torch.full((*labels.shape[:-1], 1), ignore_index, dtype=labels.dtype, device=labels.device)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def causal_lm_ce_with_ntl(
    logits: torch.Tensor, labels: torch.Tensor, vocab: NumberVocab, *, ignore_index: int = -100, **options: Any
) -> CENTLOutput:
    """:func:`ntl_scale.ce_with_ntl` of ``[batch, seq, V]`` logits for the unshifted ``labels`` a causal LM takes
    (``ignore_index`` also fills the shifted-out last position; ``**options`` go to ``ce_with_ntl``)."""
    return ce_with_ntl(logits, shift_labels(labels, ignore_index), vocab, ignore_index=ignore_index, **options)


class NTLCausalLMLoss:
    """``CE + weight * NTL`` with the signature of Hugging Face's ``ForCausalLMLoss``.

    Args:
        vocab: the number table (over the model's vocabulary).
        ntl_weight: weight of the NTL term (0.3 in the paper).
        options: the NTL variant (default NTL-WAS).
        causal: shift the labels as causal LMs do (False for labels aligned with the logits, e.g. seq2seq).
        framework_loss: with ``options.ce_kernel="framework"``, the model's own loss function that computes the
            CE (None: transformers' ``ForCausalLMLoss``).
    """

    def __init__(
        self,
        vocab: NumberVocab,
        ntl_weight: float = 0.3,
        options: NTLOptions | None = None,
        *,
        causal: bool = True,
        framework_loss: Any = None,
    ) -> None:
        if not isinstance(vocab, NumberVocab):
            raise TypeError(f"vocab must be an ntl_scale.NumberVocab, got {type(vocab).__name__}")
        self.vocab, self.ntl_weight = vocab, check_option("weight", ntl_weight, "ntl_weight")
        self.options = options or NTLOptions()
        check_table(vocab, self.options, "hf")  # refused when the loss is built, not at the first step
        self.causal = causal
        self.framework_loss = framework_loss
        # detached running sums (TOTALS) of the training and, apart, the evaluation calls
        self.totals = torch.zeros(len(TOTALS), dtype=torch.float64)
        self.eval_totals = torch.zeros(len(TOTALS), dtype=torch.float64)

    def targets(self, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """The labels each logit position predicts (shifted for causal LMs)."""
        if not self.causal:
            return labels
        return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if ignore_index is None:
            ignore_index = self.options.ignore_index
        if shift_labels is None:
            if labels is None:
                raise ValueError("NTLCausalLMLoss needs labels or shift_labels")
            shift_labels = self.targets(labels, ignore_index)
        targets = shift_labels.to(logits.device)
        # evaluation: a call under no grad, whatever model.training says (a gradient sees one objective)
        options = self.options if torch.is_grad_enabled() else self.options.for_evaluation()
        if options.ignore_index != ignore_index:
            options = dataclasses.replace(options, ignore_index=ignore_index)
        if vocab_size is not None and logits.shape[-1] != vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns but vocab_size is {vocab_size}")
        if not framework_ce(options):
            terms = per_token_ce_ntl(logits, targets, self.vocab, options)
            return self.reduce(terms, targets, num_items_in_batch, ignore_index)
        from transformers.loss.loss_utils import ForCausalLMLoss

        own = self.framework_loss or ForCausalLMLoss
        through: list[torch.Tensor] = []  # NTL first: its columns join the framework CE's logits gradient in place
        ntl = per_token_ce_ntl(logits, targets, self.vocab, options, need_ce=False, passthrough=through)
        one = torch.ones((), device=logits.device)  # num_items_in_batch 1: the framework's CE sum
        ce_sum = own(through[0], None, logits.shape[-1], num_items_in_batch=one, ignore_index=ignore_index,
                     shift_labels=targets.contiguous(), **kwargs)  # fmt: skip
        return self.reduce(ntl, targets, num_items_in_batch, ignore_index, ce_sum=ce_sum)

    def reduce(
        self,
        terms: PerTokenTerms,
        targets: torch.Tensor,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        *,
        ce_sum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``CE + weight * NTL`` by what ``num_items_in_batch`` carries; sums to :attr:`totals` or :attr:`eval_totals`.

        ``ce_sum``: the framework's CE sum, in place of the terms' CE.
        """
        valid = targets != ignore_index
        if ce_sum is not None:  # the arg-max among the number columns (the full one is the framework's)
            terms = terms._replace(hit=terms.number_choice_hit)
        sums = micro_batch_sums(terms, valid)
        sums = sums if ce_sum is None else sums._replace(ce=ce_sum.to(sums.ntl.dtype))
        evaluation = not torch.is_grad_enabled()
        z_weight = 0.0 if evaluation else self.options.z_loss_weight
        if z_weight:  # the z-loss part of the CE term: logged apart as z_loss, out of the logged ce
            z_sum = z_weight * (terms.lse.detach().double().square() * valid).sum()
        else:
            z_sum = torch.zeros((), dtype=torch.float64, device=sums.ce.device)
        step = torch.stack([sums.ce.detach().double(), sums.tokens.double(), sums.ntl.detach().double(),
                            sums.numbers.double(), sums.hits.double(), z_sum])  # fmt: skip
        name = "eval_totals" if evaluation else "totals"
        totals = getattr(self, name)
        if totals.device != step.device:  # kept where the loss runs: logging reads it, training never syncs
            totals = totals.to(step.device)
            setattr(self, name, totals)
        totals += step
        counts = num_items_in_batch
        if counts is None:  # the micro-batch normalisation
            tokens, step_numbers = sums.tokens, sums.numbers
        elif torch.is_tensor(counts) and counts.numel() == 2:  # the global one, over ntl_trainer_class's counts
            tokens, step_numbers = counts.reshape(2).to(sums.ce.device, sums.ce.dtype)
        else:  # Trainer's token count N alone: K estimated as k N / n (exact when numbers are spread evenly)
            tokens = torch.as_tensor(counts, dtype=sums.ce.dtype, device=sums.ce.device).reshape(())
            step_numbers = sums.numbers * tokens / sums.tokens.clamp_min(1)
        return objective(sums, (tokens, step_numbers), self.ntl_weight)

    def pop_means(self, reduce: Any = None, *, evaluation: bool = False) -> dict[str, float]:
        """The means since the last call, then resets: ``ce`` (without the z-loss; plain in evaluation), ``ntl``,
        ``number_accuracy`` (:data:`~..beside.CHOICE` with the framework CE) and, training with a z-loss,
        ``z_loss``. A mean whose count is 0 is left out.

        Args:
            reduce: sums the running totals across processes (e.g. ``accelerator.reduce(t, "sum")``, a
                collective every process must call); None: this process's batches only.
            evaluation: the evaluation calls' totals (made under ``torch.no_grad()``) instead of training's.
        """
        own = self.eval_totals if evaluation else self.totals
        totals = own if reduce is None else reduce(own.clone())
        ce_sum, tokens, ntl_sum, numbers, hits, z_sum = totals.tolist()  # the one host read, at logging
        own.zero_()
        means = {}  # a mean without a count is left out (as the DeepSpeed trainer's step rows), never logged as 0
        if tokens:
            means["ce"] = (ce_sum - z_sum) / tokens
            if self.options.z_loss_weight and not evaluation:
                means["z_loss"] = z_sum / tokens
        if numbers:
            means["ntl"] = ntl_sum / numbers
            means[CHOICE if framework_ce(self.options) else "number_accuracy"] = hits / numbers
        return means


def apply_ntl_to_hf_model(
    model: Any,
    number_vocab: NumberVocab,
    *,
    ntl_weight: float = 0.3,
    options: NTLOptions | None = None,
    chunked: bool = False,
    chunk_tokens: int | None = None,
    check: bool = True,
) -> NTLCausalLMLoss:
    """Makes a Hugging Face causal LM's loss ``CE + ntl_weight * NTL``; idempotent, undone by :func:`remove_ntl`.

    Sets ``model.loss_function``. With ``chunked=True`` a training forward with labels computes the loss from
    the final hidden states (:mod:`ntl_scale.integrations.hf.chunked`; ``outputs.logits`` is None); evaluation,
    ``generate`` and calls without labels are the model's own. A second call with other settings is refused.

    Args:
        model: a ``transformers`` causal LM (``PreTrainedModel`` with a ``loss_function``).
        number_vocab: the number table over the model's vocabulary (``model.config.vocab_size``).
        ntl_weight: the NTL weight.
        options: the NTL variant and ``impl`` (:class:`ntl_scale.NTLOptions`).
        chunked: the hidden-state loss in training (bias-free linear head; logit scaling and soft-capping
            applied).
        chunk_tokens: tokens per chunk of the hidden-state loss (default: about 2**26 logits per chunk).
        check: with ``chunked``, refuse a model whose logits differ from the hidden-state reconstruction on
            four tokens (skipped for weights not materialised, e.g. under ZeRO-3).

    Returns:
        The installed :class:`NTLCausalLMLoss` (its ``pop_means()`` gives CE and NTL for logging).
    """
    if not hasattr(type(model), "loss_function"):
        raise TypeError(
            "apply_ntl_to_hf_model needs a Hugging Face model with a loss_function hook "
            "(transformers >= 4.46 causal LMs), "
            f"got {type(model).__name__}"
        )
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is not None and number_vocab.vocab_size is not None and number_vocab.vocab_size > size:
        raise ValueError(
            f"the number table covers {number_vocab.vocab_size} ids but the model has vocab_size={size}; build it "
            "with NumberVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)"
        )
    check_option("chunk_tokens", chunk_tokens)
    check_chunk_route(chunked, chunk_tokens, "hf")  # the logits path would not read it
    installed = model.__dict__.get(_MARK)
    if installed is not None:
        loss = installed["loss"]
        same = loss.vocab == number_vocab and loss.ntl_weight == float(ntl_weight)
        same = same and installed["chunked"] == (chunk_tokens if chunked else False)
        if not same or loss.options != (options or NTLOptions()):
            raise ValueError(
                "apply_ntl_to_hf_model was already called on this model with other settings; call remove_ntl first"
            )
        return loss
    from . import chunked as hidden

    framework = options is not None and framework_ce(options)
    own_loss = model.loss_function if framework else None  # transformers' (or the model's) own CE
    loss = NTLCausalLMLoss(number_vocab, ntl_weight, options, framework_loss=own_loss)
    if framework and chunked and hidden.model_softcap(model) is not None:
        raise ValueError(
            f"{type(model).__name__} soft-caps its logits: ce_kernel='framework' with chunked=True would take NTL "
            "from uncapped hidden-state logits; use the logits path (chunked=False) or ce_kernel='ntl_scale'"
        )
    if chunked:
        multiplier = hidden.logit_multiplier(model)
        head = hidden.linear_head(model)
        if check:
            hidden.check_head(model, multiplier, head)
        own_forward = model.__dict__.get("forward")  # another patch's instance forward, restored by remove_ntl
        if framework:  # the model's own forward (transformers', or Liger's) computes CE; NTL beside it
            wrapped = hidden.framework_forward(model.forward, loss, multiplier, chunk_tokens)
        else:
            hidden.install_linear_loss_head(head, number_vocab, hidden.head_options(model, loss.options), chunk_tokens)
            wrapped = hidden.chunked_forward(model.forward, loss, multiplier)
        model.forward = types.MethodType(wrapped, model)
    elif not framework:  # framework: its CE reads the model's own logits (capped ones too), as NTL does
        hidden.head_options(model, loss.options)  # refuses capping twice
    record = {
        "loss": loss,
        "previous": model.__dict__.get("_loss_function"),
        "chunked": chunk_tokens if chunked else False,
        "forward": own_forward if chunked else None,
    }
    model.loss_function = loss
    model.__dict__[_MARK] = record
    return loss


def installed_loss(model: Any) -> NTLCausalLMLoss | None:
    """The loss :func:`apply_ntl_to_hf_model` installed on ``model`` (None if it was not)."""
    record = model.__dict__.get(_MARK)
    return None if record is None else record["loss"]


def is_chunked(model: Any) -> bool:
    """Whether ``model`` trains with the hidden-state loss of ``apply_ntl_to_hf_model(..., chunked=True)``."""
    record = model.__dict__.get(_MARK)
    return record is not None and record["chunked"] is not False


def remove_ntl(model: Any) -> bool:
    """Undoes :func:`apply_ntl_to_hf_model`; returns whether it was installed."""
    record = model.__dict__.pop(_MARK, None)
    if record is None:
        return False
    if record["previous"] is None:
        model.__dict__.pop("_loss_function", None)
    else:
        model.__dict__["_loss_function"] = record["previous"]
    if record["chunked"] is not False:
        from .chunked import remove_linear_loss_head

        model.__dict__.pop("forward", None)
        if record["forward"] is not None:
            model.__dict__["forward"] = record["forward"]
        remove_linear_loss_head(model.get_output_embeddings())
    return True
