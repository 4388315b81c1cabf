"""Growth that keeps the attention scale of the old width (``keep_attention_scale``): the grown config records it,
the grown models compute with it, and nothing is folded into the old queries or their optimizer moments."""

import copy

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, BertModel, LlamaForCausalLM

from hf_grow import (
    GrowthCallback,
    GrownBertConfig,
    GrownGPT2Config,
    GrownLlamaConfig,
    grow_in_training,
    grow_model,
)
from hf_grow.adapters import get_adapter

from conftest import assert_causal_lm_loads_without_hf_grow, lm_batches, outputs_of, sum_of_outputs
from test_grown_bert import padded_batch, tiny_bert_config
from test_grown_llama import tiny_llama_config
from test_training import trained  # noqa: F401  (the fixture)
from test_training import copied


def scalings(model) -> list[float]:
    return [attention.scaling for attention in get_adapter(model).attention_modules(model)]


@pytest.mark.parametrize("architecture", ["gpt2", "bert", "llama"])
def test_every_architecture_grows_exactly_at_the_old_scale_and_reloads(architecture, trained_gpt2, stdlib_bytes,
                                                                       tmp_path):
    torch.manual_seed(0)
    if architecture == "gpt2":
        model, auto = trained_gpt2, AutoModelForCausalLM
        batches, batch = lm_batches(stdlib_bytes["stats"], 2), lm_batches(stdlib_bytes["test"], 1, seed=5)[0]
    elif architecture == "bert":
        model, auto = BertModel(tiny_bert_config()).eval(), AutoModel
        batches, batch = [padded_batch(seed=seed) for seed in range(2)], padded_batch(seed=5)
    else:
        model, auto = LlamaForCausalLM(tiny_llama_config()).eval(), AutoModelForCausalLM
        batches, batch = lm_batches(stdlib_bytes["stats"], 2), lm_batches(stdlib_bytes["test"], 1, seed=5)[0]
    loss_fn = sum_of_outputs if architecture == "bert" else None
    old_dims = get_adapter(model).qk_head_dims(model.config)

    grown = grow_model(model, batches, p=8, step_size=0.0, keep_attention_scale=True, loss_fn=loss_fn)
    assert grown.config.qk_head_dims == [dim + 8 for dim in old_dims]
    assert grown.config.attention_scale_dims == old_dims
    assert scalings(grown) == scalings(model)
    for expected, actual in zip(outputs_of(model, batch), outputs_of(grown, batch), strict=True):
        assert (expected - actual).abs().max() <= 1e-5
    # Refactored at step 0, the old queries are the old function's factors: kept scale, nothing folded in.
    folded = grow_model(model, batches, p=8, step_size=0.0, loss_fn=loss_fn)
    assert folded.config.attention_scale_dims is None and scalings(folded) != scalings(model)

    grown.save_pretrained(tmp_path / "grown")
    loaded = auto.from_pretrained(tmp_path / "grown").eval()
    assert loaded.config.attention_scale_dims == old_dims and scalings(loaded) == scalings(model)
    for expected, actual in zip(outputs_of(grown, batch), outputs_of(loaded, batch), strict=True):
        assert torch.equal(expected, actual)
    if architecture == "gpt2":  # the exported modeling file reads the scale from the config, without hf_grow
        assert_causal_lm_loads_without_hf_grow(grown, tmp_path / "grown", batch, tmp_path,
                                               base_class="GrownGPT2Model")


