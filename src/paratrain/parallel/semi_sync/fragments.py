"""Which parameters sync when: the fragments of Streaming DiLoCo and their schedule (plain DiLoCo is one fragment).

The parameters, in the model's order, are cut into P contiguous fragments of about equal size. Fragment syncs
come every h = H / P inner steps, in turn (the k-th sync, k = 1, 2, ..., is fragment (k - 1) mod P), so each
fragment syncs every H steps, as torchft's DiLoCo schedules them. With a delay T the fragment's outer gradient is
taken, and its all-reduce started, T inner steps before the sync that applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import UserError


def split_into_fragments(sizes: list[int], count: int) -> list[list[int]]:
    """The indices of parameters of these sizes (elements, in model order) in `count` contiguous groups, each as
    close to an equal share of the elements as whole parameters allow, none empty."""
    if count > len(sizes):
        raise UserError(f"--fragments {count} is more than the model's {len(sizes)} parameter tensors")
    total, groups, current, done = sum(sizes), [], [], 0
    for index, size in enumerate(sizes):
        current.append(index)
        done += size
        left_params, left_groups = len(sizes) - index - 1, count - len(groups) - 1
        # close a group at its share of the elements, or when the rest only just fills the groups left
        if left_groups and (done >= total * (len(groups) + 1) / count or left_params == left_groups):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


@dataclass(frozen=True)
class FragmentSchedule:
    fragments: int  # P
    sync_every: int  # H: inner steps between two syncs of one fragment
    delay: int  # T: inner steps an all-reduce overlaps, below H / P

    @property
    def interval(self) -> int:
        return self.sync_every // self.fragments

    def _fragment_at(self, step: int) -> int | None:
        if step <= 0 or step % self.interval:
            return None
        return (step // self.interval - 1) % self.fragments

    def started_after(self, inner_step: int) -> int | None:
        """The fragment whose outer gradient is taken after this inner step (1-based), or None."""
        return self._fragment_at(inner_step + self.delay)

    def applied_after(self, inner_step: int) -> int | None:
        """The fragment whose outer step is applied after this inner step, or None."""
        return self._fragment_at(inner_step)
