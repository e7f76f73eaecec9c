"""What a job's items are: dtypes, item sizes and the byte limits of a chunk.

Plain arithmetic shared by the wire (``farm.protocol``, which checks what peers send
against it) and the broker's scheduling core (``farm.broker.state``, which cuts chunks
by it), so the core needs neither the protocol nor its messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Bytes per value of each dtype that may cross the wire, by its numpy name.
DTYPE_BYTES = {"uint8": 1, "float32": 4}
#: Dtypes that may cross the wire.
ALLOWED_DTYPES = frozenset(DTYPE_BYTES)
#: The dtype of a job of image files: an item is one file's encoded bytes, at most
#: ``item_shape[0]`` of them.  A chunk of files travels as two frames
#: (``protocol.file_frames``): the files' sizes (``SIZE_BYTES`` each) and their bytes back to
#: back.  Workers decode them.
ENCODED = "encoded"
#: Bytes of one file's size in a chunk of image files (a little-endian uint32).
SIZE_BYTES = 4
#: Largest image file a job may send (a chunk's input must fit ``MAX_TASK_BYTES``).
MAX_FILE_BYTES = 32 << 20
#: Largest chunk of input the broker cuts: policies' chunks are capped to this many bytes.
MAX_TASK_BYTES = 64 << 20


def item_bytes(dtype: str, item_shape: Sequence[int]) -> int:
    """Bytes per item of a valid dtype and item shape (for ``ENCODED``: the most one file
    may have)."""
    if dtype == ENCODED:
        return item_shape[0]
    return DTYPE_BYTES[dtype] * math.prod(item_shape)


def chunk_items(item_shape: Sequence[int]) -> int:
    """The most uint8 images of ``item_shape`` one chunk holds (``MAX_TASK_BYTES``)."""
    return max(1, MAX_TASK_BYTES // item_bytes("uint8", item_shape))


def input_mismatch(
    model: str, model_shape: tuple[int, ...], layout: str, dtype: str, item_shape: tuple[int, ...]
) -> str | None:
    """Why a job's images cannot feed ``model`` (None: they can): image files give 1 or 3
    channels; an array's items must have the model's shape (``layout`` CHW or HWC).  The
    broker refuses such a job, and ``farm run`` before it starts a farm, in these words."""
    if dtype == ENCODED:
        channels = model_shape[-1 if layout == "HWC" else 0]
        if channels not in (1, 3):
            return (
                f"model {model!r} takes {channels} channels: image files give 1 (grey) "
                f"or 3 (colour)"
            )
        return None
    if tuple(item_shape) != tuple(model_shape):
        hwc = " (H x W x C)" if layout == "HWC" else ""
        return (
            f"images of shape {tuple(item_shape)} do not match model {model!r}, which "
            f"takes {tuple(model_shape)}{hwc}"
        )
    return None
