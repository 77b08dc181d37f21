"""`paratrain export` of a run trained with `--model hf:DIR`: the model back in its own Hugging Face format.

The names are the transformers model's own: the checkpoint holds the wrapper's names (`hf.model.layers.0...`
from HFCausalLM, or `tok_embeddings` / `layers.N` / `norm` / `output` from a pipeline run's stages:
models/hf_pipeline.py), mapped back here. The model is built on the meta device from the run's config.json (no
memory, no weights) to know its exact key set; a tied head is written once, as `save_pretrained` does (the
token table, not `lm_head.weight`), so `from_pretrained` reports no missing or unexpected keys. Tensors transformers
keeps in another layout than it saves (MoE experts, fused in memory, one per expert on disk) are written as
save_pretrained writes them (convert/hf_saved_format.py).

Beside the weights: config.json (the source's, with `architectures` and the dtype written), the source
directory's generation config, and the tokenizer (the run's --tokenizer, else the source directory's:
convert/hf_tokenizer_export.py). The config comes from the manifest
(recorded at save time), so it survives the source directory; the tokenizer does not, and one line says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from paratrain.convert.export_plan import ExportPlan, checkpoint_tensors, write_json
from paratrain.convert.hf_saved_format import saved_format_specs
from paratrain.convert.hf_tokenizer_export import copy_files, write_tokenizer
from paratrain.errors import UserError
from paratrain.interop.hf_format import TORCH_DTYPE_NAMES
from paratrain.models.hf_files import HF_PREFIX, read_hf_config

log = logging.getLogger("paratrain")

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def source_of(step_dir: Path, manifest: dict) -> tuple[str, dict, Path | None]:
    """(the --model spec, its config document, the source directory or None when it is gone)."""
    source = manifest.get("model_source") or {}
    spec = str(source.get("spec") or (manifest.get("model") or {}).get("name", ""))
    given = Path(source["config_path"]) if source.get("config_path") else Path(spec[len(HF_PREFIX):])
    config_path = given / "config.json" if given.is_dir() else given
    directory = config_path.parent if config_path.is_file() else None
    doc = source.get("config")
    if doc is None:  # a manifest from before model_source held the config: the file is the only copy
        if directory is None:
            raise UserError(f"{step_dir} was trained with --model {spec}, whose config.json is not at {config_path} "
                            "any more; export needs it to write the model in its own format: put it back there")
        doc = read_hf_config(HF_PREFIX + str(config_path))
    elif not isinstance(doc.get("model_type"), str) or doc.get("auto_map"):  # a hand-edited manifest
        raise UserError(f"{step_dir}: the config recorded in its manifest names no model_type transformers ships "
                        "without remote code")
    return spec, doc, directory


def meta_model(doc: dict, where: str):
    """The transformers model of the config, on the meta device: names, shapes and ties, no memory."""
    from paratrain.models.hf_model import hf_config_object, require_transformers

    transformers = require_transformers()
    try:
        config = hf_config_object(doc, where)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - values transformers' config validation or the model refuses
        text = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip()) or type(exc).__name__
        raise UserError(f"{where}: transformers cannot build the model: {text[:200]}") from None


def tied_aliases(model) -> set[str]:
    """Parameter names that only repeat another's storage (a tied head): save_pretrained leaves them out."""
    declared = getattr(model, "_tied_weights_keys", None) or ()
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    aliases = set()
    for names in groups.values():
        if len(names) > 1:
            keep = next((n for n in names if n not in declared), names[0])
            aliases.update(n for n in names if n != keep)
    return aliases


def name_mapper(model, doc: dict, stored: dict):
    """checkpoint FQN -> the transformers model's own name. A pipeline run's stages use paratrain's part names;
    the view that named them says how they map back."""
    if all(fqn.startswith("hf.") for fqn in stored):
        return lambda fqn: fqn[len("hf."):]
    from paratrain.models.hf_model import HFCausalLM
    from paratrain.models.hf_pipeline import hf_name, pipeline_view
    from paratrain.models.hf_shape import args_from_hf_config

    try:
        view = pipeline_view(HFCausalLM(model, "export"), args_from_hf_config(doc))
    except UserError:  # no pipeline view of this model: the names cannot be a pipeline run's
        return lambda fqn: fqn[len("hf."):] if fqn.startswith("hf.") else fqn
    return lambda fqn: fqn[len("hf."):] if fqn.startswith("hf.") else hf_name(view, fqn)[len("hf."):]


def hf_model_plan(step_dir: Path, manifest: dict) -> ExportPlan:
    spec, doc, directory = source_of(step_dir, manifest)
    model = meta_model(doc, f"{spec} (as recorded in {step_dir})")
    architecture = type(model).__name__
    stored = checkpoint_tensors(step_dir)
    to_hf = name_mapper(model, doc, stored)
    by_name = {to_hf(fqn): fqn for fqn in stored}
    aliases = tied_aliases(model)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in aliases}
    missing = [n for n in expected if n not in by_name]
    if missing:
        raise UserError(f"{step_dir}: {architecture} of {spec} has a tensor {missing[0]} that the checkpoint lacks "
                        f"({len(missing)} missing): it was not saved from this model")
    foreign = [n for n in by_name if n not in expected and n not in aliases]
    if foreign:
        raise UserError(f"{step_dir}: the checkpoint's tensor {by_name[foreign[0]]} has no place in {architecture} "
                        f"of {spec}: it was not saved from this model")
    for name, shape in expected.items():
        if stored[by_name[name]][0] != shape:
            raise UserError(f"{step_dir}: tensor {by_name[name]} has shape {list(stored[by_name[name]][0])}, but "
                            f"{name} of {spec} is {list(shape)}: it was not saved from this model")
    specs = saved_format_specs(model, expected, by_name)  # e.g. fused MoE experts written one per expert

    tokenizer = (manifest.get("model_source") or {}).get("tokenizer")

    def finish(out: Path, dtype: str) -> list[str]:
        return write_companions(out, doc, architecture, dtype, directory, spec, tokenizer)

    return ExportPlan("hf", architecture, specs, stored, finish)


def write_companions(out: Path, doc: dict, architecture: str, dtype: str, directory: Path | None,
                     spec: str, tokenizer: str | None = None) -> list[str]:
    """config.json, the source's generation config, and the tokenizer (the run's --tokenizer, else the source's:
    convert/hf_tokenizer_export.py); returns the names written."""
    name = TORCH_DTYPE_NAMES[dtype]
    # `dtype` for transformers >= 4.56, `torch_dtype` for older ones: both say what the safetensors hold
    write_json(out / "config.json", {**doc, "architectures": [architecture], "dtype": name, "torch_dtype": name})
    written = ["config.json"]
    if directory is None:
        log.warning("the source of %s is gone: config.json written from the checkpoint's copy, but no %sgeneration "
                    "config could be copied", spec, "" if tokenizer else "tokenizer or ")
    else:
        written += copy_files(["generation_config.json"], directory, out)
    written += write_tokenizer(out, tokenizer, directory, spec)
    ids = {k: doc[k] for k in TOKEN_IDS if doc.get(k) is not None}
    if "generation_config.json" not in written and ids:  # what generate() needs, from the config: nothing invented
        write_json(out / "generation_config.json", {**ids, "_from_model_config": True})
        written.append("generation_config.json")
    return written
