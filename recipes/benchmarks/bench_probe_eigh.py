"""Benchmark: the line search's per-step decompositions, a full eigh against a subset eigensolver.

At every step it tries, "refactor" growth takes the top w singular directions (w the grown width) of each head's
compact core (`hf_grow.compact.CompactTarget.decompose`): a full float64 `torch.linalg.eigh` of the k x k Gram
matrix, k = d_k + s (424 at GPT-2 small, where w = 72). LAPACK's subset drivers (scipy's ``eigh(...,
subset_by_index=...)``: dsyevr, dsyevx) compute only the top w eigenpairs, but every driver first reduces the
whole matrix to tridiagonal form, O(k^3) either way. This times both on ``--heads`` random Gram matrices with a
decaying spectrum (the timings do not depend on the spectrum's values), in one thread and split over two Python
threads as `hf_grow.lapack.per_matrix` splits torch's, and checks that they agree on the top w.

    python recipes/benchmarks/bench_probe_eigh.py               # GPT-2 small's shape, ~1 minute on 2 CPU cores
    python recipes/benchmarks/bench_probe_eigh.py --k 1056 --w 136 --heads 32   # a Llama-3.2-1B layer's shape

Needs scipy (installed with the test extras, through sentence-transformers).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import scipy
import scipy.linalg
import torch

from hf_grow.lapack import batched_eigh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=424, help="the cores' width d_k + s")
    parser.add_argument("--w", type=int, default=72, help="the eigenpairs kept (the grown width)")
    parser.add_argument("--heads", type=int, default=144, help="the cores decomposed per step (layers x heads)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; the table gives the fastest")
    args = parser.parse_args()
    k, w = args.k, args.w
    generator = torch.Generator().manual_seed(0)
    decay = torch.logspace(0, -6, k, dtype=torch.float64)
    cores = torch.randn(args.heads, k, k, dtype=torch.float64, generator=generator) * decay
    grams = cores @ cores.mT

    def subset(driver: str, threads: int) -> Callable[[], list]:
        def one(gram: torch.Tensor) -> tuple:
            return scipy.linalg.eigh(gram.numpy(), subset_by_index=(k - w, k - 1), driver=driver, check_finite=False)

        def run() -> list:
            with ThreadPoolExecutor(threads) as pool:
                return list(pool.map(one, grams))

        return run

    def full(threads: int) -> Callable[[], tuple]:
        def run() -> tuple:
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                return batched_eigh(grams)
            finally:
                torch.set_num_threads(before)

        return run

    print(f"# bench_probe_eigh {datetime.date.today()} torch {torch.__version__} scipy {scipy.__version__} "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.heads} Gram matrices "
          f"{k} x {k} (float64), top {w} eigenpairs")
    arms = {
        "torch.linalg.eigh, all (the library)": full,
        "scipy dsyevr, top w": lambda threads: subset("evr", threads),
        "scipy dsyevx, top w": lambda threads: subset("evx", threads),
    }
    print(f"{'method':<40}{'1 thread (s)':>14}{'2 threads (s)':>15}")
    results = {}
    for name, make in arms.items():
        row = f"{name:<40}"
        for threads in (1, 2):
            run = make(threads)
            run()  # warm-up
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                results[name] = run()
                seconds.append(time.perf_counter() - start)
            row += f"{min(seconds):>{14 if threads == 1 else 15}.2f}"
        print(row, flush=True)
    values, vectors = results["torch.linalg.eigh, all (the library)"]
    for name in list(arms)[1:]:
        value_error = max(
            float((values[i, -w:] - torch.from_numpy(pair[0])).abs().max() / values[i, -1])
            for i, pair in enumerate(results[name])
        )
        projector_error = max(
            float((vectors[i, :, -w:] @ vectors[i, :, -w:].mT - (lambda v: v @ v.mT)(torch.from_numpy(pair[1])))
                  .abs().max())
            for i, pair in enumerate(results[name])
        )
        print(f"{name}: top-w eigenvalues within {value_error:.1e} of the largest, their projector within "
              f"{projector_error:.1e} of the full eigh's")


if __name__ == "__main__":
    main()
