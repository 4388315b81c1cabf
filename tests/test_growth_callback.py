"""GrowthCallback inside a real `transformers.Trainer`: what it refuses before training, small and streamed
training sets, a reused callback, the best checkpoint across a growth, and the generators it leaves alone."""

import logging
import random

import numpy
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainerState, TrainingArguments

from hf_grow import (GrowthCallback, GrowthConfig, GrownGPT2Config, GrownGPT2LMHeadModel, save_grown_base,
                     to_grown_model)
from hf_grow.statistics.memory import statistics_bytes

from conftest import tiny_gpt2_config, trainer_arguments, trainer_dataset


def grown_model(seed: int = 0) -> GrownGPT2LMHeadModel:
    torch.manual_seed(seed)
    return GrownGPT2LMHeadModel(GrownGPT2Config(**tiny_gpt2_config().to_dict() | {"qk_head_dims": [8, 8]}))


def test_a_reused_callback_grows_in_every_training_run(stdlib_bytes, tmp_path):
    """A second train() (model_init, hyperparameter_search) grew nothing: the callback remembered the first run's
    growth steps and skipped them."""
    dataset = trainer_dataset(stdlib_bytes, 64, seed=11)
    callback = GrowthCallback({3: 8}, mode="zero")
    for run in range(2):
        trainer = Trainer(model=grown_model(run), args=trainer_arguments(tmp_path / str(run)), train_dataset=dataset,
                          callbacks=[callback])
        trainer.train()
        assert trainer.model.config.qk_head_dims == [16, 16], run
        assert callback.reports == {3: None}


def test_given_the_trainer_a_growth_reaches_its_loggers(stdlib_bytes, tmp_path):
    """The growth went to log_history alone: TensorBoard, W&B and the other report_to loggers never saw it."""
    logged = []

    class Logger(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append((state.global_step, dict(logs)))

    trainer = Trainer(model=grown_model(), args=trainer_arguments(tmp_path), callbacks=[Logger()],
                      train_dataset=trainer_dataset(stdlib_bytes, 64, seed=11))
    callback = GrowthCallback({3: 8}, statistics_batches=4, eval_batches=2, trainer=trainer)
    trainer.add_callback(callback)
    trainer.train()
    losses = {"growth_eval_loss_before": callback.reports[3].eval_loss_before,
              "growth_eval_loss_after": callback.reports[3].eval_loss_after}
    assert [(step, logs) for step, logs in logged if "growth_mode" in logs] == [
        (3, {"growth_mode": "append", "growth_qk_head_dim_mean": 16.0, **losses})]
    assert [entry for entry in trainer.state.log_history if "growth_mode" in entry] == [
        {"step": 3, "growth_mode": "append", "qk_head_dims": [16, 16], **losses}]  # once, as before
    # the Trainer's own log of the growth step stays (the handler's on_log cleared should_log: step 3's loss went)
    logged_steps = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged_steps == list(range(1, trainer.state.global_step + 1))


def test_a_small_training_set_is_shared_and_one_too_small_refused_before_training(stdlib_bytes, tmp_path, caplog):
    """5 batches against the default 8 + 4: the growth failed mid-training ("eval_dataloader yielded no batches").
    Now shared in proportion (3 + 2); a single batch is refused before the first step."""
    dataset = trainer_dataset(stdlib_bytes, 20, seed=11)  # 5 batches of 4
    callback = GrowthCallback({3: 8}, mode="append")
    trainer = Trainer(model=grown_model(), args=trainer_arguments(tmp_path), train_dataset=dataset,
                      callbacks=[callback])
    with caplog.at_level(logging.WARNING, logger="hf_grow"):
        trainer.train()
    assert "each growth uses 3 for the statistics and 2 held out (asked: 8 and 4)" in caplog.text
    assert trainer.model.config.qk_head_dims == [16, 16]
    report = callback.reports[3]
    assert report.statistics_batches == 3 and report.eval_loss_after <= report.eval_loss_before

    tiny = Trainer(model=grown_model(), args=trainer_arguments(tmp_path / "tiny"),
                   train_dataset=dataset[:4], callbacks=[GrowthCallback({3: 8}, mode="append")])
    with pytest.raises(ValueError, match=r"gives 1 batch\(es\) of 4 per process: a growth needs one for the "
                                         "statistics and one held out"):
        tiny.train()
    assert tiny.state.global_step == 0
    # shared down to one statistics batch, which cross_fit cannot halve: refused before training, as one asked for
    halved = Trainer(model=grown_model(), args=trainer_arguments(tmp_path / "halved"), train_dataset=dataset[:8],
                     callbacks=[GrowthCallback({3: 8}, config=GrowthConfig.for_training())])
    with pytest.raises(ValueError, match="cross_fit splits each growth's statistics batches into two halves, but it "
                                         "gets 1"):
        halved.train()
    assert halved.state.global_step == 0


def test_options_the_callback_sets_itself_are_refused_when_it_is_made():
    """p, accelerator and budget passed the option check and failed at the growth step ("got multiple values for
    argument 'p'")."""
    for option in ({"p": 8}, {"accelerator": object()}, {"statistics": object()}):
        with pytest.raises(TypeError, match="GrowthCallback sets"):
            GrowthCallback({3: 8}, **option)
    with pytest.raises(ValueError, match="budget allocation is grow_model's"):
        GrowthCallback({3: 8}, budget=16)
    with pytest.raises(ValueError, match="the dims added come from the schedule"):  # was ignored: the schedule's 8
        GrowthCallback({3: 8}, config=GrowthConfig(p=4))
    # grow_in_training's own keywords and fixed batches, refused at the growth step after the training to it
    for options, message in (({"init_std": -1.0}, "init_std must be a finite number >= 0"),
                             ({"init_std": float("nan")}, "init_std must be a finite number >= 0"),
                             ({"loss_fn": 3}, "loss_fn must be a function")):
        with pytest.raises(ValueError, match=message):
            GrowthCallback({3: 8}, mode="zero", **options)
    with pytest.raises(ValueError, match="init_std must be a finite number >= 0, got True"):
        GrowthCallback({3: 8}, mode="zero", init_std=True)

    class Stream(IterableDataset):
        def __iter__(self):
            yield {"input_ids": torch.zeros(4, dtype=torch.long)}

    # a DataLoader of a stream has no length (its len() raises TypeError), and a NumPy float is a number
    GrowthCallback({3: 8}, mode="zero", dataloader=DataLoader(Stream()), init_std=numpy.float32(0.02))


def test_adafactor_is_refused_before_training(stdlib_bytes, tmp_path):
    """Adafactor creates its (factored) state at the first step, so the state check before training saw nothing and
    the refusal came at the growth step, naming accelerate's wrapper instead of the optimizer."""
    arguments = trainer_arguments(tmp_path)
    arguments.optim = "adafactor"
    trainer = Trainer(model=grown_model(), args=arguments, train_dataset=trainer_dataset(stdlib_bytes, 32, seed=11),
                      callbacks=[GrowthCallback({3: 8}, mode="zero")])
    with pytest.raises(ValueError, match="cannot remap the state of Adafactor: its second moments are factored"):
        trainer.train()
    assert trainer.state.global_step == 0


def grown_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return to_grown_model(LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64,
    )))


