"""What travels to the GPU machine fits: ``scripts/travel_size.py`` and the wheel manifest of ``scripts/gpu_wheels.sh``.

1. The real tree: tracked and untracked-not-ignored files (counted here by ``git ls-files`` and ``du``)
   plus the wheel set of ``scripts/gpu_wheels.manifest.json`` are at most 40 MiB, and the tool says so
   with exit status 0 and the same byte counts; at a limit below the total it exits 1 and says OVER.
2. The tool on a throw-away git repository: it counts tracked and untracked files, not ignored ones;
   a total exactly at the limit passes and one byte more fails; ``--wheels`` measures a folder;
   without git every file is counted; a missing manifest is exit status 2 with the fix.
3. The manifest against the specs of ``gpu_wheels.sh``: every required wheel, the DeepSpeed wheel and
   the Megatron-LM archive have their file in it, and every file in it comes from a spec of the
   script, so a wheel added to the script without building and recording the set fails; the checker
   itself fails on a script with a spec the manifest lacks.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "scripts" / "travel_size.py"
MANIFEST = ROOT / "scripts" / "gpu_wheels.manifest.json"
MIB = 1 << 20


def _tool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


# 1. the real tree


def test_the_tree_and_the_gpu_wheels_fit_in_40_mib():
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: what travels is defined by git")
    command = f"git -C {ROOT} ls-files -co --exclude-standard -z | (cd {ROOT} && xargs -0 -r du -cb) | tail -1"
    listed = subprocess.run(command, shell=True, capture_output=True, text=True, check=True)
    tree = int(listed.stdout.split()[0])
    manifest = json.loads(MANIFEST.read_text())
    wheels = sum(f["bytes"] for f in manifest["files"])
    assert wheels == manifest["total_bytes"]
    done = _tool("--json")
    measured = json.loads(done.stdout)
    assert (measured["tree_bytes"], measured["wheels_bytes"]) == (tree, wheels)
    assert tree + wheels <= 40 * MIB, f"{(tree + wheels) / MIB:.1f} MiB travel: {_tool().stdout}"
    assert done.returncode == 0 and measured["ok"] and measured["limit_bytes"] == 40 * MIB
    report = _tool()
    assert report.returncode == 0 and re.search(rf"total +{(tree + wheels) / MIB:.1f} MiB .*: fits", report.stdout)
    below = (tree + wheels) / MIB - 0.5  # the same tree at a limit half a MiB under it
    over = _tool("--limit-mib", f"{below}")
    assert over.returncode == 1 and "OVER by 0.5 MiB" in over.stdout and "largest folders" in over.stdout
    assert json.loads(_tool("--json", "--limit-mib", "1").stdout)["ok"] is False


# 2. the tool on a repository made here


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("runs/\n")
    (repo / "pkg" / "code.py").write_bytes(b"x" * 1000)
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    (repo / "pkg" / "new.py").write_bytes(b"y" * 500)  # untracked, not ignored: it travels
    (repo / "runs").mkdir()
    (repo / "runs" / "big.bin").write_bytes(b"z" * 100_000)  # ignored: it stays
    return repo


def _manifest(path: Path, sizes: dict[str, int]) -> Path:
    path.write_text(json.dumps({"files": [{"name": n, "bytes": b} for n, b in sizes.items()]}))
    return path


def test_the_tool_counts_what_git_lets_travel_against_the_limit(tmp_path):
    repo = _repo(tmp_path)
    tree = 1000 + 500 + len("runs/\n")
    wheels = {"a.whl": 3 * MIB // 4 - tree, "b.tar.gz": MIB // 4}  # the total: exactly 1 MiB
    manifest = _manifest(tmp_path / "m.json", wheels)
    done = _tool("--root", str(repo), "--manifest", str(manifest), "--limit-mib", "1", "--json")
    m = json.loads(done.stdout)
    assert done.returncode == 0 and (m["tree_bytes"], m["tree_files"], m["tree_listed_by"]) == (tree, 3, "git")
    assert (m["wheels_bytes"], m["total_bytes"], m["ok"]) == (MIB - tree, MIB, True)
    wheels["a.whl"] += 1  # one byte over
    done = _tool("--root", str(repo), "--manifest", str(_manifest(tmp_path / "m.json", wheels)), "--limit-mib", "1")
    assert done.returncode == 1 and "OVER" in done.stdout
    folder = tmp_path / "wheels"
    (folder / "sub").mkdir(parents=True)
    (folder / "w.whl").write_bytes(b"w" * 700)
    (folder / "sub" / "v.whl").write_bytes(b"v" * 300)
    m = json.loads(_tool("--root", str(repo), "--wheels", str(folder), "--json").stdout)
    assert (m["wheels_bytes"], m["wheels_files"], m["ok"]) == (1000, 2, True)
    (repo / ".git").rename(tmp_path / "git")  # a copied tree: no git, every file counts
    m = json.loads(_tool("--root", str(repo), "--wheels", str(folder), "--json").stdout)
    assert (m["tree_bytes"], m["tree_listed_by"]) == (tree + 100_000, "walk")
    missing = _tool("--root", str(repo), "--manifest", str(tmp_path / "none.json"))
    assert missing.returncode == 2 and "bash scripts/gpu_wheels.sh records it" in missing.stderr
    bad = _tool("--limit-mib", "0")
    assert bad.returncode == 2 and "expected a positive number of MiB" in bad.stderr


# 3. the manifest against the script's specs


def _specs(script: str) -> dict[str, str]:
    """File-name pattern -> the spec or archive of gpu_wheels.sh that produces it (required and optional)."""
    required = re.search(r"^REQUIRED=\((.*?)^\)", script, re.M | re.S)
    optional = re.search(r"^OPTIONAL_SPECS=\((.*?)^\)", script, re.M | re.S)
    deepspeed = re.search(r"^DEEPSPEED=(\S+)", script, re.M)
    tag = re.search(r"^MEGATRON_TAG=(\S+)", script, re.M)
    assert required and optional and deepspeed and tag, "gpu_wheels.sh: REQUIRED, OPTIONAL_SPECS, DEEPSPEED, TAG"
    words = lambda block: re.findall(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.\-]+", re.sub(r"#.*", "", block))  # noqa: E731
    out = {}
    for spec in [*words(required.group(1)), deepspeed.group(1)]:
        name, version = spec.split("==")
        out[rf"{re.sub(r'[-_.]+', '_', name).lower()}-{re.escape(version)}-.+\.whl"] = spec
    out[re.escape(f"megatron-lm-{tag.group(1)}.tar.gz")] = f"Megatron-LM {tag.group(1)}"
    for spec in words(optional.group(1)):  # optional: allowed in the manifest, not required
        name, version = spec.split("==")
        out[rf"{re.sub(r'[-_.]+', '_', name).lower()}-{re.escape(version)}-.+\.whl"] = "optional " + spec
    return out


def _mismatches(script: str, names: list[str]) -> list[str]:
    specs = _specs(script)
    found = {p: [n for n in names if re.fullmatch(p, n, re.I)] for p in specs}
    missing = [f"{spec}: no file in the manifest" for p, spec in specs.items() if not found[p]
               and not spec.startswith("optional ")]  # fmt: skip
    stray = [f"{n}: from no spec of gpu_wheels.sh" for n in names if not any(re.fullmatch(p, n, re.I) for p in specs)]
    return missing + stray


def test_the_manifest_holds_every_spec_of_gpu_wheels_sh():
    script = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    names = [f["name"] for f in json.loads(MANIFEST.read_text())["files"]]
    assert _mismatches(script, names) == [], "re-record: bash scripts/gpu_wheels.sh, then commit its manifest"
    assert len(_specs(script)) >= 17  # the parse found the lists (14 required, DeepSpeed, Megatron, optional)
    added = script.replace("datasets==5.2.0", "datasets==5.2.0 newpkg==1.0")  # a wheel added, not recorded
    assert _mismatches(added, names) == ["newpkg==1.0: no file in the manifest"]
    dropped = script.replace("hjson==3.1.0", "")  # a spec removed: its file in the manifest is stray
    assert _mismatches(dropped, names) == ["hjson-3.1.0-py3-none-any.whl: from no spec of gpu_wheels.sh"]
