"""Every benchmark at its --tiny size, one after the other in one process on one Ray: the smoke run
behind tests/test_bench.py (a check that each script works end to end, not a timing).

One process and one Ray for all scripts, and one scratch folder, so the tiny models and the digits are
built once: starting Python, importing torch and starting Ray per script cost more than most tiny runs.
Each script's worker groups are its own, as in its own runs.

    python bench/smoke.py --out DIR --work DIR SCRIPT [SCRIPT ...]     # e.g. throughput recovery

Each script writes DIR/SCRIPT.json as `python bench/SCRIPT.py --tiny --out DIR --work DIR` would;
a SCRIPT with flags, one argument ("checkpoint_stall --storage DIR"), runs with them too. DIR/smoke.json
says for each whether it finished, its traceback if not, and its seconds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

import common  # noqa: F401  (sets what every script's Ray needs before Ray starts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scripts", nargs="+", help="names of bench/ scripts, without .py, each with its flags")
    p.add_argument("--out", required=True, help="folder for each script's JSON and smoke.json")
    p.add_argument("--work", required=True, help="scratch folder shared by the scripts")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import ray

    from raylora.ray_runtime import init_ray

    init_ray(num_cpus=4)  # common.local_ray uses this one and leaves it running
    status = {}
    try:
        smoke(args.scripts, out, args.work, status)
    finally:
        ray.shutdown()


def smoke(scripts: list[str], out: Path, work: str, status: dict) -> None:
    """Run each script's main() as `bench/SCRIPT.py --tiny [its flags]`; record its outcome in status and
    smoke.json, under the script's name and flags."""
    for name in scripts:
        script, *flags = name.split()
        started = time.perf_counter()
        argv = sys.argv
        # as if run on its own: write_result records sys.argv as the command
        sys.argv = [f"bench/{script}.py", "--tiny", *flags, "--out", str(out), "--work", work]
        try:
            importlib.import_module(script).main()
            status[name] = {"ok": True}
        except Exception:  # the next scripts still run; the test names this one's traceback
            status[name] = {"ok": False, "error": traceback.format_exc()}
        finally:
            sys.argv = argv
        status[name]["seconds"] = time.perf_counter() - started
        outcome = "ok" if status[name]["ok"] else "FAILED"
        print(f"smoke: {name} {outcome} in {status[name]['seconds']:.0f} s", flush=True)
        (out / "smoke.json").write_text(json.dumps(status, indent=1))


if __name__ == "__main__":
    main()
