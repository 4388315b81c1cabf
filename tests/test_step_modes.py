"""Step sizes per layer (the original notes' lam_l = t * ||Z_l|| / ||P_l||) against one lam for all layers."""

import math

import pytest
import torch

from transformers import GPT2LMHeadModel

from hf_grow import collect_statistics, evaluate_loss, get_adapter, grow_model, linalg
from hf_grow.growth import GrowthProblem

from conftest import lm_batches, tiny_gpt2_config


@pytest.fixture(scope="module")
def statistics(trained_gpt2, stdlib_bytes):
    return collect_statistics(trained_gpt2, lm_batches(stdlib_bytes["stats"], 4, seed=31), get_adapter(trained_gpt2))


def problem(model, statistics, truncation="whitened", step_mode="global") -> GrowthProblem:
    return GrowthProblem(model, get_adapter(model), statistics, [24, 24], truncation, 1e-6, "eigh", step_mode=step_mode,
                         with_rates=True)


def direction(statistics, part, layer: int) -> torch.Tensor:
    """P = C^+ M C^+ of a solved layer, from the statistics (the solve keeps only its compact form)."""
    inputs = part.query.shape[-2]
    return linalg.solve_direction(statistics.mean_gradient(layer)[:, :inputs, :inputs], part.metric)


def test_per_layer_steps_follow_each_layers_own_norms(trained_gpt2, statistics):
    for truncation in ("whitened", "frobenius"):
        solved = problem(trained_gpt2, statistics, truncation, "per_layer")
        for layer, part in enumerate(solved.layers):
            if truncation == "whitened":
                scores, step = (
                    float(linalg.whitened_norm_sq(matrix, part.metric).sum())
                    for matrix in (part.bilinear, direction(statistics, part, layer))
                )
            else:
                scores = float(part.bilinear.square().sum())
                step = float(direction(statistics, part, layer).square().sum())
            assert solved.lam(0.3, layer) == pytest.approx(0.3 * math.sqrt(scores / step), rel=1e-12)
        # the layers' ratios differ, so one lam would under-step some of them
        assert solved.layer_lam_units[0] != pytest.approx(solved.layer_lam_units[1], rel=1e-3)


def test_global_steps_share_one_lam_from_all_heads(trained_gpt2, statistics):
    solved = problem(trained_gpt2, statistics)
    scores = sum(float(linalg.whitened_norm_sq(p.bilinear, p.metric).sum()) for p in solved.layers)
    step = sum(
        float(linalg.whitened_norm_sq(direction(statistics, p, layer), p.metric).sum())
        for layer, p in enumerate(solved.layers)
    )
    assert solved.layer_lam_units == [solved.lam_unit] * 2
    assert solved.lam_unit == pytest.approx(math.sqrt(scores / step), rel=1e-12)


def test_each_layer_takes_its_own_lam(trained_gpt2, statistics):
    """The per-layer weights at step t are the global solve's weights at that layer's own lam."""
    per_layer, global_ = problem(trained_gpt2, statistics, step_mode="per_layer"), problem(trained_gpt2, statistics)
    weights = per_layer.weights(0.05)
    for layer in range(2):
        same_lam = 0.05 * per_layer.layer_lam_units[layer] / global_.lam_unit
        query, key = global_.weights(same_lam)[layer]
        torch.testing.assert_close(weights[layer][0] @ weights[layer][1].mT, query @ key.mT)


def test_per_head_steps_follow_each_heads_own_norms(trained_gpt2, statistics):
    """The notes' ratio per head: each head's weights at step t are the global solve's at that head's own lam."""
    for truncation in ("whitened", "frobenius"):
        per_head, per_layer, global_ = (
            problem(trained_gpt2, statistics, truncation, mode) for mode in ("per_head", "per_layer", "global")
        )
        weights = per_head.weights(0.05)
        for layer, part in enumerate(per_head.layers):
            pair = (part.bilinear, direction(statistics, part, layer))
            if truncation == "whitened":
                scores, step = (linalg.whitened_norm_sq(matrix, part.metric) for matrix in pair)
            else:
                scores, step = (matrix.square().sum(dim=(-2, -1)) for matrix in pair)
            lams = per_head.head_lams(0.05, layer)
            torch.testing.assert_close(lams, 0.05 * (scores / step).sqrt(), rtol=1e-12, atol=0)
            assert per_head.lam(0.05, layer) == pytest.approx(per_layer.lam(0.05, layer))
            assert float(lams.max() / lams.min()) > 1.05  # the heads' ratios differ
            query, key = weights[layer]
            for head, lam in enumerate(lams.tolist()):
                global_query, global_key = global_.layer_weights(layer, lam / global_.lam_unit)
                torch.testing.assert_close(query[head] @ key[head].mT, global_query[head] @ global_key[head].mT)
        # the expected gains rank each head at its own step: the rates per unit step follow the head's factor
        factors = (per_head.head_lams(1.0, 0) / per_head.lam(1.0, 0))[:, None]
        torch.testing.assert_close(per_head.gain_rates(0).marginal, per_layer.gain_rates(0).marginal * factors)


