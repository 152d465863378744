"""`jaxdist bench` reports the SM clock and power its steps ran at (observe/clocks.py).

nvidia-smi is played by a script on PATH that prints what the real one prints for two GPUs, the
first held at the power limit.
"""

import json
import os
import stat

from jaxdist import cli
from jaxdist.observe import clocks

# index, clocks.sm, power.draw, clocks_event_reasons.active (csv, noheader, nounits)
SMI_OUTPUT = """0, 1650, 689.50, 0x0000000000000004
1, 1980, 120.25, 0x0000000000000000
2, [N/A], [N/A], [N/A]
"""


def _fake_smi(tmp_path, monkeypatch, output: str = SMI_OUTPUT):
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    (tmp_path / "out.txt").write_text(output)
    smi.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'}\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")


def test_parse_reads_clock_power_and_reasons_and_skips_unreadable_gpus():
    samples = clocks.parse(SMI_OUTPUT)
    assert samples == [clocks.Sample(0, 1650.0, 689.5, 4), clocks.Sample(1, 1980.0, 120.25, 0)]


def test_sampler_summarizes_only_its_gpus(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch)
    with clocks.ClockSampler([0], interval_s=0.01) as capped:
        pass
    assert len(capped.samples) >= 1 and {s.gpu for s in capped.samples} == {0}
    assert capped.summary() == {"sm_clock_mhz": 1650, "power_w": 690, "power_capped": 1.0}
    with clocks.ClockSampler([0, 1], interval_s=0.01) as both:
        pass
    assert both.summary()["power_capped"] == 0.5
    # Around a whole program: only the samples near the most power seen (GPU 0's here) count.
    assert both.summary(busy_share=0.8) == {"sm_clock_mhz": 1650, "power_w": 690, "power_capped": 1.0}


def test_without_nvidia_smi_nothing_is_sampled(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with clocks.ClockSampler([0]) as sampler:
        pass
    assert sampler.samples == [] and sampler.summary() == {}


def test_cuda_visible_devices_maps_ordinals_to_nvidia_smi_indices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert clocks.smi_indices([0, 1]) == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert clocks.smi_indices([0, 1]) == [2, 3]


def _bench(capsys) -> dict:
    overrides = ["model.layers=1", "train.global_batch=8", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "--devices", "1"]
    assert cli.main(["bench", "jaxdist/recipes/tiny.yaml", *overrides, "--steps", "2", "--warmup", "1"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_reports_the_clocks_of_its_timed_steps(tmp_path, monkeypatch, capsys):
    _fake_smi(tmp_path, monkeypatch)
    # This CPU has no GPU to sample, even where nvidia-smi answers: no clock fields.
    printed = _bench(capsys)
    assert printed["step_ms"] > 0 and "sm_clock_mhz" not in printed and "power_w" not in printed
    # Taken for nvidia-smi's GPU 0, the bench's device is sampled while its steps are timed.
    monkeypatch.setattr(clocks, "smi_indices", lambda ordinals: [0])
    printed = _bench(capsys)
    assert (printed["sm_clock_mhz"], printed["power_w"], printed["power_capped"]) == (1650, 690, 1.0)
