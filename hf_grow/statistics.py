"""First-order statistics of the attention scores, collected over a dataloader.

Per layer, C = sum X'^T X' over non-padding tokens; per head, M_i = sum X'^T G_i X' with G_i = dLoss/dS_i
the gradient of the loss with respect to the pre-softmax scores S_i (scale included, mask excluded).
M_i is exactly dLoss/dZ_i for the bilinear form Z_i of `hf_grow.linalg`.

The model runs under a registered attention function that computes scores eagerly and hooks their gradient;
padding tokens are zeroed out of X', so they contribute exactly nothing to C or M. Backward runs with
`torch.autograd.grad` towards the input embeddings only, so no parameter `.grad` is touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from .adapters import ArchitectureAdapter


STATISTICS_ATTENTION = "hf_grow_statistics"

LossFn = Callable[[PreTrainedModel, Mapping[str, Tensor]], Tensor]

# Gradient hooks for the attention modules of the collection under way; read by `statistics_attention`.
_SCORE_HOOKS: dict[nn.Module, Callable[[Tensor], None]] = {}


def statistics_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """Eager attention that hands the gradient of its pre-softmax scores to the hook of ``module``."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    hook = _SCORE_HOOKS.get(module)
    if hook is not None and scores.requires_grad:
        scores.register_hook(hook)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


# A new attention name needs its mask function too, or transformers runs it without any mask.
AttentionInterface.register(STATISTICS_ATTENTION, statistics_attention)
AttentionMaskInterface.register(STATISTICS_ATTENTION, eager_mask)


@dataclass
class GrowthStatistics:
    """Sums over the data: ``second_moments[l]`` (d, d) and ``gradients[l]`` (heads, d, d), d = d_e + 1.

    ``num_tokens`` counts the non-padding tokens in C, ``num_batches`` the loss evaluations summed in M.
    Sums (not means) so that statistics from several processes or passes add up exactly.
    """

    second_moments: list[Tensor]
    gradients: list[Tensor]
    num_tokens: int
    num_batches: int

    def mean_second_moment(self, layer: int) -> Tensor:
        """E[x' x'^T] over tokens."""
        return self.second_moments[layer] / self.num_tokens

    def mean_gradient(self, layer: int) -> Tensor:
        """The gradient of the mean batch loss with respect to each head's Z."""
        return self.gradients[layer] / self.num_batches


def iterate_batches(dataloader: Iterable[Mapping[str, Tensor]], device: torch.device) -> Iterator[dict[str, Tensor]]:
    """Batches as dicts on ``device``; a clear error for anything that is not a dict."""
    for index, batch in enumerate(dataloader):
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"batch {index} is a {type(batch).__name__}; hf_grow expects dict batches passed as model(**batch), "
                "e.g. from a DataLoader with transformers' DataCollatorForLanguageModeling."
            )
        yield {key: value.to(device) if isinstance(value, Tensor) else value for key, value in batch.items()}


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


