"""The collector: hooks that accumulate C and M while the model runs forward and backward on a batch.

Padding tokens are zeroed out of the X' that C sums, so they contribute exactly nothing to C; M pairs the unmasked
X' with the score gradients, which are zero at padding wherever the loss has no terms there. Backward runs with
`torch.autograd.grad` towards the input embeddings only, so no parameter `.grad` is touched.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from ..adapters import ArchitectureAdapter
from .batches import LossFn, compute_loss, module_modes, restore_modes, without_kv_cache
from .kernels import (
    COLLECTING,
    STATISTICS_ATTENTION,
    without_autocast,
    choose_method,
    default_query_block,
    matmul_precision,
    score_gradient_products,
    tf32_matmuls,
)
from .offload import mapped_zeros


@contextlib.contextmanager
def statistics_mode(model: PreTrainedModel, tf32: bool) -> Iterator[None]:
    """Eval mode, the statistics attention and the float32 matmul precision; restored on exit, also on error.

    Layers with gradient checkpointing enabled keep it: transformers checkpoints only layers in training mode,
    so those layers (not their submodules: dropout stays off) are switched to training, with a non-reentrant
    checkpoint (the only kind that supports `torch.autograd.grad`). No KV cache (``config.use_cache``): the
    statistics need none, and a recomputed layer would append to it twice.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError("statistics need gradients: call hf_grow outside torch.inference_mode().")
    original_attention = model.config._attn_implementation
    checkpointed = [
        module
        for module in model.modules()
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing
    ]
    checkpoint_functions = {module: module.__dict__.get("_gradient_checkpointing_func") for module in checkpointed}
    modes = module_modes(model)
    model.eval()
    model.set_attn_implementation(STATISTICS_ATTENTION)
    for module in checkpointed:
        module.training = True
        module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    try:
        with torch.enable_grad(), without_kv_cache(model), matmul_precision(tf32):
            yield
    finally:
        for module, function in checkpoint_functions.items():
            if function is None:
                del module._gradient_checkpointing_func
            else:
                module._gradient_checkpointing_func = function
        model.set_attn_implementation(original_attention)
        restore_modes(modes)


def augmented_input(hidden: Tensor, dtype: torch.dtype) -> Tensor:
    """X' = [X | 1] in ``dtype``."""
    return torch.cat([hidden, torch.ones_like(hidden[..., :1])], dim=-1).to(dtype)


def real_token_rows(augmented: Tensor, token_mask: Tensor | None, layer: int) -> Tensor:
    """``augmented`` with the rows of padding tokens (``token_mask`` False) zeroed: what C sums."""
    if token_mask is None:
        return augmented
    if token_mask.shape != augmented.shape[:-1]:
        raise ValueError(
            f"attention_mask of shape {tuple(token_mask.shape)} does not match the "
            f"{tuple(augmented.shape[:-1])} tokens reaching layer {layer}"
        )
    return augmented * token_mask[..., None].to(augmented.dtype)


