"""FarmState against a real broker process: a recorded run replays to the same instructions, the
state imports no socket, the scale bench drives both."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading

import zmq

from farm.broker import events as ev
from farm.broker.state import FarmState
from farm.ops.local import farm_command, free_port
from tests.conftest import bench_script


def test_the_state_imports_no_socket_clock_or_log_handler() -> None:
    """Neither the state nor any farm module it loads imports zmq, time or logging.handlers,
    and zmq is not loaded at all."""
    code = (
        "import sys, json; import farm.broker.state, farm.simulation.simulator; "
        "print(json.dumps(['zmq' in sys.modules, sorted(m.__file__ for n, m in "
        "sys.modules.items() if n.startswith('farm'))]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    zmq_loaded, files = json.loads(out)
    assert not zmq_loaded
    for path in files:
        tree = ast.parse(open(path).read())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        imported |= {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not imported & {"zmq", "time", "logging.handlers"}, path


def test_a_real_broker_run_replays_to_the_same_instructions(lenet, digits) -> None:
    """Record a real broker's events (two jobs, real workers, one worker killed mid-job) and
    replay them into a fresh state: it gives exactly the broker's assignments."""
    from farm.broker.broker import Broker, BrokerConfig
    from farm.client.client import Client

    config = BrokerConfig(
        bind="tcp://127.0.0.1:*",
        algo="fifo",
        params={"chunk": 50},
        heartbeat=0.2,
        max_chunk_seconds=0.05,
    )
    context = zmq.Context()
    broker = Broker(config, context)
    first_id = broker.state.next_chunk_id
    broker.recorded = []
    thread = threading.Thread(target=broker.serve)
    thread.start()
    workers = [
        subprocess.Popen(
            farm_command(
                "--log-level",
                "WARNING",
                "worker",
                "--device",
                "cpu",
                "--broker",
                broker.endpoint,
                "--model",
                "lenet",
            ),
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        with Client(broker.endpoint, timeout=60) as client:
            client.info(wait_workers=2)
            first = client.run(digits[:400], "lenet")
            workers[0].kill()
            second = client.run(digits[:300], "lenet")
        assert first.outputs.shape[0] == 400 and second.outputs.shape[0] == 300
    finally:
        broker.stop()
        thread.join()
        for worker in workers:
            worker.kill()
            worker.wait()
        context.term()
    replay = FarmState(config, first_chunk_id=first_id)
    recorded = broker.recorded
    assert sum(isinstance(event, ev.DataArrived) for event, _ in recorded) >= 7
    for number, (event, instructions) in enumerate(recorded, start=1):
        replayed = replay.handle(event)
        assert replayed == instructions, event
        # each instruction names the event that caused it, in the broker and in the replay
        causes = {instruction.stimulus for instruction in instructions + replayed}
        assert causes <= {number} == {replay.stimulus}, (event, causes)


def test_the_scale_bench_drives_the_state_and_a_real_broker() -> None:
    """bench/broker_scale.py's two parts, small: every chunk is counted, the broker and the
    bare loop both finish the job."""
    broker_scale = bench_script("broker_scale")
    run = broker_scale.drive_state("equal-finish", 50, 2, 300)
    assert run.chunks == 300 and run.us_per_chunk > 0
    broker = farm_command("--log-level", "ERROR", "broker", "--bind", "{}")
    sent = broker_scale.measure_broker(broker, free_port(), 3, 200)
    shared = broker_scale.measure_broker(broker, free_port(), 3, 200, shared=True)
    bare = broker_scale.measure_broker(
        [sys.executable, broker_scale.__file__, "--bare", "{}"], free_port(), 3, 200
    )
    for measured in (sent, shared, bare):
        assert measured.rate > 0 and measured.cpu_us > 0
    # one-image chunks of 784 bytes: sent, each crosses the broker twice; shared, only where
    # it lies does (the SUBMIT's document, the TASK's row range and header)
    assert sent.bytes_per_image > 2 * 784
    assert shared.bytes_per_image < sent.bytes_per_image / 4
