"""A test-only accelerator whose device generators are observable CPU ``torch.Generator`` objects.

It answers the part of DeepSpeed's accelerator interface that checkpoints use (``device_name``,
``device_count``, ``get_rng_state``, ``set_rng_state``, ``manual_seed_all``), so code that saves and
restores "every device generator" can be checked on a machine without devices: ``draw(i)`` is what a
dropout mask on device ``i`` would consume.
"""

from __future__ import annotations

import torch


class FakeAccelerator:
    def __init__(self, devices: int, seed: int = 0, name: str = "fake") -> None:
        self.name = name
        self.generators = [torch.Generator() for _ in range(devices)]
        self.manual_seed_all(seed)

    def device_name(self, device_index: int | None = None) -> str:
        return self.name if device_index is None else f"{self.name}:{device_index}"

    def device_count(self) -> int:
        return len(self.generators)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return self.generators[device_index or 0].get_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        self.generators[device_index or 0].set_state(new_state)

    def manual_seed_all(self, seed: int) -> None:
        """What ``torch.manual_seed(train.seed)`` does to every device generator at start-up."""
        for generator in self.generators:
            generator.manual_seed(seed)

    def draw(self, device_index: int, n: int = 4) -> list[float]:
        """Random numbers from device ``device_index``'s generator (it moves on, as dropout would)."""
        return torch.rand(n, generator=self.generators[device_index]).tolist()
