"""Grammar work spread over worker processes (``structured_output_processes: N``).

A grammar's host work is per row and per token (one mask filled, one sampled token taken),
and at a few hundred constrained rows a step on a small model it outlasts the GPU's step:
on the H200, ~430 rows cost 4.5-7 ms a step against a 2.4 ms forward pass. Threads inside
one process do not spread it: xgrammar holds the GIL while it works, and llguidance's
threads serialize on the lexer shared by copies of a compiled grammar. Processes share
nothing, so N of them do a step's work in about 1/N of the time.

Each worker process owns the matchers of the requests given to it (in turn, as they come)
and runs the in-process backend (grammar_llguidance.py or grammar_xgrammar.py) on them with
one thread. A step costs one message, the same to each worker with a part in it, and two
answers from each, over a socket pair (grammar_wire.py reads a worker's answers in one call
when both are in). Messages are raw int64 arrays (a kind, then keys and tokens or places),
answers raw bytes: a step's hundreds of rows are never pickled, nor grouped by worker in the
engine: each worker picks its own rows out of the step (their keys modulo the worker count).

    add              sent, not answered (the spec was compiled here first, so it compiles)
    step             the matchers of finished requests to drop, the previous step's tokens
                     and this step's masks in one message (``send_step``; any part may be
                     empty). The worker drops, takes its rows' tokens and answers where
                     a row's status is not "taken" (stopped or rejected:
                     structured_output_params), then the errors of rejected tokens as
                     JSON, if any; then, without waiting for another message,
                     writes its rows' masks at their places in the step's mask buffer and
                     answers that they are in. The mask buffers live in shared memory (the
                     engine's two come from ``shared_masks``, pinned for CUDA with
                     cudaHostRegister, so the upload reads what the workers wrote; another
                     array is filled through a scratch buffer and a copy)

The backend interface is the in-process backends' (matcher / fill / consume / error /
release), so structured_output.py keeps the bookkeeping either way; a row here is the
request's key, and its worker is the key modulo the worker count. A worker that
dies, or does not answer a step for ``ANSWER_TIMEOUT_S`` (stalled), raises RuntimeError
naming it at the next call; ``close`` stops them all. Workers run in a session of their own:
a Ctrl-C or a SIGTERM to the job's process group reaches the engine, which stops at its next
commit boundary with the workers still serving it (each exits when the engine's end of its
socket closes, also when the engine is killed).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from tokenmill.engine.core.runs import run_entries, within_runs
from tokenmill.engine.grammar_drafts import consume_runs, fill_with_drafts
from tokenmill.engine.grammar_llguidance import LlguidanceGrammars
from tokenmill.engine.grammar_wire import Link
from tokenmill.engine.grammar_xgrammar import XgrammarGrammars
from tokenmill.engine.structured_output_params import REJECTED

__all__ = ["BACKENDS", "GrammarProcesses", "TokenizerNotPicklable", "auto_processes"]

# structured_output_backend -> the in-process backend (a worker runs one too)
BACKENDS = {"llguidance": LlguidanceGrammars, "xgrammar": XgrammarGrammars}

_WORKER_MAIN = "from tokenmill.engine.grammar_processes import main; main()"
# A step's answer takes milliseconds; the slowest honest one is a batch of new specs that
# each compile for seconds (compiled here first, so the engine already waited that long).
ANSWER_TIMEOUT_S = 120.0
_CHECKED = 64  # specs whose compile check is remembered (``matcher``)
SCRATCH = -1  # the shared buffer of masks bound for an array not in shared memory
# A message's kind, its first int64. Its layout after that (int64s, then text):
ADD, STEP, SHM, STOP = range(4)
#   ADD      key, then the spec (UTF-8)
#   STEP     slot, d, n, t, m, w, then d keys of finished requests to drop, then n keys,
#            how many tokens each consumes and their t tokens one row after another, then
#            m keys, their places in the slot's masks to fill, how many drafts each walks,
#            whether its masks may be left open (1 or 0) and their w drafts
#            (grammar_drafts.py): every worker's rows, each worker takes
#            those it holds. It drops, answers the tokens, then goes straight on to the
#            masks and answers them (a part with none of its rows is not answered)
#   (tokens' answer: int64 k, then k row numbers within the step's n, their statuses and
#   how many tokens each took, for the rows not simply taken; then the rejected rows'
#   errors as JSON by row number)
#   SHM      slot, rows, words, then the shared memory's name (UTF-8)
#   STOP     nothing


class _Sent:
    """A step's message sent to the workers, whose answers are still to read: the
    consume part's (its keys and the workers holding some) and the fill part's (the
    workers, the mask, and the places when it goes through the scratch buffer)."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)  # tokens each consumed row was sent
        self.consumed: list[int] = []
        self.filled: list[int] = []
        self.mask: np.ndarray | None = None
        self.scratch_places: np.ndarray | None = None
        self.consume_read = False  # finish_consume has read the consume part's answers


