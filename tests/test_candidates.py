"""truncation="auto" / step_mode="auto": the held-out loss chooses the candidate, confirmed on batches the search
never saw (`hf_grow.growth.candidates`)."""

import math

import pytest
import torch

from hf_grow import GrowthConfig, collect_statistics, evaluate_loss, get_adapter, grow_model
from hf_grow.card import model_card
from hf_grow.report import load_growth_report

from conftest import lm_batches, outputs_of


AUTO = dict(truncation="auto", step_mode="auto")


@pytest.fixture(scope="module")
def statistics(trained_gpt2, stdlib_bytes):
    return collect_statistics(trained_gpt2, lm_batches(stdlib_bytes["stats"], 4, seed=31), get_adapter(trained_gpt2))


@pytest.fixture(scope="module")
def held_out(stdlib_bytes):
    """A held-out batch on which whitened truncation with steps per layer beats the simplest candidate (whitened,
    per head) by about 0.001 nats: the constructed case with a known better candidate that is not the simplest."""
    return lm_batches(stdlib_bytes["eval"], 1, seed=43)[0]


def signed_loss(model, batch):
    """The model's loss, negated on batches marked ``sign=-1``: such a batch ranks the candidates opposite."""
    loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    return loss * batch.get("sign", 1.0)


def grown(model, statistics, eval_batches, **settings):
    return grow_model(model, None, p=8, statistics=statistics, eval_dataloader=eval_batches, loss_fn=signed_loss,
                      measure_realized_gains=False, **settings)


@pytest.fixture(scope="module")
def alone(trained_gpt2, statistics, held_out):
    """Each candidate grown alone, its step searched on the held-out batch: (truncation, step_mode) -> report."""
    return {
        (truncation, step_mode): grown(trained_gpt2, statistics, [held_out], truncation=truncation,
                                       step_mode=step_mode).growth_report
        for truncation, step_mode in GrowthConfig(**AUTO).candidates
    }


@pytest.fixture(scope="module")
def chosen(trained_gpt2, statistics, held_out):
    """Auto options with confirmation batches that agree with the search's: the same batch again."""
    return grown(trained_gpt2, statistics, [held_out, held_out], **AUTO)


def test_the_search_keeps_the_known_better_candidate(chosen, alone):
    best = min(alone, key=lambda candidate: alone[candidate].eval_loss_after)
    assert best == ("whitened", "per_layer")  # the constructed case: not the simplest
    report = chosen.growth_report
    assert (report.truncation, report.step_mode, report.selection) == ("whitened", "per_layer", "search")
    # each truncation's first candidate (per head) was searched as it is alone; per layer by a shorter search from
    # that step, which finds the loss it finds alone (the known-better candidate's to roundoff) or less
    for candidate in report.candidates:
        by_itself = alone[candidate.truncation, candidate.step_mode]
        if candidate.step_mode == "per_head":
            assert (candidate.step_size, candidate.search_loss) == (by_itself.step_size, by_itself.eval_loss_after)
        assert candidate.search_loss <= by_itself.eval_loss_after + 2e-6
        assert candidate.confirm_loss == pytest.approx(candidate.search_loss, abs=1e-6)  # the same batch
    assert report.candidates[1].search_loss == pytest.approx(alone[best].eval_loss_after, abs=1e-6)
    # its step searched again on both batches (the same loss as alone), from the step found alone: never worse
    assert report.line_search[0].step_size == pytest.approx(alone[best].step_size, rel=1e-9)
    assert report.eval_loss_after <= alone[best].eval_loss_after + 1e-6
    assert report.eval_loss_before == pytest.approx(alone[best].eval_loss_before, abs=1e-6)
    simplest = alone["whitened", "per_head"].eval_loss_after
    assert report.selection_margin == pytest.approx(simplest - alone[best].eval_loss_after, abs=1e-5)
    assert report.selection_margin > 5e-4


def test_the_confirmation_rejects_a_choice_that_only_fits_the_search_batches(
    trained_gpt2, statistics, held_out, alone
):
    flipped = {**held_out, "sign": torch.tensor(-1.0)}  # the confirmation batch ranks the candidates opposite
    model = grown(trained_gpt2, statistics, [held_out, flipped], **AUTO)
    report = model.growth_report
    assert (report.truncation, report.step_mode, report.selection) == ("whitened", "per_head", "fallback")
    assert report.selection_margin == 0.0
    searched = min(report.candidates, key=lambda candidate: candidate.search_loss)
    assert (searched.truncation, searched.step_mode) == ("whitened", "per_layer")
    # the simplest candidate's step is searched again on both batches, from the step its search found, and the
    # grown model holds the step chosen there: the flipped batch cancels the other at every step
    simplest = alone["whitened", "per_head"]
    assert report.line_search[0].step_size == pytest.approx(simplest.step_size, rel=1e-9)
    with torch.no_grad():
        both = (float(signed_loss(model, held_out)) + float(signed_loss(model, flipped))) / 2
    assert both == pytest.approx(report.eval_loss_after, abs=1e-6) and abs(both) < 1e-5
    assert "the search preferred whitened, per layer, which the confirmation batches did not" in report.summary()


