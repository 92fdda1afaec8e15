"""SamplingMetadata: the per-row sampling settings of one engine step, as device tensors.

Built once per step on the host from the requests' ``SamplingParams`` and token histories, then
read by the ``Sampler`` without a single host-device sync. Row ``i`` describes logits row ``i``.

    params[i] ──► temperature[i], top_k[i], top_p[i], min_p[i], penalties[i]   (Tensor[B])
    prompt_token_ids[i] ──► prompt_mask[i, :]            (only when a row has repetition_penalty)
    output_token_ids[i] ──► output_token_counts[i, :]    (only when a row has any penalty)
    (seed, len(output_token_ids[i])) ──► row_seeds       (seeded, non-greedy rows)
    grammar of row i ──► allowed_token_bitmask[g, :]     (only the rows with structured_output)
    logit_bias of row i ──► logit_bias_index/values[k]   (flat i * V + token; rows with a bias)
    stop tokens of a row short of min_tokens ──► more of them, -inf   (min_tokens.py)

With async scheduling a row's last output token may still be on the device only (sampled by
the previous step): ``pending_rows`` names those rows and ``pending_token_ids`` holds their
tokens there; they count as output (position, penalties) without a host read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tokenmill.engine.device_copy import upload
from tokenmill.engine.sampling_columns import SamplingColumns, SamplingRows
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.seeds import row_seed

__all__ = ["SamplingMetadata", "TokenBitmask"]


# (logits rows with a grammar [G]) -> their allowed-token bitmask [G, ceil(V / 32)] int32
TokenBitmask = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling tensors for a batch of ``num_rows`` logits rows over ``vocab_size``.

    Greedy rows carry ``temperature == 1`` (never used, but keeps the division finite) and are
    flagged in ``greedy``. Disabled filters are no-ops: ``top_k == vocab_size``, ``top_p == 1``,
    ``min_p == 0``. The ``no_*`` / ``all_*`` flags are host booleans that let the sampler skip
    whole stages.
    """

    num_rows: int
    vocab_size: int
    temperature: torch.Tensor  # [B] float32, 1.0 on greedy rows
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64, vocab_size when off
    top_p: torch.Tensor  # [B] float32, 1.0 when off
    min_p: torch.Tensor  # [B] float32, 0.0 when off
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool
    no_repetition_penalty: bool
    max_num_logprobs: int | None  # largest ``logprobs`` asked for in the batch; None: nobody asked
    output_token_counts: torch.Tensor | None  # [B, V] float32; None when no_penalties
    prompt_mask: torch.Tensor | None  # [B, V] bool; None when no_repetition_penalty
    # (row, seed derived from (request seed, output position)) for seeded non-greedy rows.
    row_seeds: tuple[tuple[int, int], ...]
    # Whether some non-greedy row has no seed and draws from ``generator``.
    has_unseeded_random: bool
    generator: torch.Generator | None  # shared by unseeded rows; None: torch's default RNG
    # Rows with a grammar and the tokens it allows there: bit t of allowed_token_bitmask[g]
    # (int32 words, little-endian bits) is token t for logits row allowed_token_rows[g].
    # None when no row has one.
    allowed_token_rows: torch.Tensor | None = None  # [G] int64
    allowed_token_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32
    # Every biased (row, token) of the batch as a flat index row * V + token, and its bias:
    # one sparse add over the [B * V] logits applies them all. None when no row has one.
    logit_bias_index: torch.Tensor | None = None  # [K] int64
    logit_bias_values: torch.Tensor | None = None  # [K] float32
    # Some row is short of its min_tokens: -inf on its stop tokens among the biases (the
    # metadata depends on the step's positions, so it is not reused: sampling_reuse.py).
    bans_stop_tokens: bool = False

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        generator: torch.Generator | None = None,
        pending_rows: Sequence[int] = (),
        pending_token_ids: torch.Tensor | None = None,
        token_bitmask: TokenBitmask | None = None,
    ) -> SamplingMetadata:
        """Build the metadata for one step; row ``i`` is ``params[i]`` and its histories.

        ``output_token_ids[i]`` is everything the row generated so far: its length is the row's
        output position, which seeds a seeded row's draw. Raises ValueError when the three
        lists differ in length; see ``from_rows`` for the rest.
        """
        num_rows = len(params)
        if len(prompt_token_ids) != num_rows or len(output_token_ids) != num_rows:
            raise ValueError(
                f"SamplingMetadata.build: got {num_rows} params, {len(prompt_token_ids)} prompts "
                f"and {len(output_token_ids)} outputs; pass one of each per logits row"
            )
        return cls.from_rows(
            SamplingColumns.of(params).gather(slice(None)),
            np.fromiter(map(len, output_token_ids), dtype=np.int64, count=num_rows),
            lambda: (prompt_token_ids, output_token_ids),
            vocab_size,
            device,
            generator,
            pending_rows,
            pending_token_ids,
            token_bitmask,
        )

    @classmethod
    def from_rows(
        cls,
        rows: SamplingRows,
        num_outputs: np.ndarray,
        histories: Callable[[], tuple[Sequence[list[int]], Sequence[list[int]]]],
        vocab_size: int,
        device: torch.device,
        generator: torch.Generator | None = None,
        pending_rows: Sequence[int] | np.ndarray = (),
        pending_token_ids: torch.Tensor | None = None,
        token_bitmask: TokenBitmask | None = None,
        upload_many: Callable[[Sequence[np.ndarray]], list[torch.Tensor]] | None = None,
        banned: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """Build the metadata from gathered settings, with numpy over all rows.

        ``num_outputs`` [S] is each row's number of generated tokens (known on the host);
        ``histories()`` gives (prompt token ids, output token ids) per row and is called only
        when some row has a penalty. ``generator`` (on ``device``) serves the unseeded rows.
        ``pending_rows`` have one more output token, not in the histories but in
        ``pending_token_ids`` ([P] int64 on ``device``, one per pending row).
        ``token_bitmask(rows)`` gives the allowed-token bitmask [G, ceil(V / 32)] int32 of the
        rows with a grammar (``rows.structured``; [G] indices), called only when there are
        some. ``upload_many(arrays)`` sends the per-row columns to ``device`` in one copy
        (the model runner's ``UploadRing.upload``; default: one copy each). ``banned``
        [K] flat indices (row * V + token) may not be sampled (min_tokens.py). Raises
        ValueError when ``vocab_size < 1``, a history holds an id outside the vocabulary, or
        rows have a grammar but no ``token_bitmask`` gives their masks.
        """
        device = torch.device(device)
        num_rows = len(rows)
        if vocab_size < 1:
            raise ValueError(f"SamplingMetadata.build: vocab_size must be >= 1, got {vocab_size}")
        greedy = rows.greedy
        random = ~greedy
        top_k = np.where((rows.top_k > 0) & (rows.top_k < vocab_size), rows.top_k, vocab_size)
        # The float columns as one [6, S] float32 array, rows viewed on the device.
        floats = np.stack(
            [
                np.where(greedy, np.float32(1.0), rows.temperature),
                rows.top_p,
                rows.min_p,
                rows.presence_penalty,
                rows.frequency_penalty,
                rows.repetition_penalty,
            ]
        ).astype(np.float32)
        if upload_many is None:
            upload_many = _one_copy_each(device)
        on_device, greedy_t, top_k_t = upload_many([floats, greedy, top_k.astype(np.int64)])
        no_repetition_penalty = bool((rows.repetition_penalty == 1.0).all())
        no_penalties = (
            no_repetition_penalty
            and not rows.presence_penalty.any()
            and not rows.frequency_penalty.any()
        )
        asked = rows.logprobs[rows.logprobs >= 0]

        output_token_counts = None
        prompt_mask = None
        if not no_penalties:
            prompts, outputs = histories()
            output_token_counts = _token_counts(outputs, vocab_size, device)
            if len(pending_rows):
                _count_pending(output_token_counts, pending_rows, pending_token_ids)
            if not no_repetition_penalty:
                prompt_mask = _token_counts(prompts, vocab_size, device) > 0

        allowed_rows = allowed_bitmask = None
        constrained = np.flatnonzero(rows.structured)
        if len(constrained):
            allowed_bitmask = _allowed_bitmask(token_bitmask, constrained, vocab_size, device)
            allowed_rows = upload(torch.from_numpy(constrained.astype(np.int64)), device)

        bias_index, bias_values = _logit_bias(rows.logit_bias, vocab_size, device, banned)

        positions = num_outputs.astype(np.int64)
        positions[np.asarray(pending_rows, dtype=np.int64)] += 1
        seeded = np.flatnonzero(random & rows.has_seed)
        row_seeds = tuple(
            (i, row_seed(seed, position))
            for i, seed, position in zip(
                seeded.tolist(), rows.seed[seeded].tolist(), positions[seeded].tolist(), strict=True
            )
        )
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            temperature=on_device[0],
            greedy=greedy_t,
            top_k=top_k_t,
            top_p=on_device[1],
            min_p=on_device[2],
            presence_penalty=on_device[3],
            frequency_penalty=on_device[4],
            repetition_penalty=on_device[5],
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
            no_top_k=bool((top_k[random] == vocab_size).all()),
            no_top_p=bool((rows.top_p[random] >= 1.0).all()),
            no_min_p=bool((rows.min_p[random] <= 0.0).all()),
            no_penalties=no_penalties,
            no_repetition_penalty=no_repetition_penalty,
            max_num_logprobs=int(asked.max()) if asked.size else None,
            output_token_counts=output_token_counts,
            prompt_mask=prompt_mask,
            row_seeds=row_seeds,
            has_unseeded_random=len(row_seeds) < int(random.sum()),
            generator=generator,
            allowed_token_rows=allowed_rows,
            allowed_token_bitmask=allowed_bitmask,
            logit_bias_index=bias_index,
            logit_bias_values=bias_values,
            bans_stop_tokens=banned is not None and len(banned) > 0,
        )

    def with_token_bitmask(
        self, token_bitmask: TokenBitmask | None, structured: np.ndarray
    ) -> SamplingMetadata:
        """This metadata with this step's grammar masks: metadata kept from an earlier step
        of rows that sample alike (sampling_reuse.py) is right for this one but for them.
        ``structured`` [S] says which rows have a grammar (the rows' ``structured``
        column); ``token_bitmask`` is ``from_rows``' (ValueError as there)."""
        if self.allowed_token_rows is None:
            return self
        constrained = np.flatnonzero(structured)
        device = self.allowed_token_rows.device
        bitmask = _allowed_bitmask(token_bitmask, constrained, self.vocab_size, device)
        return dataclasses.replace(self, allowed_token_bitmask=bitmask)


