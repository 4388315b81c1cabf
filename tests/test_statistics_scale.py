"""Statistics at scale on one process: several passes within a memory budget, gradient checkpointing, wrapped
models, half precision and autocast, non-finite values named by layer and batch."""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_grow import collect_statistics, get_adapter, grow_model
from hf_grow.statistics import collector as collector_module
from hf_grow.statistics import layer_groups, parse_bytes, statistics_bytes
from hf_grow.statistics.collector import checkpoint

from conftest import lm_batches, tiny_gpt2_config


@pytest.fixture(scope="module")
def three_layers() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config(n_layer=3)).eval()


def assert_same_statistics(first, second, rtol: float = 0.0) -> None:
    assert (first.num_tokens, first.num_batches) == (second.num_tokens, second.num_batches)
    for ours, theirs in zip(first.second_moments + first.gradients, second.second_moments + second.gradients):
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=0.0)


def test_memory_plan():
    width = 65
    assert statistics_bytes(3, 4, 64) == 8 * width**2 * (3 + 3 * 4)
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("1.5 GiB") == 3 * 2**29 and parse_bytes(4096) == 4096
    one_layer = statistics_bytes(3, 4, 64, 2)  # C of all layers, M of one layer and of the batch's product
    assert layer_groups(3, 4, 64, None) == [[0, 1, 2]]
    assert layer_groups(3, 4, 64, one_layer) == [[0], [1], [2]]
    assert layer_groups(3, 4, 64, statistics_bytes(3, 4, 64, 3)) == [[0, 1], [2]]
    assert layer_groups(3, 4, 64, statistics_bytes(3, 4, 64, 4)) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="raise the budget"):
        layer_groups(3, 4, 64, one_layer - 1)
    for bad in ("2 parsecs", "GB", "-1GB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="positive"):
        parse_bytes(0)


@pytest.mark.parametrize("layers_per_pass", [1, 2])
def test_several_passes_equal_one_pass_exactly(three_layers, stdlib_bytes, layers_per_pass):
    model, adapter = three_layers, get_adapter(three_layers)
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=4, seed=41)
    one_pass = collect_statistics(model, batches, adapter, compute_dtype=torch.float64)
    budget = statistics_bytes(3, 4, 64, layers_per_pass + 1)
    passes = collect_statistics(model, batches, adapter, compute_dtype=torch.float64, memory_budget=budget)
    assert_same_statistics(passes, one_pass)  # bit for bit: every pass computes the same products
    dataloader = torch.utils.data.DataLoader(batches, batch_size=None)
    from_dataloader = collect_statistics(model, dataloader, adapter, compute_dtype=torch.float64, memory_budget=budget)
    assert_same_statistics(from_dataloader, one_pass)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_passes_and_recomputations_equal_one_pass_exactly(three_layers, stdlib_bytes, dtype):
    """The reference method formed float32 scores only in the layers a pass collects: in half precision each pass of
    a memory_budget ran another function (bfloat16: a false "the data changed" error; float16: M 5e-4 off one pass),
    and a checkpointed layer's recomputation another than its forward (a raw CheckpointError)."""
    model = copy.deepcopy(three_layers).to(dtype)
    adapter = get_adapter(model)
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=4, seed=41)
    one_pass = collect_statistics(model, batches, adapter, method="reference")
    budget = statistics_bytes(3, 4, 64, 2)  # one layer a pass
    passes = collect_statistics(model, batches, adapter, method="reference", memory_budget=budget)
    assert_same_statistics(passes, one_pass)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_same_statistics(collect_statistics(model, batches, adapter, method="reference"), one_pass)


def test_several_passes_need_the_same_data_each_time(three_layers, stdlib_bytes):
    model, adapter = three_layers, get_adapter(three_layers)
    budget = statistics_bytes(3, 4, 64, 2)
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=42)
    with pytest.raises(ValueError, match="one-shot iterator"):
        collect_statistics(model, iter(batches), adapter, memory_budget=budget)

    class FreshDraws:
        """Re-iterable, but with new random windows on every pass (like random masking in a collator)."""

        def __init__(self):
            self.seed = 0

        def __iter__(self):
            self.seed += 1
            return iter(lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=self.seed))

    with pytest.raises(ValueError, match="the data changed between passes"):
        collect_statistics(model, FreshDraws(), adapter, memory_budget=budget)

    class MaskedAnew:
        """Labels masked anew on every pass (a masked-LM collator): refused at the first batch pass 1 had no match
        for, not after the whole second pass."""

        def __init__(self):
            self.served = []

        def __iter__(self):
            self.served.append(0)
            generator = torch.Generator().manual_seed(len(self.served))
            for batch in lm_batches(stdlib_bytes["stats"], 6, batch_size=4, seed=42):
                self.served[-1] += 1
                yield {**batch, "labels": batch["labels"].masked_fill(
                    torch.rand(batch["labels"].shape, generator=generator) < 0.5, -100)}

    masked = MaskedAnew()
    with pytest.raises(ValueError, match=r"batch 0 of statistics 2/\d has \d+ loss terms, more batches of that many"):
        collect_statistics(model, masked, adapter, memory_budget=budget)
    assert masked.served == [6, 1]


