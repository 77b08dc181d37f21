"""`paratrain eval`'s contract in this process (issue 49): --json prints one document with DESIGN.md's keys, the loss
equals the training run's val_loss at the saved step, hf:DIR (the exported checkpoint) gives the same loss, a
mixture's sources get their own losses, and bad input (a missing, incomplete or corrupt checkpoint, another model,
options that do not apply) is one line and exit 2. Multi-rank layouts: test_eval_layouts.py."""

from __future__ import annotations

import json
import shutil

import pytest

from paratrain.verify.compare import Tolerance
from reliability.inproc import one_rank
from support.doc_corpus import make_corpus

KEYS = {"loss", "perplexity", "tokens", "per_source", "layout", "checkpoint"}
RUN = ("--global-batch", "4", "--seq-len", "32", "--val-batches", "2")
ONE = ("--strategy", "single", "--nproc", "1")


def close(loss: float, ref: float) -> bool:
    tol = Tolerance()
    return abs(loss - ref) <= tol.loss_atol + tol.loss_rtol * abs(ref)


def train_saving(root, steps: int, **overrides) -> tuple:
    """(the step directory, the run's val_loss there): a single-device run in this process, validated and saved at
    its last step."""
    from paratrain.train.trainer import Trainer

    cfg = {"model": "tiny4", "strategy": "single", "nproc": 1, "device": "cpu", "steps": steps, "global_batch": 4,
           "seq_len": 32, "val_batches": 2, "eval_every": steps, "ckpt_every": steps, "ckpt_dir": str(root),
           "resume": "never", "metrics": False, **overrides}
    from paratrain.config import TrainConfig

    with one_rank() as rt:
        summary = Trainer(TrainConfig(**cfg), rt, quiet=True).fit()
    return root / f"step-{steps}", summary["val_loss"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_saving(tmp_path_factory.mktemp("eval-ck"), steps=2)


def test_json_is_one_document_equal_to_the_runs_val_loss(cli_here, trained):
    step_dir, val_loss = trained
    res = cli_here("eval", str(step_dir.parent), *RUN, "--json")  # no layout flag: the one it was saved under
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)  # the whole of stdout is one document
    assert set(doc) == KEYS
    assert doc["checkpoint"] == str(step_dir)  # the newest complete step of the directory given
    assert close(doc["loss"], val_loss), (doc["loss"], val_loss)
    assert doc["perplexity"] == pytest.approx(2.718281828 ** doc["loss"], rel=1e-9)
    assert doc["tokens"] == 2 * 4 * 32
    assert doc["per_source"] == {"synthetic": {"loss": doc["loss"], "tokens": doc["tokens"]}}
    # saved by one device (the default layout would be ddp on 2 ranks)
    assert (doc["layout"]["dp_replicate"], doc["layout"]["dp_shard"], doc["layout"]["tp"]) == (1, 1, 1)
    assert "eval " in res.stderr and "loss" in res.stderr  # the human line goes to stderr


