"""What a CPU run measures against the planner's peak: the process's resident memory above what it held just
before the model was built. That baseline is the interpreter, torch's libraries and the process group, which the
planner does not predict (as a GPU's peak allocated bytes leave out the CUDA context)."""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 2**30


def resident_gib() -> tuple[float, float] | None:
    """(now, peak) resident GiB of this process, from /proc/self/status (Linux); None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            status = f.read()
    except OSError:
        return None
    found = {key: re.search(rf"^{key}:\s+(\d+) kB", status, re.M) for key in ("VmRSS", "VmHWM")}
    if not all(found.values()):
        return None
    return int(found["VmRSS"].group(1)) * 1024 / GIB, int(found["VmHWM"].group(1)) * 1024 / GIB


def _reset_peak() -> bool:
    """The kernel's resident high-water mark set back to the resident memory now (Linux >= 4.0): the peak read at
    step 2 is then that of the run, not of whatever this process did before (in a one-rank run: the planner)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class ResidentBaseline:
    gib: float  # resident memory when taken
    since_start: bool  # the peak could not be reset: it is the process's since it started

    @classmethod
    def take(cls) -> ResidentBaseline | None:
        """Call before the model is built; None where resident memory cannot be read."""
        reset = _reset_peak()
        now = resident_gib()
        return None if now is None else cls(now[0], since_start=not reset)

    def peak_above(self) -> float:
        """GiB: the resident peak since the baseline, less the baseline."""
        now = resident_gib()
        return (now[1] if now else self.gib) - self.gib

    def describe(self) -> str:
        peak = "process peak" if self.since_start else "peak"
        return f"resident {peak} above the {self.gib:.3g} GiB held before the model was built"
