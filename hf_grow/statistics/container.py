"""The statistics container and its file format (safetensors with the counts in the metadata)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from .. import linalg
from ..files import write_atomically


STATISTICS_FORMAT = "hf_grow.statistics.v1"


@dataclass
class GrowthStatistics:
    """Sums over the data: ``second_moments[l]`` (d, d) and ``gradients[l]`` (heads, d, d), d = d_e + 1.

    ``num_tokens`` counts the non-padding tokens in C, ``num_batches`` the batches in M. M sums each batch's
    gradient times its ``loss_weight`` (`batch_loss_weight`: the loss terms its loss averages over), so that
    M / total weight is the gradient of the loss over all terms, the one `evaluate_loss` measures, also for
    batches of different sizes. Sums (not means) so that statistics from several processes or passes add up
    exactly.

    A loss that runs the model several times per batch (one forward pass per text column) contributes every
    pass: each pass's real tokens count once in C (a batch of anchors and positives adds both columns' tokens,
    as if they were concatenated), and its M is the sum over passes of X'^T G X' with each pass's own X' and
    G = dLoss/dS, which is dLoss/dZ of the whole loss. Its loss weight is that of the batch (with a
    ``loss_fn``, its number of examples), counted once however many passes it makes.

    Collected with ``cross_fit``, ``half_gradients[l]`` sums M over the odd-numbered batches only, whose loss
    terms ``half_loss_weight`` counts: the rest is the other half (`cross_fitted_gradient`).
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
    #: With cross-fitting: M over the odd-numbered batches, per layer (None where released after its solve).
    half_gradients: list[Tensor | None] | None = None
    #: The loss terms of those batches.
    half_loss_weight: int | None = None

    def mean_second_moment(self, layer: int) -> Tensor:
        """E[x' x'^T] over tokens, in float64 (whatever dtype the sums were stored in)."""
        return self.second_moments[layer].to(torch.float64) / self.num_tokens

    def mean_gradient(self, layer: int, heads: slice = slice(None)) -> Tensor:
        """The gradient of the mean loss (over all loss terms) with respect to each head's Z (of ``heads``), in
        float64."""
        if self.gradients[layer] is None:
            raise RuntimeError(f"M of layer {layer} was released after its solve: collect the statistics again")
        weight = self.num_batches if self.loss_weight is None else self.loss_weight
        return self.gradients[layer][heads].to(torch.float64) / weight

    def cross_fitted_gradient(
        self, layer: int, metric: linalg.Metric, rank: int, method: str = "eigh", heads: slice = slice(None),
        in_basis: bool = False,
    ) -> Tensor:
        """The mean gradient of ``heads`` kept to what the two halves of the batches agree on, in float64, over the
        first inputs of M that ``metric`` (of C) spans: `linalg.cross_fitted_gradient` of the halves' means,
        ``half_gradients / half_loss_weight`` and the rest of M over the rest of the loss terms (``in_basis``: in
        C's eigenbasis).

        Statistics with one noisy M fit the batches they came from; each half's top-``rank`` directions valued
        by the other half keep what is common to the data.
        """
        if self.half_gradients is None or self.half_loss_weight is None:
            raise ValueError("these statistics hold no halves to cross-fit: collect them with cross_fit=True")
        if self.gradients[layer] is None or self.half_gradients[layer] is None:
            raise RuntimeError(f"M of layer {layer} was released after its solve: collect the statistics again")
        inputs = metric.eigenvectors.shape[-1]
        total = self.gradients[layer][heads, :inputs, :inputs].to(torch.float64)
        half = self.half_gradients[layer][heads, :inputs, :inputs].to(torch.float64)
        first = half / self.half_loss_weight
        second = (total - half) / (self.loss_weight - self.half_loss_weight)
        return linalg.cross_fitted_gradient(first, second, metric, rank, method, in_basis)

    def release(self, layer: int) -> None:
        """Free the M of ``layer`` (and its half sum) once it is solved."""
        self.gradients[layer] = None
        if self.half_gradients is not None:
            self.half_gradients[layer] = None

    def save(self, path: str | os.PathLike) -> None:
        """Write the statistics to a safetensors file (no pickle), atomically."""
        missing = [layer for layer, sums in enumerate(self.gradients) if sums is None]
        if missing:
            raise ValueError(
                f"cannot save statistics without the M of layers {missing} (freed once solved, or held by another "
                "process: collect_statistics(owners=)): save them before growth, or collect them without owners."
            )
        named = [("second_moments", self.second_moments), ("gradients", self.gradients)]
        named += [("half_gradients", self.half_gradients)] if self.half_gradients is not None else []
        tensors = {
            f"{name}.{layer}": tensor.detach().cpu().contiguous() for name, sums in named
            for layer, tensor in enumerate(sums)
        }
        if self.weights is not None:
            tensors["weights"] = self.weights.detach().cpu().contiguous()
        metadata = {
            "format": STATISTICS_FORMAT,
            "num_tokens": str(self.num_tokens),
            "num_batches": str(self.num_batches),
            "model_type": self.model_type or "",
            "method": self.method or "",
            "loss_weight": "" if self.loss_weight is None else str(self.loss_weight),
            "half_loss_weight": "" if self.half_loss_weight is None else str(self.half_loss_weight),
        }
        write_atomically(path, lambda temporary: safetensors.torch.save_file(tensors, temporary, metadata=metadata))

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
        halves = "half_gradients.0" in tensors  # files of cross-fitted statistics (and none before them)
        names = [f"{kind}.{layer}" for kind in ("second_moments", "gradients", *["half_gradients"] * halves)
                 for layer in range(layers)]
        missing = [name for name in names if name not in tensors]
        missing += [key for key in ("num_tokens", "num_batches", "model_type") if key not in metadata]
        if missing or not layers:
            raise ValueError(f"{path} is a damaged statistics file: it lacks {missing or 'every layer'}")
        counts = [metadata.get(key) for key in ("num_tokens", "num_batches", "loss_weight", "half_loss_weight")]
        if any(count and not (count.isdigit() and int(count) > 0) for count in counts):
            raise ValueError(f"{path} is a damaged statistics file: its counts {counts} are not all positive")
        return cls(
            second_moments=[tensors[f"second_moments.{layer}"] for layer in range(layers)],
            gradients=[tensors[f"gradients.{layer}"] for layer in range(layers)],
            num_tokens=int(metadata["num_tokens"]),
            num_batches=int(metadata["num_batches"]),
            model_type=metadata["model_type"] or None,
            weights=tensors["weights"].cpu() if "weights" in tensors else None,  # compared with a CPU sample
            method=metadata.get("method") or None,
            loss_weight=int(metadata["loss_weight"]) if metadata.get("loss_weight") else None,
            half_gradients=[tensors[f"half_gradients.{layer}"] for layer in range(layers)] if halves else None,
            half_loss_weight=int(metadata["half_loss_weight"]) if metadata.get("half_loss_weight") else None,
        )


