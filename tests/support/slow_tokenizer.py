"""A slow on-the-fly tokenizer: every document the document stream tokenizes costs SECONDS more (a sleep in
encode_batch, called for 4 documents at a time), wherever the stream runs (the loader's worker processes are forked from the process that loaded
this plugin). tests/data/test_doc_doctor.py: the doctor's data_loading finding, then gone on pre-tokenized data.

    PARATRAIN_PLUGINS=support.slow_tokenizer:plugin PARATRAIN_TEST_TOKENIZE_DELAY_S=0.01 paratrain doctor ...
"""

from __future__ import annotations

import os
import time

from paratrain.errors import UserError
from support.step_share import delay_s, share_of_step, track_steps

DELAY_ENV = "PARATRAIN_TEST_TOKENIZE_DELAY_S"


class SlowTokenizer:
    def __init__(self, tok, seconds: float, share: float):
        self.tok, self.seconds, self.share = tok, seconds, share

    def encode_batch(self, texts, **kwargs):
        time.sleep(delay_s(self.seconds * len(texts), self.share))
        return self.tok.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def plugin(hooks) -> None:
    from paratrain.train.data import doc_stream

    text = os.environ.get(DELAY_ENV, "") or "0"
    try:
        seconds = float(text)
    except ValueError:
        raise UserError(f"{DELAY_ENV}={text!r}: give seconds, e.g. 0.01") from None
    if seconds <= 0 or getattr(doc_stream.open_tokenizer, "slowed", False):
        return
    share = share_of_step()
    if share > 0:  # each batch of documents at least `share` x the step's own compute (step_share.py)
        track_steps(hooks)
    original = doc_stream.open_tokenizer

    def open_slow_tokenizer(path: str):
        tok, eot, vocab = original(path)
        return SlowTokenizer(tok, seconds, share), eot, vocab

    open_slow_tokenizer.slowed = True
    doc_stream.open_tokenizer = open_slow_tokenizer
    doc_stream.LOOKAHEAD = 4  # tokenize a few documents at a time: the delay falls on every step, not in bursts
