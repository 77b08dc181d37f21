"""A Hugging Face model in, trained, and out again: `--model hf:DIR` -> train -> `export` -> from_pretrained ->
`--model hf:OUT` -> train again, through the CLI as a user runs it.

Two chains of 2-rank runs, each leg training from the previous leg's export:
- a tiny Qwen2 (untied head; q/k/v biases): zero3 -> tp -> pp (a pipeline run's checkpoint names its tensors by
  paratrain's stage parts, tok_embeddings / layers.N / norm / output, mapped back on export);
- a tiny tied Llama-style config: zero3 -> pp (the last stage's copy of the tied table is written once; a tp
  checkpoint names its tensors as a zero3 one does, so the Qwen2 chain's tp leg covers that path).
For every export: the safetensors key set equals what transformers' own save_pretrained writes for the input
model (a tied head written once), from_pretrained reports nothing missing or unexpected, a tied model stays tied,
and transformers' logits equal paratrain's logits (its hf: model, or its pipeline stages for the pp leg) with the
checkpoint's weights (fp32, atol 1e-5). The next leg's first loss equals the exported model's loss on that
first batch: the weights went in. The last leg's export is checked the same way but not trained again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers  # the [hf] extra is part of [test]
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from paratrain.convert.hf_export import export_checkpoint
from paratrain.errors import UserError
from paratrain.models.hf_model import build_hf_model
from paratrain.models.hf_pipeline import pipeline_view
from paratrain.models.hf_shape import args_from_hf_config
from paratrain.train.data.indexed_sets import BatchSource, make_dataset
from paratrain.train.recovery.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from reliability.inproc import run_cli_inproc

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from hf_configs import write_config  # noqa: E402

SEQ, BATCH = 32, 4
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the 256 ids, its config, and a generation config naming eos and pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "<pad>": 1, **{f"w{i}": i for i in range(2, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "pad_token_id": 1}))


def train(root: Path, spec: str, strategy: str, name: str, extra: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A 2-rank, 2-step run of `spec` saving its last step; returns (checkpoint step dir, metrics.jsonl). In this
    process: the ranks fork from its warm forkserver (no interpreter start)."""
    code, _, err = run_cli_inproc(["train", "--model", spec, "--strategy", strategy, "--nproc", "2", "--steps", "2",
                                   "--seq-len", str(SEQ), "--global-batch", str(BATCH), "--ckpt-every", "2",
                                   "--ckpt-dir", f"ck-{name}", "--out", f"run-{name}", "--resume", "never", *extra],
                                  cwd=root)
    assert code == 0, err[-3000:]
    return root / f"ck-{name}" / "step-2", root / f"run-{name}" / "metrics.jsonl"


def chain(root: Path, source: Path, strategies: tuple[str, ...], first: tuple[str, ...] = ()) -> list[dict]:
    """Train, export, train the export...; `first`: more train arguments for the first leg (its data)."""
    legs, spec = [], f"hf:{source.name}"
    for i, strategy in enumerate(strategies):
        step_dir, metrics = train(root, spec, strategy, f"{i}-{strategy}", first if i == 0 else ())
        out = root / f"out-{i}-{strategy}"
        if i == 0:  # the CLI's arguments, as a user writes them, once (in this process: export starts no worker)
            code, stdout, stderr = run_cli_inproc(["export", step_dir.parent.name, "-o", out.name, "--json"], cwd=root)
            assert code == 0, stderr[-2000:]
            doc = json.loads(stdout)
        else:
            doc = export_checkpoint(step_dir, out)
        legs.append({"strategy": strategy, "trained_from": root / spec[3:], "ckpt": step_dir, "metrics": metrics,
                     "out": out, "doc": doc})
        spec = f"hf:{out.name}"
    return legs


@pytest.fixture(scope="module")
def qwen2_chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2-chain")
    source = write_config(root, "qwen2")
    write_tokenizer(source)
    return chain(root, source, ("zero3", "tp", "pp"))


