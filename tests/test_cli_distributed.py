"""hf-grow under torchrun with 2 CPU processes: the same grown model as one process, written once."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from hf_grow import cli, load_growth_report

from test_cli import SMALL, TEXT_GLOB, model_folder  # noqa: F401 (the fixture)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_two_processes_grow_what_one_process_grows(model_folder, tmp_path):  # noqa: F811
    # one candidate: under "auto" each process confirms on its own shard's last batches, not one process's (README)
    # --max-batches counts the batches of all the processes, as one process's: 5 of the 11, not 5 each
    # one held-out batch: the second process has none (it was refused: "cannot be shared by 2 processes")
    arguments = [str(model_folder), "--p", "8", "--data", TEXT_GLOB, "--device", "cpu", *SMALL, "--truncation",
                 "whitened", "--step-mode", "per_head", "--max-batches", "5", "--eval-tokens", "500"]
    assert cli.main([*arguments, "--output-dir", str(tmp_path / "one")]) == 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hf_grow"]
    result = subprocess.run(
        [*torchrun, *arguments, "--output-dir", str(tmp_path / "two")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("on 2 processes; grown model written to") == 1  # the main process alone writes
    one, two = load_growth_report(tmp_path / "one"), load_growth_report(tmp_path / "two")
    assert one.statistics_batches == 5
    assert (two.statistics_tokens, two.statistics_batches, two.eval_weight) == (
        one.statistics_tokens,
        one.statistics_batches,
        one.eval_weight,
    )
    assert two.step_size == pytest.approx(one.step_size, rel=1e-9)
    assert two.eval_loss_after == pytest.approx(one.eval_loss_after, rel=1e-6)  # float32 rounding of the weights
    # never worse; the small model trained with one thread gains nothing on its one held-out batch (step 0), with
    # two threads a 2.9e-5 step: the test compares the processes, not the gain
    assert two.eval_loss_after <= two.eval_loss_before
    weights_one = load_file(tmp_path / "one" / "model.safetensors")
    weights_two = load_file(tmp_path / "two" / "model.safetensors")
    assert weights_one.keys() == weights_two.keys()
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["one", "two"]  # no staging folders left
