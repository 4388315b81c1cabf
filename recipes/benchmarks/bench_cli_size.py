"""Benchmark: the `hf-grow` command at the real size of the models it names, stage by stage.

Builds a model of the GPT-2 small (124M parameters), medium (355M) or large (774M) shape, or of a Llama-3.2-1B
or Llama-3-8B shape, with random weights and a byte-level BPE tokenizer trained on a few standard-library files,
saves them to a folder, then runs

    hf-grow FOLDER --p 8 --data <standard-library text> --max-tokens N --eval-tokens M --seq-len 256 ...

as a new user would, with stderr going to a pipe (as in a log file). It samples the command's resident memory
every 0.2 s and splits the run at the command's own progress lines: model and data loading, statistics, solve,
line search, realized gains, writing the grown model (with ``--inspect``, of `hf-grow inspect`: statistics, the
gains and the statistics file of ``--save-stats``).
Prints one table row per stage (seconds and peak resident memory within it) and the total, and the peak of its
anonymous memory (resident memory less file-backed pages, such as the mapping of ``--offload-dir``, which the
operating system can write back and drop).

    python recipes/benchmarks/bench_cli_size.py --shape small            # ~4 minutes on 2 CPU cores
    python recipes/benchmarks/bench_cli_size.py --shape small --inspect -- --save-stats /tmp/stats.safetensors
    python recipes/benchmarks/bench_cli_size.py --shape medium --batch-size 2   # 15-20 minutes alone, 8.8 GiB
                                                                         # (14.2 GiB at the default batch 8)
    python recipes/benchmarks/bench_cli_size.py --shape llama-1b --max-tokens 2048 --eval-tokens 512 \
        -- --memory-budget 4GB                                           # the Llama-3.2-1B shape
    python recipes/benchmarks/bench_cli_size.py --shape llama-8b --device cuda --seq-len 1024 --batch-size 2 \
        --stop-after first-pass -- --dtype bfloat16 --memory-budget 40.83GB --accumulate-dtype float32

On a GPU (``--device cuda``) the model is built on the device in bfloat16 (a Llama-3-8B in seconds), and the
device memory in use (NVML: the CUDA context and everything PyTorch's allocator holds) is sampled beside the
resident memory; the tables then give both, and the plan's device column against the measured device peak.
``--layers N`` keeps a shape's layers but N of them (per-layer statistics and solve as at full size).

The plan of ``--dry-run`` comes first; the last table sets its predicted peak per stage against the measured one.
``--stop-after load`` stops the command at its first progress line of the statistics (the stage's start is read
back from that line's count and rate), ``--stop-after statistics`` (or ``solve``) at the stage's closing line: the
stages before it without the whole run; ``--stop-after first-pass`` at the closing line of the statistics' first
pass over the data.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as transformers_logging


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quickstart import stdlib_files, train_tokenizer  # noqa: E402

SHAPES = {
    "small": dict(n_embd=768, n_layer=12, n_head=12),
    "medium": dict(n_embd=1024, n_layer=24, n_head=16),
    "large": dict(n_embd=1280, n_layer=36, n_head=20),
    # Llama-3.2-1B: grouped-query attention, a 128,256-token vocabulary, tied embeddings.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                     max_position_embeddings=2048, rope_theta=500000.0),
    # Llama-3-8B: untied embeddings, 4,096 wide, 32 layers of 32 query and 8 key/value heads.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                     max_position_embeddings=8192, rope_theta=500000.0),
}
#: Plan stage -> the command's stages it covers (the realized gains run on the line search's memory).
BUILD = "build the grown model, first held-out pass"
PLAN_STAGES = {"load": ("load model and data",), "statistics": ("statistics",), "solve": ("solve",),
               "line search": (BUILD, "line search", "realized gains"), "write": ("writing the grown model",)}
#: The same for ``hf-grow inspect`` (``--inspect``): the gains are solved group by group after each pass.
INSPECT_PLAN_STAGES = {"load": ("load model and data",), "statistics": ("statistics",),
                       "write": ("writing the statistics",), "gains": ("gains",)}
STDLIB = sysconfig.get_paths()["stdlib"]


def build_model(folder: Path, shape: str, layers: int | None, device: str) -> int:
    """Save a model of ``shape`` with random weights (float32 on the CPU; bfloat16, built on the GPU, with
    ``device`` cuda) and a byte-level BPE tokenizer; its parameter count."""
    torch.manual_seed(0)
    sizes = dict(SHAPES[shape])
    if layers is not None:
        sizes["num_hidden_layers" if shape.startswith("llama") else "n_layer"] = layers
    config = LlamaConfig(**sizes) if shape.startswith("llama") else GPT2Config(**sizes)
    model_class = LlamaForCausalLM if shape.startswith("llama") else GPT2LMHeadModel
    if device == "cpu":
        model = model_class(config)
    else:
        with torch.device(device):
            model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    train_tokenizer(stdlib_files()[:20], vocab_size=2000).save_pretrained(folder)
    parameters = model.num_parameters()
    del model
    torch.cuda.empty_cache() if device != "cpu" else None
    return parameters


class DeviceMemory:
    """The memory in use on GPU 0 (NVML), less what was in use when it was made; zero without a GPU."""

    def __init__(self, device: str) -> None:
        self.handle = None
        if device != "cpu":
            import pynvml  # nvidia-ml-py, beside CUDA builds of PyTorch

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.read = lambda: pynvml.nvmlDeviceGetMemoryInfo(self.handle).used
            self.baseline = self.read()

    def __call__(self) -> int:
        return 0 if self.handle is None else self.read() - self.baseline


def run_command(
    command: list[str], stop: Callable[[str], bool] = lambda line: False, device_memory: Callable[[], int] = int,
    echo: bool = False,
) -> tuple[list[tuple[float, str]], list[tuple[float, int, int]], int, int]:
    """Run ``command``, stopped at the first stderr line ``stop`` takes; its stderr lines (printed as they come
    with ``echo``) and its resident- and device-memory samples (bytes), timestamped, its exit status and its peak
    anonymous memory."""
    started = time.monotonic()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines: list[tuple[float, str]] = []
    samples: list[tuple[float, int, int]] = []
    anonymous = 0

    def read_stderr() -> None:
        for line in process.stderr:
            lines.append((time.monotonic() - started, line.rstrip()))
            if echo:
                print(f"| {lines[-1][0]:7.1f} s  {lines[-1][1]}", flush=True)
            if stop(line):
                process.terminate()
                break

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            samples.append((time.monotonic() - started, watched.memory_info().rss, device_memory()))
            anonymous = max(anonymous, anonymous_memory(process.pid))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    reader.join()
    samples.append((time.monotonic() - started, 0, 0))
    print(process.stdout.read())
    return lines, samples, process.returncode, anonymous


def anonymous_memory(pid: int) -> int:
    """``RssAnon`` of /proc/PID/status in bytes (Linux; 0 elsewhere or once the process is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0)


