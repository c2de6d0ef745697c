"""Device-correctness of ``launch/train.py`` on the CPU: no host tensor reaches the model or a collective.

On a CPU a forgotten ``.to(device)`` goes unnoticed; on a GPU the model gets CPU ``input_ids`` and NCCL
refuses CPU tensors. ``tests/helpers/host_guard.py`` makes the omission fail here: collated batches and
tensors the loop creates without ``device=`` are ``HostOnly`` tensors, usable only after a device move,
and the collectives refuse them (checked to fail on the pre-Trainer ``launch/train.py``).

Sections:
1. The guard itself: a use raises, a device move returns a plain tensor, a collective refuses it.
2. Real two-process DeepSpeed runs under the guard: the logits path (ZeRO-3, accumulation 2, held-out
   evaluation, generation), the chunked loss, AutoTP's vocabulary-parallel path (TP=2), and packed
   text pretraining (``collate_packed`` batches with ``position_ids``, held-out text batches).
3. The megatron.core example (TP = 2 x PP = 2) under the guard: run by
   ``tests/integration/test_megatron_example.py``, whose 30-step run is guarded (one launch for both).
4. Model FLOPs under AutoTP count the whole model, not a rank's slice, read off section 2's TP=2 run (one
   launch for both; the guard changes no count).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import free_port, run_launch
from tests.helpers.host_guard import HostOnly, HostTensorError, _check_collective, host_only
from tests.helpers.spawn_ranks import deepspeed_command

ROOT = Path(__file__).resolve().parents[2]


# ---- 1. the guard --------------------------------------------------------------------------------------


def test_guard_raises_on_use_and_allows_a_device_move():
    t = host_only(torch.arange(6).reshape(2, 3))
    assert isinstance(t, HostOnly) and t.shape == (2, 3) and t.dtype == torch.long
    for use in (lambda: t + 1, lambda: t.sum(), lambda: torch.nn.functional.embedding(t, torch.ones(6, 2)),
                lambda: t.to(torch.float64), lambda: float(t[0, 0]), lambda: t != -100):  # fmt: skip
        with pytest.raises(HostTensorError):
            use()
    moved = t.to(torch.device("cpu"), non_blocking=True)
    assert type(moved) is torch.Tensor and moved.sum().item() == 15
    assert type(t.to(device="cpu")) is torch.Tensor
    calls = []
    guarded = _check_collective("all_reduce", lambda tensor, **kw: calls.append(tensor))
    with pytest.raises(HostTensorError, match=r"torch\.distributed\.all_reduce"):
        guarded(host_only(torch.zeros(2)))
    guarded(torch.zeros(2))
    assert len(calls) == 1


# ---- 2. the trainer under the guard ----------------------------------------------------------------------


def _guarded_train(run_dir: Path, *overrides: str, nproc: int = 2, script: Path = ROOT / "launch" / "train.py",
                   env: dict | None = None):  # fmt: skip
    shims = [str(ROOT / "tests" / "helpers" / "host_guard.py"), str(ROOT / "tests" / "helpers" / "ds_launch.py")]
    # the ranks `deepspeed --num_gpus nproc` starts, with its variables, without its launcher's interpreters
    cmd = deepspeed_command(nproc, str(free_port()), *shims, str(script), f"run_dir={run_dir}", *overrides)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1",
           "NTL_HOST_GUARD_REPORT": str(run_dir.parent / f"{run_dir.name}_guard"), **(env or {})}  # fmt: skip
    return run_launch(cmd, cwd=ROOT, env=env, timeout=600)


TP_MICRO_BATCH, TP_MAX_LENGTH = 4, 48  # the TP=2 run's, read by section 4
COMMON = ("train.steps=2", "train.log_every=1", "tracking.wandb=disabled", "tracking.plot=false",
          "data.eval_examples=8", "eval.max_new_tokens=2", "train.eval_every=1")  # fmt: skip
PATHS = {
    "logits": ("train.micro_batch_size=4", "train.gradient_accumulation_steps=2"),
    # with coupled position ids (data.position_coupling), made on the device for every batch
    "chunked": ("train.micro_batch_size=4", "train.chunked_loss=true", "train.loss_chunk_tokens=16",
                "data.kinds=[add]", "data.negative_share=0", "data.reverse_answers=true", "data.position_coupling=true",
                "data.position_offset=3"),
    "tp": ("--config", str(ROOT / "configs" / "train" / "tiny_cpu_tp2.yaml"), "train.gradient_accumulation_steps=1",
           f"train.micro_batch_size={TP_MICRO_BATCH}", f"data.max_length={TP_MAX_LENGTH}"),
    # packed text (collate_packed, position_ids for document isolation, held-out text batches)
    "packed": ("--config", str(ROOT / "configs" / "train" / "tiny_pretrain_cpu.yaml"), "train.seq_length=32",
               "train.micro_batch_size=2", "train.global_batch_size=8", "data.eval_sequences=4",
               "data.document_isolation=true", "eval.at_end=false"),
}  # fmt: skip


def _guarded_path(tmp_path: Path, path: str):
    """The run of ``PATHS[path]`` under the guard, in ``tmp_path / path``."""
    overrides = PATHS[path]
    if path == "packed":
        from tests.integration.test_train_pretrain import corpus_texts

        corpus = tmp_path / "numbers.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_texts(60)))
        overrides = (*overrides, f"data.train_path={corpus}")
    env = {"NTL_TEST_RECORD_POSITIONS": str(tmp_path / "positions.jsonl")} if path == "chunked" else {}
    return _guarded_train(tmp_path / path, *COMMON, *overrides, env=env)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """The TP=2 run under the guard (section 2), also read by section 4: its folder's parent and its output."""
    pytest.importorskip("deepspeed")
    tmp = tmp_path_factory.mktemp("tp")
    return tmp, _guarded_path(tmp, "tp")


