"""Helpers for multi-rank tests: compile programs, run a job on P real gloo ranks."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def compile_to(model_path: str, out_dir: str, **options) -> str:
    from shardbound.compiler.driver import compile_model
    from shardbound.passes.manager import PassOptions

    compile_model(model_path, out_dir, PassOptions(**options))
    return out_dir


def run_job(tmp_path, entries, methods, nproc, threads=1, tag="job", bounds=False,
            gradients=False) -> dict:
    """Results of tests/rank_driver.py run on `nproc` ranks: {(dir, method): result}; with
    `gradients`, also {(dir, "gradient"): forward values and input gradients}."""
    from shardbound.runtime.launch import launch

    job = tmp_path / f"{tag}_{nproc}.json"
    out = tmp_path / f"{tag}_{nproc}_out.json"
    job.write_text(json.dumps({"entries": entries, "methods": methods, "threads": threads,
                               "timeout": 180, "bounds": bounds,
                               "gradients": gradients}))
    if nproc == 1:
        from rank_driver import main

        main(str(job), str(out))
    else:
        log = tmp_path / f"{tag}_{nproc}.stderr"
        with open(log, "w") as err:
            code = launch(os.path.join(HERE, "rank_driver.py"), [str(job), str(out)], nproc, 180,
                          stderr=err)
        if code != 0:
            # A failed launch (a rendezvous port taken, a rank killed by the machine) is retried
            # once and reported with the ranks' last stderr lines; a bitwise mismatch never is
            # retried: that is checked by the caller.
            tail = " | ".join(log.read_text().strip().splitlines()[-6:])
            warnings.warn(f"rank job on {nproc} ranks failed with {code}; retrying once: {tail}")
            code = launch(os.path.join(HERE, "rank_driver.py"), [str(job), str(out)], nproc, 180)
        assert code == 0, f"rank job failed with {code}"
    data = json.loads(out.read_text())
    assert data["world"] == nproc
    return {(r["dir"], r["method"]): r for r in data["results"]}


def box_entry(directory, lower, upper) -> dict:
    return {"dir": str(directory), "lower": np.asarray(lower, dtype=np.float32).reshape(-1).tolist(),
            "upper": np.asarray(upper, dtype=np.float32).reshape(-1).tolist()}
