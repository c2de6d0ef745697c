"""One NTL option spec (``ntl_scale/options.py``), checked on every front end.

Each front end is introspected, not the spec's own tables:

1. The spec: every option documented, the run-level variant fields with the same defaults as
   ``NTLOptions``, the choices of ``loss``/``normalization``/``impl`` the ones the library accepts.
2. YAML (``launch/train.py``): the fields and defaults of the ``NTLConfig`` dataclass (and of
   ``TrainConfig`` for the chunked route); ``ntl.huber_delta``, ``ntl.float_level``, ``ntl.impl``
   reach the loss options.
3. Megatron (both routes): the actions of the parser ``add_ntl_args`` builds (flags, defaults,
   choices); ``NTLSettings.from_args`` carries every option into ``NTLOptions``.
4. Hugging Face: ``apply_ntl_to_hf_model``'s signature and the defaults of ``NTLOptions()`` its ``options``
   means; torchtitan: ``NTLLoss.Config``'s fields.
5. Config files: every ``ntl.*`` key of the study presets and train configs, and every ``ntl-*`` key of
   the Megatron configs, is an option of its front end; every train config and preset arm loads.

A test fails when an option is missing from a front end, when a front end has a key the spec does not
know, or when a default differs from the one the spec declares for that front end.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import inspect
import os
import textwrap

import pytest
import yaml

import ntl_scale
from ntl_scale.options import (
    IMPLS,
    LOSS_KINDS,
    NORMALIZATIONS,
    NTLOptions,
    NTLRunOptions,
    option_fields,
    surface_default,
    surface_name,
    surface_reason,
)
from ntl_scale.training.config import NTLConfig, TrainConfig, load_config
from tests.helpers.study_presets import run_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = [option.name for option in option_fields()]

# ------------------------------------------------------------------------------------ 1. the spec


def test_every_option_is_documented_and_typed():
    assert len(set(NAMES)) == len(NAMES)
    for option in option_fields():
        assert len(option.doc) > 20, option.name
        assert option.type and option.level in ("variant", "run", "route"), option
    assert {"loss", "squash_factor", "reweigh", "huber_delta", "float_level", "impl", "weight", "digit_level",
            "normalization", "chunked", "chunk_tokens", "z_loss_weight", "label_smoothing",
            "logit_softcap", "ce_kernel"} == set(NAMES)  # fmt: skip


def test_run_options_repeat_the_variant_with_its_defaults():
    """``NTLRunOptions`` (the YAML section) holds the variant fields of ``NTLOptions``: same defaults."""
    variant = {f.name: f.default for f in dataclasses.fields(NTLOptions) if f.name != "ignore_index"}
    run = {f.name: f.default for f in dataclasses.fields(NTLRunOptions)}
    assert {name: run.get(name, "missing") for name in variant} == variant
    assert NTLRunOptions().options() == NTLOptions()


def _settings_classes() -> dict[str, type]:
    from ntl_scale.integrations.megatron import NTLSettings

    surfaces = {"yaml": NTLRunOptions, "megatron": NTLSettings}
    try:
        from ntl_scale.integrations.torchtitan.loss import NTLLoss
    except ImportError:
        return surfaces
    return {**surfaces, "torchtitan": NTLLoss.Config}


def test_no_surface_declares_a_variant_field_itself():
    """The variant fields are written once, in NTLOptions: no surface's class body declares one (so a new
    variant option cannot be forgotten on one of them), yet each has all of them, with NTLOptions's defaults."""
    variant = {f.name: f.default for f in dataclasses.fields(NTLOptions) if f.name != "ignore_index"}
    for surface, cls in _settings_classes().items():
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        declared = {node.target.id for node in body.body if isinstance(node, ast.AnnAssign)}  # type: ignore[attr-defined]
        assert not declared & set(variant), (surface, declared & set(variant))
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert {name: defaults[name] for name in variant} == variant, surface


