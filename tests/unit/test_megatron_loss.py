"""Megatron adapter without a pipeline: arguments, settings, tables, and the loss_func contract.

Sections:
1. ``--ntl-*`` arguments: defaults, every flag, bad values rejected by argparse with the value named.
2. Number tables from a Megatron-style tokenizer (``inv_vocab``), from a saved file, padded.
3. ``loss_func`` under Megatron's schedule arithmetic (divide by num_tokens and micro-batches, DDP
   mean over DP; or, with per-token loss, divide the summed gradients by the global token count):
   micro-batch mode gives the paper's per-micro-batch means; global mode gives the same gradient for
   1 x 4, 2 x 2 and 4 x 1 micro-batch splits and DP = 1 or 2, equal to the naive global objective.
"""

from __future__ import annotations

import argparse
import functools
import subprocess

import pytest
import torch

import ntl_scale
from ntl_scale.integrations import megatron as ntl_megatron
from tests.helpers.data import random_labels, random_logits
from tests.helpers.reference import naive_per_token
from tests.helpers.scripts import load_script


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", exit_on_error=False)
    parser.add_argument("--micro-batch-size", type=int, default=1)  # a stand-in Megatron argument
    return ntl_megatron.add_ntl_args(parser)


def test_defaults_leave_ntl_off():
    args = _parser().parse_args(["--micro-batch-size", "4"])
    settings = ntl_megatron.NTLSettings.from_args(args)
    assert settings == ntl_megatron.NTLSettings() and not settings.enabled and args.micro_batch_size == 4


def test_every_flag():
    args = _parser().parse_args(
        "--ntl-weight 0.3 --ntl-loss huber --ntl-number-vocab multi-digit --ntl-reweigh "
        "--ntl-huber-delta 2 --ntl-normalization global".split()
    )
    settings = ntl_megatron.NTLSettings.from_args(args)
    assert settings.enabled and settings.weight == 0.3 and settings.loss == "huber" and settings.reweigh
    assert settings.number_vocab == "multi-digit" and settings.huber_delta == 2.0 and settings.normalization == "global"
    args = _parser().parse_args(["--ntl-weight", "0.3", "--ntl-squash-factor", "4"])
    assert ntl_megatron.NTLSettings.from_args(args).squash_factor == 4.0


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--ntl-weight", "-1"], "--ntl-weight must be a finite number >= 0 .*got -1.0 .*the text '-1'"),
        (["--ntl-weight", "abc"], "expected a number, got 'abc'"),
        (["--ntl-loss", "l2"], "invalid choice: 'l2'"),
        (["--ntl-normalization", "per-batch"], "invalid choice: 'per-batch'"),
        (["--ntl-squash-factor", "1"], "--ntl-squash-factor must be a finite number > 1 .*the text '1'"),
    ],
)
def test_bad_flags_are_named(argv, match):
    with pytest.raises(argparse.ArgumentError, match=match):
        _parser().parse_args(argv)


def test_settings_validation():
    with pytest.raises(ValueError, match="--ntl-normalization must be one of"):
        ntl_megatron.NTLSettings(weight=0.3, normalization="tokens")
    with pytest.raises(ValueError, match="squash_factor applies to loss='was' only"):
        ntl_megatron.NTLSettings(weight=0.3, loss="mse", squash_factor=3.0)
    with pytest.raises(ValueError, match="--ntl-weight must be a finite number >= 0"):
        ntl_megatron.NTLSettings(weight=float("nan"))


class _MegatronStyleTokenizer:
    def __init__(self, tokens):
        self.inv_vocab = dict(enumerate(tokens))
        self.vocab_size = len(tokens)


TOKENS = ["<eod>", "a", "b", "."] + [str(d) for d in range(10)] + ["12", "345"] + [f"w{i}" for i in range(34)]


def test_number_vocab_from_megatron_tokenizer_and_file(tmp_path):
    tokenizer = _MegatronStyleTokenizer(TOKENS)
    padded = ntl_scale.pad_vocab_size(len(TOKENS), divisible_by=32, tp_size=2)
    digits = ntl_megatron.build_number_vocab(ntl_megatron.NTLSettings(), tokenizer, padded)
    assert len(digits) == 10 and digits.vocab_size == padded == 64
    squash = 16.0  # values 0-345 unsquashed would start NTL-WAS at 17x the digit level's (refused)
    multi = ntl_megatron.build_number_vocab(
        ntl_megatron.NTLSettings(number_vocab="multi-digit", squash_factor=squash), tokenizer, padded
    )
    assert sorted(multi.values.tolist())[-2:] == [12.0, 345.0]
    path = tmp_path / "numbers.json"
    multi.save(path)
    loaded = ntl_megatron.build_number_vocab(
        ntl_megatron.NTLSettings(number_vocab=str(path), squash_factor=squash), None, 128
    )
    assert loaded == multi.with_vocab_size(128)
    with pytest.raises(ValueError, match=r"neither one of .* nor an existing file"):
        ntl_megatron.build_number_vocab(ntl_megatron.NTLSettings(number_vocab="digitz"), tokenizer, padded)


