"""Several processes growing together: sums across processes, one main process, unwrapped and re-bucketed models.

Statistics and held-out losses are sums, so processes that each read their own shard of the data add up to
exactly what one process reading all of it would get; a sum may also go to one process only (`reduce_to_`, M to
the owner of its layer: `hf_grow.growth.sharding`). Collectives run only when the caller asks for them
by passing an `accelerate.Accelerator`: a collective on a code path that only some processes take would
wait forever, so hf_grow never starts one on its own.

Growth during training resizes Parameters in place. DistributedDataParallel keeps gradient buckets sized for
the old shapes, so its reducer is rebuilt afterwards (`rebuild_ddp_buckets_`); FSDP and DeepSpeed shard
parameters and optimizer state by shape and are refused (`refuse_sharded_training`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

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

    def broadcast_(self, tensor: Tensor) -> Tensor:
        """Replace ``tensor`` by the main process's (in place) and return it."""
        if self.world_size > 1:
            from accelerate.utils import broadcast

            tensor.copy_(broadcast(tensor, from_process=0))
        return tensor

    def sum_(self, tensor: Tensor) -> Tensor:
        """Replace ``tensor`` by its sum over the processes (in place) and return it."""
        if self.world_size > 1:
            tensor.copy_(self.accelerator.reduce(tensor, reduction="sum"))
        return tensor

    def reduce_to_(self, tensor: Tensor, owner: int) -> Tensor | None:
        """The sum of ``tensor`` over the processes, in place on process ``owner``, which gets it back; the other
        processes get None (their ``tensor`` holds a partial sum then, to be dropped)."""
        if self.world_size == 1:
            return tensor
        dist.reduce(tensor, dst=owner, op=dist.ReduceOp.SUM)
        return tensor if self.rank == owner else None

    def broadcast_object_(self, objects: list, owner: int) -> list:
        """Replace the items of ``objects`` (picklable, of the same length everywhere) by process ``owner``'s, in
        place, and return it."""
        if self.world_size > 1:
            dist.broadcast_object_list(objects, src=owner)
        return objects

    def gathered(self, value: Any) -> list:
        """Every process's ``value`` (picklable), in process order."""
        if self.world_size == 1:
            return [value]
        values: list = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def check_same(
        self, value: dict[str, Any], what: str, advice: str = "call it with the same options on every process"
    ) -> None:
        """Refuse, with a ValueError on every process, where ``value`` (picklable, by name) differs from the main
        process's: processes given different options would each compute their part differently (a model that
        neither option describes) or wait forever in a collective that another process does not take."""
        if self.world_size == 1:
            return
        main = self.broadcast_object_([value if self.is_main else None], owner=0)[0]
        here = [f"{name} {value.get(name)!r} here, {main.get(name)!r} on the main process"
                for name in sorted(set(main) | set(value)) if main.get(name) != value.get(name)]
        differing = self._count_failures(failed=bool(here))
        if differing:
            where = "; ".join(here) if here else f"on {differing} other process(es)"
            raise ValueError(
                f"{what} differ between the processes ({where}): {advice}"
            )

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
    """The model inside DistributedDataParallel / DataParallel / accelerate wrappers (``.module``) and
    torch.compile's (``_orig_mod``).

    hf_grow runs the plain model: its backward reaches only the input embeddings (no parameter gradients to
    synchronize), and the statistics are summed across processes explicitly. A compiled model follows the plain
    one's new shapes (it recompiles).
    """
    if accelerator is not None:
        model = accelerator.unwrap_model(model, keep_torch_compile=False)
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_modules", {}).get("_orig_mod"), nn.Module):
            model = model._orig_mod
        else:
            return model


#: What each refused wrapper or accelerate mode is called in the error message.
_SHARDED = {"FullyShardedDataParallel": "FSDP", "FSDPModule": "FSDP", "DeepSpeedEngine": "DeepSpeed"}
_SHARDED_MODES = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed", "MEGATRON_LM": "Megatron-LM"}


def refuse_sharded_training(model: nn.Module, accelerator: Accelerator | None = None) -> None:
    """Refuse, before any work, a model trained with FSDP or DeepSpeed: growth during training supports DDP only.

    They shard the parameters and the optimizer state into flat buffers laid out by shape, which an in-place
    resize cannot follow. Detected from the accelerator's mode and from the wrappers' class names (DeepSpeed
    need not be installed to be recognized).
    """
    found = None
    mode = getattr(getattr(accelerator, "distributed_type", None), "name", None)
    if mode in _SHARDED_MODES:
        found = _SHARDED_MODES[mode]
    while found is None and isinstance(model, nn.Module):
        names = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
        found = next((what for name, what in _SHARDED.items() if name in names), None)
        if found is None and any(type(p).__name__ in ("DTensor", "FlatParameter") for p in model.parameters()):
            found = "FSDP"
        model = getattr(model, "module", None)
    if found is not None:
        raise ValueError(sharded_training_message(found))


