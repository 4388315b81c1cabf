"""Losses that run the model several times per batch (one pass per text column, as sentence-transformers' losses
do) on nested batches: each pass's X' is paired with its own dLoss/dS, every pass's real tokens count in C, and
batch structures hf_grow cannot handle are clear errors."""

import pytest
import torch
from transformers import BatchEncoding, BertModel

from hf_grow import collect_statistics, get_adapter, grow_model
from hf_grow.adapters.base import split_heads
from hf_grow.growth.line_search import evaluate_loss
from hf_grow.statistics import layer_groups
from sentence_pairs import mean_pooled

from test_grown_bert import padded_batch, tiny_bert_config


def two_pass_loss(model, batch):
    """In-batch contrastive loss with one forward pass per column (how sentence-transformers' losses are written)."""
    anchors, positives = (mean_pooled(model(**batch[side]).last_hidden_state, batch[side]["attention_mask"])
                          for side in ("a", "b"))
    scores = 20 * anchors @ positives.T
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(scores)))


def one_pass_loss(model, batch):
    """The same loss on the two columns concatenated into one padded batch."""
    embeddings = mean_pooled(model(**batch).last_hidden_state, batch["attention_mask"])
    anchors, positives = embeddings.chunk(2)
    return torch.nn.functional.cross_entropy(20 * anchors @ positives.T, torch.arange(len(anchors)))


def column_batch(seed: int, batch_size: int = 4) -> dict:
    """Two columns of different padded lengths, as BatchEncodings (a tokenizer's output)."""
    a = padded_batch(batch_size=batch_size, seq_len=9, seed=seed)
    b = padded_batch(batch_size=batch_size, seq_len=14, seed=seed + 100)
    return {"a": BatchEncoding(a), "b": BatchEncoding(b)}


def concatenated(batch: dict) -> dict:
    width = max(batch[side]["input_ids"].shape[1] for side in "ab")
    return {
        key: torch.cat([torch.nn.functional.pad(batch[side][key], (0, width - batch[side][key].shape[1]))
                        for side in "ab"])
        for key in ("input_ids", "attention_mask")
    }


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    return BertModel(tiny_bert_config(), add_pooling_layer=False).double().eval()


@pytest.mark.parametrize("method", ["reference", "chunked"])
def test_each_pass_pairs_its_inputs_with_its_own_score_gradients(bert, method):
    """M / loss terms is dLoss/dZ of the two-pass loss: dLoss/dW'_Q = scaling M W'_K, dLoss/dW'_K = scaling M^T W'_Q."""
    adapter = get_adapter(bert)
    batch = column_batch(seed=1)
    statistics = collect_statistics(bert, [batch], adapter, loss_fn=two_pass_loss, compute_dtype=torch.float64,
                                    method=method)
    assert statistics.num_tokens == sum(int(batch[side]["attention_mask"].sum()) for side in "ab")
    assert statistics.loss_weight == 4 and statistics.num_batches == 1
    bert.zero_grad()
    two_pass_loss(bert, batch).backward()
    for layer, attention in enumerate(adapter.attention_modules(bert)):
        query, key = adapter.read_qk(attention)
        heads, scaling = query.shape[0], adapter.scaling(bert.config, layer, query.shape[-1])
        query_grad = split_heads(attention.query.weight.grad.mT, attention.query.bias.grad, heads)
        key_grad = split_heads(attention.key.weight.grad.mT, attention.key.bias.grad, heads)
        gradient = statistics.mean_gradient(layer)
        assert (scaling * gradient @ key - query_grad).norm() <= 1e-12 * query_grad.norm()
        assert (scaling * gradient.mT @ query - key_grad).norm() <= 1e-12 * key_grad.norm()
    bert.zero_grad()


def test_two_passes_equal_the_concatenated_pass(bert):
    """Padding each column to its own length or both to one: the same C, M, tokens and loss terms."""
    adapter = get_adapter(bert)
    batches = [column_batch(seed) for seed in (2, 3)]
    two = collect_statistics(bert, batches, adapter, loss_fn=two_pass_loss, compute_dtype=torch.float64)
    one = collect_statistics(bert, [concatenated(batch) for batch in batches], adapter, loss_fn=one_pass_loss,
                             compute_dtype=torch.float64)
    assert two.num_tokens == one.num_tokens
    for layer in range(2):
        torch.testing.assert_close(two.second_moments[layer], one.second_moments[layer], rtol=1e-10, atol=1e-10)
        # one_pass_loss's batches count 2 x 4 sequences (its weight), the two-pass ones 4 examples per batch
        torch.testing.assert_close(two.mean_gradient(layer), one.mean_gradient(layer), rtol=1e-9, atol=1e-12)


