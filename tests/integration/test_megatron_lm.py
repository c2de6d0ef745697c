"""``launch/pretrain_gpt_ntl.py`` against the real Megatron-LM releases (core_v0.16.1, core_v0.19.0) on CPU.

Every run is the checkout's own ``pretrain_gpt.py`` (directly, or under our drop-in) in 1 or 2
processes over gloo, with CUDA-only calls redirected by ``tests/helpers/megatron_lm_cpu.py``; the
per-iteration losses and gradient norm come from Megatron's own ``training_log`` at full precision.

Sections:
1. ``--ntl-weight 0`` (with the other ``--ntl-*`` flags given) logs exactly what plain ``pretrain_gpt.py``
   logs, bit for bit: training losses, gradient norms and evaluation, and the MTP losses to the 7 digits
   Megatron prints; TP=1, section 6's configuration with a learning rate, so iteration 2 and the evaluation
   see updated weights (the drop-in then hands Megatron the release's own ``forward_step`` itself,
   whatever the layout).
2. NTL on at TP=2: ``ntl loss`` and ``number accuracy`` are logged and the loss falls, a step without
   number tokens logs 0, the ignored ``--cross-entropy-loss-fusion`` is said once. The ``lm loss`` is
   Megatron's cross entropy: at TP=2 against Megatron's own fused CE (``--ntl-ce-kernel framework``,
   section 7), at TP=1 against plain Megatron (section 6).
3. Resume and global normalisation: a TP=1 run with ``--ntl-normalization global`` (micro-batch 2,
   ``torch_dist`` checkpoints) resumed from iteration 2 at another layout *and* another micro-batch split
   logs the uninterrupted run's losses and gradient norms (1e-5): the gradient of CE/T + 0.3 NTL/K
   depends on neither. As a control, the paper's per-micro-batch mean does move with the split.
4. Real data: an indexed dataset made by the release's ``tools/preprocess_data.py`` from our
   arithmetic text with a Hugging Face tokenizer built offline, the number table read from that
   tokenizer, data parallel 2, evaluation on: ``ntl loss`` is printed for validation without a perplexity.
5. Errors: a tokenizer without a token table (``NullTokenizer``) and no ``--ntl-number-vocab``.
6. Multi-token prediction with NTL and a z-loss (``--lr 0``: its evaluation compares initial weights).
7. ``--ntl-chunked`` trains like the logits route (at TP=2 and at TP=1); ``--ntl-ce-kernel framework``
   (the release's fused CE, NTL beside it) too, at TP=2.
8. The README's smallest command (the header of ``configs/megatron/tiny_cpu.yaml``), run as written
   through the CPU harness (plus its CPU-only flags), from this checkout.

Releases and layouts (pairwise, not a full cross product). Each release runs every path where our code meets
code that differs between releases: the drop-in's argument hook (``parse_and_validate_args`` since core
0.18, ``pretrain``'s ``extra_args_provider`` before), its ``pretrain``/``evaluate`` wrappers and the
weight-0 hand-over (section 1); the tokenizer look-up (``get_tokenizer``, else the release's
``build_tokenizer``) and the number table from the release's tokenizer classes (sections 2 and 4; section 5,
our refusal, on the newer release); the ``compute_language_model_loss`` hook on the release's ``GPTModel``
and ``loss_func`` (every NTL run); the release's schedule and micro-batch loss scaling at 1, 2 and 4
micro-batches, and its ``torch_dist`` checkpoint saved and loaded resharded (section 3); its
``preprocess_data.py`` and evaluation loop (section 4); its MTP heads and their loss scaling (section 6);
the chunked route's output-layer hook inside the release's ``GPTModel.forward`` and the release's own fused
CE (section 7); its ``training_log``, which every test parses. What does not depend on the release, our own
math at a layout, runs once per layout: the resumes run at PP=2 on both releases (the release's pipeline
schedule drives our step bookkeeping), at TP=1 on core_v0.16.1 and at TP=2 on core_v0.19.0 (TP=2 training
runs on both releases in sections 2 and 7), the chunked route at TP=1 on core_v0.16.1 and at TP=2 on
core_v0.19.0, and the control once. Each resume is also a split of the global batch (4 x 1 or 1 x 4 against
the uninterrupted run's 2 x 2), so one launch checks both.

Runs that several tests read are launched once per release (``Shared``, module-scoped): the NTL run at TP=2
(sections 2 and 7) and the TP=1 run that saves the checkpoint section 3 starts from (and section 7's TP=1
reference). Tests read their outputs and never write to them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.helpers import megatron_lm as mlm

pytestmark = pytest.mark.distributed

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--split", "100,0,0", "--eval-iters", "0",
        "--eval-interval", "1000"]  # fmt: skip


@pytest.fixture(scope="module")
def numbers_json(tmp_path_factory) -> str:
    """The number table of the NullTokenizer runs: ids 48-57 are the digits 0-9 (as in ASCII)."""
    from ntl_scale import NumberVocab

    path = tmp_path_factory.mktemp("vocab") / "numbers.json"
    table = {i: (str(i - 48) if 48 <= i < 58 else f"w{i}") for i in range(127)}
    NumberVocab.from_id_to_token(table, vocab_size=128).save(path)
    return str(path)


def _ok(run: mlm.Run) -> mlm.Run:
    assert run.returncode == 0 and run.trace, mlm.tail(run.output)
    return run


TP2 = ["--tensor-model-parallel-size", "2"]


class Shared:
    """The runs several tests compare against, launched on first use, once per release."""

    def __init__(self, root: Path, numbers_json: str) -> None:
        self.root, self.numbers_json = root, numbers_json
        self.ntl = ["--ntl-weight", "0.3", "--ntl-number-vocab", numbers_json]
        self.runs: dict[tuple[str, str], mlm.Run] = {}

    def _run(self, tag: str, name: str, script, args: list[str], nproc: int) -> mlm.Run:
        if (tag, name) not in self.runs:
            self.runs[tag, name] = _ok(mlm.run(tag, script, args, nproc=nproc, workdir=self.root / tag / name))
        return self.runs[tag, name]

    @staticmethod
    def mtp_args() -> list[str]:
        """A GPT with one MTP head, rope, ``--lr 0`` and an evaluation at iteration 2 (2 iterations, TP=1)."""
        return [*mlm.tiny_args(iters=2), *MOCK, "--mtp-num-layers", "1", "--position-embedding-type", "rope",
                "--lr", "0", "--split", "80,20,0", "--eval-interval", "2", "--eval-iters", "1"]  # fmt: skip

    def mtp_off(self, tag: str) -> mlm.Run:
        """The drop-in with ``--ntl-weight 0`` (and a number table given) on :meth:`mtp_args`, one process."""
        args = [*self.mtp_args(), "--ntl-weight", "0", "--ntl-number-vocab", self.numbers_json]
        return self._run(tag, "mtp_off", mlm.DROP_IN, args, 1)

    def ntl_tp2_args(self) -> list[str]:
        # Megatron's fused CE flag, which NTL replaces: the run must say so (once) and train as without it.
        return [*mlm.tiny_args(iters=8), *MOCK, *TP2, *self.ntl, "--cross-entropy-loss-fusion"]

    def ntl_tp2(self, tag: str) -> mlm.Run:
        """The drop-in at TP=2 with NTL-WAS (0.3) through the logits, 8 iterations."""
        return self._run(tag, "ntl_tp2", mlm.DROP_IN, self.ntl_tp2_args(), 2)

    def checkpoint_args(self, micro_batch: int = 2) -> list[str]:
        """The TP=1 run's arguments (NTL-MSE, global normalisation, micro-batch 2 of a global batch of 4),
        also those of the runs resumed from its checkpoint (without --save, with their own micro-batch)."""
        return [*mlm.tiny_args(iters=4, micro_batch=micro_batch, global_batch=4), *MOCK, *self.ntl, "--ntl-loss",
                "mse", "--ntl-normalization", "global"]  # fmt: skip

    def checkpointed(self, tag: str) -> tuple[mlm.Run, Path]:
        """The drop-in at TP=1 (one process), 4 iterations, a ``torch_dist`` checkpoint every 2; and its folder."""
        ckpt = self.root / tag / "ckpt"
        args = [*self.checkpoint_args(), "--save", str(ckpt), "--save-interval", "2"]
        return self._run(tag, "checkpointed", mlm.DROP_IN, args, 1), ckpt


@pytest.fixture(scope="module")
def shared(tmp_path_factory, numbers_json) -> Shared:
    return Shared(tmp_path_factory.mktemp("shared"), numbers_json)


def _close(a: dict[int, float], b: dict[int, float], rel: float) -> None:
    assert a.keys() == b.keys(), (a, b)
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=rel, abs_tol=rel), (k, a[k], b[k])


def _mtp_losses(run: mlm.Run) -> list[float]:
    """The ``mtp_1 loss`` values Megatron prints (its MTP loss tracker; not in ``training_log``'s loss_dict)."""
    return [float(v) for v in re.findall(r"mtp_1 loss: ([0-9.E+-]+)", run.output)]


@pytest.mark.parametrize("tag", mlm.RELEASES)
def test_ntl_off_is_plain_megatron(tag, tmp_path, shared):
    """Section 1: --ntl-weight 0 changes nothing, bit for bit: losses, gradient norms, evaluation; the MTP losses
    to the 7 digits Megatron prints.

    With weight 0 ``forward_step_from_args`` returns the release's ``forward_step`` itself and the
    evaluation wrapper passes Megatron's totals through: no code of ours depends on the layout there,
    so one layout covers it: TP=1 on section 6's configuration, with a learning rate (``--lr 1e-3``, not
    section 6's 0), so that iteration 2 and the evaluation see the weights after an update (a changed
    optimizer setting, such as a weight-decay default, shows there).
    """
    args = [*shared.mtp_args(), "--lr", "1e-3"]
    plain = _ok(mlm.run(tag, "pretrain_gpt.py", args, nproc=1, workdir=tmp_path / "plain"))
    off = _ok(mlm.run(tag, mlm.DROP_IN, [*args, "--ntl-weight", "0", "--ntl-number-vocab", shared.numbers_json],
                      nproc=1, workdir=tmp_path / "off"))  # fmt: skip
    assert [r["losses"] for r in off.trace] == [r["losses"] for r in plain.trace]
    assert off.grad_norms() == plain.grad_norms()
    assert off.validations == plain.validations and plain.validations, (off.validations, plain.validations)
    assert _mtp_losses(off) == _mtp_losses(plain) and _mtp_losses(plain), mlm.tail(plain.output)
    assert len(plain.trace) == 2


@pytest.mark.parametrize("tag", mlm.RELEASES)
def test_ntl_trains_at_tp2(tag, shared):
    """Section 2: NTL logged and falling at TP=2; the ignored fused-CE flag said once; a step without numbers is 0.

    That ``lm loss`` keeps the value of Megatron's cross entropy is checked against Megatron's own CE:
    at TP=2 its fused kernel (``test_framework_ce_kernel_beside_ntl``), at TP=1 plain Megatron
    (``test_multi_token_prediction``).
    """
    trained = shared.ntl_tp2(tag)
    assert " ntl loss: " in trained.output and "number accuracy" in trained.trace[0]["losses"]
    ignored = "--cross-entropy-loss-fusion (--cross-entropy-fusion-impl native) is ignored with --ntl-weight > 0"
    assert trained.output.count(ignored) == 1, mlm.tail(trained.output)  # said once, by rank 0 of 2
    ntl_losses = trained.losses("ntl loss")
    assert all(math.isfinite(v) and v >= 0 for v in ntl_losses.values()) and any(v > 0 for v in ntl_losses.values())
    # This data has a step without any number token (iteration 2): a defined 0, not 0 / 0 = NaN.
    assert ntl_losses[2] == 0.0, ntl_losses
    lm = trained.losses()
    assert lm[8] < lm[1] - 0.05, lm


PP2 = ["--pipeline-model-parallel-size", "2"]
# (release, layout name, processes, layout flags, micro-batch size): each release resumes at PP=2 and at one
# other layout; each resume also splits the global batch of 4 differently from the checkpoint's run (2 x 2).
OLDER, NEWER = mlm.RELEASES
RESUMES = [
    (OLDER, "tp1", 1, [], 4),
    (OLDER, "pp2", 2, PP2, 1),
    (NEWER, "tp2", 2, TP2, 4),
    (NEWER, "pp2", 2, PP2, 1),
]


def _resume(shared: Shared, tag: str, tmp_path: Path, nproc: int, layout: list[str], micro_batch: int,
            extra: tuple[str, ...] = ()) -> mlm.Run:  # fmt: skip
    """The checkpoint's run resumed from iteration 2 (to iteration 4: Megatron refuses another schedule length)."""
    _, ckpt = shared.checkpointed(tag)
    assert (ckpt / "iter_0000002").is_dir()
    args = [*shared.checkpoint_args(micro_batch), *layout, *extra, "--load", str(ckpt), "--ckpt-step", "2"]
    return _ok(mlm.run(tag, mlm.DROP_IN, args, nproc=nproc, workdir=tmp_path))


@pytest.mark.parametrize(
    ("tag", "name", "nproc", "layout", "micro_batch"), RESUMES, ids=[f"{r[0]}-{r[1]}-mbs{r[4]}" for r in RESUMES]
)
def test_resume_at_another_layout_and_split(tag, name, nproc, layout, micro_batch, tmp_path, shared):
    """Section 3: the TP=1, 2 x 2 run's checkpoint resumed at ``layout`` with another micro-batch split logs the
    uninterrupted run's losses and gradient norms (1e-5), with global normalisation.

    Iteration 3 of this data has number tokens in some micro-batches only (iteration 2 has none), so a
    per-micro-batch weighting would move its gradient (``test_micro_batch_mean_depends_on_the_split``).
    All splits start from one checkpoint: plain Megatron itself logs different first-step losses for
    micro-batch sizes 4 and 2 of the same samples when each run initialises its own model (measured here
    on both releases), so only a shared starting point isolates the loss.
    """
    whole, _ = shared.checkpointed(tag)
    resumed = _resume(shared, tag, tmp_path, nproc, layout, micro_batch)
    assert sorted(resumed.losses()) == [3, 4], resumed.trace
    assert resumed.losses("ntl loss")[3] > 0, resumed.trace
    for key in ("lm loss", "ntl loss"):
        _close(resumed.losses(key), {k: v for k, v in whole.losses(key).items() if k > 2}, 1e-5)
    _close(resumed.grad_norms(), {k: v for k, v in whole.grad_norms().items() if k > 2}, 1e-5)


def test_micro_batch_mean_depends_on_the_split(tmp_path, shared):
    """Section 3's control: the paper's per-micro-batch NTL mean weighs number tokens by their micro-batch, so at
    1 x 4 its iteration-3 gradient differs from the global one (which every split shares). Our math alone: one
    release."""
    tag = mlm.RELEASES[0]
    whole, _ = shared.checkpointed(tag)
    per_micro_batch = _resume(shared, tag, tmp_path, 1, [], 1, ("--ntl-normalization", "micro-batch"))
    assert per_micro_batch.losses("ntl loss")[3] > 0, per_micro_batch.trace
    norm, reference = per_micro_batch.grad_norms()[3], whole.grad_norms()[3]
    assert not math.isclose(norm, reference, rel_tol=1e-4), (norm, reference)


def _arithmetic_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """JSONL of arithmetic text and a Hugging Face tokenizer (single characters) built from it, offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ntl_scale.data import arithmetic

    lines = [f"{e.question} {e.answer}" for e in arithmetic.generate(400, seed=3)]
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eod>"]))
    folder = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eod>").save_pretrained(folder)
    return data, folder


@pytest.mark.parametrize("tag", mlm.RELEASES)
def test_real_data_tokenizer_and_evaluation(tag, tmp_path):
    """Section 4: preprocess_data.py + a Hugging Face tokenizer + evaluation (DP=2), numbers read from the tokenizer."""
    data, tokenizer = _arithmetic_corpus(tmp_path)
    prefix = tmp_path / "arith"
    done = mlm.run_tool(
        tag, "tools/preprocess_data.py",
        ["--input", str(data), "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", str(tokenizer), "--append-eod", "--workers", "1"],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    args = [*mlm.tiny_args(iters=4), "--data-path", f"{prefix}_text_document", "--split", "90,10,0",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
            "--eval-interval", "2", "--eval-iters", "1", "--ntl-weight", "0.3"]  # fmt: skip
    trained = _ok(mlm.run(tag, mlm.DROP_IN, args, nproc=2, workdir=tmp_path))
    assert all(r["losses"]["ntl loss"] > 0 for r in trained.trace), trained.trace  # digits in every step
    validation = [line for line in trained.output.splitlines() if "validation (ntl_scale)" in line]
    assert validation and "ntl loss: " in validation[0] and "number accuracy: " in validation[0], mlm.tail(
        trained.output
    )
    assert "ntl loss PPL" not in trained.output and "lm loss PPL" in trained.output


def test_null_tokenizer_needs_a_table(tmp_path):
    """Section 5: NullTokenizer has no token table: the error names the shipped placeholder table and the fix."""
    args = [*mlm.tiny_args(iters=1), *MOCK, "--ntl-weight", "0.3"]
    failed = mlm.run(mlm.RELEASES[-1], mlm.DROP_IN, args, nproc=1, workdir=tmp_path)
    assert failed.returncode != 0
    message = "has no token table (NotImplementedError"
    assert message in failed.output and "--ntl-number-vocab PATH" in failed.output, mlm.tail(failed.output)
    # mock data has no tokenizer to build a table from: the advice is the shipped table, or one from ids
    assert "--ntl-number-vocab configs/megatron/null_tokenizer_numbers.json" in failed.output
    assert "NumberVocab.from_id_to_token" in failed.output and "save_number_vocab" not in failed.output


TINY = mlm.ROOT / "configs" / "megatron" / "tiny_cpu.yaml"


def header_command(path: Path, script: str) -> list[str]:
    """The ``torchrun ... SCRIPT ...`` command of a config's header comment, joined across its ``\\`` lines."""
    lines = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
    first = next(i for i, line in enumerate(lines) if line.startswith(f"torchrun --nproc_per_node 1 {script}"))
    words: list[str] = []
    for line in lines[first:]:
        words += line.removesuffix("\\").split()
        if not line.endswith("\\"):
            return words
    return words


@pytest.mark.parametrize("tag", mlm.RELEASES)
def test_readme_command_runs_as_written(tag, tmp_path):
    """Section 8: the smallest Megatron-LM command of README.md and docs/megatron.md trains from this checkout.

    Taken from the header of configs/megatron/tiny_cpu.yaml (the README's row points there and
    docs/megatron.md prints it); ``torchrun`` becomes ``torch.distributed.run`` with the CPU harness before
    the script, and only the harness's CPU flags are added.
    """
    command = header_command(TINY, "launch/pretrain_gpt_ntl.py")
    assert "$(" not in " ".join(command), command  # one command, nothing for a shell to lose
    written = " ".join(command)
    docs = " ".join((mlm.ROOT / "docs" / "megatron.md").read_text().replace("\\\n", " ").split())
    assert written in docs, f"docs/megatron.md does not print the header's command: {written}"
    assert "configs/megatron/tiny_cpu.yaml" in (mlm.ROOT / "README.md").read_text()
    assert command[:3] == ["torchrun", "--nproc_per_node", "1"]
    run = mlm.run(tag, command[3], [*command[4:], *mlm.CPU_FLAGS], nproc=1, workdir=tmp_path, cwd=mlm.ROOT,
                  torchrun=True)  # fmt: skip
    assert run.returncode == 0 and run.trace, mlm.tail(run.output)
    assert sorted(run.losses()) == list(range(1, 31)), run.trace  # train-iters 30 from the config
    ntl = run.losses("ntl loss")
    assert any(v > 0 for v in ntl.values()), ntl  # the shipped table's digits are trained on
    assert run.validations and "ntl loss" in run.validations[0], run.validations  # --eval-interval 10


@pytest.mark.parametrize(("tag", "layout"), [(OLDER, "tp1"), (NEWER, "tp2")])
def test_chunked_route_matches_logits_route(tag, layout, tmp_path, shared):
    """Section 7: --ntl-chunked (CE + NTL from hidden states, no logits) trains like the logits route (1e-5).

    The route's hook into the release's ``GPTModel.forward`` runs on both releases; its vocabulary-parallel
    math is ours, so each layout runs once: at TP=2 against section 2's NTL run (NTL-WAS, micro-batch
    normalisation, 8 iterations), at TP=1 against section 3's uninterrupted run (NTL-MSE, global
    normalisation, 4 iterations), each with the reference's arguments.
    """
    if layout == "tp2":
        args, reference, nproc = shared.ntl_tp2_args(), shared.ntl_tp2(tag), 2
    else:
        args, reference, nproc = shared.checkpoint_args(), shared.checkpointed(tag)[0], 1
    chunked = _ok(mlm.run(tag, mlm.DROP_IN, [*args, "--ntl-chunked", "--ntl-chunk-tokens", "24"], nproc=nproc,
                          workdir=tmp_path))  # fmt: skip
    for key in ("lm loss", "ntl loss", "number accuracy"):
        _close(chunked.losses(key), reference.losses(key), 1e-5)
    _close(chunked.grad_norms(), reference.grad_norms(), 1e-5)


@pytest.mark.parametrize("tag", mlm.RELEASES)
def test_framework_ce_kernel_beside_ntl(tag, tmp_path, shared):
    """Section 7: --ntl-ce-kernel framework (the release's own fused CE, NTL beside it) trains like the logits
    route at TP=2.

    The logits route is section 2's NTL run at TP=2 (8 iterations); this run has its arguments. Its step-1
    ``lm loss`` is Megatron's own CE on the same weights: the logits route's CE value against Megatron's at TP=2.
    """
    args = shared.ntl_tp2_args()
    logits = shared.ntl_tp2(tag)
    # Megatron's own fused CE (--cross-entropy-loss-fusion, native) runs, NTL beside it from the logits shard.
    # Step 1 (the same weights): the fused op's losses (1e-6); Megatron's native kernel returns its CE gradient
    # in bfloat16, so the gradient norms and the later steps agree to that rounding (1e-3). No number accuracy
    # (the arg-max among the number columns is logged as number choice accuracy), nothing ignored.
    framework = _ok(mlm.run(tag, mlm.DROP_IN, [*args, "--ntl-ce-kernel", "framework"], nproc=2, workdir=tmp_path))
    for key in ("lm loss", "ntl loss"):
        _close({1: framework.losses(key)[1]}, {1: logits.losses(key)[1]}, 1e-6)
        _close(framework.losses(key), logits.losses(key), 1e-3)
    _close(framework.grad_norms(), logits.grad_norms(), 1e-3)
    assert "number accuracy" not in framework.trace[0]["losses"] and "is ignored" not in framework.output
    choice = framework.losses("number choice accuracy")
    assert choice.keys() == logits.losses().keys() and all(0 <= v <= 1 for v in choice.values()), choice


@pytest.mark.parametrize("tag", mlm.RELEASES)
def test_multi_token_prediction(tag, tmp_path, shared):
    """Section 6: MTP heads train with NTL on their own labels: the logged main and MTP losses stay Megatron's CE.

    The NTL run has a z-loss too: the training ``lm loss`` and ``mtp_1 loss`` are the cross entropy without it
    (plain Megatron's, the reference: the weight-0 run, which section 1 shows is plain ``pretrain_gpt.py``),
    the z-loss is logged as ``z loss`` of its own, and Megatron's own evaluation (no gradient,
    ``model.eval()``) reports the plain cross entropy: with ``--lr 0`` both runs keep their initial weights,
    so the validation ``lm loss`` (and its perplexity) equals plain Megatron's.
    """
    off = shared.mtp_off(tag)
    z_loss = ["--ntl-z-loss-weight", "0.01"]
    on = _ok(mlm.run(tag, mlm.DROP_IN, [*shared.mtp_args(), *shared.ntl, *z_loss], nproc=1, workdir=tmp_path))
    assert _mtp_losses(off) and _mtp_losses(on)[0] == _mtp_losses(off)[0], (_mtp_losses(on), _mtp_losses(off))
    _close({1: on.losses()[1]}, {1: off.losses()[1]}, 1e-6)
    assert on.losses("ntl loss")[1] > 0
    assert not math.isclose(on.grad_norms()[1], off.grad_norms()[1], rel_tol=1e-3)  # NTL reaches the gradient
    # the z-loss, 0.01 * lse**2 with lse about log(128) at initialisation, logged on its own
    z = on.losses("z loss")
    assert set(z) == {1, 2} and all(0.01 * 3.0**2 < v < 0.01 * 7.0**2 for v in z.values()), z
    assert "z loss" not in off.trace[0]["losses"]
    # Megatron's evaluation: the plain cross entropy, as plain Megatron's; no z-loss in it
    assert on.validations and len(on.validations) == len(off.validations), (on.validations, off.validations)
    plain = dict(enumerate(v["lm loss"] for v in off.validations))
    _close(dict(enumerate(v["lm loss"] for v in on.validations)), plain, 1e-6)
    assert all("z loss" not in v for v in on.validations) and any(v["ntl loss"] > 0 for v in on.validations)
