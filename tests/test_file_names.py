"""File names are unique across src/paratrain's packages (docs/architecture.md), so a name in a traceback or a
review says which file it is. `__init__.py` is the one name every package shares. Walks the tree; imports nothing."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path, PurePosixPath

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"


def shared_names(paths: list[str]) -> dict[str, list[str]]:
    """{file name: the paths that have it} for every name more than one path has, `__init__.py` aside."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        if PurePosixPath(path).name != "__init__.py":
            by_name[PurePosixPath(path).name].append(path)
    return {name: sorted(found) for name, found in by_name.items() if len(found) > 1}


def test_module_file_names_are_unique_across_packages():
    shared = shared_names([path.relative_to(SRC).as_posix() for path in SRC.rglob("*.py")])
    assert not shared, "\n".join(f"{name}: {', '.join(found)}" for name, found in sorted(shared.items()))


def test_a_planted_duplicate_name_is_found():
    planted = ["models/routing.py", "verify/routing.py", "models/__init__.py", "verify/__init__.py",
               "plan/search.py", "parallel/dp/dp_cost.py"]
    assert shared_names(planted) == {"routing.py": ["models/routing.py", "verify/routing.py"]}