REFUSED_BEFORE_TRAINING = {  # each trained to the growth step before it was refused
    "Rprop": ({"mode": "zero"}, "cannot remap the state of Rprop: its per-entry step sizes"),
    # state that no refusal by name knows, created at the first step: found by a throwaway copy's first step
    "Adadelta": ({"mode": "zero"}, r"cannot remap the Adadelta state \['acc_delta'\] of .* \(at the first step\)"),
    "ASGD": ({"mode": "zero"}, "cannot remap the state of ASGD"),
    "refactor on Llama": ({"mode": "refactor"}, "GrownLlamaForCausalLM cannot grow by mode 'refactor'"),
    "cross_fit, one batch": ({"statistics_batches": 1, "config": GrowthConfig.for_training()},
                             "cross_fit splits each growth's statistics batches into two halves, but it gets 1"),
    "no offload folder": ({"offload_dir": "/nonexistent/hf_grow"}, "offload_dir"),
    "budget below a layer": ({"memory_budget": "1KB"}, "is below the .* bytes the statistics need for one layer"),
    # one layer's M and a batch's product fit, not the half sums of the cross_fit that growth in training turns on
    "budget below cross_fit's": ({"memory_budget": statistics_bytes(2, 4, 64, 2)}, r"M and its half sum for cross"),
}


@pytest.mark.parametrize("case", REFUSED_BEFORE_TRAINING)
def test_what_would_fail_at_the_growth_step_is_refused_before_training(stdlib_bytes, tmp_path, case):
    options, message = REFUSED_BEFORE_TRAINING[case]
    model = grown_llama() if "Llama" in case else grown_model()
    optimizer = getattr(torch.optim, case)(model.parameters()) if case in ("Rprop", "ASGD", "Adadelta") else None
    trainer = Trainer(model=model, args=trainer_arguments(tmp_path), optimizers=(optimizer, None),
                      train_dataset=trainer_dataset(stdlib_bytes, 32, seed=11),
                      callbacks=[GrowthCallback({3: 8}, **options)])
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0


