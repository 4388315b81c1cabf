"""The held-out passes after the line search: the realized gains replay the blocks the step-0 pass recorded,
no pass builds a key/value cache, and no layer's core is decomposed twice (`hf_grow.growth.layer_steps`)."""

import copy

import pytest
import torch

from hf_grow import evaluate_loss, get_adapter, grow_model
from hf_grow.growth.problem import write_weights

from conftest import lm_batches


@pytest.fixture
def no_block_recorded_again(monkeypatch):
    """Fails the test where a block's outputs are recorded by a pass of their own (`HeldOutPasses.record`) instead
    of by the pass at step 0."""
    from hf_grow.growth.layer_steps import HeldOutPasses

    recording = HeldOutPasses.record

    def record(self, layer):
        assert not (self.blocks and layer == len(self.recorded) < self.num_layers - 1), f"block {layer} recorded"
        recording(self, layer)

    monkeypatch.setattr(HeldOutPasses, "record", record)


def _old_and_stepped_weights(grown, model, batches):
    """The grown model's adapter, its Q/K weights at step 0 (``model`` grown with step 0) and at its step, by layer."""
    adapter = get_adapter(grown)
    stepped = {layer: adapter.read_qk(module) for layer, module in enumerate(adapter.attention_modules(grown))}
    unchanged = grow_model(model, batches, p=8, step_size=0.0, measure_realized_gains=False)
    unchanged = {layer: adapter.read_qk(module) for layer, module in enumerate(adapter.attention_modules(unchanged))}
    return adapter, unchanged, stepped


def _assert_realized_gains_are_full_passes(grown, adapter, unchanged, stepped, held_out, before):
    """Each layer's realized gain in ``grown``'s report equals ``before`` less a full pass with that layer's step
    alone (the other layers at step 0); some gain is not 0."""
    report = grown.growth_report
    for layer in range(len(stepped)):
        write_weights(adapter, grown, {**unchanged, layer: stepped[layer]})
        full_pass = before - evaluate_loss(grown, held_out)[0]
        assert report.layers[layer].realized_gain == pytest.approx(full_pass, rel=1e-9, abs=1e-12)
    assert any(layer.realized_gain != 0 for layer in report.layers)


def test_realized_gains_replaying_unchanged_blocks_equal_full_passes(gpt2_copy, stdlib_bytes):
    """Each layer's realized gain replays the blocks before it (at step 0): the same loss as a full pass."""
    batches = lm_batches(stdlib_bytes["stats"], 4, batch_size=4, seq_len=64)
    held_out = lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=64, seed=1)
    grown = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out, step_size=0.05)
    adapter, unchanged, stepped = _old_and_stepped_weights(grown, gpt2_copy, batches)
    write_weights(adapter, grown, unchanged)
    # the gains are counted from the old function at the grown widths, which can round differently from the
    # original's (by 8e-8 on a CPU with AMX kernels; bit for bit on the CPU of earlier sessions)
    before = evaluate_loss(grown, held_out)[0]
    assert grown.growth_report.eval_loss_before == pytest.approx(before, rel=1e-12)
    assert before == pytest.approx(evaluate_loss(gpt2_copy, held_out)[0], abs=1e-6)
    _assert_realized_gains_are_full_passes(grown, adapter, unchanged, stepped, held_out, before)


def test_realized_gains_after_a_choice_replay_the_old_functions_records(
    gpt2_copy, stdlib_bytes, no_block_recorded_again
):
    """Where the held-out loss chooses (the default's step modes), the old function's passes over the search and the
    confirmation batches record every block, and the realized gains replay those records joined: no block is
    recorded again, and each layer's gain is that of a full pass."""
    batches = lm_batches(stdlib_bytes["stats"], 4, batch_size=4, seq_len=64)
    held_out = lm_batches(stdlib_bytes["eval"], 5, batch_size=4, seq_len=64, seed=1)  # 3 to search on, 2 to confirm
    grown = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out)
    report = grown.growth_report
    assert report.selection is not None and report.step_size > 0
    adapter, unchanged, stepped = _old_and_stepped_weights(grown, gpt2_copy, batches)
    write_weights(adapter, grown, unchanged)
    before = evaluate_loss(grown, held_out)[0]  # the old function at the grown widths, as the search evaluates it
    assert report.eval_loss_before == pytest.approx(before, rel=1e-12)
    _assert_realized_gains_are_full_passes(grown, adapter, unchanged, stepped, held_out, before)


