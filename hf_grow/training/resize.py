"""Resizing a model's query/key Parameters in place, and remapping its optimizer state to the new shapes.

The Parameter objects stay (``param.data = ...``), so the optimizer's param_groups, an LR scheduler and a
`transformers.Trainer` keep working; the optimizer moments of entries that keep their meaning are kept, the
others start as `hf_grow.optimizer_state` says.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter, get_adapter, is_peft_model, scale_dims_after_growth
from ..adapters.building import attention_scale_entry
from ..growth import QKWeights
from ..growth.prepare import check_no_injected_adapters, check_weights_in_memory
from ..optimizer_state import fill_new_moments
from ..version import __version__

#: Optimizer state entries that can be remapped, and their degree in the gradient: when a weight is rescaled by
#: ``fold`` its gradient scales by ``1 / fold``, so a moment of degree k scales by ``fold ** -k``.
OPTIMIZER_STATE_DEGREES: dict[str, int] = {
    "exp_avg": 1,  # Adam, AdamW
    "exp_avg_sq": 2,
    "max_exp_avg_sq": 2,
    "momentum_buffer": 1,  # SGD, RMSprop
    "sum": 2,  # Adagrad
    "square_avg": 2,  # RMSprop
    "grad_avg": 1,
    "exp_inf": 1,  # Adamax: a running maximum of |gradient|
}

#: Optimizers whose state entries are all in `OPTIMIZER_STATE_DEGREES` (for messages).
SUPPORTED_OPTIMIZERS = "Adam/AdamW, SGD, Adagrad, RMSprop, NAdam, RAdam, Adamax, Muon"
#: Optimizers refused by class, with the reason: their state is created at the first step, after the checks before
#: training (transformers' and torch's Adafactor; bitsandbytes' 8-bit optimizers by their names' ending).
UNREMAPPABLE_OPTIMIZERS = {
    "Adafactor": "its second moments are factored into row and column statistics of each weight",
    "Rprop": "its per-entry step sizes start at the learning rate, not at zero",
    "ASGD": "it keeps an average of the weights themselves",
    "LBFGS": "its curvature history holds all parameters flattened together",
    "ZeroRedundancyOptimizer": "its state is sharded across processes by parameter partition (like FSDP's)",
}


def to_grown_model(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` as its grown type, computing exactly the same function, ready to grow during training.

    A plain model (e.g. `GPT2LMHeadModel`) becomes a new grown model (e.g. `GrownGPT2LMHeadModel`) with the
    same weights and setup (frozen parameters, training mode, generation config, activation checkpointing); a
    model already of a grown type is returned as is. Convert before creating the optimizer.
    """
    convert_first = ("convert the base model before adding the PEFT adapters (to_grown_model(base), then "
                     "get_peft_model), or grow the PeftModel with grow_model, which merges its adapters into a copy")
    if is_peft_model(model):
        raise ValueError(f"to_grown_model converts a plain model: {convert_first}")
    if "peft" in sys.modules:  # adapter layers imply peft is imported
        check_no_injected_adapters(model, convert_first)
    check_weights_in_memory(model)
    adapter = get_adapter(model)
    if isinstance(model, adapter.grown_base_class):
        return model
    config = model.config  # a grown model of another class (remote code) keeps its layers' attention scale
    return adapter.build_grown_model(model, adapter.qk_head_dims(config), {}, adapter.attention_scale_dims(config))


#: One optimizer, or several that share the model's parameters (e.g. Muon for the weight matrices, AdamW for the
#: biases and embeddings); each may be accelerate's ``AcceleratedOptimizer``.
Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


def torch_optimizers(optimizers: Optimizers) -> list[torch.optim.Optimizer]:
    """The optimizers given, as a list, each unwrapped from accelerate's ``AcceleratedOptimizer`` (which subclasses
    `torch.optim.Optimizer` too: unwrapped wherever it holds one, so that messages name the optimizer that holds
    the state)."""
    listed = [] if optimizers is None else list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    unwrapped = []
    for optimizer in listed:
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")):
            raise TypeError(f"expected torch optimizers (param_groups and state), got {type(optimizer).__name__}")
        unwrapped.append(optimizer)
    return unwrapped


