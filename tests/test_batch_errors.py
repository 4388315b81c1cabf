"""Batches that are nearly right, and small API edges: each refused before the model runs, with what to pass instead
(they failed deep inside transformers, or with advice that did not fit)."""

import json
import warnings

import pytest
import torch
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_grow import GrowthConfig, GrownGPT2Config, GrownGPT2LMHeadModel, grow_in_training, grow_model
from hf_grow.data import read_text_files

from conftest import lm_batches, tiny_gpt2_config


@pytest.fixture(scope="module")
def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config()).eval()


def test_nearly_right_batches_are_refused_with_what_to_pass(model, stdlib_bytes):
    batch = lm_batches(stdlib_bytes["stats"], 1, batch_size=2, seq_len=12)[0]
    ids = batch["input_ids"]
    cases = [
        ({"input_ids": ids.tolist(), "labels": ids}, TypeError,
         r"batch 0\['input_ids'\] is a list, not a tensor: call the tokenizer with return_tensors='pt'"),
        ({"input_ids": ids[0], "labels": ids[0]}, ValueError,
         r"batch 0 holds token inputs without a batch dimension \(shape \(12,\)\): these look like rows of a dataset"),
        ({**batch, "attention_mask": torch.ones(2, 1, 12, 12)}, ValueError,
         r"batch 0\['attention_mask'\] has shape \(2, 1, 12, 12\) against the tokens' \(2, 12\).* a 4-D mask "
         r"\(packed sequences, custom attention\) is not supported"),
        ({**batch, "return_dict": False}, ValueError,
         r"batch 0\['return_dict'\] is False: hf_grow reads the model's outputs.loss"),
    ]
    rows = {"input_ids": list(ids), "labels": ids}  # rows left unstacked
    with pytest.raises(TypeError, match=r"stack \['input_ids'\] into tensors \(a DataLoader with a collator does\)"):
        grow_model(model, [rows], p=8, eval_dataloader=[batch])
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            grow_model(model, [bad], p=8, eval_dataloader=[batch])
        with pytest.raises(error, match=message.replace("batch 0", "held-out batch 0")):
            grow_model(model, [batch], p=8, eval_dataloader=[bad])


def test_one_token_sequences_are_named_in_the_error(model, stdlib_bytes):
    """Only one-token sequences (a causal LM: nothing to predict) were refused with "every label is -100" though no
    label was: in the statistics' batches and in the held-out ones."""
    batch = {"input_ids": torch.ones(4, 1, dtype=torch.long), "labels": torch.ones(4, 1, dtype=torch.long)}
    held_out = lm_batches(stdlib_bytes["eval"], 1, batch_size=2, seq_len=12)
    with pytest.raises(ValueError, match="none of the 2 batches has a loss term .* or for a causal LM sequences of one "
                                         "token, which predict nothing"):
        grow_model(model, [batch, batch], p=8, eval_dataloader=held_out)
    with pytest.raises(ValueError, match="the held-out data holds no loss terms .* or for a causal LM sequences of"):
        grow_model(model, [batch, batch], p=8)


def test_rotary_models_take_sequences_past_max_position_embeddings(stdlib_bytes):
    """A Llama with 16 positions runs 48-token sequences (its positions are computed, not a table): they were
    refused as too long. GPT-2's learned table still refuses them (tests/test_statistics.py)."""
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        head_dim=16, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )).eval()
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=2, seq_len=48)
    grown = grow_model(llama, batches[:2], p=8, eval_dataloader=batches[2:], step_size=0.0)
    with torch.no_grad():
        torch.testing.assert_close(grown(**batches[2]).logits, llama(**batches[2]).logits, rtol=0, atol=1e-5)


