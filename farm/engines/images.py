"""Encoded image files (JPEG, PNG, BMP, TIFF, WebP, GIF, PNM) -> the arrays a client would
send.

A worker decodes each file into exactly what a client sending decoded arrays
sends for the model: ``spec.item_shape`` uint8, colour in **RGB** order (the
model's ``[preprocess] channel_swap`` makes Caffe's BGR, as ``classify.py``
does with ``caffe.io.load_image``), then ``farm.engines.preprocess.Transformer``
makes the net's input.  One file, in order:

1. empty data is refused;
2. the format comes from the file's signature: other formats are refused;
3. a JPEG must have an end-of-image marker after its last scan: older OpenCV
   releases decode a truncated JPEG into a part-grey image instead of failing
   (4.14 returns nothing), and the message is clearer either way;
4. the header alone is read, with Pillow, for the declared width x height:
   images over ``max_pixels`` are refused before any pixel is decoded;
5. OpenCV decodes it: ``cv2.imdecode(buf, flags)`` with
   ``flags = cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION`` for 3-channel
   nets and ``cv2.IMREAD_GRAYSCALE | cv2.IMREAD_IGNORE_ORIENTATION`` for
   1-channel nets (see ``imread_flags``).  So a grey image for a colour net is
   replicated to 3 channels, a colour image for a grey net is converted to grey
   by OpenCV, 16-bit samples become 8-bit (``value >> 8``), CMYK JPEGs become
   colour, alpha is dropped (not blended) and palettes are expanded.  A GIF is
   decoded by Pillow instead (OpenCV reads GIF only from 4.11 on): its first frame,
   the palette expanded to RGB (a transparent pixel keeps its palette colour), then
   converted by OpenCV as a decoded PNG would be (``decode_gif``).  OpenCV's
   own EXIF handling is off (it differs across releases and formats): the
   orientation that Pillow reads from the header turns the image upright, as
   viewers show it (``orient``), unless the job asked for the stored pixels
   (``exif_rotate=False``, as Caffe's ``classify.py`` and ``convert_imageset``
   read them).  BGR -> RGB follows;
6. resized per ``spec.resize`` with ``cv2.resize`` and cropped (centre, or
   Caffe's 10-crop ``oversample``), see ``resized_size`` and ``crop_boxes``;
7. laid out H x W x C for HWC models, else C x H x W.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from farm.defaults import DECODED_FORMATS
from farm.modelrepo.repository import ModelError, ModelSpec, Resize

#: Default refusal threshold on the declared width x height.  A file of a few kilobytes
#: can declare 50 000 x 50 000 pixels (a decompression bomb): decoding it would take
#: 7.5 GB and minutes of one worker, so such files are refused from their header.
#: 100 M pixels still admits a 10 000 x 10 000 scan (300 MB decoded).
MAX_PIXELS = 100_000_000

# farm checks the declared size itself (``_check_size``) with a clearer message and its own
# limit; Pillow's check would raise or warn past its own 89 M-pixel default.
Image.MAX_IMAGE_PIXELS = None

#: The formats decoded, by the name messages use: their file signatures, and Pillow's
#: names for them (MPO is a camera JPEG with a second, preview image; OpenCV decodes the
#: first image like any JPEG).  PNM is PBM, PGM and PPM, ASCII or binary.
SIGNATURES = {
    "JPEG": (b"\xff\xd8\xff",),
    "PNG": (b"\x89PNG\r\n\x1a\n",),
    "BMP": (b"BM",),
    "TIFF": (b"II*\x00", b"MM\x00*"),
    "WebP": (b"RIFF",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "PNM": tuple(b"P%d" % n for n in range(1, 7)),
}
PILLOW_FORMATS = {
    "JPEG": ["JPEG", "MPO"],
    "PNG": ["PNG"],
    "BMP": ["BMP"],
    "TIFF": ["TIFF"],
    "WebP": ["WEBP"],
    "GIF": ["GIF"],
    "PNM": ["PPM"],
}
NOT_AN_IMAGE = (
    f"not an image file (no {', '.join(DECODED_FORMATS[:-1])} or {DECODED_FORMATS[-1]} header)"
)

#: The EXIF tag of an image's orientation: how to turn the stored pixels to show them.
ORIENTATION_TAG = 0x0112

INTERPOLATION = {
    "linear": cv2.INTER_LINEAR,
    "area": cv2.INTER_AREA,
    "cubic": cv2.INTER_CUBIC,
    "nearest": cv2.INTER_NEAREST,
}


class ImageError(ValueError):
    """Why one file cannot be an input (the message is shown to the user)."""


@dataclass(frozen=True)
class DecodedBatch:
    """The outcome of decoding a list of files: the good ones' inputs, the bad ones' reasons."""

    images: np.ndarray  # (len(ok) * crops, *item_shape) uint8; each image's crops consecutive
    ok: np.ndarray  # int64 indices into the input list of the images decoded, ascending
    failures: list[tuple[int, str]]  # (index into the input list, reason), ascending
    crops: int
    oriented: int = 0  # images decoded whose EXIF orientation is not "as stored"


def imread_flags(channels: int) -> int:
    """The ``cv2.imdecode`` flags for a net with this many input channels."""
    mode = cv2.IMREAD_GRAYSCALE if channels == 1 else cv2.IMREAD_COLOR
    return mode | cv2.IMREAD_IGNORE_ORIENTATION


class ImageDecoder:
    """Decodes image files into one model's client-side arrays (``spec.item_shape`` uint8)."""

    def __init__(self, spec: ModelSpec, max_pixels: int = MAX_PIXELS) -> None:
        channels, height, width = spec.input_shape
        if channels not in (1, 3):
            raise ModelError(
                f"model {spec.name!r}: image files need a 1- or 3-channel input, "
                f"its input is {spec.input_shape}"
            )
        try:
            spec.resize.check((height, width))
        except ModelError as exc:
            raise ModelError(f"model {spec.name!r}: {exc}") from None
        self.spec = spec
        self.max_pixels = max_pixels
        self.net_size = (height, width)
        self.channels = channels
        self.hwc = spec.preprocess.layout == "HWC"
        self.crops = spec.resize.crops
        self.flags = imread_flags(channels)

    def decode_one(self, data: bytes | memoryview, exif_rotate: bool = True) -> np.ndarray:
        """``(crops, *item_shape)`` uint8 for one file; ImageError says why it cannot be."""
        out = np.empty((self.crops, *self.spec.item_shape), np.uint8)
        self._decode_into(data, out, exif_rotate)
        return out

    def decode(self, files: Sequence[bytes | memoryview], exif_rotate: bool = True) -> DecodedBatch:
        """Every file decoded, in order, turned upright by its EXIF orientation unless
        ``exif_rotate`` is False; a bad file is listed in ``failures``, never raised."""
        images = np.empty((len(files) * self.crops, *self.spec.item_shape), np.uint8)
        ok: list[int] = []
        failures: list[tuple[int, str]] = []
        oriented = 0
        for index, data in enumerate(files):
            start = len(ok) * self.crops
            try:
                oriented += self._decode_into(data, images[start : start + self.crops], exif_rotate)
            except ImageError as exc:
                failures.append((index, str(exc)))
            except (cv2.error, MemoryError) as exc:  # the file's fault, not its chunk's
                failures.append(
                    (index, f"cannot decode: {type(exc).__name__}: {str(exc).strip()[:200]}")
                )
            else:
                ok.append(index)
        return DecodedBatch(
            images[: len(ok) * self.crops], np.array(ok, np.int64), failures, self.crops, oriented
        )

    def _decode_into(self, data: bytes | memoryview, out: np.ndarray, exif_rotate: bool) -> bool:
        """Decode one file into ``out``; whether its EXIF orientation is not "as stored"
        (applied when ``exif_rotate``)."""
        data = bytes(data)  # Pillow's BytesIO copies anyway; bytes have find/rfind
        if not data:
            raise ImageError("empty file")
        kind = sniff(data)
        if kind is None:
            raise ImageError(NOT_AN_IMAGE)
        if kind == "JPEG":
            check_jpeg_complete(data)
        width, height, orientation = read_header(data, kind)
        _check_size(width, height, self.max_pixels)
        image = decode_pixels(data, self.flags, kind)
        if exif_rotate:
            image = orient(image, orientation)
        target = resized_size(image.shape[:2], self.net_size, self.spec.resize)
        if target[0] * target[1] > self.max_pixels:  # a 1 x 100 000 strip at shorter_side 256
            raise ImageError(
                f"a {width} x {height} image would be resized to {target[1]} x "
                f"{target[0]}, over the limit of {self.max_pixels:,} pixels"
            )
        image = resize(image, target, self.spec.resize.interpolation)
        if image.ndim == 3:
            cv2.cvtColor(image, cv2.COLOR_BGR2RGB, dst=image)
        boxes = crop_boxes(image.shape[:2], self.net_size, self.spec.resize.crop)
        lay_out(cropped(image, boxes, self.net_size), out, self.hwc)
        return orientation != 1


