"""Model FLOPs, TFLOP/s and MFU (ntl_scale/training/flops.py) against independent references (issue 29).

Sections:
1. Parameter counts against the model's own ``sum(p.numel())`` (GPT-2 with a tied output layer, Llama
   untied).
2. FLOPs of a forward and of a forward + backward against ``torch.utils.flop_counter.FlopCounterMode``
   on tiny models built from configs (eager attention, so that the scores are counted matmuls): GPT-2,
   Llama (also with ``heads x head_dim`` != hidden), T5 (tied and untied; the encoder and decoder of
   different lengths and depths). ``N`` counts every non-embedding parameter (PaLM's convention),
   norm gains and biases included, which FlopCounterMode does not count (they are not matmuls), so the
   count must lie in ``[reference, reference + 6 x vector parameters x tokens]`` (0.4 % above the
   reference for Llama and T5, 1.7 % for GPT-2 here); the attention scores are counted exactly (full
   ``S x S`` products, as eager attention computes them). Padding tokens are not counted.
3. Rates and MFU from a stretch's tokens and FLOPs.
4. The peak table by device name, as ``torch.cuda.get_device_name`` reports it, against the dense bf16
   figures of the vendors' data sheets (half the "with sparsity" figure where only that is printed).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ntl_scale.training.config import TrainConfig
from ntl_scale.training.flops import FlopsCounter, peak_tflops_of

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")


def _counted(model: torch.nn.Module, inputs: dict[str, torch.Tensor], backward: bool) -> int:
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as mode:
        logits = model(**inputs).logits
        if backward:
            logits.sum().backward()
    return mode.get_total_flops()


def _vector_params(model: torch.nn.Module) -> int:
    """Norm gains and biases: parameters of no matmul (FlopCounterMode leaves them out)."""
    return sum(p.numel() for p in model.parameters() if p.dim() == 1)


def _within(got: float, reference: int, slack: float) -> None:
    assert reference <= got <= reference + slack, (got, reference, slack, got / reference)


# ---- 1. parameter counts ----------------------------------------------------------------------------------


def test_tied_gpt2_counts_its_token_table_once_as_the_output_layer():
    config = transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=50, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    counter = FlopsCounter.for_model(model, device=CPU)
    # the model's own count, less the position table (a lookup); the tied token table is the output layer
    assert counter.matmul_params == sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    assert (counter.layers, counter.width, counter.peak_tflops) == (3, 32, None)


def test_untied_llama_leaves_out_its_input_table():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=40, tie_word_embeddings=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    counter = FlopsCounter.for_model(model, device=CPU)
    table = model.get_input_embeddings().weight
    assert counter.matmul_params == sum(p.numel() for p in model.parameters()) - table.numel()


# ---- 2. FLOPs against FlopCounterMode ---------------------------------------------------------------------


def _gpt2():
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=50, n_positions=64,
                                     attn_implementation="eager")  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama(**extra):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=50, tie_word_embeddings=False,
                                      attn_implementation="eager", **extra)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("build", [_gpt2, _llama, lambda: _llama(head_dim=32)], ids=["gpt2", "llama", "llama_head_dim"])
def test_causal_flops_match_torch_flop_counter(build):
    torch.manual_seed(0)
    model = build()
    batch, seq = 3, 20
    ids = torch.randint(0, 50, (batch, seq))
    counter = FlopsCounter.for_model(model, device=CPU)
    forward = _counted(model, {"input_ids": ids}, backward=False)
    both = _counted(model, {"input_ids": ids}, backward=True)
    assert both == 3 * forward  # the backward of each matmul is two of its size
    slack = 6 * _vector_params(model) * batch * seq
    _within(counter.flops(batch * seq, seq), both, slack)
    _within(counter.flops(batch * seq, seq) / 3, forward, slack / 3)
    _within(float(counter.of_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})), both, slack)
    # a padding row is no tokens: the batch's FLOPs scale with its tokens at the padded length
    mask = torch.ones_like(ids)
    mask[0] = 0
    assert float(counter.of_batch({"input_ids": ids, "attention_mask": mask})) == pytest.approx(
        float(counter.flops(batch * seq, seq)) * (batch - 1) / batch
    )


@pytest.mark.parametrize("tied", [True, False])
def test_seq2seq_flops_match_torch_flop_counter(tied):
    """T5: encoder parameters on encoder tokens, decoder parameters and the output layer on decoder
    tokens, cross-attention keys and values on encoder tokens (the old count charged every parameter
    for every token: 1.8x here)."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=2,
                                   num_heads=4, tie_word_embeddings=tied, dropout_rate=0.0, pad_token_id=0,
                                   decoder_start_token_id=0, attn_implementation="eager")  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    batch, enc_len, dec_len = 2, 13, 5
    ids = torch.randint(1, 64, (batch, enc_len))
    labels = torch.randint(1, 64, (batch, dec_len))
    inputs = {"input_ids": ids, "decoder_input_ids": model.prepare_decoder_input_ids_from_labels(labels=labels)}
    counter = FlopsCounter.for_model(model, kind="seq2seq", device=CPU)
    forward = _counted(model, inputs, backward=False)
    both = _counted(model, inputs, backward=True)
    assert both == 3 * forward
    slack = 6 * _vector_params(model) * batch * (enc_len + dec_len)
    got = counter.flops(batch * dec_len, dec_len, encoder_tokens=batch * enc_len, encoder_len=enc_len)
    _within(got, both, slack)
    _within(got / 3, forward, slack / 3)
    trained = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    _within(float(counter.of_batch(trained)), both, slack)
    # a row of padding (no input tokens, no answer tokens) costs nothing
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels.clone()}
    padded["attention_mask"][1] = 0
    padded["labels"][1] = -100
    assert float(counter.of_batch(padded)) == pytest.approx(float(counter.of_batch(trained)) / 2)


