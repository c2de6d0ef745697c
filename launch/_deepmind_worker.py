"""Runs inside the generator's own environment (``mathematics-dataset==1.0.1``, ``sympy==1.5.1``,
``numpy<1.24``), run by ``launch/deepmind_data.py``: writes DeepMind's file layout, each (split, module) file
from its own seed.
"""

import argparse
import json
import os
import random
import sys
import zlib


def _seed(seed, regime, module):
    value = zlib.crc32(f"{seed}/{regime}/{module}".encode())
    random.seed(value)
    import numpy

    numpy.random.seed(value)


def _base(name, trained):
    """The training module an extrapolation module extends (``arithmetic__mul_big`` -> ``arithmetic__mul``):
    the longest training name that prefixes it (so ``arithmetic__mul_div_multiple_longer`` is not ``mul``)."""
    if name in trained:
        return name
    bases = [t for t in trained if name.startswith(t + "_")]
    return max(bases, key=len) if bases else None


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--modules", required=True, help="comma-separated module names")
    parser.add_argument("--per-module", type=int, required=True, help="examples per module per training level")
    parser.add_argument("--per-test-module", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args(argv)

    from absl import flags
    from mathematics_dataset import generate

    # per_train_module counts the three training levels together (the generator writes a third to each)
    flags.FLAGS(["generate", f"--per_train_module={3 * args.per_module}", f"--per_test_module={args.per_test_module}"])
    generate.init_modules(train_split=True)
    wanted = [m for m in args.modules.split(",") if m]
    trained = sorted(generate.filtered_modules["train-easy"])
    missing = [m for m in wanted if m not in trained]
    if missing:
        sys.stderr.write(f"unknown module(s) {missing}; the generator has: {', '.join(trained)}\n")
        return 2
    written = {}
    for regime, modules in generate.filtered_modules.items():
        os.makedirs(os.path.join(args.out, regime), exist_ok=True)
        for name, module in modules.items():
            if _base(name, trained) not in wanted:
                continue
            _seed(args.seed, regime, name)
            path = os.path.join(args.out, regime, name + ".txt")
            with open(path, "w", encoding="utf-8") as f:
                for _ in range(generate.counts[regime]):
                    problem, _ = generate.sample_from_module(module)
                    f.write(f"{problem.question}\n{problem.answer}\n")
            written.setdefault(regime, []).append(name)
    json.dump(written, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