@pytest.mark.distributed
@pytest.mark.parametrize("path", list(PATHS))
def test_no_host_tensor_reaches_the_model_or_a_collective(tmp_path, path, request):
    pytest.importorskip("deepspeed")
    if path == "tp":  # shared with section 4
        tmp_path, out = request.getfixturevalue("tp_run")
    else:
        out = _guarded_path(tmp_path, path)
    run = tmp_path / path
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    assert "HostTensorError" not in text
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"{path}_guard.{rank}").read_text())
        assert counts["wrapped"] > 0 and counts["moved"] >= counts["wrapped"] // 2, counts  # the guard was active
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("eval/ppl" in r for r in rows)
    if path in ("logits", "chunked"):  # the held-out CE equals plain float64 cross entropy of the exported model
        coupled = path == "chunked"
        assert abs(rows[-1]["eval/ce"] - _heldout_ce(run / "hf_model", coupled)) <= 1e-5 * rows[-1]["eval/ce"]
        assert rows[-1]["eval/ppl"] == pytest.approx(math.exp(rows[-1]["eval/ce"]), rel=1e-12)
        if coupled:
            _training_ids_are_coupled(run / "hf_model", tmp_path / "positions.jsonl", offsets=range(4))
            _greedy_answers_follow_the_coupled_ids(run / "hf_model", run / "predictions_extrapolate.jsonl")


def _text_position_ids(question: str, answer: str, offset: int = 0) -> list[int]:
    """Coupled position ids read off the text (character tokens): in ``question + " "`` the i-th digit of
    an n-digit run has offset + n - i, the final space offset, other characters 0; the answer's k-th
    character and then EOS have offset + k + 1."""
    prompt = question + " "
    ids = [0] * len(prompt)
    for run in re.finditer(r"\d+", prompt):
        ids[run.start() : run.end()] = range(offset + len(run.group()), offset, -1)
    ids[-1] = offset
    return ids + list(range(offset + 1, offset + len(answer) + 2))