@pytest.fixture(scope="module")
def tied_chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied-chain")
    source = write_config(root, "llama", tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return chain(root, source, ("zero3", "pp"))


WORDS = ("alpha", "beta", "x1", "42", "3.14", "hello,", "world!", "(a+b)", "'quoted'", "2024-01-05", "#tag",
         "foo_bar", "user@example.com", "1234567", "Über", "naïve", "  spaced", "end.\n")


@pytest.fixture(scope="module")
def tokenized_qwen2_chain(tmp_path_factory):
    """A tied Qwen2 trained first on 300 documents (digits, punctuation) with a tokenizer `paratrain data
    tokenizer` trains on them, then from its export under tp (synthetic data). The model directory holds the same
    tokenizer.json, as a user keeps it beside the config."""
    from paratrain.train.data.train_tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("qwen2-tokenized")
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(300)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "docs.txt").write_text("\n".join(docs))
    train_tokenizer([root / "docs.txt"], root / "tok", 320)
    source = write_config(root, "qwen2", tie_word_embeddings=True, vocab_size=320)
    shutil.copyfile(root / "tok" / "tokenizer.json", source / "tokenizer.json")
    return chain(root, source, ("zero3", "tp"), ("--data", "docs.jsonl", "--tokenizer", "tok")), docs, root / "tok"


def saved_keys(directory: Path) -> set[str]:
    keys = set()
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            keys |= set(handle.keys())
    return keys


def reference_keys(config_dir: Path, tmp: Path) -> set[str]:
    """What transformers itself writes for the input model: save_pretrained of a model built from its config."""
    config = transformers.AutoConfig.from_pretrained(str(config_dir))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp))
    return saved_keys(tmp)


def paratrain_logits(leg: dict) -> torch.Tensor:
    """The checkpoint's weights in paratrain's own model: the hf: wrapper, or the pipeline stages for a pp run."""
    spec = f"hf:{leg['trained_from']}"
    model = build_hf_model(spec, seed=None)
    if leg["strategy"] == "pp":
        model = pipeline_view(model, args_from_hf_config(json.loads((leg["trained_from"] / "config.json").read_text())))
    sd = {"model": model.state_dict()}
    dcp.load(sd, storage_reader=SafeFileSystemReader(leg["ckpt"]), planner=SafeLoadPlanner(), no_dist=True)
    model.load_state_dict(sd["model"])
    with torch.no_grad():
        return model.eval()(TOKENS)


