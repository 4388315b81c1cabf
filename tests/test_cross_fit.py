"""Cross-fitting (``cross_fit=True``): M's sum over the odd-numbered batches collected in the same pass as M, the same
in memory, on disk and over several passes, kept in the statistics file, and solved from (issue #35)."""

import copy

import pytest
import torch
from conftest import lm_batches, tiny_gpt2_config
from transformers import GPT2LMHeadModel

from hf_grow import (
    GrowthCallback, GrowthConfig, GrowthStatistics, collect_statistics, evaluate_loss, get_adapter, grow_in_training,
    grow_model, linalg, model_card, to_grown_model,
)
from hf_grow.cli import build_parser
from hf_grow.cli.checks import _growth_config
from hf_grow.growth.memory_plan import plan_memory
from hf_grow.statistics import layer_groups, statistics_bytes


@pytest.fixture(scope="module")
def three_layers() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config(n_layer=3)).eval()


@pytest.fixture(scope="module")
def batches(stdlib_bytes) -> list[dict]:
    """Five small batches with a loss, and one without (every label -100) that no half counts."""
    chosen = lm_batches(stdlib_bytes["stats"], 5, batch_size=2, seq_len=32, seed=61)
    empty = {**chosen[0], "labels": torch.full_like(chosen[0]["labels"], -100)}
    return [chosen[0], empty, *chosen[1:]]


@pytest.fixture(scope="module")
def cross_fitted(three_layers, batches) -> GrowthStatistics:
    return collect_statistics(three_layers, batches, get_adapter(three_layers), cross_fit=True)


def test_one_pass_halves_equal_two_separate_collections(three_layers, batches, cross_fitted):
    """The odd-numbered batches with a loss (the skipped one not counted) are one half, the rest the other; M is the
    same as without cross-fitting."""
    adapter = get_adapter(three_layers)
    with_loss = [batches[0], *batches[2:]]
    odd, even = (collect_statistics(three_layers, with_loss[start::2], adapter) for start in (1, 0))
    plain = collect_statistics(three_layers, batches, adapter)
    assert cross_fitted.half_loss_weight == odd.loss_weight
    assert cross_fitted.loss_weight - cross_fitted.half_loss_weight == even.loss_weight
    for layer in range(3):
        assert torch.equal(cross_fitted.gradients[layer], plain.gradients[layer])
        assert torch.equal(cross_fitted.half_gradients[layer], odd.gradients[layer])
        rest = cross_fitted.gradients[layer] - cross_fitted.half_gradients[layer]
        assert torch.allclose(rest, even.gradients[layer], rtol=0, atol=1e-12 * even.gradients[layer].abs().max())


def test_cross_fitted_gradient_is_that_of_the_halves_means(cross_fitted):
    metric = linalg.metric_from_second_moment(cross_fitted.mean_second_moment(1))
    half, total = cross_fitted.half_gradients[1], cross_fitted.gradients[1]
    first = half / cross_fitted.half_loss_weight
    second = (total - half) / (cross_fitted.loss_weight - cross_fitted.half_loss_weight)
    expected = linalg.cross_fitted_gradient(first, second, metric, 20)
    assert torch.equal(cross_fitted.cross_fitted_gradient(1, metric, 20), expected)
    some_heads = cross_fitted.cross_fitted_gradient(1, metric, 20, heads=slice(1, 3))
    assert torch.allclose(some_heads, expected[1:3], rtol=0, atol=1e-12 * expected.abs().max())  # batched eigh


def test_several_passes_equal_one_and_count_both_accumulators(three_layers, batches, cross_fitted):
    """A budget for C and two layers' M holds one layer of M and its half per pass: three passes, the same sums."""
    budget = statistics_bytes(3, 4, 64, 3)
    assert len(layer_groups(3, 4, 64, budget)) == 2 and len(layer_groups(3, 4, 64, budget, cross_fit=True)) == 3
    passes = collect_statistics(three_layers, batches, get_adapter(three_layers), memory_budget=budget, cross_fit=True)
    assert passes.half_loss_weight == cross_fitted.half_loss_weight
    for layer in range(3):
        assert torch.equal(passes.half_gradients[layer], cross_fitted.half_gradients[layer])
        assert torch.equal(passes.gradients[layer], cross_fitted.gradients[layer])
    with pytest.raises(ValueError, match=r"M of 3 layers .*half sum"):
        layer_groups(3, 4, 64, statistics_bytes(3, 4, 64, 2), cross_fit=True)