def test_loss_number_with_a_multi_digit_table_is_one_refusal_on_every_surface():
    from ntl_scale.integrations.megatron import NTLSettings

    surfaces = _settings_classes()
    cases = {"yaml": lambda: NTLRunOptions(loss="number", digit_level=False),
             "megatron": lambda: NTLSettings(weight=0.3, loss="number", number_vocab="multi-digit")}  # fmt: skip
    if "torchtitan" in surfaces:
        cases["torchtitan"] = lambda: surfaces["torchtitan"](loss="number", digit_level=False)
    messages = {}
    for surface, build in cases.items():
        with pytest.raises(ValueError, match="assembles numbers from single-digit tokens") as error:
            build()
        loss, table = surface_name("loss", surface), surface_name("digit_level", surface)
        messages[surface] = str(error.value).replace(str(loss), "LOSS").replace(str(table), "TABLE")
        assert "LOSS" in messages[surface] and "TABLE" in messages[surface], messages[surface]
    # one message, spelled per surface (flags take a space and "digits", keys "=" and "true")
    normalized = {m.replace(" number", "=number").replace("TABLE digits", "TABLE=true") for m in messages.values()}
    assert len(normalized) == 1, messages


def test_choices_are_what_the_library_accepts():
    by_name = {option.name: option for option in option_fields()}
    assert by_name["loss"].choices == LOSS_KINDS == ntl_scale.LOSS_KINDS
    assert by_name["impl"].choices == IMPLS
    assert by_name["normalization"].choices == NORMALIZATIONS
    for kind in LOSS_KINDS:
        NTLOptions(loss=kind)
    for impl in IMPLS:
        NTLOptions(impl=impl)
    with pytest.raises(ValueError, match=r"unknown impl 'cuda'; expected one of 'auto', 'torch', 'triton'"):
        NTLOptions(impl="cuda")


# ------------------------------------------------------------------------------------ 2. YAML


def _yaml_fields() -> dict[str, object]:
    fields = {f"ntl.{f.name}": f.default for f in dataclasses.fields(NTLConfig)}
    fields.update({f"train.{f.name}": f.default for f in dataclasses.fields(TrainConfig)})
    return fields


@pytest.mark.parametrize("name", NAMES)
def test_yaml_has_every_option_with_its_default(name):
    key = surface_name(name, "yaml")
    fields = _yaml_fields()
    assert key in fields, f"{name} is not a run-config key ({key}): {surface_reason(name, 'yaml')}"
    assert fields[key] == surface_default(name, "yaml"), key


def test_yaml_ntl_section_has_no_key_outside_the_spec():
    spelled = {surface_name(name, "yaml") for name in NAMES}
    assert {f"ntl.{f.name}" for f in dataclasses.fields(NTLConfig)} <= spelled


def test_new_yaml_keys_reach_the_loss_options():
    """Issue 30: ``ntl.huber_delta=2.0`` and ``ntl.float_level=true`` were refused as unknown keys."""
    from ntl_scale.integrations.deepspeed.steps import ntl_options

    cfg = load_config(None, ["ntl.loss=huber", "ntl.huber_delta=2.0", "ntl.impl=torch"])
    assert ntl_options(cfg.ntl) == NTLOptions(loss="huber", huber_delta=2.0, impl="torch")
    cfg = load_config(None, ["ntl.loss=number", "ntl.float_level=true"])
    assert ntl_options(cfg.ntl) == NTLOptions(loss="number", float_level=True)
    with pytest.raises(ValueError, match=r"unknown impl 'gpu'"):
        load_config(None, ["ntl.impl=gpu"])
    with pytest.raises(ValueError, match=r"float_level applies to loss='number' only"):
        load_config(None, ["ntl.float_level=true"])


# ------------------------------------------------------------------------------------ 3. Megatron


def _megatron_actions() -> dict[str, argparse.Action]:
    from ntl_scale.integrations.megatron import add_ntl_args

    parser = add_ntl_args(argparse.ArgumentParser())
    return {flag: action for action in parser._actions for flag in action.option_strings if flag.startswith("--ntl")}


@pytest.mark.parametrize("name", NAMES)
def test_megatron_has_every_option_with_its_default(name):
    flag = surface_name(name, "megatron")
    actions = _megatron_actions()
    assert flag in actions, f"{name}: no {flag} flag"
    assert actions[flag].default == surface_default(name, "megatron"), flag
    option = next(o for o in option_fields() if o.name == name)
    if option.choices is not None:
        assert tuple(actions[flag].choices) == option.choices, flag


def test_megatron_has_no_flag_outside_the_spec():
    assert set(_megatron_actions()) == {surface_name(name, "megatron") for name in NAMES}


