"""Pushing a grown model to the Hugging Face Hub.

What is pushed is a saved grown checkpoint: safetensors weights, the config with ``auto_map``, the self-contained
configuration and modeling files, the tokenizer, ``growth_report.json`` and the model card ``README.md`` (`card`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Collection, Iterable
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, get_token
from huggingface_hub.constants import is_offline_mode
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .card import CARD_FILENAME, SENTENCE_PLACEHOLDER, model_card, pushable
from .files import SHARD_BYTES
from .report import REPORT_FILENAME
from .sentence import is_sentence_transformer, transformer_module


logger = logging.getLogger("hf_grow")


#: The files of which one makes a saved tokenizer (its config; a fast tokenizer's own file).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
#: What a push leaves out of a folder: what transformers' Trainer writes beside a model it saves into its output
#: folder (its run's arguments, a pickle; state, results, a checkpoint's state; as the Trainer's own push does), and
#: a PEFT adapter saved there, which from_pretrained would apply to the grown model.
ADAPTER_FILES = r"adapter_config\.json|adapter_model\.(safetensors|bin)"  # which from_pretrained applies
LEFT_OUT_FILES = re.compile(
    r"training_args\.bin|(optimizer|scheduler|scaler)\.(pt|bin)|rng_state(_\d+)?\.pth|trainer_state\.json"
    rf"|(all|train|eval|test|predict)_results\.json|{ADAPTER_FILES}"
)
#: The folders a Trainer's run writes in its output folder (checkpoints, TensorBoard logs), left out of a push.
RUN_FOLDERS = re.compile(r"checkpoint-\d+|runs")
def check_push(repo_id: str, api: HfApi | None = None) -> None:
    """Refuse a push that cannot work, before any growth: an invalid repo id, offline mode, no token.

    Raises ValueError with one line that says what to do.
    """
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"invalid Hub repository id {repo_id!r}: {str(error).splitlines()[0]}") from None
    if os.path.exists(repo_id):
        raise ValueError(f"{repo_id!r} is a local path, not a Hub repository id (user/name)")
    if is_offline_mode():
        raise ValueError(
            "cannot push to the Hub: offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); unset it or push "
            "later with hf_grow.push_to_hub"
        )
    if api is None and get_token() is None:
        raise ValueError("cannot push to the Hub: not logged in; run `hf auth login` or set HF_TOKEN")


def _is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


def _files_to_push(folder: Path) -> list[Path]:
    """Every file of a saved grown model, after checking the ones another person needs are there."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} holds no config.json: save the grown model there first (save_pretrained)")
    auto_map = json.loads(config_path.read_text()).get("auto_map")
    if not auto_map:
        raise ValueError(f"the config in {folder} has no auto_map: is it a model grown by hf_grow?")
    needed = {f"{reference.split('.')[0]}.py" for reference in auto_map.values()}
    missing = sorted(name for name in needed if not (folder / name).is_file())
    if missing:
        raise ValueError(f"{folder} lacks {', '.join(missing)}: save the grown model with its save_pretrained")
    if not (folder / REPORT_FILENAME).is_file():
        raise ValueError(f"{folder} lacks {REPORT_FILENAME}: a grown model loaded with from_pretrained and saved "
                         f"again writes none; copy the {REPORT_FILENAME} of the folder it was grown into here")
    # every file, those of its folders too (a SentenceTransformer's modules, a tokenizer's chat templates); none
    # hidden, none of a Trainer's run in the same folder (`LEFT_OUT_FILES`, `RUN_FOLDERS`), no PEFT adapter
    files, left_out = [], []
    for path in sorted(folder.rglob("*")):
        parts = path.relative_to(folder).parts
        if not path.is_file() or any(part.startswith(".") for part in parts):
            continue
        run = RUN_FOLDERS.fullmatch(parts[0]) or (folder / parts[0] / "trainer_state.json").is_file()
        leave = LEFT_OUT_FILES.fullmatch(parts[0]) if len(parts) == 1 else run
        (left_out if leave else files).append(path)
    if left_out:
        names = sorted({path.relative_to(folder).parts[0] for path in left_out})
        shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
        logger.warning("not pushed from %s: %s (a training run's, or a PEFT adapter's)", folder, shown)
    if not any(path.suffix == ".safetensors" for path in files):
        raise ValueError(f"{folder} holds no safetensors weights: save with save_pretrained(safe_serialization=True)")
    return files


def _stale_weights(in_repo: Iterable[str], pushed: Collection[str]) -> list[str]:
    """The weight files (and shard indexes) of a model pushed to the repository before that this push does not
    replace: from_pretrained reads ``model.safetensors`` before a sharded index, so a single file left beside the
    shards of a later push would load the old weights (the Hub keeps what a commit does not delete); and a PEFT
    adapter pushed there before, which from_pretrained would apply to the grown model."""
    weights = r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?"
    return sorted(name for name in in_repo if name not in pushed and "/" not in name
                  and re.fullmatch(f"{weights}|{ADAPTER_FILES}", name))


