"""torchtitan's own trainer with CE + NTL on CPU over gloo, 2 processes (``ntl_scale.integrations.torchtitan``).

Every run is ``config.build()`` + torchtitan's ``train_step`` (``tests/helpers/torchtitan_step.py``,
the CPU patches of ``tests/helpers/torchtitan_cpu.py``) on the llama3 debug model, 3 steps of
2 x 32 tokens per rank, ``ChunkedLossWrapper`` with 4 chunks, the configs users run
(``llama3_debugmodel`` and ``llama3_debugmodel_ntl``), a tokenizer and a corpus built offline.
Two layouts (module-scoped): FSDP2 (``dp_shard 2``) launched three times (torchtitan's CE, NTL at weight 0,
NTL at 0.3), tensor parallel 2 (vocabulary-sharded DTensor logits) once (NTL at 0.3). ``loss.ce_kernel=framework``
(torchtitan's CE reading NTL's passthrough) is not launched here: ``tests/distributed/test_torchtitan_shards.py``
checks it at TP 2 on DTensor ``Shard(-1)`` logits and inside ``ChunkedLossWrapper`` (loss, gradients,
``ntl_mean``), ``tests/unit/test_torchtitan_loss.py`` its every variant and logged metric names; the trainer
around it is this module's TP 2 run's.

Sections:
1. NTL at weight 0: torchtitan's logged loss is its own CE run's, bit for bit, step by step, on FSDP2's
   plain logits (on DTensor logits: ``tests/distributed/test_torchtitan_shards.py``, and torchtitan's own
   ``test_loss_parallel_cross_entropy_parity`` at weight 0 in ``tests/integration/test_torchtitan_upstream.py``:
   loss and gradients ``torch.equal`` to ``loss_parallel``).
2. NTL at 0.3 with label smoothing 0.1 and z-loss 1e-3: the step-1 loss, the ``lm_head`` gradient and the
   logged ``ce`` (smoothed, without the z-loss) / ``z_loss`` / ``ntl`` equal a one-process float64
   computation from the gathered hidden states, labels and weight (torch's ``F.cross_entropy`` with
   ``label_smoothing``, ``logsumexp``, ``tests/helpers/reference.py``: global counts of the step); torchtitan's
   own ``Validator`` (run after step 1) logs the **plain** CE of its batches' logits, torch's
   ``F.cross_entropy`` in float64 on the same logits (no smoothing, no z-loss).
3. ``llama3_3b_ntl`` (the Llama-3.2-3B shape, Llama 3's multi-digit number table) steps at reduced
   width and depth (``tests.helpers.torchtitan_cpu.small_llama3``: vocabulary, tying and RoPE kept), in
   one process with torchtitan's default ``spmd_backend``: the logged loss is ``ce + 0.3 * ntl`` and falls.
4. The README's command as written (``launch/torchtitan_assets.py``, then ``torchtitan.train`` at 2 ranks
   with ``partial_dtensor``), only the CPU patches and a shorter run added.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import reference
from tests.helpers.distributed import free_port, run_launch

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 (scripts/setup.sh --dev)")

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
WEIGHT = 0.3
SMOOTHING, Z_LOSS = 0.1, 1e-3  # the CE features of the weight-0.3 runs
NTL_FEATURES = ["--loss.loss-fn.label_smoothing", str(SMOOTHING), "--loss.loss-fn.z_loss_weight", str(Z_LOSS)]
SAVE_HF = ["--checkpoint.enable", "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"]
VALIDATOR = ["--validator.enable", "--validator.steps", "1", "--validator.freq", "1000"]  # after step 1 only
# partial_dtensor: torch 2.13's FSDP2 cannot shard spmd_types' plain parameters (docs/torchtitan.md)
MULTI = [
    "--override.imports",
    "tests.helpers.torchtitan_cpu.sdpa_attention",
    "--parallelism.spmd_backend",
    "partial_dtensor",
]
LAYOUTS = {
    "fsdp2": [*MULTI, "--parallelism.data_parallel_shard_degree", "2"],
    "tp2": [*MULTI, "--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A byte-level BPE tokenizer (single-digit number tokens) and an arithmetic corpus, built offline."""
    from tests.helpers import tokenizers

    root = tmp_path_factory.mktemp("torchtitan_assets")
    tokenizers.byte_level_bpe().save_pretrained(root / "tokenizer")
    tokenizers.llama3_style_bpe().save_pretrained(root / "llama3_tokenizer")  # 1-3 digit number tokens
    (root / "data").mkdir()
    with open(root / "data" / "train.jsonl", "w") as f:
        for line in tokenizers.corpus(400):
            f.write(json.dumps({"text": line}) + "\n")
    return {
        "tokenizer": str(root / "tokenizer"),
        "llama3_tokenizer": str(root / "llama3_tokenizer"),
        "data": str(root / "data"),
        "out": str(root),
    }


