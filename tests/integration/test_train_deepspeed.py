"""``deepspeed launch/train.py``: real two-process ZeRO-3 runs on CPU over gloo, tiny config.

Sections:
1. A short run: parameters are partitioned (each rank holds about half), the loss decreases, the
   evaluation and checkpoints are written, the config is saved as given and the resolved values
   (accumulation, layout, bf16, the DeepSpeed config) beside it.
2. Resume: stop after k steps, run again to the end on another number of processes (DeepSpeed universal
   checkpoints) or, with dropout, on the same; the losses after k equal the uninterrupted run. A run
   stopped by a signal, or dead, after its last step is finished on restart; a finished one is left as it is.
3. Gradient accumulation: 1 x 4 micro-batch splits of the same global batch give the first-step gradient
   norm of the whole batch (global normalisation of CE and NTL).
4. Bad input stops before training with a clear message.
5. Tensor parallelism (AutoTP, vocabulary-parallel head) equals one process, also resumed at another
   tensor-parallel size; what AutoTP cannot do is refused.

Two runs are shared by the tests that read them (module-scoped, never written to by a test): the
uninterrupted no-dropout run, which is section 1's short run, section 2's reference and section 3's causal
whole batch, and the run started from another directory, which is also the logits-path reference of the
chunked loss. Several starts of main() that need no process each (refusals, restarts of one run, the one-process
reference they are compared with) run in one process (``_mains``).

The uninterrupted run is started by ``deepspeed`` itself (DeepSpeed's runner and per-node launcher, the documented
command); every other run of more than one process starts its ranks with the same variables and ``--local_rank``
argument, without the launcher's two interpreters (``tests/helpers/spawn_ranks.py --deepspeed``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port, run_launch
from tests.helpers.spawn_ranks import deepspeed_command

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "helpers" / "ds_launch.py"


def _train(run_dir: Path, *overrides: str, nproc: int = 2, check: bool = True, cwd: Path = ROOT,
           env: dict | None = None, launcher: bool = False) -> subprocess.CompletedProcess:  # fmt: skip
    # one process: `python launch/train.py`, a one-rank world without a rendezvous; more: the ranks `deepspeed`
    # starts, with its variables and --local_rank (tests/helpers/spawn_ranks.py), or (`launcher`) by `deepspeed`
    # itself, whose runner and per-node launcher (two more interpreters importing DeepSpeed) the runs do not see
    script = [str(SHIM), str(ROOT / "launch" / "train.py"), f"run_dir={run_dir}", *overrides]
    port = str(free_port())
    cmd = [sys.executable, *script] if nproc == 1 else deepspeed_command(nproc, port, *script, launcher=launcher)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", **(env or {})}
    out = run_launch(cmd, cwd=cwd, env=env, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"train.py failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# no dropout: its masks depend on how the batch is split
ARCHITECTURES = {
    "causal": "{model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 4, n_positions: 128, "
    "resid_pdrop: 0, embd_pdrop: 0, attn_pdrop: 0}",
    "seq2seq": "{model_type: t5, d_model: 64, d_ff: 128, num_layers: 2, num_heads: 4, d_kv: 16, dropout_rate: 0}",
}
# wandb's offline log and the plot, written after the last step: read by test_short_zero3_run, off where not read
UNREAD = ("tracking.wandb=disabled", "tracking.plot=false")
# 2 processes x micro-batch 4 x accumulation 1
RESUME_COMMON = ("train.log_every=5", "eval.at_end=false", *UNREAD,
                 f"model.architecture={ARCHITECTURES['causal']}", "train.micro_batch_size=4",
                 "train.global_batch_size=8")  # fmt: skip
# the same, 12 steps, evaluated, logged to wandb offline and plotted at the end (after the last step: the curve is
# RESUME_COMMON's)
SHORT = ("train.steps=12", "train.log_every=5", "data.eval_examples=8", "eval.max_new_tokens=8",
         f"model.architecture={ARCHITECTURES['causal']}", "train.micro_batch_size=4",
         "train.global_batch_size=8")  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """12 steps of the no-dropout GPT-2 on 2 processes, micro-batch 4, global batch 8, started by ``deepspeed``
    itself (the module's one run under DeepSpeed's launcher): its folder and its output."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    return run, _train(run, *SHORT, launcher=True)