class Sums:
    """The sums of one pass: C for every layer (``with_second_moments``, float64), M for the layers of ``group``
    (in ``accumulate_dtype``; in memory, or mapped from the safetensors file ``offload_file``: `offload`), and the
    counts of tokens, batches, loss terms and losses they were summed over.

    ``cross_fit``: also M's sum over the odd-numbered batches (``half_gradients``, beside M in memory or in the
    same file) and their loss terms (``half_loss_weight``): the halves `GrowthStatistics.cross_fitted_gradient`
    splits the data into, from the same pass.
    """

    def __init__(
        self, num_layers: int, num_heads: int, width: int, group: Sequence[int], with_second_moments: bool,
        device: torch.device, float16: bool, accumulate_dtype: torch.dtype = torch.float64,
        offload_file: Path | None = None, cross_fit: bool = False,
    ):
        self.second_moments = (
            [torch.zeros(width, width, dtype=torch.float64, device=device) for _ in range(num_layers)]
            if with_second_moments
            else None
        )
        shape = (num_heads, width, width)
        names = ("gradients", "half_gradients") if cross_fit else ("gradients",)
        if offload_file is None:
            sums = {name: {layer: torch.zeros(shape, dtype=accumulate_dtype, device=device) for layer in group}
                    for name in names}
        else:
            mapped = mapped_zeros(
                offload_file, {f"{name}.{layer}": shape for name in names for layer in group}, accumulate_dtype
            )
            sums = {name: {layer: mapped[f"{name}.{layer}"] for layer in group} for name in names}
        self.gradients: dict[int, Tensor] = sums["gradients"]
        #: With ``cross_fit``: M summed over the odd-numbered batches only, and their loss terms (else None).
        self.half_gradients: dict[int, Tensor] | None = sums.get("half_gradients")
        self.half_loss_weight: int | None = 0 if cross_fit else None
        self.float16 = float16
        self.num_tokens = 0
        self.batch_index = 0  # batches added (their loss terms not all ignored)
        #: The dataloader's index of the batch being added (skipped batches counted), which errors name.
        self.batch_number = 0
        self.loss_weight = 0
        self.loss_sum = 0.0

    @property
    def in_half(self) -> bool:
        """Whether the batch being added is in the cross-fitting half (odd ``batch_index``), with ``cross_fit``."""
        return self.half_gradients is not None and self.batch_index % 2 == 1

    def add_second_moment(self, layer: int, augmented: Tensor) -> None:
        """C of ``layer`` += X'^T X' over the batch's tokens (``augmented``: X' with padding rows zeroed)."""
        flat = augmented.reshape(-1, augmented.shape[-1]).to(torch.float64)
        product = flat.mT @ flat
        if not torch.isfinite(product).all():
            raise FloatingPointError(
                f"non-finite inputs to the attention of layer {layer} at batch {self.batch_number}: "
                "check the data of that batch and the model's weights."
            )
        self.second_moments[layer] += product

    def add_gradient(self, layer: int, contribution: Tensor) -> None:
        """M of ``layer`` += one batch's per-head products, by ``add_`` (on a CPU it still converts the product to
        M's dtype in a temporary; a separate conversion and an entry-by-entry scan were 14% of a GPT-2-small pass);
        their sum is checked, and only a sum that is not finite (NaN and Inf carry into it, or an overflow of
        finite values) is checked entry by entry. Products wider than M (float64 into float32) can overflow M's
        range as they are added: M is then checked the same way."""
        if not torch.isfinite(contribution.sum()) and not torch.isfinite(contribution).all():
            overflow = " (float16 overflows most easily: load the model in bfloat16 or float32)" if self.float16 else ""
            raise FloatingPointError(
                f"non-finite score gradients in layer {layer} at batch {self.batch_number}{overflow}: "
                "check the loss and the data of that batch."
            )
        targets = [self.gradients[layer]] + ([self.half_gradients[layer]] if self.in_half else [])
        for target in targets:
            target.add_(contribution)
        if torch.finfo(targets[0].dtype).max >= torch.finfo(contribution.dtype).max:
            return
        if any(not torch.isfinite(target.sum()) and not torch.isfinite(target).all() for target in targets):
            raise FloatingPointError(
                f"the sum of score gradients of layer {layer} overflowed {targets[0].dtype} at batch "
                f"{self.batch_number}: accumulate in float64 (accumulate_dtype) or compute in float32 (compute_dtype)."
            )

    def add_batch(self, tokens: int, loss_weight: int, loss: float) -> None:
        """Count a batch whose products were added: its non-padding tokens, loss terms and loss."""
        if self.in_half:
            self.half_loss_weight += loss_weight
        self.num_tokens += tokens
        self.batch_index += 1
        self.loss_weight += loss_weight
        self.loss_sum += loss


