"""The benchmark recipes' own pieces: the retrieval task is learnable and growth runs through train_variant."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes", "benchmarks"))
import bench_bottleneck  # noqa: E402
from bench_bottleneck import steps_to_escape  # noqa: E402
from bottleneck_tasks import plateau_task, retrieval_task  # noqa: E402
from progressive_gpt2 import CurvePoint, Run, Variant, train_variant  # noqa: E402
from conftest import train  # noqa: E402


@pytest.fixture(scope="module")
def task():
    return retrieval_task(keys=16, values=4, pairs=8, n_embd=32, n_head=1, batch_size=32, eval_batches=1)


def test_retrieval_labels_are_the_value_stored_under_the_query(task):
    """A wide enough head learns the lookup almost perfectly: the labels are consistent with the inputs. (250
    steps: with GPT-2's scaled initialization of c_proj, which grown GPT-2s built from a config have had since
    ae14d91, this seed reaches 0.77 accuracy at 150 steps, 0.99 at 200 and 1.0 at 250.)"""
    torch.manual_seed(0)
    run = train_variant(
        Variant("fixed-large", 8), task, steps=250, lr=3e-3, warmup=10, eval_every=250, log=lambda _: None
    )
    assert run.curve[-1].metrics["accuracy"] >= 0.9
    assert run.final_loss < 0.5 * run.curve[0].eval_loss


@pytest.mark.parametrize("mode", ["append", "zero"])
def test_growth_inside_train_variant_preserves_the_held_out_loss(task, mode):
    """zero-init widening keeps the function exactly; append's line search never takes a step that is worse on
    its own held-out batches (step 0 is among its candidates)."""
    run = train_variant(
        Variant("grown", 2, mode, {10: 8}), task, steps=12, lr=3e-3, warmup=2, eval_every=6, log=lambda _: None
    )
    (growth,) = run.growths
    assert growth.qk_dims == [8]
    if mode == "zero":
        assert growth.eval_loss_after == pytest.approx(growth.eval_loss_before, abs=1e-5)
    else:
        assert growth.search_loss_after <= growth.search_loss_before
    assert run.overhead_flops > 0 if mode == "append" else run.overhead_flops == 0


def test_plateau_task_asks_stored_keys_and_labels_their_values():
    task = plateau_task(keys=64, values=4, pairs=8, queries=3, n_embd=16, n_head=1, batch_size=5, eval_batches=1)
    batch = task.train_batch(1)
    keys, values, labels = batch["input_ids"], batch["value_ids"], batch["labels"]
    assert keys.shape == values.shape == labels.shape == (5, 11)
    assert (labels[:, :8] == -100).all() and (values[:, 8:] == 64 + 4).all()  # the query marker token
    for row in range(5):
        stored = dict(zip(keys[row, :8].tolist(), values[row, :8].tolist()))
        assert len(stored) == 8  # distinct stored keys
        assert [stored[key] for key in keys[row, 8:].tolist()] == labels[row, 8:].tolist()
    assert task.train_batch(1)["input_ids"].equal(keys) and not task.train_batch(2)["input_ids"].equal(keys)
    torch.manual_seed(0)
    model = train_variant(Variant("fixed", 4), task, steps=1, lr=1e-3, warmup=1, eval_every=1, log=lambda _: None)
    assert model.curve[0].eval_loss > 0.5 * torch.log(torch.tensor(4.0))  # an untrained model is on the plateau


def test_steps_to_escape_is_the_first_scheduled_evaluation_below_the_threshold():
    curve = [CurvePoint(step, 0, 0.0, loss, scheduled=scheduled) for step, loss, scheduled in
             [(0, 3.0, True), (10, 2.8, True), (15, 0.5, False), (20, 1.0, True), (30, 0.1, True)]]
    run = Run("v", curve, [], 0.0, 0.0, 0.0)
    assert steps_to_escape(run, 1.2) == 20  # the extra evaluation at a growth (step 15) does not count
    assert steps_to_escape(run, 0.05) is None


def test_bench_bottleneck_runs_the_plateau_preset(tmp_path, capsys):
    output = str(tmp_path / "out")
    bench_bottleneck.main(
        ["--preset", "tiny", "--tasks", "plateau", "--seeds", "1", "--steps", "20", "--output", output]
    )
    printed = capsys.readouterr().out
    assert "steps to escape" in printed
    assert "grown-append (new_moments=head_mean)" in printed
    assert (tmp_path / "out.json").exists()


def test_bench_bottleneck_prints_a_table_without_fixed_large(tmp_path, capsys):
    """A part run without fixed-large (e.g. only the grown variants and the baselines) still gets its table,
    without the steps to fixed-large's loss."""
    bench_bottleneck.main([
        "--preset", "tiny", "--tasks", "plateau", "--seeds", "1", "--steps", "20", "--output", str(tmp_path / "out"),
        "--variants", "zero", "grown-append (new_moments=head_mean)",
    ])
    printed = capsys.readouterr().out
    assert "| grown-append (new_moments=head_mean) |" in printed and "| zero |" in printed
    assert "steps to escape" in printed and "GFLOPs to it" not in printed