def test_grow_model_with_a_memory_budget_equals_one_pass(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=4, seed=43)
    eval_batches = lm_batches(stdlib_bytes["eval"], 2, batch_size=4, seed=44)
    kwargs = dict(p=8, eval_dataloader=eval_batches, step_size=0.05, compute_dtype=torch.float64)
    kwargs.update(measure_realized_gains=False)
    one_pass = grow_model(trained_gpt2, batches, **kwargs)
    # C of 2 layers: 68 kB, M: 135 kB per layer; 340 kB hold C and M of one layer and of the batch: 2 passes.
    passes = grow_model(trained_gpt2, batches, memory_budget="340kB", **kwargs)
    assert passes.growth_report.eval_loss_after == one_pass.growth_report.eval_loss_after
    for name, tensor in one_pass.state_dict().items():
        assert torch.equal(passes.state_dict()[name], tensor), name


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_statistics(trained_gpt2, stdlib_bytes, monkeypatch, use_reentrant):
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=45)
    adapter = get_adapter(trained_gpt2)
    plain = {
        method: collect_statistics(trained_gpt2, batches, adapter, compute_dtype=torch.float64, method=method)
        for method in ("chunked", "reference")
    }
    model = GPT2LMHeadModel(trained_gpt2.config)
    model.load_state_dict(trained_gpt2.state_dict())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.eval()  # checkpointing is for training; the statistics use it in eval mode too
    block = model.transformer.h[0]
    original_function = block._gradient_checkpointing_func
    runs = []

    def counting_checkpoint(function, *args, **kwargs):
        def run(*inner_args, **inner_kwargs):
            runs.append(1)
            return function(*inner_args, **inner_kwargs)

        return checkpoint(run, *args, **kwargs)

    monkeypatch.setattr(collector_module, "checkpoint", counting_checkpoint)
    for method in ("chunked", "reference"):
        runs.clear()
        checkpointed = collect_statistics(model, batches, adapter, compute_dtype=torch.float64, method=method)
        assert len(runs) == 2 * 2 * len(batches)  # 2 layers, each run in forward and again in backward
        assert_same_statistics(checkpointed, plain[method])
    assert block._gradient_checkpointing_func is original_function and block.gradient_checkpointing
    assert not model.training and not block.training and model.config.use_cache


@pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="torch's per-backend precision: 2.9 on")
def test_the_matmul_precision_set_per_backend_is_kept_and_restored(three_layers, stdlib_bytes):
    """transformers' ``TrainingArguments(tf32=...)`` sets the precision per backend: the statistics read it with the
    global getter, which then raises (every pass crashed), and restored it with the global setter, which pins every
    backend (a generic setting made after a growth reached none of them)."""
    model, adapter = three_layers, get_adapter(three_layers)
    batches = lm_batches(stdlib_bytes["stats"], 1, batch_size=2, seed=47)
    backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)

    def settings() -> list[str]:
        return [torch.backends.fp32_precision, *(backend.fp32_precision for backend in backends)]

    try:
        for backend in backends:
            backend.fp32_precision = "none"  # follow the generic setting, as in a fresh process
        collect_statistics(model, batches, adapter, tf32=True)
        assert settings() == ["none", "none", "none"]
        torch.backends.fp32_precision = "tf32"
        assert settings() == ["tf32", "tf32", "tf32"]
        collect_statistics(model, batches, adapter, tf32=False)
        assert settings() == ["tf32", "tf32", "tf32"]
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        collect_statistics(model, batches, adapter, tf32=True)
        assert settings() == ["tf32", "ieee", "tf32"]
    finally:
        torch.backends.fp32_precision = "none"
        for backend in backends:
            backend.fp32_precision = "none"
    assert torch.get_float32_matmul_precision() == "highest"


