"""Node-state tier names (``sven.models.names``): where state lives, on every machine."""

from __future__ import annotations

import pytest
import torch

from sven.models.names import STATE_DEVICES, TIERS, resolve_tier
from sven.models.storage import Storage


def test_gpu_without_a_gpu_is_host_and_every_other_name_is_itself() -> None:
    assert resolve_tier("gpu", "cpu") == "host"
    assert [resolve_tier(t, "cuda") for t in TIERS] == ["gpu", "host", "disk"]
    assert [resolve_tier(t, "cpu") for t in ("host", "disk")] == ["host", "disk"]
    assert STATE_DEVICES == ("auto", "gpu", "host", "disk")
    with pytest.raises(ValueError, match="state tier must be one of"):
        resolve_tier("auto", "cpu")


def test_storage_on_a_cpu_names_the_alias_host_and_allocates_plain_tensors() -> None:
    for asked in ("gpu", "host"):
        st = Storage(asked, "cpu")
        assert st.tier == "host" and not st.pinned and not st.staged
        view, host = st.empty("memory", (3, 2), torch.float32)
        assert host is None and view.shape == (3, 2) and view.device.type == "cpu"
        assert st.describe() == "in host memory"