def test_batches_reordered_between_passes_are_refused_for_halves(three_layers, stdlib_bytes):
    """A loader that shuffles on each pass (DataLoader(shuffle=True)) gave the layers of later passes halves over
    other batches than the loss terms counted in pass 1 (a half mean 110% off); without halves the sums commute."""
    sized = [lm_batches(stdlib_bytes["stats"], 1, batch_size=size, seq_len=32, seed=70 + size)[0] for size in (1, 2, 3)]

    class Shuffling:
        orders = [[0, 1, 2], [1, 0, 2], [2, 1, 0]]

        def __init__(self):
            self.passes = 0

        def __iter__(self):
            order, self.passes = self.orders[self.passes % 3], self.passes + 1
            return iter([sized[index] for index in order])

    budget = statistics_bytes(3, 4, 64, 3)
    with pytest.raises(ValueError, match=r"another order in pass 2 than in pass 1 .* 62 in pass 1, 31 in pass 2"):
        collect_statistics(three_layers, Shuffling(), get_adapter(three_layers), memory_budget=budget, cross_fit=True)

    class Masking(Shuffling):  # in order, labels masked anew on each pass: the data changed, not the order
        def __iter__(self):
            self.passes += 1
            return iter([{**batch, "labels": batch["labels"].masked_fill(
                torch.rand(batch["labels"].shape, generator=torch.Generator().manual_seed(self.passes)) < 0.3, -100)}
                for batch in sized])

    with pytest.raises(ValueError, match="the data changed between passes over it"):
        collect_statistics(three_layers, Masking(), get_adapter(three_layers), memory_budget=budget, cross_fit=True)
    whole = collect_statistics(three_layers, sized, get_adapter(three_layers))
    passes = collect_statistics(three_layers, Shuffling(), get_adapter(three_layers), memory_budget=budget)
    for layer in range(3):
        torch.testing.assert_close(passes.gradients[layer], whole.gradients[layer], rtol=1e-12, atol=1e-12)


def test_halves_on_disk_equal_those_in_memory_and_are_freed_after_each_solve(three_layers, batches, cross_fitted,
                                                                             tmp_path):
    seen = []

    def solve(statistics, group):
        for layer in group:
            assert statistics.half_gradients[layer].untyped_storage().filename is not None  # in the pass's file
            seen.append(torch.equal(statistics.half_gradients[layer], cross_fitted.half_gradients[layer]))
            statistics.release(layer)
            assert statistics.gradients[layer] is None and statistics.half_gradients[layer] is None

    budget = statistics_bytes(3, 4, 64, 5)  # two layers per pass
    collect_statistics(three_layers, batches, get_adapter(three_layers), memory_budget=budget, offload_dir=tmp_path,
                       on_group=solve, cross_fit=True)
    assert seen == [True] * 3
    assert not any(tmp_path.iterdir())


def test_the_statistics_file_keeps_the_halves_and_old_files_still_load(three_layers, batches, cross_fitted, tmp_path):
    cross_fitted.save(tmp_path / "halves.safetensors")
    loaded = GrowthStatistics.load(tmp_path / "halves.safetensors")
    assert loaded.half_loss_weight == cross_fitted.half_loss_weight
    for layer in range(3):
        assert torch.equal(loaded.half_gradients[layer], cross_fitted.half_gradients[layer])
        assert torch.equal(loaded.gradients[layer], cross_fitted.gradients[layer])
    plain = collect_statistics(three_layers, batches[:3], get_adapter(three_layers))
    plain.save(tmp_path / "plain.safetensors")
    loaded = GrowthStatistics.load(tmp_path / "plain.safetensors")
    assert loaded.half_gradients is None and loaded.half_loss_weight is None


