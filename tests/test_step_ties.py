"""The line search keeps step 0 where a step gains no more than the loss's rounding (`ties_step_zero`)."""

import math

import torch

from hf_grow.growth import best_step, search_step_size
from hf_grow.growth.line_search import within_precision

#: A held-out loss (all-MiniLM-L6-v2's contrastive loss on stdlib line pairs) and one float32 unit of it.
LOSS = 4.7435120940208435
ULP = 2.0**-21


def test_a_step_one_float32_unit_below_step_0_ties_with_it():
    """Where nothing is gained the losses of small steps wobble by an ulp around step 0's: the search took a step
    of 6.8e-8 that "gained" one ulp (4.77e-7), which rewrote every query/key weight of the model (its layer 0's
    queries by 159%) for a change of the scores of 1e-6. A gain beyond two ulps is still taken."""
    def wobbling(step: float) -> float:
        if step == 0 or step >= 0.01:
            return LOSS + step
        return LOSS + ULP * (-1) ** round(math.log(step, 4))  # one ulp below, then above, ...

    losses = search_step_size(wobbling, start=0.03)
    assert min(losses.values()) == LOSS - ULP and best_step(losses) == 0.0
    assert len(losses) <= 5  # the walk down stopped at the second tie in a row

    def gaining(step: float) -> float:  # three ulps below step 0's: a gain the rounding does not explain
        return LOSS - 3 * ULP if 1e-4 < step < 0.01 else LOSS + step * (step > 0)

    losses = search_step_size(gaining, start=0.03)
    assert 1e-4 < best_step(losses) < 0.01 and losses[best_step(losses)] == LOSS - 3 * ULP
    assert best_step({0.0: math.inf, 0.1: 2.0}) == 0.1  # a step 0 whose loss overflowed ties with nothing


def test_a_gain_within_the_models_precision_seeds_no_other_candidates_search():
    """In bfloat16 a MiniLM's held-out loss moved by up to 0.02 at tiny steps: the first candidate took such a step,
    and the second searched only near it (`candidates._near`), missing a gain of 2.0 that a full search finds."""
    assert within_precision(LOSS - 0.02, LOSS, torch.bfloat16) and within_precision(LOSS + 0.02, LOSS, torch.bfloat16)
    assert not within_precision(LOSS - 0.05, LOSS, torch.bfloat16)  # beyond bfloat16's epsilon of the loss
    assert within_precision(LOSS - 7e-4, LOSS, torch.float16) and not within_precision(LOSS - 7e-3, LOSS, torch.float16)
    assert within_precision(LOSS - ULP, LOSS, torch.float32) and not within_precision(LOSS - 1e-5, LOSS, torch.float32)
    assert not within_precision(1.0, math.inf, torch.bfloat16)


def test_a_half_precision_models_own_loss_is_computed_from_float32_logits():
    """transformers' masked-LM and classification heads compute their cross-entropy in the logits' dtype: in
    bfloat16 the held-out loss moved in steps of 0.004 near 10 nats, and the line search took such a step for a
    gain. The loss hf_grow computes (statistics, line search, report) is the float32 cross-entropy of the logits."""
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification

    from hf_grow import evaluate_loss

    torch.manual_seed(0)
    settings = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    ids = torch.randint(5, 300, (4, 16), generator=torch.Generator().manual_seed(1))
    masked = torch.full_like(ids, -100)
    masked[:, ::3] = ids[:, ::3]
    classes = torch.tensor([0, 1, 2, 1])
    def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), labels.reshape(-1))

    pretraining = {"labels": masked, "next_sentence_label": classes % 2}  # its masked-LM and next-sentence heads
    for model, labels in ((BertForMaskedLM(BertConfig(**settings)), {"labels": masked}),
                          (BertForSequenceClassification(BertConfig(**settings, num_labels=3)), {"labels": classes}),
                          (BertForPreTraining(BertConfig(**settings)), pretraining)):
        model = model.eval().to(torch.bfloat16)
        with torch.no_grad():
            outputs = model(input_ids=ids)
            assert model(input_ids=ids, **labels).loss.dtype == torch.bfloat16  # transformers' own
        if "next_sentence_label" in labels:
            expected = cross_entropy(outputs.prediction_logits, masked) + cross_entropy(
                outputs.seq_relationship_logits, labels["next_sentence_label"])
        else:
            expected = cross_entropy(outputs.logits, labels["labels"])
        loss = evaluate_loss(model, [{"input_ids": ids, **labels}])[0]
        assert math.isclose(loss, float(expected), rel_tol=1e-6), (type(model).__name__, loss, float(expected))
        assert all(not module._forward_hooks for module in model.modules())  # the float32 heads are undone


def test_a_start_that_ties_looks_further_out_before_walking_down():
    """A loss curve flat within rounding at the start (0.03) that falls further out: the walk down met two ties
    and kept step 0 (a byte GPT-2 lost its gain at step 1.92 in the candidates benchmark). Where the steps above the
    start lose, the walk down runs as before."""
    def falling_far_out(best: float):
        return lambda step: LOSS - 0.01 * (step / best) * (2 - step / best) if step > best / 1000 else LOSS

    for best in (1.0, 30.0):
        losses = search_step_size(falling_far_out(best), start=0.03)
        assert best / 1.5 < best_step(losses) < best * 1.5, (best, best_step(losses))

    def only_losing(step: float) -> float:
        return LOSS + step if step > 0.05 else LOSS

    losses = search_step_size(only_losing, start=0.03)
    assert best_step(losses) == 0.0 and sorted(losses) == [0.0, 0.0075, 0.03, 0.12]  # one step up, two down


def test_a_half_precision_models_step_needs_a_neighbour_that_gains_too():
    """A bfloat16 MiniLM's line search (session 34) took t = 9.2e-7 for a "gain" of 0.005 that its neighbours, worse
    than step 0, did not share: the rounding of its arithmetic. In half precision a step counts only with a
    searched neighbour that gains too; a smooth curve's best step has them."""
    noisy = {0.0: 4.734832048416138, 4.57763671875e-07: 4.7417484521865845, 6.473755931273324e-07: 4.751128911972046,
             9.1552734375e-07: 4.729671001434326, 1.2947511862546647e-06: 4.743434727191925,
             1.8310546875e-06: 4.7541691064834595, 3.662109375e-06: 4.743927538394928,
             7.32421875e-06: 4.749161183834076, 1.46484375e-05: 4.749799728393555, 2.9296875e-05: 4.741724133491516,
             5.859375e-05: 4.741950631141663, 0.0001171875: 4.739607810974121, 0.000234375: 4.736051440238953}
    assert best_step(noisy) == 9.1552734375e-07 and best_step(noisy, confirmed=True) == 0.0
    smooth = search_step_size(lambda step: LOSS - 0.01 * step * (2 - step), start=0.03)
    assert best_step(smooth, confirmed=True) == best_step(smooth) != 0.0
    alone = {0.0: LOSS, 0.5: LOSS - 0.01, 1.0: LOSS + 0.01, 0.25: LOSS + 0.02}  # a gain whose neighbours both lose
    assert best_step(alone) == 0.5 and best_step(alone, confirmed=True) == 0.0
