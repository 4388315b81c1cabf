"""Checks from transformers' own model and generation tests that grown models could fail and the rest of this suite
does not make: a fresh model's initialization, decoding paths that use the cache differently from greedy search
(beam search, assisted and prompt-lookup decoding, which crop it), left padding, the dynamic cache's key and value
widths, and BERT as a decoder with a cache.

Tiny random models at +0 and +8 query/key dims per head and with a width of their own per layer ("mixed"), as in
test_cache_paths.py. Found by running transformers 5.24's ModelTesterMixin on the grown classes (issue #36).
"""

import pytest
import torch
from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

from hf_grow import (
    GrownBertConfig,
    GrownBertForMaskedLM,
    GrownBertModel,
    GrownGPT2Config,
    GrownGPT2LMHeadModel,
    GrownGPT2Model,
    GrownLlamaConfig,
    GrownLlamaForCausalLM,
    grow_model,
)

from conftest import tiny_gpt2_config
from test_cache_paths import GROWTHS, grown_gpt2, grown_llama
from test_grown_bert import tiny_bert_config
from test_grown_llama import tiny_llama_config


@pytest.fixture(params=[grown_gpt2, grown_llama], ids=["gpt2", "llama"])
def build(request):
    return request.param


@pytest.fixture(params=list(GROWTHS), ids=list(GROWTHS))
def added(request) -> list[int]:
    return GROWTHS[request.param]


def prompts(batch_size: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(1, 256, (batch_size, length), generator=torch.Generator().manual_seed(1))


GREEDY = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize(
    "plain_class, grown_class, plain_config, grown_config",
    [
        (GPT2LMHeadModel, GrownGPT2LMHeadModel, tiny_gpt2_config, GrownGPT2Config),
        (LlamaForCausalLM, GrownLlamaForCausalLM, tiny_llama_config, GrownLlamaConfig),
        (BertForMaskedLM, GrownBertForMaskedLM, tiny_bert_config, GrownBertConfig),
    ],
    ids=["gpt2", "llama", "bert"],
)
def test_fresh_plus0_model_is_initialized_as_the_plain_one(plain_class, grown_class, plain_config, grown_config):
    """Built from a config with the same seed, a +0 grown model has the plain model's weights, bit for bit."""
    config = plain_config()
    torch.manual_seed(0)
    plain = plain_class(config)
    torch.manual_seed(0)
    grown = grown_class(grown_config(**config.to_dict()))
    plain_state, grown_state = plain.state_dict(), grown.state_dict()
    assert plain_state.keys() == grown_state.keys()
    assert [name for name in plain_state if not torch.equal(plain_state[name], grown_state[name])] == []


@pytest.mark.parametrize(
    "grown_class, plain_config, grown_config",
    [
        (GrownGPT2LMHeadModel, tiny_gpt2_config, GrownGPT2Config),
        (GrownLlamaForCausalLM, tiny_llama_config, GrownLlamaConfig),
        (GrownBertForMaskedLM, tiny_bert_config, GrownBertConfig),
    ],
    ids=["gpt2", "llama", "bert"],
)
def test_flash_and_flex_attention_are_refused_saying_why(grown_class, plain_config, grown_config, tmp_path):
    """Not transformers' "does not support Flash Attention yet, request support on its Hub page" (with a made-up
    Hub address for a local folder); and the grown models' tags reach the card transformers' push_to_hub writes."""
    config = grown_config(**plain_config().to_dict())
    model = grown_class(config)
    assert model.model_tags == ["hf_grow", "grown-attention"]
    model.save_pretrained(tmp_path)
    name = grown_class.__name__
    for implementation in ("flash_attention_2", "flash_attention_3", "flex_attention"):
        message = f"{name} cannot run attn_implementation='{implementation}': its query/key heads differ in width"
        with pytest.raises(ValueError, match=message):
            grown_class.from_pretrained(tmp_path, attn_implementation=implementation)
        with pytest.raises(ValueError, match=message):
            model.set_attn_implementation(implementation)
    model.set_attn_implementation("eager")  # the two it runs
    model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("plain_class, plain_config", [(LlamaForCausalLM, tiny_llama_config),
                                                       (BertForMaskedLM, tiny_bert_config)], ids=["llama", "bert"])
def test_a_model_running_flex_attention_grows_into_one_running_sdpa(plain_class, plain_config, caplog):
    """A source model running flex attention (or, as loaded for a GPU, flash attention, which needs one) was refused
    when the grown model was built, after the statistics pass and the solve."""
    torch.manual_seed(0)
    model = plain_class(plain_config()).eval()
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 99, (4, 2, 16))]
    model.set_attn_implementation("flex_attention")
    with caplog.at_level("WARNING", logger="hf_grow"):
        grown = grow_model(model, batches, p=8, step_size=0.0)
    model.set_attn_implementation("sdpa")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert grown.config._attn_implementation == "sdpa" and grown.config.qk_head_dims[0] == head_dim + 8
    assert "runs attention with 'sdpa', not the source's 'flex_attention'" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(grown(batches[0]["input_ids"]).logits, model(batches[0]["input_ids"]).logits,
                                   rtol=0, atol=1e-5)


