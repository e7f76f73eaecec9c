"""Image files through a real farm: folders of JPEG/PNG in, named answers out, each bad file
failing alone with its reason.

The workers decode the files (``farm.engines.images``); these tests compare what comes back with
a direct OpenCV forward of the same files decoded and preprocessed as the documentation
says.  The ImageNet test reads the real SqueezeNet from ``../shared`` (not in the
repository: its weights carry no licence) and skips, saying so, where it is absent.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from farm.benchsuite.common import shared_squeezenet
from farm.client.answers import AnswerSink, ModelCard, top_k
from farm.client.client import Client, split_failures
from farm.client.inputs import FileSource, InputError, find_image_files
from farm.engines.preprocess import Transformer
from farm.modelrepo.repository import find
from farm.ops.local import LocalFarm, farm_command
from farm.wire import messages, protocol
from farm.wire.protocol import Command
from tests.conftest import reference_forward
from tests.frames import reply, reply_after_probe
from tests.unit.test_images import png_declaring

#: The real ImageNet SqueezeNet this workplace shares (see its README).
SQUEEZENET = Path(__file__).resolve().parents[3] / "shared" / "models" / "squeezenet_v1.0"
DIGITS = 300


@pytest.fixture(scope="module")
def digit_folder(tmp_path_factory, digits) -> Path:
    """300 MNIST digits as lossless PNG files in two subfolders, named in input order."""
    folder = tmp_path_factory.mktemp("digits")
    for index, digit in enumerate(digits[:DIGITS]):
        sub = folder / ("a" if index < DIGITS // 2 else "b")
        sub.mkdir(exist_ok=True)
        cv2.imwrite(str(sub / f"{index:04d}.png"), digit)
    return folder


def test_a_folder_of_digits_matches_the_array_job(
    farm_two_workers, digit_folder, lenet, digits
) -> None:
    with Client(farm_two_workers.endpoint) as client:
        result = client.run([digit_folder], "lenet")
    assert not result.failed
    np.testing.assert_allclose(result.outputs, reference_forward(lenet, digits[:DIGITS]), atol=1e-5)


def test_each_bad_file_fails_alone_with_its_reason(
    farm_two_workers, lenet, digits, tmp_path
) -> None:
    good = digits[:6]
    jpeg = cv2.imencode(".jpg", cv2.resize(good[0], (64, 64)))[1].tobytes()
    colour = np.repeat(good[3][..., None], 3, axis=2)
    files = {
        "00_good.png": cv2.imencode(".png", good[0])[1].tobytes(),
        "01_truncated.jpg": jpeg[: len(jpeg) // 2],
        "02_not_an_image.png": b"just some text, not pixels\n",
        "03_empty.jpg": b"",
        "04_bomb.png": png_declaring(50_000, 50_000),
        "05_sixteen_bit.png": cv2.imencode(".png", good[1].astype(np.uint16) * 257)[1].tobytes(),
        "06_cmyk.jpg": b"",  # written below with Pillow
        "07_colour_for_a_grey_net.png": cv2.imencode(".png", colour)[1].tobytes(),
        "08_good.bmp": cv2.imencode(".bmp", good[4])[1].tobytes(),
        "09_good.webp": cv2.imencode(".webp", good[5], [cv2.IMWRITE_WEBP_QUALITY, 101])[
            1
        ].tobytes(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    Image.fromarray(good[2]).convert("CMYK").save(tmp_path / "06_cmyk.jpg", "JPEG", quality=100)

    with Client(farm_two_workers.endpoint) as client:
        result = client.run([tmp_path], "lenet")

    reasons = {failure.start: failure.error for failure in result.failed}
    assert all(failure.count == 1 for failure in result.failed)
    assert sorted(reasons) == [1, 2, 3, 4], reasons
    assert "truncated JPEG" in reasons[1]
    assert "not an image file" in reasons[2]
    assert reasons[3] == "empty file"
    assert "50000 x 50000" in reasons[4] and "limit" in reasons[4]
    assert np.isnan(result.outputs[1:5]).all()
    expected = reference_forward(lenet, good)
    for row, digit in [(0, 0), (5, 1), (7, 3), (8, 4), (9, 5)]:  # exact pixels: exact outputs
        np.testing.assert_allclose(result.outputs[row], expected[digit], atol=1e-5)
    cmyk = cv2.imread(str(tmp_path / "06_cmyk.jpg"), cv2.IMREAD_GRAYSCALE)
    assert np.abs(cmyk.astype(int) - good[2]).mean() < 8, "CMYK decodes to the picture"
    np.testing.assert_allclose(
        result.outputs[6], reference_forward(lenet, cmyk[None])[0], atol=1e-5
    )


def submit_on_the_terminal(local: LocalFarm, *images: Path) -> subprocess.CompletedProcess:
    """``farm submit IMAGES --model lenet``, answers on the terminal."""
    return subprocess.run(
        farm_command(
            "submit", *map(str, images), "--model", "lenet", "--broker", local.endpoint, "--quiet"
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def failure_lines(stderr: str) -> list[str]:
    """The failure list's lines (``  path: reason``) under "N images failed:"."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("failed:"))
    return [line.strip() for line in lines[start + 1 :] if line.startswith("  ")]