def test_megatron_settings_carry_every_option():
    from ntl_scale.integrations.megatron import NTLSettings, add_ntl_args

    parser = add_ntl_args(argparse.ArgumentParser())
    # The defaults docs/megatron.md documents for the flags, written out here (not read from the spec or the
    # parser): adding the flags changes nothing until --ntl-weight is given.
    documented = {
        "weight": 0.0, "number_vocab": "digits", "normalization": "micro-batch", "chunked": False,
        "chunk_tokens": None, "loss": "was", "squash_factor": None, "reweigh": False, "huber_delta": 1.0,
        "float_level": False, "impl": "auto", "z_loss_weight": 0.0, "label_smoothing": 0.0, "logit_softcap": None,
            "ce_kernel": "ntl_scale",
    }  # fmt: skip
    assert dataclasses.asdict(NTLSettings.from_args(parser.parse_args([]))) == documented
    assert dataclasses.asdict(NTLSettings()) == documented
    assert not NTLSettings.from_args(parser.parse_args([])).enabled
    args = ["--ntl-weight", "0.3", "--ntl-loss", "number", "--ntl-float-level", "--ntl-impl", "torch",
            "--ntl-normalization", "global", "--ntl-chunked", "--ntl-chunk-tokens", "64"]  # fmt: skip
    settings = NTLSettings.from_args(parser.parse_args(args))
    assert settings.options() == NTLOptions(loss="number", float_level=True, impl="torch")
    assert (settings.weight, settings.normalization) == (0.3, "global")
    assert (settings.chunked, settings.chunk_tokens) == (True, 64)
    settings = NTLSettings.from_args(parser.parse_args(["--ntl-loss", "huber", "--ntl-huber-delta", "2.5"]))
    assert settings.options() == NTLOptions(loss="huber", huber_delta=2.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ntl-impl", "cuda"])


# ------------------------------------------------------------------------------------ 4. Hugging Face


@pytest.mark.parametrize("name", NAMES)
def test_apply_ntl_takes_every_option_with_its_default(name):
    from ntl_scale.integrations.hf import apply_ntl_to_hf_model as apply_ntl

    spelled = surface_name(name, "hf")
    if spelled is None:
        assert surface_reason(name, "hf"), f"{name}: not an apply_ntl argument, and the spec gives no reason"
        return
    parameters = inspect.signature(apply_ntl).parameters
    if spelled.startswith("options."):
        assert parameters["options"].default is None  # None means NTLOptions()
        default = getattr(NTLOptions(), spelled.split(".", 1)[1])
    else:
        assert spelled in parameters, f"apply_ntl has no {spelled} argument"
        default = parameters[spelled].default
    assert default == surface_default(name, "hf"), name


@pytest.mark.parametrize("name", NAMES)
def test_torchtitan_config_has_every_option_with_its_default(name):
    pytest.importorskip("torchtitan")
    from ntl_scale.integrations.torchtitan import NTLLoss

    spelled = surface_name(name, "torchtitan")
    fields = {f.name: f for f in dataclasses.fields(NTLLoss.Config)}
    if spelled is None:
        assert surface_reason(name, "torchtitan") and name not in fields, name
        return
    assert spelled.startswith("loss.") and spelled[5:] in fields, f"NTLLoss.Config has no field for {spelled}"
    assert fields[spelled[5:]].default == surface_default(name, "torchtitan"), name


# ------------------------------------------------------------------------------------ 5. config files


def _preset_overrides() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "study", "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            preset = yaml.safe_load(f)
        for arm, overrides in preset.get("arms", {}).items():
            run, _ = run_overrides(preset, [*preset.get("overrides", []), *overrides])
            found.append((f"{os.path.basename(path)}:{arm}", run))
    return found


def test_study_presets_and_train_configs_use_spec_keys():
    known = {f"ntl.{f.name}" for f in dataclasses.fields(NTLConfig)}
    used = set()
    for _, overrides in _preset_overrides():
        used |= {item.split("=", 1)[0] for item in overrides if item.startswith("ntl.")}
    for path in glob.glob(os.path.join(ROOT, "configs", "train", "*.yaml")):
        with open(path, encoding="utf-8") as f:
            used |= {f"ntl.{key}" for key in (yaml.safe_load(f).get("ntl") or {})}
    assert used and used <= known, used - known


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "train", "*.yaml"))))
def test_every_train_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg.ntl, NTLConfig)


