"""GrowthConfig: one growth configuration for grow_model, grow_in_training, GrowthCallback and the command line."""

import dataclasses
import inspect
import json

import pytest
import torch

from hf_grow.option_values import parse_bytes
from hf_grow import (
    GrowthCallback,
    GrowthConfig,
    GrowthReport,
    get_adapter,
    grow_in_training,
    grow_model,
    inspect_growth,
    load_growth_report,
    model_card,
)
from hf_grow.cli import build_parser, main
from hf_grow.statistics import collect_statistics

from conftest import lm_batches, tiny_gpt2_config


class Untouchable:
    """A dataloader that fails the test if anything reads it: options are checked before any data."""

    def __iter__(self):
        raise AssertionError("the data was read before the options were checked")


def test_defaults_are_the_ones_grow_model_always_had_but_the_measured_choices():
    config = GrowthConfig()
    assert (config.p, config.budget, config.multiple_of, config.step_size) == (None, None, 1, None)
    assert (config.truncation, config.step_mode, config.search, config.solver) == ("whitened", "auto", "exact", "auto")
    # bench_candidates.py: whitened truncation best on 17 of 18 splits; per head or per layer, whichever the held-out
    # loss prefers (per layer best on a BPE GPT-2), per head (never below the notes' formula) the simplest
    assert config.candidates == [("whitened", "per_head"), ("whitened", "per_layer")]
    assert config.confirm_fraction == 1 / 3
    assert (config.initial_step_size, config.rtol, config.eval_fraction) == (0.03, 1e-6, 0.1)
    assert (config.max_batches, config.measure_realized_gains, config.statistics_method) == (None, True, "auto")
    assert (config.compute_dtype, config.query_block, config.memory_budget) == ("float32", None, None)
    assert config.torch_compute_dtype == torch.float32
    # every option has help text (the command line's --help)
    assert all(option.metadata.get("help") for option in dataclasses.fields(GrowthConfig))


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"p": 8, "budget": 16}, ValueError, "either p or budget"),
        ({"multiple_of": 8}, ValueError, "multiple_of applies to a budget"),
        ({"p": "8"}, TypeError, "p must be an int or a mapping"),
        ({"p": 0}, ValueError, "p must be a positive number"),
        ({"p": -3}, ValueError, "p must be a positive number"),
        ({"p": {0: 8, 1: -1}}, ValueError, "p must map layers to non-negative ints"),
        ({"budget": 0}, ValueError, "budget must be a positive"),
        ({"budget": 12, "multiple_of": 8}, ValueError, "not a multiple"),
        ({"budget": 8, "multiple_of": 0}, ValueError, "multiple_of must be a positive"),
        ({"truncation": "nuclear"}, ValueError, "truncation must be one of"),
        ({"step_mode": "per_token"}, ValueError, "step_mode must be one of"),
        ({"step_size": float("nan")}, ValueError, "step_size must be a finite number"),
        ({"initial_step_size": 0.0}, ValueError, "initial_step_size must be a finite number > 0"),
        ({"rtol": 2.0}, ValueError, "rtol must be in"),
        ({"rtol": 1e-17}, ValueError, "below 1e-13 they are float64 rounding noise"),  # it inverted that noise
        ({"eval_fraction": 1.0}, ValueError, "eval_fraction must be in"),
        ({"max_batches": 0}, ValueError, "max_batches must be a positive int"),
        ({"memory_budget": "lots"}, ValueError, "is not a size"),
        ({"compute_dtype": torch.float16}, ValueError, "compute_dtype must be float32 or float64"),
        ({"statistics_method": "triton", "compute_dtype": "float64"}, ValueError, "computes in float32"),
        ({"query_block": 0}, ValueError, "query_block must be a positive int"),
        ({"query_block": 2.5}, ValueError, "query_block must be a positive int"),
        ({"p": {0: True}}, ValueError, "p must map layers to non-negative ints"),
        ({"keep_attention_scale": "no"}, ValueError, "keep_attention_scale must be True or False"),
        ({"measure_realized_gains": "no"}, ValueError, "measure_realized_gains must be True or False"),
        ({"offload_dir": ""}, ValueError, "offload_dir must be a folder's path"),
    ],
)
def test_bad_options_are_refused_when_made_and_before_any_data(options, error, message, trained_gpt2):
    with pytest.raises(error, match=message):
        GrowthConfig(**options)
    with pytest.raises(error, match=message):
        grow_model(trained_gpt2, Untouchable(), **options)


def test_a_loss_fn_that_is_no_function_is_refused_before_any_data(trained_gpt2):
    with pytest.raises(ValueError, match="loss_fn must be a function"):
        grow_model(trained_gpt2, Untouchable(), loss_fn="mse")


