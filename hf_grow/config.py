"""`GrowthConfig`: how a model grows, in one place, for `grow_model`, `grow_in_training`, `GrowthCallback` and
the command line.

Like peft's ``LoraConfig`` or transformers' ``TrainingArguments``: a dataclass with each option's default and
help text, validated once when it is made (before any data is read), saved with the grown model's report and
card, and read back from JSON. The runtime objects of a growth (the model, the data, ``loss_fn``, precomputed
statistics, an accelerator) are arguments of the functions, not options.

Some options in more detail:

- ``budget``: instead of ``p``, a total of dimensions added per head, summed over layers, allocated from the
  statistics before the line search: greedily, ``multiple_of`` dimensions at a time, to the layer whose
  next dimensions have the largest expected gain summed over its heads (in the metric of C, whatever the
  ``truncation``). The gains are first-order in the step (`hf_grow.linalg.growth_gain_rates`) per unit of
  the searched step size, each head at its own lam (``step_mode``). ``growth_report.budget`` records it.
- ``step_size``: relative units, ``step_size = lam / lam_unit`` (see `hf_grow.growth`): at 1 the update is as
  large as Z in the truncation's norm. ``0.0`` gives a grown model that computes the old function (to float32 rounding).
- ``search``: ``"exact"`` searches the rank-constrained update; ``"fast"`` first brackets the step with the
  full-rank update Z - lam P (no SVD per step, also reported as an upper reference), then refines the
  rank-constrained step from there.
- ``solver``: how each head's direction is decomposed, once, for the compact solve (`hf_grow.compact`):
  ``"subspace"`` (top singular directions by subspace iteration), ``"eigh"`` (eigendecomposition of A A^T),
  ``"svd"`` (full SVD, several times slower), ``"auto"`` (eigh for "refactor" growth, measured never
  slower than subspace iteration for its rank of about twice the grown width; for "append" growth,
  subspace where the added dims plus 16 are at most a sixth of the hidden size); see
  `hf_grow.linalg.decompose`. The line search's small cores use eigh (svd with ``"svd"``).
- ``statistics_method``, ``compute_dtype``, ``accumulate_dtype``, ``query_block``, ``memory_budget``,
  ``offload_dir``, ``max_batches``: how the statistics are collected; see `hf_grow.collect_statistics`. The
  folder of ``offload_dir`` is checked where the statistics are collected (a config may be read on another
  machine).
- ``keep_attention_scale``: the attention scale of a grown layer follows its new width (``1/sqrt(d_k + p)``), the
  change folded into the old queries, or with this option stays at the old width's, recorded in the grown config's
  ``attention_scale_dims``. Refactored growth gives the same function in other weights; appended growth and the
  baselines keep the old queries (and their optimizer moments) as they were. What it does to training after
  growth depends on the task (BENCHMARKS.md, issue #35).
- ``rotate_factors``: "refactor" growth writes Z's truncation as its singular directions, one product per column;
  with this option the factors are written times the orthonormal DCT-II matrix (the same scores, each product
  spread over every column), which bfloat16 rounds as it rounds trained factors and which trained ahead of the
  singular-direction form in most runs measured (BENCHMARKS.md, "The step's weight where the inputs hardly
  vary"). "append" growth keeps the old weights and refuses it.
- ``cross_fit``: M from a few batches is mostly noise, and the step solved from it fits those batches (issue
  #35). With it, the statistics also sum M over the odd-numbered batches, and the solve keeps each half's
  top directions at the value the other half gives them (`GrowthStatistics.cross_fitted_gradient`).
  Precomputed statistics must be collected with ``cross_fit=True``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, TypeVar

import numpy
import torch

from . import linalg
from .budget import check_budget_chunks
from .files import write_text_atomically
from .option_values import check_statistics_options


#: Measured on trained GPT-2s (BENCHMARKS.md): truncating in the metric of C beats the Frobenius norm of Z on
#: most models; the default (Frobenius truncation's candidates cost held-out passes: at GPT-2 small 24.0 against
#: 14.0, BENCHMARKS.md), and the simplest candidate of ``truncation="auto"``.
SIMPLEST_TRUNCATION = "whitened"
SEARCHES = ("exact", "fast")
#: How one searched step size becomes each layer's lam. "global": one lam for all layers, lam = t * lam_unit
#: with lam_unit = sqrt(sum ||Z||^2 / sum ||P||^2) over every head (whitened norms). "per_layer": the original
#: notes' lam_l = t * ||Z_l|| / ||P_l|| for each layer (norms in the truncation's own metric: whitened, or
#: plain Frobenius), so that layers whose gradient is small against their weights are not under-stepped.
#: "per_head": the notes' ratio per head, lam_lh = t * ||Z_lh|| / ||P_lh|| (per group of heads sharing a key
#: under grouped-query attention), at no extra cost. "layer_search": each layer's step line-searched alone
#: on the held-out batches (the others at step 0), then one multiplier t of all of them. "coordinate": the
#: "per_layer" step, then each layer's step refined in turn (first to last, the others fixed). The searches per
#: layer run only when the step is searched (not with a given ``step_size``, where they take the "per_layer"
#: lam); see `hf_grow.growth.layer_steps`.
STEP_MODES = ("global", "per_layer", "per_head", "layer_search", "coordinate")
#: Measured on four trained models, three held-out/test splits each (BENCHMARKS.md, bench_step_modes.py), all
#: with whitened truncation: "per_head" never gave less test decrease than the notes' formula or "per_layer"
#: there (1.22x "per_layer" on the GPT-2s, best of all modes on MiniLM), at the same cost; on a later BPE GPT-2
#: "per_layer" gave 1.02-1.14x "per_head" on 2-3 of 3 splits, hence the default "auto". The searches per layer gave
#: 1.6x "per_layer" on the GPT-2s for about 4x the held-out passes but overfit MiniLM's 8 line-search batches
#: (below the notes' formula on 1 and 2 of its 3 splits); one global lam fell to 0.80x the notes on one split.
SIMPLEST_STEP_MODE = "per_head"
#: What ``"auto"`` lets the held-out loss choose from, per option, simplest first: the candidates are the
#: product over the options set to "auto", each line-searched; the simplest (the first of each) is kept when
#: the held-out batches the search did not use disagree with the search (`hf_grow.growth.candidates`).
#: Measured (bench_candidates.py, 18 splits of six trained models): both options "auto" never below the notes'
#: formula, 1.03x the simplest candidate's test decrease in the mean, 0.94-1.25x per split (0.94x where it kept
#: Frobenius per head on a Llama split), where no single candidate wins on every model.
AUTO_CHOICES = {"truncation": (SIMPLEST_TRUNCATION, "frobenius"), "step_mode": (SIMPLEST_STEP_MODE, "per_layer")}
#: The defaults of `GrowthConfig`: whitened truncation, steps per head or per layer as the held-out loss chooses
#: (one solve serves both step modes: no memory beyond the simplest's; BENCHMARKS.md).
DEFAULT_TRUNCATION = SIMPLEST_TRUNCATION
#: Query/key dimensions added per head where neither ``p`` nor ``budget`` is given.
DEFAULT_P = 8
DEFAULT_STEP_MODE = "auto"
#: The options for a model that is trained after it grows (issue #35): a tenth of the searched step, steps per head,
#: the cross-fitted M and each layer's attention scale kept. Growth in a training loop takes them by default; for
#: `grow_model` and the command, whose defaults take the whole searched step (the one-shot decrease that issue #34
#: measures), they are `GrowthConfig.for_training()` and ``--for-training``. Measured (BENCHMARKS.md, 3 seeds each,
#: paired with the original): when pretrained models were grown and then trained on, never behind the original
#: beyond the seed spread in nine of eleven regimes (a BPE GPT-2 and a Llama, seven learning-rate regimes; MiniLM
#: fine-tuned on other files from 320 and from 800 pairs), where the whole step fell behind wherever training
#: overfits (+0.0175 nats after 100 steps on the GPT-2, +0.018 on MiniLM from 320 pairs); behind on a byte GPT-2
#: at lr 3e-4 (+0.0050) and on MiniLM fine-tuned on its statistics' own 320 pairs (+0.020; the whole step
#: +0.077); in pretraining with
#: `GrowthCallback` (with growth in a training loop's mode "append" and rtol 1e-5), ahead of the original in the
#: mean in four CPU settings (2 layers × 128 in three regimes, 4 × 256 over 10 seeds) and level with zero widening
#: with the scale kept on the 4 × 256 model.
FOR_TRAINING: dict[str, Any] = {
    "step_scale": 0.1, "step_mode": SIMPLEST_STEP_MODE, "cross_fit": True, "keep_attention_scale": True
}
COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_Config = TypeVar("_Config", bound="JsonConfigMixin")


class JsonConfigMixin:
    """``replace`` with checks, and the round trip through a dict and JSON, for a dataclass of options (as peft's
    ``PeftConfigMixin``). ``from_dict`` reads what ``to_dict`` wrote; `_from_json_values` turns JSON's strings
    back into what the options hold."""

    def replace(self: _Config, **overrides: Any) -> _Config:
        """A copy with ``overrides`` applied and checked; an unknown option is a TypeError naming the known ones."""
        known = {option.name for option in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown growth option(s) {unknown}; {type(self).__name__} has {sorted(known)}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, path: str | os.PathLike) -> None:
        write_text_atomically(path, self.to_json_string())

    @classmethod
    def from_dict(cls: type[_Config], values: Mapping[str, Any]) -> _Config:
        """The config of `to_dict`, or of its JSON."""
        return cls().replace(**cls._from_json_values(dict(values)))

    @classmethod
    def from_json_file(cls: type[_Config], path: str | os.PathLike) -> _Config:
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    @classmethod
    def _from_json_values(cls, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` as read from JSON, made options again (here as they are)."""
        return values


