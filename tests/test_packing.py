"""train.packing: a packed pass computes what the padded micro batch of the same samples computes.

In one process (each tiny architecture, no DeepSpeed): the answer-token loss and every gradient of one
packed row equal the padded batch's within 1e-5 relative, on multi-turn, two-image and text-only samples;
Qwen2-VL's 3-D rotary positions are the per-sample ones (1-D positions give other numbers), and Gemma 3,
Gemma 4 (bidirectional image blocks) and Qwen3.5 (linear attention), whose packed rows are not their padded
batches, are refused before Ray starts. On 2 ZeRO-3 workers: one step packed against one step padded on
every verified architecture (loss and Adam moments), and a packed run, and a padded one cut by a token
budget, killed and resumed bitwise equal to an uninterrupted one (with train.group_by_length, whose sample
order is tested here too, and ranks running stand-in passes).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raylora.assets import TINY_ARCHS, build_tiny_model
from raylora.config import ConfigError
from raylora.data import lengths, packing
from raylora.data.batches import (
    _collate,
    budgeted_micro_batches,
    packed_passes,
    read,
    sorted_micro_batches,
    stand_in,
)
from raylora.data.labels import IGNORE_INDEX, encode
from raylora.data.sampler import LENGTH_GROUP_STEPS, GlobalSampler
from raylora.loss import answer_token_losses
from raylora.tiny import TEMPLATE_KWARGS
from tests import whole_checkpoint
from tests.support import straight_and_killed, tiny_run_config
from tests.test_batches import MULTI_TURN, SAMPLES, TEXT_ONLY, TWO_IMAGES, _write_chat_jsonl

TOLERANCE = 1e-5  # relative: the packed and padded passes sum the same products in another order


def test_pack_fills_each_pass_up_to_the_budget_longest_first():
    lengths = [30, 70, 20, 50, 90, 10, 40]
    bins = packing.pack(lengths, budget=100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert bins == [[4, 5], [1, 0], [3, 6], [2]]  # first fit, longest first: 90+10, 70+30, 50+40, 20
    assert packing.pack(lengths, budget=100) == bins  # the same on every rank and after a resume
    assert packing.pack([120, 5], budget=100) == [[0], [1]]


def _model(arch: str):
    model, processor = build_tiny_model(arch, width=64, layers=2, seed=0)
    processor.chat_template_kwargs = TEMPLATE_KWARGS.get(arch, {})  # as load_processor hands a run's
    model.eval()  # no dropout: its noise depends on the tensors' shapes
    # as raylora.model builds it: a cache in the forward would hide the packed samples' boundaries
    model.config.use_cache = model.config.get_text_config().use_cache = False
    return model, processor


def _loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    batch = dict(batch)
    labels = batch.pop("labels")
    model.zero_grad()
    loss = answer_token_losses(model, batch, labels)[0].sum()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), grads


def _relative(reference: torch.Tensor, got: torch.Tensor) -> float:
    return float((reference - got).abs().max() / reference.abs().max())


def _padded_and_packed(arch: str, samples, rope: bool = True):
    model, processor = _model(arch)
    padded = _collate(processor, [encode(processor, s) for s in samples], with_answers=True)
    row = packing.packed(padded, packing.rope_index_of(model) if rope else None)
    return model, padded, row


@pytest.mark.parametrize("arch", packing.VERIFIED)
def test_packed_row_gives_the_padded_loss_and_gradients(arch, monkeypatch):
    """Under sdpa's block-diagonal mask, and through PACKED_SDPA (each sample's attention on its own),
    which raylora's packed runs use."""
    model, padded, row = _padded_and_packed(arch, SAMPLES)
    mask = padded["attention_mask"].bool()
    assert row["input_ids"].shape == (1, int(mask.sum())) and "attention_mask" not in row
    assert torch.equal(row["labels"][0], padded["labels"][mask])
    assert row["cu_seq_lens_q"].tolist() == [0, *mask.sum(-1).cumsum(0).tolist()]
    loss, grads = _loss_and_grads(model, padded)
    packed_loss, packed_grads = _loss_and_grads(model, row)
    assert float(loss) > 0 and float(grads.abs().max()) > 0
    assert _relative(loss, packed_loss) <= TOLERANCE
    assert _relative(grads, packed_grads) <= TOLERANCE

    per_sample = []
    plain = packing.sdpa_attention_forward

    def counted(module, query, key, value, attention_mask, **kwargs):
        per_sample.append((query.shape[2], attention_mask is None))
        return plain(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(packing, "sdpa_attention_forward", counted)
    packing.use_packed_attention(model)
    assert model.config.get_text_config()._attn_implementation == packing.PACKED_SDPA
    sdpa_loss, sdpa_grads = _loss_and_grads(model, row)
    assert _relative(loss, sdpa_loss) <= TOLERANCE
    assert _relative(grads, sdpa_grads) <= TOLERANCE
    # the language model's every layer attended sample by sample, unmasked
    lengths = mask.sum(-1).tolist()
    layers = model.config.get_text_config().num_hidden_layers
    assert [n for n, unmasked in per_sample if unmasked] == lengths * layers, per_sample
    assert _relative(loss, _loss_and_grads(model, padded)[0]) <= TOLERANCE  # a padded batch: plain sdpa


def test_qwen2_vl_packed_positions_are_each_samples_3d_rotary_ids():
    """Counting positions 0, 1, ... per sample, as a text model's packing does, is not Qwen2-VL's forward:
    an image's tokens share a temporal id and count its rows and columns."""
    model, padded, row = _padded_and_packed("qwen2_vl", [TWO_IMAGES, MULTI_TURN])
    assert row["position_ids"].shape == (4, 1, row["input_ids"].shape[1])
    assert not torch.equal(row["position_ids"][1], row["position_ids"][0])  # not one per token
    _, _, flat = _padded_and_packed("qwen2_vl", [TWO_IMAGES, MULTI_TURN], rope=False)
    loss, _ = _loss_and_grads(model, padded)
    assert _relative(loss, _loss_and_grads(model, row)[0]) <= TOLERANCE
    assert _relative(loss, _loss_and_grads(model, flat)[0]) > 1e-3


def test_gemma3_packed_row_is_not_its_padded_batch_so_packing_is_refused():
    """What packing.REFUSED says of Gemma 3, measured: with an image sample in the row, the packed loss is
    not the padded one."""
    model, padded, row = _padded_and_packed("gemma3", [TEXT_ONLY, MULTI_TURN])
    loss, _ = _loss_and_grads(model, padded)
    assert _relative(loss, _loss_and_grads(model, row)[0]) > 1e-4
    assert packing.refusal("gemma3") == packing.REFUSED["gemma3"]
    assert "verified: llava" in packing.refusal("phi3_v")
    # every tiny architecture is either verified or refused with its reason
    assert set(packing.VERIFIED) | set(packing.REFUSED) == set(TINY_ARCHS)


def test_gemma4_packed_row_is_not_its_padded_batch_so_packing_is_refused():
    """Gemma 4's text config may let image tokens attend both ways in its sliding-window layers
    (`use_bidirectional_attention: vision`; transformers leaves it unset for the smaller checkpoints only,
    as for the tiny one, whose packed row is exact). Set, the packed row is not the padded batch: an image
    sample's tokens and the sample after it see other samples, as in Gemma 3."""
    for order in ([TEXT_ONLY, MULTI_TURN], [MULTI_TURN, TEXT_ONLY]):
        model, padded, row = _padded_and_packed("gemma4", order)
        assert model.config.get_text_config().use_bidirectional_attention is None
        loss, grads = _loss_and_grads(model, padded)
        packed_loss, packed_grads = _loss_and_grads(model, row)
        assert _relative(loss, packed_loss) <= TOLERANCE and _relative(grads, packed_grads) <= TOLERANCE
        model.config.get_text_config().use_bidirectional_attention = "vision"
        loss, _ = _loss_and_grads(model, padded)
        assert _relative(loss, _loss_and_grads(model, row)[0]) > 1e-4, order
    assert "bidirectional image-token blocks" in packing.refusal("gemma4")


def test_qwen3_5_packed_row_would_leak_between_samples_so_packing_is_refused():
    """Qwen3.5's Gated DeltaNet layers: given the samples' bounds (`cu_seq_lens_q`, which a packed row
    carries), transformers' torch fallback of the delta rule raises (only the optional flash-linear-attention
    kernel takes them); without them, the recurrent state and the causal conv1d run from one sample into
    the next, and the packed gradients are not the padded ones (measured: 1e-2 relative; the loss moves
    by 3e-5, more than TOLERANCE)."""
    model, padded, row = _padded_and_packed("qwen3_5", [TEXT_ONLY, MULTI_TURN])
    with pytest.raises(
        ValueError, match="can't keep packed sequences apart without `flash-linear-attention`"
    ):
        _loss_and_grads(model, row)
    unbounded = {k: v for k, v in row.items() if k != "cu_seq_lens_q"}
    loss, grads = _loss_and_grads(model, padded)
    packed_loss, packed_grads = _loss_and_grads(model, unbounded)
    assert _relative(loss, packed_loss) > TOLERANCE and _relative(grads, packed_grads) > 1e-3
    assert "recurrent state" in packing.refusal("qwen3_5")


@pytest.mark.parametrize(
    ("arch", "why"),
    [
        ("gemma3", "transformers ORs"),
        ("gemma4", "transformers ORs Gemma 4's"),
        ("qwen3_5", "Qwen3.5's linear-attention layers"),
    ],
)
def test_driver_refuses_packing_before_ray(arch, why, tiny_models, digits):
    from raylora.driver import preflight

    cfg = tiny_run_config(
        tiny_models(arch), digits[0], "/tmp/unused", "packed", "train.packing=true",
        "train.max_tokens_per_micro_batch=512",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=f"train.packing is not available for {arch}: {why}"):
        preflight(cfg)


def test_packing_settings_are_checked_when_loaded(tmp_path):
    with pytest.raises(ConfigError, match="train.packing needs train.max_tokens_per_micro_batch"):
        tiny_run_config("m", "d", tmp_path, "n", "train.packing=true")
    with pytest.raises(ConfigError, match=r"data.max_length \(300\) exceeds train.max_tokens_per_micro"):
        tiny_run_config(
            "m", "d", tmp_path, "n", "train.packing=true", "train.max_tokens_per_micro_batch=200",
            "data.max_length=300",
        )  # fmt: skip
    with pytest.raises(ConfigError, match="train.sort_by_length is for padded micro batches"):
        tiny_run_config(
            "m", "d", tmp_path, "n", "train.packing=true", "train.max_tokens_per_micro_batch=200",
            "train.sort_by_length=true",
        )  # fmt: skip
    with pytest.raises(ConfigError, match="must be positive"):
        tiny_run_config("m", "d", tmp_path, "n", "train.max_tokens_per_micro_batch=0")
    # padded under a token budget: the same limit
    with pytest.raises(ConfigError, match=r"\(200\): a sample that long would not fit in a padded pass"):
        tiny_run_config(
            "m", "d", tmp_path, "n", "train.max_tokens_per_micro_batch=200", "data.max_length=300"
        )


def test_driver_refuses_a_token_budget_below_the_shortest_sample_before_ray(tiny_models, digits):
    """Padded under a token budget as packed: a budget no sample fits would skip every one."""
    from raylora.driver import preflight

    cfg = tiny_run_config(
        tiny_models("gemma3"), digits[0], "/tmp/unused", "b", "train.max_tokens_per_micro_batch=8"
    )
    with pytest.raises(
        ConfigError, match=r"train.max_tokens_per_micro_batch \(8\) is shorter than the shortest"
    ):
        preflight(cfg)


def test_packed_passes_keep_the_budget_skip_what_cannot_fit_and_give_each_pass_an_image():
    model, processor = _model("qwen2_vl")
    lengths = [len(encode(processor, s).labels) for s in SAMPLES]
    standin = len(encode(processor, stand_in()).labels)
    budget = max(lengths) + min(lengths)
    samples = [TEXT_ONLY, None, MULTI_TURN, TWO_IMAGES, TEXT_ONLY]
    passes, too_long = packed_passes(processor, samples, budget, None, packing.rope_index_of(model))
    assert too_long == []
    tokens = sorted(p["input_ids"].shape[1] for p in passes)
    # every sample once (the empty slot takes no place), each pass within the budget, and a pass of
    # text-only samples carries the label-less stand-in image row beside them
    answers = sum(int((p["labels"] != IGNORE_INDEX).sum()) for p in passes)
    labelled = [sum(t != IGNORE_INDEX for t in encode(processor, s).labels) for s in samples if s]
    assert answers == sum(labelled) > 0
    assert all(t <= budget + standin for t in tokens)
    assert all("image_grid_thw" in p for p in passes)
    # shorter than every sample: each is skipped as too long, and nothing is left to pack
    assert packed_passes(processor, samples, budget, max_length=min(lengths) - 1) == ([], [0, 2, 3, 4])


def test_sorted_micro_batches_pad_less_and_keep_every_sample():
    """train.sort_by_length: the same samples and passes, cut after ordering by length."""
    _, processor = _model("llava")
    samples = [MULTI_TURN, TEXT_ONLY, TWO_IMAGES, TEXT_ONLY, None, MULTI_TURN]
    kept = [encode(processor, s) for s in samples if s]
    batches, too_long = sorted_micro_batches(processor, samples, 2, 4, max_length=None)
    assert too_long == [] and len(batches) == 4

    def answers(batches) -> int:
        return sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)

    def padding_share(batches) -> float:
        return 1 - sum(int(b["attention_mask"].sum()) for b in batches) / sum(
            b["attention_mask"].numel() for b in batches
        )

    assert answers(batches) == sum(sum(t != IGNORE_INDEX for t in r.labels) for r in kept)
    in_order = [_collate(processor, [encode(processor, s) for s in pair if s], True) for pair in
                (samples[0:2], samples[2:4], samples[4:6])]  # fmt: skip
    assert padding_share(batches[:3]) < padding_share(in_order)


