"""The activations of one statistics batch, counted before any data is read: a forward of the model's twin on the
meta device (no memory, no compute) with a hook on the tensors autograd saves (`activation_bytes`), with the
attention the statistics run (`statistics_attention`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import find_labels

from ..statistics import CPU_REFERENCE_MAX_LENGTH
from ..statistics.batches import float32_logits


def statistics_attention(seq_len: int, device: torch.device | str) -> str:
    """The attention whose activations the statistics keep: eager where "auto" takes the reference method
    (`statistics.choose_method`), else a fused one (`FUSED_PROBE`: what sdpa and the chunked method save)."""
    on_cpu = torch.device(device).type == "cpu"
    return "eager" if on_cpu and seq_len <= CPU_REFERENCE_MAX_LENGTH else FUSED_PROBE


class _FusedAttention(torch.autograd.Function):
    """Saves what fused attention saves for backward (queries, keys, values, output and the row log-sum-exp),
    without computing anything: on the meta device, sdpa falls back to the math path and saves the scores."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        output = query.new_empty((*query.shape[:-1], value.shape[-1]))
        ctx.save_for_backward(query, key, value, output, query.new_empty(query.shape[:-1]))
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # never run: the probe only counts
        raise NotImplementedError


def _fused_probe(module: nn.Module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    return _FusedAttention.apply(query, key, value).transpose(1, 2), None


FUSED_PROBE = "hf_grow_memory_probe"
AttentionInterface.register(FUSED_PROBE, _fused_probe)
AttentionMaskInterface.register(FUSED_PROBE, sdpa_mask)


def activation_bytes(model: PreTrainedModel, batch_size: int, seq_len: int, attention: str) -> int:
    """Bytes autograd saves in a forward with a language-model loss whose backward reaches the inputs only (as
    in the statistics pass), plus the largest saved tensor again for its gradient: a forward of a twin of
    ``model`` on the meta device. A model without a head (a SentenceTransformer's) runs without labels: its
    loss on the pooled outputs saves little beside the model's own tensors."""
    config = copy.deepcopy(model.config)  # its own config: setting its attention leaves the model's
    config.pad_token_id = None  # GPT-2 looks for pads in ids without a mask, a `.item()` the meta device has not
    # Without a cache, transformers' causal masks look for packed sequences in the positions, another `.item()`
    # (sentence-transformers saves its causal models with `use_cache: false`); the cache saves no activation.
    config.use_cache = True
    with torch.device("meta"):
        twin = type(model)(config)
    for module in twin.modules():  # dynamic rotary positions read the batch's length, another `.item()`
        if isinstance(getattr(module, "rope_type", None), str) and "dynamic" in module.rope_type:
            module.rope_type = "default"  # the same tensors saved, from the frequencies the twin holds
    twin = twin.to(dtype=next(model.parameters()).dtype)
    twin.set_attn_implementation(attention)
    twin.requires_grad_(False)
    parameters = {id(parameter) for parameter in twin.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in parameters and id(tensor) not in parameters:
            saved[id(base)] = base.numel() * base.element_size()
        return tensor

    handle = twin.get_input_embeddings().register_forward_hook(lambda module, args, output: output.requires_grad_())
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    try:
        # float32 logits where the statistics pass makes them so (`float32_logits`): a half-precision model's
        # vocabulary-sized logits saved twice as wide
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), float32_logits(twin):
            twin(input_ids=ids, **({} if twin.get_output_embeddings() is None else _labels(twin, ids)))
    finally:
        handle.remove()
    return sum(saved.values()) + max(saved.values(), default=0)


def _labels(model: PreTrainedModel, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A language model's labels: the ids, and a label per sequence for its other heads' (BertForPreTraining's
    next-sentence head, without which it computes no loss)."""
    return {name: ids if name == "labels" else ids[:, 0] for name in find_labels(type(model))}
