# One task runner. `make run` and `make test` are the README's two commands.
PYTHON ?= python3

.PHONY: setup setup-dev run test test-unit test-dist lint format bench docs study gpu-check gpu-prepare gpu-wheels

setup:
	bash scripts/setup.sh

setup-dev:
	bash scripts/setup.sh --dev

run: setup
	bash scripts/run.sh

# two test files at a time (pytest-xdist), the longest first (conftest.py); make test TEST_WORKERS=0 runs them one
# after another
TEST_WORKERS ?= 2
test: setup-dev lint
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-unit:
	$(PYTHON) -m pytest tests/unit

test-dist:
	$(PYTHON) -m pytest tests/distributed

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .

bench:
	$(PYTHON) benchmarks/bench_memory.py
	$(PYTHON) benchmarks/bench_vocab_parallel.py
	$(PYTHON) benchmarks/bench_linear.py

# the GPU check (docs/gpu.md); on the device machine itself call the script, which needs no make:
#   bash scripts/gpu_check.sh --out $OUT      (without a CUDA GPU: a dry run)
GPU_CHECK_OUT ?= /tmp/ntl_scale_gpu_check/out
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# before a device call: .gpu_wheels/ (built if missing), its COMMIT record and the size check
gpu-prepare:
	PYTHON=$(PYTHON) bash scripts/gpu_prepare.sh

# the wheels and sources a GPU machine without internet needs for gpu-check (.gpu_wheels/; with the tree <= 40 MiB: scripts/travel_size.py)
gpu-wheels:
	PYTHON=$(PYTHON) bash scripts/gpu_wheels.sh

docs:
	$(PYTHON) -m mkdocs build --strict

study:
	$(PYTHON) experiments/study.py --preset configs/study/cpu.yaml
