"""Backup attempts for a job's last chunks, stragglers and the tail (farm/broker/backups.py).

``FarmState`` is driven by hand (``farm.simulation.kit``): worker A holds a chunk and does
not answer (a stopped or throttled process) while worker B runs everything else; the
simulator then runs whole jobs with a device that slows down mid-job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from farm.broker import events as ev
from farm.broker.backups import plan, rate_of
from farm.broker.jobs import ChunkRecord
from farm.broker.state import FarmState, SchedulingConfig
from farm.simulation import kit
from farm.simulation.simulator import DeviceModel, Scenario, simulate

A, B, C = b"worker-a", b"worker-b", b"worker-c"
#: Both workers ran 1 000 images/s on the model before (their remembered speeds).
SPEEDS = {kit.MODEL: (1000, 1.0)}


@dataclass
class Farm:
    """Worker A and the ``fast`` ones, one job; A's TASKs are held (``held``) until the
    test answers them, the others' answered at once.  A keeps sending heartbeats (a slow
    process, not a dead one) unless ``a_heard`` is False."""

    config: SchedulingConfig = field(default_factory=SchedulingConfig)
    now: float = 0.0
    held: list[ev.SendTask] = field(default_factory=list)
    results: list[ev.SendResult] = field(default_factory=list)
    cancels: list[ev.SendCancel] = field(default_factory=list)
    done: list[ev.SendDone] = field(default_factory=list)
    a_heard: bool = True
    hold_backups: bool = False  # the fast workers' TASKs within a range A holds are held too
    fast: tuple[bytes, ...] = (B,)

    def __post_init__(self) -> None:
        self.driver = kit.Driver(FarmState(self.config))
        for worker in (A, *self.fast):
            self.driver.join(
                worker, slots=1, pid=len(worker), device=worker.decode(), speeds=SPEEDS
            )

    def carry_out(self, instructions: list[ev.Instruction]) -> None:
        """NEEDs answered at once; the fast workers' TASKs at 1 000 images/s; A's held."""
        queue = list(instructions)
        while queue:
            instruction = queue.pop(0)
            if isinstance(instruction, ev.SendNeed):
                queue += self.driver.answer(instruction, self.now)
            elif isinstance(instruction, ev.SendTask) and (
                instruction.worker == A or self.hold_backups and self.backs_up(instruction)
            ):
                self.held.append(instruction)
            elif isinstance(instruction, ev.SendTask):
                self.now += instruction.count / 1000
                queue += self.heartbeats()
                queue += self.driver.answer(instruction, self.now, instruction.count / 1000)
            elif isinstance(instruction, ev.SendResult):
                self.results.append(instruction)
            elif isinstance(instruction, ev.SendCancel):
                self.cancels.append(instruction)
            elif isinstance(instruction, ev.SendDone):
                self.done.append(instruction)

    def backs_up(self, task: ev.SendTask) -> bool:
        """Whether ``task`` runs a piece of a range A holds."""
        return task.worker != A and any(within(task, t) for t in self.held if t.worker == A)

    def heartbeats(self) -> list[ev.Instruction]:
        """The fast workers' heartbeats, and A's unless it is silent."""
        heard = [*self.fast, A] if self.a_heard else list(self.fast)
        return [i for w in heard for i in self.driver.feed(ev.WorkerHeard(worker=w, at=self.now))]

    def tick(self, seconds: float) -> None:
        """Time passes: heartbeats, then a tick."""
        self.now += seconds
        self.carry_out(self.heartbeats())
        self.carry_out(self.driver.feed(ev.Tick(at=self.now)))

    def run_until_a_holds_the_last_chunk(self, total: int) -> ev.SendTask:
        self.carry_out(self.driver.submit("job", total))
        assert self.held, "A got no chunk"
        return self.held[0]

    def delivered(self) -> list[tuple[int, int]]:
        return sorted((r.result.start, r.result.count) for r in self.results)


def within(task: ev.SendTask, held: ev.SendTask) -> bool:
    return held.start <= task.start and task.start + task.count <= held.start + held.count


def backup_of(farm: Farm, task: ev.SendTask) -> list[ev.SendTask]:
    """The other workers' TASKs within the range A holds (its backup's pieces)."""
    return [
        t
        for t in farm.driver.sent or []
        if isinstance(t, ev.SendTask) and t.worker != A and within(t, task)
    ]


def tick_until_backup(farm: Farm, task: ev.SendTask, limit: int = 200) -> list[ev.SendTask]:
    for _ in range(limit):
        found = backup_of(farm, task)
        if found:
            return found
        farm.tick(0.05)
    raise AssertionError("no backup of A's chunk was started")


def covers_once(delivered: list[tuple[int, int]], total: int) -> bool:
    position = 0
    for start, count in delivered:
        if start != position:
            return False
        position += count
    return position == total


def test_an_idle_worker_backs_up_a_silent_workers_last_chunk_and_wins() -> None:
    farm = Farm()
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    tick_until_backup(farm, held)
    state = farm.driver.state
    assert state.stats.backup_attempts == 1 and state.stats.backup_wins == 1
    assert [c.chunk for c in farm.cancels if c.peer == A] == [held.chunk]  # A told to drop it
    assert covers_once(farm.delivered(), 40_000)
    # A answers late: dropped, nothing delivered twice
    farm.carry_out(farm.driver.answer(held, farm.now + 1, 1.0))
    assert covers_once(farm.delivered(), 40_000) and state.stats.late_replies == 1
    (done,) = farm.done
    summary = done.summary
    assert summary.backups == 1 and summary.backup_wins == 1
    assert summary.backup_items == held.count
    assert 0 < summary.tail_s <= summary.span_s
    assert "backup attempts: 1 chunk" in summary.format()


def test_the_first_attempt_answering_first_cancels_its_backup() -> None:
    farm = Farm(hold_backups=True)  # B's answer to the backup waits: A answers first
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    (backup,) = tick_until_backup(farm, held)
    farm.carry_out(farm.driver.answer(held, farm.now, held.count / 1000))
    assert [c.chunk for c in farm.cancels if c.peer == B] == [backup.chunk]
    farm.carry_out(farm.driver.answer(backup, farm.now + 0.1, 0.1))  # late: dropped
    assert covers_once(farm.delivered(), 40_000)
    assert farm.driver.state.stats.backup_wins == 0 and farm.done


def test_a_lost_first_attempt_leaves_its_backup_to_carry_the_range() -> None:
    farm = Farm(hold_backups=True)
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    (backup,) = tick_until_backup(farm, held)
    farm.carry_out(farm.driver.feed(ev.WorkerLeft(worker=A, at=farm.now, reason="gone")))
    needs = [i for i in farm.driver.sent or [] if isinstance(i, ev.SendNeed)]
    assert sum((n.start, n.count) == (held.start, held.count) for n in needs) == 2  # no third
    farm.carry_out(farm.driver.answer(backup, farm.now + 0.1, 0.1))
    assert covers_once(farm.delivered(), 40_000)
    (done,) = farm.done
    assert done.summary.failed_items == 0


def test_a_failed_backup_charges_nothing_and_the_first_attempt_runs_on() -> None:
    farm = Farm(hold_backups=True)
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    (backup,) = tick_until_backup(farm, held)
    farm.carry_out(farm.driver.feed(kit.failure_for(backup, farm.now, "out of memory")))
    farm.carry_out(farm.driver.answer(held, farm.now + 0.1, 0.1))
    assert covers_once(farm.delivered(), 40_000)
    (done,) = farm.done
    assert done.summary.failed_attempts == 0 and done.summary.backup_wins == 0


def test_backups_stay_within_their_share_of_the_job() -> None:
    farm = Farm(SchedulingConfig(backup_share=0.0))
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    for _ in range(100):
        farm.tick(0.05)
    assert not backup_of(farm, held) and farm.driver.state.stats.backup_attempts == 0
    assert farm.driver.state.stats.stragglers == 1  # found, all the same


def test_a_silent_workers_chunk_is_backed_up_before_its_liveness_expires() -> None:
    farm = Farm(SchedulingConfig(liveness=50), a_heard=False)
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    tick_until_backup(farm, held)
    assert A in farm.driver.state.workers  # not expired: its chunk was backed up first
    assert covers_once(farm.delivered(), 40_000)


def held_without_backups() -> tuple[Farm, ev.SendTask, ChunkRecord]:
    """A farm whose A holds the job's last chunk, no backup started yet (backups are
    turned on once it holds it): the farm, A's TASK and its attempt."""
    farm = Farm(SchedulingConfig(backup_share=0.0))
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    state = farm.driver.state
    record = state.awaited_result(A, held.chunk)
    assert record is not None
    state.config.backup_share = 0.05
    return farm, held, record


