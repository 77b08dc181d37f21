"""benchmarks/inference.py in this process, tiny: paratrain's generate and transformers' on the same export, both
timed, side by side as a ratio, and the same greedy tokens (the benchmark's own check that the two ran the same
model). Its speed claim (paratrain at least 1.0x at batch 1 and 8) is measured by running it, not here."""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("transformers")


def test_inference_benchmark_runs_both_sides(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import inference

    args = inference.parse_args(["--batches", "1,2", "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1",
                                 "--train-steps", "1", "--workdir", str(tmp_path)])
    doc = inference.run(args)
    assert [r["batch"] for r in doc["rows"]] == [1, 2]
    for row in doc["rows"]:
        assert row["paratrain_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["paratrain_tokens_per_s"] / row["transformers_tokens_per_s"])
        assert row["same_tokens"] == 1.0
        assert len(row["paratrain_runs"]) == len(row["transformers_runs"]) == 1
    assert "paratrain tok/s" in inference.table(doc)
