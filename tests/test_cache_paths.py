"""Grown GPT-2 and Llama (and a BERT decoder) on transformers' pre-allocated caches: static caches with chunked
prefill, the ExecuTorch export recipe, continuous batching, and the per-layer key widths a saved config gives those
caches.

Tiny random models at +0 and +8 query/key dims per head and with a width of their own per layer ("mixed"); every
path must generate the tokens plain `generate` does (ported from transformers' generation and export tests).
"""

import pytest
import torch
from transformers import AutoConfig, BertConfig, ContinuousBatchingConfig, GenerationConfig
from transformers.cache_utils import Fp8QuantizedLayer, QuantizedCache, StaticCache
from transformers.integrations.executorch import (
    TorchExportableModuleWithStaticCache,
    convert_and_export_with_cache,
)

from hf_grow import (
    GrownBertConfig,
    GrownBertLMHeadModel,
    GrownGPT2Config,
    GrownGPT2LMHeadModel,
    GrownLlamaConfig,
    GrownLlamaForCausalLM,
)

from conftest import tiny_gpt2_config
from test_grown_llama import tiny_llama_config


#: Added query/key dims per head in each of the two layers (the value heads are 16 wide).
GROWTHS = {"plus0": [0, 0], "plus8": [8, 8], "mixed": [8, 4]}


def grown_gpt2(added: list[int], **overrides) -> GrownGPT2LMHeadModel:
    torch.manual_seed(0)
    settings = tiny_gpt2_config(**overrides).to_dict()
    return GrownGPT2LMHeadModel(GrownGPT2Config(**settings | {"qk_head_dims": [16 + dim for dim in added]})).eval()


def grown_llama(added: list[int], **overrides) -> GrownLlamaForCausalLM:
    torch.manual_seed(0)
    settings = tiny_llama_config(num_key_value_heads=2, **overrides).to_dict()
    return GrownLlamaForCausalLM(GrownLlamaConfig(**settings | {"qk_nope_dims": added})).eval()


def grown_bert_decoder(added: list[int]) -> GrownBertLMHeadModel:
    torch.manual_seed(0)
    settings = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=64, is_decoder=True, pad_token_id=0).to_dict()
    return GrownBertLMHeadModel(GrownBertConfig(**settings | {"qk_head_dims": [16 + dim for dim in added]})).eval()


@pytest.fixture(params=[grown_gpt2, grown_llama], ids=["gpt2", "llama"])
def build(request):
    return request.param


@pytest.fixture(params=[grown_gpt2, grown_llama, grown_bert_decoder], ids=["gpt2", "llama", "bert-decoder"])
def static_build(request):
    """Also a BERT decoder: its static cache allocated ahead of time held keys at the value width (no per-layer
    cache types in its config), and the first write of the wider grown keys failed."""
    return request.param


@pytest.fixture(params=list(GROWTHS), ids=list(GROWTHS))
def added(request) -> list[int]:
    return GROWTHS[request.param]


def prompts(batch_size: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(1, 256, (batch_size, length), generator=torch.Generator().manual_seed(1))


SETTINGS = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


def test_static_cache_with_chunked_prefill_matches_generate(static_build, added):
    """`prefill_chunk_size` initializes the static cache up front (from `config.head_dim` before this fix)."""
    model, prompt = static_build(added), prompts()
    expected = model.generate(prompt, **SETTINGS)
    static = model.generate(prompt, cache_implementation="static", prefill_chunk_size=4, **SETTINGS)
    assert torch.equal(static, expected)


def test_executorch_export_runs_and_matches_the_model(static_build, added):
    """transformers' ExecuTorch recipe: a static-cache wrapper initialized up front, exported with torch.export.
    Fed a prompt one token at a time, the program gives the model's logits at every position (so its cache holds
    the keys and values of the earlier tokens), and its own greedy loop runs."""
    model, prompt = static_build(added), prompts(batch_size=1)
    model.generation_config.cache_implementation = "static"
    model.generation_config.cache_config = {"batch_size": 1, "max_cache_len": 32}
    program = convert_and_export_with_cache(model).module()
    steps = [program(input_ids=prompt[:, [i]], cache_position=torch.tensor([i])) for i in range(prompt.shape[1])]
    with torch.no_grad():
        expected = model(prompt).logits
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-4, atol=1e-5)
    generated = TorchExportableModuleWithStaticCache.generate(
        convert_and_export_with_cache(model), prompt, max_new_tokens=4
    )
    assert generated.shape == (1, prompt.shape[1] + 4) and torch.equal(generated[:, : prompt.shape[1]], prompt)