def test_report_and_card_name_the_chosen_candidate(chosen, tmp_path):
    report = chosen.growth_report
    assert "whitened, per layer chosen by held-out loss over 3 other candidate(s)" in report.summary()
    chosen.save_pretrained(tmp_path)
    loaded = load_growth_report(tmp_path)
    assert loaded.candidates == report.candidates and loaded.selection == "search"
    assert loaded.config["truncation"] == loaded.config["step_mode"] == "auto"
    card = str(model_card(tmp_path, base_model=None))
    assert "- Candidate: whitened, per layer chosen by held-out loss" in card
    assert "`selection` search" in card
    assert "| frobenius | per_layer |" in card  # every candidate's losses
    assert "(coarse search)" in card  # the losing candidates searched coarsely
    # the table's steps are each candidate's own search; the card says which step the model took
    assert f"searched again on all of them: step {report.step_size:.4g}." in card
    # the report's line search is the final search, over all held-out batches: step 0 is the loss before
    at_zero = [point.loss for point in report.line_search if point.step_size == 0]
    assert at_zero == [report.eval_loss_before]
    assert min(point.loss for point in report.line_search) == report.eval_loss_after


def test_step_0_is_exact_and_the_simplest_is_kept_without_a_held_out_choice(gpt2_copy, stdlib_bytes):
    batches, batch = lm_batches(stdlib_bytes["stats"], 3), lm_batches(stdlib_bytes["test"], 1, seed=5)[0]
    at_zero = grow_model(gpt2_copy, batches, step_size=0.0, **AUTO)
    report = at_zero.growth_report
    assert (report.truncation, report.step_mode, report.selection) == ("whitened", "per_head", "simplest")
    for before, after in zip(outputs_of(gpt2_copy, batch), outputs_of(at_zero, batch)):
        torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    # one held-out batch leaves none to confirm on: the simplest candidate, its step searched
    one_batch = grow_model(gpt2_copy, batches, eval_dataloader=batches[:1], measure_realized_gains=False, **AUTO)
    assert (one_batch.growth_report.selection, one_batch.growth_report.step_mode) == ("simplest", "per_head")
    assert one_batch.growth_report.step_size > 0


def test_bad_confirm_fraction_is_refused_before_any_work():
    with pytest.raises(ValueError, match="confirm_fraction must be in"):
        GrowthConfig(confirm_fraction=1.0)
    assert GrowthConfig(truncation="auto", step_mode="per_layer").candidates == [
        ("whitened", "per_layer"), ("frobenius", "per_layer")
    ]
    assert GrowthConfig(truncation="frobenius", step_mode="per_head").candidates == [("frobenius", "per_head")]
    assert GrowthConfig().candidates == [("whitened", "per_head"), ("whitened", "per_layer")]  # the default


def test_auto_solves_refactor_growth_once_and_frees_m_group_by_group(trained_gpt2, stdlib_bytes):
    """With both truncations among the candidates, "refactor" growth is solved once, for Frobenius truncation,
    which holds the whitened targets too: M is freed group by group as for one candidate, and the simplest
    candidate's targets are those of a solve for whitened truncation alone."""
    from hf_grow.growth.prepare import prepare_growth
    from hf_grow.statistics import statistics_bytes

    batches = lm_batches(stdlib_bytes["stats"], 4, seed=47)  # two held out: one to search on, one to confirm on
    config = trained_gpt2.config
    budget = statistics_bytes(config.n_layer, config.n_head, config.n_embd, 2)  # one layer per pass
    prepared = {
        settings["truncation"]: prepare_growth(
            trained_gpt2, batches, GrowthConfig(p=8, memory_budget=budget, eval_fraction=0.5, **settings),
            mode=None, eval_dataloader=None, loss_fn=None, statistics=None, accelerator=None, progress=False,
        )
        for settings in (AUTO, dict(truncation="whitened"))
    }
    auto, alone = prepared["auto"], prepared["whitened"]
    assert all(gradient is None for gradient in auto.statistics.gradients)  # every group's M freed after its solve
    assert auto.problem.truncation == "whitened" and auto.problem.holds("frobenius")
    assert not alone.problem.holds("frobenius")
    for ours, theirs in zip(auto.problem.layers, alone.problem.layers):
        torch.testing.assert_close(ours.target.step_core, theirs.target.step_core)
    for step in (0.0, 0.05):
        for layer, (query, key) in auto.problem.weights(step).items():
            torch.testing.assert_close(query, alone.problem.weights(step)[layer][0])
            torch.testing.assert_close(key, alone.problem.weights(step)[layer][1])
    auto.problem.set_truncation("frobenius")
    assert auto.problem.truncation == "frobenius"
    with pytest.raises(ValueError, match="not solved for 'frobenius'"):
        alone.problem.set_truncation("frobenius")


