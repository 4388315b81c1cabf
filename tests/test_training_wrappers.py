"""Growth in training with what a training script sets up around a model (PEFT adapters, torch.compile, several
optimizers, activation checkpointing), and what a baseline growth leaves of an earlier growth's report."""

import copy

import pytest
import torch
from transformers import GPT2LMHeadModel

from hf_grow import GrownGPT2Config, GrownGPT2LMHeadModel, grow_in_training, to_grown_model

from conftest import lm_batches, tiny_gpt2_config, train


@pytest.fixture
def model(stdlib_bytes) -> GrownGPT2LMHeadModel:
    torch.manual_seed(0)
    model = GrownGPT2LMHeadModel(GrownGPT2Config(**tiny_gpt2_config().to_dict() | {"qk_head_dims": [8, 8]}))
    train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), lm_batches(stdlib_bytes["train"], 20, seed=1))
    return model.eval()


def test_a_peft_model_grows_in_place_unless_its_adapters_are_on_query_key(model, stdlib_bytes):
    """A PeftModel was refused as "PeftModel cannot be grown", its base model with LoRA on Q/K with a bare
    KeyError: now LoRA elsewhere grows in place and trains on, LoRA on Q/K is refused with what to do."""
    from peft import LoraConfig, get_peft_model

    batch = lm_batches(stdlib_bytes["eval"], 1, seed=5)[0]
    on_qk = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    with pytest.raises(ValueError, match=r"layer 0's query/key parameters \['c_attn.weight', 'c_attn.bias'\] are "
                                         r"not where .*merge_and_unload"):
        grow_in_training(on_qk, None, None, 8, mode="zero")
    assert on_qk.get_base_model().config.qk_head_dims == [8, 8]

    on_mlp = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["c_fc"], fan_in_fan_out=True,
                                                     init_lora_weights=False))
    optimizer = torch.optim.AdamW([p for p in on_mlp.parameters() if p.requires_grad], lr=1e-3)
    train(on_mlp, optimizer, lm_batches(stdlib_bytes["train"], 2, seed=2))
    on_mlp.eval()
    with torch.no_grad():
        before = on_mlp(**batch).logits
    grow_in_training(on_mlp, optimizer, None, 8, mode="zero")
    assert on_mlp.get_base_model().config.qk_head_dims == [16, 16]
    with torch.no_grad():
        torch.testing.assert_close(on_mlp(**batch).logits, before, rtol=0, atol=1e-5)
    losses = train(on_mlp, optimizer, lm_batches(stdlib_bytes["train"], 2, seed=3))
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_compiled_model_grows_in_place(model, stdlib_bytes):
    """torch.compile's wrapper was refused as "OptimizedModule cannot be grown"; the model inside it grows, and the
    compiled module follows the new widths."""
    batch = lm_batches(stdlib_bytes["eval"], 1, seed=5)[0]
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        before = compiled(**batch).logits
    grow_in_training(compiled, None, None, 8, mode="zero")
    assert model.config.qk_head_dims == [16, 16]
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch).logits, before, rtol=0, atol=1e-5)


def test_a_baseline_growth_drops_the_report_of_an_earlier_growth(model, stdlib_bytes, tmp_path):
    """After a solved growth and a zero growth, the model and its saved growth_report.json described the first
    growth (Q/K 8 -> 16) while the config said 24."""
    batches = lm_batches(stdlib_bytes["stats"], 4, seed=2)
    assert grow_in_training(model, None, batches, 8, mode="append") is not None and model.growth_report is not None
    (tmp_path / "solved").mkdir()
    model.save_pretrained(tmp_path / "solved")
    assert (tmp_path / "solved" / "growth_report.json").exists()
    grow_in_training(model, None, None, 8, mode="zero")
    assert model.config.qk_head_dims == [24, 24] and model.growth_report is None
    model.save_pretrained(tmp_path / "zero")
    assert not (tmp_path / "zero" / "growth_report.json").exists()


def test_to_grown_model_keeps_activation_checkpointing(trained_gpt2, stdlib_bytes):
    """It was off on the converted model (the memory a training script counted on), and is kept layer by layer:
    which layers recompute, and the checkpoint function they call."""
    plain = copy.deepcopy(trained_gpt2).train()
    plain.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=2)
    calls = []

    def counted(run):
        def checkpoint(*args, **kwargs):
            calls.append(1)
            return run(*args, **kwargs)
        return checkpoint

    for layer in plain.transformer.h:
        layer._gradient_checkpointing_func = counted(layer._gradient_checkpointing_func)
    grown = to_grown_model(plain)
    assert [layer.gradient_checkpointing for layer in grown.transformer.h] == [True, False]
    batch = lm_batches(stdlib_bytes["eval"], 1, seed=12)[0]
    grown(**batch).loss.backward()
    plain(**batch).loss.backward()
    assert len(calls) == 2  # layer 0 of each model recomputed through the same function
    torch.testing.assert_close(grown.transformer.h[1].mlp.c_fc.weight.grad, plain.transformer.h[1].mlp.c_fc.weight.grad,
                               rtol=0, atol=1e-6)


