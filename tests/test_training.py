"""Growth during training: the model and optimizer carry on, the loss does not jump, Trainer checkpoints resume."""

import copy
import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    Trainer,
    TrainerState,
)

from hf_grow import (
    GrowthCallback,
    GrowthConfig,
    GrownBertConfig,
    GrownBertForMaskedLM,
    GrownGPT2Config,
    GrownGPT2LMHeadModel,
    evaluate_loss,
    grow_in_training,
    load_growth_report,
    to_grown_model,
)

from conftest import lm_batches, tiny_gpt2_config, train, trainer_arguments, trainer_dataset


def grown_config(qk: int = 8) -> GrownGPT2Config:
    return GrownGPT2Config(**tiny_gpt2_config().to_dict() | {"qk_head_dims": [qk, qk]})


@pytest.fixture(scope="module")
def trained(stdlib_bytes):
    """A grown-type GPT-2 with d_k = 8 trained 40 AdamW steps, with its optimizer (copy before use)."""
    torch.manual_seed(0)
    model = GrownGPT2LMHeadModel(grown_config(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(model, optimizer, lm_batches(stdlib_bytes["train"], 40, seed=1))
    return model, optimizer


def copied(trained):
    """Independent copies of the model and its optimizer (the optimizer bound to the copied Parameters)."""
    model, optimizer = copy.deepcopy(trained)
    return model, optimizer


def c_attn_state(model, optimizer) -> dict[str, torch.Tensor]:
    """The optimizer state and weights of layer 0's fused projection, cloned."""
    weight = model.transformer.h[0].attn.c_attn.weight
    state = optimizer.state[weight]
    return {"weight": weight.detach().clone(), **{k: v.clone() for k, v in state.items()}}


@pytest.mark.parametrize("keep_attention_scale", [True, False], ids=["scale-kept", "scale-folded"])
@pytest.mark.parametrize("mode", ["refactor", "append", "zero"])
def test_growth_keeps_the_function_parameters_and_moments(trained, stdlib_bytes, mode, keep_attention_scale):
    model, optimizer = copied(trained)
    batch = lm_batches(stdlib_bytes["eval"], 1, seed=5)[0]
    model.eval()
    with torch.no_grad():
        loss_before = float(model(**batch).loss)
    parameters_before = [id(p) for p in model.parameters()]
    before = c_attn_state(model, optimizer)
    step_before = float(optimizer.state[model.transformer.h[0].attn.c_attn.weight]["step"])

    stats = lm_batches(stdlib_bytes["stats"], 3, seed=6)
    model.train()
    live_graph = model(**batch).loss  # a user's loop often keeps the last loss, and so its graph, alive
    live_graph.backward()
    report = grow_in_training(
        model, optimizer, stats, 8, mode=mode, step_size=0.0, new_moments="zero",
        keep_attention_scale=keep_attention_scale,
    )
    assert (report is None) == (mode == "zero")

    # Same Parameter objects (the optimizer's param_groups stay valid), new widths everywhere.
    assert [id(p) for p in model.parameters()] == parameters_before
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == parameters_before
    assert model.config.qk_head_dims == [16, 16]
    assert model.transformer.h[0].attn.qk_head_dim == 16
    for parameter in model.parameters():
        for key, value in optimizer.state[parameter].items():
            if value.dim() > 0:
                assert value.shape == parameter.shape, key
    # At step 0 the grown model computes the old function (the zero baseline has zero new keys).
    model.eval()
    with torch.no_grad():
        assert float(model(**batch).loss) == pytest.approx(loss_before, abs=2e-6)

    after = c_attn_state(model, optimizer)
    qk_old, qk_new = 4 * 8, 4 * 16
    assert float(optimizer.state[model.transformer.h[0].attn.c_attn.weight]["step"]) == step_before
    for key in ("exp_avg", "exp_avg_sq"):
        # Values' moments are kept bit for bit in every mode.
        assert torch.equal(after[key][:, 2 * qk_new :], before[key][:, 2 * qk_old :])
        new_query = after[key][:, :qk_new].reshape(64, 4, 16)
        new_key = after[key][:, qk_new : 2 * qk_new].reshape(64, 4, 16)
        old_query = before[key][:, :qk_old].reshape(64, 4, 8)
        old_key = before[key][:, qk_old : 2 * qk_old].reshape(64, 4, 8)
        if mode == "refactor":
            assert not new_query.any() and not new_key.any()
            continue
        degree = 1 if key == "exp_avg" else 2
        fold = 1.0 if keep_attention_scale else math.sqrt(16 / 8)  # 1/sqrt(8) -> 1/sqrt(16) folded into queries
        assert torch.equal(new_key[..., :8], old_key)
        torch.testing.assert_close(new_query[..., :8], old_query * fold**-degree, rtol=1e-6, atol=0)
        assert not new_query[..., 8:].any() and not new_key[..., 8:].any()
    # Gradients were cleared, and the next step trains at the new shapes (with the old graph still alive).
    assert all(p.grad is None for p in model.transformer.h[0].attn.c_attn.parameters())
    assert math.isfinite(train(model, optimizer, [batch])[0]) and live_graph.grad_fn is not None


def test_training_continues_after_growth_and_the_loss_keeps_decreasing(trained, stdlib_bytes):
    held_out = lm_batches(stdlib_bytes["eval"], 4, seed=7)
    results = {}
    for mode in ("append", "refactor"):
        model, optimizer = copied(trained)
        stats, search = lm_batches(stdlib_bytes["stats"], 6, seed=8), lm_batches(stdlib_bytes["eval"], 3, seed=9)
        at_growth = evaluate_loss(model, held_out)[0]
        report = grow_in_training(model, optimizer, stats, 8, mode=mode, eval_dataloader=search)
        assert report.mode == mode and report.qk_dims_after == [16, 16]
        assert report.eval_loss_after <= report.eval_loss_before
        assert report.eval_loss_before == pytest.approx(evaluate_loss(trained[0], search)[0], abs=1e-5)
        losses = train(model, optimizer, lm_batches(stdlib_bytes["train"], 30, seed=10))
        assert all(math.isfinite(loss) for loss in losses)
        results[mode] = evaluate_loss(model, held_out)[0]
        assert results[mode] < at_growth - 0.05
    # The same 30 steps without growth, for scale: growth must not cost training progress.
    model, optimizer = copied(trained)
    train(model, optimizer, lm_batches(stdlib_bytes["train"], 30, seed=10))
    baseline = evaluate_loss(model, held_out)[0]
    assert min(results.values()) < baseline + 0.05


def test_growth_with_trainer_callback_and_resume(stdlib_bytes, tmp_path):
    torch.manual_seed(0)
    dataset = trainer_dataset(stdlib_bytes, 64, seed=11)

    callback = GrowthCallback({3: 8}, mode="append", statistics_batches=3, eval_batches=2)
    trainer = Trainer(model=GrownGPT2LMHeadModel(grown_config(8)), args=trainer_arguments(tmp_path),
                      train_dataset=dataset, callbacks=[callback])
    trainer.train()
    model = trainer.model
    assert model.config.qk_head_dims == [16, 16]
    report = callback.reports[3]
    assert report is not None and report.eval_loss_after <= report.eval_loss_before
    assert [entry for entry in trainer.state.log_history if "growth_mode" in entry][0]["step"] == 3
    optimizer = trainer.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the torch optimizer
    for parameter in model.parameters():
        state = optimizer.state[parameter]
        assert state["exp_avg"].shape == parameter.shape and float(state["step"]) == 6
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)

    # The checkpoint after growth carries the new widths; a model built from it resumes with Trainer.
    checkpoint = tmp_path / "checkpoint-4"
    resumed_model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert isinstance(resumed_model, GrownGPT2LMHeadModel) and resumed_model.config.qk_head_dims == [16, 16]
    resumed_callback = GrowthCallback({3: 8}, mode="append", statistics_batches=3, eval_batches=2)
    resumed = Trainer(model=resumed_model, args=trainer_arguments(tmp_path), train_dataset=dataset,
                      callbacks=[resumed_callback])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6 and resumed_callback.reports == {}
    assert resumed_model.config.qk_head_dims == [16, 16]
    resumed_optimizer = resumed.optimizer.optimizer
    for parameter in resumed_model.parameters():
        assert resumed_optimizer.state[parameter]["exp_avg"].shape == parameter.shape


def test_qk_dims_schedule_grows_to_the_total_width(trained, stdlib_bytes):
    model, optimizer = copied(trained)
    callback = GrowthCallback(qk_dims_at={2: [16, 8]}, mode="zero")
    args = type("Args", (), {"per_device_train_batch_size": 4})()
    state = type("State", (), {"global_step": 2, "log_history": []})()
    callback.on_step_end(args, state, None, model=model, optimizer=optimizer, train_dataloader=None)
    assert model.config.qk_head_dims == [16, 8] and callback.reports == {2: None}


def test_to_grown_model_computes_the_same_function(trained_gpt2, stdlib_bytes):
    grown = to_grown_model(trained_gpt2)
    assert isinstance(grown, GrownGPT2LMHeadModel) and to_grown_model(grown) is grown
    batch = lm_batches(stdlib_bytes["eval"], 1, seed=12)[0]
    with torch.no_grad():
        torch.testing.assert_close(grown(**batch).logits, trained_gpt2(**batch).logits, rtol=0, atol=0)
    # what the model was set up with stays: a frozen embedding stays frozen, generation settings stay
    plain = copy.deepcopy(trained_gpt2)
    plain.transformer.wpe.weight.requires_grad_(False)
    plain.generation_config.max_new_tokens = 7
    converted = to_grown_model(plain)
    frozen = [name for name, parameter in converted.named_parameters() if not parameter.requires_grad]
    assert frozen == ["transformer.wpe.weight"] and converted.generation_config.max_new_tokens == 7


def test_bert_grows_in_place(stdlib_bytes):
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
    )
    model = GrownBertForMaskedLM(GrownBertConfig(**config.to_dict() | {"qk_head_dims": [4, 4]}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = lm_batches(stdlib_bytes["train"], 4, batch_size=4, seed=13)
    for batch in batches:  # a masked-LM style loss: predict the inputs (enough to exercise the path)
        batch["labels"] = torch.where(torch.rand(batch["labels"].shape) < 0.3, batch["labels"], -100)
    train(model, optimizer, batches[:2])
    before = evaluate_loss(model, batches[2:])[0]
    grow_in_training(model, optimizer, batches[:2], 4, mode="append", step_size=0.0)
    assert model.config.qk_head_dims == [8, 8]
    assert evaluate_loss(model, batches[2:])[0] == pytest.approx(before, abs=2e-6)
    query = model.bert.encoder.layer[0].attention.self.query
    assert query.weight.shape == optimizer.state[query.weight]["exp_avg"].shape == (32, 32)
    train(model, optimizer, batches[:2])


def test_clear_errors(trained_gpt2, trained):
    optimizer = torch.optim.AdamW(trained_gpt2.parameters())
    with pytest.raises(ValueError, match="to_grown_model"):
        grow_in_training(trained_gpt2, optimizer, None, 8, mode="zero")
    model, _ = copied(trained)
    class Traced(torch.optim.SGD):  # a state entry hf_grow does not know the degree of
        def step(self, closure=None):
            super().step(closure)
            for parameter in self.param_groups[0]["params"]:
                self.state[parameter]["trace"] = torch.zeros_like(parameter)

    traced = Traced(model.parameters(), lr=1e-3)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    traced.step()
    with pytest.raises(ValueError, match=r"cannot remap the Traced state \['trace'\]"):
        grow_in_training(model, traced, None, 8, mode="zero")
    assert model.config.qk_head_dims == [8, 8]  # refused before any change
    stray = torch.optim.AdamW(copied(trained)[0].parameters())  # made before a conversion, say: another model's
    with pytest.raises(ValueError, match="holds none of the model's parameters"):
        grow_in_training(model, stray, None, 8, mode="zero")
    assert model.config.qk_head_dims == [8, 8]
    with pytest.raises(ValueError, match="mode must be one of"):
        grow_in_training(model, None, None, 8, mode="widest")
    with pytest.raises(ValueError, match="exactly one of"):
        GrowthCallback({10: 8}, qk_dims_at={10: 16})
    with pytest.raises(ValueError, match="positive global steps"):
        GrowthCallback({0: 8})
    # growth options refused when the callback is made, not at the growth step in the middle of training
    with pytest.raises(ValueError, match="pass mode='refactor' with it"):
        GrowthCallback({10: 8}, search="fast")
    with pytest.raises(ValueError, match="pass mode='refactor' with it"):
        GrowthCallback({10: 8}, config=GrowthConfig(search="fast"), mode="append")
    GrowthCallback({10: 8}, search="fast", mode="refactor")
    with pytest.raises(ValueError, match="step_size must be a finite number"):
        GrowthCallback({10: 8}, step_size=float("nan"))
    with pytest.raises(TypeError, match=r"unknown growth option\(s\) \['stepsize'\]"):
        GrowthCallback({10: 8}, stepsize=0.1)
    GrowthCallback({10: 8}, loss_fn=lambda model, batch: model(**batch).loss, init_std=0.01, rtol=1e-3)
    with pytest.raises(ValueError, match="rotate_factors rewrites refactored Q/K factors: pass mode='refactor'"):
        GrowthCallback({10: 8}, rotate_factors=True)  # the default mode appends
    GrowthCallback({10: 8}, rotate_factors=True, mode="refactor")


def test_a_schedule_with_bad_sizes_or_layers_is_refused_before_training(trained, tmp_path):
    """grow_at's sizes were checked only at the growth step, in the middle of training, and the layers of both
    schedules too: now the sizes when the callback is made, the layers when training begins."""
    with pytest.raises(ValueError, match=r"grow_at\[10\]: p must be a positive"):
        GrowthCallback({10: 0})
    with pytest.raises(ValueError, match=r"grow_at\[10\]: p must map layers to non-negative ints"):
        GrowthCallback({10: {0: -1}})
    with pytest.raises(TypeError, match=r"grow_at\[10\]: p must be an int"):
        GrowthCallback({10: "x"})
    model, optimizer = copied(trained)
    args, state = trainer_arguments(tmp_path), TrainerState(max_steps=20)
    for callback, message in ((GrowthCallback({10: {5: 8}}), r"grow_at\[10\]: p names layers \[5\]"),
                              (GrowthCallback(qk_dims_at={10: [16, 16, 16]}), r"qk_dims_at\[10\] has 3 widths")):
        with pytest.raises(ValueError, match=message):
            callback.on_train_begin(args, state, None, model=model, optimizer=optimizer)
    GrowthCallback({10: {1: 8}}).on_train_begin(args, state, None, model=model, optimizer=optimizer)


def test_append_mode_with_the_subspace_solver_matches_eigh(trained, stdlib_bytes):
    """The "append" update (a rank-p truncation of -P, decomposed once and rescaled) by subspace iteration."""
    stats, search = lm_batches(stdlib_bytes["stats"], 3, seed=8), lm_batches(stdlib_bytes["eval"], 2, seed=9)
    reports = {}
    for solver in ("eigh", "subspace"):
        model, optimizer = copied(trained)
        reports[solver] = grow_in_training(
            model, optimizer, stats, 8, mode="append", eval_dataloader=search, solver=solver
        )
    eigh, subspace = reports["eigh"], reports["subspace"]
    assert (eigh.solver, subspace.solver) == ("eigh", "subspace")
    assert subspace.step_size == eigh.step_size > 0
    assert subspace.eval_loss_after == pytest.approx(eigh.eval_loss_after, abs=1e-6)
    for a, b in zip(subspace.layers, eigh.layers):
        for head_a, head_b in zip(a.heads, b.heads):
            assert head_a.marginal_gains == pytest.approx(head_b.marginal_gains, rel=1e-6)


def qk_state(model, optimizer, key: str, qk: int, role: int) -> torch.Tensor:
    """Layer 0's optimizer ``key`` state of the queries (role 0) or keys (role 1), as (heads, d + 1, qk)."""
    attention = model.transformer.h[0].attn.c_attn
    columns = slice(role * 4 * qk, (role + 1) * 4 * qk)
    weight = optimizer.state[attention.weight][key][:, columns]
    bias = optimizer.state[attention.bias][key][columns]
    return torch.cat([weight, bias[None]]).reshape(65, 4, qk).transpose(0, 1)


@pytest.mark.parametrize("mode", ["append", "zero", "refactor"])
def test_head_mean_moments_start_new_entries_at_their_head_s_second_moment(trained, stdlib_bytes, mode):
    """new_moments="head_mean": the new entries' exp_avg_sq is the mean of the old entries' of the same head and
    role (in the units of the new weights), exp_avg 0, old entries untouched; the function at step 0 is the old
    one, and the first step after growth moves the new entries less than zero moments do (those take ~3 lr)."""
    batch = lm_batches(stdlib_bytes["eval"], 1, seed=5)[0]
    stats = lm_batches(stdlib_bytes["stats"], 3, seed=6)
    model, optimizer = copied(trained)
    old = {role: qk_state(model, optimizer, "exp_avg_sq", 8, role) for role in (0, 1)}
    model.eval()
    with torch.no_grad():
        loss_before = float(model(**batch).loss)
    moved = {}
    for new_moments in ("zero", "head_mean"):
        model, optimizer = copied(trained)
        # The scale folded into the queries (not the default): their moments then change units as well.
        grow_in_training(
            model, optimizer, stats, 8, mode=mode, step_size=0.0, new_moments=new_moments, keep_attention_scale=False
        )
        model.eval()
        with torch.no_grad():
            assert float(model(**batch).loss) == pytest.approx(loss_before, abs=2e-6)
        start = 0 if mode == "refactor" else 8
        for role, scale in ((0, 2.0), (1, 1.0)):  # the queries' second moments follow the fold sqrt(16 / 8)
            squares = qk_state(model, optimizer, "exp_avg_sq", 16, role)
            assert not qk_state(model, optimizer, "exp_avg", 16, role)[..., start:].any()
            if mode != "refactor":
                torch.testing.assert_close(squares[..., :8], old[role] / scale, rtol=1e-6, atol=0)
            if new_moments == "zero":
                assert not squares[..., start:].any()
            else:
                expected = (old[role] / (1.0 if mode == "refactor" else scale)).mean(dim=(1, 2))
                # tolerances of their own: these moments are ~1e-8, below assert_close's default atol (1e-5)
                torch.testing.assert_close(squares[..., start:], expected[:, None, None].expand(4, 65, 16 - start),
                                           rtol=1e-5, atol=0)
                assert (expected > 0).all()
        weight_before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
        train(model, optimizer, [batch])
        step = (model.transformer.h[0].attn.c_attn.weight.detach() - weight_before)[:, : 2 * 4 * 16]
        moved[new_moments] = step.reshape(64, 2, 4, 16)[..., start:].abs()
    if mode == "append":
        return  # at step 0 the new query and key dims are both zero: no gradient reaches them yet
    lr = optimizer.param_groups[0]["lr"]
    assert float(moved["head_mean"].max()) <= 3.2 * lr  # bounded
    assert float(moved["head_mean"].mean()) < 0.5 * float(moved["zero"].mean())


@pytest.mark.parametrize("mode", ["zero", "random"])
def test_baseline_dims_follow_the_model_s_device(mode):
    """The baselines draw their new dims on the host (the same dims from a seed on every device) and move them to
    the model's device: on a GPU, `GrowthCallback(mode="zero")` failed in torch.cat (2026-11-27, H100). The meta
    device stands in for a GPU here: any device but the host's fails the same way."""
    from hf_grow.adapters import get_adapter
    from hf_grow.training.grow import _initialized_weights

    model = GrownGPT2LMHeadModel(grown_config(8)).to("meta")
    weights = _initialized_weights(model, get_adapter(model), [8, 8], mode, 0.02, 0, keep_attention_scale=False)
    assert {tensor.device.type for pair in weights.values() for tensor in pair} == {"meta"}
    assert [tuple(query.shape) for query, _ in weights.values()] == [(4, 65, 16)] * 2


def test_each_growth_of_a_schedule_draws_its_own_batches(monkeypatch, stdlib_bytes):
    """GrowthCallback draws the statistics and held-out batches of each growth from the training set in an order
    of its own (seed + step): two growths of one schedule see different samples, not the same ones twice."""
    from torch.utils.data import DataLoader

    from hf_grow.training import callback as callback_module

    drawn = {}

    def record(model, optimizer, batches, added, **kwargs):
        drawn[len(drawn)] = torch.cat([batch["input_ids"] for batch in batches])

    monkeypatch.setattr(callback_module, "grow_in_training", record)
    monkeypatch.setattr(callback_module, "resolved_mode", lambda model, mode: "refactor")
    rows = [{"input_ids": batch["input_ids"][0]} for batch in lm_batches(stdlib_bytes["train"], 64, batch_size=1)]
    loader = DataLoader(rows, batch_size=4)
    callback = GrowthCallback(grow_at={2: 8, 4: 8}, statistics_batches=2, eval_batches=1)
    args = type("Args", (), {"per_device_train_batch_size": 4, "world_size": 1, "process_index": 0})()
    model = GrownGPT2LMHeadModel(GrownGPT2Config(**tiny_gpt2_config().to_dict() | {"qk_head_dims": [8, 8]}))
    for step in (2, 4):
        state = type("State", (), {"global_step": step, "log_history": []})()
        callback.on_step_end(args, state, None, model=model, optimizer=None, train_dataloader=loader)
    assert len(drawn) == 2 and not torch.equal(drawn[0], drawn[1])


def test_an_interrupted_resize_leaves_a_config_that_matches_its_layers(trained_gpt2, stdlib_bytes, tmp_path,
                                                                      monkeypatch):
    """Interrupted between layers (Ctrl-C in a long resize with optimizer state), the config records the widths of
    the layers done: the model saves and reloads (the config kept every old width, and the checkpoint failed to load
    with a size mismatch)."""
    from hf_grow import get_adapter, resize_qk_

    model = to_grown_model(copy.deepcopy(trained_gpt2))
    adapter = get_adapter(model)
    weights = {layer: tuple(torch.nn.functional.pad(weight, (0, 4)) for weight in adapter.read_qk(attention))
               for layer, attention in enumerate(adapter.attention_modules(model))}
    scaling = type(adapter).scaling

    def interrupted_at_layer_1(self, config, layer, dims):
        if layer == 1:
            raise KeyboardInterrupt
        return scaling(self, config, layer, dims)

    monkeypatch.setattr(type(adapter), "scaling", interrupted_at_layer_1)
    with pytest.raises(KeyboardInterrupt):
        resize_qk_(model, weights, keep_moments=False)
    monkeypatch.undo()
    assert model.config.qk_head_dims == [20, 16]
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    batch = lm_batches(stdlib_bytes["eval"], 1, seed=13)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)


def test_a_resize_failing_inside_a_layer_leaves_the_layer_as_it_was(trained_gpt2, stdlib_bytes, monkeypatch):
    """Out of memory (or an interruption) between a layer's parameters left some resized and the config at the old
    width: the model neither ran nor reloaded. The layer's changes are undone."""
    from hf_grow import get_adapter, resize_qk_
    from hf_grow.training import resize

    model = to_grown_model(copy.deepcopy(trained_gpt2))
    adapter = get_adapter(model)
    weights = {0: tuple(torch.nn.functional.pad(weight, (0, 4))
                        for weight in adapter.read_qk(adapter.attention_modules(model)[0]))}
    batch = lm_batches(stdlib_bytes["eval"], 1, seed=14)[0]
    with torch.no_grad():
        before = model(**batch).logits
    calls = []
    resize_parameter = resize._resize_parameter

    def failing_second_resize(parameter, value):
        calls.append(value.shape)
        if len(calls) == 2:  # GPT-2's fused c_attn: its weight resized, then its bias fails
            raise MemoryError("out of memory")
        resize_parameter(parameter, value)

    monkeypatch.setattr(resize, "_resize_parameter", failing_second_resize)
    with pytest.raises(MemoryError):
        resize_qk_(model, weights, keep_moments=False)
    monkeypatch.undo()
    assert model.config.qk_head_dims == [16, 16]
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["zero", "append"])
def test_a_frozen_qk_parameter_leaves_the_others_state_remapped(stdlib_bytes, mode):
    """With the fused Q/K/V bias frozen, the optimizer holds state for the weight only: that state follows the new
    width (it was left at the old one, and the next step failed) and the frozen bias gets none."""
    torch.manual_seed(0)
    model = GrownGPT2LMHeadModel(grown_config(8))
    for block in model.transformer.h:
        block.attn.c_attn.bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batches = lm_batches(stdlib_bytes["train"], 6, seed=3)
    train(model, optimizer, batches[:3])
    grow_in_training(model, optimizer, batches[:2], 8, mode=mode, eval_dataloader=batches[2:3])
    for block in model.transformer.h:
        weight, bias = block.attn.c_attn.weight, block.attn.c_attn.bias
        assert optimizer.state[weight]["exp_avg"].shape == weight.shape == (64, 2 * 16 * 4 + 64)
        assert bias not in optimizer.state and not bias.requires_grad
    assert all(math.isfinite(loss) for loss in train(model, optimizer, batches[3:]))


