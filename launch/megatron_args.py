"""Turns a ``configs/megatron/*.yaml`` file into Megatron command-line arguments.

    torchrun ... launch/pretrain_gpt_ntl.py --config configs/megatron/FILE.yaml --data-path ...
    python launch/megatron_args.py configs/megatron/FILE.yaml     # the flags, for scripts (the sbatch)

The YAML holds one mapping, ``megatron_args``, from flag name (without ``--``) to value: ``true``
writes the bare flag, ``false`` and ``null`` leave it out, a list writes several values.

A file that cannot be read exits with status 2 and the reason on stderr. Inside a command
substitution (``torchrun ... $(python launch/megatron_args.py FILE)``) the shell would still start the
launch, without the file's flags; so the failure also prints ``--ntl-config-error PATH`` on stdout,
an argument that ``launch/pretrain_gpt_ntl.py`` (and Megatron's own parser) refuses.
"""

from __future__ import annotations

import shlex
import sys

import yaml

CONFIG_ERROR_FLAG = "--ntl-config-error"


def to_argv(path: str) -> list[str]:
    """The Megatron argv of one config file; a ``SystemExit`` naming the file and the fix when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise SystemExit(
            f"{path}: cannot read this Megatron config ({e.strerror or e}); pass an existing "
            "configs/megatron/*.yaml file (relative to the working directory, or absolute)"
        ) from None
    except yaml.YAMLError as e:
        raise SystemExit(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("megatron_args"), dict):
        raise SystemExit(f"{path}: expected a mapping 'megatron_args: {{flag: value, ...}}' at the top level")
    return flags(data["megatron_args"])


def flags(mapping: dict) -> list[str]:
    """The Megatron argv of one ``{flag: value}`` mapping (the rules of the module docstring)."""
    argv: list[str] = []
    for flag, value in mapping.items():
        if value is None or value is False:
            continue
        argv.append(f"--{flag}")
        if value is True:
            continue
        argv.extend(str(v) for v in (value if isinstance(value, list) else [value]))
    return argv


def main(argv: list[str]) -> int:
    """Prints the flags of one config file; on failure the reason (stderr), the refused marker (stdout) and 2."""
    if len(argv) != 1:
        print("usage: python launch/megatron_args.py configs/megatron/FILE.yaml", file=sys.stderr)
        return 2
    try:
        print(shlex.join(to_argv(argv[0])))
    except SystemExit as e:
        print(f"launch/megatron_args.py: {e}", file=sys.stderr)
        print(shlex.join([CONFIG_ERROR_FLAG, argv[0]]))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
