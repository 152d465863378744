"""One of two real processes for tests/test_data_multiprocess.py (run as a script, not collected).

    python tests/data_process.py PORT PROCESS_ID SHARD_DIR OUT_JSON

Resolves `data.workers: auto` as `jaxdist train` does, reads two epochs of train batches and one
eval pass through the config-driven iterators, builds each global batch on the config's mesh
spanning both processes, and writes what this process read and the gathered global batches as JSON.
"""

import json
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

import jaxdist
from jaxdist import config
from jaxdist.data import loader
from jaxdist.parallel import distributed, feed, layout


def main(port: str, process_id: str, shard_dir: str, out: str) -> None:
    jaxdist.use_cpu_devices()
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, int(process_id))
    cfg = config.from_dict({
        "data": {"source": "arrayrecord", "path": shard_dir},
        "model": {"seq_len": 16}, "train": {"global_batch": 8}, "eval": {"every": 1},
    })
    cfg = loader.resolve_workers(cfg)
    run_layout = layout.from_config(cfg)
    rows = run_layout.process_rows(cfg.train.global_batch)
    steps = -(-2 * len(loader.open_split(cfg, "train")) // 8)
    result = {"rows": list(rows.rows), "workers": cfg.data.workers, "sharing": distributed.processes_sharing_cores()}
    for name, batches in (("train", loader.train_iterator(cfg, rows)), ("eval", loader.eval_iterator(cfg, rows))):
        local, gathered, weights = [], [], []
        for _, batch in zip(range(steps), batches):
            global_batch = feed.assemble(batch, run_layout.batch_sharding, cfg.train.global_batch)
            local.append(batch["inputs"].tolist())
            gathered.append(np.asarray(multihost_utils.process_allgather(global_batch["inputs"], tiled=True)).tolist())
            if "weights" in batch:
                weights.append(batch["weights"].tolist())
        result[name] = {"local": local, "global": gathered, "weights": weights}
    with open(out, "w") as file:
        json.dump(result, file)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