def split_stages(lines: list[tuple[float, str]], total: float) -> list[tuple[str, float, float]]:
    """(stage, start, end) from the command's closing lines ``STAGE: ... done in DURATION[, ...]``; the time
    before the first stage is model and data loading, other gaps are "other" (reports, summaries)."""
    stages = []
    cursor = 0.0
    for at, line in lines:
        progress = PROGRESS.match(line)
        if progress and line is lines[-1][1]:  # stopped within a stage: its start from the count and rate
            stage, begin = progress["stage"], at - float(progress["count"]) / float(progress["rate"])
        elif "done in " not in line or ": " not in line:
            continue
        else:
            stage = line.split(": ", 1)[0].split(" to ")[0]  # "writing the grown model to DIR" -> its first words
            begin = at - _seconds(line.rsplit("done in ", 1)[1].split(",")[0])
        if begin > cursor + 0.5:
            gap = "load model and data" if not stages else BUILD if stage == "line search" else "other"
            stages.append((gap, cursor, begin))
        stages.append((stage, begin, at))
        cursor = at
    stages.append(("exit", cursor, total))
    return stages


#: A progress line of `hf_grow.progress.LogProgress`: ``statistics: 12/50 batch (24%), 0.41 batch/s, ...``.
PROGRESS = re.compile(r"^(?P<stage>[^:]+): (?P<count>\d+)(/\d+)? \w+( \(\d+%\))?, (?P<rate>[\d.e+-]+) \w+/s")


