"""The memory of an inspection: `inspect_growth` frees each group of layers' M once solved, and `hf-grow inspect`
plans its memory (``--dry-run``, a refusal naming the flags that fit), takes the statistics flags of the main
command, and its ``--max-batches`` statistics serve ``hf-grow --stats`` with the same flag."""

import pytest
import torch

from hf_grow import GrowthConfig, GrowthStatistics, cli, get_adapter, inspect_growth
from hf_grow.growth import memory_plan, prepare
from hf_grow.statistics import statistics_bytes

from conftest import lm_batches
from test_cli import SMALL, TEXT_GLOB
from test_cli_inspect import model_folder  # noqa: F401  (the trained model folder fixture)


def test_inspect_growth_frees_each_group_of_layers_m_once_solved(trained_gpt2, stdlib_bytes, monkeypatch):
    """With a memory_budget of one layer's M, each pass's M was held to the end (all layers at once): the budget
    bounded nothing. The gains are those of one pass."""
    batches = lm_batches(stdlib_bytes["stats"], 4, seed=41)
    adapter = get_adapter(trained_gpt2)
    config = trained_gpt2.config
    one_layer = statistics_bytes(config.n_layer, config.n_head, config.n_embd, 2, 8)
    held = []
    collect = prepare.collect_statistics

    def spy(*args, on_group=None, **kwargs):
        def on_pass(statistics: GrowthStatistics, layers: list[int]) -> None:
            if on_group is not None:
                on_group(statistics, layers)
            held.append(sum(gradient is not None for gradient in statistics.gradients))

        return collect(*args, on_group=on_pass, **kwargs)

    monkeypatch.setattr(prepare, "collect_statistics", spy)
    bounded = inspect_growth(trained_gpt2, batches, config=GrowthConfig(memory_budget=one_layer), max_dims=4)
    assert held == [0] * config.n_layer  # a pass per layer, its M freed when solved
    held.clear()
    whole = inspect_growth(trained_gpt2, batches, max_dims=4)
    assert held == [0]
    assert len(adapter.attention_modules(trained_gpt2)) == config.n_layer
    for layer, same in zip(bounded.layers, whole.layers):
        torch.testing.assert_close(torch.tensor(layer.marginal_gains), torch.tensor(same.marginal_gains),
                                   rtol=1e-9, atol=0)


def test_the_plan_of_an_inspection_holds_every_m_only_where_it_is_saved(trained_gpt2):
    """No line search or grown model; with --save-stats every layer's M to the end (on disk with --offload-dir)."""
    adapter = get_adapter(trained_gpt2)
    config = trained_gpt2.config
    layer_m = config.n_head * (config.n_embd + 1) ** 2 * 8
    budget = GrowthConfig(memory_budget=statistics_bytes(config.n_layer, config.n_head, config.n_embd, 2, 8))

    def plan(growth_config: GrowthConfig, keep: bool) -> memory_plan.MemoryPlan:
        return memory_plan.plan_memory(trained_gpt2, adapter, growth_config, batch_size=4, seq_len=64,
                                       eval_tokens=1000, inspection=True, keep_statistics=keep)

    def m_of(plan: memory_plan.MemoryPlan, stage: str) -> int:
        return next(found for found in plan.stages if found.name == stage).terms.get("M", 0)

    freed, kept = plan(budget, keep=False), plan(budget, keep=True)
    assert [stage.name for stage in freed.stages] == ["load", "statistics", "gains"]
    assert [stage.name for stage in kept.stages] == ["load", "statistics", "write", "gains"]
    assert m_of(freed, "statistics") == m_of(freed, "gains") == layer_m
    assert m_of(kept, "statistics") == m_of(kept, "write") == m_of(kept, "gains") == config.n_layer * layer_m
    assert trained_gpt2.config._attn_implementation == "sdpa"  # the plan's twin ran eager on the model's own config
    offloaded = plan(budget.replace(offload_dir="somewhere"), keep=True)
    assert m_of(offloaded, "gains") == 0 and offloaded.disk == config.n_layer * layer_m
    assert plan(budget.replace(offload_dir="somewhere"), keep=False).disk == layer_m


def test_inspect_plans_its_memory_before_reading_anything(model_folder, tmp_path, capsys):  # noqa: F811
    missing = str(tmp_path / "no-such-text" / "*.txt")  # a dry run reads no data
    common = ["inspect", str(model_folder), "--seq-len", "64"]
    assert cli.main([*common, "--data", TEXT_GLOB, "--dry-run", "--save-stats", str(tmp_path / "s.st")]) == 0
    table = capsys.readouterr().out
    assert [line.split()[0] for line in table.splitlines()[1:5]] == ["load", "statistics", "write", "gains"]
    assert not (tmp_path / "s.st").exists()
    # a limit below the plan: refused in one line naming the flags that fit, before the text is read
    assert cli.main([*common, "--data", TEXT_GLOB, "--max-memory", "100MB"]) == 2
    error = capsys.readouterr().err
    assert "the statistics stage needs about" in error and "--max-memory" in error
    assert cli.main([*common, "--data", missing, "--memory-budget", "1000"]) == 2
    assert "--memory-budget 1000: memory_budget 1,000 bytes is below" in capsys.readouterr().err
    assert cli.main([*common, "--data", TEXT_GLOB, "--offload-dir", str(tmp_path / "absent")]) == 2
    assert "--offload-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's choices
        cli.main([*common, "--data", TEXT_GLOB, "--accumulate-dtype", "float16"])
    assert "invalid choice" in capsys.readouterr().err


def test_inspect_with_a_memory_budget_and_max_batches_serves_hf_grow_stats(model_folder, tmp_path, capsys):  # noqa: F811
    """The same table in passes of a layer each; statistics of the first --max-batches, taken by `hf-grow --stats`
    with the same flag (and refused without it: the counts differ)."""
    common = ["inspect", str(model_folder), "--data", TEXT_GLOB, "--layers-only", *SMALL]
    assert cli.main(common) == 0
    whole = capsys.readouterr().out
    assert cli.main([*common, "--memory-budget", "300000", "--accumulate-dtype", "float32"]) == 0
    assert capsys.readouterr().out == whole and "+16" in whole
    stats = tmp_path / "stats.safetensors"
    assert cli.main([*common, "--max-batches", "2", "--save-stats", str(stats)]) == 0
    capsys.readouterr()
    assert GrowthStatistics.load(stats).num_batches == 2
    grow = [str(model_folder), "--data", TEXT_GLOB, "--stats", str(stats), "--p", "8", "--step-size", "0", *SMALL]
    assert cli.main([*grow, "--output-dir", str(tmp_path / "refused")]) == 2
    assert "in 2 batches" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert cli.main([*grow, "--max-batches", "2", "--output-dir", str(tmp_path / "grown")]) == 0


@pytest.mark.parametrize("flag", ["--statistics-method", "--statistics_method"])
def test_inspect_takes_both_spellings_of_the_statistics_flags(flag):
    args = cli.parsers.build_inspect_parser().parse_args(["m", flag, "chunked", "--query-block", "32"])
    assert (args.statistics_method, args.query_block, args.memory_budget) == ("chunked", 32, None)
