"""Gated sampling: a constrained step launched in one call while its bitmask is filled.

The split design (vLLM's, ``EngineCore`` with ``structured_outputs_sampling="split"``) sends a
constrained step's sampling as a second call once the engine thread has advanced the grammars
and seen the bitmask filled. Served on an H100 that cost the engine thread, the bound of a
served step, 1.7x its unconstrained work per token: the accepts, the fill's hand-over and the
sampling call all ran on it.

Gated, the engine thread launches the forward *and* the masked sampling at once
(``SchedulerOutput.grammar``); the sampling waits on the device for a flag that says the
bitmask is filled (``tandem.kernels.host_flag``; a CPU worker waits on the host), so the
device goes on as soon as the bitmask is there, whatever the engine thread is doing. The
fills run on a thread of their own, in launch order; the accepts run on the engine thread:

    launch S:    fill(S)    (fill thread) once accept(S-1) is done: write S's bitmask, raise
                            the flag to S's number
    complete S:  accept(S)  (engine thread) S's sampled ids are on the host: advance the
                            matchers, note the refusals, let fill(S+1) go

Every token a request of step S received came from an earlier step, whose accept precedes
fill(S): the matchers are current when S's rows are filled. No two threads touch a matcher
at once: fill(S) is done before S's ids exist (they are sampled behind its flag), and
fill(S+1) waits for accept(S). The accept stays on the engine thread, which needs its
refusals to apply the step anyway: on the fill thread it had to wait for the step's ids on
the device itself (a spinning CUDA event wait, or a sleeping one that wakes late), and the
engine thread then waited for it, a cross-thread hand-over on every step's critical path.
Now the fill thread sleeps on a condition between fills and takes the GIL twice a step.

A CPU worker waits for its gate on the engine thread, inside the launch of S+1, before the
engine completes S: there ``wait_filled`` runs the accepts still pending first (a CPU step's
ids exist when its launch returns). A fill that fails still raises its flag (the device
never waits for ever) and fails its step. On the CPU (``background=False``) the fills run
inline as they are submitted, after running any accept still pending.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from tandem.structured_output.buffers import BitmaskBuffers
from tandem.types.grammar import GrammarOutput

if TYPE_CHECKING:
    import torch

    from tandem.structured_output.backend import GrammarBackend
    from tandem.structured_output.manager import RequestGrammarState

logger = logging.getLogger(__name__)

# The GIL switch interval while the gated fill thread runs (CPython's default is 5 ms): the
# thread takes the GIL when a fill starts and when it returns, and a waiting thread gets in
# only after a switch interval of the holder's pure-Python work, longer than a served step.
SWITCH_INTERVAL_S = 0.0002

# A refused token: its position in the step's output, and why (``explain_refusal``).
Refusals = dict[int, tuple[str, bool]]


class BitmaskGate:
    """``GrammarOutput.gate`` of a gated step: its bitmask is filled once ``flag[0] >= seq``.
    ``flag`` is a one-element int32 tensor in host memory, pinned for a CUDA worker (which
    waits on the device); ``wait`` blocks a CPU worker's thread."""

    __slots__ = ("flag", "seq", "_owner")

    def __init__(self, flag: "torch.Tensor", seq: int, owner: "GatedFills") -> None:
        self.flag = flag
        self.seq = seq
        self._owner = owner

    def wait(self) -> None:
        self._owner.wait_filled(self.seq)