def test_bench_train_after_growth_scores_rankings_and_reads_arms():
    from bench_train_after_growth import parse_arm, ranking_scores

    scores = torch.tensor([[0.9, 0.1, 0.2], [0.8, 0.5, 0.1], [0.1, 0.2, 0.3]])  # ranks 0, 1, 0 (1-based: 1, 2, 1)
    mrr, ndcg = ranking_scores(scores)
    assert mrr == pytest.approx((1 + 1 / 2 + 1) / 3)
    assert ndcg == pytest.approx((1 + 1 / torch.log2(torch.tensor(3.0)).item() + 1) / 3)
    assert ranking_scores(scores, cutoff=1) == pytest.approx((2 / 3, 2 / 3))  # the second query's code is not first
    assert parse_arm("zero") == ("zero", {"step_size": 0.0})
    assert parse_arm("original") == ("original", None)
    assert parse_arm('rtol=1e-2={"rtol": 0.01}') == ("rtol=1e-2", {"rtol": 0.01})


def test_bench_train_after_growth_lm_splits_texts_and_trains_every_arm_on_the_same_batches():
    """The held-out documents are re-cut without overlap, windows hold each token once, and zero widening (the
    same function) continues training like the original, and a "step_scale" arm takes that fraction of the searched
    step, on a tiny GPT-2 and a random walk of tokens (which the searched step gains on)."""
    from bench_growth import make_model
    from bench_train_after_growth_lm import run_model, split_documents, tables, windows

    documents = {"train": ["t"], "stats": [f"s{i}" for i in range(20)], "held_out": [f"h{i}" for i in range(30)]}
    split = split_documents(documents)
    assert split["train"] == ["t"]
    assert sorted(sum((split[name] for name in ("statistics", "other", "search", "test")), [])) == sorted(
        documents["stats"] + documents["held_out"])
    stream = torch.arange(200)  # 12 whole windows of 16 tokens
    assert torch.cat([batch["input_ids"].flatten() for batch in windows(stream, 5, 3, 16)]).equal(stream[:192])
    assert len(windows(stream, 9, 5, 16)) == 2  # the partial batch is left out
    assert windows(stream, 2, 4, 16)[1]["labels"][0, 0] == 64 and len(windows(stream, 2, 4, 16)) == 2
    torch.manual_seed(0)
    names = ("statistics", "other", "search", "test")
    texts = {name: torch.randint(0, 4, (4 * 16 * 3,)).cumsum(0) % 256 for name in names}
    batches = {name: windows(text, 3, 4, 16) for name, text in texts.items()}
    model = make_model(32, 1, 2, 16, seed=0)
    # trained a little first: at random weights the searched step gained two float32 units of the loss, which the
    # line search now takes for rounding (step 0)
    train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), batches["other"] * 5)
    arms = ["original", "zero", "default", 'half={"step_scale": 0.5}']
    results, diagnostics = run_model(model.eval(), batches, texts["statistics"], arms, p=2, at=[0, 2, 3], lr=1e-3,
                                     seeds=2)
    assert set(diagnostics) == {"zero", "default", "half"} and diagnostics["zero"]["step"] == 0
    assert diagnostics["default"]["step"] > 0
    assert diagnostics["half"]["step"] == pytest.approx(0.5 * diagnostics["default"]["step"])  # searched, halved
    for seed in range(2):
        assert results["zero"][seed][0] == pytest.approx(results["original"][seed][0], abs=1e-5)
        assert results["zero"][seed][3] == pytest.approx(results["original"][seed][3], abs=1e-3)
    assert results["original"][0][3] != results["original"][1][3]  # the seed draws the batches
    assert "| zero | 0.0000 ± 0.0000 |" in tables(results, diagnostics, [0, 2, 3])


