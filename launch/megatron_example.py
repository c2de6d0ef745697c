"""End-to-end NTL on ``megatron.core`` alone (no Megatron-LM checkout): a tiny GPT on arithmetic text.

Builds a character tokenizer (every digit is one token, so the digit-level number table comes
from its ``inv_vocab``), writes the text as Megatron indexed files, reads them back through
``megatron.core.datasets.GPTDataset``, and trains a tiny ``GPTModel`` with CE + NTL through
Megatron's pipeline schedule, tensor and pipeline parallel as launched:

    torchrun --nproc_per_node 4 launch/megatron_example.py --tp 2 --pp 2 --steps 30 --ntl-weight 0.3

``--config configs/megatron/FILE.yaml`` reads the file's ``megatron_args`` as flags (the command line's
come after them and win); the model and batch flags it knows are Megatron-LM's own (``--num-layers``,
``--hidden-size``, ``--num-attention-heads``, ``--seq-length``, ``--max-position-embeddings``,
``--micro-batch-size``, ``--global-batch-size``, ``--train-iters``, ``--lr``), so
``configs/megatron/tiny_cpu.yaml`` runs here and with ``launch/pretrain_gpt_ntl.py`` alike.

Checkpoints follow Megatron-LM's names and layout: ``--save DIR`` writes
``DIR/iter_0000030/mp_rank_TT[_PPP]/model_optim_rng.pt`` and ``DIR/latest_checkpointed_iteration.txt``
every ``--save-interval`` steps and at the end; ``--load DIR`` resumes from the latest one;
``--exit-signal-handler`` makes SIGTERM or SIGUSR1 checkpoint and exit after the current step.

On GPUs it runs as is. On CPU (gloo) Megatron needs a few CUDA calls patched; the test suite's patches
do that (``tests/helpers/megatron_cpu.py``), never this file. The CPU route on a laptop runs this file
under them:

    torchrun --nproc_per_node 1 tests/helpers/megatron_cpu_launch.py launch/megatron_example.py \
        --config configs/megatron/tiny_cpu.yaml
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile

import numpy
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for launch.finish

from launch import startup
from launch.finish import run_then_leave
from launch.megatron_args import to_argv
from ntl_scale.atomic import atomic_write, write_atomically
from ntl_scale.integrations import megatron as ntl_megatron


def arithmetic_text(lines: int, seed: int) -> list[str]:
    """Seeded ``a+b=c`` / ``a*b=c`` problems, one per line."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        out.append(f"{a}+{b}={a + b}" if rng.random() < 0.5 else f"{a}*{b}={a * b}")
    return out


class CharTokenizer:
    """A character tokenizer with Megatron's tokenizer interface (``inv_vocab``, ``eod``, ...)."""

    def __init__(self, alphabet: str = "0123456789+*=\n") -> None:
        self.inv_vocab = {0: "<eod>", 1: "<pad>", **{i + 2: c for i, c in enumerate(alphabet)}}
        self.vocab = {t: i for i, t in self.inv_vocab.items()}
        self.eod, self.pad = 0, 1
        # Megatron's dataset cache keys on this description of the tokenizer.
        self.unique_identifiers = {"class": type(self).__name__, "alphabet": alphabet}

    @property
    def vocab_size(self) -> int:
        return len(self.inv_vocab)

    def tokenize(self, text: str) -> list[int]:
        return [self.vocab[c] for c in text]

    def detokenize(self, ids) -> str:
        return "".join(self.inv_vocab[int(i)] for i in ids)


def build_dataset(tokenizer: CharTokenizer, prefix: str, seq_length: int, samples: int, seed: int):
    """Writes the text as indexed files (rank 0) and returns a ``GPTDataset`` over them."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if dist.get_rank() == 0:
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
        for line in arithmetic_text(4000, seed):
            builder.add_document([*tokenizer.tokenize(line + "\n"), tokenizer.eod], [len(line) + 2])
        builder.finalize(f"{prefix}.idx")
    dist.barrier()
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=os.path.dirname(prefix),
    )
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, [samples, None, None], lambda: True, config).build()
    return datasets[0]


def build_model(
    vocab_size: int,
    seq_length: int,
    tp: int,
    pp: int,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    ffn_hidden_size: int | None = None,
    model_class: type | None = None,
):
    """A small ``GPTModel`` (local layer spec, fp32, no fusions, dropout 0) for this pipeline stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    stage = parallel_state.get_pipeline_model_parallel_rank()
    return (model_class or GPTModel)(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        pre_process=stage == 0,
        post_process=stage == pp - 1,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )


