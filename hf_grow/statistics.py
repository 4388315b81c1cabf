"""First-order statistics of the attention scores, collected over a dataloader.

Per layer, C = sum X'^T X' over non-padding tokens; per head, M_i = sum X'^T G_i X' with G_i = dLoss/dS_i
the gradient of the loss with respect to the pre-softmax scores S_i (scale included, mask excluded).
M_i is exactly dLoss/dZ_i for the bilinear form Z_i of `hf_grow.linalg`.

Three methods, with the same result:

- ``"chunked"``: the model runs sdpa attention, as in training; in backward, a hook on each attention output
  receives dLoss/dO and accumulates M one block of queries at a time, the way flash-attention's backward
  computes dQ (recompute the block's softmax P, dP = dO V^T, G = P * (dP - rowsum(P * dP)), M += X'^T (G X')).
  No b * h * s * s tensor is ever held: memory per block is b * h * block * s.
- ``"triton"``: the same, with fused kernels (`hf_grow.triton_kernels`) that keep each tile of G on chip.
- ``"reference"``: eager attention whose materialized scores hand their gradient G to a hook.

``"auto"`` (the default) picks per batch by device and sequence length (`choose_method`). Where a query may
attend to no key at all (a pad position before the first token of a left-padded sequence), sdpa gives it a zero
output and eager a uniform average: ``"auto"`` keeps the model's own convention (eager models get the
reference method), while ``"chunked"`` or ``"triton"`` forced on an eager model follow sdpa's.

Padding tokens are zeroed out of X', so they contribute exactly nothing to C or M. Backward runs with
`torch.autograd.grad` towards the input embeddings only, so no parameter `.grad` is touched.

The sums add up across processes (`hf_grow.distributed`) and across passes over the data: with a
``memory_budget``, each pass accumulates M for one group of layers only (C for all layers in the first).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import safetensors
import safetensors.torch
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_layers import GradientCheckpointingLayer

from .adapters import ArchitectureAdapter
from .distributed import Processes, unwrap_model


if TYPE_CHECKING:
    from accelerate import Accelerator


logger = logging.getLogger("hf_grow")

STATISTICS_ATTENTION = "hf_grow_statistics"
METHODS: tuple[str, ...] = ("auto", "chunked", "reference", "triton")
# Up to this many tokens per sequence the reference method is the faster one on a CPU (BENCHMARKS.md).
CPU_REFERENCE_MAX_LENGTH = 256
STATISTICS_FORMAT = "hf_grow.statistics.v1"

LossFn = Callable[[PreTrainedModel, Mapping[str, Tensor]], Tensor]

# Per attention module of the model under collection: the collector and the layer. Read by `statistics_attention`.
_COLLECTING: dict[nn.Module, tuple[_Collector, int]] = {}

# Elements of one (b, h, block, s) float tensor in the chunked path. On a CPU, 2^21 float32 numbers
# (8 MiB) stay in cache and skip most of a causal mask's upper triangle: 1.2-1.9x faster than 1024-query blocks
# from 1024 tokens on, in the training step's memory (BENCHMARKS.md). On a GPU, 2^26 (256 MiB) keeps kernels busy.
_CPU_BLOCK_ELEMENTS = 2**21
_GPU_BLOCK_ELEMENTS = 2**26
# Fewer queries per block than this cost more in per-block overhead than they save in memory (2.3x a training
# step at 8 queries, 1.35x at 32, on a CPU at batch 8 x 2048 tokens: BENCHMARKS.md).
_MIN_QUERY_BLOCK = 32


def statistics_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """The attention of a model whose statistics are being collected.

    For the chunked and triton methods, transformers' sdpa attention handing its inputs and output to the
    collector; for the reference method, eager attention handing the gradient of its scores to it.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    is_causal = attention_mask is None and query.shape[2] > 1 and causal
    collector, layer = _COLLECTING.get(module, (None, None))
    collects = collector is not None and layer in collector.gradients
    if collector is not None and collector.batch_method == "reference":
        # Every layer runs eager attention, also those whose M is collected in another pass: the same forward.
        hook = collector.score_hook(layer) if collects else None
        zero_masked_rows = not collector.eager_model  # as the model's own sdpa attention does
        return _eager_attention(query, key, value, attention_mask, scaling, is_causal, zero_masked_rows, hook)
    output, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    if collects and output.requires_grad:
        collector.on_attention_output(layer, output, query, key, value, attention_mask, scaling, is_causal)
    return output, weights


