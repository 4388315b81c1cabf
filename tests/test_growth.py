"""grow_model on a GPT-2 trained on real text: the held-out loss decreases, the report tells the truth."""

import copy
import dataclasses
import json
import math

import pytest
import torch
from transformers import GPT2LMHeadModel

from hf_grow import (
    DEFAULT_TRUNCATION,
    GrowthConfig,
    GrowthReport,
    collect_statistics,
    evaluate_loss,
    get_adapter,
    grow_model,
    inspect_growth,
    load_growth_report,
)
from hf_grow.growth import best_step, search_step_size

from conftest import lm_batches, tiny_gpt2_config


@pytest.fixture(scope="module")
def data(stdlib_bytes):
    return {
        "stats": lm_batches(stdlib_bytes["stats"], 12, seed=21),
        "eval": lm_batches(stdlib_bytes["eval"], 4, seed=22),
        "test": lm_batches(stdlib_bytes["test"], 6, seed=23),
    }


@pytest.fixture(scope="module")
def grown_by_truncation(trained_gpt2, data):
    return {
        truncation: grow_model(trained_gpt2, data["stats"], p=8, eval_dataloader=data["eval"], truncation=truncation,
                              step_mode="per_head")
        for truncation in ("whitened", "frobenius")
    }


def test_growth_decreases_held_out_loss(trained_gpt2, grown_by_truncation, data):
    grown = grown_by_truncation["whitened"]
    report = grown.growth_report
    before, _ = evaluate_loss(trained_gpt2, data["eval"])
    assert report.eval_loss_before == pytest.approx(before, abs=1e-5)
    assert report.eval_loss_after < report.eval_loss_before - 2e-3
    assert report.step_size > 0
    assert evaluate_loss(grown, data["eval"])[0] == pytest.approx(report.eval_loss_after, abs=1e-6)
    # The decrease carries over to text neither the statistics nor the line search saw.
    assert evaluate_loss(grown, data["test"])[0] < evaluate_loss(trained_gpt2, data["test"])[0] - 1e-3


def test_the_default_chooses_and_its_simplest_candidate_is_at_least_as_good(grown_by_truncation):
    whitened = grown_by_truncation["whitened"].growth_report
    frobenius = grown_by_truncation["frobenius"].growth_report
    assert DEFAULT_TRUNCATION == GrowthConfig().truncation == "whitened" and GrowthConfig().step_mode == "auto"
    assert GrowthConfig().candidates[0] == ("whitened", "per_head")
    assert whitened.eval_loss_after <= frobenius.eval_loss_after + 1e-4


def test_report_is_complete_and_consistent(trained_gpt2, grown_by_truncation, data, tmp_path):
    grown = grown_by_truncation["whitened"]
    report = grown.growth_report
    assert report.qk_dims_before == [16, 16] and report.qk_dims_after == [24, 24]
    assert report.parameters_added == grown.num_parameters() - trained_gpt2.num_parameters() == 2 * 2 * 4 * 8 * 65
    assert report.statistics_tokens == 12 * 16 * 64 and report.statistics_batches == 12
    assert report.eval_weight == 4 * 16 * 63  # next-token targets: exact, shifted counts
    assert {"statistics", "solve", "line_search", "total"} <= set(report.seconds)
    assert report.perplexity_after == pytest.approx(math.exp(report.eval_loss_after))
    # Every evaluated point is in the report; the chosen one is the best, and step 0 is among them.
    losses = {point.step_size: point.loss for point in report.line_search}
    assert losses[0.0] == pytest.approx(report.eval_loss_before)
    assert min(losses.values()) == pytest.approx(report.eval_loss_after)
    assert report.lam > 0
    for layer in report.layers:
        assert len(layer.heads) == 4
        assert layer.realized_gain is not None
        for head in layer.heads:
            assert len(head.marginal_gains) == 8 and head.lam > 0
            assert all(a >= b >= 0 for a, b in zip(head.marginal_gains, head.marginal_gains[1:]))
            # Growing adds the marginal gains of the added ranks to the same solve at the old rank.
            assert head.expected_gain == pytest.approx(
                head.expected_gain_without_growth + sum(head.marginal_gains), rel=1e-6, abs=1e-9
            )
    assert sum(layer.expected_gain for layer in report.layers) > 0
    # JSON round trip
    path = tmp_path / "report.json"
    report.to_json_file(path)
    assert GrowthReport.from_dict(json.loads(path.read_text())).to_dict() == report.to_dict()
    assert "held-out loss" in report.summary()
    assert report.step_mode == "per_head" and ", per head)" in report.summary()  # each head at its own lam


