"""Training steps per second: raylora on Ray Train against the same DeepSpeed loop without Ray.

1. raylora: `raylora.driver` (preflight, TorchTrainer with raylora's callbacks, `fit`) on a tiny config,
   reporting metrics every `run.report_every_s` (its default); step times are the `wall_time` of each
   step's row (when the step ended on rank 0), as the metrics reach Ray Train's controller (a callback),
   so the time spent in the reports between steps is included.
2. The same, reporting every step (`run.report_every_s=0`): what raylora did before it batched reports
   (not at --tiny, the smoke test), after all the pairs of 1 and 3.
3. The same ZeRO-3 loop without Ray: 2 processes from torch.multiprocessing, gloo, calling
   `raylora.worker.setup` and `raylora.worker.train_step` directly; same model, config and batches.

Each repeat runs 1 and 3 back to back (a pair); the next repeat runs them in the opposite order, so
that the drift of the machine's speed between the two runs of a pair counts for raylora in half the
pairs and against it in the other half. The runs of 2 come after all the pairs.

`alongside` (the goal's pairs): as many pairs again, each a whole raylora run (as in 1) and the loop of 3
up at once, taking turns every 0.25 s: the side whose turn it is runs, every process of the other side
(raylora's workers, controller and report barrier actor; the plain processes) is stopped with SIGSTOP
until its next turn, and each side's steps/s counts its own turns only. On this shared machine the speed
moves by 10-25% within seconds, so back-to-back pairs of whole runs scatter from 0.77 to 1.25 (2026-12-05);
pairs taking turns every 0.25 s from 0.93 to 0.95 in one series and 0.92 to 0.99 in another. Ray's
cluster processes (raylet, GCS, agents, log monitor, idle workers) run through both sides' turns, as they
run beside both halves of a sequential pair. What the run does per second of wall time (a report every
`run.report_every_s`, a controller poll every `controller_poll_s`) comes at twice those intervals, since the
run has half of the wall time: per step of its own, it reports and is polled as often as a run alone.

4. `in_worker`: where the difference sits, measured so that the machine's drift cancels. On this shared
   machine a whole run's speed moves by up to 2x from one minute to the next, more than the difference
   looked for. So two process pairs are up at once, Ray Train workers (a probe group) and plain
   processes, each after the same setup and warm-up steps, and they take turns: blocks of `train_step`
   calls, one side's block, then the other's, while the side whose turn it is not waits (rank 0 polls a
   file every 20 ms, the other ranks wait in a gloo barrier). Each pair of adjacent blocks gives a ratio.
   Without reports, checkpoints or the controller's work for a run, it isolates what running inside a
   Ray Train worker process costs `train_step` itself; with each block, the training thread's CPU time
   and its and the whole process's context switches (/proc).
5. `--where`: the same taking turns between a plain Ray actor process (no Ray Train) and plain processes,
   then between Ray Train workers and plain Ray actor processes (`where`): how much of the `in_worker`
   difference any Ray worker process has, and how much Ray Train adds.
6. `--floor`: what raylora's own choices about Ray cost. Pairs taking turns as in `alongside`, alternating
   between raylora's run as it runs and the same run with the least of what raylora decides: a report at
   its first and last step only (each report is a cross-rank barrier through an actor) and the controller
   polling every 1 s instead of 0.25 s. What the least run still loses to the plain loop is what Ray costs
   whatever raylora does.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import common

from raylora.demo import DEMO_SETTINGS, DEMO_WIDTH
from tests.support import tiny_run_config

THREADS = common.PLAIN_THREADS  # each plain process, as a Ray worker holding 1 CPU


def plain_worker(rank: int, world: int, rendezvous: str, cfg, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    common.plain_process_group(rank, world, rendezvous)
    from raylora import worker

    s = worker.setup(cfg, None)
    times = []
    for _ in range(steps):
        worker.train_step(s)
        times.append(time.time())
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "threads": torch.get_num_threads()}))
    dist.barrier()
    dist.destroy_process_group()


def plain_worker_alongside(
    rank: int, world: int, rendezvous: str, cfg, warmup: int, ticks: str, go: str
) -> None:
    """The loop without Ray for `alongside`: `warmup` steps, then (once the file `go` exists) steps until
    the bench stops it, rank 0 appending each step's end time to `ticks`, a line per step."""
    import torch.distributed as dist

    common.plain_process_group(rank, world, rendezvous)
    from raylora import worker

    s = worker.setup(cfg, None)
    for _ in range(warmup):
        worker.train_step(s)
    if rank == 0:
        Path(f"{ticks}.ready").touch()
        while not Path(go).exists():
            time.sleep(0.02)
    dist.barrier()
    with open(ticks if rank == 0 else os.devnull, "w", buffering=1) as out:
        for _ in range(warmup, cfg.train.max_steps):
            worker.train_step(s)
            out.write(f"{time.time()}\n")


# The processes of one raylora run (its Ray Train workers, its controller, its report barrier's actor),
# by their command lines. The cluster's own processes (raylet, GCS, agents, log monitor, idle workers, Ray
# Train's detached autoscaling coordinator) are not the run's: they go on through both sides' turns, as
# they run beside both halves of a sequential pair.
RUN_PROCESSES = ("ray::RayTrainWorker", "ray::TrainController", "ray::SynchronizationActor")