def test_the_report_gives_each_heads_step(trained_gpt2, statistics):
    grown = grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=0.05, step_mode="per_head",
                       measure_realized_gains=False)
    solved = problem(trained_gpt2, statistics, step_mode="per_head")
    for layer in grown.growth_report.layers:
        assert layer.lam == pytest.approx(solved.lam(0.05, layer.layer), rel=1e-12)
        expected = solved.head_lams(0.05, layer.layer).tolist()
        assert [head.lam for head in layer.heads] == pytest.approx(expected, rel=1e-12)


def test_a_huge_step_the_config_accepts_is_reported(trained_gpt2, statistics):
    """The report's root mean square of the layers' lam squared them: from step 1e155 on, a growth that had run to
    its end failed in the report with a bare OverflowError."""
    report = grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=1e200, step_mode="global",
                        measure_realized_gains=False).growth_report
    assert math.isfinite(report.lam) and report.lam == pytest.approx(report.layers[0].lam, rel=1e-12)


def test_per_head_append_rescales_each_heads_update(trained_gpt2, statistics):
    adapter = get_adapter(trained_gpt2)
    solved = GrowthProblem(trained_gpt2, adapter, statistics, [24, 24], "whitened", 1e-6, "eigh", mode="append",
                           step_mode="per_head")
    query, key = solved.weights(0.05)[1]
    added = (query[..., 16:] @ key[..., 16:].mT) * solved.layers[1].scaling_after
    unit = solved.unit_update(1).product
    torch.testing.assert_close(added, solved.head_lams(0.05, 1)[:, None, None] * unit)


def test_step_zero_is_the_old_function_in_every_step_mode(trained_gpt2, statistics):
    modes = ("global", "per_layer", "per_head")
    at_zero = [problem(trained_gpt2, statistics, step_mode=mode).weights(0.0) for mode in modes]
    for layer in range(2):
        for weights in at_zero[1:]:
            for a, b in zip(at_zero[0][layer], weights[layer]):
                assert torch.equal(a, b)


def test_unknown_step_mode_is_refused(trained_gpt2, statistics):
    with pytest.raises(ValueError, match="step_mode must be one of"):
        problem(trained_gpt2, statistics, step_mode="per_token")
    # the search ran exact, the report said "fast", without its full-rank reference
    with pytest.raises(ValueError, match="search='fast' brackets one step of all layers .* search='exact'"):
        grow_model(trained_gpt2, iter(()), p=8, search="fast", step_mode="layer_search")


@pytest.fixture(scope="module")
def held_out(stdlib_bytes):
    return lm_batches(stdlib_bytes["eval"], 3, seed=32)


def test_held_out_passes_replay_the_unchanged_blocks_exactly(trained_gpt2, held_out):
    from hf_grow.growth.layer_steps import HeldOutPasses

    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=3))
    model.load_state_dict({**model.state_dict(), **trained_gpt2.state_dict()}, strict=False)
    model.eval()
    passes = HeldOutPasses(model, get_adapter(model), held_out, None, None)
    full = passes.loss()
    passes.record(0)
    passes.record(1)
    assert len(passes.recorded) == 2
    assert passes.loss(first_changed=1) == pytest.approx(full, abs=1e-6)
    assert passes.loss(first_changed=2) == pytest.approx(full, abs=1e-6)
    assert passes.loss(first_changed=2) == pytest.approx(full, abs=1e-6)  # a replay leaves the records as they were
    # one full pass, two recordings of one block each, then passes over 2 and 1 and 1 of the 3 blocks
    assert passes.evaluations == 4 and passes.passes == pytest.approx(1 + 2 / 3 + 2 / 3 + 1 / 3 + 1 / 3)
    # a change in a block that is replayed would go unseen, so the searches replay only the blocks before it
    layer = model.transformer.h[0].attn.c_attn
    with torch.no_grad():
        layer.weight.mul_(1.5)
    assert passes.loss(first_changed=2) == pytest.approx(full, abs=1e-6)
    assert passes.loss(first_changed=0) != pytest.approx(full, abs=1e-4)


