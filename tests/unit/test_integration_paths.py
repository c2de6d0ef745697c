"""Where the framework adapters live (issue 30, item 3): one package per framework, one module per route.

Sections:
1. Every module of ``ntl_scale.integrations`` imports with only torch (the frameworks are blocked).
2. The old import paths keep working for one release: ``ntl_scale.integrations.hf`` and ``.megatron``
   export every name they exported as flat modules; ``hf_loss``, ``hf_chunked``, ``megatron_lm`` and
   ``deepspeed_tp`` are aliases of the same objects (renamed functions included) and warn.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODULES = [
    "ntl_scale.integrations",
    "ntl_scale.integrations.hf",
    "ntl_scale.integrations.hf.loss",
    "ntl_scale.integrations.hf.chunked",
    "ntl_scale.integrations.hf.trainer",
    "ntl_scale.integrations.hf.vocab",
    "ntl_scale.integrations.megatron",
    "ntl_scale.integrations.megatron.args",
    "ntl_scale.integrations.megatron.core",
    "ntl_scale.integrations.megatron.lm",
    "ntl_scale.integrations.megatron.terms",
    "ntl_scale.integrations.deepspeed",
    "ntl_scale.integrations.deepspeed.autotp",
]


# -- 1. only torch to import --------------------------------------------------------------------------
def test_every_integration_module_imports_without_its_framework():
    blocked = ["transformers", "trl", "deepspeed", "megatron", "accelerate"]
    code = (
        "import importlib, sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # any import of it now fails\n"
        f"for module in {MODULES!r}:\n"
        "    importlib.import_module(module)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- 2. the old paths ---------------------------------------------------------------------------------
# What the flat modules exported before the split (their __all__ and the names the repo imported).
OLD_HF = [
    "ChunkedLossCausalLM",
    "causal_lm_ce_with_ntl",
    "count_step_numbers",
    "ntl_trainer_class",
    "number_vocab_from_pretrained",
    "shift_labels",
]
OLD_MEGATRON = [
    "NORMALIZATIONS",
    "VOCAB_RULES",
    "GlobalCounts",
    "NTLLanguageModelMixin",
    "NTLSettings",
    "add_ntl_args",
    "build_number_vocab",
    "count_targets",
    "make_forward_step",
    "make_loss_func",
    "output_layer_terms",
    "plain_loss_func",
    "sequence_first_terms",
]
# old module -> {old name: (new module, new name)}
ALIASES = {
    "hf_loss": {
        name: ("hf.loss", name)
        for name in ["NTLCausalLMLoss", "apply_ntl", "installed_loss", "is_chunked", "remove_ntl"]
    },
    "hf_chunked": {
        "check_head": ("hf.chunked", "check_head"),
        "chunked_forward": ("hf.chunked", "chunked_forward"),
        "hidden_state_terms": ("hf.chunked", "hidden_state_terms"),
        "linear_head": ("hf.chunked", "linear_head"),
        "logit_multiplier": ("hf.chunked", "logit_multiplier"),
        "install_chunked_head": ("hf.chunked", "install_linear_loss_head"),
        "remove_chunked_head": ("hf.chunked", "remove_linear_loss_head"),
    },
    "megatron_lm": {
        name: ("megatron.lm", name)
        for name in [
            "GPTModelNTL",
            "MicroBatchScale",
            "NTLForwardStep",
            "NTLStats",
            "StepGroups",
            "apply_ntl",
            "find_language_model",
            "remove_ntl",
        ]
    },
    "deepspeed_tp": {
        "HeadShard": ("deepspeed.autotp", "HeadShard"),
        "head_shard": ("deepspeed.autotp", "head_shard"),
        "full_logits": ("deepspeed.autotp", "full_logits"),
        "gathered_weights": ("deepspeed.autotp", "gathered_weights"),
        "install_chunked_head": ("deepspeed.autotp", "install_vocab_parallel_loss_head"),
    },
}


@pytest.mark.parametrize(("package", "names"), [("hf", OLD_HF), ("megatron", OLD_MEGATRON)])
def test_package_keeps_the_flat_modules_names(package, names):
    module = importlib.import_module(f"ntl_scale.integrations.{package}")
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"ntl_scale.integrations.{package} lost {missing}"


@pytest.mark.parametrize("old", list(ALIASES))
def test_deprecated_module_is_an_alias_that_warns(old):
    path = f"ntl_scale.integrations.{old}"
    sys.modules.pop(path, None)  # imported afresh, so its warning fires here
    with pytest.warns(DeprecationWarning, match=rf"{path} is deprecated"):
        module = importlib.import_module(path)
    for name, (new, new_name) in ALIASES[old].items():
        target = importlib.import_module(f"ntl_scale.integrations.{new}")
        assert getattr(module, name) is getattr(target, new_name), f"{path}.{name}"
    assert sorted(module.__all__) == sorted(ALIASES[old])