def _run_processes(cmdlines: dict[int, str]) -> dict[int, str]:
    return {pid: c for pid, c in cmdlines.items() if any(m in c for m in RUN_PROCESSES)}


def _cmdlines() -> dict[int, str]:
    return {pid: cmdline for pid, cmdline, _ in common.processes()}


def active_rate(ticks: list[float], windows: list[tuple[float, float]]) -> tuple[float, int]:
    """Steps per second of a side's own time: from the first step that ended inside one of its `windows`
    to the last, the steps in between over the part of its windows between them (the side is stopped
    outside its windows). Returns (steps/s, steps counted)."""
    inside = [i for i, t in enumerate(ticks) if any(a <= t <= b for a, b in windows)]
    if len(inside) < 2:
        raise RuntimeError(f"alongside: {len(inside)} step(s) ended inside the side's turns; need 2")
    first, last = ticks[inside[0]], ticks[inside[-1]]
    active = sum(max(0.0, min(b, last) - max(a, first)) for a, b in windows)
    return (inside[-1] - inside[0]) / active, inside[-1] - inside[0]


TURN_SIDES = 2  # `alongside`: raylora and the plain loop, each running half of the wall time


def alongside(
    work: Path,
    cfg,
    name: str,
    warmup: int,
    windows: int,
    window_s: float,
    first: str,
    poll_s: float | None = None,
) -> dict:
    """One pair, drift cancelled: raylora's whole run (`make_trainer(...).fit()`: reports, the controller's
    polls, its final checkpoint) and the loop without Ray, both up at once, take turns on the machine
    every `window_s` seconds, `windows` turns each: the side whose turn it is runs, every process of the
    other side is stopped (SIGSTOP, SIGCONT at its next turn). `first` starts; the order flips each round.
    Each side's steps/s is over its own turns only (`active_rate`). `poll_s`: the controller's poll
    interval of a lone run (default: raylora's, `controller_poll_s`)."""
    import signal

    import torch.multiprocessing as mp

    from raylora.driver import POLL_ENV, controller_poll_s, make_trainer, preflight

    # enough steps that the run outlasts the turns at up to 18 steps/s (about 11 here); the rest it runs
    # alone after the turns
    steps = warmup + int(18 * windows * window_s) + 60
    # What a run does on a clock it does per second of wall time: a report every run.report_every_s
    # (a number of steps worked out from the steps' wall times) and a controller poll every
    # controller_poll_s. Taking turns, the run has half of the wall time, so it would report and be polled
    # twice as often per step of its own as a run alone (as it was until 2026-12-06: 0.934, 0.951 and 0.898
    # against 0.978, 0.996 and 0.981 with reports every 4 s, pairs in turn). Both intervals are doubled,
    # so that per step the run reports and is polled as often as alone.
    every_s = cfg(f"alongside-{name}").run.report_every_s
    c = cfg(
        f"alongside-{name}",
        f"train.max_steps={steps}",
        f"train.checkpoint_every={steps}",
        f"run.report_every_s={TURN_SIDES * every_s:g}",
    )
    poll_s = TURN_SIDES * (controller_poll_s(every_s) if poll_s is None else poll_s)
    preflight(c)
    clock, ticks, go = (work / f"{k}-alongside-{name}" for k in ("clock", "ticks", "go"))
    for leftover in (clock, ticks, go, Path(f"{ticks}.ready")):
        leftover.unlink(missing_ok=True)
    before = set(_run_processes(_cmdlines()))  # a probe group's workers (bench/smoke.py) are not this run's
    got: dict = {}

    def fit() -> None:
        try:
            got["result"] = make_trainer(c, [common.step_clock(clock)]).fit()
        except BaseException as err:  # noqa: BLE001 - handed to the bench's thread
            got["error"] = err

    thread = threading.Thread(target=fit, name="alongside-raylora")
    os.environ[POLL_ENV] = f"{poll_s:g}"  # Trainer.fit leaves a poll interval that the environment holds
    thread.start()
    sides: dict[str, list[int]] = {"plain": [], "raylora": []}
    plain = None

    def signal_all(pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # a side that ended meanwhile: found out below
                pass

    turns: dict[str, list[tuple[float, float]]] = {"raylora": [], "plain": []}
    try:
        with common.raylora_worker_env():  # as raylora's Train workers start: Ray is the difference
            plain = mp.start_processes(
                plain_worker_alongside,
                args=(
                    2,
                    common.rendezvous(),
                    cfg(f"alongside-plain-{name}", f"train.max_steps={10 * steps}"),
                    warmup,
                    str(ticks),
                    str(go),
                ),
                nprocs=2,
                join=False,
                start_method="spawn",
            )
        sides["plain"] = [p.pid for p in plain.processes]
        deadline = time.monotonic() + 900
        while not (
            Path(f"{ticks}.ready").exists()
            and max((r["step"] for r in common.read_clock(clock)), default=0) >= warmup
        ):
            if not thread.is_alive() or not all(p.is_alive() for p in plain.processes):
                raise RuntimeError(f"alongside: a side ended before the turns: {got.get('error')!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("alongside: the sides did not warm up in 900 s")
            time.sleep(0.05)
        run = {pid: c for pid, c in _run_processes(_cmdlines()).items() if pid not in before}
        workers = [pid for pid, c in run.items() if "RayTrainWorker" in c]
        if len(workers) != 2 or not any("TrainController" in c for c in run.values()):
            raise RuntimeError(f"alongside: expected 2 Ray Train workers and a controller, found {run}")
        sides["raylora"] = list(run)
        bound = {pid: bound_threads(pid) for pid in workers}
        signal_all(sides["raylora"], signal.SIGSTOP)
        signal_all(sides["plain"], signal.SIGSTOP)
        go.touch()  # the plain side passes its gate in its first turn
        order = (first, "plain" if first == "raylora" else "raylora")
        for turn in range(windows):
            for side in order if turn % 2 == 0 else order[::-1]:
                signal_all(sides[side], signal.SIGCONT)
                start = time.time()
                time.sleep(window_s)
                signal_all(sides[side], signal.SIGSTOP)
                turns[side].append((start, time.time()))
    finally:
        for procs in sides.values():
            signal_all(procs, signal.SIGCONT)
        for proc in plain.processes if plain is not None else []:
            proc.kill()
            proc.join()
        thread.join()
        os.environ.pop(POLL_ENV, None)
    if "error" in got:
        raise RuntimeError(f"alongside: raylora's run failed: {got['error']!r}")
    assert got["result"].error is None, got["result"].error
    rows = [r for r in common.read_clock(clock) if r["restarts"] == 0]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "a step's row is missing"
    ray_ticks = [r["t"] for r in rows]
    if ray_ticks[-1] < turns["raylora"][-1][1]:
        raise RuntimeError(f"alongside: raylora's {steps} steps ended before its turns did")
    plain_ticks = [float(line) for line in ticks.read_text().split()]
    ray_rate, ray_steps = active_rate(ray_ticks, turns["raylora"])
    plain_rate, plain_steps = active_rate(plain_ticks, turns["plain"])
    return {
        "first": first,
        "raylora_steps_per_s": ray_rate,
        "plain_steps_per_s": plain_rate,
        "raylora_over_plain": ray_rate / plain_rate,
        "steps_counted": {"raylora": ray_steps, "plain": plain_steps},
        "seconds_of_turns": {side: sum(b - a for a, b in w) for side, w in turns.items()},
        "raylora_report_every_s": c.run.report_every_s,
        "raylora_reports": len({r["reported"] for r in rows}),
        "raylora_controller_poll_s": poll_s,
        # each Ray Train worker's threads bound to fewer cores than its process may use, after the warm-up
        # (scaling.bind_cores: the training thread alone)
        "raylora_bound_threads": list(bound.values()),
    }


def bound_threads(pid: int) -> list[list[int]]:
    """The cores of each thread of process `pid` that may run on fewer cores than the process's main
    thread (/proc/PID/task/TID/status: Cpus_allowed_list)."""

    def cores(status: Path) -> list[int]:
        line = next(x for x in status.read_text().splitlines() if x.startswith("Cpus_allowed_list:"))
        out = []
        for part in line.split(":", 1)[1].strip().split(","):
            first, _, last = part.partition("-")
            out += range(int(first), int(last or first) + 1)
        return out

    every = cores(Path(f"/proc/{pid}/status"))
    threads = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        try:
            mine = cores(task / "status")
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        if mine != every:
            threads.append(mine)
    return threads


def _switches(path: str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of the thread or process whose /proc status is `path`."""
    fields = dict(line.split(":\t") for line in Path(path).read_text().splitlines() if ":\t" in line)
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def _process_switches() -> int:
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            total += sum(_switches(str(task / "status")))
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total


SIDES = ("ray", "plain")


def take_turns(side: str, turn: str, cfg, blocks: int, n: int, sides: tuple = SIDES) -> list[dict]:
    """One side of `in_worker` (module docstring), on every rank: setup and 3 warm-up steps, then
    `blocks` blocks of `n` train_steps taking turns with the other of `sides` (`common.Turns`). Returns
    (rank 0's) each block's seconds, the training thread's CPU seconds (`time.thread_time`), context
    switches (the training thread's, voluntary and involuntary, and all threads' of the process) and
    cores. The Ray Train side binds its training thread as raylora's loop does (`worker.bind_cores`); the
    plain processes, as users start them, and the plain Ray actors of `where` do not."""
    from raylora import worker

    turns = common.Turns(turn, sides, side)
    s = worker.setup(cfg, None)
    if side == "ray":  # as raylora's training loop binds its thread (scaling.bind_cores)
        import ray.train

        context = ray.train.get_context()
        worker.bind_cores(cfg, context.get_local_rank(), context.get_local_world_size())
    for _ in range(3):
        worker.train_step(s)
    turns.ready()
    rows = []
    for block in range(blocks):
        turns.wait(block)
        thread, process = _switches("/proc/thread-self/status"), _process_switches()
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            worker.train_step(s)

        def record(start=start, cpu=cpu, thread=thread, process=process) -> None:
            seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
            after = _switches("/proc/thread-self/status")
            rows.append(
                {
                    "seconds": seconds,
                    "thread_cpu_seconds": cpu,
                    "thread_switches": [a - b for a, b in zip(after, thread, strict=True)],
                    "process_switches": _process_switches() - process,
                    "cores": sorted(os.sched_getaffinity(0)),  # the training thread's
                }
            )

        turns.done(block, record)
    turns.finish(blocks)
    return rows


def _plain_turns(
    rank: int,
    world: int,
    rendezvous: str,
    cfg,
    blocks: int,
    n: int,
    turn: str,
    out: str,
    sides: tuple = SIDES,
) -> None:
    import torch.distributed as dist

    common.plain_process_group(rank, world, rendezvous)
    try:
        rows = take_turns("plain", turn, cfg, blocks, n, sides)
    except BaseException:
        common.Turns(turn, sides, "plain").fail()
        raise
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _actor_turns(
    rank: int, world: int, rendezvous: str, cfg, blocks: int, n: int, turn: str, side: str, sides
):
    """A side of `where` in a plain Ray task (a Ray worker process without Ray Train): its own gloo
    group, as the plain processes have. Returns rank 0's blocks."""
    import torch.distributed as dist

    common.plain_process_group(rank, world, rendezvous)
    try:
        rows = take_turns(side, turn, cfg, blocks, n, sides)
    except BaseException:
        common.Turns(turn, sides, side).fail()
        raise
    dist.barrier()
    dist.destroy_process_group()
    return rows


def _ratios(first: list[dict], second: list[dict], n: int) -> dict:
    """Each adjacent pair of blocks' steps/s ratio (first side over second), and the process's context
    switches per step at the median, of each side's rank 0."""
    per_block = [b["seconds"] / a["seconds"] for a, b in zip(first, second, strict=True)]
    return {
        "per_block": per_block,
        "median": common.median(per_block),
        "process_switches_per_step": [
            common.median([r["process_switches"] / n for r in side]) for side in (first, second)
        ],
    }


def where(work: Path, cfg, blocks: int, n: int) -> dict:
    """`--where`: which part of a Ray Train worker the `in_worker` difference belongs to, by two more
    comparisons taking turns: a plain Ray actor process (a Ray task holding 1 CPU, its own gloo group;
    no Ray Train) against plain processes, and Ray Train workers against plain Ray actor processes. The
    first is what any Ray worker process costs (its core worker's threads, the main thread's 10 ms signal
    check); the second, what Ray Train adds (its training thread, the controller's polls)."""
    import ray
    import torch.multiprocessing as mp

    from raylora.driver import worker_env

    work.mkdir(parents=True, exist_ok=True)
    # max_calls=1: a fresh process for each call, as the plain processes and Ray Train's workers are
    # raylora's worker env, as raylora's Train workers and the plain processes start with it
    remote = ray.remote(num_cpus=1, max_retries=0, max_calls=1, runtime_env={"env_vars": worker_env()})(
        _actor_turns
    )

    def actors(turn: str, sides: tuple) -> list:
        """The two plain Ray actor processes' side, started; their refs."""
        common.Turns.start(turn, sides)
        rendezvous = common.rendezvous()
        return [remote.remote(r, 2, rendezvous, cfg, blocks, n, turn, "actor", sides) for r in range(2)]

    out = {}
    sides = ("actor", "plain")
    turn = str(work / "turn-actor-plain")
    refs = actors(turn, sides)
    plain_out = work / "turns-plain-beside-actor.json"
    with common.raylora_worker_env():
        mp.spawn(
            _plain_turns, args=(2, common.rendezvous(), cfg, blocks, n, turn, str(plain_out), sides), nprocs=2
        )
    out["actor_over_plain"] = _ratios(ray.get(refs)[0], json.loads(plain_out.read_text()), n)

    sides = ("train", "actor")
    turn = str(work / "turn-train-actor")
    refs = actors(turn, sides)
    try:
        train = common.on_workers(
            lambda: take_turns("train", turn, cfg, blocks, n, sides), work / "where", "throughput-where"
        )
    except BaseException:
        common.Turns(turn, sides, "train").fail()
        ray.get(refs)  # the actors' error, when it was theirs
        raise
    out["train_over_actor"] = _ratios(train, ray.get(refs)[0], n)
    return out


def in_worker(work: Path, cfg, blocks: int, n: int) -> dict:
    """`train_step` in Ray Train workers against plain processes, blocks taking turns (module docstring)."""
    import torch.multiprocessing as mp

    work.mkdir(parents=True, exist_ok=True)
    turn, out = str(work / "turn"), work / "turns-plain.json"
    common.Turns.start(turn, SIDES)
    got: dict = {}

    def ray_side() -> None:
        try:
            got["ray"] = common.on_workers(
                lambda: take_turns("ray", turn, cfg, blocks, n), work / "ray", "throughput-turns"
            )
        except BaseException as err:
            got["error"] = err
            common.Turns(turn, SIDES, "ray").fail()

    thread = threading.Thread(target=ray_side, name="in-worker-ray-side")
    thread.start()
    try:
        with common.raylora_worker_env():
            mp.spawn(_plain_turns, args=(2, common.rendezvous(), cfg, blocks, n, turn, str(out)), nprocs=2)
    finally:
        thread.join()
    if "error" in got:
        raise RuntimeError(f"in_worker: the Ray side failed: {got['error']!r}")
    rows = {"ray": got["ray"], "plain": json.loads(out.read_text())}
    rates = {side: [n / r["seconds"] for r in rows[side]] for side in SIDES}
    per_block = [r / p for r, p in zip(rates["ray"], rates["plain"], strict=True)]
    cpu_per_block = [
        r["thread_cpu_seconds"] / p["thread_cpu_seconds"]
        for r, p in zip(rows["ray"], rows["plain"], strict=True)
    ]

    def per_step(side: str, key) -> float:
        return common.median([key(r) / n for r in rows[side]])

    return {
        "blocks": blocks,
        "steps_per_block": n,
        "ray_worker_steps_per_s": common.summary(rates["ray"]),
        "plain_process_steps_per_s": common.summary(rates["plain"]),
        "ray_over_plain_per_block": per_block,
        "ray_over_plain": common.median(per_block),
        # the same steps' CPU in the training thread: more in the Ray worker means it gets less done per
        # CPU second, not that it waits more (bench/HISTORY.md: "Where the workers' lower speed per CPU
        # second goes")
        "training_thread_cpu_ms_per_step_rank0": {
            side: common.summary([1000 * r["thread_cpu_seconds"] / n for r in rows[side]]) for side in SIDES
        },
        "training_thread_cpu_ray_over_plain_per_block": cpu_per_block,
        "training_thread_cpu_ray_over_plain": common.median(cpu_per_block),
        "training_thread_cores_rank0": {side: rows[side][0]["cores"] for side in SIDES},
        "context_switches_per_step_rank0": {
            side: {
                "training_thread_voluntary": per_step(side, lambda r: r["thread_switches"][0]),
                "training_thread_involuntary": per_step(side, lambda r: r["thread_switches"][1]),
                "all_threads_of_the_process": per_step(side, lambda r: r["process_switches"]),
            }
            for side in SIDES
        },
    }


def rate(times: list[float], warmup: int) -> float:
    """Steps per second between the end of step `warmup` and the end of the second-last step (the last
    one also writes the final checkpoint)."""
    window = times[warmup - 1 : -1]
    return (len(window) - 1) / (window[-1] - window[0])


# The demo's step: its model width and its batch, LoRA and trained-module settings (not its schedule,
# checkpoints, evaluation or fault drill, which the loop without Ray does not have).
STEP_KEYS = (
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.freeze_vision",
    "train.freeze_aligner",
)
DEMO_STEP = [s for s in DEMO_SETTINGS if s.startswith(STEP_KEYS) or s.startswith("lora.")]
# (label, width, layers, overrides): the demo's step (about 0.3 s here), the tests' tiny run (steps of
# about 0.1 s), to tell a fixed cost per step (each report is a cross-rank barrier through an actor)
# from a share of the CPU (Ray's own processes and the controller's polling, on 2 cores that the 2
# workers already fill); --tiny measures width 32 only.
SIZES = [("demo", DEMO_WIDTH, 2, DEMO_STEP), ("tiny", 64, 2, [])]
VARIANTS = {"raylora": [], "raylora_every_step": ["run.report_every_s=0"]}


def _configs(args, work: Path, size: tuple, steps: int):
    """`cfg(name, *more)`: the run config of `size` (SIZES) under `name`, with `more` overrides."""
    _, width, layers, overrides = size
    model, data = common.tiny_model(args.work, width, layers), common.digits(args.work)

    def cfg(name: str, *more: str):
        return tiny_run_config(
            model,
            data,
            work / "ray",
            name,
            *overrides,
            # batches built inline, in the training process, as the loop without Ray builds them (and as
            # the demo does); the background pipeline is measured by bench/pipeline.py
            "data.workers=0",
            f"train.max_steps={steps}",
            f"train.checkpoint_every={steps}",
            *more,
        )

    return cfg


def turn_blocks(args) -> tuple[int, int]:
    """(blocks, steps per block) of the comparisons taking turns."""
    return (2, 2) if args.tiny else (12, 15)


def alongside_turns(args) -> tuple[int, float]:
    """(turns of each side, seconds per turn) of each `alongside` pair."""
    # Turns of 1 s gave pairs from 0.93 to 1.03 (6 pairs, 15 turns each); of 0.25 s, from 0.932 to 0.950
    # (6 pairs, 60 turns each) and 0.921 to 0.988 (5 pairs), 2026-12-05: the speed moves within seconds.
    return (2, 0.5) if args.tiny else (60, 0.25)


# `--floor`: the run as raylora runs it, against the same run with the least of what raylora decides about
# Ray: a report at the first and the last step only (Ray Train's report is a cross-rank barrier through an
# actor) and the controller polling every FLOOR_POLL_S, four times less often than raylora's 0.25 s. What
# the least run still loses to the plain loop is what Ray costs whatever raylora does: its worker processes,
# controller and barrier actor beside the workers.
FLOOR_VARIANTS = {"raylora": ([], None), "least": (["run.report_every_s=1000000"], 1.0)}
FLOOR_POLL_S = FLOOR_VARIANTS["least"][1]


def floor(work: Path, cfg, reps: int, windows: int, window_s: float) -> dict:
    """`reps` rounds of one `alongside` pair of each of FLOOR_VARIANTS, the variants' order flipped from
    round to round. Within a round the two pairs start with opposite sides, and which variant's pair
    takes the first turn flips every two rounds (raylora's pairs: raylora, plain, plain, raylora, ...).
    Warm-up: one step (the least run reports its first step, then none until its last, so the pair's
    gate cannot wait for a later one), in both variants alike."""
    work.mkdir(parents=True, exist_ok=True)
    pairs: dict[str, list[dict]] = {v: [] for v in FLOOR_VARIANTS}
    order = []
    for rep in range(reps):
        names = list(FLOOR_VARIANTS) if rep % 2 == 0 else list(FLOOR_VARIANTS)[::-1]
        for i, variant in enumerate(names):
            more, poll_s = FLOOR_VARIANTS[variant]
            first = "raylora" if (rep // 2 + i) % 2 == 0 else "plain"
            order.append([variant, f"{first} first"])

            def variant_cfg(name: str, *also: str, more=more):
                return cfg(name, *more, *also)

            pairs[variant].append(
                alongside(work, variant_cfg, f"{variant}-{rep}", 1, windows, window_s, first, poll_s)
            )
    per_pair = {v: [p["raylora_over_plain"] for p in ps] for v, ps in pairs.items()}
    return {
        "order_of_pairs": order,
        "pairs": pairs,
        "ratios": {
            **{f"{v}_per_pair": r for v, r in per_pair.items()},
            **{v: common.median(r) for v, r in per_pair.items()},
            "least_over_raylora": common.median(per_pair["least"]) / common.median(per_pair["raylora"]),
        },
    }


def measure(args, work: Path, size: tuple, steps: int, warmup: int, reps: int) -> dict:
    import torch.multiprocessing as mp

    from raylora.driver import make_trainer, preflight

    label, width, layers, overrides = size
    cfg = _configs(args, work, size, steps)

    # --tiny (the smoke test) leaves out the every-step variant: one Ray run fewer, the same code path
    variants = {"raylora": VARIANTS["raylora"]} if args.tiny else VARIANTS
    samples: dict[str, list[float]] = {v: [] for v in variants} | {"plain": []}
    in_step: list[float] = []
    reports: list[int] = []
    load: dict[str, list[float]] = {k: [] for k in samples}
    # cores each group of processes used over the timed steps: raylora's run and the loop without Ray
    cores: dict[str, dict[str, list[float]]] = {"raylora": {}, "plain": {}}
    threads: dict[str, dict[str, list[float]]] = {"raylora": {}, "plain": {}}  # the workers' cores, by thread

    def add_cores(label: str, sampler: common.CpuSampler, times: list[float]) -> None:
        for group, value in sampler.cores(times[warmup - 1], times[-2]).items():
            cores[label].setdefault(group, []).append(value)
        for kind, value in sampler.worker_threads(times[warmup - 1], times[-2]).items():
            threads[label].setdefault(kind, []).append(value)

    def ray_run(variant: str, name: str) -> None:
        c = cfg(f"throughput-{variant}-{name}", *variants[variant])
        preflight(c)
        load[variant].append(os.getloadavg()[0])
        clock = work / f"clock-{variant}-{name}.jsonl"
        sampler = common.CpuSampler() if variant == "raylora" else None
        result = make_trainer(c, [common.step_clock(clock)]).fit()
        assert result.error is None, result.error
        rows = [r for r in common.read_clock(clock) if r["restarts"] == 0]
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), "a step's row is missing"
        samples[variant].append(rate([r["t"] for r in rows], warmup))
        if variant == "raylora":
            add_cores("raylora", sampler, [r["t"] for r in rows])
            reports.append(len({r["reported"] for r in rows}))
            history = result.return_value or []
            # train_step's own time, without reporting: what Ray costs on top of it
            per_step = [c.train.global_batch_size / h["samples_per_s"] for h in history[warmup:-1]]
            in_step.append(len(per_step) / sum(per_step))

    def plain_run(name: str) -> None:
        out = work / f"plain-{name}.json"
        load["plain"].append(os.getloadavg()[0])
        sampler = common.CpuSampler()
        with common.raylora_worker_env():  # as raylora's Train workers start: Ray is the difference
            mp.spawn(
                plain_worker, args=(2, common.rendezvous(), cfg(f"plain-{name}"), steps, str(out)), nprocs=2
            )
        times = json.loads(out.read_text())["times"]
        samples["plain"].append(rate(times, warmup))
        add_cores("plain", sampler, times)

    order = []
    for rep in range(reps):
        name = f"w{width}-{rep}"
        # A pair is back to back (raylora's run, then the plain loop's, or the other way round), and the
        # order flips from one pair to the next: whichever side runs first, on a machine whose speed
        # drifts, the drift between the two halves of a pair changes sign from pair to pair instead of
        # counting against one side in every pair.
        runs = ["raylora", "plain"] if rep % 2 == 0 else ["plain", "raylora"]
        order.append(runs)
        for run in runs:
            if run == "plain":
                plain_run(name)
            else:
                ray_run(run, name)
    # The same number of pairs taking turns (`alongside`), raylora's turn first in every other pair.
    windows, window_s = alongside_turns(args)
    together = []
    for rep in range(reps):
        first = "raylora" if rep % 2 == 0 else "plain"
        order.append([f"alongside, {first} first"])
        together.append(alongside(work, cfg, f"w{width}-{rep}", warmup, windows, window_s, first))
    # The other variants after all the pairs, not between them: with an every-step run between the pairs,
    # the pairs came out lower (0.93-0.95 at the median against 0.98-0.99 without, 8 to 12 pairs each,
    # 2026-12-05), for a cause not found in any process's CPU; the back-to-back pairs are raylora's
    # default run and the plain loop with nothing else between them.
    for rep in range(reps):
        for variant in (v for v in variants if v != "raylora"):
            order.append([variant])
            ray_run(variant, f"w{width}-{rep}")

    # --tiny (the smoke test) leaves out in_worker too: `--where --tiny` runs it, and the smoke runs both
    turns = None
    if not args.tiny:
        blocks, per_block = turn_blocks(args)
        turns_cfg = cfg(f"turns-w{width}", f"train.max_steps={3 + blocks * per_block}")
        turns = in_worker(work / f"turns-w{width}", turns_cfg, blocks, per_block)

    med = {k: common.median(v) for k, v in samples.items()}
    figures = {
        "raylora_steps_per_s": common.summary(samples["raylora"]),
        "plain_deepspeed_steps_per_s": common.summary(samples["plain"]),
        "raylora_train_step_only_steps_per_s": common.summary(in_step),
        "raylora_reports_per_run": reports,
        "cores_while_training": {
            label: {group: common.summary(v) for group, v in groups.items()}
            for label, groups in cores.items()
        },
        "worker_threads_while_training": {
            label: {kind: common.summary(v) for kind, v in kinds.items()} for label, kinds in threads.items()
        },
        "plain_seconds_per_step": 1 / med["plain"],
        "ray_seconds_added_per_step": 1 / med["raylora"] - 1 / med["plain"],
    }
    if turns is not None:
        figures["in_worker"] = turns
    ratios = {
        "raylora_over_plain": med["raylora"] / med["plain"],
        "raylora_over_plain_per_pair": [
            r / p for r, p in zip(samples["raylora"], samples["plain"], strict=True)
        ],
    }
    figures["alongside"] = {"turns_per_side": windows, "seconds_per_turn": window_s, "pairs": together}
    ratios["alongside_per_pair"] = [p["raylora_over_plain"] for p in together]
    ratios["alongside"] = common.median(ratios["alongside_per_pair"])
    ratios["sequential_median_of_pairs"] = common.median(ratios["raylora_over_plain_per_pair"])
    if "raylora_every_step" in samples:
        figures["raylora_every_step_steps_per_s"] = common.summary(samples["raylora_every_step"])
        figures["ray_seconds_added_per_step_every_step"] = 1 / med["raylora_every_step"] - 1 / med["plain"]
        ratios["raylora_every_step_over_plain"] = med["raylora_every_step"] / med["plain"]
    return {
        "model": f"tiny llava width {width}, {layers}+{layers} layers",
        "overrides": overrides,
        "order_of_runs": order,
        "load_average_1min_before_each_run": load,
        "figures": figures,
        "ratios": ratios,
    }


def main() -> None:
    from raylora.config import RunConfig
    from raylora.driver import controller_poll_s

    p = common.parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 100, --tiny 40)")
    p.add_argument(
        "--warmup", type=int, default=None, help="steps left out at the start (default 5, --tiny 2)"
    )
    p.add_argument(
        "--sizes",
        default=None,
        help=f"comma-separated, of {[s[0] for s in SIZES]} (default all; --tiny its own)",
    )
    p.add_argument(
        "--where",
        action="store_true",
        help="instead: in_worker at the demo's step, and each side against a plain Ray actor process "
        "(`where`), written to throughput_where.json",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="instead: pairs taking turns (alongside) at the demo's step, raylora's run as it runs and the "
        "same run reporting at its first and last step only, polled every 1 s, alternating; written to "
        "throughput_floor.json",
    )
    args = p.parse_args()
    reps = common.repeats(args, 3)
    # --tiny: 40 steps, so that the window of the CPU split by thread spans more than a few of the kernel's
    # 10-ms ticks: with 6, gloo's threads, which run in short bursts, were once charged no tick at all
    steps = args.steps or (40 if args.tiny else 100)
    warmup = args.warmup or (2 if args.tiny else 5)
    work = Path(args.work) / "throughput"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sizes = [("tiny", 32, 1, [])] if args.tiny else SIZES
    if args.sizes and not args.tiny:
        wanted = args.sizes.split(",")
        unknown = set(wanted) - {s[0] for s in SIZES}
        if unknown:
            p.error(f"--sizes: no size {sorted(unknown)}; the sizes are {[s[0] for s in SIZES]}")
        sizes = [s for s in SIZES if s[0] in wanted]
    if args.floor:
        size = next(s for s in sizes if s[0] in ("demo", "tiny"))
        windows, window_s = alongside_turns(args)
        with common.local_ray():
            figures = floor(work / "floor", _configs(args, work, size, steps), reps, windows, window_s)
        common.write_result(
            args,
            "throughput_floor",
            {
                "model": f"tiny llava width {size[1]}, {size[2]}+{size[2]} layers",
                "setup": {
                    "repeats": reps,
                    "turns_per_side": windows,
                    "seconds_per_turn": window_s,
                    "overrides": size[3],
                    "variants": {
                        v: {"overrides": more, "controller_poll_s_alone": poll_s}
                        for v, (more, poll_s) in FLOOR_VARIANTS.items()
                    },
                },
                "figures": figures,
                "notes": [
                    "Each pair: a whole run and the loop without Ray taking turns (alongside), its ratio "
                    "raylora's steps/s over the plain loop's. `raylora`: the run as raylora runs it; "
                    "`least`: a report at its first and last step only and the controller polling every "
                    f"{FLOOR_POLL_S:g} s (a lone run's intervals; doubled while taking turns, as in "
                    "throughput.json). What `least` still loses is what Ray costs whatever raylora decides.",
                ],
            },
        )
        print(json.dumps(figures["ratios"], indent=1))
        return
    if args.where:
        size = next(s for s in sizes if s[0] in ("demo", "tiny"))
        blocks, n = turn_blocks(args)
        turns_cfg = _configs(args, work, size, 3 + blocks * n)("where")
        with common.local_ray():
            figures = {
                "ray_train_over_plain": in_worker(work / "in-worker", turns_cfg, blocks, n),
                **where(work / "where", turns_cfg, blocks, n),
            }
        common.write_result(
            args,
            "throughput_where",
            {
                "model": f"tiny llava width {size[1]}, {size[2]}+{size[2]} layers",
                "setup": {"blocks": blocks, "steps_per_block": n, "overrides": size[3]},
                "figures": figures,
                "notes": [
                    "Each figure: train_step's steps/s of the first side over the second's, per pair of "
                    "adjacent blocks taking turns (common.Turns), and the median. The chain actor_over_plain "
                    "x train_over_actor splits ray_train_over_plain (measured in the same run).",
                ],
            },
        )
        print(json.dumps({k: v.get("median", v.get("ray_over_plain")) for k, v in figures.items()}, indent=1))
        return
    with common.local_ray():
        results = {size[0]: measure(args, work, size, steps, warmup, reps) for size in sizes}
    values = {label: r["ratios"]["alongside"] for label, r in results.items()}
    common.write_result(
        args,
        "throughput",
        {
            "setup": {
                "workers": 2,
                "zero_stage": 3,
                "steps_per_run": steps,
                "warmup_steps_left_out": warmup,
                "run": "tests.support.tiny_run_config, then each size's overrides",
                "threads_per_worker": THREADS,
                "repeats": reps,
            },
            "sizes": results,
            "goal": {
                "text": "raylora steps/s at least 0.97x the plain DeepSpeed loop at the demo's step, at the "
                "median of the pairs taking turns (alongside; module docstring)",
                "sequential_pairs_by_size": {
                    label: r["ratios"]["sequential_median_of_pairs"] for label, r in results.items()
                },
                "value_by_size": values,
                "met_by_size": {label: v >= 0.97 for label, v in values.items()},
                "met": values.get("demo", 0.0) >= 0.97,
            },
            "notes": [
                "raylora's steps/s comes from each step's wall_time (when the step ended on rank 0, carried "
                "in its metrics row), so it includes the ray.train.report calls between the steps, the "
                "controller's polling (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, "
                f"{controller_poll_s(RunConfig().report_every_s):g} s at the default report interval, "
                "raylora.driver.controller_poll_s) and the metrics log; the plain loop's from time.time() "
                "after each train_step.",
                "raylora reports every run.report_every_s (default) with the rows of the steps in between; "
                "raylora_every_step is run.report_every_s=0, one report per step as before.",
                "raylora_train_step_only_steps_per_s is the same Ray run timed inside train_step (its "
                "samples_per_s metric): the difference to raylora_steps_per_s is what reporting costs.",
                "ray_seconds_added_per_step is 1/raylora - 1/plain at the medians. If Ray's cost were a "
                "fixed amount per step (the report's barrier), it would stay the same at the wider size and "
                "the ratio would improve; if it grows with the step, it is a share of the CPU taken by "
                "Ray's processes (raylet, GCS, dashboard, the controller's polls) from workers "
                "that already fill both cores, and raylora_train_step_only_steps_per_s drops with it.",
                "Ray Train 2.60 takes one report per controller poll (a one-deep queue), so raylora polls at "
                "half the report interval (0.1 s when every step reports); a slower poll would cap training "
                "at one report per poll.",
                "The ratio is of medians; raylora_over_plain_per_pair gives each back-to-back pair's ratio. "
                "order_of_runs: the runs in the order they ran, the pairs first (their order flipping from "
                "one pair to the next), then the every-step runs; raylora_every_step_over_plain is their "
                "median over the plain runs' median, not paired.",
                "The Ray here is raylora's own local one (init_ray: no preemption watcher, no metrics "
                "export); the plain loop runs beside the same, idle, Ray. cores_while_training splits "
                "Ray's processes by kind; a group's cores divided by the steps/s is its CPU per step. "
                "worker_threads_while_training splits the workers' cores by thread (bench/common.py "
                "CpuSampler.worker_threads): training, ray_main (a Ray worker's main thread: the task "
                "loop that answers the controller's polls and takes the GIL every 10 ms to check for "
                "signals), gloo, other_threads (Ray's and gRPC's threads, idle Python helpers).",
                "alongside: each pair's raylora run and plain loop up at once, taking turns every "
                "seconds_per_turn, the other side's processes stopped (SIGSTOP) outside its turns; "
                "alongside_per_pair the ratio of each pair's steps/s over its own turns, alongside their "
                "median (the goal's figure). The run reports and its controller polls at twice the "
                "intervals of a run alone (raylora_report_every_s, raylora_controller_poll_s of each pair): "
                "it has half of the wall time, so per step of its own it reports and is polled as often "
                "as a run alone. sequential_median_of_pairs is the median of raylora_over_plain_per_pair.",
                "in_worker: train_step in Ray Train workers against plain processes, both pairs up at once "
                "and taking turns block by block (module docstring); ray_over_plain is the median of the "
                "adjacent blocks' ratios. It leaves out what a run adds around train_step (reports, the "
                "controller's polls for a run's reports, checkpoints), and the side waiting for its turn "
                "idles (its rank 0 polls a file every 20 ms) while the other trains.",
            ],
        },
    )
    print(json.dumps(values, indent=1))


if __name__ == "__main__":
    main()