@contextlib.contextmanager
def _statistics_mode(model: PreTrainedModel) -> Iterator[None]:
    """Eval mode and the statistics attention; both restored on exit, also on error."""
    was_training = model.training
    original_attention = model.config._attn_implementation
    model.eval()
    model.set_attn_implementation(STATISTICS_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(original_attention)
        model.train(was_training)


class _Collector:
    """Hooks that accumulate C and M for every layer of one model."""

    def __init__(self, model: PreTrainedModel, adapter: ArchitectureAdapter, compute_dtype: torch.dtype):
        self.attentions = adapter.attention_modules(model)
        self.compute_dtype = compute_dtype
        self.embeddings = model.get_input_embeddings()
        device = next(model.parameters()).device
        num_heads, width = adapter.num_heads(model.config), adapter.hidden_size(model.config) + 1
        self.second_moments = [torch.zeros(width, width, dtype=torch.float64, device=device) for _ in self.attentions]
        self.gradients = [
            torch.zeros(num_heads, width, width, dtype=torch.float64, device=device) for _ in self.attentions
        ]
        self.qk_inputs = [adapter.qk_input_module(attention) for attention in self.attentions]
        self.num_tokens = 0
        self.token_mask: Tensor | None = None
        self.batch_index = 0
        self.inputs: dict[int, Tensor] = {}
        self.anchors: list[Tensor] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        handles = [self.embeddings.register_forward_hook(self._keep_anchor)]
        for layer, module in enumerate(self.qk_inputs):
            handles.append(module.register_forward_pre_hook(self._input_hook(layer)))
        for layer, attention in enumerate(self.attentions):
            _SCORE_HOOKS[attention] = self._score_hook(layer)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for attention in self.attentions:
                _SCORE_HOOKS.pop(attention, None)
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
            if layer in self.inputs:
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
            self.inputs[layer] = augmented
            flat = augmented.reshape(-1, augmented.shape[-1]).to(torch.float64)
            self.second_moments[layer] += flat.mT @ flat

        return hook

    def _score_hook(self, layer: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            augmented = self.inputs.pop(layer)
            if grad.shape[-1] != augmented.shape[-2] or grad.shape[-2] != augmented.shape[-2]:
                raise ValueError("statistics need full self-attention scores: run the model without a KV cache")
            # M_i = X'^T G_i X' summed over the batch: (b, s, d)^T (b, h, s, s) (b, s, d) -> (h, d, d)
            projected = torch.matmul(grad.to(self.compute_dtype), augmented[:, None])
            contribution = torch.einsum("bqd,bhqe->hde", augmented, projected).to(torch.float64)
            if not torch.isfinite(contribution).all():
                raise FloatingPointError(
                    f"non-finite score gradients in layer {layer} at batch {self.batch_index}: "
                    "check the loss and the data of that batch."
                )
            self.gradients[layer] += contribution

        return hook

    def step(self, model: PreTrainedModel, batch: Mapping[str, Tensor], loss_fn: LossFn | None) -> float:
        """Forward and backward on one batch, accumulating C and M. Returns the batch loss."""
        mask = batch.get("attention_mask")
        self.token_mask = None if mask is None else (mask != 0)
        if self.token_mask is not None:
            self.token_mask = self.token_mask.reshape(-1, self.token_mask.shape[-1])
        self.inputs.clear()
        self.anchors.clear()
        loss = compute_loss(model, batch, loss_fn)
        if loss.dim() != 0:
            raise ValueError(f"the loss must be a scalar, got shape {tuple(loss.shape)}")
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss.item()} at batch {self.batch_index}")
        anchors = [anchor for anchor in self.anchors if anchor.requires_grad]
        torch.autograd.grad(loss, anchors, allow_unused=True)
        tokens = self.token_mask.sum() if self.token_mask is not None else None
        first_input = batch.get("input_ids", batch.get("inputs_embeds"))
        self.num_tokens += int(tokens) if tokens is not None else int(first_input.shape[:2].numel())
        self.inputs.clear()
        self.anchors.clear()
        self.batch_index += 1
        return float(loss.detach())


def collect_statistics(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]],
    adapter: ArchitectureAdapter,
    loss_fn: LossFn | None = None,
    max_batches: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> GrowthStatistics:
    """Accumulate C and M over ``dataloader`` (at most ``max_batches``), leaving the model as it was.

    ``compute_dtype`` is the precision of the per-batch products (float32 or float64, whatever the model
    dtype); sums are always float64. Raises ValueError on an empty dataloader, FloatingPointError on
    non-finite losses or statistics (naming the layer and batch).
    """
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
    collector = _Collector(model, adapter, compute_dtype)
    device = next(model.parameters()).device
    batches = iterate_batches(dataloader, device)
    with _statistics_mode(model), collector.installed():
        for batch in tqdm(batches, desc="statistics", unit="batch", total=max_batches, disable=not progress):
            collector.step(model, batch, loss_fn)
            if max_batches is not None and collector.batch_index >= max_batches:
                break
    if collector.batch_index == 0:
        raise ValueError("the dataloader yielded no batches: statistics need at least one batch of data.")
    if collector.num_tokens == 0:
        raise ValueError("every token of the data is padding (attention_mask is all zero): nothing to learn from.")
    return GrowthStatistics(collector.second_moments, collector.gradients, collector.num_tokens, collector.batch_index)
