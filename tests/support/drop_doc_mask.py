"""Fault: document masks dropped. After parallelize, every attention hook forgets the document ids it is given,
so attention runs causally across the documents of a packed row (tests/data: the per-document loss test must
then fail). A transformers model (`--model hf:...`): its attention function is swapped for one that drops the
document mask (on one device) or the document ids (context parallel) before calling the original.

    PARATRAIN_PLUGINS=support.drop_doc_mask:plugin paratrain train --data docs.jsonl --tokenizer tok ...
"""

from __future__ import annotations


def _forget_documents(attn_fn):
    def attention(q, k, v, doc_ids=None):
        return attn_fn(q, k, v)

    return attention


def _forget_documents_in_transformers(config) -> None:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[name]

    def attention(module, query, key, value, attention_mask=None, **kwargs):
        kwargs.pop("doc_ids", None)
        return original(module, query, key, value, None, **kwargs)  # no mask: causal across the whole row

    AttentionInterface.register(f"{name}-without-documents", attention)
    config._attn_implementation = f"{name}-without-documents"


def plugin(hooks) -> list:
    def after_parallelize(module, layout) -> None:
        module = getattr(module, "module", module)  # DDP's wrapper holds the model as .module
        # a transformers model, or a pipeline stage of one (models/hf_pipeline.py): its modules share one config
        config = next((m.config for m in module.modules()
                       if hasattr(getattr(m, "config", None), "_attn_implementation")), None)
        if config is not None:
            _forget_documents_in_transformers(config)
            return
        for block in (getattr(module, "layers", None) or {}).values():
            block.attention.attn_fn = _forget_documents(block.attention.attn_fn)

    return [hooks.after_parallelize(after_parallelize)]
