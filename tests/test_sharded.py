"""Layers shared out among 2 and 3 CPU processes (gloo): each layer's M is reduced to its owner, which alone solves
it; every process ends with the same grown model as one process reading all the data, holding a share of M."""

import dataclasses
import gc
import math
import os

import pytest
import torch
from torch import distributed as dist
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_grow import GrowthConfig, cli, collect_statistics, get_adapter, grow_model
from hf_grow.cli import memory as cli_memory
from hf_grow.distributed import OtherProcessFailed, Processes
from hf_grow.growth import GrowthProblem
from hf_grow.growth import problem as problem_module
from hf_grow.growth.memory_plan import plan_memory
from hf_grow.growth.sharding import SKELETON_FIELDS, Sharding, moved, plan_owners, solve_cost
from hf_grow.statistics import statistics_bytes

from conftest import lm_batches, tiny_gpt2_config, trained_on_text
from test_distributed import run_processes
from test_training_distributed import one_thread


ONE_CANDIDATE = dict(truncation="whitened", step_mode="per_head")
#: The grown model's: each layer's step searched too (every layer's weights asked of its owner, layer by layer),
#: bracketed by the full-rank update (computed by the owners too).
EVERY_STEP = dict(truncation="whitened", step_mode="coordinate", search="fast")
#: The grown model: 5 layers, shared unevenly among 2 or 3 processes, grown in passes of 2 layers.
GROW = dict(n_layer=5, n_embd=32, n_head=4)
#: The model whose held M is counted: 12 layers of 2 heads, one per pass, kept (no solve frees them), with its
#: cross-fitting halves, in offloaded files.
COUNT = dict(n_layer=12, n_embd=16, n_head=2)


@pytest.mark.parametrize(("layers", "world_size"), [(5, 2), (5, 3), (12, 2), (12, 3), (2, 3), (1, 1), (7, 4)])
def test_the_plan_gives_each_layer_one_owner_and_balances_the_processes(layers, world_size):
    owners = plan_owners([1.0] * layers, world_size)
    assert len(owners) == layers and all(0 <= owner < world_size for owner in owners)
    counts = [owners.count(rank) for rank in range(world_size)]
    assert max(counts) - min(counts) <= 1  # equal costs: as even as the count allows
    assert owners == plan_owners([1.0] * layers, world_size)  # the same plan on every process
    if layers == 5 and world_size == 2:
        assert owners == [0, 1, 0, 1, 0]


def test_the_plan_balances_unequal_costs_and_refuses_bad_input():
    costs = [solve_cost(heads, 65) for heads in (8, 1, 1, 1, 1, 1, 1, 1, 1)]  # one layer as costly as the others
    owners = plan_owners(costs, 2)
    assert owners[0] == 0 and owners[1:] == [1] * 8
    assert plan_owners([], 3) == []
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan_owners([1.0], 0)
    with pytest.raises(ValueError, match="non-negative"):
        plan_owners([1.0, float("nan")], 2)


