"""Megatron-LM's ``pretrain_gpt.py`` with Number Token Loss: the same run, plus ``--ntl-*`` flags.

    cd /path/to/Megatron-LM        # or: export MEGATRON_LM_PATH=/path/to/Megatron-LM
    torchrun --nproc_per_node 8 /path/to/ntl_scale/launch/pretrain_gpt_ntl.py \\
        <your usual Megatron arguments> --ntl-weight 0.3 [--ntl-loss was] [--ntl-normalization global]
    torchrun ... launch/pretrain_gpt_ntl.py --config configs/megatron/FILE.yaml <more arguments>

``--config FILE.yaml`` puts the file's ``megatron_args`` (``launch/megatron_args.py``) where it
stands, before Megatron parses; a later flag wins, as always with Megatron's parser. A file that
cannot be read stops the launch before anything runs.

This runs the checkout's own ``pretrain_gpt.py`` as ``__main__``: its argument parsing, model
builder, datasets, ``get_batch``, ``forward_step`` and ``loss_func``, training loop, checkpoints and
logging, whatever the release (tested: core_v0.16.1 and core_v0.19.0). Before it runs, three entry
points of ``megatron.training`` are wrapped for this process only:

* the argument parser gets the ``--ntl-*`` group (``parse_and_validate_args`` since core 0.18, or
  ``pretrain``'s ``extra_args_provider`` before);
* ``pretrain`` gets ``forward_step`` wrapped by :class:`ntl_scale.integrations.megatron.lm.NTLForwardStep`,
  which makes the model compute CE + NTL where it computes CE and adds ``ntl loss`` and
  ``number accuracy`` to the report;
* ``evaluate`` hands ``lm loss`` to Megatron's printer (value and perplexity, as before) and prints
  the NTL metrics on their own line, without a perplexity.

With ``--ntl-weight 0`` (the default) each step is the release's own ``forward_step``: the plain run.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the ntl_scale checkout, when not pip-installed

from launch.finish import run_then_leave  # noqa: E402
from launch.megatron_args import CONFIG_ERROR_FLAG, to_argv  # noqa: E402
from ntl_scale.integrations import megatron as ntl_megatron  # noqa: E402
from ntl_scale.integrations.megatron.lm import forward_step_from_args  # noqa: E402

SUPPORTED = "Megatron-LM core_v0.16.x to core_v0.19.x"
NTL_KEYS = ("ntl loss", "number accuracy")


def find_pretrain_gpt() -> str:
    """The checkout's ``pretrain_gpt.py`` (``MEGATRON_LM_PATH`` or the working directory), or exits with the fix."""
    checkout = os.path.abspath(os.environ.get("MEGATRON_LM_PATH", os.getcwd()))
    script = os.path.join(checkout, "pretrain_gpt.py")
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    try:
        if not os.path.isfile(script):
            raise ImportError(f"no pretrain_gpt.py in {checkout}")
        import megatron.training  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"pretrain_gpt_ntl.py needs a Megatron-LM checkout (megatron.training and pretrain_gpt.py), "
            f"which is not importable from {checkout!r} ({e}). The megatron-core wheel does not contain "
            f"them. Fix: git clone Megatron-LM ({SUPPORTED}), then run from its root or set MEGATRON_LM_PATH "
            "to it. Without a checkout, see launch/megatron_example.py (megatron.core only)."
        ) from None
    return script


def with_ntl_args(extra_args_provider):
    """Megatron's ``extra_args_provider`` plus the ``--ntl-*`` group."""

    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return ntl_megatron.add_ntl_args(parser)

    return provider


