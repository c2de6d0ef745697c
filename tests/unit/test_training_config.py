"""Run configuration and DeepSpeed-independent step pieces of launch/train.py.

Sections: strict YAML and overrides; DeepSpeed "auto" resolution and contradictions; the sharded,
resumable data order; causal shifting and global counts against direct counting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ntl_scale
from ntl_scale.data import ShardedOrder
from ntl_scale.integrations.deepspeed.resolved import resolve_deepspeed_config
from ntl_scale.integrations.deepspeed.resume_layout import Layout, plan_resume, write_layout
from ntl_scale.integrations.deepspeed.steps import global_counts, shift_for_causal
from ntl_scale.training.config import TrainConfig, load_config
from tests.helpers.study_presets import run_overrides


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_dir: r\ntrain:\n  steps: 7\nntl:\n  loss: mse\n")
    cfg = load_config(str(path), ["train.lr=0.01", "ntl.reweigh=true", "model.architecture={model_type: t5}"])
    assert (cfg.run_dir, cfg.train.steps, cfg.train.lr, cfg.ntl.loss, cfg.ntl.reweigh) == ("r", 7, 0.01, "mse", True)
    assert cfg.model.architecture == {"model_type": "t5"}


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["trian.steps=3"], r"unknown config key 'trian'; did you mean 'train'"),
        (["train.stpes=3"], r"unknown config key 'train.stpes'; did you mean 'train.steps'"),
        (["train.steps=many"], r"train.steps: expected int, got 'many'"),
        (["train.steps=2.5"], r"train.steps: expected an integer, got 2.5"),
        (["ntl.reweigh=maybe"], r"ntl.reweigh: expected true or false, got 'maybe'"),
        (["ntl.normalization=batch"], r"ntl.normalization must be one of \('global', 'micro-batch'\)"),
        (["train.steps=0"], r"train.steps must be >= 1, got 0"),
        (["data.source=jsonl"], r"data.source='jsonl' needs data.train_path"),
        (["steps"], r"override 'steps' must look like section.key=value"),
    ],
)
def test_bad_config_is_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="no such config file"):
        load_config(str(tmp_path / "nope.yaml"))


def test_deepspeed_auto_and_contradictions():
    train = TrainConfig(micro_batch_size=4, gradient_accumulation_steps=2, lr=0.01)
    ds = {"train_batch_size": "auto", "optimizer": {"params": {"lr": "auto"}}}
    resolved = resolve_deepspeed_config(ds, train, world_size=2)
    assert resolved["train_batch_size"] == 16 and resolved["train_micro_batch_size_per_gpu"] == 4
    assert resolved["optimizer"]["params"]["lr"] == 0.01 and ds["optimizer"]["params"]["lr"] == "auto"
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3 but the run config implies 2"):
        resolve_deepspeed_config({"gradient_accumulation_steps": 3}, train, 2)
    with pytest.raises(ValueError, match=r"lr=0\.5 contradicts train\.lr=0\.01"):
        resolve_deepspeed_config({"optimizer": {"params": {"lr": 0.5}}}, train, 2)


def test_sharded_order_partitions_and_resumes():
    ranks = [ShardedOrder(20, 2, r, 2, seed=3) for r in range(2)]
    epoch = [i for _ in range(5) for o in ranks for i in o.next_indices()]
    assert sorted(epoch) == list(range(20))  # one epoch: every example once, ranks disjoint
    resumed = ShardedOrder(20, 2, 1, 2, seed=3)
    fresh = ShardedOrder(20, 2, 1, 2, seed=3)
    fresh.next_indices(), fresh.next_indices()
    resumed.position = fresh.position
    assert resumed.next_indices() == fresh.next_indices()
    with pytest.raises(ValueError, match="cannot fill one step of 2 sequences x 2 ranks x 1"):
        ShardedOrder(3, 2, 0, 2, seed=0)


def _steps(order_of_rank, ranks: int, accumulation: int, steps: int) -> list[list[int]]:
    """The examples of each optimizer step, over all ranks and micro-batches, in a canonical order."""
    orders = [order_of_rank(r) for r in range(ranks)]
    return [sorted(i for _ in range(accumulation) for o in orders for i in o.next_indices()) for _ in range(steps)]


def test_sharded_order_steps_do_not_depend_on_the_split():
    """The same global batch (12) split as 4 x 3 ranks x 1, 2 x 2 x 3 and 1 x 1 x 12 takes the same examples
    at every step, across epoch ends (50 examples: 4 steps per epoch, 2 left out), and a resumed split
    continues where another stopped: the state is the number of examples consumed."""
    splits = [(4, 3, 1), (2, 2, 3), (1, 1, 12)]  # micro-batch, ranks, accumulation
    runs = [_steps(lambda r, m=m, n=n, a=a: ShardedOrder(50, m, r, n, seed=5, accumulation=a), n, a, 10)
            for m, n, a in splits]  # fmt: skip
    assert runs[0] == runs[1] == runs[2]
    assert sorted(i for step in runs[0][:4] for i in step) != list(range(50))  # 48 of 50 in an epoch
    assert len({i for step in runs[0][:4] for i in step}) == 48
    first = [ShardedOrder(50, 4, r, 3, seed=5) for r in range(3)]
    for _ in range(5):  # 5 steps on 3 ranks ...
        for o in first:
            o.next_indices()
    position = first[0].position

    def resumed(r):  # ... then 2 ranks with accumulation 3 from the saved position
        order = ShardedOrder(50, 2, r, 2, seed=5, accumulation=3)
        order.position = position
        return order

    assert _steps(resumed, 2, 3, 5) == runs[0][5:]


def test_shift_and_global_counts():
    vocab = ntl_scale.NumberVocab.from_id_to_token(["a", "b"] + [str(d) for d in range(10)])
    labels = torch.tensor([[-100, 2, 3, 0], [-100, -100, 5, 1]])
    targets = shift_for_causal(labels)
    assert targets.tolist() == [[2, 3, 0, -100], [-100, 5, 1, -100]]
    assert global_counts([targets, targets[:1]], vocab, None) == (5.0 + 3.0, 3.0 + 2.0)


def test_run_data_from_files_and_generator(tmp_path):
    from ntl_scale.training.config import DataConfig
    from ntl_scale.training.sources import eval_sets, train_dataset
    from ntl_scale.training.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    train = tmp_path / "train.txt"
    train.write_text("What is 1 + 1?\n2\nWhat is 2 + 3?\n5\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"question": "What is 4 + 4?", "answer": "8"}\n')
    cache = str(tmp_path / "cache")
    rows = train_dataset(DataConfig(source="deepmind", train_path=str(train), cache_dir=cache), tokenizer)
    answers = [tokenizer.decode([t for t in r["labels"] if t >= 0], skip_special_tokens=True) for r in rows]
    assert answers == ["2", "5"] and eval_sets(DataConfig(source="deepmind", train_path=str(train))) == {}
    sets = eval_sets(DataConfig(source="jsonl", train_path=str(evals), eval_path=str(evals)))
    assert [e.question for e in sets["eval"]] == ["What is 4 + 4?"]
    rows = train_dataset(DataConfig(train_examples=10, eval_examples=3), tokenizer)
    sets = eval_sets(DataConfig(train_examples=10, eval_examples=3))
    assert len(rows) == 10 and {k: len(v) for k, v in sets.items()} == {"interpolate": 3, "extrapolate": 3}
    with pytest.raises(ValueError, match=r"folder without arithmetic_train\.txt"):
        train_dataset(DataConfig(source="deepmind", train_path=str(tmp_path)), tokenizer)
    with pytest.raises(ValueError, match=r"streaming=true reads data\.train_path"):
        DataConfig(streaming=True)


def test_learning_rate_schedule():
    from ntl_scale.training.config import TrainConfig

    cosine = TrainConfig(steps=110, lr=1e-3, warmup_steps=10, lr_decay="cosine", min_lr=1e-4)
    assert cosine.lr_at(5) == pytest.approx(5e-4) and cosine.lr_at(10) == pytest.approx(1e-3)
    assert cosine.lr_at(60) == pytest.approx(1e-4 + 0.9e-3 * 0.5) and cosine.lr_at(110) == pytest.approx(1e-4)
    linear = TrainConfig(steps=110, lr=1e-3, warmup_steps=10, lr_decay="linear")
    assert linear.lr_at(35) == pytest.approx(0.75e-3) and linear.lr_at(110) == pytest.approx(0.0)
    assert TrainConfig(steps=110, lr=1e-3, warmup_steps=10).lr_at(100) == 1e-3
    with pytest.raises(ValueError, match="lr_decay must be constant, cosine or linear"):
        TrainConfig(lr_decay="step")
    with pytest.raises(ValueError, match=r"min_lr=0\.1 must be in"):
        TrainConfig(lr=1e-3, min_lr=0.1)


@pytest.mark.parametrize(
    "name",
    [
        "tiny_cpu.yaml",
        "granite-3.2-2b_zero3.yaml",
        "t5-3b_zero3.yaml",
        "tiny_cpu_tp2.yaml",
        "granite-3.2-2b_tp2_zero1.yaml",
    ],
)
def test_shipped_configs_load_and_resolve(name):
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = root / "configs" / "train" / name
    cfg = load_config(str(path))
    assert os.path.isabs(cfg.train.deepspeed_config)  # resolved, so a run starts from any directory
    with open(cfg.train.deepspeed_config) as f:
        ds = resolve_deepspeed_config(json.load(f), cfg.train, world_size=8)
    assert ds["bf16"]["enabled"] == bool(cfg.train.bf16)  # null (auto) is off on this CPU-only resolve
    if cfg.train.tensor_parallel_size > 1:  # AutoTP: ZeRO 1/2, the vocabulary-parallel head asked for
        assert ds["zero_optimization"]["stage"] in (1, 2)
        assert ds["tensor_parallel"] == {"autotp_size": cfg.train.tensor_parallel_size, "vocab_parallel_lm_head": True}
    else:  # the tiny default uses ZeRO-2 (faster at its size); the full-size configs ZeRO-3
        assert ds["zero_optimization"]["stage"] == (2 if name == "tiny_cpu.yaml" else 3) and "tensor_parallel" not in ds
    assert "launch/train.py" in path.read_text().split("run_dir:")[0]  # the header gives the launch command


def test_resume_plan_follows_the_recorded_layout(tmp_path):
    now = Layout(data_parallel=2, tensor_parallel=1, global_batch=8)
    assert plan_resume(str(tmp_path), now) is None  # nothing written yet: start
    (tmp_path / "latest").write_text("step4")
    assert plan_resume(str(tmp_path), now) == "same"  # no record (older run): DeepSpeed's own checks
    write_layout(str(tmp_path), now)
    assert plan_resume(str(tmp_path), now) == "same"
    assert plan_resume(str(tmp_path), Layout(1, 1, 8)) == "universal"
    assert plan_resume(str(tmp_path), Layout(2, 2, 8)) == "universal"
    with pytest.raises(ValueError, match=r"global batch 8; this run has .* global batch 16\. Set train\."
                       r"global_batch_size=8"):  # fmt: skip
        plan_resume(str(tmp_path), Layout(2, 1, 16))
    (tmp_path / "layout.json").write_text('{"data_parallel": 2, "tensor_parallel": 1}')  # no global batch
    with pytest.raises(ValueError, match=r"no recorded global batch.*Resume with 2 processes"):
        plan_resume(str(tmp_path), Layout(1, 1, 8))


def test_global_batch_size_sets_the_accumulation():
    train = TrainConfig(micro_batch_size=4, global_batch_size=32)
    assert [train.accumulation_for(dp) for dp in (1, 2, 8)] == [8, 4, 1]
    assert TrainConfig(micro_batch_size=4, gradient_accumulation_steps=3).accumulation_for(5) == 3
    with pytest.raises(ValueError, match=r"global_batch_size=32 is not a multiple of .*4 x 3 data-parallel"):
        train.accumulation_for(3)
    resolved = resolve_deepspeed_config({}, train, 2)
    assert (resolved["gradient_accumulation_steps"], resolved["train_batch_size"]) == (4, 32)


STUDY_PRESETS = sorted((Path(__file__).resolve().parents[2] / "configs" / "study").glob("*.yaml"))


@pytest.mark.parametrize("preset", STUDY_PRESETS, ids=lambda p: p.name)
def test_study_presets_resolve_for_every_arm(preset):
    """Every arm of every study preset is a valid run config (its base, the shared overrides, the arm's
    own, a seed), so a long study cannot stop at its fifth arm on a typo; the arms differ as they say."""
    import json

    import yaml

    spec = yaml.safe_load(preset.read_text())
    root = preset.parents[2]
    configs = {}
    for arm, overrides in spec["arms"].items():
        run, extra = run_overrides(spec, [*spec.get("overrides", []), *overrides, "train.seed=1"])
        cfg = load_config(str(root / spec["base_config"]), run)
        assert cfg.train.seed == 1
        configs[arm] = {**cfg.to_dict(), "entry": extra}
    assert len({json.dumps(c, sort_keys=True) for c in configs.values()}) == len(configs)  # no two arms alike


TRAIN_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "train").glob("*.yaml"))


def _shipped_data() -> list[tuple[str, Any]]:
    """The distinct (data, model, eval) sections of every shipped run config and every study preset's
    arms, each named by the runs that use it (arms of one preset usually share one)."""
    import json

    import yaml

    runs = [(p.name, p, []) for p in TRAIN_CONFIGS]
    for preset in STUDY_PRESETS:
        spec = yaml.safe_load(preset.read_text())
        for arm, overrides in spec["arms"].items():
            base = preset.parents[2] / spec["base_config"]
            run, _ = run_overrides(spec, [*spec.get("overrides", []), *overrides])
            runs.append((f"{preset.name}:{arm}", base, run))
    distinct: dict[str, tuple[list[str], Any]] = {}
    for name, base, overrides in runs:
        cfg = load_config(str(base), overrides)
        key = json.dumps([cfg.data.__dict__, cfg.model.__dict__, cfg.eval.__dict__], sort_keys=True, default=str)
        distinct.setdefault(key, ([], cfg))[0].append(name)
    return [(",".join(names), cfg) for names, cfg in distinct.values()]


@pytest.mark.parametrize("names,cfg", _shipped_data(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_shipped_config_and_preset_builds_its_generated_data(names, cfg):
    """Every shipped config and every study arm on the arithmetic generator draws its training set and both
    evaluation splits at full size (a preset asking for more distinct questions than its task has fails here,
    not hours into a study); the interpolate split shares no question with the training set, nor a sum or
    product with its operands swapped (set intersection of the texts, swaps written out here); with the
    character tokenizer, every evaluation prompt plus ``eval.max_new_tokens`` fits the model's positions (else
    generation would index past the position table at the end of a run). File sources read the user's corpus or
    a prepared one: the pretraining configs take steps in test_pretrain_configs, the CI study presets run end to
    end in test_docs_and_study, and the DeepMind generator is run in test_deepmind_data."""
    import re

    from ntl_scale.training.sources import _task, eval_sets
    from ntl_scale.training.tokenizer import build_char_tokenizer

    data = cfg.data
    if data.source != "arithmetic":
        pytest.skip(f"data.source={data.source!r} reads files (see the docstring)")
    train = ntl_scale.data.generate(data.train_examples, "train", seed=data.seed, config=_task(data))
    splits = eval_sets(data)
    questions = {e.question for e in train}
    assert len(questions) == data.train_examples
    assert {s: len(v) for s, v in splits.items()} == {
        "interpolate": data.eval_examples,
        "extrapolate": data.eval_examples,
    }
    held_out = {e.question for e in splits["interpolate"]}
    swapped = {re.sub(r"^What is (\S+) (\+|times) (\S+)\?$", r"What is \3 \2 \1?", q) for q in held_out}
    assert not questions & held_out and not questions & swapped
    if cfg.model.tokenizer != "builtin:char":
        return  # a Hugging Face tokenizer of the user's (not here offline)
    arch = cfg.model.architecture or {}
    positions = arch.get("n_positions") or arch.get("max_position_embeddings")
    tokenizer = build_char_tokenizer()
    longest_prompt = max(len(tokenizer(e.question + " ")["input_ids"]) for v in splits.values() for e in v)
    if positions:
        assert longest_prompt + cfg.eval.max_new_tokens <= positions, (longest_prompt, cfg.eval.max_new_tokens)


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan"])
def test_every_numeric_key_refuses_non_finite_values(text):
    """Issue 40's sweep: every float or int key of a run config (``train.lr``, ``train.peak_tflops``,
    ``data.negative_share``, the ``ntl.*`` numbers, ...) refuses inf and nan, named, in one place (the
    YAML coercion); before, ``train.lr=.inf`` was accepted and trained to NaN."""
    import dataclasses

    from ntl_scale.training.config import RunConfig

    keys = []
    defaults = RunConfig()
    for section in dataclasses.fields(RunConfig):
        value = getattr(defaults, section.name)
        if not dataclasses.is_dataclass(value):
            continue
        for f in dataclasses.fields(value):
            if str(f.type).split(" |")[0] in ("float", "int"):
                keys.append(f"{section.name}.{f.name}")
    assert {"train.lr", "train.min_lr", "train.peak_tflops", "ntl.weight", "ntl.huber_delta"} <= set(keys)
    for key in keys:
        with pytest.raises(ValueError, match=rf"{key}.*(inf|nan)"):
            load_config(None, [f"{key}={text}"])
