"""``step_scale``: a fraction of the line-searched step, for training after growth that overfits (issue #35)."""

import copy
import json

import pytest
import torch

from hf_grow import (
    GrowthConfig,
    GrowthReport,
    collect_statistics,
    evaluate_loss,
    get_adapter,
    grow_in_training,
    grow_model,
    to_grown_model,
)
from hf_grow.card import model_card

from conftest import lm_batches


@pytest.fixture(scope="module")
def statistics(trained_gpt2, stdlib_bytes):
    return collect_statistics(trained_gpt2, lm_batches(stdlib_bytes["stats"], 4, seed=51), get_adapter(trained_gpt2))


@pytest.fixture(scope="module")
def held_out(stdlib_bytes):
    return lm_batches(stdlib_bytes["eval"], 3, seed=53)


def grown(model, statistics, held_out, **settings):
    return grow_model(model, None, p=8, statistics=statistics, eval_dataloader=held_out, **settings)


def test_the_step_taken_is_that_fraction_of_the_searched_one(trained_gpt2, statistics, held_out, tmp_path):
    searched = grown(trained_gpt2, statistics, held_out).growth_report
    shrunk = grown(trained_gpt2, statistics, held_out, step_scale=0.25)
    report = shrunk.growth_report
    assert searched.step_size > 0 and searched.searched_step_size is None
    assert report.searched_step_size == searched.step_size
    assert report.step_size == pytest.approx(0.25 * searched.step_size, rel=1e-12)
    # the weights of the given step, its held-out loss measured (one more pass), between the old and the searched
    given = grown(trained_gpt2, statistics, held_out, step_size=report.step_size)
    for name, tensor in given.state_dict().items():
        torch.testing.assert_close(shrunk.state_dict()[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    assert report.eval_loss_after == pytest.approx(evaluate_loss(shrunk, held_out)[0], abs=1e-6)
    assert searched.eval_loss_after < report.eval_loss_after < report.eval_loss_before
    assert report.line_search_passes == searched.line_search_passes + 1
    # the realized gains are of the step taken
    assert [layer.realized_gain for layer in report.layers] == pytest.approx(
        [layer.realized_gain for layer in given.growth_report.layers], abs=1e-6
    )
    # said in the summary and the card, kept through JSON
    assert "(0.25 of the searched" in report.summary()
    shrunk.save_pretrained(tmp_path)
    assert "0.25 of the searched" in str(model_card(tmp_path, base_model=None))
    assert GrowthReport.from_dict(json.loads(json.dumps(report.to_dict()))).searched_step_size == searched.step_size


def test_auto_options_scale_the_kept_candidates_step(trained_gpt2, statistics, held_out):
    auto = dict(truncation="auto", step_mode="auto", measure_realized_gains=False)
    chosen = grown(trained_gpt2, statistics, held_out, **auto).growth_report
    report = grown(trained_gpt2, statistics, held_out, step_scale=0.5, **auto).growth_report
    assert (report.truncation, report.step_mode, report.selection) == (
        chosen.truncation, chosen.step_mode, chosen.selection
    )
    assert report.searched_step_size == chosen.step_size
    assert report.step_size == pytest.approx(0.5 * chosen.step_size, rel=1e-12)


def test_growth_in_training_takes_the_fraction_too(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 4, seed=55)
    model = to_grown_model(copy.deepcopy(trained_gpt2))
    report = grow_in_training(model, None, batches, p=8, step_scale=0.5)
    assert report.searched_step_size is not None and report.step_size == pytest.approx(0.5 * report.searched_step_size)


def test_growth_in_training_takes_a_tenth_of_the_searched_step_by_default(trained_gpt2, stdlib_bytes):
    """Training follows every growth in a training loop: without a config it takes `FOR_TRAINING`'s step_scale of the
    searched step (measured never behind training at the old width, issue #35); a given step is taken as it is,
    and a config is used as given (its step_scale 1.0: the whole searched step)."""
    from hf_grow.config import FOR_TRAINING
    from hf_grow.training.grow import IN_TRAINING_DEFAULTS

    batches = lm_batches(stdlib_bytes["stats"], 4, seed=55)

    def in_training(**options):
        return grow_in_training(to_grown_model(copy.deepcopy(trained_gpt2)), None, batches, p=8, **options)

    default = in_training()
    assert FOR_TRAINING["step_scale"] == 0.1 and default.searched_step_size > 0
    assert default.step_size == pytest.approx(0.1 * default.searched_step_size, rel=1e-12)
    assert in_training(step_size=0.05).step_size == 0.05  # no fraction of a given step
    whole = in_training(config=GrowthConfig(p=8, **IN_TRAINING_DEFAULTS, step_mode="per_head",
                                            keep_attention_scale=True, cross_fit=True))
    assert whole.searched_step_size is None and whole.step_size == default.searched_step_size


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"step_scale": 0.0}, r"step_scale must be in \(0, 1\]"),
        ({"step_scale": 1.5}, r"step_scale must be in \(0, 1\]"),
        ({"step_scale": float("nan")}, r"step_scale must be in \(0, 1\]"),
        ({"step_scale": 0.5, "step_size": 0.1}, "with a step_size given, pass the step to take"),
        ({"step_scale": 0.5, "step_mode": "coordinate"}, "step_mode='coordinate' refines each layer's own"),
    ],
)
def test_a_step_scale_that_cannot_apply_is_refused_before_any_work(trained_gpt2, settings, message):
    with pytest.raises(ValueError, match=message):
        grow_model(trained_gpt2, iter(()), p=8, **settings)


@pytest.mark.parametrize("worse", [1.0, float("nan")])
def test_a_fraction_worse_than_no_step_falls_back_to_step_0(trained_gpt2, statistics, held_out, monkeypatch, worse):
    """The loss need not be convex along the line (in bfloat16, refactored factors round away from the old weights at
    any step > 0): a fraction of the searched step was taken even where its held-out loss was above step 0's."""
    import inspect

    from hf_grow.growth import search

    def worse_at_the_fraction(*args, **kwargs):
        loss, weight = evaluate_loss(*args, **kwargs)
        return (loss + worse if inspect.stack()[1].function == "take_step_scale" else loss), weight

    monkeypatch.setattr(search, "evaluate_loss", worse_at_the_fraction)
    model = grown(trained_gpt2, statistics, held_out, step_scale=0.25)
    report = model.growth_report
    assert report.step_size == 0 and report.searched_step_size > 0
    assert report.eval_loss_after == report.eval_loss_before
    monkeypatch.undo()
    assert evaluate_loss(model, held_out)[0] == pytest.approx(report.eval_loss_before, abs=1e-6)
    exact = grown(trained_gpt2, statistics, held_out, step_size=0.0)
    for name, tensor in exact.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