def test_bench_train_after_growth_caps_each_heads_change_of_its_old_form():
    """A "max_change" arm takes the step chosen with the other options and shrinks only the heads whose Z would
    change by more than the cap (to the cap, up to the float32 weights' rounding); a cap no head reaches changes
    nothing."""
    from bench_train_after_growth import grow, head_changes
    from sentence_pairs import contrastive_loss
    from transformers import BertConfig, BertModel

    import hf_grow

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32)
    model = BertModel(config).eval()
    batches = [{"input_ids": torch.randint(0, 64, (8, 12)), "attention_mask": torch.ones(8, 12, dtype=torch.long)}
               for _ in range(6)]
    statistics = hf_grow.collect_statistics(model, batches[:4], hf_grow.get_adapter(model), loss_fn=contrastive_loss)
    arm = lambda options: grow(model, options, batches[:4], batches[4:], statistics, 2, contrastive_loss)  # noqa: E731
    default = head_changes(model, arm({"step_size": 0.2}))
    assert default.min() > 0.01
    uncapped = arm({"step_size": 0.2, "max_change": 1e9})
    assert head_changes(model, uncapped).equal(default)
    cap = default.median().item()
    capped = head_changes(model, arm({"step_size": 0.2, "max_change": cap}))
    below = default <= cap
    assert capped[below].equal(default[below])  # those heads keep the step
    assert (capped[~below] <= cap * (1 + 1e-5)).all() and (capped[~below] > (1 - 1e-3) * cap).all()


def test_bench_bottleneck_names_the_step_scale_variants_for_variants_selection():
    plateau = bench_bottleneck.PRESETS["cpu"]["plateau"]
    variants = {variant.name: variant for variant in bench_bottleneck.task_variants(plateau)}
    assert variants["grown-refactor (step_scale=1.0)"].options == {"step_scale": 1.0}
    assert variants["grown-refactor (step_scale=0.25)"].mode == "refactor"


def test_bench_growth_callback_trains_every_arm_alike_and_grows_through_the_trainer():
    """Every arm of a seed starts from the same model and batches: zero widening and the moments' restart (the
    same function) score as the original right after the growth; the previous default takes a tenth of the step
    that "whole" takes, both from the Trainer's own training set through `GrowthCallback`; the table pairs each
    arm with the original by seed."""
    from bench_growth_callback import PRESETS, parse_arm, run_seed, table

    assert parse_arm("whole") == ("whole", {"mode": "refactor", "step_scale": 1.0, "cross_fit": False,
                                            "keep_attention_scale": False, "rtol": 1e-6})
    assert parse_arm('step0={"step_size": 0.0}') == ("step0", {"step_size": 0.0})
    with pytest.raises(Exception, match="name=\\{json options\\}"):
        parse_arm("halfway")
    # 12 steps of 4 windows: the training set holds the callback's 8 + 4 batches
    settings = {**PRESETS["cpu"], "n_embd": 32, "n_head": 2, "seq_len": 32, "batch_size": 4, "steps": 12,
                "grow_at": 3, "eval_every": 3, "eval_windows": 8, "threads": 1, "cpu": True}
    arms = ("original", "zero", "default", "previous-default", "whole", "restart")
    settings["arms"] = dict(parse_arm(arm) for arm in arms)
    results = {r["arm"]: r for r in run_seed(0, settings)}
    assert set(results) == set(arms)
    for arm in ("zero", "restart"):  # the same function right after the growth (the moments' restart)
        assert results[arm]["losses"][3] == pytest.approx(results["original"]["losses"][3], abs=1e-5)
    assert results["restart"]["qk_head_dims"] == [8, 8]
    assert results["restart"]["losses"][12] != results["original"]["losses"][12]  # the restart changes training
    assert results["default"]["qk_head_dims"] == [16, 16] and results["original"]["qk_head_dims"] == [8, 8]
    assert results["whole"]["step_size"] > 0 and results["default"]["step_size"] > 0
    assert results["previous-default"]["step_size"] == pytest.approx(0.1 * results["whole"]["step_size"])
    assert results["original"]["losses"][12] < results["original"]["losses"][3]  # it trains
    text = table(list(results.values()), settings)
    assert "| zero | +0.0000 ± 0.0000 (0/1)" in text and "| whole | 0 |" in text