def test_short_zero3_run(uninterrupted):
    run, out = uninterrupted
    for rank in (0, 1):
        part = json.loads((run / f"zero_rank{rank}.json").read_text())
        assert 0.4 < part["held"] / part["total"] < 0.6  # ZeRO-3: each of 2 ranks holds about half
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    first = sum(r["ce"] for r in rows[:3]) / 3
    last = sum(r["ce"] for r in rows[-3:]) / 3
    assert last < 0.8 * first
    results = json.loads((run / "eval.json").read_text())
    assert set(results) == {"interpolate", "extrapolate"} and results["interpolate"]["count"] == 8
    assert len((run / "predictions_interpolate.jsonl").read_text().splitlines()) == 8
    assert (run / "checkpoints" / "latest").read_text().strip() == "step12"
    # the config as given (bf16 stays auto); what the run derived is beside it, in resolved.json
    from ntl_scale.training.config import load_config

    assert json.loads((run / "config.json").read_text()) == load_config(None, [f"run_dir={run}", *SHORT]).to_dict()
    resolved = json.loads((run / "resolved.json").read_text())
    # accumulation 1 on 2 data-parallel ranks of micro-batch 4, fp32 on the CPU
    assert {k: resolved[k] for k in ("world_size", "tensor_parallel", "data_parallel", "gradient_accumulation_steps",
                                     "global_batch", "bf16", "resume")} == {
        "world_size": 2, "tensor_parallel": 1, "data_parallel": 2, "gradient_accumulation_steps": 1,
        "global_batch": 8, "bf16": False, "resume": None}  # fmt: skip
    ds = resolved["deepspeed"]
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (8, 4)
    assert ds["bf16"] == {"enabled": False} and ds["gradient_accumulation_steps"] == 1
    assert "step 12/12" in out.stdout
    assert (run / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert list((run / "wandb").glob("offline-run-*")), "wandb logs offline by default"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ntl_scale

    model = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(run / "hf_model")
    assert sum(p.numel() for p in model.parameters()) == part["total"]  # every weight was gathered
    assert len(ntl_scale.NumberVocab.load(run / "hf_model" / "number_vocab.json")) == 10 and len(tokenizer) > 10


def _same_curve(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]  # no step lost or logged twice
    for x, y in zip(a, b):
        for key in ("ce", "ntl", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-6 * max(1.0, abs(x[key])), (key, x, y)


def test_resume_continues_the_same_curve(tmp_path, uninterrupted):
    """ZeRO-3: stopped at step 4 on 2 processes and resumed on 1 process (DeepSpeed's universal checkpoint
    re-partitions the weights and Adam's state; accumulation doubles to keep the global batch of 8), the curve
    is the uninterrupted run's; a changed global batch is told. (Resumed on the same layout:
    test_tensor_parallel_with_zero3_equals_one_process under ZeRO-3, test_resume_with_dropout_... under ZeRO-2.)"""
    common = RESUME_COMMON  # dropout off: its masks depend on how the batch is split over ranks
    parted = tmp_path / "parted"
    _train(parted, "train.steps=4", *common)
    written = _files(parted)
    ran = _mains(tmp_path, {
        # another global batch cannot continue the run: stopped before any step, saying what to set
        "other": [f"run_dir={parted}", "train.steps=12", *common, "train.global_batch_size=4"],
        # on 1 process with the same global batch (accumulation 2): the same curve to the end
        "one": [f"run_dir={parted}", "train.steps=12", *common],
    })  # fmt: skip
    assert (
        "written with 2 data-parallel x 1 tensor-parallel ranks, global batch 8; this run has 1 data-parallel x 1 "
        "tensor-parallel ranks, global batch 4. Set train.global_batch_size=8"
    ) in ran["other"]["error"], ran["other"]
    assert ran["other"]["files"]["metrics.jsonl"] == written["metrics.jsonl"]  # no step logged by the refused run
    assert ran["one"]["error"] is None, ran["one"]
    assert "converting its checkpoint to DeepSpeed's universal format" in ran["one"]["stdout"]
    assert "resumed from step 4" in ran["one"]["stdout"]
    _same_curve(_metrics(uninterrupted[0]), _metrics(parted))
    assert json.loads((parted / "checkpoints" / "layout.json").read_text())["data_parallel"] == 1
    # (started again once finished, a run says so and writes nothing: test_a_signal_at_the_last_step_...)


# the built-in GPT-2 with its dropout (0.1 on attention, residuals and embeddings), ZeRO-2, 2 processes x
# micro-batch 4
DROPOUT_COMMON = ("train.log_every=5", "eval.at_end=false", *UNREAD, "train.micro_batch_size=4",
                  "train.global_batch_size=8", "train.deepspeed_config=configs/deepspeed/zero2.json")  # fmt: skip


def test_resume_with_dropout_continues_the_same_curve(tmp_path):
    """Dropout on: each rank writes its generators next to its shards (``rng_rank{r}.pt``) and reads its
    own back, so 2 processes stopped at step 3 and resumed on 2 log the uninterrupted run's losses.
    ZeRO-2: DeepSpeed keeps the client state of data-parallel rank 0 only, whose CPU generator rank 1
    took before (its masks, hence the curve, changed); under ZeRO-3 each rank writes its own. The stop is a
    stop signal to rank 0 alone during step 3 of 6 (as Slurm's time-limit warning): both ranks checkpoint
    and stop there."""
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    _train(whole, "train.steps=6", *DROPOUT_COMMON)
    out = _train(parted, "train.steps=6", *DROPOUT_COMMON, env={"NTL_TEST_SIGNAL_AT_STEP": "3"})
    assert "checkpointed at step 3, stopping" in out.stdout
    assert json.loads((parted / "status.json").read_text()) == {"state": "stopped", "step": 3}
    assert [r["step"] for r in _metrics(parted)] == [1, 2, 3]
    saved = sorted(p.name for p in (parted / "checkpoints" / "step3").glob("rng_rank*"))
    assert saved == ["rng_rank0.pt", "rng_rank1.pt"]  # no temporary file left
    out = _train(parted, "train.steps=6", *DROPOUT_COMMON)
    assert "resumed from step 3\n" in out.stdout  # no note: every generator was restored
    _same_curve(_metrics(whole), _metrics(parted))


def test_a_signal_at_the_last_step_is_finished_on_restart(tmp_path):
    """A stop signal during the last step checkpoints and stops (status ``stopped``, nothing exported);
    started again, the run exports and evaluates without training, and its answers are those of the
    same run uninterrupted. So does a run that died after its last checkpoint (status ``running``); one
    whose checkpoint is past ``train.steps`` is refused. Started again once finished, it writes nothing with
    the same config and refuses a changed one (a new run_dir), keeping the run's record."""
    common = ("train.steps=3", "train.micro_batch_size=4", "data.eval_examples=8", "eval.max_new_tokens=4",
              "tracking.wandb=disabled", "tracking.plot=false",
              f"model.architecture={ARCHITECTURES['causal']}")  # fmt: skip
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    out = _train(parted, *common, nproc=1, env={"NTL_TEST_SIGNAL_AT_STEP": "3"})
    assert "checkpointed at step 3, stopping" in out.stdout
    assert json.loads((parted / "status.json").read_text()) == {"state": "stopped", "step": 3}
    assert not (parted / "eval.json").exists() and not (parted / "hf_model").exists()
    curve = (parted / "metrics.jsonl").read_text()
    record = ("config.json", "resolved.json", "eval.json", "metrics.jsonl", "status.json")
    ran = _mains(tmp_path, {
        "whole": [f"run_dir={whole}", *common],  # the same run uninterrupted: the answers to get
        "again": [f"run_dir={parted}", *common],
        "finished": [f"run_dir={parted}", *common],  # and now it is finished: nothing to do, nothing written
        # a changed config into the finished run: refused with the fix, its record kept (2000 -> 50 steps)
        "changed": [f"run_dir={parted}", *common[1:], "train.steps=2"],
    })  # fmt: skip
    assert ran["whole"]["error"] is None and ran["again"]["error"] is None and ran["finished"]["error"] is None, ran
    assert "every step is done (checkpoint at step 3); exporting and evaluating" in ran["again"]["stdout"]
    assert "already finished: its checkpoint is at step 3 of train.steps=3" in ran["finished"]["stdout"]
    told = ran["changed"]["error"]
    assert told and "already finished at step 3 with another config (train.steps: 3 -> 2)" in told, ran["changed"]
    assert "give this config a new run_dir" in told
    for name in ("finished", "changed"):
        assert {f: ran[name]["files"][f] for f in record} == {f: ran["again"]["files"][f] for f in record}, name
    assert json.loads((parted / "status.json").read_text()) == {"state": "finished", "step": 3}
    assert (parted / "metrics.jsonl").read_text() == curve  # no step trained or logged again
    assert json.loads((parted / "eval.json").read_text()) == json.loads((whole / "eval.json").read_text())
    for split in ("interpolate", "extrapolate"):
        name = f"predictions_{split}.jsonl"
        assert (parted / name).read_text() == (whole / name).read_text()
    assert (parted / "hf_model" / "config.json").is_file()
    assert json.loads((parted / "config.json").read_text())["train"]["steps"] == 3
    # a run that died after its last checkpoint (status still "running", as written when training starts)
    (parted / "status.json").write_text(json.dumps({"state": "running", "step": 0}))
    (parted / "eval.json").unlink()
    ran = _mains(tmp_path, {
        "past": [f"run_dir={parted}", *common[1:], "train.steps=2"],  # fewer steps than its checkpoint
        "died": [f"run_dir={parted}", *common],
    })  # fmt: skip
    assert "has a checkpoint at step 3, past train.steps=2, and was not finished (running)" in (
        ran["past"]["error"] or ""
    ), ran["past"]
    assert ran["died"]["error"] is None, ran["died"]
    assert "every step is done (checkpoint at step 3); exporting and evaluating" in ran["died"]["stdout"]
    assert json.loads((parted / "eval.json").read_text()) == json.loads((whole / "eval.json").read_text())


@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_gradient_accumulation_split_does_not_change_the_gradient(tmp_path, kind, uninterrupted):
    """The same global batch of 8 as 4 accumulated micro-batches of 1 on each of 2 processes, and whole: the
    same first-step gradient norm (CE and NTL normalised over the global batch, not per micro-batch or rank).
    Whole: for causal the first step of the uninterrupted run (2 processes x micro-batch 4; its first step's
    gradient does not depend on train.steps), for seq2seq one process with one micro-batch of 8. (A 2 x 2
    split adds nothing: padding within a micro-batch and accumulation over micro-batches each run here.)"""
    common = ("train.steps=1", "eval.at_end=false", *UNREAD, f"model.kind={kind}",
              f"model.architecture={ARCHITECTURES[kind]}")  # fmt: skip
    if kind == "causal":
        whole = _metrics(uninterrupted[0])[0]["grad_norm"]
    else:
        _train(tmp_path / "whole", *common, "train.micro_batch_size=8", "train.gradient_accumulation_steps=1", nproc=1)
        whole = _metrics(tmp_path / "whole")[0]["grad_norm"]
    _train(tmp_path / "split", *common, "train.micro_batch_size=1", "train.gradient_accumulation_steps=4")
    split = _metrics(tmp_path / "split")[0]["grad_norm"]
    assert whole > 0
    assert abs(split - whole) <= 1e-6 * whole, (whole, split)


# 3 steps of the built-in default (GPT-2 with dropout, ZeRO-3), micro-batch 4 on 2 processes
ELSEWHERE = ("train.steps=3", "train.micro_batch_size=4", "data.eval_examples=4", "eval.max_new_tokens=4")


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The run started from another directory without matplotlib and wandb: its folder and its output."""
    root = tmp_path_factory.mktemp("elsewhere")
    (root / "elsewhere").mkdir()
    out = _train(root / "run", *ELSEWHERE, cwd=root / "elsewhere", env={"NTL_TEST_ABSENT": "matplotlib,wandb"})
    return root / "run", out


def test_chunked_loss_matches_the_logits_path_under_zero3(tmp_path, elsewhere):
    """train.chunked_loss: CE + NTL from the hidden states, the output weight gathered by ZeRO-3; and
    ntl.ce_kernel=framework (torch's CE, NTL beside it) trains as the fused op.

    The logits path is the run of ``test_runs_from_another_directory_without_the_optional_packages``;
    the chunked run trains with its settings (no evaluation, wandb or plot: they come after the steps)."""
    _train(tmp_path / "chunked", *ELSEWHERE, "eval.at_end=false", *UNREAD,
           "train.chunked_loss=true", "train.loss_chunk_tokens=7")  # fmt: skip
    a, b = _metrics(elsewhere[0]), _metrics(tmp_path / "chunked")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for key in ("ce", "ntl", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-4 * abs(x[key]), (key, x, y)
    assert (tmp_path / "chunked" / "hf_model" / "config.json").exists()  # the plain HF model is exported
    # ntl.ce_kernel=framework: torch's CE on the logits (what the model's own loss runs), NTL beside it
    _train(tmp_path / "framework", *ELSEWHERE, "eval.at_end=false", *UNREAD,
           "ntl.ce_kernel=framework")  # fmt: skip
    for x, y in zip(a, _metrics(tmp_path / "framework"), strict=True):
        for key in ("ce", "ntl", "grad_norm", "number_acc"):
            assert abs(x[key] - y[key]) <= 1e-5 * abs(x[key]), (key, x, y)


# launch/train.py's main() once per case, in order, in one process (a one-rank world, as `python launch/train.py`
# starts): each case's exception with its traceback (None when it returned), what it printed, and the modification
# times of the files in its run_dir after it, written to a JSON file. Refusals that stop before any step, and
# several starts of one run and its reference (each a new world and DeepSpeed engine), need no process each (the
# exit status of a refusal on 2 ranks: test_tensor_parallel_refusals)
_MAINS = """
import io, json, os, sys, traceback

import torch.distributed as dist

from launch.train import main

cases, out = json.loads(open(sys.argv[1]).read()), {}
for name, overrides in cases.items():
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # set by the last case's one-rank start-up
        os.environ.pop(key, None)
    stdout, sys.stdout = sys.stdout, io.StringIO()
    try:
        main(overrides)
        error = None
    except BaseException:  # SystemExit too
        error = traceback.format_exc()
    printed, sys.stdout = sys.stdout.getvalue(), stdout
    print(printed, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    from deepspeed.utils import groups  # DeepSpeed keeps the groups of the world it saw: cleared for the next one

    for key, value in list(vars(groups).items()):
        if key.startswith("_") and key.endswith(("_GROUP", "_GROUP_RANKS")):
            setattr(groups, key, {} if isinstance(value, dict) else None)
    groups.mpu = groups.mesh_device = None
    run_dir = next(item.split("=", 1)[1] for item in overrides if item.startswith("run_dir="))
    files = {f: os.stat(os.path.join(run_dir, f)).st_mtime_ns for f in sorted(os.listdir(run_dir))
             if os.path.isfile(os.path.join(run_dir, f))} if os.path.isdir(run_dir) else {}
    out[name] = {"error": error, "stdout": printed, "files": files}
open(sys.argv[1] + ".out", "w").write(json.dumps(out))
"""


def _files(run_dir: Path) -> dict[str, int]:
    """The files directly in ``run_dir`` and their modification times (ns), as ``_MAINS`` records them."""
    return {p.name: p.stat().st_mtime_ns for p in sorted(run_dir.iterdir()) if p.is_file()}


def _mains(tmp_path: Path, cases: dict[str, list[str]]) -> dict[str, dict]:
    """``main(overrides)`` per case in one process: each case's ``error``, ``stdout`` and ``files`` (``_MAINS``), and
    ``stderr``, the whole process's (shared by its cases)."""
    script, spec = tmp_path / "mains.py", tmp_path / f"cases_{next(iter(cases))}.json"
    script.write_text(_MAINS)
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = run_launch([sys.executable, str(SHIM), str(script), str(spec)], cwd=ROOT, env=env, timeout=600)
    result = Path(f"{spec}.out")
    assert result.is_file(), done.stdout[-4000:] + done.stderr[-4000:]
    return {name: {**case, "stderr": done.stderr} for name, case in json.loads(result.read_text()).items()}


def _refused(tmp_path: Path, cases: dict[str, list[str]]) -> dict[str, str]:
    """Each case's error (traceback and message) from ``main(overrides)``; fails if a case trained."""
    ran = _mains(tmp_path, cases)
    assert all(ran[name]["error"] for name in cases), {name: "ran" for name in cases if not ran[name]["error"]}
    return {name: ran[name]["error"] for name in cases}


def test_bad_input_stops_before_training(tmp_path):
    """A typo, a DeepSpeed config against the run's batch, a missing data file, a tokenizer folder that is
    not there, a tensor-parallel size that does not divide the ranks: each stops with what to fix."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3}}))
    errors = _refused(tmp_path, {
        "typo": [f"run_dir={tmp_path / 'bad'}", "train.stpes=3"],
        "ds_config": [f"run_dir={tmp_path / 'bad2'}", f"train.deepspeed_config={ds}"],
        "data": [f"run_dir={tmp_path / 'bad3'}", "data.source=jsonl", f"data.train_path={tmp_path / 'missing.jsonl'}"],
        "tokenizer": [f"run_dir={tmp_path / 'bad4'}", "model.tokenizer=/nonexistent"],
        "odd": [f"run_dir={tmp_path / 'odd'}", *TP_CONFIG, "train.tensor_parallel_size=2"],
    })  # fmt: skip
    assert "did you mean 'train.steps'" in errors["typo"], errors["typo"]
    assert "train_micro_batch_size_per_gpu=3" in errors["ds_config"], errors["ds_config"]
    assert not (tmp_path / "bad2" / "metrics.jsonl").exists()
    assert "no such data file" in errors["data"], errors["data"]
    assert "is not a directory" in errors["tokenizer"] and "never downloads" in errors["tokenizer"], errors
    assert "Repo id" not in errors["tokenizer"], errors["tokenizer"]
    assert "does not divide the 1 ranks" in errors["odd"], errors["odd"]


def test_runs_from_another_directory_without_the_optional_packages(elsewhere):
    """As a new user with only ``ntl_scale[deepspeed]``: started elsewhere, no matplotlib, no wandb.

    The built-in default's ``configs/deepspeed/zero3.json`` resolves against the repository; the plot
    and the wandb log are skipped with one line each naming the extra; both ranks exit 0.
    """
    run, out = elsewhere
    assert out.returncode == 0
    assert "loss_curves.png skipped: matplotlib is not installed (pip install 'ntl_scale[wandb]')" in out.stdout
    assert "wandb offline log skipped" in out.stdout
    assert not (run / "loss_curves.png").exists()
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


TP_CONFIG = ("--config", str(ROOT / "configs" / "train" / "tiny_cpu_tp2.yaml"))
TP_COMMON = ("train.steps=3", "eval.at_end=false", *UNREAD, "train.log_every=1",
             "train.eval_every=3", "ntl.label_smoothing=0.1", "ntl.z_loss_weight=1e-3")  # fmt: skip


def _layout(run: Path, rank: int) -> dict:
    return json.loads((run / f"zero_rank{rank}.json").read_text())


def _agree(name: str, reference: list[dict], rows: list[dict]) -> None:
    """Per-step CE, NTL, number accuracy, gradient norm and z-loss, and the held-out metrics of step 3, equal the
    one-process ``reference`` (1e-5)."""
    for want, got in zip(reference[: len(rows)], rows, strict=True):
        for key in ("ce", "ntl", "number_acc", "grad_norm", "z_loss"):
            assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (name, key, want, got)
    for key in ("eval/ce", "eval/ppl", "eval/ntl", "eval/number_acc"):  # the held-out metrics of step 3
        assert abs(rows[2][key] - reference[2][key]) <= 1e-5 * max(1.0, reference[2][key]), (name, key)


def test_tensor_parallel_equals_one_process(tmp_path):
    """AutoTP with a vocabulary-parallel head: TP=2 x DP=2 trains as one process does.

    Same global batch of 4 sequences per step, a Llama-style model built from a config, ZeRO-1, the logits
    path (the one layout where the tensor-parallel group is not the world: the vocabulary reductions must use
    it; the chunked loss at TP=2: test_tensor_parallel_with_zero3_equals_one_process): per-step CE, NTL,
    number accuracy and gradient norm equal the one-process run (1e-5) for 3 steps, and for 2 more when the
    TP 2 x DP 2 run resumes as TP 1 x DP 2; the loss sees the local vocabulary shard (80 ids split 40/40); the
    exported Hugging Face model is whole. With label smoothing and a z-loss on, the logged ``z_loss`` agrees
    too, and the held-out ``eval/ce`` / ``eval/ppl`` / ``eval/ntl`` of step 3 equal the one-process run's
    (``tests/unit/test_deepspeed_heldout.py`` checks that one against float64 torch).
    """
    _train(tmp_path / "tp1", *TP_COMMON, *TP_CONFIG, "train.tensor_parallel_size=1", "train.micro_batch_size=4",
           "train.steps=5", nproc=1)  # fmt: skip
    reference = _metrics(tmp_path / "tp1")
    assert len(reference) == 5 and all(row["ntl"] > 0 for row in reference)
    assert "eval/ce" in reference[2] and "z_loss" in reference[0]
    run = tmp_path / "tp2_dp2"
    _train(run, *TP_COMMON, *TP_CONFIG, "train.micro_batch_size=2", nproc=4)
    layouts = [_layout(run, r) for r in range(4)]
    assert sorted((x["dp_rank"], tuple(x["vocab_shard"])) for x in layouts) == [
        (0, (0, 40)), (0, (40, 80)), (1, (0, 40)), (1, (40, 80))
    ]  # fmt: skip
    _agree("tp2_dp2", reference, _metrics(run))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    assert exported.lm_head.weight.shape[0] == 80
    # TP 2 x DP 2 stopped at step 3, resumed as TP 1 x DP 2: a universal checkpoint joins the shards
    resumed = _train(run, *TP_CONFIG, *TP_COMMON, "train.steps=5", "train.tensor_parallel_size=1",
                     "train.micro_batch_size=2", nproc=2)  # fmt: skip
    assert (
        "(written with 2 data-parallel x 2 tensor-parallel ranks, global batch 4) on 2 data-parallel x 1 "
        "tensor-parallel ranks, global batch 4"
    ) in resumed.stdout
    _agree("tp2_dp2_then_tp1_dp2", reference, _metrics(run))


def test_tensor_parallel_refusals(tmp_path):
    """A model AutoTP cannot split, on 2 ranks: the message, and a failed exit status (a size that does not
    divide the ranks: test_bad_input_stops_before_training)."""
    zero1 = "train.deepspeed_config=configs/deepspeed/zero1.json"
    out = _train(tmp_path / "gpt2", "train.tensor_parallel_size=2", zero1, "train.steps=1", check=False)
    assert out.returncode != 0 and "AutoTP cannot split GPT2LMHeadModel" in out.stdout + out.stderr


def test_tensor_parallel_with_zero3_equals_one_process(tmp_path):
    """AutoTP (vocabulary-parallel head) with ZeRO-3 (DeepSpeed >= 0.19.4) trains as one process does.

    Tied input and output embeddings, as in Granite and Llama 3.2 (AutoTP splits the embedding with
    the output layer's vocabulary rows; the export gathers the shared weight once). One process with
    ZeRO-3 (the same zero.Init initialisation) against TP=2 with ZeRO-3, run for 3
    steps and resumed on the same layout to 5, and TP=2 with the chunked loss (the output weight gathered by
    ZeRO-3): per-step CE, NTL, number accuracy, gradient norm and, with label smoothing and a z-loss on, the
    logged ``z_loss`` and the held-out metrics of step 3 agree (1e-5); each rank holds its vocabulary slice,
    and the two ranks together hold every weight once (ZeRO-3 partitions the weights AutoTP replicates); the
    greedy answers after training and the exported Hugging Face weights are the one-process run's.
    """
    zero3 = "train.deepspeed_config=configs/deepspeed/zero3.json"
    tied = "model.architecture.tie_word_embeddings=true"
    common = (*TP_CONFIG, zero3, tied, *UNREAD, "train.log_every=1", "train.micro_batch_size=4",
              "train.eval_every=3", "data.eval_examples=4", "ntl.label_smoothing=0.1",
              "ntl.z_loss_weight=1e-3")  # fmt: skip
    evaluate = ("eval.max_new_tokens=4",)
    _train(tmp_path / "tp1", *common, "train.tensor_parallel_size=1", "train.steps=5", *evaluate, nproc=1)
    _train(tmp_path / "tp2", *common, "train.steps=3", "eval.at_end=false")
    resumed = _train(tmp_path / "tp2", *common, "train.steps=5", *evaluate)
    assert "resumed from step 3" in resumed.stdout
    _train(tmp_path / "tp2_chunked", *common, "train.steps=3", "eval.at_end=false", "train.chunked_loss=true")
    reference = _metrics(tmp_path / "tp1")
    assert len(reference) == 5 and all(row["ntl"] > 0 for row in reference)
    assert "eval/ce" in reference[2] and "z_loss" in reference[0]
    for name in ("tp2", "tp2_chunked"):
        _agree(name, reference, _metrics(tmp_path / name))
        layouts = [_layout(tmp_path / name, r) for r in (0, 1)]
        assert [x["vocab_shard"] for x in layouts] == [[0, 40], [40, 80]]
        assert sum(x["held"] for x in layouts) == _layout(tmp_path / "tp1", 0)["total"]
    assert len(_metrics(tmp_path / "tp2")) == 5
    for split in ("interpolate", "extrapolate"):
        name = f"predictions_{split}.jsonl"
        assert (tmp_path / "tp2" / name).read_text() == (tmp_path / "tp1" / name).read_text()
    from safetensors.torch import load_file

    want = load_file(tmp_path / "tp1" / "hf_model" / "model.safetensors")
    got = load_file(tmp_path / "tp2" / "hf_model" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].shape == tensor.shape and (got[key] - tensor).abs().max() <= 1e-5, key
