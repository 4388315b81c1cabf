"""The command's text: held-out defaults that fit small local text, and one-line errors for bad inputs."""

import glob
import os
import shutil
import sysconfig

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_grow import cli, load_growth_report
from hf_grow.data import DEFAULT_EVAL_TOKENS, split_held_out
from hf_grow.growth import split_batches
from quickstart import train_small_gpt2
from test_cli import TRAIN_FILES, run_cli


STDLIB_FILES = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A GPT-2 with 128 positions and its byte-level BPE tokenizer, trained briefly on standard-library sources."""
    folder = tmp_path_factory.mktemp("model")
    train_small_gpt2(folder, TRAIN_FILES, steps=20, vocab_size=400)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One plain text file of 55,000 characters (real Python source the model was not trained on)."""
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("".join(open(f).read() for f in STDLIB_FILES[40:80])[:55_000])
    return path


def split_line(stdout: str) -> tuple[int, int]:
    """The tokens of each side from the command's line ``text: S tokens for the statistics, H held out (...)``."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("text: ")]
    statistics, held_out = line.removeprefix("text: ").split(" tokens for the statistics, ")
    return int(statistics.replace(",", "")), int(held_out.split(" held out")[0].replace(",", ""))


def test_the_plain_command_grows_on_a_small_text_file(model_folder, corpus, tmp_path):
    """A newcomer's first command, no data options besides the file: 10% of the text is held out."""
    output = tmp_path / "out"
    result = run_cli(str(model_folder), "--p", "8", "--data", str(corpus), "--output-dir", str(output),
                     "--seq-len", "128")
    assert result.returncode == 0, result.stderr[-3000:]
    statistics_tokens, held_out_tokens = split_line(result.stdout)
    sequences = (statistics_tokens + held_out_tokens) // 128
    assert 100 < sequences < 500  # all the text was read: 55,000 characters are some 20,000-30,000 tokens
    assert held_out_tokens == 128 * round(0.1 * sequences)
    report = load_growth_report(output)
    assert report.statistics_tokens == statistics_tokens and report.config["eval_fraction"] == 0.1
    assert report.eval_weight == held_out_tokens - held_out_tokens // 128  # next-token terms of the held-out text
    assert report.qk_dims_after == [24, 24] and report.eval_loss_after <= report.eval_loss_before


def test_budget_and_inspect_take_the_same_split(model_folder, corpus, tmp_path, capsys):
    common = ["--data", str(corpus), "--seq-len", "128", "--quiet"]
    assert cli.main(["inspect", str(model_folder), *common, "--max-dims", "4", "--layers-only"]) == 0
    inspected = capsys.readouterr().out
    assert cli.main([str(model_folder), *common, "--budget", "16", "--multiple-of", "8", "--output-dir",
                     str(tmp_path / "out")]) == 0
    grown = capsys.readouterr().out
    assert split_line(inspected) == split_line(grown)
    assert load_growth_report(tmp_path / "out").budget == 16
    # an explicit --eval-tokens wins, and --eval-fraction sets the share
    assert cli.main(["inspect", str(model_folder), *common, "--max-dims", "1", "--eval-tokens", "1000"]) == 0
    assert split_line(capsys.readouterr().out)[1] == 896  # whole sequences of 128 tokens
    assert cli.main(["inspect", str(model_folder), *common, "--max-dims", "1", "--eval-fraction", "0.5"]) == 0
    statistics_tokens, held_out_tokens = split_line(capsys.readouterr().out)
    assert abs(statistics_tokens - held_out_tokens) <= 128
    # --max-batches: the tokens of the batches the statistics take (the line counted all the text's)
    assert cli.main([str(model_folder), *common, "--p", "8", "--max-batches", "2", "--step-size", "0",
                     "--output-dir", str(tmp_path / "few")]) == 0
    statistics_tokens = load_growth_report(tmp_path / "few").statistics_tokens
    assert split_line(capsys.readouterr().out)[0] == 2 * 8 * 128 == statistics_tokens


def windows(count: int, length: int = 8) -> list[torch.Tensor]:
    return [torch.full((length,), index) for index in range(count)]


