"""Loading what the command grows: the tokenizer, the model's config (which gives the loss, causal or masked),
the model itself and saved statistics, each failure as a one-line `CommandError` that says what to do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..adapters import position_limit, supported_model_types
from ..statistics import GrowthStatistics
from .checks import CommandError


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        raise CommandError(
            f"cannot load a tokenizer for {args.model!r} ({str(error).splitlines()[0]}): check the name, "
            "that the folder holds tokenizer files, and network access (HF_HUB_OFFLINE)"
        ) from None
    # transformers builds an empty tokenizer for a folder without vocabulary files: it encodes nothing.
    if not tokenizer("def grow(): pass", add_special_tokens=False)["input_ids"]:
        raise CommandError(f"{args.model!r} has no usable tokenizer: save the model's tokenizer into that folder")
    return tokenizer


#: The share of tokens masked for a masked LM's loss (transformers' DataCollatorForLanguageModeling's default).
MLM_PROBABILITY = 0.15


def model_objective(args: argparse.Namespace) -> str:
    """``"causal"`` or ``"masked"``: the loss the command grows the model on, from the model's config.

    Also checks the architecture, resolves ``--seq-len`` against the model's positions and records the vocabulary
    size, before any data is read.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    if Path(args.model).is_file():
        raise CommandError(
            f"cannot load model {args.model!r}: it is a file; pass a Hub id or the model's folder (with config.json)"
        )
    if not Path(args.model).exists() and not _hub_id(args.model):  # a mistyped folder read as a Hub id
        raise CommandError(
            f"cannot load model {args.model!r}: no folder there, and not a Hub id; pass the model's folder (with "
            "config.json) or a Hub id"
        )
    if Path(args.model).is_dir() and not (Path(args.model) / "config.json").is_file():
        adapter = Path(args.model) / "adapter_config.json"
        base = json.loads(adapter.read_text()).get("base_model_name_or_path") if adapter.is_file() else None
        what = (f"a PEFT adapter (of {base}): merge it into its base model (PeftModel.merge_and_unload(), then "
                "save_pretrained) and pass that folder, or grow the PeftModel with hf_grow.grow_model"
                if adapter.is_file() else "a SentenceTransformer (its model in a module folder): grow it with --pairs"
                if (Path(args.model) / "modules.json").is_file() else
                "no config.json: pass the folder a model was saved to (save_pretrained)")
        raise CommandError(f"cannot load model {args.model!r}: it holds {what}")
    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        missing = "" if Path(args.model).exists() else f"no local folder {args.model}, and as a Hub id: "
        raise CommandError(f"cannot load model {args.model!r}: {missing}{str(error).splitlines()[0]}") from None
    if config.model_type not in supported_model_types():
        raise CommandError(
            f"hf_grow cannot grow {args.model!r} (model_type={config.model_type!r}); "
            f"supported model types: {', '.join(supported_model_types())}"
        )
    _check_no_other_head(args, config)
    keys = _check_local_weights(args.model, needed=not getattr(args, "dry_run", False))  # a plan needs the config
    masked = type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False)
    if masked and keys is not None and not any("cls.predictions." in key for key in keys):  # a bare encoder's file
        raise CommandError(_no_head(args, "masked", ["cls.predictions.bias", "cls.predictions.transform.dense.weight",
                                                    "cls.predictions.transform.dense.bias", "..."]))
    positions = position_limit(config)  # None for rotary models: any length
    args.vocab_size = getattr(config, "vocab_size", None)  # for the tokenizer's ids (`_check_token_ids`)
    if args.seq_len is None:
        args.seq_len = min(512, getattr(config, "max_position_embeddings", None) or 512)
    elif positions is not None and args.seq_len > positions:
        raise CommandError(f"--seq-len {args.seq_len} exceeds the {positions} positions of {args.model!r}")
    if masked:
        return "masked"
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        if getattr(args, "mlm_probability", MLM_PROBABILITY) != MLM_PROBABILITY:  # it would mask nothing, silently
            raise CommandError(f"--mlm-probability applies to masked LMs; {args.model!r} is a causal LM, grown on "
                               "next-token loss: leave it out")
        if args.seq_len < 3:  # the one position with a label attends to itself alone: no score has a gradient
            raise CommandError(f"--seq-len {args.seq_len} gives a causal LM no position that attends to two tokens "
                               "(its scores would have no gradient): pass --seq-len 3 or more")
        return "causal"
    raise CommandError(
        f"{args.model!r} ({config.model_type}) is neither a causal nor a masked language model: the command line "
        "only knows those losses; use the Python API: grow_model(model, batches, loss_fn=...)"
    )


#: Endings of the model classes (`config.architectures`) whose checkpoint holds a language model's head, or none.
LANGUAGE_MODEL_CLASSES = ("LMHeadModel", "ForCausalLM", "ForMaskedLM", "ForPreTraining")


def _check_no_other_head(args: argparse.Namespace, config) -> None:
    """Refuse a checkpoint saved with another head (a classifier's `score`, a QA head): loaded as a language model it
    loads without a missing weight where its LM head is the tied embeddings, and the grown model dropped the head."""
    architecture = (getattr(config, "architectures", None) or [""])[0]
    other_head = "For" in architecture or "DoubleHeads" in architecture
    if other_head and not architecture.endswith(LANGUAGE_MODEL_CLASSES):
        python = "grow_model" if hasattr(args, "pairs") else "inspect_growth"
        raise CommandError(
            f"{args.model!r} is a {architecture}: the command line measures a language model's own loss, which "
            "leaves out this checkpoint's trained head (and so would the grown model); use the Python API with this "
            f"model's loss: {python}(model, batches, loss_fn=...)"
        )


