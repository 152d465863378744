"""What the GPUs ran at while a benchmark timed them: SM clock, power draw, and why the driver held
the clock down (NVML's clock event reasons, a.k.a. throttle reasons).

A training step that keeps an H100 or H200 busy draws the card's power limit (700 W on SXM
parts), and the driver then lowers the SM clock (to about 1520-1700 MHz from 1980 for GPT 406M)
by a few percent more or less from one run to the next: enough to move a step by 1%. `jaxdist bench`
samples the clocks while it times steps, so that a step time can be read with the clock it ran
at. The samples come from NVML in this process (nvidia-ml-py, the `gpu` extra), in a background
thread, one reading every `interval_s`. Without nvidia-ml-py or a working NVML, one line says so and
the summary is empty.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import statistics
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

# NVML's clock event reason bits (nvmlClocksEventReason*), named as `nvidia-smi -q` names them.
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
SW_POWER_CAP = 0x4  # the driver holds the clock down to the power limit

# A GPU as NVML finds it: its index (int), PCI bus id ("0000:1B:00.0") or UUID ("GPU-8f2c...", a prefix will do).
Target = int | str


def reason_names(mask: int) -> list[str]:
    """The names of the reasons set in a clock event reason mask, lowest bit first (unknown bits in hex)."""
    bits = [1 << i for i in range(mask.bit_length()) if mask >> i & 1]
    return [REASONS.get(bit, hex(bit)) for bit in bits]


@dataclasses.dataclass(frozen=True)
class Sample:
    gpu: int  # position in the sampler's targets
    sm_mhz: float
    power_w: float
    reasons: int  # bit mask of clock event reasons


def cuda_targets(devices: Sequence[Any]) -> list[Target]:
    """NVML targets of this process's JAX GPU devices.

    A device's PCI bus id, where JAX reports one, names it exactly. Otherwise its CUDA ordinal
    (`local_hardware_id`) indexes CUDA_VISIBLE_DEVICES, whose entries are NVML indices or UUIDs;
    without that variable the ordinal is NVML's index (the same order wherever CUDA_DEVICE_ORDER
    is PCI_BUS_ID or the GPUs are alike, as on training hosts).
    """
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    targets: list[Target] = []
    for device in devices:
        bus_id = getattr(device, "pci_bus_id", None)
        if isinstance(bus_id, str) and bus_id:
            targets.append(bus_id)
        elif visible:
            entry = visible[device.local_hardware_id]
            targets.append(int(entry) if entry.isdigit() else entry)
        else:
            targets.append(device.local_hardware_id)
    return targets


def nvml_handle(nvml, target: Target):
    """The NVML handle of a target GPU (`Target`)."""
    if isinstance(target, int):
        return nvml.nvmlDeviceGetHandleByIndex(target)
    if target.startswith(("GPU-", "MIG-")):
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if nvml.nvmlDeviceGetUUID(handle).startswith(target):
                return handle
        return nvml.nvmlDeviceGetHandleByUUID(target)  # a MIG instance, or NVML's own "not found"
    return nvml.nvmlDeviceGetHandleByPciBusId(target)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ClockSampler:
    """A context manager that samples the `targets` GPUs' clocks while open; `summary()` after it
    closes. Where sampling cannot start or fails, `notify` gets one line (default: stderr) and the
    summary is empty."""

    def __init__(self, targets: Sequence[Target], interval_s: float = 0.2,
                 notify: Callable[[str], None] = _stderr):
        self.targets = list(targets)
        self.interval_s = interval_s
        self.notify = notify
        self.samples: list[Sample] = []
        self.failure: str | None = None
        self._nvml = None
        self._handles: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        if not self.targets:
            return self
        try:
            import pynvml
        except ImportError:
            self._fail("nvidia-ml-py is not installed (pip install 'jaxdist[gpu]')")
            return self
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            self._fail(f"NVML did not start ({err})")
            return self
        self._nvml = pynvml
        try:
            self._handles = [nvml_handle(pynvml, target) for target in self.targets]
            self._read()  # a GPU NVML cannot read fails here, before the timed steps
        except pynvml.NVMLError as err:
            self._fail(f"NVML could not read GPU(s) {self.targets} ({err})")
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None

    def _fail(self, why: str) -> None:
        self.failure = why
        self.samples = []
        self.notify(f"GPU clocks not sampled: {why}")

    def _read(self) -> None:
        nvml = self._nvml
        for gpu, handle in enumerate(self._handles):
            self.samples.append(Sample(
                gpu,
                float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,  # milliwatts
                int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
            ))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._read()
            except self._nvml.NVMLError as err:
                self._fail(f"NVML stopped answering ({err})")
                return

    def summary(self, busy_share: float | None = None) -> dict:
        """Medians over the samples: `sm_clock_mhz`, `power_w`; `power_capped`, the share of
        samples the driver held down to the power limit; `throttle_reasons`, the share of samples
        each clock event reason was active in (only those seen). Empty without samples.

        `busy_share`: only the samples drawing at least this share of the most power seen, for
        a sampler open around a whole program (start-up, compile), of which the steps draw most.
        """
        samples = self.samples
        if samples and busy_share is not None:
            threshold = busy_share * max(s.power_w for s in samples)
            samples = [s for s in samples if s.power_w >= threshold]
        if not samples:
            return {}
        seen = reason_names(functools.reduce(operator.or_, (s.reasons for s in samples)))
        return {
            "sm_clock_mhz": round(statistics.median(s.sm_mhz for s in samples)),
            "power_w": round(statistics.median(s.power_w for s in samples)),
            "power_capped": round(sum(bool(s.reasons & SW_POWER_CAP) for s in samples) / len(samples), 2),
            "throttle_reasons": {name: round(sum(name in reason_names(s.reasons) for s in samples) / len(samples), 2)
                                 for name in seen},
        }
