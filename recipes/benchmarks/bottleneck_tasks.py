"""The learning-speed benchmark's retrieval tasks (`bench_bottleneck.py`): the easy key -> value lookup with fixed
random embeddings, and the plateau task with learned ones, each a `progressive_gpt2.Task` whose batches come
from seeds of their own."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from progressive_gpt2 import Task  # noqa: E402

from hf_grow import GrownGPT2Config, GrownGPT2LMHeadModel  # noqa: E402


def seeded_batches(
    sample: Callable[[int, torch.Generator], dict], batch_size: int, eval_batches: int
) -> tuple[Callable[[int], dict], Callable[[int, int], list[dict]], list[dict]]:
    """A task's training batch of each step, the batches drawn at a growth step, and its evaluation batches
    (256 sequences each), each from seeds of their own: every variant and seed sees the same data."""

    def train_batch(step: int) -> dict:
        return sample(batch_size, torch.Generator().manual_seed(step))

    def growth_batches(step: int, count: int) -> list[dict]:
        generator = torch.Generator().manual_seed(10**6 + step)
        return [sample(batch_size, generator) for _ in range(count)]

    evaluation = [sample(256, torch.Generator().manual_seed(2**31 - 1 - index)) for index in range(eval_batches)]
    return train_batch, growth_batches, evaluation


def answer_accuracy(
    evaluation: list[dict], answers: Callable[[GrownGPT2LMHeadModel, dict], tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[GrownGPT2LMHeadModel], dict[str, float]]:
    """A task's accuracy: the share of the evaluation batches' answers the model gets right, ``answers(model,
    batch)`` giving the predicted and the true answers of a batch already on the model's device."""

    def accuracy(model: GrownGPT2LMHeadModel) -> dict[str, float]:
        device = next(model.parameters()).device
        correct = total = 0
        model.eval()
        with torch.no_grad():
            for batch in evaluation:
                predicted, target = answers(model, {key: value.to(device) for key, value in batch.items()})
                correct += int((predicted == target).sum())
                total += target.numel()
        return {"accuracy": correct / total}

    return accuracy


def retrieval_task(
    keys: int, values: int, pairs: int, n_embd: int, n_head: int, batch_size: int, eval_batches: int
) -> Task:
    """Key -> value retrieval in one attention layer (see the module docstring), given as ``inputs_embeds``.

    Sequences: ``pairs`` stored (key, value) positions with distinct keys, the query position, and one more
    position whose label is the value stored under the query key (GPT-2 predicts position t + 1 at t).
    """
    if pairs > keys:
        raise ValueError(f"pairs ({pairs}) must not exceed keys ({keys}): stored keys are distinct")
    tables = torch.Generator().manual_seed(12345)
    scale = 2 / math.sqrt(n_embd)
    key_table = torch.randn(keys, n_embd, generator=tables) * scale
    value_table = torch.randn(values, n_embd, generator=tables) * scale
    query_marker = torch.randn(n_embd, generator=tables) * scale
    config = GrownGPT2Config(
        vocab_size=values, n_positions=pairs + 2, n_embd=n_embd, n_layer=1, n_head=n_head, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )

    def sample(count: int, generator: torch.Generator) -> dict:
        stored = torch.stack([torch.randperm(keys, generator=generator)[:pairs] for _ in range(count)])
        stored_values = torch.randint(0, values, (count, pairs), generator=generator)
        picked = torch.randint(0, pairs, (count,), generator=generator)
        rows = torch.arange(count)
        query, answer = stored[rows, picked], stored_values[rows, picked]
        embeddings = torch.cat(
            [
                key_table[stored] + value_table[stored_values],
                (key_table[query] + query_marker)[:, None],
                torch.zeros(count, 1, n_embd),
            ],
            dim=1,
        )
        labels = torch.full((count, pairs + 2), -100)
        labels[:, -1] = answer
        return {"inputs_embeds": embeddings, "labels": labels}

    train_batch, growth_batches, evaluation = seeded_batches(sample, batch_size, eval_batches)

    def answers(model: GrownGPT2LMHeadModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return model(inputs_embeds=batch["inputs_embeds"]).logits[:, -2].argmax(-1), batch["labels"][:, -1]

    accuracy = answer_accuracy(evaluation, answers)

    return Task(config, train_batch, growth_batches, evaluation, accuracy)


def plateau_task(
    keys: int, values: int, pairs: int, queries: int, n_embd: int, n_head: int, batch_size: int, eval_batches: int,
    n_inner: int | None = None,
) -> Task:
    """Key -> value retrieval with learned embeddings, where training itself stalls on a loss plateau.

    Each sequence stores ``pairs`` (key, value) pairs with distinct keys out of ``keys``, one per position
    (embedded as the sum of the model's own learned token embeddings of the key and of the value), then asks
    ``queries`` of the stored keys, one per position (the key's embedding plus a learned query marker's); the
    loss is the cross-entropy of the value at each query position. Until the query/key embeddings and W_Q, W_K
    align, attention is near-uniform and the loss sits at about log(values): a plateau of hundreds of steps.
    ``n_inner`` is the MLP width (the lookup needs none; a narrow one keeps the preset cheap).
    """
    if pairs > keys or queries > pairs:
        raise ValueError(f"need queries ({queries}) <= pairs ({pairs}) <= keys ({keys}): stored keys are distinct")
    marker = keys + values
    config = GrownGPT2Config(
        vocab_size=keys + values + 1, n_positions=pairs + queries, n_embd=n_embd, n_layer=1, n_head=n_head,
        n_inner=n_inner, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )

    def sample(count: int, generator: torch.Generator) -> dict:
        stored = torch.stack([torch.randperm(keys, generator=generator)[:pairs] for _ in range(count)])
        stored_values = torch.randint(0, values, (count, pairs), generator=generator)
        asked = torch.stack([torch.randperm(pairs, generator=generator)[:queries] for _ in range(count)])
        labels = torch.full((count, pairs + queries), -100)
        labels[:, pairs:] = keys + stored_values.gather(1, asked)
        return {
            "input_ids": torch.cat([stored, stored.gather(1, asked)], 1),
            "value_ids": torch.cat([keys + stored_values, torch.full((count, queries), marker)], 1),
            "labels": labels,
        }

    def logits(model: GrownGPT2LMHeadModel, batch: dict) -> torch.Tensor:
        """The logits at the query positions (the last ``queries``): the LM head runs only there."""
        embed = model.get_input_embeddings()
        inputs = embed(batch["input_ids"]) + embed(batch["value_ids"])
        return model(inputs_embeds=inputs, logits_to_keep=queries).logits

    def loss_fn(model: GrownGPT2LMHeadModel, batch: dict) -> torch.Tensor:
        scores = logits(model, batch)
        return torch.nn.functional.cross_entropy(scores.flatten(0, 1).float(), batch["labels"][:, pairs:].flatten())

    train_batch, growth_batches, evaluation = seeded_batches(sample, batch_size, eval_batches)
    def answers(model: GrownGPT2LMHeadModel, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return logits(model, batch).argmax(-1), batch["labels"][:, pairs:]

    accuracy = answer_accuracy(evaluation, answers)

    return Task(config, train_batch, growth_batches, evaluation, accuracy, loss_fn)
