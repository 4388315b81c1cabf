"""The memory plan: its terms, the activations it counts on the meta device, the command's --dry-run and its
refusal of runs that would not fit, with the flags that make them fit."""

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import lm_batches, tiny_gpt2_config
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_grow import GrowthConfig, cli, collect_statistics, get_adapter, grow_model, hub
from hf_grow.cli import memory as cli_memory
from hf_grow.statistics import collect as collect_module
from hf_grow.growth.activation_probe import activation_bytes
from hf_grow.growth.memory_plan import (
    CUDA_PROCESS_BASELINE_BYTES, OFFLOAD_PLACEHOLDER, PROCESS_BASELINE_BYTES, RATES_SQUARES_PER_HEAD,
    SOLVE_SQUARES_PER_HEAD, fitting_changes, plan_memory,
)
from hf_grow.progress import format_bytes
from hf_grow.statistics import compute_loss, layer_groups, statistics_bytes
from quickstart import train_small_gpt2
from test_cli import TEXT_GLOB, TRAIN_FILES, model_folder  # noqa: F401  (the trained model folder fixture)


def meta_model(model_class, config):
    with torch.device("meta"):
        return model_class(config)


@pytest.mark.parametrize("kind", ["gpt2", "bfloat16 bert", "bert pretraining"])
def test_activation_bytes_on_the_meta_device_equal_what_a_real_forward_saves(kind):
    """As the statistics pass computes the loss (`compute_loss`): a half-precision masked LM's logits in float32,
    twice the bytes of its own (the probe counted them in bfloat16: 69 of 129 MiB at BERT's vocabulary)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=2))
    else:  # BertForPreTraining computes no loss without its next-sentence labels: the probe counted 1.6 of 30 MiB
        bert = BertForPreTraining if kind == "bert pretraining" else BertForMaskedLM
        dtype = torch.float32 if kind == "bert pretraining" else torch.bfloat16
        model = bert(BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64)).to(dtype)
    model.set_attn_implementation("eager")
    model.requires_grad_(False)
    ids = torch.randint(0, model.config.vocab_size, (4, 32))
    saved = {}

    def pack(tensor):
        base = tensor if tensor._base is None else tensor._base
        if not isinstance(base, torch.nn.Parameter) and not isinstance(tensor, torch.nn.Parameter):
            saved[base.data_ptr()] = base.numel() * base.element_size()
        return tensor

    handle = model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.requires_grad_())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        labels = {"next_sentence_label": ids[:, 0] % 2} if kind == "bert pretraining" else {}
        compute_loss(model, {"input_ids": ids, "labels": ids, **labels}, None)
    handle.remove()
    real = sum(saved.values()) + max(saved.values())
    # (BERT: 3 KiB apart in 30 MiB, a small saved tensor the probe's zero ids and labels do not match; not traced)
    assert activation_bytes(model, 4, 32, "eager") == (real if kind == "gpt2" else pytest.approx(real, rel=1e-3))
    assert activation_bytes(model, 8, 32, "eager") == pytest.approx(2 * real, rel=0.01)  # linear in the batch


def test_the_probe_runs_models_that_read_their_inputs_values():
    """A GPT-2 with a pad token (fine-tuned checkpoints set one) and a Llama with dynamic rotary positions read the
    ids' values in their forward, a `.item()` the meta device refuses: the plan, --dry-run and inspect crashed."""
    plain = activation_bytes(GPT2LMHeadModel(tiny_gpt2_config(n_layer=2)), 2, 32, "eager")
    assert activation_bytes(GPT2LMHeadModel(tiny_gpt2_config(n_layer=2, pad_token_id=0)), 2, 32, "eager") == plain
    settings = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    rotary = activation_bytes(LlamaForCausalLM(LlamaConfig(**settings)), 2, 32, "eager")
    dynamic = LlamaForCausalLM(LlamaConfig(**settings, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert activation_bytes(dynamic, 2, 32, "eager") == rotary and dynamic.model.rotary_emb.rope_type == "dynamic"
    # saved without a cache (sentence-transformers saves its GPT-2 and Llama models so): their masks read positions
    uncached = LlamaForCausalLM(LlamaConfig(**settings, use_cache=False))
    assert activation_bytes(uncached, 2, 32, "eager") == rotary and uncached.config.use_cache is False
    assert activation_bytes(GPT2LMHeadModel(tiny_gpt2_config(n_layer=2, use_cache=False)), 2, 32, "eager") == plain


def test_the_write_stage_counts_the_grown_models_weights():
    """It counted the model before growth (108 MiB where 116.6 MiB were written at p 64): the output disk's check
    passed a disk short by the added Q/K weights."""
    from hf_grow import GrownGPT2Config, GrownGPT2LMHeadModel

    model = meta_model(GPT2LMHeadModel, tiny_gpt2_config(n_layer=3))
    plan = plan_memory(model, get_adapter(model), GrowthConfig(p=24), batch_size=2, seq_len=32, eval_tokens=256)
    write = next(stage for stage in plan.stages if stage.name == "write")
    grown = meta_model(GrownGPT2LMHeadModel, GrownGPT2Config(**tiny_gpt2_config(n_layer=3).to_dict(),
                                                             qk_head_dims=[16 + 24] * 3))
    stored = [*grown.parameters(), *grown.buffers()]  # the tied head once
    assert write.terms["grown model"] == sum(tensor.numel() * tensor.element_size() for tensor in stored)


def test_the_plan_holds_one_group_of_m_in_the_accumulators_dtype():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    model = meta_model(LlamaForCausalLM, config)
    adapter = get_adapter(model)
    shape = dict(batch_size=2, seq_len=32, eval_tokens=256)
    whole = plan_memory(model, adapter, GrowthConfig(), **shape)
    statistics = dict(whole.stages[1].terms)
    assert statistics["M"] == 6 * 4 * 65 * 65 * 8 and statistics["C"] == 6 * 65 * 65 * 8
    assert whole.groups == [list(range(6))]
    budget = statistics_bytes(6, 4, 64, 3, 4)  # two layers of float32 M per pass
    grouped = plan_memory(model, adapter, GrowthConfig(memory_budget=budget, accumulate_dtype="float32"), **shape)
    assert grouped.groups == layer_groups(6, 4, 64, budget, 4) == [[0, 1], [2, 3], [4, 5]]
    assert grouped.stages[1].terms["M"] == 2 * 4 * 65 * 65 * 4
    assert grouped.stages[1].host < whole.stages[1].host
    assert grouped.budget_for(2, 4) == str(budget)
    assert layer_groups(6, 4, 64, grouped.budget_for(2, 4), 4) == grouped.groups


def test_fitting_changes_pick_the_largest_budget_that_fits():
    # Wide enough that M, not the compact solve, dominates (on the meta device: no memory is used): a pass's M
    # 2.7x a layer's compact solve, which a later pass holds beside its own M.
    model = meta_model(GPT2LMHeadModel, tiny_gpt2_config(n_layer=6, n_embd=1024, n_head=64))
    adapter, config = get_adapter(model), GrowthConfig(p=8, accumulate_dtype="float32")

    def plan_with(changes):
        fields = {name: value for name, value in changes.items() if name not in ("batch_size", "dtype")}
        return plan_memory(model, adapter, dataclasses.replace(config, **fields),
                           batch_size=changes.get("batch_size", 4), seq_len=32, eval_tokens=256)

    plan = plan_with({})
    assert max(plan.stages, key=lambda stage: stage.host).name in ("statistics", "solve")
    limit = plan.peak_host - plan.stages[1].terms["M"] // 4  # a quarter of M must go
    changes = fitting_changes(plan_with, config, lambda plan: plan.peak_host <= limit)
    assert set(changes) == {"memory_budget"}
    fitted = plan_with(changes)
    assert fitted.peak_host <= limit and len(fitted.groups) >= 2
    fewer_passes = -(-6 // (len(fitted.groups) - 1))  # layers per pass with one pass less
    assert plan_with({"memory_budget": plan.budget_for(fewer_passes, 8)}).peak_host > limit  # the fewest passes
    assert fitting_changes(plan_with, config, lambda plan: False) is None
    # Summed in float64, M is twice the size; float32 sums fit it in one pass, which beats two passes.
    config = dataclasses.replace(config, accumulate_dtype="float64")
    limit = plan_with({}).peak_host - 1
    assert fitting_changes(plan_with, config, lambda plan: plan.peak_host <= limit) == {"accumulate_dtype": "float32"}


def mapped_files(tensor: torch.Tensor) -> set[str]:
    """The files whose mappings (/proc/self/maps) hold ``tensor``'s memory."""
    address, files = tensor.data_ptr(), set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end and len(fields) > 5:
                files.add(fields[5])
    return files


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's mappings (Linux)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loading_maps_the_weights_file_unless_it_converts_and_the_plan_counts_so(tmp_path, dtype):
    # The plan's load stage rests on how transformers loads a safetensors file: in its own dtype the weights are
    # the file's mapped pages (nothing resident until read); in another they are a converted copy beside them.
    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=2))
    model.save_pretrained(tmp_path)  # float32
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path, dtype=dtype)
    weights_file = str((tmp_path / "model.safetensors").resolve())
    mapped = [weights_file in mapped_files(parameter) for parameter in loaded.parameters()]
    assert all(mapped) if dtype == torch.float32 else not any(mapped)

    meta = meta_model(GPT2LMHeadModel, tiny_gpt2_config(n_layer=2)).to(dtype)
    plan = plan_memory(meta, get_adapter(model), GrowthConfig(p=8), batch_size=2, seq_len=32, eval_tokens=256,
                       weights_dtype=torch.float32)
    load, weights = plan.stages[0], plan.stages[1].terms["model"]
    if dtype == torch.float32:  # mapped: the process alone, and the table says why
        assert load.host == PROCESS_BASELINE_BYTES and not load.terms and "mapped" in plan.table().splitlines()[1]
    else:  # the converted model beside the whole float32 file
        assert load.terms == {"model, converted": weights, "weights file": 2 * weights}
        assert load.host == PROCESS_BASELINE_BYTES + 3 * weights
    on_gpu = plan_memory(meta, get_adapter(model), GrowthConfig(p=8), batch_size=2, seq_len=32, eval_tokens=256,
                         device="cuda").stages[0]
    assert on_gpu.device == weights and on_gpu.terms == {"weights file": weights}  # moving it reads every page