def test_one_full_pass_records_every_block_as_recording_each_in_turn_does(trained_gpt2, held_out, monkeypatch):
    from hf_grow.growth import layer_steps
    from hf_grow.growth.layer_steps import HeldOutPasses

    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=3))
    model.load_state_dict({**model.state_dict(), **trained_gpt2.state_dict()}, strict=False)
    model.eval()
    adapter = get_adapter(model)
    in_turn = HeldOutPasses(model, adapter, held_out, None, None)
    full = in_turn.loss()
    in_turn.record(0)
    in_turn.record(1)
    at_once = HeldOutPasses(model, adapter, held_out, None, None)
    assert at_once.loss_recording() == evaluate_loss(model, held_out)
    assert at_once.passes == 1 and at_once.recorded_bytes == in_turn.recorded_bytes > 0
    for once, turn in zip(at_once.recorded, in_turn.recorded, strict=True):
        for a, b in zip(once, turn, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    at_once.record(2)  # the last block is not recorded (nothing replays it), nor one already recorded
    at_once.record(1)
    assert len(at_once.recorded) == 2 and at_once.loss(first_changed=2) == pytest.approx(full, abs=1e-6)
    monkeypatch.setattr(layer_steps, "CACHE_BYTES", in_turn.recorded_bytes - 1)  # too many bytes: full passes
    too_large = HeldOutPasses(model, adapter, held_out, None, None)
    assert too_large.loss_recording()[0] == pytest.approx(full, abs=1e-6)
    assert too_large.recorded == [] and too_large.blocks is None


def test_held_out_passes_replay_a_bert_encoder_with_a_loss_of_its_own(stdlib_bytes):
    from transformers import BertConfig, BertModel

    from hf_grow.growth.layer_steps import HeldOutPasses

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=64)).eval()
    batches = [{key: value for key, value in batch.items() if key != "labels"}
               for batch in lm_batches(stdlib_bytes["eval"], 2, batch_size=4, seq_len=32, seed=33)]
    batches[1]["attention_mask"][:, 20:] = 0  # padding

    def hidden_states_loss(model, batch):  # reads every layer's hidden states, replayed ones too
        return sum(state.square().mean() for state in model(**batch, output_hidden_states=True).hidden_states)

    passes = HeldOutPasses(model, get_adapter(model), batches, hidden_states_loss, None)
    full = passes.loss()
    passes.record(0)
    passes.record(1)
    assert passes.loss(first_changed=2) == pytest.approx(full, rel=1e-6)


@pytest.mark.parametrize("step_mode", ["layer_search", "coordinate"])
def test_searched_steps_never_lose_held_out_loss_and_are_exact_at_step_zero(
    trained_gpt2, statistics, held_out, stdlib_bytes, step_mode
):
    grown = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=held_out, step_mode=step_mode)
    report = grown.growth_report
    assert report.step_mode == step_mode and report.step_size > 0
    assert report.eval_loss_after < report.eval_loss_before
    assert evaluate_loss(grown, held_out)[0] == pytest.approx(report.eval_loss_after, abs=1e-6)
    assert {point.kind for point in report.line_search} >= {"layer 0", "layer 1"}
    assert report.line_search_passes > 0
    one_lam = problem(trained_gpt2, statistics)  # the report's lam of each layer is the step that layer took
    adapter = get_adapter(grown)
    for layer, attention in zip(report.layers, adapter.attention_modules(grown)):
        query, key = one_lam.weights(layer.lam / one_lam.lam_unit)[layer.layer]
        grown_query, grown_key = adapter.read_qk(attention)
        torch.testing.assert_close(
            grown_query @ grown_key.mT, (query @ key.mT).to(grown_query.dtype), rtol=1e-4, atol=1e-5
        )
    # step 0 in every mode: exactly the old function
    unchanged = grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=0.0, step_mode=step_mode)
    batch = lm_batches(stdlib_bytes["test"], 1, seed=34)[0]
    with torch.no_grad():
        torch.testing.assert_close(unchanged(**batch).logits, trained_gpt2(**batch).logits, rtol=1e-5, atol=1e-5)


