"""A local farm's torch worker reports its device seconds in the job's trace."""

from __future__ import annotations

import numpy as np
import pytest

from farm.client.report import analyse
from farm.ops.local import cores
from tests.unit.test_gpu_worker import torch  # noqa


@pytest.mark.skipif(len(cores()) < 2, reason="a worker and a stand-in need two cores")
def test_a_trace_shows_the_device_seconds_of_the_torch_worker(lenet, digits, local_farm) -> None:
    """The GPU worker's stand-in (``--device cpu`` on torch) and a pinned core: each chunk
    reports its device seconds, within its compute time, and the report sums them."""
    local = local_farm(
        devices=["cpu", f"cpu:{cores()[0]}"],
        preload=["lenet"],
        device_options=[["--backend", "torch"], []],
        device_launchers=[["taskset", "-c", str(cores()[-1])], []],
    )
    with local.client() as client:
        result = client.run(
            np.resize(digits, (4000, *digits.shape[1:])),
            "lenet",
            algo="fifo",
            params={"chunk": 500},
            trace=True,
        )
    assert result.trace is not None and len(result.trace.chunks) == 8
    for chunk in result.trace.chunks:
        assert chunk.device is not None and 0 < chunk.device <= chunk.finished - chunk.started
        assert chunk.copy == 0.0
    lines = {line.name.rsplit("/", 1)[1]: line for line in analyse(result.trace).workers}
    stand_in = lines["cpu"]
    assert stand_in.device_s == pytest.approx(
        sum(c.device for c in result.trace.chunks if c.worker.endswith("/cpu"))
    )
    assert 0 < stand_in.device_share(analyse(result.trace).seconds) <= 1