def test_each_statistics_pass_allocates_m_within_its_own_progress(monkeypatch, stdlib_bytes):
    # M's accumulators (gigabytes at real size) belong to the statistics' time and stage, as the plan counts them,
    # not to the loading before them; each pass of a memory budget allocates its group's.
    events = []
    bar, collector = collect_module.progress_bar, collect_module.Collector
    monkeypatch.setattr(collect_module, "progress_bar", lambda *a, **k: events.append(k["desc"]) or bar(*a, **k))
    monkeypatch.setattr(collect_module, "Collector", lambda *a, **k: events.append("M") or collector(*a, **k))
    model = GPT2LMHeadModel(tiny_gpt2_config())
    budget = statistics_bytes(2, 4, 64, 2)  # one layer of M per pass
    collect_statistics(model, lm_batches(stdlib_bytes["stats"], 2, batch_size=2, seq_len=32), get_adapter(model),
                       progress=True, memory_budget=budget)
    assert events == ["statistics 1/2", "M", "statistics 2/2", "M"]


def live_bytes(excluded: set[int]) -> int:
    """Bytes of the live tensors' storages (each once), found by the garbage collector, less ``excluded``'s."""
    import gc

    storages = {}
    # plain tensors and parameters only: subclasses such as the FakeTensors other tests may leave have no storage
    plain = (torch.Tensor, torch.nn.Parameter)
    for tensor in (obj for obj in gc.get_objects() if type(obj) in plain and obj.device.type == "cpu"):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(size for pointer, size in storages.items() if pointer not in excluded)