def _vocab() -> ntl_scale.NumberVocab:
    return ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=64)


def _global_batch(seed: int = 0, sequences: int = 8, seq: int = 12):
    vocab = _vocab()
    labels = random_labels(vocab, (sequences, seq), len(TOKENS), seed=seed, number_fraction=0.4, ignore_index=0)
    loss_mask = (labels != 0).to(torch.float32)
    loss_mask[torch.rand(labels.shape, generator=torch.Generator().manual_seed(seed)) < 0.1] = 0.0
    logits = random_logits((sequences, seq, 64), seed=seed, dtype=torch.float64)
    return vocab, labels, loss_mask, logits


def _schedule_grad(settings, vocab, labels, loss_mask, logits, micro_batches, dp, per_token):
    """Megatron's arithmetic: per-micro-batch loss_func, the schedule's division, DP reduction."""
    leaf = logits.clone().requires_grad_()
    replicas = torch.chunk(torch.arange(labels.shape[0]), dp)
    counts = None
    grads_total = torch.zeros_like(leaf)
    total_tokens = 0
    for rows in replicas:
        if settings.normalization == "global":
            counts = ntl_megatron.GlobalCounts(vocab)
            # "all-reduced" over DP: the counts of every replica's micro-batches
            counts.set_step(
                [(labels[r], loss_mask[r]) for r in torch.chunk(torch.arange(labels.shape[0]), dp * micro_batches)]
            )
        loss_func = ntl_megatron.make_loss_func(
            settings,
            vocab,
            tp_group=None,
            calculate_per_token_loss=per_token,
            global_counts=counts,
            num_microbatches=micro_batches,
            data_parallel_size=dp,
        )
        for mb in torch.chunk(rows, micro_batches):
            bound = functools.partial(loss_func, labels[mb], loss_mask[mb])
            out, num_tokens, report = bound(leaf[mb])
            total_tokens += int(num_tokens)
            if not per_token:
                out = out / num_tokens.clamp_min(1) / micro_batches
            grad = torch.autograd.grad(out, leaf)[0]
            grads_total += grad / (1 if per_token else dp)  # DDP: mean over DP, or sum for per-token loss
            assert set(report) == {"lm loss", "ntl loss", "number accuracy"}
            assert all(v.shape == (2,) for v in report.values())
    return grads_total / total_tokens if per_token else grads_total


def _naive_global_grad(vocab, labels, loss_mask, logits, weight, loss):
    leaf = logits.clone().requires_grad_()
    ce, ntl, mask = naive_per_token(leaf, labels, vocab, loss=loss, ignore_index=-100)
    m = loss_mask.double()
    objective = (ce * m).sum() / m.sum() + weight * (ntl * m).sum() / (mask.double() * m).sum()
    return torch.autograd.grad(objective, leaf)[0]


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("loss", ["was", "mse"])
def test_global_normalization_is_split_invariant_and_exact(per_token, loss):
    vocab, labels, loss_mask, logits = _global_batch()
    settings = ntl_megatron.NTLSettings(weight=0.3, loss=loss, normalization="global")
    want = _naive_global_grad(vocab, labels, loss_mask, logits, 0.3, loss)
    for micro_batches, dp in [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]:
        got = _schedule_grad(settings, vocab, labels, loss_mask, logits, micro_batches, dp, per_token)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10, msg=f"{micro_batches} x dp {dp}")