@dataclass
class GrowthConfig(JsonConfigMixin):
    """How a model grows. By default the held-out loss chooses steps per head or per layer (``step_mode="auto"``)
    for whitened truncation; ``truncation="auto"`` adds Frobenius truncation's candidates (more held-out passes,
    the same solve).

    ``GrowthConfig(p=16, truncation="frobenius")``; ``config.replace(step_size=0.0)`` for a checked variant;
    ``config.to_json_file(path)`` / ``GrowthConfig.from_json_file(path)`` to keep it. Each field's help text
    (also the command line's) says what it does; the module's docstring says more of some.
    """

    #: The section of `hf-grow --help` that lists these options (`transformers.HfArgumentParser`).
    _argument_group_name: ClassVar[str] = "growth (hf_grow.GrowthConfig)"

    p: Optional[int] = field(
        default=None,
        metadata={"help": "query/key dimensions to add per head (default 8); in Python also a mapping {layer: p} "
                  "(missing layers get 0: they keep their width but still take the step); not with budget"},
    )
    budget: Optional[int] = field(
        default=None,
        metadata={"help": "instead of p: added dims per head summed over layers, allocated to the layers by "
                  "expected gain"},
    )
    multiple_of: int = field(
        default=1,
        metadata={"help": "with budget: allocate in chunks of this many dims (8 suits fused kernels)"},
    )
    step_size: Optional[float] = field(
        default=None,
        metadata={"help": "skip the line search and take this (relative) step; 0 keeps the old function (to float32 "
                  "rounding)"},
    )
    step_scale: float = field(
        default=1.0,
        metadata={"help": "take this fraction (0 < f <= 1) of the line-searched step: a step shrunk toward the old "
                  "function, for training after growth that overfits (a short fine-tune at a high learning rate; "
                  "BENCHMARKS.md)"},
    )
    keep_attention_scale: bool = field(
        default=False,
        metadata={"help": "keep each grown layer's attention scale at its old width's (recorded in the grown config's "
                  "attention_scale_dims) instead of the new width's, folded into the queries: in pretraining by "
                  "GrowthCallback better on text, worse on a retrieval plateau (BENCHMARKS.md)"},
    )
    rotate_factors: bool = field(
        default=False,
        metadata={"help": "refactor growth: write the Q/K factors times the orthonormal DCT-II matrix (the same "
                  "scores, each product spread over every column instead of one singular direction per column): "
                  "bfloat16 serving, training after growth (BENCHMARKS.md)"},
    )
    step_mode: Literal["global", "per_layer", "per_head", "layer_search", "coordinate", "auto"] = field(
        default=DEFAULT_STEP_MODE,
        metadata={"help": "global: one step lam for all layers; per_layer: each layer steps by t * ||Z_l|| / ||P_l|| "
                  "with one t searched (the original notes' step); per_head: the same ratio per head; layer_search: "
                  "each layer's step searched alone, then one multiplier; coordinate: per_layer, then each layer's "
                  "step refined with the others fixed; auto (default): per_head or per_layer, chosen by held-out loss"},
    )
    truncation: Literal["whitened", "frobenius", "auto"] = field(
        default=DEFAULT_TRUNCATION,
        metadata={"help": "rank truncation in the metric of C (whitened, default) or in the plain Frobenius norm of Z; "
                  "auto: either, chosen by held-out loss (the same solve, more held-out passes)"},
    )
    confirm_fraction: float = field(
        default=1 / 3,
        metadata={"help": "with truncation or step_mode auto: the share of the held-out batches kept from the "
                  "search to confirm its choice (the simplest candidate is kept when they disagree)"},
    )
    search: Literal["exact", "fast"] = field(
        default="exact",
        metadata={"help": "exact: search the rank-constrained update; fast: bracket with the full-rank update first"},
    )
    solver: Literal["auto", "eigh", "svd", "subspace"] = field(
        default="auto",
        metadata={"help": "how each head's direction is decomposed, once (auto: eigh for refactor growth; for append "
                  "growth subspace iteration in wide models, eigh otherwise)"},
    )
    initial_step_size: float = field(default=0.03, metadata={"help": "where the log-grid line search starts"})
    rtol: float = field(
        default=1e-6, metadata={"help": "relative eigenvalue tolerance of C for pseudo-inverse and whitening"}
    )
    eval_fraction: float = field(
        default=0.1,
        metadata={"help": "without held-out batches: the share of the batches held out for the line search"},
    )
    max_batches: Optional[int] = field(
        default=None,
        metadata={"help": "use at most this many statistics batches (of each process's own, with several processes); "
                  "without held-out batches, only as many more are read as eval_fraction holds out"},
    )
    measure_realized_gains: bool = field(
        default=True,
        metadata={"help": "evaluate the held-out loss with each layer's step alone (one pass per layer)"},
    )
    statistics_method: Literal["auto", "chunked", "reference", "triton"] = field(
        default="auto",
        metadata={"help": "chunked: sdpa forward, M block by block in backward (bounded memory); triton: the same, "
                  "fused kernels (CUDA, TF32 products); reference: eager attention; auto: reference on CPU up to 256 "
                  "tokens, else chunked"},
    )
    compute_dtype: Literal["float32", "float64"] = field(
        default="float32",
        metadata={"help": "precision of the per-batch statistics products"},
    )
    accumulate_dtype: Literal["float32", "float64"] = field(
        default="float64",
        metadata={"help": "precision of M's sums over batches (float32 halves the largest tensors; C is summed in "
                  "float64 always)"},
    )
    query_block: Optional[int] = field(
        default=None,
        metadata={"help": "queries per block of the chunked statistics (default: sized to the memory of one block)"},
    )
    memory_budget: Optional[str] = field(
        default=None,
        metadata={"help": "bytes for the statistics' accumulators, e.g. 2GB (in Python also an int): M is "
                  "collected for groups of layers in several passes"},
    )
    offload_dir: Optional[str] = field(
        default=None,
        metadata={"help": "a folder where M's accumulators live as memory-mapped files instead of memory (CPU only; "
                  "needs disk for M of a pass's layers), for M that does not fit even one layer at a time"},
    )

    cross_fit: bool = field(
        default=False,
        metadata={"help": "solve from M kept to what two halves of the statistics batches agree on (odd and even "
                  "batches, summed in the same pass; twice M's memory): a step less fitted to the statistics' own "
                  "batches"},
    )

    def __post_init__(self) -> None:
        names = {dtype: name for name, dtype in COMPUTE_DTYPES.items()}
        for option in ("compute_dtype", "accumulate_dtype"):
            dtype = getattr(self, option)
            if isinstance(dtype, torch.dtype):
                if dtype not in names:
                    raise ValueError(f"{option} must be float32 or float64, got {dtype}")
                setattr(self, option, names[dtype])
        if isinstance(self.p, Mapping):
            self.p = dict(self.p)  # a plain dict: to_dict copies it
        if isinstance(self.offload_dir, os.PathLike):
            self.offload_dir = os.fspath(self.offload_dir)  # a string: to_json_file writes it
        for option in ("step_size", "step_scale", "initial_step_size"):
            value = getattr(self, option)
            if _is_number(value) and not isinstance(value, (int, float)):
                setattr(self, option, float(value))  # a NumPy number: a Python float, which to_json_file writes
        _check_options(self)

    def with_default_p(self) -> GrowthConfig:
        """This config with ``p`` written out (`DEFAULT_P`) where neither it nor ``budget`` was given: what ran."""
        return self if self.p is not None or self.budget is not None else self.replace(p=DEFAULT_P)

    @classmethod
    def for_training(cls, **overrides: Any) -> GrowthConfig:
        """The options for a model that will be trained after it grows (`FOR_TRAINING`), ``overrides`` on top:
        ``GrowthConfig.for_training(p=16)``. Where the step is not searched (a ``step_size`` given, or
        ``step_mode="coordinate"``) there is no searched step to take a fraction of, and the step is the given one."""
        return cls().replace(**{**training_options(overrides), **overrides})

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.compute_dtype]

    @property
    def torch_accumulate_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.accumulate_dtype]

    @property
    def candidates(self) -> list[tuple[str, str]]:
        """The (truncation, step_mode) pairs the held-out loss chooses from, the simplest first (`AUTO_CHOICES`);
        one pair where neither option is "auto"."""
        step_modes = AUTO_CHOICES["step_mode"] if self.step_mode == "auto" else (self.step_mode,)
        return [(truncation, step_mode) for truncation in self.candidate_truncations for step_mode in step_modes]

    @property
    def candidate_truncations(self) -> tuple[str, ...]:
        """The truncations among `candidates`, the simplest first."""
        return AUTO_CHOICES["truncation"] if self.truncation == "auto" else (self.truncation,)

    @classmethod
    def _from_json_values(cls, values: dict[str, Any]) -> dict[str, Any]:
        """JSON's layer keys of ``p`` are strings: they become ints."""
        if isinstance(values.get("p"), Mapping):
            values["p"] = {_layer(key): value for key, value in values["p"].items()}
        return values