def _launch(
    assets: dict[str, str],
    tag: str,
    module: str,
    config: str,
    extra: list[str],
    *,
    nproc: int = 2,
    tokenizer: str = "tokenizer",
    validate: bool = False,
    save_hf: bool = False,
) -> list[dict]:
    validator = (
        [*VALIDATOR, "--validator.dataloader.dataset", "c4_test", "--validator.dataloader.dataset_path", assets["data"]]
        if validate
        else ["--validator.no-enable"]
    )
    args = [
        "--module", module, "--config", config,
        "--hf_assets_path", assets[tokenizer], "--dataloader.dataset_path", assets["data"],
        "--dump_folder", str(Path(assets["out"]) / f"{tag}_outputs"),
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(STEPS),
        "--training.disable_cuda_graphs", *(SAVE_HF if save_hf else ["--checkpoint.no-enable"]), *validator,
        "--training.mixed_precision_param", "float32", "--training.max_norm", "1e9", "--debug.seed", "7",
        "--loss.num-chunks", "4", *extra, "activation-checkpoint:none",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port]
    helper = str(ROOT / "tests" / "helpers" / "torchtitan_step.py")
    proc = run_launch([*cmd, helper, assets["out"], tag, *args], env=env, timeout=400, cwd=ROOT)
    if proc.returncode:
        raise AssertionError(f"torchtitan run {tag} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [torch.load(Path(assets["out"]) / f"{tag}.rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request: pytest.FixtureRequest, assets: dict[str, str]) -> dict[str, object]:
    layout = request.param
    extra = LAYOUTS[layout]
    ntl = "ntl_scale.integrations.torchtitan"
    return {
        "layout": layout,
        "hf": str(Path(assets["out"]) / f"{layout}_ntl_outputs" / "checkpoint" / f"step-{STEPS}"),  # SAVE_HF's
        # weight 0 against torchtitan's own CE on plain logits (DTensor logits: the upstream parity test)
        "ce": _launch(assets, f"{layout}_ce", "llama3", "llama3_debugmodel", extra) if layout == "fsdp2" else None,
        "ntl0": _launch(assets, f"{layout}_ntl0", ntl, "llama3_debugmodel_ntl", [*extra, "--loss.loss-fn.weight", "0"])
        if layout == "fsdp2"
        else None,
        "ntl": _launch(
            assets,
            f"{layout}_ntl",
            ntl,
            "llama3_debugmodel_ntl",
            [*extra, "--loss.loss-fn.weight", "0.3", *NTL_FEATURES],
            validate=True,
            save_hf=True,
        ),
        "tokenizer": assets["tokenizer"],
    }


# ------------------------------------------------------------------------ 1. weight 0 = torchtitan's CE


def test_weight_zero_logs_torchtitans_own_ce_loss(runs: dict) -> None:
    if runs["ce"] is None:
        pytest.skip("launched in the fsdp2 layout only (DTensor logits at weight 0: test_torchtitan_upstream.py)")
    ce, ntl0 = runs["ce"][0]["losses"], runs["ntl0"][0]["losses"]
    assert len(ce) == len(ntl0) == STEPS
    # At weight 0 NTLLoss computes the loss with torchtitan's own CE op: the same bits at every step.
    assert ntl0 == ce, (ntl0, ce)
    assert runs["ce"][0]["losses"] == runs["ce"][1]["losses"]  # every rank logs the global loss


# ------------------------------------------------------------------------ 2. NTL = float64 reference


