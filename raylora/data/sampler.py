"""The global sampler: which samples form step `s`'s batch depends only on (seed, epoch) and the global batch
size (and, with train.group_by_length, the samples' token counts), never on the number of workers. Ray
Data's iterators have no state to save, so an exact mid-epoch resume needs this sampler of our own; its
position is just the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from raylora.config import ConfigError

# train.group_by_length: steps per group whose samples are sorted by length together, as the HF Trainer's
# LengthGroupedSampler sorts "megabatches" of 50 batches (fewer where an epoch has under 200 steps: a
# quarter of them, as it does); more steps per group pad less but let a group's steps differ more in
# length (its long steps and its short ones).
LENGTH_GROUP_STEPS = 50


@dataclass(frozen=True)
class GlobalSampler:
    """Sample order from (seed, epoch) only; one global batch per step, drop-last within an epoch.

    With `lengths` (each sample's tokens: train.group_by_length) the epoch's shuffled order is cut into
    groups of `group_steps` steps' samples, each group sorted by length and cut into its steps'
    global batches, which then run in a shuffled order: every sample still once an epoch, and each step
    holds samples of similar length, so its micro batches pad little. Within a global batch the samples
    stay sorted and are dealt to the ranks pass by pass (`micro_batches`): each micro batch holds
    neighbours in length, and the ranks' k-th micro batches are alike. A
    negative length marks a sample that its step will skip (too long, or a bad row): it is not sorted
    but keeps its place in the shuffled order, so skipped samples spread over the steps as without
    grouping.
    """

    num_samples: int
    global_batch_size: int
    seed: int
    lengths: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.num_samples < self.global_batch_size:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) exceeds the {self.num_samples} "
                f"training samples"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def group_steps(self) -> int:
        """Steps per length-sorted group (train.group_by_length)."""
        return max(1, min(LENGTH_GROUP_STEPS, self.steps_per_epoch // 4))

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of the global batch that optimizer step `step` (0-based) trains on."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        size = self.global_batch_size
        if self.lengths is None:
            return order[pos * size : (pos + 1) * size].tolist()
        group, within = divmod(pos, self.group_steps)
        first = group * self.group_steps
        steps = min(self.group_steps, self.steps_per_epoch - first)  # an epoch's last group may be short
        members = order[first * size : (first + steps) * size].copy()
        # A sample its step will skip (a negative length) keeps its shuffled place: sorted, they would
        # crowd the group's longest steps, and a step of nothing but skipped samples ends the run.
        keys = self.lengths[members]
        usable = keys >= 0
        # stable: equal lengths keep the shuffled order, so the order follows from (seed, epoch) alone
        members[usable] = members[usable][np.argsort(keys[usable], kind="stable")]
        batch = np.random.default_rng([self.seed, epoch, group]).permutation(steps)[within]
        return members[batch * size : (batch + 1) * size].tolist()

    def shares(self, world_size: int) -> list[int]:
        """Samples each rank trains on per step: the global batch split as evenly as it goes, so that
        shares differ by at most one sample (the first ranks take the remainder)."""
        base, extra = divmod(self.global_batch_size, world_size)
        return [base + (rank < extra) for rank in range(world_size)]

    def micro_batches(
        self, step: int, rank: int, world_size: int, micro_batch_size: int
    ) -> list[list[int | None]]:
        """This rank's share of the global batch, cut into micro batches.

        Every rank gets as many micro batches as the largest share needs (`Config.grad_accum_steps`):
        under ZeRO-3 all ranks run each forward and backward pass together. A rank one sample short of
        that ends with `[None]`: a slot for a label-less stand-in, which trains on nothing.

        In the plain order a rank's share is a contiguous slice of the global batch. A length-sorted
        global batch (train.group_by_length) is dealt pass by pass instead: the k-th micro batches of all
        ranks take the next samples in length order, rank after rank. Each pass then computes alike on
        every rank; contiguous shares would give the last rank the longest samples of every pass, and
        under ZeRO-3 each pass waits for the slowest rank (its all-gathers and reduce-scatters are
        collectives).
        """
        shares = self.shares(world_size)
        count = -(-shares[0] // micro_batch_size)
        batch: list[int | None] = self.global_batch(step)
        if self.lengths is None:
            start = sum(shares[:rank])
            mine = batch[start : start + shares[rank]]
            micro = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
        else:
            micro, start = [], 0
            for k in range(count):  # pass k: each rank's k-th micro batch, in rank order
                sizes = [min(micro_batch_size, max(0, share - k * micro_batch_size)) for share in shares]
                if sizes[rank]:
                    first = start + sum(sizes[:rank])
                    micro.append(batch[first : first + sizes[rank]])
                start += sum(sizes)
        return micro + [[None] for _ in range(count - len(micro))]