def _check_options(config: GrowthConfig) -> None:
    """Today's errors for options no model or data is needed to refuse, raised before any work."""
    if config.budget is not None:
        if config.p is not None:
            raise ValueError("give either p or budget, not both: a budget decides the dimensions added per layer.")
        check_budget_chunks(config.budget, config.multiple_of)  # what the layers can take needs the model
    elif config.multiple_of != 1:
        raise ValueError("multiple_of applies to a budget allocation: pass budget=N with it, or leave it at 1.")
    if config.p is not None:
        check_p(config.p)  # which layers there are needs the model
    _choose("truncation", config.truncation, (*linalg.TRUNCATIONS, "auto"))
    _choose("solver", config.solver, linalg.SOLVERS)
    _choose("search", config.search, SEARCHES)
    _choose("step_mode", config.step_mode, (*STEP_MODES, "auto"))
    if not 0 < config.confirm_fraction < 1:
        raise ValueError(f"confirm_fraction must be in (0, 1), got {config.confirm_fraction}")
    if config.step_size is not None and (not _is_number(config.step_size) or not math.isfinite(config.step_size)
                                         or config.step_size < 0):
        raise ValueError(f"step_size must be a finite number >= 0, got {config.step_size!r}")
    if not (_is_number(config.step_scale) and math.isfinite(config.step_scale)
            and 0 < config.step_scale <= 1):
        raise ValueError(f"step_scale must be in (0, 1], a fraction of the searched step; got {config.step_scale!r}")
    if config.step_scale != 1 and config.step_size is not None:
        raise ValueError("step_scale shrinks the line-searched step: with a step_size given, pass the step to take.")
    if config.step_scale != 1 and config.step_mode == "coordinate":
        raise ValueError(
            "step_scale shrinks one searched step, and step_mode='coordinate' refines each layer's own: use "
            "step_mode 'per_layer', 'per_head', 'global', 'layer_search' or 'auto' with it."
        )
    if config.search == "fast" and config.step_mode == "layer_search":  # it ran the exact search, the report "fast"
        raise ValueError(
            "search='fast' brackets one step of all layers with the full-rank update, and step_mode='layer_search' "
            "searches each layer's own step first: use search='exact' (the default) with it."
        )
    if not (_is_number(config.initial_step_size) and math.isfinite(config.initial_step_size)
            and config.initial_step_size > 0):
        raise ValueError(
            f"initial_step_size must be a finite number > 0 (the first step tried), got {config.initial_step_size}"
        )
    linalg.check_rtol(config.rtol)
    if not 0 < config.eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {config.eval_fraction}")
    _choose("compute_dtype", config.compute_dtype, tuple(COMPUTE_DTYPES))
    _choose("accumulate_dtype", config.accumulate_dtype, tuple(COMPUTE_DTYPES))
    check_statistics_options(
        config.statistics_method, config.query_block, config.max_batches, config.memory_budget,
        config.compute_dtype == "float32", method_option="statistics_method", float32="'float32'",
    )
    if config.offload_dir is not None and (not isinstance(config.offload_dir, str) or not config.offload_dir):
        raise ValueError(f"offload_dir must be a folder's path, got {config.offload_dir!r}")
    for option in ("keep_attention_scale", "rotate_factors", "measure_realized_gains", "cross_fit"):
        if not isinstance(getattr(config, option), bool):  # a string such as "no" would read as True
            raise ValueError(f"{option} must be True or False, got {getattr(config, option)!r}")


