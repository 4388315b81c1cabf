"""The fused Triton kernels of ``method="triton"``, run by Triton's interpreter on the CPU (conftest sets
TRITON_INTERPRET=1): the same products as autograd and as the reference path, with every kind of mask."""

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, GPT2LMHeadModel


pytest.importorskip("triton", reason="triton has wheels for Linux x86_64 only (the `test` extra installs it there)")

from hf_grow import collect_statistics, get_adapter, grow_model  # noqa: E402
from hf_grow.statistics import collect, triton_kernels  # noqa: E402
from hf_grow.statistics import triton_available  # noqa: E402
from hf_grow.statistics.triton_kernels import score_gradient_products_fused  # noqa: E402

from conftest import tiny_gpt2_config  # noqa: E402
from test_statistics import attention_problem, left_padded_batch_with_every_label, masked_causal_batch


def relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return float((ours.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("mask_kind", ["causal", "boolean", "additive", "none"])
def test_fused_products_equal_autograd(mask_kind):
    (query, key, value, grad_output, inputs, mask, scaling, causal), expected = attention_problem(mask_kind)
    single = [t.float() for t in (query, key, value, grad_output, inputs)]
    if mask is not None and mask.is_floating_point():
        mask = mask.float()
    fused = score_gradient_products_fused(*single, mask, scaling, causal)
    assert fused.dtype == torch.float32 and fused.shape == expected.shape
    assert relative_error(fused, expected) <= 1e-5


def test_fused_products_with_strided_inputs_several_launches_and_bfloat16(monkeypatch):
    """A transposed dLoss/dO (as the hook receives it), a q/k width that is no power of two, a broadcast
    (b, 1, 1, s) key mask, query ranges split over several launches; bfloat16 tensors within 1e-3."""
    (query, key, value, grad_output, inputs, _, scaling, _), _ = attention_problem("none", length=23, qk_dim=9)
    keys_allowed = torch.ones(2, 1, 1, 23, dtype=torch.bool)
    keys_allowed[1, ..., 17:] = False
    from hf_grow.statistics import score_gradient_products

    exact = (query, key, value, grad_output, inputs)
    expected = score_gradient_products(*exact, keys_allowed, scaling, False, 23, torch.float64)
    strided_grad = grad_output.float().transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided_grad.is_contiguous()
    monkeypatch.setattr(triton_kernels, "_BUFFER_ELEMENTS", 2 * 3 * 19 * 7)  # 7 queries per launch
    single = [query.float(), key.float(), value.float(), strided_grad, inputs.float()]
    fused = score_gradient_products_fused(*single, keys_allowed, scaling, False)
    assert relative_error(fused, expected) <= 1e-5
    rounded = [t.to(torch.bfloat16) for t in (query, key, value, grad_output, inputs)]
    exact = score_gradient_products(*[t.double() for t in rounded], keys_allowed, scaling, False, 23, torch.float64)
    assert relative_error(score_gradient_products_fused(*rounded, keys_allowed, scaling, False), exact) <= 1e-3


@pytest.mark.parametrize("architecture", ["gpt2", "bert"])
def test_triton_method_equals_the_reference(architecture):
    torch.manual_seed(0)
    if architecture == "gpt2":
        model = GPT2LMHeadModel(tiny_gpt2_config(n_embd=32, n_head=2)).eval()
    else:
        config = BertConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
        )
        model = BertForMaskedLM(config).eval()
    batches = [masked_causal_batch(0, batch_size=3, seq_len=18), left_padded_batch_with_every_label(1)]
    adapter = get_adapter(model)
    reference = collect_statistics(model, batches, adapter, compute_dtype=torch.float64, method="reference")
    fused = collect_statistics(model, batches, adapter, method="triton")
    assert fused.method == "triton" and fused.num_tokens == reference.num_tokens
    for layer in range(2):
        assert relative_error(fused.gradients[layer], reference.gradients[layer]) <= 1e-5
        assert relative_error(fused.second_moments[layer], reference.second_moments[layer]) <= 1e-6


def test_triton_method_needs_float32_and_a_device_it_runs_on(gpt2_copy, stdlib_bytes, monkeypatch):
    from conftest import lm_batches

    batches = lm_batches(stdlib_bytes["stats"], 1)
    adapter = get_adapter(gpt2_copy)
    with pytest.raises(ValueError, match="computes in float32"):
        collect_statistics(gpt2_copy, batches, adapter, method="triton", compute_dtype=torch.float64)
    with pytest.raises(ValueError, match="22x slower"):  # IEEE float32 products: no tensor cores (BENCHMARKS.md)
        collect_statistics(gpt2_copy, batches, adapter, method="triton", tf32=False)
    modes = []
    real_mode = collect.statistics_mode
    monkeypatch.setattr(collect, "statistics_mode", lambda model, tf32: modes.append(tf32) or real_mode(model, tf32))
    collect_statistics(gpt2_copy, batches, adapter, method="triton")
    collect_statistics(gpt2_copy, batches, adapter, method="chunked")
    assert modes == [True, False]  # a float32 model: TF32 products for triton alone
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available(torch.device("cpu"))
    with pytest.raises(ValueError, match="statistics method .triton. needs a CUDA device"):
        collect_statistics(gpt2_copy, batches, adapter, method="triton")

    def unread():
        raise AssertionError("the data was read before the arguments were checked")
        yield

    with pytest.raises(ValueError, match="statistics method .triton. needs a CUDA device"):
        grow_model(gpt2_copy, unread(), p=2, statistics_method="triton")
    with pytest.raises(RuntimeError, match="run on CUDA devices"):
        monkeypatch.setattr(triton_kernels.knobs.runtime, "interpret", False)
        score_gradient_products_fused(*(torch.zeros(1, 1, 2, 2),) * 4, torch.zeros(1, 2, 3), None, 1.0, True)


COMPILE_FOR_GPUS = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_grow.statistics import triton_kernels

pointers = {"max_ptr": "*fp32", "logsum_ptr": "*fp32", "delta_ptr": "*fp32", "out_ptr": "*fp32", "x_ptr": "*fp32"}
results = []
for tuned in (triton_kernels._softmax_rows, triton_kernels._gradient_times_inputs):
    kernel, config = tuned.fn, tuned.configs[0]
    variants = [((0, True), ("bf16", "tf32")), ((1, False), ("bf16", "tf32")), ((2, False), ("bf16", "tf32"))]
    for (mask_kind, causal), (dtype, precision) in variants + [((0, False), ("fp32", "ieee"))]:
        constants = dict(
            QK_BLOCK=64, V_BLOCK=64, MASK_KIND=mask_kind, CAUSAL=causal, PRECISION=precision, **config.kwargs
        )
        signature = {}
        for name in kernel.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name == "mask_ptr":
                signature[name] = "*i1" if mask_kind == 1 else "*fp32"
            elif name.endswith("_ptr"):
                signature[name] = pointers.get(name, "*" + dtype)
            else:
                signature[name] = "fp32" if name == "scaling" else "i32"
        source = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constants.items()})
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        results.append([kernel.__name__, compiled.metadata.shared])
print(json.dumps(results))
'''


def test_kernels_compile_for_gpus():
    """Triton's real compiler (not the interpreter) turns each kernel, with every kind of mask, bf16 inputs on TF32
    and float32 on IEEE products, into H100 (sm_90) machine code within its shared memory; it needs no GPU.
    Catches what the interpreter accepts but the compiler refuses."""
    import json
    import os
    import subprocess
    import sys

    environment = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    command = [sys.executable, "-c", COMPILE_FOR_GPUS]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(compiled) == 2 * 4
    for name, shared in compiled:
        assert 0 < shared <= 227 * 1024, (name, shared)  # an H100 block's shared memory