def test_no_backup_when_the_idle_worker_would_not_finish_sooner() -> None:
    farm, held, record = held_without_backups()
    state = farm.driver.state
    record.sent_at = farm.now  # just sent, and A is heard: due in its predicted time,
    # which B (as fast) cannot beat by MIN_SAVING
    assert plan(state, record.job, [state.workers[B]]) is None
    record.sent_at = farm.now - 2 * held.count / 1000  # overdue: backed up
    backup = plan(state, record.job, [state.workers[B]])
    assert backup is not None and backup.original is record
    assert backup.projected == pytest.approx(farm.now + 2)


def test_an_attempt_is_projected_by_its_own_pace_from_the_heartbeats_counters() -> None:
    farm, held, record = held_without_backups()
    state = farm.driver.state
    record.sent_at = farm.now - 2.0  # overdue: predicted 1 s at A's speed
    b = state.workers[B]
    # A's counters: 900 of the chunk's 1 000 images in 2 s, at 450 images/s: it ends in
    # 0.2 s, sooner than B would run all 1 000 (1 s): no backup
    for at, images in ((farm.now - 2.0, 0), (farm.now - 1.0, 450), (farm.now, 900)):
        farm.driver.feed(ev.WorkerHeard(worker=A, at=at, computed=(images, at)))
    assert plan(state, record.job, [b]) is None
    # ... at 50 images/s it has 900 images to go (18 s): backed up, and B's run of the
    # 100 images A did costs 100 images of extra work at most
    state.workers[A].samples.clear()
    for at, images in ((farm.now - 2.0, 0), (farm.now - 1.0, 50), (farm.now, 100)):
        farm.driver.feed(ev.WorkerHeard(worker=A, at=at, computed=(images, at)))
    backup = plan(state, record.job, [b])
    assert backup is not None and backup.projected == pytest.approx(farm.now + 18)
    own = held.count / rate_of(b, kit.MODEL)  # B's time for the whole chunk
    assert backup.extra == pytest.approx(100 + 50 * own)  # and what A computes meanwhile


