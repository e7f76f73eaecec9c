"""farm.engines.images: real image files decoded into the arrays a client would send."""

from __future__ import annotations

import dataclasses
import io
import struct
import time
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from farm.engines.images import (
    MAX_PIXELS,
    DecodedBatch,
    ImageDecoder,
    ImageError,
    orient,
    read_header,
    resized_size,
    split_files,
)
from farm.modelrepo.repository import ModelError, ModelSpec, Resize, find

#: The flags farm.engines.images documents: what a "direct OpenCV" reading of a file does.
COLOUR = cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION
GREY = cv2.IMREAD_GRAYSCALE | cv2.IMREAD_IGNORE_ORIENTATION


@pytest.fixture(scope="module")
def lenet() -> ModelSpec:
    return find("lenet")  # grey, C x H x W 1 x 28 x 28


@pytest.fixture(scope="module")
def cifar() -> ModelSpec:
    return find("cifar10_quick")  # colour, H x W x C 32 x 32 x 3


def with_resize(spec: ModelSpec, **settings) -> ModelSpec:
    return dataclasses.replace(spec, resize=Resize(**settings))


def with_layout(spec: ModelSpec, layout: str) -> ModelSpec:
    return dataclasses.replace(spec, preprocess=dataclasses.replace(spec.preprocess, layout=layout))


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """An RGB uint8 image with smooth gradients and some noise, as a photo might be."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack(
        [
            255 * x / max(width - 1, 1),
            255 * y / max(height - 1, 1),
            128 + 100 * np.sin((x + y) / 7),
        ],
        axis=-1,
    )
    noise = np.random.default_rng(seed).normal(0, 6, rgb.shape)
    return np.clip(rgb + noise, 0, 255).astype(np.uint8)


def coordinates(height: int, width: int) -> np.ndarray:
    """RGB whose red is the row and green the column (and blue 7): each pixel says where it is."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([y, x, np.full_like(y, 7)], axis=-1).astype(np.uint8)


def save(tmp_path: Path, image: Image.Image | np.ndarray, name: str, **options) -> bytes:
    """``image`` written to a real file by Pillow (format from the name); its bytes."""
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    path = tmp_path / name
    image.save(path, **options)
    return path.read_bytes()


def by_hand(
    data: bytes,
    flags: int,
    size: tuple[int, int],
    crop: tuple[int, int],
    interpolation: int = cv2.INTER_LINEAR,
) -> np.ndarray:
    """cv2.imdecode + cv2.resize + a centre crop, H x W x C RGB (or H x W grey)."""
    image = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    if image.ndim == 3:
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    if image.shape[:2] != size:
        image = cv2.resize(image, (size[1], size[0]), interpolation=interpolation)
    top, left = (size[0] - crop[0]) // 2, (size[1] - crop[1]) // 2
    return image[top : top + crop[0], left : left + crop[1]]


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height RGB, with a tiny IDAT (a decompression bomb)."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload))
            + kind
            + payload
            + struct.pack(">I", zlib.crc32(kind + payload))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


# --- formats and channel order ------------------------------------------------------------


@pytest.mark.parametrize(
    "name, options, tolerance",
    [
        ("a.png", {}, 0),
        ("a.bmp", {}, 0),
        ("a.tiff", {}, 0),
        ("a.webp", {"lossless": True}, 0),
        ("a.webp", {"quality": 90}, 6),
        ("a.jpg", {"quality": 95}, 6),
    ],
)
def test_each_format_decodes(tmp_path, cifar, name, options, tolerance):
    rgb = photo(48, 64)
    image = ImageDecoder(cifar).decode_one(save(tmp_path, rgb, name, **options))
    assert image.shape == (1, 32, 32, 3) and image.dtype == np.uint8
    expected = cv2.resize(rgb, (32, 32), interpolation=cv2.INTER_LINEAR)  # crop is the whole
    assert np.abs(image[0].astype(int) - expected).mean() <= tolerance


def test_red_comes_out_in_channel_0(tmp_path, cifar):
    red = np.zeros((40, 60, 3), np.uint8)
    red[..., 0] = 255
    data = save(tmp_path, red, "red.png")
    hwc = ImageDecoder(cifar).decode_one(data)
    assert (hwc[0].reshape(-1, 3) == [255, 0, 0]).all()
    chw = ImageDecoder(with_layout(cifar, "CHW")).decode_one(data)
    assert chw.shape == (1, 3, 32, 32)
    assert (chw[0, 0] == 255).all() and (chw[0, 1:] == 0).all()