def test_bench_growth_callback_diagnostics_change_only_what_they_name():
    """The probe measures without changing training (one thread: the same losses to the last digit); a learning
    rate of the new dims at 1x trains as the plain arm, at 0x leaves the new dims where the growth put them; the
    probe sees the new dims move in the first and not in the second."""
    from bench_growth_callback import PRESETS, parse_arm, run_seed, table

    settings = {**PRESETS["cpu"], "n_embd": 32, "n_head": 2, "seq_len": 32, "batch_size": 4, "steps": 12,
                "grow_at": 3, "eval_every": 3, "eval_windows": 8, "threads": 1, "cpu": True, "probe": False}
    arms = ['append={"mode": "append"}', 'lr1={"mode": "append", "new_dims_lr": 1.0}',
            'frozen={"mode": "append", "new_dims_lr": 0.0}']
    settings["arms"] = dict(parse_arm(arm) for arm in arms)
    plain = {r["arm"]: r for r in run_seed(0, settings)}
    probed = {r["arm"]: r for r in run_seed(0, {**settings, "probe": True})}
    assert probed["append"]["losses"] == plain["append"]["losses"]
    assert plain["lr1"]["losses"] == plain["append"]["losses"]
    assert plain["frozen"]["losses"][12] != plain["append"]["losses"][12]
    moving, frozen = probed["append"]["probe"]["2-10"], probed["frozen"]["probe"]["2-10"]
    assert moving["step_q_new"] > 0.01 and moving["score_rate"] > 0 and 0 < moving["gain_q_new"]
    assert frozen["step_q_new"] == 0 and frozen["step_k_new"] == 0 and frozen["score_rate"] == 0
    assert frozen["step_q_old"] > 0.01  # the old dims still train
    # frozen new dims on the inputs fixed at the growth: their scores move only with the old dims' (the ratio's
    # denominator); on each step's own inputs they differ
    first = probed["frozen"]["probe"]["1-1"]
    assert first["score_share"] == pytest.approx(first["score_share_now"])
    assert frozen["score_share_now"] != pytest.approx(frozen["score_share"], rel=1e-3)
    assert "| frozen | 2-10 |" in table(list(probed.values()), settings)