class GradientProducts:
    """M of the layers of ``sums``'s group, from their attention: the `kernels.AttentionObserver` that
    `statistics_attention` reports to. Each layer's X', kept in ``inputs`` by the collector's input hook, is paired
    with the gradient of the same forward pass's scores: dLoss/dS as a whole (the reference method), or dLoss/dO,
    from which M is computed one block of queries at a time (chunked, triton).

    ``method`` may be ``"auto"``: `start_pass` then chooses one per forward pass. ``eager_model``: the model
    normally runs eager attention, whose fully masked rows the statistics keep.
    """

    def __init__(
        self, sums: Sums, compute_dtype: torch.dtype, method: str, query_block: int | None, eager_model: bool,
        device: torch.device,
    ):
        self.sums = sums
        self.compute_dtype = compute_dtype
        self.method = method
        self.query_block = query_block
        self.eager_model = eager_model
        self.device = device
        #: The method of the forward pass under way (``method``, or what ``"auto"`` chose for it).
        self.batch_method = method
        self.methods_used: set[str] = set()
        #: The X' of the pass under way, per layer of the group, until its attention takes it.
        self.inputs: dict[int, Tensor] = {}
        # True while the collector's backward runs (`Collector.step`): checkpointed layers then run their forward
        # again, which adds nothing.
        self.in_backward = False

    def start_pass(self, length: int) -> None:
        """A forward pass of ``length`` tokens per sequence starts: X' of its own, and its method."""
        self.inputs.clear()
        if self.method == "auto":
            self.batch_method = choose_method(self.device, length, self.eager_model)
        self.methods_used.add(self.batch_method)

    def collects(self, layer: int) -> bool:
        """Whether this pass collects M of ``layer``: a layer of its group, in a pass with gradient (one without, a
        teacher's or a guide's, has no score gradients and takes no X')."""
        return layer in self.sums.gradients and torch.is_grad_enabled()

    def score_hook(self, layer: int) -> Callable[[Tensor], None] | None:
        """The reference method: receives G = dLoss/dS of ``layer`` as a whole (paired with this pass's X').

        None for a checkpointed layer's recomputation whose first forward pass took its X' (and hooked its scores).
        """
        if self.in_backward and layer not in self.inputs:
            return None
        augmented = self.inputs.pop(layer)

        def hook(grad: Tensor) -> None:
            if grad.shape[-1] != augmented.shape[-2] or grad.shape[-2] != augmented.shape[-2]:
                raise ValueError("statistics need full self-attention scores: run the model without a KV cache")
            # M_i = X'^T G_i X' summed over the batch: (b, s, d)^T (b, h, s, s) (b, s, d) -> (h, d, d)
            with without_autocast(grad.device):
                projected = torch.matmul(grad.to(self.compute_dtype), augmented[:, None])
                self.sums.add_gradient(layer, torch.einsum("bqd,bhqe->hde", augmented, projected))

        return hook

    def on_attention_output(
        self, layer: int, output: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
        scaling: float, is_causal: bool,
    ) -> None:
        """The chunked and triton methods: M of ``layer`` is computed when dLoss/dO reaches ``output``."""
        if self.in_backward:
            return  # a checkpointed layer's recomputation: the hook of its first forward pass receives dLoss/dO
        augmented = self.inputs.pop(layer)
        if query.shape[-2] != key.shape[-2] or query.shape[-2] != augmented.shape[-2]:
            raise ValueError("statistics need full self-attention scores: run the model without a KV cache")
        saved = [tensor.detach() for tensor in (query, key, value)]
        batch, heads, length = query.shape[:3]
        block = self.query_block or default_query_block(query.device, batch, heads, length)
        method = self.batch_method

        def on_backward(grad_output: Tensor) -> None:
            with without_autocast(grad_output.device):
                if method == "triton":
                    from .triton_kernels import score_gradient_products_fused

                    products = score_gradient_products_fused(
                        *saved, grad_output.transpose(1, 2), augmented, mask, scaling, is_causal, tf32_matmuls()
                    )
                else:
                    products = score_gradient_products(
                        *saved, grad_output.transpose(1, 2), augmented, mask, scaling, is_causal, block,
                        self.compute_dtype,
                    )
                self.sums.add_gradient(layer, products)

        output.register_hook(on_backward)