def test_a_report_of_a_newer_version_loads_and_a_damaged_one_is_named(grown_by_truncation, tmp_path):
    """Unknown entries were left out at the top level only: one in a layer or a head (HeadReport gains fields
    from release to release) made load_growth_report, model_card and push_to_hub fail on a newer report."""
    report = grown_by_truncation["whitened"].growth_report.to_dict()
    newer = {**report, "new": 1, "line_search": [{**point, "new": 1} for point in report["line_search"]],
             "layers": [{**layer, "new": 1, "heads": [{**head, "new": 1} for head in layer["heads"]]}
                        for layer in report["layers"]]}
    assert GrowthReport.from_dict(newer).to_dict() == report
    (tmp_path / "growth_report.json").write_text(json.dumps(report)[:-20])
    with pytest.raises(ValueError, match="growth_report.json is not a growth report"):
        load_growth_report(tmp_path)


def test_fast_search_brackets_with_the_unconstrained_update(trained_gpt2, data):
    grown = grow_model(
        trained_gpt2, data["stats"], p=8, eval_dataloader=data["eval"], search="fast", measure_realized_gains=False,
        step_mode="per_head",  # one candidate: the default's choice searches each from a known step
    )
    report = grown.growth_report
    kinds = {point.kind for point in report.line_search}
    assert kinds == {"unconstrained", "rank"}
    assert report.unconstrained_eval_loss < report.eval_loss_before
    assert report.eval_loss_after < report.eval_loss_before - 2e-3


def test_without_growth_the_same_solve_still_helps(trained_gpt2, data):
    grown = grow_model(
        trained_gpt2, data["stats"], p={0: 0, 1: 0}, eval_dataloader=data["eval"], measure_realized_gains=False
    )
    assert grown.config.qk_head_dims == [16, 16]
    assert grown.growth_report.eval_loss_after < grown.growth_report.eval_loss_before


def test_default_split_holds_out_the_last_batches(trained_gpt2, data):
    batches = data["stats"] + data["eval"][:2]  # 14 batches: the last round(1.4) = 1 is held out
    grown = grow_model(trained_gpt2, batches, p=8, measure_realized_gains=False)
    assert grown.growth_report.statistics_batches == 13
    assert grown.growth_report.eval_loss_before == pytest.approx(evaluate_loss(trained_gpt2, batches[-1:])[0], abs=1e-5)


def test_max_batches_bounds_what_the_default_split_reads(trained_gpt2, data):
    """With max_batches and no eval_dataloader, only the batches the statistics and their held-out share need are
    read: an endless dataloader returns."""
    read = []

    def endless():
        while True:
            for batch in data["stats"]:
                if len(read) == 100:
                    raise AssertionError("the dataloader was read past what max_batches needs")
                read.append(batch)
                yield batch

    grown = grow_model(trained_gpt2, endless(), p=8, max_batches=4, eval_fraction=0.5, measure_realized_gains=False)
    assert len(read) == 8 and grown.growth_report.statistics_batches == 4  # 8 read, the last 4 held out
    expected = evaluate_loss(trained_gpt2, data["stats"][4:8])[0]
    assert grown.growth_report.eval_loss_before == pytest.approx(expected, abs=1e-5)


