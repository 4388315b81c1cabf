"""How a run behaves, for both the text and the ``--pairs`` commands: progress and seeding, several processes
(an `accelerate.Accelerator` and every N-th batch per process), output folders written atomically with their
model card, and the push to the Hub.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers.utils import logging as transformers_logging

from .. import card, hub
from .checks import CommandError, check_output_folder


def _progress(args: argparse.Namespace) -> bool:
    """Progress unless --quiet: bars on a terminal, a line every half minute in a log (`hf_grow.progress`)."""
    return not args.quiet


#: What a process that writes nothing says when the main process failed while writing or after (a push, --report).
MAIN_WRITES = "the main process writes the outputs, and its error says what was written"


def write_folder_atomically(output: Path, write, overwrite: bool, done: Callable[[], None]) -> None:
    """Write into a temporary sibling folder, then rename it into place: no half-written model, ever.

    The output folder is checked again just before the rename: what appeared there meanwhile is replaced
    only with ``overwrite``. ``done()`` runs as soon as the folder is in place (an interruption then says so); the
    folder it replaced is then removed whole, an interruption taking effect after that.
    """
    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.hf-grow-{os.getpid()}"
    replaced = output.parent / f".{output.name}.hf-grow-old-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        write(staging)
        check_output_folder(output, overwrite)
        if output.exists():  # a folder made for the model keeps its permissions (a shared group's, a private one)
            made = output.stat()
            # its group, to the files too, where this user may give it (a member); its owner where root runs this
            owner = made.st_uid if hasattr(os, "geteuid") and os.geteuid() == 0 else -1
            with contextlib.suppress(OSError):
                for path in [staging, *staging.rglob("*")]:
                    os.chown(path, owner, made.st_gid)
            os.chmod(staging, stat.S_IMODE(made.st_mode))
            output.rename(replaced)
        staging.rename(output)
        done()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if replaced.exists() and not output.exists():
            replaced.rename(output)
        raise
    with _interruptions_deferred():
        shutil.rmtree(replaced, ignore_errors=True)


@contextlib.contextmanager
def _interruptions_deferred() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back until the block ends, then raised as the interruption they are (in the
    main thread, where handlers can be set; a signal the process ignores stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    numbers = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)]
    previous = {number: signal.signal(number, lambda signum, frame: received.append(signum))
                for number in numbers if signal.getsignal(number) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if received:
        raise KeyboardInterrupt


def accelerator_for(args: argparse.Namespace):
    """An `accelerate.Accelerator` when launched with several processes (``WORLD_SIZE`` > 1), else None.

    The model then goes to the accelerator's device (one GPU per process, or the CPU with ``--device cpu``). A
    ``--dry-run`` starts none: it plans one process of ``WORLD_SIZE`` (which may be set by hand to plan a launch).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or args.dry_run:
        return None
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=torch.device(args.device).type == "cpu")
    args.device = str(accelerator.device)
    return accelerator


def shard_batches(batches: list, accelerator, what: str) -> list:
    """Every N-th batch, from this process's index: the processes' shards add up to all the batches. A process may
    get none where there are fewer batches than processes (growth sums over the others')."""
    if accelerator is None:
        return batches
    if not batches:
        raise CommandError(f"no {what} batches to share among {accelerator.num_processes} processes: pass more text")
    return batches[accelerator.process_index :: accelerator.num_processes]


def show_bars(args: argparse.Namespace) -> bool:
    """Other libraries' progress bars (transformers' loading and saving, datasets'): on a terminal only."""
    return _progress(args) and sys.stderr.isatty()


def start_run(args: argparse.Namespace, is_main: bool = True) -> bool:
    """Seed and logging; whether progress shows (on the main process only)."""
    torch.manual_seed(args.seed)
    show_progress = _progress(args) and is_main
    transformers_logging.set_verbosity_error()
    if not (show_progress and show_bars(args)):
        transformers_logging.disable_progress_bar()
    return show_progress


#: The files of a model's terms copied beside the grown model (a license may require them with every copy: Llama's
#: does, Apache-2.0's NOTICE); its card's terms are kept in the growth card (`card.INHERITED_CARD_DATA`).
TERMS_FILES = ("LICENSE*", "NOTICE*", "USE_POLICY*", "license*", "notice*")