def test_the_old_functions_records_stay_within_the_cache_for_both_parts(gpt2_copy, stdlib_bytes, monkeypatch):
    """The search and the confirmation batches' records share `CACHE_BYTES`: where both would not fit, none are
    kept, as a recording pass over all of them would drop them, and the realized gains are full passes."""
    from hf_grow.growth import candidates, layer_steps

    batches = lm_batches(stdlib_bytes["stats"], 4, batch_size=4, seq_len=64)
    held_out = lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=64, seed=1)
    kept = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out).growth_report
    one_batch = 4 * 64 * gpt2_copy.config.n_embd * 4 * (gpt2_copy.config.n_layer - 1)  # every block's, but the last
    monkeypatch.setattr(candidates, "CACHE_BYTES", int(2.5 * one_batch))  # the search part's two batches fit
    joined = []
    join_records = layer_steps.HeldOutPasses.join_records

    def join(self, parts):
        join_records(self, parts)
        joined.append((parts, self))

    monkeypatch.setattr(layer_steps.HeldOutPasses, "join_records", join)
    report = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out).growth_report
    (parts, passes), = joined
    assert parts[0].recorded and parts[1].blocks is None and passes.blocks is None and not passes.recorded
    assert [layer.realized_gain for layer in report.layers] == pytest.approx(
        [layer.realized_gain for layer in kept.layers], rel=1e-9, abs=1e-12
    )


def test_realized_gains_replay_the_blocks_the_step_zero_loss_recorded(gpt2_copy, stdlib_bytes, no_block_recorded_again):
    """The line search's pass at step 0 records every block: the realized gains run no recording pass of their own."""
    batches = lm_batches(stdlib_bytes["stats"], 4, batch_size=4, seq_len=64)
    held_out = lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=64, seed=1)
    report = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out, step_size=0.05).growth_report
    assert all(layer.realized_gain is not None for layer in report.layers)


def test_no_step_zero_records_without_realized_gains(gpt2_copy, stdlib_bytes, monkeypatch):
    """The step-0 records (up to CACHE_BYTES) are kept only for the realized gains: without them, no pass records."""
    from hf_grow.growth.layer_steps import HeldOutPasses

    calls = []
    recording = HeldOutPasses.loss_recording

    def loss_recording(self):
        calls.append(self)
        return recording(self)

    monkeypatch.setattr(HeldOutPasses, "loss_recording", loss_recording)
    batches = lm_batches(stdlib_bytes["stats"], 4, batch_size=4, seq_len=64)
    held_out = lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=64, seed=1)
    report = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out, measure_realized_gains=False).growth_report
    assert not calls and all(layer.realized_gain is None for layer in report.layers)
    grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out, step_size=0.05)
    assert len(calls) == 1