def test_a_baseline_growth_s_save_removes_the_report_an_earlier_save_left(trained, stdlib_bytes, tmp_path):
    """The folder said qk_dims_after [12, 12] while its config said [16, 16]. A model loaded from a folder (no
    report held) saved back keeps the folder's report."""
    model, optimizer = copied(trained)
    grow_in_training(model, optimizer, lm_batches(stdlib_bytes["stats"], 4, seed=2), 4, step_size=0.0)
    model.save_pretrained(tmp_path)
    loaded = GrownGPT2LMHeadModel.from_pretrained(tmp_path)
    loaded.save_pretrained(tmp_path)
    assert load_growth_report(tmp_path).qk_dims_after == [12, 12]
    grow_in_training(model, optimizer, None, 4, mode="zero")
    model.save_pretrained(tmp_path)
    assert not (tmp_path / "growth_report.json").exists()


def test_adagrad_s_new_sums_start_where_a_fresh_adagrad_s_do(trained, stdlib_bytes):
    """New entries' sums were 0, not the group's initial_accumulator_value: a first step of a full lr."""
    model, _ = copied(trained)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2, initial_accumulator_value=0.1)
    train(model, optimizer, lm_batches(stdlib_bytes["train"], 2, seed=1))
    weight = model.transformer.h[0].attn.c_attn.weight
    old = optimizer.state[weight]["sum"].clone()
    grow_in_training(model, optimizer, None, 8, mode="zero", keep_attention_scale=True)
    state = optimizer.state[weight]["sum"]  # columns: queries, keys (4 heads of 8 -> 16 each), values
    for role in range(2):
        heads = state[:, role * 64 : (role + 1) * 64].view(-1, 4, 16)
        assert torch.equal(heads[..., :8], old[:, role * 32 : (role + 1) * 32].view(-1, 4, 8))
        assert bool((heads[..., 8:] == 0.1).all())