def _save_model(model: nn.Module, folder: Path, tokenizer: PreTrainedTokenizerBase | None, repo_id: str) -> str | None:
    """Save a grown model or `SentenceTransformer` to ``folder`` for `push_to_hub`; the name of its base model."""
    if getattr(model, "growth_report", None) is None:
        raise ValueError("the model has no growth_report: push a model returned by hf_grow.grow_model, or give a "
                         "grown model loaded with from_pretrained the report of the folder it was grown into "
                         "(model.growth_report = hf_grow.load_growth_report(folder))")
    if is_sentence_transformer(model):
        model.save(str(folder))  # its modules, tokenizer and the grown transformers model
        return transformer_module(model).model.config.name_or_path or None
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"cannot push a {type(model).__name__}: pass a grown model, SentenceTransformer or folder")
    model.save_pretrained(folder, max_shard_size=SHARD_BYTES)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    else:
        logger.warning("pushing %s without a tokenizer: pass tokenizer= so that others can use it", repo_id)
    return model.config.name_or_path or None


def push_to_hub(
    folder_or_model: str | os.PathLike | PreTrainedModel | nn.Module,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    api: HfApi | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    base_model: str | None = None,
) -> CommitInfo | None:
    """Push a grown model to the Hub in one commit: weights, config, modeling files, tokenizer, report, card.

    ``folder_or_model``: a folder written by the grown model's `save_pretrained` (and the tokenizer's) or by a
    grown `SentenceTransformer`'s ``save``, or a grown model or `SentenceTransformer` (saved to a temporary folder
    first; a transformers model with ``tokenizer`` when given; a folder is pushed as it is, and ``tokenizer`` with a
    folder is refused: save it into the folder). A folder's ``README.md`` is the card; a model's
    card, or a folder's without one, is made (`model_card`, with ``base_model``); metadata the Hub refuses (local
    paths as base model or datasets) is left out of the committed card. The repository is created if needed
    (``private``), and ``revision`` names a branch, created if needed; weight files that a push there before left
    and this one does not replace (a single file beside new shards) are deleted in the commit. ``api``: the
    `HfApi` to use (default: a new one with the saved token). Only the main process of a multi-process run pushes;
    the others return None.
    """
    check_push(repo_id, api)
    if not _is_main_process():
        return None
    api = api or HfApi()
    with tempfile.TemporaryDirectory(prefix="hf-grow-push-") as staging:
        existing = None
        if isinstance(folder_or_model, nn.Module):
            folder = Path(staging) / "model"
            saved_from = _save_model(folder_or_model, folder, tokenizer, repo_id)
            base_model = base_model or saved_from
        else:
            folder = Path(folder_or_model)
            if not folder.is_dir():
                raise ValueError(f"{folder} is not a folder: pass a saved grown model's folder or the model itself")
            has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
            if tokenizer is not None:  # a folder is pushed as it is: the tokenizer would be left out
                fix = ("its own is pushed: leave out tokenizer=" if has_tokenizer else
                       "save the tokenizer into it (tokenizer.save_pretrained(folder)) and push it without tokenizer=")
                raise ValueError(f"tokenizer= is saved with a model, and {folder} is a folder: {fix}")
            if not has_tokenizer:
                logger.warning("pushing %s without a tokenizer: save the tokenizer into it (tokenizer.save_pretrained)"
                               " so that others can use it", folder)
            existing = folder / CARD_FILENAME if (folder / CARD_FILENAME).is_file() else None
        files = _files_to_push(folder)
        if existing is not None:
            card = ModelCard.load(existing)
            # A card written for the folder (by the CLI, say) is titled and loads it by the folder's name, or a
            # grown SentenceTransformer's by sentence-transformers' placeholder: use the repository's.
            card.text = card.text.replace(f"# {folder.name}\n", f"# {repo_id.split('/')[-1]}\n", 1)
            for old_name in (folder.name, SENTENCE_PLACEHOLDER):
                for loader in ("from_pretrained(", "SentenceTransformer("):
                    card.text = card.text.replace(f'{loader}"{old_name}"', f'{loader}"{repo_id}"')
        else:
            card = model_card(folder, base_model=base_model, repo_id=repo_id)
        card_path = Path(staging) / CARD_FILENAME
        pushable(card).save(card_path)
        in_repo = {path.relative_to(folder).as_posix(): path for path in files} | {CARD_FILENAME: card_path}
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
                      for name, path in in_repo.items()]
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        operations += [CommitOperationDelete(path_in_repo=name)
                       for name in _stale_weights(api.list_repo_files(repo_id, revision=revision), in_repo)]
        return api.create_commit(
            repo_id,
            operations=operations,
            commit_message=commit_message or "Upload a model grown by hf_grow",
            revision=revision,
        )
