"""`grow_model`: statistics, solve, line search and the grown model, with its report."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor
from transformers import PreTrainedModel

from ..config import GrowthConfig, resolve_config
from ..distributed import Processes, refuse_sharded_training, unwrap_model
from ..card import set_sentence_card
from ..sentence import as_loss_fn, is_sentence_transformer, transformer_module, with_grown_model
from ..statistics import GrowthStatistics, LossFn, return_free_memory
from .prepare import merged_if_peft, prepare_growth
from .candidates import search_and_report


if TYPE_CHECKING:
    from accelerate import Accelerator


def grow_model(
    model: PreTrainedModel,
    dataloader: Iterable[Mapping[str, Tensor]] | None,
    p: int | Mapping[int, int] | None = None,
    *,
    config: GrowthConfig | None = None,
    eval_dataloader: Iterable[Mapping[str, Tensor]] | None = None,
    loss_fn: LossFn | None = None,
    statistics: GrowthStatistics | None = None,
    accelerator: Accelerator | None = None,
    progress: bool = False,
    **overrides: Any,
) -> PreTrainedModel:
    """Grow the query/key width of every attention head by ``p``, with weights solved from the loss.

    How it grows is a `GrowthConfig` (``config``, default ``GrowthConfig()``); ``p`` and keyword ``overrides``
    (``step_size=0.0``, ``truncation="frobenius"``, ... any `GrowthConfig` field) replace its fields, and are
    checked before any data is read (an unknown keyword is a TypeError naming the fields).

    Args:
        model: a supported transformers model (GPT-2, BERT or Llama-family classes, or a model grown by
            hf_grow), a PeftModel around one (its adapters are merged into a copy first), or a
            sentence-transformers `SentenceTransformer` whose transformers model is one (`hf_grow.sentence`).
            Left unchanged. GPT-2 and BERT grow by "refactor" (all Q/K rewritten), rotary models by "append"
            (content dims added beside the rotary ones).
        dataloader: dict batches passed as ``model(**batch)``; the loss is ``outputs.loss`` (or ``loss_fn``, which
            may take nested batches and run the model several times). For a `SentenceTransformer`: one tokenized
            feature dict per text column, ``{"anchor": ..., "positive": ...}``.
        p: dimensions added per head, in every layer, or a mapping ``{layer: p}`` (`GrowthConfig.p`).
        config: the growth options; see `GrowthConfig` for each.
        eval_dataloader: held-out batches for the line search and the before/after losses. Without it, the
            last ``eval_fraction`` of the dataloader's batches are held out (when a line search runs; with
            several processes, of each process's own batches).
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor`` instead of ``outputs.loss``. For a
            `SentenceTransformer`: a sentence-transformers loss object built on it (default
            ``MultipleNegativesRankingLoss(model)``), or a loss_fn that receives its transformers model.
        statistics: statistics already collected for this model (e.g. by `collect_statistics`), to grow it
            several ways without reading the data again; ``dataloader`` may then be None when
            ``eval_dataloader`` or ``step_size`` is given.
        accelerator: an `accelerate.Accelerator` to grow with several processes: call grow_model on every
            process with its own shard of the data (statistics and held-out batches); statistics and held-out
            losses are summed over the processes, and every process returns the same grown model. ``model``
            may be wrapped by the accelerator or by DistributedDataParallel.
        progress: show progress (on the main process): bars on a terminal, lines in a log (`hf_grow.progress`).

    Returns:
        The grown model (for a `SentenceTransformer`, a new `SentenceTransformer` around the grown model, with the
        report as its ``growth_report``) (a new object of the grown model type, same device and dtype) with the
        `GrowthReport` as ``grown.growth_report`` (which records the config); `save_pretrained` writes it as
        ``growth_report.json``.
    """
    with Processes(accelerator).failing_together():  # an option refused on one process alone: every process stops
        config = resolve_config(config, overrides if p is None else {**overrides, "p": p})
    started = time.perf_counter()
    refuse_sharded_training(model)  # FSDP's and DeepSpeed's parameters are shards: their Q/K cannot be read whole
    model = unwrap_model(model, accelerator)
    if is_sentence_transformer(model):
        grown = grow_model(
            transformer_module(model).model, dataloader, config=config, eval_dataloader=eval_dataloader,
            loss_fn=as_loss_fn(loss_fn, model), statistics=statistics, accelerator=accelerator, progress=progress,
        )
        grown_sentence_model = with_grown_model(model, grown)
        set_sentence_card(grown_sentence_model)  # not the card of the model it was grown from
        return grown_sentence_model
    model = merged_if_peft(model)
    progress = progress and Processes(accelerator).is_main
    prepared = prepare_growth(
        model,
        dataloader,
        config,
        mode=None,  # the architecture's own: "refactor" for GPT-2 and BERT, "append" for rotary models
        eval_dataloader=eval_dataloader,
        loss_fn=loss_fn,
        statistics=statistics,
        accelerator=accelerator,
        progress=progress,
    )
    tick = time.perf_counter()
    scale_dims = prepared.problem.attention_scale_dims(prepared.qk_after)
    grown = prepared.adapter.build_grown_model(model, prepared.qk_after, prepared.problem.weights(0.0), scale_dims)
    prepared.seconds["solve"] += time.perf_counter() - tick
    grown.growth_report = search_and_report(
        prepared, grown, measure_realized_gains=config.measure_realized_gains, progress=progress, started=started
    )
    del prepared  # the solve and the statistics: only the grown model is returned
    return_free_memory()
    return grown
