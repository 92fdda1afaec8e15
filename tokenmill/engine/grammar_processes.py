"""Grammar work spread over worker processes (``structured_output_processes: N``).

A grammar's host work is per row and per token (one mask filled, one sampled token taken),
and at a few hundred constrained rows a step on a small model it outlasts the GPU's step:
on the H200, ~430 rows cost 4.5-7 ms a step against a 2.4 ms forward pass. Threads inside
one process do not spread it: xgrammar holds the GIL while it works, and llguidance's
threads serialize on the lexer shared by copies of a compiled grammar. Processes share
nothing, so N of them do a step's work in about 1/N of the time.

Each worker process owns the matchers of the requests given to it (in turn, as they come)
and runs the in-process backend (grammar_llguidance.py or grammar_xgrammar.py) on them with
one thread. A step costs one message to each worker and two answers from it, over a socket
pair. Messages are raw int64 arrays (a kind, then keys and tokens or places), answers raw
bytes: a step's hundreds of rows are never pickled, and the engine groups them by worker
with numpy.

    add              sent, not answered (the spec was compiled here first, so it compiles)
    step             the matchers of finished requests to drop, the previous step's tokens
                     and this step's masks in one message (``send_step``; any part may be
                     empty). The worker drops, takes its rows' tokens and answers one
                     status byte per row (taken, stopped or rejected:
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
import select
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

from tokenmill.engine.grammar_llguidance import LlguidanceGrammars
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
#   STEP     slot, d, n, then d keys of finished requests to drop, then n keys and their
#            tokens to consume, then keys and their places in the slot's masks to fill (as
#            many): the worker drops, answers the tokens, then goes straight on to the masks
#            and answers them (any part may be empty; an empty one is not answered)
#   SHM      slot, rows, words, then the shared memory's name (UTF-8)
#   STOP     nothing


class _Sent:
    """A step's messages sent to the workers, whose answers are still to read: the
    consume part's (its keys and each worker's indices into them) and the fill part's
    (the workers, the mask, and the places when it goes through the scratch buffer)."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, dtype=np.int64)
        self.consumed: list[tuple[int, np.ndarray]] = []
        self.filled: list[int] = []
        self.mask: np.ndarray | None = None
        self.scratch_places: np.ndarray | None = None
        self.consume_read = False  # finish_consume has read the consume part's answers


def _message(kind: int, *ints: np.ndarray | Sequence[int], text: str = "") -> bytes:
    """One message: ``kind``, the int64s of ``ints`` one after another, then ``text``."""
    parts = [np.asarray([kind], dtype=np.int64)]
    parts += [np.asarray(part, dtype=np.int64) for part in ints]
    return np.concatenate(parts).tobytes() + text.encode()


def _halves(body: np.ndarray) -> tuple[list[int], list[int]]:
    """A message's two equally long int64 runs (keys and tokens or places), as lists."""
    half = len(body) // 2
    return body[:half].tolist(), body[half:].tolist()


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


def _serve(conn: Connection, backend: Any) -> None:
    """A worker's loop over the messages of ``GrammarProcesses``, until STOP."""
    matchers: dict[int, Any] = {}
    segments: dict[int, tuple[SharedMemory, np.ndarray]] = {}  # slot -> memory, masks
    while True:
        message = conn.recv_bytes()
        ints = np.frombuffer(message, dtype=np.int64, count=len(message) // 8)
        kind = int(ints[0])
        if kind == STEP:
            slot, d, n = int(ints[1]), int(ints[2]), int(ints[3])
            body = ints[4:]
            dropped = [matchers.pop(key, None) for key in body[:d].tolist()]
            backend.release([row for row in dropped if row is not None])
            keys, tokens = _halves(body[d : d + 2 * n])
            if n:
                rows = [matchers[key] for key in keys]
                status = backend.consume(rows, tokens)
                rejected = np.flatnonzero(status == REJECTED).tolist()
                errors = {i: backend.error(rows[i]) for i in rejected}
                answer = status.tobytes() + (json.dumps(errors).encode() if errors else b"")
                conn.send_bytes(answer)
            keys, places = _halves(body[d + 2 * n :])
            if keys:
                backend.fill([matchers[key] for key in keys], segments[slot][1], at=places)
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
    conns: list[Connection], procs: list[subprocess.Popen], segments: dict[int, tuple]
) -> None:
    """What a ``GrammarProcesses`` collected unclosed holds: its workers stopped and its
    shared masks' names removed (the memory goes with the last array over it), so no
    segment is left in /dev/shm behind an engine that was dropped, not closed."""
    _stop_workers(conns, procs)
    for shm, *_ in segments.values():
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
    segments.clear()