def _is_number(value: Any) -> bool:
    """A real number (NumPy's too), not a bool (True would read as 1)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, numpy.bool_))


def training_options(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`FOR_TRAINING` without its ``step_scale`` where ``overrides`` leave no searched step to take a fraction of."""
    return {name: value for name, value in FOR_TRAINING.items() if _searched(overrides) or name != "step_scale"}


def _searched(overrides: Mapping[str, Any]) -> bool:
    """Whether ``overrides`` leave a searched step (no ``step_size`` given, steps not searched by coordinates)."""
    return overrides.get("step_size") is None and overrides.get("step_mode") != "coordinate"


def check_p(p: Any) -> None:
    """Refuse a ``p`` that is not a positive int or a mapping to non-negative ints (its layers need the model)."""
    if isinstance(p, bool) or not isinstance(p, (int, Mapping)):
        raise TypeError(f"p must be an int or a mapping {{layer: int}}, got {type(p).__name__}")
    if isinstance(p, int):
        if p <= 0:
            raise ValueError(
                f"p must be a positive number of query/key dimensions to add per head, got {p}. "
                "(To take the same step without adding dimensions, pass p={layer: 0, ...}.)"
            )
        return
    negative = {layer: value for layer, value in p.items()
                if isinstance(value, bool) or not isinstance(value, int) or value < 0}
    if negative:
        raise ValueError(f"p must map layers to non-negative ints, got {negative}")


def _layer(key: Any) -> Any:
    """A layer key of ``p`` read back from JSON: ``"3"`` is layer 3 (anything else is left for the model to refuse)."""
    return int(key) if isinstance(key, str) and key.isdecimal() else key


def _choose(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def resolve_config(config: GrowthConfig | None, overrides: Mapping[str, Any], **defaults: Any) -> GrowthConfig:
    """``config`` (or a default one, with an entry point's own ``defaults``) with keyword ``overrides`` applied.

    A ``step_size`` (or ``step_mode="coordinate"``) given as a keyword takes its step as given: the config's
    ``step_scale`` (`GrowthConfig.for_training`'s, say) has no searched step left to take a fraction of.
    """
    base = GrowthConfig(**defaults) if config is None else config
    if not overrides:
        return base
    if "step_scale" not in overrides and not _searched(overrides):
        overrides = {**overrides, "step_scale": 1.0}
    return base.replace(**overrides)