def test_idle_workers_share_a_backup_and_its_first_piece_wins_for_all() -> None:
    farm = Farm(fast=(B, C))
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    pieces = tick_until_backup(farm, held)
    assert {p.worker for p in pieces} == {B, C}  # cut in two, by their speeds
    assert covers_once([(p.start - held.start, p.count) for p in pieces], held.count)
    assert covers_once(farm.delivered(), 40_000)
    (done,) = farm.done
    assert done.summary.backup_wins >= 1


def test_a_failed_piece_cancels_its_group_and_the_first_attempt_runs_on() -> None:
    farm = Farm(fast=(B, C), hold_backups=True)
    held = farm.run_until_a_holds_the_last_chunk(40_000)
    first, second = tick_until_backup(farm, held)
    farm.carry_out(farm.driver.feed(kit.failure_for(first, farm.now, "out of memory")))
    assert [(c.peer, c.chunk) for c in farm.cancels] == [(second.worker, second.chunk)]
    farm.carry_out(farm.driver.answer(held, farm.now + 0.1, 0.1))
    assert covers_once(farm.delivered(), 40_000)
    (done,) = farm.done
    assert done.summary.failed_attempts == 0


# ---------------------------------------------------------------- the simulator


def slowing_farm(total: int = 60_000) -> Scenario:
    """Three devices at 1 000 images/s and one at 3 000 that slows 20x near the end (a
    stopped or throttled process: no policy foresees it)."""
    cpus = tuple(DeviceModel(f"cpu{i}", 1000.0, 0.001, 0.05) for i in range(3))
    gpu = DeviceModel("gpu", 3000.0, 0.001, 0.05, drift_at=9.0, drift_factor=0.05)
    return Scenario("slowing", (*cpus, gpu), total)


@pytest.mark.parametrize("seed", range(4))
def test_simulated_backups_shorten_the_tail_within_their_share(seed: int) -> None:
    scenario = slowing_farm()
    speeds = {d.name: d.rate for d in scenario.devices}
    run = {"seed": seed, "speeds": speeds, "max_chunk_seconds": 1.0, "heartbeat": 0.1}
    without = simulate(scenario, "equal-finish", backup_share=0.0, **run)
    with_backups = simulate(scenario, "equal-finish", backup_share=0.05, **run)
    assert without.summary is not None and with_backups.summary is not None
    assert with_backups.summary.tail_s < without.summary.tail_s
    assert with_backups.seconds < without.seconds
    assert with_backups.summary.backup_items <= 0.05 * scenario.total
    delivered = sorted((c.chunk.start, c.chunk.count) for c in with_backups.chunks)
    assert covers_once(delivered, scenario.total)
