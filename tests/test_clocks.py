"""`jaxdist bench` reports the SM clock and power its steps ran at (observe/clocks.py, through NVML).

NVML is played by a fake `pynvml` module with three GPUs, the first held at the power limit; the
last test reads a real GPU where one is present.
"""

import json
import sys
import time
import types

import jax
import jax.numpy as jnp
import pytest

from jaxdist import cli
from jaxdist.observe import clocks

pytestmark = pytest.mark.slow

# In NVML index order: PCI bus id, UUID, SM MHz, power in mW, clock event reasons.
GPUS = [
    ("00000000:1B:00.0", "GPU-aaaa1111-0000", 1650, 689_500, 0x4),
    ("00000000:43:00.0", "GPU-bbbb2222-0000", 1980, 120_250, 0x0),
    ("00000000:52:00.0", "GPU-cccc3333-0000", 1410, 402_000, 0x4 | 0x40),
]


def fake_nvml(init_error: str | None = None) -> types.ModuleType:
    """A `pynvml` whose handles are indices into GPUS; counts its inits and shutdowns."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def by_index(index):
        if not 0 <= index < len(GPUS):
            raise NVMLError("Invalid Argument")
        return index

    def by(column: int):
        def find(value):
            for index, gpu in enumerate(GPUS):
                if gpu[column] == value:
                    return index
            raise NVMLError("Not Found")
        return find

    def init():
        if init_error:
            raise NVMLError(init_error)
        nvml.inits += 1

    def shutdown():
        nvml.shutdowns += 1

    def clock(handle, kind):
        assert kind == nvml.NVML_CLOCK_SM
        return GPUS[handle][2]

    nvml.__dict__.update(
        NVMLError=NVMLError, NVML_CLOCK_SM=1, inits=0, shutdowns=0, nvmlInit=init, nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: len(GPUS), nvmlDeviceGetHandleByIndex=by_index,
        nvmlDeviceGetHandleByPciBusId=by(0), nvmlDeviceGetHandleByUUID=by(1),
        nvmlDeviceGetUUID=lambda handle: GPUS[handle][1], nvmlDeviceGetClockInfo=clock,
        nvmlDeviceGetPowerUsage=lambda handle: GPUS[handle][3],
        nvmlDeviceGetCurrentClocksEventReasons=lambda handle: GPUS[handle][4],
    )
    return nvml


@pytest.fixture
def nvml(monkeypatch):
    module = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def sample(targets, **kwargs) -> clocks.ClockSampler:
    lines = []
    with clocks.ClockSampler(targets, interval_s=0.01, notify=lines.append, **kwargs) as sampler:
        time.sleep(0.05)
    sampler.lines = lines
    return sampler


def test_reason_names_decode_nvml_clock_event_bits():
    assert clocks.reason_names(0) == []
    assert clocks.reason_names(0x4) == ["sw_power_cap"]
    assert clocks.reason_names(0x1 | 0x8 | 0x40 | 0x100) == [
        "gpu_idle", "hw_slowdown", "hw_thermal_slowdown", "display_clock_setting"]
    assert clocks.reason_names(0x4 | 0x2000) == ["sw_power_cap", "0x2000"]  # a bit newer than this table


def test_summary_takes_medians_and_shares():
    sampler = clocks.ClockSampler([0])
    sampler.samples = [
        clocks.Sample(0, 1650, 690.0, 0x4), clocks.Sample(0, 1700, 650.0, 0x4 | 0x40),
        clocks.Sample(0, 1980, 660.0, 0x0), clocks.Sample(0, 345, 70.0, 0x1),  # the last one idle
    ]
    assert sampler.summary() == {"sm_clock_mhz": 1675, "power_w": 655, "power_capped": 0.5, "throttle_reasons": {
        "gpu_idle": 0.25, "sw_power_cap": 0.5, "hw_thermal_slowdown": 0.25}}
    # Around a whole program: only the samples near the most power seen count.
    assert sampler.summary(busy_share=0.8) == {"sm_clock_mhz": 1700, "power_w": 660, "power_capped": 0.67,
                                               "throttle_reasons": {"sw_power_cap": 0.67, "hw_thermal_slowdown": 0.33}}


def test_sampler_reads_its_gpus_from_nvml(nvml):
    capped = sample([0])
    assert len(capped.samples) >= 2 and {s.gpu for s in capped.samples} == {0} and capped.lines == []
    assert capped.summary() == {"sm_clock_mhz": 1650, "power_w": 690, "power_capped": 1.0,
                                "throttle_reasons": {"sw_power_cap": 1.0}}
    # By PCI bus id and by UUID prefix (as CUDA_VISIBLE_DEVICES may name them).
    both = sample(["00000000:43:00.0", "GPU-cccc"])
    assert both.summary() == {"sm_clock_mhz": 1695, "power_w": 261, "power_capped": 0.5,
                              "throttle_reasons": {"sw_power_cap": 0.5, "hw_thermal_slowdown": 0.5}}
    assert nvml.inits == nvml.shutdowns == 2


def test_cuda_ordinals_map_to_nvml_targets(monkeypatch):
    device = types.SimpleNamespace(local_hardware_id=1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert clocks.cuda_targets([device]) == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert clocks.cuda_targets([device]) == [3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb, GPU-aaaa")
    assert clocks.cuda_targets([device]) == ["GPU-aaaa"]
    # A PCI bus id from JAX names the GPU whatever the variable says.
    assert clocks.cuda_targets([types.SimpleNamespace(local_hardware_id=1, pci_bus_id="00000000:52:00.0")]) == [
        "00000000:52:00.0"]


def test_without_nvml_one_line_and_nothing_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as if not installed
    missing = sample([0])
    assert missing.lines == ["GPU clocks not sampled: nvidia-ml-py is not installed (pip install 'jaxdist[gpu]')"]
    assert missing.summary() == {}

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error="Driver Not Loaded"))
    no_driver = sample([0])
    assert no_driver.lines == ["GPU clocks not sampled: NVML did not start (Driver Not Loaded)"]
    assert no_driver.summary() == {}

    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    unknown = sample([0, "00000000:99:00.0"])
    assert unknown.lines == ["GPU clocks not sampled: NVML could not read GPU(s) [0, '00000000:99:00.0'] (Not Found)"]
    assert unknown.summary() == {} and nvml.inits == nvml.shutdowns == 1
    assert sample([]).lines == []  # no GPU to sample: nothing to say


def _bench(capsys) -> tuple[dict, str]:
    overrides = ["model.layers=1", "train.global_batch=8", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "--devices", "1"]
    assert cli.main(["bench", "configs/tiny.yaml", *overrides, "--steps", "2", "--warmup", "1"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.gpu
def test_bench_reports_the_clocks_of_its_timed_steps(nvml, monkeypatch, capsys):
    # No GPU to sample, even where NVML answers: no clock fields, no line about them. (On a GPU
    # host the bench runs on its GPU, so there the absence of one is played.)
    if jax.default_backend() == "gpu":
        monkeypatch.setattr(clocks, "cuda_targets", lambda devices: [])
    printed, err = _bench(capsys)
    assert printed["step_ms"] > 0 and "sm_clock_mhz" not in printed and "power_w" not in printed
    assert "GPU clocks" not in err and nvml.inits == 0
    # Taken for NVML's GPU 0, the bench's device is sampled while its steps are timed.
    monkeypatch.setattr(clocks, "cuda_targets", lambda devices: [0])
    printed, _ = _bench(capsys)
    assert (printed["sm_clock_mhz"], printed["power_w"], printed["power_capped"]) == (1650, 690, 1.0)
    assert printed["throttle_reasons"] == {"sw_power_cap": 1.0} and nvml.inits == nvml.shutdowns == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_a_real_gpu_is_sampled_while_it_works():
    """The GPU JAX runs on is found in NVML (as docs/performance.md says, also under
    CUDA_VISIBLE_DEVICES) and read while a matmul keeps it busy."""
    device = jax.devices("gpu")[0]
    (target,) = clocks.cuda_targets([device])
    x = jax.device_put(jnp.ones((8192, 8192), jnp.bfloat16), device)
    matmul = jax.jit(lambda a: a @ a)
    jax.block_until_ready(matmul(x))
    lines = []
    with clocks.ClockSampler([target], interval_s=0.05, notify=lines.append) as sampler:
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            jax.block_until_ready(matmul(x))
    summary = sampler.summary()
    assert lines == [] and len(sampler.samples) >= 20
    assert 500 <= summary["sm_clock_mhz"] <= 3000 and 20 <= summary["power_w"] <= 1500
    assert 0 <= summary["power_capped"] <= 1
    assert summary["throttle_reasons"].get("gpu_idle", 0) < 0.5  # the sampled GPU is the busy one