def test_the_solve_frees_m_layer_by_layer_as_the_plan_counts_it(stdlib_bytes, monkeypatch):
    """The solve frees each layer's M once the layer is solved, so the plan's solve holds M and the compact solve
    each whole, never both (`_held_m_and_solved`); the live tensors of a real solve stay within it."""
    from hf_grow.growth import GrowthProblem, layer_solve

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(n_layer=4, n_embd=128, n_head=8)).eval()
    adapter = get_adapter(model)
    statistics = collect_statistics(model, lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=46), adapter)
    model_storages = {tensor.untyped_storage().data_ptr() for tensor in [*model.parameters(), *model.buffers()]}
    before = live_bytes(model_storages)  # with the statistics' M and C
    held, peaks = [], []
    direction = layer_solve.linalg.solve_direction_in_basis

    def counting_direction(*args, **kwargs):  # one chunk of 8 heads: a layer
        result = direction(*args, **kwargs)
        held.append(sum(gradient is not None for gradient in statistics.gradients))
        peaks.append(live_bytes(model_storages))
        return result

    monkeypatch.setattr(layer_solve.linalg, "solve_direction_in_basis", counting_direction)
    GrowthProblem(model, adapter, statistics, [24] * 4, "whitened", 1e-6, "eigh", release=True)
    assert held == [4, 3, 2, 1]  # the M of the layers not solved yet
    plan = plan_memory(model, adapter, GrowthConfig(p=8), batch_size=4, seq_len=64, eval_tokens=256)
    solve, layer_m, layer_solved = plan.stages[2].terms, 8 * 129 * 129 * 8, plan.stages[3].terms["compact solve"] // 4
    assert layer_solved > layer_m  # at d = 129 a head's targets (three k x k cores, k = 128) outweigh its M
    assert (solve["M"], solve["compact solve"]) == (layer_m, 4 * layer_solved)  # at the last layer
    transients = solve["solve of 8 heads"] + solve["metric"] + solve["C"]
    assert max(peaks) - before + 4 * layer_m <= solve["M"] + solve["compact solve"] + transients

    # Where M outweighs the targets (GPT-2 medium's width), the peak is at the first layer; a later pass of a
    # memory budget holds its M beside the earlier passes' targets.
    wide = meta_model(GPT2LMHeadModel, tiny_gpt2_config(n_layer=4, n_embd=1024, n_head=32))
    shape = dict(batch_size=4, seq_len=64, eval_tokens=256)
    plan = plan_memory(wide, adapter, GrowthConfig(p=8), **shape)
    layer_m, layer_solved = 32 * 1025 * 1025 * 8, plan.stages[3].terms["compact solve"] // 4
    assert layer_m > layer_solved and plan.stages[2].terms["M"] == 4 * layer_m
    assert plan.stages[2].terms["compact solve"] == layer_solved
    grouped = plan_memory(wide, adapter, GrowthConfig(p=8, memory_budget=statistics_bytes(4, 32, 1024, 2)), **shape)
    assert grouped.groups == [[0], [1], [2], [3]]
    assert grouped.stages[1].terms["M"] == layer_m
    assert grouped.stages[1].terms["compact solve of earlier passes"] == 3 * layer_solved
    assert (grouped.stages[2].terms["M"], grouped.stages[2].terms["compact solve"]) == (layer_m, 4 * layer_solved)


