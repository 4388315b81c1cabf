"""Growth during training with 2 CPU processes (gloo, DDP): equal weights everywhere, one process's loss curve."""

import contextlib
import copy
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import distributed as dist

from hf_grow import GrowthCallback, GrownGPT2LMHeadModel, grow_in_training, grow_model

from conftest import lm_batches, trainer_arguments, trainer_dataset
from conftest import train as train_alone
from test_distributed import WORLD_SIZE, run_processes
from test_training import grown_config


def join_group(rank: int, folder: str) -> None:
    os.environ.update(WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run one torch thread, as the workers do, so that the reference rounds as they do."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_steps(model, optimizer, batches, rank: int, world_size: int, accelerator=None) -> list[float]:
    """One optimizer step per global batch, this process on its rows; the losses of the global batches."""
    losses = []
    model.train()
    for batch in batches:
        rows = len(batch["input_ids"]) // world_size
        shard = {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()}
        loss = model(**shard).loss
        (loss.backward() if accelerator is None else accelerator.backward(loss))
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        losses.append(float(loss if accelerator is None else accelerator.reduce(loss, reduction="mean")))
    return losses


def grow_between_steps(rank, world_size, state_dict, train, stats, search, accelerator=None):
    """3 AdamW steps, growth d_k 8 -> 16 (append, solved), 3 more steps: losses, weights after growth and at the end."""
    model = GrownGPT2LMHeadModel(grown_config(8))
    model.load_state_dict(state_dict)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    losses = train_steps(model, optimizer, train[:3], rank, world_size, accelerator)
    plain = model.module if accelerator is not None else model
    # One candidate: under "auto" each process confirms on its own shard (README). No cross-fitting: its halves
    # are each process's odd- and even-numbered batches, other halves than one process's; M's sum is the same.
    report = grow_in_training(
        model, optimizer, stats[rank::world_size], 8, eval_dataloader=search[rank::world_size], accelerator=accelerator,
        truncation="whitened", step_mode="per_head", cross_fit=False,
    )
    grown = {name: tensor.clone() for name, tensor in plain.state_dict().items()}
    losses += train_steps(model, optimizer, train[3:], rank, world_size, accelerator)
    return {"losses": losses, "grown": grown, "final": plain.state_dict(), "report": report.to_dict()}


def accelerate_worker(rank: int, state_dict, train, stats, search, folder: str) -> None:
    join_group(rank, folder)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    result = grow_between_steps(rank, WORLD_SIZE, state_dict, train, stats, search, accelerator)
    torch.save(result, f"{folder}/rank{rank}.pt")
    accelerator.end_training()


def assert_same_on_every_process(results: list[dict], key: str) -> None:
    for name, tensor in results[0][key].items():
        assert torch.equal(tensor, results[1][key][name]), f"{key}: {name} differs between processes"


def test_accelerate_loop_grows_under_ddp_like_one_process(stdlib_bytes, tmp_path):
    torch.manual_seed(0)
    model = GrownGPT2LMHeadModel(grown_config(8))
    train = lm_batches(stdlib_bytes["train"], 6, batch_size=8, seed=41)
    stats = lm_batches(stdlib_bytes["stats"], 4, batch_size=4, seed=42)
    search = lm_batches(stdlib_bytes["eval"], 2, batch_size=4, seed=43)
    # trained a little first: at random weights the first steps' gains were float32 rounding, which the line search
    # takes for ties, and the last bits in which the processes' sums differ decided between step 0 and a step
    train_alone(model, torch.optim.AdamW(model.parameters(), lr=3e-3), lm_batches(stdlib_bytes["train"], 10, seed=40))
    state_dict = model.state_dict()
    run_processes(accelerate_worker, (state_dict, train, stats, search, str(tmp_path)))
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    # Every process holds the same grown weights, and the same weights after 3 more synchronized steps.
    assert results[0]["grown"]["transformer.h.0.attn.c_attn.weight"].shape == (64, 2 * 4 * 16 + 64)  # q, k at d_k 16; v
    assert_same_on_every_process(results, "grown")
    assert_same_on_every_process(results, "final")
    assert results[0]["losses"] == results[1]["losses"]

    with one_thread():  # as in the workers
        alone = grow_between_steps(0, 1, state_dict, train, stats, search)
    report, expected = results[0]["report"], alone["report"]
    assert report["statistics_tokens"] == expected["statistics_tokens"] == 4 * 4 * 64
    assert report["step_size"] == pytest.approx(expected["step_size"], rel=1e-9) and report["step_size"] > 0
    assert report["eval_loss_after"] == pytest.approx(expected["eval_loss_after"], rel=1e-6)
    # The loss curve of one process on the same global batches, to float32 rounding (the statistics are
    # summed in another order, so the grown weights differ in their last bits).
    assert results[0]["losses"] == pytest.approx(alone["losses"], rel=2e-5)


def train_with_growth(model, dataset, output_dir: str, batch_size: int, resume: str | None = None) -> dict:
    """Trainer, 6 optimizer steps of 2 accumulated batches, growth d_k 8 -> 16 after step 3, checkpoint at 4."""
    from transformers import Trainer

    trainer = Trainer(model=model, args=trainer_arguments(output_dir, batch_size=batch_size), train_dataset=dataset)
    callback = GrowthCallback({3: 8}, statistics_batches=2, eval_batches=1, trainer=trainer)
    trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume)
    report = callback.reports.get(3)
    return {
        "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "qk_head_dims": list(trainer.model.config.qk_head_dims),
        "final": {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()},
        "report": None if report is None else report.to_dict(),
    }


