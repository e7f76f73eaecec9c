"""Chaos: one real 200 000-image LeNet job through a farm under churn (issue 17).

A broker (``--heartbeat 0.2 --liveness 5``) and 3 pinned workers (cores taken in
turn) run as separate ``farm broker`` / ``farm worker`` processes; ``farm submit
IMAGES --model lenet --out OUT.npy`` runs one job on them, first without faults
(the baseline wall time), then under churn.  The input is the bundled LeNet
sample's digits tiled to ``--images`` in a seeded order.

Every U(0.5, 1.5) s of the chaos run (seeded) one fault: a worker SIGKILLed and
a new one started at once on its core; a worker SIGSTOPped for one interval,
then SIGCONT; worker 0, run in a network namespace (``ip netns``, a veth pair),
has its link cut (veth down) for one interval.  At evenly spread points of the
job: the broker SIGKILLed and restarted on the same address (``--broker-restarts``
times) and the client SIGKILLed, then ``farm submit ... --resume`` started
(``--client-kills`` times).  Without network namespaces (not root, no ``ip``)
the link cut is skipped, saying why.

Checks, per seed: the last ``farm submit`` exited 0, no image failed (no NaN),
every output within 1e-5 of an in-process forward, the planned broker/client
kills happened, no journal left behind.  Printed: the faults (by kind, with
times), both wall times and their ratio, the images recomputed (chunks the
workers' debug logs say they computed, minus the job's images) and, per client
kill, the images computed twice because of it against one chunk per worker.
Exit status 1 if any check failed; the run's folder (logs, inputs, outputs) is
then kept and named.

``--backup-share SHARE`` is passed to every broker started (``farm broker
--backup-share``; default: the broker's): ``--backup-share 0`` runs without backup
attempts, to compare.  Per seed, the report shows the backup attempts (chunks, extra
work, wins) and the tail share that the last ``farm submit``'s summary printed (of its
own job: after a client kill, only the images the resumed submit asked for; "n/a"
where the summary lacks them), and the same for the fault-free job.

``--poison ITEM``: workers fail every chunk touching ITEM (``--fail-items``), no
other faults; exactly that image must fail (NaN, ``farm submit`` exits 1) and
every other equal the reference; prints the extra compute spent.

    python bench/chaos.py [--images 200000] [--workers 3] [--seeds 5 | --seed S ...]
                          [--interval 0.5,1.5] [--broker-restarts 2] [--client-kills 1]
                          [--no-link-cut] [--backup-share SHARE] [--poison ITEM] [--keep]
                          [--save bench/results/DATE-chaos.txt]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import date
from pathlib import Path

from faults import ChaosConfig, SeedReport, keep_or_remove, run_poison, run_resume, run_seed

from farm.benchsuite.common import machine, saved


def interval(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    try:
        bounds = float(low), float(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A,B") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < A <= B")
    return bounds


def tail_total(reports: list[SeedReport]) -> str:
    """Backup attempts and the mean tail share over the seeds whose last summary gave them."""
    figures = [report.chaos.tail for report in reports]
    backups = [f for f in figures if f.backups is not None]
    tails = [f.tail_share for f in figures if f.tail_share is not None]
    shown = (
        f"backups {sum(f.backups or 0 for f in backups)} (won {sum(f.wins or 0 for f in backups)})"
        f" in {len(backups)} of {len(figures)} seeds' summaries"
        if backups
        else "backups n/a"
    )
    if not tails:
        return shown + ", tail n/a"
    seeds = f"{len(tails)} seed{'' if len(tails) == 1 else 's'}"
    return shown + f", mean tail {sum(tails) / len(tails):.1%} ({seeds})"


def chaos(args: argparse.Namespace) -> int:
    """Run every seed (or the poison job) and print the report; the exit status."""
    config = ChaosConfig(
        images=args.images,
        workers=args.workers,
        interval=args.interval,
        broker_restarts=args.broker_restarts,
        client_kills=args.client_kills,
        link_cut=args.link_cut,
        algo=args.algo,
        poison=args.poison,
        shared=args.shared,
        backup_share=args.backup_share,
    )
    print(machine())
    print("command: python bench/chaos.py " + " ".join(sys.argv[1:]))
    root = Path(tempfile.mkdtemp(prefix="farm-chaos-"))
    if config.poison is not None:
        passed = not run_poison(config, root).problems
    elif args.resume_only:
        passed = not run_resume(config, root).problems
    else:
        seeds = args.seed or list(range(1, args.seeds + 1))
        print(
            f"chaos: {config.images:,} LeNet images, {config.workers} workers, a fault "
            f"every U({config.interval[0]:g}, {config.interval[1]:g}) s, "
            f"{config.broker_restarts} broker restarts, {config.client_kills} client kills, "
            + (
                f"--backup-share {config.backup_share:g}"
                if config.backup_share is not None
                else "the broker's default --backup-share"
            )
            + f"; seeds {', '.join(map(str, seeds))}",
            flush=True,
        )
        reports = [run_seed(config, seed, root) for seed in seeds]
        print()
        for report in reports:
            print(report.line())
        failed = [report.seed for report in reports if not report.passed]
        print(
            f"total: {len(reports)} seeds, {len(reports) - len(failed)} passed, "
            f"{sum(len(r.faults) for r in reports)} faults, "
            f"{sum(r.recomputed for r in reports):,} images recomputed; {tail_total(reports)}"
            + (f"; FAILED seeds {', '.join(map(str, failed))}" if failed else "")
        )
        passed = not failed
    print("PASS" if passed else "FAIL")
    keep_or_remove(root, passed, args.keep)
    return 0 if passed else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=3, help="pinned workers (cores in turn)")
    parser.add_argument("--seeds", type=int, default=1, help="run seeds 1..N")
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    parser.add_argument(
        "--interval",
        type=interval,
        default=(0.5, 1.5),
        help="seconds between faults, A,B: uniform in [A, B]",
    )
    parser.add_argument("--broker-restarts", type=int, default=2)
    parser.add_argument("--client-kills", type=int, default=1)
    parser.add_argument(
        "--no-link-cut",
        dest="link_cut",
        action="store_false",
        help="no network namespace, no link-cut fault",
    )
    parser.add_argument("--algo", help="the broker's policy [default: the broker's]")
    parser.add_argument(
        "--backup-share",
        type=float,
        metavar="SHARE",
        help="the brokers' --backup-share (0: no backup attempts) [default: the broker's]",
    )
    parser.add_argument(
        "--resume-only",
        action="store_true",
        help="no churn: the client killed at half-way then resumed; images "
        "computed twice against one chunk per worker",
    )
    parser.add_argument(
        "--poison",
        type=int,
        metavar="ITEM",
        help="poison mode: this item fails on every worker, no other faults",
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="farm submit --shared: the workers read the job's .npy themselves",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's folder even on PASS")
    parser.add_argument(
        "--save",
        type=Path,
        default=Path(f"bench/results/{date.today()}-chaos.txt"),
        help="also write the report here ('-': nowhere)",
    )
    args = parser.parse_args()
    if args.backup_share is not None and not 0 <= args.backup_share <= 1:
        parser.error("--backup-share must be in [0, 1]")
    if args.poison is not None and not 0 <= args.poison < args.images:
        parser.error("--poison must be an item of the job (0 <= ITEM < --images)")
    sys.exit(saved(args.save, lambda: chaos(args)))


if __name__ == "__main__":
    main()