#: Continuous batching settings small enough for a CPU, and the generation settings it runs with.
SMALL_BATCHING = dict(num_blocks=8, max_batch_tokens=32, default_compile_level=0)
GREEDY = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_continuous_batching_matches_greedy_generate(build, added):
    """`generate_batch` (the engine of `transformers serve`) gives, per prompt (three lengths, no padding), the
    tokens of greedy `generate` and their log-probabilities. Keys wider than values (by 8 in both layers, or by 8
    and 4) are zero-padded to one width in the paged cache. Weights are drawn at 10 times GPT-2's scale, so that the
    tokens depend on the prompt (at 0.02 the tiny GPT-2 repeats one token whatever the attention does)."""
    model = build(added, initializer_range=0.2)
    inputs = [prompts(1, length)[0].tolist() for length in (10, 7, 3)]
    batching = ContinuousBatchingConfig(**SMALL_BATCHING, return_logprobs=True)
    outputs = model.generate_batch(inputs, GenerationConfig(**GREEDY), continuous_batching_config=batching)
    assert [output.prompt_ids for output in outputs.values()] == inputs
    for output in outputs.values():
        prompt = torch.tensor([output.prompt_ids])
        expected = model.generate(prompt, output_logits=True, return_dict_in_generate=True, **GREEDY)
        tokens = expected.sequences[0, prompt.shape[1] :]
        assert output.generated_tokens == tokens.tolist()
        logprobs = torch.stack([logits[0].log_softmax(-1)[token] for logits, token in zip(expected.logits, tokens)])
        torch.testing.assert_close(torch.tensor(output.logprobs), logprobs, rtol=0, atol=1e-4)


def test_continuous_batching_pads_a_paged_cache_to_the_widest_keys(build):
    """Where keys and values differ in width, transformers' manager is given the model through hf_grow's view, so
    its paged cache holds all layers in one full-attention group at the widest key width (24: 16 + 8). Kept on the
    model (`persistent_manager`), the manager serves the next session too; both give greedy `generate`'s tokens
    with eager attention ("paged|eager" while batching), which the model has again afterwards."""
    model = build(GROWTHS["mixed"])
    model.set_attn_implementation("eager")
    batching = ContinuousBatchingConfig(**SMALL_BATCHING)
    run = dict(generation_config=GenerationConfig(**GREEDY), continuous_batching_config=batching)
    first = model.generate_batch([[1, 2, 3]], persistent_manager=True, **run)
    manager = model._cached_continuous_batching_manager
    assert type(manager.model).__name__ == "PagedModelView" and manager.model._model is model
    allocators = manager.batch_processor.cache.cache_allocators
    assert {kind: (allocator.head_dim, allocator.layer_indices) for kind, allocator in allocators.items()} == {
        "full_attention": (24, [0, 1])
    }
    second = model.generate_batch([[1, 2, 3]], persistent_manager=True, **run)
    assert model._cached_continuous_batching_manager is manager
    model.destroy_cached_continuous_batching_manager()
    assert model.config._attn_implementation == "eager"
    assert [output.generated_tokens for output in (*first.values(), *second.values())] == [
        model.generate(torch.tensor([[1, 2, 3]]), **GREEDY)[0, 3:].tolist()
    ] * 2


