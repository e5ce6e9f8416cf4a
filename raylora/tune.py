"""`raylora tune`: a Ray Tune sweep whose trials are raylora runs that survive faults.

With Ray Train V2 a trial is a driver function that builds and fits a `TorchTrainer`. Each trial's
run name is derived from its Tune trial id, never a timestamp, so a trial that Tune retries (its
`FailureConfig`) or that `--resume` restarts continues from its own adapter checkpoint. Metrics
reach Tune through Ray's `TuneReportCallback`.

The search space is YAML: dotted config keys mapped to one Tune sampler each, e.g.

    train.lr: {loguniform: [1.0e-4, 3.0e-3]}
    lora.r: {choice: [8, 16]}
"""

from __future__ import annotations

import logging
import posixpath
from pathlib import Path
from typing import Any

import yaml
from ray import tune

from raylora import config, config_checks
from raylora.config import ConfigError
from raylora.reporting import rows

log = logging.getLogger("raylora")

SAMPLERS = {
    "choice": lambda v: tune.choice(list(v)),
    "grid": lambda v: tune.grid_search(list(v)),
    "uniform": lambda v: tune.uniform(*v),
    "loguniform": lambda v: tune.loguniform(*v),
    "randint": lambda v: tune.randint(*v),
}


def load_space(path: str | Path, base: config.Config) -> dict[str, Any]:
    """Parse a search-space YAML into Tune samplers; keys must be config keys."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"search space file not found: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path}: expected a mapping of config keys to samplers")
    known = config.from_dict(base.to_dict()).to_dict()
    space = {}
    for key, spec in raw.items():
        section, _, field = key.partition(".")
        if section not in known or field not in known[section]:
            raise ConfigError(f"{path}: {key} is not a config key")
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SAMPLERS:
            raise ConfigError(f"{path}: {key} needs one sampler of {', '.join(SAMPLERS)}, got {spec!r}")
        kind, values = next(iter(spec.items()))
        space[key] = SAMPLERS[kind](values)
    return space


def trial_config(base: dict[str, Any], sample: dict[str, Any], trial_id: str) -> config.Config:
    """The run config of one trial: base plus its sampled values, named after the trial id."""
    data = config.apply_overrides(_copy(base), [f"{k}={_yaml(v)}" for k, v in sample.items()])
    data["run"]["name"] = f"{data['run']['name']}-{trial_id}"
    cfg = config.from_dict(data)
    config_checks.validate(cfg)
    return cfg


def _copy(data: dict) -> dict:
    return yaml.safe_load(yaml.safe_dump(data))


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def make_driver(base: dict[str, Any]):
    """The Tune trainable: one trial = one raylora run, reporting through TuneReportCallback."""

    def driver(sample: dict[str, Any]) -> None:
        from ray.tune.integration.ray_train import TuneReportCallback

        from raylora.driver import make_trainer

        class TuneReport(TuneReportCallback):
            """Tune gets one result per report, its last step's row; the metrics sinks get every step's."""

            def after_report(self, run_context, metrics, checkpoint) -> None:
                super().after_report(run_context, [rows(m)[-1] if m else m for m in metrics], checkpoint)

        cfg = trial_config(base, sample, tune.get_context().get_trial_id())
        result = make_trainer(cfg, callbacks=[TuneReport()]).fit()
        if result.error:
            raise result.error

    return driver


def experiment_path(cfg: config.Config) -> str:
    return posixpath.join(cfg.run.storage_path, f"{cfg.run.name}-tune")


def run_tune(
    config_path: str,
    overrides: list[str],
    space_path: str | None,
    num_samples: int = 4,
    max_concurrent: int | None = None,
    resume: bool = False,
    metric: str = "loss",
    mode: str = "min",
    max_trial_failures: int = 2,
):
    """Run (or with `resume`, restore and finish) a sweep; returns Tune's ResultGrid."""
    from raylora.preflight import check_shared_storage, preflight
    from raylora.ray_runtime import init_ray

    base_cfg = config.load(config_path, overrides)
    preflight(base_cfg)
    base = base_cfg.to_dict()  # local paths already absolute: trials run in other working directories
    if not resume and space_path is None:
        raise ConfigError("raylora tune needs --space SPACE.yaml (or --resume)")
    space = load_space(space_path, base_cfg) if space_path else {}
    init_ray()
    check_shared_storage(base_cfg.run.storage_path)
    # A trial's own process only drives Ray Train; its workers hold the CPUs and GPUs. (Tune refuses
    # a trial with no resources at all, hence a sliver of a CPU.)
    trainable = tune.with_resources(make_driver(base), {"CPU": 0.01})
    path = experiment_path(base_cfg)
    if resume:
        if not tune.Tuner.can_restore(path):
            raise ConfigError(f"--resume: no Tune experiment to restore at {path}")
        log.info("restoring the sweep at %s", path)
        tuner = tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(
                num_samples=num_samples, max_concurrent_trials=max_concurrent, metric=metric, mode=mode
            ),
            run_config=tune.RunConfig(
                name=posixpath.basename(path),
                storage_path=posixpath.dirname(path),
                failure_config=tune.FailureConfig(max_failures=max_trial_failures),
            ),
        )
    results = tuner.fit()
    return results


def best(results, metric: str = "loss", mode: str = "min") -> dict[str, Any]:
    """The best trial's metric, config and checkpoint path."""
    result = results.get_best_result(metric=metric, mode=mode)
    return {
        "metric": metric,
        "value": result.metrics.get(metric),
        "config": result.config,
        "checkpoint": result.metrics.get("checkpoint_path"),
        "errors": sum(1 for r in results if r.error),
    }
