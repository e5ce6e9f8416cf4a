"""The `raylora` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from raylora.config import ConfigError


def _train(args) -> int:
    from raylora import config
    from raylora.driver import run

    cfg = config.load(args.config, args.overrides)
    result = run(cfg)
    if result.error:
        print(f"raylora: run failed: {result.error}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {"checkpoint": result.checkpoint.path if result.checkpoint else None, "metrics": result.metrics},
            indent=2,
            default=str,
        )
    )
    return 0


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raylora", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train from a YAML config (uses RAY_ADDRESS when set)")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=1e-4")
    t.set_defaults(fn=_train)
    d = sub.add_parser("demo", help="tiny model + digits, 2 workers, one killed mid-run, then evaluate")
    d.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    d.add_argument("--no-failure", action="store_true", help="do not kill a worker mid-run")
    d.add_argument("--arch", default="llava", choices=["llava", "qwen2_vl"])
    d.add_argument("overrides", nargs="*", help="dotted key=value overrides of the demo's config")
    d.set_defaults(fn=_demo)
    m = sub.add_parser("make-tiny-model", help="write a tiny model folder built from config classes")
    m.add_argument("dir")
    m.add_argument("--arch", default="llava", choices=["llava", "qwen2_vl"])
    m.set_defaults(fn=_make_tiny_model)
    g = sub.add_parser(
        "make-digits", help="write DIR/train.parquet and DIR/eval.parquet from sklearn's digits"
    )
    g.add_argument("dir")
    g.set_defaults(fn=_make_digits)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s raylora %(message)s")
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"raylora: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