def write_card(args: argparse.Namespace, folder: Path, data: str, datasets: list[str]) -> None:
    """The growth card into a folder being written (`card.model_card`), its snippets naming ``--push-to-hub``'s
    repository or the output folder; the model's license and language, and the files of its terms, kept."""
    source = _terms_source(args.model)
    # A local model is named by its absolute path: the card stays true wherever it is pushed from later.
    base_model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    grown_card = card.model_card(folder, base_model=base_model,
                                 repo_id=args.push_to_hub or Path(args.output_dir).name, data=data,
                                 datasets=datasets, base_card_data=_terms(source) if source else {})
    grown_card.save(folder / card.CARD_FILENAME)
    files = {path for pattern in TERMS_FILES for path in source.glob(pattern) if path.is_file()} if source else ()
    for path in sorted(files):
        if not (folder / path.name).exists():
            shutil.copyfile(path, folder / path.name)


def _terms_source(model: str) -> Path | None:
    """The folder holding the model's card and terms files: a local model's own; for a Hub model, its card and terms
    files fetched into the Hub cache (``from_pretrained`` fetches neither). A warning where no card comes (offline
    without it in the cache, or none in the repository): the card then carries no license; None where nothing
    could be fetched."""
    if Path(model).exists():
        return Path(model)
    if not card.is_hub_id(model):
        return None
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(model, allow_patterns=[card.CARD_FILENAME, *TERMS_FILES]))
    except Exception as error:  # offline, gated or removed: the Hub's errors come in many types
        folder, reason = None, f"could not be fetched ({type(error).__name__})"
    else:
        if (folder / card.CARD_FILENAME).is_file():
            return folder
        # offline, the cached snapshot from_pretrained made (no card in it); or a repository without one, whose
        # terms files are still copied
        reason = "is not in the Hub cache (offline) or the repository has none"
    print(f"hf-grow: warning: the card of {model} {reason}: the grown model's card names no license; add the "
          "model's license to it before sharing", file=sys.stderr)
    return folder


def _terms(source: Path) -> dict:
    """`card.INHERITED_CARD_DATA` of the card in ``source`` (none without a card, or with a damaged one)."""
    path = source / card.CARD_FILENAME
    return card.card_terms(path.read_text(encoding="utf-8-sig", errors="replace")) if path.is_file() else {}


def finish_run(args: argparse.Namespace, report, output: Path, lines: list[str]) -> None:
    """After the output folder is written: the push (first: a reader of stdout that leaves early, ``| head``, stops
    none), ``--report``, then the summary ``lines`` printed; what failed of the push and the report is raised after
    them, in one line (the summary stays on the screen). A closed stdout (BrokenPipeError) goes to `main`, which says
    what was written."""
    failures = []
    try:
        push_output(args)
    except CommandError as error:
        failures.append(str(error))
    if args.report:
        try:
            report.to_json_file(args.report)
            args.written.append(f"the report to {args.report}")
        except BrokenPipeError:
            raise
        except (OSError, SafetensorError) as error:
            failures.append(f"writing --report {args.report} failed ({error}); the grown model is in {output}")
    for line in lines:
        print(line)
    if failures:
        raise CommandError("; and ".join(failures))


def push_output(args: argparse.Namespace) -> None:
    """With ``--push-to-hub``: the output folder pushed (`hub.push_to_hub`), a failure one line that says where the
    model is."""
    if not args.push_to_hub:
        return
    try:
        commit = hub.push_to_hub(args.output_dir, args.push_to_hub, private=args.private or None,
                                 revision=args.revision, commit_message=args.commit_message)
    except Exception as error:  # network and Hub errors come in many types; the model is safe on disk
        reason = (str(error).splitlines() or [""])[0]
        raise CommandError(
            f"pushing to {args.push_to_hub} failed ({type(error).__name__}: {reason}); the grown model is in "
            f"{args.output_dir}: push it later with hf_grow.push_to_hub"
        ) from None
    if commit is not None:
        pushed = getattr(commit, "commit_url", None) or args.push_to_hub
        args.written.append(f"the push to {pushed}")
        print(f"pushed to {pushed}")
