"""Several processes collecting statistics together: sums across processes, one main process, unwrapped models.

Statistics and held-out losses are sums, so processes that each read their own shard of the data add up to
exactly what one process reading all of it would get. Collectives run only when the caller asks for them
by passing an `accelerate.Accelerator`: a collective on a code path that only some processes take would
wait forever, so hf_grow never starts one on its own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch import distributed as dist


if TYPE_CHECKING:
    from accelerate import Accelerator


logger = logging.getLogger("hf_grow")
_warned: list[bool] = []  # the warning about an initialized process group without accelerator: once per process


class OtherProcessFailed(RuntimeError):
    """Raised on every process when another process of the group failed (its own error is in its log)."""


class Processes:
    """The processes that sum their statistics: ``world_size``, this one's ``rank``, and in-place sums.

    With an `accelerate.Accelerator`, all of its processes. Without one, this process alone, even when
    torch.distributed is initialized (with a warning: the statistics then cover this process's data only).
    """

    def __init__(self, accelerator: Accelerator | None = None):
        self.accelerator = accelerator
        if accelerator is not None:
            self.world_size, self.rank = accelerator.num_processes, accelerator.process_index
            return
        self.world_size, self.rank = 1, 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not _warned:
            _warned.append(True)
            logger.warning(
                "torch.distributed is initialized with %d processes but no accelerator was passed: hf_grow uses the "
                "data of this process only. Pass accelerator=accelerate.Accelerator() on every process to sum the "
                "statistics and held-out losses across processes.",
                dist.get_world_size(),
            )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum_(self, tensor: Tensor) -> Tensor:
        """Replace ``tensor`` by its sum over the processes (in place) and return it."""
        if self.world_size > 1:
            tensor.copy_(self.accelerator.reduce(tensor, reduction="sum"))
        return tensor

    @contextlib.contextmanager
    def failing_together(self) -> Iterator[None]:
        """Every process leaves the block by the same door: if one raises, the others raise too.

        Without this, a process that fails (bad batch, non-finite loss) leaves the others waiting forever in
        the next collective. The flag sum is the one collective of the block, taken on both doors.
        """
        if self.world_size == 1:
            yield
            return
        try:
            yield
        except Exception:
            self._count_failures(failed=True)
            raise
        failures = self._count_failures(failed=False)
        if failures:
            raise OtherProcessFailed(f"{failures} other process(es) failed; their error is in their output")

    def _count_failures(self, failed: bool) -> int:
        device = self.accelerator.device if self.accelerator is not None else torch.device("cpu")
        return int(self.sum_(torch.tensor([float(failed)], dtype=torch.float64, device=device)).item())


def unwrap_model(model: nn.Module, accelerator: Accelerator | None = None) -> nn.Module:
    """The model inside DistributedDataParallel / DataParallel / accelerate wrappers (``.module``).

    hf_grow runs the plain model: its backward reaches only the input embeddings (no parameter gradients to
    synchronize), and the statistics are summed across processes explicitly.
    """
    if accelerator is not None:
        model = accelerator.unwrap_model(model, keep_torch_compile=False)
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model