def test_held_out_passes_build_no_kv_cache_and_keep_the_config(gpt2_copy, stdlib_bytes):
    """The held-out passes want a loss only: no block is asked for a key/value cache, also in the recording and
    replaying passes, and the model's config is as it was afterwards (its value, or no value at all)."""
    from hf_grow.growth.layer_steps import HeldOutPasses

    held_out = lm_batches(stdlib_bytes["eval"], 2, batch_size=2, seq_len=32, seed=1)
    adapter = get_adapter(gpt2_copy)
    asked = []
    for block in gpt2_copy.transformer.h:
        block.register_forward_pre_hook(
            lambda module, args, kwargs: asked.append(kwargs["use_cache"]), with_kwargs=True
        )
    assert gpt2_copy.config.use_cache is True
    loss = evaluate_loss(gpt2_copy, held_out)[0]
    passes = HeldOutPasses(gpt2_copy, adapter, held_out, None, None)
    assert passes.loss_recording()[0] == loss
    assert passes.loss(first_changed=1) == pytest.approx(loss, rel=1e-9)
    passes.recorded = []
    passes.record(0)
    blocks = len(gpt2_copy.transformer.h)  # per batch: three passes over every block, then block 0 recorded
    assert len(asked) == len(held_out) * (3 * blocks + 1) and not any(asked)
    assert gpt2_copy.config.use_cache is True and gpt2_copy(**held_out[0]).cache is not None
    try:  # a config without the field (the model shares it with the module's fixture: set back after)
        del gpt2_copy.config.use_cache
        with pytest.raises(ValueError, match="batch 0 holds sequences"):
            evaluate_loss(gpt2_copy, [{"input_ids": torch.zeros(1, 10**5, dtype=torch.long)}])
        evaluate_loss(gpt2_copy, held_out)
        assert "use_cache" not in vars(gpt2_copy.config)
    finally:
        gpt2_copy.config.use_cache = True


def test_the_report_reads_the_line_searchs_decomposition_of_the_chosen_step(gpt2_copy, stdlib_bytes, monkeypatch):
    """No work twice: each layer's core is decomposed once per line-search step (never again for the chosen
    weights or the report), and the report is the same, bit for bit, as from a decomposition of its own. One
    candidate's search (the default's choice among several searches more steps, each decomposed once)."""
    ONE_SEARCH = dict(truncation="whitened", step_mode="per_head")
    from hf_grow.growth import search
    from hf_grow.growth.problem import StepWeights

    calls = []
    decompose = StepWeights.decomposition

    def counted(self, layer, step_size, *args, **kwargs):
        calls.append((layer, step_size))
        return decompose(self, layer, step_size, *args, **kwargs)

    monkeypatch.setattr(StepWeights, "decomposition", counted)
    batches = lm_batches(stdlib_bytes["stats"], 4, batch_size=4, seq_len=64)
    held_out = lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=64, seed=1)
    report = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out, **ONE_SEARCH).growth_report
    layers = len(report.layers)
    searched = [point.step_size for point in report.line_search if point.step_size > 0]
    assert report.step_size > 0
    assert sorted(calls) == sorted((layer, step) for step in searched for layer in range(layers))
    calls.clear()
    grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out, step_size=0.05, measure_realized_gains=False)
    assert calls == [(layer, 0.05) for layer in range(layers)]  # a given step: decomposed for its weights alone

    own = search.head_reports
    monkeypatch.setattr(search, "head_reports", lambda problem, layer, step, decomposition: own(problem, layer, step))
    calls.clear()
    again = grow_model(gpt2_copy, batches, p=8, eval_dataloader=held_out, **ONE_SEARCH).growth_report
    assert len(calls) == layers * (len(searched) + 1)
    assert [layer.heads for layer in again.layers] == [layer.heads for layer in report.layers]
    assert again.eval_loss_after == report.eval_loss_after and again.step_size == report.step_size


def _two_column_loss(model, batch):
    """A loss_fn running the model once per text column (as a SentenceTransformer's loss does)."""
    return 0.5 * (model(**batch["a"]).loss + model(**batch["b"]).loss)


def _attention_entropy_loss(model, batch):
    """The LM loss plus the first layer's attention entropy: a loss_fn reading what replayed blocks do not make,
    through the model inside (a pre-hook on the outer model alone missed it)."""
    inner = model.transformer(input_ids=batch["input_ids"], output_attentions=True)
    attention = inner.attentions[0].clamp_min(1e-9)
    return model(**batch).loss - 0.5 * (attention * attention.log()).sum(-1).mean()


