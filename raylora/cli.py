"""The `raylora` command."""

from __future__ import annotations

import argparse
import json
import sys

from raylora import console
from raylora.config import ConfigError


def _train(args) -> int:
    from raylora import config

    # The config first: a wrong key or type is reported in about a second, before torch, DeepSpeed and
    # Ray are imported (the driver's imports take about 9 s on 2 cores).
    cfg = config.load(args.config, [*args.overrides, *(["run.verbose=true"] if args.verbose else [])])

    import ray.train

    from raylora.driver import run
    from raylora.failures import PermanentError

    try:
        result = run(cfg)
    except (ray.train.TrainingFailedError, PermanentError) as err:
        print(f"raylora: run failed: {err}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {"checkpoint": result.checkpoint.path if result.checkpoint else None, "metrics": result.metrics},
            indent=2,
            default=str,
        )
    )
    return 0


def _tune(args) -> int:
    from raylora import config

    config.load(args.config, args.overrides)  # as for train: a config error before Ray is imported
    from raylora.tune import best, run_tune

    results = run_tune(
        args.config,
        args.overrides,
        args.space,
        num_samples=args.num_samples,
        max_concurrent=args.max_concurrent,
        resume=args.resume,
        metric=args.metric,
        mode=args.mode,
    )
    summary = best(results, args.metric, args.mode)
    print(json.dumps(summary, indent=2, default=str))
    print(f"best trial: {args.metric}={summary['value']} checkpoint={summary['checkpoint']}")
    return 1 if summary["errors"] else 0


def _demo(args) -> int:
    from raylora.demo import demo

    summary = demo(args.out, failure=not args.no_failure, arch=args.arch, overrides=args.overrides)
    print(json.dumps(summary, indent=2))
    return 0


def _make_tiny_model(args) -> int:
    from raylora.assets import make_tiny_model

    print(make_tiny_model(args.dir, args.arch))
    return 0


def _make_digits(args) -> int:
    from raylora.assets import make_digits

    for path in make_digits(args.dir):
        print(path)
    return 0


def _export(args) -> int:
    from raylora.export import export

    print(export(args.checkpoint, args.out, merge=args.merge, model_path=args.model, device=args.device))
    return 0


def _eval(args) -> int:
    from raylora.data.formats import check_source
    from raylora.evaluate import evaluate, inference_device, load_for_inference
    from raylora.export import base_model_path, local_checkpoint, verified_state

    inference_device(args.device)  # --device cuda on a node without one: said before anything is read
    with local_checkpoint(args.checkpoint) as folder:  # a URI is downloaded, then removed after loading
        state = verified_state(folder, args.checkpoint)
        model_path = base_model_path(state, args.model)
        check_source(args.data, "--data", args.format, args.image_root)
        model, processor = load_for_inference(folder, model_path, device=args.device)
    scores = evaluate(
        model,
        processor,
        args.data,
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        fmt=args.format,
        image_root=args.image_root,
    )
    device = str(next(model.parameters()).device)
    print(
        json.dumps({"checkpoint": args.checkpoint, "step": state.step, "device": device, **scores}, indent=2)
    )
    return 0


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def _prepare_data(args) -> int:
    from raylora.prepare import format_report, prepare, verdict

    kwargs = args.chat_template_kwargs
    summary = prepare(args.source, args.out, args.format, args.image_root, args.model, kwargs)
    print(format_report(summary))
    code, why = verdict(summary, args.max_bad_fraction)
    if why:
        print(f"raylora: error: {why}", file=sys.stderr)
    return code


def _inspect(args) -> int:
    from raylora.inspection import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.checkpoint)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["manifest"]["ok"] else 1


