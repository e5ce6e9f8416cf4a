"""How the per-step metrics travel from the workers to the driver: several steps per `ray.train.report`.

Each `ray.train.report` is a barrier over the workers through an actor, and the report then waits for
the controller's next poll to take the one before it: at steps of a tenth of a second that cost more
than the loop without Ray spends on a step's last tenth. So the workers report about every
`run.report_every_s` seconds, and a report carries the rows of the steps since the previous one
(`pack` on the workers, `rows` on the driver, where every metrics sink still gets one row per step).
Checkpoint steps and the last step report at their step.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

log = logging.getLogger("raylora")
EARLIER_ROWS = "earlier_rows"  # the metrics key under which a report carries the rows before its own step


def rows(metrics: dict | None) -> list[dict]:
    """The per-step rows one report carries, oldest first: the inverse of `Reporter.take`."""
    if not metrics:
        return []
    row = dict(metrics)
    return [*row.pop(EARLIER_ROWS, []), row]


class Reporter:
    """Collects each step's row and decides at which steps to report, the same way on every rank.

    Every rank must call `ray.train.report` the same number of times, so the decision cannot rest on
    each rank's own clock. At each report rank 0 turns the seconds per step since the previous report
    into a number of steps until the next one and broadcasts it (one small collective per report).
    """

    def __init__(self, every_s: float, device: torch.device, step: int):
        self.every_s, self.device = every_s, device
        self.pending: list[dict] = []
        # The first step reports at once: its row shows quickly, and it times the steps that follow.
        self.next_step = step + 1
        self.since, self.since_step = time.perf_counter(), step

    def add(self, row: dict) -> None:
        """Keep a step's row until the next report; `wall_time` is when the step ended (seconds since
        the epoch), which the sinks use as the row's time rather than when the report reached them."""
        self.pending.append({**row, "wall_time": time.time()})

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def take(self, step: int) -> dict:
        """The metrics to report at `step` (its own row, the earlier unreported ones under EARLIER_ROWS),
        and the step of the next report. Every rank calls it at the same steps."""
        *earlier, last = self.pending
        self.pending = []
        self.next_step = step + self._steps_until_next(step)
        return {**last, EARLIER_ROWS: earlier} if earlier else last

    def _steps_until_next(self, step: int) -> int:
        if self.every_s <= 0:
            return 1
        now = time.perf_counter()
        per_step = (now - self.since) / max(1, step - self.since_step)
        self.since, self.since_step = now, step
        # Collectives carry tensors on the device the process group serves (NCCL: GPU only).
        steps = torch.tensor([max(1, int(self.every_s / max(per_step, 1e-6)))], device=self.device)
        dist.broadcast(steps, src=0)  # rank 0's clock decides for all
        return int(steps.item())


def log_progress(metrics: dict, bad_so_far: int, steps_per_s: float) -> None:
    """One line of the run's progress on rank 0's console."""
    step, max_steps = metrics["step"], metrics["max_steps"]
    log.info(
        "step %d/%d loss %.4f lr %.2e %.1f samples/s %.0f tokens/s bad rows %d eta %.0fs",
        step,
        max_steps,
        metrics["loss"],
        metrics["lr"],
        metrics["samples_per_s"],
        metrics["tokens_per_s"],
        bad_so_far,
        (max_steps - step) / max(steps_per_s, 1e-9),
    )


def log_preemption(info, step: int) -> None:
    """Say which nodes and ranks a coming preemption (a `ray.train.PreemptionInfo`) takes, and by when."""
    left = f"in {info.deadline_ms / 1000 - time.time():.0f} s" if info.deadline_ms else "at an unknown time"
    log.warning(
        "node(s) %s (ranks %s) will be preempted %s: checkpointing at every step from step %d until then",
        ", ".join(info.preempted_node_ids),
        info.preempted_ranks,
        left,
        step,
    )
