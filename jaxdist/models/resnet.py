"""ResNet-18 and ResNet-50 (He et al. 2016) in flax NNX, with SyncBatchNorm, naming its dimensions only.

torchvision's layouts: 18 is basic blocks (two 3x3 convolutions) [2, 2, 2, 2], 50 is bottleneck
blocks (1x1, 3x3, 1x1 at four times the width) [3, 4, 6, 3], the 3x3 carrying a stage's stride 2
("v1.5"); a projection (1x1 convolution + BatchNorm) where a block changes shape. Stage s has
`width x 2^s` channels (x4 out of a bottleneck). Stems: `imagenet` (7x7 stride 2 + 3x3 stride-2
max-pool, for 224x224 images) or `small` (one 3x3 stride-1 convolution, no pool, for 32x32 and
smaller). Convolutions have no bias and pad k // 2 on each side; global average pooling feeds a
linear layer. At width 64, 1000 classes and 224x224x3 images the parameter counts are the
published 11,689,512 and 25,557,032.

Kernels are (`kernel_h`, `kernel_w`, `conv_in`, `conv_out`); BatchNorm's scale, offset and running
statistics are (`conv_out`,); feature maps are (`batch`, `height`, `width`, `channels`). The blocks
differ in shape from stage to stage, so they are no layer stack for a pipeline.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import Field

from jaxdist.config import MODEL_NAME, ClassCount, ClassifierSection, Config, ImageShape, ParamSize
from jaxdist.models import classifier
from jaxdist.models.batchnorm import BatchNorm
from jaxdist.models.registry import register
from jaxdist.parallel.rules import constrain

class ResNetConfig(ClassifierSection):
    """The `model:` section of a residual convolutional network with BatchNorm (`model.name=resnet`;
    He et al. 2016)."""

    name: Literal["resnet"] = Field("resnet", description=MODEL_NAME)
    classes: ClassCount = "auto"
    image_shape: ImageShape = "auto"
    depth: Literal[18, 50] = Field(
        18, description="18: basic blocks [2, 2, 2, 2]; 50: bottleneck blocks [3, 4, 6, 3]")
    width: int = Field(64, gt=0, description="channels of the first stage (doubled at each later stage; 64 published)")
    stem: Literal["imagenet", "small"] = Field(
        "imagenet", description="imagenet: 7x7 stride-2 conv + 3x3 max-pool; small: one 3x3 stride-1 conv (small images)")
    bn_momentum: float = Field(0.9, gt=0, lt=1, description="decay of BatchNorm's running averages per update")

    def param_sizes(self) -> list[ParamSize]:
        # Stage 3 has width x 8 channels, x 4 out of ResNet-50's bottleneck blocks: the head's inputs.
        last = self.width * 8 * (4 if self.depth == 50 else 1)
        sizes = [
            ParamSize("conv_out", "model.width", self.width, self.width,
                      "the output channels of every convolution (each a multiple of model.width)"),
            ParamSize("embed", "model.width", self.width, last,
                      f"the head's inputs, the last stage's channels model.width x {last // self.width}"),
        ]
        if self.classes != "auto":
            sizes.append(ParamSize("classes", "model.classes", self.classes, self.classes, "the head's outputs"))
        return sizes

    def summary(self) -> dict[str, Any]:
        return {"depth": self.depth, "width": self.width, "stem": self.stem}


FEATURE_MAP = ("batch", "height", "width", "channels")
KERNEL = ("kernel_h", "kernel_w", "conv_in", "conv_out")
# Block kind and blocks per stage, by depth.
LAYOUTS = {18: ("basic", (2, 2, 2, 2)), 50: ("bottleneck", (3, 4, 6, 3))}
# torchvision's init: normal with variance 2 / (kernel area x output channels).
_he_fan_out = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def _out_size(size: int, kernel: int, stride: int) -> int:
    """A spatial size after a window of `kernel` with padding kernel // 2 on each side and `stride`."""
    return (size + 2 * (kernel // 2) - kernel) // stride + 1


class ConvNorm(nnx.Module):
    """A bias-free convolution and its BatchNorm (with `relu`, the ReLU after it too)."""

    def __init__(self, features_in: int, features_out: int, kernel: int, stride: int, cfg: ResNetConfig, *,
                 rngs: nnx.Rngs, param_dtype, compute_dtype):
        pad = kernel // 2
        self.conv = nnx.Conv(
            features_in, features_out, (kernel, kernel), strides=stride, padding=((pad, pad), (pad, pad)),
            use_bias=False, kernel_init=_he_fan_out, kernel_metadata={"out_sharding": KERNEL},
            dtype=compute_dtype, param_dtype=param_dtype, rngs=rngs,
        )
        self.norm = BatchNorm(features_out, ("conv_out",), momentum=cfg.bn_momentum, param_dtype=param_dtype)
        self.kernel, self.stride, self.features_out = kernel, stride, features_out

    def __call__(self, x: jax.Array, relu: bool = False) -> jax.Array:
        return constrain(self.norm(constrain(self.conv(x), FEATURE_MAP), relu=relu), FEATURE_MAP)

    def macs(self, height: int, width: int) -> tuple[int, int, int]:
        """(multiply-adds for one image of height x width, output height, output width)."""
        height, width = _out_size(height, self.kernel, self.stride), _out_size(width, self.kernel, self.stride)
        features_in = self.conv.kernel.shape[2]
        return height * width * self.kernel**2 * features_in * self.features_out, height, width


def _chain_macs(layers, height: int, width: int) -> tuple[int, int, int]:
    total = 0
    for layer in layers:
        macs, height, width = layer.macs(height, width)
        total += macs
    return total, height, width


class Block(nnx.Module):
    """A residual block: relu(convs(x) + shortcut(x)), the convs relu'd between them.

    basic: 3x3 (stride) -> 3x3, `features` out; bottleneck: 1x1 -> 3x3 (stride) -> 1x1 to 4 x
    `features` out. The shortcut is the identity, or a strided 1x1 ConvNorm where the shape changes.
    """

    def __init__(self, kind: str, features_in: int, features: int, stride: int, cfg: ResNetConfig, **kwargs):
        if kind == "basic":
            plan = [(features_in, features, 3, stride), (features, features, 3, 1)]
        else:
            plan = [(features_in, features, 1, 1), (features, features, 3, stride), (features, 4 * features, 1, 1)]
        self.convs = nnx.List([ConvNorm(*sizes, cfg, **kwargs) for sizes in plan])
        features_out = plan[-1][1]
        self.shortcut = (ConvNorm(features_in, features_out, 1, stride, cfg, **kwargs)
                         if stride != 1 or features_in != features_out else None)
        self.features_out = features_out

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x
        for i, conv in enumerate(self.convs):
            y = conv(y, relu=i < len(self.convs) - 1)
        return jax.nn.relu(y + (x if self.shortcut is None else self.shortcut(x)))

    def macs(self, height: int, width: int) -> tuple[int, int, int]:
        total, out_height, out_width = _chain_macs(self.convs, height, width)
        if self.shortcut is not None:
            total += self.shortcut.macs(height, width)[0]
        return total, out_height, out_width


class ResNet(nnx.Module):
    """`__call__(images [B, H, W, C])` gives logits [B, classes] in the compute dtype."""

    def __init__(self, cfg: ResNetConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, compute_dtype=jnp.float32):
        classes, image_shape = classifier.sizes(cfg)
        kwargs = {"rngs": rngs, "param_dtype": param_dtype, "compute_dtype": compute_dtype}
        self.compute_dtype = compute_dtype
        self.image_shape = image_shape
        self.pool = cfg.stem == "imagenet"
        self.stem = ConvNorm(image_shape[2], cfg.width, 7 if self.pool else 3, 2 if self.pool else 1, cfg, **kwargs)
        kind, counts = LAYOUTS[cfg.depth]
        blocks, features = [], cfg.width
        for stage, count in enumerate(counts):
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(Block(kind, features, cfg.width * 2**stage, stride, cfg, **kwargs))
                features = blocks[-1].features_out
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(features, classes, kernel_metadata={"out_sharding": ("embed", "classes")},
                               bias_metadata={"out_sharding": ("classes",)}, dtype=compute_dtype,
                               param_dtype=param_dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.stem(constrain(images.astype(self.compute_dtype), FEATURE_MAP), relu=True)
        if self.pool:
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for block in self.blocks:
            x = block(x)
        pooled = constrain(x.astype(jnp.float32).mean(axis=(1, 2)).astype(self.compute_dtype), ("batch", "embed"))
        return constrain(self.head(pooled), ("batch", "classes"))

    def forward_macs(self) -> int:
        """Multiply-adds of the forward pass for one image (convolutions and the last layer)."""
        height, width, _ = self.image_shape
        total, height, width = self.stem.macs(height, width)
        if self.pool:
            height, width = _out_size(height, 3, 2), _out_size(width, 3, 2)
        total += _chain_macs(self.blocks, height, width)[0]
        return total + self.head.in_features * self.head.out_features


def flops_per_example(cfg: Config) -> int:
    """Training FLOPs of one example (`classifier.training_flops` of `ResNet.forward_macs`)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: ResNet(cfg.model, rngs=nnx.Rngs(0)))
    return classifier.training_flops(model.forward_macs())


ENTRY = register(classifier.entry(ResNetConfig, ResNet, flops_per_example,
                                  (FEATURE_MAP, ("batch", "embed"), ("batch", "classes"))))