def test_every_study_arm_loads():
    for where, overrides in _preset_overrides():
        preset = os.path.join(ROOT, "configs", "study", where.split(":")[0])
        with open(preset, encoding="utf-8") as f:
            base = os.path.join(ROOT, yaml.safe_load(f)["base_config"])
        load_config(base, overrides)  # raises on an unknown or invalid key


def test_megatron_configs_use_spec_flags():
    flags = {surface_name(name, "megatron") for name in NAMES}
    used = set()
    for path in glob.glob(os.path.join(ROOT, "configs", "megatron", "*.yaml")):
        with open(path, encoding="utf-8") as f:
            used |= {f"--{key}" for key in (yaml.safe_load(f).get("megatron_args") or {}) if key.startswith("ntl-")}
    assert used and used <= flags, used - flags


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -0.3, True])
def test_every_front_end_refuses_the_same_bad_weights(weight):
    """One weight check for every front end: the functional API, the YAML section, Megatron's flags and
    the Hugging Face loss refuse NaN, inf, negative and bool weights alike, each naming its spelling."""
    from ntl_scale.integrations.hf.loss import NTLCausalLMLoss
    from ntl_scale.integrations.megatron import NTLSettings

    vocab = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in range(10)}, vocab_size=12)
    import torch

    logits, labels = torch.zeros(2, 12), torch.tensor([3, 11])
    attempts = {
        "ntl_weight": lambda: ntl_scale.ce_with_ntl(logits, labels, vocab, ntl_weight=weight),
        "ntl.weight": lambda: NTLConfig(weight=weight),
        "--ntl-weight": lambda: NTLSettings(weight=weight),
        "ntl_weight ": lambda: NTLCausalLMLoss(vocab, weight),
    }
    for name, attempt in attempts.items():
        with pytest.raises(ValueError, match=f"{name.strip()} must be a finite number >= 0"):
            attempt()


def test_an_ignored_huber_delta_is_refused():
    with pytest.raises(ValueError, match=r"huber_delta=2\.0 applies to loss='huber' only"):
        load_config(None, ["ntl.huber_delta=2.0", "ntl.loss=was"])
    assert load_config(None, ["ntl.huber_delta=2.0", "ntl.loss=huber"]).ntl.huber_delta == 2.0


# ------------------------------------------------------------------------------------ 6. non-finite values


# Issue 40, item 4: squash_factor=inf was accepted (the check was `> 1`) and gave a NaN loss (0 * inf in the
# distance table). Every numeric option is checked once, in ntl_scale.options.check_option; each front end
# passes its spelling. A non-default but valid value of each option, and the variant it needs.
NUMERIC = {
    "weight": {},
    "squash_factor": {"loss": "was"},
    "huber_delta": {"loss": "huber"},
    "chunk_tokens": {},
    "z_loss_weight": {},
    "label_smoothing": {},
    "logit_softcap": {},
}
BAD = [float("inf"), float("-inf"), float("nan")]


def test_numeric_checks_cover_every_numeric_option():
    from ntl_scale.options import NUMERIC_CHECKS

    numeric = {o.name for o in option_fields() if o.type.split(" |")[0] in ("float", "int")}
    assert numeric == set(NUMERIC) == set(NUMERIC_CHECKS)