def _eager_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scaling: float,
    is_causal: bool,
    zero_masked_rows: bool,
    hook: Callable[[Tensor], None] | None,
) -> tuple[Tensor, Tensor]:
    """Attention with materialized scores, whose gradient goes to ``hook``; masks as `score_gradient_products`.

    ``zero_masked_rows``: a query that may attend to no key gets a zero output, as in sdpa (eager attention
    averages all values uniformly instead).
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if hook is not None and scores.requires_grad:
        scores.register_hook(hook)
    mask = _block_mask(mask, 0, query.shape[-2], key.shape[-2], is_causal, query.device)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    if zero_masked_rows and mask is not None and mask.dtype == torch.bool:
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


def _block_mask(mask: Tensor | None, start: int, stop: int, num_keys: int, is_causal: bool, device) -> Tensor | None:
    """The mask rows of queries ``start:stop``: boolean (True = attend), additive float, or None."""
    if mask is not None:
        return mask[..., start:stop, :num_keys]
    if not is_causal:
        return None
    return torch.arange(start, stop, device=device)[:, None] >= torch.arange(num_keys, device=device)[None, :]


def score_gradient_products(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_output: Tensor,
    inputs: Tensor,
    mask: Tensor | None,
    scaling: float,
    is_causal: bool,
    block: int,
    dtype: torch.dtype,
) -> Tensor:
    """Per head, the sum over the batch of X'^T G X' (G = dLoss/dS), computed one block of queries at a time.

    ``query``/``key`` (b, h, s, d_k), ``value``/``grad_output`` (b, h, s, d_v) of one attention call and its
    output gradient, ``inputs`` X' (b, s, d); ``mask`` as the attention received it (boolean, additive or
    None with ``is_causal``). Within a block the softmax rows are complete, so G = P * (dP - rowsum(P * dP)).
    G is exactly dLoss/dS: zero where a boolean mask replaces the score (a query that may attend to no key has
    a uniform softmax row but no score gradient); an additive mask passes the gradient on. Returns (h, d, d)
    in ``dtype``.
    """
    batch, heads, length = query.shape[:3]
    width = inputs.shape[-1]
    query, key, value, grad_output, inputs = (t.to(dtype) for t in (query, key, value, grad_output, inputs))
    products = torch.zeros(heads, width, width, dtype=dtype, device=query.device)
    for start in range(0, length, block):
        stop = min(start + block, length)
        # Causal without a mask: the block's queries see keys up to ``stop`` only, so skip the rest (half the work).
        seen = stop if mask is None and is_causal else key.shape[-2]
        keys_t, values_t, seen_inputs = key[:, :, :seen].mT, value[:, :, :seen].mT, inputs[:, :seen]
        # In place where possible: the (b, h, block, s) tensors dominate time and memory.
        scores = torch.matmul(query[:, :, start:stop] * scaling, keys_t)
        block_mask = _block_mask(mask, start, stop, seen, is_causal, query.device)
        if block_mask is not None and block_mask.dtype == torch.bool:
            scores.masked_fill_(~block_mask, torch.finfo(dtype).min)  # finite: fully masked rows stay finite
        elif block_mask is not None:
            scores.add_(block_mask.to(dtype))
        probs = torch.softmax(scores, dim=-1)
        del scores
        block_grad = grad_output[:, :, start:stop]
        if mask is not None and mask.dtype == torch.bool:
            # Elsewhere P is 0 where the mask is False; a fully masked row gets G = 0 from a zero dLoss/dO row.
            block_grad = block_grad * block_mask.any(dim=-1, keepdim=True)
        # rowsum(P * dP) = rowsum(dO * O) with O = P V: from (b, h, block, d_v) tensors only.
        row_sums = (block_grad * torch.matmul(probs, values_t.mT)).sum(dim=-1, keepdim=True)
        grad_scores = torch.matmul(block_grad, values_t).sub_(row_sums).mul_(probs)
        del probs
        # G X' per sequence: (b, h * block, keys) @ (b, keys, d), then X'^T (G X') summed over sequences and queries.
        projected = torch.matmul(grad_scores.reshape(batch, -1, seen), seen_inputs).reshape(batch, heads, -1, width)
        rows = inputs[:, start:stop].reshape(-1, width)  # (b * block, d)
        products += torch.matmul(rows.mT, projected.transpose(0, 1).reshape(heads, -1, width))
    return products


def default_query_block(device: torch.device, batch: int, heads: int, length: int) -> int:
    """Queries per block of the chunked method: as many as keep one (b, h, block, s) tensor within the device's
    budget, but at least 32 (or the whole sequence)."""
    elements = _CPU_BLOCK_ELEMENTS if device.type == "cpu" else _GPU_BLOCK_ELEMENTS
    return min(length, max(_MIN_QUERY_BLOCK, elements // (batch * heads * length)))


# A new attention name needs its mask function too, or transformers runs it without any mask.
AttentionInterface.register(STATISTICS_ATTENTION, statistics_attention)
AttentionMaskInterface.register(STATISTICS_ATTENTION, sdpa_mask)


def choose_method(device: torch.device, length: int, eager_model: bool) -> str:
    """The method ``"auto"`` runs for a batch of sequences of ``length`` tokens on ``device``.

    Eager models get the reference method, which keeps their own fully masked rows. Otherwise the reference
    method is the faster one on a CPU up to `CPU_REFERENCE_MAX_LENGTH` tokens, and the chunked method beyond
    it and on GPUs, where it also needs less memory (BENCHMARKS.md).
    """
    if eager_model or (device.type == "cpu" and length <= CPU_REFERENCE_MAX_LENGTH):
        return "reference"
    return "chunked"


def check_arguments(
    method: str,
    device: torch.device,
    compute_dtype: torch.dtype,
    query_block: int | None = None,
    max_batches: int | None = None,
    memory_budget: int | str | None = None,
) -> None:
    """A ValueError, before any work, for arguments `collect_statistics` cannot run with on ``device``."""
    invalid_count = isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
    if max_batches is not None and invalid_count:
        raise ValueError(f"max_batches must be a positive int (or None for all batches), got {max_batches!r}")
    if memory_budget is not None:
        parse_bytes(memory_budget)
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if query_block is not None and query_block <= 0:
        raise ValueError(f"query_block must be positive, got {query_block}")
    if method == "triton" and not triton_available(device):
        missing = "" if importlib.util.find_spec("triton") else " and triton is not installed"
        raise ValueError(
            f"method='triton' needs a CUDA device and the triton package (pip install triton); the model is on "
            f"{device}{missing}: use method='auto' or 'chunked'."
        )
    if method == "triton" and compute_dtype != torch.float32:
        raise ValueError("method='triton' computes in float32: use compute_dtype=torch.float32, or method='chunked'.")


def triton_available(device: torch.device) -> bool:
    """Whether ``method="triton"`` can run on ``device``: CUDA with triton installed, or Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    from triton import knobs  # imported only here: statistics need no triton otherwise

    return device.type == "cuda" or bool(knobs.runtime.interpret)


