"""Evaluation inside ZeRO-3 training, on 2 Ray Train workers: scoring on a copy of the model gathered once
(`raylora.evaluate.gathered_copy`) gives what generating under ZeRO-3 gives, and neither path changes the
training that follows.

For Llava and Qwen2-VL (whose aligner sits inside its vision tower): after 2 steps, the ZeRO-3 model and
its copy compute bitwise equal logits and generate the same tokens; `evaluate_sharded` on the copy equals
it under ZeRO-3 (`synced_gpus`) on 7 samples (uneven shards: 4 and 3); the automatic choice falls back to
ZeRO-3 when the copy does not fit; the parameters, fp32 masters and Adam moments are bitwise unchanged by
all of it, and 2 more steps give the losses and final state of a run that never evaluated. The copy is
built from the model's own config and adapter config, so the same comparisons (without the run that never
evaluated) cover the PEFT options that change the modules (DoRA with OLoRA init, modules_to_save with
PiSSA init) and a model that brings its own modeling code.
"""

from __future__ import annotations

import pytest

from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SAMPLES = 7  # over 2 ranks: shards of 4 and 3, in micro batches of 2 (the last of rank 1 is a single row)


def _state(s) -> tuple[dict, dict, dict]:
    """(model parameters, fp32 masters, Adam moments) of every trainable tensor; on rank 0 (the masters
    and moments are empty dicts elsewhere). Every rank must call this."""
    from raylora import zero
    from tests.probes import read_params

    params = read_params(s.params)
    gathered = zero.gather_trainable_state(s.engine, s.params)
    masters, moments = gathered if gathered is not None else ({}, {})
    return params, masters, moments


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _probe(cfgs: dict, full: set[str]) -> dict:
    """On each worker, for each config: the comparisons above (with the run that never evaluated for
    those in `full`); rank 0 returns them."""
    import torch

    from raylora import evaluate, worker
    from raylora.data.batches import make_batch, read

    results = {}
    for name, cfg in cfgs.items():
        s = worker.setup(cfg, None)
        losses = [worker.train_step(s)["loss"] for _ in range(2)]
        before = _state(s)
        args = (s.engine, s.processor, s.eval_data, SAMPLES, cfg.train.micro_batch_size)
        zero3 = evaluate.evaluate_sharded(*args, gather=False)
        copied = evaluate.evaluate_sharded(*args, gather=True)
        auto = evaluate.evaluate_sharded(*args)  # a tiny model fits: the copy
        headroom, evaluate.COPY_HEADROOM = evaluate.COPY_HEADROOM, float("inf")
        try:
            fallback = evaluate.evaluate_sharded(*args)  # nothing fits: under ZeRO-3
        finally:
            evaluate.COPY_HEADROOM = headroom

        # the copy against the ZeRO-3 model on one batch of this rank's rows: logits and generated tokens
        examples = [read(s.eval_data, 2 * s.rank + i) for i in range(2)]
        batch = {k: v.to(s.engine.device) for k, v in make_batch(s.processor, examples).items()}
        batch.pop("labels")
        prompts = make_batch(s.processor, examples, with_answers=False)
        prompts = {k: v.to(s.engine.device) for k, v in prompts.items()}
        generation = {
            "max_new_tokens": 6,
            "do_sample": False,
            "pad_token_id": s.processor.tokenizer.pad_token_id,
        }
        copy = evaluate.gathered_copy(s.engine.module, s.engine.device)
        model = s.engine.module
        model.eval()
        with torch.no_grad():
            logits_zero3, logits_copy = model(**batch).logits, copy(**batch).logits
            ids_zero3 = model.generate(**prompts, synced_gpus=True, **generation)
            ids_copy = copy.generate(**prompts, **generation)
        model.train()
        del copy

        after = _state(s)
        losses += [worker.train_step(s)["loss"] for _ in range(2)] if name in full else []
        final = _state(s)
        del s
        plain_losses, plain_final = losses, final
        if name in full:  # the same run, never evaluated
            t = worker.setup(cfg, None)
            plain_losses = [worker.train_step(t)["loss"] for _ in range(4)]
            plain_final = _state(t)
            del t
        results[name] = {
            "zero3": zero3,
            "copied": copied,
            "auto": auto,
            "fallback": fallback,
            "logits_equal": bool(torch.equal(logits_zero3, logits_copy)),
            "logits_max_diff": float((logits_zero3 - logits_copy).abs().max()),
            "ids_equal": bool(torch.equal(ids_zero3, ids_copy)),
            "state_unchanged": all(_equal(x, y) for x, y in zip(before, after, strict=True)),
            "losses": losses,
            "plain_losses": plain_losses,
            "final_equal": all(_equal(x, y) for x, y in zip(final, plain_final, strict=True)),
        }
    return results


def test_eval_on_a_gathered_copy_equals_eval_under_zero3(ray_cluster, probes, tiny_models, digits, tmp_path):
    from tests.remote_model import REMOTE_PARTS, make_remote_code_model

    def cfg(name: str, model: str, *overrides: str):
        settings = (
            f"data.eval={digits[1]}",
            "train.eval_every=2",
            f"train.eval_samples={SAMPLES}",
            "data.workers=0",
        )
        return tiny_run_config(model, digits[0], tmp_path, f"eval-{name}", *settings, *overrides)

    llava = tiny_models("llava")
    remote = str(make_remote_code_model(llava, tmp_path / "remote"))
    cfgs = {
        "llava": cfg("llava", llava),
        "qwen2_vl": cfg("qwen2_vl", tiny_models("qwen2_vl")),
        "dora": cfg("dora", llava, "lora.use_dora=true", "lora.use_rslora=true", "lora.init=olora"),
        "saved": cfg("saved", llava, "lora.modules_to_save=[lm_head]", "lora.init=pissa"),
        "remote_code": cfg("remote", remote, *REMOTE_PARTS),
    }
    full = {"llava", "qwen2_vl"}
    # One worker group for every engine: an engine's memory stays held in its process after the engine is
    # dropped (DeepSpeed keeps the module in a global stack), but DeepSpeed's 2 GB reduce bucket is never
    # written on CPU (train.deterministic leaves torch.empty unfilled), so 7 engines stay small.
    results = probes(lambda: _probe(cfgs, full))
    assert sorted(results) == sorted(cfgs)
    for name, r in results.items():
        assert r["logits_equal"], f"{name}: the copy's logits differ by {r['logits_max_diff']}"
        assert r["ids_equal"], f"{name}: the copy generates other tokens"
        for other in ("copied", "auto", "fallback"):
            assert r[other]["eval_accuracy"] == r["zero3"]["eval_accuracy"], (name, other)
            assert r[other]["eval_stopped"] == r["zero3"]["eval_stopped"], (name, other)
            assert r[other]["eval_loss"] == pytest.approx(r["zero3"]["eval_loss"], rel=1e-6), (name, other)
        assert r["zero3"]["eval_loss"] > 0
        assert r["state_unchanged"], f"{name}: evaluation changed the parameters, masters or moments"
        if name in full:
            assert len(r["losses"]) == 4
            assert r["losses"] == r["plain_losses"], f"{name}: the steps after evaluation differ"
            assert r["final_equal"], (
                f"{name}: the state after evaluation and 2 steps differs from a plain run's"
            )