def test_a_folder_names_every_file_it_holds(farm_two_workers, lenet, digits, tmp_path) -> None:
    """A folder's broken links and unsupported images fail, each named once with its reason;
    a GIF runs; its other files are skipped and counted; the rest of the job is unharmed."""
    folder = tmp_path / "photos"
    folder.mkdir()
    cv2.imwrite(str(folder / "a_good.png"), digits[0])
    Image.fromarray(digits[1]).save(folder / "b_digit.gif")  # grey palette: exact pixels
    (folder / "c_dangling.jpg").symlink_to("gone.jpg")
    (folder / "d_loop.jpg").symlink_to("d_loop.jpg")
    (folder / "e_phone.heic").write_bytes(b"\0\0\0\x18ftypheic")
    (folder / "notes.txt").write_text("not an image\n")

    done = submit_on_the_terminal(farm_two_workers, folder)

    assert done.returncode == 1, done.stderr
    assert f"{folder}: skipped 1 file that is not an image (.txt)" in done.stderr
    assert "Traceback" not in done.stderr
    top = reference_forward(lenet, digits[:2]).argmax(axis=1)
    answers = dict(
        line.split(": ", 1) for line in done.stdout.splitlines() if line.startswith(str(folder))
    )
    assert list(answers) == [
        str(folder / name)
        for name in ("a_good.png", "b_digit.gif", "c_dangling.jpg", "d_loop.jpg", "e_phone.heic")
    ]
    for name, digit in [("a_good.png", 0), ("b_digit.gif", 1)]:
        assert answers[str(folder / name)].startswith(f"{lenet.labels[top[digit]]} ")
    reasons = {
        "c_dangling.jpg": "dangling symbolic link to gone.jpg",
        "d_loop.jpg": "symbolic link loop",
        "e_phone.heic": "unsupported format: HEIC (the workers decode JPEG, PNG, "
        "BMP, TIFF, WebP, GIF and PNM)",
    }
    assert "3 images failed:" in done.stderr
    assert failure_lines(done.stderr) == [
        f"{folder / name}: {reason}" for name, reason in reasons.items()
    ]
    for name, reason in reasons.items():
        assert answers[str(folder / name)] == f"FAILED: {reason}"


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="root reads any file, whatever its permissions: no file is unreadable to this test",
)
def test_an_unreadable_file_fails_alone(farm_two_workers, lenet, digits, tmp_path) -> None:
    for index in range(3):
        cv2.imwrite(str(tmp_path / f"{index}.png"), digits[index])
    (tmp_path / "1.png").chmod(0)
    done = submit_on_the_terminal(farm_two_workers, tmp_path)
    assert done.returncode == 1, done.stderr
    assert failure_lines(done.stderr) == [f"{tmp_path / '1.png'}: permission denied"]
    top = reference_forward(lenet, digits[:3]).argmax(axis=1)
    for index in (0, 2):
        assert f"{tmp_path / f'{index}.png'}: {lenet.labels[top[index]]} " in done.stdout


def test_a_symlink_loop_on_the_command_line_fails_that_input(
    farm_two_workers, lenet, digits, tmp_path
) -> None:
    loop, good = tmp_path / "loop.jpg", tmp_path / "good.png"
    loop.symlink_to(loop.name)
    cv2.imwrite(str(good), digits[0])
    done = submit_on_the_terminal(farm_two_workers, loop, good)
    assert done.returncode == 1, done.stderr
    assert failure_lines(done.stderr) == [f"{loop}: symbolic link loop"]
    top = reference_forward(lenet, digits[:1]).argmax(axis=1)
    assert f"{good}: {lenet.labels[top[0]]} " in done.stdout
    alone = submit_on_the_terminal(farm_two_workers, loop)  # nothing left to run: refused
    assert alone.returncode == 1
    assert alone.stderr.strip() == f"Error: {loop}: symbolic link loop"