def hf_model(directory: Path, tied: bool):
    """from_pretrained, asserting nothing is missing, unexpected or misshaped, and that a tied head stays tied."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    head, table = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head.data_ptr() == table.data_ptr()) == tied and model.config.tie_word_embeddings == tied
    return model.eval()


def check_export(leg: dict, reference: set[str], tied: bool) -> None:
    assert saved_keys(leg["out"]) == reference
    model = hf_model(leg["out"], tied)
    with torch.no_grad():
        theirs = model(TOKENS).logits
    assert (theirs - paratrain_logits(leg)).abs().max().item() < 1e-5


def first_batch_loss(directory: Path) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    batch = BatchSource(make_dataset("synthetic", model.config.vocab_size, SEQ, 0), BATCH, 0, 1, BATCH).rank_batch(0)
    with torch.no_grad():
        logits = model(batch.inputs).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()))


def check_chain(legs: list[dict], tmp_path: Path, tied: bool) -> None:
    reference = reference_keys(legs[0]["trained_from"], tmp_path / "reference")
    for leg in legs:
        assert leg["doc"]["kind"] == "hf" and leg["doc"]["step"] == 2, leg["doc"]
        check_export(leg, reference, tied)
    for before, after in zip(legs, legs[1:]):  # the next leg started from this export's weights
        first = json.loads(after["metrics"].read_text().splitlines()[0])["loss"]
        assert first == pytest.approx(first_batch_loss(before["out"]), rel=1e-5), after["strategy"]


def test_untied_qwen2_round_trips_under_zero3_tp_and_pp(qwen2_chain, tmp_path):
    assert [leg["strategy"] for leg in qwen2_chain] == ["zero3", "tp", "pp"]
    check_chain(qwen2_chain, tmp_path, tied=False)


def test_tied_llama_round_trips_under_zero3_and_pp(tied_chain, tmp_path):
    assert [leg["strategy"] for leg in tied_chain] == ["zero3", "pp"]
    check_chain(tied_chain, tmp_path, tied=True)
    assert "lm_head.weight" not in saved_keys(tied_chain[-1]["out"])


def test_tied_qwen2_with_its_own_tokenizer_round_trips(tokenized_qwen2_chain, tmp_path):
    """The export ships the run's --tokenizer, and AutoTokenizer gives exactly the training ids (transformers'
    own Qwen2 class would split digits and punctuation otherwise); every file is written with one mode."""
    from tokenizers import Tokenizer

    legs, docs, tokenizer_dir = tokenized_qwen2_chain
    check_chain(legs, tmp_path, tied=True)
    out = legs[0]["out"]
    training = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert [auto(d)["input_ids"] for d in docs] == [training.encode(d).ids for d in docs]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(legs[0]["doc"]["files"])
    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == \
        {f.name: 0o666 & ~umask for f in out.iterdir()}


def test_a_mangled_name_fails_the_key_check(qwen2_chain, tmp_path):
    """Fault injected: one tensor of a good export renamed. The same checks must fail."""
    bad = tmp_path / "bad"
    shutil.copytree(qwen2_chain[0]["out"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight_"] = tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    leg = {**qwen2_chain[0], "out": bad}
    with pytest.raises(AssertionError):
        check_export(leg, reference_keys(leg["trained_from"], tmp_path / "reference"), tied=False)
    with pytest.raises(AssertionError):  # and transformers' own loading report, checked on its own
        hf_model(bad, tied=False)


def test_manifest_says_which_model_and_export_copies_its_tokenizer(qwen2_chain, tied_chain):
    first = qwen2_chain[0]
    source = json.loads((first["ckpt"] / "manifest.json").read_text())["model_source"]
    assert source["kind"] == "hf" and source["config"] == json.loads((first["trained_from"] / "config.json").read_text())
    assert Path(source["config_path"]) == (first["trained_from"] / "config.json").resolve()
    last = qwen2_chain[-1]["out"]  # copied leg by leg: source -> out-0 -> out-1 -> out-2
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= \
        set(qwen2_chain[-1]["doc"]["files"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(last))
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<eos>", "<pad>")
    generation = transformers.GenerationConfig.from_pretrained(str(last))
    assert (generation.eos_token_id, generation.pad_token_id) == (0, 1)
    assert json.loads((last / "config.json").read_text())["dtype"] == "float32"
    # no generation config at the source: the config's own token ids, nothing invented
    tied_generation = json.loads((tied_chain[0]["out"] / "generation_config.json").read_text())
    assert {k: v for k, v in tied_generation.items() if k.endswith("token_id")} == \
        {"bos_token_id": 1, "eos_token_id": 2}


def test_export_without_the_source_directory(qwen2_chain, tmp_path, caplog):
    """The config travels in the manifest: with the source gone the model still exports, and one line says the
    tokenizer could not come along. An older manifest (no config in it) with the source gone: one line."""
    ck = tmp_path / "ck" / "step-2"
    shutil.copytree(qwen2_chain[0]["ckpt"], ck)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["model_source"]["config_path"] = str(tmp_path / "gone" / "config.json")
    (ck / "manifest.json").write_text(json.dumps(manifest))
    doc = export_checkpoint(ck, tmp_path / "out")
    assert doc["files"] == ["config.json"]
    assert any("source of hf:qwen2 is gone" in r.getMessage() for r in caplog.records)
    hf_model(tmp_path / "out", tied=False)
    del manifest["model_source"]["config"]
    (ck / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="config.json is not at .*gone.*put it back"):
        export_checkpoint(ck, tmp_path / "out2")


def test_custom_module_exports_its_own_state_dict(tmp_path):
    """train --script / paratrain.api: a plain safetensors state dict that the factory's model loads strictly."""
    from paratrain import api

    script = Path(__file__).parents[1] / "tp_custom_model.py"
    api.fit(f"{script}:build", strategy="single", nproc=1, device="cpu", steps=1, ckpt_every=1,
            ckpt_dir=str(tmp_path / "ck"), global_batch=4)
    doc = export_checkpoint(tmp_path / "ck", tmp_path / "out")
    assert doc["kind"] == "custom" and doc["files"] == []
    sys.path.insert(0, str(script.parent))
    from tp_custom_model import build

    model = build()
    model.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")))  # strict: same key set
    sd = {"model": model.state_dict()}
    dcp.load(sd, storage_reader=SafeFileSystemReader(tmp_path / "ck" / "step-1"), planner=SafeLoadPlanner(),
             no_dist=True)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in sd["model"].items())


def test_preset_checkpoint_still_exports_as_llama(tiny_checkpoint, tmp_path):
    doc = export_checkpoint(tiny_checkpoint, tmp_path / "out")
    assert (doc["kind"], doc["architecture"]) == ("preset", "LlamaForCausalLM")
    assert json.loads((tiny_checkpoint / "manifest.json").read_text())["model_source"]["kind"] == "preset"