@dataclass
class GrowthStatistics:
    """Sums over the data: ``second_moments[l]`` (d, d) and ``gradients[l]`` (heads, d, d), d = d_e + 1.

    ``num_tokens`` counts the non-padding tokens in C, ``num_batches`` the batches in M. M sums each batch's
    gradient times its ``loss_weight`` (`batch_loss_weight`: the loss terms its loss averages over), so that
    M / total weight is the gradient of the loss over all terms, the one `evaluate_loss` measures, also for
    batches of different sizes. Sums (not means) so that statistics from several processes or passes add up
    exactly.
    """

    second_moments: list[Tensor]
    gradients: list[Tensor]
    num_tokens: int
    num_batches: int
    #: The `config.model_type` of the model the statistics were collected on.
    model_type: str | None = None
    #: `weight_sample` of that model, so that statistics of other weights can be refused.
    weights: Tensor | None = None
    #: The methods that computed M (`METHODS`), joined by "+" where ``"auto"`` chose differently per batch.
    method: str | None = None
    #: The loss terms M sums over (None in files of hf_grow 0.x before it: M summed unweighted batch means).
    loss_weight: int | None = None

    def mean_second_moment(self, layer: int) -> Tensor:
        """E[x' x'^T] over tokens, in float64 (whatever dtype the sums were stored in)."""
        return self.second_moments[layer].to(torch.float64) / self.num_tokens

    def mean_gradient(self, layer: int) -> Tensor:
        """The gradient of the mean loss (over all loss terms) with respect to each head's Z, in float64."""
        weight = self.num_batches if self.loss_weight is None else self.loss_weight
        return self.gradients[layer].to(torch.float64) / weight

    def save(self, path: str | os.PathLike) -> None:
        """Write the statistics to a safetensors file (no pickle), atomically."""
        tensors = {f"second_moments.{layer}": tensor.detach().cpu().contiguous() for layer, tensor in enumerate(self.second_moments)}
        tensors.update({f"gradients.{layer}": tensor.detach().cpu().contiguous() for layer, tensor in enumerate(self.gradients)})
        if self.weights is not None:
            tensors["weights"] = self.weights.detach().cpu().contiguous()
        metadata = {
            "format": STATISTICS_FORMAT,
            "num_tokens": str(self.num_tokens),
            "num_batches": str(self.num_batches),
            "model_type": self.model_type or "",
            "method": self.method or "",
            "loss_weight": "" if self.loss_weight is None else str(self.loss_weight),
        }
        temporary = f"{os.fspath(path)}.tmp-{os.getpid()}"
        safetensors.torch.save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu") -> GrowthStatistics:
        """Read statistics written by `save`; a ValueError for any other file."""
        try:
            with safetensors.safe_open(os.fspath(path), framework="pt", device=str(device)) as handle:
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        except (OSError, safetensors.SafetensorError) as error:
            raise ValueError(f"cannot read statistics from {path}: {error}") from None
        if metadata.get("format") != STATISTICS_FORMAT:
            raise ValueError(f"{path} is not an hf_grow statistics file (format {metadata.get('format')!r})")
        layers = sum(name.startswith("second_moments.") for name in tensors)
        return cls(
            second_moments=[tensors[f"second_moments.{layer}"] for layer in range(layers)],
            gradients=[tensors[f"gradients.{layer}"] for layer in range(layers)],
            num_tokens=int(metadata["num_tokens"]),
            num_batches=int(metadata["num_batches"]),
            model_type=metadata["model_type"] or None,
            weights=tensors.get("weights"),
            method=metadata.get("method") or None,
            loss_weight=int(metadata["loss_weight"]) if metadata.get("loss_weight") else None,
        )