def test_saved_config_gives_caches_each_layers_key_width(build, tmp_path):
    """A saved and reloaded config keeps the per-layer widths, and a static cache built from it alone (as
    transformers builds one) allocates each layer's keys at the layer's width and its values at 16."""
    model = build(GROWTHS["mixed"])
    model.config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is type(model.config)
    assert loaded.qk_head_dims == model.config.qk_head_dims == [24, 20]
    assert loaded.layer_types == ["grown_attention_qk24", "grown_attention_qk20"]
    cache = StaticCache(config=loaded, max_cache_len=16)
    cache.early_initialization(batch_size=1, num_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    assert [layer.keys.shape[-1] for layer in cache.layers] == [24, 20]
    assert [layer.values.shape[-1] for layer in cache.layers] == [16, 16]
    assert build(GROWTHS["plus0"]).config.layer_types == ["full_attention", "full_attention"]


@pytest.mark.parametrize("added", [[8, 8], [0, 0]], ids=["plus8", "plus0"])
def test_continuous_batching_of_a_grown_bert_decoder_is_refused(added):
    """Requests failed in the manager's thread with an AttributeError logged (a plain BertLMHeadModel's too), and
    generate_batch returned empty outputs."""
    with pytest.raises(NotImplementedError, match="cannot generate with continuous batching"):
        grown_bert_decoder(added).generate_batch([[1, 2, 3]], generation_config=GenerationConfig(**GREEDY))


def test_a_grown_models_cache_pickles_and_loads_in_a_fresh_process(static_build, tmp_path):
    """The cache layer classes of grown widths were made with type() and named in no module (`abc`): a cache, and
    any output holding one (torch.save(model(...))), could not be pickled."""
    import pickle
    import subprocess
    import sys

    model = static_build(GROWTHS["mixed"])
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    static = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=static, use_cache=True)
    for kept in (cache, static):
        loaded = pickle.loads(pickle.dumps(kept))
        assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in kept.layers]
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(loaded.layers, kept.layers))
    torch.save(static, tmp_path / "cache.pt")  # a width no grown model of the fresh process has made yet
    widths = [tuple(layer.keys.shape) for layer in static.layers]
    script = (f"import torch, hf_grow; cache = torch.load({str(tmp_path / 'cache.pt')!r}, weights_only=False); "
              "print([tuple(layer.keys.shape) for layer in cache.layers])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(widths)


def test_a_quantized_cache_runs_on_wider_keys(static_build, added):
    """`cache_implementation="quantized"` (fp8: the backend that needs no other package) was refused where a
    layer's keys are wider than its values: transformers' `QuantizedCache` read the grown config's layer types, one
    per key width (for static caches), as layers that are not full attention. The scores stay within fp8's
    rounding of the dynamic cache's, and greedy decoding picks the same tokens."""
    model, prompt = static_build(added), prompts()
    settings = SETTINGS | dict(return_dict_in_generate=True, output_scores=True)
    expected = model.generate(prompt, **settings)
    quantized = model.generate(prompt, cache_implementation="quantized", cache_config={"backend": "fp8"}, **settings)
    assert isinstance(quantized.past_key_values, QuantizedCache)
    assert all(isinstance(layer, Fp8QuantizedLayer) for layer in quantized.past_key_values.layers)
    assert torch.equal(quantized.sequences, expected.sequences)
    errors = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(quantized.scores[1:], expected.scores[1:])]
    assert 0 < max(errors) < 0.1, errors  # the steps after the prompt's read the rounded keys and values


def test_a_grown_config_ignores_a_sources_full_attention_layer_types(static_build, tmp_path):
    """README's Qwen2 recipe loads the source with `layer_types=["full_attention"] * layers`; the same call on the
    grown folder failed with "property 'layer_types' ... has no setter". The grown config derives the types from
    its widths: full attention is ignored, any other type refused saying so."""
    model = static_build([8, 4])
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, layer_types=["full_attention"] * 2).eval()
    assert loaded.config.layer_types == model.config.layer_types == ["grown_attention_qk24", "grown_attention_qk20"]
    ids = prompts()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match=r"full attention layers only, not layer_types \['sliding_attention'\]"):
        type(model.config)(**model.config.to_dict() | {"layer_types": ["sliding_attention"] * 2})
