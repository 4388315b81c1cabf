"""The grown GPT-2 type: exact at step 0 for every class and setting, save/load, remote code, generate."""

import os
import warnings

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
    RobertaConfig,
    RobertaModel,
)

import hf_grow
from hf_grow import GrownGPT2LMHeadModel, grow_model, load_growth_report

from conftest import (
    CONTINUOUS_BATCHING_MATCHES_GENERATE,
    assert_causal_lm_loads_without_hf_grow,
    assert_generation_is_unchanged,
    grown_twice,
    lm_batches,
    outputs_of,
    sum_of_outputs,
    tiny_gpt2_config,
)


CLASSES = [
    GPT2Model,
    GPT2LMHeadModel,
    GPT2DoubleHeadsModel,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2ForQuestionAnswering,
]


def random_batches(count=2, batch_size=4, seq_len=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(1, 256, (batch_size, seq_len), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return batches


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("model_class", CLASSES, ids=lambda c: c.__name__)
def test_step_zero_preserves_every_class(model_class, attention):
    torch.manual_seed(0)
    model = model_class(tiny_gpt2_config(num_labels=3, pad_token_id=0)).eval()
    model.set_attn_implementation(attention)
    batches = random_batches()
    grown = grow_model(model, batches, p=8, step_size=0.0, loss_fn=sum_of_outputs)
    assert type(grown).__name__ == "Grown" + model_class.__name__
    assert grown.config.qk_head_dims == [24, 24]
    assert grown.config._attn_implementation == attention
    batch = random_batches(seed=1)[0]
    for expected, actual in zip(outputs_of(model, batch), outputs_of(grown, batch), strict=True):
        assert (expected - actual).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "settings",
    [
        {"scale_attn_by_inverse_layer_idx": True},
        {"scale_attn_weights": False},
        {"reorder_and_upcast_attn": True},
    ],
    ids=lambda s: next(iter(s)),
)
def test_step_zero_preserves_scaling_variants(settings):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(**settings)).eval()
    model.set_attn_implementation("eager")
    grown = grow_model(model, random_batches(), p=4, step_size=0.0, loss_fn=sum_of_outputs)
    batch = random_batches(seed=2)[0]
    assert (outputs_of(model, batch)[0] - outputs_of(grown, batch)[0]).abs().max() <= 1e-4
    # The scale is 1/sqrt of the new width: the change is folded into the query weights.
    expected = (20**-0.5 if settings.get("scale_attn_weights", True) else 1.0) / (
        2 if settings.get("scale_attn_by_inverse_layer_idx") else 1
    )
    assert grown.transformer.h[1].attn.scaling == pytest.approx(expected)


def test_line_search_step_keeps_the_function_close_when_tiny(trained_gpt2, stdlib_bytes):
    """A rank-(d_k+p) refactoring at a negligible step is the old function up to float error."""
    batches = lm_batches(stdlib_bytes["stats"], 2)
    grown = grow_model(trained_gpt2, batches, p=8, step_size=1e-9)
    batch = lm_batches(stdlib_bytes["test"], 1, seed=9)[0]
    assert (outputs_of(trained_gpt2, batch)[1] - outputs_of(grown, batch)[1]).abs().max() <= 1e-4


def test_save_and_load_round_trip_is_bit_exact(trained_gpt2, stdlib_bytes, tmp_path):
    grown = grow_model(trained_gpt2, lm_batches(stdlib_bytes["stats"], 3), p=8, step_size=0.05)
    grown.save_pretrained(tmp_path)
    names = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "modeling_grown_gpt2.py", "configuration_grown_gpt2.py"} <= names
    assert "growth_report.json" in names
    assert load_growth_report(tmp_path).to_dict() == grown.growth_report.to_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, GrownGPT2LMHeadModel)
    for name, tensor in grown.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base).__name__ == "GrownGPT2Model"
    batch = lm_batches(stdlib_bytes["test"], 1, seed=4)[0]
    assert torch.equal(outputs_of(grown, batch)[1], outputs_of(loaded, batch)[1])


def test_plain_gpt2_refuses_a_grown_checkpoint(trained_gpt2, stdlib_bytes, tmp_path):
    grown = grow_model(trained_gpt2, lm_batches(stdlib_bytes["stats"], 2), p=8, step_size=0.0)
    grown.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="size mismatch|mismatch"):
        GPT2LMHeadModel.from_pretrained(tmp_path)