def test_where_no_choice_can_be_made_the_simplest_alone_is_solved(trained_gpt2, statistics, held_out):
    """One held-out batch (or a given step size) leaves nothing to confirm a choice on: only the simplest
    candidate's truncation is solved, as cheap as naming it, and the same model grows."""
    from hf_grow.growth.prepare import prepare_growth

    def prepared(eval_batches, **settings):
        return prepare_growth(trained_gpt2, None, GrowthConfig(p=8, **AUTO, **settings), mode=None,
                              eval_dataloader=eval_batches, loss_fn=signed_loss, statistics=statistics,
                              accelerator=None, progress=False)

    one_batch = prepared([held_out])
    assert one_batch.confirmation is None and not one_batch.problem.holds("frobenius")
    assert not prepared([held_out, held_out], step_size=0.05).problem.holds("frobenius")
    assert prepared([held_out, held_out]).problem.holds("frobenius")  # two batches: a choice to make
    auto = grown(trained_gpt2, statistics, [held_out], **AUTO).growth_report
    named = grown(trained_gpt2, statistics, [held_out], truncation="whitened", step_mode="per_head").growth_report
    assert (auto.selection, auto.truncation, auto.step_mode) == ("simplest", "whitened", "per_head")
    assert (auto.step_size, auto.eval_loss_after) == (named.step_size, named.eval_loss_after)


@pytest.mark.parametrize("measure_realized_gains", [False, True])
def test_the_old_function_is_evaluated_once_on_each_held_out_batch(
    trained_gpt2, statistics, stdlib_bytes, measure_realized_gains
):
    """Every candidate's search starts from the old function's loss on the same search batches, a candidate at
    step 0 is confirmed by its loss on the confirmation batches, and the final search's loss at step 0 is theirs
    together: one pass at step 0 in all, also where the realized gains replay the blocks' outputs at step 0 (the
    same pass records them). The report counts every other pass of the search."""
    def qk_sums(model):
        return torch.stack([block.attn.c_attn.weight.sum() for block in model.transformer.h])

    at_zero = qk_sums(grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=0.0))
    calls = {True: 0, False: 0}

    def counted_loss(model, batch):
        calls[torch.equal(qk_sums(model), at_zero)] += 1
        return signed_loss(model, batch)

    batches = lm_batches(stdlib_bytes["eval"], 3, seed=43)  # two to search on, one to confirm
    report = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=batches, loss_fn=counted_loss,
                        measure_realized_gains=measure_realized_gains, **AUTO).growth_report
    assert len(report.candidates) == 4 and report.step_size > 0
    assert calls[True] == len(batches)
    searched = calls[True] + calls[False] - len(batches) * len(report.layers) * measure_realized_gains
    assert searched == pytest.approx(len(batches) * (1 + report.line_search_passes))


def test_the_kept_search_per_layer_keeps_its_layers_steps_for_the_final_search(
    trained_gpt2, statistics, stdlib_bytes, monkeypatch
):
    """With steps searched per layer, a candidate's step multiplies each layer's own step (`layer_scales`), found by
    its search: the final search on all the held-out batches starts from the kept candidate's, not from ones."""
    from hf_grow.growth import candidates

    calls = []
    line_search = candidates.search.line_search

    def recorded(prepared, problem, *args, **kwargs):
        entry = (problem.truncation, list(problem.layer_scales))
        outcome = line_search(prepared, problem, *args, **kwargs)
        calls.append((*entry, list(outcome.layer_scales)))
        return outcome

    monkeypatch.setattr(candidates.search, "line_search", recorded)
    batches = lm_batches(stdlib_bytes["eval"], 3, seed=43)  # two to search on, one to confirm
    report = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=batches,
                        measure_realized_gains=False, truncation="auto", step_mode="layer_search").growth_report
    *searches, (_, final_entry, final_exit) = calls
    kept = next(exit_scales for truncation, _, exit_scales in searches if truncation == report.truncation)
    assert report.step_size > 0 and len(set(kept)) > 1  # the layers' steps differ: a case that can tell
    assert final_entry == kept and final_exit == kept