def weight_sample(model: PreTrainedModel, per_parameter: int = 8) -> Tensor:
    """A few evenly spaced entries of every parameter, in float64: a fingerprint of the weights.

    Compared with a tolerance (not hashed), so that the same checkpoint loaded in another dtype still matches.
    """
    samples = []
    with torch.no_grad():
        for parameter in model.parameters():
            flat = parameter.detach().reshape(-1)
            positions = torch.linspace(0, flat.numel() - 1, min(per_parameter, flat.numel()), device=flat.device)
            samples.append(flat[positions.round().long()].to(torch.float64).cpu())
    return torch.cat(samples)


def iterate_batches(dataloader: Iterable[Mapping[str, Tensor]], model: PreTrainedModel) -> Iterator[dict[str, Tensor]]:
    """Batches as dicts on the model's device; a clear error for anything that is not a dict or is longer than
    the model's positions (which would otherwise fail deep inside the embedding lookup)."""
    device = next(model.parameters()).device
    positions = getattr(model.config, "max_position_embeddings", None)
    for index, batch in enumerate(dataloader):
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"batch {index} is a {type(batch).__name__}; hf_grow expects dict batches passed as model(**batch), "
                "e.g. from a DataLoader with transformers' DataCollatorForLanguageModeling."
            )
        tokens = token_shape(batch)
        length = tokens[-1] if tokens is not None and len(tokens) >= 2 else None
        if positions is not None and length is not None and length > positions:
            raise ValueError(
                f"batch {index} holds sequences of {length} tokens, but the model has {positions} positions "
                "(config.max_position_embeddings): cut the sequences to at most that many tokens."
            )
        yield {key: value.to(device) if isinstance(value, Tensor) else value for key, value in batch.items()}


def token_shape(batch: Mapping[str, Tensor]) -> torch.Size | None:
    """The (..., s) shape of a batch's tokens: ``input_ids``' shape, or ``inputs_embeds``' without the embedding
    dimension (e.g. (b, choices, s) for multiple choice). None where the batch holds neither."""
    if isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"].shape
    if isinstance(batch.get("inputs_embeds"), Tensor):
        return batch["inputs_embeds"].shape[:-1]
    return None


def batch_loss_weight(
    adapter: ArchitectureAdapter, model: PreTrainedModel, batch: Mapping[str, Tensor], loss_fn: LossFn | None
) -> int:
    """How many loss terms the batch's loss averages over (`ArchitectureAdapter.loss_weight`); with a custom
    ``loss_fn``, whose normalization hf_grow cannot see, its number of sequences."""
    if loss_fn is None:
        return adapter.loss_weight(model, batch)
    return len(next(value for value in batch.values() if isinstance(value, Tensor)))


def compute_loss(model: PreTrainedModel, batch: Mapping[str, Tensor], loss_fn: LossFn | None) -> Tensor:
    """``loss_fn(model, batch)``, or the model's own ``outputs.loss``."""
    if loss_fn is not None:
        return loss_fn(model, batch)
    loss = model(**batch).loss
    if loss is None:
        raise ValueError(
            "the model returned no loss: put labels in the batches (e.g. labels=input_ids for a causal LM) "
            "or pass loss_fn(model, batch) -> Tensor."
        )
    return loss