def test_dry_run_prints_the_plan_and_reads_nothing(model_folder, tmp_path, capsys):  # noqa: F811
    missing_text = str(tmp_path / "no-such-text-*.txt")  # a dry run reads no data
    assert cli.main([str(model_folder), "--p", "8", "--data", missing_text, "--seq-len", "64", "--dry-run",
                     "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    for stage in ("load", "statistics", "solve", "line search", "write"):
        assert f"\n{stage} " in table
    assert "peak" in table and "1 pass over the data" in table
    assert not list(tmp_path.iterdir())


def test_a_run_that_would_not_fit_is_refused_with_the_flags_that_fix_it(model_folder, tmp_path, capsys,  # noqa: F811
                                                                         monkeypatch):
    arguments = [str(model_folder), "--p", "8", "--data", TEXT_GLOB, "--seq-len", "64", "--batch-size", "8",
                 "--max-tokens", "6000", "--eval-tokens", "2000", "--quiet", "--device", "cpu"]
    assert cli.main([*arguments, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    statistics_row = next(line for line in plan.splitlines() if line.startswith("statistics "))
    model = GPT2LMHeadModel.from_pretrained(model_folder)
    layers, heads, hidden = model.config.n_layer, model.config.n_head, model.config.n_embd
    m_bytes = statistics_bytes(layers, heads, hidden, layers) - statistics_bytes(layers, heads, hidden, 0)
    stages = plan_memory(model, get_adapter(model), GrowthConfig(p=8), batch_size=8, seq_len=64,
                         eval_tokens=2000).stages
    free = stages[1].host - m_bytes // 4
    assert all(stage.host < free for stage in stages if stage.name != "statistics")  # only the statistics exceed
    monkeypatch.setattr(cli_memory, "_free_memory", lambda device: (free, 0))
    output = tmp_path / "grown"
    assert cli.main([*arguments, "--output-dir", str(output)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "statistics stage needs about" in error[0] and "rerun with --" in error[0], (
        statistics_row, error)
    assert not output.exists()  # refused before any work
    fix = error[0].split("rerun with ", 1)[1].split(" (see", 1)[0].split()
    assert cli.main([*arguments, *fix, "--output-dir", str(output)]) == 0  # the named flags make it fit
    assert (output / "config.json").is_file()
    assert cli.main([*arguments, "--ignore-memory-plan", "--output-dir", str(tmp_path / "anyway")]) == 0


def test_float32_sums_of_m_grow_the_same_model(trained_gpt2, stdlib_bytes):
    batches = lm_batches(stdlib_bytes["stats"], 6, batch_size=4, seq_len=64)
    held_out = lm_batches(stdlib_bytes["eval"], 3, batch_size=4, seq_len=64, seed=1)
    adapter = get_adapter(trained_gpt2)
    single = collect_statistics(trained_gpt2, batches, adapter, accumulate_dtype=torch.float32)
    double = collect_statistics(trained_gpt2, batches, adapter)
    assert single.gradients[0].dtype == torch.float32 and double.gradients[0].dtype == torch.float64
    for m32, m64 in zip(single.gradients, double.gradients):
        assert (m32.double() - m64).norm() <= 1e-5 * m64.norm()
    grown = [grow_model(trained_gpt2, None, p=8, statistics=statistics, eval_dataloader=held_out,
                        measure_realized_gains=False).growth_report for statistics in (single, double)]
    assert grown[0].step_size == grown[1].step_size
    assert grown[0].eval_loss_after == pytest.approx(grown[1].eval_loss_after, abs=1e-5)


def test_max_memory_caps_the_plan_and_a_run_nothing_fits_says_so(model_folder, tmp_path, capsys):  # noqa: F811
    arguments = [str(model_folder), "--p", "8", "--data", TEXT_GLOB, "--seq-len", "64", "--quiet", "--device", "cpu",
                 "--output-dir", str(tmp_path / "grown")]
    assert cli.main([*arguments, "--max-memory", "1MB"]) == 2
    error = capsys.readouterr().err.strip()
    assert "977 KiB is allowed (--max-memory): use a machine with more memory" in error, error
    assert cli.main([*arguments, "--max-memory", "lots"]) == 2
    assert "--max-memory 'lots' is not a size" in capsys.readouterr().err
    assert not (tmp_path / "grown").exists()


def test_auto_truncation_frees_m_group_by_group_and_counts_one_solve_for_both_truncations():
    """Both truncations among the candidates: one solve serves both, from each group's M while it is alive, so the
    plan counts one group's M as for one truncation. "refactor": one compact target truncated either way (Frobenius
    adds one number per head, its plain tail); "append": both rank-p unit updates."""
    budget_layers = 1
    for model in (GPT2LMHeadModel(tiny_gpt2_config(n_layer=4)),
                  LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16))):
        adapter, config = get_adapter(model), model.config
        layers, heads, hidden = 4, adapter.num_heads(config), adapter.hidden_size(config)
        budget = statistics_bytes(layers, heads, hidden, budget_layers + 1)

        def solve_terms(eval_tokens=64, **settings):  # 64 tokens: two held-out batches of 2 x 16
            plan = plan_memory(model, adapter, GrowthConfig(p=8, memory_budget=budget, **settings), batch_size=2,
                               seq_len=16, eval_tokens=eval_tokens)
            return next(stage for stage in plan.stages if stage.name == "solve").terms

        whitened, auto = solve_terms(truncation="whitened"), solve_terms(truncation="auto")
        frobenius = solve_terms(truncation="frobenius")
        # one held-out batch or a given step: no choice to make, the simplest candidate solved alone
        assert solve_terms(truncation="auto", eval_tokens=32) == whitened
        assert solve_terms(truncation="auto", step_size=0.1) == whitened
        name = type(model).__name__
        assert auto["M"] == whitened["M"] == frobenius["M"], name
        assert auto["compact solve"] == frobenius["compact solve"] > whitened["compact solve"], name
        if name.startswith("GPT2"):
            assert auto["compact solve"] - whitened["compact solve"] == layers * heads * 8
    # "append": two rank-p unit updates per head, left and right factors in float64, beside the old Q/K in float64
    # (4 query heads and 2 key heads of 16 dims over the 64 inputs: no bias)
    old_qk = (4 + 2) * hidden * 16 * 8
    assert auto["compact solve"] == 2 * layers * heads * 2 * (hidden + 1) * 8 * 8 + layers * old_qk


def test_m_on_disk_leaves_the_host_memory_and_the_plan_says_where_it_is(tmp_path):
    model = meta_model(GPT2LMHeadModel, tiny_gpt2_config(n_layer=6, n_embd=512, n_head=32))
    adapter, shape = get_adapter(model), dict(batch_size=4, seq_len=32, eval_tokens=256)
    in_memory = plan_memory(model, adapter, GrowthConfig(p=8), **shape)
    on_disk = plan_memory(model, adapter, GrowthConfig(p=8, offload_dir=str(tmp_path)), **shape)
    m_bytes = 6 * 32 * 513 * 513 * 8
    assert (in_memory.disk, on_disk.disk, on_disk.groups) == (0, m_bytes, in_memory.groups)
    for memory, disk in zip(in_memory.stages, on_disk.stages):
        assert "M" not in disk.terms
        if memory.name == "solve":  # without M to free, the solve's peak is its end: every layer's targets
            assert disk.terms["compact solve"] == on_disk.stages[3].terms["compact solve"] and disk.host < memory.host
        else:
            assert memory.host - disk.host == memory.terms.get("M", 0)
    assert in_memory.stages[1].terms["M"] == m_bytes  # statistics and solve hold it in memory
    assert f"M on disk: {format_bytes(m_bytes)} in {tmp_path}" in on_disk.table()
    assert "on disk" not in in_memory.table()
    # a pass's group on disk at a time; on a GPU, M is on the device (a run refuses offload_dir there)
    budget = statistics_bytes(6, 32, 512, 3)
    assert plan_memory(model, adapter, GrowthConfig(p=8, offload_dir=str(tmp_path), memory_budget=budget),
                       **shape).disk == 2 * 32 * 513 * 513 * 8
    on_gpu = plan_memory(model, adapter, GrowthConfig(p=8, offload_dir=str(tmp_path)), device="cuda", **shape)
    assert on_gpu.disk == 0 and on_gpu.offload_dir is None and "M" in on_gpu.stages[1].terms


def test_where_no_pass_fits_m_in_memory_the_fix_is_m_on_disk(tmp_path):
    model = meta_model(GPT2LMHeadModel, tiny_gpt2_config(n_layer=6, n_embd=512, n_head=32))
    adapter = get_adapter(model)

    def planner(config):
        def plan_with(changes):
            fields = {name: value for name, value in changes.items() if name not in ("batch_size", "dtype")}
            return plan_memory(model, adapter, dataclasses.replace(config, **fields),
                               batch_size=changes.get("batch_size", 4), seq_len=32, eval_tokens=256)
        return plan_with

    def peak(plan):  # of the stages that hold M (the line search holds the Q/K weights of every layer, also here)
        return max(stage.host for stage in plan.stages if stage.name != "line search")

    config = GrowthConfig(p=8)
    plan_with = planner(config)
    limit = peak(plan_with({"offload_dir": OFFLOAD_PLACEHOLDER}))
    one_layer = {"memory_budget": plan_with({}).budget_for(1, 4), "accumulate_dtype": "float32", "batch_size": 1}
    assert peak(plan_with(one_layer)) > limit  # one layer's M per pass, in float32, at batch 1: too much
    assert fitting_changes(plan_with, config, lambda plan: peak(plan) <= limit) == {"offload_dir": "DIR"}
    # With a folder given, a disk that holds two layers' float64 M: three layers' float32 M per pass, two passes
    config = GrowthConfig(p=8, offload_dir=str(tmp_path))
    plan_with, two_layers = planner(config), 2 * 32 * 513 * 513 * 8
    changes = fitting_changes(plan_with, config, lambda plan: plan.disk <= two_layers)
    assert changes == {"memory_budget": plan_with({}).budget_for(3, 4), "accumulate_dtype": "float32"}
    assert plan_with(changes).groups == [[0, 1, 2], [3, 4, 5]]


@pytest.fixture(scope="module")
def wide_model_folder(tmp_path_factory):
    """A GPT-2 whose M (16 heads over 257 inputs) outweighs one batch's activations at batch size 1."""
    folder = tmp_path_factory.mktemp("wide-model")
    train_small_gpt2(folder, TRAIN_FILES, steps=1, vocab_size=400, n_embd=256, n_head=16)
    return folder


def test_the_command_plans_m_on_disk_and_names_the_flag_where_nothing_else_fits(wide_model_folder, tmp_path, capsys,
                                                                                monkeypatch):
    offload = tmp_path / "offload"
    offload.mkdir()
    arguments = [str(wide_model_folder), "--p", "8", "--data", TEXT_GLOB, "--seq-len", "64", "--batch-size", "1",
                 "--max-tokens", "1200", "--eval-tokens", "600", "--quiet", "--device", "cpu"]
    assert cli.main([*arguments, "--dry-run", "--offload-dir", str(offload)]) == 0
    assert f"\nM on disk: 16 MiB in {offload} (memory-mapped" in capsys.readouterr().out
    model = GPT2LMHeadModel.from_pretrained(wide_model_folder)
    free = plan_memory(model, get_adapter(model), GrowthConfig(p=8, offload_dir=str(offload)), batch_size=1,
                       seq_len=64, eval_tokens=600).peak_host
    monkeypatch.setattr(cli_memory, "_free_memory", lambda device: (free, 0))
    output = tmp_path / "grown"
    assert cli.main([*arguments, "--output-dir", str(output)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "rerun with --offload-dir DIR, DIR a folder with 16 MiB of free disk for M (see --dry-run" in error
    assert not output.exists()
    fix = error.split("rerun with ", 1)[1].split(",", 1)[0].replace("DIR", str(offload)).split()
    assert cli.main([*arguments, *fix, "--output-dir", str(output)]) == 0  # the named flag makes it fit
    assert (output / "config.json").is_file() and not any(offload.iterdir())
    # A folder whose disk holds less than one layer's M (8 MiB): one layer per pass, summed in float32
    usage = cli_memory.shutil.disk_usage(offload)
    monkeypatch.setattr(cli_memory.shutil, "disk_usage", lambda path: usage._replace(free=6 * 2**20))
    assert cli.main([*arguments, *fix, "--output-dir", str(tmp_path / "other")]) == 2
    error = capsys.readouterr().err.strip()
    assert f"M needs about 16 MiB of disk in --offload-dir {offload}, 6 MiB is free there: rerun with --memory-budget" \
        in error and error.endswith("--accumulate-dtype float32 (see --dry-run; --ignore-memory-plan runs anyway)")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("folder, message", [("missing", "is not a folder"), ("a-file", "is not a folder")])
def test_a_bad_offload_dir_is_refused_before_any_work(model_folder, tmp_path, capsys, folder, message):  # noqa: F811
    (tmp_path / "a-file").write_text("")
    output = tmp_path / "grown"
    assert cli.main([str(model_folder), "--p", "8", "--data", TEXT_GLOB, "--offload-dir", str(tmp_path / folder),
                     "--output-dir", str(output), "--quiet", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"--offload-dir {tmp_path / folder} {message}" in error, error
    assert not output.exists()


def test_a_run_that_fits_only_below_the_rank_ceiling_goes_on_with_a_warning(wide_model_folder, tmp_path, capsys,
                                                                           monkeypatch):
    # The certified rank is known only during the solve: the plan counts its ceiling, and refuses only a run that
    # would not fit at the least rank either.
    arguments = [str(wide_model_folder), "--p", "8", "--data", TEXT_GLOB, "--seq-len", "64", "--batch-size", "1",
                 "--max-tokens", "1200", "--eval-tokens", "600", "--quiet", "--device", "cpu"]
    assert cli.main([*arguments, "--dry-run"]) == 0
    table = capsys.readouterr().out
    model = GPT2LMHeadModel.from_pretrained(wide_model_folder)
    plan = plan_memory(model, get_adapter(model), GrowthConfig(p=8), batch_size=1, seq_len=64, eval_tokens=600)
    assert plan.least_peak_host < plan.peak_host
    assert f"at their least rank the peak is {format_bytes(plan.least_peak_host)}" in table
    output = tmp_path / "grown"
    monkeypatch.setattr(cli_memory, "_free_memory", lambda device: (plan.least_peak_host, 0))
    assert cli.main([*arguments, "--output-dir", str(output)]) == 0
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "may need up to" in warning[0] and "rank ceiling" in warning[0]
    assert (output / "config.json").is_file()
    monkeypatch.setattr(cli_memory, "_free_memory", lambda device: (plan.least_peak_host - 1, 0))
    assert cli.main([*arguments, "--output-dir", str(tmp_path / "refused")]) == 2
    assert "needs about" in capsys.readouterr().err and not (tmp_path / "refused").exists()


@pytest.mark.parametrize("layers", [1, 12])
def test_on_a_gpu_the_host_keeps_the_cuda_process_and_one_shard_of_the_written_model(layers):
    """Measured on an H100 (BENCHMARKS.md): the process with the CUDA libraries holds 1.45-1.87 GiB, and writing
    a Llama-3-8B from the GPU in one shard put its whole 15 GiB on the host; the command writes shards of at
    most `hub.SHARD_BYTES`, so the host holds one of them. Loading holds the weights file until the model moves,
    then the CUDA libraries: the larger of the two (GPT-2 small: 1.61 GiB measured, planned 1.16 before)."""
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256)
    model = meta_model(LlamaForCausalLM, config).to(torch.bfloat16)
    adapter, shape = get_adapter(model), dict(batch_size=1, seq_len=128, eval_tokens=256, activations=0)
    plan = plan_memory(model, adapter, GrowthConfig(p=8), device="cuda", **shape)
    weights = sum(tensor.numel() * tensor.element_size() for tensor in [*model.parameters(), *model.buffers()])
    shard = min(weights, hub.SHARD_BYTES)
    assert layers == 1 and weights < hub.SHARD_BYTES or layers == 12 and weights > hub.SHARD_BYTES
    assert plan.stages[0].host == PROCESS_BASELINE_BYTES + weights  # an 8B layer's file outweighs the CUDA libraries
    for stage in plan.stages[1:]:
        assert stage.host == CUDA_PROCESS_BASELINE_BYTES + (shard if stage.name == "write" else 0)
    write = plan.stages[-1]
    grown = write.terms["grown model"]  # the weights and the added Q/K entries (p 8 beside head_dim 128)
    assert write.device == grown and weights < grown < 1.01 * weights
    assert write.terms["shard copied to the host"] == shard
    on_cpu = plan_memory(model, adapter, GrowthConfig(p=8), **shape).stages[-1]
    assert on_cpu.host == PROCESS_BASELINE_BYTES + grown and "shard copied to the host" not in on_cpu.terms
    small = meta_model(LlamaForCausalLM, LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    small_plan = plan_memory(small, get_adapter(small), GrowthConfig(p=8), device="cuda", **shape)
    assert small_plan.stages[0].host == CUDA_PROCESS_BASELINE_BYTES  # a small file: the CUDA libraries outweigh it



def test_the_solve_counts_whole_key_groups_and_the_gain_rates():
    """The solve takes a whole group of query heads sharing a key at once (16 in Llama-3.1-405B), the plan counted 8;
    and a budget's gains per added dim hold ~5 more squares a head, which it did not count (1.4-1.7x under)."""
    shape = dict(batch_size=2, seq_len=32, eval_tokens=256)
    settings = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=8,
                    num_attention_heads=16, max_position_embeddings=64)
    for key_heads, chunk in ((1, 16), (4, 8), (16, 8)):
        model = meta_model(LlamaForCausalLM, LlamaConfig(**settings, num_key_value_heads=key_heads))
        plain, budget = (
            next(stage for stage in plan_memory(model, get_adapter(model), config, **shape).stages
                 if stage.name == "solve").terms
            for config in (GrowthConfig(p=8), GrowthConfig(budget=16))
        )
        square = chunk * 129 * 129 * 8
        assert plain[f"solve of {chunk} heads"] == SOLVE_SQUARES_PER_HEAD * square
        assert budget[f"solve of {chunk} heads"] == (SOLVE_SQUARES_PER_HEAD + RATES_SQUARES_PER_HEAD) * square