def test_unknown_options_name_the_known_ones(trained_gpt2):
    with pytest.raises(TypeError, match="unknown growth option.*'stepsize'.*'step_size'"):
        grow_model(trained_gpt2, Untouchable(), stepsize=0.0)
    with pytest.raises(TypeError, match="unknown growth option"):
        GrowthConfig().replace(learning_rate=1.0)


def test_json_round_trip_keeps_every_option(tmp_path):
    config = GrowthConfig(p={0: 8, 1: 0}, step_size=0.5, truncation="frobenius", step_mode="per_layer",
                          compute_dtype=torch.float64, memory_budget="2GB", measure_realized_gains=False)
    assert config.compute_dtype == "float64"
    config.to_json_file(tmp_path / "growth.json")
    loaded = GrowthConfig.from_json_file(tmp_path / "growth.json")
    assert loaded == config and loaded.p == {0: 8, 1: 0}  # JSON's string keys come back as layers
    assert GrowthConfig.from_dict(json.loads(config.to_json_string())) == config
    assert GrowthConfig.from_dict({"p": {"3": 8}}).p == {3: 8}
    assert GrowthConfig(memory_budget=2**31).memory_budget == 2**31  # an int of bytes works in Python
    assert parse_bytes(GrowthConfig(memory_budget=2.5e9).memory_budget) == 2_500_000_000  # as one writes it
    with pytest.raises(TypeError, match="memory_budget must be a whole number of bytes .* got 1.5"):
        GrowthConfig(memory_budget=1.5)
    assert GrowthConfig(offload_dir=tmp_path).offload_dir == str(tmp_path)  # a Path works too, kept as a string


def test_layers_of_p_are_not_guessed_in_python(trained_gpt2):
    """Only JSON's string layer keys become ints (in from_dict): other keys are refused as before."""
    with pytest.raises(ValueError, match=r"names layers \[1.5\]"):
        grow_model(trained_gpt2, Untouchable(), p={1.5: 8})
    with pytest.raises(ValueError, match=r"names layers \['x'\]"):
        grow_model(trained_gpt2, Untouchable(), config=GrowthConfig.from_dict({"p": {"x": 8}}))


def test_a_config_and_its_overrides_grow_as_the_keywords_do(trained_gpt2, stdlib_bytes, tmp_path):
    stats, held_out = lm_batches(stdlib_bytes["stats"], 3, seed=41), lm_batches(stdlib_bytes["eval"], 2, seed=42)
    by_keywords = grow_model(trained_gpt2, stats, p=8, eval_dataloader=held_out, truncation="frobenius",
                             measure_realized_gains=False)
    config = GrowthConfig(p=4, truncation="frobenius", measure_realized_gains=False)
    by_config = grow_model(trained_gpt2, stats, config=config, eval_dataloader=held_out, p=8)  # p overrides
    assert by_config.growth_report.step_size == by_keywords.growth_report.step_size
    for (name, a), b in zip(by_keywords.state_dict().items(), by_config.state_dict().values()):
        assert torch.equal(a, b), name
    report = by_config.growth_report
    assert GrowthConfig.from_dict(report.config) == config.replace(p=8)  # the report records what ran
    # p left to its default is recorded as the 8 that ran; a budget leaves p out
    default = grow_model(trained_gpt2, stats, eval_dataloader=held_out, step_size=0.0, measure_realized_gains=False)
    assert default.growth_report.config["p"] == 8 and default.growth_report.config["budget"] is None
    by_config.save_pretrained(tmp_path / "grown")
    assert load_growth_report(tmp_path / "grown").config == report.config
    card = str(model_card(tmp_path / "grown", base_model="tiny-gpt2"))
    assert '"truncation": "frobenius"' in card and "GrowthConfig" in card
    # a report written before GrowthConfig (no config, no step_mode) still loads, and its card has no options
    old = {key: value for key, value in json.loads((tmp_path / "grown" / "growth_report.json").read_text()).items()
           if key not in ("config", "step_mode")}
    assert GrowthReport.from_dict(old).config is None
    (tmp_path / "grown" / "growth_report.json").write_text(json.dumps(old))
    assert "GrowthConfig" not in str(model_card(tmp_path / "grown", base_model="tiny-gpt2"))


