"""Surviving failures: checkpoints (DCP), preemption, healing replicas, and naming the rank that hung
or died (flight recorder, hang report, failure lines)."""