def test_budgeted_micro_batches_fit_the_budget_and_keep_every_sample():
    """train.max_tokens_per_micro_batch without packing: padded micro batches of at most the budget's
    positions (rows times their longest), short samples together, and every usable sample's answers in
    them; a skipped slot takes no pass."""
    _, processor = _model("qwen2_vl")
    samples = [MULTI_TURN, TEXT_ONLY, TWO_IMAGES, TEXT_ONLY, None, MULTI_TURN, TEXT_ONLY]
    rows = [encode(processor, s) for s in samples if s]
    longest = max(len(r.labels) for r in rows)
    batches, too_long = budgeted_micro_batches(processor, samples, 3 * longest, max_length=None)
    assert too_long == []
    sizes = []
    for b in batches:
        real = (b["labels"] != IGNORE_INDEX).any(dim=1)  # the stand-in image row trains on nothing
        width = int(b["attention_mask"][real].sum(dim=1).max())
        sizes.append(int(real.sum()))
        assert sizes[-1] * width <= 3 * longest, (sizes[-1], width)
        assert "pixel_values" in b  # a text-only micro batch carries the stand-in image row
    assert sum(sizes) == len(rows) and len(batches) < len(rows) / 2  # micro batches of 2 would take 3
    assert sizes == sorted(sizes)  # longest first: the short samples share the last passes
    answers = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    assert answers == sum(sum(t != IGNORE_INDEX for t in r.labels) for r in rows) > 0
    # a sample longer than the budget (or data.max_length) is skipped as too long
    shortest = min(len(r.labels) for r in rows)
    over = [i for i, s in enumerate(samples) if s and len(encode(processor, s).labels) > shortest]
    assert budgeted_micro_batches(processor, samples, shortest, None)[1] == over
    assert budgeted_micro_batches(processor, samples, 3 * longest, shortest - 1) == ([], [0, 1, 2, 3, 5, 6])