def test_layouts_hold_the_same_pixels(tmp_path, cifar, lenet):
    data = save(tmp_path, photo(50, 40), "a.png")
    hwc = ImageDecoder(cifar).decode_one(data)
    chw = ImageDecoder(with_layout(cifar, "CHW")).decode_one(data)
    np.testing.assert_array_equal(chw, hwc.transpose(0, 3, 1, 2))
    grey_chw = ImageDecoder(lenet).decode_one(data)
    grey_hwc = ImageDecoder(with_layout(lenet, "HWC")).decode_one(data)
    assert grey_chw.shape == (1, 1, 28, 28) and grey_hwc.shape == (1, 28, 28, 1)
    np.testing.assert_array_equal(grey_chw[:, 0], grey_hwc[..., 0])


# --- equal to OpenCV by hand --------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, size",
    [
        ({}, (32, 32)),
        ({"size": (40, 50)}, (40, 50)),
        ({"size": (40, 50), "interpolation": "area"}, (40, 50)),
        ({"size": (37, 45), "interpolation": "cubic"}, (37, 45)),
        ({"shorter_side": 36, "interpolation": "nearest"}, (36, 48)),
        ({"crop": "none"}, (32, 32)),
    ],
)
def test_decode_equals_opencv_by_hand(tmp_path, cifar, settings, size):
    data = save(tmp_path, photo(60, 80), "a.jpg", quality=90)
    interpolation = {
        "linear": cv2.INTER_LINEAR,
        "area": cv2.INTER_AREA,
        "cubic": cv2.INTER_CUBIC,
        "nearest": cv2.INTER_NEAREST,
    }[settings.get("interpolation", "linear")]
    image = ImageDecoder(with_resize(cifar, **settings)).decode_one(data)
    np.testing.assert_array_equal(image[0], by_hand(data, COLOUR, size, (32, 32), interpolation))


def test_grey_net_equals_opencv_by_hand(tmp_path, lenet):
    data = save(tmp_path, photo(56, 70), "a.jpg", quality=90)
    spec = with_resize(lenet, shorter_side=40, interpolation="area")
    image = ImageDecoder(spec).decode_one(data)
    np.testing.assert_array_equal(
        image[0, 0], by_hand(data, GREY, (40, 50), (28, 28), cv2.INTER_AREA)
    )