def trainer_worker(rank: int, state_dict, dataset, folder: str) -> None:
    """The Trainer under DDP (2 processes of 2 sequences per batch), then a resume from the checkpoint after growth."""
    join_group(rank, folder)
    from transformers import AutoModelForCausalLM

    model = GrownGPT2LMHeadModel(grown_config(8))
    model.load_state_dict(state_dict)
    result = train_with_growth(model, dataset, f"{folder}/run", batch_size=2)
    dist.barrier()
    resumed_model = AutoModelForCausalLM.from_pretrained(f"{folder}/run/checkpoint-4")
    result["resumed"] = train_with_growth(
        resumed_model, dataset, f"{folder}/resumed", batch_size=2, resume=f"{folder}/run/checkpoint-4"
    )
    torch.save(result, f"{folder}/rank{rank}.pt")
    dist.barrier()  # no process tears the group down while the other still saves or synchronizes
    dist.destroy_process_group()


def test_trainer_grows_under_ddp_like_one_process_and_resumes(stdlib_bytes, tmp_path):
    torch.manual_seed(0)
    state_dict = GrownGPT2LMHeadModel(grown_config(8)).state_dict()
    dataset = trainer_dataset(stdlib_bytes, 48, seed=44)
    run_processes(trainer_worker, (state_dict, dataset, str(tmp_path)))
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    assert [result["qk_head_dims"] for result in results] == [[16, 16], [16, 16]]
    assert_same_on_every_process(results, "final")
    two = results[0]
    assert two["report"]["eval_loss_after"] <= two["report"]["eval_loss_before"]

    # One process whose batch is the global batch: the same samples for training and for growth, and one thread
    # as in the workers (Adam's first steps on the reset Q/K moments turn last-bit differences into 1e-3).
    model = GrownGPT2LMHeadModel(grown_config(8))
    model.load_state_dict(state_dict)
    with one_thread():
        one = train_with_growth(model, dataset, str(tmp_path / "one"), batch_size=4)
    assert two["report"]["statistics_tokens"] == one["report"]["statistics_tokens"] == 4 * 2 * 64
    assert two["report"]["step_size"] == pytest.approx(one["report"]["step_size"], rel=1e-9)
    assert list(two["losses"]) == list(range(1, 7)) and all(math.isfinite(loss) for loss in two["losses"].values())
    before_growth, after_growth = ([two["losses"][step] for step in steps] for steps in ((1, 2, 3), (4, 5, 6)))
    assert before_growth == pytest.approx([one["losses"][step] for step in (1, 2, 3)], rel=2e-5)
    # After growth Adam's first updates of the reset Q/K entries are about lr * sign(g): the all-reduce's
    # last-bit differences reach the loss at 4e-5 by step 6 with steps per head (below 2e-5 per layer).
    assert after_growth == pytest.approx([one["losses"][step] for step in (4, 5, 6)], rel=1e-4)

    # The checkpoint after growth carries the grown widths and resumes on 2 processes without growing again.
    resumed = results[0]["resumed"]
    assert resumed["qk_head_dims"] == [16, 16] and resumed["report"] is None
    after_resume = [two["losses"][step] for step in (5, 6)]
    assert [resumed["losses"][step] for step in (5, 6)] == pytest.approx(after_resume, rel=1e-6)
    assert_same_on_every_process([result["resumed"] for result in results], "final")


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone (for DDP and FSDP wrappers in the test process)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "options",
    [{}, {"static_graph": True}, {"find_unused_parameters": True, "gradient_as_bucket_view": True, "comm_hook": True}],
)
def test_ddp_wrapper_trains_on_after_growth_like_the_plain_model(one_process_group, stdlib_bytes, options):
    """The rebuilt buckets (with DDP's options and communication hooks) pass every gradient, at the new shapes."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    plain = GrownGPT2LMHeadModel(grown_config(8))
    model = copy.deepcopy(plain)
    options = dict(options)
    comm_hook = options.pop("comm_hook", False)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, **options)
    if comm_hook:
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    batches = lm_batches(stdlib_bytes["train"], 4, batch_size=4, seed=45)
    curves = []
    for trained in (wrapped, plain):
        optimizer = torch.optim.AdamW(trained.parameters(), lr=3e-3)
        losses = train_steps(trained, optimizer, batches[:2], 0, 1)
        if trained is wrapped:
            with pytest.raises(ValueError, match="pass accelerator="):
                grow_in_training(wrapped, optimizer, batches[:2], 8, step_size=0.0)
            assert model.config.qk_head_dims == [8, 8]  # refused before any change
        grow_in_training(trained, optimizer, None, 8, mode="zero")  # the baselines draw the same dims everywhere
        losses += train_steps(trained, optimizer, batches[2:], 0, 1)
        curves.append(losses)
    assert model.config.qk_head_dims == plain.config.qk_head_dims == [16, 16]
    assert curves[0] == pytest.approx(curves[1], rel=1e-6)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=1e-5, atol=1e-7, msg=name)


def test_the_ddp_wrapper_is_found_inside_a_compiled_model(one_process_group):
    """accelerate compiles after wrapping in DDP: the compiled wrapper's `.module` forwards past the DDP, whose
    buckets growth must rebuild, so the wrappers are looked through by what they wrap."""
    from hf_grow.distributed import ddp_wrappers

    model = GrownGPT2LMHeadModel(grown_config(8))
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    assert ddp_wrappers(torch.compile(wrapped)) == [wrapped] and ddp_wrappers(wrapped) == [wrapped]
    assert ddp_wrappers(torch.compile(model)) == []


def test_fsdp_and_deepspeed_are_refused_with_what_works(one_process_group, stdlib_bytes):
    from torch.distributed.fsdp import fully_shard

    sharded = GrownGPT2LMHeadModel(grown_config(8))
    fully_shard(sharded)
    with pytest.raises(ValueError, match="not FSDP.*Train with DDP, or grow a saved checkpoint"):
        grow_in_training(sharded, None, None, 8, mode="zero")
    with pytest.raises(ValueError, match="not FSDP.*gather the full state dict.*on one process with a memory_budget"):
        grow_model(sharded, None, 8, step_size=0.0)

    class DeepSpeedEngine(torch.nn.Module):  # DeepSpeed is recognized by name: it need not be installed
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = GrownGPT2LMHeadModel(grown_config(8))
    with pytest.raises(ValueError, match="DistributedDataParallel.*not DeepSpeed"):
        grow_in_training(DeepSpeedEngine(model), None, None, 8, mode="zero")
    accelerator = type("Accelerator", (), {"distributed_type": type("Mode", (), {"name": "FSDP"})()})()
    with pytest.raises(ValueError, match="not FSDP"):
        grow_in_training(model, None, None, 8, mode="zero", accelerator=accelerator)
    assert model.config.qk_head_dims == [8, 8]

    callback = GrowthCallback({3: 8})
    args = type("Args", (), {"world_size": 2, "deepspeed": None, "fsdp": ""})()
    with pytest.raises(ValueError, match=r"trainer.add_callback\(GrowthCallback\(..., trainer=trainer\)\)"):
        callback.on_train_begin(args, None, None, model=model)
    args.deepspeed = "ds_config.json"
    with pytest.raises(ValueError, match="not DeepSpeed"):
        callback.on_train_begin(args, None, None, model=model)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_the_trainer_recipe_runs_under_torchrun(tmp_path):
    """README's runnable example, shortened: 2 CPU processes grow once and save the grown model."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "grow_with_trainer.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    options = ["--output-dir", str(tmp_path), "--steps", "6", "--grow-at", "3", "--batch-size", "4", "--cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*torchrun, str(recipe), *options], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 3: grew to qk_head_dims [16, 16]" in result.stdout
    assert "2 process(es): final held-out loss" in result.stdout
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_ddp_options_growth_cannot_follow_are_refused_before_any_change(one_process_group):
    """Refused at the end of the growth, they left the model grown under a reducer that no longer synchronized (the
    replicas drifted apart from the next step on)."""
    model = GrownGPT2LMHeadModel(grown_config(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    delayed = torch.nn.parallel.DistributedDataParallel(
        model, delay_all_reduce_named_params=[("transformer.wte.weight", model.transformer.wte.weight)],
        param_to_hook_all_reduce=model.transformer.ln_f.weight,
    )
    with pytest.raises(ValueError, match="does not support DDP with delayed all-reduce"):
        grow_in_training(delayed, optimizer, None, 8, mode="zero")
    assert model.config.qk_head_dims == [8, 8] and model.transformer.h[0].attn.c_attn.weight.shape[1] == 2 * 4 * 8 + 64
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    compressed = torch.nn.parallel.DistributedDataParallel(model)  # its hook's error feedback is kept per bucket
    compressed.register_comm_hook(powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
    with pytest.raises(ValueError, match="does not support DDP's PowerSGD communication hook"):
        grow_in_training(compressed, optimizer, None, 8, mode="zero")
    assert model.config.qk_head_dims == [8, 8]


def test_a_failed_line_search_leaves_the_ddp_wrapper_synchronizing(one_process_group, stdlib_bytes, monkeypatch):
    """The growth widens Q/K before its line search: one that failed (and was caught) left DDP's buckets at the old
    shapes, so training on through the wrapper reduced no gradient (2 processes: every replica drifted apart)."""
    from accelerate import Accelerator
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from hf_grow.training import grow as grow_module

    torch.manual_seed(0)
    model = GrownGPT2LMHeadModel(grown_config(8))
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    reduced = []

    def counting_allreduce(state, bucket):
        reduced.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(None, bucket)

    wrapped.register_comm_hook(None, counting_allreduce)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)
    batches = lm_batches(stdlib_bytes["train"], 4, batch_size=4, seed=46)

    def failing_search(*args, **kwargs):
        raise RuntimeError("the line search ran out of memory")

    monkeypatch.setattr(grow_module, "search_and_report", failing_search)
    with pytest.raises(RuntimeError, match="ran out of memory"):
        grow_in_training(wrapped, optimizer, batches[:2], 8, eval_dataloader=batches[2:3],
                         accelerator=Accelerator(cpu=True), cross_fit=False)
    assert model.config.qk_head_dims == [16, 16]  # grown, at the old function
    reduced.clear()
    train_steps(wrapped, optimizer, batches[3:], 0, 1)
    assert sum(reduced) == sum(parameter.numel() for parameter in model.parameters())


def test_zero_redundancy_optimizer_is_refused_before_any_change(one_process_group):
    """Its state lives in its own partition's inner optimizer: accepted, the growth ran and the next step crashed in
    Adam with a shape error on the process whose partition held the query/key weights."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = GrownGPT2LMHeadModel(grown_config(8))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match="cannot remap the state of ZeroRedundancyOptimizer: its state is sharded"):
        grow_in_training(model, optimizer, None, 8, mode="zero")
    assert model.config.qk_head_dims == [8, 8]