def check_growable(model: PreTrainedModel, adapter: ArchitectureAdapter, optimizers: Sequence[torch.optim.Optimizer]):
    """Refuse, before any work, a model that is not of a grown type, Q/K inside wrapped modules, or optimizers whose
    state cannot be remapped or that hold none of the model's parameters."""
    if not isinstance(model, adapter.grown_base_class) and type(model).__module__.startswith("transformers_modules"):
        raise ValueError(
            f"{type(model).__name__} was loaded from its checkpoint's own modeling file (trust_remote_code before "
            "hf_grow was imported), a class of its own that hf_grow cannot resize in place: import hf_grow before "
            "from_pretrained (it then builds hf_grow's class), or convert it once with hf_grow.to_grown_model(model) "
            "before creating the optimizer."
        )
    if not isinstance(model, adapter.grown_base_class):
        raise ValueError(
            f"{type(model).__name__} is not of a grown model type, so its Q/K cannot be resized in place: build it "
            "from a grown config (e.g. hf_grow.GrownGPT2Config(qk_head_dims=...)) or convert it once with "
            "hf_grow.to_grown_model(model) before creating the optimizer."
        )
    qk_parameters = []
    for layer, attention in enumerate(adapter.attention_modules(model)):
        parameters = dict(attention.named_parameters())
        missing = [name for name in adapter.qk_parameter_names(attention) if name not in parameters]
        if missing:
            raise ValueError(
                f"layer {layer}'s query/key parameters {missing} are not where {type(model).__name__} keeps them "
                f"(its attention holds {sorted(parameters)}): a wrapped module, such as a PEFT LoRA layer, cannot be "
                "resized in place. Merge the adapters into the model first (peft_model.merge_and_unload()), or put "
                "them on other modules (the values, the MLP)."
            )
        qk_parameters += [(name, parameters[name]) for name in adapter.qk_parameter_names(attention)]
    model_parameters = {id(parameter) for parameter in model.parameters()}
    for optimizer in optimizers:
        _check_optimizer(optimizer, model_parameters, qk_parameters)


def _check_optimizer(optimizer: torch.optim.Optimizer, model_parameters: set[int],
                     qk_parameters: list[tuple[str, Tensor]]) -> None:
    name = type(optimizer).__name__
    reason = UNREMAPPABLE_OPTIMIZERS.get(name)
    if name.endswith("8bit"):  # bitsandbytes' Adam8bit, PagedAdamW8bit, ...
        reason = "its states are quantized to 8 bits in blocks"
    if reason is not None:
        raise ValueError(
            f"cannot remap the state of {name}: {reason}. Supported: optimizers whose state entries are "
            f"{sorted(OPTIMIZER_STATE_DEGREES)} ({SUPPORTED_OPTIMIZERS}) and scalars."
        )
    held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    if not held & model_parameters:
        raise ValueError(
            f"the {name} holds none of the model's parameters, so its steps would not train the grown model: "
            "create the optimizer from the model being grown (after hf_grow.to_grown_model)."
        )
    held_qk = [(parameter_name, parameter) for parameter_name, parameter in qk_parameters if id(parameter) in held]
    states = [(parameter_name, optimizer.state.get(parameter, {})) for parameter_name, parameter in held_qk]
    if held_qk and not optimizer.state:  # before its first step: the state it will create for the Q/K
        states = [(f"{held_qk[0][0]} (at the first step)", _first_step_state(optimizer, held_qk[0][1]))]
    for parameter_name, state in states:
        unknown = sorted(key for key, value in state.items()
                         if isinstance(value, Tensor) and value.dim() > 0 and key not in OPTIMIZER_STATE_DEGREES)
        if unknown:
            raise ValueError(
                f"cannot remap the {name} state {unknown} of {parameter_name}: supported state entries are "
                f"{sorted(OPTIMIZER_STATE_DEGREES)} ({SUPPORTED_OPTIMIZERS}) and scalars."
            )