def test_a_grey_file_for_a_colour_net_is_replicated(farm_two_workers, tmp_path) -> None:
    spec = find("cifar10_quick")
    grey = np.random.default_rng(1).integers(0, 256, (32, 32), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "grey.png"), grey)
    with Client(farm_two_workers.endpoint) as client:
        outputs = client.map([tmp_path / "grey.png"], "cifar10_quick")
    colour = np.repeat(grey[None, ..., None], 3, axis=3)  # 1 x H x W x 3, as a client sends
    net = cv2.dnn.readNetFromCaffe(str(spec.prototxt), str(spec.weights))
    net.setInput(Transformer.for_model(spec)(colour))
    np.testing.assert_allclose(
        outputs, net.forward(spec.output).reshape(outputs.shape), rtol=1e-4, atol=1e-5
    )


def test_answers_are_written_in_input_order_as_csv_and_jsonl(
    farm_two_workers, digit_folder, lenet, digits, tmp_path
) -> None:
    """``farm submit FOLDER --out answers.csv``: a row per file, in order, named."""
    expected = reference_forward(lenet, digits[:DIGITS]).argmax(axis=1)
    for suffix in ("csv", "jsonl"):
        out = tmp_path / f"answers.{suffix}"
        done = subprocess.run(
            farm_command(
                "submit",
                str(digit_folder),
                "--model",
                "lenet",
                "--top-k",
                "3",
                "--out",
                str(out),
                "--broker",
                farm_two_workers.endpoint,
                "--quiet",
            ),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert f"answers for {DIGITS} images written to {out}" in done.stdout
        if suffix == "csv":
            rows = list(csv.DictReader(out.open()))
            paths, top = [row["path"] for row in rows], [int(row["id_1"]) for row in rows]
            assert rows[0]["name_1"] == lenet.labels[top[0]] and rows[0]["error"] == ""
        else:
            lines = [json.loads(line) for line in out.read_text().splitlines()]
            paths, top = [line["path"] for line in lines], [line["top"][0]["id"] for line in lines]
            assert len(lines[0]["top"]) == 3
        assert paths == [str(path) for path in find_image_files([str(digit_folder)])]
        assert top == expected.tolist()


def test_labels_come_from_the_broker_when_the_client_lacks_the_model(
    tmp_path, digit_folder, lenet, digits, local_farm
) -> None:
    """A model only the broker has (a copy of LeNet, renamed): the workers fetch it, the
    client asks the broker for its labels."""
    import shutil

    models = tmp_path / "models"
    shutil.copytree(find("lenet").folder, models / "digits")
    toml = models / "digits" / "model.toml"
    names = [f"digit {n}" for n in range(10)]
    toml.write_text(
        "\n".join(
            f"labels = {json.dumps(names)}" if line.startswith("labels") else line
            for line in toml.read_text().splitlines()
        )
    )
    local = local_farm(1, models_dir=models)
    done = subprocess.run(
        farm_command(
            "submit",
            str(digit_folder / "a" / "0001.png"),
            "--model",
            "digits",
            "--top-k",
            "2",
            "--broker",
            local.endpoint,
            "--quiet",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    digit = int(reference_forward(lenet, digits[1:2]).argmax())
    assert f"0001.png: digit {digit} 100.0%; " in done.stdout, done.stdout


def test_image_files_resume_after_an_interrupted_job(
    farm_two_workers, digit_folder, lenet, digits, tmp_path
) -> None:
    out = tmp_path / "scores.npy"
    with Client(farm_two_workers.endpoint) as client:
        done = [0]

        def progress(count: int) -> None:
            done[0] += count
            if done[0] >= DIGITS // 3:
                client.cancel()

        first = client.run([digit_folder], "lenet", resume=out, progress=progress)
        assert first.cancelled and first.failed
        second = client.run([digit_folder], "lenet", resume=out)
    assert 0 < second.resumed < DIGITS and not second.failed
    assert second.summary.total == DIGITS - second.resumed, "only the missing files ran"
    np.testing.assert_allclose(np.load(out), reference_forward(lenet, digits[:DIGITS]), atol=1e-5)


def test_a_files_frame_that_lies_about_its_sizes_fails_only_its_job(
    farm_two_workers, raw_socket, lenet, digits
) -> None:
    raw_socket.send_multipart(
        protocol.encode(
            Command.SUBMIT,
            messages.Submit(
                job="liar",
                model="lenet",
                dtype=protocol.ENCODED,
                item_shape=(100,),
                total=2,
                options=messages.Options(),
            ),
        )
    )
    need = reply_after_probe(raw_socket, [np.array([10], np.uint32).tobytes(), bytes(10)])
    assert need.command is Command.NEED
    sizes = np.array([10, 10], np.uint32)
    raw_socket.send_multipart(
        protocol.encode(
            Command.DATA,
            messages.Data(job="liar", chunk=need.header.chunk, start=0, count=2),
            [sizes.tobytes(), b"\0" * 19],
        )
    )
    message = reply(raw_socket)
    assert message.command is Command.ERROR and message.header.job == "liar"
    assert "add up to 20 bytes, the frame has 19" in message.header.error
    with Client(farm_two_workers.endpoint) as client:
        np.testing.assert_allclose(
            client.map(digits[:50], "lenet"), reference_forward(lenet, digits[:50]), atol=1e-5
        )


# ----------------------------------------------------------------------- ImageNet, real


def squeezenet_folder(root: Path) -> Path:
    """A model folder for the shared SqueezeNet (copied: model files lie in their folder)."""
    if not (SQUEEZENET / "squeezenet_v1.0.caffemodel").is_file():
        pytest.skip(
            f"the real SqueezeNet is not at {SQUEEZENET} (this workplace's shared "
            f"models); its weights are not in the repository"
        )
    return shared_squeezenet(root, SQUEEZENET, resize=True)


def opencv_reference(spec, path: Path) -> np.ndarray:
    """The documented preprocessing by hand, then OpenCV's own Caffe importer: probabilities."""
    image = cv2.imread(str(path), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    height, width = image.shape[:2]
    scale = 256 / min(height, width)  # the shorter side to 256, the other rounded half up
    image = cv2.resize(
        image, (int(width * scale + 0.5), int(height * scale + 0.5)), interpolation=cv2.INTER_LINEAR
    )
    top, left = (image.shape[0] - 227) // 2, (image.shape[1] - 227) // 2
    crop = image[top : top + 227, left : left + 227].astype(np.float32)  # BGR, as the net wants
    blob = (crop - np.array([104.0, 117.0, 123.0], np.float32)).transpose(2, 0, 1)[None]
    net = cv2.dnn.readNetFromCaffe(str(spec.prototxt), str(spec.weights))
    net.setInput(np.ascontiguousarray(blob))
    scores = net.forward(spec.output).reshape(-1).astype(np.float64)
    probabilities = np.exp(scores - scores.max())
    return probabilities / probabilities.sum()


def test_photos_are_named_right_and_match_a_direct_opencv_forward(tmp_path) -> None:
    """``farm run photos/ --model squeezenet_v1.0 --top-k 5 --out answers.csv``."""
    import skimage.data

    models = tmp_path / "models"
    spec_folder = squeezenet_folder(models)
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.fromarray(skimage.data.chelsea()).save(photos / "cat.jpg", quality=90)
    Image.fromarray(skimage.data.coffee()).save(photos / "coffee.jpg", quality=90)
    out = tmp_path / "answers.csv"
    done = subprocess.run(
        farm_command(
            "run",
            str(photos),
            "--model",
            "squeezenet_v1.0",
            "--models-dir",
            str(models),
            "--top-k",
            "5",
            "--out",
            str(out),
            "--quiet",
            "--workers",
            "2",
            "--backend",
            "opencv",
        ),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = {Path(row["path"]).name: row for row in csv.DictReader(out.open())}
    assert rows["cat.jpg"]["name_1"] in ("Egyptian cat", "tabby, tabby cat", "tiger cat")
    assert rows["coffee.jpg"]["name_1"] in ("espresso", "cup", "coffee mug")
    spec = find("squeezenet_v1.0", [str(models)])
    assert spec.folder == spec_folder and len(spec.labels) == 1000
    for name, row in rows.items():
        reference = opencv_reference(spec, photos / name)
        ids = [int(row[f"id_{rank}"]) for rank in range(1, 6)]
        assert ids == list(np.argsort(-reference)[:5])
        np.testing.assert_allclose(
            [float(row[f"probability_{rank}"]) for rank in range(1, 6)], reference[ids], rtol=1e-4
        )


# ------------------------------------------------------------------------ no farm


def test_files_folders_globs_and_lists_are_found_in_order(tmp_path) -> None:
    for name in ("b/2.png", "a/1.JPG", "a/0.jpeg", "c.dat", "skip.npy"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "list.txt").write_text("b/2.png 7\n# a comment\n\na/1.JPG\n")
    found = find_image_files(
        [
            str(tmp_path / "a"),
            str(tmp_path / "b" / "*.png"),
            str(tmp_path / "list.txt"),
            str(tmp_path / "c.dat"),
        ]
    )
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "a/0.jpeg",
        "a/1.JPG",
        "b/2.png",
        "b/2.png",
        "a/1.JPG",
        "c.dat",
    ]
    for missing, reason in [("nowhere", "no such file"), ("*.gif", "matches no files")]:
        with pytest.raises(InputError, match=reason):
            find_image_files([str(tmp_path / missing)])
    source = FileSource(found)
    assert source.item_shape == (1,) and len(source) == 6


def test_every_path_a_folder_or_glob_yields_is_an_input_or_told_of(tmp_path) -> None:
    from farm.client.inputs import find_inputs

    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for name in ("b.png", "sub/c.jpg", "notes.txt", ".DS_Store", "sub/meta.json", "LICENSE"):
        (folder / name).write_bytes(b"x")
    (folder / "a_loop").symlink_to("a_loop")
    (folder / "d.jpg").symlink_to(tmp_path / "gone" / "d.jpg")
    (folder / "linked").symlink_to("sub")
    os.mkfifo(folder / "pipe")
    found = find_inputs([str(folder)])
    assert [p.relative_to(folder).as_posix() for p in found.paths] == [
        "a_loop",
        "b.png",
        "d.jpg",
        "sub/c.jpg",
    ]
    assert found.refused == {
        0: "symbolic link loop",
        2: f"dangling symbolic link to {tmp_path / 'gone' / 'd.jpg'}",
    }
    assert found.notices == [
        f"{folder}: skipped 5 files that are not images (.DS_Store, "
        f".json, .txt, no suffix, special files) and 1 link to a folder "
        f"(not followed)"
    ]
    matched = find_inputs([str(folder / "*")])
    assert [p.name for p in matched.paths] == ["LICENSE", "a_loop", "b.png", "d.jpg", "notes.txt"]
    assert matched.refused == {1: "symbolic link loop", 3: found.refused[2]}
    assert matched.notices == [
        f"{folder / '*'}: skipped the 2 folders it matches (give a "
        f"folder itself to run the images under it)"
    ]
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "README.txt").write_text("x")
    with pytest.raises(InputError, match="texts: no image files .* under this folder"):
        find_inputs([str(tmp_path / "texts")])
    with pytest.raises(InputError, match="none of the 2 files can be read .*a_loop: symbolic"):
        find_inputs([str(folder / "a_loop"), str(folder / "d.jpg")])


def test_answers_wait_for_earlier_rows_and_name_failures() -> None:
    class Rows:
        def __init__(self) -> None:
            self.rows: list = []

        def row(self, answer) -> None:
            self.rows.append(answer)

        def close(self) -> None:
            pass

    rows = Rows()
    sink = AnswerSink(
        2, ModelCard(("a", "b", "c")), rows, lambda s, n: [f"f{i}" for i in range(s, s + n)]
    )
    sink.write(2, np.array([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]], np.float32))
    assert rows.rows == [], "rows wait for the files before them"
    sink.fail(0, 2, "broken")
    sink.write(4, np.array([[0.0, 0.0, 9.0]], np.float32))
    assert [answer.name for answer in rows.rows] == ["f0", "f1", "f2", "f3", "f4"]
    assert rows.rows[1].error == "broken" and rows.rows[2].ids == (1, 2)
    ids, probabilities = top_k(np.array([[1.0, 3.0, 2.0]]), 2, softmax=True)
    assert ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(probabilities[0], np.exp([3.0, 2.0]) / np.exp([1, 2, 3]).sum())


def test_split_failures_cuts_a_chunk_into_good_and_failed_runs() -> None:
    assert split_failures(0, 6, [(1, 2, "x"), (4, 1, "y")]) == [
        (0, 1, None),
        (1, 3, "x"),
        (3, 4, None),
        (4, 5, "y"),
        (5, 6, None),
    ]
    assert split_failures(2, 2, [(0, 3, "x")]) == [(2, 3, "x"), (3, 4, None)]


def test_oversampled_files_answer_the_mean_of_ten_crops(tmp_path, local_farm) -> None:
    """``crop = "oversample"``: each file runs as Caffe's 10 crops (corners and centre, and
    their mirrors), and its output is their mean."""
    import shutil

    models = tmp_path / "models"
    shutil.copytree(find("cifar10_quick").folder, models / "cifar10_ten")
    toml = models / "cifar10_ten" / "model.toml"
    toml.write_text(toml.read_text() + '\n[resize]\nsize = [40, 44]\ncrop = "oversample"\n')
    spec = find("cifar10_ten", [str(models)])
    rng = np.random.default_rng(3)
    pictures = [rng.integers(0, 256, (50, 60, 3), dtype=np.uint8) for _ in range(3)]
    for index, picture in enumerate(pictures):
        cv2.imwrite(str(tmp_path / f"{index}.png"), picture)
    with Client(local_farm(1, models_dir=models).endpoint) as client:
        outputs = client.map([tmp_path / f"{index}.png" for index in range(3)], "cifar10_ten")
    net = cv2.dnn.readNetFromCaffe(str(spec.prototxt), str(spec.weights))
    for picture, output in zip(pictures, outputs):
        rgb = cv2.resize(picture, (44, 40), interpolation=cv2.INTER_LINEAR)[..., ::-1]
        crops = [
            rgb[top : top + 32, left : left + 32]
            for top in (0, 4, 8)
            for left in (0, 6, 12)
            if (top, left) in {(0, 0), (0, 12), (8, 0), (8, 12), (4, 6)}
        ]
        crops += [crop[:, ::-1] for crop in crops]
        net.setInput(Transformer.for_model(spec)(np.stack(crops)))
        expected = net.forward(spec.output).reshape(10, -1).mean(axis=0)
        np.testing.assert_allclose(output.reshape(-1), expected, rtol=1e-4, atol=1e-5)


def test_model_settings_that_image_files_cannot_meet_are_refused_when_loaded(tmp_path) -> None:
    import shutil

    from farm.modelrepo.repository import ModelError, load_spec

    for extra, reason in [
        ('[resize]\nshorter_side = 40\ncrop = "none"\n', 'crop = "none"'),
        ("", "labels name 3 classes, the output 'prob' has 10 values"),
    ]:
        folder = tmp_path / f"model{len(extra)}"
        shutil.copytree(find("lenet").folder, folder)
        toml = folder / "model.toml"
        lines = [
            'labels = ["a", "b", "c"]' if line.startswith("labels") and not extra else line
            for line in toml.read_text().splitlines()
        ]
        toml.write_text("\n".join(lines) + "\n" + extra)
        with pytest.raises(ModelError, match=reason):
            load_spec(folder)


def test_a_chunk_of_image_files_is_capped_by_its_decoded_size() -> None:
    from farm.broker.jobs import Job

    job = Job("j", b"c", "m", protocol.ENCODED, (1,), 10**6, 0.0)  # 1-byte files, said a client
    job.decoded_bytes = 227 * 227 * 3 * 10  # SqueezeNet's input, oversampled
    assert job.max_chunk == protocol.MAX_TASK_BYTES // job.decoded_bytes == 43


def test_one_path_is_one_input_and_arrays_do_not_mix_with_files(tmp_path, digits) -> None:
    from farm.client.client import as_source
    from farm.client.inputs import ArraySource, open_input

    cv2.imwrite(str(tmp_path / "0.png"), digits[0])
    np.save(tmp_path / "a.npy", digits[:3])
    assert len(as_source(str(tmp_path))) == 1 and len(as_source(tmp_path / "0.png")) == 1
    assert isinstance(as_source(str(tmp_path / "a.npy")), ArraySource)
    with pytest.raises(InputError, match="a .npy array is a job of its own"):
        open_input([str(tmp_path / "a.npy"), str(tmp_path / "0.png")])