def test_given_step_size_skips_the_search_and_is_deterministic(trained_gpt2, data):
    first = grow_model(trained_gpt2, data["stats"][:4], p=8, step_size=0.05)
    second = grow_model(trained_gpt2, data["stats"][:4], p=8, step_size=0.05)
    assert first.growth_report.line_search == [] and first.growth_report.eval_loss_before is None
    assert first.growth_report.step_size == 0.05
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    # Q/K actually moved; everything else is the input's.
    attention = get_adapter(first).attention_modules(first)[0]
    original = get_adapter(trained_gpt2).attention_modules(trained_gpt2)[0]
    assert not torch.allclose(attention.c_attn.weight[:, :64], original.c_attn.weight[:, :64])
    assert torch.equal(attention.c_attn.weight[:, -64:], original.c_attn.weight[:, -64:])
    assert torch.equal(first.transformer.wte.weight, trained_gpt2.transformer.wte.weight)


def test_zero_gradients_mean_no_step(trained_gpt2, data):
    """A constant loss: nothing to learn, the model keeps its function exactly."""
    grown = grow_model(
        trained_gpt2, data["stats"][:3], p=8, eval_dataloader=data["eval"][:1],
        loss_fn=lambda model, batch: model(**batch).logits.sum() * 0.0,
    )
    report = grown.growth_report
    assert report.step_size == 0.0 and report.eval_loss_after == report.eval_loss_before
    assert all(head.expected_gain == 0 for layer in report.layers for head in layer.heads)
    batch = data["test"][0]
    with torch.no_grad():
        assert (grown(**batch).logits - trained_gpt2(**batch).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("architecture", ["gpt2", "bert"])
def test_peft_model_is_merged_into_a_copy(architecture, trained_gpt2, data, caplog):
    """LoRA deltas (random, so that merging matters) end up in the grown Q/K; the PeftModel is untouched."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForMaskedLM

    if architecture == "gpt2":
        base = copy.deepcopy(trained_gpt2)
        lora = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    else:
        torch.manual_seed(0)
        base = BertForMaskedLM(
            BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
        )
        lora = LoraConfig(r=4, target_modules=["query", "value"], init_lora_weights=False)
    peft_model = get_peft_model(base, lora).eval()
    before = {name: tensor.clone() for name, tensor in peft_model.state_dict().items()}
    with caplog.at_level("WARNING", logger="hf_grow"):
        grown = grow_model(peft_model, data["stats"][:2], p=8, step_size=0.0)
    assert "merge_and_unload" in caplog.text
    assert type(grown).__name__.startswith("Grown") and not any("lora" in name for name in grown.state_dict())
    assert all(parameter.requires_grad for parameter in grown.parameters())  # merged: frozen for LoRA no more
    batch = data["test"][0]
    with torch.no_grad():
        expected, actual = peft_model(**batch).logits, grown(**batch).logits
    assert (expected - actual).abs().max() <= 1e-4
    state = peft_model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[name], before[name]) for name in before)
    with peft_model.disable_adapter():  # the base model's function: its adapters were merged in all the same
        grown = grow_model(peft_model, data["stats"][:2], p=8, step_size=0.0)
        with torch.no_grad():
            assert (grown(**batch).logits - peft_model(**batch).logits).abs().max() <= 1e-4


def test_a_peft_model_with_prompt_learning_adapters_is_refused_before_any_data(trained_gpt2):
    """Prompt tuning adds virtual tokens, not weights: nothing can be merged into the Q/K that growth rewrites."""
    from peft import PromptTuningConfig, TaskType, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(trained_gpt2), PromptTuningConfig(task_type=TaskType.CAUSAL_LM,
                                                                                num_virtual_tokens=4))

    def unread():
        raise AssertionError("the data was read before the model was checked")
        yield

    with pytest.raises(ValueError, match=r"prompt-learning adapters \['default'\].*peft_model.get_base_model\(\)"):
        grow_model(peft_model, unread(), p=8)


def test_precomputed_statistics_give_the_same_growth(trained_gpt2, data):
    statistics = collect_statistics(trained_gpt2, data["stats"], get_adapter(trained_gpt2))
    direct = grow_model(trained_gpt2, data["stats"], p=8, step_size=0.05)
    reused = grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=statistics)
    assert all(torch.equal(tensor, reused.state_dict()[name]) for name, tensor in direct.state_dict().items())
    with pytest.raises(ValueError, match="collected for another model"):
        grow_model(GPT2LMHeadModel(tiny_gpt2_config(n_layer=3)), None, p=8, step_size=0.0, statistics=statistics)
    with pytest.raises(ValueError, match="eval_dataloader"):
        grow_model(trained_gpt2, None, p=8, statistics=statistics)
    with pytest.raises(ValueError, match="needs a dataloader"):
        grow_model(trained_gpt2, None, p=8, step_size=0.0)


@pytest.mark.parametrize("solver", ["svd", "subspace"])
def test_solvers_take_the_same_step(trained_gpt2, data, solver):
    """Full SVD and warm-started subspace iteration give the weights of the default (auto: eigh at this size)."""
    fast = grow_model(trained_gpt2, data["stats"], p=8, step_size=0.05, measure_realized_gains=False)
    other = grow_model(trained_gpt2, data["stats"], p=8, step_size=0.05, solver=solver, measure_realized_gains=False)
    assert (fast.growth_report.solver, other.growth_report.solver) == ("eigh", solver)
    test = data["test"][:2]
    assert evaluate_loss(fast, test)[0] == pytest.approx(evaluate_loss(other, test)[0], abs=1e-6)
    with pytest.raises(ValueError, match="solver must be one of"):
        grow_model(trained_gpt2, data["stats"], p=8, solver="lanczos")


def test_subspace_line_search_matches_eigh(trained_gpt2, data):
    """A whole line search with the warm-started subspace solver: the same steps, losses and chosen weights as
    with full eigendecompositions, and the written weights are those the search evaluated."""
    statistics = collect_statistics(trained_gpt2, data["stats"][:4], get_adapter(trained_gpt2))
    runs = {
        solver: grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=data["eval"], solver=solver,
                           measure_realized_gains=False)
        for solver in ("eigh", "subspace")
    }
    eigh, subspace = (runs[solver].growth_report for solver in ("eigh", "subspace"))
    assert [point.step_size for point in subspace.line_search] == [point.step_size for point in eigh.line_search]
    for a, b in zip(subspace.line_search, eigh.line_search):
        assert a.loss == pytest.approx(b.loss, abs=1e-6)
    assert subspace.step_size == eigh.step_size > 0
    assert evaluate_loss(runs["subspace"], data["eval"])[0] == pytest.approx(subspace.eval_loss_after, abs=1e-6)
    adapter = get_adapter(runs["eigh"])
    for grown_eigh, grown_subspace in zip(
        *(adapter.attention_modules(runs[solver]) for solver in ("eigh", "subspace"))
    ):
        # Factors are unique up to signs and rotations: compare the bilinear forms Q K^T of every head (the
        # subspace method stops within a relative 1e-7 of the optimal truncation error, not at exact vectors).
        forms = [query @ key.mT for query, key in (adapter.read_qk(grown_eigh), adapter.read_qk(grown_subspace))]
        torch.testing.assert_close(forms[1], forms[0], rtol=0, atol=1e-4 * float(forms[0].abs().max()))


def test_batches_without_loss_terms_are_skipped_not_nan(trained_gpt2, data, caplog):
    """An all-padding batch (and one-token sequences for a causal LM) has no loss term: skipped with a warning,
    never a NaN; data made only of such batches is a clear error."""
    empty = {key: value.clone() for key, value in data["stats"][0].items()}
    empty["attention_mask"].zero_()
    empty["labels"].fill_(-100)
    with caplog.at_level("WARNING", logger="hf_grow"):
        grown = grow_model(
            trained_gpt2, [data["stats"][1], empty, data["stats"][2]], p=8, eval_dataloader=[empty, *data["eval"][:1]]
        )
    assert "skipped 1 batch" in caplog.text
    report = grown.growth_report
    assert report.statistics_batches == 2 and report.statistics_tokens == 2 * 16 * 64
    assert math.isfinite(report.eval_loss_before) and math.isfinite(report.eval_loss_after)
    assert all(torch.isfinite(tensor).all() for tensor in grown.state_dict().values() if tensor.is_floating_point())
    one_token = [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        for ids in torch.randint(0, 256, (3, 4, 1))
    ]
    with pytest.raises(ValueError, match="none of the 3 batches has a loss term"):
        grow_model(trained_gpt2, one_token, p=8, step_size=0.0)


def unread():
    """A dataloader that fails the test if growth reads it."""
    raise AssertionError("the dataloader was read before the arguments were checked")
    yield


def without_labels(batches):
    return [{**batch, "labels": torch.full_like(batch["labels"], -100)} for batch in batches]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"initial_step_size": float("nan")}, "initial_step_size must be a finite number > 0"),
        ({"initial_step_size": 0.0}, "initial_step_size must be a finite number > 0"),
        ({"initial_step_size": -0.03}, "initial_step_size must be a finite number > 0"),
        ({"rtol": 2.0}, "rtol must be in \\[1e-13, 1\\)"),
        ({"rtol": 0.0}, "rtol must be in \\[1e-13, 1\\)"),
        ({"max_batches": 0}, "max_batches must be a positive int"),
        ({"max_batches": True}, "max_batches must be a positive int"),
        ({"memory_budget": "lots"}, "memory_budget 'lots' is not a size"),
        ({"eval_dataloader": "unlabelled"}, "the held-out data holds no loss terms"),
        ({"eval_dataloader": "too long"}, "held-out batch 1 holds sequences of 65 tokens, but the model has 64"),
    ],
)
def test_bad_arguments_fail_before_any_data_is_read(trained_gpt2, data, arguments, message):
    if arguments.get("eval_dataloader") == "unlabelled":
        arguments = {"eval_dataloader": without_labels(data["eval"][:2])}
    if arguments.get("eval_dataloader") == "too long":
        longer = {name: torch.cat([tensor, tensor[:, :1]], dim=1) for name, tensor in data["eval"][1].items()}
        arguments = {"eval_dataloader": [data["eval"][0], longer]}
    with pytest.raises(ValueError, match=message):
        grow_model(trained_gpt2, unread(), p=8, **arguments)
    if "rtol" in arguments:
        with pytest.raises(ValueError, match=message):
            inspect_growth(trained_gpt2, unread(), rtol=arguments["rtol"])


def test_held_out_fraction_must_leave_statistics_batches(trained_gpt2, data):
    with pytest.raises(ValueError, match="eval_fraction=0.75 holds out all 2 batches, leaving none for the statistics"):
        grow_model(trained_gpt2, data["stats"][:2], p=8, eval_fraction=0.75)


def test_line_search_ranks_non_finite_losses_last():
    """A step whose loss overflows is never chosen, also where it is tried first; ties go to the smaller step."""

    def overflowing(step: float) -> float:
        return float("nan") if step > 1.0 else (step - 0.1) ** 2

    losses = search_step_size(overflowing, start=100.0)
    best = min(losses, key=losses.get)
    assert losses[100.0] == math.inf and 0.05 < best < 0.2
    assert search_step_size(lambda step: 0.0 if step == 0 else float("nan"), start=0.03) == {
        **{0.03 / 4**k: math.inf for k in range(12)}, 0.0: 0.0
    }


def test_the_walk_down_stops_where_a_step_changes_the_loss_by_less_than_its_rounding():
    """A model without gains: the loss rises with the step, and from some step on it is step 0's to the last bit.
    The walk down stops there (it went on to 7e-9, every pass a held-out pass and every head decomposed), and
    still finds a gain that lies above that step."""
    calls = []

    def flat_below(threshold: float, better: float | None = None):
        def loss(step: float) -> float:
            calls.append(step)
            if better is not None and step == better:
                return 0.5
            return 1.0 if step <= threshold else 1.0 + step
        return loss

    losses = search_step_size(flat_below(0.03 / 4**2), start=0.03)
    assert sorted(losses) == [0.0, 0.03 / 4**3, 0.03 / 4**2, 0.03 / 4, 0.03] and best_step(losses) == 0.0
    assert len(calls) == 5  # two ties in a row
    losses = search_step_size(flat_below(0.03 / 4**2, better=0.03 / 4**4), start=0.03)
    assert 0.03 / 4**4 not in losses  # the walk stopped above it: a gain below rounding's step is not looked for
    # one tie is a curve crossing step 0's level beyond its minimum (rounded as bfloat16 rounds): the walk goes on
    crossing = lambda step: float(torch.tensor(3 - 0.5 * step + 2 * step**2).bfloat16())  # noqa: E731
    assert best_step(search_step_size(crossing, start=0.25)) > 0
    losses = search_step_size(lambda step: 1.0 - step * (0.1 - step), start=0.03)
    assert 0.04 < best_step(losses) < 0.06  # a real minimum is still found


def test_a_step_whose_loss_overflows_in_float16_is_never_taken(trained_gpt2, data):
    """In float16 the first steps of a search from a huge step overflow the scores (NaN losses): the search
    ranks them last (it used to take the first) and takes a finite step, never worse than step 0."""
    model = GPT2LMHeadModel(tiny_gpt2_config(attn_implementation="eager"))
    model.load_state_dict(trained_gpt2.state_dict())
    model = model.half().eval()
    held_out = [{name: tensor[:4] for name, tensor in data["eval"][0].items()}]
    grown = grow_model(
        model, data["stats"][:3], p=8, eval_dataloader=held_out, initial_step_size=1e4, measure_realized_gains=False
    )
    report = grown.growth_report
    assert report.line_search[0].loss is None and report.line_search[0].step_size == 1e4  # NaN, JSON's null
    json.dumps(report.to_dict(), allow_nan=False)  # strict JSON: raises on NaN
    assert math.isfinite(report.step_size) and report.step_size < 1e3
    assert math.isfinite(report.eval_loss_after) and report.eval_loss_after <= report.eval_loss_before
    with torch.no_grad():
        assert torch.isfinite(grown(**data["test"][0]).logits).all()


def test_same_inputs_give_bit_identical_growth(trained_gpt2, data):
    runs = [
        grow_model(trained_gpt2, data["stats"][:4], p=8, eval_dataloader=data["eval"][:2], measure_realized_gains=False)
        for _ in range(2)
    ]
    first, second = (run.state_dict() for run in runs)
    assert all(torch.equal(tensor, second[name]) for name, tensor in first.items())
    assert runs[0].growth_report.step_size == runs[1].growth_report.step_size


def test_a_corpus_of_one_repeated_token_keeps_everything_finite(trained_gpt2):
    """One repeated byte in 8-token windows: C has rank <= 9 of 65 in every layer. The pseudo-inverses take
    only the data's span; growth stays finite, exact at step 0, and does not raise the held-out loss."""
    ids = torch.full((16, 8), ord(" "))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids} for _ in range(4)]
    statistics = collect_statistics(trained_gpt2, batches[:3], get_adapter(trained_gpt2))
    assert all(torch.linalg.matrix_rank(statistics.mean_second_moment(layer), rtol=1e-6) <= 9 for layer in range(2))
    grown = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=batches[3:])
    report = grown.growth_report
    assert report.eval_loss_after <= report.eval_loss_before
    assert all(torch.isfinite(tensor).all() for tensor in grown.state_dict().values() if tensor.is_floating_point())
    gains = [
        value for layer in report.layers for head in layer.heads for value in (head.expected_gain, *head.marginal_gains)
    ]
    assert all(math.isfinite(gain) for gain in gains)
    unchanged = grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=0.0)
    with torch.no_grad():
        assert (unchanged(**batches[3]).logits - trained_gpt2(**batches[3]).logits).abs().max() <= 1e-4


