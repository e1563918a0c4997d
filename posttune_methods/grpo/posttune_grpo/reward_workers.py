"""Worker processes that score one completion each under a hard time limit.

One completion can keep a reward that parses model output busy for minutes: ``\\boxed{9^{9^{9}}}``
sends math_answer's sympy into a huge power. math-verify's own timeout is SIGALRM, which only a
main thread may set: in a thread or a Ray actor nothing stops it, and it stalls the trainer. So
a reward registered with ``RewardFunction(isolated=True)`` is scored here:

    the caller (trainer, thread, Ray actor)            workers (python -c ..., a few)
      hands each idle worker one completion  ─────────▶  runs the reward under an interval timer
      waits on the results, until the nearest deadline ◀── ok | error | timeout
      past timeout_s + KILL_GRACE_S: kills that worker, starts a fresh one on demand

A worker interrupts its own reward at ``timeout_s`` (SIGALRM in its main thread: cheap, the
worker lives on; CPython checks for signals inside long bignum and regex work too). A reward
that never lets the signal through (a C extension's loop, SIGALRM blocked or taken over)
is killed by the caller ``KILL_GRACE_S`` later, and its worker replaced. A batch ends by
``budget_s`` whatever happens: what is not scored by then is cut.

Workers are plain ``python -c`` subprocesses rather than multiprocessing's: its "spawn" re-imports
the caller's ``__main__`` (torch in a torchrun rank, Ray in an actor; an unguarded script would run
again), and "fork" copies a process that holds torch's threads. concurrent.futures cannot kill
one hung task, math-verify's process timeout is Windows-only and starts a process per call, and
pebble would be a dependency for the hundred lines below. Workers start when first needed,
are reused across steps, and ``close`` kills them: at the end of a run (GRPO's ``Method.close``,
which the core calls on every exit, and an actor's close), else at interpreter exit (``atexit``:
scoring outside a run, e.g. a script calling ``score``, has no other end).
A worker whose caller dies reads end-of-file and exits; on Linux, one started from a main thread
is also killed by the kernel (PR_SET_PDEATHSIG) if it is busy in C code at that moment.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from posttune.plugin import PosttuneError, first_line

KILL_GRACE_S = 1.0  # past its timeout, a worker that did not interrupt itself has this long before it is killed
START_LIMIT_S = 60.0  # a worker not ready by then (imports, warm-up) means a broken environment
MAX_WORKERS = 8  # per process: sympy's imports weigh ~70 MB a worker, and 8 score hundreds of completions a second

_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         "from posttune_grpo.reward_workers import serve; serve(sys.argv[2:])")


@dataclass(frozen=True)
class Call:
    """``fn(*args, **kwargs)``, to run in a worker: each part travels by pickle (a function by its name)."""

    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """How one call ended. ``ok``: ``value`` is its result; ``error``: ``value`` is the exception;
    ``timeout``: it ran past ``timeout_s``; ``budget``: the batch's ``budget_s`` ran out first."""

    kind: Literal["ok", "error", "timeout", "budget"]
    value: Any = None


class RemoteError(Exception):
    """An exception raised in a worker that could not travel back as itself (``name``: its type)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


# ---- the caller's side -------------------------------------------------------------------------


class _Worker:
    """One worker process and the two pipes to it."""

    def __init__(self, warm_up: tuple[Callable[[], Any], ...]):
        if not sys.executable:
            raise PosttuneError("reward workers: this Python has no sys.executable to start worker processes with")
        inbox_r, inbox_w = os.pipe()
        outbox_r, outbox_w = os.pipe()
        # the kernel's parent-death signal follows the *thread* that started the child: only a main thread lasts
        die_with_parent = threading.current_thread() is threading.main_thread()
        argv = [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(inbox_r), str(outbox_w), str(os.getpid()),
                str(int(die_with_parent))]
        try:
            self.process = subprocess.Popen(argv, pass_fds=(inbox_r, outbox_w), stdin=subprocess.DEVNULL)
        except OSError as exc:
            os.close(inbox_w)
            os.close(outbox_r)
            raise PosttuneError(f"reward workers: cannot start {sys.executable} ({exc})") from None
        finally:
            os.close(inbox_r)
            os.close(outbox_w)
        self.inbox = Connection(inbox_w, readable=False)
        self.outbox = Connection(outbox_r, writable=False)
        self.started = time.monotonic()
        try:
            self.inbox.send_bytes(pickle.dumps(warm_up))
        except OSError:
            pass  # it died at once: its end-of-file says so (WorkerPool._ready)

    def exit_status(self) -> int | None:
        """After its pipe's end-of-file (which comes first), the status it exited with."""
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass  # already gone, or unkillable (uninterruptible I/O): nothing more to do from here
        self.inbox.close()
        self.outbox.close()