def test_the_memory_plan_of_a_process_counts_the_group_in_flight_and_its_own_solved_layers():
    """8 layers in passes of 2: every process sums the 2 layers of M in flight (then reduced to their owners and
    freed when solved), and keeps the solved form of its own layers only: 8 in one process, 2 in each of 4."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    adapter = get_adapter(model)
    config = GrowthConfig(p=8, truncation="auto", memory_budget=statistics_bytes(8, 4, 64, 3))
    plans = {processes: plan_memory(model, adapter, config, batch_size=2, seq_len=16, eval_tokens=256,
                                    processes=processes) for processes in (1, 4)}  # 2 held-out batches each of 4
    one_layer = 4 * 65 * 65 * 8
    for processes in (1, 4):
        assert all(plans[processes].stages[index].terms["M"] == 2 * one_layer for index in (1, 2))
    solved = {processes: plans[processes].stages[2].terms["compact solve"] for processes in (1, 4)}
    assert solved[1] > 0 and solved[4] * 4 == solved[1]
    assert "per process of 4" in plans[4].table() and "per process" not in plans[1].table()


def test_a_dry_run_plans_one_process_of_world_size_without_starting_any(tmp_path, tmp_path_factory, monkeypatch,
                                                                       capsys):
    """``WORLD_SIZE=4 hf-grow ... --dry-run`` on a login node: the plan of one of 4 processes, no process group."""
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64).save_pretrained(tmp_path)
    arguments = [str(tmp_path), "--p", "8", "--data", str(tmp_path / "none-*.txt"), "--seq-len", "64", "--dry-run",
                 "--device", "cpu", "--truncation", "auto", "--memory-budget", str(statistics_bytes(8, 4, 64, 3))]
    tables = {}
    for world_size in ("1", "4"):
        monkeypatch.setenv("WORLD_SIZE", world_size)
        assert cli.main(arguments) == 0
        tables[world_size] = capsys.readouterr().out
    assert "per process of 4" in tables["4"] and "per process" not in tables["1"]
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "1")  # torchrun's other processes: the plan is printed once, by the first
    assert cli.main(arguments) == 0 and capsys.readouterr().out == ""
    monkeypatch.delenv("RANK")

    # The processes launched on one machine share its memory and the disk of --offload-dir: a plan that fits one
    # process's share of a machine of 4 is refused there, and goes on on a machine of its own.
    offload = tmp_path_factory.mktemp("offload")
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(tmp_path))
    config = GrowthConfig(p=8, truncation="auto", memory_budget=statistics_bytes(8, 4, 64, 3), offload_dir=str(offload))
    disk = plan_memory(model, get_adapter(model), config, batch_size=1, seq_len=64, eval_tokens=256, processes=4).disk
    usage = cli_memory.shutil.disk_usage(offload)
    monkeypatch.setattr(cli_memory.shutil, "disk_usage", lambda path: usage._replace(free=2 * disk))
    peaks = []
    fits = cli_memory._fits
    monkeypatch.setattr(cli_memory, "_fits", lambda plan, *args: peaks.append(plan.peak_host) or fits(plan, *args))
    on_disk = [*arguments, "--offload-dir", str(offload)]
    assert cli.main(on_disk) == 0
    for local, status in (("1", 0), ("4", 2)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        monkeypatch.setattr(cli_memory, "_free_memory", lambda device: (2 * peaks[0], 0))
        assert cli.main(arguments) == status
        monkeypatch.setattr(cli_memory, "_free_memory", lambda device: (8 * peaks[0], 0))
        assert cli.main(on_disk) == status
    errors = capsys.readouterr().err.strip().splitlines()
    assert "of host memory" in errors[-2] and "is free for each of the 4 processes on this machine" in errors[-2]
    assert "M needs about" in errors[-1] and "is free there for each of the 4 processes on this machine" in errors[-1]


def test_one_process_owns_and_shares_everything():
    """World size 1: every layer owned here, shared as it is (the same object, no copy)."""
    sharding = Sharding.planned(Processes(), [1.0, 2.0])
    solved = {"norms": (torch.ones(2), torch.zeros(2))}
    assert sharding.owners == (0, 0) and sharding.owns(1)
    assert sharding.share(1, solved, torch.device("cpu")) is solved
    assert moved(solved, torch.device("cpu"))["norms"][0] is solved["norms"][0]


def held_m_bytes(heads: int, width: int) -> int:
    """Bytes of the live tensors shaped like one layer's M, (heads, d, d), each storage counted once (garbage not
    yet collected is not held: collected first, so that the count does not depend on when the collector ran)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor and tuple(obj.shape) == (heads, width, width):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def peak_held_m(model, batches, folder, accelerator=None, owners=None) -> tuple[int, object]:
    """The most M bytes held at any batch of a collection in passes of one layer, with halves, offloaded to
    ``folder`` and kept (not solved), and the statistics."""
    heads, width = model.config.n_head, model.config.n_embd + 1
    peaks = []

    def counting_loss(m, batch):
        peaks.append(held_m_bytes(heads, width))
        return m(**batch).loss

    budget = statistics_bytes(model.config.n_layer, heads, model.config.n_embd, 3)  # C, M of one layer, its half
    statistics = collect_statistics(
        model, batches, get_adapter(model), loss_fn=counting_loss, memory_budget=budget, accelerator=accelerator,
        owners=owners, cross_fit=True, offload_dir=folder,
    )
    return max(*peaks, held_m_bytes(heads, width)), statistics


