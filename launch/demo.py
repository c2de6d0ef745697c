"""Self-check and demo: cross entropy alone cannot tell a near miss from a far miss; NTL can.

Run: ``python launch/demo.py``. It builds a tiny vocabulary, puts the same probability on a wrong
digit (3 or 9) for a true 4, and prints CE and CE + 0.3 * NTL for every NTL variant. It also checks
the fused path against a plain PyTorch computation and exits non-zero if they disagree.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import ntl_scale


def main() -> int:
    tokens = ["<pad>", "the", "answer", "is", "."] + [str(d) for d in range(10)] + ["▁7", "12"]
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens)
    print(f"number-token table: {vocab}")

    true_id = tokens.index("4")
    rows = []
    for guess in ("4", "3", "9"):
        logits = torch.full((1, len(tokens)), -2.0)
        logits[0, tokens.index(guess)] = 4.0  # same confidence, different wrong digit
        labels = torch.tensor([true_id])
        out = {
            kind: ntl_scale.ce_with_ntl(logits, labels, vocab, ntl_weight=0.3, loss=kind)
            for kind in ("was", "mse", "mae", "huber")
        }
        rows.append((guess, out))

    confidence = F.softmax(torch.tensor([4.0] + [-2.0] * (len(tokens) - 1)), dim=0)[0]
    print(f"\ntrue digit 4; the model puts p={confidence:.2f} on its guess (CE cannot tell 3 from 9)")
    header = f"{'guess':>6} {'CE':>8} " + " ".join(
        f"{'CE+0.3*' + k.upper():>13}" for k in ("was", "mse", "mae", "huber")
    )
    print(header)
    for guess, out in rows:
        cells = " ".join(f"{float(out[k].loss):13.4f}" for k in ("was", "mse", "mae", "huber"))
        print(f"{guess:>6} {float(out['was'].ce):8.4f} {cells}")

    # Self-check: the fused op against plain PyTorch (CE) and a direct NTL-WAS formula.
    torch.manual_seed(0)
    logits = torch.randn(64, len(tokens), dtype=torch.float64)
    labels = torch.randint(0, len(tokens), (64,))
    with torch.no_grad():
        got = ntl_scale.ce_with_ntl(logits, labels, vocab, ntl_weight=0.3)
    ce_ref = F.cross_entropy(logits, labels)
    probs = F.softmax(logits[:, vocab.ids], dim=-1)
    row = vocab.index_of_id()[labels]
    is_num = row >= 0
    dist = (vocab.values.double()[row[is_num]].unsqueeze(1) - vocab.values.double().unsqueeze(0)).abs()
    was_ref = (probs[is_num] * dist).sum(-1).mean()
    ok = torch.allclose(got.ce, ce_ref, rtol=1e-12) and torch.allclose(got.ntl, was_ref, rtol=1e-12)
    print(
        f"\nself-check (fused vs plain PyTorch): CE {float(got.ce):.6f} vs {float(ce_ref):.6f}, "
        f"NTL-WAS {float(got.ntl):.6f} vs {float(was_ref):.6f}: {'OK' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
