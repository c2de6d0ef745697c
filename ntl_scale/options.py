"""The NTL option spec: every option once, with its type, default and meaning.

Each field is documented once, by the attribute docstring under it:

* :class:`NTLOptions`: what one loss call computes (the variant: ``loss``, ``squash_factor``,
  ``reweigh``, ``huber_delta``, ``float_level``), which labels it ignores, and which code computes it
  (``impl``); frozen, passed to :func:`ntl_scale.per_token_ce_ntl`, :func:`ntl_scale.linear_ce_ntl`
  and every integration.
* :class:`NTLRunOptions`: the options of a training run: the variant again (its defaults are checked
  to be :class:`NTLOptions`'s) and the NTL ``weight``, the number table (``digit_level``) and the
  ``normalization``; the ``ntl`` section of a run config is this class.
* The chunked route (``chunked``, ``chunk_tokens``): how the logits are obtained, listed by
  :func:`option_fields` (a run config keeps them in its ``train`` section).

Every front end is built from or checked against these (:func:`option_fields` lists them for a
new front end, such as a torchtitan ``BaseLoss.Config``; :func:`surface_name` and
:func:`surface_default` say how each front end spells an option and which defaults differ there, and
why):

| option | YAML (``launch/train.py``) | Megatron (both routes) | ``apply_ntl_to_hf_model`` (Hugging Face) |
|---|---|---|---|
| ``loss`` ... ``impl`` (the variant) | ``ntl.<name>`` | ``--ntl-<name>`` | ``options=NTLOptions(...)`` |
| ``weight`` | ``ntl.weight`` | ``--ntl-weight`` (default 0: off) | ``ntl_weight`` |
| ``digit_level`` | ``ntl.digit_level`` | ``--ntl-number-vocab`` | the ``NumberVocab`` argument |
| ``normalization`` | ``ntl.normalization`` | ``--ntl-normalization`` (``micro-batch``) | ``num_items_in_batch`` |
| ``chunked`` | ``train.chunked_loss`` | ``--ntl-chunked`` | ``chunked`` |
| ``chunk_tokens`` | ``train.loss_chunk_tokens`` | ``--ntl-chunk-tokens`` | ``chunk_tokens`` |

Every numeric option (``weight``, ``squash_factor``, ``huber_delta``, ``chunk_tokens``) is checked once,
here (:func:`check_option`: finite, in range, the right type), by every front end with its own spelling
(:func:`check_numeric_options`); ``chunk_tokens`` without ``chunked`` is refused by
:func:`check_chunk_route`.

``tests/unit/test_options_surfaces.py`` introspects each front end (the YAML dataclass, the argparse
parser, ``apply_ntl_to_hf_model``'s signature) and fails when an option is missing there or has another default
than this module declares.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import math
import numbers
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .number_vocab import NumberVocab

__all__ = [
    "IMPLS",
    "LOSS_KINDS",
    "NORMALIZATIONS",
    "NUMERIC_CHECKS",
    "REDUCTIONS",
    "SURFACES",
    "VOCAB_RULES",
    "NTLOptions",
    "NTLRunOptions",
    "OptionField",
    "check_chunk_route",
    "check_chunk_tokens",
    "check_huber_delta",
    "check_impl",
    "check_label_smoothing",
    "check_logit_softcap",
    "check_ntl_weight",
    "check_numeric_options",
    "check_option",
    "check_run_options",
    "check_squash_factor",
    "check_z_loss_weight",
    "option_field",
    "option_fields",
    "surface_default",
    "surface_name",
    "surface_reason",
    "table_source",
    "variant_fields",
    "variant_of",
]

LOSS_KINDS = ("was", "mse", "mae", "huber", "number")
"""The NTL variants: Wasserstein-1 (the paper's default), the point losses of the expected value, and
number-level symmetric MAPE."""
NORMALIZATIONS = ("global", "micro-batch")
"""How a step's loss is normalised: sum over the global batch / its global count, or a mean per micro-batch."""
REDUCTIONS = ("mean", "sum", "none")
"""How the loss functions reduce per-token terms: a weighted mean, a sum, or none (per token)."""
IMPLS = ("auto", "torch", "triton")
"""Which code computes the fused CE + NTL statistics (``docs/kernels.md``)."""


def check_impl(impl: object) -> str:
    """Returns ``impl`` when it is one of :data:`IMPLS`; otherwise a ValueError naming it and the choices."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(
            f"unknown impl {impl!r}; expected one of {', '.join(map(repr, IMPLS))}: 'auto' (the default: the "
            "PyTorch code, until the Triton kernels have passed the GPU suite), 'torch' (always the PyTorch code) "
            "or 'triton' (the Triton kernels; CUDA tensors, triton installed)"
        )
    return impl


def _is_number(value: object) -> bool:
    """A real number, not a bool (``True`` is an int to Python, never an option value)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_ntl_weight(weight: object, name: str = "ntl_weight") -> float:
    """The NTL weight as a float, or a ``ValueError`` naming ``name`` (the spelling of the front end that
    passed it: ``ntl_weight``, ``ntl.weight``, ``--ntl-weight``). A finite number >= 0; not a bool."""
    if not _is_number(weight) or not math.isfinite(weight) or not weight >= 0:  # type: ignore[arg-type, operator]
        raise ValueError(f"{name} must be a finite number >= 0 (0.3 in the paper, 0 = CE alone), got {weight!r}")
    return float(weight)  # type: ignore[arg-type]


def check_squash_factor(value: object, name: str = "squash_factor") -> float | None:
    """``squash_factor`` as a float (or None): a finite number > 1; a ``ValueError`` naming ``name`` otherwise.

    ``inf`` is refused: the squashed distance table would hold ``0 * inf`` (NaN) entries."""
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or not value > 1:  # type: ignore[arg-type, operator]
        raise ValueError(
            f"{name} must be a finite number > 1 (how much worse the farthest number is than the closest wrong one; "
            f"1 would turn NTL-WAS into cross entropy), got {value!r}; use None for plain |v_i - v_j|"
        )
    return float(value)  # type: ignore[arg-type]


def check_huber_delta(value: object, name: str = "huber_delta") -> float:
    """``huber_delta`` as a float: a finite number > 0; a ``ValueError`` naming ``name`` otherwise."""
    if not _is_number(value) or not math.isfinite(value) or not value > 0:  # type: ignore[arg-type, operator]
        raise ValueError(
            f"{name} must be a finite number > 0 (the Huber loss's threshold between its quadratic and linear "
            f"parts; 1.0 by default), got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def check_chunk_tokens(value: object, name: str = "chunk_tokens") -> int | None:
    """``chunk_tokens`` as an int (or None): a whole number >= 1; a ``ValueError`` naming ``name`` otherwise
    (0 or less made empty chunks; a float such as 2.5 or ``inf`` is not a token count)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"{name} must be a whole number >= 1 (tokens per chunk) or None, got {value!r}; "
            "pass e.g. chunk_tokens=512, or None for the default budget"
        )
    return int(value)


def check_z_loss_weight(value: object, name: str = "z_loss_weight") -> float:
    """``z_loss_weight`` as a float: a finite number >= 0; a ``ValueError`` naming ``name`` otherwise."""
    if not _is_number(value) or not math.isfinite(value) or not value >= 0:  # type: ignore[arg-type, operator]
        raise ValueError(
            f"{name} must be a finite number >= 0 (the weight of the z-loss z_loss_weight * logsumexp(z)**2 added to "
            f"CE; 1e-4 in PaLM and OLMo 2, 0 = off), got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def check_label_smoothing(value: object, name: str = "label_smoothing") -> float:
    """``label_smoothing`` as a float: a finite number in ``[0, 1]``; a ``ValueError`` naming ``name`` otherwise."""
    if not _is_number(value) or not math.isfinite(value) or not 0 <= value <= 1:  # type: ignore[arg-type, operator]
        raise ValueError(
            f"{name} must be a finite number in [0, 1] (the share of the CE target spread uniformly over the whole "
            f"vocabulary, as torch's F.cross_entropy(label_smoothing=); 0 = off, 0.1 is usual), got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def check_logit_softcap(value: object, name: str = "logit_softcap") -> float | None:
    """``logit_softcap`` as a float (or None): a finite number > 0; a ``ValueError`` naming ``name`` otherwise."""
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or not value > 0:  # type: ignore[arg-type, operator]
        raise ValueError(
            f"{name} must be a finite number > 0 (logits become cap * tanh(z / cap); 30.0 in Gemma 2) or None "
            f"(no capping), got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


NUMERIC_CHECKS = {
    "weight": check_ntl_weight,
    "squash_factor": check_squash_factor,
    "huber_delta": check_huber_delta,
    "chunk_tokens": check_chunk_tokens,
    "z_loss_weight": check_z_loss_weight,
    "label_smoothing": check_label_smoothing,
    "logit_softcap": check_logit_softcap,
}
"""The one check of every numeric option (finite, in range, the right type), by option name: every front
end (the Python API, the YAML sections, torchtitan's ``NTLLoss.Config``, Megatron's flags and
``NTLSettings``, Hugging Face's ``apply_ntl_to_hf_model``) calls :func:`check_option` with its own spelling."""


def check_option(name: str, value: object, spelling: str | None = None) -> Any:
    """Checks the numeric option ``name`` (:data:`NUMERIC_CHECKS`); returns it converted (float, int or None).

    Raises:
        ValueError: naming ``spelling`` (the front end's name of the option; default ``name``), the value
            and what is expected. Non-finite values (``inf``, ``nan``) are refused for every option.
    """
    if name not in NUMERIC_CHECKS:
        raise ValueError(f"{name!r} is not a numeric NTL option; the numeric options are {sorted(NUMERIC_CHECKS)}")
    return NUMERIC_CHECKS[name](value, spelling or name)


def check_numeric_options(settings: object, spell: Callable[[str], str | None]) -> None:
    """:func:`check_option` of every numeric option ``settings`` carries (by attribute name), each named as
    ``spell(name)`` says its front end spells it (``ntl.squash_factor``, ``--ntl-squash-factor``, ...)."""
    for name in NUMERIC_CHECKS:
        if hasattr(settings, name):
            check_option(name, getattr(settings, name), spell(name))


@dataclass(frozen=True)
class NTLOptions:
    """Which NTL variant one loss call computes, and with which code.

    ``NTLOptions(loss, squash_factor, reweigh, huber_delta, float_level, ignore_index)`` positionally,
    as before ``impl`` was added; invalid values raise a ValueError (TypeError for a wrong type)
    naming the value and the fix.
    """

    loss: str = "was"
    """``was`` (Wasserstein-1 between the number-token distribution and the label, the paper's
    default), ``mse``, ``mae``, ``huber`` (point loss of the expected value) or ``number``
    (number-level symmetric MAPE of whole numbers rebuilt from digit tokens; needs a digit table)."""
    squash_factor: float | None = None
    """``was`` only: map the nonzero distances onto ``[1, squash_factor]`` (> 1); None: ``|v_k - t|``."""
    reweigh: bool = False
    """Scale NTL by the probability mass on number tokens and charge the rest ``1.01 * max loss``
    (the reference's default; not used in the paper)."""
    huber_delta: float = 1.0
    """``huber`` only: the threshold between the quadratic and the linear part (> 0)."""
    float_level: bool = False
    """``number`` only: a decimal point between two digits joins them into one number."""
    ignore_index: int = -100
    """The label value that carries no loss (a per-call argument: run configs mask with -100)."""
    impl: str = "auto"
    """Which code computes the fused statistics: ``auto`` (the PyTorch code today; the Triton kernels
    on CUDA once they have passed the GPU suite), ``torch``, or ``triton`` (CUDA tensors, ``triton``
    installed; the PyTorch code while ``torch.compile`` traces). The numbers agree to rounding.
    The Triton kernels compute the z-loss of the CE features below, not label smoothing or soft-capping:
    with those ``auto`` runs the PyTorch code and ``triton`` is refused."""
    z_loss_weight: float = 0.0
    """Weight of the z-loss ``z_loss_weight * logsumexp(z)**2`` added to each token's CE (PaLM, OLMo 2,
    Chameleon; 1e-4 there), on the same positions and weights as CE; 0: off. Exact under tensor
    parallelism (the log-sum-exp is the all-reduced one); the per-token log-sum-exp is returned
    (``PerTokenTerms.lse``) for logging."""
    label_smoothing: float = 0.0
    """CE against ``(1 - eps) * onehot(y) + eps / V`` over the **whole** vocabulary ``V`` (all TP shards),
    as torch's ``F.cross_entropy(label_smoothing=eps)``; NTL keeps the hard number target. 0: off."""
    logit_softcap: float | None = None
    """Soft-capping of the logits, ``cap * tanh(z / cap)`` (Gemma 2: 30.0), before CE, z-loss and NTL
    (all of them see the capped logits); None: off. Leave None where the model already caps its output."""

    def __post_init__(self) -> None:
        if self.loss not in LOSS_KINDS:
            raise ValueError(f"unknown NTL loss {self.loss!r}; expected one of {LOSS_KINDS}")
        if self.squash_factor is not None:
            if self.loss != "was":
                raise ValueError(f"squash_factor applies to loss='was' only, got loss={self.loss!r}")
            if isinstance(self.squash_factor, bool) or not isinstance(self.squash_factor, numbers.Real):
                raise TypeError(f"squash_factor must be a finite number > 1 or None, got {self.squash_factor!r}")
            check_squash_factor(self.squash_factor)
        check_huber_delta(self.huber_delta)
        if self.huber_delta != 1.0 and self.loss != "huber":  # ignored otherwise: say so, like squash_factor
            raise ValueError(
                f"huber_delta={self.huber_delta!r} applies to loss='huber' only, got loss={self.loss!r}; "
                "drop it or set the loss to 'huber'"
            )
        if self.float_level and self.loss != "number":
            raise ValueError(f"float_level applies to loss='number' only, got loss={self.loss!r}")
        if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        check_impl(self.impl)
        check_z_loss_weight(self.z_loss_weight)
        check_label_smoothing(self.label_smoothing)
        check_logit_softcap(self.logit_softcap)

    @property
    def ce_features(self) -> tuple[str, ...]:
        """The CE features switched on (``z_loss_weight``, ``label_smoothing``, ``logit_softcap``), by name."""
        on = (self.z_loss_weight != 0, self.label_smoothing != 0, self.logit_softcap is not None)
        return tuple(name for name, flag in zip(("z_loss_weight", "label_smoothing", "logit_softcap"), on) if flag)

    def for_evaluation(self) -> NTLOptions:
        """These options without the training regularisers of CE (z-loss, label smoothing), so that a
        held-out CE and perplexity are the model's own; soft-capping stays (it is part of the model's logits)."""
        return dataclasses.replace(self, z_loss_weight=0.0, label_smoothing=0.0)

    def point_loss(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Element-wise loss between an expected value and its target (mse/mae/huber)."""
        if self.loss == "mse":
            return (pred - target).square()
        if self.loss == "mae":
            return (pred - target).abs()
        return F.huber_loss(pred, target, reduction="none", delta=float(self.huber_delta))

    def max_loss(self, vocab: NumberVocab) -> torch.Tensor:
        """The largest value the per-token loss can take (the reweighing constant's base).

        A 0-dim float64 CPU tensor (usable with tensors on any device, like a Python number): no
        host read, so ``torch.compile`` traces it without a graph break.
        """
        if self.loss == "number":
            return torch.ones((), dtype=torch.float64)
        if self.loss == "was":
            return vocab.distance_table(self.squash_factor).max().double()
        low, high = vocab.values.min(), vocab.values.max()
        return torch.maximum(self.point_loss(low, high).abs(), self.point_loss(high, low).abs()).double()


_T = TypeVar("_T")


def variant_fields(cls: type[_T]) -> type[_T]:
    """Gives a front end's settings class (before ``@dataclass``) the variant fields of :class:`NTLOptions`.

    Every field of :class:`NTLOptions` but ``ignore_index`` (a per-call argument): ``loss``, ``squash_factor``,
    ``reweigh``, ``huber_delta``, ``float_level``, ``impl`` and the CE options ``z_loss_weight``,
    ``label_smoothing``, ``logit_softcap``, with :class:`NTLOptions`'s types and defaults, after the class's
    own fields. So :class:`NTLRunOptions` (the YAML ``ntl`` section), Megatron's ``NTLSettings`` and
    torchtitan's ``NTLLoss.Config`` declare none of them: a new variant option is added to
    :class:`NTLOptions` alone. Their documentation is :class:`NTLOptions`'s (:func:`option_fields`).

    Raises:
        TypeError: the class declares one of them itself (it would shadow the spec's).
    """
    own = dict(inspect.get_annotations(cls))
    added: dict[str, Any] = {}
    for f in dataclasses.fields(NTLOptions):
        if f.name == "ignore_index":
            continue
        if f.name in own:
            raise TypeError(
                f"{cls.__name__} declares {f.name!r}, a field of NTLOptions: drop it (variant_fields adds it)"
            )
        added[f.name] = f.type
        setattr(cls, f.name, f.default)
    cls.__annotations__ = {**own, **added}
    return cls


@dataclass
@variant_fields
class NTLRunOptions:
    """The NTL options of a training run: the variant of :class:`NTLOptions` and the run-level choices.

    The ``ntl`` section of ``launch/train.py``'s config is this class
    (:class:`ntl_scale.training.config.NTLConfig`). Its variant fields (``loss``, ``squash_factor``, ...,
    ``logit_softcap``) are :class:`NTLOptions`'s, added by :func:`variant_fields`; declared here are the
    run-level ones. ``chunked`` and ``chunk_tokens`` are listed by :func:`option_fields` but live in the
    ``train`` section of a run config (``train.chunked_loss``, ``train.loss_chunk_tokens``), so they are
    not fields here.
    """

    weight: float = 0.3
    """Weight of NTL in ``CE + weight * NTL`` (0.3 in the paper); 0 trains with CE alone."""
    digit_level: bool = True
    """Number table of the ten digits (True) or of multi-digit tokens (False); ``loss=number`` needs digits.
    (Megatron spells it ``--ntl-number-vocab digits|multi-digit|PATH``; torchtitan ``loss.digit_level``, or a
    saved table in ``loss.number_vocab``; Hugging Face takes the ``NumberVocab`` itself.)"""
    normalization: str = "global"
    """``global`` (sum / count of the whole global batch) or ``micro-batch`` (mean per micro-batch)."""

    def __post_init__(self) -> None:
        check_run_options(self, "yaml")

    def options(self, ignore_index: int = -100) -> NTLOptions:
        """The :class:`NTLOptions` of this run (the variant and ``impl``)."""
        return variant_of(self, ignore_index)


VOCAB_RULES = ("digits", "multi-digit")
"""The number-table rules a ``number_vocab`` value may name instead of a saved table's path."""


def table_source(number_vocab: str | None, digit_level: bool = True, name: str = "number_vocab") -> bool | str:
    """What a front end's number table is, read the same way on every surface.

    ``number_vocab`` (Megatron's ``--ntl-number-vocab``, torchtitan's ``loss.number_vocab``) is a rule or the
    path of a table saved with ``NumberVocab.save``: ``"digits"`` is ``digit_level=True`` (the ten digit
    tokens), ``"multi-digit"`` is ``digit_level=False``; None leaves the rule to ``digit_level`` (the YAML's
    ``ntl.digit_level``, torchtitan's ``loss.digit_level``).

    Args:
        number_vocab: the rule or path, or None.
        digit_level: the rule where ``number_vocab`` is None.
        name: how the front end spells ``number_vocab``, for messages.

    Returns:
        ``digit_level`` of the rule (True/False), or the path of the saved table (a str).

    Raises:
        ValueError: ``number_vocab`` is empty, or ``"digits"`` beside ``digit_level=False`` (contradictory).
    """
    if number_vocab is None:
        return digit_level
    if not isinstance(number_vocab, str) or not number_vocab:
        raise ValueError(
            f"{name} must be one of {VOCAB_RULES} or the path of a table saved with NumberVocab.save, got "
            f"{number_vocab!r}"
        )
    if number_vocab == "digits" and not digit_level:
        raise ValueError(f"{name}='digits' contradicts digit_level=False: drop one of them")
    if number_vocab in VOCAB_RULES:
        return number_vocab == "digits"
    return number_vocab


def check_run_options(settings: object, surface: str) -> NTLOptions:
    """The run-level rules of every front end, checked once, named as ``surface`` spells the options.

    * each numeric option it carries (:func:`check_numeric_options`);
    * ``normalization`` (where it has one) one of :data:`NORMALIZATIONS`;
    * ``chunk_tokens`` only with ``chunked`` (where it has both: :func:`check_chunk_route`);
    * the number table (:func:`table_source`), and ``loss="number"`` not with the multi-digit rule: it
      assembles numbers from single-digit tokens (a saved table is checked when it is read);
    * the variant itself (:class:`NTLOptions`'s checks, through :func:`variant_of`).

    Args:
        settings: the front end's settings (their fields by name: the YAML ``ntl`` section, Megatron's
            ``NTLSettings``, torchtitan's ``NTLLoss.Config``).
        surface: one of :data:`SURFACES`, for the spelling in messages.

    Returns:
        The :class:`NTLOptions` of the settings.
    """
    check_numeric_options(settings, lambda name: surface_name(name, surface) or name)
    if hasattr(settings, "normalization") and settings.normalization not in NORMALIZATIONS:
        raise ValueError(
            f"{surface_name('normalization', surface)} must be one of {NORMALIZATIONS}, got {settings.normalization!r}"
        )
    if hasattr(settings, "chunked"):
        check_chunk_route(settings.chunked, getattr(settings, "chunk_tokens", None), surface)
    options = variant_of(settings)
    spelled = {"megatron": "--ntl-number-vocab", "torchtitan": "loss.number_vocab"}.get(surface, "number_vocab")
    source = table_source(getattr(settings, "number_vocab", None), getattr(settings, "digit_level", True), spelled)
    if options.loss == "number" and source is False:  # a saved table is checked when it is read
        loss, table = surface_name("loss", surface), surface_name("digit_level", surface)
        eq, digits = (" ", "digits") if surface == "megatron" else ("=", "true")  # --flag value, key=value
        raise ValueError(
            f"{loss}{eq}number assembles numbers from single-digit tokens and cannot read a multi-digit table (a token "
            f"worth 123 would count as one digit); set {table}{eq}{digits} (a digit table), or use a token-level "
            f"{loss} (was, mse, mae, huber) with the multi-digit table"
        )
    return options


def variant_of(settings: object, ignore_index: int = -100) -> NTLOptions:
    """The :class:`NTLOptions` of any front end's settings that carry its fields by name (the YAML
    section, Megatron's ``NTLSettings``), with ``ignore_index`` given: one mapping for every front end."""
    names = [f.name for f in dataclasses.fields(NTLOptions) if f.name != "ignore_index"]
    return NTLOptions(**{name: getattr(settings, name) for name in names}, ignore_index=ignore_index)


def check_chunk_route(chunked: object, chunk_tokens: object, surface: str) -> None:
    """Refuses ``chunk_tokens`` without ``chunked`` (a value no code would read), named as ``surface`` spells
    them (:func:`surface_name`), like ``squash_factor`` without ``loss="was"``."""
    if chunk_tokens is not None and not chunked:
        tokens, route = surface_name("chunk_tokens", surface), surface_name("chunked", surface)
        raise ValueError(
            f"{tokens}={chunk_tokens!r} applies to the chunked route only, but {route} is off: turn {route} on "
            f"or drop {tokens}"
        )


# ---------------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class OptionField:
    """One option of the spec (:func:`option_fields`).

    Attributes:
        name: the option's name (the field name in :class:`NTLOptions` / :class:`NTLRunOptions`).
        type: its annotation as written (``"float | None"``).
        default: its default.
        doc: its attribute docstring.
        choices: the allowed strings, for options that take one of a few (else None).
        level: ``variant`` (an :class:`NTLOptions` field), ``run`` (an :class:`NTLRunOptions` field) or
            ``route`` (the chunked route: ``chunked``, ``chunk_tokens``).
    """

    name: str
    type: str
    default: Any
    doc: str
    choices: tuple[str, ...] | None
    level: str


_CHOICES: dict[str, tuple[str, ...]] = {"loss": LOSS_KINDS, "normalization": NORMALIZATIONS, "impl": IMPLS}

# The chunked route: how the logits are obtained, not what the loss is, so not a field of the YAML
# ``ntl`` section (a run config spells them train.chunked_loss / train.loss_chunk_tokens).
_ROUTE = (
    OptionField(
        "chunked",
        "bool",
        False,
        "CE + NTL from the final hidden states and the output weight in token chunks, never materialising "
        "the [tokens, vocab] logits (ntl_scale.linear_ce_ntl).",
        None,
        "route",
    ),
    OptionField(
        "chunk_tokens",
        "int | None",
        None,
        "Tokens per chunk of the chunked loss (None: about 2**26 logits per chunk).",
        None,
        "route",
    ),
)


def attribute_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (a string literal right under a field), by field name.

    Empty where the source is not available (a frozen application without ``.py`` files).
    """
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    node = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(node, ast.ClassDef):
        raise TypeError(f"attribute_docs takes a class, got {cls!r}")
    body = node.body
    docs = {}
    for field, after in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


@functools.lru_cache(maxsize=1)
def option_fields() -> tuple[OptionField, ...]:
    """Every NTL option a front end exposes, with its type, default, documentation and choices.

    The variant fields of :class:`NTLOptions` (without ``ignore_index``, a per-call argument), then
    the run-level fields of :class:`NTLRunOptions` (``weight``, ``digit_level``, ``normalization``),
    then the chunked route (``chunked``, ``chunk_tokens``). The hook for a new front end: a torchtitan
    ``BaseLoss.Config``, a CLI, a config schema can be generated from this list.
    """
    fields: list[OptionField] = []
    for cls, level in ((NTLOptions, "variant"), (NTLRunOptions, "run")):
        docs = attribute_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name == "ignore_index" or any(o.name == f.name for o in fields):
                continue
            doc = docs.get(f.name, "")
            fields.append(OptionField(f.name, str(f.type), f.default, doc, _CHOICES.get(f.name), level))
    return (*fields, *_ROUTE)


def option_field(name: str) -> OptionField:
    """The :class:`OptionField` called ``name`` (ValueError naming the known options otherwise)."""
    for option in option_fields():
        if option.name == name:
            return option
    raise ValueError(f"unknown NTL option {name!r}; the options are {[o.name for o in option_fields()]}")


# ---------------------------------------------------------------------------------- the front ends

SURFACES = ("yaml", "megatron", "hf", "torchtitan")
"""The front ends: ``yaml`` (``launch/train.py``'s run config), ``megatron`` (the ``--ntl-*`` flags of
both Megatron routes), ``hf`` (``apply_ntl_to_hf_model``: its keyword arguments, the variant in
``options=``), ``torchtitan`` (``NTLLoss.Config``'s fields: ``--loss.<name>``, or ``--loss.loss-fn.<name>``
inside ``ChunkedLossWrapper``)."""

# How a front end spells an option where its rule (yaml: ntl.<name>; megatron: --ntl-<name with
# dashes>; hf: options.<name> for the variant, <name> otherwise; torchtitan: loss.<name>) does not
# give it. None: the option is not an argument of that front end, for the reason given.
_SPELLING: dict[str, dict[str, tuple[str | None, str]]] = {
    "yaml": {
        "chunked": ("train.chunked_loss", "the chunked route is a train-section choice"),
        "chunk_tokens": ("train.loss_chunk_tokens", "the chunked route is a train-section choice"),
    },
    "megatron": {
        "digit_level": ("--ntl-number-vocab", "digits | multi-digit | the path of a saved table"),
    },
    "hf": {
        "weight": ("ntl_weight", "apply_ntl_to_hf_model(model, vocab, ntl_weight=...)"),
        "digit_level": (
            None,
            "apply_ntl_to_hf_model takes the NumberVocab itself (NumberVocab.from_tokenizer(digit_level=...))",
        ),
        "normalization": (None, "Hugging Face normalises by what num_items_in_batch carries (ntl_trainer_class)"),
    },
    "torchtitan": {
        "chunked": (None, "torchtitan's chunked route is its ChunkedLossWrapper (--loss.num-chunks)"),
        "normalization": (None, "torchtitan normalises by the step's global counts; there is no micro-batch mean"),
    },
}

# Defaults that differ on a front end, in that front end's spelling, and why.
_DEFAULTS: dict[str, dict[str, tuple[Any, str]]] = {
    "megatron": {
        "weight": (0.0, "adding the flags leaves a Megatron run unchanged until --ntl-weight is given"),
        "normalization": ("micro-batch", "Megatron averages each micro-batch's loss by default"),
        "digit_level": ("digits", "--ntl-number-vocab digits is digit_level=True"),
    },
}


def _check_surface(surface: str) -> None:
    if surface not in SURFACES:
        raise ValueError(f"unknown front end {surface!r}; expected one of {SURFACES}")


def surface_name(name: str, surface: str) -> str | None:
    """How ``surface`` spells the option ``name`` (``ntl.loss``, ``--ntl-loss``, ``options.loss``), or None.

    None means the front end takes no such argument; :func:`surface_reason` says why.
    """
    _check_surface(surface)
    option = option_field(name)
    if name in _SPELLING.get(surface, {}):
        return _SPELLING[surface][name][0]
    if surface == "yaml":
        return f"ntl.{name}"
    if surface == "megatron":
        return "--ntl-" + name.replace("_", "-")
    if surface == "torchtitan":
        return f"loss.{name}"
    return f"options.{name}" if option.level == "variant" else name


def surface_reason(name: str, surface: str) -> str:
    """Why ``surface`` spells ``name`` or defaults it otherwise than the rule ('' where it follows the rule)."""
    _check_surface(surface)
    reasons = [r for table in (_SPELLING, _DEFAULTS) for n, (_, r) in table.get(surface, {}).items() if n == name]
    return "; ".join(reasons)


def surface_default(name: str, surface: str) -> Any:
    """The default of option ``name`` on ``surface``, in its spelling: the spec's, except where declared."""
    _check_surface(surface)
    if name in _DEFAULTS.get(surface, {}):
        return _DEFAULTS[surface][name][0]
    return option_field(name).default
