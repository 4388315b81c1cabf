"""The command's outputs under failure: interrupted and failed writes leave the old output and say what was written,
outputs that would break the output or the input are refused before any work, an ignored signal stays ignored."""

import os
import re

import pytest

import hf_grow
from hf_grow import cli

from test_cli import SMALL, TEXT_GLOB, model_folder  # noqa: F401 (the fixture)


@pytest.mark.parametrize("case", ["SIGTERM while writing", "Ctrl-C after writing", "a full disk",
                                  "SIGTERM while the old output is removed"])
def test_an_interrupted_or_failed_write_leaves_the_old_output_and_says_what_was_written(model_folder, tmp_path,  # noqa: F811
                                                                                     capsys, monkeypatch, case):
    """SIGTERM (kill, timeout, a scheduler's stop) interrupts as Ctrl-C does: the staging folder is removed (it
    stayed, a loadable half-written model, and the old output was left under a hidden name when the signal came
    between the renames); an interruption after the output is in place says so; a save that fails with safetensors'
    own error (a full disk while serializing) is one line (it was a traceback)."""
    import signal

    from safetensors import SafetensorError

    from hf_grow.cli import commands

    output = tmp_path / "grown"
    assert cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--step-size", "0.0",
                     *SMALL]) == 0
    before = {path.name: path.read_bytes() for path in output.iterdir()}
    card = commands.write_card

    def failing_card(*args):
        card(*args)
        if case == "SIGTERM while writing":
            os.kill(os.getpid(), signal.SIGTERM)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def interrupted_push(args):
        raise KeyboardInterrupt

    if case == "Ctrl-C after writing":
        from hf_grow.cli import running

        monkeypatch.setattr(running, "push_output", interrupted_push)
    elif case == "SIGTERM while the old output is removed":  # it said "nothing was written" and left the old half
        from hf_grow.cli import running

        remove = running.shutil.rmtree

        def removing(path, **kwargs):
            if "hf-grow-old" in str(path):
                os.kill(os.getpid(), signal.SIGTERM)
            remove(path, **kwargs)

        monkeypatch.setattr(running.shutil, "rmtree", removing)
    else:
        monkeypatch.setattr(commands, "write_card", failing_card)
    handler = signal.getsignal(signal.SIGTERM)
    status = cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--overwrite",
                       "--step-size", "0.5", *SMALL])
    error = capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is handler  # put back
    assert sorted(path.name for path in tmp_path.iterdir()) == ["grown"]  # no staging or replaced folder left
    if case in ("Ctrl-C after writing", "SIGTERM while the old output is removed"):
        assert status == 130 and f"interrupted; already written: the grown model to {output}" in error, error
        assert {path.name: path.read_bytes() for path in output.iterdir()} != before
        return
    assert {path.name: path.read_bytes() for path in output.iterdir()} == before
    if case == "SIGTERM while writing":
        assert status == 130 and "interrupted; nothing was written" in error, error
    else:
        assert status == 2 and "No space left on device" in error and "nothing was written" in error
        assert len(error.strip().splitlines()) == 1


@pytest.mark.parametrize("case", ["a report inside the output", "offloading into the input", "a mount point",
                                  "a report folder that cannot be written", "the current folder"])
def test_outputs_that_would_break_the_output_or_the_input_are_refused_before_any_work(model_folder, tmp_path, capsys,  # noqa: F811
                                                                                      monkeypatch, case):
    """A --report inside --output-dir replaced a file of the grown model (exit 0, a model that did not load); an
    --offload-dir inside the input folder left M's files there when killed; an output folder that is a mount point
    (a container's volume) failed at the rename, after all the work; the current folder (``--output-dir .``) was
    replaced whole, the shell left in a deleted copy that showed nothing."""
    import shutil

    output = tmp_path / "grown"
    if case == "offloading into the input":
        model_folder = shutil.copytree(model_folder, tmp_path / "model")
        (model_folder / "offload").mkdir()
    extra = {
        "a report inside the output": ["--report", str(output / "model.safetensors")],
        "offloading into the input": ["--offload-dir", str(model_folder / "offload")],
        "a mount point": [],
        "a report folder that cannot be written": ["--report", str(tmp_path / "read-only" / "report.json")],
        "the current folder": [],
    }[case]
    if case == "the current folder":
        output.mkdir()
        monkeypatch.chdir(output / ".")
    if case == "a mount point":
        output.mkdir()
        monkeypatch.setattr(os.path, "ismount", lambda path: os.fspath(path) == os.fspath(output))
    if case == "a report folder that cannot be written":  # a read-only disk (permissions do not bind root)
        (tmp_path / "read-only").mkdir()
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and "read-only" not in str(path))
    before = sorted(path.name for path in model_folder.iterdir())
    assert cli.main([str(model_folder), "--data", "/nonexistent/never-read.txt", "--output-dir", str(output),
                     *extra, *SMALL]) == 2
    error = capsys.readouterr().err
    expected = {"a report inside the output": "lies inside --output-dir",
                "offloading into the input": "is inside the input", "a mount point": "is a mount point",
                "a report folder that cannot be written": "its folder cannot be written",
                "the current folder": "is the current folder or holds it"}[case]
    assert expected in error and len(error.strip().splitlines()) == 1, error
    assert sorted(path.name for path in model_folder.iterdir()) == before


