"""The command's refusals before any work: a --memory-budget below one layer's statistics, and the flag that drops
the realized gains (and the held-out states they replay) where the line search is short of memory."""

import dataclasses
import re

import torch

from conftest import tiny_gpt2_config
from transformers import GPT2Config, GPT2LMHeadModel

from hf_grow import GrowthConfig, cli, get_adapter
from hf_grow.cli import memory as cli_memory
from hf_grow.growth.memory_plan import fitting_changes, plan_memory
from test_cli import TEXT_GLOB, model_folder  # noqa: F401  (the trained model folder fixture)


def meta_model(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def test_a_memory_budget_below_one_layer_is_refused_in_one_line(model_folder, tmp_path, capsys):  # noqa: F811
    output = tmp_path / "grown"
    arguments = [str(model_folder), "--p", "8", "--data", TEXT_GLOB, "--memory-budget", "40KB", "--quiet",
                 "--device", "cpu"]
    for run in (["--dry-run"], ["--output-dir", str(output)]):
        assert cli.main([*arguments, *run]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "--memory-budget 40KB: memory_budget 40,000 bytes is below" in error
    assert not output.exists()


def test_a_line_search_short_of_memory_drops_the_realized_gains_before_the_models_precision():
    # The held-out states the realized gains replay (up to 1 GiB) are the line search's largest term here.
    model = meta_model(GPT2LMHeadModel, tiny_gpt2_config(n_layer=6, n_embd=1024, n_head=16))
    adapter = get_adapter(model)

    def plan_with(changes, config=GrowthConfig(p=8)):  # a bfloat16 model would fit too: it comes last
        fields = {name: value for name, value in changes.items() if name not in ("batch_size", "dtype")}
        return plan_memory(model, adapter, dataclasses.replace(config, **fields),
                           batch_size=changes.get("batch_size", 8), seq_len=64, eval_tokens=50_000)

    def held_out_states(plan):
        return next(stage for stage in plan.stages if stage.name == "line search").terms["held-out states"]

    plan, without = plan_with({}), plan_with({"measure_realized_gains": False})
    assert max(plan.stages, key=lambda stage: stage.host).name == "line search"
    assert held_out_states(plan) > 0 and held_out_states(without) == 0
    layer_steps = plan_with({"measure_realized_gains": False}, GrowthConfig(p=8, step_mode="coordinate"))
    assert held_out_states(layer_steps) > 0  # a step searched layer by layer replays them too
    limit = without.peak_host
    assert fitting_changes(plan_with, GrowthConfig(p=8), lambda plan: plan.peak_host <= limit) == {
        "measure_realized_gains": False}


def test_the_command_names_the_flag_that_drops_the_realized_gains(tmp_path, monkeypatch, capsys):
    GPT2Config(n_layer=6, n_embd=1024, n_head=16, vocab_size=400, n_positions=256).save_pretrained(tmp_path)
    arguments = [str(tmp_path), "--p", "8", "--data", str(tmp_path / "none-*.txt"), "--seq-len", "64", "--batch-size",
                 "8", "--dry-run", "--device", "cpu"]
    peaks = []
    fits = cli_memory._fits
    monkeypatch.setattr(cli_memory, "_fits", lambda plan, *args: peaks.append(plan.peak_host) or fits(plan, *args))
    assert cli.main([*arguments, "--no-measure-realized-gains"]) == 0
    monkeypatch.setattr(cli_memory, "_free_memory", lambda device: (peaks[0], 0))
    assert cli.main(arguments) == 2
    error = capsys.readouterr().err.strip()
    assert "the line search stage needs about" in error and "rerun with --no-measure-realized-gains (see" in error


def test_statistics_given_are_planned_as_held_not_collected(model_folder, tmp_path, capsys):  # noqa: F811
    """With --stats the plan counted a statistics pass that does not run (and refused over it, naming
    --accumulate-dtype or --batch-size, which change nothing there), and not the statistics held through the line
    search; nor the Q/K weights at the new width that the line search holds (a GPT-2 small shape's run held 0.32
    GiB the plan missed: its line-search stage was 0.83x the measured peak)."""
    model = meta_model(GPT2LMHeadModel, GPT2Config())  # GPT-2 small's shape
    adapter, given = get_adapter(model), 3 * 2**30

    def plan(config: GrowthConfig, statistics: int | None = None):
        return plan_memory(model, adapter, config, batch_size=2, seq_len=128, eval_tokens=50_000,
                           given_statistics=statistics)

    collected, held = plan(GrowthConfig(p=8)), plan(GrowthConfig(p=8), given)
    assert [stage.name for stage in held.stages] == ["load", "solve", "line search", "write"] and held.groups == []
    solve, search = held.stages[1].terms, held.stages[2].terms
    assert solve["statistics given"] == search["statistics given"] == given and "M" not in solve
    assert "statistics given: no pass over the data" in held.table()
    # the statistics options change nothing where nothing is collected
    options = GrowthConfig(p=8, memory_budget="1GB", accumulate_dtype="float32", offload_dir=str(tmp_path))
    assert plan(options, given).stages == held.stages
    weights = 12 * 2 * 768 * 769 * 8  # float64 Q/K of a layer (with the bias row), at 64 + 8 of 64 dims, 3 times
    assert search["Q/K weights at the new width"] == 3 * weights * 72 // 64
    assert collected.stages[3].terms["Q/K weights at the new width"] == search["Q/K weights at the new width"]

    # a budget's dims are spread over the layers: 768 of them add what p=64 adds to each of 12 layers
    spread = plan(GrowthConfig(budget=768)).stages[3].terms["Q/K weights at the new width"]
    assert spread == plan(GrowthConfig(p=64)).stages[3].terms["Q/K weights at the new width"]

    stats = tmp_path / "stats.safetensors"
    assert cli.main(["inspect", str(model_folder), "--data", TEXT_GLOB, "--save-stats", str(stats), "--seq-len", "64",
                     "--max-tokens", "6000", "--quiet"]) == 0
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--stats", str(stats), "--dry-run", "--seq-len", "64",
                     "--max-tokens", "6000"]) == 0
    table = capsys.readouterr().out
    assert "statistics given: no pass over the data" in table and "\nstatistics " not in table
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--stats", str(tmp_path / "missing"), "--dry-run"]) == 2
    assert "--stats " + str(tmp_path / "missing") + ": no such file" in capsys.readouterr().err  # was a traceback