def _stop_after(stage: str | None) -> Callable[[str], bool]:
    """Whether a stderr line ends the run with ``--stop-after stage``: for "load" the first progress line of the
    statistics, else the stage's closing line (of the statistics' last pass, of the first group's solve)."""
    if stage is None:
        return lambda line: False
    if stage == "first-pass":
        return lambda line: line.startswith("statistics") and "done in " in line
    if stage == "load":
        return lambda line: line.startswith("statistics") and PROGRESS.match(line) is not None
    def closes_stage(line: str) -> bool:
        passes = re.match(r"\S+ (\d+)/(\d+):", line)  # "statistics 1/2: ..."
        return line.startswith(stage) and "done in " in line and (passes is None or passes[1] == passes[2])

    return closes_stage


def _seconds(text: str) -> float:
    """Read back `hf_grow.progress.format_seconds`: ``7.4 s``, ``3 min 05 s``, ``1 h 02 min``."""
    parts = text.replace(",", " ").split()
    seconds = 0.0
    for value, unit in zip(parts[::2], parts[1::2]):
        seconds += float(value) * {"s": 1, "min": 60, "h": 3600}[unit]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--max-tokens", type=int, default=8192, help="statistics tokens")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens of the line search")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--workdir", help="folder for the model and the output (default: a temporary one)")
    parser.add_argument("--echo", action="store_true", help="print the command's progress lines as they come")
    parser.add_argument("--layers", type=int, help="the shape with this many layers (default: the shape's own)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: a bfloat16 model and device memory sampled")
    parser.add_argument("--stop-after", choices=["load", "first-pass", "statistics", "solve"],
                        help="stop the command once this stage is over (see above)")
    parser.add_argument("--inspect", action="store_true",
                        help="run `hf-grow inspect` (statistics and gains; add -- --save-stats FILE to keep M)")
    parser.add_argument("extra", nargs="*", help="more hf-grow options, after --, e.g. -- --memory-budget 4GB")
    args = parser.parse_args()
    transformers_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as temporary:
        workdir = Path(args.workdir or temporary)
        name = args.shape + (f"-{args.layers}-layers" if args.layers else "")
        model_folder, output = workdir / name, workdir / f"{name}-grown"
        if (model_folder / "config.json").is_file():  # a --workdir from an earlier run: the same seed and shape
            parameters = json.loads((model_folder / "size.json").read_text())["parameters"]
        else:
            parameters = build_model(model_folder, args.shape, args.layers, args.device)
            (model_folder / "size.json").write_text(json.dumps({"parameters": parameters}))
        text = [os.path.join(STDLIB, folder, "*.py") for folder in ("json", "email", "asyncio", "unittest")]
        growth = [] if args.inspect else ["--p", str(args.p), "--output-dir", str(output), "--overwrite"]
        command = [sys.executable, "-m", "hf_grow", *["inspect"] * args.inspect, str(model_folder), *growth,
                   "--data", *text, "--max-tokens", str(args.max_tokens), "--eval-tokens", str(args.eval_tokens),
                   "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--device", args.device,
                   *args.extra]
        print(f"# bench_cli_size {datetime.date.today()} torch {torch.__version__} "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"{psutil.virtual_memory().total / 2**30:.0f} GiB, {device_name(args.device)}; {name} shape "
              f"({parameters / 1e6:.0f}M "
              f"parameters, random weights), {args.max_tokens} + {args.eval_tokens} tokens at seq {args.seq_len}, "
              f"batch {args.batch_size}, p {args.p}", flush=True)
        print("$ hf-grow " + " ".join(command[3:]), flush=True)
        plan = subprocess.run([*command, "--dry-run"], capture_output=True, text=True, check=True).stdout
        print(plan, flush=True)
        lines, samples, returncode, anonymous = run_command(
            command, _stop_after(args.stop_after), DeviceMemory(args.device), args.echo)
    total = samples[-1][0]
    if returncode != 0 and (args.stop_after is None or not _stop_after(args.stop_after)(lines[-1][1] if lines else "")):
        print("\n".join(line for _, line in lines[-20:]))
        raise SystemExit(f"hf-grow exited with {returncode} after {total:.0f} s "
                         f"(peak {max(sample[1] for sample in samples) / 2**30:.1f} GiB)")
    on_device = args.device != "cpu"
    kinds = ("host", "device") if on_device else ("host",)
    print(f"{'stage':<44}{'seconds':>9}{'share':>8}{'peak GiB':>10}" + (f"{'device GiB':>12}" if on_device else ""))
    peaks: dict[str, dict[str, float]] = {kind: {} for kind in kinds}
    for stage, begin, end in split_stages(lines, total):
        # The samples within the stage; one shorter than the sampling interval gets the samples around it.
        inside = [sample for sample in samples if begin <= sample[0] <= end] or [
            sample for sample in samples if begin - 0.25 <= sample[0] <= end + 0.25] or [(0, 0, 0)]
        passes = re.sub(r" \d+/\d+$", "", stage)  # "statistics 1/2" -> "statistics"
        row = f"{stage:<44}{end - begin:>9.1f}{(end - begin) / total:>8.0%}"
        for column, kind in enumerate(kinds, start=1):
            peak = max(sample[column] for sample in inside)
            peaks[kind][passes] = max(peaks[kind].get(passes, 0), peak)
            row += f"{peak / 2**30:>{10 + 2 * (column - 1)}.2f}"
        print(row)
    overall = {kind: max(sample[column] for sample in samples) / 2**30 for column, kind in enumerate(kinds, start=1)}
    print(f"{'total':<44}{total:>9.1f}{1:>8.0%}" + "".join(
        f"{overall[kind]:>{10 + 2 * column}.2f}" for column, kind in enumerate(kinds)))
    print(f"peak anonymous memory (resident less file-backed pages): {anonymous / 2**30:.2f} GiB")
    plan_stages = INSPECT_PLAN_STAGES if args.inspect else PLAN_STAGES
    for column, kind in enumerate(kinds):
        predicted = planned_peaks(plan, plan_stages, column)
        print(f"\n{'plan stage':<14}{f'planned {kind} GiB':>20}{'measured GiB':>14}{'planned/measured':>18}")
        for name, covered in plan_stages.items():
            if name not in predicted:  # not planned (inspect without --save-stats writes no statistics)
                continue
            measured = max((peaks[kind][stage] for stage in covered if stage in peaks[kind]), default=0) / 2**30
            ratio = f"{predicted[name] / measured:>18.2f}" if measured else f"{'-':>18}"
            print(f"{name:<14}{predicted[name]:>20.2f}{measured:>14.2f}{ratio}")
        planned = max(predicted.values())
        print(f"{'peak':<14}{planned:>20.2f}{overall[kind]:>14.2f}{planned / overall[kind]:>18.2f}")


def planned_peaks(table: str, stages: dict[str, tuple[str, ...]], column: int = 0) -> dict[str, float]:
    """GiB per stage of ``stages`` from the ``--dry-run`` table (`hf_grow.growth.memory_plan.MemoryPlan.table`):
    its host column (0) or its device column (1)."""
    peaks = {}
    for line in table.splitlines():
        for name in stages:
            if line.startswith(name + " ") and line[len(name):].strip()[:1].isdigit():
                value, unit = line[14:].split()[2 * column:2 * column + 2]
                peaks[name] = float(value) / {"MiB": 1024, "GiB": 1, "KiB": 2**20, "B": 2**30}[unit]
    return peaks


def device_name(device: str) -> str:
    return "no GPU" if device == "cpu" else f"{torch.cuda.get_device_name(0)}, torch CUDA {torch.version.cuda}"


if __name__ == "__main__":
    main()