def _sample_positions(numel: int, per_parameter: int) -> list[int]:
    """The evenly spaced flat positions `weight_sample` reads of a parameter of ``numel`` entries."""
    # float64: float32 positions round to the wrong entry (and past the end) beyond 2^24 entries
    count = min(per_parameter, numel)
    return torch.linspace(0, numel - 1, count, dtype=torch.float64).round().long().tolist()


def weight_sample(model: PreTrainedModel, per_parameter: int = 8) -> Tensor:
    """A few evenly spaced entries of every parameter, in float64: a fingerprint of the weights.

    Compared with a tolerance (not hashed), so that the same checkpoint loaded in another dtype still matches.
    """
    samples = []
    with torch.no_grad():
        for parameter in model.parameters():
            flat = parameter.detach().reshape(-1)
            positions = torch.tensor(_sample_positions(flat.numel(), per_parameter), device=flat.device)
            samples.append(flat[positions].to(torch.float64).cpu())
    return torch.cat(samples)


def fingerprint(values: Tensor) -> str:
    """A short hash of ``values`` (in float64): what processes compare to find that they hold other weights or
    statistics (`Processes.check_same`), a dozen characters instead of the values themselves."""
    return hashlib.sha256(values.detach().to(torch.float64).cpu().contiguous().numpy().tobytes()).hexdigest()[:12]


def statistics_fingerprint(statistics: GrowthStatistics, per_layer: int = 64) -> str:
    """`fingerprint` of the counts and of evenly spaced entries of each layer's C (held by every process, also where
    M is sharded): entries, not sums, whose rounding would depend on the thread count."""
    counts = torch.tensor([statistics.num_tokens, statistics.num_batches, statistics.loss_weight or 0],
                          dtype=torch.float64)
    entries = [c.reshape(-1)[_sample_positions(c.numel(), per_layer)].to(torch.float64).cpu()
               for c in statistics.second_moments]
    return fingerprint(torch.cat([counts, *entries]))


def checkpoint_weight_sample(model: nn.Module, folder: str | os.PathLike, per_parameter: int = 8) -> Tensor | None:
    """`weight_sample` of the weights saved in ``folder`` (safetensors: one file or an index of shards) for
    ``model``'s parameters, read entry by entry without loading them (``model`` may be on the meta device); None
    where the folder does not hold every parameter under its name and shape."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = json.loads(index.read_text()).get("weight_map", {})
    elif (folder / "model.safetensors").is_file():
        with safetensors.safe_open(os.fspath(folder / "model.safetensors"), framework="pt") as handle:
            files = dict.fromkeys(handle.keys(), "model.safetensors")
    else:
        return None
    samples = []
    with contextlib.ExitStack() as opened:
        handles: dict[str, Any] = {}
        for name, parameter in model.named_parameters():
            if name not in files:
                return None
            if files[name] not in handles:
                path = os.fspath(folder / files[name])
                handles[files[name]] = opened.enter_context(safetensors.safe_open(path, framework="pt"))
            saved = handles[files[name]].get_slice(name)
            shape = tuple(saved.get_shape())
            if shape != tuple(parameter.shape):
                return None
            entries = []
            for position in _sample_positions(parameter.numel(), per_parameter):
                index_of = [int(i) for i in torch.unravel_index(torch.tensor(position), shape)] if shape else []
                entries.append(saved[tuple(slice(i, i + 1) for i in index_of)].reshape(-1)[0].to(torch.float64))
            samples.append(torch.stack(entries))
    return torch.cat(samples)
