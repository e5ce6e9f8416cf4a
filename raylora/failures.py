"""An error that comes back on every attempt ends the run once, instead of `run.max_failures` times.

Ray Train 2.60 retries every worker error (its failure policy is not pluggable), and every attempt
loads the model again: minutes per try on GPU nodes. So a worker sorts what fails its start (before
the first step): an error that does not depend on timing, such as a config the workers reject, a
checkpoint made for another model, a file missing on the node, or the engine refusing the model's
dtypes (DeepSpeed's assertions), is raised as `PermanentError`. A callback in Ray Train's controller
ends the run as soon as a worker raises one (Ray does not retry a callback error), and `driver.run`
raises it. Worker deaths, lost nodes, collective errors and storage errors (`OSError`) are left to
Ray's retries, and so is every error once training steps have begun.

Why a controller callback rather than a marker file that the next attempt's workers find and stop on:
the callback ends the run at the first poll after the error, before Ray starts another worker group,
and leaves nothing in the run folder that must be cleared before a fixed config runs under the same name.
"""

from __future__ import annotations

from ray.train import UserCallback

from raylora.checkpoint import CheckpointError

# What a worker's start raises when retrying cannot help. ValueError covers raylora's ConfigError.
# FileNotFoundError and PermissionError are the OSErrors that do not go away by themselves; any other
# OSError may be a network error or a timeout.
PERMANENT = (
    ValueError,
    TypeError,
    AssertionError,
    ImportError,
    FileNotFoundError,
    PermissionError,
    CheckpointError,
)


# Not a TrainingFailedError: Ray Train's controller takes those for its own and has no decision for
# an unknown kind; any other error from a callback is a controller error, which it does not retry.
class PermanentError(RuntimeError):
    """A worker error that would come back on every attempt; the run ends at once with it."""

    @classmethod
    def at_start(cls, err: BaseException, rank: int) -> PermanentError:
        return cls(
            f"rank {rank}: {type(err).__name__}: {err} (raised before the first step and would be raised "
            f"again on every attempt, so the run is not retried)"
        )


class EndOnPermanentError(UserCallback):
    """Ends the run when a worker raised `PermanentError`: the error goes to the driver, not to a retry."""

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        for _, err in sorted(worker_exceptions.items()):
            if isinstance(err, PermanentError):
                raise err
