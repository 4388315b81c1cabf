"""The memory plan of a growth: the peak host and device memory of each stage, predicted before any data is read.

Every term is a tensor the run holds (the model, the statistics' sums of one group of layers, the compact solve,
the grown model) or the activations of one statistics batch (`activation_probe`). BENCHMARKS.md compares the plan with
measured peaks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from ..adapters import ArchitectureAdapter
from ..compact import compact_rank, rank_ceiling, stored_bytes
from ..config import COMPUTE_DTYPES, DEFAULT_P, GrowthConfig
from ..files import SHARD_BYTES
from ..progress import format_bytes
from ..statistics import layer_groups, m_copies, statistics_bytes
from .activation_probe import activation_bytes, statistics_attention
from .layer_solve import head_chunk
from .layer_steps import CACHE_BYTES
from .line_search import can_confirm_a_choice
from .sharding import plan_owners, solve_cost


#: Resident memory of a process that has imported torch, transformers and hf_grow (measured on Linux, 2026).
PROCESS_BASELINE_BYTES = 480 * 2**20
#: The same once the model has moved to a GPU: the CUDA libraries' pages. Measured 1.45-1.87 GiB from the
#: statistics on, on an H100 with torch 2.11 (cu130), at GPT-2 small, the Llama-3.2-1B and Llama-3-8B shapes.
CUDA_PROCESS_BASELINE_BYTES = int(1.6 * 2**30)
#: The statistics pass holds this many times the bytes autograd saves: the transients of forward and backward
#: (the loss's log-softmax and its gradient, a block's attention scores) add about half again. Measured
#: 1.34-1.59x on GPT-2 small and a Llama shape, reference and chunked statistics (BENCHMARKS.md).
ACTIVATION_OVERHEAD = 1.5
#: The held-out passes' no-grad forwards leave about this share of a statistics batch's saved activations resident
#: (the allocator's heap keeps tensors under its mmap threshold), measured on GPT-2 small. They build no key/value
#: cache (`without_kv_cache`): without it GPT-2 small's line search peaked at 4.04 GiB against 4.16 with it
#: (planned 4.23).
HELD_OUT_FORWARD = 0.3
#: (heads, d, d) float64 tensors alive at once while a chunk of heads is solved: M, the direction, its whitened
#: form, and the decomposition's input, vectors and workspace.
SOLVE_SQUARES_PER_HEAD = 6
#: The same with ``cross_fit``, while a chunk's cross-fitted M is formed (`linalg.cross_fitted_gradient`): the
#: halves' means and their whitened forms, a decomposition's input and vectors for each half, the confirmed parts
#: (counted from its code, not measured).
CROSS_FIT_SQUARES_PER_HEAD = 9
#: More (heads, d, d) float64 tensors alive at once where the solve also computes each head's gain per added dim
#: (`layer_solve._rates`: the whitened Z and P, the scores' decomposition, their projections), measured by a review
#: as 4.8 squares per head beside the solve's ("refactor", d = 513) and 4.2 ("append").
RATES_SQUARES_PER_HEAD = 5
#: The ``offload_dir`` a refusal names where only M on disk fits (the user picks the folder).
OFFLOAD_PLACEHOLDER = "DIR"


@dataclass(frozen=True)
class Stage:
    """A stage's predicted peak: host and device bytes, the terms they are made of (host or device), and what the
    table says of a stage without terms."""

    name: str
    host: int
    device: int
    terms: dict[str, int] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """The stages of a growth with their predicted peaks, and the layer groups of the statistics passes."""

    stages: tuple[Stage, ...]
    groups: list[list[int]]
    on_device: bool
    #: The shape it was planned for: layers, heads, hidden size + 1, sequences per statistics batch.
    num_layers: int
    num_heads: int
    width: int
    batch_size: int
    #: With ``offload_dir`` (on a CPU): the folder M's accumulators are mapped from, and the most bytes of M it holds
    #: at once (not counted in any stage's host memory: the operating system pages them out as memory runs short).
    offload_dir: str | None = None
    disk: int = 0
    #: Planned with ``cross_fit``: M's accumulators are held twice (M and its sum over half the batches).
    cross_fit: bool = False
    #: The processes that share the layers (`sharding`): each stage is one process's.
    processes: int = 1
    #: The same stages with every head's compact solve at its least rank instead of its ceiling: the rank is
    #: certified from the spectra during the solve, so ``stages`` count the most it may keep and these the least.
    least_stages: tuple[Stage, ...] = ()

    @property
    def peak_host(self) -> int:
        return max(stage.host for stage in self.stages)

    @property
    def peak_device(self) -> int:
        return max(stage.device for stage in self.stages)

    @property
    def least_peak_host(self) -> int:
        """The host peak with every compact solve at its least rank (a lower bound)."""
        return max(stage.host for stage in self.least_stages or self.stages)

    @property
    def least_peak_device(self) -> int:
        return max(stage.device for stage in self.least_stages or self.stages)

    def budget_for(self, layers_per_pass: int, m_itemsize: int) -> str:
        """The smallest ``memory_budget`` that collects M for ``layers_per_pass`` layers per pass
        (`statistics.layer_groups`): in GB rounded up to 10 MB, or in bytes below 1 GB."""
        layers_of_m = m_copies(self.cross_fit) * layers_per_pass + 1
        size = statistics_bytes(self.num_layers, self.num_heads, self.width - 1, layers_of_m, m_itemsize)
        return f"{math.ceil(size / 10**7) / 100:g}GB" if size >= 10**9 else str(size)

    def table(self) -> str:
        """The plan as a table: a row per stage, its peak(s) and its two largest terms."""
        device = f"{'device':>10}" if self.on_device else ""
        rows = [f"{'stage':<14}{'host':>10}{device}  largest terms"]
        for stage in self.stages:
            largest = sorted(stage.terms.items(), key=lambda item: -item[1])[:3]
            terms = ", ".join(f"{name} {format_bytes(size)}" for name, size in largest) or stage.note
            device = f"{format_bytes(stage.device):>10}" if self.on_device else ""
            rows.append(f"{stage.name:<14}{format_bytes(stage.host):>10}{device}  {terms}")
        passes = len(self.groups)
        rows.append(f"peak {format_bytes(self.peak_host)} host" + (
            f", {format_bytes(self.peak_device)} device" if self.on_device else "") + (
            f"; statistics in {passes} pass{'es' if passes > 1 else ''} over the data" if passes else
            "; statistics given: no pass over the data"))
        if self.processes > 1:
            rows.append(f"per process of {self.processes}: M of the group in flight (each layer's reduced to its "
                        "owner); each solves and keeps its own layers")
        least = self.least_peak_device if self.on_device else self.least_peak_host
        if least < (self.peak_device if self.on_device else self.peak_host):
            rows.append(f"compact solves counted at their rank ceiling (flat spectra, such as random weights'); at "
                        f"their least rank the peak is {format_bytes(least)}")
        if self.cross_fit:
            rows.append("M counted twice: cross_fit sums it over all batches and over the odd-numbered ones")
        if self.offload_dir is not None:
            disk = format_bytes(self.disk)
            rows.append(f"M on disk: {disk} in {self.offload_dir} (memory-mapped, not in the host peak)")
        return "\n".join(rows)


def plan_memory(
    model: PreTrainedModel,
    adapter: ArchitectureAdapter,
    config: GrowthConfig,
    *,
    batch_size: int,
    seq_len: int,
    eval_tokens: int,
    device: torch.device | str = "cpu",
    activations: int | None = None,
    processes: int = 1,
    weights_dtype: torch.dtype | None = None,
    given_statistics: int | None = None,
    inspection: bool = False,
    keep_statistics: bool = False,
) -> MemoryPlan:
    """Predict the peak memory of each stage of growing ``model`` (real or on the meta device) with ``config``
    on statistics batches of ``batch_size`` x ``seq_len`` tokens and ``eval_tokens`` held-out tokens.

    ``activations``: the bytes of one batch's forward and backward, by default `activation_bytes` of a
    language-model loss on the batch (labels = inputs). On a GPU (``device``) the model, the sums and the solve
    live on the device and the host holds the process and the data. With ``config.offload_dir`` on a CPU, M lives
    on disk (`MemoryPlan.disk`) instead of in the statistics' and the solve's host memory. ``processes``: plan one
    of that many processes sharing the layers (`sharding`), each summing the group in flight and keeping the
    solved form of its own layers.

    ``weights_dtype``: the dtype of the weights file (the saved config's ``dtype``); loading into another dtype
    converts (`_loading`). None: the model's own dtype.

    ``given_statistics``: the bytes of statistics given (``grow_model(statistics=...)``, ``hf-grow --stats``): no
    statistics pass (nor its options: ``memory_budget``, ``offload_dir``), and they are held through the solve and
    the line search.

    ``inspection``: the plan of `inspect_growth` instead (``hf-grow inspect``): the statistics pass and the gains,
    solved at the current widths, no line search and no grown model. ``keep_statistics``: every layer's M is held
    to the end and saved (``--save-stats``), not freed group by group as each is solved.
    """
    on_device = torch.device(device).type != "cpu"
    # The blocks' outputs on the held-out batches are recorded for what replays them (`search.step_zero`): the
    # realized gains, and a step searched layer by layer.
    recorded = config.measure_realized_gains or (config.step_size is None and any(
        step_mode in ("layer_search", "coordinate") for _, step_mode in config.candidates))
    # Where the held-out batches (each process's share) leave nothing to confirm a choice on, or the step is
    # given, the simplest candidate is taken and solved for alone (`prepare_growth`).
    held_out_batches = math.ceil(eval_tokens / (seq_len * batch_size)) // processes
    if len(config.candidates) > 1 and not can_confirm_a_choice(held_out_batches, config.step_size is None):
        config = config.replace(truncation=config.candidates[0][0], step_mode=config.candidates[0][1])
    model_config = model.config
    layers, heads = len(adapter.attention_modules(model)), adapter.num_heads(model_config)
    width = adapter.hidden_size(model_config) + 1
    qk_dims = adapter.qk_head_dims(model_config)
    accumulate = config.torch_accumulate_dtype.itemsize
    compute = config.torch_compute_dtype.itemsize
    if inspection:  # gains in the metric of C: the whitened solve alone
        config = config.replace(truncation="whitened")
    if given_statistics is not None:  # collected already: no pass, the statistics options do nothing
        config = config.replace(memory_budget=None, offload_dir=None)
    groups = layer_groups(layers, heads, width - 1, config.memory_budget, accumulate, config.cross_fit)
    mode = adapter.check_mode(model, None)
    square = heads * width * width  # entries of one layer's M
    layer_bytes = m_copies(config.cross_fit) * square * accumulate  # one layer's accumulators (and its half)
    weights = _model_bytes(model)
    second_moments = layers * width * width * 8

    tokens = batch_size * seq_len
    reference = statistics_attention(seq_len, device) == "eager"
    if activations is None:
        activations = activation_bytes(model, batch_size, seq_len, statistics_attention(seq_len, device))
    scores = batch_size * heads * seq_len * (seq_len + width) * 4 if reference else 2 * 2**21 * 4
    offload = config.offload_dir is not None and not on_device  # on a GPU the run refuses it (`check_offload_dir`)
    layer_m = 0 if offload else layer_bytes
    chunk = head_chunk(heads, adapter.read_qk(adapter.attention_modules(model)[0])[1].shape[0])
    squares_per_head = CROSS_FIT_SQUARES_PER_HEAD if config.cross_fit else SOLVE_SQUARES_PER_HEAD
    if config.budget is not None or inspection:  # the gains per added dim: a budget's allocation, an inspection
        squares_per_head += RATES_SQUARES_PER_HEAD
    # no logits without a language-model head (the transformers model inside a SentenceTransformer)
    vocabulary = 0 if model.get_output_embeddings() is None else getattr(model_config, "vocab_size", 0) or 0

    def stages_after_loading(solved: int) -> tuple[Stage, ...]:
        """The stages from the statistics on, with ``solved`` bytes of compact solve (of this process's layers:
        their share of each layer where the processes share them)."""
        held = _held_m_and_solved(groups, layer_m, solved // layers)
        (pass_m, earlier_solved), (solve_m, solve_solved) = held
        earlier_m = {}
        if keep_statistics:  # every layer's M to the end, solved once all are collected
            pass_m, earlier_solved, solve_m, solve_solved = layers * layer_m, 0, layers * layer_m, solved
            if on_device:  # the passes before the last move their layers' M to the host
                pass_m = max(len(group) for group in groups) * layer_m
                earlier_m = {"M of earlier passes": (layers - len(groups[-1])) * layer_m}
                solve_m = len(groups[-1]) * layer_m
        statistics = {
            "model": weights, "activations": int(ACTIVATION_OVERHEAD * activations), "C": second_moments,
            **_named({"M": pass_m, "compact solve of earlier passes": earlier_solved}),
            "M of a batch": square * (compute + accumulate),
            "inputs X'": layers * tokens * width * compute, "score gradients": scores,
        }
        given = {"statistics given": given_statistics} if given_statistics is not None else {}
        solve = {
            "model": weights, "C": second_moments, "metric": layers * width * width * 8,
            **(given or _named({"M": solve_m})),
            f"solve of {chunk} heads": squares_per_head * chunk * width * width * 8,
            "compact solve": solve_solved if not given else solved,
        }
        held_out = {
            "model": weights, "grown model": weights, "C": second_moments, "metric": layers * width * width * 8,
            **given, "compact solve": solved, "Q/K weights at the new width": grown_qk,
            "held-out logits": 2 * batch_size * seq_len * vocabulary * 4,
            "held-out forward": int(HELD_OUT_FORWARD * activations),
            "held-out states": min(CACHE_BYTES, eval_tokens * width * 4 * max(layers - 1, 0)) if recorded else 0,
        }
        # The command frees the input model first; on a CPU safetensors writes the tensors' own memory (a GPT-2
        # small's save added 2 MiB to the process, safetensors 0.8), so saving adds no copy; from a GPU it copies
        # the shard being written to the host.
        write = {"grown model": grown_weights}
        shard = {"shard copied to the host": min(weights, SHARD_BYTES)} if on_device else {}
        if inspection:
            kept = (("write", {"model": weights, "C": second_moments, **_named({"M": solve_m})}),
                    ) * keep_statistics
            # saving copies a device's statistics to the host (`GrowthStatistics.save`)
            copied = {"statistics copied to the host": solve_m + second_moments} if on_device else {}
            return (_stage("statistics", statistics, on_device, earlier_m),
                    *[_stage(name, terms, on_device, {**earlier_m, **copied}) for name, terms in kept],
                    _stage("gains", solve, on_device, earlier_m))
        stages = (("statistics", statistics), ("solve", solve), ("line search", held_out))[1 if given else 0:]
        return tuple(_stage(name, terms, on_device) for name, terms in stages) + (
            _stage("write", write, on_device, shard),)

    model_dtype = next(model.parameters()).dtype
    loading = _loading(weights, model_dtype, weights_dtype or model_dtype, on_device)
    # a process keeps the solved form of its own layers (each layer's M goes to its owner and is freed when solved)
    owners = plan_owners([solve_cost(heads, width)] * layers, processes)
    owned = max(owners.count(rank) for rank in range(processes))
    # beside it, each layer's old Q/K weights in float64 (`LayerProblem.query`/``key``: 5.4 GB at Llama-3-8B),
    # counted at the widest layer's, as the solved form is (a model grown before may differ layer by layer)
    old_qk = 8 * max(sum(weight.numel() for weight in adapter.read_qk(attention))
                     for attention in adapter.attention_modules(model))
    added = 0 if inspection else None  # an inspection solves at the current widths
    solved = {
        at_ceiling: _solved_bytes(mode, config, owned, heads, width, max(qk_dims), at_ceiling, added) + owned * old_qk
        for at_ceiling in (True, False)
    }
    # the line search holds every layer's Q/K weights at the new width in float64 (those of step 0, of the best step
    # and its factors: a GPT-2 small shape's run held the three, 0.32 GiB the plan missed)
    widest = max(qk_dims)  # a budget's dims are spread over the layers, p's added to each
    grown_dims = (min(layers * width, layers * widest + config.budget) if config.budget is not None
                  else layers * min(width, widest + _largest_p(config.p)))
    grown_qk = 3 * old_qk * grown_dims // widest
    # what is written: the weights and the added Q/K entries in the model's dtype (an output disk's check reads it)
    added_entries = old_qk // 8 * max(grown_dims - layers * widest, 0) // widest
    grown_weights = weights + added_entries * next(model.parameters()).element_size()
    # M on disk: the largest group's accumulators, one group at a time (each layer's, where all are kept)
    disk = (layers if keep_statistics else max(len(group) for group in groups)) * layer_bytes if offload else 0
    return MemoryPlan(
        (loading, *stages_after_loading(solved[True])), [] if given_statistics is not None else groups, on_device,
        layers, heads, width, batch_size,
        config.offload_dir if offload else None, disk, config.cross_fit, processes,
        least_stages=(loading, *stages_after_loading(solved[False])),
    )


def _held_m_and_solved(
    groups: list[list[int]], layer_m: int, layer_solved: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The bytes of M and of the compact solve held together at the peak of the statistics passes, and at that of
    the solves: (M, solve) for each.

    A pass holds its group's M beside the earlier groups' compact solve. A group's solve turns M into compact
    targets layer by layer and frees each layer's M after it (`GrowthProblem.solve_layers`): beside the earlier
    groups' targets it holds at most the whole group's M and one layer's targets (at its first layer), or one
    layer's M and the whole group's targets (at its last), whichever is more; not both whole. ``layer_m``: one
    layer's M (with its half under cross-fitting), 0 where M is on disk.
    """
    statistics, solve = (0, 0), (0, 0)
    before = 0  # layers solved in earlier groups
    for group in groups:
        held = len(group)  # layers whose M is held during this pass
        statistics = max(statistics, (held * layer_m, before * layer_solved), key=sum)
        points = [(held * layer_m, (before + 1) * layer_solved), (layer_m, (before + len(group)) * layer_solved)]
        solve = max(solve, *points, key=sum)
        before += len(group)
    return statistics, solve


def _named(terms: dict[str, int]) -> dict[str, int]:
    """The terms that hold anything (M on disk is no host term)."""
    return {name: size for name, size in terms.items() if size}


def _solved_bytes(
    mode: str, config: GrowthConfig, layers: int, heads: int, width: int, qk_dim: int, at_ceiling: bool,
    added: int | None = None,
) -> int:
    """What the solve keeps for the steps (`layer_solve.LayerProblem`) beside the old weights: per head, the compact
    target (`compact.stored_bytes`, one for both truncations: "refactor"), or the unit update of the added dims of
    each truncation ("append").

    The compact rank is certified from each head's spectrum during the solve (`compact.certified_rank`), between
    `compact.compact_rank` and `compact.rank_ceiling`: ``at_ceiling`` counts the ceiling (flat spectra, such as
    random weights', reach it), else the least rank. ``added``: the dims added (default: the config's)."""
    if added is None:
        added = config.budget if config.budget is not None else _largest_p(config.p)
    grown = min(width, qk_dim + added)
    # The whitened update always (the step norms, the spectrum); the Frobenius one too where a candidate truncates so.
    plain = config.candidate_truncations != ("whitened",)
    if mode == "append":
        return (1 + plain) * layers * heads * 2 * width * max(1, grown - qk_dim) * 8
    rank = compact_rank(width, grown)
    if at_ceiling and qk_dim + rank < width:  # compact: the certified rank may keep up to its ceiling
        rank = max(rank, rank_ceiling(width, grown, qk_dim))
    kept = min(width, qk_dim + rank)
    return layers * stored_bytes(heads, width, kept, plain)


def _largest_p(p: int | dict[int, int] | None) -> int:
    """The most dims any layer gains (`DEFAULT_P` when not given)."""
    if p is None:
        return DEFAULT_P
    return p if isinstance(p, int) else max(p.values(), default=0)


def _stage(name: str, terms: dict[str, int], on_device: bool, host_terms: dict[str, int] | None = None) -> Stage:
    """Host = the process + its terms on a CPU; on a GPU the terms are on the device and the host keeps the
    process, with the CUDA libraries, and ``host_terms``."""
    total = sum(terms.values())
    if not on_device:
        return Stage(name, PROCESS_BASELINE_BYTES + total, 0, terms)
    host_terms = host_terms or {}
    return Stage(name, CUDA_PROCESS_BASELINE_BYTES + sum(host_terms.values()), total, {**terms, **host_terms})


def _loading(weights: int, model_dtype: torch.dtype, weights_dtype: torch.dtype, on_device: bool) -> Stage:
    """The load stage. transformers maps a safetensors file and, where the model keeps the file's dtype, uses the
    mapped tensors as its weights (copy-on-write): loading makes nothing resident, the statistics pass reads the
    pages in (the later stages count the model). Loading into another dtype reads the whole file and fills a
    converted copy: the file's pages and the model at once (GPT-2 medium float32 <-> bfloat16, measured). On a
    GPU the model is loaded on the host, then moved, which reads every page of the file and loads the CUDA
    libraries: the stage peaks at the larger of the two (GPT-2 small on an H100: 1.61 GiB, its file 0.7)."""
    terms = {}
    if weights_dtype != model_dtype:
        terms["model, converted"] = weights
    if weights_dtype != model_dtype or on_device:
        terms["weights file"] = weights * weights_dtype.itemsize // model_dtype.itemsize
    host = PROCESS_BASELINE_BYTES + sum(terms.values())
    if on_device:
        host = max(host, CUDA_PROCESS_BASELINE_BYTES)
    note = "" if terms else "weights mapped from their file, read in by the statistics pass"
    return Stage("load", host, weights if on_device else 0, terms, note)


def _model_bytes(model: nn.Module) -> int:
    """Parameters and buffers, each storage once (tied embeddings count once)."""
    seen: dict[tuple, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        key = (tensor.device.type, tensor.data_ptr()) if tensor.device.type != "meta" else ("meta", id(tensor))
        seen[key] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def fitting_changes(
    plan_with: Callable[[dict], MemoryPlan], config: GrowthConfig, fits: Callable[[MemoryPlan], bool],
    model_dtypes: Sequence[str | None] = (None, "bfloat16"),
) -> dict | None:
    """The cheapest change of options under which the plan fits, as {option: value}; None when none does.

    ``plan_with(changes)`` plans with some `GrowthConfig` fields, ``batch_size`` or the model's ``dtype``
    changed. Passes over the data cost the most, so the fewest passes win (``memory_budget``, the largest that
    gives them); then the fewest other changes: smaller batches (the same tokens), M summed in float32. Where no
    number of passes fits M in memory (on a CPU), M on disk: ``offload_dir`` `OFFLOAD_PLACEHOLDER` in one pass.
    Then the same without the realized gains (``measure_realized_gains`` False: the held-out states they replay
    are not recorded). The model's ``dtype`` changes only where nothing else fits, to each of ``model_dtypes``
    in turn (None: unchanged).
    """
    base = plan_with({})
    unchanged = {"batch_size": base.batch_size, "accumulate_dtype": config.accumulate_dtype}
    variants = [  # the fewest changes first
        {name: value for name, value in zip(unchanged, choice) if value != unchanged[name]}
        for choice in itertools.product(
            [base.batch_size >> halvings for halvings in range(base.batch_size.bit_length())],
            [config.accumulate_dtype] + (["float32"] if config.accumulate_dtype == "float64" else []),
        )
    ]
    offloads = [{}] if config.offload_dir is not None or base.on_device else [{}, {"offload_dir": OFFLOAD_PLACEHOLDER}]
    reports = [{}] + ([{"measure_realized_gains": False}] if config.measure_realized_gains else [])
    for model_dtype in model_dtypes:  # the model's own precision changes only as a last resort
        for report, offload in itertools.product(reports, offloads):
            for passes in range(1, 2 if offload else base.num_layers + 1):
                layers_per_pass = math.ceil(base.num_layers / passes)
                if math.ceil(base.num_layers / layers_per_pass) != passes:
                    continue  # no budget gives exactly this many passes
                for variant in variants:
                    itemsize = COMPUTE_DTYPES[variant.get("accumulate_dtype", config.accumulate_dtype)].itemsize
                    budget = {} if passes == 1 else {"memory_budget": base.budget_for(layers_per_pass, itemsize)}
                    dtype = {} if model_dtype is None else {"dtype": model_dtype}
                    changes = {**budget, **offload, **variant, **report, **dtype}
                    if fits(plan_with(changes)):
                        return changes
    return None
