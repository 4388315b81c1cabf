"""M's accumulators in memory-mapped safetensors files (``offload_dir``): the same growth as in memory, files that
exist while their pass runs and are gone after it (also after an error), and folders refused before any work."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from transformers import GPT2LMHeadModel

from hf_grow import collect_statistics, get_adapter, grow_model
from hf_grow.statistics import OFFLOAD_PREFIX, check_offload_dir, statistics_bytes
from hf_grow.statistics import offload as offload_module

from conftest import lm_batches, tiny_gpt2_config
from test_config import Untouchable


@pytest.fixture(scope="module")
def three_layers() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config(n_layer=3)).eval()


def mapped_files() -> set[str]:
    """The files this process has mapped (Linux: /proc/self/maps)."""
    return {line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if len(line.split(maxsplit=5)) == 6}


@pytest.mark.parametrize("budget", [None, "340kB"])
def test_growth_with_m_on_disk_equals_growth_in_memory(trained_gpt2, stdlib_bytes, tmp_path, budget):
    """Bit for bit, in one pass and in two (a layer's M per pass: see test_statistics_scale)."""
    batches = lm_batches(stdlib_bytes["stats"], 3, batch_size=4, seed=43)
    eval_batches = lm_batches(stdlib_bytes["eval"], 2, batch_size=4, seed=44)
    kwargs = dict(p=8, eval_dataloader=eval_batches, memory_budget=budget, measure_realized_gains=False)
    in_memory = grow_model(trained_gpt2, batches, **kwargs)
    on_disk = grow_model(trained_gpt2, batches, offload_dir=str(tmp_path), **kwargs)
    assert on_disk.growth_report.step_size == in_memory.growth_report.step_size
    assert on_disk.growth_report.eval_loss_after == in_memory.growth_report.eval_loss_after
    for name, tensor in in_memory.state_dict().items():
        assert torch.equal(on_disk.state_dict()[name], tensor), name
    assert not any(tmp_path.iterdir())  # nothing left behind


def test_each_pass_accumulates_into_a_mapped_safetensors_file_removed_after_its_solve(three_layers, stdlib_bytes,
                                                                                      tmp_path):
    model, adapter = three_layers, get_adapter(three_layers)
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=45)
    in_memory = collect_statistics(model, batches, adapter)
    assert all(gradient.untyped_storage().filename is None for gradient in in_memory.gradients)
    seen = []

    def solve(statistics, group):
        (folder,) = tmp_path.iterdir()  # one subfolder of this run
        (path,) = folder.iterdir()  # the previous pass's file is gone
        assert folder.name.startswith(OFFLOAD_PREFIX) and path.name == f"m-pass-{len(seen) + 1}.safetensors"
        width = 64 + 1
        assert path.stat().st_size >= len(group) * 4 * width * width * 8  # a float64 (heads, d, d) per layer
        with safetensors.safe_open(str(path), framework="pt") as handle:  # a safetensors file throughout
            assert sorted(handle.keys()) == sorted(f"gradients.{layer}" for layer in group)
            for layer in group:
                gradient = statistics.gradients[layer]
                assert gradient.untyped_storage().filename == str(path)  # the sums are the file's mapping
                assert torch.equal(handle.get_tensor(f"gradients.{layer}"), gradient)  # written into the file
                assert torch.equal(gradient, in_memory.gradients[layer]) and gradient.abs().sum() > 0
        if sys.platform.startswith("linux"):
            assert str(path) in mapped_files()
        seen.append(group)
        for layer in group:
            statistics.gradients[layer] = None  # as the solve releases it

    collect_statistics(model, batches, adapter, memory_budget=statistics_bytes(3, 4, 64, 2), offload_dir=tmp_path,
                       on_group=solve)
    assert seen == [[0], [1], [2]]
    assert not any(tmp_path.iterdir())
    # Returned M outlives its file: it stays mapped from the removed file, equal to the sums in memory.
    returned = collect_statistics(model, batches, adapter, offload_dir=tmp_path)
    assert not any(tmp_path.iterdir())
    for ours, theirs in zip(returned.gradients, in_memory.gradients):
        assert ours.untyped_storage().filename is not None and torch.equal(ours, theirs)


@pytest.mark.parametrize("where", ["loss", "solve"])
def test_an_error_mid_collection_leaves_no_file(three_layers, stdlib_bytes, tmp_path, where):
    model, adapter = three_layers, get_adapter(three_layers)
    batches = lm_batches(stdlib_bytes["stats"], 2, batch_size=4, seed=46)
    calls = []

    def failing_loss(model, batch):
        calls.append(sorted(path.name for path in tmp_path.rglob("*.safetensors")))
        if where == "loss" and len(calls) == 3:  # the first batch of the second pass
            raise RuntimeError("a failing batch")
        return model(**batch).loss

    def failing_solve(statistics, group):
        raise RuntimeError("a failing solve")

    with pytest.raises(RuntimeError, match="a failing"):
        collect_statistics(model, batches, adapter, loss_fn=failing_loss, memory_budget=statistics_bytes(3, 4, 64, 2),
                           offload_dir=tmp_path, on_group=failing_solve if where == "solve" else None)
    assert calls[0] == ["m-pass-1.safetensors"]  # the file existed while the pass ran
    assert not any(tmp_path.iterdir())