def test_seq2seq_needs_an_encoder_and_kind_is_checked():
    model = _gpt2()
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is not an encoder-decoder model.*kind='causal'"):
        FlopsCounter.for_model(model, kind="seq2seq", device=CPU)
    with pytest.raises(ValueError, match=r"kind='encoder'.*'causal' or 'seq2seq'"):
        FlopsCounter.for_model(model, kind="encoder", device=CPU)


# ---- 3. rates and MFU ---------------------------------------------------------------------------------------


def test_rates_and_mfu_per_device():
    counter = FlopsCounter(matmul_params=1, layers=0, width=0, peak_tflops=100.0)
    rates = counter.rates(tokens=4000, flops=8e12, seconds=2.0, devices=2)
    assert rates == {"tokens_per_s_per_device": 1000.0, "tflops": 2.0, "mfu": 0.02}
    assert FlopsCounter(1, 0, 0, None).rates(tokens=1, flops=1.0, seconds=1.0, devices=1)["mfu"] is None


# ---- 4. the peak table ------------------------------------------------------------------------------------

# Names as torch.cuda.get_device_name reports them -> dense bf16 TFLOP/s of the data sheet (NVIDIA
# H100/H200/H800/L40S/L40/L4/A10/A100 and GH200; HGX B200; AMD Instinct MI300X).
DEVICES = [
    ("NVIDIA H100 80GB HBM3", 989.0),  # SXM5
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),  # SXM
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA H800", 989.0),  # SXM
    ("NVIDIA H800 PCIe", 756.0),
    ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA A10", 125.0),
    ("NVIDIA L40S", 362.0),
    ("NVIDIA L40", 181.0),
    ("NVIDIA L4", 121.0),
    ("AMD Instinct MI300X", 1307.0),
    ("Tesla T4", None),  # not in the table: MFU not reported
]


@pytest.mark.parametrize(("name", "want"), DEVICES, ids=[name for name, _ in DEVICES])
def test_peak_table_by_device_name(monkeypatch, name, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    got = peak_tflops_of(torch.device("cuda", 0))
    assert got == (pytest.approx(want, abs=0.5) if want is not None else None), (name, got)
    assert peak_tflops_of(CPU) is None


def test_a_configured_peak_must_be_positive():
    with pytest.raises(ValueError, match=r"train\.peak_tflops must be > 0"):
        TrainConfig(peak_tflops=0)