def read_header(data: bytes, kind: str) -> tuple[int, int, int]:
    """The (width, height) the header of a ``kind`` file declares, as stored, and its EXIF
    orientation (1, "as stored", when it has none or an invalid one): read by Pillow
    without decoding any pixel."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Corrupt EXIF data": OpenCV decides
            with Image.open(io.BytesIO(data), formats=PILLOW_FORMATS[kind]) as image:
                return (*image.size, exif_orientation(image))
    except UnidentifiedImageError:
        raise ImageError(f"corrupt {kind} header") from None
    except Exception as exc:  # Pillow raises many kinds on a broken header
        raise ImageError(f"corrupt {kind} header: {exc}") from None


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (0x0112) of an opened image, 1 to 8; 1 when it has none,
    an invalid one, or EXIF that cannot be read (a GIF has none).  Read from the header
    alone: ``Image.getexif`` itself, as PNG's override would decode the pixels first (a PNG's
    ``eXIf`` chunk counts when it comes before the pixel data, as the PNG spec asks)."""
    if image.format == "GIF":
        return 1
    try:
        value = Image.Image.getexif(image).get(ORIENTATION_TAG, 1)
    except Exception:  # broken EXIF: the pixels as stored, as a viewer would show them
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def orient(image: np.ndarray, orientation: int) -> np.ndarray:
    """``image`` (H x W or H x W x C) turned as EXIF ``orientation`` says, to show it upright:
    2 mirror, 3 rotate 180, 4 flip, 5 transpose, 6 rotate 90 clockwise, 7 transverse,
    8 rotate 90 counter-clockwise (Pillow's ``ImageOps.exif_transpose``)."""
    if orientation == 2:
        return cv2.flip(image, 1)
    if orientation == 3:
        return cv2.rotate(image, cv2.ROTATE_180)
    if orientation == 4:
        return cv2.flip(image, 0)
    if orientation == 5:
        return cv2.transpose(image)
    if orientation == 6:
        return cv2.rotate(image, cv2.ROTATE_90_CLOCKWISE)
    if orientation == 7:
        return cv2.rotate(cv2.transpose(image), cv2.ROTATE_180)
    if orientation == 8:
        return cv2.rotate(image, cv2.ROTATE_90_COUNTERCLOCKWISE)
    return image