def test_refactor_at_the_old_scale_is_the_same_function_in_other_weights(trained_gpt2, stdlib_bytes):
    """Refactored growth solves Z, which the scale does not change: at one step both give the same model; only the
    split of Z into weights differs, by (scale_width / scale_kept)^(1/2) on queries and keys alike."""
    batches = lm_batches(stdlib_bytes["stats"], 3)
    evaluation = lm_batches(stdlib_bytes["eval"], 1, seed=11)
    settings = dict(p=8, step_size=0.05, eval_dataloader=evaluation, measure_realized_gains=False)
    kept = grow_model(trained_gpt2, batches, keep_attention_scale=True, **settings)
    folded = grow_model(trained_gpt2, batches, **settings)
    assert kept.growth_report.eval_loss_after == pytest.approx(folded.growth_report.eval_loss_after, abs=1e-5)
    assert abs(kept.growth_report.eval_loss_after - kept.growth_report.eval_loss_before) > 1e-3  # a real step
    adapter = get_adapter(kept)
    ratio = (24 ** -0.5 / 16 ** -0.5) ** 0.5
    for kept_attention, folded_attention in zip(adapter.attention_modules(kept), adapter.attention_modules(folded)):
        for kept_weight, folded_weight in zip(adapter.read_qk(kept_attention), adapter.read_qk(folded_attention)):
            torch.testing.assert_close(kept_weight, folded_weight * ratio, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["zero", "append"])
def test_growth_in_training_leaves_old_queries_and_their_moments_as_they_were(trained, stdlib_bytes, mode):  # noqa: F811
    model, optimizer = copied(trained)
    attention = model.transformer.h[0].attn
    weight = attention.c_attn.weight
    before = {"weight": weight.detach().clone(), **{k: v.clone() for k, v in optimizer.state[weight].items()}}
    scaling = attention.scaling
    batch = lm_batches(stdlib_bytes["eval"], 1, seed=5)[0]
    model.eval()
    with torch.no_grad():
        loss_before = float(model(**batch).loss)

    stats = lm_batches(stdlib_bytes["stats"], 3, seed=6)
    grow_in_training(model, optimizer, stats, 8, mode=mode, step_size=0.0, keep_attention_scale=True)
    assert model.config.qk_head_dims == [16, 16] and model.config.attention_scale_dims == [8, 8]
    assert attention.qk_head_dim == 16 and attention.scaling == scaling
    with torch.no_grad():
        assert float(model(**batch).loss) == pytest.approx(loss_before, abs=1e-5)
    # Query columns 0-7 of every head, weights and moments, exactly as before (no fold); the new ones start at 0.
    heads, old, new = attention.num_heads, 8, 16
    after = {"weight": weight.detach(), **optimizer.state[weight]}
    for key in ("weight", "exp_avg", "exp_avg_sq"):
        old_queries = before[key][:, : heads * old].reshape(-1, heads, old)
        new_queries = after[key][:, : heads * new].reshape(-1, heads, new)
        assert torch.equal(new_queries[..., :old], old_queries), key
        if key != "weight":
            assert torch.count_nonzero(new_queries[..., old:]) == 0


def test_a_layer_that_does_not_grow_keeps_its_scale(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 2)
    batch = lm_batches(stdlib_bytes["test"], 1, seed=5)[0]
    kept = grow_model(trained_gpt2, batches, p=8, step_size=0.0, keep_attention_scale=True)
    # Grown again, following the width: layer 0's scale now follows its new width, layer 1's (not grown) stays.
    again = grow_model(kept, batches, p={0: 8, 1: 0}, step_size=0.0)
    assert again.config.qk_head_dims == [32, 24] and again.config.attention_scale_dims == [32, 16]
    assert scalings(again) == [32 ** -0.5, 16 ** -0.5]
    assert (outputs_of(kept, batch)[1] - outputs_of(again, batch)[1]).abs().max() <= 1e-4
    # Where every layer's scale follows its width again, the config says so with None.
    back = grow_model(kept, batches, p=8, step_size=0.0)
    assert back.config.attention_scale_dims is None and back.config.qk_head_dims == [32, 32]


@pytest.mark.parametrize("config_class, settings", [
    (GrownGPT2Config, dict(n_layer=2)),
    (GrownBertConfig, dict(num_hidden_layers=2)),
    (GrownLlamaConfig, tiny_llama_config().to_dict()),
], ids=["gpt2", "bert", "llama"])
def test_configs_refuse_attention_scale_dims_that_do_not_fit(config_class, settings):
    with pytest.raises(Exception, match="one positive width per layer"):
        config_class(**settings | {"attention_scale_dims": [16]})
    with pytest.raises(Exception, match="one positive width per layer"):
        config_class(**settings | {"attention_scale_dims": [16, 0]})
    config = config_class(**settings | {"attention_scale_dims": [4, 9]})
    assert [config.attention_scale_dim(layer) for layer in range(2)] == [4, 9]