def test_an_output_disk_too_small_for_the_grown_model_is_refused_first(model_folder, tmp_path, capsys,  # noqa: F811
                                                                       monkeypatch):
    """The write failed with "No space left on device" after the statistics, the solve and the line search (53 s on
    a tiny model; a lost half hour at GPT-2 large)."""
    from collections import namedtuple

    from hf_grow.cli import commands

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cli_memory.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**19, 2**19))
    def never(*args, **kwargs):
        raise AssertionError("the text was read")

    monkeypatch.setattr(commands, "text_batches", never)
    output = tmp_path / "new" / "grown"  # made by the run: the disk of its nearest existing folder
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--quiet"]) == 2
    error = capsys.readouterr().err
    assert f"of disk in {tmp_path}, 512 KiB is free there: free disk there or pass another --output-dir" in error


def test_a_memory_budget_that_lowers_no_peak_is_named(tmp_path, capsys):
    """A budget costs a pass over the data per group: where the plan's peak stays (here the line search's; GPT-2's
    compact solves, held through the later passes, outweigh their M), the command says to leave it out. Where it
    lowers the peak (Llama: its M outweighs its appended dimensions' solve), nothing is said."""
    from transformers import LlamaConfig

    GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=400, n_positions=256).save_pretrained(tmp_path / "gpt2")
    LlamaConfig(num_hidden_layers=4, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                intermediate_size=512, vocab_size=400, max_position_embeddings=256).save_pretrained(tmp_path / "llama")
    said = {}
    for model, budget in (("gpt2", "150MB"), ("gpt2", None), ("llama", "400MB")):
        arguments = [str(tmp_path / model), "--p", "8", "--data", str(tmp_path / "none-*.txt"), "--seq-len", "64",
                     "--dry-run", "--device", "cpu"]
        assert cli.main(arguments + (["--memory-budget", budget] if budget else [])) == 0
        output = capsys.readouterr()
        passes = int(output.out.split(" passes over the data")[0].split()[-1]) if "passes" in output.out else 1
        said[model, budget] = passes, [line for line in output.err.splitlines() if "--memory-budget" in line]
    passes, (warning,) = said["gpt2", "150MB"]
    assert passes == 4 and re.fullmatch(r"hf-grow: warning: --memory-budget 150MB takes 4 passes over the data but "
                                        r"lowers no planned peak \((\S+ GiB), \1 in one pass; the line search stage "
                                        r"peaks\): leave it out \(see --dry-run\)", warning)
    assert said["gpt2", None] == (1, []) and said["llama", "400MB"] == (4, [])
