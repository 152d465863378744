"""Two real JAX processes (jax.distributed on CPU) read the rows their devices hold: disjoint shares
that make up every epoch, each global batch a contiguous slice of the stream."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import make_config
from data_helpers import prepared, random_documents

from jaxdist.data import loader

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_processes_read_each_example_once_per_epoch(tmp_path):
    path, _ = prepared(tmp_path, random_documents(40, seed=1), eval_fraction=0.2, chunk_tokens=64)
    port = free_port()
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "2", "PYTHONPATH": os.pathsep.join(sys.path)}
    workers = [
        subprocess.Popen(
            [sys.executable, str(HERE / "data_process.py"), str(port), str(i), str(path), str(tmp_path / f"{i}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    for worker in workers:
        output, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0, output[-3000:]
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    # Both run on this host's cores: data.workers=auto would give each half of them (these tokens: none).
    assert [(result["sharing"], result["workers"]) for result in results] == [(2, 0)] * 2

    cfg = make_config(tmp_path, data={"source": "arrayrecord", "path": str(path)}, model={"seq_len": 16})
    for split in ("train", "eval"):
        source = loader.open_split(cfg, split)
        index = {source[i]["inputs"].tobytes(): i for i in range(len(source))}
        ids = lambda rows: [index[np.asarray(row, np.int32).tobytes()] for row in rows]  # noqa: E731
        local = [[ids(batch) for batch in result[split]["local"]] for result in results]
        assert all(len(batch) == 4 for process in local for batch in process)
        # Every global batch is exactly the union of the two processes' rows, seen alike by both.
        for step, gathered in enumerate(results[0][split]["global"]):
            assert results[1][split]["global"][step] == gathered
            assert sorted(ids(gathered)) == sorted(local[0][step] + local[1][step])
        n = len(source)
        if split == "train":
            # Global batch b is stream positions 8b .. 8b + 7, process p holding rows 4p .. 4p + 3:
            # rebuild the stream, check both epochs.
            assert [result["rows"] for result in results] == [[0, 1, 2, 3], [4, 5, 6, 7]]
            stream = [i for step in range(len(local[0])) for i in local[0][step] + local[1][step]]
            for epoch in range(2):
                part = stream[epoch * n : (epoch + 1) * n]
                assert sorted(part) == list(range(n))
                assert not set(part[0::2]) & set(part[1::2])
        else:
            weights = [w for result in results for batch in result[split]["weights"] for w in batch]
            rows = [i for process in local for batch in process for i in batch]
            assert sorted(i for i, w in zip(rows, weights) if w == 1) == list(range(n))


def test_processes_whose_data_differ_stop_before_compiling(tmp_path):
    """Two hosts' copies of data.path differ (one has 10% more rows), under a layout where no batch
    row is held by both processes, so the first batch's replica check has nothing to compare: the
    start-up check of every split stops both processes, exit 2."""
    tokens = np.random.default_rng(0).integers(0, 64, (220, 17))
    for host, rows in (("a", 200), ("b", 220)):
        (tmp_path / host).mkdir()
        np.savez(tmp_path / host / "data.npz", inputs=tokens[:rows, :-1], targets=tokens[:rows, 1:])
    cfg = make_config(tmp_path / "run", data={"source": "arrays", "path": "data.npz"}, model={"seq_len": 16, "vocab": 64},
                      mesh={"data": 1, "fsdp": -1}, train={"steps": 1, "global_batch": 8})
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    port = free_port()
    env = {**os.environ, "JAXDIST_CPU_DEVICES": "2", "PYTHONPATH": os.pathsep.join(sys.path)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxdist.cli", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i), "train", str(tmp_path / "config.yaml")],
            cwd=tmp_path / host, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i, host in enumerate("ab")
    ]
    for worker in workers:
        _, stderr = worker.communicate(timeout=120)
        assert worker.returncode == 2, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "jaxdist: error: the data differs across processes: the train split holds 198 examples on processes 0, "
        "218 examples on processes 1; every process must read the same data (same data.path contents on every host)")