def exif_photo(tmp_path: Path, orientation: int, fmt: str = "jpg") -> bytes:
    """A real file of ``photo(40, 64)`` stored with this EXIF orientation."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    options = {"quality": 95} if fmt == "jpg" else {}
    return save(tmp_path, photo(40, 64), f"o{orientation}.{fmt}", exif=exif.tobytes(), **options)


def test_exif_orientation_turns_the_image_upright_by_default(tmp_path, cifar):
    data = exif_photo(tmp_path, 6)  # "rotate 90 degrees clockwise to display"
    upright = cv2.rotate(cv2.imdecode(np.frombuffer(data, np.uint8), COLOUR), 0)  # 64 x 40
    spec = with_resize(cifar, size=(64, 40))  # no resampling of the upright image's size
    expected = by_hand(cv2.imencode(".png", upright)[1].tobytes(), COLOUR, (64, 40), (32, 32))
    np.testing.assert_array_equal(ImageDecoder(spec).decode_one(data)[0], expected)
    batch = ImageDecoder(spec).decode([data, save(tmp_path, photo(40, 64), "plain.jpg")])
    assert batch.oriented == 1  # the file without EXIF is not counted


def test_exif_orientation_is_ignored_when_asked(tmp_path, cifar):
    data = exif_photo(tmp_path, 6)
    spec = with_resize(cifar, size=(40, 64))
    image = ImageDecoder(spec).decode_one(data, exif_rotate=False)
    np.testing.assert_array_equal(image[0], by_hand(data, COLOUR, (40, 64), (32, 32)))
    assert ImageDecoder(spec).decode([data], exif_rotate=False).oriented == 1  # still told


@pytest.mark.parametrize("fmt", ["jpg", "png", "webp"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientations_match_pillow(tmp_path, orientation, fmt):
    """Every orientation, in each format that carries EXIF, as Pillow's exif_transpose
    turns it (PNG and WebP losslessly, so the pixels compare exactly)."""
    data = exif_photo(tmp_path, orientation, fmt)
    stored = cv2.imdecode(np.frombuffer(data, np.uint8), COLOUR)
    width, height, found = read_header(data, {"jpg": "JPEG", "png": "PNG", "webp": "WebP"}[fmt])
    assert (width, height, found) == (64, 40, orientation)
    with Image.open(io.BytesIO(data)) as opened:
        expected = np.asarray(ImageOps.exif_transpose(opened.convert("RGB")))
    if fmt == "jpg":  # Pillow's and OpenCV's JPEG decoders differ: OpenCV's own turning
        turned = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        assert turned.shape[:2] == expected.shape[:2]
        np.testing.assert_array_equal(orient(stored, orientation), turned)
    else:
        np.testing.assert_array_equal(orient(stored, orientation)[..., ::-1], expected)


# --- resize and crops ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(50, 70), (51, 70), (50, 71), (32, 32)])
def test_centre_crop_offsets(tmp_path, cifar, shape):
    data = save(tmp_path, coordinates(*shape), "xy.png")
    image = ImageDecoder(with_resize(cifar, size=shape)).decode_one(data)[0]  # no resampling
    top, left = (shape[0] - 32) // 2, (shape[1] - 32) // 2
    assert image.shape == (32, 32, 3)
    np.testing.assert_array_equal(image[:, 0, 0], np.arange(top, top + 32))
    np.testing.assert_array_equal(image[0, :, 1], np.arange(left, left + 32))
    assert (image[..., 2] == 7).all()


@pytest.mark.parametrize(
    "image_size, side, expected",
    [
        ((480, 640), 256, (256, 341)),  # 341.33
        ((640, 480), 256, (341, 256)),  # portrait
        ((333, 500), 256, (256, 384)),  # 384.38
        ((4, 6), 3, (3, 5)),  # 4.5 rounds half up
        ((100, 100), 50, (50, 50)),
    ],
)
def test_shorter_side_keeps_aspect(image_size, side, expected):
    assert resized_size(image_size, (2, 2), Resize(shorter_side=side)) == expected


@pytest.mark.parametrize(
    "settings, expected",
    [
        (Resize(shorter_side=20), (32, 48)),  # 20 x 30 scaled up until 32 x 32 fits
        (Resize(size=(16, 64)), (32, 128)),  # an exact size smaller than the crop
        (Resize(size=(64, 16)), (128, 32)),
        (Resize(), (32, 32)),  # no resize settings: the crop is the whole
        (Resize(size=(64, 64), crop="oversample"), (64, 64)),
    ],
)
def test_resize_makes_the_crop_fit(settings, expected):
    assert resized_size((60, 90), (32, 32), settings) == expected


def test_shorter_side_decodes_with_the_aspect_kept(tmp_path, cifar):
    for shape in ((60, 90), (90, 60)):
        data = save(tmp_path, photo(*shape), "a.png")
        image = ImageDecoder(with_resize(cifar, shorter_side=40)).decode_one(data)
        size = (40, 60) if shape[0] < shape[1] else (60, 40)
        np.testing.assert_array_equal(image[0], by_hand(data, COLOUR, size, (32, 32)))


def test_oversample_is_caffes_ten_crops_in_order(tmp_path, cifar):
    data = save(tmp_path, coordinates(40, 51), "xy.png")
    spec = with_resize(cifar, size=(40, 51), crop="oversample")
    crops = ImageDecoder(spec).decode_one(data)
    assert crops.shape == (10, 32, 32, 3)
    # pycaffe's caffe.io.oversample: corners TL, TR, BL, BR, then the centre (its offsets
    # truncate (40 - 32) / 2 = 4 and (51 - 32) / 2 = 9.5 -> 9), then all five mirrored
    origins = [(0, 0), (0, 19), (8, 0), (8, 19), (4, 9)]
    for index, (top, left) in enumerate(origins * 2):
        crop = crops[index]
        columns = np.arange(left, left + 32)
        if index >= 5:
            columns = columns[::-1]
        np.testing.assert_array_equal(crop[:, 0, 0], np.arange(top, top + 32), f"crop {index}")
        np.testing.assert_array_equal(crop[0, :, 1], columns, f"crop {index}")
        assert (crop[..., 0] == crop[:, :1, 0]).all() and (crop[..., 1] == crop[:1, :, 1]).all()


def test_oversample_crops_stay_together_in_a_batch(tmp_path, lenet):
    files = [save(tmp_path, photo(40, 40, seed), f"{seed}.png") for seed in range(3)]
    decoder = ImageDecoder(with_resize(lenet, shorter_side=32, crop="oversample"))
    batch = decoder.decode([files[0], b"", files[1], files[2]])
    assert batch.crops == 10 and batch.images.shape == (30, 1, 28, 28)
    np.testing.assert_array_equal(batch.ok, [0, 2, 3])
    for position, file in enumerate(files):
        np.testing.assert_array_equal(
            batch.images[position * 10 : (position + 1) * 10], decoder.decode_one(file)
        )


def test_crop_none_with_other_sizes_is_refused(cifar):
    with pytest.raises(ModelError, match="crop"):
        ImageDecoder(with_resize(cifar, shorter_side=40, crop="none"))
    with pytest.raises(ModelError, match="crop"):
        ImageDecoder(with_resize(cifar, size=(40, 40), crop="none"))
    ImageDecoder(with_resize(cifar, size=(32, 32), crop="none"))  # the net's own size: fine


# --- what each kind of file becomes -------------------------------------------------------


def test_cmyk_jpeg_decodes_to_its_rgb(tmp_path, cifar):
    rgb = photo(32, 32)
    data = save(tmp_path, Image.fromarray(rgb).convert("CMYK"), "cmyk.jpg", quality=95)
    assert Image.open(tmp_path / "cmyk.jpg").mode == "CMYK"
    image = ImageDecoder(cifar).decode_one(data)[0]
    assert np.abs(image.astype(int) - rgb).mean() < 3  # not inverted (that would be ~100)


def test_16_bit_png_keeps_the_high_byte(tmp_path, cifar, lenet):
    rng = np.random.default_rng(1)
    colour = rng.integers(0, 65536, (32, 32, 3), dtype=np.uint16)  # BGR, as cv2 writes
    cv2.imwrite(str(tmp_path / "c16.png"), colour)
    image = ImageDecoder(cifar).decode_one((tmp_path / "c16.png").read_bytes())[0]
    np.testing.assert_array_equal(image, (colour >> 8).astype(np.uint8)[..., ::-1])
    grey = rng.integers(0, 65536, (28, 28), dtype=np.uint16)
    cv2.imwrite(str(tmp_path / "g16.png"), grey)
    image = ImageDecoder(lenet).decode_one((tmp_path / "g16.png").read_bytes())[0, 0]
    np.testing.assert_array_equal(image, (grey >> 8).astype(np.uint8))


def test_grey_image_for_a_colour_net_is_replicated(tmp_path, cifar):
    grey = photo(32, 32)[..., 1]
    for name in ("g.png", "g.jpg"):
        data = save(tmp_path, Image.fromarray(grey, "L"), name, quality=95)
        image = ImageDecoder(cifar).decode_one(data)[0]
        assert (image[..., 0] == image[..., 1]).all() and (image[..., 0] == image[..., 2]).all()
        assert np.abs(image[..., 0].astype(int) - grey).mean() < 2


def test_colour_image_for_a_grey_net_is_converted(tmp_path, lenet):
    rgb = photo(28, 28)
    data = save(tmp_path, rgb, "c.png")
    image = ImageDecoder(lenet).decode_one(data)[0, 0]
    np.testing.assert_array_equal(image, cv2.imdecode(np.frombuffer(data, np.uint8), GREY))
    luma = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    assert np.abs(image.astype(int) - luma).max() <= 1


def test_rgba_png_drops_alpha(tmp_path, cifar):
    rgb = photo(32, 32)
    alpha = np.random.default_rng(2).integers(0, 256, (32, 32, 1), dtype=np.uint8)
    data = save(tmp_path, np.concatenate([rgb, alpha], axis=-1), "rgba.png")
    np.testing.assert_array_equal(ImageDecoder(cifar).decode_one(data)[0], rgb)


def test_palette_png_expands_its_colours(tmp_path, cifar):
    palette = Image.fromarray(photo(32, 32)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    data = save(tmp_path, palette, "p.png")
    assert Image.open(tmp_path / "p.png").mode == "P"
    expected = np.asarray(palette.convert("RGB"))
    np.testing.assert_array_equal(ImageDecoder(cifar).decode_one(data)[0], expected)


def test_memoryview_input(tmp_path, cifar):
    data = save(tmp_path, photo(40, 40), "a.png")
    decoder = ImageDecoder(cifar)
    np.testing.assert_array_equal(decoder.decode_one(memoryview(data)), decoder.decode_one(data))


# --- refusals -----------------------------------------------------------------------------


def refusal(decoder: ImageDecoder, data: bytes) -> str:
    with pytest.raises(ImageError) as caught:
        decoder.decode_one(data)
    return str(caught.value)


def test_truncated_jpeg_is_refused(tmp_path, cifar):
    data = save(tmp_path, photo(120, 160), "a.jpg", quality=90)
    reason = refusal(ImageDecoder(cifar), data[: len(data) // 2])
    assert reason == "truncated JPEG: no end-of-image marker after the last scan"


def test_progressive_jpeg_cut_between_scans_is_refused(tmp_path, cifar):
    data = save(tmp_path, photo(120, 160), "p.jpg", quality=90, progressive=True)
    assert data.count(b"\xff\xda") > 1
    decoder = ImageDecoder(cifar)
    decoder.decode_one(data)  # the whole file decodes
    assert "truncated JPEG" in refusal(decoder, data[: data.rfind(b"\xff\xda")])


def test_thumbnail_end_marker_does_not_hide_a_truncation(tmp_path, cifar):
    """A thumbnail in an APP segment (as EXIF keeps one) has its own SOS ... EOI before the
    main image's scan: only an EOI after the last scan counts."""
    thumbnail = save(tmp_path, photo(8, 8), "t.jpg", quality=50)
    main = save(tmp_path, photo(120, 160), "m.jpg", quality=90)
    segment = b"\xff\xe9" + struct.pack(">H", len(thumbnail) + 2) + thumbnail
    data = main[:2] + segment + main[2:]
    decoder = ImageDecoder(cifar)
    np.testing.assert_array_equal(decoder.decode_one(data), decoder.decode_one(main))
    assert "truncated JPEG" in refusal(decoder, data[: len(data) - 200])


