"""experiments/study.py on held-out text, without training: per-sequence files written here by hand.

The group tables, the seed-level tests and the per-sequence counts are checked against a float64
reference written here (perplexity of summed label counts; differences averaged over seeds, or per
(seed, sequence) where each seed holds out its own text; scipy's paired t-test), and the study refuses
what it cannot pair: an arm's and the baseline's run of one seed holding out other text, files from
before labels_crc32, a missing file, groups on runs without held-out text, group ranges that are not
[first, stop).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
study = load_script("experiments/study.py", "study_under_test")

stats = pytest.importorskip("scipy.stats")


def _row(rng: random.Random, index: int, crc: int) -> dict:
    shape = random.Random(index)  # a sequence has the same labels in every run; the model's sums differ
    tokens = shape.randint(50, 256)
    numbers = shape.choice([0, shape.randint(1, tokens - 1), tokens])  # no numbers, a mix, numbers only
    ce = rng.uniform(0.3, 2.5) * tokens
    number_ce = rng.uniform(0.0, 1.0) * ce if numbers else 0.0
    if numbers == tokens:
        number_ce = ce
    return {"sequence": index, "ce_sum": ce, "ntl_sum": 0.0, "tokens": tokens, "ntl_positions": numbers,
            "ntl_hits": 0, "number_tokens": numbers, "number_ce_sum": number_ce,
            "number_hits": rng.randint(0, numbers), "number_abs_error_sum": rng.uniform(0, 3) * numbers,
            "labels_crc32": crc}  # fmt: skip


def _write(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "heldout_sequences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval.json").write_text(json.dumps({"heldout": study.sequence_metrics(rows)}))


def _runs(tmp_path: Path, crcs: list[int], seeds: int = 3, per_seed_text: bool = False) -> dict[str, list[str]]:
    rng = random.Random(7)
    runs: dict[str, list[str]] = {}
    for arm in ("CE", "NTL"):
        for seed in range(seeds):
            run = tmp_path / arm / f"seed{seed}"
            shift = 1000 * seed if per_seed_text else 0  # a corpus per data seed: other text at each seed
            _write(run, [_row(rng, i + shift, crc + shift) for i, crc in enumerate(crcs)])
            runs.setdefault(arm, []).append(str(run))
    return runs


def _text_ppl(r: dict) -> float:
    return math.exp((r["ce_sum"] - r["number_ce_sum"]) / (r["tokens"] - r["number_tokens"]))


def test_groups_and_per_sequence_tests_match_a_reference(tmp_path):
    runs = _runs(tmp_path, list(range(12)))
    groups = {"a": (0, 5), "b": (5, 12)}
    table = study.aggregate(runs, groups)
    tests = study.paired_tests(runs, table, "CE", groups)
    rows = {arm: [[json.loads(x) for x in Path(d, "heldout_sequences.jsonl").read_text().splitlines()] for d in dirs]
            for arm, dirs in runs.items()}  # fmt: skip
    for split, (first, stop) in (("heldout", (0, 12)), ("heldout:a", groups["a"]), ("heldout:b", groups["b"])):
        for arm in runs:
            for seed, seq in enumerate(rows[arm]):
                part = seq[first:stop]
                text = [(r["ce_sum"] - r["number_ce_sum"], r["tokens"] - r["number_tokens"]) for r in part]
                want = math.exp(sum(c for c, _ in text) / sum(n for _, n in text))
                assert table[arm][split]["text_ppl"]["seeds"][seed] == pytest.approx(want, rel=1e-12)
        diffs = []
        for i in range(first, stop):
            pairs = [(a[i], b[i]) for a, b in zip(rows["NTL"], rows["CE"])]
            if all(a["tokens"] > a["number_tokens"] for a, _ in pairs):
                diffs.append(sum(_text_ppl(a) - _text_ppl(b) for a, b in pairs) / len(pairs))
        counted = tests["NTL"][split]["text_ppl"]["sequences"]
        assert counted == {"n": len(diffs), "arm_better": sum(d < 0 for d in diffs)}
        seed_level = tests["NTL"][split]["text_ppl"]
        ntl, ce = table["NTL"][split]["text_ppl"]["seeds"], table["CE"][split]["text_ppl"]["seeds"]
        assert seed_level["p_seed_t"] == pytest.approx(float(stats.ttest_rel(ntl, ce).pvalue), rel=1e-9)
        assert "p" not in counted and "wilcoxon" not in seed_level  # no test over the pseudo-replicated sequences


def test_a_corpus_per_data_seed_counts_each_seed_and_sequence(tmp_path):
    """Each seed holds out its own text (data_seed: with_seed): sequence i of seed 0 is not sequence i of
    seed 1, so each (seed, sequence) is counted on its own, and nothing is averaged across seeds."""
    runs = _runs(tmp_path, list(range(6)), seeds=2, per_seed_text=True)
    table = study.aggregate(runs, {})
    counted = study.paired_tests(runs, table, "CE", {})["NTL"]["heldout"]["text_ppl"]["sequences"]
    rows = {arm: [[json.loads(x) for x in Path(d, "heldout_sequences.jsonl").read_text().splitlines()] for d in dirs]
            for arm, dirs in runs.items()}  # fmt: skip
    diffs = [_text_ppl(a) - _text_ppl(b) for ra, rb in zip(rows["NTL"], rows["CE"]) for a, b in zip(ra, rb)
             if a["tokens"] > a["number_tokens"]]  # fmt: skip
    assert counted == {"n": len(diffs), "arm_better": sum(d < 0 for d in diffs)}


def test_runs_that_hold_out_other_text_are_not_paired(tmp_path):
    runs = _runs(tmp_path, list(range(6)))
    path = Path(runs["NTL"][2], "heldout_sequences.jsonl")  # the last seed of the arm: another text
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[3]["labels_crc32"] = 99
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = study.aggregate(runs, {})
    with pytest.raises(SystemExit, match=r"NTL/seed2 and .*CE/seed2 hold out different text"):
        study.paired_tests(runs, table, "CE", {})


def test_files_that_cannot_be_paired_are_refused(tmp_path):
    runs = _runs(tmp_path, list(range(4)), seeds=1)
    path = Path(runs["CE"][0], "heldout_sequences.jsonl")
    old = [{k: v for k, v in json.loads(x).items() if k != "labels_crc32"} for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    with pytest.raises(SystemExit, match="has no labels_crc32"):
        study.aggregate(runs, {"a": (0, 2)})
    path.unlink()
    with pytest.raises(SystemExit, match=r"heldout_sequences\.jsonl is missing"):
        study.aggregate(runs, {"a": (0, 2)})
    Path(runs["NTL"][0], "eval.json").write_text(json.dumps({"questions": {"accuracy": 0.5}}))
    with pytest.raises(SystemExit, match="evaluated no held-out text"):
        study.run_eval(runs["NTL"][0], {"a": (0, 2)})
    fresh = _runs(tmp_path / "fresh", list(range(4)), seeds=1)
    with pytest.raises(SystemExit, match=r"\[0, 9\) but .* held out 4 sequences"):
        study.run_eval(fresh["CE"][0], {"a": (0, 9)})
    for bad in ({"a": [2, 2]}, {"a": [True, 3]}, {"a": [0]}):
        with pytest.raises(SystemExit, match=r"\[first, stop\)"):
            study._groups({"heldout_groups": bad})


def test_differences_that_cancel_over_the_seeds_are_ties(tmp_path):
    """Digit accuracy 3/7 vs 2/7 at one seed and 5/7 vs 6/7 at the other: the mean difference is 0 in
    exact arithmetic (about 1e-17 in floats), so the sequence is a tie, counted as neither better nor
    worse; a sequence better at both seeds counts once."""
    runs: dict[str, list[str]] = {}
    hits = {"CE": ((2, 1), (6, 1)), "NTL": ((3, 2), (5, 2))}  # (sequence 0, sequence 1) per seed
    for arm, per_seed in hits.items():
        for seed, seq_hits in enumerate(per_seed):
            rows = [{"sequence": i, "ce_sum": 10.0 + seed + i, "ntl_sum": 0.0, "tokens": 20, "ntl_positions": 7,
                     "ntl_hits": h, "number_tokens": 7, "number_ce_sum": 4.0 + i, "number_hits": h,
                     "number_abs_error_sum": 3.0, "labels_crc32": i} for i, h in enumerate(seq_hits)]  # fmt: skip
            run = tmp_path / arm / f"seed{seed}"
            _write(run, rows)
            runs.setdefault(arm, []).append(str(run))
    table = study.aggregate(runs, {})
    counted = study.paired_tests(runs, table, "CE", {})["NTL"]["heldout"]["number_token_acc"]["sequences"]
    assert counted == {"n": 2, "arm_better": 1}