def module_modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every submodule's own train/eval flag (a dropout turned off inside a training model, say)."""
    return [(module, module.training) for module in model.modules()]


def restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    """Set back the flags `module_modes` took: ``model.train(flag)`` would set one flag on every submodule."""
    for module, training in modes:
        module.training = training


@contextlib.contextmanager
def _statistics_mode(model: PreTrainedModel, tf32: bool) -> Iterator[None]:
    """Eval mode, the statistics attention and the float32 matmul precision; restored on exit, also on error.

    Layers with gradient checkpointing enabled keep it: transformers checkpoints only layers in training mode,
    so those layers (not their submodules: dropout stays off) are switched to training, with a non-reentrant
    checkpoint (the only kind that supports `torch.autograd.grad`). No KV cache (``config.use_cache``): the
    statistics need none, and a recomputed layer would append to it twice.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError("statistics need gradients: call hf_grow outside torch.inference_mode().")
    original_attention = model.config._attn_implementation
    original_precision = torch.get_float32_matmul_precision()
    checkpointed = [
        module
        for module in model.modules()
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing
    ]
    checkpoint_functions = {module: module.__dict__.get("_gradient_checkpointing_func") for module in checkpointed}
    use_cache = getattr(model.config, "use_cache", None)
    modes = module_modes(model)
    model.eval()
    model.config.use_cache = False
    model.set_attn_implementation(STATISTICS_ATTENTION)
    for module in checkpointed:
        module.training = True
        module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        with torch.enable_grad():
            yield
    finally:
        torch.set_float32_matmul_precision(original_precision)
        for module, function in checkpoint_functions.items():
            if function is None:
                del module._gradient_checkpointing_func
            else:
                module._gradient_checkpointing_func = function
        model.set_attn_implementation(original_attention)
        if use_cache is None:
            del model.config.use_cache
        else:
            model.config.use_cache = use_cache
        restore_modes(modes)


class _Collector:
    """Hooks that accumulate C for every layer (``with_second_moments``) and M for the layers of ``group``.

    ``eager_model``: the model normally runs eager attention, whose fully masked rows the statistics keep.
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
    ):
        self.attentions = adapter.attention_modules(model)
        self.compute_dtype = compute_dtype
        self.method = method
        self.eager_model = eager_model
        #: The method of the batch under way (``method``, or what ``"auto"`` chose for it).
        self.batch_method = method
        self.methods_used: set[str] = set()
        self.query_block = query_block
        self.embeddings = model.get_input_embeddings()
        parameter = next(model.parameters())
        self.device = device = parameter.device
        self.float16 = parameter.dtype == torch.float16
        num_heads, width = adapter.num_heads(model.config), adapter.hidden_size(model.config) + 1
        self.second_moments = (
            [torch.zeros(width, width, dtype=torch.float64, device=device) for _ in self.attentions]
            if with_second_moments
            else None
        )
        self.gradients = {
            layer: torch.zeros(num_heads, width, width, dtype=torch.float64, device=device) for layer in group
        }
        self.hooked_layers = range(len(self.attentions)) if with_second_moments else sorted(group)
        self.qk_inputs = [adapter.qk_input_module(attention) for attention in self.attentions]
        self.num_tokens = 0
        self.loss_weight = 0
        self.loss_sum = 0.0
        self.token_mask: Tensor | None = None
        self.batch_index = 0
        self.inputs: dict[int, Tensor] = {}
        self.layers_run: set[int] = set()
        self.anchors: list[Tensor] = []
        # True while backward runs: checkpointed layers then run their forward again, which adds nothing.
        self.in_backward = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        handles = [self.embeddings.register_forward_hook(self._keep_anchor)]
        for layer in self.hooked_layers:
            handles.append(self.qk_inputs[layer].register_forward_pre_hook(self._input_hook(layer)))
        for layer, attention in enumerate(self.attentions):
            _COLLECTING[attention] = (self, layer)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for attention in self.attentions:
                _COLLECTING.pop(attention, None)
            self.inputs.clear()
            self.anchors.clear()

    def _keep_anchor(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        # Backward runs towards the embeddings' output, so it must be part of the graph even if they are frozen.
        if not output.requires_grad:
            output = output.detach().requires_grad_(True)
        self.anchors.append(output)
        return output

    def _input_hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if self.in_backward:
                return  # gradient checkpointing recomputes the layer: its inputs were taken in the forward pass
            if layer in self.layers_run:
                raise ValueError(
                    f"layer {layer} ran twice on batch {self.batch_index}: loss_fn must call the model once per "
                    "batch (each forward pass is paired with its backward); concatenate the inputs into one call."
                )
            hidden = args[0].detach()
            ones = torch.ones_like(hidden[..., :1])
            augmented = torch.cat([hidden, ones], dim=-1).to(self.compute_dtype)
            if self.token_mask is not None:
                if self.token_mask.shape != augmented.shape[:-1]:
                    raise ValueError(
                        f"attention_mask of shape {tuple(self.token_mask.shape)} does not match the "
                        f"{tuple(augmented.shape[:-1])} tokens reaching layer {layer}"
                    )
                augmented = augmented * self.token_mask[..., None].to(augmented.dtype)
            self.layers_run.add(layer)
            if layer in self.gradients:
                self.inputs[layer] = augmented
            if self.second_moments is not None:
                flat = augmented.reshape(-1, augmented.shape[-1]).to(torch.float64)
                product = flat.mT @ flat
                if not torch.isfinite(product).all():
                    raise FloatingPointError(
                        f"non-finite inputs to the attention of layer {layer} at batch {self.batch_index}: "
                        "check the data of that batch and the model's weights."
                    )
                self.second_moments[layer] += product

        return hook

    def score_hook(self, layer: int) -> Callable[[Tensor], None]:
        """The reference method: receives G = dLoss/dS of ``layer`` as a whole."""

        def hook(grad: Tensor) -> None:
            augmented = self.inputs.pop(layer)
            if grad.shape[-1] != augmented.shape[-2] or grad.shape[-2] != augmented.shape[-2]:
                raise ValueError("statistics need full self-attention scores: run the model without a KV cache")
            # M_i = X'^T G_i X' summed over the batch: (b, s, d)^T (b, h, s, s) (b, s, d) -> (h, d, d)
            with _without_autocast(grad.device):
                projected = torch.matmul(grad.to(self.compute_dtype), augmented[:, None])
                self._accumulate(layer, torch.einsum("bqd,bhqe->hde", augmented, projected))

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
            with _without_autocast(grad_output.device):
                if method == "triton":
                    from .triton_kernels import score_gradient_products_fused

                    tf32 = torch.get_float32_matmul_precision() != "highest"
                    products = score_gradient_products_fused(
                        *saved, grad_output.transpose(1, 2), augmented, mask, scaling, is_causal, tf32
                    )
                else:
                    products = score_gradient_products(
                        *saved, grad_output.transpose(1, 2), augmented, mask, scaling, is_causal, block,
                        self.compute_dtype,
                    )
                self._accumulate(layer, products)

        output.register_hook(on_backward)

    def _accumulate(self, layer: int, contribution: Tensor) -> None:
        contribution = contribution.to(torch.float64)
        if not torch.isfinite(contribution).all():
            overflow = " (float16 overflows most easily: load the model in bfloat16 or float32)" if self.float16 else ""
            raise FloatingPointError(
                f"non-finite score gradients in layer {layer} at batch {self.batch_index}{overflow}: "
                "check the loss and the data of that batch."
            )
        self.gradients[layer] += contribution

    def step(self, model: PreTrainedModel, batch: Mapping[str, Tensor], loss_fn: LossFn | None, weight: int) -> float:
        """Forward and backward on one batch of ``weight`` loss terms, accumulating C and M. Returns its loss.

        Backward runs on the loss times ``weight``, the sum over its terms: M sums those (see `GrowthStatistics`),
        and each term's gradient is of order one, which keeps float16 score gradients from underflowing.
        """
        mask = batch.get("attention_mask")
        self.token_mask = None if mask is None else (mask != 0)
        if self.token_mask is not None:
            self.token_mask = self.token_mask.reshape(-1, self.token_mask.shape[-1])
        self.inputs.clear()
        self.layers_run.clear()
        self.anchors.clear()
        tokens = token_shape(batch)
        if tokens is None:
            raise ValueError(f"batch {self.batch_index} holds neither input_ids nor inputs_embeds: pass one of them.")
        if self.method == "auto":
            self.batch_method = choose_method(self.device, tokens[-1], self.eager_model)
        self.methods_used.add(self.batch_method)
        embeddings = batch.get("inputs_embeds")
        if isinstance(embeddings, Tensor):
            # Inputs given as embeddings skip the embedding layer: backward runs towards them instead.
            if not embeddings.requires_grad:
                embeddings = embeddings.detach().requires_grad_(True)
                batch = {**batch, "inputs_embeds": embeddings}
            self.anchors.append(embeddings)
        loss = compute_loss(model, batch, loss_fn)
        if loss.dim() != 0:
            raise ValueError(f"the loss must be a scalar, got shape {tuple(loss.shape)}")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss.item()} at batch {self.batch_index}")
        anchors = [anchor for anchor in self.anchors if anchor.requires_grad]
        self.in_backward = True
        try:
            torch.autograd.grad(loss * weight, anchors, allow_unused=True)
        finally:
            self.in_backward = False
        self.num_tokens += int(self.token_mask.sum()) if self.token_mask is not None else tokens.numel()
        self.loss_weight += weight
        self.inputs.clear()
        self.anchors.clear()
        self.batch_index += 1
        self.loss_sum += float(loss.detach())
        return float(loss.detach())