def sniff(data: bytes) -> str | None:
    """The format whose signature ``data`` starts with, or None."""
    for kind, signatures in SIGNATURES.items():
        if data.startswith(signatures):
            if kind == "WebP" and data[8:12] != b"WEBP":
                continue
            if kind == "PNM" and not data[2:3].isspace():
                continue
            return kind
    return None


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise ImageError(
            f"image declares {width} x {height} = {width * height:,} pixels, over "
            f"the limit of {max_pixels:,}: refused without decoding"
        )


def check_jpeg_complete(data: bytes) -> None:
    """Refuse a JPEG with no EOI (FF D9) after its last SOS (FF DA).

    A progressive JPEG has several scans, so the last one counts; an EXIF thumbnail's EOI
    lies before the main image's scans.  Inside scan data FF is always followed by 00 or a
    restart marker, so these pairs are real markers there.
    """
    # the same as searching for an EOI after the last SOS, but a whole file's scan data is
    # not searched backwards when it ends as it should: the last EOI is near the end
    last_end = data.rfind(b"\xff\xd9")
    if last_end < 0 or data.find(b"\xff\xda", last_end) >= 0 or b"\xff\xda" not in data:
        raise ImageError("truncated JPEG: no end-of-image marker after the last scan")


def decode_pixels(data: bytes, flags: int, kind: str) -> np.ndarray:
    """OpenCV's decoding: H x W x 3 BGR or H x W grey, uint8."""
    if kind == "GIF":
        return decode_gif(data, grey=not flags & cv2.IMREAD_COLOR)
    try:
        image = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    except cv2.error as exc:
        raise ImageError(f"corrupt or unsupported {kind}: {exc.err or exc}") from None
    if image is None or image.size == 0:
        raise ImageError(f"corrupt or unsupported {kind}: OpenCV could not decode it")
    if image.dtype != np.uint8:  # not expected without IMREAD_ANYDEPTH
        raise ImageError(f"unsupported {kind}: {image.dtype} samples")
    return image


