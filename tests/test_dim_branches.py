"""A parallel dimension is known by name only inside parallel/ (DESIGN.md principle 10): code elsewhere asks the
Layout a question named by what it needs (`layout.splits_stages`, `layout.data_parallel_only`, ...) or iterates
the declared dims (parallel/dims.py). Counted with ast over src/ outside parallel/ (tests/source_rules.py):
degree comparisons on a dimension's name (`layout.tp > 1`, `pp == 1`, `layout.cp_enabled`, getattr(x, "ep", 1))
and name branches (`group == "tp"`, a hand-written list of dim names). What remains is listed below, each with
its reason: a new one fails, and so does an entry no longer found (shrink the list, and its count, then)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import source_rules
from paratrain.parallel.dims import all_dims

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"
DIM_NAMES = {d.name for d in all_dims()} | {"dp"}  # dp: Layout's dp_replicate x dp_shard


def allowed(groups: dict[tuple[str, ...], str]) -> tuple[Counter, dict[str, str]]:
    """(how many times each "path: what" may occur, its reason): an entry listed twice is allowed twice."""
    counts = Counter(entry for entries in groups for entry in entries)
    return counts, {entry: reason for entries, reason in groups.items() for entry in entries}


TRACE = ("the planner's trace builds one rank's model from a TraceKey, degrees as numbers with no Layout or mesh "
         "(FakeTensor simulation of what each technique's apply does: TP's sharded weights, loss parallel and DTensor "
         "redistributions, CP's attention, EP's expert split and token exchange): the simulations are the planner's, "
         "above parallel/, so they read the key's degrees")
ALLOWED_DEGREE_COMPARISONS, DEGREE_REASONS = allowed({
    ("plan/costing/compose.py: key.tp > 1", "plan/tracing/local_model.py: cp > 1", "plan/tracing/local_model.py: tp > 1",
     "plan/tracing/moe_trace.py: ep == 1", *["plan/tracing/moe_trace.py: ep > 1"] * 3,
     "plan/tracing/trace.py: key.tp > 1", "plan/tracing/trace.py: tp > 1", "plan/tracing/units.py: key.tp > 1"):
        TRACE,
    ("costs/expert_spread.py: ep <= 1",):
        "ranks_per_token is a formula of the expert-parallel degree as a number (the ranks a token's top-k experts "
        "reach); ep <= 1 is its base case, one rank holding every expert, not a branch on what a run does",
    ("train/recovery/replica_launch.py: (cfg.dp_replicate or 1) > 1",):
        "--heal-replicas' refusal suggests the replica count the user gave (--dp-replicate), read from the config "
        "before any Layout exists: a data-parallel option read back, not a branch on what the run does",
})
ALLOWED_NAME_BRANCHES, NAME_REASONS = allowed({
    ("plan/costing/time.py: group == 'tp'",):
        "chunk_time sorts the traced collectives by the group the trace recorded them on: TP's (with SP's "
        "redistribution overhead) into ChunkTime.tp_comm, the others (CP's) into cp_comm, which the techniques' "
        "adjust_chunk terms read; the trace names the group, so the split reads its name",
})
# the totals the lists above allow (93 degree comparisons and 2 name branches at df287d5, before issue 45; 48
# and 2 at 14094b8, before the planner's options, reasons, uneven splits and DP memory term moved)
DEGREE_COMPARISONS_AT_MOST = 12
NAME_BRANCHES_AT_MOST = 1


def found_outside_parallel(check) -> Counter:
    """Counter of "path: what" over src/ outside parallel/, `check(source, dims)` giving "LINE: what" strings."""
    found = Counter()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith("parallel/"):
            found.update(f"{rel}: {where.partition(': ')[2]}" for where in check(path.read_text(), DIM_NAMES))
    return found


def by_file(found: Counter) -> dict[str, int]:
    files = Counter()
    for entry, n in found.items():
        files[entry.partition(": ")[0]] += n
    return dict(sorted(files.items()))


def compare_with_allowed(found: Counter, allow: Counter, at_most: int, what: str) -> None:
    new = found - allow
    assert not new, f"{what} outside parallel/ (ask the Layout a question instead): {sorted(new.elements())}"
    gone = allow - found
    assert not gone, f"no longer found: remove from the allow-list (and lower the count): {sorted(gone.elements())}"
    assert sum(found.values()) <= at_most, (sum(found.values()), by_file(found))


def test_degree_comparisons_outside_parallel_are_only_the_listed_ones():
    found = found_outside_parallel(source_rules.degree_comparisons)
    compare_with_allowed(found, ALLOWED_DEGREE_COMPARISONS, DEGREE_COMPARISONS_AT_MOST, "degree comparison")
    assert set(DEGREE_REASONS) == set(ALLOWED_DEGREE_COMPARISONS)


def test_name_branches_outside_parallel_are_only_the_listed_ones():
    found = found_outside_parallel(source_rules.name_branches)
    compare_with_allowed(found, ALLOWED_NAME_BRANCHES, NAME_BRANCHES_AT_MOST, "branch on a dimension's name")
    assert set(NAME_REASONS) == set(ALLOWED_NAME_BRANCHES)


PLANTED = '''
def f(layout, cfg, group, degrees, name, pp):
    if layout.tp > 1 and pp == 1:
        return layout.cp_enabled, getattr(layout, "ep", 1), (cfg.dp_replicate or 1) > 1, degrees["cp"] >= 2
    others = [d for d in ("tp", "pp", "cp", "dp_shard", "ep") if getattr(cfg, d, None) not in (None, 1)]
    if group == "tp" or name in ("ep", "dp_shard") or "cp" != name:
        return others
    return layout.splits_stages, layout.tp * 2, layout.micro_batch > 1, group == "weights", ("tp", "weights")
'''


def test_the_counters_see_each_form_and_nothing_else():
    assert source_rules.degree_comparisons(PLANTED, DIM_NAMES) == [
        "3: layout.tp > 1", "3: pp == 1", "4: layout.cp_enabled", "4: getattr(layout, 'ep', 1)",
        "4: (cfg.dp_replicate or 1) > 1", "4: degrees['cp'] >= 2"]
    assert source_rules.name_branches(PLANTED, DIM_NAMES) == [
        "6: group == 'tp'", "6: name in ('ep', 'dp_shard')", "6: 'cp' != name",
        "5: lists ('tp', 'pp', 'cp', 'dp_shard', 'ep')"]
    # a second copy of an allowed comparison is one too many
    twice = Counter({"train/recovery/replica_launch.py: (cfg.dp_replicate or 1) > 1": 2})
    with pytest.raises(AssertionError, match="replica_launch.py"):
        compare_with_allowed(twice, ALLOWED_DEGREE_COMPARISONS, DEGREE_COMPARISONS_AT_MOST, "degree comparison")
