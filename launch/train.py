"""Train a Hugging Face model with CE + NTL under DeepSpeed ZeRO-3.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train.py --config configs/train/tiny_cpu.yaml [key=value ...]
    python launch/train.py                      # one process, the tiny default
    torchrun --nproc_per_node 2 launch/train.py --config ... train.steps=20

Reads the config, initialises distributed once, builds tokenizer, number table, data, model and the
DeepSpeed engine, trains with exactly normalised CE + NTL, evaluates by generation, checkpoints
(resuming automatically from the run directory's latest checkpoint; SIGTERM/SIGUSR1 checkpoint and
stop) and exports a Hugging Face folder.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import signal
import socket
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ntl_scale
from ntl_scale.data import collate
from ntl_scale.eval.numbers import extract_number
from ntl_scale.integrations.deepspeed_tp import full_logits, gathered_weights, head_shard, install_chunked_head
from ntl_scale.training.config import RunConfig, load_config
from ntl_scale.training.data import Batches, eval_sets, train_dataset
from ntl_scale.training.evaluate import evaluate_generation
from ntl_scale.training.resume import Layout, plan_resume, read_layout, to_universal, write_layout
from ntl_scale.training.steps import (
    global_counts,
    loss_from_terms,
    micro_batch_loss,
    ntl_options,
    resolve_deepspeed_config,
    shift_for_causal,
)
from ntl_scale.training.tracking import Tracker, plot_curves


def init_distributed() -> tuple[int, int]:
    """Single-process runs get a one-rank world (DeepSpeed would otherwise ask for mpi4py)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores: N ranks x all cores each runs 3-4x slower
            local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))
    quiet_libraries()
    import deepspeed

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # DeepSpeed's CPU backend prints "... built successfully" per rank
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    for line in printed.getvalue().splitlines():
        if not (line.startswith("DeepSpeed ") and line.endswith(" built successfully")):
            print(line, flush=True)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def quiet_libraries() -> None:
    """One progress line per log interval: drop the libraries' known repeated notices (each named
    here), never their errors or other warnings."""
    warnings.filterwarnings(  # DeepSpeed's ZeRO-3 calls these per step; torch warns on every call site
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    import datasets
    import transformers

    datasets.disable_progress_bars()  # a bar per cached map and filter
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" at export


def build_tokenizer(cfg: RunConfig):
    if cfg.model.tokenizer == "builtin:char":
        from ntl_scale.training.tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    if not os.path.isdir(cfg.model.tokenizer):
        raise ValueError(
            f"model.tokenizer={cfg.model.tokenizer!r} is not a directory (looked in the working directory, next to the "
            "config file and in the repository); ntl_scale never downloads. Save the tokenizer first "
            "(tokenizer.save_pretrained(DIR)) and pass DIR, or use model.tokenizer=builtin:char"
        )
    return AutoTokenizer.from_pretrained(cfg.model.tokenizer)


def build_model(cfg: RunConfig, vocab_size: int, ds_config: dict, tokenizer):
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(ds_config)  # ZeRO-3 partitions the weights as they are created
    auto = transformers.AutoModelForCausalLM if cfg.model.kind == "causal" else transformers.AutoModelForSeq2SeqLM
    if cfg.model.path:
        model = auto.from_pretrained(cfg.model.path)
    else:
        arch = dict(cfg.model.architecture)
        ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
        ids["bos_token_id"] = ids["bos_token_id"] if ids["bos_token_id"] is not None else ids["eos_token_id"]
        if cfg.model.kind == "seq2seq":
            ids["decoder_start_token_id"] = ids["pad_token_id"]  # T5's convention
        config = transformers.AutoConfig.for_model(arch.pop("model_type"), vocab_size=vocab_size, **ids, **arch)
        model = auto.from_config(config)
    return model, keep_alive


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="run config YAML (default: the tiny CPU run)")
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before or after --config
    cfg = load_config(args.config, args.overrides)
    if cfg.model.path and not os.path.isdir(cfg.model.path):
        raise ValueError(
            f"model.path={cfg.model.path!r} is not a directory (looked in the working directory, next to the config "
            "file and in the repository); ntl_scale never downloads: pass a local checkpoint directory"
        )
    if not os.path.isfile(cfg.train.deepspeed_config):
        raise ValueError(
            f"train.deepspeed_config={cfg.train.deepspeed_config!r} is not a file (looked in the working directory, "
            "next to the config file and in the repository)"
        )
    rank, world = init_distributed()
    import deepspeed

    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(cfg.train.deepspeed_config) as f:
        ds_config = resolve_deepspeed_config(json.load(f), cfg.train, world)
    cfg.train.gradient_accumulation_steps = ga = ds_config["gradient_accumulation_steps"]  # global_batch_size
    if rank == 0:
        cfg.save(os.path.join(cfg.run_dir, "config.json"))
    tp = cfg.train.tensor_parallel_size
    dp = world // tp
    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    layout = Layout(dp, tp, cfg.train.micro_batch_size * ga * dp)
    resume = plan_resume(ckpt_dir, layout)  # a change that cannot continue the run stops here, before any step
    if resume == "universal":  # written on another number of ranks: DeepSpeed re-partitions a universal copy
        if rank == 0:
            print(
                f"resuming {cfg.run_dir} (written with {read_layout(ckpt_dir).describe()}) on "
                f"{layout.describe()}: converting its checkpoint to DeepSpeed's universal format",
                flush=True,
            )
        _on_rank_zero(rank, lambda: to_universal(ckpt_dir))
        ds_config.setdefault("checkpoint", {})["load_universal"] = True

    tokenizer = build_tokenizer(cfg)
    if cfg.model.path:
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(cfg.model.path).vocab_size
    else:
        vocab_size = cfg.model.architecture.get("vocab_size") or ntl_scale.pad_vocab_size(
            len(tokenizer), divisible_by=8
        )
    if vocab_size < len(tokenizer):
        raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=vocab_size, digit_level=cfg.ntl.digit_level)
    # rank 0 tokenises (and fills the Arrow cache) first; the other ranks then read its cache
    train_set = train_dataset(cfg.data, tokenizer, kind=cfg.model.kind) if rank == 0 else None
    torch.distributed.barrier()
    if rank != 0:
        train_set = train_dataset(cfg.data, tokenizer, kind=cfg.model.kind)
    evals = eval_sets(cfg.data)

    torch.manual_seed(cfg.train.seed)
    model, _keep = build_model(cfg, vocab_size, ds_config, tokenizer)
    trained = model
    if cfg.train.chunked_loss:  # CE + NTL from the hidden states: the logits are never materialised
        if cfg.model.kind != "causal":
            raise ValueError("train.chunked_loss=true supports model.kind=causal; use the logits path for seq2seq")
        from ntl_scale.integrations.hf import ChunkedLossCausalLM

        trained = ChunkedLossCausalLM(model, vocab, ntl_options(cfg.ntl), cfg.train.loss_chunk_tokens)
    if tp > 1 and cfg.model.kind != "causal":
        raise ValueError(
            f"train.tensor_parallel_size={tp} supports model.kind=causal (a vocabulary-parallel lm_head); "
            "train seq2seq models such as T5 with data parallelism and ZeRO-3"
        )
    try:
        engine, *_ = deepspeed.initialize(model=trained, model_parameters=model.parameters(), config=ds_config)
    except AssertionError as error:
        if tp > 1 and "AutoTP not supported" in str(error):
            raise ValueError(
                f"DeepSpeed AutoTP cannot split {type(model).__name__} (train.tensor_parallel_size={tp}): it supports "
                "models built from nn.Linear layers, such as Llama, Granite, Mistral or Qwen; GPT-2 uses Conv1D. "
                "Use one of those architectures or train.tensor_parallel_size=1"
            ) from error
        raise
    shard = head_shard(model) if tp > 1 else None
    if tp > 1 and shard is None:
        raise ValueError(
            f"DeepSpeed AutoTP left {type(model).__name__}'s output layer whole, expected a vocabulary shard"
        )
    if shard is not None and cfg.train.chunked_loss:
        install_chunked_head(shard, vocab, ntl_options(cfg.ntl), cfg.train.loss_chunk_tokens)
    if tp > 1:
        from deepspeed.utils import groups

        dp_group, dp_rank = groups.get_data_parallel_group(), groups.get_data_parallel_rank()
    else:
        dp_group, dp_rank = torch.distributed.group.WORLD, rank
    tp_group, vocab_start = (shard.group, shard.start) if shard is not None else (None, None)
    order = Batches(train_set, cfg.train.micro_batch_size, dp_rank, dp, cfg.data.seed, ga, cfg.data.shuffle_buffer)
    params = list(model.parameters())
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)  # this rank's part
    total = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3: the whole parameter
    with open(os.path.join(cfg.run_dir, f"zero_rank{rank}.json"), "w") as f:
        part = {"held": held, "total": total, "host": socket.gethostname(), "tp": tp, "dp": dp, "dp_rank": dp_rank}
        if shard is not None:
            part["vocab_shard"] = [shard.start, shard.end]
        json.dump(part, f)
    start_step = 0
    if resume:
        _, client = engine.load_checkpoint(ckpt_dir)
        if "examples_consumed" not in client:
            raise ValueError(
                f"{ckpt_dir} was written by an older launch/train.py (its data position counts micro-batches); "
                "finish it with that version or start a new run_dir"
            )
        start_step, order.position = client["step"], client["examples_consumed"]
        torch.set_rng_state(client["rng"])
        if rank == 0:
            print(f"resumed from step {start_step}", flush=True)
        if start_step >= cfg.train.steps:  # started again after it finished: say so, change nothing
            if rank == 0:
                print(
                    f"{cfg.run_dir} already finished: its checkpoint is at step {start_step} of train.steps="
                    f"{cfg.train.steps}; nothing to do (raise train.steps to train on, or use a new run_dir)",
                    flush=True,
                )
            _shutdown()
            return {"finished_before": start_step, "history": []}

    stop = {"signal": 0}
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda num, _frame: stop.update(signal=num))

    def save(step: int) -> None:
        client = {"step": step, "examples_consumed": order.position, "rng": torch.get_rng_state()}
        engine.save_checkpoint(ckpt_dir, tag=f"step{step}", client_state=client, save_latest=False)
        torch.distributed.barrier()  # every rank's shard is on disk before "latest" points at it
        if rank == 0:  # a crash before this line leaves "latest" at the previous, complete checkpoint
            write_layout(ckpt_dir, layout)
            with open(os.path.join(ckpt_dir, "latest.tmp"), "w") as f:
                f.write(f"step{step}")
            os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))
        torch.distributed.barrier()

    tracker = Tracker(cfg.tracking.wandb, cfg.run_dir, cfg.to_dict(), cfg.tracking.project, active=rank == 0)
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    if rank == 0:  # keep the logged curve free of steps that are about to be redone
        kept = []
        if os.path.isfile(metrics_path):
            kept = [line for line in open(metrics_path) if json.loads(line)["step"] <= start_step]
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    clock, history, tokens_read = time.time(), [], 0
    for step in range(start_step + 1, cfg.train.steps + 1):
        step_start = time.perf_counter()
        for group in engine.optimizer.param_groups:
            group["lr"] = cfg.train.lr_at(step)
        batches = [collate(order.next(), tokenizer.pad_token_id) for _ in range(ga)]
        causal = cfg.model.kind == "causal"  # seq2seq labels already align with the decoder's logits
        targets = [shift_for_causal(b["labels"]) if causal else b["labels"] for b in batches]
        counts = global_counts(targets, vocab, None if dp == 1 else dp_group)
        totals = None  # [ce_sum, ntl_sum, tokens, numbers, hits] on the loss's device: read once per step
        for batch, target in zip(batches, targets):
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            if not causal:
                inputs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=target)
            if cfg.train.chunked_loss:
                terms = engine(**inputs, targets=target)
                loss, stats = loss_from_terms(terms, target, cfg.ntl, counts=counts, scale=ga * dp)
            else:
                logits = engine(**inputs).logits  # with TP: this rank's vocabulary shard
                loss, stats = micro_batch_loss(
                    logits, target, vocab, cfg.ntl, counts=counts, scale=ga * dp, tp_group=tp_group,
                    vocab_start=vocab_start,
                )  # fmt: skip
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            totals = stats if totals is None else totals + stats
        # every token the model read (prompts and answers, not padding; seq2seq: the decoder's too)
        read = sum(int(b["attention_mask"].sum()) for b in batches)
        read += 0 if causal else sum(int((b["labels"] != -100).sum()) for b in batches)
        totals = torch.cat([totals, totals.new_tensor([read])])
        torch.distributed.all_reduce(totals, group=dp_group)  # TP ranks hold the same sums: DP only
        totals = totals.cpu()
        tokens_read += int(totals[5])
        ce, ntl = float(totals[0] / totals[2]), float(totals[1] / max(totals[3], 1))
        row = {
            "step": step,
            "ce": ce,
            "ntl": ntl,
            "number_acc": float(totals[4] / max(totals[3], 1)),
            "lr": engine.optimizer.param_groups[0]["lr"],
            "grad_norm": float(engine.get_global_grad_norm() or 0),
            "tokens": int(totals[5]),
            "time_s": time.perf_counter() - step_start,  # data, forward, backward, optimizer, logging reduce
        }
        history.append(row)
        if rank == 0:
            tracker.log(row, step)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                elapsed = time.time() - clock
                eta = (cfg.train.steps - step) * elapsed / (step - start_step)
                print(
                    f"step {step}/{cfg.train.steps}  ce {ce:.4f}  ntl {ntl:.4f}  number acc {row['number_acc']:.3f}  "
                    f"{tokens_read / elapsed:.0f} tok/s  eta {eta:.0f}s",
                    flush=True,
                )
        flag = torch.tensor([stop["signal"]])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if (cfg.train.save_every and step % cfg.train.save_every == 0) or flag.item():
            save(step)
        if flag.item():
            if rank == 0:
                print(f"signal {flag.item()}: checkpointed at step {step}, stopping", flush=True)
            tracker.finish()
            _write_status(cfg.run_dir, rank, "stopped", step)
            _shutdown()
            return {"stopped_at": step, "history": history}
    save(cfg.train.steps)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None), gathered_weights(model):
        if rank == 0:  # a plain Hugging Face folder: from_pretrained(run_dir/hf_model) loads it
            model.save_pretrained(os.path.join(cfg.run_dir, "hf_model"))
            tokenizer.save_pretrained(os.path.join(cfg.run_dir, "hf_model"))
            vocab.save(os.path.join(cfg.run_dir, "hf_model", "number_vocab.json"))
    results = {}
    for split, examples in (evals if cfg.eval.at_end else {}).items():
        path = os.path.join(cfg.run_dir, f"predictions_{split}.jsonl") if rank == 0 else None
        with full_logits(shard):  # every rank generates the same answers; a TP head gathers its columns
            results[split] = evaluate_generation(
                model,
                tokenizer,
                examples,
                kind=cfg.model.kind,
                max_new_tokens=cfg.eval.max_new_tokens,
                num_beams=cfg.eval.num_beams,
                synced_gpus=world > 1,
                predictions_path=path,
            )
    if rank == 0:
        tracker.log({f"eval/{split}/{k}": v for split, m in results.items() for k, v in m.items()}, cfg.train.steps)
        tracker.finish()
        if cfg.tracking.plot:
            if importlib.util.find_spec("matplotlib") is None:
                print("loss_curves.png skipped: matplotlib is not installed (pip install 'ntl_scale[wandb]')")
            else:
                plot_curves(metrics_path, os.path.join(cfg.run_dir, "loss_curves.png"))
    if rank == 0 and results:
        with open(os.path.join(cfg.run_dir, "eval.json"), "w") as f:
            json.dump(results, f, indent=2)
        print_summary(cfg.run_dir, results, {split: len(examples) for split, examples in evals.items()})
    _write_status(cfg.run_dir, rank, "finished", cfg.train.steps)
    _shutdown()
    return {"history": history, "eval": results}