def _training_ids_are_coupled(model_dir: Path, record: Path, offsets: range) -> None:
    """Every training row the model got has the ids read off its text, shifted by an offset in
    ``offsets`` (padding 0), and the offsets vary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seen = set()
    rows = 0
    for line in record.read_text().splitlines():
        batch = json.loads(line)
        for ids, labels, mask, positions in zip(batch["input_ids"], batch["labels"], batch["attention_mask"],
                                                batch["position_ids"]):  # fmt: skip
            start, length = next(i for i, t in enumerate(labels) if t != -100), sum(mask)
            text = tokenizer.convert_ids_to_tokens(ids[:length])
            question, answer = "".join(text[: start - 1]), "".join(text[start : length - 1])  # less " " and EOS
            offset = positions[start - 1]
            assert offset in offsets, positions
            assert positions == [*_text_position_ids(question, answer, offset), *[0] * (len(ids) - length)]
            seen.add(offset)
            rows += 1
    assert rows >= 8 and len(seen) >= 2, (rows, seen)


def _greedy_answers_follow_the_coupled_ids(model_dir: Path, predictions: Path) -> None:
    """The generated answers are the exported model's arg-max continuations under the coupled ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        prompt, generated = row["question"] + " ", row["generated"]
        ids = tokenizer(prompt + generated, add_special_tokens=False)["input_ids"]
        positions = _text_position_ids(row["question"], generated)[: len(ids)]
        with torch.no_grad():
            logits = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           position_ids=torch.tensor([positions])).logits[0]  # fmt: skip
        picks = logits[len(prompt) - 1 : len(ids) - 1].argmax(-1).tolist()
        assert picks == ids[len(prompt) :], row


def _heldout_ce(model_dir: Path, coupled: bool = False) -> float:
    """Mean next-token CE over the answer tokens of the 8 held-out questions, without ntl_scale's loss
    (``coupled``: reversed answers, position ids read off the text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ntl_scale.data.collate import encode_pairs
    from ntl_scale.training.config import DataConfig
    from ntl_scale.training.sources import eval_sets

    model = AutoModelForCausalLM.from_pretrained(model_dir).double().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = {"kinds": ["add"], "negative_share": 0.0, "reverse_answers": True} if coupled else {}
    examples = next(iter(eval_sets(DataConfig(eval_examples=8, **task)).values()))
    inputs, labels = encode_pairs(tokenizer, [e.question for e in examples], [e.answer for e in examples])
    total, count = 0.0, 0
    with torch.no_grad():
        for e, ids, lab in zip(examples, inputs, labels):
            positions = torch.tensor([_text_position_ids(e.question, e.answer)]) if coupled else None
            assert positions is None or positions.shape[1] == len(ids)
            mask = torch.ones(1, len(ids), dtype=torch.long)  # explicit: no mask can mean packed documents to HF
            logits = model(torch.tensor([ids]), attention_mask=mask, position_ids=positions).logits[0, :-1]
            target = torch.tensor(lab[1:])
            total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
            count += int((target != -100).sum())
    return total / count


# ---- 4. FLOPs under AutoTP ---------------------------------------------------------------------------------


@pytest.mark.distributed
def test_tensor_parallel_flops_count_the_whole_model(tp_run):
    """The TP=2 run's first step (2 CPU processes over gloo, the tiny Llama-style config): its model FLOPs in
    ``metrics.jsonl`` (``tflops`` x time x ranks) over its tokens must be ``6 N + 12 n_layer width S`` with ``N``
    the exported (whole) model's own parameter count less its untied input table, and ``S``, the micro-batch's
    padded length, a whole number between the mean and the longest allowed sequence length. Counting after
    AutoTP split the layers gave N = 39,744 of 79,168 (S would come out at about -110)."""
    transformers = pytest.importorskip("transformers")
    tmp, out = tp_run
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    run = tmp / "tp"
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and json.loads((run / "zero_rank0.json").read_text())["tp"] == 2

    # the reference: the whole model, as exported, counts its own parameters
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "hf_model")
    table, output = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    whole = sum(p.numel() for p in model.parameters()) - (0 if table is output else table.numel())
    config = model.config
    layers, width = config.num_hidden_layers, config.num_attention_heads * config.head_dim

    step_flops = row["tflops"] * 1e12 * row["time_s"] * 2  # per device x 2 ranks
    padded = (step_flops / row["tokens"] - 6 * whole) / (12 * layers * width)
    assert math.ceil(row["tokens"] / TP_MICRO_BATCH) <= round(padded) <= TP_MAX_LENGTH, (whole, padded, row)
    assert padded == pytest.approx(round(padded), abs=1e-6), (whole, padded, row)