def _allowed_bitmask(
    token_bitmask: TokenBitmask | None,
    constrained: np.ndarray,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """The masks of the ``constrained`` rows from ``token_bitmask``, checked, on ``device``."""
    if token_bitmask is None:
        raise ValueError(
            f"SamplingMetadata.build: {len(constrained)} rows have structured_output "
            "but no token_bitmask gives their allowed tokens"
        )
    bitmask = np.ascontiguousarray(token_bitmask(constrained), dtype=np.int32)
    if bitmask.shape != (len(constrained), -(-vocab_size // 32)):
        raise ValueError(
            f"SamplingMetadata.build: token_bitmask gave shape {bitmask.shape} for "
            f"{len(constrained)} rows of {vocab_size} tokens"
        )
    return upload(torch.from_numpy(bitmask), device)


def _logit_bias(
    biases: np.ndarray, vocab_size: int, device: torch.device, banned: np.ndarray | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(flat index [K] int64, bias [K] float32) on ``device`` for every biased (row, token),
    then -inf for each ``banned`` flat index:

        row 0: {7: +5}, row 2: {1: -100, 9: +1}   ──►   index [0V+7, 2V+1, 2V+9]
                                                        bias  [5,    -100, 1   ]

    (None, None) when no row has a bias and nothing is banned. Raises ValueError for an id
    outside the vocabulary (the engine refuses such a request when it is added; this guards
    direct callers).
    """
    rows = np.flatnonzero(biases != None)  # noqa: E711 (elementwise on an object array)
    flat = np.empty(0, dtype=np.int64)
    values = np.empty(0, dtype=np.float32)
    if len(rows):
        pairs = biases[rows].tolist()  # [(ids, values)] per biased row
        ids = np.concatenate([i for i, _ in pairs])  # [K]
        values = np.concatenate([v for _, v in pairs])  # [K]
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(
                f"SamplingMetadata.build: logit_bias holds a token id outside "
                f"[0, {vocab_size}) (largest {int(ids.max())})"
            )
        lengths = np.fromiter((len(i) for i, _ in pairs), dtype=np.int64, count=len(pairs))
        flat = np.repeat(rows.astype(np.int64) * vocab_size, lengths) + ids  # [K]
    if banned is not None and len(banned):
        flat = np.concatenate([flat, banned.astype(np.int64)])
        values = np.concatenate([values, np.full(len(banned), -np.inf, dtype=np.float32)])
    if not len(flat):
        return None, None
    return (
        upload(torch.from_numpy(flat), device),
        upload(torch.from_numpy(values.astype(np.float32)), device),
    )


def _count_pending(
    counts: torch.Tensor, rows: Sequence[int] | np.ndarray, token_ids: torch.Tensor | None
) -> None:
    """Add one count per pending row for its device-resident token (no host read)."""
    if token_ids is None or token_ids.shape != (len(rows),):
        raise ValueError(
            f"SamplingMetadata.build: {len(rows)} pending rows need pending_token_ids of "
            f"shape [{len(rows)}]"
        )
    vocab_size = counts.shape[1]
    rows_t = upload(torch.from_numpy(np.asarray(rows, dtype=np.int64)), counts.device)
    flat = counts.view(-1)
    ones = torch.ones_like(token_ids, dtype=flat.dtype)
    flat.index_add_(0, rows_t * vocab_size + token_ids, ones)


def _one_copy_each(device: torch.device) -> Callable[[Sequence[np.ndarray]], list[torch.Tensor]]:
    return lambda arrays: [upload(torch.from_numpy(a), device) for a in arrays]


def _token_counts(
    token_ids: Sequence[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Count each row's token ids: returns [B, V] float32 with counts[i, t] = #t in row i.

    All rows go to the device as one flat [N] tensor of ids with flat index ``row * V + id``,
    summed into [B * V] counts there.
    """
    num_rows = len(token_ids)
    lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=num_rows)  # [B]
    # numpy reads Python ints an order of magnitude faster than torch.tensor(list).
    flat = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):  # [N], host memory
        row, bad = next(
            (i, t) for i, ids in enumerate(token_ids) for t in ids if not 0 <= t < vocab_size
        )
        raise ValueError(
            f"SamplingMetadata.build: row {row} holds token id {bad} outside "
            f"[0, {vocab_size}); check the tokenizer and the model's vocab_size"
        )
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), lengths)  # [N]
    flat_index = upload(torch.from_numpy(rows * vocab_size + flat), device)  # [N]
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    counts.index_add_(0, flat_index, torch.ones(flat_index.shape, device=device))
    return counts.view(num_rows, vocab_size)  # [B, V]