def sharded_training_message(found: str) -> str:
    """The one-line refusal of growth under ``found`` (FSDP, DeepSpeed), saying what works."""
    return (
        f"growth supports one process or DistributedDataParallel (torchrun, accelerate launch --multi_gpu, Trainer "
        f"under either), not {found}: it shards parameters and optimizer state by shape, which an in-place resize "
        "cannot follow. Train with DDP, or grow a saved checkpoint between runs: gather the full state dict "
        "(accelerator.get_state_dict, or save_pretrained from the Trainer), grow it on one process with a "
        "memory_budget (hf_grow.grow_model, or hf-grow --memory-budget), and resume from the grown model."
    )


def ddp_wrappers(model: nn.Module) -> list[nn.parallel.DistributedDataParallel]:
    """The DistributedDataParallel wrappers in ``model``'s chain of wrappers (``.module``, and torch.compile's
    ``_orig_mod``), outermost first.

    A wrapper cannot be found from the plain model inside it (nor from accelerate, which records the plain
    model), so growth during training must be given the wrapped model. A compiled wrapper is looked through by
    what it wraps: its ``.module`` would forward past a DDP inside it (accelerate compiles after wrapping).
    """
    found = []
    while isinstance(model, nn.Module):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            found.append(model)
        compiled = model._modules.get("_orig_mod")
        model = compiled if compiled is not None else getattr(model, "module", None)
    return found


def synchronize_after_growth(
    parameters: Iterable[Tensor],
    wrappers: Iterable[nn.parallel.DistributedDataParallel],
    accelerator: Accelerator | None,
) -> None:
    """Make several processes consistent again after the in-place growth of ``parameters`` (on every process).

    The grown Parameters take the main process's values (the solve gives the same on every process from the
    summed statistics; the broadcast rules out a last-bit difference between devices), and every DDP wrapper
    gets gradient buckets for the new shapes. The optimizer state needs nothing: it was remapped on every
    process from equal state by the same rule.
    """
    processes = Processes(accelerator)
    if processes.world_size > 1:
        with torch.no_grad():
            for parameter in parameters:
                processes.broadcast_(parameter.data)
    wrappers = list(wrappers)
    if not wrappers and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        logger.warning(
            "grew a model that is not wrapped by DistributedDataParallel in a process group: if it trains through a "
            "DDP wrapper, pass the wrapper (what accelerator.prepare returned), whose buckets must be rebuilt."
        )
    for wrapper in wrappers:
        rebuild_ddp_buckets_(wrapper)


def refuse_unsupported_ddp(model: nn.Module) -> None:
    """Refuse, before any work, DistributedDataParallel options whose reducer `rebuild_ddp_buckets_` cannot rebuild
    after the resize (found at its end, the model was left grown with a reducer that no longer synchronizes)."""
    for ddp in ddp_wrappers(model):
        if getattr(ddp, "_delay_all_reduce_params", None) or getattr(ddp, "_use_python_reducer", False):
            raise ValueError(
                "growth during training does not support DDP with delayed all-reduce "
                "(delay_all_reduce_named_params) or the Python reducer: wrap the model without them"
            )
        if getattr(ddp, "mixed_precision", None) is not None:
            raise ValueError("growth during training does not support DDP's own mixed_precision: use autocast instead")
        if any(type(state).__name__ == "PowerSGDState" for _, state in getattr(ddp, "_comm_hooks", [])):
            raise ValueError(  # its per-bucket state, sized for the old buckets, failed the first backward after
                "growth during training does not support DDP's PowerSGD communication hook, whose state is kept per "
                "gradient bucket: register a stateless one (allreduce, fp16 or bf16 compression)"
            )


def rebuild_ddp_buckets_(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Rebuild ``ddp``'s reducer for its module's current parameter shapes, in place (after a resize).

    The reducer holds flat gradient buckets sized for the shapes it was built with, and autograd hooks on the
    parameters' old gradient accumulators: without a rebuild the next backward would not synchronize (or fail).
    This repeats what DistributedDataParallel's constructor does (checking that every process has the same
    shapes; the parameters are already equal, so nothing is broadcast), keeps the wrapper object, its
    options and its communication hooks, so a Trainer's or accelerate's reference to it stays valid. Call it
    on every process, between optimizer steps.
    """
    from torch.distributed.utils import _verify_param_shape_across_processes

    refuse_unsupported_ddp(ddp)
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    _verify_param_shape_across_processes(ddp.process_group, parameters)
    ddp.reducer._remove_autograd_hooks()  # the old reducer must not fire, even if something keeps it alive
    static_graph, ddp.static_graph = ddp.static_graph, False
    ddp._ddp_init_helper(
        parameters, expect_sparse_gradient, ddp._build_debug_param_to_name_mapping(parameters), static_graph
    )
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp._has_rebuilt_buckets = False
    if static_graph:
        ddp._set_static_graph()