class WorkerPool:
    """Up to ``size`` workers, each scoring one call at a time; ``run`` a batch, ``close`` at the end."""

    def __init__(self, size: int, warm_up: Sequence[Callable[[], Any]] = ()):
        """``warm_up``: picklable functions each new worker runs before its first call (imports,
        caches), so that no call's time limit pays for them."""
        self.size = max(1, int(size))
        self.warm_up = tuple(warm_up)
        self.started = 0  # workers started so far (a restart after a kill counts)
        self._idle: list[_Worker] = []
        self._starting: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()  # one batch at a time; callers in other threads wait their turn

    def run(self, calls: Sequence[Call], *, timeout_s: float, budget_s: float) -> list[Outcome]:
        """Every call's outcome, in order: each call gets ``timeout_s`` seconds in a worker, the
        whole batch ``budget_s``, counted once the workers are up: their start-up (first use, or
        after a cut killed them) is the pool's cost, bounded by ``START_LIMIT_S``, not the batch's."""
        with self._lock:
            self._start_workers(min(self.size, len(calls)))
            while self._starting:
                self._wait({}, [], math.inf)
            return self._run(list(calls), timeout_s, time.monotonic() + budget_s)

    def close(self) -> None:
        """Kill every worker (idle, starting or busy): nothing is left running."""
        for worker in list(self._live):
            self._discard(worker)

    def pids(self) -> list[int]:
        """The live workers' process ids (for tests and diagnostics)."""
        return [worker.process.pid for worker in self._live]

    def _run(self, calls: list[Call], timeout_s: float, end: float) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(calls)
        todo = deque(range(len(calls)))
        busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (call index, kill deadline)
        try:
            while (todo or busy) and time.monotonic() < end:
                self._start_workers(min(self.size, len(todo) + len(busy)))
                self._dispatch(calls, todo, busy, outcomes, timeout_s)
                self._wait(busy, outcomes, end)
        finally:  # the budget ran out, or the caller is interrupted: cut what is still running
            for worker, (index, _) in busy.items():
                self._discard(worker)
                outcomes[index] = Outcome("budget")
        return [outcome or Outcome("budget") for outcome in outcomes]

    def _start_workers(self, wanted: int) -> None:
        while len(self._live) < wanted:
            worker = _Worker(self.warm_up)
            self.started += 1
            self._live.add(worker)
            self._starting.append(worker)

    def _dispatch(self, calls: list[Call], todo: deque, busy: dict, outcomes: list, timeout_s: float) -> None:
        while todo and self._idle:
            index = todo.popleft()
            try:
                message = pickle.dumps((timeout_s, calls[index]))
            except Exception as exc:  # an argument that cannot travel fails its own call only
                outcomes[index] = Outcome("error", exc)
                continue
            worker = self._idle.pop()
            try:
                worker.inbox.send_bytes(message)
            except OSError:  # died while idle (killed from outside): replace it, keep the call
                self._discard(worker)
                todo.appendleft(index)
                return
            busy[worker] = (index, time.monotonic() + timeout_s + KILL_GRACE_S)

    def _wait(self, busy: dict, outcomes: list, end: float) -> None:
        """Take whatever finishes before the nearest deadline, then kill what ran past its own."""
        deadlines = [end, *(deadline for _, deadline in busy.values()),
                     *(worker.started + START_LIMIT_S for worker in self._starting)]
        by_pipe = {worker.outbox: worker for worker in (*busy, *self._starting)}
        if not by_pipe:  # an idle worker was found dead: the next round starts another
            return
        for pipe in wait(list(by_pipe), timeout=max(0.0, min(deadlines) - time.monotonic())):
            worker = by_pipe[pipe]
            if worker in busy:
                index, _ = busy.pop(worker)
                outcomes[index] = self._result(worker)
            else:
                self._ready(worker)
        now = time.monotonic()
        for worker, (index, deadline) in list(busy.items()):
            if now >= deadline:
                del busy[worker]
                self._discard(worker)
                outcomes[index] = Outcome("timeout")
        for worker in list(self._starting):
            if now >= worker.started + START_LIMIT_S:
                self._discard(worker)
                raise PosttuneError(f"reward workers: a worker process did not start within {START_LIMIT_S:g} s")

    def _result(self, worker: _Worker) -> Outcome:
        try:
            kind, value = pickle.loads(worker.outbox.recv_bytes())
        except (EOFError, OSError):
            code = worker.exit_status()
            self._discard(worker)
            return Outcome("error", RemoteError("WorkerDied", f"the worker process died (exit status {code})"))
        except Exception as exc:  # a result that cannot be unpickled here
            self._idle.append(worker)
            return Outcome("error", exc)
        self._idle.append(worker)
        if kind == "error" and not isinstance(value, BaseException):
            value = RemoteError(*value)
        return Outcome(kind, value)

    def _ready(self, worker: _Worker) -> None:
        try:
            kind, message = pickle.loads(worker.outbox.recv_bytes())
        except (EOFError, OSError):
            kind, message = "failed", f"it exited with status {worker.exit_status()}"
        self._starting.remove(worker)
        if kind != "ready":
            self._discard(worker)
            raise PosttuneError(f"reward workers: a worker process could not start: {message}")
        self._idle.append(worker)

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._live.discard(worker)
        for group in (self._idle, self._starting):
            if worker in group:
                group.remove(worker)