def test_grow_in_training_keeps_its_own_defaults_and_takes_a_config(stdlib_bytes):
    from hf_grow import to_grown_model
    from transformers import GPT2LMHeadModel

    signature = inspect.signature(grow_in_training)
    assert "config" in signature.parameters
    torch.manual_seed(0)
    model = to_grown_model(GPT2LMHeadModel(tiny_gpt2_config()))
    batches = lm_batches(stdlib_bytes["stats"], 4, seed=43)
    report = grow_in_training(model, None, batches, 8, mode="refactor", step_size=0.0)
    assert report.config["eval_fraction"] == 0.25 and report.config["measure_realized_gains"] is False
    assert report.config["p"] == 8 and report.config["step_size"] == 0.0
    with pytest.raises(ValueError, match="budget allocation is grow_model's"):
        grow_in_training(model, None, batches, None, mode="refactor", config=GrowthConfig(budget=8))
    callback = GrowthCallback(grow_at={10: 8}, config=GrowthConfig(step_mode="per_layer"))
    assert callback.config.step_mode == "per_layer"
    # p=None takes the config's p; a config is used as given (its own eval_fraction, not 0.25)
    report = grow_in_training(model, None, batches, None, mode="refactor",
                              config=GrowthConfig(p=4, step_size=0.0, measure_realized_gains=False))
    assert report.config["p"] == 4 and report.config["eval_fraction"] == 0.1
    assert model.config.qk_head_dims == [model.config.n_embd // model.config.n_head + 12] * model.config.n_layer


def test_the_callback_passes_its_config_and_keywords_on(monkeypatch):
    import types

    import hf_grow.training.callback as training

    calls = []
    monkeypatch.setattr(training, "grow_in_training", lambda *args, **kwargs: calls.append((args, kwargs)))
    config = GrowthConfig(truncation="frobenius")
    callback = GrowthCallback(grow_at={10: 8}, mode="zero", config=config, step_size=0.0)
    model = types.SimpleNamespace(config=types.SimpleNamespace(qk_head_dims=[16]))
    callback.on_step_end(None, types.SimpleNamespace(global_step=10, log_history=[]), None, model=model)
    (args, kwargs), = calls
    assert args[3] == 8 and kwargs["config"] is config and kwargs["step_size"] == 0.0 and kwargs["mode"] == "zero"


def test_inspect_growth_takes_the_config_it_would_grow_with(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 2, seed=44)
    statistics = collect_statistics(trained_gpt2, batches, get_adapter(trained_gpt2))
    by_config = inspect_growth(trained_gpt2, statistics=statistics, max_dims=4,
                               config=GrowthConfig(p=16, step_mode="global", rtol=1e-5))
    by_keywords = inspect_growth(trained_gpt2, statistics=statistics, max_dims=4, step_mode="global", rtol=1e-5)
    assert dataclasses.asdict(by_config) == dataclasses.asdict(by_keywords)
    assert by_config.lam_unit != inspect_growth(trained_gpt2, statistics=statistics, max_dims=4).lam_unit
    with pytest.raises(ValueError, match="rtol must be in"):  # a keyword replaces the config's, checked first
        inspect_growth(trained_gpt2, Untouchable(), config=GrowthConfig(), rtol=2.0)


def test_the_command_line_builds_its_growth_flags_from_the_config():
    parser = build_parser()
    args = parser.parse_args(["gpt2", "--output-dir", "out", "--p", "16", "--multiple-of", "1", "--step-mode",
                              "per_layer", "--truncation", "frobenius", "--memory-budget", "2GB", "--step-size", "0"])
    assert (args.p, args.step_mode, args.truncation, args.memory_budget, args.step_size) == (
        16, "per_layer", "frobenius", "2GB", 0.0
    )
    help_text = parser.format_help()
    for option in dataclasses.fields(GrowthConfig):  # eval_fraction too: the share of the text held out
        assert "--" + option.name.replace("_", "-") in help_text
    # HfArgumentParser's underscore spellings work too, and build the same config
    underscored = parser.parse_args(["gpt2", "--output-dir", "out", "--budget", "16", "--multiple_of", "8",
                                     "--no_measure_realized_gains", "--statistics_method", "chunked"])
    assert (underscored.budget, underscored.multiple_of, underscored.measure_realized_gains) == (16, 8, False)
    assert underscored.statistics_method == "chunked"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--eval-fraction", "1.5"], "--eval-fraction must be between 0 and 1"),
        (["--eval-fraction", "0.2"], "--eval-fraction applies to held-out text cut from the statistics' text"),
        (["--data", "x.txt", "--eval-tokens", "100", "--eval-fraction", "0.2"], "give either --eval-tokens or"),
        (["--p", "8", "--budget", "16"], "give either --p or --budget, not both"),
        (["--p", "8", "--multiple-of", "8"], "--multiple-of applies to --budget"),
        (["--initial-step-size", "0"], "initial_step_size must be a finite number > 0"),
        (["--statistics-method", "triton", "--compute-dtype", "float64"], "computes in float32"),
        # ignored: a .csv's whole text (header, ids, quotes) was grown on, not its --text-column
        (["--data", "x.csv", "--text-column", "review", "--split", "test"],
         "--split, --text-column apply to --dataset, not to --data (text files, read whole); to read one column"),
        (["--data", "x.txt", "--streaming", "--dataset-config", "c"], "--dataset-config, --streaming apply to"),
    ],
)
def test_the_command_refuses_bad_growth_flags_in_one_line_before_any_data(arguments, message, tmp_path, capsys):
    status = main(["no-such-model-is-loaded", "--output-dir", str(tmp_path / "out"), *arguments])
    error = capsys.readouterr().err
    assert status == 2 and message in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