def _message(kind: int, *ints: np.ndarray | Sequence[int], text: str = "") -> bytes:
    """One message: ``kind``, the int64s of ``ints`` one after another, then ``text``."""
    parts = [np.asarray([kind], dtype=np.int64)]
    parts += [np.asarray(part, dtype=np.int64) for part in ints]
    return np.concatenate(parts).tobytes() + text.encode()


class TokenizerNotPicklable(ValueError):
    """The model's tokenizer cannot be handed to a worker process (it does not pickle)."""


def auto_processes(device_type: str) -> int:
    """``structured_output_processes`` when unset: on CUDA a worker per two CPU cores this
    process may run on, at most 8 (the H200 machine's 16 cores ran 8 fastest: BENCHMARKS.md,
    session 21); on CPU none, as the model's own work needs the cores there."""
    if device_type != "cuda":
        return 0
    return max(1, min(8, usable_cpus() // 2))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container's or a scheduler's
    CPU set narrows), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 2


def _backend(name: str, tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> Any:
    """The in-process backend a worker (or the parent, to compile specs once) runs."""
    return BACKENDS[name](tokenizer, vocab_size, eos, threads=1)


def _serve(conn: Connection, backend: Any, me: int = 0, workers: int = 1) -> None:
    """Worker ``me`` of ``workers``: its loop over the messages of ``GrammarProcesses``,
    until STOP. It holds the matchers whose key modulo ``workers`` is ``me``."""
    matchers: dict[int, Any] = {}
    segments: dict[int, tuple[SharedMemory, np.ndarray]] = {}  # slot -> memory, masks
    opened: dict[int, int] = {}  # key -> positions its last fill left open, as bits

    def own(keys: np.ndarray) -> tuple[np.ndarray, list[Any]]:
        """Where this worker's keys are among a step's ``keys``, and their matchers."""
        mine = np.flatnonzero(keys % workers == me)
        return mine, [matchers[key] for key in keys[mine].tolist()]

    while True:
        message = conn.recv_bytes()
        ints = np.frombuffer(message, dtype=np.int64, count=len(message) // 8)
        kind = int(ints[0])
        if kind == STEP:
            slot, d, n, t, m, w = (int(v) for v in ints[1:7])
            parts = np.split(ints[7:], np.cumsum([d, n, n, t, m, m, m, m, w])[:-1])
            dropped_keys, keys, counts, tokens, fill_keys, places, walks, opens, drafts = parts
            for key in dropped_keys.tolist():
                opened.pop(key, None)
            dropped = [matchers.pop(key, None) for key in dropped_keys.tolist()]
            backend.release([row for row in dropped if row is not None])
            mine, rows = own(keys)
            if len(mine):
                # each row's last token tried where its mask was left open (grammar_drafts);
                # a plain step's rows have no open masks: no lookup a row
                try_last = None
                if opened:
                    bits = [opened.pop(key, 0) for key in keys[mine].tolist()]
                    try_last = (np.array(bits, np.int64) >> (counts[mine] - 1)) & 1 == 1
                status, took = consume_runs(
                    backend, rows, tokens[run_entries(counts, mine)], counts[mine], try_last
                )
                took = counts[mine] if took is None else took
                hit = np.flatnonzero(status)
                errors = {
                    int(mine[i]): backend.error(rows[i]) for i in hit if status[i] == REJECTED
                }
                answer = [[len(hit)], mine[hit], status[hit], took[hit]]
                head = np.concatenate(answer).astype(np.int64)
                conn.send_bytes(head.tobytes() + (json.dumps(errors).encode() if errors else b""))
            mine, rows = own(fill_keys)
            if len(mine):
                mask = segments[slot][1]
                bits = fill_with_drafts(
                    backend,
                    rows,
                    mask,
                    places[mine],
                    drafts[run_entries(walks, mine)],
                    walks[mine],
                    opens[mine] != 0,
                )
                for key, row_bits in zip(fill_keys[mine].tolist(), bits.tolist(), strict=True):
                    if row_bits:
                        opened[key] = row_bits
                    else:  # (a feed pops each entry; none outlives a fill that opens none)
                        opened.pop(key, None)
                conn.send_bytes(b"")
        elif kind == ADD:
            matchers[int(ints[1])] = backend.matcher(message[16:].decode())
        elif kind == SHM:
            slot, rows_, words = (int(v) for v in ints[1:4])
            if slot in segments:
                segments.pop(slot)[0].close()
            try:
                shm = _attach(message[32:].decode())
            except FileNotFoundError:
                # Replaced (and unlinked) before this worker read of it: a worker started
                # after a restart hears of the segments there were, and a newer one for the
                # slot follows this message.
                continue
            segments[slot] = (shm, np.ndarray((rows_, words), dtype=np.int32, buffer=shm.buf))
        elif kind == STOP:
            break
    for shm, _ in segments.values():
        shm.close()


def _attach(name: str) -> SharedMemory:
    """The engine's shared memory ``name``, which the engine alone unlinks (untracked here:
    a tracked attachment is unlinked, with a warning, when this process exits)."""
    try:
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]  # 3.13+
    except TypeError:
        pass
    from multiprocessing import resource_tracker

    shm = SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _register(masks: np.ndarray) -> bool:
    """Pin ``masks``' memory for CUDA copies (cudaHostRegister); False if CUDA refuses,
    and the upload then stages it as it would any pageable array."""
    import torch

    try:
        error = torch.cuda.cudart().cudaHostRegister(masks.ctypes.data, masks.nbytes, 0)
    except (RuntimeError, AttributeError):
        return False
    return int(error) == 0


def _unregister(masks: np.ndarray) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(masks.ctypes.data)


def _release(
    links: list[Link], procs: list[subprocess.Popen], segments: dict[int, tuple], owner: int
) -> None:
    """What a ``GrammarProcesses`` collected unclosed holds: its workers stopped and its
    shared masks' names removed (the memory goes with the last array over it), so no
    segment is left in /dev/shm behind an engine that was dropped, not closed. Only in the
    process ``owner`` that started them: a forked child that exits runs its copy of this
    finalizer too, and stopped its parent's workers and removed its masks (an audit)."""
    if os.getpid() != owner:
        return
    _stop_workers(links, procs)
    for shm, *_ in segments.values():
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
    segments.clear()


def _stop_workers(links: list[Link], procs: list[subprocess.Popen]) -> None:
    """Ask the workers to stop, wait for them (killing any that hangs), and empty both
    lists."""
    for link in links:
        try:
            link.send(_message(STOP))
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for link in links:
        link.close()
    links.clear()
    procs.clear()


class GrammarProcesses:
    """A structured-output backend whose matchers live in ``processes`` worker processes.

    ``name`` is the library each worker runs (llguidance or xgrammar). The workers start on
    the first constrained request (about a second: each loads the library and builds its
    tokenizer); specs are compiled here once too, so a spec the library rejects raises
    ValueError at ``matcher``, as in process.
    """

    def __init__(
        self,
        name: str,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        processes: int,
    ) -> None:
        if processes < 1:
            raise ValueError(f"structured_output_processes must be >= 1, got {processes}")
        self.name = name
        self.leaves_masks_open = BACKENDS[name].leaves_masks_open
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._num = processes
        self._words = -(-vocab_size // 32)
        self._checker = _backend(name, tokenizer, vocab_size, self._eos)
        self._checked: dict[str, None] = {}  # specs the checker compiled, oldest first
        # These three change in place only (the finalizer holds them).
        self._links: list[Link] = []
        self._procs: list[subprocess.Popen] = []
        # slot -> (memory, its [rows, words] masks, registered with CUDA, the masks'
        # address): slots 0 and 1 are the engine's two mask buffers (``shared_masks``),
        # SCRATCH any other array's
        self._segments: dict[int, tuple[SharedMemory, np.ndarray, bool, int]] = {}
        self._owner = os.getpid()  # the process whose workers and masks these are
        weakref.finalize(self, _release, self._links, self._procs, self._segments, self._owner)
        self._closed = False
        self._next_key = 0  # a request's key; its worker is key % processes
        self._errors: dict[int, str] = {}  # key -> why its last token was rejected
        self._released: list[int] = []  # finished requests' keys, to drop
        self._lock = threading.Lock()
        self.answer_timeout_s = ANSWER_TIMEOUT_S

    # ---- the backend interface -----------------------------------------------------------
    def matcher(self, spec: str) -> int:
        """A new request's matcher (in a worker, in its start state): its key."""
        if spec not in self._checked:
            self._checker.matcher(spec)  # raises ValueError for a spec the library rejects
            if len(self._checked) >= _CHECKED:  # one schema a row: keep the newest
                self._checked.pop(next(iter(self._checked)))
            self._checked[spec] = None
        self._ensure_started()
        key = self._next_key
        self._next_key += 1
        self._send(key % self._num, _message(ADD, [key], text=spec))
        return key

    @property
    def num_processes(self) -> int:
        return self._num

    def release(self, rows: Sequence[int]) -> None:
        """Forget the matchers of finished requests. Any thread may call it (the engine
        finishes requests beside a fill): the keys are only noted here, and the workers
        drop them at the next ``consume``, by when no fill can name them."""
        with self._lock:
            self._released.extend(rows)

    def fill(self, rows: Sequence[int], mask: np.ndarray, at: Sequence[int] | None = None) -> None:
        """Row ``at[i]`` (default i) of ``mask`` <- rows[i]'s next-token bitmask. Into one of
        ``shared_masks``' buffers the workers write directly; into any other array through
        a scratch buffer and a copy."""
        places = np.arange(len(rows)) if at is None else np.asarray(at, dtype=np.int64)
        self.finish_fill(self.send_step(fill=(rows, mask, places, None)))

    def shared_masks(self, slot: int, rows: int, pinned: bool) -> np.ndarray:
        """A [rows, words] int32 buffer in shared memory for the engine's mask buffer
        ``slot`` (0 or 1; structured_output.py's ``_MaskBuffers``), replacing the slot's
        previous one; registered with CUDA as pinned memory when ``pinned``, so the upload
        reads it without a staging copy."""
        return self._new_segment(slot, rows, pinned)

    def consume(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Each row's matcher takes its token: [rows] uint8, TAKEN, STOPPED or REJECTED
        (structured_output_params) per row, in input order."""
        return self.finish_consume(self.send_step(consume=(rows, tokens, None)))[0]

    def send_step(
        self,
        consume: tuple[Sequence[int], Sequence[int], np.ndarray | None] | None = None,
        fill: tuple[Sequence[int], np.ndarray, np.ndarray, tuple | None] | None = None,
        open_rows: np.ndarray | None = None,
    ) -> _Sent:
        """Send a step's work, one message per worker: with ``consume`` (rows, their
        tokens, how many each takes: None for one) the drops of the requests released since
        the last one and then the tokens, then ``fill`` (rows, mask, each row's first
        place, and None or (drafts, counts) to walk: grammar_drafts.py), with ``open_rows``
        [rows] bool the fill's rows whose masks after drafts may be left open (each worker
        keeps what it left open and tries those rows' last tokens when they come);
        ``finish_consume`` and then ``finish_fill`` read the answers. A worker goes from the
        tokens to the masks without waiting for another message."""
        sent = _Sent()
        with self._lock:
            released, self._released = self._released, []
        for key in released:
            self._errors.pop(key, None)
        dropped = np.asarray(released, dtype=np.int64)
        none = np.zeros(0, dtype=np.int64)
        keys_c = counts_c = tokens_c = keys_f = places = walks = opens = drafts = none
        if consume is not None:
            keys_c = sent.keys = np.asarray(consume[0], dtype=np.int64)
            tokens_c = np.asarray(consume[1], dtype=np.int64)
            counts = consume[2]
            counts_c = np.ones(len(keys_c), np.int64) if counts is None else np.asarray(counts)
            sent.counts = counts_c.astype(np.int64)
            sent.consumed = self._holders(keys_c)
        slot = 0
        if fill is not None:
            rows, sent.mask, places, walk = fill
            keys_f = np.asarray(rows, dtype=np.int64)
            places = np.asarray(places, dtype=np.int64)
            walks = np.zeros(len(keys_f), np.int64)
            if walk is not None:
                drafts, walks = (np.asarray(a, dtype=np.int64) for a in walk)
            opens = np.zeros(len(keys_f), np.int64)
            if open_rows is not None:
                opens = np.asarray(open_rows, dtype=np.int64)
            shared = self._slot_of(sent.mask)
            if shared is None:  # every row's masks, its first and one per draft
                sent.scratch_places = np.repeat(places, walks + 1) + within_runs(walks + 1)
                self._scratch_room(int(sent.scratch_places.max(initial=-1)) + 1)
            slot = SCRATCH if shared is None else shared
            sent.filled = self._holders(keys_f)
        head = [slot, len(dropped), len(keys_c), len(tokens_c), len(keys_f), len(drafts)]
        parts = (dropped, keys_c, counts_c, tokens_c, keys_f, places, walks, opens, drafts)
        message = _message(STEP, head, *parts)
        for worker in sorted({*self._holders(dropped), *sent.consumed, *sent.filled}):
            self._send(worker, message)
        return sent

    def finish_consume(self, sent: _Sent) -> tuple[np.ndarray, np.ndarray]:
        """The consume part's answers: [rows] uint8 statuses, as ``consume``, and [rows]
        how many tokens each row took (grammar_drafts.consume_runs)."""
        status = np.zeros(len(sent.keys), dtype=np.uint8)  # TAKEN unless answered
        took = sent.counts.copy()
        for worker in sent.consumed:
            answer = self._recv(worker)
            k = int.from_bytes(answer[:8], sys.byteorder)
            if not k:  # every row of the worker's took its tokens
                continue
            parts = np.frombuffer(answer, dtype=np.int64, count=3 * k, offset=8)
            rows = parts[:k]
            status[rows] = parts[k : 2 * k]
            took[rows] = parts[2 * k :]
            if len(answer) > 8 * (1 + 3 * k):  # the rejected rows' errors
                for j, why in json.loads(answer[8 * (1 + 3 * k) :]).items():
                    self._errors[int(sent.keys[int(j)])] = why
        sent.consume_read = True
        return status, took

    def answered(self, sent: _Sent) -> bool:
        """Whether every worker of ``sent`` has answered what is still to read (so its
        masks are in), without waiting. Before the consume part's answers are read, a
        worker's waiting answer may be its statuses, not its masks: False then."""
        if sent.consumed and not sent.consume_read:
            return False
        return all(self._links[worker].ready(0) for worker in sent.filled)

    def finish_fill(self, sent: _Sent) -> None:
        """Wait for the fill part's masks (after ``finish_consume`` when it had one)."""
        for worker in sent.filled:
            self._recv(worker)
        if sent.scratch_places is not None and sent.mask is not None:
            places = sent.scratch_places
            sent.mask[places] = self._segments[SCRATCH][1][places]

    def error(self, row: int) -> str:
        """Why ``row``'s last token was rejected."""
        return self._errors.get(row, "the grammar rejected the token")

    def restart(self) -> None:
        """Replace the workers with fresh ones that know the shared masks (no request may be
        left: their matchers go). After a call cut short, a message to a worker or its
        answer may be half sent: the old workers are killed, not asked to stop. The new
        ones start when a request next needs one (``_ensure_started``): a job stopping on
        a signal started a set only to stop it a moment later."""
        if self._closed or not self._links:
            return
        for proc in self._procs:
            proc.kill()
            proc.wait()
        for link in self._links:
            link.close()
        self._links.clear()
        self._procs.clear()
        self._errors.clear()
        self._released.clear()

    def close(self) -> None:
        """Stop the workers and free the shared masks; the workers do not start again (in
        a forked child, only this copy is closed: the workers and masks are its parent's)."""
        self._closed = True
        if os.getpid() != self._owner:
            return
        _stop_workers(self._links, self._procs)
        for slot in list(self._segments):
            self._free_segment(slot)

    # ---- internals -----------------------------------------------------------------------
    def _ensure_started(self) -> None:
        """Start the workers unless they run, and tell them of the shared masks there are
        (after a ``restart``); after ``close`` they do not start again."""
        if self._links:
            return
        if self._closed:
            raise RuntimeError("the structured-output worker processes were closed")
        self._start()
        for slot in self._segments:
            self._announce(slot)

    def _start(self) -> None:
        """Start the workers as fresh interpreters (``python -c``), not through
        multiprocessing: its spawn would run the user's main module again in each, which a
        script without a ``__main__`` guard does not survive. Each gets one end of a
        socket pair, its number and the worker count, and its settings over the socket."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        settings = self._settings()
        for me in range(self._num):
            ours, theirs = socket.socketpair()
            with theirs:
                fd = theirs.fileno()
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _WORKER_MAIN, str(fd), str(me), str(self._num)],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        pass_fds=(fd,),
                        start_new_session=True,  # out of the job's process group's signals
                    )
                )
            self._links.append(Link(ours))
            self._links[-1].send(settings)

    def _settings(self) -> bytes:
        """The workers' start message, pickled once for all of them. Raises ValueError when
        the tokenizer cannot be pickled (a worker needs its own copy)."""
        message = ("start", self.name, self._tokenizer, self.vocab_size, self._eos)
        try:
            return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TokenizerNotPicklable(
                "structured_output_processes: the model's tokenizer cannot be handed to a "
                f"worker process ({type(exc).__name__}: {exc}); set "
                "structured_output_processes to 0 to keep the grammars in this process"
            ) from None

    def _new_segment(self, slot: int, rows: int, pinned: bool) -> np.ndarray:
        """Shared memory for ``rows`` masks in ``slot``, replacing the slot's old one, made
        known to every worker."""
        self._ensure_started()
        self._free_segment(slot)
        shm = SharedMemory(create=True, size=rows * self._words * 4)
        masks = np.ndarray((rows, self._words), dtype=np.int32, buffer=shm.buf)
        registered = pinned and _register(masks)
        self._segments[slot] = (shm, masks, registered, masks.ctypes.data)
        self._announce(slot)
        return masks

    def _announce(self, slot: int) -> None:
        """Tell every worker where ``slot``'s masks are (its shared memory's name, rows)."""
        shm, masks, *_ = self._segments[slot]
        for worker in range(self._num):
            self._send(worker, _message(SHM, [slot, len(masks), self._words], text=shm.name))

    def _scratch_room(self, rows: int) -> None:
        """A scratch buffer of at least ``rows`` masks."""
        held = self._segments.get(SCRATCH)
        if held is None or held[1].shape[0] < rows:
            self._new_segment(SCRATCH, max(64, 1 << (max(rows, 1) - 1).bit_length()), False)

    def _free_segment(self, slot: int) -> None:
        held = self._segments.pop(slot, None)
        if held is None:
            return
        shm, masks, registered, _ = held
        if registered:
            _unregister(masks)
        del masks  # before its memory goes
        shm.close()
        shm.unlink()

    def _slot_of(self, mask: np.ndarray) -> int | None:
        """The slot whose buffer ``mask`` is the head of (its first rows), if any."""
        # (the segments' addresses are kept: reading an array's costs ~5-10 us, CPU)
        address = mask.ctypes.data
        for slot, (_, masks, _, head) in self._segments.items():
            if (
                slot != SCRATCH
                and head == address
                and mask.shape[1:] == masks.shape[1:]
                and mask.flags.c_contiguous
            ):
                return slot
        return None

    def _holders(self, keys: np.ndarray) -> list[int]:
        """The workers holding some of ``keys``, in order."""
        if not len(keys):
            return []
        return np.flatnonzero(np.bincount(keys % self._num, minlength=self._num)).tolist()

    def _send(self, worker: int, message: bytes) -> None:
        try:
            self._links[worker].send(message)
        except OSError as exc:
            raise self._died(worker) from exc

    def _recv(self, worker: int) -> bytes:
        link = self._links[worker]
        try:
            if not link.ready(self.answer_timeout_s):
                raise self._died(worker, f"has not answered in {self.answer_timeout_s:g} s")
            return link.take()
        except (EOFError, OSError) as exc:
            raise self._died(worker) from exc

    def _died(self, worker: int, how: str | None = None) -> RuntimeError:
        proc = self._procs[worker]
        how = how or f"stopped (exit code {proc.poll()})"
        return RuntimeError(
            f"structured output: grammar worker process {worker} (pid {proc.pid}) {how}; "
            "the engine cannot go on with its grammars"
        )


def main() -> None:
    """A worker process: take the settings from the engine's socket, serve until "stop"."""
    conn = Connection(int(sys.argv[1]))
    try:
        _, name, tokenizer, vocab_size, eos = conn.recv()
        _serve(conn, _backend(name, tokenizer, vocab_size, eos), int(sys.argv[2]), int(sys.argv[3]))
    except EOFError:  # the engine went away
        pass