def test_a_signal_ignored_before_the_command_stays_ignored(model_folder, monkeypatch):  # noqa: F811
    """`nohup hf-grow ...` ignores SIGHUP so that the run outlives the terminal: the command's handler, which turns
    SIGTERM and SIGHUP into an interruption, must not take SIGHUP over (it did: a logout ended the run)."""
    import signal

    from hf_grow.cli import commands

    seen = {}
    monkeypatch.setattr(commands, "run", lambda args: seen.update(
        hup=signal.getsignal(signal.SIGHUP), term=signal.getsignal(signal.SIGTERM)))
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert cli.main([str(model_folder), "--output-dir", "unused"]) == 0
        assert seen["hup"] is signal.SIG_IGN and seen["term"] not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_an_interrupted_process_that_does_not_write_says_so(model_folder, tmp_path, capsys, monkeypatch):  # noqa: F811
    """Under torchrun only the main process writes: another process, interrupted, said "nothing was written" even
    when the main process had written the model."""
    from hf_grow.cli import commands

    class OtherProcess:
        is_main_process = False

        def end_training(self) -> None:
            pass

    def interrupted(args, is_main):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "accelerator_for", lambda args: OtherProcess())
    monkeypatch.setattr(commands, "start_run", interrupted)
    status = cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "grown"), *SMALL])
    error = capsys.readouterr().err
    assert status == 130 and "interrupted; this process writes nothing (the main process writes" in error, error


def test_a_reader_of_stdout_that_leaves_early_stops_no_push(model_folder, tmp_path, capfd, monkeypatch):  # noqa: F811
    """`hf-grow ... | head -1`: printing the summary raised BrokenPipeError (a traceback, exit 1), after the model
    was written and before --push-to-hub ran."""
    from hf_grow.cli import running

    import threading

    read, write = os.pipe()

    def head_1() -> None:  # reads the first line ("text: ..."), then leaves: every later write to stdout fails
        while os.read(read, 1) != b"\n":
            pass
        os.close(read)

    reader = threading.Thread(target=head_1)
    reader.start()
    monkeypatch.setattr("sys.stdout", open(write, "w", buffering=1))
    pushed = []
    monkeypatch.setattr(running.hub, "push_to_hub", lambda folder, repo, **_: pushed.append(repo))
    monkeypatch.setattr(running.hub, "check_push", lambda *_: None)  # offline here
    output = tmp_path / "grown"
    status = cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(output), "--push-to-hub", "me/x",
                       "--report", f"/proc/self/fd/{write}", *SMALL])  # also the report into the closed pipe
    reader.join()
    error = capfd.readouterr().err
    assert status == 1 and "stdout was closed before the command ended; already written: the grown model" in error
    assert "Traceback" not in error and pushed == ["me/x"] and (output / "config.json").is_file()


def test_a_failed_push_comes_after_the_summary(model_folder, tmp_path, capsys, monkeypatch):  # noqa: F811
    from hf_grow.cli import running

    def failing(*args, **kwargs):
        raise ConnectionError("the Hub is away")

    monkeypatch.setattr(running.hub, "push_to_hub", failing)
    monkeypatch.setattr(running.hub, "check_push", lambda *_: None)  # offline here
    status = cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "grown"),
                       "--push-to-hub", "me/x", "--report", str(tmp_path / "report.json"), *SMALL])
    captured = capsys.readouterr()
    assert status == 2 and "pushing to me/x failed (ConnectionError: the Hub is away)" in captured.err
    assert "held-out loss" in captured.out and "wall time" in captured.out and (tmp_path / "report.json").is_file()

    write_report = hf_grow.GrowthReport.to_json_file

    def failing_report(self, path):  # --report's, not the output folder's growth_report.json
        if str(path).endswith("report.json") and "growth_report" not in str(path):
            raise OSError("disk full")
        write_report(self, path)

    monkeypatch.setattr(hf_grow.GrowthReport, "to_json_file", failing_report)  # both fail: both said, in one line
    status = cli.main([str(model_folder), "--data", TEXT_GLOB, "--output-dir", str(tmp_path / "grown"), "--overwrite",
                       "--push-to-hub", "me/x", "--report", str(tmp_path / "report.json"), *SMALL])
    captured = capsys.readouterr()
    assert status == 2 and "the Hub is away" in captured.err and "failed (disk full)" in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "wall time" in captured.out


