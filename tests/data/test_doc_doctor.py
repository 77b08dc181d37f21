"""The doctor's data_loading finding on document data names the fixes that exist: more --data-workers, or
tokenizing once (`data prepare`) and training on the .bin. Contexts built as in tests/doctor/test_doctor_units.py."""

from __future__ import annotations

from doctor.test_doctor_units import capture, context
from paratrain.doctor.rules import diagnose


def test_data_loading_fix_names_workers_and_pre_tokenized_data():
    slow = [capture(iteration=0.2, data=0.1)]
    finding = diagnose(context(slow, data="docs.jsonl", tokenizer="tok"))[0]
    assert finding.cause == "data_loading"
    assert "--data-workers" in finding.fix and "data prepare" in finding.fix and "tokens.bin" in finding.fix
    plain = diagnose(context(slow))[0]
    assert "--data-workers" not in plain.fix and ".bin" in plain.fix
