"""One of several real processes for tests/test_layouts_multiprocess.py (run as a script, not collected).

    python tests/layouts_process.py PORT PROCESS_ID NUM_PROCESSES CASES_JSON

Joins the others through jax.distributed (unless it is the only one), then trains each case's config (a dict for
`config.from_dict`) in turn with the `train` command's loop, and writes the rows of each global
batch this process fed to `<run_dir>/rows-<process id>.json`. A case whose training raises a
`UserError` writes its message to `<run_dir>/error-<process id>.txt` instead.
"""

import json
import sys
from pathlib import Path

import jax

import jaxdist
from jaxdist import config, loop
from jaxdist.errors import UserError
from jaxdist.parallel import layout


def main(port: str, process_id: str, num_processes: str, cases_file: str) -> None:
    jaxdist.use_cpu_devices()
    if int(num_processes) > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", int(num_processes), int(process_id))
    for raw in json.loads(Path(cases_file).read_text()):
        cfg = config.from_dict(raw)
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        rows = layout.from_config(cfg).process_rows(cfg.train.global_batch).rows
        (run_dir / f"rows-{process_id}.json").write_text(json.dumps(list(rows)))
        try:
            loop.train(cfg)
        except UserError as err:
            (run_dir / f"error-{process_id}.txt").write_text(str(err))
    if int(num_processes) > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