def test_the_unaligned_width_warning_points_at_the_callers_line(model, stdlib_bytes):
    """It pointed into hf_grow (growth/api.py) instead of the line that called grow_model."""
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=2, seq_len=16)
    grown_type = GrownGPT2LMHeadModel(GrownGPT2Config(**tiny_gpt2_config().to_dict() | {"qk_head_dims": [16, 16]}))
    for grow in (lambda: grow_model(model, batches, p=3, step_size=0.0),
                 lambda: grow_in_training(grown_type, None, batches, 3, step_size=0.0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grow()
        unaligned = [warning for warning in caught if "not multiples of 8" in str(warning.message)]
        assert unaligned and unaligned[0].filename == __file__


def test_booleans_are_not_steps():
    """step_size=True was taken as a step of 1 (p=True and max_batches=True were refused); NumPy numbers are steps."""
    import numpy

    for option in ("step_size", "step_scale", "initial_step_size"):
        with pytest.raises(ValueError, match=f"{option} must be"):
            GrowthConfig(**{option: True})
        config = GrowthConfig(**{option: numpy.float32(0.5)})  # a Python float: the report's JSON writes it
        assert type(getattr(config, option)) is float and json.loads(json.dumps(config.to_dict()))[option] == 0.5


def test_batches_that_were_right_stay_accepted(model, stdlib_bytes):
    """A model whose forward takes **kwargs (no label names to read), and a loss_fn's batch holding lists of
    tensors, were refused by the new checks (the review of 2026-11-29)."""

    class Wrapped(GPT2LMHeadModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    wrapped = Wrapped(model.config)
    wrapped.load_state_dict(model.state_dict())
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=2, seq_len=12)
    grow_model(wrapped.eval(), batches[:2], p=8, eval_dataloader=batches[2:], step_size=0.0)

    def per_sequence(model, batch):
        return sum(model(input_ids=ids, labels=ids).loss for ids in batch["input_ids"]) / len(batch["input_ids"])

    listed = [{"input_ids": [batch["input_ids"][:1], batch["input_ids"][1:]]} for batch in batches]
    grow_model(model, listed[:2], p=8, eval_dataloader=listed[2:], loss_fn=per_sequence, step_size=0.0)


@pytest.mark.parametrize("name, text", [("records.jsonl", '{"text": "hello"}\n'), ("table.CSV", "id,text\n1,hi\n")])
def test_a_file_of_records_to_data_is_read_as_text_with_a_warning(tmp_path, name, text):
    """A .csv (like a .jsonl) is read whole, its header and quotes included: said (it was not, for a .csv)."""
    records = tmp_path / name
    records.write_text(text)
    said = []
    texts = ["".join(pieces) for pieces in read_text_files([str(records)], warn=said.append)]
    assert texts == [text]
    assert said == [f"--data {str(records)!r} is read as plain text, its syntax (JSON keys, a header, quotes) "
                    "included: to read one field of its records, put the file in a folder of its own and pass "
                    "--dataset FOLDER --text-column FIELD --eval-split train"]


def test_held_out_batches_without_labels_or_with_foreign_token_ids_are_refused_first(model, stdlib_bytes):
    """Both were found in the line search, after the statistics pass and the solve (a foreign id on a GPU: a
    device-side assert that ends the CUDA context)."""
    batch = lm_batches(stdlib_bytes["stats"], 1, batch_size=2, seq_len=12)[0]

    def statistics_batches():
        raise AssertionError("the statistics pass began")
        yield batch

    foreign = {**batch, "input_ids": batch["input_ids"].clone().index_fill_(1, torch.tensor([3]), 300)}
    for bad, message in (({"input_ids": batch["input_ids"]}, r"held-out batch 1 holds no labels, so the model computes "
                                                               "no loss from it"),
                         (foreign, r"held-out batch 1\['input_ids'\] holds token id 300, outside the model's 256 "
                                   "embeddings")):
        with pytest.raises(ValueError, match=message):
            grow_model(model, statistics_batches(), p=8, eval_dataloader=[batch, bad])
    with pytest.raises(ValueError, match=r"batch 0\['input_ids'\] holds token id 300"):
        grow_model(model, [foreign], p=8, eval_dataloader=[batch])


def test_token_type_ids_past_the_models_types_are_refused_first():
    """They reached BERT's embedding as an IndexError (on a GPU, a device-side assert) in the statistics pass: a
    checkpoint with type_vocab_size=1 fed a pair tokenizer's segment ids 0 and 1."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, type_vocab_size=1)).eval()
    ids = torch.randint(3, 64, (2, 12))
    batch = {"input_ids": ids, "labels": ids, "token_type_ids": (torch.arange(12) >= 6).long().expand(2, 12)}
    with pytest.raises(ValueError, match=r"batch 0\['token_type_ids'\] holds token type id 1, outside the model's 1 "
                                         r"token types \(config.type_vocab_size\)"):
        grow_model(bert, [batch], p=8, eval_dataloader=[batch])
    gpt2 = GPT2LMHeadModel(tiny_gpt2_config()).eval()  # which embeds token types as tokens
    ids = torch.randint(3, 256, (2, 12))
    batch = {"input_ids": ids, "labels": ids, "token_type_ids": torch.full((2, 12), 300)}
    with pytest.raises(ValueError, match=r"holds token type id 300, outside the model's 256 embeddings"):
        grow_model(gpt2, [batch], p=8, eval_dataloader=[batch])


def test_a_memory_budget_below_one_layer_is_refused_before_the_batches_are_read(model):
    """Without held-out batches every batch was read (to hold the last ones out) before the refusal."""
    def batches():
        raise AssertionError("a batch was read")
        yield

    with pytest.raises(ValueError, match="memory_budget 1,000 bytes is below the .* bytes the statistics need"):
        grow_model(model, batches(), p=8, memory_budget="1KB")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_growth_problem_refuses_statistics_with_a_non_finite_m(bad):
    """`GrowthProblem` (exported) on statistics whose M holds a NaN: the layer's step norm was NaN, its lam 0,
    silently (grow_model checks the statistics first; hand-made statistics reach the problem directly)."""
    from hf_grow import collect_statistics, get_adapter
    from hf_grow.growth import GrowthProblem

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(n_embd=64, n_head=4, n_layer=2)).eval()
    ids = torch.randint(0, 256, (2, 4, 32))
    statistics = collect_statistics(
        model, [{"input_ids": batch, "labels": batch} for batch in ids], get_adapter(model)
    )
    statistics.gradients[1][2, 3, 3] = bad
    with pytest.raises(FloatingPointError, match=r"layer 1's statistics give a non-finite step for heads \[2\]"):
        GrowthProblem(model, get_adapter(model), statistics, [24, 24], "whitened", 1e-6, "auto")
