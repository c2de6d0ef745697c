"""Prepare the ``ntl_numeracy`` lm-eval task folder (``ntl_scale.eval.tasks``), print its path, or compare.

python launch/eval_tasks.py --path            # the default folder (prepared on first use)
python launch/eval_tasks.py prepare --out DIR [--gsm8k DIR] [--examples 250] [--texts 100]
                                    [--seed 0] [--run-dir RUN]
python launch/eval_tasks.py compare --run-dir RUN --results DIR   # harness vs the run's scorer
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for ntl_scale

from ntl_scale.eval.tasks import DEFAULT_GSM8K, GROUP, default_dir, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python launch/eval_tasks.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--path", action="store_true", help="print the default task folder (preparing it if absent)")
    parser.add_argument(
        "command",
        nargs="?",
        choices=["prepare", "compare"],
        help="prepare: write a task folder; compare: ntl_run_<split> beside eval.json",
    )
    parser.add_argument("--out", default=None, help="the task folder (default: --path's)")
    parser.add_argument(
        "--gsm8k", default=None, help=f"local GSM8K folder (test.jsonl, train.jsonl[.gz]; default {DEFAULT_GSM8K})"
    )
    parser.add_argument("--examples", type=int, default=250, help="test questions per arithmetic operation")
    parser.add_argument("--texts", type=int, default=100, help="sentences per perplexity slice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None, help="also the tasks ntl_run_<split>: this run's held-out questions")
    parser.add_argument("--results", default=None, help="compare: lm_eval's --output_path (or a results JSON)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="their max_gen_toks (default: the run's)")
    args = parser.parse_args(argv)
    out = args.out or default_dir()
    if args.path and args.command is None:
        if not os.path.exists(os.path.join(out, f"{GROUP}.yaml")):
            prepare(out, gsm8k=args.gsm8k, examples=args.examples, texts=args.texts, seed=args.seed)
        print(os.path.abspath(out))
        return 0
    if args.command == "compare":
        from ntl_scale.eval.tasks.compare import compare_run, latest_results, print_comparison

        if not args.run_dir or not args.results:
            parser.error("compare needs --run-dir and --results")
        rows = compare_run(args.run_dir, latest_results(args.results))
        if not rows:
            parser.error(f"no ntl_run_<split> results in {args.results} for {args.run_dir}")
        return 0 if print_comparison(rows) else 1
    if args.command != "prepare":
        parser.error("give --path, prepare or compare")
    counts = prepare(out, gsm8k=args.gsm8k, examples=args.examples, texts=args.texts, seed=args.seed,
                     run_dir=args.run_dir, max_new_tokens=args.max_new_tokens)  # fmt: skip
    print(f"{os.path.abspath(out)}: " + ", ".join(f"{k} {v}" for k, v in counts.items()), file=sys.stderr)
    print(os.path.abspath(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