def test_growth_callback_keeps_the_scale_in_its_checkpoints(trained, tmp_path):  # noqa: F811
    model, optimizer = copied(trained)
    callback = GrowthCallback({2: 8}, mode="zero", keep_attention_scale=True)
    args = type("Args", (), {"per_device_train_batch_size": 4})()
    state = type("State", (), {"global_step": 2, "log_history": []})()
    callback.on_step_end(args, state, None, model=model, optimizer=optimizer, train_dataloader=None)
    assert model.config.qk_head_dims == [16, 16] and model.config.attention_scale_dims == [8, 8]
    model.save_pretrained(tmp_path / "checkpoint")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert loaded.config.attention_scale_dims == [8, 8] and scalings(loaded) == scalings(model) == [8 ** -0.5] * 2


def test_the_fast_search_brackets_the_same_step_at_the_old_scale(trained_gpt2, stdlib_bytes):
    """``search="fast"`` brackets the step on a full-rank reference model, which must take the kept scale too."""
    batches = lm_batches(stdlib_bytes["stats"], 3)
    evaluation = lm_batches(stdlib_bytes["eval"], 1, seed=11)
    settings = dict(p=8, search="fast", eval_dataloader=evaluation, measure_realized_gains=False)
    kept = grow_model(trained_gpt2, batches, keep_attention_scale=True, **settings).growth_report
    folded = grow_model(trained_gpt2, batches, **settings).growth_report
    assert kept.step_size == folded.step_size and kept.eval_loss_after < kept.eval_loss_before
    assert kept.eval_loss_after == pytest.approx(folded.eval_loss_after, abs=1e-5)
    unconstrained = [[point.loss for point in report.line_search if point.kind == "unconstrained"]
                     for report in (kept, folded)]
    assert unconstrained[0] and unconstrained[0] == pytest.approx(unconstrained[1], abs=1e-5)


@pytest.mark.parametrize("architecture, flags", [
    ("gpt2", {}), ("gpt2", {"scale_attn_weights": False}), ("gpt2", {"scale_attn_by_inverse_layer_idx": True}),
    ("bert", {}), ("llama", {}),
])
def test_the_adapters_scaling_rule_is_the_modeling_files(architecture, flags):
    """The solve and the resize read each layer's scale from its adapter, a grown model built from its config (as
    `from_pretrained` does) from its modeling file's self-contained copy of the rule: both agree, on the plain
    model and after growth by 8 at the old scale and at the new one (GPT-2's flags: no scaling, scaling by the
    inverse layer index)."""
    from transformers import GPT2LMHeadModel

    from hf_grow import to_grown_model

    from conftest import tiny_gpt2_config

    torch.manual_seed(0)
    build = {"gpt2": lambda: GPT2LMHeadModel(tiny_gpt2_config(n_layer=3, **flags)),
             "bert": lambda: BertModel(tiny_bert_config()), "llama": lambda: LlamaForCausalLM(tiny_llama_config())}
    plain = build[architecture]()
    adapter = get_adapter(plain)
    layers = range(len(adapter.attention_modules(plain)))
    assert scalings(plain) == [adapter.current_scaling(plain.config, layer) for layer in layers]
    for keep_attention_scale in (False, True):
        grown = to_grown_model(copy.deepcopy(plain))
        grow_in_training(grown, None, None, 8, mode="zero", keep_attention_scale=keep_attention_scale)
        expected = [adapter.current_scaling(grown.config, layer) for layer in layers]
        assert scalings(grown) == pytest.approx(expected, rel=1e-15)  # set by the adapter at the resize
        assert scalings(type(grown)(grown.config)) == pytest.approx(expected, rel=1e-15)  # the modeling file's
        unscaled = not flags.get("scale_attn_weights", True)
        assert (expected == scalings(plain)) == (keep_attention_scale or unscaled)