def test_too_few_batches_and_statistics_without_halves_are_refused(three_layers, batches, trained_gpt2,
                                                                   stdlib_bytes):
    adapter = get_adapter(three_layers)
    with pytest.raises(ValueError, match=r"cross_fit splits .* got 1 batch\(es\) with a loss"):
        collect_statistics(three_layers, batches[:2], adapter, cross_fit=True)  # the second has no loss term
    statistics = collect_statistics(trained_gpt2, lm_batches(stdlib_bytes["stats"], 2, 2, 32, seed=62),
                                    get_adapter(trained_gpt2))
    with pytest.raises(ValueError, match="collect them with cross_fit=True"):
        grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=0.0, cross_fit=True)
    with pytest.raises(ValueError, match="cross_fit must be True or False"):
        GrowthConfig(cross_fit="yes")


@pytest.fixture(scope="module")
def data(stdlib_bytes):
    return {
        "stats": lm_batches(stdlib_bytes["stats"], 8, batch_size=8, seed=63),
        "eval": lm_batches(stdlib_bytes["eval"], 3, batch_size=8, seed=64),
        "test": lm_batches(stdlib_bytes["test"], 3, batch_size=8, seed=65),
    }


@pytest.fixture(scope="module")
def statistics_of(trained_gpt2, data):
    return collect_statistics(trained_gpt2, data["stats"], get_adapter(trained_gpt2), cross_fit=True)


def test_cross_fitted_growth_is_exact_at_step_zero_and_steps_elsewhere(trained_gpt2, data, statistics_of):
    common = dict(p=8, statistics=statistics_of, measure_realized_gains=False)
    at_zero = grow_model(trained_gpt2, None, step_size=0.0, cross_fit=True, **common)
    batch = data["test"][0]
    with torch.no_grad():
        assert torch.allclose(at_zero(**batch).logits, trained_gpt2(**batch).logits, rtol=0, atol=1e-5)
    stepped, plain = (grow_model(trained_gpt2, None, step_size=1.0, cross_fit=cross_fit, **common)
                      for cross_fit in (True, False))
    assert stepped.growth_report.cross_fit and not plain.growth_report.cross_fit
    query = "transformer.h.0.attn.c_attn.weight"
    assert not torch.allclose(stepped.state_dict()[query], plain.state_dict()[query])
    assert not torch.allclose(stepped.state_dict()[query], at_zero.state_dict()[query])
    assert "M cross-fitted (`cross_fit`)" in stepped.growth_report.summary()
    assert "M the mean over all statistics batches" in plain.growth_report.summary()


def test_cross_fitted_growth_decreases_the_held_out_loss(trained_gpt2, data, statistics_of, tmp_path):
    """The line search's loss and the loss on text neither the statistics nor the line search saw both decrease;
    the model card says M was cross-fitted."""
    grown = grow_model(trained_gpt2, None, p=8, statistics=statistics_of, eval_dataloader=data["eval"],
                       cross_fit=True, measure_realized_gains=False)
    report = grown.growth_report
    assert report.cross_fit and report.config["cross_fit"] is True
    grown.save_pretrained(tmp_path)
    assert "- Gradient M: cross-fitted (`cross_fit`)" in model_card(tmp_path, base_model=None).text
    assert report.eval_loss_after < report.eval_loss_before - 1e-3
    assert evaluate_loss(grown, data["test"])[0] < evaluate_loss(trained_gpt2, data["test"])[0]


def test_the_memory_plan_counts_m_twice():
    with torch.device("meta"):
        model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=4))
    adapter, shape = get_adapter(model), dict(batch_size=2, seq_len=32, eval_tokens=256)
    plain, crossed = (plan_memory(model, adapter, GrowthConfig(cross_fit=cross_fit), **shape)
                      for cross_fit in (False, True))
    assert plain.stages[1].terms["M"] == 4 * 4 * 65 * 65 * 8
    assert crossed.stages[1].terms["M"] == 2 * plain.stages[1].terms["M"]
    assert crossed.stages[1].terms["M of a batch"] == plain.stages[1].terms["M of a batch"]
    assert "M counted twice" in crossed.table() and "M counted twice" not in plain.table()
    budget = crossed.budget_for(2, 8)
    assert layer_groups(4, 4, 64, budget, 8, cross_fit=True) == [[0, 1], [2, 3]]
    grouped = plan_memory(model, adapter, GrowthConfig(cross_fit=True, memory_budget=budget), **shape)
    assert grouped.groups == [[0, 1], [2, 3]] and grouped.stages[1].terms["M"] == 2 * 2 * 4 * 65 * 65 * 8


