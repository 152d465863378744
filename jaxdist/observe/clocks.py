"""What the GPUs ran at while a benchmark timed them: SM clock, power draw, power-cap throttling.

A training step that keeps an H100 or H200 busy draws the card's power limit (700 W on SXM
parts), and the driver then lowers the SM clock (to about 1520-1700 MHz from 1980 for GPT 406M)
by a few percent more or less from one run to the next: enough to move a step by 1%. `jaxdist bench`
samples the clocks while it times steps, so that a step time can be read with the clock it ran
at. The samples come from `nvidia-smi` (in a background thread, one query every `interval_s`);
where it is missing (no NVIDIA GPU) nothing is sampled and the summary is empty.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import subprocess
import threading

QUERY = "index,clocks.sm,power.draw,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap: the driver holds the clock down to the power limit


@dataclasses.dataclass(frozen=True)
class Sample:
    gpu: int  # nvidia-smi's index
    sm_mhz: float
    power_w: float
    reasons: int  # bit mask of clock event (throttle) reasons


def parse(text: str) -> list[Sample]:
    """Samples from `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits` output; lines
    with fields nvidia-smi could not read ("[N/A]") are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            samples.append(Sample(int(fields[0]), float(fields[1]), float(fields[2]), int(fields[3], 16)))
        except ValueError:
            continue
    return samples


def smi_indices(cuda_ordinals: list[int]) -> list[int]:
    """nvidia-smi's indices of the GPUs CUDA numbers `cuda_ordinals` in this process.

    Under CUDA_VISIBLE_DEVICES (as indices) the ordinals index its list; without it, or with
    UUIDs there, they are taken as nvidia-smi's own (the same order on hosts of identical GPUs).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if all(entry.strip().isdigit() for entry in visible):
        return [int(visible[ordinal]) for ordinal in cuda_ordinals if ordinal < len(visible)]
    return list(cuda_ordinals)


class ClockSampler:
    """A context manager that samples the GPUs' clocks while open; `summary()` after it closes."""

    def __init__(self, gpus: list[int], interval_s: float = 0.2):
        self.gpus = set(gpus)
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        smi = shutil.which("nvidia-smi")
        if smi and self.gpus:
            self._thread = threading.Thread(target=self._run, args=(smi,), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, smi: str) -> None:
        command = [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        while True:
            try:
                out = subprocess.run(command, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                return
            self.samples += [s for s in parse(out) if s.gpu in self.gpus]
            if self._stop.wait(self.interval_s):
                return

    def summary(self, busy_share: float | None = None) -> dict:
        """Medians over the samples of the sampled GPUs: `sm_clock_mhz`, `power_w`, and
        `power_capped`, the share of samples the driver held down to the power limit. Empty
        without samples.

        `busy_share`: only the samples drawing at least this share of the most power seen, for
        a sampler open around a whole program (start-up, compile), of which the steps draw most.
        """
        samples = self.samples
        if samples and busy_share is not None:
            threshold = busy_share * max(s.power_w for s in samples)
            samples = [s for s in samples if s.power_w >= threshold]
        if not samples:
            return {}
        return {
            "sm_clock_mhz": round(statistics.median(s.sm_mhz for s in samples)),
            "power_w": round(statistics.median(s.power_w for s in samples)),
            "power_capped": round(sum(bool(s.reasons & SW_POWER_CAP) for s in samples) / len(samples), 2),
        }