def test_grown_gpt2_scales_residual_projections_at_initialization():
    """GPT-2's scheme (transformers' test_gpt2_weight_initialization): every `c_proj` weight has std
    `initializer_range / sqrt(2 * n_layer)`, in grown layers too (it was `initializer_range`: transformers skips
    parameterless modules of custom-code classes)."""
    config = GrownGPT2Config(**tiny_gpt2_config(n_layer=8).to_dict() | {"qk_head_dims": [24] * 8})
    torch.manual_seed(0)
    model = GrownGPT2Model(config)
    expected = config.initializer_range / (2 * config.n_layer) ** 0.5
    stds = [param.std().item() for name, param in model.named_parameters() if name.endswith("c_proj.weight")]
    assert len(stds) == 16
    assert all(abs(std - expected) < 1e-3 for std in stds), stds


def test_beam_search_matches_without_the_cache(build, added):
    """Beam search reorders the cache between steps: the same beams and scores as recomputing everything."""
    model, prompt = build(added), prompts()
    settings = dict(num_beams=3, num_return_sequences=2, return_dict_in_generate=True, output_scores=True, **GREEDY)
    cached = model.generate(prompt, use_cache=True, **settings)
    uncached = model.generate(prompt, use_cache=False, **settings)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-5, rtol=1e-5)


def test_assisted_and_prompt_lookup_decoding_match_greedy(build, added):
    """Assisted decoding and prompt lookup verify drafts and crop the rejected ones from the cache."""
    model, prompt = build(added), prompts(batch_size=1).repeat(1, 2)
    expected = model.generate(prompt, **GREEDY)
    assistant = build(added)
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assert torch.equal(model.generate(prompt, assistant_model=assistant, **GREEDY), expected)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=3, **GREEDY), expected)


def test_left_padding_leaves_the_last_logits_unchanged(build, added):
    model, prompt = build(added), prompts()
    pad = torch.zeros((prompt.shape[0], 4), dtype=prompt.dtype)
    mask = torch.cat([torch.zeros_like(pad), torch.ones_like(prompt)], dim=1)
    padded = model(
        torch.cat([pad, prompt], dim=1), attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
    )
    torch.testing.assert_close(padded.logits[:, -1], model(prompt).logits[:, -1], atol=1e-5, rtol=1e-5)


def test_dynamic_cache_holds_each_layers_key_width(build, added):
    model, prompt = build(added), prompts()
    cache = model(prompt, use_cache=True).cache
    heads = getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)
    for layer, key_width in enumerate(model.config.qk_head_dims):
        assert cache.layers[layer].keys.shape == (2, heads, 8, key_width)
        assert cache.layers[layer].values.shape == (2, heads, 8, 16)


@pytest.mark.parametrize("added", list(GROWTHS.values()), ids=list(GROWTHS))
def test_grown_bert_as_a_decoder_with_a_cache_matches_the_full_forward(added):
    config = GrownBertConfig(**tiny_bert_config(is_decoder=True).to_dict())
    config.qk_head_dims = [dim + extra for dim, extra in zip(config.qk_head_dims, added)]
    torch.manual_seed(0)
    model = GrownBertModel(GrownBertConfig(**config.to_dict())).eval()
    prompt, following = prompts(length=7) % 100, prompts(length=3) % 100
    past = model(prompt, use_cache=True).cache
    full = model(torch.cat([prompt, following], dim=1)).last_hidden_state
    step = model(following, cache=past).last_hidden_state
    torch.testing.assert_close(step, full[:, -3:], atol=1e-4, rtol=1e-4)


def test_a_model_with_offloaded_weights_is_refused_before_any_data(tmp_path):
    """device_map with a "disk" entry leaves that layer's weights on the meta device (accelerate loads them per
    forward): growth builds the grown model from the weights, so it is refused before the statistics pass."""
    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "model")
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "cpu",
                  "transformer.h.1": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "model", device_map=device_map,
                                            offload_folder=str(tmp_path / "offload"))

    def unread():
        raise AssertionError("the dataloader was read before the weights were checked")
        yield

    with pytest.raises(ValueError, match=r"parameters are on the meta device \(first: transformer\.h\.1\."):
        grow_model(model, unread(), p=8)