def layer_tensors(value) -> list[torch.Tensor]:
    """The tensors of a solved layer but its norms and gain rates (`sharding.SKELETON_FIELDS`)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [tensor for field in dataclasses.fields(value) if field.name not in SKELETON_FIELDS
                for tensor in layer_tensors(getattr(value, field.name))]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in layer_tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in layer_tensors(item)]
    return []


def sharded_worker(rank: int, world_size: int, grow_state: dict, count_state: dict, data: dict, folder: str) -> None:
    """One process: a sharded growth of its shard, its held M while collecting, a failure mid-pass."""
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    shard, eval_shard = data["batches"][rank::world_size], data["eval"][rank::world_size]
    model = GPT2LMHeadModel(tiny_gpt2_config(**GROW))
    model.load_state_dict(grow_state)
    grown = grow_model(accelerator.prepare(model), shard, p=8, eval_dataloader=eval_shard, accelerator=accelerator,
                       memory_budget=data["budget"], **EVERY_STEP)

    counted = GPT2LMHeadModel(tiny_gpt2_config(**COUNT))
    counted.load_state_dict(count_state)
    owners = plan_owners([1.0] * COUNT["n_layer"], world_size)
    os.makedirs(f"{folder}/offload{rank}")
    peak, statistics = peak_held_m(counted, shard, f"{folder}/offload{rank}", accelerator, owners)
    held = [layer for layer, gradient in enumerate(statistics.gradients) if gradient is not None]
    # The solve of those statistics: each process keeps the solved form of its own layers, a skeleton of the others.
    sharding = Sharding.planned(Processes(accelerator), [1.0] * COUNT["n_layer"])
    problem = GrowthProblem(counted, get_adapter(counted), statistics, [16] * COUNT["n_layer"], "whitened", 1e-6,
                            "eigh", sharding=sharding)
    solved_on = [sorted({tensor.device.type for tensor in layer_tensors(part)}) for part in problem.layers]
    solved_weights = problem.weights(0.5)
    # Growth from those statistics (each process holds its own layers' M), and from statistics whose owners are
    # not those growth solves on: refused on every process, before any solve.
    from_shares = grow_model(counted, None, statistics=statistics, eval_dataloader=eval_shard, accelerator=accelerator,
                             p=8, step_size=0.5, **ONE_CANDIDATE)
    others = collect_statistics(counted, shard, get_adapter(counted), accelerator=accelerator,
                                owners=[(owner + 1) % world_size for owner in owners])
    try:
        grow_model(counted, None, statistics=others, eval_dataloader=eval_shard, accelerator=accelerator, p=8,
                   step_size=0.5, **ONE_CANDIDATE)
        other_owners = None
    except (ValueError, OtherProcessFailed) as error:
        other_owners = f"{type(error).__name__}: {error}"

    calls = []

    def failing_in_second_pass(m, batch):  # on the last process only, after its first pass over its shard
        calls.append(None)
        if rank == world_size - 1 and len(calls) > len(shard):
            raise RuntimeError("a bad batch")
        return m(**batch).loss

    try:
        grow_model(model, shard, p=8, eval_dataloader=eval_shard, accelerator=accelerator,
                   loss_fn=failing_in_second_pass, memory_budget=data["budget"], **ONE_CANDIDATE)
        failure = None
    except (RuntimeError, OtherProcessFailed) as error:
        failure = f"{type(error).__name__}: {error}"
    accelerator.wait_for_everyone()
    torch.save({"state_dict": grown.state_dict(), "report": grown.growth_report.to_dict(), "peak": peak,
                "held": held, "failure": failure, "summed": statistics.gradients,
                "halves": (statistics.half_gradients, statistics.half_loss_weight), "solved_on": solved_on,
                "solved_weights": solved_weights, "from_shares": from_shares.state_dict(),
                "other_owners": other_owners}, f"{folder}/rank{rank}.pt")
    accelerator.end_training()


@pytest.fixture(scope="module")
def sharded_setup(stdlib_bytes, tmp_path_factory):
    torch.manual_seed(0)
    grow_state = trained_on_text(GPT2LMHeadModel(tiny_gpt2_config(**GROW)), stdlib_bytes).state_dict()
    count_state = GPT2LMHeadModel(tiny_gpt2_config(**COUNT)).state_dict()
    data = {
        "batches": lm_batches(stdlib_bytes["stats"], 6, batch_size=2, seed=51),
        "eval": lm_batches(stdlib_bytes["eval"], 6, batch_size=2, seed=52),
        "budget": statistics_bytes(GROW["n_layer"], GROW["n_head"], GROW["n_embd"], 3),  # 2 layers of M a pass (+1)
    }
    alone = GPT2LMHeadModel(tiny_gpt2_config(**GROW))
    alone.load_state_dict(grow_state)
    with one_thread():  # as in the workers, so that the reference rounds as they do
        grown = grow_model(alone, data["batches"], p=8, eval_dataloader=data["eval"], memory_budget=data["budget"],
                           **EVERY_STEP)
        counted = GPT2LMHeadModel(tiny_gpt2_config(**COUNT))
        counted.load_state_dict(count_state)
        peak, statistics = peak_held_m(counted, data["batches"], tmp_path_factory.mktemp("offload"))
    return grow_state, count_state, data, grown, peak, statistics, counted


#: Report entries measured by running the float32 model: equal to its rounding (the grown weights are the float64
#: solve rounded to float32, from M summed in another order); every other number comes from the float64 solve.
MEASURED = {"eval_loss_before", "eval_loss_after", "loss", "realized_gain", "search_loss", "confirm_loss"}


def assert_same_report(found, expected, scale: float, path: str = "report") -> None:
    """Reports equal, wall times aside: the solve's numbers to float64 rounding (relative 1e-9), the measured
    losses and their differences to float32 rounding of a loss of size ``scale``."""
    key = path.rsplit(".", 1)[-1]
    if isinstance(expected, dict):
        assert found.keys() == expected.keys(), path
        for name in expected:
            if name != "seconds":
                assert_same_report(found[name], expected[name], scale, f"{path}.{name}")
    elif isinstance(expected, list):
        assert len(found) == len(expected), path
        for index, (item, other) in enumerate(zip(found, expected)):
            assert_same_report(item, other, scale, f"{path}[{index}]")
    elif isinstance(expected, float) and key in MEASURED:
        assert math.isclose(found, expected, rel_tol=1e-6, abs_tol=1e-6 * scale), (path, found, expected)
    elif isinstance(expected, float):
        assert math.isclose(found, expected, rel_tol=1e-9, abs_tol=1e-12), (path, found, expected)
    else:
        assert found == expected, path


@pytest.mark.parametrize("world_size", [2, 3])
def test_processes_sharing_the_layers_grow_like_one_and_hold_a_share_of_m(sharded_setup, tmp_path, world_size):
    grow_state, count_state, data, alone, alone_peak, alone_statistics, counted = sharded_setup
    run_processes(sharded_worker, (world_size, grow_state, count_state, data, str(tmp_path)), nprocs=world_size)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]

    # Every process: the same grown model bit for bit, and a complete report, that of one process.
    expected = alone.growth_report.to_dict()
    for result in results:
        assert all(torch.equal(tensor, results[0]["state_dict"][name]) for name, tensor in result["state_dict"].items())
        assert result["report"] == results[0]["report"] | {"seconds": result["report"]["seconds"]}
        assert_same_report(result["report"], expected, expected["eval_loss_before"])
    assert expected["step_size"] > 0 and expected["eval_loss_after"] < expected["eval_loss_before"]
    assert len(expected["layers"]) == 5 and all(layer["realized_gain"] is not None for layer in expected["layers"])
    kinds = {point["kind"] for point in expected["line_search"]}
    assert {"rank", "unconstrained"} <= kinds and any(kind.startswith("layer") for kind in kinds)
    # The grown weights: those of one process to float32 rounding (the stored weights round the float64 solve).
    state_dict = results[0]["state_dict"]
    for name, tensor in alone.state_dict().items():
        torch.testing.assert_close(state_dict[name], tensor, rtol=1e-5, atol=1e-6, msg=name)

    # Each layer's M is held by its owner only, equal to one process's sum, and so is its half: the sum over the
    # odd-numbered batches of each process's shard. No process holds more than its share.
    owners = plan_owners([1.0] * COUNT["n_layer"], world_size)
    odd = [batch for rank in range(world_size) for batch in data["batches"][rank::world_size][1::2]]
    odd_statistics = collect_statistics(counted, odd, get_adapter(counted), loss_fn=lambda m, batch: m(**batch).loss)
    for rank, result in enumerate(results):
        assert result["held"] == [layer for layer, owner in enumerate(owners) if owner == rank]
        half_gradients, half_loss_weight = result["halves"]
        assert half_loss_weight == odd_statistics.loss_weight
        for layer in range(COUNT["n_layer"]):
            if layer not in result["held"]:
                assert result["summed"][layer] is None and half_gradients[layer] is None
                continue
            for found, expected_m in ((result["summed"][layer], alone_statistics.gradients[layer]),
                                      (half_gradients[layer], odd_statistics.gradients[layer])):
                torch.testing.assert_close(found, expected_m, rtol=1e-12, atol=1e-12 * float(expected_m.abs().max()))
    peaks = [result["peak"] / alone_peak for result in results]
    assert max(peaks) <= {2: 0.6, 3: 0.45}[world_size], peaks  # 12 layers: 6 + 1 in flight, 4 + 1 in flight

    # Solved from them: the owner keeps a layer's solved form, the others its skeleton (meta tensors, no memory);
    # every process computes the same weights, those of one process solving all of it.
    problem = GrowthProblem(counted, get_adapter(counted), alone_statistics, [16] * COUNT["n_layer"], "whitened",
                            1e-6, "eigh")
    expected_weights = problem.weights(0.5)
    for rank, result in enumerate(results):
        assert result["solved_on"] == [["cpu"] if owner == rank else ["meta"] for owner in owners]
        for layer, (query, key) in expected_weights.items():
            found_query, found_key = result["solved_weights"][layer]
            assert torch.equal(found_query, results[0]["solved_weights"][layer][0])
            assert torch.equal(found_key, results[0]["solved_weights"][layer][1])
            # The scores' bilinear form (factors of near-equal singular values may rotate with M's last bits), to
            # the float32 rounding of the compact bases (`compact.BASIS_DTYPE`) that M's last bits can flip.
            expected_form = query @ key.mT
            torch.testing.assert_close(found_query @ found_key.mT, expected_form, rtol=0,
                                       atol=torch.finfo(torch.float32).eps * float(expected_form.abs().max()))

    # Grown from the shares: the model grown from one process's statistics, on every process.
    from_all = grow_model(counted, None, statistics=alone_statistics, eval_dataloader=data["eval"], p=8, step_size=0.5,
                          **ONE_CANDIDATE).state_dict()
    for rank, result in enumerate(results):
        for name, tensor in from_all.items():
            assert torch.equal(result["from_shares"][name], results[0]["from_shares"][name]), name
            torch.testing.assert_close(result["from_shares"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        # Shares of other owners: each process lacks the M of the layers it would solve.
        assert result["other_owners"].startswith("ValueError: the statistics hold no M for layers ["), result
        assert f"plan_owners([1.0] * {COUNT['n_layer']}, {world_size})" in result["other_owners"]

    # A process failing in the second pass: it raises its error, the others one clear error, none waits forever.
    failures = [result["failure"] for result in results]
    assert failures[-1] == "RuntimeError: a bad batch"
    assert failures[:-1] == ["OtherProcessFailed: 1 other process(es) failed; their error is in their output"] * (
        world_size - 1)


#: A Llama with grouped-query attention ("append" growth), 3 layers on 2 processes. With truncation "auto" each owner
#: solves both truncations' updates of its layers from their M (then freed).
LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
             pad_token_id=0)
#: Each process confirms on the last of its 2 held-out batches, one process on the last 2 of 4: the same batches.
AUTO = dict(truncation="auto", step_mode="per_head", confirm_fraction=0.5)


def llama_worker(rank: int, world_size: int, state_dict: dict, data: dict, folder: str) -> None:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.load_state_dict(state_dict)
    grown = grow_model(model, data["batches"][rank::world_size], p=8, eval_dataloader=data["eval"][rank::world_size],
                       accelerator=accelerator, memory_budget=data["budget"], **AUTO)

    def failing_solve(*args, **kwargs):
        raise ArithmeticError("a failed solve")

    own_layer_weights = GrowthProblem._own_layer_weights

    def failing_weights(self, layer, step_size, decompositions):  # a decomposition of the line search failing
        if step_size > 0:
            raise MemoryError("a failed decomposition")
        return own_layer_weights(self, layer, step_size, decompositions)

    failures = []
    # An owner whose solve fails, then one whose weights at a searched step fail (a process that survives its
    # error, as in a notebook): every process stops, none waits for the failed owner's layers.
    for patch in ((problem_module, "solve_layer", failing_solve), (GrowthProblem, "_own_layer_weights",
                                                                   failing_weights)):
        original = getattr(*patch[:2])
        if rank == world_size - 1:
            setattr(*patch)
        try:
            grow_model(model, data["batches"][rank::world_size], p=8,
                       eval_dataloader=data["eval"][rank::world_size], accelerator=accelerator, **AUTO)
            failures.append(None)
        except (ArithmeticError, MemoryError, OtherProcessFailed) as error:
            failures.append(type(error).__name__)
        setattr(*patch[:2], original)
    torch.save({"state_dict": grown.state_dict(), "report": grown.growth_report.to_dict(), "failure": failures},
               f"{folder}/rank{rank}.pt")
    accelerator.end_training()


def test_append_growth_with_both_truncations_on_two_processes_grows_like_one_process(stdlib_bytes, tmp_path):
    torch.manual_seed(0)
    model = trained_on_text(LlamaForCausalLM(LlamaConfig(**LLAMA)), stdlib_bytes)
    state_dict = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    data = {
        "batches": lm_batches(stdlib_bytes["stats"], 4, batch_size=2, seed=53),
        "eval": lm_batches(stdlib_bytes["eval"], 4, batch_size=2, seed=54),
        "budget": statistics_bytes(3, 4, 32, 2),  # one layer of M per pass
    }
    run_processes(llama_worker, (2, state_dict, data, str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    with one_thread():
        alone = grow_model(model, data["batches"], p=8, eval_dataloader=data["eval"], memory_budget=data["budget"],
                           **AUTO)
    expected = alone.growth_report.to_dict()
    assert [candidate["truncation"] for candidate in expected["candidates"]] == ["whitened", "frobenius"]
    assert expected["step_size"] > 0
    for result in results:
        assert all(torch.equal(tensor, results[0]["state_dict"][name]) for name, tensor in result["state_dict"].items())
        assert_same_report(result["report"], expected, expected["eval_loss_before"])
        for name, tensor in alone.state_dict().items():
            torch.testing.assert_close(result["state_dict"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # An owner's solve failing, then its weights at a searched step: its error there, one clear error on the other
    # process, no wait for its layers.
    assert [result["failure"] for result in results] == [["OtherProcessFailed"] * 2, ["ArithmeticError", "MemoryError"]]