def test_hf_directory_of_the_exported_checkpoint_gives_the_same_loss(cli_here, trained, tmp_path):
    step_dir, _ = trained
    assert cli_here("export", str(step_dir), "-o", str(tmp_path / "hf")).returncode == 0
    ours = json.loads(cli_here("eval", str(step_dir), *RUN, *ONE, "--json").stdout)
    res = cli_here("eval", f"hf:{tmp_path / 'hf'}", *RUN, *ONE, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["checkpoint"] == f"hf:{tmp_path / 'hf'}"
    assert close(doc["loss"], ours["loss"]), (doc["loss"], ours["loss"])


def test_mixture_reports_each_sources_held_out_loss(cli_here, tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    from paratrain.config import TrainConfig
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(model="tiny4", vocab_size=320, strategy="single", nproc=1, device="cpu", seq_len=32,
                      global_batch=4, ckpt_dir=str(tmp_path / "ck"), resume="never", metrics=False)
    with one_rank() as rt:
        step_dir = Trainer(cfg, rt, quiet=True).save_checkpoint()  # its initial weights, step 0
    held_out = ("--val-fraction", "0.3", "--tokenizer", corpus["tok"], *RUN, *ONE, "--json")
    mixed = cli_here("eval", str(step_dir), "--data", f"{corpus['a']}:0.5,{corpus['b']}:0.5", *held_out)
    assert mixed.returncode == 0, mixed.stderr
    per_source = json.loads(mixed.stdout)["per_source"]
    assert set(per_source) == {corpus["a"], corpus["b"]}
    for name in (corpus["a"], corpus["b"]):  # each equals the eval of that source alone
        alone = json.loads(cli_here("eval", str(step_dir), "--data", name, *held_out).stdout)
        assert per_source[name] == {"loss": alone["loss"], "tokens": alone["tokens"]}
        assert 0 < alone["tokens"] <= 2 * 4 * 32  # only the targets inside a document count
    assert per_source[corpus["a"]]["loss"] != per_source[corpus["b"]]["loss"]
    held = cli_here("eval", str(step_dir), "--val-data", corpus["val"], "--tokenizer", corpus["tok"], *RUN, *ONE, "--json")
    assert held.returncode == 0, held.stderr
    assert set(json.loads(held.stdout)["per_source"]) == {corpus["val"]}


def one_line_exit_2(res, *phrases: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("error: "), res.stderr
    assert [ln for ln in lines if ln.startswith("error")] == lines[-1:]
    for phrase in phrases:
        assert phrase in lines[-1], lines[-1]
    assert res.stdout == ""


def test_bad_sources_are_one_line_and_exit_2(cli_inproc, trained, tmp_path):
    step_dir, _ = trained
    one_line_exit_2(cli_inproc("eval", str(tmp_path / "nowhere"), *ONE), "no such checkpoint directory")
    incomplete = tmp_path / "incomplete"
    shutil.copytree(step_dir, incomplete)
    (incomplete / "manifest.json").unlink()
    one_line_exit_2(cli_inproc("eval", str(incomplete), *ONE), "not a complete paratrain checkpoint")
    one_line_exit_2(cli_inproc("eval", str(tmp_path), *ONE), "not a paratrain checkpoint")
    one_line_exit_2(cli_inproc("eval", str(step_dir), "--model", "gpt2-tiny", *ONE), "contradicts", "tiny4")
    one_line_exit_2(cli_inproc("eval", str(step_dir), "--vocab-size", "512", *ONE), "vocab_size 256")
    one_line_exit_2(cli_inproc("eval", f"hf:{tmp_path / 'none'}", *ONE), "not a directory")
    one_line_exit_2(cli_inproc("eval", str(step_dir), "--resume", "never", *ONE), "--resume")
    one_line_exit_2(cli_inproc("eval", str(step_dir), "--val-fraction", "0.1", *ONE), "--val-fraction")
    one_line_exit_2(cli_inproc("eval", str(step_dir), "--heal-replicas", *ONE), "paratrain eval")


def test_past_the_presets_positions_the_trained_length_is_asked_for(cli_inproc, tmp_path):
    from paratrain.config import TrainConfig
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(model="tiny", strategy="single", nproc=1, device="cpu", seq_len=1100, global_batch=1,
                      ckpt_dir=str(tmp_path / "ck"), resume="never", metrics=False)  # tiny's table: 1024 positions
    with one_rank() as rt:
        step_dir = Trainer(cfg, rt, quiet=True).save_checkpoint()
    one_line_exit_2(cli_inproc("eval", str(step_dir), "--seq-len", "32", *ONE), "--seq-len 1100")


def test_corrupt_checkpoint_is_one_line_and_exit_2(cli_here, trained, tmp_path):
    step_dir, _ = trained
    corrupt = tmp_path / "corrupt"
    shutil.copytree(step_dir, corrupt)
    shard = next(corrupt.glob("*.distcp"))
    shard.write_bytes(b"\x00" * shard.stat().st_size)  # the sizes the manifest lists still match
    # found by DCP in the ranks (2 here), reported by the launcher in one line
    one_line_exit_2(cli_here("eval", str(corrupt), *RUN, "--strategy", "ddp", "--nproc", "2"), "unreadable")


def test_a_long_eval_prints_progress_now_and_then(monkeypatch, caplog):
    from paratrain.infer import eval_run

    clock = iter([0.0, 1.0, 6.0, 7.0, 8.0, 13.0])  # the start, then one reading per batch
    monkeypatch.setattr(eval_run.time, "perf_counter", lambda: next(clock))
    progress = eval_run.Progress("synthetic")
    with caplog.at_level("INFO", logger="paratrain"):
        for done in range(1, 6):
            progress(done, 5, 2.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["eval synthetic: 2/5 batches, loss so far 2.5000 (6 s)",
                     "eval synthetic: 5/5 batches, loss so far 2.5000 (13 s)"]
