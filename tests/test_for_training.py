"""The options for a model that is trained after it grows (`GrowthConfig.for_training`, ``--for-training``): one
definition for grow_model, the command and growth in a training loop (issue #35)."""

import copy

import pytest
import torch

from hf_grow import GrowthConfig, evaluate_loss, grow_in_training, grow_model, model_card, to_grown_model
from hf_grow.cli import build_parser
from hf_grow.cli.checks import _growth_config
from hf_grow.config import FOR_TRAINING

from conftest import lm_batches


def test_the_options_for_training_are_a_tenth_per_head_cross_fitted_with_the_scale_kept(tmp_path):
    config = GrowthConfig.for_training(p=16)
    assert (config.p, config.step_scale, config.step_mode) == (16, 0.1, "per_head")
    assert config.cross_fit is True and config.keep_attention_scale is True
    assert {name: getattr(config, name) for name in FOR_TRAINING} == FOR_TRAINING
    # everything else is grow_model's default, and grow_model's defaults still take the whole searched step
    assert config.replace(**{name: getattr(GrowthConfig(), name) for name in FOR_TRAINING}) == GrowthConfig(p=16)
    default = GrowthConfig()
    assert (default.step_scale, default.cross_fit, default.keep_attention_scale) == (1, False, False)
    # overrides win; with no searched step there is no fraction to take (and no error)
    assert GrowthConfig.for_training(step_scale=0.5, cross_fit=False).step_scale == 0.5
    assert GrowthConfig.for_training(cross_fit=False).cross_fit is False
    assert GrowthConfig.for_training(step_size=0.02).step_scale == 1.0
    assert GrowthConfig.for_training(step_mode="coordinate").step_scale == 1.0
    with pytest.raises(TypeError, match="unknown growth option"):
        GrowthConfig.for_training(step_scal=0.5)
    with pytest.raises(ValueError, match="step_scale must be in"):
        GrowthConfig.for_training(step_scale=2.0)
    config.to_json_file(tmp_path / "config.json")
    assert GrowthConfig.from_json_file(tmp_path / "config.json") == config


def test_growth_in_training_defaults_to_the_options_for_training(trained_gpt2, stdlib_bytes):
    """One definition: growth in a training loop without a config takes `GrowthConfig.for_training`'s options,
    beside its own held-out quarter and no per-layer replays."""
    batches = lm_batches(stdlib_bytes["stats"], 8, batch_size=8, seed=71)
    report = grow_in_training(to_grown_model(copy.deepcopy(trained_gpt2)), None, batches, p=8)
    expected = GrowthConfig.for_training(p=8, eval_fraction=0.25, measure_realized_gains=False)
    assert report.config == expected.to_dict()


def test_grow_model_for_training_takes_a_tenth_of_the_cross_fitted_step_and_keeps_the_scale(trained_gpt2,
                                                                                            stdlib_bytes, tmp_path):
    statistics_batches = lm_batches(stdlib_bytes["stats"], 8, batch_size=8, seed=72)
    held_out = lm_batches(stdlib_bytes["eval"], 3, batch_size=8, seed=73)
    grown = grow_model(trained_gpt2, statistics_batches, config=GrowthConfig.for_training(p=8),
                       eval_dataloader=held_out, measure_realized_gains=False)
    report = grown.growth_report
    assert report.cross_fit is True and report.step_mode == "per_head" and report.searched_step_size > 0
    assert report.step_size == pytest.approx(0.1 * report.searched_step_size, rel=1e-12)
    old_dim = trained_gpt2.config.n_embd // trained_gpt2.config.n_head
    assert grown.config.qk_head_dims == [old_dim + 8] * 2
    assert grown.config.attention_scale_dims == [old_dim] * 2  # the scale kept at the old width's
    (before, _), (after, _) = evaluate_loss(trained_gpt2, held_out), evaluate_loss(grown, held_out)
    assert after < before and report.eval_loss_after == pytest.approx(after, rel=1e-5)
    grown.save_pretrained(tmp_path / "for-training")
    card = str(model_card(tmp_path / "for-training", base_model="tiny-gpt2"))
    assert "`step_scale`" in card and "`cross_fit`" in card and "`keep_attention_scale`" in card
    assert "chosen for training after growth (`GrowthConfig.for_training()`" in card
    # the default's card says its step is the one-shot one, and where the other is
    one_shot = grow_model(trained_gpt2, statistics_batches, p=8, eval_dataloader=held_out, measure_realized_gains=False)
    one_shot.save_pretrained(tmp_path / "one-shot")
    card = str(model_card(tmp_path / "one-shot", base_model="tiny-gpt2"))
    assert "the whole searched step, chosen for the held-out loss now" in card
    assert "chosen for training after growth" not in card


def _config(*flags: str) -> GrowthConfig:
    return _growth_config(build_parser().parse_args(["gpt2", "--output-dir", "out", *flags]))


def test_the_command_takes_the_options_for_training_under_the_flags_given():
    assert _config() == GrowthConfig()  # the defaults as before: the whole searched step
    assert _config("--for-training") == GrowthConfig.for_training()
    assert _config("--for-training", "--p", "16") == GrowthConfig.for_training(p=16)
    # flags given win, including a default's value given explicitly
    assert _config("--for-training", "--step-scale", "1.0", "--cross-fit", "false") == GrowthConfig.for_training(
        step_scale=1.0, cross_fit=False)
    assert _config("--for-training", "--step-mode", "auto").step_mode == "auto"
    assert _config("--for-training", "--step-size", "0.02") == GrowthConfig.for_training(step_size=0.02)
    # without --for-training the preset's flags are GrowthConfig's as before
    assert _config("--cross-fit", "--step-scale", "0.5") == GrowthConfig(cross_fit=True, step_scale=0.5)
    assert "--for-training" in build_parser().format_help()


def test_a_config_for_training_is_exact_at_step_zero(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 4, batch_size=8, seed=74)
    grown = grow_model(trained_gpt2, batches, config=GrowthConfig.for_training(p=8, step_size=0.0))
    batch = lm_batches(stdlib_bytes["test"], 1, batch_size=4, seed=75)[0]
    with torch.no_grad():
        expected = trained_gpt2(**batch).logits
        assert torch.allclose(grown(**batch).logits, expected, rtol=0, atol=1e-4 * expected.abs().max())
