"""Grammar work spread over worker processes (``structured_output_processes: N``).

A grammar's host work is per row and per token (one mask filled, one sampled token taken),
and at a few hundred constrained rows a step on a small model it outlasts the GPU's step:
on the H200, ~430 rows cost 4.5-7 ms a step against a 2.4 ms forward pass. Threads inside
one process do not spread it: xgrammar holds the GIL while it works, and llguidance's
threads serialize on the lexer shared by copies of a compiled grammar. Processes share
nothing, so N of them do a step's work in about 1/N of the time.

Each worker process owns the matchers of the requests given to it (in turn, as they come)
and runs the in-process backend (grammar_llguidance.py or grammar_xgrammar.py) on them with
one thread. A step costs one round trip per call and worker over a socket pair:

    add / drop       sent, not answered (the spec was compiled here first, so it compiles)
    consume          each worker takes its rows' tokens and answers, per row, accepted or
                     not, stopped or not, and the error of a rejected token (the engine
                     sends the tokens, then the next step's fill, and only then reads the
                     answers: the workers go from one to the other without waiting)
    fill             each worker writes its rows' masks at their places in the step's mask
                     buffer, which lives in shared memory (the engine's two mask buffers
                     come from ``shared_masks``, pinned for CUDA with cudaHostRegister, so
                     the upload reads what the workers wrote; another array is filled
                     through a scratch buffer and a copy); the answer says they are in

The backend interface is the in-process backends' (matcher / fill / consume / is_stopped /
error / release), so structured_output.py keeps the bookkeeping either way. A worker that
dies raises RuntimeError naming it at the next call; ``close`` stops them all.
"""

from __future__ import annotations

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

from tokenmill.engine.grammar_llguidance import LlguidanceGrammars
from tokenmill.engine.grammar_xgrammar import XgrammarGrammars

__all__ = ["BACKENDS", "GrammarProcesses"]

# structured_output_backend -> the in-process backend (a worker runs one too)
BACKENDS = {"llguidance": LlguidanceGrammars, "xgrammar": XgrammarGrammars}

Row = tuple[int, int]  # (the request's key, its worker)
_WORKER_MAIN = "from tokenmill.engine.grammar_processes import main; main()"
SCRATCH = -1  # the shared buffer of masks bound for an array not in shared memory


