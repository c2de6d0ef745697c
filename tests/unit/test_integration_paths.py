"""Where the framework adapters live (issue 30, item 3): one package per framework, one module per route.

Sections:
1. Every module of ``ntl_scale.integrations`` imports with only torch (the frameworks are blocked).
2. No compatibility layer before 1.0: the old module paths and names of 0.2.x are gone (an import or an
   attribute look-up fails), the package faces export every route's names.
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
]

# the DeepSpeed trainer's modules that moved out of ntl_scale.training in 0.2.x (old -> new)
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


# -- 2. the old paths are gone ----------------------------------------------------------------------
# What each package face exports (the names of its route modules).
HF_NAMES = [
    "ChunkedLossCausalLM",
    "causal_lm_ce_with_ntl",
    "count_step_numbers",
    "ntl_trainer_class",
    "number_vocab_from_pretrained",
    "shift_labels",
]
MEGATRON_NAMES = [
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
REMOVED_MODULES = [
    "ntl_scale._deprecation",
    "ntl_scale.integrations.hf_loss",
    "ntl_scale.integrations.hf_chunked",
    "ntl_scale.integrations.megatron_lm",
    "ntl_scale.integrations.deepspeed_tp",
    *MOVED_MODULES,
    # the op layer moved under ntl_scale.ops; the on-chip op to lab/on_chip (outside the package)
    "ntl_scale.parallel",
    "ntl_scale.linear_op",
    "ntl_scale.shards",
    "ntl_scale.shard_math",
    "ntl_scale.kernels",
    "ntl_scale.kernels.triton_ce_ntl",
    "ntl_scale.linear_on_chip",
]
# module -> names removed from it (renamed: apply_ntl_to_hf_model, apply_ntl_to_megatron_model, impl="triton";
# moved: resolved.resolve_deepspeed_config)
REMOVED_NAMES = {
    "ntl_scale.integrations.hf": ["apply_ntl"],
    "ntl_scale.integrations.hf.loss": ["apply_ntl"],
    "ntl_scale.integrations.megatron.lm": ["apply_ntl"],
    "ntl_scale.integrations.deepspeed.steps": ["resolve_deepspeed_config"],
    "ntl_scale.ops.triton_ce_ntl": ["set_triton_kernels", "_ENABLED"],
}


@pytest.mark.parametrize(("package", "names"), [("hf", HF_NAMES), ("megatron", MEGATRON_NAMES)])
def test_package_exports_its_modules_names(package, names):
    module = importlib.import_module(f"ntl_scale.integrations.{package}")
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"ntl_scale.integrations.{package} lost {missing}"


def test_old_modules_and_names_are_gone():
    """An old path fails at import (no alias, no import hook on ``sys.meta_path``); an old name is no attribute."""
    import ntl_scale.training  # noqa: F401  (it registered the hook before 0.3)

    hooks = [type(finder).__name__ for finder in sys.meta_path if "ntl_scale" in type(finder).__module__]
    assert not hooks, hooks
    for old in REMOVED_MODULES:
        sys.modules.pop(old, None)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    for module, names in REMOVED_NAMES.items():
        present = [name for name in names if hasattr(importlib.import_module(module), name)]
        assert not present, f"{module} still has {present}"