#: The weights files from_pretrained reads, in the order it looks for them (the first present is read).
WEIGHTS_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)


def _check_local_weights(model: str, needed: bool = True) -> set[str] | None:
    """A local folder holds the weights from_pretrained reads (`WEIGHTS_FILES`), with every shard their index names
    and whole safetensors headers and data (a truncated copy or an interrupted download is found before any text is
    read; reading the headers costs nothing; a folder of a config alone where the weights are not ``needed``, for a
    plan). The names of the weights where they are safetensors (else None)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    read = next((folder / name for name in WEIGHTS_FILES if (folder / name).is_file()), None)
    if read is None and not needed:
        return None
    if read is None:
        raise CommandError(f"cannot load model {model!r}: the folder holds no weights file ({', '.join(WEIGHTS_FILES)})"
                           "; download or save the model again")
    files = [read]
    if read.name.endswith(".index.json"):
        try:
            files = sorted({folder / str(shard) for shard in json.loads(read.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CommandError(f"cannot load model {model!r}: its index file {read.name} is damaged ({error!r}); "
                               "download or save the model again") from None
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise CommandError(f"cannot load model {model!r}: it lacks {', '.join(missing[:3])}"
                               f"{', ...' if len(missing) > 3 else ''}, named by its index {read.name} (an "
                               "interrupted download?); download or save the model again")
    if files[0].suffix != ".safetensors":
        return None
    keys: set[str] = set()
    for path in files:
        try:
            keys.update(safe_open(path, framework="pt").keys())
        except SafetensorError as error:
            raise CommandError(
                f"cannot load model {model!r}: its weights file {path.name} is damaged or incomplete ({error}); "
                "download or save it again"
            ) from None
    return keys


def load_model(args: argparse.Namespace, objective: str):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto_class = AutoModelForMaskedLM if objective == "masked" else AutoModelForCausalLM
    try:
        model, loading = auto_class.from_pretrained(args.model, dtype=DTYPES[args.dtype], output_loading_info=True)
    except ValueError as error:
        raise CommandError(
            f"{args.model!r} cannot be loaded as a {objective} language model ({str(error).splitlines()[0]}); "
            "for other heads use the Python API: grow_model(..., loss_fn=...)"
        ) from None
    except OSError as error:
        raise CommandError(f"cannot load model {args.model!r}: {str(error).splitlines()[0]}") from None
    except SafetensorError as error:
        raise CommandError(
            f"cannot load model {args.model!r}: its weights file is damaged or incomplete ({error}); download or "
            "save it again"
        ) from None
    if loading["missing_keys"]:
        raise CommandError(_no_head(args, objective, sorted(loading["missing_keys"])))
    return model.to(args.device)


def _no_head(args: argparse.Namespace, objective: str, missing: list[str]) -> str:
    """Why a checkpoint without its language-model head cannot grow on that loss, and what to run instead."""
    instead = ("Grow a SentenceTransformer on text pairs with --pairs FILE, or use the Python API with a loss for "
               "this model: grow_model(model, batches, loss_fn=...)") if hasattr(args, "pairs") else (
               "Inspect it with the Python API and a loss for this model: inspect_growth(model, batches, loss_fn=...)")
    return (f"{args.model!r} has no trained {objective}-LM head (missing {', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): its loss would measure random weights. {instead}")


def load_statistics(path: str) -> GrowthStatistics:
    if Path(path).is_dir():
        raise CommandError(f"--stats {path} is a folder: pass the file written by `hf-grow inspect --save-stats`")
    try:
        return GrowthStatistics.load(path)
    except ValueError as error:
        raise CommandError(f"{error}: pass a file written by `hf-grow inspect --save-stats`") from None


def check_statistics_text(
    args: argparse.Namespace, statistics: GrowthStatistics, batches: list, objective: str
) -> None:
    """Refuse ``--stats`` of another number of tokens or batches than the statistics ``batches`` these data options
    give (the first ``--max-batches``, as `hf-grow inspect` takes them): collected with other data options, the
    held-out text could lie inside the text of the statistics, and the card would name data they were not collected
    on; and of another number of loss terms (a masked LM's masks drawn with another ``--mlm-probability`` or
    ``--seed``). Other text of the same size is not detected (the statistics carry no fingerprint of their text)."""
    tokens = sum(int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
                 for batch in batches)
    if (statistics.num_tokens, statistics.num_batches) != (tokens, len(batches)):
        raise CommandError(
            f"--stats {args.stats} holds the statistics of {statistics.num_tokens:,} tokens in "
            f"{statistics.num_batches:,} batches, but these data options give {tokens:,} tokens in {len(batches):,} "
            "batches for the statistics: pass the data options of the `hf-grow inspect --save-stats` run (--data or "
            "--dataset, --max-tokens, --seq-len, --batch-size, --max-batches and the held-out options)"
        )
    shift = 1 if objective == "causal" else 0  # a causal LM's labels are shifted: the first predicts nothing
    terms = sum(int((batch["labels"][..., shift:] != -100).sum()) for batch in batches)
    if statistics.loss_weight is not None and statistics.loss_weight != terms:
        masks = " (the masks: --mlm-probability and --seed)" if objective == "masked" else ""
        raise CommandError(
            f"--stats {args.stats} holds the statistics of {statistics.loss_weight:,} loss terms, but these data "
            f"options give {terms:,}: pass the options of the `hf-grow inspect --save-stats` run{masks}"
        )


def _hub_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub id (``name`` or ``namespace/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True
