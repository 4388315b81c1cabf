"""The grown model holds each of the source's tensors as the source holds it: in its own dtype (a bfloat16 model
loaded by `from_pretrained` keeps its rotary frequencies in float32; training recipes keep norms in float32), and
with the rotary module's state beside its buffers (dynamic rope rescales its frequencies for long inputs)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_grow import grow_model, to_grown_model


def tiny_llama(**options) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1, **options,
    )).eval()


def test_a_bfloat16_rotary_model_keeps_its_float32_frequencies(tmp_path):
    """`from_pretrained(dtype=torch.bfloat16)` keeps ``inv_freq`` in float32; the grown model had it rounded to
    bfloat16, which moves the rotary angle by position x rounding (3.4 rad at position 8192): 0.156 off the source
    at positions 256-1024, three times bfloat16's own error, in the model the report's losses were measured on."""
    tiny_llama(max_position_embeddings=2048).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # as transformers loads it
    same = to_grown_model(model)  # the same widths: the same function, exactly
    ids = torch.randint(3, 128, (1, 1024))
    with torch.no_grad():
        assert torch.equal(same(ids).logits, model(ids).logits)
    grown = grow_model(model, [{"input_ids": ids[:, :64], "labels": ids[:, :64]}] * 2, p=8, step_size=0.0)
    for rotary in (same.model.rotary_emb, grown.model.rotary_emb):
        assert rotary.inv_freq.dtype == rotary.original_inv_freq.dtype == torch.float32
        assert torch.equal(rotary.inv_freq, model.model.rotary_emb.inv_freq)


def test_a_bfloat16_model_with_float32_norms_keeps_them():
    """Every tensor was cast to the first parameter's dtype: float32 norms in a bfloat16 body became bfloat16."""
    torch.manual_seed(0)
    for model in (tiny_llama(), GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4)).eval()):
        model.to(torch.bfloat16)
        for name, parameter in model.named_parameters():
            if "norm" in name or "ln_" in name:
                parameter.data = parameter.data.float() + 0.01 * torch.randn_like(parameter.data.float())
        ids = torch.randint(3, 128, (2, 24))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # how such a model runs
            grown = grow_model(model, [{"input_ids": ids, "labels": ids}] * 2, p=8, step_size=0.0)
        dtypes = {name: parameter.dtype for name, parameter in model.named_parameters()}
        assert {name: parameter.dtype for name, parameter in grown.named_parameters()} == dtypes
        assert {name: buffer.dtype for name, buffer in grown.named_buffers()} == {
            name: buffer.dtype for name, buffer in model.named_buffers()}
        assert torch.float32 in dtypes.values() and torch.bfloat16 in dtypes.values()
        same = to_grown_model(model)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(same(ids).logits, model(ids).logits)


def test_dynamic_rope_frequencies_reset_for_short_inputs_as_the_source_does():
    """The statistics' long batches rescale a dynamic rope's frequencies; the grown model copied them but not the
    length they were set for, so it never reset them for short inputs: 0.30 off the source (logits of ~3)."""
    model = tiny_llama(max_position_embeddings=16,
                       rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    long, short = torch.randint(3, 128, (4, 40)), torch.randint(3, 128, (2, 12))
    grown = grow_model(model, [{"input_ids": long, "labels": long}] * 3, p=8, step_size=0.0)
    with torch.no_grad():
        for ids in (short, long, short):
            torch.testing.assert_close(grown(ids).logits, model(ids).logits, rtol=0, atol=2e-5)


def test_a_head_untied_by_hand_keeps_its_own_weights(tmp_path):
    """A head given its own Parameter, the config still saying tie_word_embeddings=True (transformers' save and load
    keep it): the grown model tied it back to the embeddings, 1.4-1.8 off the source at step 0."""
    for model in (GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)).eval(),
                  tiny_llama(tie_word_embeddings=True)):
        head = model.get_output_embeddings()
        embeddings = model.get_input_embeddings().weight.detach()
        head.weight = torch.nn.Parameter(embeddings + 0.5 * torch.randn_like(embeddings))
        ids = torch.randint(0, 64, (2, 16))
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        for grown in (grow_model(model, [{"input_ids": ids, "labels": ids}], p=8, step_size=0.0),
                      to_grown_model(model)):
            with torch.no_grad():
                torch.testing.assert_close(grown(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
            assert grown.get_output_embeddings().weight is not grown.get_input_embeddings().weight
            grown.save_pretrained(tmp_path / "grown")
            reloaded = type(grown).from_pretrained(tmp_path / "grown")
            with torch.no_grad():
                torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