def test_sequences_beyond_the_models_positions_are_a_clear_error(trained_gpt2, data):
    positions = trained_gpt2.config.n_positions
    ids = torch.zeros(2, positions + 1, dtype=torch.long)
    too_long = {"input_ids": ids, "labels": ids}
    with pytest.raises(
        ValueError, match=f"batch 1 holds sequences of {positions + 1} tokens, but the model has {positions} positions"
    ):
        grow_model(trained_gpt2, [data["stats"][0], too_long, data["stats"][1]], p=8, step_size=0.0)
    with pytest.raises(ValueError, match=f"batch 0 holds sequences of {positions + 1} tokens"):
        evaluate_loss(trained_gpt2, [too_long])


def test_step_zero_returns_the_old_weights_and_function_off_the_statistics_span(trained_gpt2, stdlib_bytes):
    """Step size 0 in refactor mode is the old weights, zero-padded (queries times the fold of the scale): not a
    re-factorization of Z that is exact only on the span of the statistics' inputs. With 16 statistics tokens
    (C of rank <= 16 of 65), text the statistics never saw must still get the old logits."""
    stats = lm_batches(stdlib_bytes["stats"], 1, batch_size=1, seq_len=16, seed=3)
    grown = grow_model(trained_gpt2, stats, p=8, step_size=0.0)  # GPT-2: mode "refactor"
    adapter = get_adapter(trained_gpt2)
    pairs = zip(adapter.attention_modules(trained_gpt2), adapter.attention_modules(grown))
    for layer, (old, new) in enumerate(pairs):
        (query, key), (grown_query, grown_key) = adapter.read_qk(old), adapter.read_qk(new)
        fold = adapter.current_scaling(trained_gpt2.config, layer) / adapter.current_scaling(grown.config, layer)
        width = query.shape[-1]
        torch.testing.assert_close(grown_query[..., :width], query * fold, rtol=1e-6, atol=0)
        assert torch.equal(grown_key[..., :width], key)
        assert not grown_query[..., width:].any() and not grown_key[..., width:].any()
    batch = lm_batches(stdlib_bytes["test"], 1, batch_size=4, seed=5)[0]
    with torch.no_grad():
        difference = (grown(**batch).logits - trained_gpt2(**batch).logits).abs().max()
    assert difference <= 1e-4, difference