class StepAccept(Future):  # type: ignore[type-arg]
    """accept(S) as a future of its refusals: it runs, once, on the first ``result()`` (the
    engine thread applying S, or a CPU worker's wait at a later gate), which waits for S's
    ids, advances S's grammars and lets the fill thread go on. An interrupt while waiting for
    the ids leaves it to run again on a later ``result()``, like the step's own output."""

    def __init__(self, owner: "GatedFills", req_ids: list[str], grammars: list["RequestGrammarState"],
                 output: "Future[Any]") -> None:
        super().__init__()
        self._owner = owner
        self._args = (req_ids, grammars, output)
        self._lock = threading.Lock()

    def run(self) -> None:
        with self._lock:
            if self.done():
                return
            req_ids, grammars, output = self._args
            try:
                out = output.result()
            except Exception as e:  # the step failed: its requests fail with it
                self.set_exception(e)
            else:
                try:
                    self.set_result(self._owner._accept(req_ids, grammars, out))
                except Exception as e:  # noqa: BLE001 - the engine fails the step
                    self.set_exception(e)
            self._args = ()  # type: ignore[assignment]
        self._owner._accepted()

    def run_if_ready(self) -> None:
        """Run now if the step's ids are on the host already (never waits for them)."""
        if self.done():
            return
        ready = getattr(self._args[2], "ready", None)  # an in-process step's output future
        if ready is not None and ready():
            self.run()

    def result(self, timeout: Optional[float] = None) -> Refusals:
        self.run()
        return super().result()


