"""Every command of README.md and docs/getting_started.md is checked, so that the front door stays true.

Sections:
1. Each shell command of the two pages (fenced blocks, ``tests/helpers/docs_commands.py``) goes to the
   checker of its entry: ``make`` targets exist; Python entries parse the command's own arguments with
   their real parsers (an unknown or removed flag fails; the parse is stopped before any training);
   ``launch/train.py`` also loads its config with the overrides; the Slurm scripts plan the command as a
   dry run; torchtitan parses it with its own ``ConfigManager``. A command no checker knows fails.
2. Every repository path the commands and the stack table name exists; the table is the same on both pages.
The commands that train on CPU run as written elsewhere: ``tests/integration/test_megatron_example.py``
(the megatron.core row), ``tests/integration/test_torchtitan.py`` (the torchtitan block), ``make run``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers.docs_commands import ROOT, commands
from tests.helpers.scripts import load_script

PAGES = ("README.md", "docs/getting_started.md")
CASES = [(page, command) for page in PAGES for command in commands(page)]


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once the arguments parsed: stops the entry before it runs."""


def _parse_only(monkeypatch: pytest.MonkeyPatch, call) -> argparse.Namespace:
    for name in ("parse_args", "parse_intermixed_args"):
        original = getattr(argparse.ArgumentParser, name)

        def parse(self, args=None, namespace=None, _original=original):  # type: ignore[no-untyped-def]
            raise _Parsed(_original(self, args, namespace))

        monkeypatch.setattr(argparse.ArgumentParser, name, parse)
    with pytest.raises(_Parsed) as parsed:
        call()
    return parsed.value.args[0]


def _python_entry(words: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    script, argv = words[0], words[1:]
    assert (ROOT / script).is_file(), script
    monkeypatch.syspath_prepend(str(ROOT))
    if script == "launch/torchtitan_assets.py":  # builds in a second: run it, into tmp
        load_script(script, "doc_torchtitan_assets").main([str(tmp_path), *argv[1:]])
        assert (tmp_path / "tokenizer" / "tokenizer.json").is_file() and (tmp_path / "data").is_dir()
        return
    if script == "launch/megatron_example.py":
        module = load_script(script, "doc_megatron_example")
        args = module.parse_args(argv)
        assert args.config is None or os.path.isfile(args.config)
        return
    module = load_script(script, "doc_" + re.sub(r"\W", "_", script))
    monkeypatch.setattr(sys, "argv", [script, *argv])
    takes_argv = script != "examples/hf_trainer_ntl.py"  # its main() reads sys.argv
    args = _parse_only(monkeypatch, lambda: module.main(argv) if takes_argv else module.main())
    if script == "launch/train.py":
        from ntl_scale.training.config import load_config

        load_config(args.config, [a for a in argv if "=" in a and not a.startswith("-")])
    if script == "experiments/study.py":
        import yaml

        assert yaml.safe_load((ROOT / args.preset).read_text())["arms"], args.preset


def _torchtitan(argv: list[str]) -> None:
    code = "import sys; from torchtitan.config import ConfigManager; ConfigManager().parse_args(sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _sbatch(words: list[str]) -> None:
    nodes = [w.split("=", 1)[1] for w in words if w.startswith("--nodes=")]
    script = next(w for w in words if w.endswith(".sbatch"))
    rest = words[words.index(script) + 1 :]
    plan = ["--nodes", nodes[0]] if nodes and "--dry-run" not in rest else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cmd = ["bash", script, *([] if "--dry-run" in rest else ["--dry-run"]), *plan, *rest]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "srun " in out.stdout


@pytest.mark.parametrize(("page", "command"), CASES, ids=[f"{p}:{c[:60]}" for p, c in CASES])
def test_command_parses(page: str, command: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # DS_ACCELERATOR=cpu ...
        words = words[1:]
    head = words[0]
    if head == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert set(words[1:]) <= set(targets), words
    elif head == "export":
        assert words[1].split("=")[0] == "MEGATRON_LM_PATH", command  # the Megatron-LM checkout the Slurm line needs
    elif head in ("sbatch", "bash") and any(w.endswith(".sbatch") for w in words):
        _sbatch(words)
    elif head == "bash":
        assert (ROOT / words[1]).is_file(), command
    elif head == "torchrun" and "torchtitan.train" in words:
        _torchtitan(words[words.index("torchtitan.train") + 1 :])
    elif head in ("torchrun", "deepspeed"):
        entry = next(i for i, w in enumerate(words) if w.endswith(".py"))
        if words[entry] == "tests/helpers/megatron_cpu_launch.py":
            entry += 1
        _python_entry(words[entry:], monkeypatch, tmp_path)
    elif head == "python" and words[1:3] == ["-m", "pytest"]:
        pass
    elif head == "python":
        _python_entry(words[1:], monkeypatch, tmp_path)
    else:
        pytest.fail(f"{page}: no check for the command {command!r}; add one here")


def test_named_paths_exist_and_the_stack_table_is_one() -> None:
    names = set()
    for page in PAGES:
        text = (ROOT / page).read_text()
        pattern = r"\b((?:launch|configs|examples|experiments|scripts)/[\w./-]+\.(?:py|yaml|json|sh|sbatch))"
        names |= set(re.findall(pattern, text))
    missing = sorted(n for n in names if not (ROOT / n).is_file())
    assert not missing, missing

    def table(page: str) -> str:
        text = (ROOT / page).read_text()
        block = text[text.index("## One table per stack") :].split("\n\n")[1]  # the table: the first paragraph
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len(rows) == 7, block
        return re.sub(r"\]\([^)]*\)", "]", "\n".join(rows))  # the links differ by page

    assert table(PAGES[0]) == table(PAGES[1])