def _hf_model(vocab_size: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _surfaces(name: str, value: float) -> dict[str, object]:
    """How each front end is handed ``name=value``: a callable per front end, keyed by the spelling its
    error must name."""
    import torch

    from ntl_scale.integrations.megatron import NTLSettings, add_ntl_args

    variant = NUMERIC[name]
    vocab = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in range(10)}, vocab_size=12)
    logits, labels = torch.zeros(1, 2, 12), torch.tensor([[3, 11]])
    hidden, weight = torch.zeros(1, 2, 4), torch.zeros(12, 4)
    kwarg = {"weight": "ntl_weight"}.get(name, name)
    surfaces: dict[str, object] = {}
    # the Python API
    if name == "chunk_tokens":
        surfaces["chunk_tokens"] = lambda: ntl_scale.linear_ce_with_ntl(
            hidden, weight, labels, vocab, chunk_tokens=value
        )
        surfaces["chunk_tokens "] = lambda: ntl_scale.vocab_parallel_ce_ntl(logits, labels, vocab, chunk_tokens=value)
    else:
        surfaces[kwarg] = lambda: ntl_scale.ce_with_ntl(logits, labels, vocab, **variant, **{kwarg: value})
        surfaces[kwarg + " "] = lambda: ntl_scale.linear_ce_with_ntl(
            hidden, weight, labels, vocab, **variant, **{kwarg: value}
        )
    if name in ("squash_factor", "huber_delta", "z_loss_weight", "label_smoothing", "logit_softcap"):
        surfaces[name + "  "] = lambda: ntl_scale.NTLOptions(**variant, **{name: value})
    # YAML (launch/train.py): the override text is a YAML scalar, .inf / .nan
    text = {float("inf"): ".inf", float("-inf"): "-.inf"}.get(value, ".nan")
    yaml_key = surface_name(name, "yaml")
    yaml_variant = [f"ntl.{k}={v}" for k, v in variant.items()]
    surfaces[yaml_key] = lambda: load_config(None, [*yaml_variant, f"{yaml_key}={text}"])
    # Megatron: the flag (argparse) and NTLSettings
    flag = surface_name(name, "megatron")
    argv = ["--ntl-weight", "0.3", *[f"--ntl-{k}={v}" for k, v in variant.items()], f"{flag}={value}"]
    parser = add_ntl_args(argparse.ArgumentParser(exit_on_error=False))
    surfaces[flag] = lambda: parser.parse_args(argv)
    settings = {"weight": 0.3, **variant, name: value}
    surfaces[flag + " "] = lambda: NTLSettings(**settings)
    # Hugging Face: apply_ntl's keyword arguments (the variant in options=)
    hf_kwargs = {"ntl_weight": value} if name == "weight" else {}
    if name == "chunk_tokens":
        hf_kwargs = {"chunked": True, "chunk_tokens": value}
    elif name != "weight":
        hf_kwargs = {"options": None}  # built in the attempt: NTLOptions refuses the value itself

    def hf() -> None:
        from ntl_scale.integrations.hf import apply_ntl_to_hf_model as apply_ntl

        kwargs = dict(hf_kwargs)
        if "options" in kwargs:
            kwargs["options"] = ntl_scale.NTLOptions(**variant, **{name: value})
        apply_ntl(_hf_model(12), vocab, **kwargs)

    surfaces[{"weight": "ntl_weight", "chunk_tokens": "chunk_tokens"}.get(name, name) + "   "] = hf
    # torchtitan's NTLLoss.Config
    try:
        from ntl_scale.integrations.torchtitan.loss import NTLLoss
    except ImportError:
        if os.environ.get("CI"):
            raise
    else:
        surfaces[f"loss.{name}"] = lambda: NTLLoss.Config(**variant, **{name: value})
    return surfaces


