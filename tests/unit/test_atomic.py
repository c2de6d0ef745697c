"""The one atomic writer (``ntl_scale/atomic.py``): a crash mid-write never leaves a torn file.

1. The writer: the new content replaces the old; an exception inside the block leaves the old file and no
   temporary file; a process killed mid-write leaves the old file (a plain ``open(path, "w")`` killed at the
   same point leaves a torn one: the check can fail); bytes and ``torch.save``; only whole-file modes.
2. Its users: ``eval.json`` and the cut-back ``metrics.jsonl`` of the DeepSpeed trainer's metrics, the
   number table, a checkpoint's ``status.json``, keep the old file when the write fails; no module of the
   package, the launchers, benchmarks or experiments writes its own temporary-file-and-rename.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import pathlib
import signal
import textwrap

import pytest
import torch

import ntl_scale
from ntl_scale.atomic import atomic_write, write_atomically, write_json_atomically

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Boom(RuntimeError):
    pass


def _write_then_fail(real_dump):
    """A ``json.dump`` that writes a part of its output, then fails (a full disk, a bug, a signal)."""

    def dump(value, f, **kwargs):
        f.write(json.dumps(value, **kwargs)[:7])
        f.flush()
        raise _Boom("mid-write")

    return dump


class _HalfWriter:
    """A file whose ``writelines`` writes the first line, then fails."""

    def __init__(self, f):
        self._f = f

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def writelines(self, lines):
        self._f.write(next(iter(lines)))
        self._f.flush()
        raise _Boom("mid-write")


# ---- 1. the writer ----------------------------------------------------------------------------------------


def test_replaces_the_old_content_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    write_json_atomically({"x": [1, 2]}, path)
    assert json.loads(path.read_text()) == {"x": [1, 2]} and path.read_text().endswith("\n")
    write_atomically(str(path), b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_an_exception_mid_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "latest"
    path.write_text("step10")
    with pytest.raises(_Boom), atomic_write(path) as f:
        f.write("st")
        f.flush()
        raise _Boom("mid-write")
    assert path.read_text() == "step10"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # the temporary file is gone
    with pytest.raises(_Boom), atomic_write(tmp_path / "new.pt", "wb") as f:  # nothing there before: nothing after
        torch.save({"w": torch.ones(3)}, f)
        raise _Boom("after the bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_torch_save_through_the_writer_loads_back(tmp_path):
    with atomic_write(tmp_path / "rng.pt", "wb") as f:
        torch.save({"cpu": torch.arange(5)}, f)
    assert torch.equal(torch.load(tmp_path / "rng.pt", weights_only=True)["cpu"], torch.arange(5))


@pytest.mark.parametrize("how", ["atomic", "plain"])
def test_a_process_killed_mid_write(tmp_path, how):
    """The writer under SIGKILL keeps the old file; a plain ``open(path, "w")`` there leaves a torn one
    (the control: the same check fails without the writer). A forked child writes and kills itself."""
    path = tmp_path / "status.json"
    path.write_text('{"step": 1}')
    pid = os.fork()
    if pid == 0:  # the child: no exception handler or finally block runs after the kill
        try:
            with atomic_write(path) if how == "atomic" else open(path, "w") as f:
                f.write('{"step": 2, "half')
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if how == "atomic":
        assert json.loads(path.read_text()) == {"step": 1}
    else:
        assert path.read_text() == '{"step": 2, "half'  # torn: what the writer exists to prevent


def test_only_whole_file_modes():
    for mode in ("a", "r+", "w+", "x"):
        with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"), atomic_write("/nonexistent/x", mode):
            pass


# ---- 2. its users -----------------------------------------------------------------------------------------


def test_eval_json_and_the_cut_back_metrics_keep_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    from ntl_scale.training.config import TrackingConfig
    from ntl_scale.training.flops import FlopsCounter
    from ntl_scale.training.metrics import MetricsLogger

    flops = FlopsCounter(matmul_params=1000, layers=2, width=8, peak_tflops=100.0)
    logger = MetricsLogger(TrackingConfig(wandb="disabled", plot=False), str(tmp_path), steps=4, log_every=2,
                           flops=flops, rank=0, world_size=1)  # fmt: skip
    (tmp_path / "eval.json").write_text('{"val": {"acc": 0.5}}')
    monkeypatch.setattr(json, "dump", _write_then_fail(json.dump))
    with pytest.raises(_Boom):
        logger.finish({"val": {"acc": 0.75}}, {"val": 4})
    assert json.loads((tmp_path / "eval.json").read_text()) == {"val": {"acc": 0.5}}
    monkeypatch.undo()

    rows = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(rows)

    real_open = builtins.open

    def failing_open(file, mode="r", *args, **kwargs):  # metrics.jsonl opened for writing fails mid-write
        f = real_open(file, mode, *args, **kwargs)
        return _HalfWriter(f) if "metrics.jsonl" in str(file) and mode in ("w", "x") else f

    with monkeypatch.context() as m:  # the resume's cut back to step 1 fails while writing
        m.setattr(builtins, "open", failing_open)
        with pytest.raises(_Boom):
            logger.open(1, {})
    assert (tmp_path / "metrics.jsonl").read_text() == rows


def test_number_table_and_checkpoint_status_keep_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    from ntl_scale.integrations.deepspeed.checkpointer import Checkpointer
    from ntl_scale.integrations.deepspeed.resume_layout import Layout

    vocab = ntl_scale.NumberVocab([3, 4], [0.0, 1.0], 8)
    vocab.save(tmp_path / "vocab.json")
    before = (tmp_path / "vocab.json").read_text()
    status = Checkpointer(str(tmp_path), Layout(1, 1, 8), save_every=1, rank=0, device=torch.device("cpu"))
    status.write_status("running", 3)
    monkeypatch.setattr(json, "dump", _write_then_fail(json.dump))
    with pytest.raises(_Boom):
        ntl_scale.NumberVocab([3, 4, 5], [0.0, 1.0, 2.0], 8).save(tmp_path / "vocab.json")
    with pytest.raises(_Boom):
        status.write_status("finished", 4)
    monkeypatch.undo()
    assert (tmp_path / "vocab.json").read_text() == before
    assert json.loads((tmp_path / "status.json").read_text()) == {"state": "running", "step": 3}
    assert ntl_scale.NumberVocab.load(tmp_path / "vocab.json").ids.tolist() == [3, 4]


# Renames that are not a file written in place: a finished folder moved to its name (the writer is for files).
_FOLDER_RENAMES = {
    ("ntl_scale/integrations/deepspeed/resume_layout.py", "partial"),
    ("launch/deepmind_data.py", "partial"),
    ("experiments/gpu_study.py", "aside"),  # the harness task folder, published whole (array tasks race for it)
}


def test_no_hand_written_temporary_file_and_rename():
    """``os.replace``/``os.rename`` appear in ``ntl_scale/atomic.py`` only, except the folder renames above.

    ``scripts/gpu_check.py`` keeps its own: it runs before the carried wheels (torch among them) are
    installed, and ``import ntl_scale`` needs torch."""
    found = []
    for folder in ("ntl_scale", "launch", "benchmarks", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("replace", "rename")
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"):  # fmt: skip
                    first = ast.unparse(node.args[0]) if node.args else ""
                    if rel != "ntl_scale/atomic.py" and (rel, first) not in _FOLDER_RENAMES:
                        found.append(f"{rel}:{node.lineno}: os.{node.func.attr}({first}, ...)")
    assert not found, "write through ntl_scale.atomic.atomic_write instead:\n" + textwrap.indent("\n".join(found), "  ")


def test_a_row_torn_by_a_kill_mid_append_does_not_stop_the_resume(tmp_path):
    """metrics.jsonl is appended row by row: a kill mid-append leaves half a row at the end. The resume drops
    it (that step is redone) instead of failing on it; a damaged row before the end is a clear error."""
    from ntl_scale.training.config import TrackingConfig
    from ntl_scale.training.flops import FlopsCounter
    from ntl_scale.training.metrics import MetricsLogger

    flops = FlopsCounter(matmul_params=1000, layers=2, width=8, peak_tflops=100.0)
    logger = MetricsLogger(TrackingConfig(wandb="disabled", plot=False), str(tmp_path), steps=6, log_every=2,
                           flops=flops, rank=0, world_size=1)  # fmt: skip
    rows = "".join(json.dumps({"step": s, "ce": 1.0 / s}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 4, "ce": 0.2')  # the kill came mid-append
    logger.open(4, {})
    assert (tmp_path / "metrics.jsonl").read_text() == rows
    logger.open(2, {})  # and the ordinary cut back still applies
    assert (tmp_path / "metrics.jsonl").read_text() == rows.split("\n", 2)[0] + "\n" + rows.split("\n")[1] + "\n"

    (tmp_path / "metrics.jsonl").write_text(rows.replace('"step": 2', '"step": 2,,') + rows)
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON row"):
        logger.open(6, {})
