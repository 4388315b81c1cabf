"""Model cards of grown models: metadata, the growth summary and how to load the model, built with huggingface_hub's
`ModelCard` / `ModelCardData`; and the card a Hub commit takes (no local paths in its metadata).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from torch import nn

from .config import FOR_TRAINING
from .report import (
    CROSS_FIT_NOTES, REPORT_FILENAME, GrowthReport, format_loss, format_score_rms, format_weight_ratio,
    load_growth_report,
)
from .sentence import transformer_module



CARD_FILENAME = "README.md"
#: How each growth mode (`GrowthReport.mode`) changed the query/key weights, as the card says it.
MODE_NOTES = {
    "refactor": "`refactor`, every query/key weight rewritten (the old and the new dimensions)",
    "append": "`append`, the old query/key weights kept and the new dimensions holding the step (beside the rotary "
    "dimensions of a rotary model, without rotation)",
}
#: The file that makes a folder a saved `SentenceTransformer`.
SENTENCE_MODULES = "modules.json"
#: The model id sentence-transformers replaces with the repository's in a card's snippets when it pushes.
SENTENCE_PLACEHOLDER = "sentence_transformers_model_id"
#: The Hub pipeline tag of each Auto class a grown checkpoint declares (None: no pipeline fits).
PIPELINE_TAGS: dict[str, str | None] = {
    "AutoModelForCausalLM": "text-generation",
    "AutoModelForMaskedLM": "fill-mask",
    "AutoModelForSequenceClassification": "text-classification",
    "AutoModelForTokenClassification": "token-classification",
    "AutoModelForQuestionAnswering": "question-answering",
    "AutoModel": "feature-extraction",
    "AutoModelForPreTraining": None,
    "AutoModelForMultipleChoice": None,
}


def _auto_class(architecture: str, auto_map: Mapping[str, str]) -> str | None:
    """The Auto class whose ``auto_map`` entry is ``architecture`` (None for a head class no Auto class loads)."""
    return next((auto for auto, reference in auto_map.items() if reference.split(".")[-1] == architecture), None)


def is_hub_id(name: str | None) -> bool:
    """A name the Hub can resolve (not a local folder): the Hub rejects commits whose card names local paths."""
    if not name or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


#: What a model's card says of its terms that the growth card keeps (a license may require them with every copy).
INHERITED_CARD_DATA = ("license", "license_name", "license_link", "language")


def model_card(
    folder: str | os.PathLike,
    *,
    base_model: str | None,
    repo_id: str | None = None,
    data: str | None = None,
    datasets: Sequence[str] = (),
    base_card_data: Mapping | None = None,
) -> ModelCard:
    """The model card of a saved grown model (or a sentence-transformers folder around one): metadata, the growth
    summary and how to load it; ``base_card_data``: metadata of the grown model's card kept in this one (its license
    and language, say).

    ``base_model`` names the model that was grown; ``repo_id`` is where the card will live (the loading snippets
    use it; default: the folder's name); ``data`` says in words what the statistics were collected on, ``datasets``
    names the datasets among it. Local paths stay in the metadata of a local card (where the model came from);
    `push_to_hub` drops them from the card it commits, since the Hub refuses them.
    """
    folder = Path(folder)
    return grown_model_card(
        load_growth_report(folder),
        json.loads((folder / "config.json").read_text()),
        name=repo_id or folder.name,
        base_model=base_model,
        data=data,
        datasets=datasets,
        tokenizer=(folder / "tokenizer_config.json").is_file(),
        sentence=is_sentence_folder(folder),
        base_card_data=base_card_data,
    )


def is_sentence_folder(folder: Path) -> bool:
    """Whether ``folder`` is a saved `SentenceTransformer` (its modules around the grown transformers model)."""
    return (folder / SENTENCE_MODULES).is_file()


def grown_model_card(
    report: GrowthReport,
    config: Mapping,
    *,
    name: str,
    base_model: str | None,
    data: str | None = None,
    datasets: Sequence[str] = (),
    tokenizer: bool,
    sentence: bool,
    base_card_data: Mapping | None = None,
) -> ModelCard:
    """`model_card` from the report and the config itself: ``name`` for the loading snippets, ``tokenizer`` whether
    the model comes with one, ``sentence`` whether it is a `SentenceTransformer`'s (loaded as one)."""
    architecture = (config.get("architectures") or [f"Grown{report.model_class}"])[0]
    auto_class = _auto_class(architecture, config.get("auto_map", {}))
    pipeline_tag = PIPELINE_TAGS.get(auto_class) if auto_class else None
    card_data = ModelCardData(
        base_model=base_model or None,
        library_name="sentence-transformers" if sentence else "transformers",
        pipeline_tag="sentence-similarity" if sentence else pipeline_tag,
        tags=["hf_grow", "grown-attention", config["model_type"], *["sentence-transformers"] * sentence],
        datasets=list(datasets) or None,
        **(base_card_data or {}),
    )
    remote, installed = _loading(architecture, auto_class, name, tokenizer, sentence)
    # sentence-transformers puts the repository's id into the snippets only: a title of its own for its placeholder
    title = f"Grown {report.model_class}" if name == SENTENCE_PLACEHOLDER else name.split("/")[-1]
    body = _card_body(report, title, base_model, data, remote, installed)
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{body}")


def set_sentence_card(sentence_model: nn.Module) -> None:
    """Make a grown `SentenceTransformer`'s own ``save`` and ``push_to_hub`` write its growth card.

    sentence-transformers keeps the card a model was loaded with and writes it again on save (until it is trained
    with its trainer): a grown copy would carry the card of the model it was grown from, naming that model in its
    snippets. Its card text is set to the growth card instead, with sentence-transformers' placeholder for the
    model id (its ``push_to_hub`` puts the repository's there) and no local path in the metadata."""
    grown = transformer_module(sentence_model).model
    base_model = grown.config.name_or_path or None
    card = grown_model_card(grown.growth_report, grown.config.to_dict(), name=SENTENCE_PLACEHOLDER,
                            base_model=base_model, tokenizer=True, sentence=True,
                            base_card_data=_sentence_terms(sentence_model))
    sentence_model._model_card_text = str(pushable(card))


def _sentence_terms(sentence_model: nn.Module) -> dict:
    """`INHERITED_CARD_DATA` of the card a `SentenceTransformer` was loaded with (all-MiniLM-L6-v2's license sits
    there alone), and of its ``model_card_data`` where set there (none of a damaged card)."""
    terms = card_terms(getattr(sentence_model, "_model_card_text", None) or "")
    card_data = getattr(sentence_model, "model_card_data", None)
    terms.update({key: getattr(card_data, key) for key in INHERITED_CARD_DATA if getattr(card_data, key, None)})
    return terms


def card_terms(text: str) -> dict:
    """`INHERITED_CARD_DATA` of a model card's text (none of a damaged card's)."""
    try:
        data = ModelCard(text.removeprefix("\ufeff")).data.to_dict()  # sentence-transformers keeps a BOM
    except Exception:  # metadata that is no YAML mapping, or no YAML (yaml's own errors): nothing kept of it
        return {}
    return {key: data[key] for key in INHERITED_CARD_DATA if data.get(key)}


def _selection(report: GrowthReport) -> str:
    """The card's line on how the held-out loss chose among the "auto" candidates (empty without a choice)."""
    if report.selection is None:
        return ""
    rows = "\n".join(
        f"| {c.truncation} | {c.step_mode} | {c.step_size:.4g}{' (coarse search)' * c.coarse} "
        f"| {format_loss(c.search_loss)} | {format_loss(c.confirm_loss)} |"
        for c in report.candidates
    )
    table = (
        "\n\n| truncation | step mode | step size (its search) | held-out loss (search) "
        "| held-out loss (confirmation) |\n"
        f"|---|---|---|---|---|\n{rows}\n\nEach candidate's step was searched on part of the held-out batches and "
        f"confirmed on the rest; the kept one's was then searched again on all of them: step "
        f"{report.searched_step_size or report.step_size:.4g}."
        if report.selection != "simplest" else ""
    )
    return f"\n- Candidate: {report.selection_summary()} (`selection` {report.selection}).{table}"


def _step_purpose(config: Mapping | None) -> str:
    """What the step was chosen for, where the options say: training after growth, or the held-out loss now."""
    if not config:  # reports written before GrowthConfig
        return ""
    if all(config.get(name) == value for name, value in FOR_TRAINING.items()):
        return "; chosen for training after growth (`GrowthConfig.for_training()`, `hf-grow --for-training`)"
    if config.get("step_size") is None and config.get("step_scale") == 1:
        return (
            "; the whole searched step, chosen for the held-out loss now (to train on after growth, "
            "`GrowthConfig.for_training()` takes a tenth of it: hf_grow's BENCHMARKS.md)"
        )
    return ""


def _loading(architecture: str, auto_class: str | None, name: str, tokenizer: bool, sentence: bool) -> tuple[str, str]:
    """The card's two loading snippets: without hf_grow (the repository's own modeling code) and with it."""
    if sentence:
        remote = 'from sentence_transformers import SentenceTransformer\n\n'
        remote += f'model = SentenceTransformer("{name}", trust_remote_code=True)'
        installed = "import hf_grow  # registers the grown model types\n"
        installed += f'from sentence_transformers import SentenceTransformer\n\nmodel = SentenceTransformer("{name}")'
        return remote, installed
    if auto_class:
        remote = f'from transformers import {auto_class}\n\n'
        remote += f'model = {auto_class}.from_pretrained("{name}", trust_remote_code=True)'
        installed = f"import hf_grow  # registers the grown model types\nfrom transformers import {auto_class}\n\n"
        installed += f'model = {auto_class}.from_pretrained("{name}")'
    else:  # a head class no Auto class loads: its class, from hf_grow
        remote = f"from transformers import AutoModel\n\n# the base model, without the {architecture} head\n"
        remote += f'model = AutoModel.from_pretrained("{name}", trust_remote_code=True)'
        installed = f'from hf_grow import {architecture}\n\nmodel = {architecture}.from_pretrained("{name}")'
    if tokenizer:  # the config's auto_map makes AutoTokenizer ask about remote code too
        remote = remote.replace("\n\n", ", AutoTokenizer\n\n", 1)
        remote += f'\ntokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)'
    return remote, installed


def _card_body(
    report: GrowthReport,
    title: str,
    base_model: str | None,
    data: str | None,
    remote: str,
    installed: str,
) -> str:
    grown_from = f"`{base_model}`" if base_model else f"A `{report.model_class}`"
    loss = f"{format_loss(report.eval_loss_before)} -> {format_loss(report.eval_loss_after)}"
    if report.language_model_loss:  # not of a sentence encoder's contrastive loss
        loss += f" (perplexity {format_loss(report.perplexity_before)} -> {format_loss(report.perplexity_after)})"
    widths = "\n".join(
        f"| {layer.layer} | {layer.qk_dim_before} | {layer.qk_dim_after} | {layer.expected_gain:.3g} | "
        f"{'-' if layer.realized_gain is None else f'{layer.realized_gain:.3g}'} | {format_score_rms(layer)} | "
        f"{format_weight_ratio(layer)} |"
        for layer in report.layers
    )
    step = f"size {report.step_size:.4g} in relative units, λ = {report.lam:.4g}"
    if report.step_fraction is not None:
        step += f", {report.step_fraction} (`step_scale`)"
    if report.step_mode == "per_head":
        step += " (root mean square of the layers' λ; each head steps by its own: `step_mode` per_head)"
    elif report.step_mode != "global":
        step += f" (root mean square of the layers' own λ: `step_mode` {report.step_mode})"
    budget = (
        f" The {report.budget} added dimensions per head were allocated to the layers by expected gain (`budget`)."
        if report.budget is not None
        else ""
    )
    step += _step_purpose(report.config)
    kept = (report.config or {}).get("keep_attention_scale", False)
    scale = (
        "kept at the old widths' (`keep_attention_scale`; the config's `attention_scale_dims`)"
        if kept
        else "follows the new query/key width, the change folded into the old queries"
    )
    step_zero = ": this model took step 0, the new dimensions left for training to use" * (report.step_size == 0)
    version = f"\n- Grown with hf_grow {report.hf_grow_version}." if report.hf_grow_version else ""
    configuration = ""
    if report.config is not None:  # reports written before GrowthConfig have none
        configuration = (
            "\n\nThe growth options (`hf_grow.GrowthConfig`; `GrowthConfig.from_dict` reads them back):\n\n"
            f"```json\n{json.dumps(report.config, indent=2, sort_keys=True)}\n```"
        )
    return f"""# {title}

{grown_from} with the query/key width of its attention heads grown by [hf_grow](https://pypi.org/project/hf_grow/):
the new query/key weights are solved from first-order loss statistics, so that the grown model starts where the
old one was and takes one step downhill. At step 0 it computes the old function, up to floating-point
rounding{step_zero}.

## Growth

- Parameters: {report.parameters_before:,} -> {report.parameters_after:,} ({report.parameters_added:,} added).
- Statistics: {report.statistics_tokens:,} tokens in {report.statistics_batches} batches{f" of {data}" if data else ""}.
- Gradient M: {CROSS_FIT_NOTES[report.cross_fit]}.
- Mode: {MODE_NOTES.get(report.mode, f"`{report.mode}`")}.
- Held-out loss: {loss}.
- Step: {step}; truncation `{report.truncation}`.{budget}{_selection(report)}
- Attention scale: {scale}.{version}

| layer | Q/K dims before | Q/K dims after | expected gain | realized gain | score RMS before -> after | Z norm |
|---|---|---|---|---|---|---|
{widths}

The score RMS is the root mean square of the pre-softmax attention scores over pairs of statistics tokens, the
heads' together: how much sharper the step made attention. Z norm: the Frobenius norm of Z = scaling W_Q W_K^T
at the step over before it; far above the score RMS's change, it is weight where the statistics' inputs hardly
vary, which serving in bfloat16 rounds into the scores.

The full report (line search, per-head expected gains, timings) is in `{REPORT_FILENAME}`.{configuration}

## Load

Without hf_grow, the repository carries its own modeling code (it needs transformers 5.24 or later):

```python
{remote}
```

With hf_grow installed (`pip install hf_grow`):

```python
{installed}
```
"""


def pushable(card: ModelCard) -> ModelCard:
    """The card without metadata the Hub would refuse the commit for (local paths as base model or datasets), and
    without the local paths of base models in its text (a folder's own name stays). The data and the options
    (``offload_dir``) stay as given, local paths too (README says so)."""
    data, text = card.data, card.text
    base_models = [data.base_model] if isinstance(data.base_model, str) else data.base_model or []
    for local in (name for name in base_models if not is_hub_id(name)):
        text = text.replace(f"`{local}`", f"`{Path(local).name}`")
    if not all(map(is_hub_id, base_models)):
        data.base_model = None
    if data.datasets:
        data.datasets = [name for name in data.datasets if is_hub_id(name)] or None
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{text}")
