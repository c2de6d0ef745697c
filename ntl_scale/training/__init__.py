"""Framework-free building blocks of the DeepSpeed trainer (:mod:`ntl_scale.integrations.deepspeed`):
the run config, tokenizer and model builders, data sources, model inputs, scoring, metrics, FLOPs.

Importing this package needs only torch; each piece imports its framework when called. The modules that
moved in 0.2.x keep their old names for one release (an import warns; see ``docs/changelog.md``).
"""

from .._deprecation import deprecated_modules

_DEEPSPEED = "ntl_scale.integrations.deepspeed"
deprecated_modules(
    {
        "ntl_scale.training.trainer": f"{_DEEPSPEED}.trainer",
        "ntl_scale.training.engine": f"{_DEEPSPEED}.engine",
        "ntl_scale.training.checkpoint": f"{_DEEPSPEED}.checkpointer",
        "ntl_scale.training.resume": f"{_DEEPSPEED}.resume_layout",
        "ntl_scale.training.resolved": f"{_DEEPSPEED}.resolved",
        "ntl_scale.training.steps": f"{_DEEPSPEED}.steps",
        "ntl_scale.training.evaluator": f"{_DEEPSPEED}.heldout",
        "ntl_scale.training.evaluate": "ntl_scale.training.scoring",
        "ntl_scale.training.data": "ntl_scale.training.sources",
        "ntl_scale.training.inputs": "ntl_scale.training.model_inputs",
    }
)
