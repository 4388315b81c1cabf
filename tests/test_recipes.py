"""The benchmark recipes' own pieces: the retrieval task is learnable and growth runs through train_variant."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes", "benchmarks"))
from bench_bottleneck import retrieval_task  # noqa: E402
from progressive_gpt2 import Variant, train_variant  # noqa: E402


@pytest.fixture(scope="module")
def task():
    return retrieval_task(keys=16, values=4, pairs=8, n_embd=32, n_head=1, batch_size=32, eval_batches=1)


def test_retrieval_labels_are_the_value_stored_under_the_query(task):
    """A wide enough head learns the lookup almost perfectly: the labels are consistent with the inputs."""
    torch.manual_seed(0)
    run = train_variant(Variant("fixed-large", 8), task, steps=150, lr=3e-3, warmup=10, eval_every=150, log=lambda _: None)
    assert run.curve[-1].metrics["accuracy"] >= 0.9
    assert run.final_loss < 0.5 * run.curve[0].eval_loss


@pytest.mark.parametrize("mode", ["append", "zero"])
def test_growth_inside_train_variant_preserves_the_held_out_loss(task, mode):
    """zero-init widening keeps the function exactly; append's line search never takes a step that is worse on
    its own held-out batches (step 0 is among its candidates)."""
    run = train_variant(Variant("grown", 2, mode, {10: 8}), task, steps=12, lr=3e-3, warmup=2, eval_every=6, log=lambda _: None)
    (growth,) = run.growths
    assert growth.qk_dims == [8]
    if mode == "zero":
        assert growth.eval_loss_after == pytest.approx(growth.eval_loss_before, abs=1e-5)
    else:
        assert growth.search_loss_after <= growth.search_loss_before
    assert run.overhead_flops > 0 if mode == "append" else run.overhead_flops == 0