def _without_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Statistics products in their own dtype even when the caller runs the model under autocast."""
    return torch.autocast(device.type, enabled=False)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(size: int | str) -> int:
    """A number of bytes from an int or a string such as ``"2GB"``, ``"1.5 GiB"`` or ``"500MB"``."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"memory_budget must be a number of bytes or a string like '2GB', got {type(size).__name__}")
    if isinstance(size, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"memory_budget {size!r} is not a size: write e.g. '2GB', '1.5GiB', '500MB' or bytes")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory_budget must be positive, got {size}")
    return size


def statistics_bytes(num_layers: int, num_heads: int, hidden_size: int, layers_of_m: int | None = None) -> int:
    """Bytes of the float64 accumulators: C for every layer, M for ``layers_of_m`` layers (default all).

    ``layers * (d_e + 1)^2 * 8 + layers_of_m * heads * (d_e + 1)^2 * 8``.
    """
    width = hidden_size + 1
    layers_of_m = num_layers if layers_of_m is None else layers_of_m
    return 8 * width * width * (num_layers + layers_of_m * num_heads)


def layer_groups(num_layers: int, num_heads: int, hidden_size: int, memory_budget: int | str | None) -> list[list[int]]:
    """Layers whose M is collected together, one group per pass over the data, within ``memory_budget``.

    The budget covers C for all layers, M for the layers of a pass, and one more layer's M for the product
    of the batch being added (the model's own memory comes on top).
    """
    if memory_budget is None:
        return [list(range(num_layers))]
    budget = parse_bytes(memory_budget)
    per_layer = statistics_bytes(1, num_heads, hidden_size, 1) - statistics_bytes(1, num_heads, hidden_size, 0)
    fitting = (budget - statistics_bytes(num_layers, num_heads, hidden_size, 1)) // per_layer
    if fitting < 1:
        needed = statistics_bytes(num_layers, num_heads, hidden_size, 2)
        raise ValueError(
            f"memory_budget {budget:,} bytes is below the {needed:,} bytes the statistics need for one layer at a "
            f"time (C of {num_layers} layers and M of 2 layers of {num_heads} heads, in float64): raise the budget."
        )
    passes = math.ceil(num_layers / fitting)
    size = math.ceil(num_layers / passes)  # as even as possible: the same number of passes, less memory
    return [list(range(start, min(start + size, num_layers))) for start in range(0, num_layers, size)]


