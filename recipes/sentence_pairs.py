"""Real sentence-embedding data and loss for BERT encoders: docstring -> code pairs from Python's own sources.

all-MiniLM-L6-v2 was trained with an in-batch contrastive loss (MultipleNegativesRankingLoss) on pair data that
includes docstring/code pairs (CodeSearchNet). The standard library gives the same kind of pairs offline:
each documented function's docstring, and its code with the docstring removed. The loss below is the model's
own training objective, so a held-out decrease means the grown model embeds unseen pairs better.

    from recipes.sentence_pairs import docstring_code_pairs, pair_batches, contrastive_loss
"""

from __future__ import annotations

import ast
import glob
import os
import random
import sysconfig
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def stdlib_files() -> list[str]:
    """The standard library's top-level ``.py`` files, sorted (the same list on every machine with this Python)."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def docstring_code_pairs(files: Sequence[str], min_doc_chars: int = 40) -> list[tuple[str, str]]:
    """(docstring, code without the docstring) for every documented function or method in ``files``."""
    pairs = []
    for path in files:
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            docstring = ast.get_docstring(node)
            if not docstring or len(docstring) < min_doc_chars or len(node.body) < 2:
                continue
            node.body = node.body[1:]
            pairs.append((" ".join(docstring.split()), ast.unparse(node)))
    return pairs


def pair_batches(
    pairs: Sequence[tuple[str, str]], tokenizer, batch_size: int = 16, max_length: int = 64
) -> list[dict[str, Tensor]]:
    """Batches of ``2 * batch_size`` sequences: the docstrings, then their code, in one padded forward pass."""
    batches = []
    for start in range(0, len(pairs) - batch_size + 1, batch_size):
        chunk = pairs[start : start + batch_size]
        texts = [doc for doc, _ in chunk] + [code for _, code in chunk]
        encoded = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        batches.append({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    return batches


def pair_splits(tokenizer, counts: Mapping[str, int], batch_size: int = 16, max_length: int = 64) -> dict[str, list]:
    """``{name: pair batches}`` from disjoint thirds of the standard library's files (by position in ``counts``),
    each shuffled with a fixed seed, ``counts[name]`` batches each."""
    files = stdlib_files()
    splits = {}
    for offset, (name, count) in enumerate(counts.items()):
        pairs = docstring_code_pairs(files[offset::3])
        random.Random(0).shuffle(pairs)
        splits[name] = pair_batches(
            pairs[: batch_size * count], tokenizer, batch_size=batch_size, max_length=max_length
        )
    return splits


def mean_pooled(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the token embeddings over real tokens, L2-normalised (all-MiniLM-L6-v2's sentence embedding)."""
    mask = attention_mask[..., None].to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=-2) / mask.sum(dim=-2).clamp_min(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def contrastive_loss(model, batch: Mapping[str, Tensor], scale: float = 20.0) -> Tensor:
    """In-batch contrastive loss (MultipleNegativesRankingLoss): docstring i must pick code i among the batch."""
    embeddings = mean_pooled(model(**batch).last_hidden_state, batch["attention_mask"])
    queries, documents = embeddings.float().chunk(2)
    scores = scale * queries @ documents.T
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(queries), device=scores.device))