def test_the_final_search_evaluates_only_the_confirmation_batches_where_the_kept_search_did(
    trained_gpt2, statistics, stdlib_bytes, monkeypatch
):
    """At the steps the kept candidate's search evaluated on the search batches, the final search on all the
    held-out batches evaluates only the confirmation batches: its losses there are a full pass's, for fewer
    forwards."""
    from hf_grow.growth import candidates

    batches = lm_batches(stdlib_bytes["eval"], 3, seed=43)  # two to search on, one to confirm
    searches, forwards = [], []
    line_search = candidates.search.line_search

    def recorded(*args, **kwargs):
        searches.append([])
        outcome = line_search(*args, **kwargs)
        searches[-1] = [point.step_size for point in outcome.points if point.kind == "rank" and point.step_size > 0]
        return outcome

    def counted_loss(model, batch):
        forwards.append((len(searches), next(i for i, b in enumerate(batches) if b["input_ids"] is batch["input_ids"])))
        return signed_loss(model, batch)

    monkeypatch.setattr(candidates.search, "line_search", recorded)
    report = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=batches, loss_fn=counted_loss,
                        measure_realized_gains=False, **AUTO).growth_report
    kept_index = [(c.truncation, c.step_mode) for c in report.candidates].index((report.truncation, report.step_mode))
    kept, final = searches[kept_index], searches[-1]
    assert final[0] == report.candidates[kept_index].step_size  # its loss known from the search and confirmation
    reused = [step for step in final[1:] if any(abs(step - known) <= 1e-12 * step for known in kept)]
    assert reused  # a case that can tell
    in_final = [batch for search_count, batch in forwards if search_count == len(searches)]
    assert in_final.count(2) == len(final) - 1
    assert in_final.count(0) == in_final.count(1) == len(final) - 1 - len(reused)
    points = {point.step_size: point.loss for point in report.line_search}
    for step in reused[:2]:
        alone = grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=step,
                           truncation=report.truncation, step_mode=report.step_mode)
        assert points[step] == pytest.approx(evaluate_loss(alone, batches, loss_fn=signed_loss)[0], abs=1e-6)


def test_losing_candidates_stay_coarse_and_the_choice_is_the_full_searches(
    trained_gpt2, statistics, held_out, chosen, monkeypatch
):
    """The candidates but the simplest are searched coarsely, and completed only while a bound for convex losses
    leaves them within reach of the best: the choice, the kept candidate's search and every completed candidate's
    report are those of full searches of every candidate (a reach that completes all), for fewer passes."""
    from hf_grow.growth import candidates

    monkeypatch.setattr(candidates, "REACH_FACTOR", math.inf)  # every coarse search completed
    full = grown(trained_gpt2, statistics, [held_out, held_out], **AUTO).growth_report
    report = chosen.growth_report
    assert [candidate.coarse for candidate in full.candidates] == [False] * 4
    assert [candidate.coarse for candidate in report.candidates] == [False, False, True, True]  # Frobenius lost
    assert (report.truncation, report.step_mode, report.selection) == (full.truncation, full.step_mode, "search")
    assert report.candidates[:2] == full.candidates[:2]  # the simplest and the kept one, completed
    for coarse, completed in zip(report.candidates[2:], full.candidates[2:]):  # a coarse search finds no less
        assert coarse.search_loss >= completed.search_loss
        assert coarse.search_loss - completed.search_loss < coarse.search_loss - report.candidates[1].search_loss
    assert [(point.step_size, point.loss) for point in report.line_search] == [
        (point.step_size, point.loss) for point in full.line_search
    ]
    assert report.line_search_passes < full.line_search_passes - 1


@pytest.mark.parametrize("seed", [43, 44])
def test_the_kept_coordinate_search_reports_the_loss_of_the_model_it_returns(trained_gpt2, statistics, stdlib_bytes,
                                                                            seed):
    """Steps refined layer by layer: the final search starts again from every layer at the common step, so the kept
    candidate's refined loss is not that step's: the returned model's held-out loss is the one reported."""
    batches = lm_batches(stdlib_bytes["eval"], 3, seed=seed)
    model = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=batches,
                       measure_realized_gains=False, truncation="auto", step_mode="coordinate")
    report = model.growth_report
    assert report.step_size > 0 and report.step_mode == "coordinate"
    assert report.eval_loss_after == pytest.approx(evaluate_loss(model, batches)[0], rel=1e-6, abs=0)


