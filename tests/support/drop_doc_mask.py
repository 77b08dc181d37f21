"""Fault: document masks dropped. After parallelize, every attention hook forgets the document ids it is given,
so attention runs causally across the documents of a packed row (tests/data: the per-document loss test must
then fail).

    PARATRAIN_PLUGINS=support.drop_doc_mask:plugin paratrain train --data docs.jsonl --tokenizer tok ...
"""

from __future__ import annotations


def _forget_documents(attn_fn):
    def attention(q, k, v, doc_ids=None):
        return attn_fn(q, k, v)

    return attention


def plugin(hooks) -> list:
    def after_parallelize(module, layout) -> None:
        module = getattr(module, "module", module)  # DDP's wrapper holds the model as .module
        for block in (getattr(module, "layers", None) or {}).values():
            block.attention.attn_fn = _forget_documents(block.attention.attn_fn)

    return [hooks.after_parallelize(after_parallelize)]