def test_split_sizes():
    statistics, held_out = split_held_out(windows(100), 8, max_tokens=10**6, eval_tokens=None, eval_fraction=0.1)
    assert (len(statistics), len(held_out)) == (90, 10)
    assert [int(w[0]) for w in held_out] == list(range(90, 100))  # the tail, disjoint from the statistics
    statistics, held_out = split_held_out(windows(100), 8, max_tokens=200, eval_tokens=None, eval_fraction=0.1)
    assert (len(statistics), len(held_out)) == (25, 10)  # the statistics are capped, the held-out text is not
    statistics, held_out = split_held_out(windows(100), 8, max_tokens=10**6, eval_tokens=100, eval_fraction=0.1)
    assert (len(statistics), len(held_out)) == (88, 12)  # explicit tokens win, in whole windows
    statistics, held_out = split_held_out(windows(3), 8, max_tokens=10**6, eval_tokens=None, eval_fraction=0.1)
    assert (len(statistics), len(held_out)) == (2, 1)  # at least one window
    long = windows(1000, length=1000)
    statistics, held_out = split_held_out(long, 1000, max_tokens=10**9, eval_tokens=None, eval_fraction=0.1)
    assert len(held_out) * 1000 == DEFAULT_EVAL_TOKENS and len(statistics) == 950  # at most 50,000 by default


@pytest.mark.parametrize("count", [2, 3, 9, 10, 15, 24, 25, 100])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_the_command_holds_out_as_grow_model_does(count, fraction):
    """The command's sequences and the Python API's batches are held out by the same rule (eval_fraction)."""
    _, held_batches = split_batches(list(range(count)), None, fraction, needs_eval=True)
    _, held_windows = split_held_out(windows(count), 8, max_tokens=10**6, eval_tokens=None, eval_fraction=fraction)
    assert len(held_windows) == len(held_batches)


def test_split_errors_name_the_flag_that_fixes_them():
    with pytest.raises(ValueError, match="too short: it gives 1 sequence.*pass more text or a smaller --seq-len"):
        split_held_out(windows(1), 8, max_tokens=10**6, eval_tokens=None, eval_fraction=0.1)
    with pytest.raises(ValueError, match="--eval-tokens 80 holds out all 10 sequences.*a smaller --eval-tokens"):
        split_held_out(windows(10), 8, max_tokens=10**6, eval_tokens=80, eval_fraction=0.1)


def bad_inputs(model_folder, corpus, tmp_path):
    """Each bad input as (arguments, message) for `test_bad_input_is_one_line_and_writes_nothing`."""
    truncated = tmp_path / "truncated"
    shutil.copytree(model_folder, truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    mismatched = tmp_path / "mismatched"
    shutil.copytree(model_folder, mismatched)  # the tokenizer of 400 tokens beside a model of 100
    GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=128, n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        mismatched
    )
    unsharded, sharded, damaged_index = tmp_path / "unsharded", tmp_path / "sharded", tmp_path / "damaged-index"
    for copy in (unsharded, sharded, damaged_index):
        shutil.copytree(model_folder, copy)
        (copy / "model.safetensors").unlink()  # an interrupted download: no weights, a shard or a whole index short
    GPT2LMHeadModel.from_pretrained(model_folder).save_pretrained(sharded, max_shard_size="200KB")
    shutil.copytree(sharded, damaged_index, dirs_exist_ok=True)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    # what from_pretrained does not read is not checked: an earlier save's index beside the file it reads first, the
    # index of .bin shards a safetensors-only download left out
    shutil.copy(damaged_index / "model.safetensors.index.json", mismatched / "model.safetensors.index.json")
    (mismatched / "pytorch_model.bin.index.json").write_text('{"weight_map": {"x": "pytorch_model-1-of-2.bin"}}')
    index = damaged_index / "model.safetensors.index.json"
    index.write_text(index.read_text()[:100])
    broken_config = tmp_path / "broken-config"
    shutil.copytree(model_folder, broken_config)
    (broken_config / "config.json").write_text("{not json")
    binary = tmp_path / "binary.dat"
    binary.write_bytes(bytes(range(256)) * 100)
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text(corpus.read_text()[:5000], encoding="utf-16")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    folder = tmp_path / "texts"
    folder.mkdir()
    return {
        "truncated weights": (
            [str(truncated), "--data", str(corpus)],
            "weights file model.safetensors is damaged or incomplete",
        ),
        "binary --data": ([str(model_folder), "--data", str(binary)], "binary.dat is not text: "),
        "UTF-16 --data": ([str(model_folder), "--data", str(utf16)], "utf16.txt is not text: "),
        "empty --data": ([str(model_folder), "--data", str(empty)], "the text is too short: it gives 0 sequence"),
        "a folder as --data": ([str(model_folder), "--data", str(folder)], "is a folder: pass its text files"),
        "a missing file": ([str(model_folder), "--data", str(tmp_path / "nope.txt")], "no text file at"),
        "another model's tokenizer": ([str(mismatched), "--data", str(corpus)], "past the model's vocabulary of 100"),
        "a broken config.json": ([str(broken_config), "--data", str(corpus)], "not a valid JSON file"),
        "--eval-tokens over the text": (
            [str(model_folder), "--data", str(corpus), "--eval-tokens", "50000"], "pass a smaller --eval-tokens"
        ),
        "a text file as --stats": (
            [str(model_folder), "--data", str(corpus), "--stats", str(corpus)], "cannot read statistics from"
        ),
        "a weights file as the model": (
            [str(model_folder / "model.safetensors"), "--data", str(corpus)], "it is a file; pass a Hub id or the"
        ),
        "a folder as --stats": (
            [str(model_folder), "--data", str(corpus), "--stats", str(folder)], "is a folder: pass the file written"
        ),
        "a mistyped model folder": (  # was the Hub's "Repo id must be in the form 'repo_name' or ..."
            [str(tmp_path / "no-such-model"), "--data", str(corpus)], "no folder there, and not a Hub id"
        ),
        "a folder as --report": ([str(model_folder), "--data", str(corpus), "--report", str(folder)], "is a folder"),
        "a folder as --json": ([str(model_folder), "--data", str(corpus), "--json", str(folder)], "is a folder"),
        "no weights file": ([str(unsharded), "--data", str(corpus)], "holds no weights file (model.safetensors"),
        "a missing shard": ([str(sharded), "--data", str(corpus)], "it lacks model-00002-of-00003.safetensors, named"),
        "a damaged index": ([str(damaged_index), "--data", str(corpus)], "its index file model.safetensors.index.json"),
        "--json onto --save-stats": (  # the inspection replaced the statistics it had just saved
            [str(model_folder), "--data", str(corpus), "--json", str(tmp_path / "out")],
            "--json and --save-stats name the same file",
        ),
    }