def test_a_folder_made_for_the_output_keeps_its_permissions(tmp_path):
    """An empty folder made beforehand (private, or a group's) is replaced by the staged one: it keeps its mode and
    its group (with the mode alone, a group's folder shut its group out), and its owner where root writes it (a
    folder of a user's, mounted into a container: its files came back root's, which that user could not remove)."""
    from hf_grow.cli.running import write_folder_atomically

    output = tmp_path / "grown"
    output.mkdir()
    os.chmod(output, 0o770)
    group = 1 if os.geteuid() == 0 else output.stat().st_gid  # a group's folder (another group where root may)
    os.chown(output, -1, group)
    written = []
    write_folder_atomically(output, lambda folder: (folder / "config.json").write_text("{}"), overwrite=False,
                            done=lambda: written.append(True))
    assert written and (output / "config.json").read_text() == "{}"
    assert oct(output.stat().st_mode & 0o777) == oct(0o770) and output.stat().st_gid == group  # the group kept
    assert (output / "config.json").stat().st_gid == group  # its files' too
    if os.geteuid() == 0:
        (output / "config.json").write_text('{"model_type": "gpt2"}')  # a saved model, which --overwrite replaces
        os.chown(output, 1000, group)
        write_folder_atomically(output, lambda folder: (folder / "config.json").write_text("{}"), overwrite=True,
                                done=lambda: written.append(True))
        assert output.stat().st_uid == (output / "config.json").stat().st_uid == 1000


def test_a_tilde_the_shell_left_is_expanded_in_every_path(tmp_path, monkeypatch):
    """`--data '~/corpus.txt'` (quoted, or from a list of arguments) read $HOME's file, but `--output-dir '~/grown'`
    wrote a folder named `~` in the current folder while the command said "written to ~/grown"."""
    from hf_grow.cli import commands

    monkeypatch.setenv("HOME", str(tmp_path))
    seen = []
    monkeypatch.setattr(commands, "run", seen.append)
    monkeypatch.setattr(commands, "run_inspect", seen.append)
    assert commands.main(["~/model", "--output-dir", "~/grown", "--report", "~/r.json", "--stats", "~/s"]) == 0
    assert commands.main(["inspect", "~/model", "--json", "~/i.json", "--plot", "~/p.png", "--save-stats", "~/s"]) == 0
    first, second = (vars(args) for args in seen)
    assert [first[name] for name in ("model", "output_dir", "report", "stats")] == [
        f"{tmp_path}/model", f"{tmp_path}/grown", f"{tmp_path}/r.json", f"{tmp_path}/s"]
    assert [second[name] for name in ("model", "json", "plot", "save_stats")] == [
        f"{tmp_path}/model", f"{tmp_path}/i.json", f"{tmp_path}/p.png", f"{tmp_path}/s"]


@pytest.mark.parametrize("flags, expected", [
    (["--private", "--revision", "v2"], "--private, --revision apply to --push-to-hub, which is not given"),
    (["--eval-pairs", "0"], "--eval-pairs applies to --pairs, which is not given"),
    (["--seed", str(2**70)], "--seed must fit in 64 bits"),
    (["--seed", str(2**64 - 1)], "--seed must fit in 64 bits"),  # a masked LM's held-out masks take seed + 1
])
def test_flags_that_would_do_nothing_or_crash_are_one_line_errors(tmp_path, capsys, flags, expected):
    """They ran without a word (a forgotten --push-to-hub pushed nothing), or with a traceback (a seed past 64 bits,
    in torch.manual_seed after the data was read)."""
    output = tmp_path / "grown"
    assert cli.main(["gpt2", "--data", "/nonexistent/never-read.txt", "--output-dir", str(output), *flags]) == 2
    error = capsys.readouterr().err
    assert expected in error and len(error.strip().splitlines()) == 1, error
    assert not output.exists()


def test_a_negated_flag_says_what_it_turns_off(capsys):
    """HfArgumentParser gave --no-measure-realized-gains the help of the flag it negates."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert re.search(r"--no-measure-realized-gains.*\n\s+do not: evaluate the held-out loss", capsys.readouterr().out)


def test_a_model_folder_without_a_config_says_what_it_holds(tmp_path, capsys, monkeypatch):
    """A PEFT adapter's folder was "Unrecognized model ... Should have a `model_type` key in its config.json" (it
    has no config.json), and a mistyped relative folder, read as a Hub id offline, a network error alone."""
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "gpt2", "peft_type": "LORA"}')
    arguments = ["--data", "/nonexistent/never-read.txt", "--output-dir", str(tmp_path / "grown")]
    assert cli.main([str(adapter), *arguments]) == 2
    error = capsys.readouterr().err
    assert "it holds a PEFT adapter (of gpt2): merge it into its base model" in error, error
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert cli.main(["models/gpt2-mine", *arguments]) == 2
    error = capsys.readouterr().err
    assert "no local folder models/gpt2-mine, and as a Hub id: " in error and len(error.strip().splitlines()) == 1


def test_a_masking_option_for_a_causal_lm_is_refused(model_folder, tmp_path, capsys):  # noqa: F811
    """--mlm-probability on a causal LM ran without a word (a review, 2026-11-30): it masks nothing there."""
    output = tmp_path / "grown"
    assert cli.main([str(model_folder), "--data", "/nonexistent/never-read.txt", "--output-dir", str(output),
                     "--mlm-probability", "0.3"]) == 2
    error = capsys.readouterr().err
    assert "--mlm-probability applies to masked LMs" in error and len(error.strip().splitlines()) == 1, error
    assert not output.exists()