def test_bad_offload_dirs_are_refused_before_any_data(trained_gpt2, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for folder, message in ((a_file, "is not a folder"), (tmp_path / "missing", "is not a folder")):
        with pytest.raises(ValueError, match=message):
            grow_model(trained_gpt2, Untouchable(), offload_dir=str(folder))
    unwritable = tmp_path / "read-only"
    unwritable.mkdir(mode=0o555)
    if offload_module.os.access(unwritable, offload_module.os.W_OK):  # root writes anywhere: take sysfs
        unwritable = Path("/sys")
    if not unwritable.is_dir():
        pytest.skip("no unwritable folder to try")
    with pytest.raises(ValueError, match="cannot create files there"):
        grow_model(trained_gpt2, Untouchable(), offload_dir=str(unwritable))
    with pytest.raises(ValueError, match=r"model is on cuda:0.*memory_budget"):
        check_offload_dir(tmp_path, torch.device("cuda:0"))  # the accumulators of a GPU model are on the GPU


def test_a_disk_too_small_for_a_pass_is_refused_before_its_first_batch(three_layers, tmp_path, monkeypatch):
    model, adapter = three_layers, get_adapter(three_layers)
    usage = offload_module.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(offload_module.shutil, "disk_usage", lambda path: usage._replace(free=100_000))

    def untouched_loss(model, batch):
        raise AssertionError("a batch ran before the disk was checked")

    batches = [{"input_ids": torch.zeros(1, 8, dtype=torch.long)}]
    with pytest.raises(ValueError, match=r"need \d+ [KM]iB of disk in .* is free: free disk there"):
        collect_statistics(model, batches, adapter, loss_fn=untouched_loss, offload_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_later_run_names_the_folder_a_killed_run_left(trained_gpt2, stdlib_bytes, tmp_path):
    """A process killed outright (SIGKILL, out of memory) leaves its subfolder; the next run warns with its name and
    size. Folders of running processes and of other machines (a shared disk) are left alone and unnamed."""
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()
    this_machine = offload_module._subfolder_prefix().rsplit("-", 2)[0]
    left = tmp_path / f"{this_machine}-{killed.pid}-k1lled"
    left.mkdir()
    (left / "m-pass-1.safetensors").write_bytes(b"\0" * 3000)
    running = tmp_path / f"{this_machine}-{os.getpid()}-runn1ng"
    other_machine = tmp_path / f"{OFFLOAD_PREFIX}elsewhere-{killed.pid}-0ther"
    # a run in another PID namespace (a container of the same host name): its process id is none here, its lock held
    elsewhere = tmp_path / f"{this_machine}-{killed.pid}-c0ntainer"
    for folder in (running, other_machine, elsewhere):
        folder.mkdir()
    held = offload_module._lock(elsewhere)
    batches = lm_batches(stdlib_bytes["stats"], 1, batch_size=2, seed=46)
    with pytest.warns(UserWarning, match=rf"holds {left.name} \(3 KiB\), left by a run .* remove it") as caught:
        grow_model(trained_gpt2, batches, p=8, eval_dataloader=batches, offload_dir=str(tmp_path),
                   measure_realized_gains=False)
    assert sum("left by a run" in str(warning.message) for warning in caught) == 1  # not once per check
    assert sorted(tmp_path.iterdir()) == sorted([left, running, other_machine, elsewhere])  # named, never removed
    descriptors = len(os.listdir("/proc/self/fd"))
    for _ in range(20):  # each check of a held lock closes what it opened
        assert offload_module.killed_runs_folders(tmp_path) == [left]
    assert len(os.listdir("/proc/self/fd")) == descriptors
    os.close(held)


def test_a_disk_without_directory_locks_offloads_unlocked(three_layers, stdlib_bytes, tmp_path, monkeypatch):
    """NFS refuses an exclusive flock on a read-only descriptor (EBADF), which a folder's is: the run crashed at its
    first pass with a raw OSError and left its subfolder; it runs without the lock now (nothing to name it by)."""
    import fcntl

    def no_locks(descriptor, operation):
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    model, adapter = three_layers, get_adapter(three_layers)
    batches = lm_batches(stdlib_bytes["stats"], 1, batch_size=2, seed=47)
    descriptors = len(os.listdir("/proc/self/fd"))
    offloaded = collect_statistics(model, batches, adapter, offload_dir=tmp_path)
    assert offloaded.num_tokens == collect_statistics(model, batches, adapter).num_tokens
    assert not any(tmp_path.iterdir()) and len(os.listdir("/proc/self/fd")) == descriptors
