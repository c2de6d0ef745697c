"""Turns a ``configs/megatron/*.yaml`` file into Megatron command-line arguments.

    torchrun ... launch/pretrain_gpt_ntl.py $(python launch/megatron_args.py configs/megatron/FILE.yaml) --data-path ...

The YAML holds one mapping, ``megatron_args``, from flag name (without ``--``) to value: ``true``
writes the bare flag, ``false`` and ``null`` leave it out, a list writes several values.
"""

from __future__ import annotations

import shlex
import sys

import yaml


def to_argv(path: str) -> list[str]:
    """The Megatron argv of one config file."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python launch/megatron_args.py configs/megatron/FILE.yaml")
    print(shlex.join(to_argv(sys.argv[1])))
