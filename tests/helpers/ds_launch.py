"""Runs a script under DeepSpeed without compiling its CPU shared-memory op (test-only shim).

DeepSpeed's CPU accelerator compiles a shared-memory collective at start-up (60-110 s the first
time). Tests replace the builder with a no-op; gloo collectives are used instead.

    deepspeed --num_gpus 2 tests/helpers/ds_launch.py launch/train.py key=value ...
    python tests/helpers/spawn_ranks.py --deepspeed 2 PORT -- tests/helpers/ds_launch.py launch/train.py key=value ...
"""

import importlib
import os
import runpy
import sys

# This file's folder holds tests/helpers/tokenizers.py, which must not shadow the real package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *args, **kwargs: None
# NTL_TEST_ABSENT=matplotlib,wandb: run as if those packages were not installed (an import raises
# ImportError, importlib.util.find_spec returns None), as with only `pip install 'ntl_scale[deepspeed]'`.
for name in filter(None, os.environ.get("NTL_TEST_ABSENT", "").split(",")):
    sys.modules[name] = None  # type: ignore[assignment]
# NTL_TEST_SIGNAL_AT_STEP=N: rank 0 sends itself SIGUSR1 during step N (as a Slurm time-limit warning would).
if os.environ.get("NTL_TEST_SIGNAL_AT_STEP"):
    import signal

    from ntl_scale.integrations.deepspeed.trainer import Trainer

    signal_step, train_step = int(os.environ["NTL_TEST_SIGNAL_AT_STEP"]), Trainer.train_step

    def signalled_step(self, step):
        row = train_step(self, step)
        if step == signal_step and self.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return row

    Trainer.train_step = signalled_step
# NTL_TEST_RECORD_POSITIONS=path: rank 0 writes every training micro-batch's rows (input_ids, labels,
# attention_mask, position_ids) as JSON lines, as the model gets them.
if os.environ.get("NTL_TEST_RECORD_POSITIONS"):
    import json

    from ntl_scale.training.model_inputs import Inputs

    record_path, device_batch = os.environ["NTL_TEST_RECORD_POSITIONS"], Inputs.device_batch

    def recorded_batch(self, host, *, training):
        batch = device_batch(self, host, training=training)
        if training and self.rank == 0:
            keys = ("input_ids", "labels", "attention_mask", "position_ids")
            with open(record_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({k: batch[k].tolist() for k in keys if k in batch}) + "\n")
        return batch

    Inputs.device_batch = recorded_batch
arguments = sys.argv[1:]
script = next(a for a in arguments if a.endswith(".py"))
arguments.remove(script)
sys.argv = [script, *arguments]
runpy.run_path(script, run_name="__main__")