def test_bench_input_spectrum_counts_the_directions_each_tolerance_keeps():
    """bench_input_spectrum: C summed from the attention inputs the growth would see (layer 0: LayerNorm of the
    embeddings, with the ones column), and per tolerance the eigenvalues kept and the trace share dropped."""
    from bench_growth_callback import PRESETS
    from bench_input_spectrum import input_second_moments, spectrum_rows, table, trained_to_growth

    settings = {**PRESETS["cpu"], "n_embd": 32, "n_head": 2, "seq_len": 16, "batch_size": 4, "steps": 6,
                "grow_at": 2, "cpu": True}
    model = trained_to_growth(settings, seed=0)
    ids = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(0))
    moments = input_second_moments(model, [{"input_ids": row, "labels": row} for row in ids], batch_size=4)
    assert len(moments) == 2 and moments[0].shape == (33, 33) and moments[0].dtype == torch.float64
    with torch.no_grad():
        embeddings = model(input_ids=ids, output_hidden_states=True).hidden_states[0]
        x = model.transformer.h[0].ln_1(embeddings).flatten(0, 1).double()
    x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
    torch.testing.assert_close(moments[0], x.T @ x, rtol=1e-10, atol=1e-8)

    eigenvalues = torch.tensor([1.0, 2e-2, 5e-4, 2e-5, 3e-6, 0.0], dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
    (row,) = spectrum_rows([basis @ torch.diag(eigenvalues) @ basis.T])
    assert [row[f"kept@{rtol:g}"] for rtol in (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)] == [5, 4, 3, 2, 2]
    assert row["dropped_trace@1e-05"] == pytest.approx(3e-6 / eigenvalues.sum().item(), rel=1e-6)
    assert row["largest_over_mean"] == pytest.approx(6 / eigenvalues.sum().item(), rel=1e-9)
    assert "| 0 | 6 | 5 | 4 | 3 | 2 | 2 |" in table([row])


def test_bench_growth_and_bench_stats_print_their_tables_at_their_smallest(tmp_path, capsys, monkeypatch):
    """Both failed after the library changed and nothing ran them (a smoke run of every benchmark, 2026-11-28):
    bench_growth's full-rank reference (None where two step modes were searched), bench_stats with one length."""
    import bench_growth
    import bench_stats

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a machine without CUDA: no triton rows (interpreted, minutes)
    monkeypatch.setattr(sys, "argv", ["bench_growth", "--preset", "tiny", "--models", "1", "--json",
                                      str(tmp_path / "growth.json")])
    bench_growth.main()
    assert "Unconstrained full-rank update (reference, search='fast'): held-out" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["bench_stats", "--preset", "cpu", "--seq-lens", "64", "--rounds", "1",
                                      "--batch-size", "1", "--threads", "1", "--solve-heads", "4", "--solve-width",
                                      "129", "--solve-qk-dim", "16"])
    bench_stats.main()
    assert "# grow_model at seq 64" in capsys.readouterr().out


def test_bench_score_scale_prints_its_table_at_its_smallest(monkeypatch, capsys):
    import bench_score_scale

    monkeypatch.setattr(sys, "argv", ["bench_score_scale", "--steps", "5", "--stats-batches", "2", "--eval-batches",
                                      "2", "--batch-size", "4", "--seq-len", "32"])
    bench_score_scale.main()
    out = capsys.readouterr().out
    assert "| steps | step | loss | score rms | rms x | max abs score | bf16 error | bf16 error, rotated |" in out
    assert "\n| 5 | " in out


def test_bench_bf16_serving_prints_its_table_at_its_smallest(tmp_path, capsys):
    """One row per arm after the original's, each with a Q/K norm ratio per layer; step 0 keeps the norms but
    for the scale folded into the queries."""
    import bench_bf16_serving

    bench_bf16_serving.main(["--quick", "--train-steps", "5", "--cache", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| arm | step | test loss | bf16 logits' largest error |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| arm")]
    assert [row.split(" | ")[0] for row in rows] == ["| original", "| zero", "| default", "| dct"]
    assert rows[1].endswith("1.22 / 1.00 |") and len(rows[2].rsplit(" | ", 1)[1].split("  ")) == 4


def test_bench_probe_eigh_times_every_method_and_checks_they_agree(monkeypatch, capsys):
    import bench_probe_eigh

    monkeypatch.setattr(sys, "argv", ["bench_probe_eigh", "--k", "24", "--w", "6", "--heads", "3", "--repeats", "1"])
    bench_probe_eigh.main()
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith(("torch.", "scipy")) and "(s)" not in line
                and "within" not in line]) == 3
    errors = [float(part.split(" ")[0]) for line in out.splitlines() if "within" in line
              for part in line.split("within ")[1:]]
    assert len(errors) == 4 and max(errors) < 1e-12
