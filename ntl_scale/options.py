"""The NTL option spec: every option once, with its type, default and meaning (the attribute docstring
under each field).

:class:`NTLOptions` is what one loss call computes; :class:`NTLRunOptions` adds a run's ``weight``,
``digit_level`` and ``normalization``; :func:`option_fields` lists them with the chunked route, and
:func:`surface_name` says how each front end spells them. Numeric options are checked here once
(:data:`NUMERIC_CHECKS`, :func:`check_option`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "CE_KERNELS",
    "IMPLS",
    "LOSS_KINDS",
    "NORMALIZATIONS",
    "NUMERIC_CHECKS",
    "REDUCTIONS",
    "SURFACES",
    "VOCAB_RULES",
    "NTLOptions",
    "NTLRunOptions",
    "NumericRange",
    "OptionField",
    "check_chunk_route",
    "check_impl",
    "check_numeric_options",
    "check_option",
    "check_run_options",
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
CE_KERNELS = ("ntl_scale", "framework")
"""Which cross entropy a training stack runs beside NTL: ntl_scale's fused op, or the stack's own."""


def check_impl(impl: object) -> str:
    """Returns ``impl`` when it is one of :data:`IMPLS`; otherwise a ValueError naming it and the choices."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(
            f"unknown impl {impl!r}; expected one of {', '.join(map(repr, IMPLS))}: 'auto' (the default: the "
            "PyTorch code, until the Triton kernels have passed the GPU suite), 'torch' (always the PyTorch code) "
            "or 'triton' (the Triton kernels; CUDA tensors, triton installed)"
        )
    return impl


@dataclass(frozen=True)
class NumericRange:
    """The allowed values of one numeric option (a row of :data:`NUMERIC_CHECKS`)."""

    low: float
    open_low: bool
    meaning: str
    high: float | None = None
    whole: bool = False
    optional: bool = False
    fix: str = ""

    def expected(self) -> str:
        """The rule in words: ``a finite number > 1``, ``a whole number >= 1``, ``a finite number in [0, 1]``."""
        kind = "a whole number" if self.whole else "a finite number"
        low = int(self.low) if float(self.low).is_integer() else self.low
        if self.high is not None:
            return f"{kind} in {'(' if self.open_low else '['}{low}, {int(self.high)}]"
        return f"{kind} {'>' if self.open_low else '>='} {low}"


NUMERIC_CHECKS: dict[str, NumericRange] = {
    "weight": NumericRange(0, False, "0.3 in the paper, 0 = CE alone"),
    "squash_factor": NumericRange(
        1, True, "how much worse the farthest number is than the closest wrong one; 1 would turn NTL-WAS into "
        "cross entropy; inf would put 0 * inf = NaN in the distance table", optional=True,
        fix="; use None for plain |v_i - v_j|",
    ),
    "huber_delta": NumericRange(
        0, True, "the Huber loss's threshold between its quadratic and linear parts; 1.0 by default"
    ),
    "chunk_tokens": NumericRange(
        1, False, "tokens per chunk", whole=True, optional=True,
        fix="; pass e.g. chunk_tokens=512, or None for the default budget",
    ),
    "z_loss_weight": NumericRange(
        0, False, "the weight of the z-loss z_loss_weight * logsumexp(z)**2 added to CE; 1e-4 in PaLM and "
        "OLMo 2, 0 = off",
    ),
    "label_smoothing": NumericRange(
        0, False, "the share of the CE target spread uniformly over the whole vocabulary, as torch's "
        "F.cross_entropy(label_smoothing=); 0 = off, 0.1 is usual", high=1,
    ),
    "logit_softcap": NumericRange(
        0, True, "logits become cap * tanh(z / cap); 30.0 in Gemma 2; None = no capping", optional=True
    ),
}  # fmt: skip
"""The one check of every numeric option, by option name: every front end (the Python API, the YAML sections,
torchtitan's ``NTLLoss.Config``, Megatron's flags and ``NTLSettings``, Hugging Face's ``apply_ntl_to_hf_model``)
calls :func:`check_option` with its own spelling."""


def check_option(name: str, value: object, spelling: str | None = None) -> Any:
    """Checks the numeric option ``name`` against its :data:`NUMERIC_CHECKS` row; returns it as a float, an
    int or None."""
    if name not in NUMERIC_CHECKS:
        raise ValueError(f"{name!r} is not a numeric NTL option; the numeric options are {sorted(NUMERIC_CHECKS)}")
    rule = NUMERIC_CHECKS[name]
    if value is None and rule.optional:
        return None
    number = isinstance(value, numbers.Integral if rule.whole else numbers.Real) and not isinstance(value, bool)
    fits = (
        number
        and math.isfinite(value)  # type: ignore[arg-type]
        and (value > rule.low if rule.open_low else value >= rule.low)  # type: ignore[operator]
        and (rule.high is None or value <= rule.high)  # type: ignore[operator]
    )
    if not fits:
        none = " or None" if rule.optional else ""
        raise ValueError(
            f"{spelling or name} must be {rule.expected()}{none} ({rule.meaning}), got {value!r}{rule.fix}"
        )
    return int(value) if rule.whole else float(value)  # type: ignore[arg-type, call-overload]