def test_coordinate_search_lowers_the_held_out_loss_of_the_per_layer_step(trained_gpt2, statistics, held_out):
    losses = {}
    for step_mode in ("per_layer", "coordinate"):
        grown = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=held_out,
                           step_mode=step_mode, measure_realized_gains=False)
        losses[step_mode] = grown.growth_report.eval_loss_after
        if step_mode == "per_layer":
            per_layer = grown.growth_report
    report = grown.growth_report
    assert losses["coordinate"] < losses["per_layer"] - 1e-4
    assert report.step_size == per_layer.step_size  # it starts from the per-layer step and moves layers from there
    assert [layer.lam for layer in report.layers] != pytest.approx([layer.lam for layer in per_layer.layers])
    # the refinement of layer 1 replays block 0: fewer than one full pass per evaluation of it
    layer_points = sum(point.kind.startswith("layer") for point in report.line_search)
    assert report.line_search_passes < sum(point.kind == "rank" for point in report.line_search) + layer_points


def test_searched_steps_work_in_training_and_from_the_command_line_flags(stdlib_bytes):
    from hf_grow import GrowthConfig, grow_in_training, to_grown_model
    from hf_grow.cli import build_parser

    torch.manual_seed(0)
    model = to_grown_model(GPT2LMHeadModel(tiny_gpt2_config()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in lm_batches(stdlib_bytes["train"], 30, seed=35):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    report = grow_in_training(model, optimizer, lm_batches(stdlib_bytes["stats"], 2, seed=36), 8, mode="append",
                              eval_dataloader=lm_batches(stdlib_bytes["eval"], 2, seed=37),
                              config=GrowthConfig(step_mode="coordinate", measure_realized_gains=False))
    assert report.step_mode == "coordinate" and report.eval_loss_after <= report.eval_loss_before
    assert any(point.kind == "layer 1" for point in report.line_search)
    args = build_parser().parse_args(["gpt2", "--output-dir", "out", "--step-mode", "layer_search"])
    assert args.step_mode == "layer_search"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gpt2", "--output-dir", "out", "--step-mode", "per_token"])


def test_the_step_zero_pass_records_for_the_search_of_each_layer_alone_and_the_realized_gains(
    trained_gpt2, statistics, held_out, monkeypatch
):
    """One set of step-0 records serves both: the search of each layer alone replays them (the other layers are at
    step 0), then the realized gains do; no block is recorded again, and the gains are those of full passes."""
    from hf_grow.growth.layer_steps import HeldOutPasses
    from hf_grow.growth.problem import write_weights

    created, initialize, recording = [], HeldOutPasses.__init__, HeldOutPasses.record

    def init(self, *args):
        created.append(self)
        initialize(self, *args)

    def record(self, layer):
        assert not (self.blocks and layer == len(self.recorded) < self.num_layers - 1), f"block {layer} recorded"
        recording(self, layer)

    monkeypatch.setattr(HeldOutPasses, "__init__", init)
    monkeypatch.setattr(HeldOutPasses, "record", record)
    grown = grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=held_out,
                       step_mode="layer_search")
    report = grown.growth_report
    assert len(created) == 1 and report.step_size > 0
    adapter = get_adapter(grown)
    stepped = {layer: adapter.read_qk(module) for layer, module in enumerate(adapter.attention_modules(grown))}
    unchanged = grow_model(trained_gpt2, None, p=8, statistics=statistics, step_size=0.0, measure_realized_gains=False)
    unchanged = {layer: adapter.read_qk(module) for layer, module in enumerate(adapter.attention_modules(unchanged))}
    for layer in range(len(stepped)):
        write_weights(adapter, grown, {**unchanged, layer: stepped[layer]})
        full_pass = report.eval_loss_before - evaluate_loss(grown, held_out)[0]
        assert report.layers[layer].realized_gain == pytest.approx(full_pass, rel=1e-9, abs=1e-12)
