"""How the broker scales: FarmState's CPU per chunk by workers and jobs, and a real broker's
chunks/s.

Part 1 drives ``FarmState`` in-process with 1 to 10 000 simulated workers and 1 to 100
jobs, for every policy, and prints the state machine's CPU time per chunk (steady state:
the first round of chunks, which only fills the farm, is not timed).  Workers run at
speeds spread over 4x and answer in order of their simulated finish times; clients
answer NEED at once.

Part 2 starts a real broker (``farm broker``) and drives it over loopback with
protocol-level fake workers and a fake client that answer at once (no model runs),
and prints chunks/s and the broker process's CPU per chunk: for a job whose client sends
the items (NEED, DATA, TASK, RESULT in, RESULT out: five messages a chunk) and for one
whose workers read them from shared storage (``farm.wire.storage``: TASK, RESULT in, RESULT
out), with the broker's bytes of input per image for each.

    python bench/broker_scale.py                  # both parts, about 20 minutes
    python bench/broker_scale.py --quick          # fewer sizes (what the tests run)
    python bench/broker_scale.py --part broker    # the real broker alone, about 3 minutes
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass

from farm.broker import events as ev
from farm.broker.state import FarmState, SchedulingConfig
from farm.policies import POLICIES
from farm.simulation import kit

#: Items per chunk the policies aim at: each chunk is 1 s of compute at 1 000 items/s.
CHUNK_SECONDS = 1.0


@dataclass
class StateRun:
    policy: str
    workers: int
    jobs: int
    chunks: int
    cpu_s: float

    @property
    def us_per_chunk(self) -> float:
        return 1e6 * self.cpu_s / max(1, self.chunks)


def drive_state(policy: str, workers: int, jobs: int, chunks: int, seed: int = 0) -> StateRun:
    """Feed the state a farm of ``workers`` and ``jobs`` until ``chunks`` chunks came back
    after the first round; time only ``FarmState.handle`` (one thread, nothing else runs in
    it, so its time in the state is its CPU time there, give or take preemption)."""
    rng = random.Random(seed)
    driver = kit.Driver(
        FarmState(SchedulingConfig(algo=policy, max_chunk_seconds=CHUNK_SECONDS, heartbeat=60.0)),
        sent=None,
    )
    rates = {f"w{i}".encode(): rng.uniform(500.0, 2000.0) for i in range(workers)}
    per_job = max(1, (workers * 4 + chunks * 2) * 2000 // jobs)  # never runs dry
    running: list[tuple[float, int, ev.SendTask]] = []
    order = 0
    cpu = 0.0
    done = 0
    warm = workers * 2  # the first round fills every slot: not timed

    def handle(event: ev.FarmEvent) -> list[ev.Instruction]:
        nonlocal cpu
        start = time.perf_counter()  # a cheap clock (process_time costs 2 us a call here)
        out = driver.feed(event)
        if done >= warm:
            cpu += time.perf_counter() - start
        return out

    def carry_out(out: list[ev.Instruction], now: float) -> None:
        nonlocal order
        for instruction in out:
            if isinstance(instruction, ev.SendNeed):  # the client answers at once
                carry_out(handle(kit.data_for(instruction, now)), now)
            elif isinstance(instruction, ev.SendTask):
                seconds = instruction.count / rates[instruction.worker]
                heapq.heappush(running, (now + seconds, order, instruction))
                order += 1

    for identity in rates:
        carry_out(handle(kit.joined(identity, slots=2, host="sim", pid=0)), 0.0)
    for j in range(jobs):
        carry_out(
            handle(kit.submitted(f"j{j}", per_job, client=f"c{j}".encode(), heartbeat=60.0)), 0.0
        )
    while running and done < warm + chunks:
        now, _, task = heapq.heappop(running)
        out = handle(kit.result_for(task, now, task.count / rates[task.worker]))
        done += 1
        carry_out(out, now)
    return StateRun(policy, workers, jobs, max(0, done - warm), cpu)


def state_table(
    worker_counts: list[int], job_counts: list[int], chunks: int, policies: list[str]
) -> None:
    print(
        f"FarmState CPU per chunk (us), {chunks} chunks after the first round; "
        f"rows: policy x jobs, columns: workers"
    )
    print(f"{'policy':<14}{'jobs':>5}" + "".join(f"{n:>9,}" for n in worker_counts))
    for policy in policies:
        for jobs in job_counts:
            cells = [drive_state(policy, n, jobs, chunks).us_per_chunk for n in worker_counts]
            print(f"{policy:<14}{jobs:>5}" + "".join(f"{c:>9.1f}" for c in cells), flush=True)


# -------------------------------------------------------------------- the real broker


def fake_farm(
    endpoint: str, workers: int, items: int, chunk: int, shared: bool = False
) -> tuple[int, float, int]:
    """Fake workers and a client in this process, against a real broker: (chunks, seconds,
    the broker's bytes of input).  ``shared``: the job's items lie in a `.npy` file on
    shared storage (the fake workers read nothing)."""
    import numpy as np
    import zmq

    from farm.wire import messages, protocol
    from farm.wire.link import limit_socket
    from farm.wire.protocol import Command

    context = zmq.Context()
    poller = zmq.Poller()
    sockets = []
    for i in range(workers):
        sock = context.socket(zmq.DEALER)
        limit_socket(sock)
        sock.connect(endpoint)
        sock.send_multipart(
            protocol.encode(
                Command.READY,
                messages.Ready(
                    device=f"cpu:{i}",
                    host="fake",
                    pid=i,
                    backend="fake",
                    models={"lenet": messages.ModelFacts(input_shape=(1, 28, 28))},
                    loaded=("lenet",),
                    slots=2,
                    threads=1,
                    heartbeat=60.0,
                ),
            )
        )
        poller.register(sock, zmq.POLLIN)
        sockets.append(sock)
    client = context.socket(zmq.DEALER)
    limit_socket(client)
    client.connect(endpoint)
    poller.register(client, zmq.POLLIN)
    client.send_multipart(protocol.encode(Command.INFO, messages.Info(wait_workers=workers)))
    while protocol.decode(client.recv_multipart()).command is not Command.INFO:
        pass
    output = np.zeros((chunk, 10), np.float32)
    pixels = bytes(chunk * 784)
    document = []
    if shared:
        stored = messages.StoredInputs(
            kind="npy",
            path="/shared/digits.npy",
            offset=128,
            size=128 + 784 * items,
            head="0" * 16,
            rows=items,
            runs=[(0, 0, items)],
        )
        document = protocol.document_frames(messages.SubmitDocument(inputs=stored))
    started = time.perf_counter()
    client.send_multipart(
        protocol.encode(
            Command.SUBMIT,
            messages.Submit(
                job="scale",
                model="lenet",
                dtype="uint8",
                item_shape=(1, 28, 28),
                total=items,
                options=messages.Options(algo="fifo", params={"chunk": chunk}),
                heartbeat=60.0,
            ),
            document,
        )
    )
    chunks = 0
    while True:
        for sock, _ in poller.poll(10_000):
            for _ in range(100):
                try:
                    message = protocol.decode(sock.recv_multipart(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
                header = message.header
                if message.command is Command.NEED:
                    sock.send_multipart(
                        protocol.encode(
                            Command.DATA,
                            messages.Data(
                                job="scale",
                                chunk=header.chunk,
                                start=header.start,
                                count=header.count,
                            ),
                            [pixels[: 784 * header.count]],
                        )
                    )
                elif message.command is Command.TASK:
                    count = header.count
                    sock.send_multipart(
                        protocol.encode(
                            Command.RESULT,
                            messages.Result(
                                job=header.job,
                                chunk=header.chunk,
                                start=header.start,
                                count=count,
                                dtype="float32",
                                item_shape=(10,),
                                timings={"compute": 1e-4 * count},
                            ),
                            [output[:count].data],
                        )
                    )
                elif message.command is Command.RESULT:
                    chunks += 1
                elif message.command in (Command.DONE, Command.ERROR):
                    seconds = time.perf_counter() - started
                    if message.command is Command.ERROR:
                        context.destroy(linger=0)
                        raise RuntimeError(header.error)
                    client.send_multipart(protocol.encode(Command.INFO, messages.Info()))
                    while (reply := protocol.decode(client.recv_multipart())).command is not (
                        Command.INFO
                    ):
                        pass
                    traffic = (reply.document(dict) or {}).get("traffic", {})
                    context.destroy(linger=0)
                    return chunks, seconds, traffic.get("input_bytes", 0)


def bare_broker(endpoint: str) -> None:
    """The floor: the broker's message pattern (NEED, DATA -> TASK, RESULT -> RESULT) with
    no checks, no state machine and no policy (one-image chunks, workers in turn); headers
    stay plain maps, encoded as they are."""
    import msgspec
    import zmq

    from farm.wire import protocol
    from farm.wire.link import limit_socket
    from farm.wire.protocol import Command

    def frames(command: Command, header: dict, payload: list | tuple = ()) -> list:
        return [protocol.SIGNATURE, command.value, msgspec.msgpack.encode(header), *payload]

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    limit_socket(router)
    router.bind(endpoint)
    print("listening", flush=True)
    free: list[bytes] = []
    client, job, total, next_item, answered = b"", "", 0, 0, 0
    owner: dict[int, bytes] = {}
    chunk_id = 0
    while True:
        identity, _, command, header_frame, *payload = router.recv_multipart(copy=False)
        command, header = command.bytes, msgspec.msgpack.decode(header_frame.bytes)
        if command == Command.READY.value:
            free += [identity.bytes] * header["slots"]
        elif command == Command.INFO.value:
            router.send_multipart([identity, *frames(Command.INFO, {})])
        elif command == Command.SUBMIT.value:
            client, job, total = identity.bytes, header["job"], header["total"]
        elif command == Command.DATA.value:
            header.update(
                item_shape=[1, 28, 28], dtype="uint8", attempt=1, model="lenet", digest=""
            )
            router.send_multipart(
                [owner.pop(header["chunk"]), *frames(Command.TASK, header, payload)], copy=False
            )
        elif command == Command.RESULT.value:
            router.send_multipart([client, *frames(Command.RESULT, header, payload)], copy=False)
            free.append(identity.bytes)
            answered += 1
            if answered == total:
                router.send_multipart([client, *frames(Command.DONE, {"job": job})])
        while client and free and next_item < total:
            owner[chunk_id] = free.pop()
            router.send_multipart(
                [
                    client,
                    *frames(
                        Command.NEED,
                        {"job": job, "chunk": chunk_id, "start": next_item, "count": 1},
                    ),
                ]
            )
            chunk_id += 1
            next_item += 1


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_table(worker_counts: list[int], items: int, rounds: int = 2) -> None:
    from farm.ops.local import farm_command, free_port

    print(
        f"\nreal broker over loopback, fake workers and client answering at once, "
        f"{items:,} one-image chunks, best of {rounds} rounds taken in turn; sent: the "
        f"client sends each chunk's items (NEED, DATA); shared: the workers read them "
        f"(a .npy on shared storage); bare: the sent job's messages with no checks, no "
        f"state machine and no policy"
    )
    print(
        f"{'workers':>8}{'sent/s':>9}{'us CPU':>8}{'B/img':>7}{'shared/s':>10}{'us CPU':>8}"
        f"{'B/img':>7}{'shared/sent':>13}{'bare/s':>9}{'us CPU':>8}"
    )
    broker = farm_command(
        "--log-level", "ERROR", "broker", "--bind", "{}", "--heartbeat", "5", "--algo", "fifo"
    )
    bare_broker = [sys.executable, __file__, "--bare", "{}"]
    for workers in worker_counts:
        best: dict[str, Measured] = {}
        for _ in range(rounds):
            for name, command, shared in (
                ("sent", broker, False),
                ("shared", broker, True),
                ("bare", bare_broker, False),
            ):
                measured = measure_broker(command, free_port(), workers, items, shared)
                if name not in best or measured.rate > best[name].rate:
                    best[name] = measured
        sent, shared, bare = best["sent"], best["shared"], best["bare"]
        print(
            f"{workers:>8}{sent.rate:>9,.0f}{sent.cpu_us:>8.0f}{sent.bytes_per_image:>7.0f}"
            f"{shared.rate:>10,.0f}{shared.cpu_us:>8.0f}{shared.bytes_per_image:>7.0f}"
            f"{shared.rate / sent.rate:>12.2f}x{bare.rate:>9,.0f}{bare.cpu_us:>8.0f}",
            flush=True,
        )


@dataclass
class Measured:
    rate: float  # chunks/s
    cpu_us: float  # the broker process's CPU per chunk
    bytes_per_image: float  # the broker's bytes of input (and of where it lies) per image


def measure_broker(
    command: list[str], port: int, workers: int, items: int, shared: bool = False
) -> Measured:
    """Chunks/s, the broker process's CPU microseconds per chunk, its input bytes per image."""
    endpoint = f"tcp://127.0.0.1:{port}"
    broker = subprocess.Popen(
        [arg.replace("{}", endpoint) for arg in command], stdout=subprocess.PIPE, text=True
    )
    try:
        broker.stdout.readline()
        before = cpu_seconds(broker.pid)
        chunks, seconds, input_bytes = fake_farm(endpoint, workers, items, 1, shared)
        used = cpu_seconds(broker.pid) - before
    finally:
        broker.terminate()
        broker.wait()
    return Measured(chunks / seconds, 1e6 * used / chunks, input_bytes / items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, fewer chunks")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--part", choices=("both", "state", "broker"), default="both", help="which part to run"
    )
    parser.add_argument("--bare", metavar="ENDPOINT", help="serve the bare loop (internal)")
    args = parser.parse_args()
    if args.bare:
        bare_broker(args.bare)
        return
    policies = args.policies.split(",")
    if args.part != "broker":
        if args.quick:
            state_table([1, 100, 1000], [1, 10], 2000, policies)
        else:
            state_table([1, 10, 100, 1000, 10_000], [1, 10, 100], 20_000, policies)
    if args.part != "state":
        if args.quick:
            broker_table([1, 10], 2000)
        else:
            broker_table([1, 10, 100, 1000], 20_000)
    print(f"\n{sys.argv[0]}: machine: {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
