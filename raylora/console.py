"""What a run prints: raylora's progress lines, evaluations, restarts and errors, and little else.

Ray Train logs every `report` at INFO (35 lines for the demo), transformers and torch warn about
deprecated names once per worker and restart, and DeepSpeed logs its setup at INFO; together they bury
the progress lines. `run.verbose: true` (or `raylora train --verbose`) leaves them all as they are.
"""

from __future__ import annotations

import logging
import warnings

FORMAT = "%(asctime)s raylora %(message)s"


def setup_logging(verbose: bool) -> None:
    """raylora's own lines at INFO; unless `verbose`, the libraries' warnings and chatter quieted."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    if verbose:
        return
    for module in ("torch", "transformers", "deepspeed", "peft"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def setup_worker_logging(verbose: bool) -> None:
    """`setup_logging`, and in a Ray Train worker its per-report and per-upload lines quieted."""
    setup_logging(verbose)
    if verbose:
        return
    # Ray Train 2.60 names this logger by its file path (`logging.getLogger(__file__)`), so it is reached
    # through the module rather than a dotted name.
    from ray.train.v2._internal.execution import context

    context.logger.setLevel(logging.WARNING)
    logging.getLogger("ray.train.v2._internal.execution.storage").setLevel(logging.WARNING)  # per upload