def _log_normal_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Long-tailed token counts, as real conversations have (bench/padding.py's mixes)."""
    return (np.random.default_rng(seed).lognormal(np.log(300), 0.9, n)).astype(np.int64) + 20


def test_grouped_epoch_holds_every_sample_once_in_steps_of_similar_length():
    """train.group_by_length: the same samples an epoch as the plain order, each step sorted and near in
    length, the steps of a group in a shuffled order, and the order a function of (seed, epoch) alone."""
    n, size = 5000, 32
    lengths = _log_normal_lengths(n)
    skipped = np.random.default_rng(1).random(n) < 0.05  # too long or bad: -1 (lengths.grouping_keys)
    lengths[skipped] = -1
    plain = GlobalSampler(n, size, seed=7)
    grouped = GlobalSampler(n, size, seed=7, lengths=lengths)
    steps = plain.steps_per_epoch
    for epoch in (0, 1):
        mine = [grouped.global_batch(epoch * steps + k) for k in range(steps)]
        theirs = [plain.global_batch(epoch * steps + k) for k in range(steps)]
        # every sample the plain epoch trains on, once (drop-last drops the same ones)
        assert sorted(i for b in mine for i in b) == sorted(i for b in theirs for i in b)
        assert all(len(b) == size for b in mine)
        usable = [lengths[b][lengths[b] >= 0] for b in mine]
        assert all(list(u) == sorted(u) for u in usable)  # each rank's share: neighbours in length
        # skipped samples keep their shuffled places: each group's steps skip as many as without grouping,
        # not the longest steps all of them
        for g in range(0, steps, grouped.group_steps):
            count = [int((lengths[b] < 0).sum()) for b in mine[g : g + grouped.group_steps]]
            plain_count = [int((lengths[b] < 0).sum()) for b in theirs[g : g + grouped.group_steps]]
            assert sorted(count) == sorted(plain_count)

        def padding(batches) -> float:  # micro batches of 4, padded to their longest (skipped: 0)
            cut = [np.maximum(lengths[b[k : k + 4]], 0) for b in batches for k in range(0, size, 4)]
            return 1 - sum(c.sum() for c in cut) / sum(c.max() * len(c) for c in cut)

        assert padding(mine) < padding(theirs) / 4, (padding(mine), padding(theirs))
        # within a group the steps are not run from short to long
        first_group = [int(lengths[b].max()) for b in mine[: grouped.group_steps]]
        assert first_group != sorted(first_group)
    # groups of 50 steps, as the HF Trainer's megabatches; a quarter of a short epoch's steps
    assert grouped.group_steps == min(LENGTH_GROUP_STEPS, steps // 4) == 39
    assert GlobalSampler(512, 16, 0, lengths=lengths[:512]).group_steps == 8
    assert grouped.global_batch(5) == GlobalSampler(n, size, 7, lengths=lengths.copy()).global_batch(5)
    assert grouped.global_batch(5) != GlobalSampler(n, size, 8, lengths=lengths).global_batch(5)
    assert grouped.global_batch(3) != grouped.global_batch(steps + 3)  # each epoch its own order
    for world, micro in ((1, 2), (2, 4), (3, 2), (4, 3)):  # the same global batch on any number of workers
        mine = [grouped.micro_batches(4, r, world, micro) for r in range(world)]
        assert [sum(i is not None for mb in m for i in mb) for m in mine] == grouped.shares(world)
        assert len({len(m) for m in mine}) == 1  # every rank runs as many passes
        # dealt pass by pass: the k-th micro batches of all ranks hold the next samples in length order
        dealt = [i for k in range(len(mine[0])) for m in mine for i in m[k] if i is not None]
        assert dealt == grouped.global_batch(4)

    def lockstep(cut) -> int:  # ZeRO-3 runs each pass at the pace of its slowest rank
        return sum(max(max(lengths[i] for i in m[k]) for m in cut) for k in range(len(cut[0])))

    step = next(k for k in range(steps) if (lengths[grouped.global_batch(k)] >= 0).all())
    batch = grouped.global_batch(step)
    contiguous = [[batch[r * 16 + k : r * 16 + k + 4] for k in range(0, 16, 4)] for r in range(2)]
    dealt = [grouped.micro_batches(step, r, 2, 4) for r in range(2)]
    assert lockstep(dealt) < lockstep(contiguous), (lockstep(dealt), lockstep(contiguous))


def test_grouped_order_is_refused_on_resume_when_the_setting_changed():
    from raylora import resume

    before = {"seed": 0, "global_batch_size": 8, "num_samples": 16}  # a checkpoint from before the setting
    resume.check_sampler(before, {**before, "group_by_length": False}, "ckpt")
    with pytest.raises(ConfigError, match=r"train.group_by_length: ckpt was trained with .* False"):
        resume.check_sampler(before, {**before, "group_by_length": True}, "ckpt")
    with pytest.raises(ConfigError, match=r"train.group_by_length: .* True, this config gives False"):
        resume.check_sampler({**before, "group_by_length": True}, {**before, "group_by_length": False}, "c")


def test_token_lengths_are_counted_as_a_step_encodes_and_kept_for_restarts(
    one_rank, tiny_models, tmp_path, monkeypatch
):
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor

    model = tiny_models("qwen2_vl")
    processor = load_processor(model)
    data = _write_chat_jsonl(tmp_path, {1: "text", 4: "corrupt"}, 6)
    cfg = tiny_run_config(model, data, tmp_path, "grouped", "train.group_by_length=true")
    rows = open_rows(data)
    got = lengths.token_lengths(cfg, processor, rows, torch.device("cpu"))
    expected = [0 if i == 4 else len(encode(processor, read(rows, i)).labels) for i in range(6)]
    assert got.tolist() == expected and len(set(expected)) > 2  # the corrupt image's row counts 0
    kept = tmp_path / "grouped" / lengths.LENGTHS
    assert kept.is_file()

    def counted_again(*args):
        raise AssertionError("counted again")

    monkeypatch.setattr(lengths, "count", counted_again)
    assert lengths.token_lengths(cfg, processor, rows, torch.device("cpu")).tolist() == expected
    # other image limits give other Qwen2-VL image tokens: the kept counts are not theirs
    smaller = tiny_run_config(
        model, data, tmp_path, "grouped", "train.group_by_length=true", "data.max_pixels=3136"
    )
    with pytest.raises(AssertionError, match="counted again"):
        lengths.token_lengths(smaller, processor, rows, torch.device("cpu"))
    # for the sampler: what a step skips (the bad row, the rows over data.max_length) is -1
    limit = sorted(expected)[3]
    capped = tiny_run_config(
        model, data, tmp_path, "grouped", "train.group_by_length=true", f"data.max_length={limit}"
    )
    keys = lengths.grouping_keys(capped, processor, rows, torch.device("cpu"))
    assert keys.tolist() == [-1 if n == 0 or n > limit else n for n in expected]
    assert (keys == -1).sum() >= 2
    # and the rows over a pass's token budget, padded as well as packed
    for packed in ((), ("train.packing=true",)):
        budgeted = tiny_run_config(
            model, data, tmp_path, "grouped", "train.group_by_length=true",
            f"train.max_tokens_per_micro_batch={limit}", *packed,
        )  # fmt: skip
        assert lengths.grouping_keys(budgeted, processor, rows, torch.device("cpu")).tolist() == keys.tolist()


# ------------------------------------------------------------------------------------------ distributed

ROWS = 16
BUDGET = 64  # tokens per packed pass: rank 0's share at step 0 takes several, rank 1's text rows one
PACKED = ("train.packing=true", f"train.max_tokens_per_micro_batch={BUDGET}")


def _one_step_each(configs: dict) -> dict:
    """On each worker: per (arch, mode), one train_step from the same start; rank 0 returns the step's loss,
    its Adam first moments (the step's gradient times 1 - beta1) and every rank's pass count."""
    import torch.distributed as dist

    from raylora import worker, zero

    out = {}
    for key, cfg in configs.items():
        s = worker.setup(cfg, None)
        passes = [None] * s.world_size
        dist.all_gather_object(passes, len(worker.step_batches(s, 0).batches))
        metrics = worker.train_step(s)
        gathered = zero.gather_trainable_state(s.engine, s.params)  # (masters, moments) on rank 0
        out[key] = {
            "loss": metrics["loss"],
            "passes": passes,
            "moments": {n: m.numpy() for n, m in gathered[1].items()} if s.rank == 0 else None,
        }
        del s
    return out


def _assert_moments_close(reference: dict, got: dict, arch: str) -> None:
    """Every Adam moment within TOLERANCE of the largest one (relative to each tensor's own largest value
    would not do: a CLIP key bias's gradient is zero but for rounding, about 1e-13 either way)."""
    scale = max(float(abs(v).max()) for v in reference.values())
    assert scale > 0, arch
    for name, value in reference.items():
        assert float(abs(got[name] - value).max()) <= TOLERANCE * scale, (arch, name)


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory):
    """Chat JSONL with multi-turn one-image, two-image and text-only rows (tests.test_batches), laid out
    so that at step 0 rank 1's share is text only: it packs into fewer passes than rank 0's and runs
    stand-in passes to stay in step."""
    folder = tmp_path_factory.mktemp("packing-data")
    seed = tiny_run_config("m", "d", folder, "seed").train.seed
    sampler = GlobalSampler(ROWS, 8, seed)  # tiny_run_config's global batch
    text_only = [i for micro in sampler.micro_batches(0, 1, 2, 2) for i in micro]
    return folder, _write_chat_jsonl(folder, dict.fromkeys(text_only, "text"), ROWS)


@pytest.mark.distributed
@pytest.mark.slow
def test_packed_step_equals_padded_step_on_zero3_workers(ray_cluster, probes, tiny_models, mixed_data):
    folder, data = mixed_data
    configs = {}
    for arch in packing.VERIFIED:
        modes = {
            "padded": (),
            "packed": PACKED,
        }
        if arch in ("llava", "qwen2_vl"):
            modes["sorted"] = ("train.sort_by_length=true",)
            modes["budgeted"] = (f"train.max_tokens_per_micro_batch={BUDGET}",)  # padded, cut by tokens
        for mode, extra in modes.items():
            configs[arch, mode] = tiny_run_config(
                tiny_models(arch), data, folder, f"{arch}-{mode}", "lora.dropout=0", *extra
            )
    got = probes(lambda: _one_step_each(configs))
    uneven = 0
    for arch in packing.VERIFIED:
        padded, packed = got[arch, "padded"], got[arch, "packed"]
        assert padded["passes"] == [2, 2] and min(packed["passes"]) >= 1, arch
        uneven += len(set(packed["passes"])) > 1
        assert abs(packed["loss"] - padded["loss"]) <= TOLERANCE * abs(padded["loss"]), arch
        _assert_moments_close(padded["moments"], packed["moments"], arch)
    assert uneven, "no architecture had ranks with different pass counts (the stand-in passes untested)"
    for arch in ("llava", "qwen2_vl"):
        padded, sorted_, budgeted = got[arch, "padded"], got[arch, "sorted"], got[arch, "budgeted"]
        assert sorted_["passes"] == [2, 2], arch
        # rank 1's text-only share fits one pass of BUDGET tokens: rank 1 runs a stand-in to keep in step
        assert budgeted["passes"][1] == 1 and budgeted["passes"][0] > 1, (arch, budgeted["passes"])
        for mode in (sorted_, budgeted):
            assert abs(mode["loss"] - padded["loss"]) <= TOLERANCE * abs(padded["loss"]), arch
            _assert_moments_close(padded["moments"], mode["moments"], arch)


def _pass_counts(mode: str, budget: int, counts: list[int], processor, rows, cfg) -> list[tuple[int, int]]:
    """Each of the run's 6 steps' pass counts on rank 0 and rank 1 in the grouped order, with a pass's
    token budget of `budget`, packed or padded: what the workers' step_batches build."""
    keys = np.array(counts)
    keys[keys > budget] = -1  # lengths.grouping_keys: the step skips a row over the budget
    sampler = GlobalSampler(ROWS, cfg.train.global_batch_size, cfg.train.seed, keys)
    got = []
    for step in range(6):
        per_rank = []
        for rank in (0, 1):
            micro = sampler.micro_batches(step, rank, 2, cfg.train.micro_batch_size)
            share = [i for m in micro for i in m if i is not None and counts[i] <= budget]
            if mode == "packed":
                per_rank.append(len(packing.pack([counts[i] for i in share], budget)))
            else:
                samples = [read(rows, i) for i in share]
                per_rank.append(len(budgeted_micro_batches(processor, samples, budget, None)[0]))
        got.append(tuple(per_rank))
    return got


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["packed", "budgeted"])
def test_killed_grouped_run_under_a_token_budget_resumes_bitwise_equal(
    ray_cluster, tiny_models, mixed_data, mode
):
    """Packed, or padded micro batches cut by the token budget, and with train.group_by_length (the workers
    count every row's tokens, half each, and the restarted group reads the counts kept in the run's
    folder). After the kill the ranks' pass counts differ on some steps: the rank with fewer passes runs
    stand-ins, in the restarted group as well."""
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor

    folder, data = mixed_data
    model = tiny_models("qwen2_vl")
    grouped = "train.group_by_length=true"
    budget = 42  # the rows hold 11, 26 or 30 tokens: in the grouped order ranks differ in passes
    settings = (f"train.max_tokens_per_micro_batch={budget}", grouped)
    settings += ("train.packing=true",) if mode == "packed" else ()
    folder = folder / mode
    processor, rows = load_processor(model), open_rows(data)
    counts = [len(encode(processor, read(rows, i)).labels) for i in range(ROWS)]
    passes = _pass_counts(
        mode, budget, counts, processor, rows, tiny_run_config(model, data, folder, "passes")
    )
    assert any(a != b for a, b in passes[3:]), passes  # after the kill, a rank runs stand-ins
    straight, killed = straight_and_killed(model, data, folder, 3, *settings)
    for run in ("straight", "killed"):
        kept = json.loads((folder / run / lengths.LENGTHS).read_text())
        assert kept["lengths"] == counts and kept["key"]["rows"] == ROWS, run
    with straight.checkpoint.as_directory() as a, killed.checkpoint.as_directory() as b:
        one, two = whole_checkpoint.load(a), whole_checkpoint.load(b)
    assert one.state.step == two.state.step == 6 and two.state.restarts == 1
    for key, value in one.weights.items():
        assert torch.equal(two.weights[key], value), key
    for key, value in one.moments.items():
        assert torch.equal(two.moments[key], value), key
