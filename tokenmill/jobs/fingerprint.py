"""The job fingerprint: a hash of everything that changes results.

Model identity (resolved file or directory, its size), dtype, quantization, the sampling
section, the chat template (its variables and how conversations end), the input (files,
sizes, content samples, columns), the output format and shard size (they decide which file
holds which row), and the engine settings that change what a row gets (``RESULT_SETTINGS``:
an FP8 KV cache rounds every key and value; the two grammar libraries tokenize the same JSON
differently; ``max_model_len`` decides which prompts fit and where outputs are cut). Those
count only when set away from their defaults, so a job begun before they counted still
resumes. Engine tuning (batch sizes, block size, speculation, replicas) is left out: it does
not change greedy results.

The grammar library counts only where a row may carry a constraint (``may_constrain``): a
job without one writes the same rows under either, and changing it there blocked a resume
for nothing. Versions before that hashed it in every job (set away from its default): such
a job's earlier fingerprint is one of ``earlier_fingerprints``, so it still resumes.

The model's content is sampled too (``model_content``: small files whole, weights at 32
places each), so a checkpoint saved again into the same folder at the same sizes is told
apart. It sits beside the hash, not in it (``UNHASHED``): a job whose manifest predates it
still resumes, and it is compared wherever the manifest has it (``same_content``). So
are the input objects' versions (``input_versions``: an object store's ETag or MD5 per
file), which tell an object rewritten in its middle at the same size, where the input's
hash reads only each file's first and last MiB.

The model's identity holds its resolved path, but a job resumes wherever the model lies: the
same files at another path (a folder moved or mounted elsewhere, an alias's file in a venv
built again in another folder) with the same sampled content is the same model
(``moved_model``), so the fingerprint the manifest holds, made with the old path, is one of
``earlier_fingerprints`` and the manifest then takes the new one. A manifest without
``model_content`` cannot tell a moved model from another one at the same sizes: refused.

The settings themselves are kept beside the hash in the manifest, so that a refused resume
can say which of them changed (``changed_settings``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from tokenmill.engine.engine_config import EngineConfig
from tokenmill.jobs.input_changes import file_changes
from tokenmill.jobs.spec import JobSpec

JobSettings = dict[str, Any]  # JSON-able: what the fingerprint hashes

RESULT_SETTINGS = ("kv_cache_dtype", "structured_output_backend", "max_model_len")  # engine.*
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig) if f.name in RESULT_SETTINGS}
# model.add_generation_prompt / continue_final_message: how every conversation ends.
_ENDING_DEFAULTS = {"add_generation_prompt": True, "continue_final_message": False}
_BACKEND = "structured_output_backend"  # counts only where rows may be constrained
# Kept and compared beside the hash (module docstring); resolved_dtype: what model.dtype
# auto is on the device of a local run (runner.settings_of); input_files: how many input
# files and bytes (what a changed input fingerprint changed: a file added, one rewritten);
# input_versions: {url: version} of the input files an object store versions (none for
# local files).
# input_entries: {url: a short hash of the file's entry} (input_changes.py: which files).
# constraints: false where no row may carry a structured-output constraint (may_constrain),
# so a refused resume does not name the grammar library it left out (absent where one may).
UNHASHED = (
    "model_content",
    "resolved_dtype",
    "input_files",
    "input_versions",
    "input_entries",
    "constraints",
)

# What model_content reads: files up to _WHOLE bytes whole, larger ones _SAMPLES chunks of
# _CHUNK bytes spread from the first byte to the last.
_WHOLE, _CHUNK, _SAMPLES = 8 << 20, 64 << 10, 32
# The files of a model directory whose content decides results (weights, configs, tokenizer).
_MODEL_FILES = (".safetensors", ".json", ".model", ".jinja", ".txt", ".tiktoken")
_PLACE = ("file", "dir")  # model_identity's keys that say where the model lies


def model_identity(path: Path) -> dict[str, Any]:
    if path.is_file():
        return {"file": str(path.resolve()), "size": path.stat().st_size}
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    return {
        "dir": str(path.resolve()),
        "files": [(p.name, p.stat().st_size) for p in files],
    }


def model_content(path: Path) -> str:
    """A hex digest of the model's content: ``path`` (a file) or its directory's model files
    (``_MODEL_FILES``), each by name, size and sampled bytes."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        if file is not path and file.suffix not in _MODEL_FILES:
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            if size <= _WHOLE:
                digest.update(f.read())
                continue
            for i in range(_SAMPLES):
                f.seek((size - _CHUNK) * i // (_SAMPLES - 1))
                digest.update(f.read(_CHUNK))
    return digest.hexdigest()


def may_constrain(spec: JobSpec, input_format: str) -> bool:
    """Whether a row of the job may carry a structured-output constraint, so that
    engine.structured_output_backend (the grammar library) may change its result: the job's
    own sampling.structured_output (or sampling.response_format), a constraint column
    (input.structured_output_column), or an OpenAI Batch input (``input_format``, the format
    the input resolved to: "auto" where unknown), whose bodies may each hold a
    response_format. The last is not told from the spec: a batch input counts whether or not
    any body holds one (knowing would take reading every body before the run)."""
    return (
        spec.sampling.structured_output is not None
        or spec.input.structured_output_column is not None
        or input_format in ("openai-batch", "auto")
    )


def job_settings(
    spec: JobSpec,
    model_path: Path,
    chat_template: str | None,
    input_fingerprint: str,
    input_files: dict[str, int] | None = None,
    input_versions: dict[str, str] | None = None,
    input_entries: dict[str, str] | None = None,
    input_format: str = "auto",
) -> JobSettings:
    """Everything that changes results, as plain JSON values (and ``input_files``, the
    input's file and byte counts, ``input_versions``, its objects' versions where the store
    gives them, and ``input_entries``, each file's entry hashed, beside them: ``UNHASHED``).
    ``input_format``: the format the input resolved to, which says whether its rows may
    carry constraints (``may_constrain``; "auto": they may)."""
    settings = {
        "model": model_identity(model_path),
        "model_content": model_content(model_path),
        "dtype": spec.model.dtype,
        "quantization": spec.model.quantization,
        "sampling": spec.sampling.model_dump(mode="json"),
        "chat_template": chat_template or "",
        "input": input_fingerprint,
        "output": {"format": spec.output.format, "rows_per_shard": spec.output.rows_per_shard},
    }
    if input_files is not None:
        settings["input_files"] = input_files
    if input_versions:  # absent for local files: their manifests stay as they were
        settings["input_versions"] = input_versions
    if input_entries:  # absent past MAX_NAMED_FILES files: counts only then
        settings["input_entries"] = input_entries
    if spec.model.chat_template_kwargs:  # absent when unset: older jobs resume
        settings["chat_template_kwargs"] = dict(spec.model.chat_template_kwargs)
    for key, default in _ENDING_DEFAULTS.items():  # absent at their defaults, as above
        if getattr(spec.model, key) != default:
            settings[key] = getattr(spec.model, key)
    constrained = may_constrain(spec, input_format)
    if not constrained:
        settings["constraints"] = False
    engine = {
        key: getattr(spec.engine, key)
        for key in RESULT_SETTINGS
        if getattr(spec.engine, key) != _DEFAULTS[key] and (key != _BACKEND or constrained)
    }
    if engine:
        settings["engine"] = engine
    return json.loads(json.dumps(settings))  # tuples become lists, as they read back


def fingerprint(settings: JobSettings) -> str:
    """The hex sha256 of ``settings`` but ``UNHASHED`` (the manifest's ``fingerprint``)."""
    hashed = {key: value for key, value in settings.items() if key not in UNHASHED}
    return hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()


def moved_model(kept: JobSettings | None, settings: JobSettings) -> dict[str, Any] | None:
    """The model identity of ``kept`` (the settings of the progress a run may resume: the
    manifest's) where the model has moved since and is otherwise the same as ``settings``
    says: another path (``_PLACE``), the same file names and sizes, and ``model_content`` in
    both and equal. None where it did not move, changed, or ``kept`` predates
    ``model_content`` (a move cannot be told from a model saved again at the same sizes)."""
    if kept is None or "model_content" not in kept:
        return None
    old, new = kept.get("model"), settings["model"]
    if kept["model_content"] != settings.get("model_content") or not isinstance(old, dict):
        return None
    if old == new or old.keys() != new.keys():  # (a file where a folder was: another model)
        return None
    same_files = all(old[key] == new[key] for key in new if key not in _PLACE)
    return old if same_files else None


def earlier_fingerprints(
    settings: JobSettings,
    earlier_input: str | None,
    spec: JobSpec | None = None,
    kept: JobSettings | None = None,
) -> tuple[str, ...]:
    """The fingerprints earlier versions gave a job of these ``settings`` where this one's
    differs: by how it hashes its input (``earlier_input``: InputFingerprint.earlier, each
    URL hashed whole, a presigned URL's signature or a password in it; None where it is
    hashed as then), or by the grammar library ``spec`` sets away from its default where its
    rows carry no constraint (hashed then, left out now: ``may_constrain``). A job begun
    then resumes, its manifest then taking this version's fingerprint. Neither hashed nor
    kept in the manifest. So too the fingerprint a run with the model at its earlier path
    gave, where ``kept`` (the manifest's settings) says it moved since (``moved_model``)."""
    inputs = [settings["input"]] + ([] if earlier_input is None else [earlier_input])
    moved = moved_model(kept, settings)
    models = [settings["model"]] + ([] if moved is None else [moved])
    engines = [settings.get("engine")]
    backend = None if spec is None else spec.engine.structured_output_backend
    if backend not in (None, _DEFAULTS[_BACKEND]) and _BACKEND not in settings.get("engine", {}):
        engines.append({**settings.get("engine", {}), _BACKEND: backend})
    out = []
    for model in models:
        for digest in inputs:
            for engine in engines:
                earlier = {**settings, "model": model, "input": digest}
                if engine is not None:
                    earlier["engine"] = engine
                out.append(fingerprint(earlier))
    return tuple(out[1:])  # (the first is this version's own)


def same_content(old: JobSettings | None, new: JobSettings) -> bool:
    """Whether the ``UNHASHED`` settings agree, where both the manifest's ``old`` and
    ``new`` have them (a Ray run resolves its dtype later: replica_dtype.py)."""
    return all(
        old is None or key not in old or key not in new or old[key] == new[key] for key in UNHASHED
    )


def settings_record(settings: JobSettings) -> JobSettings:
    """``settings`` as the manifest keeps them: the chat template as a short hash."""
    template = settings.get("chat_template", "")
    return {**settings, "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16]}


def changed_settings(old: JobSettings, new: JobSettings) -> list[str]:
    """``["sampling.max_tokens: 8 -> 12", ...]`` for every leaf that differs (sorted). An
    unhashed setting's leaf that one side lacks is left out: a manifest that predates the
    setting compares it from then on, and a file added or gone is said by the input's hash
    and ``input_files``, not as ``input_versions.<url>: (unset) -> ...``. A moved model's
    path is left out too: the move alone resumes (``moved_model``)."""
    old_flat, new_flat = _flatten(_with_defaults(old)), _flatten(_with_defaults(new))
    moved = moved_model(old, new) is not None
    out = []
    for key in sorted(old_flat.keys() | new_flat.keys()):
        before, after = old_flat.get(key, "(unset)"), new_flat.get(key, "(unset)")
        top = key.split(".", 1)[0]  # (input_versions' keys are URLs, with dots in them)
        if before == after or (top in UNHASHED and "(unset)" in (before, after)):
            continue
        if top == "input_entries":  # said file by file below
            continue
        if moved and key in (f"model.{place}" for place in _PLACE):
            continue  # (not what refused the resume)
        if key == f"engine.{_BACKEND}" and new.get("constraints") is False:
            continue  # (left out: it changes no row now)
        if key in _HASHED:  # two hex digests say nothing to a reader
            out.append(f"{key}: {_HASHED[key]} (fingerprint {_short(before)} -> {_short(after)})")
        else:
            meaning = _MEANING.get(key) or _MEANING.get(f"{top}.*")
            why = f" ({meaning})" if meaning else ""
            shown = f"model.{key}" if top in _MODEL_KEYS else key
            out.append(f"{shown}: {_short(before)} -> {_short(after)}{why}")
    if "input_entries" in old and "input_entries" in new:
        out += file_changes(old["input_entries"], new["input_entries"])
    return out


# Settings kept at the top level that job.yaml writes in its model section: a change is
# named by its job.yaml key (model.dtype, not dtype).
_MODEL_KEYS = frozenset(
    {"dtype", "quantization", "chat_template", "chat_template_kwargs", *_ENDING_DEFAULTS}
)
# Settings kept as a hash, and what a change of it means.
_HASHED = {
    "input": "the input changed: its files (which, their sizes, their first or last MiB) or "
    "how they are read (format, id / prompt / messages / passthrough columns)",
    "model_content": "the model's files changed (their content: a checkpoint or config "
    "saved again in place)",
}
# What a change of an unhashed setting means, said beside its values.
_MEANING = {
    "resolved_dtype": "model.dtype auto on another kind of device",
    "input_files.files": "input files",
    "input_files.bytes": "bytes in the input files",
    "input_versions.*": "written again in storage since: rows may differ anywhere in it, "
    "even at the same size and the same first and last MiB",
}


def _with_defaults(settings: JobSettings) -> JobSettings:
    """``settings`` with the result settings and the conversations' ending at their defaults
    written out (they are left out of the hash there), so a change reads "auto -> fp8", not
    "(unset) -> fp8"."""
    return {**_ENDING_DEFAULTS, **settings, "engine": {**_DEFAULTS, **settings.get("engine", {})}}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: value}


def _short(value: Any) -> str:
    text = json.dumps(value)
    if len(text) <= 60:
        return text
    return text[:57] + "..." + ('"' if text.startswith('"') else "")