def check_numeric_options(settings: object, spell: Callable[[str], str | None]) -> None:
    """:func:`check_option` of every numeric option ``settings`` carries (by attribute name), each named as
    ``spell(name)`` says its front end spells it (``ntl.squash_factor``, ``--ntl-squash-factor``, ...)."""
    for name in NUMERIC_CHECKS:
        if hasattr(settings, name):
            check_option(name, getattr(settings, name), spell(name))


def _documented(default: Any, doc: str) -> Any:
    """A dataclass field with its documentation in ``metadata["doc"]``, read by :func:`option_fields` (help
    texts, generated configs) without parsing this module's source."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True, kw_only=True)
class NTLOptions:
    """Which NTL variant one loss call computes, and with which code (keyword arguments only).

    Invalid values raise a ValueError (TypeError for a wrong type) naming the value and the fix. Each field's
    documentation is its ``doc`` (:func:`option_fields`).
    """

    loss: str = _documented(
        "was",
        "``was`` (Wasserstein-1 between the number-token distribution and the label, the paper's default), "
        "``mse``, ``mae``, ``huber`` (point loss of the expected value) or ``number`` (number-level symmetric "
        "MAPE of whole numbers rebuilt from digit tokens; needs a digit table).",
    )
    squash_factor: float | None = _documented(
        None, "``was`` only: map the nonzero distances onto ``[1, squash_factor]`` (> 1); None: ``|v_k - t|``."
    )
    reweigh: bool = _documented(
        False,
        "Scale NTL by the probability mass on number tokens and charge the rest ``1.01 * max loss`` (the "
        "reference's default; not used in the paper).",
    )
    huber_delta: float = _documented(
        1.0, "``huber`` only: the threshold between the quadratic and the linear part (> 0)."
    )
    float_level: bool = _documented(
        False, "``number`` only: a decimal point between two digits joins them into one number."
    )
    ignore_index: int = _documented(
        -100, "The label value that carries no loss (a per-call argument: run configs mask with -100)."
    )
    impl: str = _documented(
        "auto",
        "Which code computes the fused statistics: ``auto`` (the PyTorch code until the Triton kernels have "
        "passed the GPU suite), ``torch``, or ``triton`` (CUDA tensors; refused with label smoothing or "
        "soft-capping). The numbers agree to rounding.",
    )
    z_loss_weight: float = _documented(
        0.0,
        "Weight of the z-loss ``z_loss_weight * logsumexp(z)**2`` added to each token's CE (PaLM, OLMo 2: 1e-4); "
        "0: off. A training regulariser: held-out CE is computed without it (:meth:`for_evaluation`).",
    )
    label_smoothing: float = _documented(
        0.0,
        "CE against ``(1 - eps) * onehot(y) + eps / V`` over the **whole** vocabulary ``V`` (all TP shards), as "
        "torch's ``F.cross_entropy(label_smoothing=eps)``; NTL keeps the hard number target. 0: off. A training "
        "regulariser: held-out CE is computed without it (:meth:`for_evaluation`).",
    )
    logit_softcap: float | None = _documented(
        None,
        "Soft-capping of the logits, ``cap * tanh(z / cap)`` (Gemma 2: 30.0), before CE, z-loss and NTL (all of "
        "them see the capped logits); None: off. Leave None where the model already caps its output.",
    )
    ce_kernel: str = _documented(
        "ntl_scale",
        "Which cross entropy the integrations run: ``ntl_scale`` (the fused CE + NTL op) or ``framework`` (the "
        "stack's own CE, unchanged: Megatron's, torchtitan's, transformers' or Liger's; NTL is added beside it "
        "from the number columns; ``docs/getting_started.md``). ``framework`` takes none of the CE options "
        "above, nor ``reweigh`` (it needs the full log-sum-exp, which those kernels do not return).",
    )

    def __post_init__(self) -> None:
        if self.loss not in LOSS_KINDS:
            raise ValueError(f"unknown NTL loss {self.loss!r}; expected one of {LOSS_KINDS}")
        if self.squash_factor is not None:
            if self.loss != "was":
                raise ValueError(f"squash_factor applies to loss='was' only, got loss={self.loss!r}")
            if isinstance(self.squash_factor, bool) or not isinstance(self.squash_factor, numbers.Real):
                raise TypeError(f"squash_factor must be a finite number > 1 or None, got {self.squash_factor!r}")
        for name in ("squash_factor", "huber_delta", "z_loss_weight", "label_smoothing", "logit_softcap"):
            check_option(name, getattr(self, name))
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
        if self.ce_kernel not in CE_KERNELS:
            raise ValueError(f"unknown ce_kernel {self.ce_kernel!r}; expected one of {CE_KERNELS}")
        if self.ce_kernel == "framework" and (self.ce_features or self.reweigh):
            on = (*self.ce_features, *(("reweigh",) if self.reweigh else ()))
            raise ValueError(
                f"ce_kernel='framework' runs the stack's own cross entropy, which takes none of {on} from ntl_scale "
                "(reweigh needs its log-sum-exp): set the CE options in the framework, drop them, or use "
                "ce_kernel='ntl_scale' (ntl_scale's fused op computes them)"
            )

    @property
    def ce_features(self) -> tuple[str, ...]:
        """The CE features switched on (``z_loss_weight``, ``label_smoothing``, ``logit_softcap``), by name."""
        on = (self.z_loss_weight != 0, self.label_smoothing != 0, self.logit_softcap is not None)
        return tuple(name for name, flag in zip(("z_loss_weight", "label_smoothing", "logit_softcap"), on) if flag)

    def for_evaluation(self) -> NTLOptions:
        """These options without the training regularisers of CE (z-loss, label smoothing), so that a
        held-out CE and perplexity are the model's own; soft-capping stays (it is part of the model's logits)."""
        return dataclasses.replace(self, z_loss_weight=0.0, label_smoothing=0.0)


_T = TypeVar("_T")


def variant_fields(cls: type[_T]) -> type[_T]:
    """Gives a front end's settings class (before ``@dataclass``) the variant fields of :class:`NTLOptions`.

    Every field but ``ignore_index``, with its type and default, after the class's own: a new variant option
    is added to :class:`NTLOptions` alone. A class that declares one itself is a TypeError.
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
    """The NTL options of a training run: the variant of :class:`NTLOptions` and the run-level choices."""

    weight: float = _documented(
        0.3, "Weight of NTL in ``CE + weight * NTL`` (0.3 in the paper); 0 trains with CE alone."
    )
    digit_level: bool = _documented(
        True,
        "Number table of the ten digits (True) or of multi-digit tokens (False); ``loss=number`` needs digits. "
        "(Megatron spells it ``--ntl-number-vocab digits|multi-digit|PATH``; torchtitan ``loss.digit_level``, or "
        "a saved table in ``loss.number_vocab``; Hugging Face takes the ``NumberVocab`` itself.)",
    )
    normalization: str = _documented(
        "global", "``global`` (sum / count of the whole global batch) or ``micro-batch`` (mean per micro-batch)."
    )

    def __post_init__(self) -> None:
        check_run_options(self, "yaml")

    def options(self, ignore_index: int = -100) -> NTLOptions:
        """The :class:`NTLOptions` of this run (the variant and ``impl``)."""
        return variant_of(self, ignore_index)