def test_wrapped_models_are_unwrapped(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=46)
    plain = collect_statistics(trained_gpt2, batches, get_adapter(trained_gpt2), compute_dtype=torch.float64)
    wrapped = torch.nn.DataParallel(trained_gpt2)  # `.module`, like DistributedDataParallel (tested with 2 processes)
    unwrapped = collect_statistics(wrapped, batches, get_adapter(trained_gpt2), compute_dtype=torch.float64)
    assert_same_statistics(unwrapped, plain)
    grown = grow_model(wrapped, batches, p=8, step_size=0.0)
    assert grown.config.qk_head_dims == [24, 24]


def test_non_finite_inputs_name_the_layer_and_batch(gpt2_copy, stdlib_bytes):
    """By the dataloader's index, as the batch checks do: after a skipped batch (no loss term) the error named the
    batch before the bad one."""
    model = gpt2_copy
    calls = []

    def nan_after_layer_zero_on_second_batch(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            return output * float("nan")  # a GPT2Block returns its hidden states

    handle = model.transformer.h[0].register_forward_hook(nan_after_layer_zero_on_second_batch)
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=2)
    skipped = {**batches[0], "labels": torch.full_like(batches[0]["labels"], -100)}  # no forward pass: skipped
    with pytest.raises(FloatingPointError, match="inputs to the attention of layer 1 at batch 2"):
        collect_statistics(model, [skipped, *batches], get_adapter(model))
    handle.remove()


def test_non_finite_gradients_with_a_finite_loss_name_the_layer_and_batch(gpt2_copy, stdlib_bytes):
    model = gpt2_copy
    calls = []

    def nan_gradient_on_second_batch(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            output.register_hook(lambda grad: grad * float("nan"))

    handle = model.transformer.h[1].register_forward_hook(nan_gradient_on_second_batch)
    with pytest.raises(FloatingPointError, match="score gradients in layer 1 at batch 1"):
        collect_statistics(model, lm_batches(stdlib_bytes["stats"], 3, batch_size=2), get_adapter(model))
    handle.remove()


def test_autocast_does_not_lower_the_statistics_precision(trained_gpt2, stdlib_bytes):
    """Under the caller's bfloat16 autocast the model runs in bf16, but the products stay in compute_dtype."""
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=47)
    adapter = get_adapter(trained_gpt2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        single = collect_statistics(trained_gpt2, batches, adapter, compute_dtype=torch.float32)
        double = collect_statistics(trained_gpt2, batches, adapter, compute_dtype=torch.float64)
    for layer in range(2):
        error = (single.gradients[layer] - double.gradients[layer]).norm() / double.gradients[layer].norm()
        assert error < 1e-5  # bf16 products would be ~1e-2 away


def test_a_float16_models_score_gradients_keep_float32_digits():
    """The reference method (what "auto" takes on a CPU for short batches, and for eager models) hooked scores formed
    in the model's float16: their gradients came rounded to float16, M of the last layer 5.9e-2 off the float64
    model's, where the chunked method's float32 recomputation is 4.2e-3 off (review rK of session 33's case)."""
    torch.manual_seed(0)
    vocab = 60

    def batch(size: int, length: int, padded: bool) -> dict:
        ids, mask = torch.randint(1, vocab, (size, length)), torch.ones(size, length, dtype=torch.long)
        for row in range(size if padded else 0):
            mask[row, length - (row * 3) % (length // 2):] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=256)).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        model(**batch(8, 64, padded=False)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    batches = [batch(8, 128, padded=True) for _ in range(4)]
    exact = collect_statistics(copy.deepcopy(model).double(), batches, get_adapter(model), compute_dtype=torch.float64)
    half = model.half()
    reference, chunked = (collect_statistics(half, batches, get_adapter(half), method=method)
                          for method in ("reference", "chunked"))
    for layer in range(2):
        errors = [float((sums.mean_gradient(layer) - exact.mean_gradient(layer)).norm()
                        / exact.mean_gradient(layer).norm()) for sums in (reference, chunked)]
        assert errors[0] < 2 * errors[1], (layer, errors)


def test_bfloat16_model_grows(trained_gpt2, stdlib_bytes):
    model = GPT2LMHeadModel(trained_gpt2.config).to(torch.bfloat16)
    model.load_state_dict(trained_gpt2.state_dict())
    batches = lm_batches(stdlib_bytes["stats"], 6, seed=48)
    eval_batches = lm_batches(stdlib_bytes["eval"], 3, seed=49)
    grown = grow_model(model, batches, p=8, eval_dataloader=eval_batches, measure_realized_gains=False)
    report = grown.growth_report
    assert grown.dtype == torch.bfloat16 and grown.config.qk_head_dims == [24, 24]
    assert report.step_size > 0 and report.eval_loss_after < report.eval_loss_before - 1e-3


def live_layer_tensors(entries: int) -> int:
    """Live tensors with at least ``entries`` entries (one layer's M: heads x d x d), found by the garbage
    collector."""
    import gc

    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.numel() >= entries)


@pytest.mark.parametrize("layers", [2, 4])
def test_the_grouped_solve_frees_each_groups_m_and_keeps_no_square_tensor(stdlib_bytes, monkeypatch, layers):
    """One layer per pass: while a layer is solved, the live (heads, d, d) tensors are that layer's M and the
    solve's own, as many with 4 layers as with 2; after it, the statistics hold no M and the problem no tensor of
    that size (d = 129, 8 heads of 16 dims grown to 24: compact subspaces of 16 + 88 to 16 + 112 < 129 columns)."""
    from hf_grow.growth import GrowthProblem, layer_solve

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=layers, n_embd=128, n_head=8)).eval()
    adapter, size = get_adapter(model), 129
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=46)
    layer_size = 8 * size * size
    baseline = live_layer_tensors(layer_size)  # the model's own weights and the data
    counts = []
    direction = layer_solve.linalg.solve_direction_in_basis

    def counting_direction(*args, **kwargs):  # inside the solve of a chunk of heads: M of the layer is live
        result = direction(*args, **kwargs)
        counts.append(live_layer_tensors(layer_size) - baseline)
        return result

    monkeypatch.setattr(layer_solve.linalg, "solve_direction_in_basis", counting_direction)
    problems = []

    def solve_group(statistics, group):
        if not problems:
            problems.append(GrowthProblem(model, adapter, statistics, [24] * layers, "whitened", 1e-6, "eigh",
                                          layers=group, release=True))
        else:
            problems[0].solve_layers(group)
        assert all(statistics.gradients[layer] is None for layer in group)

    statistics = collect_statistics(model, batches, adapter, memory_budget=statistics_bytes(layers, 8, 128, 2),
                                    on_group=solve_group)
    assert len(counts) == layers and all(gradient is None for gradient in statistics.gradients)
    assert max(counts) <= 4  # the layer's M, its float64 mean (and the view of it that is solved) and its P
    test_the_grouped_solve_frees_each_groups_m_and_keeps_no_square_tensor.peaks[layers] = max(counts)
    if len(test_the_grouped_solve_frees_each_groups_m_and_keeps_no_square_tensor.peaks) == 2:
        assert len(set(test_the_grouped_solve_frees_each_groups_m_and_keeps_no_square_tensor.peaks.values())) == 1
    problem = problems[0]
    assert problem.weights(0.1)[layers - 1][0].shape[-1] == 24
    for part in problem.layers:
        kept = [getattr(part.target, name) for name in ("left_basis", "right_basis", "base_core",
                                                                       "step_core", "gradient_core")]
        assert 16 + 88 <= part.target.width < size  # s from its minimum to below the width
        assert all(tensor.numel() < layer_size for tensor in kept)


