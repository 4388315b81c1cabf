"""Benchmark: the cost of collecting growth statistics, as a ratio to a plain training step.

For a GPT-2-small-sized config (n_embd 768, 12 layers, 12 heads) on a GPU in bf16 (batch 8), or a small config
on CPU, at sequence lengths 256 to 4096: time and peak memory (allocated on a GPU, resident on a Linux CPU) of
one statistics step (forward + backward + accumulation of C and M) with each method, over one plain training
step (forward + backward with parameter gradients, sdpa attention) on the same batch; the "triton" method where
it can run (CUDA with triton); with ``--query-blocks``, the chunked method at other block sizes. Then the
accuracy of each method's M on a padded batch against the reference method in float64. Also the FLOP floor of
M and the solve time for all heads.

The floor: per layer and sequence, M costs h (2 s^2 d + 2 s d^2) FLOPs on top of the training step
(d = d_e + 1: G X' then X'^T (G X')); a training step costs about 6 N s + 12 L s^2 d_e FLOPs per sequence
(N the parameters of the blocks and the LM head, plus the attention scores and values forward and backward).
The floor ratio is (training + M) / training. Last, the solve: the decomposition of every head at each step of
a line search (full SVD, eigh, and top-r subspace iteration cold or warm-started from the previous step, with
the truncation error's excess over the optimum), and a whole `grow_model` line search per solver at the
preset's second sequence length.

    python recipes/benchmarks/bench_stats.py --preset cpu    # ~8 min on 2 CPU cores, 10 GiB at seq 4096
    python recipes/benchmarks/bench_stats.py --preset gpu    # CUDA, bf16
    python recipes/benchmarks/bench_stats.py --solve-only --skip-line-search --solve-heads 12 --solve-width 769 \
        --solve-qk-dim 64                                    # one GPT-2-small layer's solve
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import platform
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as transformers_logging

import hf_grow
from hf_grow import linalg
from hf_grow.statistics import METHODS, collect_statistics, triton_available


PRESETS = {
    "cpu": dict(
        n_embd=256, n_layer=4, n_head=8, vocab_size=2048, batch_size=2, seq_lens=[256, 1024, 2048, 4096],
        dtype="float32", rounds=2,
    ),
    "gpu": dict(
        n_embd=768, n_layer=12, n_head=12, vocab_size=50257, batch_size=8, seq_lens=[256, 1024, 2048, 4096],
        dtype="bfloat16", rounds=5,
    ),
}


#: The products of `--precisions`: collect_statistics' own choice (None) or TF32 off.
PRECISIONS = {"default": None, "float32": False}
#: The decompositions of the solve benchmark: (linalg method, warm-started from the previous step).
SOLVERS = {"eigh": ("eigh", False), "svd": ("svd", False), "subspace cold": ("subspace", False),
           "subspace warm": ("subspace", True)}


def precision_label(method: str, precision: str) -> str:
    """A table row's name: the method, marked " f32" where TF32 is off."""
    return method + (" f32" if precision == "float32" else "")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(step, device: torch.device, rounds: int) -> tuple[float, float | None]:
    """Median seconds of ``step()`` after a warm-up, and its peak memory above the memory held before it in GiB:
    allocated CUDA memory on a GPU, resident memory on a Linux CPU (None elsewhere)."""
    step()
    synchronize(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = reset_resident_peak()
    times = []
    for _ in range(rounds):
        synchronize(device)
        tick = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - tick)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - baseline) / 2**30
    elif baseline is not None:
        peak = (resident_kib("VmHWM") - baseline) / 2**20
    return sorted(times)[len(times) // 2], peak


def resident_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def reset_resident_peak() -> int | None:
    """Give freed heap memory back to the OS and restart the process's resident-memory peak from its current
    value (Linux); returns the resident KiB it starts from, or None where this is not available."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return resident_kib("VmRSS")
    except OSError:
        return None


def flops(config: GPT2Config, seq_len: int) -> tuple[float, float]:
    """Training-step FLOPs and the extra FLOPs of M, per sequence."""
    d_e, layers, heads = config.n_embd, config.n_layer, config.n_head
    parameters = layers * 12 * d_e**2 + config.vocab_size * d_e
    training = 6 * parameters * seq_len + 12 * layers * seq_len**2 * d_e
    extra = layers * heads * (2 * seq_len**2 * (d_e + 1) + 2 * seq_len * (d_e + 1) ** 2)
    return training, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="override the preset's sequence lengths")
    parser.add_argument("--methods", nargs="+", choices=METHODS,
                        help="default: chunked, reference and, where it runs, triton")
    parser.add_argument("--query-blocks", type=int, nargs="+", default=[],
                        help="also time the chunked method with these queries per block (default: by device)")
    parser.add_argument("--batch-size", type=int, help="override the preset's batch size")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, help="timed repetitions per measurement (median; default: the preset's)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["default"],
                        help="default: the products collect_statistics picks (TF32 for half-precision models on "
                        "CUDA); float32: TF32 off")
    parser.add_argument("--skip-solve", action="store_true", help="leave out the solve benchmarks")
    parser.add_argument("--solvers", nargs="+", choices=SOLVERS, default=list(SOLVERS),
                        help="the decompositions the solve benchmark times (default: all)")
    parser.add_argument("--solve-only", action="store_true", help="only the solve benchmark (and the line search)")
    parser.add_argument("--skip-line-search", action="store_true", help="leave out the grow_model line search")
    parser.add_argument("--solve-heads", type=int, help="heads in the solve benchmark (default: all of the config)")
    parser.add_argument("--solve-width", type=int, help="width d_e + 1 in the solve benchmark (default: the config's)")
    parser.add_argument("--solve-qk-dim", type=int, help="Q/K width before growth in the solve benchmark (p = 8)")
    args = parser.parse_args()
    preset = dict(PRESETS[args.preset])
    if args.batch_size:
        preset["batch_size"] = args.batch_size
    rounds = args.rounds or preset["rounds"]
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    device = torch.device("cuda" if args.preset == "gpu" else "cpu")
    dtype = getattr(torch, preset["dtype"])
    config = GPT2Config(
        n_embd=preset["n_embd"], n_layer=preset["n_layer"], n_head=preset["n_head"],
        n_positions=max(preset["seq_lens"] + (args.seq_lens or [])),
        vocab_size=preset["vocab_size"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(device=device, dtype=dtype)
    model.set_attn_implementation("sdpa")
    adapter = hf_grow.get_adapter(model)
    methods = args.methods or ["chunked", "reference"] + (["triton"] if triton_available(device) else [])
    name = torch.cuda.get_device_name() if device.type == "cuda" else (platform.processor() or platform.machine())
    print(f"# {datetime.date.today()}, {name}, torch {torch.__version__}, {preset['dtype']}, "
          f"GPT-2 n_embd {config.n_embd} x {config.n_layer} layers x {config.n_head} heads, "
          f"batch {preset['batch_size']}")
    header = (
        f"{'seq':>5} {'method':<14} {'train s':>8} {'stats s':>8} {'time x':>7} {'floor x':>7} {'meas/floor':>10} "
        f"{'train GiB':>9} {'stats GiB':>9} {'mem x':>6}"
    )
    print(header)
    print("-" * len(header))
    for seq_len in [] if args.solve_only else args.seq_lens or preset["seq_lens"]:
        input_ids = torch.randint(0, config.vocab_size, (preset["batch_size"], seq_len), device=device)
        batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}

        def train_step() -> None:
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()

        try:
            train_time, train_memory = measure(train_step, device, rounds)
        except torch.OutOfMemoryError:
            print(f"{seq_len:>5} {'train':<14} OOM")
            continue
        model.zero_grad(set_to_none=True)
        training, extra = flops(config, seq_len)
        floor = (training + extra) / training
        runs = [(method, None, precision) for method in methods for precision in args.precisions]
        runs += [("chunked", block, "default") for block in args.query_blocks]
        for method, query_block, precision in runs:
            label = precision_label(method, precision) if query_block is None else f"chunked q={query_block}"

            def statistics_step() -> None:
                collect_statistics(model, [batch], adapter, method=method, query_block=query_block,
                                   tf32=PRECISIONS[precision])

            try:
                stats_time, stats_memory = measure(statistics_step, device, rounds)
            except torch.OutOfMemoryError:
                print(f"{seq_len:>5} {label:<14} {train_time:>8.3f} {'OOM':>8}")
                torch.cuda.empty_cache()
                continue
            ratio = stats_time / train_time
            memory = (
                "" if train_memory is None
                else f"{train_memory:>9.2f} {stats_memory:>9.2f} {stats_memory / train_memory:>6.2f}"
            )
            print(f"{seq_len:>5} {label:<14} {train_time:>8.3f} {stats_time:>8.3f} {ratio:>7.2f} {floor:>7.2f} "
                  f"{ratio / floor:>10.2f} {memory}", flush=True)

    if not args.solve_only:
        accuracy_benchmark(model, adapter, methods, args.precisions, (args.seq_lens or preset["seq_lens"])[0], device)
    if args.skip_solve:
        return
    solve_benchmark(args.solve_heads or config.n_layer * config.n_head, args.solve_width or config.n_embd + 1,
                    args.solve_qk_dim or config.n_embd // config.n_head, device, args.solvers)
    if args.skip_line_search:
        return
    seq_lens = args.seq_lens or preset["seq_lens"]
    seq_len = seq_lens[min(1, len(seq_lens) - 1)]  # the second length given (the only one, if one)
    generator = torch.Generator(device=device).manual_seed(1)
    batches = []
    for _ in range(4):
        input_ids = torch.randint(
            0, config.vocab_size, (preset["batch_size"], seq_len), device=device, generator=generator
        )
        batches.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids})
    statistics = hf_grow.collect_statistics(model, batches[:2], adapter)
    print(f"\n# grow_model at seq {seq_len}, 2 statistics + 2 held-out batches, p=8")
    for solver in ("eigh", "subspace", "svd"):
        grown = hf_grow.grow_model(
            model, None, p=8, statistics=statistics, eval_dataloader=batches[2:], solver=solver,
            measure_realized_gains=False,
        )
        report = grown.growth_report
        seconds = report.seconds
        print(
            f"{solver:>8}: {len(report.line_search)} line-search points, solve + line search "
            f"{seconds['solve'] + seconds['line_search']:.2f} s, step {report.step_size:.4g}, "
            f"held-out loss {report.eval_loss_before:.6f} -> {report.eval_loss_after:.6f}",
            flush=True,
        )


def accuracy_benchmark(
    model: GPT2LMHeadModel, adapter, methods: list[str], precisions: list[str], seq_len: int, device: torch.device
) -> None:
    """Each method's M (as users get it: float32 products, TF32 for half-precision models; "float32": TF32 off)
    against the reference method with float64 products, on a batch with right- and left-padded sequences."""
    generator = torch.Generator(device=device).manual_seed(2)
    input_ids = torch.randint(0, model.config.vocab_size, (4, seq_len), device=device, generator=generator)
    mask = torch.ones_like(input_ids)
    mask[1, seq_len // 2 :] = 0
    mask[2, : seq_len // 3] = 0
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}
    exact = collect_statistics(model, [batch], adapter, method="reference", compute_dtype=torch.float64)
    print(f"\n# accuracy at seq {seq_len} (batch 4, padding): relative Frobenius difference of M to the reference "
          "in float64")
    for method, precision in [(method, precision) for method in methods for precision in precisions]:
        statistics = collect_statistics(model, [batch], adapter, method=method, tf32=PRECISIONS[precision])
        errors = [
            float((ours - theirs).norm() / theirs.norm()) for ours, theirs in zip(statistics.gradients, exact.gradients)
        ]
        print(f"{precision_label(method, precision):>14}: max over layers {max(errors):.2e}, "
              f"mean {sum(errors) / len(errors):.2e}", flush=True)


def solve_benchmark(heads: int, width: int, qk_dim: int, device: torch.device, solvers: list[str]) -> None:
    """The decomposition at each line-search step, for ``heads`` whitened targets ``Z - lam P`` of ``width``:
    Z of rank ``qk_dim``, P with a decaying spectrum (as gradients have), lam over a line search's sequence."""
    generator = torch.Generator(device=device).manual_seed(0)
    options = dict(generator=generator, device=device, dtype=torch.float64)
    bilinear = torch.randn(heads, width, qk_dim, **options) @ torch.randn(heads, width, qk_dim, **options).mT
    left = torch.linalg.qr(torch.randn(heads, width, width, **options)).Q
    right = torch.linalg.qr(torch.randn(heads, width, width, **options)).Q
    decay = torch.arange(1, width + 1, device=device, dtype=torch.float64) ** -0.5
    direction = (left * decay) @ right.mT
    bilinear = bilinear / bilinear.norm(dim=(-2, -1), keepdim=True)
    direction = direction / direction.norm(dim=(-2, -1), keepdim=True)
    rank = qk_dim + 8
    steps = [1e-2 / 4**k for k in range(4)] + [1e-2 * 4, 1e-2 * 16, 1e-2 * 8, 1e-2 * 11.3]  # as a line search walks
    print(f"\n# solve: decomposition of {heads} whitened heads of {width}x{width} (float64) truncated to rank {rank}, "
          f"at {len(steps)} line-search steps; auto picks {linalg.choose_method(width, rank)}")
    print(f"{'method':<16} {'s/step':>8} {'vs eigh':>8} {'max excess error':>17}")
    targets = [bilinear - lam * direction for lam in steps]
    # The optimum's squared error from the full SVD, on the host (a GPU's batched SVD of 144 769^2 heads: minutes).
    optima = [linalg.decompose_whitened(target.cpu(), None, "svd").singular_values[..., rank:].square().sum(dim=-1)
              .to(device) for target in targets]
    results = {}
    for name in solvers:
        method, warm = SOLVERS[name]
        start, seconds, excess = None, 0.0, 0.0
        for target, optimum in zip(targets, optima):
            synchronize(device)
            tick = time.perf_counter()
            decomposition = linalg.decompose_whitened(target, None, method, rank=rank, start=start if warm else None)
            factors = decomposition.truncate(rank)
            synchronize(device)
            seconds += time.perf_counter() - tick
            start = decomposition.basis
            error = (target - factors.product).square().sum(dim=(-2, -1))
            excess = max(excess, float(((error - optimum) / optimum).max()))
        results[name] = seconds / len(steps)
        ratio = results["eigh"] / results[name] if "eigh" in results else float("nan")
        print(f"{name:<16} {results[name]:>8.3f} {ratio:>7.2f}x {excess:>17.1e}", flush=True)


if __name__ == "__main__":
    main()
