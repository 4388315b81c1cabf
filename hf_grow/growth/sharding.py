"""Layers shared out among processes: each layer's M is reduced to one owner, which alone solves the layer.

With several processes, M is the largest thing growth holds (heads x d^2 per layer) and the solve its longest
step (a d^3 decomposition per head). Each layer gets one owner (`plan_owners`, balanced by that cost): its M is
reduced to the owner only (`collect_statistics`'s ``owners``), and the owner alone solves it into the compact form
of `hf_grow.compact` and keeps it. The other processes get its skeleton (`skeleton`: the shapes, and the per-head
norms and gain rates that the step sizes and the budget need). At every step each owner computes its layers' Q/K
weights and broadcasts them (`Sharding.share`), as it does each head's report: every process writes the same
weights, bit for bit, and holds the solved form of its own layers only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..distributed import OtherProcessFailed, Processes


def plan_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The process that owns each layer: ``owners[layer]`` in ``range(world_size)``, balancing the summed costs.

    Greedy longest-first: layers by decreasing cost (the lower index first among equal costs) each go to the
    process with the least cost so far (the lowest rank among equal ones). Deterministic, so every process
    computes the same plan. Equal costs go round-robin (5 layers on 2 processes: 0, 1, 0, 1, 0), so the counts
    differ by one at most; where ``world_size`` exceeds the layers, some processes own none (and still take part).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if any(not cost >= 0 for cost in costs):
        raise ValueError(f"layer costs must be non-negative numbers, got {list(costs)}")
    owners = [0] * len(costs)
    loads = [0.0] * world_size
    for layer in sorted(range(len(costs)), key=lambda layer: (-costs[layer], layer)):
        owner = min(range(world_size), key=lambda rank: (loads[rank], rank))
        owners[layer] = owner
        loads[owner] += costs[layer]
    return owners


def solve_cost(num_heads: int, input_width: int) -> float:
    """The solve's cost of a layer, up to a constant: a d^3 decomposition per head, d the width of its inputs."""
    return float(num_heads) * float(input_width) ** 3


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Which process owns each layer (``owners``), and the ``processes`` that share them."""

    processes: Processes
    owners: tuple[int, ...]

    @classmethod
    def planned(cls, processes: Processes, costs: Sequence[float]) -> Sharding:
        """The owners `plan_owners` chooses for layers of these ``costs``."""
        return cls(processes, tuple(plan_owners(costs, processes.world_size)))

    def owns(self, layer: int) -> bool:
        """Whether this process owns ``layer``."""
        return self.owners[layer] == self.processes.rank

    def share(self, layer: int, value: Any, device: torch.device) -> Any:
        """What ``layer``'s owner computed (``value``: any picklable structure of tensors, dataclasses, tuples and
        dicts) on every process, its tensors on ``device``: the owner passes it, the others None. Every process must
        call it, for the same layers in the same order. Sent through the CPU (a pickled CUDA tensor would land on
        the owner's device index), so its bits are unchanged."""
        objects = [moved(value, torch.device("cpu")) if self.owns(layer) else None]
        self.processes.broadcast_object_(objects, self.owners[layer])
        return value if self.owns(layer) else moved(objects[0], device)

    def computed(self, layer: int, compute: Callable[[], Any], device: torch.device) -> Any:
        """``compute()`` run by ``layer``'s owner, on every process (`share`). Where it raises on the owner, the
        owner sends word of it before raising, so that the others raise `OtherProcessFailed` rather than wait in
        the broadcast for a value that never comes."""
        if not self.owns(layer):
            value = self.share(layer, None, device)
            if isinstance(value, _Failed):
                raise OtherProcessFailed(
                    f"process {self.owners[layer]} failed computing layer {layer}'s part ({value.error}); its "
                    "error is in its output"
                )
            return value
        try:
            value = compute()
        except Exception as error:
            self.share(layer, _Failed(f"{type(error).__name__}: {error}"), device)
            raise
        return self.share(layer, value, device)

    def share_skeletons(self, layers: list, methods: dict[int, Any], devices: Sequence[torch.device]) -> None:
        """Fill ``layers`` and ``methods`` (what solved each layer) in place, where this process does not own the
        layer, with the owner's `skeleton` of it and its methods, on ``devices[layer]``."""
        for layer, solved in enumerate(layers):
            shared = self.share(layer, (skeleton(solved), methods[layer]) if self.owns(layer) else None, devices[layer])
            if not self.owns(layer):
                layers[layer], methods[layer] = shared


@dataclasses.dataclass(frozen=True)
class _Failed:
    """What an owner shares in place of a value its computation failed to give (`Sharding.computed`)."""

    error: str


def moved(value: Any, device: torch.device, kept: frozenset[str] | None = None) -> Any:
    """``value`` with every tensor in it on ``device`` (dataclasses, named tuples, tuples, lists and dicts), but
    those on the meta device. ``kept``: only the dataclass fields of these names move; every other tensor goes to
    the meta device (its shape without its memory)."""
    if isinstance(value, torch.Tensor):
        target = device if kept is None else torch.device("meta")
        return value if value.is_meta else value.to(target)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            field.name: moved(getattr(value, field.name), device, None if kept and field.name in kept else kept)
            for field in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(moved(item, device, kept) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(moved(item, device, kept) for item in value)
    if isinstance(value, dict):
        return {key: moved(item, device, kept) for key, item in value.items()}
    return value


#: What every process needs of a layer it does not own (`layer_solve.LayerProblem`): the step normalization's
#: per-head norms, and the gain rates a budget is allocated by. Everything else is the owner's alone.
SKELETON_FIELDS = frozenset({"norms", "rates"})


def skeleton(solved: Any) -> Any:
    """A solved layer (`layer_solve.LayerProblem`) as the processes that do not own it hold it: its
    `SKELETON_FIELDS` on the CPU, every other tensor on the meta device (shapes, no memory): computing with one
    fails loudly or gives a meta tensor, never a wrong number."""
    return moved(solved, torch.device("cpu"), SKELETON_FIELDS)
