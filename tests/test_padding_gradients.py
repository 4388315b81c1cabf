"""M is dLoss/dZ of the loss the line search measures also where that loss has terms at padding positions: labels
left on padding (``labels=input_ids`` with a padded batch), or a question-answering head, whose softmax over start
and end positions runs over every position. C still counts the real tokens only."""

import copy

import pytest
import torch
from transformers import BertConfig, BertForQuestionAnswering

from hf_grow import collect_statistics, get_adapter
from hf_grow.statistics import batch_loss_weight

LENGTHS = torch.tensor([12, 7, 3, 9])
MASK = (torch.arange(12)[None] < LENGTHS[:, None]).long()


def assert_gradient_is_m(model, batches: list[dict]) -> None:
    """dLoss/dW'_Q = scaling * M W'_K per head, against autograd of the weighted mean loss over ``batches``."""
    adapter = get_adapter(model)
    weights = [batch_loss_weight(adapter, model, batch, None) for batch in batches]
    statistics = collect_statistics(model, batches, adapter, compute_dtype=torch.float64)
    assert statistics.num_tokens == sum(int(batch["attention_mask"].sum()) for batch in batches)
    model.zero_grad()
    (sum(model(**batch).loss * weight for batch, weight in zip(batches, weights)) / sum(weights)).backward()
    gradients = copy.deepcopy(model)  # the gradients in the weights' places: read_qk reads them as it reads Q/K
    for parameter, gradient in zip(model.parameters(), gradients.parameters()):
        gradient.data = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
    model.zero_grad()
    pairs = zip(adapter.attention_modules(model), adapter.attention_modules(gradients))
    for layer, (attention, attention_gradient) in enumerate(pairs):
        query, key = adapter.read_qk(attention)
        query_gradient, _ = adapter.read_qk(attention_gradient)
        scaling = adapter.scaling(model.config, layer, query.shape[-1])
        torch.testing.assert_close(
            scaling * statistics.mean_gradient(layer) @ key, query_gradient, rtol=1e-6, atol=1e-9
        )


def test_labels_on_padding_are_in_m(gpt2_copy):
    model = gpt2_copy.double()
    ids = torch.randint(1, 200, (4, 12), generator=torch.Generator().manual_seed(1)).masked_fill(MASK == 0, 0)
    padded = {"input_ids": ids, "attention_mask": MASK, "labels": ids}  # the padding's labels are not -100
    assert_gradient_is_m(model, [padded])


@pytest.mark.parametrize("side", ["right", "left"])
def test_question_answering_with_padding(side):
    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )).double().eval()
    mask = MASK if side == "right" else MASK.flip(-1)
    ids = torch.randint(5, 100, (4, 12), generator=torch.Generator().manual_seed(2)).masked_fill(mask == 0, 0)
    starts = mask.argmax(dim=-1)  # the first real token of each sequence
    batch = {"input_ids": ids, "attention_mask": mask, "start_positions": starts, "end_positions": starts + 1}
    assert_gradient_is_m(model, [batch])


def test_padding_rows_stay_out_of_c(gpt2_copy):
    """The same labels on padding: C of the padded batch is C of its real tokens alone."""
    model = gpt2_copy.double()
    ids = torch.randint(1, 200, (4, 12), generator=torch.Generator().manual_seed(3)).masked_fill(MASK == 0, 0)
    padded = collect_statistics(model, [{"input_ids": ids, "attention_mask": MASK, "labels": ids}],
                                get_adapter(model), compute_dtype=torch.float64)
    alone = [{"input_ids": ids[row : row + 1, :length], "labels": ids[row : row + 1, :length]}
             for row, length in enumerate(LENGTHS.tolist())]
    separate = collect_statistics(model, alone, get_adapter(model), compute_dtype=torch.float64)
    assert padded.num_tokens == separate.num_tokens == int(LENGTHS.sum())
    for layer in range(model.config.n_layer):
        torch.testing.assert_close(padded.second_moments[layer], separate.second_moments[layer], rtol=1e-9, atol=1e-9)



def test_a_pass_without_gradient_beside_one_with_is_taken(gpt2_copy):
    """A teacher's or a guide's pass of the same model under no_grad adds nothing to M, nor to C and the token count
    (its inputs have no score gradients; a self-guided GISTEmbed counted its tokens twice); only a loss that runs the
    model without gradient alone (sentence-transformers' Cached* losses) is refused: its M was 0."""
    model = gpt2_copy.double()
    ids = torch.randint(1, 200, (4, 12), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "labels": ids}

    def with_a_teacher_pass(model, batch):
        with torch.no_grad():  # before and after, on other text
            model(input_ids=ids.flip(0)[:, :7])
        loss = model(**batch).loss
        with torch.no_grad():
            model(input_ids=ids[:3] + 1)
        return loss

    adapter = get_adapter(model)
    plain = collect_statistics(model, [batch], adapter, lambda model, batch: model(**batch).loss,
                               compute_dtype=torch.float64)
    taught = collect_statistics(model, [batch], adapter, with_a_teacher_pass, compute_dtype=torch.float64)
    assert taught.num_tokens == plain.num_tokens == ids.numel()
    for layer in range(model.config.n_layer):
        torch.testing.assert_close(taught.gradients[layer], plain.gradients[layer], rtol=1e-12, atol=1e-15)
        assert torch.equal(taught.second_moments[layer], plain.second_moments[layer])

    def only_without_gradient(model, batch):
        with torch.no_grad():
            loss = model(**batch).loss
        return loss.requires_grad_()

    with pytest.raises(ValueError, match="ran the model only without gradient"):
        collect_statistics(model, [batch], adapter, only_without_gradient)
