"""Progress for a person at a terminal (tqdm bars) and for a log file (plain lines with rate and time left)."""

import io

import pytest
from tqdm.auto import tqdm

from hf_grow import progress
from hf_grow.progress import LogProgress, format_bytes, format_seconds, progress_bar, stage


class FakeStderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class Log:
    """stderr as pytest captures it: a pipe, as in a log file, never a terminal."""

    def __init__(self, capsys):
        self.capsys, self.text = capsys, ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def log(capsys) -> Log:
    return Log(capsys)


def test_a_log_gets_lines_with_rate_and_time_left(log, monkeypatch):
    monkeypatch.setattr(progress, "LOG_INTERVAL_SECONDS", 0.0)  # a line at every update
    assert list(progress_bar(range(4), desc="statistics", unit="batch")) == [0, 1, 2, 3]
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("statistics: 1/4 batch (25%), ") and "batch/s" in lines[0] and "left" in lines[0]
    assert lines[-1].startswith("statistics: 4/4 batch, done in ")
    assert "\r" not in log.getvalue()  # no carriage returns of bars in a log


def test_a_log_gets_one_closing_line_within_the_interval(log):
    with progress_bar(desc="line search", unit="eval") as bar:
        for step in (0.1, 0.4):
            bar.update()
            bar.set_postfix(step=step)
    assert log.getvalue().splitlines() == [log.getvalue().splitlines()[0]]
    assert log.getvalue().startswith("line search: 2 eval, done in ") and "step=0.4" in log.getvalue()


def test_a_terminal_gets_a_bar_and_quiet_gets_nothing(monkeypatch):
    monkeypatch.setattr("sys.stderr", FakeStderr(tty=True))
    assert isinstance(progress_bar(range(2), desc="statistics", unit="batch"), tqdm)
    quiet = FakeStderr(tty=False)
    monkeypatch.setattr("sys.stderr", quiet)
    assert list(progress_bar(range(2), desc="statistics", unit="batch", enabled=False)) == [0, 1]
    with stage("writing", enabled=False):
        pass
    assert quiet.getvalue() == ""


def test_a_stage_says_when_it_starts_and_ends(log):
    with stage("writing the grown model to out"):
        pass
    first, last = log.getvalue().splitlines()
    assert first == "writing the grown model to out..." and last.startswith("writing the grown model to out: done in ")


def test_a_failed_stage_does_not_say_done(log):
    with pytest.raises(OSError), stage("writing"):
        raise OSError("disk full")
    assert "done" not in log.getvalue()


@pytest.mark.parametrize("seconds, text", [(7.44, "7.4 s"), (185, "3 min 05 s"), (3720, "1 h 02 min")])
def test_durations_read_at_a_glance(seconds, text):
    assert format_seconds(seconds) == text


@pytest.mark.parametrize("size, text", [(270_400, "264 KiB"), (3 * 2**20, "3 MiB"), (3.25 * 2**30, "3.25 GiB"),
                                        (31.1 * 2**30, "31.1 GiB")])
def test_sizes_under_a_mebibyte_are_not_zero(size, text):
    assert format_bytes(size) == text


def test_unknown_totals_give_counts_without_time_left(log, monkeypatch):
    monkeypatch.setattr(progress, "LOG_INTERVAL_SECONDS", 0.0)
    bar = LogProgress(iter(range(3)), desc="statistics", unit="batch")
    assert list(bar) == [0, 1, 2]
    assert all("left" not in line for line in log.getvalue().splitlines())


def test_a_loader_over_a_stream_counts_as_unknown_and_its_statistics_are_collected():
    """A DataLoader over an IterableDataset has __len__, which raises TypeError: the progress line and the
    statistics pass crashed on it (the training options took it as of unknown length)."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_grow import collect_statistics, get_adapter
    from hf_grow.progress import known_length

    class Stream(IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(0)
            for _ in range(4):
                ids = torch.randint(0, 50, (16,), generator=generator)
                yield {"input_ids": ids, "labels": ids}

    loader = DataLoader(Stream(), batch_size=2)
    assert known_length(loader) is None and known_length([1, 2]) == 2 and known_length(iter([1])) is None
    assert LogProgress(loader, desc="statistics", unit="batch").total is None
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=50, n_positions=32))
    streamed = collect_statistics(model, loader, get_adapter(model), progress=True)
    listed = collect_statistics(model, list(loader), get_adapter(model))
    assert streamed.num_batches == listed.num_batches == 2
    assert torch.equal(streamed.gradients[0], listed.gradients[0])
