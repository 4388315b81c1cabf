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


def _split_qk(model, p: int) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, (old queries, new queries, old keys, new keys): the last ``p`` dims of each head are the new
    ones (modes "append" and "zero"; in mode "refactor" they are the last of a rewritten basis)."""
    adapter = get_adapter(model)
    parts = []
    for attention in adapter.attention_modules(model):
        query, key = adapter.read_qk(attention)
        parts.append((query[..., :-p], query[..., -p:], key[..., :-p], key[..., -p:]))
    return parts


class NewDimsLR(TrainerCallback):
    """A learning rate ``factor`` times the schedule's for the new Q/K dims after the growth at step ``at`` (a
    diagnostic, issue #35): each optimizer step's change of the new dims (AdamW's decay included) is scaled by
    ``factor``; the old dims, the optimizer state and the function at the growth are unchanged."""

    def __init__(self, at: int, p: int, factor: float):
        self.at, self.p, self.factor = at, p, factor
        self.before = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.before = _split_qk(model, self.p) if state.global_step >= self.at else None

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.before is None:
            return
        adapter = get_adapter(model)
        weights = {}
        for layer, (before, after) in enumerate(zip(self.before, _split_qk(model, self.p))):
            new_query = before[1] + self.factor * (after[1] - before[1])
            new_key = before[3] + self.factor * (after[3] - before[3])
            weights[layer] = (torch.cat([after[0], new_query], -1), torch.cat([after[2], new_key], -1))
        write_weights(adapter, model, weights)


def _project(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """X'W per head, (heads, sequences, positions, dims), for ``inputs`` X' (sequences, positions, d) and ``weight``
    (heads, d or d - 1, dims): architectures without Q/K biases have no ones column."""
    return torch.einsum("btd,hdk->hbtk", inputs[..., : weight.shape[1]], weight)


def _score_norms(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Per head, the Frobenius norm of the pre-softmax scores (X'Q)(X'K)^T of projected queries and keys."""
    return (query @ key.mT).flatten(1).norm(dim=1)


def _gain(projected: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per head, ||X'W||^2 / ||W||^2 from X'W: how much of the data's variance the weight's dims see."""
    return projected.flatten(1).square().sum(1) / weight.flatten(1).square().sum(1)


#: UpdateProbe's windows of optimizer steps after the growth (first and last, inclusive).
PROBE_WINDOWS = ((1, 1), (2, 10), (11, 50), (51, 150))


class UpdateProbe(TrainerCallback):
    """Measures the optimizer's updates of the old and new Q/K dims in the steps after the growth at ``at`` (issue
    #35: the size of the new entries' first Adam updates, and the rate at which the new dims' scores change),
    averaged over layers and then over `PROBE_WINDOWS`:

    - ``step_q_old`` ... ``step_k_new``: mean |change| of an entry per step, in units of the learning rate;
    - ``rel_q_new``, ``rel_k_new``: the new dims' change per step relative to their norm before it;
    - ``score_share``: the new dims' pre-softmax scores (X'Q_new)(X'K_new)ᵀ relative to the old dims' (Frobenius
      norms over all query/key positions of ``sequences`` training sequences, per head, mean over heads), on the
      attention inputs X of the first step after the growth, kept fixed;
    - ``score_rate``: the change per step of the new dims' scores, relative to the old dims' scores;
    - ``score_share_now``: ``score_share`` on the step's own training sequences (the inputs as they are now);
    - ``size_q_new``, ``size_k_new``: the new dims' norm per dim relative to the old dims' (per head);
    - ``gain_q_new``, ``gain_k_new``: ||X'W||² / ||W||² of the new dims relative to the old dims' (per head): below
      1, the new dims' weight lies in directions where the data varies less than where the old dims' lies.
    It changes nothing (one thread per run is deterministic: the losses stay those of the arm without it)."""

    def __init__(self, at: int, p: int, sequences: int = 4):
        self.at, self.p, self.sequences = at, p, sequences
        self.before = None
        self.inputs: dict[int, torch.Tensor] = {}
        self.current: dict[int, torch.Tensor] = {}
        self.handles: list = []
        self.rows: dict[int, dict[str, float]] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step != self.at:
            return
        adapter = get_adapter(model)

        def keep(layer: int, inputs: tuple) -> None:
            x = inputs[0][: self.sequences].detach().to(torch.float64)
            self.current[layer] = torch.cat([x, torch.ones_like(x[..., :1])], -1)
            self.inputs.setdefault(layer, self.current[layer])

        self.handles = [
            adapter.qk_input_module(attention).register_forward_pre_hook(
                lambda module, inputs, layer=layer: keep(layer, inputs))
            for layer, attention in enumerate(adapter.attention_modules(model))
        ]

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        after_growth = self.at <= state.global_step < self.at + PROBE_WINDOWS[-1][1]
        self.before = _split_qk(model, self.p) if after_growth else None

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.before is None:
            return
        lr = optimizer.param_groups[0]["lr"]
        per_layer = []
        for layer, (before, after) in enumerate(zip(self.before, _split_qk(model, self.p))):
            row = {f"step_{name}": (a - b).abs().mean().item() / lr
                   for name, b, a in zip(("q_old", "q_new", "k_old", "k_new"), before, after)}
            for name, index in (("q_new", 1), ("k_new", 3)):
                norm = before[index].norm().item()
                row[f"rel_{name}"] = (after[index] - before[index]).norm().item() / norm if norm else float("nan")
            q_old, q_new, k_old, k_new = (_project(self.inputs[layer], weight) for weight in after)
            old_scores = _score_norms(q_old, k_old)
            new_before = _project(self.inputs[layer], before[1]) @ _project(self.inputs[layer], before[3]).mT
            row["score_share"] = (_score_norms(q_new, k_new) / old_scores).mean().item()
            row["score_rate"] = ((q_new @ k_new.mT - new_before).flatten(1).norm(dim=1) / old_scores).mean().item()
            now = [_project(self.current[layer], weight) for weight in after]
            row["score_share_now"] = (_score_norms(now[1], now[3]) / _score_norms(now[0], now[2])).mean().item()
            for name, (old, new, seen_old, seen_new) in (("q", (after[0], after[1], q_old, q_new)),
                                                         ("k", (after[2], after[3], k_old, k_new))):
                old_norm, new_norm = old.flatten(1).norm(dim=1), new.flatten(1).norm(dim=1)
                row[f"size_{name}_new"] = (new_norm / old_norm).mean().item() * (old.shape[-1] / new.shape[-1]) ** 0.5
                row[f"gain_{name}_new"] = (_gain(seen_new, new) / _gain(seen_old, old)).mean().item()
            per_layer.append(row)
        if state.global_step + 1 - self.at == PROBE_WINDOWS[-1][1]:
            for handle in self.handles:
                handle.remove()
        self.rows[state.global_step + 1 - self.at] = {
            name: sum(row[name] for row in per_layer) / len(per_layer) for name in per_layer[0]}

    def summary(self) -> dict[str, dict[str, float]]:
        """Each measure's mean over each window of steps after the growth ("first-last")."""
        windows = {}
        for first, last in PROBE_WINDOWS:
            rows = [row for step, row in self.rows.items() if first <= step <= last]
            if rows:
                windows[f"{first}-{last}"] = {name: sum(row[name] for row in rows) / len(rows) for name in rows[0]}
        return windows
