"""tokenmill.LLM: the offline API. Give it prompts, get results back in input order."""

from __future__ import annotations

import copy
import logging
import numbers
import threading
import time
from collections.abc import Sequence
from typing import Any

from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.frozen_heap import frozen_heap
from tokenmill.engine.generation_defaults import sampling_defaults
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.prompt_dicts import (
    PROMPT_KEYS,
    UNSUPPORTED_PROMPT_KEYS,
    TextPrompt,
    TokensPrompt,
)
from tokenmill.engine.prompts import encode_chat, encode_texts, render_chat
from tokenmill.engine.sample_groups import sample_groups
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.short_gil_turns import short_gil_turns
from tokenmill.engine.vllm_settings import engine_settings as vllm_engine_settings

log = logging.getLogger(__name__)

# text, token ids, or vLLM's TextPrompt / TokensPrompt dicts (prompt_dicts.py)
Prompt = str | list[int] | TextPrompt | TokensPrompt | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """An engine replica with a batch-at-a-time API.

    >>> llm = LLM("smollm2-135m-instruct", max_num_seqs=64, enable_prefix_caching=False)
    >>> outs = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=8, n=2))
    >>> outs[0].outputs[1].text  # vLLM's shape; outs[0].text is outputs[0].text
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_settings: Any) -> None:
        """Load ``model`` (an alias, an HF directory or a .gguf file) into one engine.

        ``engine_settings`` are the fields of :class:`~tokenmill.EngineConfig` (dtype, device,
        max_num_seqs, max_num_batched_tokens, max_model_len, block_size, kv_cache_memory,
        enable_prefix_caching, ...), which declares each one, its default and what it
        accepts; vLLM's names for some (gpu_memory_utilization, enforce_eager,
        tensor_parallel_size=1, ...) are taken too (vllm_settings.py). Raises TypeError for
        an unknown setting (naming it and listing the valid ones) and ValueError
        (EngineSettingError) for a value out of range.

        ``generation_config`` is vLLM's: "auto" (the default) takes the sampling defaults
        of the model folder's generation_config.json for ``get_default_sampling_params``
        and calls given no SamplingParams, "vllm" leaves them out, a folder reads its file
        (generation_defaults.py); ValueError for another value.
        """
        generation_config = engine_settings.pop("generation_config", "auto")
        # Checked before the weights load; "auto" needs the model's resolved folder.
        defaults = None if generation_config == "auto" else sampling_defaults("", generation_config)
        settings = vllm_engine_settings(str(model), engine_settings)
        self.config = EngineConfig.from_settings(str(model), **settings)
        self.engine = LLMEngine(self.config)
        if defaults is None:
            defaults = sampling_defaults(self.engine.model_path)
        self._sampling_defaults = defaults
        self.tokenizer = self.engine.tokenizer
        self._batches = 0
        # Reentrant: a close() from a signal handler in the calling thread must not wait
        # for the call it interrupted.
        self._lock = threading.RLock()

    def close(self) -> None:
        """Stop the engine's output thread and structured-output worker processes, and free
        their shared memory; the LLM generates no more after it. ``with LLM(...) as llm:``
        closes on leaving the block. (A dropped LLM releases them when it is collected.)
        A call running in another thread stops at its next step with the error a closed
        LLM gives, and only then is anything released (it was released under the running
        step, whose caller got a grammar worker's death instead)."""
        self.engine.stop()
        with self._lock:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, ``llm.engine``, under vLLM's name: its ``get_tokenizer()`` and
        ``max_model_len`` (vLLM's ``model_config.max_model_len``: the context as the KV cache
        left it) are there; its ``model_config`` is the model's config.json, which refuses
        vLLM's engine settings by name (model_config.py)."""
        return self.engine

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's accessor; also ``llm.tokenizer``)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams: what a call without any uses (vLLM's accessor, whose
        scripts then set fields on it, e.g. ``params.max_tokens = 64``). As vLLM's, it holds
        the model's generation_config.json sampling defaults (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens as max_tokens) unless the LLM was made
        with ``generation_config="vllm"``."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Complete text prompts (tokenized with the model's BOS rules) or token-id lists;
        vLLM's dict forms ``TextPrompt(prompt=text)`` and ``TokensPrompt(prompt_token_ids=ids)``
        (``{"prompt": text}``, ``{"prompt_token_ids": ids}``) are taken too.

        Returns one RequestOutput per prompt, in input order, holding ``SamplingParams.n``
        completions in ``outputs``; a prompt that cannot run (too long, empty) gets
        ``error`` set instead of failing the batch. Raises ValueError when the number of
        SamplingParams is neither one nor one per prompt, or a prompt is none of these forms.
        ``use_tqdm`` is vLLM's and shows nothing here (the call logs its rate when done);
        ``lora_request`` must be None (no adapters).
        """
        _no_lora(lora_request)
        if isinstance(prompts, str | dict) or _is_one_id_list(prompts):
            prompts = [prompts]
        parts = [_prompt_part(p, i) for i, p in enumerate(prompts)]
        texts = [text for text, _ in parts]
        strings = [text for text, ids in parts if ids is None]
        encoded = iter(encode_texts(self.tokenizer, strings, add_special_tokens=True))
        token_lists = [next(encoded) if ids is None else ids for _, ids in parts]
        return self._run(token_lists, texts, sampling_params)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer conversations (lists of {"role", "content"} messages) with the model's chat
        template. A single conversation may be passed without the outer list. The arguments
        are vLLM's, in its order. ``tools`` (OpenAI's function specs) reach the template as
        its ``tools`` variable, as vLLM's; ``use_tqdm`` and ``lora_request`` as in
        ``generate``.

        ``chat_template`` (a Jinja string) replaces the model's template for this call;
        ``chat_template_kwargs`` are extra template variables, e.g. ``{"enable_thinking":
        False}`` for Qwen3; ``continue_final_message`` (with ``add_generation_prompt``
        False) has the model go on writing the last message, e.g. an assistant answer
        begun for it. The template gets each message's content as a string (text parts
        joined): ``chat_template_content_format`` "auto" or "string"; "openai" (content as
        a list of parts) is refused. Each result's ``prompt`` is the rendered text. Raises
        ValueError when a conversation cannot be rendered (see ``render_chat``), naming
        which of several by its index: nothing runs then.
        """
        _no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(
                f"chat_template_content_format {chat_template_content_format!r} is not "
                "supported: the template gets each message's content as a string (text "
                'parts joined by newlines), vLLM\'s "string"; pass "auto" or "string"'
            )
        if tools is not None:  # (a "tools" of chat_template_kwargs wins, as in vLLM)
            chat_template_kwargs = {"tools": tools, **(chat_template_kwargs or {})}
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # type: ignore[list-item]
        texts = []
        for i, conversation in enumerate(messages):
            try:
                text = render_chat(
                    self.tokenizer,
                    conversation,
                    add_generation_prompt,
                    chat_template,
                    chat_template_kwargs,
                    continue_final_message,
                )
            except ValueError as exc:  # which of many: "messages[1].role" named none
                if len(messages) == 1:
                    raise
                raise ValueError(f"conversation {i}: {exc}") from None
            texts.append(text)
        token_lists = encode_texts(self.tokenizer, texts, add_special_tokens=False)
        return self._run(token_lists, texts, sampling_params)

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template (or
        ``chat_template``, with ``chat_template_kwargs``), as ``chat`` renders them."""
        return encode_chat(
            self.tokenizer,
            messages,
            add_generation_prompt,
            chat_template,
            chat_template_kwargs,
            continue_final_message,
        )

    def _run(
        self,
        token_lists: list[list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        """Run every prompt's completions (``sample_groups.py``: one engine request each,
        added together so they share the prompt's cached KV blocks); one result per prompt."""
        # No full garbage collection stalls the run, and the engine loop gets the GIL back
        # from the output thread within 0.5 ms (short_gil_turns.py).
        # One call at a time: the engine's step loop is not re-entrant (two threads' loops
        # took each other's outputs); a second thread's call waits for the first.
        with self._lock, frozen_heap(), short_gil_turns():
            return self._run_frozen(token_lists, texts, sampling_params)

    def _run_frozen(
        self,
        token_lists: list[list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None:  # vLLM's: the model's defaults (generation_config)
            sampling_params = self.get_default_sampling_params()
        groups = sample_groups(str(self._batches), _per_prompt(sampling_params, len(token_lists)))
        self._batches += 1
        failed: dict[str, RequestOutput] = {}
        batch: list[str] = []  # every request this call added
        samples: dict[str, RequestOutput] = {}
        try:
            for group, tokens, text in zip(groups, token_lists, texts, strict=True):
                added: list[str] = []
                try:
                    for rid, params in group.requests():
                        self.engine.add_request(rid, tokens, params)
                        added.append(rid)
                        batch.append(rid)  # at once: a cut mid-group aborts it too
                except ValueError as exc:
                    self.engine.abort_requests(added)  # none in practice: one prompt, one verdict
                    failed[group.request_id] = RequestOutput(
                        group.request_id, list(tokens), "", [], "error", error=str(exc), prompt=text
                    )
            start = time.perf_counter()
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    samples[out.request_id] = out
            elapsed = time.perf_counter() - start
        except BaseException:
            # Ctrl-C (or an error) mid-call: the call's requests go, so that the next call
            # does not run them, or find the KV cache they held taken; and the engine forgets
            # the step the interrupt cut (LLMEngine.cut_short).
            self.engine.cut_short(batch)
            raise
        results = [
            failed[g.request_id] if g.request_id in failed else g.gather(samples, text)
            for g, text in zip(groups, texts, strict=True)
        ]
        n_out = sum(len(c.token_ids) for r in results for c in r.outputs)
        log.info(
            "generated %d tokens for %d prompts in %.2fs (%.1f tok/s)",
            n_out,
            len(token_lists),
            elapsed,
            n_out / max(elapsed, 1e-9),
        )
        return results


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported; pass None")


def _is_one_id_list(prompts: Any) -> bool:
    """Whether ``prompts`` is one prompt's token ids (a list, tuple, array or tensor of
    integers) rather than several prompts."""
    if isinstance(prompts, str | bytes | dict) or not hasattr(prompts, "__len__"):
        return False
    if len(prompts) == 0:
        return False
    first = next(iter(prompts))
    if getattr(first, "ndim", None) == 0:  # an element of a tensor (numpy's are Integral)
        first = first.tolist()
    return _is_id(first)


def _is_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(values: list[Any]) -> list[int] | None:
    """``values`` as Python ints when every one is an integer (a bool is not), else None.
    Checked once per distinct type: an isinstance against numbers.Integral per value took
    ~0.5-1 us a token (minutes for a million 500-token prompts)."""
    kinds = set(map(type, values))
    if kinds <= {int}:
        return values
    if all(issubclass(k, numbers.Integral) and not issubclass(k, bool) for k in kinds):
        return [int(v) for v in values]
    return None


def _prompt_part(prompt: Any, index: int) -> tuple[str | None, list[int] | None]:
    """One prompt of ``LLM.generate`` as (its text, its token ids), one or both known: text
    alone is encoded; ids are run as they are (vLLM's ``{"prompt_token_ids": ids, "prompt":
    text}`` keeps the text for the result; prompt_dicts.py). ValueError naming the prompt
    when it is neither (nor a dict holding one), and the key when a dict gives one of vLLM's
    that the engine cannot honour (``multi_modal_data``, ...)."""
    if isinstance(prompt, dict):
        used = {k: v for k, v in prompt.items() if not (k in UNSUPPORTED_PROMPT_KEYS and v is None)}
        refused = sorted(used.keys() & UNSUPPORTED_PROMPT_KEYS.keys())
        if refused:
            key = refused[0]
            raise ValueError(
                f"prompt {index}: {key!r} is not supported ({UNSUPPORTED_PROMPT_KEYS[key]}); "
                "leave it out or None"
            )
        if not used or used.keys() - PROMPT_KEYS:
            raise ValueError(
                f"prompt {index}: a dict prompt holds 'prompt' (text) or 'prompt_token_ids' "
                f"(with its text as 'prompt' if you like); got keys {sorted(prompt)}"
            )
        text = used.get("prompt")
        if "prompt" in used and not isinstance(text, str):
            raise ValueError(f"prompt {index}: 'prompt' holds text; got {type(text).__name__}")
        if "prompt_token_ids" not in used:
            return text, None
        ids = _ids_of(used["prompt_token_ids"])
        if ids is None:
            raise ValueError(
                f"prompt {index}: 'prompt_token_ids' holds a list of token ids; got "
                f"{_shown(used['prompt_token_ids'])}"
            )
        return text, ids
    if isinstance(prompt, str):
        return prompt, None
    ids = _ids_of(prompt)
    if ids is not None:
        return None, ids
    raise ValueError(f"prompt {index}: expected text or a list of token ids, got {_shown(prompt)}")


def _shown(value: Any) -> str:
    """What a refused prompt is: its type, and for a list of ids the kinds that are not
    integers ("got list" alone did not say that [True, 2, 3] failed for its bool), for an
    array its dtype and shape."""
    name = type(value).__name__
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        return name
    shape = getattr(value, "shape", None)
    if shape is not None:  # a numpy array or a tensor
        return f"{name} of {getattr(value, 'dtype', '?')} with shape {tuple(shape)}"
    kinds = sorted({type(v).__name__ for v in value if not _is_id(v)})
    return f"{name} holding {', '.join(kinds[:3])} (ids are integers)" if kinds else name


def _ids_of(value: Any) -> list[int] | None:
    """``value`` as token ids: a list, tuple, numpy array or tensor of them (an array's
    tolist gives Python values); None when it is not one."""
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        return None
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    return _token_ids(values) if isinstance(values, list) else None


def _per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    """One SamplingParams a prompt, each a copy of the caller's made now: the call runs with
    the params as they are when it starts, whatever the caller sets on them meanwhile (they
    are mutable, as vLLM's; a request added with params changed under it failed the call)."""
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [_snapshot(sampling_params)] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one or {n}")
    copies: dict[int, SamplingParams] = {}  # one copy per distinct object
    return [copies.get(id(p)) or copies.setdefault(id(p), _snapshot(p)) for p in params]


def _snapshot(params: SamplingParams) -> SamplingParams:
    """A copy of valid ``params`` (its fields are checked as they are set), its one mutable
    value (logit_bias) copied too: 2 us, against 16 for a copy checked again."""
    snapshot = copy.copy(params)
    if params.logit_bias:
        object.__setattr__(snapshot, "logit_bias", dict(params.logit_bias))
    return snapshot