VOCAB_RULES = ("digits", "multi-digit")
"""The number-table rules a ``number_vocab`` value may name instead of a saved table's path."""


def table_source(number_vocab: str | None, digit_level: bool = True, name: str = "number_vocab") -> bool | str:
    """``digit_level`` of the rule ``"digits"``/``"multi-digit"`` (None: ``digit_level``), or a saved table's path."""
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

    Numeric options, ``normalization``, ``chunk_tokens`` only with ``chunked``, the number table (no
    ``loss="number"`` on the multi-digit rule) and the variant; returns the :class:`NTLOptions`.
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
    """One option of the spec (:func:`option_fields`)."""

    name: str
    type: str
    default: Any
    doc: str
    choices: tuple[str, ...] | None
    level: str


_CHOICES: dict[str, tuple[str, ...]] = {
    "loss": LOSS_KINDS, "normalization": NORMALIZATIONS, "impl": IMPLS, "ce_kernel": CE_KERNELS,
}  # fmt: skip

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


@functools.lru_cache(maxsize=1)
def option_fields() -> tuple[OptionField, ...]:
    """Every NTL option a front end exposes, with its type, default, documentation and choices."""
    fields: list[OptionField] = []
    for cls, level in ((NTLOptions, "variant"), (NTLRunOptions, "run")):
        for f in dataclasses.fields(cls):
            if f.name == "ignore_index" or any(o.name == f.name for o in fields):
                continue
            doc = f.metadata.get("doc", "")
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
    """How ``surface`` spells the option ``name`` (``ntl.loss``, ``--ntl-loss``, ``options.loss``), or None."""
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