def test_several_optimizers_each_have_their_state_remapped(model, stdlib_bytes):
    """Muon for the weight matrices beside AdamW for the rest (a common split): only one optimizer was taken, so
    the other's Q/K state stayed at the old width and its next step failed."""
    from hf_grow.adapters import get_adapter

    matrices = [p for name, p in model.named_parameters() if p.dim() == 2 and "wte" not in name and "wpe" not in name]
    others = [p for p in model.parameters() if all(p is not matrix for matrix in matrices)]
    muon, adamw = torch.optim.Muon(matrices, lr=1e-3), torch.optim.AdamW(others, lr=1e-3)
    model.train()
    for batch in lm_batches(stdlib_bytes["train"], 3, seed=2):
        model(**batch).loss.backward()
        muon.step(), adamw.step(), muon.zero_grad(), adamw.zero_grad()
    attention = model.transformer.h[0].attn

    def query_moments() -> dict[str, torch.Tensor]:
        """Layer 0's query entries of Muon's momentum of c_attn.weight and AdamW's exp_avg_sq of c_attn.bias."""
        weight, bias = attention.c_attn.weight, attention.c_attn.bias
        read = get_adapter(model).read_qk
        return {
            "momentum": read(attention, {"c_attn.weight": muon.state[weight]["momentum_buffer"],
                                         "c_attn.bias": torch.zeros_like(bias)})[0],
            "exp_avg_sq": read(attention, {"c_attn.weight": torch.zeros_like(weight),
                                           "c_attn.bias": adamw.state[bias]["exp_avg_sq"]})[0],
        }

    before = query_moments()
    grow_in_training(model, [muon, adamw], None, 8, mode="zero")
    after = query_moments()
    for key in before:  # the old dims' moments kept (the scale is kept: nothing folded), the new ones zero
        torch.testing.assert_close(after[key][..., :8], before[key], rtol=0, atol=0)
        assert not after[key][..., 8:].any()
    for optimizer in (muon, adamw):
        for parameter, state in optimizer.state.items():
            assert all(value.shape == parameter.shape for value in state.values() if value.dim() > 0)
    losses = train(model, _Both(muon, adamw), lm_batches(stdlib_bytes["train"], 2, seed=3))
    assert all(torch.isfinite(torch.tensor(losses)))
    with pytest.raises(ValueError, match="the AdamW holds none of the model's parameters"):
        grow_in_training(model, [muon, torch.optim.AdamW(copy.deepcopy(model).parameters())], None, 8, mode="zero")
    # an optimizer whose state no remap knows, on parameters that do not grow: nothing of it to remap (the check of
    # the state a first step creates refused it, also after steps)
    embeddings = [model.transformer.wte.weight, model.transformer.wpe.weight]
    rest = [p for p in model.parameters() if all(p is not embedding for embedding in embeddings)]
    adadelta, adamw = torch.optim.Adadelta(embeddings), torch.optim.AdamW(rest, lr=1e-3)
    grow_in_training(model, [adamw, adadelta], None, 8, mode="zero")
    train(model, _Both(adamw, adadelta), lm_batches(stdlib_bytes["train"], 1, seed=4))
    grow_in_training(model, [adamw, adadelta], None, 8, mode="zero")
    assert model.config.qk_head_dims == [32, 32]


class _Both:
    """Two optimizers stepped as one, for `train`."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def zero_grad(self):
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()


def test_lora_on_a_llama_query_is_refused_before_any_change():
    """peft's default targets for Llama (q_proj, v_proj) passed the check (the adapter listed only the Q/K
    parameters it found) and failed later with a bare KeyError, in a Trainer at the growth step."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = to_grown_model(LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        head_dim=16, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )))
    peft_model = get_peft_model(llama, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"layer 0's query/key parameters \['q_proj.weight'\] are not where .*"
                                         r"merge_and_unload"):
        grow_in_training(peft_model, None, None, 8, mode="zero")
    assert llama.config.qk_head_dims == [16, 16]


