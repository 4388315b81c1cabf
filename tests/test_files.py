"""Files written atomically: the old file or the whole new one, and no temporary left when writing fails."""

import os
import threading

import pytest

from hf_grow import GrowthConfig
from hf_grow.files import write_atomically, write_text_atomically


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")

    def half_then_fail(temporary):
        temporary.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, half_then_fail)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    write_text_atomically(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_writing_onto_a_folder_fails_without_a_trace(tmp_path):
    """Also in words that name the path given (the errors named a temporary file the user never gave)."""
    (tmp_path / "target").mkdir()
    with pytest.raises(IsADirectoryError, match=f"^{tmp_path / 'target'} is a folder: give the path of a file"):
        GrowthConfig().to_json_file(tmp_path / "target")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"] and not any((tmp_path / "target").iterdir())
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'missing' / 's.json'}: no folder .*; create it first"):
        write_text_atomically(tmp_path / "missing" / "s.json", "{}")


def test_a_link_stays_and_a_fifo_is_written_into(tmp_path):
    """`--report /dev/stdout` replaced the link (as root, /dev's own) by a file, and nothing reached stdout."""
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    write_text_atomically(link, "new")
    assert link.is_symlink() and target.read_text() == "new"

    fifo, read = tmp_path / "fifo", []
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: read.append(fifo.read_text()))
    reader.start()

    def renaming(path):  # as safetensors' save_file does: its own temporary renamed over the path it is given
        path.with_name("own-temporary").write_text("statistics")
        os.replace(path.with_name("own-temporary"), path)

    write_atomically(fifo, renaming)
    reader.join(timeout=10)
    assert read == ["statistics"] and not fifo.is_file() and sorted(p.name for p in tmp_path.iterdir()) == [
        "fifo", "link.json", "target.json"]


def test_this_processs_stdout_is_written_through_not_replaced(tmp_path, monkeypatch):
    """`--report /dev/stdout > out.txt` renamed the report over out.txt: what the command printed was lost."""
    out = tmp_path / "out.txt"
    with open(out, "w") as stream:
        monkeypatch.setattr("sys.stdout", stream)
        print("text: the line printed before")
        write_text_atomically(f"/proc/self/fd/{stream.fileno()}", "{report}\n")  # /dev/stdout of the process
        print("wall time")
    monkeypatch.undo()
    assert out.read_text() == "text: the line printed before\n{report}\nwall time\n"
