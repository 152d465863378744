"""`data.workers: auto`: grain worker processes from the cores each training process may use, resolved
before the run starts, written into the resolved config; any count reads the same batches."""

import os
import re

import jax
import pytest
from conftest import make_config

from jaxdist import cli, config
from jaxdist.data import loader, stream
from jaxdist.errors import UserError
from jaxdist.parallel import distributed
from jaxdist.parallel.feed import BatchRows


@pytest.mark.parametrize("cores, processes, workers", [
    (1, 1, 0), (2, 1, 0), (3, 1, 0),  # too few cores: workers only take them from the training process
    (4, 1, 2), (16, 1, 14), (34, 1, 32), (128, 1, 32),  # all but two, at most 32
    (16, 8, 0), (16, 4, 2), (128, 8, 14), (130, 8, 14),  # a host's processes share its cores
])
def test_auto_gives_each_process_reading_images_its_share_of_the_cores_but_two(cores, processes, workers):
    assert stream.auto_workers("images", cores, processes) == workers


@pytest.mark.parametrize("source", ["stdlib", "arrayrecord", "arrays", "digits"])
def test_auto_reads_tokens_and_in_memory_arrays_in_the_training_process(source):
    assert stream.auto_workers(source, 128, 1) == 0


@pytest.fixture
def sixteen_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))


@pytest.mark.parametrize("files, cores", [
    ({}, 16),  # no control group files: the affinity
    ({"cpu.max": "max 100000"}, 16),  # cgroup v2, no limit
    ({"cpu.max": "450000 100000"}, 5),  # 4.5 CPUs of time: 5 cores busy part of the time
    ({"cpu.max": "50000 100000"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, 16),  # cgroup v1, no limit
    ({"cpu/cpu.cfs_quota_us": "800000", "cpu/cpu.cfs_period_us": "100000"}, 8),
    ({"cpu.max": "garbled"}, 16),
])
def test_usable_cores_are_the_affinity_capped_by_a_container_cpu_limit(tmp_path, sixteen_cores, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    assert stream.usable_cores(tmp_path) == cores


def test_usable_cores_of_this_process_are_its_affinity_at_most():
    assert 1 <= stream.usable_cores() <= len(os.sched_getaffinity(0))


def test_auto_is_the_default_and_resolves_to_a_count(tmp_path, monkeypatch):
    assert make_config(tmp_path).data.workers == "auto"
    monkeypatch.setattr(stream, "usable_cores", lambda: 16)
    assert loader.resolve_workers(make_config(tmp_path)).data.workers == 0  # stdlib tokens
    cfg = make_config(tmp_path, data={"source": "images", "path": "photos"})
    resolved = loader.resolve_workers(cfg)
    assert resolved.data.workers == 14
    assert resolved.model_dump() == {**cfg.model_dump(), "data": {**cfg.data.model_dump(), "workers": 14}}
    assert "workers: 14" in resolved.to_yaml()  # the run's config.yaml holds the count
    fixed = make_config(tmp_path, data={"workers": 3})
    assert loader.resolve_workers(fixed) is fixed


def test_a_single_process_resolves_auto_where_it_reads(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(stream, "auto_workers", lambda source, cores, processes: (source, processes))
    monkeypatch.setattr(stream, "train_batches", lambda *args, **kwargs: calls.append(kwargs["workers"]))
    loader.train_iterator(make_config(tmp_path), BatchRows(16, tuple(range(16))))
    assert calls == [("stdlib", 1)]


def test_several_processes_must_resolve_auto_first(tmp_path, monkeypatch):
    """Resolving counts the processes on each host's cores, a collective: never done as a side effect."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(UserError) as caught:
        loader.train_iterator(make_config(tmp_path), BatchRows(16, tuple(range(16))))
    assert str(caught.value) == ("data.workers=auto is not resolved; pass the config through "
                                 "jaxdist.data.loader.resolve_workers on every process first (jaxdist train does)")


def test_one_process_shares_its_cores_with_no_other():
    assert jax.process_count() == 1 and distributed.processes_sharing_cores() == 1


@pytest.mark.parametrize("value", ["many", -1, 1.5, True])
def test_a_bad_worker_count_is_one_line(capsys, value):
    with pytest.raises(UserError) as caught:
        config.from_dict({"data": {"workers": value}})
    assert str(caught.value) == (f"config: data.workers={value!r}: use a number of worker processes (0: read in "
                                 f"the training process), or auto")


def test_workers_override_from_the_command_line(capsys):
    assert cli.main(["config", "show", "data.workers=6"]) == 0
    assert re.search(r"^data\.workers +6 +int \| auto +grain worker processes", capsys.readouterr().out, re.MULTILINE)


@pytest.mark.parametrize("workers, words", [
    (0, "read in the training process"), (1, "read in 1 worker process"), (6, "read in 6 worker processes"),
    ("auto", "read in data.workers=auto worker processes"),
])
def test_the_run_names_how_it_reads(tmp_path, workers, words):
    cfg = make_config(tmp_path, data={"source": "arrays", "path": "x.npz", "workers": workers})
    assert loader.describe(cfg) == f"data: arrays from x.npz, {words} (2 read threads, 4 batches ahead)"