def _stop_workers(conns: list[Connection], procs: list[subprocess.Popen]) -> None:
    """Ask the workers to stop, wait for them (killing any that hangs), and empty both
    lists."""
    for conn in conns:
        try:
            conn.send_bytes(_message(STOP))
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
    conns.clear()
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
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._num = processes
        self._words = -(-vocab_size // 32)
        self._checker = _backend(name, tokenizer, vocab_size, self._eos)
        self._checked: dict[str, None] = {}  # specs the checker compiled, oldest first
        # These three change in place only (the finalizer holds them).
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        # A poll object per worker's connection, made once: Connection.poll builds a
        # selector at every call (tens of microseconds of Python, 16 calls a step at 8).
        self._pollers: list[Any] = []
        # slot -> (memory, its [rows, words] masks, registered with CUDA): slots 0 and 1
        # are the engine's two mask buffers (``shared_masks``), SCRATCH any other array's
        self._segments: dict[int, tuple[SharedMemory, np.ndarray, bool]] = {}
        weakref.finalize(self, _release, self._conns, self._procs, self._segments)
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
        self.finish_fill(self.send_step(fill=(rows, mask, at)))

    def shared_masks(self, slot: int, rows: int, pinned: bool) -> np.ndarray:
        """A [rows, words] int32 buffer in shared memory for the engine's mask buffer
        ``slot`` (0 or 1; structured_output.py's ``_MaskBuffers``), replacing the slot's
        previous one; registered with CUDA as pinned memory when ``pinned``, so the upload
        reads it without a staging copy."""
        return self._new_segment(slot, rows, pinned)

    def consume(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Each row's matcher takes its token: [rows] uint8, TAKEN, STOPPED or REJECTED
        (structured_output_params) per row, in input order."""
        return self.finish_consume(self.send_step(consume=(rows, tokens)))

    def send_step(
        self,
        consume: tuple[Sequence[int], Sequence[int]] | None = None,
        fill: tuple[Sequence[int], np.ndarray, Sequence[int] | None] | None = None,
    ) -> _Sent:
        """Send a step's work, one message per worker: with ``consume`` (rows, their
        tokens) the drops of the requests released since the last one and then the tokens,
        then ``fill`` (rows, mask, places as in ``fill``); ``finish_consume`` and then
        ``finish_fill`` read the answers. A worker goes from the tokens to the masks without
        waiting for another message."""
        sent = _Sent()
        # worker -> [dropped keys, consumed keys, their tokens, filled keys, their places]
        parts: dict[int, list[Any]] = {}
        if consume is not None:
            for worker, dropped in self._take_released():
                parts[worker] = [dropped, (), (), (), ()]
            sent.keys = np.asarray(consume[0], dtype=np.int64)
            tokens = np.asarray(consume[1], dtype=np.int64)
            sent.consumed = self._by_worker(sent.keys)
            for worker, index in sent.consumed:
                part = parts.setdefault(worker, [(), (), (), (), ()])
                part[1:3] = sent.keys[index], tokens[index]
        slot = 0
        if fill is not None:
            rows, sent.mask, at = fill
            keys = np.asarray(rows, dtype=np.int64)
            places = np.arange(len(keys)) if at is None else np.asarray(at, dtype=np.int64)
            shared = self._slot_of(sent.mask)
            if shared is None:
                self._scratch_room(int(places.max(initial=-1)) + 1)
                sent.scratch_places = places
            slot = SCRATCH if shared is None else shared
            for worker, index in self._by_worker(keys):
                part = parts.setdefault(worker, [(), (), (), (), ()])
                part[3:] = keys[index], places[index]
                sent.filled.append(worker)
        for worker, (dropped, keys_c, tokens_c, keys_f, places_f) in parts.items():
            head = [slot, len(dropped), len(keys_c)]
            self._send(worker, _message(STEP, head, dropped, keys_c, tokens_c, keys_f, places_f))
        return sent

    def finish_consume(self, sent: _Sent) -> np.ndarray:
        """The consume part's answers: [rows] uint8 statuses, as ``consume``."""
        status = np.empty(len(sent.keys), dtype=np.uint8)
        for worker, index in sent.consumed:
            answer = self._recv(worker)
            status[index] = np.frombuffer(answer, dtype=np.uint8, count=len(index))
            if len(answer) > len(index):  # the rejected rows' errors
                for j, why in json.loads(answer[len(index) :]).items():
                    self._errors[int(sent.keys[index[int(j)]])] = why
        sent.consume_read = True
        return status

    def answered(self, sent: _Sent) -> bool:
        """Whether every worker of ``sent`` has answered what is still to read (so its
        masks are in), without waiting. Before the consume part's answers are read, a
        worker's waiting answer may be its statuses, not its masks: False then."""
        if sent.consumed and not sent.consume_read:
            return False
        return all(self._ready(worker, 0) for worker in sent.filled)

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
        if self._closed or not self._conns:
            return
        for proc in self._procs:
            proc.kill()
            proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns.clear()
        self._pollers.clear()
        self._procs.clear()
        self._errors.clear()
        self._released.clear()

    def close(self) -> None:
        """Stop the workers and free the shared masks; the workers do not start again."""
        self._closed = True
        _stop_workers(self._conns, self._procs)
        self._pollers.clear()
        for slot in list(self._segments):
            self._free_segment(slot)

    # ---- internals -----------------------------------------------------------------------
    def _ensure_started(self) -> None:
        """Start the workers unless they run, and tell them of the shared masks there are
        (after a ``restart``); after ``close`` they do not start again."""
        if self._conns:
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
        socket pair and its settings over it."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        settings = self._settings()
        for _ in range(self._num):
            ours, theirs = socket.socketpair()
            with theirs:
                fd = theirs.fileno()
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _WORKER_MAIN, str(fd)],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        pass_fds=(fd,),
                        start_new_session=True,  # out of the job's process group's signals
                    )
                )
            self._conns.append(Connection(ours.detach()))
            poller = select.poll()
            poller.register(self._conns[-1].fileno(), select.POLLIN)
            self._pollers.append(poller)
            self._conns[-1].send_bytes(settings)

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
        self._segments[slot] = (shm, masks, registered)
        self._announce(slot)
        return masks

    def _announce(self, slot: int) -> None:
        """Tell every worker where ``slot``'s masks are (its shared memory's name, rows)."""
        shm, masks, _ = self._segments[slot]
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
        shm, masks, registered = held
        if registered:
            _unregister(masks)
        del masks  # before its memory goes
        shm.close()
        shm.unlink()

    def _slot_of(self, mask: np.ndarray) -> int | None:
        """The slot whose buffer ``mask`` is the head of (its first rows), if any."""
        address = mask.__array_interface__["data"][0]
        for slot, (_, masks, _) in self._segments.items():
            if (
                slot != SCRATCH
                and masks.__array_interface__["data"][0] == address
                and mask.shape[1:] == masks.shape[1:]
                and mask.flags.c_contiguous
            ):
                return slot
        return None

    def _take_released(self) -> list[tuple[int, np.ndarray]]:
        """(worker, its released keys) for the keys released since the last call, which
        are forgotten here."""
        with self._lock:
            released, self._released = self._released, []
        for key in released:
            self._errors.pop(key, None)
        keys = np.asarray(released, dtype=np.int64)
        return [(worker, keys[index]) for worker, index in self._by_worker(keys)]

    def _by_worker(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(worker, the indices in ``keys`` of its rows) for each worker with rows, in
        ``keys`` order within each (numpy: a step has hundreds of rows)."""
        if not len(keys):
            return []
        workers = keys % self._num
        order = np.argsort(workers, kind="stable")
        bounds = np.searchsorted(workers[order], np.arange(self._num + 1))
        return [
            (worker, order[bounds[worker] : bounds[worker + 1]])
            for worker in range(self._num)
            if bounds[worker + 1] > bounds[worker]
        ]

    def _send(self, worker: int, message: bytes) -> None:
        try:
            self._conns[worker].send_bytes(message)
        except (BrokenPipeError, OSError) as exc:
            raise self._died(worker) from exc

    def _recv(self, worker: int) -> bytes:
        conn = self._conns[worker]
        try:
            if not self._ready(worker, self.answer_timeout_s):
                raise self._died(worker, f"has not answered in {self.answer_timeout_s:g} s")
            return conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise self._died(worker) from exc

    def _ready(self, worker: int, timeout_s: float | None) -> bool:
        """Whether ``worker`` has an answer to read (or has gone: EOF reads as ready),
        waiting up to ``timeout_s`` (None: as long as it takes)."""
        return bool(self._pollers[worker].poll(None if timeout_s is None else timeout_s * 1e3))

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
        _serve(conn, _backend(name, tokenizer, vocab_size, eos))
    except EOFError:  # the engine went away
        pass