def _backend(name: str, tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> Any:
    """The in-process backend a worker (or the parent, to compile specs once) runs."""
    return BACKENDS[name](tokenizer, vocab_size, eos, threads=1)


def _serve(conn: Connection, backend: Any) -> None:
    """A worker's loop over the messages of ``GrammarProcesses``, until "stop"."""
    matchers: dict[int, tuple[Any, int]] = {}
    segments: dict[int, tuple[SharedMemory, np.ndarray]] = {}  # slot -> memory, masks
    while True:
        message = conn.recv()
        kind = message[0]
        if kind == "add":
            for key, spec in zip(message[1], message[2], strict=True):
                matchers[key] = backend.matcher(spec)
        elif kind == "drop":
            for key in message[1]:
                matchers.pop(key, None)
        elif kind == "consume":
            rows = [matchers[key] for key in message[1]]
            accepted = backend.consume(rows, message[2])
            stopped = [
                ok and backend.is_stopped(m) for (m, _), ok in zip(rows, accepted, strict=True)
            ]
            errors = {i: backend.error(rows[i][0]) for i, ok in enumerate(accepted) if not ok}
            conn.send((accepted, stopped, errors))
        elif kind == "fill":
            _, slot, keys, places = message
            backend.fill([matchers[key] for key in keys], segments[slot][1], at=places)
            conn.send(None)
        elif kind == "shm":
            _, slot, name, rows, words = message
            if slot in segments:
                segments.pop(slot)[0].close()
            shm = _attach(name)
            segments[slot] = (shm, np.ndarray((rows, words), dtype=np.int32, buffer=shm.buf))
        elif kind == "stop":
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


def _stop_workers(conns: list[Connection], procs: list[subprocess.Popen]) -> None:
    """Ask the workers to stop, wait for them (killing any that hangs), and empty both
    lists. Also run when an unclosed ``GrammarProcesses`` is collected."""
    for conn in conns:
        try:
            conn.send(("stop",))
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
        self._checked: set[str] = set()
        self._conns: list[Connection] = []  # changed in place only (see the finalizer)
        self._procs: list[subprocess.Popen] = []
        weakref.finalize(self, _stop_workers, self._conns, self._procs)
        # slot -> (memory, its [rows, words] masks, registered with CUDA): slots 0 and 1
        # are the engine's two mask buffers (``shared_masks``), SCRATCH any other array's
        self._segments: dict[int, tuple[SharedMemory, np.ndarray, bool]] = {}
        self._next_key = 0
        self._next_worker = 0
        self._stopped: dict[int, bool] = {}  # key -> stopped after its last token
        self._errors: dict[int, str] = {}  # key -> why its last token was rejected
        self._released: list[Row] = []  # finished requests' matchers, to drop
        self._lock = threading.Lock()

    # ---- the backend interface -----------------------------------------------------------
    def matcher(self, spec: str) -> Row:
        """A new request's matcher (in a worker, in its start state): its key and worker."""
        if spec not in self._checked:
            self._checker.matcher(spec)  # raises ValueError for a spec the library rejects
            self._checked.add(spec)
        if not self._conns:
            self._start()
        key, worker = self._next_key, self._next_worker
        self._next_key += 1
        self._next_worker = (worker + 1) % self._num
        self._send(worker, ("add", [key], [spec]))
        return key, worker

    def release(self, rows: Sequence[Row]) -> None:
        """Forget the matchers of finished requests. Any thread may call it (the engine
        finishes requests beside a fill): the keys are only noted here, and the workers
        drop them at the next ``consume``, by when no fill can name them."""
        with self._lock:
            self._released.extend(rows)

    def fill(self, rows: Sequence[Row], mask: np.ndarray, at: Sequence[int] | None = None) -> None:
        """Row ``at[i]`` (default i) of ``mask`` <- rows[i]'s next-token bitmask. Into one of
        ``shared_masks``' buffers the workers write directly; into any other array through
        a scratch buffer and a copy."""
        self.finish_fill(self.send_fill(rows, mask, at))

    def send_fill(
        self, rows: Sequence[Row], mask: np.ndarray, at: Sequence[int] | None = None
    ) -> tuple[list[int], np.ndarray, list[int] | None]:
        """``fill``'s first half: the messages go out; ``finish_fill`` waits for them."""
        places = list(range(len(rows))) if at is None else list(at)
        slot = self._slot_of(mask)
        if slot is None:
            needed = max(places, default=-1) + 1
            held = self._segments.get(SCRATCH)
            if held is None or held[1].shape[0] < needed:
                self._new_segment(SCRATCH, max(64, 1 << (max(needed, 1) - 1).bit_length()), False)
        at_places = np.asarray(places, dtype=np.int64)
        workers = []
        for worker, index, keys in self._by_worker(rows):
            target = SCRATCH if slot is None else slot
            self._send(worker, ("fill", target, keys, at_places[index].tolist()))
            workers.append(worker)
        return workers, mask, None if slot is not None else places

    def finish_fill(self, sent: tuple[list[int], np.ndarray, list[int] | None]) -> None:
        workers, mask, scratch_places = sent
        for worker in workers:
            self._recv(worker)
        if scratch_places is not None:
            mask[scratch_places] = self._segments[SCRATCH][1][scratch_places]

    def shared_masks(self, slot: int, rows: int, pinned: bool) -> np.ndarray:
        """A [rows, words] int32 buffer in shared memory for the engine's mask buffer
        ``slot`` (0 or 1; structured_output.py's ``_MaskBuffers``), replacing the slot's
        previous one; registered with CUDA as pinned memory when ``pinned``, so the upload
        reads it without a staging copy."""
        return self._new_segment(slot, rows, pinned)

    def consume(self, rows: Sequence[Row], tokens: Sequence[int]) -> list[bool]:
        """Each row's matcher takes its token; whether each accepted it (input order)."""
        return self.finish_consume(self.send_consume(rows, tokens))

    def send_consume(self, rows: Sequence[Row], tokens: Sequence[int]) -> tuple[int, list]:
        """``consume``'s first half: the tokens go out (after the drops of finished
        requests); ``finish_consume`` reads the answers. Masks asked for in between are
        filled after the tokens are taken (each worker reads its messages in order)."""
        self._drop_released()
        groups = self._by_worker(rows)
        token_ids = np.asarray(tokens, dtype=np.int64)
        for worker, index, keys in groups:
            self._send(worker, ("consume", keys, token_ids[index].tolist()))
        return len(rows), groups

    def finish_consume(self, sent: tuple[int, list]) -> list[bool]:
        num_rows, groups = sent
        accepted = np.zeros(num_rows, dtype=bool)
        for worker, index, keys in groups:
            oks, stopped, errors = self._recv(worker)
            accepted[index] = oks
            self._stopped.update(zip(keys, stopped, strict=True))
            for j, error in errors.items():
                self._errors[keys[j]] = error
        return accepted.tolist()

    def is_stopped(self, row_key: int) -> bool:
        """The output is complete (after the last token consumed): nothing but EOS may
        follow."""
        return self._stopped.get(row_key, False)

    def error(self, row_key: int) -> str:
        return self._errors.get(row_key, "the grammar rejected the token")

    def close(self) -> None:
        """Stop the workers and free the shared masks."""
        _stop_workers(self._conns, self._procs)
        for slot in list(self._segments):
            self._free_segment(slot)

    # ---- internals -----------------------------------------------------------------------
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
                    )
                )
            self._conns.append(Connection(ours.detach()))
            self._conns[-1].send_bytes(settings)

    def _settings(self) -> bytes:
        """The workers' start message, pickled once for all of them. Raises ValueError when
        the tokenizer cannot be pickled (a worker needs its own copy)."""
        message = ("start", self.name, self._tokenizer, self.vocab_size, self._eos)
        try:
            return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ValueError(
                "structured_output_processes: the model's tokenizer cannot be handed to a "
                f"worker process ({type(exc).__name__}: {exc}); set "
                "structured_output_processes to 0 to keep the grammars in this process"
            ) from None

    def _new_segment(self, slot: int, rows: int, pinned: bool) -> np.ndarray:
        """Shared memory for ``rows`` masks in ``slot``, replacing the slot's old one, made
        known to every worker."""
        if not self._conns:
            self._start()
        self._free_segment(slot)
        shm = SharedMemory(create=True, size=rows * self._words * 4)
        masks = np.ndarray((rows, self._words), dtype=np.int32, buffer=shm.buf)
        registered = pinned and _register(masks)
        self._segments[slot] = (shm, masks, registered)
        for worker in range(self._num):
            self._send(worker, ("shm", slot, shm.name, rows, self._words))
        return masks

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

    def _drop_released(self) -> None:
        with self._lock:
            released, self._released = self._released, []
        for worker, _, keys in self._by_worker(released):
            self._send(worker, ("drop", keys))
            for key in keys:
                self._stopped.pop(key, None)
                self._errors.pop(key, None)

    def _by_worker(self, rows: Sequence[Row]) -> list[tuple[int, np.ndarray, list[int]]]:
        """(worker, its rows' indices in ``rows``, their keys) for each worker with rows,
        in ``rows`` order (numpy: a step has hundreds of rows)."""
        if not rows:
            return []
        table = np.asarray(rows, dtype=np.int64)  # [R, 2]: key, worker
        groups = []
        for worker in range(self._num):
            index = np.flatnonzero(table[:, 1] == worker)
            if len(index):
                groups.append((worker, index, table[index, 0].tolist()))
        return groups

    def _send(self, worker: int, message: tuple) -> None:
        try:
            self._conns[worker].send(message)
        except (BrokenPipeError, OSError) as exc:
            raise self._died(worker) from exc

    def _recv(self, worker: int) -> Any:
        try:
            return self._conns[worker].recv()
        except (EOFError, OSError) as exc:
            raise self._died(worker) from exc

    def _died(self, worker: int) -> RuntimeError:
        proc = self._procs[worker]
        return RuntimeError(
            f"structured output: grammar worker process {worker} (pid {proc.pid}) stopped "
            f"(exit code {proc.poll()}); the engine cannot go on with its grammars"
        )


def main() -> None:
    """A worker process: take the settings from the engine's socket, serve until "stop"."""
    conn = Connection(int(sys.argv[1]))
    try:
        _, name, tokenizer, vocab_size, eos = conn.recv()
        _serve(conn, _backend(name, tokenizer, vocab_size, eos))
    except EOFError:  # the engine went away
        pass
