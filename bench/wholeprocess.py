"""``farm run`` as a whole process beside the best in-process scripts, on the same images.

    python bench/wholeprocess.py [--rounds 3] [--models
    lenet:100000,cifar10_quick:20000,caffenet:500]

For each model: the images (its sample, or seeded random ones, repeated to the
count) are saved once; ``farm models export`` writes the ONNX file the scripts
read.  One warm-up of each command fills the caches (``auto``'s choice, generated
weights, the page cache).  Then each round times, in turn (the order rotates
from round to round), as whole processes with start-up included:

- ``farm run IMAGES --model M --out OUT`` (its default: a broker and one pinned
  worker per core on ``auto``), whose summary also gives the job's waste;
- ``bench/user_script.py onnxruntime``: ONNX Runtime, all threads, one process;
- ``bench/user_script.py openvino``: OpenVINO, THROUGHPUT hint, async queue.

It prints each command's median seconds, ``farm run``'s ratio to the best script
(images/s over images/s, so above 1 is faster), the waste, and the largest output
difference between farm and the scripts.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from farm.engines.modelcheck import check_inputs
from farm.engines.tolerances import relative_difference
from farm.modelrepo.repository import find, prepare
from farm.ops.local import farm_command

SCRIPT = Path(__file__).with_name("user_script.py")
DEFAULT_MODELS = "lenet:100000,cifar10_quick:20000,caffenet:500"
#: The scripts' batch per model (what their authors would tune it to on a CPU).
SCRIPT_BATCH = {"lenet": 256, "cifar10_quick": 64, "caffenet": 8}


def commands(model: str, folder: Path) -> dict[str, list[str]]:
    images, onnx = str(folder / "images.npy"), str(folder / f"{model}.onnx")
    batch = str(SCRIPT_BATCH.get(model, 16))
    return {
        "farm run": farm_command(
            "run", images, "--model", model, "--quiet", "--out", str(folder / "farm.npy")
        ),
        "onnxruntime script": [
            sys.executable,
            str(SCRIPT),
            "onnxruntime",
            onnx,
            images,
            str(folder / "onnxruntime.npy"),
            model,
            batch,
        ],
        "openvino script": [
            sys.executable,
            str(SCRIPT),
            "openvino",
            onnx,
            images,
            str(folder / "openvino.npy"),
            model,
            batch,
        ],
    }


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, done.stdout + done.stderr


def bench_model(model: str, count: int, rounds: int, folder: Path) -> dict[str, object]:
    spec = find(model)
    prepare(spec)
    np.save(folder / "images.npy", np.resize(check_inputs(spec, 1000), (count, *spec.item_shape)))
    subprocess.run(
        farm_command("models", "export", model, "--onnx", str(folder / f"{model}.onnx")),
        check=True,
        capture_output=True,
    )
    runs = commands(model, folder)
    for command in runs.values():  # warm-up: caches filled, nothing timed
        timed(command)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    wastes = []
    names = list(runs)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:  # rotated
            command = runs[name]
            elapsed, output = timed(command)
            seconds[name].append(elapsed)
            if name == "farm run" and (found := re.search(r"waste (-?[\d.]+)%", output)):
                wastes.append(float(found.group(1)))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    best_peer = min((name for name in runs if name != "farm run"), key=medians.get)
    farm_out = np.load(folder / "farm.npy")
    difference = max(
        relative_difference(farm_out, np.load(folder / f"{name.split()[0]}.npy"))
        for name in runs
        if name != "farm run"
    )
    return {
        "model": model,
        "images": count,
        "medians": medians,
        "best_peer": best_peer,
        "ratio": medians[best_peer] / medians["farm run"],
        "waste": statistics.median(wastes) if wastes else None,
        "difference": difference,
        "all": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="model:images,...")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'model':<14} {'images':>7}  {'farm run':>9} {'onnxruntime':>12} {'openvino':>9}"
        f"  {'farm / best':>11}  {'waste':>6}  difference"
    )
    for item in args.models.split(","):
        model, _, count = item.partition(":")
        with tempfile.TemporaryDirectory() as folder:
            row = bench_model(model, int(count), args.rounds, Path(folder))
        medians = row["medians"]
        waste = f"{row['waste']:.1f}%" if row["waste"] is not None else "-"
        print(
            f"{model:<14} {row['images']:>7,}  {medians['farm run']:>8.2f}s "
            f"{medians['onnxruntime script']:>11.2f}s {medians['openvino script']:>8.2f}s  "
            f"{row['ratio']:>10.2f}x  {waste:>6}  {row['difference']:.1e}",
            flush=True,
        )
        print(
            "  every round (s): "
            + "; ".join(
                f"{name} {', '.join(f'{v:.2f}' for v in values)}"
                for name, values in row["all"].items()
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
