"""The commands themselves: ``hf-grow MODEL ...`` grows and writes (and pushes), ``hf-grow inspect MODEL ...``
reports; `main` parses, runs one of them and turns a `CommandError` into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

from .. import hub
from ..adapters import get_adapter
from ..config import GrowthConfig
from ..distributed import OtherProcessFailed, Processes
from ..growth import collect_configured_statistics, grow_model
from ..inspection import PLOT_EXTRA, inspect_growth
from ..progress import stage
from ..statistics import return_free_memory
from .checks import (
    CommandError,
    as_command_error,
    check_arguments,
    check_cross_fit_batches,
    check_data_arguments,
    check_device,
    check_file_folders,
    check_inputs_kept,
    check_memory_flags,
    check_statistics_flags,
)
from .memory import check_memory
from .loading import check_statistics_text, load_model, load_statistics, load_tokenizer, model_objective
from .pairs import check_pairs_arguments, grow_from_pairs
from .parsers import INSPECT_CONFIG_FIELDS, INSPECT_GAIN_FIELDS, build_inspect_parser, build_parser, text_options_given
from .running import (MAIN_WRITES, accelerator_for, finish_run, shard_batches, start_run, write_card,
                      write_folder_atomically)
from .text import data_description, text_batches


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    if args.pairs:
        check_pairs_arguments(args, text_options_given(args))
    check_arguments(args)
    accelerator = accelerator_for(args)
    try:
        _grow_and_write(args, accelerator, started)
    finally:
        if accelerator is not None:
            accelerator.end_training()  # destroys the process group: a clean exit on every process


def _grow_and_write(args: argparse.Namespace, accelerator, started: float) -> None:
    is_main = accelerator is None or accelerator.is_main_process
    args.writes = is_main
    show_progress = start_run(args, is_main)
    objective = "pairs" if args.pairs else model_objective(args)
    # --stats is read first, to be checked against the model with the growth (a dry run only plans)
    statistics = load_statistics(args.stats) if args.stats and not args.dry_run else None
    if statistics is not None and args.config.cross_fit and statistics.half_gradients is None:
        made = ("collect_statistics(..., cross_fit=True)" if args.pairs  # inspect reads no pairs
                else "`hf-grow inspect --cross-fit --save-stats`")
        raise CommandError(
            f"--cross-fit{' (of --for-training)' * args.for_training} needs statistics with M's halves, saved by "
            f"{made}, or --cross-fit false for the plain M"
        )
    try:  # before any text or weights are read; a process refused alone would leave the others waiting
        with Processes(accelerator).failing_together():
            check_memory(args, objective, show_progress, statistics)
    except OtherProcessFailed as error:
        raise CommandError(f"{error}: nothing was written") from None
    if args.dry_run:
        return
    if statistics is not None and accelerator is not None:
        raise CommandError("--stats holds the statistics of all the data: run it in one process")
    if args.pairs:
        return grow_from_pairs(args, accelerator, started, is_main, show_progress, statistics)
    tokenizer = load_tokenizer(args)
    statistics_batches, held_out_batches = text_batches(args, tokenizer, objective, is_main)  # data before the model
    if statistics is not None:
        check_statistics_text(args, statistics, statistics_batches[: args.config.max_batches], objective)
    else:
        processes = 1 if accelerator is None else accelerator.num_processes
        check_cross_fit_batches(args.config.cross_fit, len(statistics_batches[: args.config.max_batches]), processes)
    # --max-batches counts all the processes' batches (grow_model's max_batches counts each process's own)
    statistics_batches = shard_batches(statistics_batches[: args.config.max_batches], accelerator, "statistics")
    held_out_batches = shard_batches(held_out_batches, accelerator, "held-out")
    model = load_model(args, objective)
    with as_command_error(ValueError, OtherProcessFailed):
        grown = grow_model(
            model,
            None if statistics else statistics_batches,
            config=args.config,
            statistics=statistics,
            eval_dataloader=held_out_batches,
            accelerator=accelerator,
            progress=show_progress,
        )
    del model, statistics  # the grown model holds its own weights: saving it needs neither beside it
    return_free_memory()
    try:
        # Only the main process writes and pushes; the others wait for it, and learn if it failed.
        with Processes(accelerator).failing_together():
            if is_main:
                _write_outputs(args, grown, tokenizer, started, accelerator, show_progress)
    except OtherProcessFailed as error:
        raise CommandError(f"{error}: {MAIN_WRITES}") from None


def _write_outputs(
    args: argparse.Namespace, grown, tokenizer, started: float, accelerator, show_progress: bool
) -> None:
    report = grown.growth_report
    output = Path(args.output_dir)
    data, datasets = data_description(args)

    def write(folder: Path) -> None:
        grown.save_pretrained(folder, max_shard_size=hub.SHARD_BYTES)  # from a GPU, one shard at a time on the host
        tokenizer.save_pretrained(folder)
        write_card(args, folder, data, datasets)

    try:
        with stage(f"writing the grown model to {output}", enabled=show_progress):
            write_folder_atomically(output, write, args.overwrite,
                                    done=lambda: args.written.append(f"the grown model to {output}"))
    except WRITE_ERRORS as error:
        raise CommandError(f"writing {output} failed ({error}); nothing was written") from None
    processes = f" on {accelerator.num_processes} processes" if accelerator is not None else ""
    finish_run(args, report, output, [
        report.summary(), f"wall time {time.perf_counter() - started:.1f} s{processes}; grown model written to {output}"
    ])


#: What a failed write raises: the OS's errors, and safetensors' own (a full disk while serializing is not an OSError).
WRITE_ERRORS = (OSError, SafetensorError)


def run_inspect(args: argparse.Namespace) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would read all the text and write every file
        raise CommandError("hf-grow inspect runs in one process: start it without torchrun or accelerate launch")
    check_data_arguments(args)
    if args.max_dims <= 0:
        raise CommandError(f"--max-dims must be positive, got {args.max_dims}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise CommandError(f"--plot: {PLOT_EXTRA}")
    check_device(args)
    written = (("--plot", args.plot), ("--json", args.json), ("--save-stats", args.save_stats))
    check_file_folders(*written)
    check_inputs_kept(args, *written)
    _check_inspection_config(args)
    show_progress = start_run(args)
    objective = model_objective(args)
    check_memory(args, objective, show_progress, inspection=True)  # before any text or weights are read
    if args.dry_run:
        return
    tokenizer = load_tokenizer(args)
    statistics_batches, _ = text_batches(args, tokenizer, objective, held_out_used=False)  # the main command's split
    statistics_batches = statistics_batches[: args.config.max_batches]
    check_cross_fit_batches(args.cross_fit, len(statistics_batches), off="no --cross-fit")
    model = load_model(args, objective)
    with as_command_error():
        if args.save_stats:  # every layer's M is kept for the file
            statistics = collect_configured_statistics(
                model, statistics_batches, get_adapter(model), None, args.config, progress=show_progress
            )
            with stage(f"writing the statistics to {args.save_stats}", enabled=show_progress):
                _write(args, f"statistics {args.save_stats}", lambda: statistics.save(args.save_stats))
            inspection = inspect_growth(
                model, statistics=statistics, max_dims=args.max_dims, config=args.config, progress=show_progress
            )
        else:  # each group of layers' M is freed once solved
            inspection = inspect_growth(
                model, statistics_batches, max_dims=args.max_dims, config=args.config, progress=show_progress
            )
    print(inspection.table(heads=not args.layers_only))
    if args.json:
        _write(args, f"inspection {args.json}", lambda: inspection.to_json_file(args.json))
    if args.plot:
        _write(args, f"spectra {args.plot}", lambda: inspection.plot(args.plot))
    if args.written:
        print("wrote " + ", ".join(args.written))


def _check_inspection_config(args: argparse.Namespace) -> None:
    """``args.config``: the `GrowthConfig` of the inspection's statistics flags, checked as the main command's."""
    check_memory_flags(args)
    with as_command_error(TypeError, ValueError):
        args.config = GrowthConfig(
            cross_fit=args.cross_fit,
            **{name: getattr(args, name) for name in (*INSPECT_CONFIG_FIELDS, *INSPECT_GAIN_FIELDS)},
        )
    check_statistics_flags(args)


def _write(args: argparse.Namespace, what: str, write) -> None:
    """``write()`` of ``what``, recorded as written; a failure as one line that says what was written before."""
    try:
        write()
    except WRITE_ERRORS as error:
        before = f"; already written: {', '.join(args.written)}" if args.written else ""
        raise CommandError(f"writing {what} failed ({error}){before}") from None
    args.written.append(what)


#: The options that name a file or folder (--data's globs are expanded where they are read).
PATH_OPTIONS = ("model", "output_dir", "report", "stats", "plot", "json", "save_stats", "offload_dir", "pairs")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    inspecting = argv[:1] == ["inspect"]
    args = build_inspect_parser().parse_args(argv[1:]) if inspecting else build_parser().parse_args(argv)
    for name in PATH_OPTIONS:  # a `~` the shell left (quoted, from a list of arguments): --data's is expanded too
        if isinstance(getattr(args, name, None), str) and getattr(args, name).startswith("~"):
            setattr(args, name, os.path.expanduser(getattr(args, name)))
    args.written, args.writes = [], True  # what is in place, and whether this process writes: for an interruption
    try:
        with _terminations_interrupt(), _warnings_as_lines():
            if inspecting:
                run_inspect(args)
            else:
                run(args)
    except CommandError as error:
        print(f"hf-grow: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader left (`| head`): what is left to print goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        written = f"already written: {', '.join(args.written)}" if args.written else "nothing was written"
        print(f"hf-grow: stdout was closed before the command ended; {written}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if not args.writes:
            written = "this process writes nothing (the main process writes the outputs)"
        else:
            written = f"already written: {', '.join(args.written)}" if args.written else "nothing was written"
        print(f"hf-grow: interrupted; {written}", file=sys.stderr)
        return 130
    return 0


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Warnings written as ``hf-grow: warning: ...`` lines: the library points a warning at its caller's line, which
    for the command is no file of the user's (``<frozen runpy>:88``, the ``hf-grow`` script). Only their text: a
    caller recording them (``catch_warnings(record=True)``, ``pytest.warns``) still gets them."""

    def line(message, category, filename, lineno, line=None) -> str:
        kind = "" if category is UserWarning else f"{category.__name__}: "
        return f"hf-grow: warning: {kind}{message}\n"

    formatting, warnings.formatwarning = warnings.formatwarning, line
    try:
        yield
    finally:
        warnings.formatwarning = formatting


@contextlib.contextmanager
def _terminations_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (``kill``, ``timeout``, a scheduler's or container's stop, a closed terminal) interrupt as
    Ctrl-C does, so that staging folders and offloaded statistics are removed: by default they end the process
    without any cleanup. A signal the process ignores stays ignored (``nohup`` ignores SIGHUP), and handlers are
    set only in the main thread, where they can be (and put back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame) -> None:
        raise KeyboardInterrupt

    numbers = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]  # no SIGHUP: Windows
    previous = {number: signal.signal(number, interrupt) for number in numbers
                if signal.getsignal(number) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