def print_summary(run_dir: str, results: dict, sizes: dict, shown: int = 6) -> None:
    """The end of a run: accuracy and error per held-out split, then a few questions with the model's answers."""
    print(f"\nheld-out questions, answered by greedy generation ({run_dir}/eval.json)")
    print(f"{'split':<13} {'questions':>9} {'accuracy':>9} {'MAE':>10} {'unparseable':>12}")
    for split, m in results.items():
        print(f"{split:<13} {sizes[split]:>9} {m['accuracy']:>9.1%} {m['mae']:>10.3g} {m['unparseable']:>12.1%}")
    split = next(iter(results))
    with open(os.path.join(run_dir, f"predictions_{split}.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(shown))]
    width = max(len(r["question"]) for r in rows)
    print(f"\nexamples ({split}; all in {run_dir}/predictions_{split}.jsonl)")
    for r in rows:
        mark = "right" if r["parsed"] is not None and r["parsed"] == extract_number(r["answer"]) else "wrong"
        print(f"  {r['question']:<{width}}  true {r['answer']:>8}  model {r['generated'].strip()!s:>8}  {mark}")


def _on_rank_zero(rank: int, work) -> None:
    """Runs ``work`` on rank 0 while the others wait; if it fails, every rank stops (none waits forever)."""
    failed = torch.tensor([0])
    error = None
    if rank == 0:
        try:
            work()
        except Exception as exc:  # re-raised below, after the other ranks have been told
            failed[0], error = 1, exc
    torch.distributed.broadcast(failed, src=0)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError("rank 0 failed preparing the checkpoint (its error is above); stopping")


def _write_status(run_dir: str, rank: int, state: str, step: int) -> None:
    """``status.json``: ``finished`` or ``stopped`` (checkpointed early on a signal); batch scripts read it."""
    if rank == 0:
        with open(os.path.join(run_dir, "status.json.tmp"), "w") as f:
            json.dump({"state": state, "step": step}, f)
        os.replace(os.path.join(run_dir, "status.json.tmp"), os.path.join(run_dir, "status.json"))


def _shutdown() -> None:
    """Every rank reaches this point before any tears down gloo/NCCL: a rank that destroys its process
    group while a peer still works (rank 0 writing the model, the plot, wandb) can abort the peer."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