def test_memory_budget_passes_walk_nested_batches(bert):
    adapter = get_adapter(bert)
    assert len(layer_groups(2, 4, 32, 90_000)) == 2  # M of one layer per pass
    batches = [column_batch(seed) for seed in (4, 5)]
    whole = collect_statistics(bert, batches, adapter, loss_fn=two_pass_loss, compute_dtype=torch.float64)
    split = collect_statistics(bert, batches, adapter, loss_fn=two_pass_loss, compute_dtype=torch.float64,
                               memory_budget=90_000)
    assert split.num_tokens == whole.num_tokens and split.method == whole.method
    for layer in range(2):
        torch.testing.assert_close(split.gradients[layer].double(), whole.gradients[layer], rtol=1e-12, atol=1e-14)


def test_lists_tuples_and_positional_masks(bert):
    """A list of feature dicts (sentence-transformers' own format), and a model called with positional inputs."""
    batch = column_batch(seed=6)
    as_list = [dict(batch["a"]), dict(batch["b"])]

    def list_loss(model, features):
        pooled = [mean_pooled(model(f["input_ids"], f["attention_mask"]).last_hidden_state, f["attention_mask"])
                  for f in features]
        return torch.nn.functional.cross_entropy(20 * pooled[0] @ pooled[1].T, torch.arange(len(pooled[0])))

    adapter = get_adapter(bert)
    reference = collect_statistics(bert, [batch], adapter, loss_fn=two_pass_loss, compute_dtype=torch.float64)
    statistics = collect_statistics(bert, [as_list], adapter, loss_fn=list_loss, compute_dtype=torch.float64)
    assert statistics.num_tokens == reference.num_tokens
    torch.testing.assert_close(statistics.gradients[1], reference.gradients[1], rtol=1e-10, atol=1e-12)
    assert evaluate_loss(bert, [as_list], adapter, list_loss) == pytest.approx(
        evaluate_loss(bert, [batch], adapter, two_pass_loss)
    )


def test_evaluate_loss_weights_nested_batches_by_their_examples(bert):
    """Batches of 4 and 2 examples: the mean over the 6 examples' batches, weighted 4 : 2."""
    adapter = get_adapter(bert)
    big, small = column_batch(seed=7), column_batch(seed=8, batch_size=2)
    loss, weight = evaluate_loss(bert, [big, small], adapter, two_pass_loss)
    with torch.no_grad():
        expected = (4 * two_pass_loss(bert, big) + 2 * two_pass_loss(bert, small)) / 6
    assert weight == 6
    assert loss == pytest.approx(float(expected), rel=1e-12)


def test_grow_model_with_a_two_pass_loss_is_exact_at_step_zero(bert):
    batches = [column_batch(seed) for seed in (9, 10)]
    grown = grow_model(bert, batches, p=4, step_size=0.0, loss_fn=two_pass_loss)
    assert grown.config.qk_head_dims == [12, 12]
    with torch.no_grad():
        for side in "ab":
            expected = bert(**batches[0][side]).last_hidden_state
            torch.testing.assert_close(grown(**batches[0][side]).last_hidden_state, expected, rtol=1e-9, atol=1e-10)


def test_unhandled_batch_structures_are_clear_errors(bert):
    adapter = get_adapter(bert)
    batch = column_batch(seed=11)
    # the model's own loss cannot take a nested batch: it says to pass a loss_fn (was StopIteration / TypeError deep
    # inside)
    with pytest.raises(
        TypeError,
        match=r"batch of dict\(a: BatchEncoding, b: BatchEncoding\) cannot be passed as model\(\*\*batch\): "
        r"pass loss_fn",
    ):
        collect_statistics(bert, [batch], adapter)
    # a batch without any tensor: no StopIteration, a ValueError saying what was found
    with pytest.raises(ValueError, match=r"batch of dict\(a: list, b: list\) holds no tensor"):
        collect_statistics(bert, [{"a": ["text"], "b": ["code"]}], adapter, loss_fn=two_pass_loss)
    with pytest.raises(TypeError, match=r"batch 0\['a'\]\['input_ids'\] is a numpy.ndarray"):
        collect_statistics(
            bert, [{"a": {"input_ids": batch["a"]["input_ids"].numpy()}}], adapter, loss_fn=two_pass_loss
        )
    with pytest.raises(TypeError, match="expects dict batches"):
        collect_statistics(bert, [torch.zeros(2, 4, dtype=torch.long)], adapter, loss_fn=two_pass_loss)
    with pytest.raises(ValueError, match="ran no forward pass of the model"):
        collect_statistics(bert, [batch], adapter, loss_fn=lambda model, batch: torch.tensor(1.0, requires_grad=True))
    too_long = {"a": {"input_ids": torch.ones(2, 65, dtype=torch.long)}}
    with pytest.raises(ValueError, match="holds sequences of 65 tokens, but the model has 64 positions"):
        collect_statistics(bert, [too_long], adapter, loss_fn=two_pass_loss)
