"""Checksums of a checkpoint's arrays, and telling a damaged checkpoint from any other failure.

A digest of an array is two 32-bit sums over its elements, each element's bits mixed with its
row-major index in the global array. Sums modulo 2**32 come out the same in any order of addition,
so the digest does not depend on how the array is split: it is a jitted reduction over the global
array, on the devices that hold it, under any mesh and process count, and every process gets the
same answer. The first sum weighs each element by an odd number, so a change in any one element
always changes it; the second is nonlinear in the bits, so changes that cancel in the first are
still caught (all but 1 in 2**64 of them).

Damage is told from other failures by what a read raises (`is_damage`), and by where: around a
read of metadata alone, `parsing` turns what a parser raises on content not shaped as written
into `DamagedCheckpoint`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

# TensorStore's status codes for files that are missing, cut short or fail to decode.
_DAMAGE_CODES = ("DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION")
# Every status code a TensorStore error begins with (absl's): such an error is judged by its code.
_STATUS_CODES = ("CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                 "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
# What decoding a file's bytes as JSON raises when they are not what was written: bytes that are
# not UTF-8 (a flipped bit sets the high bit of an ASCII byte), or text that is not JSON.
_UNDECODABLE = (UnicodeDecodeError, json.JSONDecodeError)
# What parsing decoded metadata raises when it is not shaped as written: a key missing (KeyError),
# a value of another type (TypeError, AttributeError), an unknown type or key kind (Orbax's
# ValueError), an index past a list's end (IndexError, Orbax's AssertionError).
_MALFORMED = (LookupError, TypeError, AttributeError, AssertionError, ValueError)
OK, DAMAGED, FAILED = 0, 1, 2


class DamagedCheckpoint(Exception):
    """A checkpoint whose arrays differ from the digests saved with them, or that lacks a part."""


def array_digests(arrays: dict[str, Any]) -> dict[str, list[int]]:
    """`{name: [sum1, sum2]}` for every array of `arrays` (see the module docstring).

    Collective: with several processes, every process must call it with its part of the same
    global arrays. Typed PRNG keys are digested as their key data.
    """
    return start_digests(arrays).result()


class PendingDigests:
    """Digests being computed on the devices; `result` waits for them (from any thread)."""

    def __init__(self, sums: dict[str, jax.Array]):
        self._sums = sums

    def result(self) -> dict[str, list[int]]:
        # Replicated on every device: this process's first copy is the whole answer.
        return {name: np.asarray(sums.addressable_data(0)).tolist() for name, sums in self._sums.items()}


def start_digests(arrays: dict[str, Any]) -> PendingDigests:
    """Dispatches `array_digests` without waiting for it (collective, like it).

    One small program per distinct shape, dtype and sharding, not one for the whole state: XLA
    compiles a state's hundreds of reductions as one program many times slower than the few
    distinct ones. On CPU each runs to the end before the next starts: XLA's in-process CPU
    collectives can deadlock when programs overlap on simulated devices."""
    sums = {}
    for name, array in arrays.items():
        in_host_memory = _in_host_memory(array)
        if in_host_memory:  # offloaded state (train.offload): digested on the devices, one array at a time
            array = jax.device_put(array, array.sharding.with_memory_kind("device"))
        sums[name] = _digest_one(array)
        if in_host_memory or _on_cpu(array):
            sums[name].block_until_ready()
    return PendingDigests(sums)


def _in_host_memory(array: Any) -> bool:
    return isinstance(array, jax.Array) and array.sharding.memory_kind not in (None, "device")


def _on_cpu(array: Any) -> bool:
    """Whether a digest of `array` runs on CPU devices (a host array's runs on the default device)."""
    device = next(iter(array.sharding.device_set)) if isinstance(array, jax.Array) else jax.devices()[0]
    return device.platform == "cpu"


@jax.jit
def _digest_one(x: jax.Array) -> jax.Array:
    return _digest(x)


def _digest(x: jax.Array) -> jax.Array:
    words = _words(x)
    weight = _mix(_flat_index(words.shape)) | jnp.uint32(1)
    weighted = jnp.sum(words * weight, dtype=jnp.uint32)
    mixed = jnp.sum(_mix(words ^ weight), dtype=jnp.uint32)
    return jnp.stack([weighted, mixed])


def _words(x: jax.Array) -> jax.Array:
    """The bits of every element as uint32 (a 64-bit element gives two, on a last axis)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Every element's row-major index in an array of `shape`, modulo 2**32."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _mix(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def differences(saved: dict[str, list[int]], read: dict[str, list[int]]) -> list[str]:
    """Names of the arrays in `read` whose digests differ from (or are missing in) `saved`."""
    return [name for name, value in read.items() if saved.get(name) != value]


def is_damage(err: BaseException) -> bool:
    """Whether `err` (or an error it wraps) means a checkpoint's files are missing, cut short or
    corrupt, rather than a failure of this machine (memory, a transient I/O error) or a bug."""
    for cause in _chain(err):
        if isinstance(cause, (DamagedCheckpoint, FileNotFoundError, *_UNDECODABLE)):
            return True
        if isinstance(cause, ValueError) and str(cause).startswith(_DAMAGE_CODES):
            return True
    return False


@contextlib.contextmanager
def parsing(what: str) -> Iterator[None]:
    """Raises `DamagedCheckpoint` for what parsing `what`, a checkpoint's metadata, raises on
    content that is not shaped as it was written (a key missing, a value of another type).

    For reads whose only input is the files (no arrays, no caller's objects): there such an error
    comes from the content, not from a bug. Other errors pass unchanged: I/O and memory errors,
    and TensorStore's, which `is_damage` judges by their status code.
    """
    try:
        yield
    except _MALFORMED as err:
        if isinstance(err, ValueError) and str(err).startswith(_STATUS_CODES):
            raise
        raise DamagedCheckpoint(f"{what} is malformed ({type(err).__name__}: {err})") from err


def _chain(err: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__


def outcome(err: BaseException | None) -> int:
    """OK, DAMAGED or FAILED: what one process's attempt to read a checkpoint came to."""
    if err is None:
        return OK
    return DAMAGED if is_damage(err) else FAILED


def agree(err: BaseException | None, gather: Callable[[int], Any] | None = None) -> None:
    """Makes every process reach the same verdict on a read that failed on some of them.

    Each process passes the error its read raised (None if it succeeded); the outcomes are
    gathered from all processes. If any failed, every process raises: its own error where that
    is the worst outcome, else one naming the first process that had it. A damaged checkpoint
    anywhere raises `DamagedCheckpoint` (to be set aside by all); any other failure anywhere
    raises that failure (nothing is set aside). `gather` maps this process's outcome to the
    list of all processes' outcomes (process_allgather by default).
    """
    mine = outcome(err)
    if gather is None:
        gather = _allgather if jax.process_count() > 1 else (lambda code: [code])
    codes = [int(code) for code in gather(mine)]
    worst = max(codes)
    if worst == OK:
        return
    if mine == worst:
        raise err
    process = codes.index(worst)
    if worst == DAMAGED:
        raise DamagedCheckpoint(f"process {process} found it damaged") from err
    # Not chained to this process's own error: that may be damage, and this is not.
    here = f"; this process: {type(err).__name__}: {err}" if err is not None else ""
    raise RuntimeError(f"process {process} failed to read it (see that process's error){here}") from None


def _allgather(code: int) -> list[int]:
    return list(np.asarray(multihost_utils.process_allgather(np.int32(code))).reshape(-1))