def test_the_command_takes_cross_fit():
    def config(*flags):
        return _growth_config(build_parser().parse_args(["gpt2", "--output-dir", "out", *flags]))

    assert config("--cross-fit").cross_fit is True and config().cross_fit is False


def test_growth_in_training_and_the_callback_take_cross_fit(stdlib_bytes):
    torch.manual_seed(0)
    model = to_grown_model(GPT2LMHeadModel(tiny_gpt2_config()))
    batches = lm_batches(stdlib_bytes["stats"], 4, batch_size=4, seq_len=32, seed=66)
    report = grow_in_training(model, None, batches, 8, mode="refactor", step_size=0.5, cross_fit=True)
    assert report.cross_fit and report.config["cross_fit"] is True
    assert GrowthCallback(grow_at={10: 8}, config=GrowthConfig(cross_fit=True)).config.cross_fit


def test_growth_in_training_cross_fits_by_default_where_the_statistics_can_have_halves(trained_gpt2, data,
                                                                                        statistics_of):
    """Without a config, growth in a training loop solves from the cross-fitted M and keeps every layer's attention
    scale (issue #35), where the statistics can have two halves: precomputed ones without them, or one statistics
    batch, grow without cross-fitting instead of failing; an explicit cross_fit=False is taken as given."""
    widths = get_adapter(trained_gpt2).qk_head_dims(trained_gpt2.config)

    def in_training(batches, mode="refactor", **options):
        model = to_grown_model(copy.deepcopy(trained_gpt2))
        options = {"eval_dataloader": data["eval"], **options}
        report = grow_in_training(model, None, batches, 8, mode=mode, **options)
        return model, report

    model, default = in_training(data["stats"])
    assert default.cross_fit and default.config["cross_fit"] and default.config["keep_attention_scale"]
    assert model.config.attention_scale_dims == widths and model.config.qk_head_dims == [w + 8 for w in widths]
    _, explicit = in_training(data["stats"], cross_fit=True, keep_attention_scale=True)
    assert (explicit.step_size, explicit.eval_loss_after) == (default.step_size, default.eval_loss_after)
    assert in_training(None, statistics=statistics_of)[1].cross_fit
    plain = collect_statistics(trained_gpt2, data["stats"], get_adapter(trained_gpt2))
    assert not in_training(None, statistics=plain)[1].cross_fit
    assert not in_training(data["stats"][:1])[1].cross_fit  # one batch: no second half
    # Without held-out batches the last quarter (at least one) is held out: of two batches one is left.
    assert not in_training(data["stats"][:2], eval_dataloader=None)[1].cross_fit
    assert not in_training(data["stats"][:2], eval_dataloader=None, step_mode="coordinate")[1].cross_fit  # as well
    assert not in_training(data["stats"], cross_fit=False)[1].cross_fit
    # max_batches=1 leaves the statistics one batch, of a list or an iterable (both were refused: "leave cross_fit off")
    for batches in (data["stats"], iter(data["stats"])):
        assert not in_training(batches, max_batches=1)[1].cross_fit
    assert not in_training(data["stats"], max_batches=1, eval_dataloader=None)[1].cross_fit
    assert in_training(data["stats"][:3], max_batches=2, eval_dataloader=None)[1].cross_fit
    with pytest.raises(ValueError, match="leave cross_fit off"):  # one batch from an iterable of unknown length
        in_training(iter(data["stats"][:1]))
    zero, _ = in_training(None, mode="zero")
    assert zero.config.attention_scale_dims == widths
