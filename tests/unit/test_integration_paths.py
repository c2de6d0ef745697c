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
    "ntl_scale.integrations.deepspeed.trainer",
    "ntl_scale.integrations.deepspeed.engine",
    "ntl_scale.integrations.deepspeed.checkpointer",
    "ntl_scale.integrations.deepspeed.resume_layout",
    "ntl_scale.integrations.deepspeed.resolved",
    "ntl_scale.integrations.deepspeed.steps",
    "ntl_scale.integrations.deepspeed.heldout",
    "ntl_scale.startup",
]

# issue 41 item 5: the DeepSpeed trainer's modules moved from ntl_scale.training, look-alikes renamed
MOVED_MODULES = {
    "ntl_scale.training.trainer": "ntl_scale.integrations.deepspeed.trainer",
    "ntl_scale.training.engine": "ntl_scale.integrations.deepspeed.engine",
    "ntl_scale.training.checkpoint": "ntl_scale.integrations.deepspeed.checkpointer",
    "ntl_scale.training.resume": "ntl_scale.integrations.deepspeed.resume_layout",
    "ntl_scale.training.resolved": "ntl_scale.integrations.deepspeed.resolved",
    "ntl_scale.training.steps": "ntl_scale.integrations.deepspeed.steps",
    "ntl_scale.training.evaluator": "ntl_scale.integrations.deepspeed.heldout",
    "ntl_scale.training.evaluate": "ntl_scale.training.scoring",
    "ntl_scale.training.data": "ntl_scale.training.sources",
    "ntl_scale.training.inputs": "ntl_scale.training.model_inputs",
}
# what each old module's callers imported from it (the repository's imports before the move)
MOVED_NAMES = {
    "ntl_scale.training.trainer": ["Trainer", "check_inputs"],
    "ntl_scale.training.engine": ["Engine", "check_inputs"],
    "ntl_scale.training.checkpoint": ["Checkpointer"],
    "ntl_scale.training.resume": ["Layout", "load_rng", "plan_resume", "read_layout", "save_rng", "to_universal"],
    "ntl_scale.training.resolved": ["RESOLVED_FILE", "Resolved", "accelerator_has_bf16", "resolve_run"],
    "ntl_scale.training.steps": ["global_counts", "loss_from_terms", "ntl_options", "shift_for_causal"],
    "ntl_scale.training.evaluator": ["Evaluator", "heldout_micro_batches", "heldout_qa_batches"],
    "ntl_scale.training.evaluate": ["HELDOUT_COLUMNS", "evaluate_generation", "heldout_metrics", "sequence_stats"],
    "ntl_scale.training.data": ["Batches", "PACKED_SOURCES", "eval_sets", "heldout_batches", "train_dataset"],
    "ntl_scale.training.inputs": ["Inputs", "load_data", "to_device", "tokenizer_and_table"],
}


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


def test_training_modules_left_import_without_deepspeed():
    """What stayed in ntl_scale.training is framework-free: no module of it imports DeepSpeed."""
    code = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['deepspeed'] = None\n"
        "import ntl_scale.training as t\n"
        "names = sorted(m.name for m in pkgutil.iter_modules(t.__path__))\n"
        "for name in names:\n"
        "    importlib.import_module('ntl_scale.training.' + name)\n"
        "print(' '.join(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    left = set(out.stdout.split())
    assert not left & {old.rsplit(".", 1)[1] for old in MOVED_MODULES}, left  # no file at an old path
    for path in (ROOT / "ntl_scale" / "training").glob("*.py"):
        text = path.read_text()
        assert "import deepspeed" not in text and "from deepspeed" not in text, path


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


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_moved_training_module_is_the_new_module_and_warns(old):
    new = importlib.import_module(MOVED_MODULES[old])
    sys.modules.pop(old, None)  # imported afresh, so its warning fires here
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated; import {MOVED_MODULES[old]}"):
        module = importlib.import_module(old)
    assert module is new  # one module object: a monkeypatch through either name is seen by both
    assert module.__spec__.name == MOVED_MODULES[old]  # its own spec, not the alias's
    missing = [name for name in MOVED_NAMES[old] if not hasattr(module, name)]
    assert not missing, f"{old} lost {missing}"


def test_resolve_deepspeed_config_moved_beside_what_the_run_resolves():
    from ntl_scale.integrations.deepspeed import resolved, steps

    with pytest.warns(DeprecationWarning, match="steps.resolve_deepspeed_config is moved to"):
        old = steps.resolve_deepspeed_config
    assert old is resolved.resolve_deepspeed_config
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        steps.no_such_name  # noqa: B018