def test_a_grown_checkpoint_loaded_by_its_own_modeling_file_says_how_to_grow_in_place(tmp_path):
    """Loaded with trust_remote_code before hf_grow was imported, its class is the checkpoint file's: growing it in
    place was refused as "GrownGPT2LMHeadModel is not of a grown model type". The conversion it names keeps the
    attention scale its layers kept (`keep_attention_scale`, grow_in_training's default; it was dropped: the
    logits 5e-2 off)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    torch.manual_seed(0)
    settings = {"qk_head_dims": [8, 8], "attention_scale_dims": [16, 4]}
    model = GrownGPT2LMHeadModel(GrownGPT2Config(**tiny_gpt2_config().to_dict() | settings)).eval()
    model.save_pretrained(tmp_path)
    remote_class = get_class_from_dynamic_module("modeling_grown_gpt2.GrownGPT2LMHeadModel", str(tmp_path))
    remote = remote_class.from_pretrained(tmp_path)
    assert type(remote).__module__.startswith("transformers_modules")
    with pytest.raises(ValueError, match=r"was loaded from its checkpoint's own modeling file .* import hf_grow before "
                                         r"from_pretrained .* hf_grow.to_grown_model\(model\)"):
        grow_in_training(remote, torch.optim.AdamW(remote.parameters()), None, 8, mode="zero")
    converted = to_grown_model(remote)  # the way out it names
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, remote(ids).logits)
    assert converted.config.attention_scale_dims == [16, 4]
    grow_in_training(converted, torch.optim.AdamW(converted.parameters()), None, 8, mode="zero")
    assert converted.config.qk_head_dims == [16, 16]


def test_wrapped_models_are_taken_or_refused_before_any_data(trained_gpt2, stdlib_bytes):
    """inspect_growth refused a compiled model that grow_model takes; to_grown_model said a PeftModel "cannot be
    grown"; adapters injected without a PeftModel (transformers' add_adapter) failed after the statistics pass; a
    config with return_dict=False was told to put labels in batches that held them."""
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model
    from transformers import BertConfig, BertForMaskedLM

    from hf_grow import grow_model, inspect_growth

    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4)
    compiled = torch.compile(copy.deepcopy(trained_gpt2))
    gains = [layer.marginal_gains for layer in inspect_growth(compiled, batches, max_dims=4).layers]
    assert gains == [layer.marginal_gains for layer in inspect_growth(trained_gpt2, batches, max_dims=4).layers]
    from hf_grow import collect_statistics, get_adapter

    with pytest.raises(ValueError, match=r"a compiled model: pass the model it compiles \(model._orig_mod\)"):
        collect_statistics(compiled, batches, get_adapter(compiled))  # it said "OptimizedModule cannot be grown"

    def never_read():
        raise AssertionError("data read before the model was checked")
        yield

    lora = LoraConfig(r=4, target_modules=["c_fc"], init_lora_weights=False)
    with pytest.raises(ValueError, match="convert the base model before adding the PEFT adapters"):
        to_grown_model(get_peft_model(copy.deepcopy(trained_gpt2), lora))
    injected = inject_adapter_in_model(lora, copy.deepcopy(trained_gpt2))
    for grow in (lambda: grow_model(injected, never_read(), p=8), lambda: to_grown_model(injected),
                 lambda: inspect_growth(injected, never_read())):
        with pytest.raises(ValueError, match="holds PEFT adapter layers .* without a PeftModel around it"):
            grow()

    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, return_dict=False))
    ids = torch.randint(5, 256, (2, 4, 16))
    with pytest.raises(ValueError, match=r"config has return_dict=False; set model.config.return_dict = True"):
        grow_model(bert, [{"input_ids": batch, "labels": batch} for batch in ids], p=8, step_size=0.0)


def test_a_peft_model_with_disabled_adapters_and_a_saved_module_grows_its_base_function():
    """`modules_to_save` keeps a trained copy of a module beside the original; peft's unload() kept the copy, so a
    model grown inside `disable_adapter()` computed neither the disabled nor the enabled function (5.9 off)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_grow import grow_model

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      tie_word_embeddings=False)).eval()
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"], modules_to_save=["lm_head"],
                                                 fan_in_fan_out=True))
    with torch.no_grad():  # trained: the adapter and the head's copy moved
        for parameter in peft_model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.3 * torch.randn_like(parameter))
    ids = torch.randint(0, 64, (2, 16))
    with peft_model.disable_adapter(), torch.no_grad():
        disabled = peft_model(input_ids=ids).logits
        grown = grow_model(peft_model, [{"input_ids": ids, "labels": ids}], p=8, step_size=0.0)
        torch.testing.assert_close(grown(input_ids=ids).logits, disabled, rtol=1e-5, atol=1e-5)
    assert peft_model(input_ids=ids).logits.sub(disabled).abs().max() > 1  # enabled again, the copy in use


