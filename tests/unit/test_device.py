"""Device choice: ``train.device=auto`` and plain ``cuda`` per rank, and devices that
do not exist (one ``ConfigError`` that lists the ones that do)."""

from __future__ import annotations

import pytest
import torch

from sven.config import load_config
from sven.distributed.launcher import LaunchInfo, detect_launcher
from sven.distributed.process_group import _pick_device, existing_devices
from sven.errors import ConfigError


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def _rank(local_rank: int, local_world_size: int) -> LaunchInfo:
    env = {
        "RANK": str(local_rank),
        "WORLD_SIZE": str(local_world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
    }
    return detect_launcher(env)


def test_auto_is_cpu_without_gpus_and_the_local_gpu_with_them(monkeypatch) -> None:
    _gpus(monkeypatch, 0)
    assert _pick_device("auto", LaunchInfo(launcher="single")) == torch.device("cpu")
    _gpus(monkeypatch, 4)
    # Under torchrun each rank takes the GPU of its local rank, with auto as with cuda.
    info = _rank(2, 4)
    assert _pick_device("auto", info) == torch.device("cuda", 2)
    assert _pick_device("cuda", info) == torch.device("cuda", 2)
    assert _pick_device("cuda:1", info) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("gpus", "device", "message"),
    [
        (0, "cuda", "train.device=cuda, but this machine has only cpu"),
        (0, "cuda:0", "train.device=cuda:0, but this machine has only cpu"),
        (2, "cuda:3", "train.device=cuda:3, but this machine has only cpu, cuda:0, cuda:1"),
        (0, "gpu", "train.device=gpu: not a device; use auto, cpu, cuda or cuda:N"),
        (0, "meta", "train.device=meta: Sven runs on cpu or cuda, not meta"),
    ],
)
def test_a_missing_device_names_the_existing_ones(monkeypatch, gpus, device, message) -> None:
    _gpus(monkeypatch, gpus)
    with pytest.raises(ConfigError) as info:
        _pick_device(device, LaunchInfo(launcher="single"))
    assert str(info.value).startswith(message)
    assert existing_devices()[0] == "cpu"


def test_config_checks_the_device_spelling_and_resume_with_overwrite() -> None:
    assert load_config().train.device == "auto"
    for good in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert load_config(None, [f"train.device={good}"]).train.device == good
    for bad in ("gpu", "cuda:", "cuda:x", "CUDA", "cuda:-1"):
        with pytest.raises(ConfigError, match="must be auto, cpu, cuda or cuda:N"):
            load_config(None, [f"train.device={bad}"])
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(None, ["train.resume=true", "train.overwrite=true"])
