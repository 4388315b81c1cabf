"""GPT-2: Q/K live in the fused ``c_attn`` Conv1D of each block, as ``[queries | keys | values]`` columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from transformers import (
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
    PreTrainedConfig,
    PreTrainedModel,
)

from ..models.grown_gpt2 import (
    GrownGPT2Config,
    GrownGPT2DoubleHeadsModel,
    GrownGPT2ForQuestionAnswering,
    GrownGPT2ForSequenceClassification,
    GrownGPT2ForTokenClassification,
    GrownGPT2LMHeadModel,
    GrownGPT2Model,
    GrownGPT2PreTrainedModel,
)
from .base import ArchitectureAdapter


GROWN_CLASSES: dict[type[PreTrainedModel], type[PreTrainedModel]] = {
    GPT2Model: GrownGPT2Model,
    GPT2LMHeadModel: GrownGPT2LMHeadModel,
    GPT2DoubleHeadsModel: GrownGPT2DoubleHeadsModel,
    GPT2ForSequenceClassification: GrownGPT2ForSequenceClassification,
    GPT2ForTokenClassification: GrownGPT2ForTokenClassification,
    GPT2ForQuestionAnswering: GrownGPT2ForQuestionAnswering,
}

# Config entries that describe a checkpoint rather than the architecture; the grown config sets its own.
_CONFIG_KEYS_NOT_INHERITED = ("model_type", "qk_head_dims", "architectures", "auto_map", "transformers_version")


def _qk_head_dim(attention: nn.Module) -> int:
    return getattr(attention, "qk_head_dim", attention.head_dim)


def _split_heads(columns: Tensor, bias: Tensor, num_heads: int) -> Tensor:
    """(d_e, heads * d_k) weight columns and their bias -> augmented (heads, d_e + 1, d_k)."""
    d_e = columns.shape[0]
    weight = columns.reshape(d_e, num_heads, -1).permute(1, 0, 2)
    return torch.cat([weight, bias.reshape(num_heads, 1, -1)], dim=1)


def _merge_heads(augmented: Tensor) -> tuple[Tensor, Tensor]:
    """Augmented (heads, d_e + 1, d_k) -> (d_e, heads * d_k) weight columns and their bias."""
    num_heads, d_aug, qk_dim = augmented.shape
    weight = augmented[:, :-1, :].permute(1, 0, 2).reshape(d_aug - 1, num_heads * qk_dim)
    return weight, augmented[:, -1, :].reshape(num_heads * qk_dim)


class GPT2Adapter(ArchitectureAdapter):
    model_types = ("gpt2", "grown_gpt2")

    def check_supported(self, model: PreTrainedModel) -> None:
        if model.config.add_cross_attention:
            raise ValueError(
                "GPT-2 with add_cross_attention=True cannot be grown: the cross-attention queries and keys come "
                "from different inputs. Grow a decoder-only GPT-2."
            )
        self.grown_class(model)

    def attention_modules(self, model: PreTrainedModel) -> list[nn.Module]:
        backbone = model if isinstance(model, GPT2Model) else model.transformer
        return [block.attn for block in backbone.h]

    def qk_input_module(self, attention: nn.Module) -> nn.Module:
        return attention.c_attn

    def num_heads(self, config: PreTrainedConfig) -> int:
        return config.n_head

    def hidden_size(self, config: PreTrainedConfig) -> int:
        return config.n_embd

    def qk_head_dims(self, config: PreTrainedConfig) -> list[int]:
        return list(getattr(config, "qk_head_dims", None) or [config.n_embd // config.n_head] * config.n_layer)

    def scaling(self, config: PreTrainedConfig, layer: int, qk_head_dim: int) -> float:
        scaling = qk_head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scaling /= float(layer + 1)
        return scaling

    def read_qk(self, attention: nn.Module) -> tuple[Tensor, Tensor]:
        width = attention.num_heads * _qk_head_dim(attention)
        weight = attention.c_attn.weight.detach().to(torch.float64)
        bias = attention.c_attn.bias.detach().to(torch.float64)
        query = _split_heads(weight[:, :width], bias[:width], attention.num_heads)
        key = _split_heads(weight[:, width : 2 * width], bias[width : 2 * width], attention.num_heads)
        return query, key

    def write_qk(self, attention: nn.Module, query: Tensor, key: Tensor) -> None:
        width = attention.num_heads * _qk_head_dim(attention)
        if query.shape[-1] * query.shape[0] != width or key.shape != query.shape:
            raise ValueError(f"Q/K weights of shape {tuple(query.shape)} do not fit a layer of width {width}")
        with torch.no_grad():
            for offset, augmented in ((0, query), (width, key)):
                weight, bias = _merge_heads(augmented)
                attention.c_attn.weight[:, offset : offset + width].copy_(weight)
                attention.c_attn.bias[offset : offset + width].copy_(bias)

    def grown_config(self, config: PreTrainedConfig, qk_head_dims: Sequence[int]) -> PreTrainedConfig:
        inherited = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_KEYS_NOT_INHERITED}
        return GrownGPT2Config(**inherited, qk_head_dims=list(qk_head_dims))

    def grown_class(self, model: PreTrainedModel) -> type[PreTrainedModel]:
        if isinstance(model, GrownGPT2PreTrainedModel):
            return type(model)
        for cls in type(model).__mro__:
            if cls in GROWN_CLASSES:
                return GROWN_CLASSES[cls]
        supported = ", ".join(cls.__name__ for cls in GROWN_CLASSES)
        raise ValueError(f"{type(model).__name__} is not a supported GPT-2 class; supported: {supported}.")

    def grown_state_dict(
        self, model: PreTrainedModel, qk_weights: Mapping[int, tuple[Tensor, Tensor]]
    ) -> dict[str, Tensor]:
        state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        module_names = {module: name for name, module in model.named_modules()}
        attentions = self.attention_modules(model)
        for layer, (query, key) in qk_weights.items():
            attention = attentions[layer]
            prefix = module_names[attention.c_attn]
            old_weight, old_bias = state_dict[f"{prefix}.weight"], state_dict[f"{prefix}.bias"]
            value_start = 2 * attention.num_heads * _qk_head_dim(attention)
            (query_weight, query_bias), (key_weight, key_bias) = _merge_heads(query), _merge_heads(key)
            state_dict[f"{prefix}.weight"] = torch.cat(
                [query_weight.to(old_weight), key_weight.to(old_weight), old_weight[:, value_start:]], dim=1
            )
            state_dict[f"{prefix}.bias"] = torch.cat(
                [query_bias.to(old_bias), key_bias.to(old_bias), old_bias[value_start:]]
            )
        return state_dict

    def shifts_labels(self, model: PreTrainedModel) -> bool:
        return isinstance(model, (GPT2LMHeadModel, GPT2DoubleHeadsModel))
