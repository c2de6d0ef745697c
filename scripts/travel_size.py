"""What travels to the GPU machine, and whether it fits: the working tree plus the GPU wheel set.

    python scripts/travel_size.py                  # tree + the wheels of scripts/gpu_wheels.manifest.json
    python scripts/travel_size.py --limit-mib 40   # the limit (default 40 MiB; the device tool's is 64)
    python scripts/travel_size.py --json           # one JSON line instead of the report
    python scripts/travel_size.py --wheels .gpu_wheels   # a built wheel folder instead of the manifest

The device tool copies the working tree (tracked files and untracked files git does not ignore:
``git ls-files -co --exclude-standard``; ``.git`` stays behind) and the carried ``.gpu_wheels/``, at most
64 MiB together. Our own budget is 40 MiB, room for later wheels. The wheel set's size is read from the
manifest that ``scripts/gpu_wheels.sh`` records as it builds the set (file names and byte sizes), so the
check needs no download. Sizes are file sizes in bytes (MiB = 2**20 bytes). Exit status 1 above the
limit, 2 for a missing or unreadable manifest or folder; without git (a copied tree) every file under
the root except ``.git`` and ``.gpu_wheels`` is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join("scripts", "gpu_wheels.manifest.json")
"""The wheel set's manifest, relative to the root (written by scripts/gpu_wheels.sh)."""
LIMIT_MIB = 40.0
"""Our budget for tree + wheels (the device tool's limit is 64 MiB)."""
MIB = 1 << 20


def tree_files(root: str) -> tuple[list[str], str]:
    """The files that travel (relative paths) and how they were found (``git`` or ``walk``)."""
    try:
        done = subprocess.run(["git", "--no-optional-locks", "-C", root, "ls-files", "-co", "--exclude-standard", "-z"],
                              capture_output=True, timeout=120)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is not None and done.returncode == 0:
        names = [n.decode() for n in done.stdout.split(b"\0") if n]
        return [n for n in names if os.path.isfile(os.path.join(root, n))], "git"  # tracked but deleted: gone
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (top == root and d in (".git", ".gpu_wheels"))]
        found += [os.path.relpath(os.path.join(top, f), root) for f in files]
    return sorted(found), "walk"


def manifest_files(path: str) -> dict[str, int]:
    """File name -> bytes of a wheel-set manifest (``{"files": [{"name": ..., "bytes": ...}, ...]}``)."""
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = {str(e["name"]): int(e["bytes"]) for e in manifest["files"]}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"travel_size: cannot read the wheel manifest {path} ({error}); bash scripts/gpu_wheels.sh "
                         "records it") from None  # fmt: skip
    return files


def folder_files(path: str) -> dict[str, int]:
    """Relative path -> bytes of every file under a built wheel folder."""
    if not os.path.isdir(path):
        raise SystemExit(f"travel_size: --wheels {path} is not a folder (bash scripts/gpu_wheels.sh builds it)")
    out = {}
    for top, _, files in os.walk(path):
        for f in files:
            full = os.path.join(top, f)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


def measure(root: str = ROOT, manifest: str | None = None, wheels: str | None = None,
            limit_mib: float = LIMIT_MIB) -> dict:  # fmt: skip
    """Tree bytes (and its largest folders, two levels deep), wheel bytes (from ``wheels``, a folder, or else
    the manifest), their total against ``limit_mib``."""
    names, how = tree_files(root)
    sizes = {n: os.lstat(os.path.join(root, n)).st_size for n in names}
    if wheels is not None:
        wheel_files, source = folder_files(wheels), wheels
    else:
        source = manifest or os.path.join(root, MANIFEST)
        wheel_files = manifest_files(source)
    tree, wheel = sum(sizes.values()), sum(wheel_files.values())
    folders: dict[str, int] = {}
    for name, size in sizes.items():
        folder = "/".join(name.split("/")[:2]) if name.count("/") >= 2 else os.path.dirname(name) or "."
        folders[folder] = folders.get(folder, 0) + size
    largest = sorted(folders.items(), key=lambda kv: -kv[1])[:5]
    return {"tree_bytes": tree, "tree_files": len(sizes), "tree_listed_by": how, "wheels_bytes": wheel,
            "wheels_files": len(wheel_files), "wheels_from": os.path.relpath(source, root),
            "total_bytes": tree + wheel, "limit_bytes": int(limit_mib * MIB), "ok": tree + wheel <= limit_mib * MIB,
            "largest_tree_folders": [{"name": n, "bytes": b} for n, b in largest]}  # fmt: skip


def report(m: dict) -> str:
    """The short report: tree, wheels, total and limit in MiB, and the verdict."""
    mib = lambda b: f"{b / MIB:.1f} MiB"  # noqa: E731
    lines = [
        f"tree    {mib(m['tree_bytes']):>10}  ({m['tree_files']} files, listed by {m['tree_listed_by']})",
        f"wheels  {mib(m['wheels_bytes']):>10}  ({m['wheels_files']} files, {m['wheels_from']})",
        f"total   {mib(m['total_bytes']):>10}  of the {mib(m['limit_bytes'])} limit: "
        + ("fits" if m["ok"] else f"OVER by {mib(m['total_bytes'] - m['limit_bytes'])}"),
    ]
    if not m["ok"]:
        lines.append("largest folders of the tree: " + ", ".join(f"{e['name']} ({mib(e['bytes'])})"
                                                                 for e in m["largest_tree_folders"]))  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB, help=f"limit in MiB (default {LIMIT_MIB:g})")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the report")
    parser.add_argument("--manifest", default=None, help=f"wheel-set manifest (default {MANIFEST})")
    parser.add_argument("--wheels", default=None, help="measure this built wheel folder instead of the manifest")
    parser.add_argument("--root", default=ROOT, help="the working tree (default: this checkout)")
    args = parser.parse_args(argv)
    if not args.limit_mib > 0:
        parser.error(f"--limit-mib {args.limit_mib:g}: expected a positive number of MiB, e.g. 40")
    try:
        m = measure(args.root, args.manifest, args.wheels, args.limit_mib)
    except SystemExit as error:
        print(error, file=sys.stderr)
        return 2
    print(json.dumps(m) if args.json else report(m), flush=True)
    return 0 if m["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
