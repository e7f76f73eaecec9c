"""Write bench/nets/densenet121/deploy.prototxt: DenseNet-121 as a Caffe deploy net.

The architecture is the paper's (Huang, Liu, van der Maaten, Weinberger, "Densely Connected
Convolutional Networks", CVPR 2017, Table 1: growth rate 32, bottleneck 4 x 32, compression
0.5, dense blocks of 6, 12, 24 and 16 layers).  Layer and blob names, BatchNorm + Scale
pairs, ``eps: 1e-5``, ``ceil_mode: false`` on pool1 and the 1x1-convolution classifier
``fc6`` follow shicai/DenseNet-Caffe's DenseNet_121.prototxt, so that repository's released
weights load by name; that repository states no licence, so its file is not copied: this
script writes the same net in its own layout.

    python scripts/make_densenet121.py
"""

from __future__ import annotations

from pathlib import Path

TARGET = (
    Path(__file__).resolve().parent.parent / "bench" / "nets" / "densenet121" / "deploy.prototxt"
)
GROWTH = 32
BOTTLENECK = 4 * GROWTH
BLOCKS = ((2, 6), (3, 12), (4, 24), (5, 16))  # (stage number in the names, dense layers)


def layer(name: str, kind: str, bottom: str, top: str, params: str = "") -> str:
    """One layer on one line."""
    return (
        f'layer {{ name: "{name}" type: "{kind}" bottom: "{bottom}" top: "{top}"'
        f"{' ' + params if params else ''} }}"
    )


def conv(
    name: str,
    bottom: str,
    outputs: int,
    kernel: int,
    stride: int = 1,
    pad: int = 0,
    bias: bool = False,
) -> str:
    fields = [
        f"num_output: {outputs}",
        *([] if bias else ["bias_term: false"]),
        *([f"pad: {pad}"] if pad else []),
        f"kernel_size: {kernel}",
        *([f"stride: {stride}"] if stride > 1 else []),
    ]
    return layer(name, "Convolution", bottom, name, f"convolution_param {{ {' '.join(fields)} }}")


def bn_relu(prefix: str, relu: str, bottom: str) -> tuple[list[str], str]:
    """BatchNorm, Scale and ReLU (the last two in place); the blob they leave."""
    top = f"{prefix}/bn"
    return [
        layer(top, "BatchNorm", bottom, top, "batch_norm_param { eps: 1e-5 }"),
        layer(f"{prefix}/scale", "Scale", top, top, "scale_param { bias_term: true }"),
        layer(relu, "ReLU", top, top),
    ], top


def dense_layer(stage: int, index: int, bottom: str) -> tuple[list[str], str]:
    """BN-ReLU-Conv(1x1, 4k) then BN-ReLU-Conv(3x3, k), concatenated onto the input."""
    name = f"{stage}_{index}"
    first, blob = bn_relu(f"conv{name}/x1", f"relu{name}/x1", bottom)
    first.append(conv(f"conv{name}/x1", blob, BOTTLENECK, 1))
    second, blob = bn_relu(f"conv{name}/x2", f"relu{name}/x2", f"conv{name}/x1")
    second.append(conv(f"conv{name}/x2", blob, GROWTH, 3, pad=1))
    concat = (
        f'layer {{ name: "concat_{name}" type: "Concat" bottom: "{bottom}" '
        f'bottom: "conv{name}/x2" top: "concat_{name}" }}'
    )
    return [*first, *second, concat], f"concat_{name}"


def prototxt() -> str:
    lines = [
        'name: "DENSENET_121"',
        'input: "data"',
        *(f"input_dim: {d}" for d in (1, 3, 224, 224)),
        conv("conv1", "data", 64, 7, 2, 3),
    ]
    stem, blob = bn_relu("conv1", "relu1", "conv1")
    lines += [
        *stem,
        layer(
            "pool1",
            "Pooling",
            blob,
            "pool1",
            "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 ceil_mode: false }",
        ),
    ]
    blob, channels = "pool1", 64
    for stage, count in BLOCKS:
        for index in range(1, count + 1):
            added, blob = dense_layer(stage, index, blob)
            lines += added
        channels += count * GROWTH
        closing, blob = bn_relu(f"conv{stage}_blk", f"relu{stage}_blk", blob)
        lines += closing
        if stage < BLOCKS[-1][0]:  # transition: 1x1 convolution to half the channels, 2x2 mean
            channels //= 2
            lines += [
                conv(f"conv{stage}_blk", blob, channels, 1),
                layer(
                    f"pool{stage}",
                    "Pooling",
                    f"conv{stage}_blk",
                    f"pool{stage}",
                    "pooling_param { pool: AVE kernel_size: 2 stride: 2 }",
                ),
            ]
            blob = f"pool{stage}"
    lines += [
        layer(
            "pool5", "Pooling", blob, "pool5", "pooling_param { pool: AVE global_pooling: true }"
        ),
        conv("fc6", "pool5", 1000, 1, bias=True),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(prototxt())
    print(f"wrote {TARGET}")


if __name__ == "__main__":
    main()