def collect_statistics(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]],
    adapter: ArchitectureAdapter,
    loss_fn: LossFn | None = None,
    max_batches: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    progress: bool = False,
    method: str = "auto",
    query_block: int | None = None,
    tf32: bool | None = None,
    memory_budget: int | str | None = None,
    accelerator: Accelerator | None = None,
) -> GrowthStatistics:
    """Accumulate C and M over ``dataloader`` (at most ``max_batches``), leaving the model as it was.

    ``compute_dtype`` is the precision of the per-batch products (float32 or float64, whatever the model
    dtype or autocast); sums are always float64. Backward runs on each batch's loss times its loss terms
    (see `GrowthStatistics`), so a float16 model's score gradients do not underflow.

    ``method`` is ``"chunked"`` (sdpa attention, M block by block in backward; ``query_block`` queries per
    block, by default `default_query_block`: 8 MiB per float32 block tensor on a CPU, 256 MiB on a GPU, at
    least 32 queries), ``"triton"`` (the same with fused kernels; CUDA, float32 products), ``"reference"``
    (eager attention, full score gradients) or ``"auto"`` (by device and sequence length, per batch:
    `choose_method`). ``tf32`` runs the float32 products on TF32 tensor cores (CUDA; ~5e-4 relative error,
    several times faster; False forces full float32 precision); by default on for bfloat16/float16 models.

    ``memory_budget`` (bytes, or a string such as ``"2GB"``) bounds the float64 accumulators: M is collected
    for as many layers as fit, in several passes over ``dataloader`` (which must then be re-iterable and
    yield the same batches each time), and finished layers move to the CPU. The result equals one pass.

    ``accelerator``: an `accelerate.Accelerator`; every process passes its own shard of the data (e.g. a
    DataLoader prepared by it) and gets the sums over all processes. ``model`` may be wrapped by it or by
    DistributedDataParallel. Raises ValueError on empty data, FloatingPointError on non-finite losses or
    statistics (naming the layer and batch).
    """
    model = unwrap_model(model, accelerator)
    processes = Processes(accelerator)
    config = model.config
    parameter = next(model.parameters())
    check_arguments(method, parameter.device, compute_dtype, query_block, max_batches, memory_budget)
    eager_model = config._attn_implementation == "eager"
    num_layers = len(adapter.attention_modules(model))
    groups = layer_groups(num_layers, adapter.num_heads(config), adapter.hidden_size(config), memory_budget)
    if len(groups) > 1 and iter(dataloader) is dataloader:
        raise ValueError(
            f"memory_budget needs {len(groups)} passes over the data, but the dataloader is a one-shot iterator: "
            "pass a list of batches or a DataLoader, or a larger memory_budget."
        )
    if tf32 is None:
        tf32 = parameter.dtype in (torch.bfloat16, torch.float16)
    offload = len(groups) > 1
    second_moments: list[Tensor] = []
    gradients: list[Tensor | None] = [None] * num_layers
    first_pass: tuple[int, int, int, int, float] | None = None
    methods_used: set[str] = set()
    with _statistics_mode(model, tf32):
        for index, group in enumerate(groups):
            with processes.failing_together():
                collector = _Collector(
                    model, adapter, compute_dtype, method, query_block, group, index == 0, eager_model
                )
                description = f"statistics {index + 1}/{len(groups)}" if offload else "statistics"
                show = progress and processes.is_main
                skipped = _collect_pass(collector, model, dataloader, adapter, loss_fn, max_batches, show, description)
                counts = (
                    collector.num_tokens, collector.batch_index, skipped, collector.loss_weight, collector.loss_sum
                )
                first_pass = first_pass or counts
                methods_used |= collector.methods_used
                if counts[:4] != first_pass[:4] or not math.isclose(counts[4], first_pass[4], rel_tol=1e-6):
                    raise ValueError(
                        "the data changed between passes over it (tokens, batches, skipped, loss terms, loss sum: "
                        f"{first_pass} in pass 1, {counts} in pass {index + 1}): memory_budget needs the same "
                        "batches on every pass (no random masking or cropping in the collator), or a larger budget "
                        "for a single pass."
                    )
            for layer, gradient in collector.gradients.items():
                gradients[layer] = processes.sum_(gradient).cpu() if offload else processes.sum_(gradient)
            if collector.second_moments is not None:
                second_moments = [processes.sum_(moment) for moment in collector.second_moments]
                second_moments = [moment.cpu() for moment in second_moments] if offload else second_moments
    totals = processes.sum_(torch.tensor(first_pass[:4], dtype=torch.float64, device=parameter.device))
    num_tokens, num_batches, skipped, loss_weight = (int(total) for total in totals)
    if skipped:
        logger.warning(
            "skipped %d batch(es) without loss terms (every label -100, e.g. all padding, or one-token sequences "
            "for a causal LM)",
            skipped,
        )
    if num_batches == 0 and skipped:
        raise ValueError(
            f"none of the {skipped} batches has a loss term (every label is -100): nothing to learn from. "
            "Use longer sequences or fewer masked labels."
        )
    if num_batches == 0:
        raise ValueError("the dataloader yielded no batches: statistics need at least one batch of data.")
    if num_tokens == 0:
        raise ValueError("every token of the data is padding (attention_mask is all zero): nothing to learn from.")
    return GrowthStatistics(
        second_moments, gradients, num_tokens, num_batches, config.model_type, weight_sample(model),
        "+".join(sorted(methods_used)), loss_weight,
    )


def _collect_pass(
    collector: _Collector,
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]],
    adapter: ArchitectureAdapter,
    loss_fn: LossFn | None,
    max_batches: int | None,
    progress: bool,
    description: str,
) -> int:
    """One pass over the data with ``collector`` installed; returns the number of batches skipped."""
    skipped = 0
    batches = iterate_batches(dataloader, model)
    with collector.installed():
        for batch in tqdm(batches, desc=description, unit="batch", total=max_batches, disable=not progress):
            weight = batch_loss_weight(adapter, model, batch, loss_fn)
            if weight == 0:
                skipped += 1  # no loss term (every label -100): the model's loss would be 0 / 0
                continue
            collector.step(model, batch, loss_fn, weight)
            if max_batches is not None and collector.batch_index >= max_batches:
                break
    return skipped
