"""Number-token tables: which vocabulary ids are numbers, and what their values are.

A :class:`NumberVocab` is built once from a tokenizer (or an id -> string mapping), saved as JSON and loaded
on every rank without the tokenizer. Rules (docs/number_vocab.md): the ten ASCII digits by default;
``digit_level=False`` adds ASCII decimal literals (``"123"``, ``"-5"``, ``"2.5"``); word-prefixed digits
(``"▁3"``, ``"Ġ3"``, ``"##3"``) only with ``prefixed=True``; unicode digits never. The tokenizer is never
modified (:func:`add_digit_tokens` is the opt-in).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._runtime import is_tracing
from .atomic import write_json_atomically
from .options import check_option

__all__ = [
    "DIGIT_LEVEL_WAS",
    "SCALE_TOLERANCE",
    "NumberCensus",
    "NumberTableWarning",
    "NumberVocab",
    "VocabShard",
    "add_digit_tokens",
    "check_number_level_table",
    "digit_scale_squash_factor",
    "number_token_census",
    "pad_vocab_size",
    "parse_number_token",
    "untrained_was",
]

_FORMAT = "ntl_scale.NumberVocab"
_FORMAT_VERSION = 1
# Prefixes that mark "this token starts a new word" (SentencePiece, byte-level BPE, plain space)
# or "continues a word" (WordPiece). The body after the prefix is what is parsed.
_PREFIXES = ("\u2581", "\u0120", " ", "##")
_DIGITS = "0123456789"
_MULTI_DIGIT = re.compile(r"[+-]?[0-9]+(?:\.[0-9]+)?", flags=re.ASCII)


def parse_number_token(token: str, *, digit_level: bool = True, prefixed: bool = False) -> float | None:
    """The value of a token string (``"3"``, ``"▁3"``, ``"Ġ12"``) under the module's rules, or None.

    Args:
        digit_level: single ASCII digits only; else ASCII decimal literals with an optional sign and fraction.
        prefixed: a token with a word prefix (``▁``, ``Ġ``, space, ``##``) counts with the value of its body.
    """
    body = token
    for prefix in _PREFIXES:
        if token.startswith(prefix) and len(token) > len(prefix):
            if not prefixed:
                return None
            body = token[len(prefix) :]
            break
    if digit_level:
        return float(body) if len(body) == 1 and body in _DIGITS else None
    if _MULTI_DIGIT.fullmatch(body) is None:
        return None
    value = float(body)
    return value if math.isfinite(value) else None


def pad_vocab_size(vocab_size: int, *, divisible_by: int = 128, tp_size: int = 1) -> int:
    """``vocab_size`` padded as Megatron does, up to a multiple of ``divisible_by * tp_size``
    (``divisible_by``: Megatron's ``--make-vocab-size-divisible-by``)."""
    for name, value in (("vocab_size", vocab_size), ("divisible_by", divisible_by), ("tp_size", tp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"pad_vocab_size: {name} must be a positive int, got {value!r}")
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


DIGIT_LEVEL_WAS = 3.3
"""NTL-WAS of an untrained model on the ten digits, ``mean |i - j| = 99 / 30``: where the NTL weight was tuned."""
SCALE_TOLERANCE = 3.0
"""How far (a factor, either way) a table's untrained NTL-WAS may sit from :data:`DIGIT_LEVEL_WAS` before the
front ends refuse or warn."""


class NumberTableWarning(UserWarning):
    """A number table leaves out most of its tokenizer's number tokens, or puts NTL off the digit level's scale."""


def _pair_statistics(values: Sequence[float]) -> tuple[float, float, float, float]:
    """Over all ordered pairs (i, j) of ``values`` (float64): the mean ``|v_i - v_j|``, the share of pairs with
    different values, and the smallest and largest nonzero distance (0, 0 when all values are equal)."""
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    if n == 0:
        raise ValueError("the table has no values")
    # sum over i < j of (v_j - v_i) = sum_j v_j * (2 j - n + 1) for sorted v
    total = math.fsum(v * (2 * j - n + 1) for j, v in enumerate(ordered))
    mean = 2 * total / (n * n)
    same = math.fsum(float(count) ** 2 for count in _run_lengths(ordered))
    gaps = [b - a for a, b in itertools.pairwise(ordered) if b > a]
    smallest, largest = (min(gaps), ordered[-1] - ordered[0]) if gaps else (0.0, 0.0)
    return mean, 1 - same / (n * n), smallest, largest


def _run_lengths(ordered: list[float]) -> list[int]:
    runs: list[int] = []
    for i, value in enumerate(ordered):
        if i and value == ordered[i - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def untrained_was(values: Sequence[float] | torch.Tensor, squash_factor: float | None = None) -> float:
    """NTL-WAS of an untrained model on a table of these values: predictions uniform over the table's tokens,
    targets uniform over them, i.e. the mean over all token pairs of the (squashed) distance, in float64."""
    listed = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    mean, differ, smallest, largest = _pair_statistics(listed)
    if squash_factor is None or largest <= smallest:  # the squash keeps |v_i - v_j| when all distances are equal
        return mean
    slope = (check_option("squash_factor", squash_factor) - 1) / (largest - smallest)
    # nonzero d maps to 1 + (d - smallest) * slope; zero stays zero
    return differ * (1 - smallest * slope) + slope * mean


def digit_scale_squash_factor(values: Sequence[float] | torch.Tensor) -> float | None:
    """The squash factor that puts a table's untrained NTL-WAS at the digit level's (:data:`DIGIT_LEVEL_WAS`).

    The NTL weight was tuned on the ten digits (3.3); plain distances on 0-999 start near 333. For 0-999 this
    is 7.9. None when squashing cannot change the distances (fewer than two distinct ones).
    """
    listed = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    mean, differ, smallest, largest = _pair_statistics(listed)
    if largest <= smallest:
        return None
    # untrained_was(s) = differ * (1 - smallest * c) + c * mean with c = (s - 1) / (largest - smallest)
    slope = (DIGIT_LEVEL_WAS - differ) / (mean - differ * smallest)
    return 1 + slope * (largest - smallest)


@dataclass(frozen=True)
class NumberCensus:
    """What a tokenizer's vocabulary holds in number tokens, and what one table rule keeps of them."""

    tokens: int
    digits: tuple[str, ...]
    multi_digit: int
    prefixed: int
    digit_level: bool
    include_prefixed: bool
    kept: int
    left_out: int
    examples: tuple[str, ...]
    multi_digit_squash: float | None

    @property
    def loses_most(self) -> bool:
        """The rule leaves out more bare number tokens than it keeps (the digit rule on a multi-digit tokenizer)."""
        return self.digit_level and self.multi_digit > self.kept

    def recipe(self) -> str:
        """The table this tokenizer's numbers call for, and the options to set (``docs/number_vocab.md``)."""
        if self.multi_digit > len(self.digits):
            squash = f"{self.multi_digit_squash:.1f}" if self.multi_digit_squash is not None else "None"
            prefixed = f"; its {self.prefixed} word-prefixed number tokens need prefixed=True" if self.prefixed else ""
            return (
                "multi-digit table (digit_level=False; Megatron --ntl-number-vocab multi-digit; YAML "
                f"ntl.digit_level: false) with squash_factor={squash} (the digit level's NTL scale){prefixed}"
            )
        if len(self.digits) == 10:
            return "digit table (digit_level=True, the default); no squash factor"
        if self.prefixed:
            return "digit table with prefixed=True (its digits are word-prefixed), or ntl_scale.add_digit_tokens"
        return "ntl_scale.add_digit_tokens(tokenizer), then the digit table"

    def summary(self) -> str:
        """A few lines for people: what was found, what the rule keeps and leaves out, and the recipe."""
        rule = "digit" if self.digit_level else "multi-digit"
        rule += " + prefixed" if self.include_prefixed else ""
        found = (
            f"{self.tokens} tokens: {len(self.digits)} digit tokens, {self.multi_digit} multi-digit number "
            f"tokens, {self.prefixed} word-prefixed number tokens"
        )
        lost = f" (e.g. {', '.join(map(repr, self.examples))})" if self.examples else ""
        lines = [found, f"the {rule} table keeps {self.kept} and leaves out {self.left_out}{lost}"]
        if self.loses_most:
            lines.append("WARNING: NTL would only see labels that happen to be single digits")
        lines.append(f"recipe: {self.recipe()}")
        return "\n".join(lines)


def _id_to_token(tokenizer: Any) -> Mapping[int, str]:
    """The id -> token string mapping of a tokenizer (Hugging Face, Megatron, SentencePiece) or of a mapping."""
    if isinstance(tokenizer, Mapping):
        return {int(i): str(t) for i, t in tokenizer.items()}
    if isinstance(tokenizer, Sequence) and not isinstance(tokenizer, str):
        return dict(enumerate(map(str, tokenizer)))
    if hasattr(tokenizer, "get_vocab"):
        return {int(i): t for t, i in tokenizer.get_vocab().items()}
    if hasattr(tokenizer, "inv_vocab"):
        return dict(tokenizer.inv_vocab)
    if hasattr(tokenizer, "id_to_piece") and hasattr(tokenizer, "get_piece_size"):
        return {i: tokenizer.id_to_piece(i) for i in range(tokenizer.get_piece_size())}
    raise TypeError(
        f"unsupported tokenizer type {type(tokenizer).__name__}; expected a Hugging Face tokenizer (get_vocab), a "
        "Megatron tokenizer (inv_vocab), a SentencePieceProcessor, or an id -> token mapping"
    )


def number_token_census(tokenizer: Any, *, digit_level: bool = True, prefixed: bool = False) -> NumberCensus:
    """Counts a vocabulary's number tokens and what the table rule ``digit_level``/``prefixed`` keeps of them."""
    mapping = _id_to_token(tokenizer)
    digits, multi, prefixed_count, kept, multi_values = [], 0, 0, 0, []
    examples: list[str] = []
    for _, token in sorted(mapping.items()):
        bare = parse_number_token(token, digit_level=False)
        if bare is None and parse_number_token(token, digit_level=False, prefixed=True) is None:
            continue
        if bare is not None:
            multi_values.append(bare)
            if parse_number_token(token) is not None:
                digits.append(token)
            else:
                multi += 1
        else:
            prefixed_count += 1
        if parse_number_token(token, digit_level=digit_level, prefixed=prefixed) is not None:
            kept += 1
        elif len(examples) < 5:
            examples.append(token)
    total = multi + len(digits) + prefixed_count
    return NumberCensus(
        tokens=len(mapping),
        digits=tuple(sorted(digits)),
        multi_digit=multi,
        prefixed=prefixed_count,
        digit_level=bool(digit_level),
        include_prefixed=bool(prefixed),
        kept=kept,
        left_out=total - kept,
        examples=tuple(examples),
        multi_digit_squash=digit_scale_squash_factor(multi_values) if multi_values else None,
    )


def _count_below(ordered: list[int], bound: int) -> int:
    """How many of the sorted ``ordered`` are below ``bound`` (a binary search in plain Python, which
    torch.compile traces; ``bisect`` is a C function it cannot)."""
    low, high = 0, len(ordered)
    while low < high:
        middle = (low + high) // 2
        if ordered[middle] < bound:
            low = middle + 1
        else:
            high = middle
    return low


@dataclass(frozen=True)
class VocabShard:
    """The number tokens that fall into one tensor-parallel vocab shard ``[start, end)``.

    Attributes:
        start: first global id of the shard.
        end: one past the last global id of the shard.
        local_ids: ids of the number tokens inside the shard, relative to ``start`` (sorted).
        table_index: position of each of those tokens in the full table (``NumberVocab.ids``).
        values: their values (float32).
    """

    start: int
    end: int
    local_ids: torch.Tensor
    table_index: torch.Tensor
    values: torch.Tensor

    @property
    def size(self) -> int:
        """Number of vocabulary columns in the shard."""
        return self.end - self.start


def _keepable(*tensors: torch.Tensor) -> bool:
    """Whether tensors built for a cache may be kept: not while a graph is traced, whose tensors (fake,
    functional or proxied, also in a traced call's untraced parts) belong to the trace, not to later calls."""
    return not is_tracing() and all(type(t) is torch.Tensor for t in tensors)


class NumberVocab:
    """The number tokens of one vocabulary: sorted ids and their float values; immutable.

    Build it with :meth:`from_tokenizer`, :meth:`from_sentencepiece` or :meth:`from_id_to_token`.

    Args:
        ids: number-token ids (any order), ``values`` and ``tokens`` (optional) aligned with them.
        vocab_size: the model's (padded) vocabulary size: the logits' last dimension.
        decimal_point_id: the ``"."`` token, for number-level NTL with ``float_level``.
    """

    def __init__(
        self,
        ids: Sequence[int] | torch.Tensor,
        values: Sequence[float] | torch.Tensor,
        vocab_size: int,
        *,
        tokens: Sequence[str] | None = None,
        decimal_point_id: int | None = None,
        digit_level: bool = True,
    ) -> None:
        ids_t = torch.as_tensor(ids, dtype=torch.long).flatten()
        values_t = torch.as_tensor(values, dtype=torch.float32).flatten()
        if ids_t.numel() == 0:
            raise ValueError(
                "NumberVocab: the table has no number tokens; expected at least one. For a tokenizer "
                "without digit tokens, call ntl_scale.add_digit_tokens(tokenizer) first (and resize "
                "the model's embeddings), or use digit_level=False / prefixed=True."
            )
        if ids_t.shape != values_t.shape:
            raise ValueError(f"NumberVocab: {ids_t.numel()} ids but {values_t.numel()} values; they must align")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"NumberVocab: vocab_size must be a positive int, got {vocab_size!r}")
        if not torch.isfinite(values_t).all():
            raise ValueError(f"NumberVocab: values must be finite, got {values_t.tolist()}")
        if int(ids_t.min()) < 0:
            raise ValueError(f"NumberVocab: ids must be >= 0, got {int(ids_t.min())}")
        if int(ids_t.max()) >= vocab_size:
            raise ValueError(
                f"NumberVocab: number-token id {int(ids_t.max())} does not fit vocab_size={vocab_size}; "
                f"expected vocab_size >= {int(ids_t.max()) + 1} (the model's padded output dimension)"
            )
        if ids_t.unique().numel() != ids_t.numel():
            raise ValueError("NumberVocab: ids contain duplicates")
        if ids_t.numel() == vocab_size:
            raise ValueError("NumberVocab: every vocabulary id is a number token; at least one must not be")
        order = torch.argsort(ids_t)
        self._ids = ids_t[order]
        self._values = values_t[order]
        self._vocab_size = vocab_size
        if tokens is not None:
            if len(tokens) != ids_t.numel():
                raise ValueError(f"NumberVocab: {len(tokens)} tokens but {ids_t.numel()} ids; they must align")
            self._tokens: tuple[str, ...] | None = tuple(tokens[i] for i in order.tolist())
        else:
            self._tokens = None
        if decimal_point_id is not None and not 0 <= decimal_point_id < vocab_size:
            raise ValueError(f"NumberVocab: decimal_point_id={decimal_point_id} is outside [0, {vocab_size})")
        self._decimal_point_id = decimal_point_id
        self._digit_level = bool(digit_level)
        self._device_cache: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._shards: dict[tuple[int, int], VocabShard] = {}
        self._id_list: list[int] = self._ids.tolist()  # sorted: a shard's tokens are one contiguous run

    @classmethod
    def from_id_to_token(
        cls,
        id_to_token: Mapping[int, str] | Sequence[str],
        *,
        vocab_size: int | None = None,
        digit_level: bool = True,
        prefixed: bool = False,
    ) -> NumberVocab:
        """Builds the table from an id -> token-string mapping or list (e.g. Megatron's ``tokenizer.inv_vocab``).

        Args:
            vocab_size: the model's padded vocabulary size (default: largest id + 1).
            digit_level: the ten ASCII digits (True) or multi-digit literals (False).
            prefixed: include word-prefixed number tokens (``▁3``, ``Ġ3``, ``##3``).

        A :class:`NumberTableWarning` says when the rule leaves out most of the number tokens, with the fix.
        """
        items = id_to_token.items() if isinstance(id_to_token, Mapping) else enumerate(id_to_token)
        pairs = [(int(i), str(t)) for i, t in items]
        if not pairs:
            raise ValueError("NumberVocab.from_id_to_token: the mapping is empty")
        tokenizer_size = max(i for i, _ in pairs) + 1
        ids, values, tokens = [], [], []
        decimal_point_id = None
        for i, token in sorted(pairs):
            if token == "." and decimal_point_id is None:
                decimal_point_id = i
            value = parse_number_token(token, digit_level=digit_level, prefixed=prefixed)
            if value is not None:
                ids.append(i)
                values.append(value)
                tokens.append(token)
        size = tokenizer_size if vocab_size is None else vocab_size
        if not ids:
            raise ValueError(
                f"NumberVocab: found no number tokens among {tokenizer_size} tokens "
                f"(digit_level={digit_level}, prefixed={prefixed}); expected e.g. the tokens '0'..'9'. "
                "Fix: call ntl_scale.add_digit_tokens(tokenizer) and resize the model's embeddings, "
                "or try prefixed=True for tokenizers that only have '▁3'/'Ġ3' style digits."
            )
        census = number_token_census(dict(pairs), digit_level=digit_level, prefixed=prefixed)
        if census.loses_most:
            warnings.warn(
                f"NumberVocab: the digit table keeps {census.kept} number tokens and leaves out {census.left_out} "
                f"(e.g. {', '.join(map(repr, census.examples))}), of which {census.multi_digit} multi-digit: this "
                "tokenizer writes numbers as multi-digit tokens, so NTL would only see the labels that happen to "
                f"be single digits. Fix: the {census.recipe()}; see docs/number_vocab.md (recipes)",
                NumberTableWarning,
                stacklevel=3,
            )
        if digit_level:
            missing = sorted(set(range(10)) - {int(v) for v in values})
            if missing:
                warnings.warn(
                    f"NumberVocab: digit-level table lacks the digits {missing}; NTL will only spread mass "
                    "over the digits present. Fix: ntl_scale.add_digit_tokens(tokenizer).",
                    stacklevel=3,
                )
        return cls(ids, values, size, tokens=tokens, decimal_point_id=decimal_point_id, digit_level=digit_level)

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        digit_level: bool = True,
        prefixed: bool = False,
    ) -> NumberVocab:
        """Builds the table from a Hugging Face (``get_vocab``), Megatron (``inv_vocab``) or SentencePiece
        tokenizer, without modifying it; arguments as :meth:`from_id_to_token` (``vocab_size`` default: the
        tokenizer's size; e.g. 151936 for Qwen's 151665 tokens)."""
        if isinstance(tokenizer, (Mapping, Sequence)):
            raise TypeError(
                f"NumberVocab.from_tokenizer: got a {type(tokenizer).__name__}; for an id -> token mapping use "
                "NumberVocab.from_id_to_token(mapping)"
            )
        try:
            mapping = _id_to_token(tokenizer)
        except TypeError as e:
            raise TypeError(f"NumberVocab.from_tokenizer: {e} (from_id_to_token takes any mapping)") from None
        return cls.from_id_to_token(mapping, vocab_size=vocab_size, digit_level=digit_level, prefixed=prefixed)

    @classmethod
    def from_sentencepiece(
        cls,
        model_file: str | os.PathLike[str],
        *,
        vocab_size: int | None = None,
        digit_level: bool = True,
        prefixed: bool = False,
    ) -> NumberVocab:
        """Builds the table from a SentencePiece ``.model`` file (needs ``sentencepiece``); arguments as
        :meth:`from_id_to_token`."""
        from ._runtime import require

        sentencepiece = require("sentencepiece", "hf", "NumberVocab.from_sentencepiece")
        if not os.path.isfile(model_file):
            raise ValueError(f"NumberVocab.from_sentencepiece: no such file {os.fspath(model_file)!r}")
        processor = sentencepiece.SentencePieceProcessor(model_file=os.fspath(model_file))
        return cls.from_tokenizer(processor, vocab_size=vocab_size, digit_level=digit_level, prefixed=prefixed)

    def with_vocab_size(self, vocab_size: int) -> NumberVocab:
        """Returns a copy for a different (padded) model vocabulary size."""
        return NumberVocab(
            self._ids,
            self._values,
            vocab_size,
            tokens=self._tokens,
            decimal_point_id=self._decimal_point_id,
            digit_level=self._digit_level,
        )

    @property
    def ids(self) -> torch.Tensor:
        """Sorted number-token ids, LongTensor ``[N]``."""
        return self._ids

    @property
    def values(self) -> torch.Tensor:
        """Values of the number tokens, float32 ``[N]``, aligned with :attr:`ids`."""
        return self._values

    @property
    def vocab_size(self) -> int:
        """The model's (padded) vocabulary size: the logits' last dimension.

        The losses refuse logits of any other width (under tensor parallelism: shards of
        ``vocab_size / tp`` columns, or any contiguous slice with ``vocab_start``).
        """
        return self._vocab_size

    @property
    def tokens(self) -> tuple[str, ...] | None:
        """Token strings aligned with :attr:`ids`, when known."""
        return self._tokens

    @property
    def decimal_point_id(self) -> int | None:
        """Id of the ``"."`` token, when the vocabulary has one."""
        return self._decimal_point_id

    @property
    def digit_level(self) -> bool:
        """Whether the digit-level rule built this table."""
        return self._digit_level

    def __len__(self) -> int:
        return int(self._ids.numel())

    def __repr__(self) -> str:
        shown = self._tokens if self._tokens is not None else self._values.tolist()
        head = ", ".join(repr(t) for t in list(shown)[:12]) + (", ..." if len(self) > 12 else "")
        return f"NumberVocab({len(self)} number tokens of vocab_size={self._vocab_size}: {head})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NumberVocab):
            return NotImplemented
        return (
            self._vocab_size == other._vocab_size
            and torch.equal(self._ids, other._ids)
            and torch.equal(self._values, other._values)
            and self._decimal_point_id == other._decimal_point_id
        )

    __hash__ = None  # type: ignore[assignment]

    def index_of_id(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense map from vocabulary id to table position (``-1`` for non-number ids), LongTensor ``[V]``."""
        return self._cached("index_of_id", device, self._build_index_of_id)

    def number_mask(self, labels: torch.Tensor) -> torch.Tensor:
        """Bool mask, shaped like ``labels``, of the number-token labels (ids outside the vocabulary are not)."""
        inside = (labels >= 0) & (labels < self._vocab_size)
        index = self.index_of_id(labels.device)
        return inside & (index[torch.where(inside, labels, 0)] >= 0)

    def _build_index_of_id(self) -> torch.Tensor:
        index = torch.full((self._vocab_size,), -1, dtype=torch.long)
        index[self._ids] = torch.arange(len(self), dtype=torch.long)
        return index

    def distance_table(self, squash_factor: float | None = None) -> torch.Tensor:
        """Distances ``d(v_i, v_j)`` between number-token values, float32 ``[N, N]``, cached.

        ``|v_i - v_j|``, or with ``squash_factor`` (> 1) the nonzero distances mapped affinely onto
        ``[1, squash_factor]``; built in float32 as the reference ``ntloss`` builds it.
        """
        return self._cached(f"distance/{squash_factor}", None, lambda: self._build_distance_table(squash_factor))

    def distance_table_on(
        self, squash_factor: float | None, device: torch.device | str | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """:meth:`distance_table` in ``dtype`` on ``device``, copied once (no copy per training step)."""
        key = f"distance/{squash_factor}/{dtype}"
        return self._cached(key, device, lambda: self.distance_table(squash_factor).to(dtype))

    def _build_distance_table(self, squash_factor: float | None) -> torch.Tensor:
        diff = (self._values.unsqueeze(0) - self._values.unsqueeze(1)).abs()
        if squash_factor is None:
            return diff
        check_option("squash_factor", squash_factor)  # finite and > 1: inf would give 0 * inf = NaN entries
        nonzero = diff.masked_fill(diff == 0, torch.finfo(diff.dtype).max)
        smallest, largest = nonzero.min(), diff.max()
        # branch-free (torch.compile traces it): all distances equal, or none nonzero, keeps |v_i - v_j|
        plain = (largest <= 0) | (smallest == largest)
        scale = (squash_factor - 1) / torch.where(plain, 1, largest - smallest)
        table = torch.where(diff == 0, 0.0, 1 + (diff - smallest) * scale)
        return torch.where(plain, diff, table)

    def _cached(self, name: str, device: torch.device | str | None, build: Any) -> torch.Tensor:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        key = (name, dev)
        tensor = self._device_cache.get(key)
        if tensor is None:
            tensor = build().to(dev)
            if _keepable(tensor):
                self._device_cache[key] = tensor
        return tensor

    def shard(self, rank: int, world_size: int) -> VocabShard:
        """The number tokens in vocab shard ``[rank*V/tp, (rank+1)*V/tp)`` of a tensor-parallel split of
        ``world_size`` ranks (which must divide :attr:`vocab_size`)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"shard: world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"shard: rank must be an int in [0, {world_size}), got {rank!r}")
        if self._vocab_size % world_size:
            raise ValueError(
                f"shard: vocab_size={self._vocab_size} is not divisible by the tensor-parallel size "
                f"{world_size}; pad the model vocabulary, e.g. "
                f"vocab.with_vocab_size(ntl_scale.pad_vocab_size({self._vocab_size}, tp_size={world_size}))"
            )
        per_rank = self._vocab_size // world_size
        return self.shard_range(rank * per_rank, (rank + 1) * per_rank)

    def shard_range(self, start: int, end: int) -> VocabShard:
        """The number tokens in a vocab slice ``[start, end)`` (``end`` may exceed :attr:`vocab_size`: padding)."""
        if not 0 <= start < end:
            raise ValueError(f"shard_range: need 0 <= start < end, got [{start}, {end})")
        shard = self._shards.get((start, end))
        if shard is None:  # built once per range (the training path asks for the same range every step)
            # found on the host from the sorted ids: no data-dependent shape, no graph break
            first, last = _count_below(self._id_list, start), _count_below(self._id_list, end)
            shard = VocabShard(
                start=start,
                end=end,
                local_ids=self._ids[first:last] - start,
                table_index=torch.arange(first, last),
                values=self._values[first:last],
            )
            if _keepable(shard.local_ids, shard.table_index, shard.values):
                self._shards[(start, end)] = shard
        return shard

    def shard_tensor(self, start: int, end: int, name: str, device: torch.device | str | None) -> torch.Tensor:
        """``table_index``, ``local_ids`` or ``values`` of :meth:`shard_range` on ``device``, copied once."""
        return self._cached(f"shard/{start}/{end}/{name}", device, lambda: getattr(self.shard_range(start, end), name))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description of the table."""
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "vocab_size": self._vocab_size,
            "digit_level": self._digit_level,
            "decimal_point_id": self._decimal_point_id,
            "ids": self._ids.tolist(),
            "values": self._values.tolist(),
            "tokens": list(self._tokens) if self._tokens is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NumberVocab:
        """Inverse of :meth:`to_dict`."""
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a NumberVocab description: format={data.get('format')!r}, expected {_FORMAT!r}")
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(
                f"NumberVocab file version {data.get('version')!r} is not supported (expected {_FORMAT_VERSION}); "
                "rebuild it with NumberVocab.from_tokenizer(...).save(path)"
            )
        return cls(
            data["ids"],
            data["values"],
            int(data["vocab_size"]),
            tokens=data.get("tokens"),
            decimal_point_id=data.get("decimal_point_id"),
            digit_level=bool(data.get("digit_level", True)),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the table to a small JSON file (atomically: a crash never leaves half a file)."""
        write_json_atomically(self.to_dict(), path, ensure_ascii=False, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, vocab_size: int | None = None) -> NumberVocab:
        """Reads a table written by :meth:`save` (``vocab_size``: override the stored one)."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"NumberVocab.load: no such file {path!r}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"NumberVocab.load: {path!r} is not valid JSON ({e})") from None
        vocab = cls.from_dict(data)
        return vocab if vocab_size is None else vocab.with_vocab_size(vocab_size)


def check_number_level_table(vocab: NumberVocab) -> None:
    """Refuses a table number-level NTL (``loss="number"``) cannot read: it needs single ASCII digits 0-9, each once.

    Raises:
        ValueError: naming the offending entry and the fix.
    """
    cached = getattr(vocab, "_ntl_digit_table_ok", None)
    if cached is True:
        return
    problem = None
    tokens = vocab.tokens
    if len(vocab) > 10:
        problem = f"it has {len(vocab)} number tokens (a digit table has at most the ten digits 0-9)"
    else:
        values = vocab.values.tolist()
        for i, value in enumerate(values):
            token = None if tokens is None else tokens[i]
            shown = f"{token!r} (value {value:g})" if token is not None else f"value {value:g}"
            if value not in range(10):
                problem = f"its token {shown} is not a single digit 0-9"
            elif values.count(value) > 1:
                problem = f"the digit {value:g} appears {values.count(value)} times (e.g. {shown})"
            elif token is not None and not (len(token) == 1 and token in "0123456789"):
                problem = f"its token {shown} is not exactly one ASCII digit (a prefixed or multi-character token)"
            if problem:
                break
    if problem is not None:
        raise ValueError(
            f'loss="number" assembles numbers from single-digit tokens, but the number table cannot be read so: '
            f"{problem}. Build a digit table with NumberVocab.from_tokenizer(tokenizer, digit_level=True) "
            "(Megatron: --ntl-number-vocab digits; train config: ntl.digit_level=true), or use a token-level "
            'loss ("was", "mse", "mae", "huber") with this table'
        )
    object.__setattr__(vocab, "_ntl_digit_table_ok", True)  # the table is immutable: check it once


def add_digit_tokens(tokenizer: Any) -> list[str]:
    """Adds the ASCII digits ``"0"``..``"9"`` a Hugging Face tokenizer lacks; returns those added.

    The only function of ntl_scale that modifies a tokenizer: resize the model's embeddings afterwards.
    """
    if not hasattr(tokenizer, "add_tokens") or not hasattr(tokenizer, "get_vocab"):
        raise TypeError(
            f"add_digit_tokens needs a Hugging Face tokenizer (add_tokens, get_vocab), got {type(tokenizer).__name__}"
        )
    present = set(tokenizer.get_vocab())
    missing = [d for d in _DIGITS if d not in present]
    if missing:
        tokenizer.add_tokens(missing)
    return missing