def decode_gif(data: bytes, grey: bool) -> np.ndarray:
    """A GIF's first frame as ``decode_pixels`` gives other formats: H x W x 3 BGR or H x W
    grey, uint8.  Pillow decodes it, the palette expanded to RGB; OpenCV converts that."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. transparency in a palette image
            with Image.open(io.BytesIO(data), formats=["GIF"]) as image:
                rgb = np.asarray(image.convert("RGB"))
    except UnidentifiedImageError:
        raise ImageError("corrupt GIF") from None
    except Exception as exc:  # Pillow raises many kinds on a broken file
        raise ImageError(f"corrupt GIF: {exc}") from None
    return cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY if grey else cv2.COLOR_RGB2BGR)


def resized_size(
    image_size: tuple[int, int], net_size: tuple[int, int], settings: Resize
) -> tuple[int, int]:
    """The (H, W) an image of ``image_size`` is resized to before cropping.

    ``size`` exactly; ``shorter_side`` keeping the aspect ratio (the longer side rounded
    half up); otherwise the net's own size.  When the result is smaller than the crop in a
    dimension it is scaled up, keeping its aspect ratio, until the crop fits: a model's
    settings then still yield the net's input from every image, with no distortion beyond
    what the settings asked for, instead of refusing all images of some shapes.
    """
    height, width = image_size
    net_h, net_w = net_size
    if settings.crop == "none":
        return net_size
    if settings.size is not None:
        target = settings.size
    elif settings.shorter_side is not None:
        side = settings.shorter_side
        target = (
            (side, _scaled(width, side, height))
            if height <= width
            else (_scaled(height, side, width), side)
        )
    else:
        return net_size
    if target[0] >= net_h and target[1] >= net_w:
        return target
    # the smallest upscale of target covering the crop: max(net_h/h, net_w/w)
    if net_h * target[1] >= net_w * target[0]:
        return net_h, max(net_w, _scaled(target[1], net_h, target[0]))
    return max(net_h, _scaled(target[0], net_w, target[1])), net_w


def _scaled(length: int, numerator: int, denominator: int) -> int:
    """``length * numerator / denominator`` rounded half up, at least 1, in integers."""
    return max(1, (2 * length * numerator + denominator) // (2 * denominator))


def resize(image: np.ndarray, size: tuple[int, int], interpolation: str) -> np.ndarray:
    """``image`` resized to ``size`` (H, W); ``image`` itself when it has that size."""
    if image.shape[:2] == size:
        return image
    return cv2.resize(image, (size[1], size[0]), interpolation=INTERPOLATION[interpolation])


def crop_boxes(
    image_size: tuple[int, int], net_size: tuple[int, int], crop: str
) -> list[tuple[int, int, bool]]:
    """(top, left, mirrored) of each crop, in Caffe's order.

    ``center``: offsets ``(h - crop_h) // 2``, ``(w - crop_w) // 2`` as Caffe's data
    layer.  ``oversample``: as pycaffe's ``caffe.io.oversample``, the top-left, top-right,
    bottom-left and bottom-right corners and the centre, then those five mirrored
    left-right.  ``none``: the whole image.
    """
    height, width = image_size
    net_h, net_w = net_size
    centre = ((height - net_h) // 2, (width - net_w) // 2)
    if crop == "none":
        return [(0, 0, False)]
    if crop == "center":
        return [(*centre, False)]
    corners = [(top, left) for top in (0, height - net_h) for left in (0, width - net_w)]
    five = [*corners, centre]
    return [(top, left, False) for top, left in five] + [(top, left, True) for top, left in five]


def cropped(
    image: np.ndarray, boxes: list[tuple[int, int, bool]], net_size: tuple[int, int]
) -> list[np.ndarray]:
    """The net-sized crops at ``boxes`` (views of ``image``; copies when mirrored)."""
    net_h, net_w = net_size
    crops = []
    for top, left, mirrored in boxes:
        crop = image[top : top + net_h, left : left + net_w]
        crops.append(cv2.flip(crop, 1) if mirrored else crop)
    return crops


def lay_out(crops: list[np.ndarray], out: np.ndarray, hwc: bool) -> None:
    """Copy H x W x C (or H x W grey) crops into ``out``: (crops, H, W, C) or (crops, C, H, W)."""
    for index, crop in enumerate(crops):
        if crop.ndim == 2:
            crop = crop[:, :, np.newaxis]
        out[index] = crop if hwc else crop.transpose(2, 0, 1)


def split_files(sizes: np.ndarray, blob: memoryview | bytes) -> list[memoryview]:
    """A chunk's files from the wire: ``blob`` is their bytes concatenated, ``sizes`` (uint32)
    their lengths in order.  The files are views of ``blob``; ValueError if the sizes do not
    add up to its length."""
    sizes = np.asarray(sizes)
    if sizes.ndim != 1 or (sizes.size and (sizes.dtype.kind not in "iu" or sizes.min() < 0)):
        raise ValueError(
            f"file sizes must be a 1-D array of byte counts, got {sizes.dtype} {sizes.shape}"
        )
    view = memoryview(blob).cast("B")
    ends = np.cumsum(sizes, dtype=np.int64)
    total = int(ends[-1]) if ends.size else 0
    if total != len(view):
        raise ValueError(f"file sizes add up to {total} bytes, the blob has {len(view)}")
    starts = ends - sizes
    return [view[start:end] for start, end in zip(starts.tolist(), ends.tolist())]