def test_best_step_breaks_ties_towards_the_smaller_step():
    """Equal losses: the smaller step, and step 0 over any step that gains nothing (the docstring's rule, which
    test_line_search_ranks_non_finite_losses_last states but checks with its own min, not best_step)."""
    assert best_step({0.0: 1.0, 0.25: 1.0, 1.0: 2.0}) == 0.0
    assert best_step({0.0: 2.0, 0.5: 1.0, 0.125: 1.0}) == 0.125
    losses = search_step_size(lambda step: 0.0 if step == 0 else float("nan"), start=0.03)
    assert best_step(losses) == 0.0


def test_summary_shows_each_loss_under_its_own_label(trained_gpt2, stdlib_bytes):
    """The summary (what the command prints) puts the loss before growth under "before" and after under "after",
    and each layer's gains in its own row: the existing checks look only for the words "held-out loss". Losses set
    apart by far more than the 4 decimals shown (a tiny growth's gain can round away)."""
    stats = lm_batches(stdlib_bytes["stats"], 3, seed=21)
    evaluation = lm_batches(stdlib_bytes["eval"], 2, seed=22)
    report = grow_model(trained_gpt2, stats, p=8, eval_dataloader=evaluation, step_mode="global").growth_report
    report = dataclasses.replace(report, eval_loss_before=3.0, eval_loss_after=2.5)
    summary = report.summary()
    assert "held-out loss  before 3.0000  after 2.5000" in summary
    assert f"perplexity     before {math.exp(3.0):.4f}  after {math.exp(2.5):.4f}" in summary
    for layer in report.layers:
        assert f"{layer.layer:5d}  {layer.qk_dim_before}->{layer.qk_dim_after}  {layer.expected_gain:13.5f}" in summary
    # a loss of one's own on a language model is no perplexity (the exp of a contrastive loss was shown as one)
    own = grow_model(trained_gpt2, stats, p=8, eval_dataloader=evaluation, step_mode="global",
                     loss_fn=lambda model, batch: 2 * model(**batch).loss).growth_report
    assert own.perplexity_before is None and "perplexity" not in own.summary() and own.model_loss is False
