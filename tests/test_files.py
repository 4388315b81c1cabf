"""Files written atomically: the old file or the whole new one, and no temporary left when writing fails."""

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
    (tmp_path / "target").mkdir()
    with pytest.raises(OSError):
        GrowthConfig().to_json_file(tmp_path / "target")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"] and not any((tmp_path / "target").iterdir())