def test_other_refusals(tmp_path, cifar):
    decoder = ImageDecoder(cifar)
    assert refusal(decoder, b"") == "empty file"
    not_image = "not an image file (no JPEG, PNG, BMP, TIFF, WebP, GIF or PNM header)"
    assert refusal(decoder, b"label,value\ncat,1\n") == not_image
    assert refusal(decoder, b"P5x not a PGM") == not_image
    gif = save(tmp_path, photo(30, 40), "a.gif")
    assert refusal(decoder, gif[: len(gif) // 2]).startswith("corrupt GIF: image file is truncated")
    png = save(tmp_path, photo(40, 40), "a.png")
    corrupt = png[:60] + bytes(200) + png[260:]
    assert refusal(decoder, corrupt) == "corrupt or unsupported PNG: OpenCV could not decode it"
    assert refusal(decoder, png[:16]).startswith("corrupt PNG header")


def test_a_gif_is_its_first_frame_decoded_by_pillow(tmp_path, cifar, lenet):
    """OpenCV reads GIF only from 4.11 on: Pillow decodes it, the palette expanded (a
    transparent pixel keeps its colour); a grey net gets OpenCV's grey of it."""
    first, second = coordinates(32, 32), photo(32, 32)
    frames = [Image.fromarray(first).quantize(256), Image.fromarray(second).quantize(256)]
    data = save(
        tmp_path,
        frames[0],
        "a.gif",
        save_all=True,
        append_images=frames[1:],
        duration=100,
        transparency=0,
    )
    assert data.startswith(b"GIF89a")
    with Image.open(tmp_path / "a.gif") as image:
        assert image.n_frames == 2
        expected = np.asarray(image.convert("RGB"))  # the first frame
    np.testing.assert_array_equal(expected, np.asarray(frames[0].convert("RGB")))
    np.testing.assert_array_equal(ImageDecoder(cifar).decode_one(data)[0], expected)
    grey = cv2.cvtColor(expected, cv2.COLOR_RGB2GRAY)
    resized = cv2.resize(grey, (28, 28), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_array_equal(ImageDecoder(lenet).decode_one(data)[0, 0], resized)


@pytest.mark.parametrize("suffix, channels", [(".pgm", 1), (".ppm", 3), (".pbm", 1)])
def test_pnm_files_decode_as_opencv_reads_them(cifar, suffix, channels):
    picture = photo(32, 32)[..., ::-1]  # BGR, as cv2.imencode takes it
    if channels == 1:
        picture = cv2.cvtColor(picture, cv2.COLOR_BGR2GRAY)
    if suffix == ".pbm":
        picture = np.where(picture > 128, 255, 0).astype(np.uint8)
    data = cv2.imencode(suffix, picture)[1].tobytes()
    np.testing.assert_array_equal(
        ImageDecoder(cifar).decode_one(data)[0], by_hand(data, COLOUR, (32, 32), (32, 32))
    )


def test_decompression_bomb_is_refused_from_its_header(cifar):
    bomb = png_declaring(50_000, 50_000)
    assert len(bomb) < 200
    started = time.perf_counter()
    reason = refusal(ImageDecoder(cifar), bomb)
    assert time.perf_counter() - started < 0.5
    assert "50000 x 50000" in reason and "2,500,000,000" in reason
    assert f"{MAX_PIXELS:,}" in reason


def test_pixel_limit_is_the_decoders(tmp_path, cifar):
    data = save(tmp_path, photo(40, 50), "a.png")
    assert "limit of 1,999" in refusal(ImageDecoder(cifar, max_pixels=1999), data)
    assert ImageDecoder(cifar, max_pixels=2000).decode_one(data).shape == (1, 32, 32, 3)
    # below OpenCV's own limit (2^30) but over farm's: refused before OpenCV allocates 1.2 GB
    assert "20000 x 20000" in refusal(ImageDecoder(cifar), png_declaring(20_000, 20_000))


def test_bad_files_fail_alone(tmp_path, cifar):
    good = [
        save(tmp_path, photo(40, 60, seed), f"{seed}.{kind}")
        for seed, kind in enumerate(("jpg", "png", "bmp", "webp"))
    ]
    jpeg = good[0]
    files = [
        good[0],
        jpeg[: len(jpeg) // 2],
        good[1],
        b"hello",
        b"",
        good[2],
        png_declaring(50_000, 50_000),
        good[3],
    ]
    decoder = ImageDecoder(cifar)
    batch = decoder.decode(files)
    assert isinstance(batch, DecodedBatch) and batch.crops == 1
    assert batch.ok.dtype == np.int64
    np.testing.assert_array_equal(batch.ok, [0, 2, 5, 7])
    assert [index for index, _ in batch.failures] == [1, 3, 4, 6]
    reasons = [reason for _, reason in batch.failures]
    assert reasons[0].startswith("truncated JPEG") and reasons[1].startswith("not an image")
    assert reasons[2] == "empty file" and "50000 x 50000" in reasons[3]
    assert batch.images.shape == (4, 32, 32, 3)
    for position, data in enumerate(good):
        np.testing.assert_array_equal(batch.images[position], decoder.decode_one(data)[0])


def test_all_bad_gives_an_empty_batch(lenet):
    batch = ImageDecoder(lenet).decode([b"", b"x"])
    assert batch.images.shape == (0, 1, 28, 28) and batch.ok.shape == (0,)
    assert len(batch.failures) == 2


# --- the wire -----------------------------------------------------------------------------


def test_split_files_round_trip(tmp_path, cifar):
    files = [save(tmp_path, photo(30, 30), "a.png"), b"", save(tmp_path, photo(20, 50), "b.jpg")]
    sizes = np.array([len(f) for f in files], np.uint32)
    blob = memoryview(bytearray(b"".join(files)))
    parts = split_files(sizes, blob)
    assert [bytes(part) for part in parts] == files
    assert all(isinstance(part, memoryview) for part in parts)
    batch = ImageDecoder(cifar).decode(parts)
    np.testing.assert_array_equal(batch.ok, [0, 2])
    assert batch.failures == [(1, "empty file")]
    assert split_files(np.zeros(0, np.uint32), b"") == []


def test_split_files_refuses_sizes_that_do_not_add_up():
    sizes = np.array([3, 4], np.uint32)
    assert [bytes(part) for part in split_files(sizes, b"abcdefg")] == [b"abc", b"defg"]
    with pytest.raises(ValueError, match="add up to 7 bytes, the blob has 8"):
        split_files(sizes, b"abcdefgh")
    with pytest.raises(ValueError, match="add up to 7 bytes, the blob has 6"):
        split_files(sizes, b"abcdef")
    with pytest.raises(ValueError):
        split_files(np.array([-1, 8]), b"abcdefg")


def test_a_thin_strip_is_refused_before_a_huge_resize(cifar):
    """1 x 20 000 pixels pass the pixel limit, but a shorter side of 256 would make
    256 x 5 120 000 of them: refused, alone."""
    strip = cv2.imencode(".png", np.zeros((1, 20_000, 3), np.uint8))[1].tobytes()
    decoder = ImageDecoder(with_resize(cifar, shorter_side=256), max_pixels=10_000_000)
    batch = decoder.decode([strip, cv2.imencode(".png", np.zeros((40, 40, 3), np.uint8))[1]])
    assert batch.ok.tolist() == [1]
    assert "would be resized to 5120000 x 256, over the limit" in batch.failures[0][1]