def _first_step_state(optimizer: torch.optim.Optimizer, parameter: Tensor) -> dict[str, Any]:
    """The state an optimizer of this type creates at its first step with the options of ``parameter``'s group, from
    a throwaway one on a small parameter: checked before training, where the state is not there yet (empty where no
    such copy can be made or step, e.g. a CUDA-only or third-party optimizer that takes other arguments). Its step
    runs torch's global optimizer hooks."""
    options = {name: value for name, value in _param_group(optimizer, parameter).items() if name != "params"}
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if not any(option.kind is option.VAR_KEYWORD for option in accepted.values()):  # a group's extra entries
        options = {name: value for name, value in options.items() if name in accepted}
    probe_parameter = torch.nn.Parameter(torch.zeros(2, 2))
    try:
        probe = type(optimizer)([probe_parameter], **options)
        probe_parameter.grad = torch.ones_like(probe_parameter)
        probe.step()
    except Exception:  # noqa: BLE001 (whatever the copy cannot do, the check at the growth step still does)
        return {}
    return dict(probe.state.get(probe_parameter, {}))


def _param_group(optimizer: torch.optim.Optimizer, parameter: Tensor) -> dict[str, Any]:
    """The param group of ``optimizer`` that holds ``parameter``."""
    return next(group for group in optimizer.param_groups if any(held is parameter for held in group["params"]))


def _pad(tensor: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))


def resize_qk_(
    model: PreTrainedModel,
    weights: QKWeights,
    optimizer: Optimizers = None,
    *,
    keep_moments: bool,
    new_moments: str = "zero",
    keep_attention_scale: bool = False,
) -> None:
    """Give the layers in ``weights`` these augmented Q/K weights, of any width, in place; remap the optimizer.

    ``weights[layer]`` is ``(query, key)`` of shape ``(heads, d_e + 1, qk_dim)``. The Parameter objects stay,
    their ``.grad`` is cleared, ``model.config.qk_head_dims`` and the attention modules follow the new width.
    ``optimizer`` may be several (`Optimizers`): each one's state of the parameters it holds is remapped.
    The attention scale of a grown layer follows its new width, or with ``keep_attention_scale`` stays (the
    config's ``attention_scale_dims`` records it). With ``keep_moments`` the optimizer state of the old Q/K
    dimensions is kept, the queries' rescaled by the change of attention scale (the weights must then hold the
    old queries times ``scaling_before / scaling_after``, as every mode but "refactor" does); otherwise the Q/K
    state is reset to zero. New dimensions start at zero, or with ``new_moments="head_mean"`` their second moments
    at the mean of the old entries' of the same head and role (`hf_grow.optimizer_state`); entries that are not
    Q/K (GPT-2's fused values) and scalars (``step``) are kept. A model trained through DistributedDataParallel
    is resized on every process with the same weights, and the wrapper's gradient buckets rebuilt after it
    (`hf_grow.distributed.rebuild_ddp_buckets_`): its buckets of the old shapes would synchronize nothing.
    """
    adapter = get_adapter(model)
    optimizers = torch_optimizers(optimizer)
    check_growable(model, adapter, optimizers)
    config = model.config
    dims = adapter.qk_head_dims(config)
    widths = [weights[layer][0].shape[-1] if layer in weights else dim for layer, dim in enumerate(dims)]
    scale_dims = adapter.attention_scale_dims(config)
    scale_dims_after = scale_dims_after_growth(dims, scale_dims, widths, keep_attention_scale)
    attentions = adapter.attention_modules(model)
    scales = list(scale_dims)  # each layer's as it is resized: the config follows the layers done, if interrupted
    before, resized = list(dims), False
    try:
        with torch.no_grad():
            for layer, (query, key) in weights.items():
                attention = attentions[layer]
                new_dim = query.shape[-1]
                if new_dim < dims[layer]:
                    raise ValueError(
                        f"layer {layer} has {dims[layer]} query/key dims: growth cannot shrink it to {new_dim}"
                    )
                parameters = dict(attention.named_parameters())
                scaling_after = adapter.scaling(config, layer, scale_dims_after[layer])
                fold = adapter.scaling(config, layer, scale_dims[layer]) / scaling_after
                # Every new tensor of the layer first, then all are put in place, undone if that fails (out of memory,
                # an interruption): the layer is left as it was, never with some of its parameters resized.
                new_states = _new_states(
                    adapter, attention, optimizers, fold, dims[layer], new_dim, keep_moments, new_moments
                )
                new_parameters = adapter.qk_parameters(attention, query, key)
                old_states = [(owner, name, state_key, owner.state[parameters[name]][state_key])
                              for owner, name, state_key, _ in new_states]
                old_parameters = {name: parameters[name].data for name in new_parameters}
                try:
                    for owner, name, state_key, value in new_states:
                        owner.state[parameters[name]][state_key] = value
                    for name, value in new_parameters.items():
                        _resize_parameter(parameters[name], value)
                except BaseException:
                    for owner, name, state_key, value in old_states:
                        owner.state[parameters[name]][state_key] = value
                    for name, value in old_parameters.items():
                        _resize_parameter(parameters[name], value)
                    raise
                adapter.set_qk_head_dim(attention, config, layer, new_dim, scale_dims_after[layer])
                dims[layer], scales[layer] = new_dim, scale_dims_after[layer]
        resized = True
    finally:
        config.qk_head_dims = dims
        config.attention_scale_dims = attention_scale_entry(dims, scales)
        if resized or dims != before:  # a growth that took place (in part, if interrupted), not one refused
            config.hf_grow_version = __version__  # the version of the latest growth