def test_adamax_grows_with_its_state_remapped(stdlib_bytes, tmp_path):
    """Adamax's exp_inf (a running maximum of |gradient|) was refused at the growth step."""
    model = grown_model()
    trainer = Trainer(model=model, args=trainer_arguments(tmp_path),
                      optimizers=(torch.optim.Adamax(model.parameters()), None),
                      train_dataset=trainer_dataset(stdlib_bytes, 32, seed=11), callbacks=[GrowthCallback({3: 8})])
    trainer.train()
    weight = model.transformer.h[0].attn.c_attn.weight
    assert model.config.qk_head_dims == [16, 16]
    assert trainer.optimizer.state[weight]["exp_inf"].shape == weight.shape


def test_load_best_model_at_end_picks_a_checkpoint_saved_after_the_growth(stdlib_bytes, tmp_path, caplog):
    """The best checkpoint (here by the highest eval loss: the earliest) predated the growth, and loading it at the
    end of training failed on the Q/K shapes. Each growth now forgets the Trainer's best."""
    dataset = trainer_dataset(stdlib_bytes, 64, seed=11)
    arguments = trainer_arguments(tmp_path)
    arguments.eval_strategy = arguments.save_strategy = "steps"
    arguments.eval_steps = arguments.save_steps = 2
    arguments.load_best_model_at_end, arguments.metric_for_best_model = True, "eval_loss"
    arguments.greater_is_better = True
    trainer = Trainer(model=grown_model(), args=arguments, train_dataset=dataset, eval_dataset=dataset[:8],
                      callbacks=[GrowthCallback({3: 8}, mode="zero")])
    with caplog.at_level(logging.WARNING, logger="hf_grow"):
        trainer.train()
    assert "the best checkpoint is the best of those saved since the last growth" in caplog.text
    eval_losses = {entry["step"]: entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry}
    assert eval_losses[2] > max(eval_losses[4], eval_losses[6])  # without the growth, checkpoint-2 would be the best
    best = 4 if eval_losses[4] > eval_losses[6] else 6
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best}")
    assert trainer.model.config.qk_head_dims == [16, 16]


