"""A refused resume names each changed setting by its job.yaml key."""

from __future__ import annotations

from tokenmill.jobs.fingerprint import changed_settings


def test_model_section_settings_are_named_by_their_job_yaml_keys() -> None:
    old = {"dtype": "auto", "quantization": "none", "chat_template_kwargs": {"a": 1},
           "sampling": {"max_tokens": 8}}  # fmt: skip
    new = {"dtype": "float32", "quantization": "fp8", "chat_template_kwargs": {"a": 2},
           "sampling": {"max_tokens": 12}}  # fmt: skip
    assert changed_settings(old, new) == [
        "model.chat_template_kwargs.a: 1 -> 2",
        'model.dtype: "auto" -> "float32"',
        'model.quantization: "none" -> "fp8"',
        "sampling.max_tokens: 8 -> 12",
    ]