BAD_INPUTS = ["truncated weights", "binary --data", "UTF-16 --data", "empty --data", "a folder as --data",
              "a missing file", "another model's tokenizer", "a broken config.json", "--eval-tokens over the text",
              "a text file as --stats", "a folder as --stats",
              "a weights file as the model", "a mistyped model folder", "a folder as --report", "a folder as --json",
              "--json onto --save-stats", "no weights file", "a missing shard", "a damaged index"]
MAIN_ONLY, INSPECT_ONLY = ("--stats", "--report"), ("--json",)


@pytest.mark.parametrize(
    "command, name",
    [("grow", name) for name in BAD_INPUTS if not any(option in name for option in INSPECT_ONLY)]
    + [("inspect", name) for name in BAD_INPUTS if not any(option in name for option in MAIN_ONLY)],
)
def test_bad_input_is_one_line_and_writes_nothing(model_folder, corpus, tmp_path, capsys, command, name):
    arguments, message = bad_inputs(model_folder, corpus, tmp_path)[name]
    if command == "inspect":
        arguments = ["inspect", *arguments, "--save-stats", str(tmp_path / "out")]
    else:
        arguments = [*arguments, "--output-dir", str(tmp_path / "out")]
    files_before = sorted(path.name for path in model_folder.iterdir())
    capsys.readouterr()  # what building the inputs printed
    assert cli.main([*arguments, "--seq-len", "128", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith("hf-grow: error: ") and not captured.out
    assert not (tmp_path / "out").exists() and sorted(path.name for path in model_folder.iterdir()) == files_before


@pytest.mark.parametrize("name", ["p too wide", "a budget too large", "--stats of another model", "the pairs"])
def test_a_growth_the_model_cannot_take_is_refused_before_any_text_or_weights(
    model_folder, corpus, tmp_path, capsys, monkeypatch, name
):
    """Checked on the model's config alone (a meta model, as for the memory plan), not after the data is read."""
    from hf_grow import collect_statistics, get_adapter

    other = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 100, (2, 16))
    collect_statistics(other, [{"input_ids": ids, "labels": ids}], get_adapter(other)).save(tmp_path / "other.st")

    def never(*args, **kwargs):
        raise AssertionError("text, tokenizer or weights read before the refusal")

    for reader in ("text_batches", "load_model", "load_tokenizer"):
        monkeypatch.setattr(f"hf_grow.cli.commands.{reader}", never)
    arguments, message = {
        "p too wide": (["--p", "1000"], "the width of the query/key projections' inputs"),
        "a budget too large": (["--budget", "100000"], "budget 100000 exceeds"),
        "--stats of another model": (["--stats", str(tmp_path / "other.st")], "collected for another model"),
        "the pairs": (["--p", "1000", "--pairs", str(corpus)], "the width of the query/key projections' inputs"),
    }[name]
    data = [] if name == "the pairs" else ["--data", str(corpus)]
    monkeypatch.setattr("hf_grow.cli.commands.grow_from_pairs", never)
    assert cli.main([str(model_folder), *data, *arguments, "--output-dir", str(tmp_path / "out"), "--quiet"]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1, error


def test_an_unreadable_file_is_one_line(model_folder, corpus, tmp_path, capsys, monkeypatch):
    """(Permissions do not stop root, so reading fails by hand here.)"""
    import builtins

    def refusing_open(path, *args, **kwargs):
        if str(path) == str(corpus):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr("hf_grow.data.open", refusing_open, raising=False)
    assert cli.main([str(model_folder), "--data", str(corpus), "--output-dir", str(tmp_path / "out"), "--quiet"]) == 2
    error = capsys.readouterr().err
    assert f"cannot read --data file '{corpus}': Permission denied" in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_few_undecodable_bytes_are_a_warning(model_folder, corpus, tmp_path, capsys):
    """Text in another encoding with a few non-ASCII letters (Latin-1 here) is read, and the share is said."""
    latin1 = tmp_path / "latin1.txt"
    text = corpus.read_text().replace("e", "\u00e9", 400).encode("latin-1")
    latin1.write_bytes(text)
    arguments = [str(model_folder), "--data", str(latin1), "--seq-len", "128", "--step-size", "0", "--quiet"]
    assert cli.main([*arguments, "--output-dir", str(tmp_path / "out")]) == 0
    error = capsys.readouterr().err
    share = 400 / len(text)
    assert error.strip() == f"hf-grow: warning: {share:.2%} of the bytes of {latin1} are not UTF-8 text: read as U+FFFD"


def test_a_file_named_twice_is_read_once(model_folder, corpus, tmp_path, capsys):
    """Named by a glob and by its path (or a link), a file would put the same text in the statistics and in the
    held-out tail: it is read once, with a warning, and the split is the one of the file named once."""
    (tmp_path / "link.txt").symlink_to(corpus)
    arguments = ["--seq-len", "128", "--step-size", "0", "--quiet"]
    assert cli.main([str(model_folder), "--data", str(corpus), *arguments, "--output-dir", str(tmp_path / "once")]) == 0
    capsys.readouterr()
    twice = [str(model_folder), "--data", str(corpus), str(tmp_path / "link.txt"), str(corpus), *arguments]
    assert cli.main([*twice, "--output-dir", str(tmp_path / "twice")]) == 0
    warnings = capsys.readouterr().err.strip().splitlines()
    assert warnings == [f"hf-grow: warning: --data names {str(tmp_path / 'link.txt')!r} more than once: read once",
                        f"hf-grow: warning: --data names {str(corpus)!r} more than once: read once"]
    once, twice = load_growth_report(tmp_path / "once"), load_growth_report(tmp_path / "twice")
    assert twice.statistics_tokens == once.statistics_tokens


def test_library_warnings_are_lines_of_the_command(model_folder, corpus, tmp_path):
    """A library warning points at its caller's line, which for the command is no file of the user's (it read
    ``<frozen runpy>:88: UserWarning: ...``): the command writes it as its own warnings, and a caller recording
    warnings still gets it."""
    import warnings

    from hf_grow.cli.commands import _warnings_as_lines

    with _warnings_as_lines():
        assert warnings.formatwarning("wide", UserWarning, "<frozen runpy>", 88) == "hf-grow: warning: wide\n"
        assert warnings.formatwarning("old", FutureWarning, "x.py", 1) == "hf-grow: warning: FutureWarning: old\n"
    assert "<frozen runpy>:88" in warnings.formatwarning("wide", UserWarning, "<frozen runpy>", 88)  # put back
    arguments = [str(model_folder), "--data", str(corpus), "--seq-len", "128", "--max-batches", "2", "--quiet"]
    with pytest.warns(UserWarning, match=r"query/key widths \[19\] are not multiples of 8"):
        assert cli.main([*arguments, "--p", "3", "--step-size", "0", "--output-dir", str(tmp_path / "out")]) == 0


def test_the_card_says_where_the_held_out_text_came_from():
    from argparse import Namespace

    from hf_grow.cli.text import data_description

    options = dict(data=None, dataset="my/corpus", dataset_config=None, split="train")
    tail, _ = data_description(Namespace(**options, eval_split="train"))  # the tail of the same split
    assert tail == "`my/corpus`, split `train` (held out: its tail)"
    other, names = data_description(Namespace(**options, eval_split="validation"))
    assert other == "`my/corpus`, split `train` (held out: `validation`)" and names == ["my/corpus"]
