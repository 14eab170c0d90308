"""Gated sampling: a constrained step launched in one call while its bitmask is filled.

The split design (vLLM's, ``EngineCore`` with ``structured_outputs_sampling="split"``) sends a
constrained step's sampling as a second call once the engine thread has advanced the grammars
and seen the bitmask filled. Served on an H100 that cost the engine thread, the bound of a
served step, 1.7x its unconstrained work per token: the accepts, the fill's hand-over and the
sampling call all ran on it.

Gated, the engine thread launches the forward *and* the masked sampling at once
(``SchedulerOutput.grammar``); the sampling waits on the device for a flag that says the
bitmask is filled (``tandem.kernels.host_flag``; a CPU worker waits on the host), so the
device goes on as soon as the bitmask is there, whatever the engine thread is doing. All the
grammar work runs here, on one thread of its own, in launch order:

    launch S:  fill(S)    write S's bitmask, raise the flag to S's number
               accept(S)  wait for S's sampled ids (their host copy), advance the matchers

Every token a request of step S received came from an earlier step, whose accept precedes
fill(S) on the thread: the matchers are current when S's rows are filled, with no wait on the
engine thread. The engine thread touches no matcher of a live request: it reads accept(S)'s
refusals (with their explanation, worked out here from the matcher that refused) when it
applies step S. A fill that fails still raises its flag (the device never waits for ever)
and fails its step.

On the CPU (``background=False``) the jobs run inline as they are submitted: a CPU step's
ids exist when its launch returns, so the order above holds with nobody waiting.

The thread competes with the engine thread for the GIL whenever it leaves native code (a
step's ids arrive; a fill returns). CPython lets a waiting thread in only after a switch
interval of the holder's pure-Python work (5 ms by default), longer than a served step, so
the interval is shortened to ``SWITCH_INTERVAL_S`` once the thread starts.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from tandem import step_trace
from tandem.structured_output.buffers import BitmaskBuffers
from tandem.types.grammar import GrammarOutput

if TYPE_CHECKING:
    import torch

    from tandem.structured_output.backend import GrammarBackend
    from tandem.structured_output.manager import RequestGrammarState

logger = logging.getLogger(__name__)

# The GIL switch interval while the gated fill thread runs (CPython's default is 5 ms).
SWITCH_INTERVAL_S = 0.0002

# A refused token: its position in the step's output, and why (``explain_refusal``).
Refusals = dict[int, tuple[str, bool]]


def _traced(job: Callable[[], None], phase: str, step: int) -> Callable[[], None]:
    """``job``, marking its span on the step trace when there is one (``tandem.step_trace``;
    the accept's span includes its wait for the step's ids)."""
    if step_trace.TRACE is None:
        return job

    def run() -> None:
        trace = step_trace.TRACE
        assert trace is not None
        trace.mark(phase, "b", step)
        try:
            job()
        finally:
            trace.mark(phase, "e", step)
    return run


class BitmaskGate:
    """``GrammarOutput.gate`` of a gated step: its bitmask is filled once ``flag[0] >= seq``.
    ``flag`` is a one-element int32 tensor in host memory, pinned for a CUDA worker (which
    waits on the device); ``wait`` blocks a CPU worker's thread."""

    __slots__ = ("flag", "seq", "_owner")

    def __init__(self, flag: "torch.Tensor", seq: int, owner: "GatedFills") -> None:
        self.flag = flag
        self.seq = seq
        self._owner = owner

    @property
    def pinned(self) -> bool:
        """The flag and the step's bitmask are in pinned memory (one setting for both)."""
        return self._owner.pinned

    def wait(self) -> None:
        self._owner.wait_filled(self.seq)


class GatedFills:
    """The fill thread of gated sampling (or the inline runner of its jobs on the CPU), its
    flag and its bitmask buffers."""

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
        self.num_steps = 0

    # -- the engine thread ------------------------------------------------------------------
    def open_step(self, step_id: int, req_ids: list[str], grammars: list["RequestGrammarState"]
                  ) -> tuple[GrammarOutput, "Future[None]"]:
        """At step ``step_id``'s launch, before ``execute_model``: its ``GrammarOutput`` (a
        row per constrained request that samples, in ``req_ids`` order, gated) and the
        future of its fill. ``req_ids`` and ``grammars`` are read later, on the thread: the
        caller hands them over and changes them no more."""
        self._seq += 1
        seq = self._seq
        bitmask = self._bufs.next(len(req_ids))
        fut: "Future[None]" = Future()
        self._submit(_traced(lambda: self._fill(seq, grammars, bitmask, fut), "fill", step_id))
        self.num_steps += 1
        return GrammarOutput(step_id, req_ids, bitmask, gate=BitmaskGate(self.flag, seq, self)), fut

    def accept_step(self, req_ids: list[str], grammars: list["RequestGrammarState"],
                    output: "Future[Any]", step_id: int = -1) -> "Future[Refusals]":
        """Right after step S's launch: advance ``grammars`` (of ``req_ids``) by the ids the
        step samples, once ``output`` (its ``ModelRunnerOutput`` future) has them. Resolves
        to the refused positions of the output, with the reason. (``step_id``: the step's
        number on the step trace.)"""
        fut: "Future[Refusals]" = Future()
        self._submit(_traced(lambda: self._accept(req_ids, grammars, output, fut), "accept", step_id))
        return fut

    def wait_filled(self, seq: int) -> None:
        """Block until bitmask ``seq`` is filled (a CPU worker's wait)."""
        with self._filled:
            while int(self._flag_np[0]) < seq:
                self._filled.wait()

    def shutdown(self) -> None:
        """Stop the thread after the jobs queued (each raises its flag)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    # -- jobs -------------------------------------------------------------------------------
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

    def _fill(self, seq: int, grammars: list["RequestGrammarState"], bitmask: "torch.Tensor",
              fut: "Future[None]") -> None:
        """Fill one row per grammar (all ones where nothing constrains: an ended grammar, or
        one that never compiled), then raise the flag, whatever happened (first: the device
        may be waiting for it), then resolve ``fut``."""
        error: Optional[BaseException] = None
        try:
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

    def _accept(self, req_ids: list[str], grammars: list["RequestGrammarState"], output: "Future[Any]",
                fut: "Future[Refusals]") -> None:
        try:
            out = output.result()
        except BaseException as e:  # noqa: BLE001 - the step failed: its requests fail with it
            fut.set_exception(e)
            return
        try:
            fut.set_result(self._advance(req_ids, grammars, out.req_ids, out.sampled_token_ids))
        except BaseException as e:  # noqa: BLE001 - the engine fails the step
            fut.set_exception(e)

    def _advance(self, req_ids: list[str], grammars: list["RequestGrammarState"], out_ids: list[str],
                 tokens: list[int]) -> Refusals:
        """Advance each live grammar by its request's sampled id; the refused positions."""
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
