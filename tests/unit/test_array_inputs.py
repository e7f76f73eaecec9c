"""Arrays as a job's input: layouts against the model (``farm.wire.shapes``), integer dtypes
(``farm.client.inputs``), lists of arrays, and ``--top-k`` within a model's classes."""

from __future__ import annotations

import numpy as np
import pytest

from farm.client.answers import ModelCard
from farm.client.inputs import ArraySource, InputError, stacked
from farm.client.npy import NpyReader
from farm.wire.shapes import ENCODED, fitted_shape, input_mismatch

GREY_HWC, GREY_CHW = (32, 48, 1), (1, 32, 48)
COLOUR_HWC, COLOUR_CHW = (32, 48, 3), (3, 32, 48)


# --- layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_shape", "layout"), [(GREY_HWC, "HWC"), (GREY_CHW, "CHW")], ids=["HWC", "CHW"]
)
@pytest.mark.parametrize("item_shape", [(1, 32, 48), (32, 48, 1)], ids=["1xHxW", "HxWx1"])
def test_a_grey_model_takes_one_channel_on_either_side(model_shape, layout, item_shape):
    """An N x H x W array arrives as N x 1 x H x W: a 1-channel model of either layout
    takes it (the bytes are the same), and the job is given the model's own shape."""
    assert input_mismatch("gray", model_shape, layout, "uint8", item_shape) is None
    assert fitted_shape(model_shape, layout, item_shape) == model_shape


def test_hwc_images_for_a_chw_model_are_told_the_transpose():
    problem = input_mismatch("cifar", COLOUR_CHW, "CHW", "uint8", COLOUR_HWC)
    assert problem == (
        "images of shape (32, 48, 3) do not match model 'cifar', which takes (3, 32, 48) "
        "(C x H x W); these look H x W x C: pass images.transpose(0, 3, 1, 2) "
        "(N x H x W x C -> N x C x H x W)"
    )


def test_chw_images_for_an_hwc_model_are_told_the_transpose():
    problem = input_mismatch("cifar", COLOUR_HWC, "HWC", "float32", COLOUR_CHW)
    assert problem is not None
    assert "which takes (32, 48, 3) (H x W x C)" in problem
    assert "pass images.transpose(0, 2, 3, 1) (N x C x H x W -> N x H x W x C)" in problem


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_grey_images_for_a_colour_model_say_so(layout):
    model_shape = COLOUR_HWC if layout == "HWC" else COLOUR_CHW
    problem = input_mismatch("cifar", model_shape, layout, "uint8", (1, 32, 48))
    assert problem is not None and problem.endswith(
        "these are 1-channel (grey) images and the model takes 3 channels"
    )


def test_other_shapes_name_the_layout_without_a_hint():
    problem = input_mismatch("lenet", (1, 28, 28), "CHW", "uint8", (1, 28, 29))
    assert problem == (
        "images of shape (1, 28, 29) do not match model 'lenet', which takes (1, 28, 28) "
        "(C x H x W)"
    )
    assert fitted_shape((1, 28, 28), "CHW", (3, 28, 28)) is None


def test_image_files_still_need_one_or_three_channels():
    assert input_mismatch("m", (28, 28, 1), "HWC", ENCODED, (100,)) is None
    assert "takes 4 channels" in str(input_mismatch("m", (4, 8, 8), "CHW", ENCODED, (100,)))


def test_an_array_of_two_dimensions_names_every_layout():
    with pytest.raises(InputError, match=r"N x C x H x W, N x H x W x C .* or N x H x W"):
        ArraySource(np.zeros((4, 28), np.uint8))


# --- integer dtypes ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "int16", "int32", ">i4", "int64", "int8"])
def test_integers_within_0_255_travel_as_uint8_unchanged(dtype):
    images = np.arange(2 * 28 * 28).reshape(2, 28, 28) % 128
    source = ArraySource(images.astype(dtype))
    assert source.dtype == "uint8"
    np.testing.assert_array_equal(source.read(0, 2)[:, 0], images)
    named = "big-endian int32 (>i4)" if dtype == ">i4" else dtype
    assert source.notices == [
        f"the array: {named} values all within 0..255: sent as uint8 pixels, unchanged"
    ]


def test_sixteen_bit_pixels_are_refused_with_the_division(tmp_path):
    path = tmp_path / "images.npy"
    np.save(path, (np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256 * 257).astype(np.uint16))
    with pytest.raises(InputError) as caught:
        ArraySource(NpyReader.open(path))
    assert str(caught.value) == (
        f"{path} is uint16 with values up to 65,535; integer images are pixels and the "
        f"model takes 0..255: for 16-bit pixels divide by 257 "
        f"(np.round(images / 257).astype(np.uint8)), or, if the model takes these values "
        f"as they are, save them as float32 (images.astype(np.float32)); nothing was "
        f"submitted"
    )


def test_negative_and_wide_integers_are_refused_with_their_range():
    images = np.zeros((2, 8, 8), np.int32)
    images[1, 3, 3], images[0, 0, 0] = 70_000, -4
    with pytest.raises(InputError, match=r"int32 with values from -4 to 70,000; .*scale them"):
        ArraySource(images)


def test_floats_are_still_converted_to_float32():
    source = ArraySource(np.full((2, 8, 8), 1000.5))
    assert source.dtype == "float32"
    assert source.notices == ["the array: float64 converted to float32 on the client"]


# --- a list of arrays -------------------------------------------------------------------


def test_a_list_of_arrays_is_stacked():
    images = [np.full((28, 28), n, np.uint8) for n in range(3)]
    np.testing.assert_array_equal(stacked(images)[:, 0, 0], [0, 1, 2])


def test_a_list_of_arrays_names_the_first_that_differs():
    images = [np.zeros((28, 28), np.uint8)] * 2 + [np.zeros((28, 29), np.uint8)] * 2
    with pytest.raises(InputError, match=r"images\[2\] is uint8 \(28, 29\), images\[0\] uint8"):
        stacked(images)
    with pytest.raises(InputError, match=r"images\[1\] is float32 \(28, 28\)"):
        stacked([np.zeros((28, 28), np.uint8), np.zeros((28, 28), np.float32)])
    with pytest.raises(InputError, match=r"images\[1\] is a str.*not both"):
        stacked([np.zeros((28, 28), np.uint8), "a.jpg"])
    with pytest.raises(InputError, match=r"images\[0\] has shape \(5, 1, 28, 28\).*concatenate"):
        stacked([np.zeros((5, 1, 28, 28), np.uint8)])


# --- top-k ------------------------------------------------------------------------------


def test_top_k_is_cut_to_the_model_classes_with_a_notice():
    card = ModelCard(tuple(str(n) for n in range(10)))
    assert card.top_k(5) == (5, None)
    assert card.top_k(10) == (10, None)
    assert card.top_k(5000) == (
        10,
        "--top-k 5000: the model has 10 classes; each answer lists them all",
    )
    assert ModelCard().top_k(5000) == (5000, None)  # no labels: the classes are not known
