"""Megatron-LM's ``pretrain_gpt.py`` with Number Token Loss: the same run, plus ``--ntl-*`` flags.

    cd /path/to/Megatron-LM        # or: export MEGATRON_LM_PATH=/path/to/Megatron-LM
    torchrun --nproc_per_node 8 /path/to/ntl_scale/launch/pretrain_gpt_ntl.py \\
        <your usual Megatron arguments> --ntl-weight 0.3 [--ntl-loss was] [--ntl-normalization global]

Everything but the loss is Megatron-LM's own: its data, model provider, get_batch, training loop,
checkpoints and logging. With ``--ntl-weight 0`` (the default) each step calls Megatron-LM's own
``forward_step``, so the run is exactly the plain one. With NTL on, the last pipeline stage gets the
vocab-sharded logits and computes CE + NTL with the fused op; ``ntl loss`` and ``number accuracy``
are logged next to ``lm loss``.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the ntl_scale checkout, when not pip-installed

from ntl_scale.integrations import megatron as ntl_megatron  # noqa: E402


def import_megatron_lm():
    """Imports Megatron-LM's ``pretrain_gpt`` and ``megatron.training``, or exits with the fix."""
    checkout = os.environ.get("MEGATRON_LM_PATH", os.getcwd())
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    try:
        import pretrain_gpt
        from megatron import training
    except ImportError as e:
        raise SystemExit(
            f"pretrain_gpt_ntl.py needs a Megatron-LM checkout (megatron.training and pretrain_gpt.py), "
            f"which is not importable from {checkout!r} ({e}). The megatron-core wheel does not contain "
            "them. Fix: git clone Megatron-LM, then run from its root or set MEGATRON_LM_PATH to it. "
            "Without a checkout, see launch/megatron_example.py (megatron.core only)."
        ) from None
    return pretrain_gpt, training


def make_ntl_forward_step(pretrain_gpt, training):
    """Wraps Megatron-LM's forward_step: unchanged when NTL is off, CE + NTL from logits when on."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.utils import get_attr_wrapped_model

    takes_vp_stage = "vp_stage" in inspect.signature(pretrain_gpt.get_batch).parameters
    steps = {}

    def forward_step(data_iterator, model, *args, **kwargs):
        margs = training.get_args()
        settings = ntl_megatron.NTLSettings.from_args(margs)
        if not settings.enabled:
            return pretrain_gpt.forward_step(data_iterator, model, *args, **kwargs)
        vp_stage = get_attr_wrapped_model(model, "vp_stage", allow_none=True) if takes_vp_stage else None
        if vp_stage not in steps:
            vocab = ntl_megatron.build_number_vocab(settings, training.get_tokenizer(), margs.padded_vocab_size)
            get_batch = (
                functools.partial(pretrain_gpt.get_batch, vp_stage=vp_stage)
                if takes_vp_stage
                else pretrain_gpt.get_batch
            )
            steps[vp_stage] = ntl_megatron.make_forward_step(
                settings,
                vocab,
                get_batch,
                tp_group=parallel_state.get_tensor_model_parallel_group(),
                count_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
                num_microbatches=get_num_microbatches,
                calculate_per_token_loss=margs.calculate_per_token_loss,
                data_parallel_size=parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            )
        return steps[vp_stage](data_iterator, model)

    return forward_step


def main() -> None:
    pretrain_gpt, training = import_megatron_lm()
    from megatron.core.enums import ModelType

    builder = getattr(pretrain_gpt, "gpt_builder", None)
    provider = pretrain_gpt.model_provider
    model_provider = functools.partial(provider, builder) if builder is not None else provider
    modelopt_args = getattr(pretrain_gpt, "add_modelopt_args", None)

    def extra_args_provider(parser):
        if modelopt_args is not None and getattr(pretrain_gpt, "has_nvidia_modelopt", False):
            parser = modelopt_args(parser)
        return ntl_megatron.add_ntl_args(parser)

    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    training.pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        make_ntl_forward_step(pretrain_gpt, training),
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=extra_args_provider,
    )


if __name__ == "__main__":
    main()