def test_remote_code_loads_without_hf_grow(trained_gpt2, stdlib_bytes, tmp_path):
    grown = grow_model(trained_gpt2, lm_batches(stdlib_bytes["stats"], 2), p=8, step_size=0.05)
    folder = tmp_path / "grown"
    grown.save_pretrained(folder)
    batch = lm_batches(stdlib_bytes["test"], 1, seed=5)[0]
    assert_causal_lm_loads_without_hf_grow(grown, folder, batch, tmp_path, base_class="GrownGPT2Model",
                                           more_checks=CONTINUOUS_BATCHING_MATCHES_GENERATE)


def test_generate_with_cache_matches_the_original(trained_gpt2, stdlib_bytes):
    assert_generation_is_unchanged(trained_gpt2, stdlib_bytes)


def test_growing_twice(trained_gpt2, stdlib_bytes):
    once, twice = grown_twice(trained_gpt2, stdlib_bytes, p=4)
    assert once.config.qk_head_dims == [20, 20] and twice.config.qk_head_dims == [24, 28]


def test_bad_inputs_fail_before_any_work(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 2)

    def never_called():
        raise AssertionError("data was read before the arguments were checked")
        yield

    for bad_p in (0, -3):
        with pytest.raises(ValueError, match="p must be a positive"):
            grow_model(trained_gpt2, never_called(), p=bad_p)
    with pytest.raises(TypeError, match="p must be an int"):
        grow_model(trained_gpt2, never_called(), p=True)
    with pytest.raises(ValueError, match="names layers \\[5\\]"):
        grow_model(trained_gpt2, never_called(), p={5: 8})
    with pytest.raises(ValueError, match="exceed 65, the width of the query/key projections' inputs"):
        grow_model(trained_gpt2, never_called(), p=60)
    with pytest.raises(ValueError, match="truncation"):
        grow_model(trained_gpt2, never_called(), p=8, truncation="spectral")
    roberta = RobertaModel(
        RobertaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    )
    with pytest.raises(ValueError, match="supported model types: gpt2, grown_gpt2, bert, grown_bert"):
        grow_model(roberta, never_called(), p=8)
    with pytest.raises(ValueError, match="no batches"):
        grow_model(trained_gpt2, [], p=8, step_size=0.0)
    with pytest.raises(ValueError, match="yielded 1 batch"):
        grow_model(trained_gpt2, batches[:1], p=8)
    with pytest.raises(ValueError, match="eval_dataloader yielded no batches"):
        grow_model(trained_gpt2, batches, p=8, eval_dataloader=[])


def test_input_model_is_unchanged(gpt2_copy, stdlib_bytes):
    model = gpt2_copy.train()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    grown = grow_model(model, lm_batches(stdlib_bytes["stats"], 4), p=8, measure_realized_gains=False)
    assert model.training and model.config._attn_implementation == "sdpa"
    assert grown.training  # the grown model takes the mode of its source
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    # No storage is shared: training the grown model cannot touch the input.
    grown_storages = {t.untyped_storage().data_ptr() for t in grown.state_dict().values()}
    assert not grown_storages & {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert hf_grow.get_adapter(grown).qk_head_dims(grown.config) == [24, 24]


def test_building_the_grown_model_makes_no_third_copy_of_the_weights(gpt2_copy, monkeypatch):
    """While the grown model is filled, the live weights are the source's and the grown model's: the state dict
    it is filled from holds the source's own tensors (only the new Q/K weights are new)."""
    model = gpt2_copy.eval()
    adapter = hf_grow.get_adapter(model)
    source = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    loaded = {}
    load = torch.nn.Module.load_state_dict

    def recording_load(module, state_dict, *args, **kwargs):
        loaded.update(state_dict)
        return load(module, state_dict, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", recording_load)
    query, key = adapter.read_qk(adapter.attention_modules(model)[0])
    grown = adapter.build_grown_model(model, [query.shape[-1]] * 2, {0: (query, key)})
    copied = {name for name, tensor in loaded.items() if tensor.untyped_storage().data_ptr() not in source}
    assert copied and all(".attn." in name for name in copied), copied  # only layer 0's new Q/K tensors
    grown_storages = {t.untyped_storage().data_ptr() for t in grown.state_dict().values()}
    assert not grown_storages & source


def test_widths_off_multiples_of_eight_warn(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 2)
    with pytest.warns(UserWarning, match="not multiples of 8"):
        grow_model(trained_gpt2, batches, p=4, step_size=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grow_model(trained_gpt2, batches, p=8, step_size=0.0)