def train(args: argparse.Namespace) -> list[dict]:
    """Trains for ``args.steps`` steps; returns the reports of the last pipeline stage, per step."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import ntl_scale

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    torch.manual_seed(args.seed)
    tokenizer = CharTokenizer()
    padded = ntl_scale.pad_vocab_size(tokenizer.vocab_size, divisible_by=8, tp_size=args.tp)
    settings = ntl_megatron.NTLSettings.from_args(args)
    vocab = ntl_megatron.build_number_vocab(settings, tokenizer, padded)
    workdir = args.workdir
    if workdir is None and args.save:  # next to the checkpoints: the run directory every node sees
        workdir = os.path.join(os.path.dirname(os.path.abspath(args.save)), "data")
    if workdir is None:  # one node: rank 0's temporary folder, for every rank
        shared = [tempfile.mkdtemp(prefix="ntl_megatron_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        workdir = shared[0]
    os.makedirs(workdir, exist_ok=True)
    dp = parallel_state.get_data_parallel_world_size()
    if args.global_batch_size is not None:  # Megatron's rule: global = micro-batch size x micro-batches x DP
        per_step = args.micro_batch_size * dp
        if args.global_batch_size % per_step:
            raise SystemExit(
                f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size x "
                f"data-parallel size = {per_step}: pick a multiple of {per_step}"
            )
        args.micro_batches = args.global_batch_size // per_step
    samples = args.steps * args.micro_batches * args.micro_batch_size * dp
    dataset = build_dataset(tokenizer, os.path.join(workdir, "arithmetic"), args.seq_length, samples, args.seed)
    model = build_model(
        padded,
        args.max_position_embeddings or args.seq_length,
        args.tp,
        args.pp,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
    )
    # built on the host (use_cpu_initialization), then moved, as Megatron-LM's get_model does; every
    # tensor the loop feeds the model or a collective goes to this device (NCCL refuses host tensors)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dp_rank = parallel_state.get_data_parallel_rank()
    order = iter(range(dp_rank, len(dataset), dp))

    def get_batch(iterator):
        items = [dataset[next(iterator)] for _ in range(args.micro_batch_size)]
        batch = {k: torch.stack([torch.as_tensor(item[k]).to(device) for item in items]) for k in items[0]}
        return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]

    forward_step = ntl_megatron.make_forward_step(
        settings,
        vocab,
        get_batch,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        count_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        num_microbatches=args.micro_batches,
        data_parallel_size=dp,
    )
    start = load_checkpoint(args.load, model, optimizer) if args.load else 0
    for _ in range(start * args.micro_batches * args.micro_batch_size):  # the samples already trained on
        next(order)
    stop = {"signal": 0}
    if args.exit_signal_handler:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda num, _frame: stop.update(signal=num))
    history = []
    for step in range(start, args.steps):
        optimizer.zero_grad(set_to_none=True)
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=order,
            model=[model],
            num_microbatches=args.micro_batches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        for p in model.parameters():  # DDP's job in real runs: average gradients over DP replicas
            if p.grad is not None and dp > 1:
                dist.all_reduce(p.grad, group=parallel_state.get_data_parallel_group())
                p.grad /= dp
        optimizer.step()
        if reports:
            summary = {key: sum(r[key] for r in reports) for key in reports[0]}
            row = {key: float(v[0] / v[1].clamp_min(1)) for key, v in summary.items()}
            history.append(row)
            if parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
                shown = "  ".join(f"{k} {v:.4f}" for k, v in row.items())
                print(f"step {step + 1:3d}/{args.steps}  {shown}", flush=True)
        flag = torch.tensor([float(stop["signal"])], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops after the same step
        last = step + 1 == args.steps or bool(flag.item())
        if args.save and (last or (args.save_interval and (step + 1) % args.save_interval == 0)):
            save_checkpoint(args.save, step + 1, model, optimizer)
        if flag.item():
            if dist.get_rank() == 0:
                print(f"signal {int(flag.item())}: checkpointed at iteration {step + 1}, exiting", flush=True)
            break
    parallel_state.destroy_model_parallel()
    return history


def _rank_dir(root: str, iteration: int) -> str:
    """Megatron-LM's legacy layout: ``iter_NNNNNNN/mp_rank_TT`` (``_PPP`` with pipeline parallel)."""
    from megatron.core import parallel_state

    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{pp:03d}"
    return os.path.join(root, f"iter_{iteration:07d}", name)


def save_checkpoint(root: str, iteration: int, model, optimizer) -> None:
    """Data-parallel rank 0 of each model shard writes it; the tracker file moves once all are on disk."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() == 0:
        path = _rank_dir(root, iteration)
        os.makedirs(path, exist_ok=True)
        state = {"iteration": iteration, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        state["rng_state"] = torch.get_rng_state()
        with atomic_write(os.path.join(path, "model_optim_rng.pt"), "wb") as f:
            torch.save(state, f)
    dist.barrier()
    if dist.get_rank() == 0:  # a crash before this line leaves the tracker at the previous, complete one
        tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
        write_atomically(tracker, str(iteration))
    dist.barrier()


def load_checkpoint(root: str, model, optimizer) -> int:
    """Restores the latest checkpoint under ``root``; returns its iteration (0 when there is none)."""
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return 0
    with open(tracker) as f:
        iteration = int(f.read().strip())
    state = torch.load(os.path.join(_rank_dir(root, iteration), "model_optim_rng.pt"), weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_state"])
    if dist.get_rank() == 0:
        print(f"resumed from iteration {iteration}", flush=True)
    return iteration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``--config FILE.yaml`` puts the file's ``megatron_args`` before the command line's."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="a configs/megatron/*.yaml file: its megatron_args as flags")
    parser.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    parser.add_argument("--steps", "--train-iters", dest="steps", type=int, default=30)
    parser.add_argument("--micro-batches", type=int, default=2, help="per step and DP rank (or --global-batch-size)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=None, help="sets --micro-batches from the DP size")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--save", default=None, help="checkpoint directory (Megatron-LM layout)")
    parser.add_argument("--load", default=None, help="resume from the latest checkpoint here, if any")
    parser.add_argument("--save-interval", type=int, default=0, help="also save every N steps (0: only at the end)")
    parser.add_argument("--exit-signal-handler", action="store_true", help="SIGTERM/SIGUSR1: checkpoint and exit")
    ntl_megatron.add_ntl_args(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument("--config", default=None)
    path = config.parse_known_args(argv)[0].config
    if path is not None:
        if not os.path.isfile(path):
            parser.error(f"--config {path}: no such file (a configs/megatron/*.yaml file)")
        argv = [*to_argv(path), *argv]
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    startup.init_distributed(  # NCCL with CUDA, else gloo; the launcher's rendezvous
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        launched="RANK" in os.environ,
    )
    train(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_leave(main)
