"""Two real CPU processes (gloo) growing together equal one process reading all the data."""

import copy
import os
import time

import pytest
import torch
import torch.multiprocessing as multiprocessing
from torch import distributed as dist
from transformers import GPT2LMHeadModel

from hf_grow import collect_statistics, get_adapter, grow_model
from hf_grow.distributed import OtherProcessFailed
from hf_grow.statistics import statistics_bytes

from conftest import lm_batches


WORLD_SIZE = 2
ONE_CANDIDATE = dict(truncation="whitened", step_mode="per_head")


def unread():
    """A dataloader that fails if read: what is refused must be refused before any data."""
    raise AssertionError("a batch was read")
    yield


def grow_on_shard(rank: int, config, state_dict: dict, batches: list, eval_batches: list, folder: str) -> None:
    """One process: its shard of the batches, the model wrapped by accelerate (DDP), growth, a failure drill."""
    os.environ.update(WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = GPT2LMHeadModel(config)
    model.load_state_dict(state_dict)
    wrapped = accelerator.prepare(model)
    shard, eval_shard = batches[rank::WORLD_SIZE], eval_batches[rank::WORLD_SIZE]
    # one candidate: under "auto" each process confirms on its own shard's last batches, not one process's (README)
    grown = grow_model(wrapped, shard, p=8, eval_dataloader=eval_shard, accelerator=accelerator, **ONE_CANDIDATE)
    # Without an accelerator, nothing is summed: the statistics of this process's shard alone.
    local = collect_statistics(model, shard, get_adapter(model))
    # Cross-fitting: each process's odd-numbered batches are its share of the half, summed over the processes.
    halves = collect_statistics(model, shard, get_adapter(model), accelerator=accelerator, cross_fit=True)
    # A process without statistics batches: the statistics, and how they were computed, are the others'.
    one_sided = collect_statistics(model, shard if rank == 1 else [], get_adapter(model), accelerator=accelerator)
    # A process that fails takes the others with it instead of leaving them waiting.
    def nan_on_rank_one(m, batch):
        return m(**batch).loss * (float("nan") if rank == 1 else 1.0)

    try:
        collect_statistics(model, shard, get_adapter(model), loss_fn=nan_on_rank_one, accelerator=accelerator)
        failure = None
    except (FloatingPointError, OtherProcessFailed) as error:
        failure = type(error).__name__
    # Options that differ between the processes: refused on every process before any data (not a hybrid model).
    refusals = []
    for options in ({"truncation": ("whitened", "frobenius")[rank]}, {"step_size": (None, 0.1)[rank]}):
        try:
            grow_model(wrapped, unread(), p=8, eval_dataloader=eval_shard, accelerator=accelerator,
                       **{**ONE_CANDIDATE, **options})
        except ValueError as error:
            refusals.append(str(error))
    try:
        collect_statistics(model, unread(), get_adapter(model), accelerator=accelerator, cross_fit=rank == 1)
    except ValueError as error:
        refusals.append(str(error))
    # What differs in the data or the model, or fails on one process alone: every process stops, none waits.
    drills = {}
    other_weights = copy.deepcopy(model)
    with torch.no_grad():
        other_weights.transformer.wte.weight.add_(1e-3 * rank)
    one_layer = statistics_bytes(model.config.n_layer, model.config.n_head, model.config.n_embd, 2)  # a layer a pass
    for name, drill in {
        "other weights": lambda: grow_model(other_weights, unread(), p=8, eval_dataloader=eval_shard,
                                            accelerator=accelerator, **ONE_CANDIDATE),
        "each process's statistics": lambda: grow_model(wrapped, None, p=8, statistics=local,
                                                        eval_dataloader=eval_shard, accelerator=accelerator,
                                                        **ONE_CANDIDATE),
        "p too wide on one": lambda: grow_model(wrapped, unread(), p=(8, 1000)[rank], eval_dataloader=eval_shard,
                                                accelerator=accelerator, **ONE_CANDIDATE),
        "an option refused on one": lambda: grow_model(wrapped, unread(), p=8, rtol=(1e-6, 1e-17)[rank],
                                                       eval_dataloader=eval_shard, accelerator=accelerator),
        "an offload folder refused on one": lambda: grow_model(  # each process's own folder
            wrapped, unread(), p=8, offload_dir=(None, "/nonexistent/hf_grow")[rank], eval_dataloader=eval_shard,
            accelerator=accelerator, **ONE_CANDIDATE),
        "one-shot on one": lambda: collect_statistics(model, iter(shard) if rank else shard, get_adapter(model),
                                                      accelerator=accelerator, memory_budget=one_layer),
    }.items():
        try:
            drill()
            drills[name] = None
        except (ValueError, OtherProcessFailed) as error:
            drills[name] = (type(error).__name__, str(error))
    # "auto" on held-out shards of other sizes: its choice, and its report, the same on every process
    uneven = eval_batches[:2] if rank == 0 else [*eval_batches[2:], *shard]
    auto = grow_model(wrapped, shard, p=8, eval_dataloader=uneven, accelerator=accelerator)
    # A process without held-out batches (fewer batches than processes): the others' held-out losses serve.
    no_eval_shard = grow_model(wrapped, shard, p=8, eval_dataloader=eval_shard if rank == 0 else [],
                               accelerator=accelerator, **ONE_CANDIDATE)
    accelerator.wait_for_everyone()
    result = {
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "state_dict": grown.state_dict(),
        "report": grown.growth_report.to_dict(),
        "local_batches": local.num_batches,
        "halves": (halves.half_gradients, halves.half_loss_weight),
        "failure": failure,
        "refusals": refusals,
        "no_eval_shard": no_eval_shard.state_dict(),
        "one_sided": (one_sided.method, one_sided.num_batches),
        "drills": drills,
        "auto": (auto.growth_report.to_dict(), auto.state_dict()),
    }
    torch.save(result, f"{folder}/rank{rank}.pt")
    accelerator.end_training()


def run_processes(function, args: tuple, timeout: float = 120.0, nprocs: int = WORLD_SIZE) -> None:
    """Spawn ``nprocs`` processes running ``function(rank, *args)``; fail on any error or after ``timeout``."""
    context = multiprocessing.start_processes(function, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {nprocs} processes did not finish within {timeout} s")
    assert all(process.exitcode == 0 for process in context.processes)


def test_two_processes_equal_one(trained_gpt2, stdlib_bytes, tmp_path):
    batches = lm_batches(stdlib_bytes["stats"], 6, batch_size=4, seed=31)
    eval_batches = lm_batches(stdlib_bytes["eval"], 4, batch_size=4, seed=32)
    state_dict = {name: tensor.clone() for name, tensor in trained_gpt2.state_dict().items()}
    run_processes(grow_on_shard, (trained_gpt2.config, state_dict, batches, eval_batches, str(tmp_path)), timeout=300)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    assert [result["num_processes"] for result in results] == [2, 2]
    assert [result["process_index"] for result in results] == [0, 1]
    assert [result["local_batches"] for result in results] == [3, 3]
    assert sorted(result["failure"] for result in results) == ["FloatingPointError", "OtherProcessFailed"]
    assert [result["one_sided"] for result in results] == [(results[1]["report"]["statistics_method"], 3)] * 2
    assert results[1]["report"]["statistics_method"]  # was "" on the process without batches

    alone = grow_model(trained_gpt2, batches, p=8, eval_dataloader=eval_batches, **ONE_CANDIDATE)
    expected = alone.growth_report
    for result in results:
        report = result["report"]
        assert report["statistics_tokens"] == expected.statistics_tokens == 6 * 4 * 64
        assert report["statistics_batches"] == 6 and report["eval_weight"] == expected.eval_weight
        assert report["step_size"] == pytest.approx(expected.step_size, rel=1e-9)
        # The weights come from float64 sums taken in another order: the same function to float32 rounding.
        # A head's query/key factors are unique only up to an invertible map (factors of near-equal singular
        # values may rotate), so what they compute is compared, and every other weight directly.
        assert report["eval_loss_after"] == pytest.approx(expected.eval_loss_after, rel=1e-6)
        assert report["eval_loss_after"] < report["eval_loss_before"]
        for name, tensor in alone.state_dict().items():
            if "c_attn" not in name:
                torch.testing.assert_close(result["state_dict"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        same_architecture = copy.deepcopy(alone)
        same_architecture.load_state_dict(result["state_dict"])
        with torch.no_grad():
            for batch in eval_batches:
                torch.testing.assert_close(
                    same_architecture(**batch).logits, alone(**batch).logits, rtol=1e-4, atol=1e-4
                )
    odd = collect_statistics(trained_gpt2, [batches[2], batches[3]], get_adapter(trained_gpt2))  # shards' second
    for result in results:
        half_gradients, half_loss_weight = result["halves"]
        assert half_loss_weight == odd.loss_weight
        for half, expected_half in zip(half_gradients, odd.gradients):
            torch.testing.assert_close(half, expected_half, rtol=1e-12, atol=1e-12 * float(expected_half.abs().max()))
    # Every process returns the same model, bit for bit.
    for name, tensor in results[0]["state_dict"].items():
        assert torch.equal(tensor, results[1]["state_dict"][name]), name
    # Options that differ: the same refusal on every process, the one that differs naming what.
    for result in results:
        assert len(result["refusals"]) == 3
        assert all("differ between the processes" in refusal for refusal in result["refusals"])
    assert "truncation 'frobenius' here, 'whitened' on the main process" in results[1]["refusals"][0]
    assert "step_size 0.1 here, None on the main process" in results[1]["refusals"][1]
    assert "cross_fit True here, False on the main process" in results[1]["refusals"][2]
    assert "(on 1 other process(es))" in results[0]["refusals"][0]
    drills = [result["drills"] for result in results]
    other_weights, statistics = (drill["other weights"] for drill in drills), (
        drill["each process's statistics"] for drill in drills)
    assert all(error[0] == "ValueError" and "the models' weights differ between the processes" in error[1]
               and "load the same checkpoint on every process" in error[1] for error in other_weights)
    assert all(error[0] == "ValueError" and "the statistics given differ between the processes" in error[1]
               for error in statistics)  # collected by each process on its shard alone: each shard's, not the sum
    for drill, failing in (("p too wide on one", "ValueError"), ("one-shot on one", "ValueError"),
                           ("an option refused on one", "ValueError"),
                           ("an offload folder refused on one", "ValueError")):
        assert [drills[0][drill][0], drills[1][drill][0]] == ["OtherProcessFailed", failing], drill
    assert "one-shot iterator" in drills[1]["one-shot on one"][1]
    (report, weights), (other_report, other_weights) = (result["auto"] for result in results)
    assert report["line_search_passes"] == other_report["line_search_passes"]  # from each process's own count
    assert {key for key in report if report[key] != other_report[key]} <= {"seconds"}
    assert all(torch.equal(tensor, other_weights[name]) for name, tensor in weights.items())
    # A process without held-out batches: the line search on the other's, as one process on those alone.
    alone = grow_model(trained_gpt2, batches, p=8, eval_dataloader=eval_batches[0::2], **ONE_CANDIDATE)
    same_architecture.load_state_dict(results[1]["no_eval_shard"])
    assert torch.equal(results[0]["no_eval_shard"]["transformer.h.0.attn.c_attn.weight"],
                       results[1]["no_eval_shard"]["transformer.h.0.attn.c_attn.weight"])
    with torch.no_grad():
        for batch in eval_batches:
            torch.testing.assert_close(same_architecture(**batch).logits, alone(**batch).logits, rtol=1e-4, atol=1e-4)