@pytest.mark.parametrize("value", BAD, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", list(NUMERIC))
def test_every_numeric_option_refuses_non_finite_values_on_every_front_end(name, value):
    refused = []
    for spelling, attempt in _surfaces(name, value).items():
        with pytest.raises((ValueError, argparse.ArgumentError)) as info:
            attempt()  # type: ignore[operator]
        message = str(info.value)
        assert spelling.strip() in message, (spelling, message)
        assert ("nan" if value != value else "inf") in message, (spelling, message)  # the value, named
        refused.append(spelling.strip())
    assert len(refused) >= 6, refused


def test_valid_values_of_every_numeric_option_still_pass_every_front_end():
    """The checks refuse only bad values: a valid non-default value of each is taken as it is."""
    from ntl_scale.integrations.megatron import NTLSettings, add_ntl_args

    valid = {
        "weight": 0.5, "squash_factor": 3.0, "huber_delta": 2.0, "chunk_tokens": 7, "z_loss_weight": 1e-4,
        "label_smoothing": 0.1, "logit_softcap": 30.0,
    }  # fmt: skip
    for name, value in valid.items():
        variant = NUMERIC[name]
        route = name == "chunk_tokens"  # chunk_tokens applies to the chunked route only
        settings = {"weight": 0.3, **variant, name: value, **({"chunked": True} if route else {})}
        assert getattr(NTLSettings(**settings), name) == value
        flag = surface_name(name, "megatron")
        argv = ["--ntl-weight=0.3", *[f"--ntl-{k}={v}" for k, v in variant.items()], f"{flag}={value}"]
        args = add_ntl_args(argparse.ArgumentParser()).parse_args(argv + (["--ntl-chunked"] if route else []))
        assert getattr(NTLSettings.from_args(args), name) == value
        yaml_key = surface_name(name, "yaml")
        overrides = [*[f"ntl.{k}={v}" for k, v in variant.items()], f"{yaml_key}={value}"]
        cfg = load_config(None, overrides + (["train.chunked_loss=true"] if route else []))
        section, key = yaml_key.split(".")
        assert getattr(getattr(cfg, section), key) == value


def test_chunk_tokens_without_the_chunked_route_is_refused_on_every_front_end():
    """chunk_tokens was read by the chunked route only and ignored without it (YAML, Megatron, apply_ntl)."""
    from ntl_scale.integrations.hf import apply_ntl_to_hf_model as apply_ntl
    from ntl_scale.integrations.megatron import NTLSettings

    vocab = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in range(10)}, vocab_size=12)
    attempts = {
        "train.loss_chunk_tokens": lambda: load_config(None, ["train.loss_chunk_tokens=64"]),
        "--ntl-chunk-tokens": lambda: NTLSettings(weight=0.3, chunk_tokens=64),
        "chunk_tokens": lambda: apply_ntl(_hf_model(12), vocab, chunk_tokens=64),
    }
    for spelling, attempt in attempts.items():
        with pytest.raises(ValueError, match=rf"{spelling}=64 applies to the chunked route only"):
            attempt()


def test_number_vocab_means_the_same_on_megatron_and_torchtitan(tmp_path):
    """``number_vocab`` is a rule (``digits``, ``multi-digit``) or a saved table's path on both surfaces
    (:func:`ntl_scale.options.table_source`): the same value gives the same table, which holds the tokens
    written out here as numbers (the digits alone, or every number token)."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("torchtitan")
    from ntl_scale.integrations.megatron import NTLSettings, build_number_vocab
    from ntl_scale.integrations.torchtitan.loss import NTLLoss, number_table

    words = ["a", "b", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "12", "345", "x7"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a")
    tokenizers.Tokenizer(model).save(str(tmp_path / "tokenizer.json"))

    class InvVocab:  # Megatron's tokenizers expose id -> token as inv_vocab
        def __init__(self) -> None:
            self.inv_vocab = dict(enumerate(words))

    expected = {"digits": {words.index(str(d)): d for d in range(10)}}
    expected["multi-digit"] = {**expected["digits"], words.index("12"): 12, words.index("345"): 345}
    for rule, want in expected.items():
        squash = None if rule == "digits" else 16.0  # 0-345 unsquashed is refused (docs/number_vocab.md, recipes)
        megatron = build_number_vocab(
            NTLSettings(weight=0.3, number_vocab=rule, squash_factor=squash), InvVocab(), len(words)
        )
        titan = number_table(NTLLoss.Config(number_vocab=rule, tokenizer_path=str(tmp_path), vocab_size=len(words)))
        for table in (megatron, titan):
            assert dict(zip(table.ids.tolist(), table.values.tolist())) == want, rule
    saved = tmp_path / "table.json"
    number_table(NTLLoss.Config(number_vocab="multi-digit", tokenizer_path=str(tmp_path))).save(str(saved))
    megatron = build_number_vocab(
        NTLSettings(weight=0.3, number_vocab=str(saved), squash_factor=16.0), InvVocab(), len(words)
    )
    titan = number_table(NTLLoss.Config(number_vocab=str(saved), vocab_size=len(words)))
    assert megatron == titan and dict(zip(titan.ids.tolist(), titan.values.tolist())) == expected["multi-digit"]
    for build in (lambda: NTLSettings(weight=0.3, loss="number", number_vocab="multi-digit"),
                  lambda: NTLLoss.Config(loss="number", number_vocab="multi-digit")):  # fmt: skip
        with pytest.raises(ValueError, match="single-digit tokens"):
            build()
    with pytest.raises(ValueError, match=r"loss\.number_vocab='digits' contradicts digit_level=False"):
        NTLLoss.Config(number_vocab="digits", digit_level=False)
