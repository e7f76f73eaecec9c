"""What a job's items are: dtypes, item sizes and the byte limits of a chunk.

Plain arithmetic shared by the wire (``farm.wire.protocol``, which checks what peers send
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


def layout_words(layout: str) -> str:
    """How messages name an item's layout: "C x H x W" or "H x W x C"."""
    return "H x W x C" if layout == "HWC" else "C x H x W"


def fitted_shape(
    model_shape: tuple[int, ...], layout: str, item_shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """The model's item shape when items of ``item_shape`` are its images byte for byte
    (None: they are not): the same shape, or, for a 1-channel model, 1 x H x W or H x W x 1
    whatever its layout (an N x H x W array arrives as N x 1 x H x W)."""
    model_shape, item_shape = tuple(model_shape), tuple(item_shape)
    if item_shape == model_shape:
        return model_shape
    if len(model_shape) != 3:
        return None
    hwc = layout == "HWC"
    channels, height, width = (model_shape[2], *model_shape[:2]) if hwc else model_shape
    if channels == 1 and item_shape in ((1, height, width), (height, width, 1)):
        return model_shape
    return None


def layout_hint(model_shape: tuple[int, ...], layout: str, item_shape: tuple[int, ...]) -> str:
    """What would make items of ``item_shape`` fit the model, when a transpose would (or
    when they are 1-channel images for a model of several channels): "" otherwise."""
    if len(model_shape) != 3 or len(item_shape) != 3:
        return ""
    hwc = layout == "HWC"
    channels = model_shape[2] if hwc else model_shape[0]
    height, width = model_shape[:2] if hwc else model_shape[1:]
    if not hwc and item_shape == (height, width, channels):
        return (
            "; these look H x W x C: pass images.transpose(0, 3, 1, 2) "
            "(N x H x W x C -> N x C x H x W)"
        )
    if hwc and item_shape == (channels, height, width):
        return (
            "; these look C x H x W: pass images.transpose(0, 2, 3, 1) "
            "(N x C x H x W -> N x H x W x C)"
        )
    if channels != 1 and item_shape in ((1, height, width), (height, width, 1)):
        return f"; these are 1-channel (grey) images and the model takes {channels} channels"
    return ""


def input_mismatch(
    model: str, model_shape: tuple[int, ...], layout: str, dtype: str, item_shape: tuple[int, ...]
) -> str | None:
    """Why a job's images cannot feed ``model`` (None: they can): image files give 1 or 3
    channels; an array's items must have the model's shape (``layout`` CHW or HWC), a
    1-channel model taking 1 x H x W and H x W x 1 alike (``fitted_shape``).  The broker
    refuses such a job, and ``farm run`` before it starts a farm, in these words."""
    if dtype == ENCODED:
        channels = model_shape[-1 if layout == "HWC" else 0]
        if channels not in (1, 3):
            return (
                f"model {model!r} takes {channels} channels: image files give 1 (grey) "
                f"or 3 (colour)"
            )
        return None
    if fitted_shape(model_shape, layout, item_shape) is None:
        words = f" ({layout_words(layout)})" if len(model_shape) == 3 else ""
        return (
            f"images of shape {tuple(item_shape)} do not match model {model!r}, which "
            f"takes {tuple(model_shape)}{words}"
            f"{layout_hint(tuple(model_shape), layout, tuple(item_shape))}"
        )
    return None