class Collector:
    """Hooks that accumulate C for every layer (``with_second_moments``) and M for the layers of ``group``.

    A ``loss_fn`` may run the model any number of times per batch (one pass per text column, say). Each forward
    pass's X' is paired with its own dLoss/dS: the attention of a layer takes the X' its input hook kept in the
    same pass (`GradientProducts`, the collector's ``products``). The padding of a pass is the ``attention_mask``
    the model received (read by a hook on every `PreTrainedModel` inside ``model``), and a pass starts when its
    first layer runs.

    ``eager_model``: the model normally runs eager attention, whose fully masked rows the statistics keep.
    ``offload_file``: where M's accumulators are mapped from (`offload`), None for memory. ``cross_fit``: `Sums`'.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        adapter: ArchitectureAdapter,
        compute_dtype: torch.dtype,
        method: str,
        query_block: int | None,
        group: Sequence[int],
        with_second_moments: bool,
        eager_model: bool,
        accumulate_dtype: torch.dtype = torch.float64,
        offload_file: Path | None = None, cross_fit: bool = False,
    ):
        self.attentions = adapter.attention_modules(model)
        self.compute_dtype = compute_dtype
        self.embeddings = model.get_input_embeddings()
        self.models = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
        parameter = next(model.parameters())
        self.sums = Sums(
            len(self.attentions), adapter.num_heads(model.config), adapter.hidden_size(model.config) + 1, group,
            with_second_moments, parameter.device, float16=parameter.dtype == torch.float16,
            accumulate_dtype=accumulate_dtype, offload_file=offload_file, cross_fit=cross_fit,
        )
        self.products = GradientProducts(self.sums, compute_dtype, method, query_block, eager_model, parameter.device)
        self.hooked_layers = sorted({0, *(range(len(self.attentions)) if with_second_moments else group)})
        self.qk_inputs = [adapter.qk_input_module(attention) for attention in self.attentions]
        #: The attention mask the model last received (the next pass's padding), and that of the pass under way.
        self.received_mask: Tensor | None = None
        self.token_mask: Tensor | None = None
        self.passes = 0
        self.passes_with_gradient = 0
        self.pass_with_gradient = True
        self.pass_tokens = 0
        self.anchors: list[Tensor] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        handles = [self.embeddings.register_forward_hook(self._keep_anchor)]
        for layer in self.hooked_layers:
            handles.append(self.qk_inputs[layer].register_forward_pre_hook(self._input_hook(layer)))
        for layer, attention in enumerate(self.attentions):
            COLLECTING[attention] = (self.products, layer)
        try:
            with contextlib.ExitStack() as wrapped:
                for module in self.models:
                    wrapped.enter_context(_forward_wrapped(module, _model_inputs_hook(self, module)))
                yield
        finally:
            for handle in handles:
                handle.remove()
            for attention in self.attentions:
                COLLECTING.pop(attention, None)
            self.products.inputs.clear()
            self.anchors.clear()

    def _keep_anchor(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        # Backward runs towards the embeddings' output, so it must be part of the graph even if they are frozen.
        if not output.requires_grad:
            output = output.detach().requires_grad_(True)
        self.anchors.append(output)
        return output

    def _start_pass(self, hidden: Tensor) -> None:
        """The first layer runs: a new forward pass, whose padding is the mask the model received. A pass without
        gradient (a teacher's, a guide's) has no score gradients for M: its inputs and tokens stay out of C too."""
        self.pass_with_gradient = torch.is_grad_enabled()
        self.passes_with_gradient += self.pass_with_gradient
        mask = self.received_mask
        self.received_mask = None
        self.token_mask = None if mask is None else (mask != 0).reshape(-1, mask.shape[-1])
        if self.pass_with_gradient:
            self.pass_tokens += int(self.token_mask.sum()) if self.token_mask is not None else hidden.shape[:-1].numel()
        self.passes += 1
        self.products.start_pass(hidden.shape[-2])

    def _input_hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if self.products.in_backward:
                return  # gradient checkpointing recomputes the layer: its inputs were taken in the forward pass
            if layer == 0:
                self._start_pass(args[0])
            if not self.pass_with_gradient or (layer not in self.sums.gradients and self.sums.second_moments is None):
                return
            augmented = augmented_input(args[0].detach(), self.compute_dtype)
            if layer in self.sums.gradients:
                # M pairs X' with dLoss/dS at every position, padding too: a loss with terms there (labels on
                # padding, a question-answering head's softmax over every position) has score gradients there.
                # Elsewhere G is zero at padding, whatever its X'.
                self.products.inputs[layer] = augmented
            if self.sums.second_moments is not None:  # C: real tokens only
                self.sums.add_second_moment(layer, real_token_rows(augmented, self.token_mask, layer))

        return hook

    def step(self, model: PreTrainedModel, batch: Any, loss_fn: LossFn | None, weight: int, number: int) -> float:
        """Forward and backward on one batch of ``weight`` loss terms, accumulating C and M. Returns its loss.
        ``number``: its index in the dataloader, which errors name (as the batch checks do).

        Backward runs on the loss times ``weight``, the sum over its terms: M sums those (see `GrowthStatistics`),
        and each term's gradient is of order one, which keeps float16 score gradients from underflowing. Every
        forward pass the loss makes with gradient counts its real tokens in C and its score gradients in M (one
        without, a teacher's or a guide's, counts in neither).
        """
        self.sums.batch_number = number
        self.products.inputs.clear()
        self.anchors.clear()
        self.passes = self.passes_with_gradient = self.pass_tokens = 0
        self.received_mask = None
        loss = compute_loss(model, batch, loss_fn)
        if self.passes == 0:
            raise ValueError(
                f"the loss of batch {self.sums.batch_number} ran no forward pass of the model: loss_fn(model, batch) "
                "must compute its loss with the model it is given."
            )
        if self.passes_with_gradient == 0:  # a pass without (a teacher's, a guide's) beside one with is fine
            raise ValueError(
                f"the loss of batch {self.sums.batch_number} ran the model only without gradient (under torch.no_grad "
                "or inference_mode): its scores' gradients cannot reach M. sentence-transformers' Cached* losses "
                "(GradCache) embed so and compute gradients in a pass of their own: use the loss without the cache "
                "(e.g. MultipleNegativesRankingLoss for CachedMultipleNegativesRankingLoss), with fewer pairs per "
                "batch if memory is short."
            )
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"the loss must be a scalar tensor, got {shape}")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss.item()} at batch {self.sums.batch_number}")
        anchors = list({id(anchor): anchor for anchor in self.anchors if anchor.requires_grad}.values())
        self.products.in_backward = True
        try:
            torch.autograd.grad(loss * weight, anchors, allow_unused=True)
        finally:
            self.products.in_backward = False
        self.products.inputs.clear()
        self.anchors.clear()
        self.sums.add_batch(self.pass_tokens, weight, float(loss.detach()))
        return float(loss.detach())


@contextlib.contextmanager
def _forward_wrapped(module: nn.Module, hook: Callable) -> Iterator[None]:
    """``hook(module, args, kwargs)`` before every call of ``module.forward``, for as long as the block runs: a
    forward pre-hook (which may return new ``(args, kwargs)``) that also sees ``module.forward(...)`` called
    directly, as sentence-transformers calls its model (a registered pre-hook runs only through ``module(...)``)."""
    own = module.__dict__.get("forward")  # a forward already set on the instance, put back after
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        changed = hook(module, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        return inner(*args, **kwargs)

    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _model_inputs_hook(collector: Collector, module: nn.Module) -> Callable:
    """A forward pre-hook on a `PreTrainedModel` inside the collected model: keeps the ``attention_mask`` it
    receives (the next pass's padding) and anchors ``inputs_embeds`` given instead of tokens."""
    names = list(inspect.signature(module.forward).parameters)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if collector.products.in_backward:
            return None
        positional = dict(zip(names, args))
        mask = kwargs.get("attention_mask", positional.get("attention_mask"))
        collector.received_mask = mask if isinstance(mask, Tensor) else None
        embeddings = kwargs.get("inputs_embeds", positional.get("inputs_embeds"))
        if not isinstance(embeddings, Tensor):
            return None
        # Inputs given as embeddings skip the embedding layer: backward runs towards them instead.
        if not embeddings.requires_grad:
            embeddings = embeddings.detach().requires_grad_(True)
            if "inputs_embeds" in kwargs:
                kwargs = {**kwargs, "inputs_embeds": embeddings}
            else:
                index = names.index("inputs_embeds")
                args = (*args[:index], embeddings, *args[index + 1 :])
        collector.anchors.append(embeddings)
        return args, kwargs

    return hook
