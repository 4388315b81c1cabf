"""Diagnostic callbacks of bench_growth_callback.py (issue #35): what the optimizer and the split of the new dims do
to the training after growth. Each changes one thing at the growth's step and leaves the rest as the arm it
modifies."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from hf_grow import resize_qk_
from hf_grow.adapters import get_adapter
from hf_grow.growth import write_weights


class MomentRestart(TrainerCallback):
    """The ``restart`` arm: at the end of step ``at``, every Q/K entry's optimizer moments restart at zero (the
    weights, widths and step count unchanged)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.at:
            adapter = get_adapter(model)
            weights = {layer: adapter.read_qk(attention) for layer, attention in
                       enumerate(adapter.attention_modules(model))}
            resize_qk_(model, weights, optimizer, keep_moments=False)


class QueryInitSplit(TrainerCallback):
    """The ``append-query-init`` arm (a diagnostic of the split of the new dims, issue #35): right after the
    growth at step ``at``, each head's p new query dims are scaled by c and its new key dims by 1/c (the function
    unchanged; their optimizer moments are still zero), c such that the new query dims have the norm of a random
    initialisation with standard deviation ``std``, as zero widening's: the balanced split made unbalanced."""

    def __init__(self, at: int, p: int, std: float):
        self.at, self.p, self.std = at, p, std

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step != self.at:
            return
        adapter = get_adapter(model)
        weights = {}
        with torch.no_grad():
            for layer, attention in enumerate(adapter.attention_modules(model)):
                query, key = (weight.clone() for weight in adapter.read_qk(attention))
                new_query = query[..., -self.p:]
                target = self.std * (new_query.shape[1] * self.p) ** 0.5
                scale = (target / new_query.flatten(1).norm(dim=1).clamp_min(1e-30)).view(-1, 1, 1)
                query[..., -self.p:] = new_query * scale
                key[..., -self.p:] = key[..., -self.p:] / scale
                weights[layer] = (query, key)
        write_weights(adapter, model, weights)