def test_settings_under_which_growth_differs_from_training_are_warned_about_before_training(tmp_path, caplog):
    """A growth past the last step never happens; a custom compute_loss or label smoothing is not the loss the
    growth uses. Both were silent."""
    model = grown_model()

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    plain = trainer_arguments(tmp_path)
    smoothed = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, label_smoothing_factor=0.1)
    own_loss = OwnLoss(model=model, args=plain)
    state = TrainerState(max_steps=10)
    for callback, args, expected in (
        (GrowthCallback({5: 8, 12: 8}, mode="zero"), plain, "growth steps [12] come after the last training step"),
        (GrowthCallback({5: 8}, mode="zero"), smoothed, "not the Trainer's compute_loss or label smoothing"),
        (GrowthCallback({5: 8}, mode="zero", trainer=own_loss), plain, "not the Trainer's compute_loss"),
        (GrowthCallback({5: 8}, mode="zero", trainer=own_loss, loss_fn=lambda model, batch: model(**batch).loss),
         smoothed, None),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_grow"):
            callback.on_train_begin(args, state, None, model=model, optimizer=None)
        assert (expected in caplog.text) if expected else caplog.text == ""


class Stream(IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


@pytest.mark.parametrize("streamed", [False, True], ids=["map-style", "iterable"])
def test_the_draw_leaves_the_global_generators_as_they_were(stdlib_bytes, monkeypatch, streamed):
    """A collator drawing from the global generators (masked LM's masking) and an IterableDataset's loader (its base
    seed) changed the global torch RNG, so training after a growth differed from training without it."""
    from hf_grow.training import callback as callback_module

    drawn = []
    monkeypatch.setattr(callback_module, "grow_in_training", lambda model, optimizer, batches, added, **kwargs:
                        drawn.append(torch.cat([batch["input_ids"] for batch in batches])))
    monkeypatch.setattr(callback_module, "resolved_mode", lambda model, mode: "append")
    rows = [row["input_ids"] for row in trainer_dataset(stdlib_bytes, 24, seed=3)]

    class NoisyCollator:  # masks random positions with the three global generators and one of its own
        generator = torch.Generator().manual_seed(7)

        def __call__(self, batch):
            ids = torch.stack(batch)
            ids[:, random.randrange(ids.shape[1])] = int(numpy.random.randint(256))
            ids = torch.where(torch.rand(ids.shape, generator=self.generator) < 0.1, 1, ids)
            return {"input_ids": torch.where(torch.rand(ids.shape) < 0.1, 0, ids)}

    collator = NoisyCollator()
    loader = DataLoader(Stream(rows) if streamed else rows, batch_size=4, collate_fn=collator)
    own = collator.generator.get_state()
    callback = GrowthCallback({2: 8}, statistics_batches=2, eval_batches=1)
    args = type("Args", (), {"per_device_train_batch_size": 4, "world_size": 1, "process_index": 0})()
    state, model = TrainerState(global_step=2), grown_model()
    torch.manual_seed(1), random.seed(1), numpy.random.seed(1)
    before = torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy()
    callback.on_step_end(args, state, None, model=model, optimizer=None, train_dataloader=loader)
    assert len(drawn) == 1 and drawn[0].shape[0] == 8
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert numpy.array_equal(numpy.random.get_state()[1], before[2])
    assert torch.equal(collator.generator.get_state(), own)  # DataCollatorForLanguageModeling(seed=...)'s kind


def test_a_small_draw_leaves_a_batch_for_the_statistics():
    """2 batches against 1 + 3 gave (0, 2): no statistics batch."""
    from hf_grow.training.callback_checks import split_counts

    assert split_counts(2, 1, 3) == (1, 1) and split_counts(5, 8, 4) == (3, 2) and split_counts(20, 8, 4) == (8, 4)
    assert split_counts(3, 8, 0) == (3, 0) and split_counts(1, 8, 4) == (0, 0)


def test_each_growth_takes_its_own_batches_of_an_iterable_dataset(stdlib_bytes, monkeypatch):
    """Read from its start at every growth, an IterableDataset gave every growth the same first batches."""
    from hf_grow.training import callback as callback_module

    drawn = []
    monkeypatch.setattr(callback_module, "grow_in_training", lambda model, optimizer, batches, added, **kwargs:
                        drawn.append(torch.cat([batch["input_ids"] for batch in batches])))
    monkeypatch.setattr(callback_module, "resolved_mode", lambda model, mode: "append")
    rows = [row["input_ids"] for row in trainer_dataset(stdlib_bytes, 40, seed=3)]  # 10 batches of 4
    loader = DataLoader(Stream(rows), batch_size=4, collate_fn=lambda batch: {"input_ids": torch.stack(batch)})
    callback = GrowthCallback({2: 8, 4: 8, 6: 8}, statistics_batches=2, eval_batches=1)
    args = type("Args", (), {"per_device_train_batch_size": 4, "world_size": 1, "process_index": 0})()
    model = grown_model()
    for step in (2, 4, 6):
        callback.on_step_end(args, TrainerState(global_step=step), None, model=model, optimizer=None,
                             train_dataloader=loader)
    for growth, statistics_rows in enumerate(drawn):  # 3 batches of 4 rows a growth, the first 2 for statistics
        assert torch.equal(statistics_rows, torch.stack(rows[12 * growth : 12 * growth + 8])), growth


def test_a_run_resumed_past_a_growth_refuses_a_model_at_the_old_widths(gpt2_copy, tmp_path):
    """A resume skips the growths already done: a model at the old widths (a PEFT model's checkpoints hold its adapter
    alone) trained on at them without a word."""
    from transformers import TrainerControl

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    state = TrainerState(global_step=6, log_history=[
        {"loss": 5.0, "step": 2}, {"step": 3, "growth_mode": "refactor", "qk_head_dims": [24, 24]},
    ])
    with pytest.raises(ValueError, match=r"after growths to query/key widths \[24, 24\], but the model has \[16, 16\]"):
        GrowthCallback({3: 8}).on_train_begin(args, state, TrainerControl(), model=gpt2_copy)


def test_a_peft_run_resumes_past_a_growth_as_readme_says(stdlib_bytes, tmp_path):
    """README's recipe: the grown base saved without the adapter's layers, the adapter from the checkpoint. The
    advice was get_base_model().save_pretrained, whose adapted modules (lora_A, base_layer) did not load into the
    grown model: its MLPs came back random; and unload() put modules_to_save's trained copy in place of the
    frozen original."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    dataset = trainer_dataset(stdlib_bytes, 64, seed=5)

    def trainer(model):
        return Trainer(model=model, args=trainer_arguments(tmp_path / "run"), train_dataset=dataset,
                       callbacks=[GrowthCallback({3: 8}, mode="zero")])

    lora = LoraConfig(r=4, target_modules=["c_fc", "c_proj"], fan_in_fan_out=True, modules_to_save=["ln_f"])
    peft_model = get_peft_model(grown_model(), lora)
    trainer(peft_model).train()  # grows at step 3, a checkpoint at step 4 holds the adapter alone
    save_grown_base(peft_model, tmp_path / "grown-base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "grown-base")
    assert base.config.qk_head_dims == [16, 16]
    resumed = PeftModel.from_pretrained(base, tmp_path / "run" / "checkpoint-4", is_trainable=True)
    trainer(resumed).train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    finished = dict(peft_model.named_parameters())
    for name, parameter in resumed.named_parameters():  # every weight: the adapted MLPs', the adapter's, and the
        torch.testing.assert_close(parameter, finished[name], rtol=1e-6, atol=1e-7, msg=name)  # frozen ln_f
    ids = dataset[0]["input_ids"][None]
    with torch.no_grad(), resumed.disable_adapter(), peft_model.disable_adapter():  # the base model as it was
        torch.testing.assert_close(resumed(input_ids=ids).logits, peft_model(input_ids=ids).logits)


def test_fixed_batches_and_widths_are_checked_when_training_begins(tmp_path, stdlib_bytes):
    """Held-out batches without labels, a one-shot iterator read out by the first of two growths and widths past
    the scores' rank were refused at the growth step, after the training to it; and an empty batch list at the
    callback's making, though under DDP a process's own shard may be empty (the other process then died in gloo)."""
    from conftest import lm_batches

    model = grown_model()
    args, state = trainer_arguments(tmp_path), TrainerState(max_steps=6)
    batches = lm_batches(stdlib_bytes["train"], 2, batch_size=2, seed=3)
    unlabelled = [{"input_ids": batch["input_ids"]} for batch in batches]
    for callback, message in (
        (GrowthCallback({3: 8}, eval_dataloader=[]), "eval_dataloader holds no batches"),
        (GrowthCallback({3: 8}, mode="zero", dataloader=[]), "dataloader holds no batches"),
        (GrowthCallback({3: 8}, dataloader=batches, eval_dataloader=unlabelled),
         "eval_dataloader batch 0 holds no labels"),
        (GrowthCallback({2: 8, 4: 8}, dataloader=iter(batches), eval_dataloader=batches),
         "dataloader is a one-shot iterator, which the first of the schedule's 2 growths reads out"),
        (GrowthCallback({2: 30, 4: 30}), r"grow_at\[4\]: query/key widths \{0: 68, 1: 68\} exceed 65"),
        (GrowthCallback(qk_dims_at={2: 100}), r"qk_dims_at\[2\]: query/key widths \{0: 100, 1: 100\} exceed 65"),
    ):
        with pytest.raises(ValueError, match=message):
            callback.on_train_begin(args, state, None, model=model, optimizer=None)
    (GrowthCallback({3: 8}, mode="zero", eval_dataloader=unlabelled)  # the baselines read no batch
     .on_train_begin(args, state, None, model=model, optimizer=None))
    with pytest.raises(ValueError, match="dataloader batch 0 holds no labels"):  # statistics batches need them too
        GrowthCallback({3: 8}, dataloader=unlabelled, eval_dataloader=batches).on_train_begin(
            args, state, None, model=model, optimizer=None)
    # resumed at step 4, after the growth at 3: the growths done counted again refused a valid schedule (8 + 24 + 24
    # past 65) and an iterator that one growth is left to read
    resumed = TrainerState(max_steps=6, global_step=4, log_history=[{"step": 3, "qk_head_dims": [32, 32]}])
    wide = GrownGPT2LMHeadModel(GrownGPT2Config(**tiny_gpt2_config().to_dict() | {"qk_head_dims": [32, 32]}))
    GrowthCallback({3: 24, 5: 24}, dataloader=iter(batches), eval_dataloader=batches).on_train_begin(
        args, resumed, None, model=wide, optimizer=None)
    settings = ("deepspeed", "fsdp", "load_best_model_at_end", "label_smoothing_factor")
    two = type("Args", (), {**{name: getattr(args, name) for name in settings}, "world_size": 2})()
    fake_trainer = type("Trainer", (Trainer,), {"__init__": lambda self: None, "model_wrapped": model,
                                                 "accelerator": None, "compute_loss_func": None})()
    GrowthCallback({3: 8}, mode="zero", eval_dataloader=[], trainer=fake_trainer).on_train_begin(
        two, state, None, model=model, optimizer=None)  # this process's shard is empty: fine under DDP