def test_offloaded_weights_are_refused_before_any_data_by_inspect_and_to_grown_model(trained_gpt2):
    """inspect_growth ran the whole statistics pass, then failed copying a meta tensor; to_grown_model gave a raw
    state-dict error (grow_model refused at once)."""
    from hf_grow import inspect_growth

    offloaded = copy.deepcopy(trained_gpt2)
    layer_norm = offloaded.transformer.h[1].ln_1
    layer_norm.weight = torch.nn.Parameter(torch.empty_like(layer_norm.weight, device="meta"))

    def never_read():
        raise AssertionError("data read before the model was checked")
        yield

    for call in (lambda: inspect_growth(offloaded, never_read()), lambda: to_grown_model(offloaded)):
        with pytest.raises(ValueError, match="on the meta device .* cannot be grown"):
            call()


def test_a_peft_model_is_evaluated_as_it_is_and_refused_by_the_statistics_with_what_to_pass(trained_gpt2,
                                                                                              stdlib_bytes):
    """evaluate_loss said "PeftModel cannot be grown" (it grows nothing); collect_statistics raised an AttributeError
    from inside the adapter."""
    from peft import LoraConfig, get_peft_model

    from hf_grow import collect_statistics, evaluate_loss, get_adapter

    peft_model = get_peft_model(copy.deepcopy(trained_gpt2), LoraConfig(r=4, target_modules=["c_fc"],
                                                                         init_lora_weights=False)).eval()
    batches = lm_batches(stdlib_bytes["eval"], 2, batch_size=4)
    with torch.no_grad():
        expected = sum(float(peft_model(**batch).loss) for batch in batches) / len(batches)
    assert evaluate_loss(peft_model, batches)[0] == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="wraps PEFT adapters: pass the transformers model that is grown"):
        get_adapter(peft_model)
    with pytest.raises(ValueError, match="wraps PEFT adapters: collect the statistics of the model that is grown"):
        collect_statistics(peft_model, batches, get_adapter(peft_model.get_base_model()))


def test_the_grown_base_of_any_peft_wrapping_is_saved(model, tmp_path):
    """save_grown_base learned the names from a rebuilt model (refused a model built with other arguments) and knew
    LoRA's and modules_to_save's wrappers alone (refused trainable tokens, suggesting an in-place merge)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_grow import save_grown_base

    lora = LoraConfig(r=4, target_modules=["c_fc"], fan_in_fan_out=True, trainable_token_indices={"wte": [1, 2]},
                      init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(model), lora)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if parameter.requires_grad:  # as after training: the adapter and the tokens' deltas moved
                parameter.add_(0.1)
    save_grown_base(peft_model, tmp_path / "base")
    ids = torch.arange(1, 17)[None]
    with torch.no_grad(), peft_model.disable_adapter():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "base")(input_ids=ids).logits,
                                   peft_model(input_ids=ids).logits, rtol=0, atol=0)
    # merge_adapter() (fast evaluation during training) adds the delta into the base layers: saved as the base,
    # resuming applied the adapter twice
    merged = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["c_fc"], fan_in_fan_out=True,
                                                             init_lora_weights=False))
    merged.merge_adapter()
    with pytest.raises(ValueError, match=r"merged into 2 layers .*: call peft_model.unmerge_adapter\(\) first"):
        save_grown_base(merged, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("architecture", ["gpt2", "llama", "bert"])
def test_every_growth_records_the_hf_grow_version(architecture):
    """The grown config names the version that grew it: Llama's adapter builds its own config and recorded none, and
    growth in training kept the version of an earlier growth."""
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    import hf_grow

    plain = {"gpt2": lambda: GPT2LMHeadModel(tiny_gpt2_config()),
             "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                           num_hidden_layers=2, num_attention_heads=4)),
             "bert": lambda: BertForMaskedLM(BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=4, intermediate_size=128))}[architecture]()
    grown = to_grown_model(plain)
    assert grown.config.hf_grow_version == grown.config.to_dict()["hf_grow_version"] == hf_grow.__version__
    grown.config.hf_grow_version = "0.0.1"  # grown by an earlier version
    with pytest.raises(ValueError):  # a growth refused changes nothing, the version neither
        hf_grow.resize_qk_(grown, {0: (torch.zeros(4, 65, 4), torch.zeros(4, 65, 4))}, keep_moments=False)
    assert grown.config.hf_grow_version == "0.0.1"
    grow_in_training(grown, None, None, 8, mode="zero")
    assert grown.config.hf_grow_version == hf_grow.__version__