def test_micro_batch_normalization_is_the_paper_mean():
    vocab, labels, loss_mask, logits = _global_batch(seed=3, sequences=2)
    settings = ntl_megatron.NTLSettings(weight=0.3, loss="was")
    loss_func = ntl_megatron.make_loss_func(settings, vocab, tp_group=None)
    out, num_tokens, report = loss_func(labels, loss_mask, logits)
    ce, ntl, mask = naive_per_token(logits, labels, vocab, ignore_index=-100)
    m = loss_mask.double()
    want = (ce * m).sum() / m.sum() + 0.3 * (ntl * m).sum() / (mask.double() * m).sum()
    torch.testing.assert_close(out / num_tokens, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(
        report["ntl loss"][0] / report["ntl loss"][1], (ntl * m).sum() / (mask.double() * m).sum()
    )


def test_global_mode_needs_counts():
    settings = ntl_megatron.NTLSettings(weight=0.3, normalization="global")
    with pytest.raises(ValueError, match="needs a GlobalCounts"):
        ntl_megatron.make_loss_func(settings, _vocab(), tp_group=None)
    counts = ntl_megatron.GlobalCounts(_vocab())
    loss_func = ntl_megatron.make_loss_func(settings, _vocab(), tp_group=None, global_counts=counts)
    _, labels, loss_mask, logits = _global_batch()
    with pytest.raises(RuntimeError, match=r"call GlobalCounts\.set_step"):
        loss_func(labels, loss_mask, logits)


def test_pretrain_entry_without_megatron_lm_says_how_to_fix(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "launch" / "pretrain_gpt_ntl.py"
    env = {**__import__("os").environ, "MEGATRON_LM_PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, str(script), "--ntl-weight", "0.3"], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "needs a Megatron-LM checkout" in out.stderr and "MEGATRON_LM_PATH" in out.stderr


def _shell(command: str, tmp_path) -> subprocess.CompletedProcess[str]:
    """``command`` in bash from the checkout, with a folder that is no Megatron-LM checkout as MEGATRON_LM_PATH."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    python = os.path.dirname(sys.executable)
    env = {**os.environ, "MEGATRON_LM_PATH": str(tmp_path), "PATH": python + os.pathsep + os.environ["PATH"]}
    env["PYTHONPATH"] = str(root)
    return subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_a_mistyped_config_inside_the_command_substitution_fails_the_launch(tmp_path):
    """`$(python launch/megatron_args.py MISTYPED)`: the shell starts the launch anyway; it stops, naming the file.

    Before anything else runs (no Megatron-LM is looked for), not a run without the config's NTL flags.
    """
    written = (
        "torchrun --nproc_per_node 1 launch/pretrain_gpt_ntl.py "
        "$(python launch/megatron_args.py configs/megatron/tiny_cpu.yml) --mock-data"
    )
    out = _shell(written, tmp_path)
    assert out.returncode != 0
    assert "configs/megatron/tiny_cpu.yml: cannot read this Megatron config" in out.stderr, out.stderr
    assert "could not read 'configs/megatron/tiny_cpu.yml'" in out.stderr, out.stderr
    assert "needs a Megatron-LM checkout" not in out.stderr  # it stopped first
    # the helper on its own (the sbatch's use): status 2, the reason on stderr
    alone = _shell("python launch/megatron_args.py configs/megatron/tiny_cpu.yml", tmp_path)
    assert alone.returncode == 2 and "cannot read this Megatron config" in alone.stderr
    assert "Traceback" not in alone.stderr


def test_config_flag_of_the_drop_in(tmp_path):
    """`pretrain_gpt_ntl.py --config FILE` expands the file's flags in place; a missing file stops before anything."""
    out = _shell("python launch/pretrain_gpt_ntl.py --config configs/megatron/tiny_cpu.yml --mock-data", tmp_path)
    assert out.returncode != 0 and "--config configs/megatron/tiny_cpu.yml: cannot read" in out.stderr, out.stderr
    assert "needs a Megatron-LM checkout" not in out.stderr
    from pathlib import Path

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "megatron" / "tiny_cpu.yaml")
    drop_in = load_script("launch/pretrain_gpt_ntl.py", "pretrain_gpt_ntl_config")
    argv = drop_in.expand_config(["--lr", "1", "--config", tiny, "--lr", "2"])
    assert argv[:2] == ["--lr", "1"] and argv[-2:] == ["--lr", "2"] and "--ntl-weight" in argv
    assert drop_in.expand_config([f"--config={tiny}"]) == argv[2:-2]


@pytest.mark.parametrize("name", ["granite-3.2-2b_ntl.yaml", "llama-3.2-3b_ntl.yaml", "tiny_cpu.yaml"])
def test_megatron_configs_give_valid_ntl_settings(name):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    module = load_script("launch/megatron_args.py", "megatron_args")
    path = root / "configs" / "megatron" / name
    argv = module.to_argv(str(path))
    args, rest = _parser().parse_known_args(argv)
    settings = ntl_megatron.NTLSettings.from_args(args)
    assert settings.enabled and "--num-layers" in rest
    assert "launch/" in path.read_text().split("megatron_args:")[0]  # the header shows the launch command