def default_size() -> int:
    """The CPUs this process may use, shared among the node's ranks, at most ``MAX_WORKERS``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(MAX_WORKERS, cores // ranks))


_shared: WorkerPool | None = None
_shared_lock = threading.Lock()


def shared_pool(warm_up: Sequence[Callable[[], Any]] = ()) -> WorkerPool:
    """This process's pool, started on first use and killed by ``close_shared_pool`` (a run's close) or at exit.

    One per process (the trainer, each Ray actor), whatever the number of runs or rewards; a
    request for a warm-up it lacks replaces it with one that has both."""
    global _shared
    with _shared_lock:
        if _shared is not None and not set(warm_up) <= set(_shared.warm_up):
            warm_up = (*_shared.warm_up, *(w for w in warm_up if w not in _shared.warm_up))
            _shared.close()
            _shared = None
        if _shared is None:
            _shared = WorkerPool(default_size(), warm_up)
        return _shared


def close_shared_pool() -> None:
    """Kill this process's workers (idempotent; the next ``shared_pool`` starts new ones)."""
    global _shared
    with _shared_lock:
        pool, _shared = _shared, None
    if pool is not None:
        pool.close()


def _forget_shared_pool() -> None:
    # A forked child holds copies of its parent's pipes: the workers are the parent's to use and kill.
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


atexit.register(close_shared_pool)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared_pool)


# ---- the worker's side -------------------------------------------------------------------------

_IN_WORKER = False


def in_worker() -> bool:
    """True inside a worker process (where the pool, not the reward, enforces the time limit)."""
    return _IN_WORKER


class _Overrun(BaseException):
    """Raised by the interval timer in a worker: a BaseException, so that a reward's (or a
    library's) ``except Exception`` does not swallow it."""


def _overrun(signum: int, frame: Any) -> None:
    raise _Overrun


def serve(argv: list[str]) -> None:
    """A worker's life: warm up, say ready, then answer one call at a time until the pipe closes."""
    global _IN_WORKER
    inbox, outbox = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    if argv[3] == "1":
        _die_with_parent(int(argv[2]))
    _IN_WORKER = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the caller decides
    try:
        for warm in pickle.loads(inbox.recv_bytes()):
            warm()
    except EOFError:
        return
    except Exception as exc:
        outbox.send_bytes(pickle.dumps(("failed", f"{type(exc).__name__}: {first_line(str(exc))}")))
        return
    outbox.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            message = inbox.recv_bytes()
        except EOFError:  # the pool was closed, or the caller died
            return
        answer = _answer(message)
        try:
            outbox.send_bytes(answer)
        except OSError:  # the caller died while this call ran
            return


def _answer(message: bytes) -> bytes:
    try:
        limit, call = pickle.loads(message)
        _reset_alarm()
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            result: tuple[str, Any] = ("ok", call.fn(*call.args, **call.kwargs))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Overrun:
        result = ("timeout", None)
    except Exception as exc:
        result = ("error", _portable(exc))
    try:
        return pickle.dumps(result)
    except Exception as exc:  # a value that cannot travel back
        return pickle.dumps(("error", (type(exc).__name__, f"the reward's result cannot be sent back: {exc}")))


def _reset_alarm() -> None:
    """The worker's own SIGALRM handler, unblocked, with nothing pending: a reward (or a library
    such as math-verify with its own timeout) may have replaced or blocked it on an earlier call."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # drops an alarm left pending while blocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    signal.signal(signal.SIGALRM, _overrun)


def _portable(exc: Exception) -> Exception | tuple[str, str]:
    """The exception itself if it survives a pickle round trip, else its type's name and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return type(exc).__name__, str(exc)


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker when its parent dies, even mid-way through a C call."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(0)