def build_forward_step(forward_step):
    """``forward_step`` with NTL, built on its first call (after Megatron has initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    built = {}

    @functools.wraps(forward_step)
    def ntl_forward_step(data_iterator, model, *args, **kwargs):
        step = built.get("step")
        if step is None:
            try:
                step = built["step"] = forward_step_from_args(forward_step, get_args(), ps)
            except ValueError as e:  # flags NTL cannot train with: the fix, without a traceback
                raise SystemExit(f"pretrain_gpt_ntl.py: {e}") from None
        return step(data_iterator, model, *args, **kwargs)

    return ntl_forward_step


def wrap_pretrain(pretrain, *, add_args: bool):
    """``pretrain`` with the NTL ``forward_step`` (and with ``add_args``, the ``--ntl-*`` parser group)."""
    signature = inspect.signature(pretrain)
    if "forward_step_func" not in signature.parameters:
        raise SystemExit(
            f"pretrain_gpt_ntl.py: this Megatron-LM's pretrain() has no forward_step_func parameter "
            f"({signature}); supported: {SUPPORTED}"
        )

    @functools.wraps(pretrain)
    def ntl_pretrain(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["forward_step_func"] = build_forward_step(bound.arguments["forward_step_func"])
        if add_args:
            bound.arguments["extra_args_provider"] = with_ntl_args(bound.arguments.get("extra_args_provider"))
        return pretrain(*bound.args, **bound.kwargs)

    return ntl_pretrain


def wrap_parse_and_validate_args(parse):
    """Core >= 0.18 parses the arguments before ``pretrain``: add the ``--ntl-*`` group there."""

    @functools.wraps(parse)
    def ntl_parse(*args, **kwargs):
        bound = inspect.signature(parse).bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = with_ntl_args(bound.arguments.get("extra_args_provider"))
        return parse(*bound.args, **bound.kwargs)

    return ntl_parse


def wrap_evaluate(evaluate):
    """``evaluate`` whose NTL metrics are printed here, once, and never get a perplexity."""

    @functools.wraps(evaluate)
    def ntl_evaluate(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        totals = result[0] if isinstance(result, tuple) and result else None
        if not isinstance(totals, dict) or not any(k in totals for k in NTL_KEYS):
            return result
        metrics = {k: float(totals.pop(k)) for k in NTL_KEYS if k in totals}
        _log_validation(metrics)
        return result

    return ntl_evaluate


def _log_validation(metrics: dict[str, float]) -> None:
    from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer
    from megatron.training.utils import print_rank_last

    iteration = getattr(get_args(), "curr_iteration", None)
    parts = []
    for key, value in metrics.items():
        # No number token in the whole evaluation: sum / count is 0 / 0.
        parts.append(f"{key}: {value:.6E}" if math.isfinite(value) else f"{key}: n/a (no number tokens)")
    print_rank_last(" validation (ntl_scale) | " + " | ".join(parts) + " |")
    finite = {f"{k} validation": v for k, v in metrics.items() if math.isfinite(v)}
    writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
    if iteration is not None:
        for key, value in finite.items():
            if writer is not None:
                writer.add_scalar(key, value, iteration)
        if wandb_writer is not None and finite:
            wandb_writer.log(finite, iteration)


def install() -> None:
    """Wraps ``megatron.training``'s entry points for this process (before pretrain_gpt.py imports them)."""
    import megatron.training as training_pkg
    from megatron.training import arguments, training

    if getattr(training_pkg.pretrain, "_ntl_scale", False):
        return
    # Where Megatron parses its arguments: parse_and_validate_args (core >= 0.18, before pretrain),
    # else pretrain's own extra_args_provider. Capabilities, not version strings.
    parses_first = hasattr(arguments, "parse_and_validate_args")
    if not parses_first and "extra_args_provider" not in inspect.signature(training_pkg.pretrain).parameters:
        raise SystemExit(f"pretrain_gpt_ntl.py: cannot add the --ntl-* arguments here; supported: {SUPPORTED}")
    if parses_first:
        arguments.parse_and_validate_args = wrap_parse_and_validate_args(arguments.parse_and_validate_args)
    pretrain = wrap_pretrain(training_pkg.pretrain, add_args=not parses_first)
    pretrain._ntl_scale = True
    training_pkg.pretrain = pretrain
    training.pretrain = pretrain
    training.evaluate = wrap_evaluate(training.evaluate)


def expand_config(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config FILE.yaml`` replaced by the file's flags; exits naming a file it cannot read."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == CONFIG_ERROR_FLAG:  # a `$(python launch/megatron_args.py FILE)` that failed
            path = argv[i + 1] if i + 1 < len(argv) else "?"
            raise SystemExit(
                f"pretrain_gpt_ntl.py: launch/megatron_args.py could not read {path!r} (its reason is printed "
                "above), so this launch would run without the config's flags. Fix the path, or pass "
                "--config FILE.yaml to pretrain_gpt_ntl.py itself."
            )
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if not path:
                raise SystemExit("pretrain_gpt_ntl.py: --config needs a file: --config configs/megatron/FILE.yaml")
            try:
                out.extend(to_argv(path))
            except SystemExit as e:
                raise SystemExit(f"pretrain_gpt_ntl.py: --config {e}") from None
            i += 1 if "=" in arg else 2
            continue
        out.append(arg)
        i += 1
    return out


def main() -> None:
    arguments = expand_config(sys.argv[1:])
    script = find_pretrain_gpt()
    install()
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run_then_leave(main)  # also after Megatron's own exits (--exit-signal-handler, --exit-interval)
