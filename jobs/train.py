"""Entry point that `ray job submit` runs: `python jobs/train.py CONFIG [key=value ...]`.

Inside a Ray job, RAY_ADDRESS points at the cluster, so the run's workers are placed on it. Run again
with the same run.name to resume from the latest checkpoint in run.storage_path.
"""

import sys

from raylora.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
