"""When two backends' outputs count as the same answer: ``auto`` and ``farm models check``
compare every backend with a reference by ``relative_difference`` against ``TOLERANCES``."""

from __future__ import annotations

import numpy as np

#: Largest output difference, relative to the reference output's largest magnitude, that
#: counts as agreement, by precision (reduced precisions are compared with the f32 reference).
#: In f32, correct backends differ by up to 8e-5 on a seeded ResNet-50's softmax (logits in
#: the hundreds); a layer computed wrongly differs by 1e-2 or more.
#: int8's bound only catches a broken graph (a wrong layer differs by 1 or more): whether
#: its answers are good enough is the precision gate's test, top-1 agreement on the user's
#: images (``farm.engines.gate``); SqueezeNet's int8 differs by about 0.1.
TOLERANCES = {"f32": 1e-3, "f16": 5e-2, "bf16": 1e-1, "int8": 0.5}
#: The tolerance in f32: outputs this close are the same answer.
TOLERANCE = TOLERANCES["f32"]


def relative_difference(outputs: np.ndarray, reference: np.ndarray) -> float:
    """max |outputs - reference| over the reference's largest magnitude."""
    if outputs.shape != reference.shape:
        return float("inf")
    scale = float(np.abs(reference).max())
    difference = float(np.abs(outputs.astype(np.float64) - reference).max())
    return difference / scale if scale > 0 else difference
