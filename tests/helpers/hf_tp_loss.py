"""``apply_ntl_to_hf_model`` on a Hugging Face model loaded with ``tp_plan="auto"`` (tensor parallelism) vs
the same model whole.

    torchrun --nproc_per_node 2 tests/helpers/hf_tp_loss.py OUT.pt

Every process saves nothing but waits while rank 0 writes a tiny Llama checkpoint (seed 0), loads it
with ``tp_plan="auto"`` (its output layer and MLP are split over the processes) and, separately,
whole; both get ``apply_ntl_to_hf_model`` and one forward + backward on the same batch. Rank 0 saves the two
losses and the two sets of full gradients, and the message with which ``apply_ntl_to_hf_model(chunked=True)``
refuses the tensor-parallel model. Test only.
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, ROOT)


def main() -> None:
    import torch.distributed as dist
    import transformers

    import ntl_scale
    from ntl_scale.integrations.hf import apply_ntl_to_hf_model

    out = sys.argv[1]
    dist.init_process_group("gloo")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = os.path.join(os.path.dirname(out), "llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)  # rank 0 writes, every process waits inside
    dist.barrier()
    vocab = ntl_scale.NumberVocab.from_id_to_token({10 + d: str(d) for d in range(10)}, vocab_size=96)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 24), generator=g)
    ids[torch.rand(ids.shape, generator=g) < 0.4] = 10 + torch.randint(0, 10, (1,), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    results = {}
    for name, plan in (("tp", "auto"), ("whole", None)):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan=plan, dtype=torch.float32)
        apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3)
        out_ = model(input_ids=ids, labels=labels)
        out_.loss.backward()
        grads = {n: getattr(p.grad, "full_tensor", p.grad.detach)().detach() for n, p in model.named_parameters()}
        width = out_.logits.shape[-1] if out_.logits is not None else None
        results[name] = {"loss": float(out_.loss), "grads": grads, "logits_width": width}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    try:
        apply_ntl_to_hf_model(model, vocab, chunked=True)
        results["chunked_error"] = None
    except ValueError as error:
        results["chunked_error"] = str(error)
    if dist.get_rank() == 0:
        results["tp_size"] = dist.get_world_size()
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from launch.finish import run_then_leave

    run_then_leave(main)