test_the_grouped_solve_frees_each_groups_m_and_keeps_no_square_tensor.peaks = {}


def test_float64_products_that_overflow_float32_sums_name_the_layer_and_batch():
    """Products computed in float64 into M accumulated in float32: finite products beyond float32's range are
    not let into M as Inf without a word; products within it are added as before."""
    from hf_grow.statistics.collector import Sums

    sums = Sums(2, 3, 5, [0], False, torch.device("cpu"), float16=False, accumulate_dtype=torch.float32)
    product = torch.randn(3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sums.add_gradient(0, product)
    torch.testing.assert_close(sums.gradients[0], product.float(), rtol=0, atol=0)
    sums.batch_number = 4
    with pytest.raises(FloatingPointError, match="layer 0 overflowed torch.float32 at batch 4: accumulate in float64"):
        sums.add_gradient(0, torch.full((3, 5, 5), 1e39, dtype=torch.float64))


@pytest.mark.parametrize("option", ["compute_dtype", "accumulate_dtype"])
def test_a_dtype_given_as_a_string_is_refused_with_the_torch_dtype_to_pass(option, three_layers):
    """GrowthConfig takes "float64"; collect_statistics takes torch dtypes (it said "got float64")."""
    model = three_layers
    with pytest.raises(ValueError, match=rf"{option} must be torch.float32 or torch.float64 \(a torch dtype: "
                                         r"torch.float64\), got 'float64'"):
        collect_statistics(model, [], get_adapter(model), **{option: "float64"})
