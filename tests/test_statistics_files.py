"""Statistics saved to files and given to grow_model: exact round trips, other files and damaged ones refused,
sums stored in float32 solved in float64, non-finite sums and held-out losses refused."""

import dataclasses
import re

import pytest
import torch

from hf_grow import collect_statistics, get_adapter, grow_model

from test_growth import data  # noqa: F401 (the fixture)


def test_statistics_round_trip_through_safetensors(trained_gpt2, data, tmp_path):  # noqa: F811
    """Saved statistics (safetensors, no pickle) reload exactly and grow the same model; foreign files are refused."""
    from transformers import BertConfig, BertModel

    from hf_grow import GrowthStatistics

    statistics = collect_statistics(trained_gpt2, data["stats"][:3], get_adapter(trained_gpt2))
    path = tmp_path / "stats.safetensors"
    statistics.save(path)
    loaded = GrowthStatistics.load(path)
    assert (loaded.num_tokens, loaded.num_batches, loaded.model_type) == (statistics.num_tokens, 3, "gpt2")
    assert loaded.loss_weight == statistics.loss_weight == 3 * 16 * 63  # every shifted label of 3 full batches
    assert loaded.method == statistics.method == "reference"  # "auto" on a CPU at 64 tokens
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.gradients + loaded.second_moments, statistics.gradients + statistics.second_moments)
    )
    direct = grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=statistics)
    reloaded = grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=loaded)
    assert reloaded.growth_report.statistics_method == "reference"
    assert all(torch.equal(tensor, reloaded.state_dict()[name]) for name, tensor in direct.state_dict().items())
    bert = BertModel(
        BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    )
    with pytest.raises(ValueError, match="collected on a 'gpt2' model, not 'bert'"):
        grow_model(bert, None, p=8, step_size=0.0, statistics=loaded)
    (tmp_path / "weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read statistics"):
        GrowthStatistics.load(tmp_path / "weights.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not an hf_grow statistics file"):
        GrowthStatistics.load(tmp_path / "other.safetensors")
    # Damaged files of the format: a ValueError naming what is wrong (were KeyErrors, or NaN in the solve).
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    damaged = {
        "lacks ['gradients.1']": ({k: v for k, v in tensors.items() if k != "gradients.1"}, metadata),
        "lacks ['num_tokens']": (tensors, {k: v for k, v in metadata.items() if k != "num_tokens"}),
        "are not all positive": (tensors, {**metadata, "loss_weight": "0"}),
    }
    for message, (kept, meta) in damaged.items():
        save_file(kept, tmp_path / "damaged.safetensors", metadata=meta)
        with pytest.raises(ValueError, match=re.escape(message)):
            GrowthStatistics.load(tmp_path / "damaged.safetensors")
    # Files written before M was weighted by loss terms (no loss_weight) summed batch means: M / batches.
    batch_means = [gradient / (16 * 63) for gradient in statistics.gradients]
    unweighted = dataclasses.replace(statistics, gradients=batch_means, loss_weight=None)
    unweighted.save(tmp_path / "old.safetensors")
    old = GrowthStatistics.load(tmp_path / "old.safetensors")
    assert old.loss_weight is None
    torch.testing.assert_close(old.mean_gradient(1), statistics.mean_gradient(1), rtol=1e-12, atol=0)


def test_precomputed_statistics_are_checked_and_used_in_float64(trained_gpt2, data):  # noqa: F811
    """Sums stored in float32 (e.g. saved so) are solved in float64; NaN statistics are refused."""
    statistics = collect_statistics(trained_gpt2, data["stats"][:3], get_adapter(trained_gpt2))

    def converted(given, dtype):
        return dataclasses.replace(
            given,
            second_moments=[tensor.to(dtype) for tensor in given.second_moments],
            gradients=[tensor.to(dtype) for tensor in given.gradients],
        )

    in_float32 = converted(statistics, torch.float32)
    rounded = converted(in_float32, torch.float64)  # the same numbers, stored in float64
    from_float32, from_rounded = (
        grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=given) for given in (in_float32, rounded)
    )
    for name, tensor in from_rounded.state_dict().items():
        assert torch.equal(from_float32.state_dict()[name], tensor), name
    broken = dataclasses.replace(statistics, gradients=[tensor.clone() for tensor in statistics.gradients])
    broken.gradients[1][2, 3, 4] = float("nan")
    with pytest.raises(FloatingPointError, match="the statistics of layer 1 hold NaN or Inf"):
        grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=broken)
    halves = collect_statistics(trained_gpt2, data["stats"][:3], get_adapter(trained_gpt2), cross_fit=True)
    halves.half_gradients[0][1, 2, 3] = float("inf")  # refused as M is, naming the layer (was: in the solve)
    with pytest.raises(FloatingPointError, match="the statistics of layer 0 hold NaN or Inf"):
        grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=halves, cross_fit=True)
    # A damaged file's later layer of another shape: refused naming it (it failed inside the solve)
    for field, layer, cut in (("gradients", 1, lambda t: t[:3]), ("second_moments", 1, lambda t: t[:20, :20])):
        damaged = dataclasses.replace(statistics, **{field: list(getattr(statistics, field))})
        getattr(damaged, field)[layer] = cut(getattr(damaged, field)[layer])
        with pytest.raises(ValueError, match=f"of layer {layer} with shape .* the file is damaged or of another"):
            grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=damaged)
    flipped = dataclasses.replace(statistics, second_moments=[c * sign for c, sign in zip(statistics.second_moments,
                                                                                           (1, -1))])
    with pytest.raises(ValueError, match="a C of layer 1 with negative diagonal entries"):  # was: "no tokens"
        grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=flipped)
    short = dataclasses.replace(halves, half_gradients=halves.half_gradients[:1])  # an IndexError in the checks
    with pytest.raises(ValueError, match="the statistics hold M's half for 1 layers, where .* has 2"):
        grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=short, cross_fit=True)
    # A held-out loss that is not finite, with a given step too (its report said "nan" before the step).
    with pytest.raises(FloatingPointError, match="the held-out loss is nan before any step"):
        grow_model(trained_gpt2, None, p=8, step_size=0.05, statistics=statistics, eval_dataloader=data["eval"][:1],
                   loss_fn=lambda model, batch: model(**batch).loss * float("nan"))


def test_the_weight_sample_of_a_saved_checkpoint_is_the_loaded_models(trained_gpt2, tmp_path):
    """The command compares --stats with the checkpoint's saved weights before it reads any text: read entry by entry
    from one safetensors file or shards, the sample is the loaded model's, bit for bit; None without safetensors."""
    from hf_grow.statistics import checkpoint_weight_sample, weight_sample

    trained_gpt2.save_pretrained(tmp_path / "one")
    trained_gpt2.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    with torch.device("meta"):
        meta = type(trained_gpt2)(trained_gpt2.config)
    for folder in ("one", "shards"):
        assert torch.equal(checkpoint_weight_sample(meta, tmp_path / folder), weight_sample(trained_gpt2))
    (tmp_path / "empty").mkdir()
    assert checkpoint_weight_sample(meta, tmp_path / "empty") is None