def _new_states(
    adapter: ArchitectureAdapter,
    attention: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    fold: float,
    old_dim: int,
    new_dim: int,
    keep_moments: bool,
    new_moments: str,
) -> list[tuple[torch.optim.Optimizer, str, str, Tensor]]:
    """``(optimizer, parameter name, state key, new value)`` of every state entry of the layer's Q/K parameters at
    the new width (see `resize_qk_`), of each optimizer that holds one."""
    parameters = dict(attention.named_parameters())
    names = adapter.qk_parameter_names(attention)
    new_states = []
    for optimizer in optimizers:
        states = [optimizer.state.get(parameters[name], {}) for name in names]
        for state_key in {key for state in states for key in state}:
            present = dict(zip(names, (state.get(state_key) for state in states)))
            held = {name: value for name, value in present.items() if value is not None}
            if not all(isinstance(value, Tensor) and value.dim() > 0 for value in held.values()):
                continue  # scalars such as the step count are kept
            # a parameter without this entry (frozen, or in another optimizer) reads as zeros and gets none
            reference = next(iter(held.values()))
            source = {name: held[name] if name in held else reference.new_zeros(parameters[name].shape)
                      for name in names}
            old_query, old_key = adapter.read_qk(attention, source)
            degree = OPTIMIZER_STATE_DEGREES[state_key]
            if keep_moments:
                old_query = old_query * fold**-degree
                new_query, new_key = _pad(old_query, new_dim), _pad(old_key, new_dim)
            else:
                new_query = old_query.new_zeros(*old_query.shape[:-1], new_dim)
                new_key = old_key.new_zeros(*old_key.shape[:-1], new_dim)
            start = old_dim if keep_moments else 0
            new_query = fill_new_moments(new_query, old_query, start, degree, new_moments)
            new_key = fill_new_moments(new_key, old_key, start, degree, new_moments)
            if state_key == "sum" and new_moments == "zero":  # a fresh Adagrad starts its sums at this value
                initial = _param_group(optimizer, parameters[next(iter(held))]).get("initial_accumulator_value", 0.0)
                new_query[..., start:], new_key[..., start:] = initial, initial
            for name, value in adapter.qk_parameters(attention, new_query, new_key, source).items():
                if name in held:
                    new_states.append((optimizer, name, state_key, value))
    return new_states


def _resize_parameter(parameter: torch.nn.Parameter, value: Tensor) -> None:
    """``parameter.data = value`` for a new shape, keeping the Parameter object, its gradient cleared.

    Autograd caches a parameter's gradient accumulator (with its shape) while any graph that used it is alive,
    e.g. through a ``loss`` variable of the last step, and ``.data =`` drops that cache only on a change of
    dtype or device: passing through another dtype first makes the next backward accumulate at the new shape.
    """
    parameter.data = value.to(torch.float64 if value.dtype != torch.float64 else torch.float32)
    parameter.data = value
    parameter.grad = None