def test_a_confirmation_batch_that_overflows_at_every_step_is_never_chosen(trained_gpt2, statistics, stdlib_bytes):
    """A held-out batch whose loss is NaN at every step but 0 (a float16 overflow), among the confirmation batches:
    the simplest candidate was kept on a NaN confirmation loss, and the final search took a NaN step
    (`eval_loss_after` nan) where a single candidate's search walks down to a finite step."""
    held = lm_batches(stdlib_bytes["eval"], 5, seed=4)
    marked = held[-1]["input_ids"]
    with torch.no_grad():
        old_loss = float(trained_gpt2(**held[-1]).loss)

    def overflowing(model, batch):
        loss = model(**batch).loss
        moved = abs(float(loss) - old_loss) > 1e-4
        return loss * math.nan if torch.equal(batch["input_ids"], marked) and moved else loss

    report = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=held, loss_fn=overflowing,
                        measure_realized_gains=False).growth_report
    assert math.isfinite(report.eval_loss_after) and report.eval_loss_after <= report.eval_loss_before
    assert report.selection_margin is None or math.isfinite(report.selection_margin)
    assert all(point.loss is None or math.isfinite(point.loss) for point in report.line_search)


def test_a_loss_without_gradient_and_held_out_batches_without_loss_terms_are_said_once(gpt2_copy, stdlib_bytes,
                                                                                       caplog):
    """The zero-gradient warning came once per candidate search, completion and final search (8 times in one
    growth); held-out batches without loss terms were skipped silently."""
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4)
    held_out = lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seed=5)

    def embedding_norm(model, batch):  # no path from the attention scores to the loss
        return model(**batch, output_hidden_states=True).hidden_states[0].pow(2).mean()

    with caplog.at_level("WARNING", logger="hf_grow"):
        report = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out, loss_fn=embedding_norm,
                            measure_realized_gains=False, **AUTO).growth_report
    assert report.step_size == 0
    assert sum("zero gradient" in record.message for record in caplog.records) == 1
    caplog.clear()
    unlabelled = {**held_out[0], "labels": torch.full_like(held_out[0]["labels"], -100)}
    with caplog.at_level("WARNING", logger="hf_grow"):
        grow_model(gpt2_copy, batches, p=8, eval_dataloader=[unlabelled, *held_out], step_size=0.0,
                   measure_realized_gains=False)
    assert any("skipped 1 held-out batch(es) without loss terms" in record.message for record in caplog.records)


def test_a_held_out_batch_the_old_function_overflows_on_is_named_before_the_searches(trained_gpt2, statistics,
                                                                                    stdlib_bytes, monkeypatch):
    """The error came after every candidate's search, and named no batch."""
    from hf_grow.growth import candidates

    held = lm_batches(stdlib_bytes["eval"], 5, seed=4)
    marked = held[3]["input_ids"]

    def overflowing(model, batch):
        loss = model(**batch).loss
        return loss * math.nan if torch.equal(batch["input_ids"], marked) else loss

    monkeypatch.setattr(candidates, "_choose", lambda *args, **kwargs: pytest.fail("a candidate was searched"))
    with pytest.raises(FloatingPointError, match=r"before any step \(nan on held-out batch 3 first\)"):
        grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=held, loss_fn=overflowing)


def test_a_first_candidate_gain_within_the_models_precision_seeds_no_search(trained_gpt2, statistics, held_out,
                                                                              monkeypatch):
    """In bfloat16 the first candidate took a step whose "gain" was rounding (0.005 at 4.7 on MiniLM), and the
    second searched only near it (`_near`), missing the 1.77 nats a search from the start found. Here the first
    candidate's gain is made to count as rounding: the second searches from the start."""
    from hf_grow.growth import candidates

    seeds = []
    near = candidates._near
    def recorded(searched, problem):
        seeds.append(searched)
        return near(searched, problem)

    monkeypatch.setattr(candidates, "_near", recorded)
    grown(trained_gpt2, statistics, [held_out, held_out], step_mode="auto")
    assert seeds[1][0] > 0  # the first candidate's step seeds the second's search
    seeds.clear()
    monkeypatch.setattr(candidates, "within_precision", lambda *args: True)
    grown(trained_gpt2, statistics, [held_out, held_out], step_mode="auto")
    assert seeds[1][0] == 0.0  # none: a full search
