"""Whether a graph is being traced: ``torch.compile`` (Dynamo) or ``make_fx`` (torchtitan's graph trainer).

Code that keeps tensors across calls (caches) or writes into preallocated buffers with ``out=`` asks this:
a traced call must not leave its traced tensors in a cache, and the replay of a trace records the ops of an
autograd Function's forward for autograd, which refuses ``out=`` ops.
"""

from __future__ import annotations

import torch


def is_tracing() -> bool:
    """True inside ``torch.compile`` or under ``make_fx``'s proxy mode."""
    if torch.compiler.is_compiling():
        return True
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None
