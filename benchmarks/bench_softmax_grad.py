"""One loss chunk's softmax pass: XLA's reduction + gradient pass against the one-kernel version (GPU).

    python3 benchmarks/bench_softmax_grad.py [--blocks 1024 2048 ...]

For a chunk of the 406M and 1.4B recipes' loss (16 or 8 sequences x 256 positions x 50,304 bf16
logits) this prints XLA's two passes (`cross_entropy.xla_loss_and_grad`: the one-pass logsumexp,
then `(softmax - one-hot) * weight`) and the kernel of kernels/softmax_grad.py at each block
width, with its largest difference from XLA's result and the HBM bandwidth it reaches counting
one read and one write of the logits.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxdist
from jaxdist.kernels import softmax_grad
from jaxdist.models import cross_entropy
from jaxdist.observe.timing import time_calls

SHAPES = {"406m": (16, 256, 50304), "1b4": (8, 256, 50304)}  # batch, chunk, vocab

xla_passes = jax.jit(functools.partial(cross_entropy.xla_loss_and_grad, grad_dtype=jnp.bfloat16, one_pass=True))


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", nargs="*", type=int, default=[1024, 2048, 4096],
                        help="the kernel's columns per block")
    args = parser.parse_args()
    print(f"{'shape':<6} {'what':<22} {'ms':>7} {'GB/s':>6} {'max |diff| loss':>16} {'grad':>9}")
    for name, (batch, chunk, vocab) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), 2)
        logits = (jax.random.normal(keys[0], (batch, chunk, vocab)) * 3).astype(jnp.bfloat16)
        targets = jax.random.randint(keys[1], (batch, chunk), 0, vocab)
        weights = jnp.ones((batch,), jnp.float32)
        gigabytes = 2 * logits.size * logits.dtype.itemsize / 1e9
        ref_loss, ref_grad = xla_passes(logits, targets, weights)
        ms = time_calls(xla_passes, logits, targets, weights, repeats=50)
        print(f"{name:<6} {'xla two passes':<22} {ms:7.3f} {gigabytes / ms * 1e3:6.0f}")
        for block in args.blocks:
            kernel = jax.jit(functools.partial(softmax_grad._local, grad_dtype=jnp.bfloat16, block=block))
            loss, grad = kernel(logits, targets, weights)
            loss_diff = float(np.abs(np.asarray(loss) - np.asarray(ref_loss)).max())
            grad_diff = float(np.abs(np.asarray(grad, np.float32) - np.asarray(ref_grad, np.float32)).max())
            ms = time_calls(kernel, logits, targets, weights, repeats=50)
            print(f"{name:<6} {f'kernel, block {block}':<22} {ms:7.3f} {gigabytes / ms * 1e3:6.0f} "
                  f"{loss_diff:16.2e} {grad_diff:9.2e}")


if __name__ == "__main__":
    main()