def _reference(runs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step-1 loss, lm_head gradient, smoothed CE, z-loss and NTL in float64 from the gathered inputs of the loss.

    CE: torch's ``F.cross_entropy(..., label_smoothing)``; z-loss: ``Z_LOSS * logsumexp**2``; NTL: the
    reference's full-vocabulary softmax over the number tokens; each a mean over the step's global count."""
    from transformers import AutoTokenizer

    from ntl_scale import NumberVocab

    ranks = runs["ntl"]
    if runs["layout"] == "fsdp2":  # each rank its own micro-batch
        hidden = torch.cat([r["hidden"] for r in ranks]).double()
        labels = torch.cat([r["labels"] for r in ranks])
    else:  # tensor parallel: the same batch on both ranks
        torch.testing.assert_close(ranks[0]["hidden"], ranks[1]["hidden"], rtol=0, atol=0)
        hidden, labels = ranks[0]["hidden"].double(), ranks[0]["labels"]
    weight = ranks[0]["weight"].double().requires_grad_(True)
    vocab = NumberVocab.from_tokenizer(AutoTokenizer.from_pretrained(runs["tokenizer"]), vocab_size=weight.shape[0])
    logits = hidden @ weight.T
    _, ntl, mask = reference.naive_per_token(logits, labels, vocab)
    valid = labels != -100
    tokens, numbers = valid.sum(), mask.sum()
    assert numbers > 0
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    ce_mean = F.cross_entropy(flat, targets, label_smoothing=SMOOTHING, reduction="sum") / tokens
    z_mean = Z_LOSS * torch.logsumexp(flat, -1)[valid.reshape(-1)].square().sum() / tokens
    ntl_mean = ntl.sum() / numbers
    loss = ce_mean + z_mean + WEIGHT * ntl_mean
    loss.backward()
    return loss.detach(), weight.grad, ce_mean.detach(), z_mean.detach(), ntl_mean.detach()


def _close(value: float, expected: torch.Tensor) -> None:
    """A float32 run's number against its float64 reference: float32 rounding of sums of a few hundred terms."""
    torch.testing.assert_close(torch.tensor(value, dtype=torch.float64), expected, rtol=1e-5, atol=0)


def test_ntl_loss_and_gradient_equal_float64_reference(runs: dict) -> None:
    loss, grad, ce, z_loss, ntl = _reference(runs)
    rank0 = runs["ntl"][0]
    _close(rank0["losses"][0], loss)
    torch.testing.assert_close(rank0["grad"].double(), grad, rtol=1e-4, atol=1e-6)
    logged = next(m for m in rank0["logged"] if "loss_metrics/ce_mean" in m)  # NTLTrainer's log of step 1
    _close(logged["loss_metrics/ce_mean"], ce)  # the smoothed CE, without the z-loss
    _close(logged["loss_metrics/z_loss_mean"], z_loss)
    _close(logged["loss_metrics/ntl_mean"], ntl)
    assert 0 <= logged["loss_metrics/number_accuracy_mean"] <= 1
    assert runs["ntl"][1]["grad"].equal(rank0["grad"])  # gathered: the same full gradient on both ranks


def test_validator_logs_the_plain_cross_entropy(runs: dict) -> None:
    """torchtitan's Validator calls the loss (label smoothing and z-loss on) under no grad without a count:
    its logged loss is the plain CE of its batches' logits (torch's F.cross_entropy in float64)."""
    ranks = runs["ntl"]
    batches = [r["validation"][0] for r in ranks]
    assert all(b["step"] == 1 for b in batches) and all(len(r["validation"]) == 1 for r in ranks)
    if runs["layout"] == "tp2":  # tensor parallel: one batch, the same on both ranks
        torch.testing.assert_close(batches[0]["logits"], batches[1]["logits"], rtol=0, atol=0)
        batches = batches[:1]
    ce_sum = sum(
        F.cross_entropy(b["logits"].double().flatten(0, 1), b["labels"].flatten(), reduction="sum") for b in batches
    )
    tokens = sum((b["labels"] != -100).sum() for b in batches)
    expected = ce_sum / tokens
    for rank in ranks:
        (logged,) = [m["validation_metrics/loss"] for m in rank["logged"] if "validation_metrics/loss" in m]
        _close(logged, expected)


# ------------------------------------------------------------------------ 3. the 3B shape, reduced


def test_llama3_3b_shape_steps_at_reduced_size(assets: dict[str, str]) -> None:
    extra = ["--override.imports", "tests.helpers.torchtitan_cpu.small_llama3"]
    (run,) = _launch(
        assets, "3b", "ntl_scale.integrations.torchtitan", "llama3_3b_ntl", extra, nproc=1, tokenizer="llama3_tokenizer"
    )
    assert run["weight"].shape == (128256, 64)  # the 3B vocabulary, reduced width
    logged = [m for m in run["logged"] if "loss_metrics/ce_mean" in m]
    assert len(logged) == len(run["losses"]) == STEPS
    for loss, metrics in zip(run["losses"], logged):
        combined = metrics["loss_metrics/ce_mean"] + WEIGHT * metrics["loss_metrics/ntl_mean"]
        assert metrics["loss_metrics/ntl_mean"] > 0
        assert abs(loss - combined) <= 1e-5 * loss
    assert run["losses"][-1] < run["losses"][0]


# 4. The README's command, as written, on CPU ----------------------------------------------------------


def test_readme_command_runs_on_cpu(tmp_path: Path) -> None:
    """README's torchtitan block: its asset builder, then its trainer command with the CPU patches added.

    Only what CPU needs is added (the patched entry, SDPA, no CUDA graphs) and the run shortened; every
    flag of the README is kept, so a wrong flag or a missing asset fails here."""
    from tests.helpers.docs_commands import commands

    build, train = commands("README.md", "torchtitan")
    assert build.startswith("python launch/torchtitan_assets.py /tmp/ntl_torchtitan"), build
    prefix = "torchrun --nproc_per_node 2 -m torchtitan.train "
    assert train.startswith(prefix) and "--parallelism.spmd_backend partial_dtensor" in train, train
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    build = build.replace("/tmp/ntl_torchtitan", str(tmp_path)).split()
    proc = run_launch([sys.executable, *build[1:]], env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    args = train[len(prefix) :].replace("/tmp/ntl_torchtitan", str(tmp_path)).split()
    cpu = [
        "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.disable_cuda_graphs", "--override.imports", "tests.helpers.torchtitan_cpu.sdpa_attention",
        "--dump_folder", str(tmp_path / "outputs"),
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = run_launch([*cmd, "tests/helpers/torchtitan_cpu.py", *args, *cpu], env=env, timeout=400, cwd=ROOT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    steps = [line for line in log.splitlines() if " ntl: " in line and " ce: " in line]
    assert len(steps) == 4, log[-4000:]  # 2 steps x 2 ranks log ce, ntl and number accuracy
    ntl = [float(line.split(" ntl: ")[1].split()[0]) for line in steps]
    assert all(0 < v < 20 for v in ntl), ntl  # the digit table came from the built tokenizer: NTL positions exist


# 5. The last step in HF safetensors, in transformers and lm-evaluation-harness -----------------------


def _hf_folder(runs: dict) -> str:
    """The weight-0.3 run's last step as torchtitan saved it (``SAVE_HF``), completed by
    ``launch/torchtitan_to_hf.py`` with the run's model config and tokenizer."""
    from launch.torchtitan_to_hf import complete

    ntl = "ntl_scale.integrations.torchtitan"
    if not os.path.isfile(os.path.join(runs["hf"], "config.json")):
        complete(
            runs["hf"], ["--module", ntl, "--config", "llama3_debugmodel_ntl", "--hf_assets_path", runs["tokenizer"]]
        )
    return runs["hf"]


def test_last_step_in_hf_gives_torchtitans_logits(runs: dict) -> None:
    """``transformers``' ``LlamaForCausalLM`` on the exported folder gives the logits torchtitan's own
    trained model (FSDP2 or tensor parallel) gave after its last step, on each rank's tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_hf_folder(runs), dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    for rank in runs["ntl"]:
        final = rank["final"]
        with torch.no_grad():
            logits = model(final["tokens"]).logits
        assert logits.shape == final["logits"].shape
        # float32, two kernels: about 1e-6 apart here; a config without the Llama 3 RoPE scaling is 8e-5 off
        torch.testing.assert_close(logits, final["logits"], rtol=0, atol=1e-5)


def test_last_step_in_hf_runs_the_harness(runs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exported folder through lm-evaluation-harness's ``hf`` model, offline: one generation task and
    one number-perplexity task of the ``ntl_numeracy`` group, two examples each, give their metrics (the
    whole group runs on a tiny GPT-2 in tests/integration/test_lm_eval_harness.py; one layout here: the
    folder format is the same)."""
    if runs["layout"] != "fsdp2":
        pytest.skip("the harness runs on one layout's export (the folder format is the same)")
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from ntl_scale.eval.tasks import prepare

    folder = _hf_folder(runs)
    tasks = os.path.join(os.path.dirname(folder), "tasks")
    prepare(tasks, examples=4, texts=2)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = ["ntl_arith_sub", "ntl_ppl_integers_split"]
    out = simple_evaluate(model="hf", model_args=f"pretrained={folder}", device="cpu", tasks=names,
                          task_manager=TaskManager(include_path=tasks), limit=2, batch_size=4,
                          gen_kwargs="max_gen_toks=8")  # fmt: skip
    arith, ppl = out["results"]["ntl_arith_sub"], out["results"]["ntl_ppl_integers_split"]
    assert 0 <= arith["exact_match,none"] <= 1 and 0 <= arith["parsed,none"] <= 1 and "abs_error,none" in arith
    for metric in ("bits_per_byte", "number_bits_per_byte", "text_bits_per_byte"):
        assert ppl[f"{metric},none"] > 0, ppl
