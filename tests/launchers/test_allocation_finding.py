"""Issue 37: doctor compares what a Slurm job asked for (SLURM_CPUS_PER_TASK) with the cores a rank was given
(its CPU affinity, as capture records it): fewer is an allocation finding; as many is none."""

from __future__ import annotations

from doctor.test_doctor_units import capture, context
from paratrain.doctor.rules import diagnose


def _allocation(findings):
    return [f for f in findings if f.cause == "allocation"]


def test_fewer_cores_than_the_job_asked_is_a_finding(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    found = _allocation(diagnose(context([capture(threads=1, cores=1)])))
    assert len(found) == 1 and found[0].numbers == {"cpus_asked": 8, "cores_given": 1}, found
    assert found[0].severity == "high" and "srun --cpus-per-task" in found[0].fix


def test_the_cores_the_job_asked_for_is_no_finding(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert _allocation(diagnose(context([capture(threads=1, cores=8)]))) == []
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")  # not under Slurm: nothing asked, nothing to compare
    assert _allocation(diagnose(context([capture(threads=1, cores=1)]))) == []