class GatedFills:
    """The fill thread of gated sampling (or the inline runner of its fills on the CPU), its
    flag, its bitmask buffers and the accepts not yet run."""

    def __init__(self, bitmask_words: int, stop_token_ids: frozenset[int], background: bool, pinned: bool,
                 backend: Callable[[], Optional["GrammarBackend"]]) -> None:
        import torch

        self.words = bitmask_words
        self.stop_token_ids = stop_token_ids
        self.background = background
        self.pinned = pinned
        self._backend = backend
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=pinned)
        self._flag_np = self.flag.numpy()
        self._seq = 0
        self._filled = threading.Condition()
        # Bitmask buffers, used in turn. fill(S+1) starts after accept(S), i.e. after S's
        # sampled ids reached the host, so S's sampling has copied S's bitmask by then.
        self._bufs = BitmaskBuffers(bitmask_words, pinned)
        self._jobs: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._closed = False
        # Accepts in launch order, until they have run; the fill thread waits on
        # ``_accepts_done`` for the one before its fill.
        self._pending: list[StepAccept] = []
        self._accepts_done = threading.Condition()
        self.num_steps = 0

    # -- the engine thread ------------------------------------------------------------------
    def open_step(self, step_id: int, req_ids: list[str], grammars: list["RequestGrammarState"]
                  ) -> tuple[GrammarOutput, "Future[None]"]:
        """At step ``step_id``'s launch, before ``execute_model``: its ``GrammarOutput`` (a
        row per constrained request that samples, in ``req_ids`` order, gated) and the
        future of its fill, which starts once the accept of the gated step before it has
        run. ``req_ids`` and ``grammars`` are read later, on the thread: the caller hands
        them over and changes them no more."""
        self._seq += 1
        seq = self._seq
        bitmask = self._bufs.next(len(req_ids))
        fut: "Future[None]" = Future()
        prev = self._pending[-1] if self._pending else None
        self._submit(lambda: self._fill(seq, grammars, bitmask, fut, prev))
        self.num_steps += 1
        return GrammarOutput(step_id, req_ids, bitmask, gate=BitmaskGate(self.flag, seq, self)), fut

    def accept_step(self, req_ids: list[str], grammars: list["RequestGrammarState"],
                    output: "Future[Any]") -> StepAccept:
        """Right after step S's launch: the accept that advances ``grammars`` (of
        ``req_ids``) by the ids the step samples, once ``output`` (its ``ModelRunnerOutput``
        future) has them; its ``result()`` runs it and gives the refused positions of the
        output, with the reason. Every step's accept must be read (the next fill waits for
        it), the failed step's too."""
        accept = StepAccept(self, req_ids, grammars, output)
        self._pending.append(accept)
        return accept

    def wait_filled(self, seq: int) -> None:
        """Block until bitmask ``seq`` is filled (a CPU worker's wait, on the engine thread
        inside a launch): the accepts still pending run first, or the fill would wait for
        them while the engine thread waits for the fill."""
        for accept in list(self._pending):
            accept.run()
        with self._filled:
            while int(self._flag_np[0]) < seq:
                self._filled.wait()

    def shutdown(self) -> None:
        """Stop the thread after the fills queued (each raises its flag; one whose accept
        never ran fails)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        with self._accepts_done:
            self._accepts_done.notify_all()
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def _accepted(self) -> None:
        """An accept has run: drop the finished ones from the front, wake the fill thread."""
        with self._accepts_done:
            while self._pending and self._pending[0].done():
                self._pending.pop(0)
            self._accepts_done.notify_all()

    # -- fills ------------------------------------------------------------------------------
    def _submit(self, job: Callable[[], None]) -> None:
        if not self.background:
            job()
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("the gated fill thread is shut down")
            if self._thread is None:
                if sys.getswitchinterval() > SWITCH_INTERVAL_S:
                    sys.setswitchinterval(SWITCH_INTERVAL_S)
                self._thread = threading.Thread(target=self._run, name="tandem-gated-fill", daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def _await_accept(self, prev: Optional[StepAccept]) -> None:
        """Before a fill: the accept of the gated step launched before it has run (inline:
        run it here)."""
        if prev is None or prev.done():
            return
        if not self.background:
            prev.run()
            return
        with self._accepts_done:
            while not prev.done():
                if self._closed:
                    raise RuntimeError("the engine shut down before the step before this one was applied")
                self._accepts_done.wait()

    def _fill(self, seq: int, grammars: list["RequestGrammarState"], bitmask: "torch.Tensor",
              fut: "Future[None]", prev: Optional[StepAccept]) -> None:
        """Fill one row per grammar (all ones where nothing constrains: an ended grammar, or
        one that never compiled), then raise the flag, whatever happened (first: the device
        may be waiting for it), then resolve ``fut``."""
        error: Optional[BaseException] = None
        try:
            self._await_accept(prev)
            matchers = [g.matcher for g in grammars if g.matcher is not None and not g.terminated]
            if len(matchers) == len(grammars):  # the common case: every row constrained
                live: list[int] = list(range(len(grammars)))
            else:
                live = [k for k, g in enumerate(grammars) if g.matcher is not None and not g.terminated]
                for k in set(range(len(grammars))).difference(live):
                    bitmask[k].fill_(-1)
            if live:
                backend = self._backend()
                assert backend is not None  # a matcher exists, so its backend does
                backend.fill_bitmasks(matchers, bitmask, live)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - the step fails with it
            error = e
        finally:
            with self._filled:
                self._flag_np[0] = seq
                self._filled.notify_all()
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(None)

    # -- accepts (``StepAccept.run``, on the engine thread) ---------------------------------
    def _accept(self, req_ids: list[str], grammars: list["RequestGrammarState"], out: Any) -> Refusals:
        """Advance each live grammar by its request's id in ``out`` (the step's
        ``ModelRunnerOutput``); the refused positions."""
        out_ids, tokens = out.req_ids, out.sampled_token_ids
        if out_ids == req_ids:
            where: Sequence[int] = range(len(req_ids))
        else:
            pos = {rid: k for k, rid in enumerate(out_ids)}
            where = [pos[rid] for rid in req_ids]
        live = [(k, g) for k, g in zip(where, grammars) if g.matcher is not None and not g.terminated]
        if not live:
            return {}
        if len(live) == len(tokens) and isinstance(where, range):  # every row, in order
            toks = tokens
        else:
            toks = [tokens[k] for k, _ in live]
        backend = self._backend()
        assert backend is not None
        accepted = backend.accept_tokens([g.matcher for _, g in live], toks)  # type: ignore[misc]
        stop = self.stop_token_ids
        refused: Refusals = {}
        if False not in accepted and stop.isdisjoint(toks):
            return refused
        for (k, g), ok, tok in zip(live, accepted, toks):
            if not ok:
                refused[k] = g.refusal_reason(tok)
            elif tok in stop:
                g.terminated = g.matcher.is_terminated  # type: ignore[union-attr]
        return refused