def _plot(args) -> int:
    from raylora.plot import plot

    print(plot(args.run_dir, args.out))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    from raylora.assets import TINY_ARCHS  # light: transformers is imported only when a model is built

    p = argparse.ArgumentParser(prog="raylora", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train from a YAML config (uses RAY_ADDRESS when set)")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=1e-4")
    t.add_argument(
        "--verbose",
        action="store_true",
        help="also print Ray's, DeepSpeed's and transformers' lines (run.verbose)",
    )
    t.set_defaults(fn=_train)
    tu = sub.add_parser("tune", help="a Ray Tune sweep of raylora runs; --resume finishes an interrupted one")
    tu.add_argument("config", help="base YAML config; each trial's run name is run.name plus its trial id")
    tu.add_argument("overrides", nargs="*", help="dotted key=value overrides of the base config")
    tu.add_argument(
        "--space", help="search space YAML: config key -> {choice|grid|uniform|loguniform|randint}"
    )
    tu.add_argument("--num-samples", type=int, default=4, help="trials to sample (default 4)")
    tu.add_argument(
        "--max-concurrent", type=int, default=None, help="trials running at once (default: as fit)"
    )
    tu.add_argument("--metric", default="loss", help="metric that ranks trials (default loss)")
    tu.add_argument("--mode", default="min", choices=["min", "max"])
    tu.add_argument("--resume", action="store_true", help="restore the sweep and finish unfinished trials")
    tu.set_defaults(fn=_tune)
    d = sub.add_parser("demo", help="tiny model + digits, 2 workers, one killed mid-run, then evaluate")
    d.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    d.add_argument("--no-failure", action="store_true", help="do not kill a worker mid-run")
    d.add_argument("--arch", default="llava", choices=TINY_ARCHS)
    d.add_argument("overrides", nargs="*", help="dotted key=value overrides of the demo's config")
    d.set_defaults(fn=_demo)
    m = sub.add_parser("make-tiny-model", help="write a tiny model folder built from config classes")
    m.add_argument("dir")
    m.add_argument("--arch", default="llava", choices=TINY_ARCHS)
    m.set_defaults(fn=_make_tiny_model)
    g = sub.add_parser(
        "make-digits", help="write DIR/train.parquet and DIR/eval.parquet from sklearn's digits"
    )
    g.add_argument("dir")
    g.set_defaults(fn=_make_digits)
    x = sub.add_parser(
        "export", help="write a checkpoint as a PEFT adapter folder, or merged as a full model"
    )
    x.add_argument("checkpoint", help="checkpoint folder: a path or a URI (s3://, gs://)")
    x.add_argument("--out", required=True, help="new (or empty) output folder: a path or a URI")
    x.add_argument("--merge", action="store_true", help="merge LoRA into the base model and save it whole")
    x.add_argument("--model", help="base model folder or Hub id (default: the checkpoint's state.json)")
    x.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),  # raylora.evaluate.DEVICES, without importing torch
        help="where --merge computes, in fp32 (default auto: a GPU when the node has one)",
    )
    x.set_defaults(fn=_export)
    e = sub.add_parser("eval", help="exact-match accuracy and answer loss of a checkpoint on a Parquet file")
    e.add_argument("checkpoint", help="checkpoint folder: a path or a URI (s3://, gs://)")
    e.add_argument("--data", required=True, help="held-out data file or folder, any supported format")
    e.add_argument("--format", help="the data's format (default: detected, as data.format)")
    e.add_argument("--image-root", help="folder that relative image paths are resolved against")
    e.add_argument("--max-samples", type=_positive_int, help="evaluate the first N rows only")
    e.add_argument("--batch-size", type=_positive_int, default=32, help="samples per batch (default 32)")
    e.add_argument("--model", help="base model folder or Hub id (default: the checkpoint's state.json)")
    e.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),  # raylora.evaluate.DEVICES, without importing torch
        help="where to score (default auto: a GPU in bf16 when the node has one, else the CPU in fp32)",
    )
    e.set_defaults(fn=_eval)
    pd = sub.add_parser(
        "prepare-data",
        help="check every row of a data source on Ray Data and write the layout training reads fastest",
    )
    pd.add_argument("source", help="data file or folder, any supported format (a path or pyarrow URI)")
    pd.add_argument("--out", required=True, help="new (or empty) output folder, seen by every node")
    pd.add_argument("--format", help="the source's format (default: detected, as data.format)")
    pd.add_argument("--image-root", help="folder that relative image paths are resolved against")
    pd.add_argument("--model", help="model folder or Hub id whose processor counts each row's tokens")
    pd.add_argument(
        "--chat-template-kwargs",
        type=_json_object,
        help="JSON for the model's chat template, as data.chat_template_kwargs "
        "(e.g. '{\"enable_thinking\": false}')",
    )
    pd.add_argument(
        "--max-bad-fraction",
        type=_fraction,
        default=0.01,
        help="exit 3 when more than this fraction of the rows is bad (default 0.01); 1 when none is good",
    )
    pd.set_defaults(fn=_prepare_data)
    i = sub.add_parser("inspect", help="a checkpoint's step, files, manifest check and trainable modules")
    i.add_argument("checkpoint", help="checkpoint folder: a path or a URI (s3://, gs://)")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(fn=_inspect)
    pl = sub.add_parser("plot", help="PNG of loss against step from a run folder's metrics log")
    pl.add_argument(
        "run_dir", help="run folder {run.storage_path}/{run.name}: a path or a URI (s3://, gs://)"
    )
    pl.add_argument("--out", help="output PNG, a path or a URI (default RUN_DIR/loss.png)")
    pl.set_defaults(fn=_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console.setup_logging(verbose=getattr(args, "verbose", False))
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"raylora: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