def test_replays_follow_a_loss_fn_that_runs_the_model_twice_or_reads_attentions(gpt2_copy, stdlib_bytes):
    """`record` kept a block's first output per batch and a replay served one per model call: a loss_fn running the
    model once per column read the next batch's states (a shape error, or a bare StopIteration). A loss_fn on
    ``output_attentions`` lost the replayed blocks' attentions (a realized gain of 0.67 where a full pass gives
    -0.005): such records are dropped, every evaluation a full pass."""
    from hf_grow.growth.layer_steps import HeldOutPasses

    gpt2_copy = copy.deepcopy(gpt2_copy)  # its config is the session model's: set eager attention on a copy's
    gpt2_copy.set_attn_implementation("eager")  # attentions are returned by eager attention only
    adapter = get_adapter(gpt2_copy)
    columns = [{"a": a, "b": b} for a, b in zip(lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=64, seed=2),
                                                 lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=48, seed=3))]
    single = lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=64, seed=4)
    for batches, loss_fn in ((columns, _two_column_loss), (single, _attention_entropy_loss)):
        passes = HeldOutPasses(gpt2_copy, adapter, batches, loss_fn, None)
        passes.record(0)  # of the two layers', the first block's outputs (nothing replays the last)
        with torch.no_grad():
            for parameter in adapter.attention_modules(gpt2_copy)[1].parameters():
                parameter.mul_(1.5)
        full = evaluate_loss(gpt2_copy, batches, adapter, loss_fn)[0]
        assert passes.loss(first_changed=1) == pytest.approx(full, rel=1e-9)
        assert (passes.recorded == []) == (loss_fn is _attention_entropy_loss)  # kept where the replay is exact
        recording = HeldOutPasses(gpt2_copy, adapter, batches, loss_fn, None)
        assert recording.loss_recording()[0] == pytest.approx(full, rel=1e-9)
        with torch.no_grad():
            for parameter in adapter.attention_modules(gpt2_copy)[1].parameters():
                parameter.mul_(0.5)
        assert recording.loss(first_changed=1) == pytest.approx(evaluate_loss(gpt2_copy, batches, adapter, loss_fn)[0],
                                                                rel=1e-9)


def test_coordinate_steps_with_a_loss_fn_that_runs_the_model_per_column(gpt2_copy, stdlib_bytes):
    """The coordinate search records block by block (`HeldOutPasses.record`): it failed after the statistics pass
    with any loss_fn running the model more than once per batch."""
    def pairs(source: str, count: int, seed: int) -> list[dict]:
        first = lm_batches(stdlib_bytes[source], count, batch_size=4, seq_len=64, seed=seed)
        second = lm_batches(stdlib_bytes[source], count, batch_size=4, seq_len=48, seed=seed + 100)
        return [{"a": a, "b": b} for a, b in zip(first, second)]

    held_out = pairs("eval", 3, 4)
    grown = grow_model(gpt2_copy, pairs("stats", 3, 3), p=8, eval_dataloader=held_out, loss_fn=_two_column_loss,
                       step_mode="coordinate")
    report = grown.growth_report
    assert report.eval_loss_after == pytest.approx(evaluate_loss(grown, held_out, loss_fn=_two_column_loss)[0],
                                                   rel=1e-9)
    assert report.eval_loss_after <= report.eval_loss_before


@pytest.mark.parametrize("settings", [dict(search="fast", step_mode="per_head"),
                                      dict(truncation="auto", step_mode="layer_search")])
def test_line_search_passes_count_every_pass_that_runs(gpt2_copy, stdlib_bytes, settings):
    """`report.line_search_passes` left out the fast search's full-rank reference (5.0 reported, 13.0 run) and, with
    candidates searched per layer, the step-0 passes that only record (26.8 reported, 29.0 run)."""
    from hf_grow import collect_statistics

    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=4)
    statistics = collect_statistics(gpt2_copy, batches, get_adapter(gpt2_copy))
    held_out = lm_batches(stdlib_bytes["eval"], 5, batch_size=4, seed=1)
    calls = [0]

    def count(module, args):
        calls[0] += type(module).__name__.endswith("Attention")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        report = grow_model(gpt2_copy, None, p=8, statistics=statistics, eval_dataloader=held_out,
                            measure_realized_gains=False, **settings).growth_report
    finally:
        handle.remove()
    passes = calls[0] / (gpt2_copy.config.n_layer * len(held_out)) - 1  # all but the pass at step 0
    assert report.line_search_passes == pytest.approx(passes, rel=1e-9)
