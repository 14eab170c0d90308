"""Structured outputs in the engine core: compile off the step loop, cache, match, fill bitmasks.

* ``grammar_for(params)`` returns a request's ``RequestGrammarState`` at once. Compilation
  runs in a thread pool; requests with the same constraint share one compilation (and its
  error), kept in a bounded LRU cache of compiled grammars keyed by the constraint. The
  backend itself (tokenizer load, vocabulary tables, importing xgrammar) is built in the
  pool too, on the first constrained request, so neither start-up nor the loop waits for it.
* The scheduler keeps a request in ``WAITING_FOR_GRAMMAR`` until ``is_ready``; other requests
  are scheduled meanwhile. A constraint that fails to compile ends its request with the
  compiler's message, marked as the request's fault.
* Each received token advances the request's matcher (``accept_token``, from the
  scheduler); ``grammar_output`` fills one bitmask row per constrained request of a step.
* ``start_grammar_output`` fills a step's bitmask on a thread of its own (``FILL_THREADS``;
  with more, each fills a share of the rows; the fill runs in the backend's native code,
  without the GIL), and the engine thread goes on with the rest of its step meanwhile;
  ``PendingGrammarOutput.result()`` waits for them. The hand-over is a handshake
  (``FillThreads``): a thread merely woken would wait for the GIL until the engine thread's
  pure-Python work paused, i.e. until it waited for the fill. While a fill runs no other
  call may touch those matchers: the engine samples the step (which waits for the fill)
  before it applies the step's tokens, and ``explain_refusal`` waits for the fill first.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from tandem.sampling_params import StructuredOutputsParams
from tandem.structured_output.backend import (CompiledGrammar, GrammarBackend, GrammarBackendError,
                                              GrammarCompileError, GrammarSpec, Matcher, create_backend)
from tandem.structured_output.buffers import BitmaskBuffers
from tandem.structured_output.gated import GatedFills
from tandem.types.grammar import GrammarOutput
from tandem.types.request import Request, RequestStatus

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class RequestGrammarState:
    """One request's grammar: its compilation (shared) and, once compiled, its own matcher.

    Implements ``tandem.types.grammar.RequestGrammar`` for the scheduler; used on the engine
    thread only (the compilation future is the one thing another thread touches).
    """

    __slots__ = ("_future", "_bitmask_words", "_stop_token_ids", "_wait_fills", "matcher", "terminated", "_error",
                 "error_is_request_fault")

    def __init__(self, future: "Future[CompiledGrammar]", bitmask_words: int, stop_token_ids: frozenset[int],
                 wait_fills: Optional[Callable[[], None]] = None) -> None:
        self._future = future
        self._bitmask_words = bitmask_words
        self._stop_token_ids = stop_token_ids
        # Returns once no background fill (which may read this matcher) is running.
        self._wait_fills = wait_fills or (lambda: None)
        self.matcher: Optional[Matcher] = None
        # The matcher's is_terminated, kept here: it changes only when a stop token is
        # accepted, and the step loop asks for every constrained request at every step.
        self.terminated = False
        self._error: Optional[str] = None
        self.error_is_request_fault = True

    @property
    def future(self) -> "Future[CompiledGrammar]":
        return self._future

    @property
    def is_ready(self) -> bool:
        if self.matcher is not None or self._error is not None:
            return True
        if not self._future.done():
            return False
        try:
            self.matcher = self._future.result().new_matcher()
        except GrammarCompileError as e:
            self._error = str(e)
        except Exception as e:  # the backend could not be built, or a bug: not the request's fault
            self._error = str(e) if isinstance(e, GrammarBackendError) else f"structured outputs failed: " \
                                                                            f"{type(e).__name__}: {e}"
            self.error_is_request_fault = False
        return True

    @property
    def error(self) -> Optional[str]:
        return self._error

    def accept_token(self, token: int) -> bool:
        """Advance by a received token. Once the grammar has ended (it accepted a stop token,
        and ``ignore_eos`` kept the request going) nothing constrains the output any more."""
        assert self.matcher is not None, "a token for a request whose grammar never compiled"
        if self.terminated:
            return True
        ok = self.matcher.accept_token(token)
        if ok and token in self._stop_token_ids:
            self.terminated = self.matcher.is_terminated
        return ok

    def explain_refusal(self, token: int) -> tuple[str, bool]:
        """The masked sampler picks a refused token only when every token the mask allowed
        was banned: none at all (the vocabulary cannot spell what the constraint needs next)
        or only the stop token of a complete answer, which min_tokens forbids. Both are the
        request's fault; anything else would be the engine's."""
        self._wait_fills()  # a background fill may be reading this matcher
        return self.refusal_reason(token)

    def refusal_reason(self, token: int) -> tuple[str, bool]:
        """``explain_refusal`` on the thread that owns the matcher (gated sampling's fill
        thread), which need not wait for a fill."""
        import torch

        assert self.matcher is not None
        row = torch.zeros((1, self._bitmask_words), dtype=torch.int32)
        self.matcher.fill_bitmask(row, 0)
        bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
        allowed = int(bits.sum())
        if allowed == 0:
            return ("structured outputs: no token of the model's vocabulary can continue the output under its "
                    "constraint", True)
        if allowed == sum(int(bits[t]) for t in self._stop_token_ids if t < bits.numel()):
            return ("structured outputs: the output is complete and only the stop token may follow, but min_tokens "
                    "forbids it", True)
        return f"structured outputs: the sampled token {token} is not allowed by the constraint", False


class PendingGrammarOutput:
    """A step's ``GrammarOutput`` whose bitmask may still be filling on the fill threads."""

    __slots__ = ("_output", "_fills")

    def __init__(self, output: GrammarOutput, fills: Sequence["Future[None]"] = ()) -> None:
        self._output = output
        self._fills = fills

    def done(self) -> bool:
        """Whether the bitmask is filled (or a fill failed): ``result`` would not wait."""
        return all(f.done() for f in self._fills)

    def result(self) -> GrammarOutput:
        """The output once its bitmask is filled (re-raises a fill's error, once all ended)."""
        wait_all(self._fills)
        return self._output


def wait_all(futures: Sequence["Future[None]"]) -> None:
    """Wait for every future, then re-raise the first error: none may still be running
    (reading matchers) when the caller goes on."""
    error: Optional[BaseException] = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        raise error


class _Lane:
    """One thread of ``FillThreads`` and its hand-over locks (``go``: a job is there;
    ``taken``: the thread has it)."""

    def __init__(self, name: str) -> None:
        self.go = threading.Lock()
        self.go.acquire()
        self.taken = threading.Lock()
        self.taken.acquire()
        self.job: Optional[tuple[Callable[[], None], "Future[None]"]] = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.go.acquire()
            job, self.job = self.job, None
            self.taken.release()
            if job is None:  # shutdown
                return
            fn, fut = job
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - the waiter re-raises it
                fut.set_exception(e)
            else:
                fut.set_result(None)


class FillThreads:
    """Threads that each run a job (a share of a step's bitmask fill) as soon as it is
    handed over.

    A pool thread woken by ``submit`` needs the GIL before it can run, and the engine
    thread, busy with pure-Python scheduling and bookkeeping, gives it up only every switch
    interval (5 ms) or when it blocks: the fill then started late, often when the engine
    thread came to wait for it. ``submit`` therefore blocks until every thread it handed a
    job to has taken it, which lets them take the GIL at once; each hands the GIL back as
    soon as its job enters native code that releases it (xgrammar's and llguidance's fills
    do), so the jobs may run in parallel. Measured on the CPU machine: the fill starts
    0.06 ms after ``submit`` instead of after the caller's Python work (0.9 ms in that
    test), and ``submit`` costs the caller about 0.09 ms. The threads start on first use."""

    def __init__(self, name: str, num_threads: int = 1) -> None:
        self.name = name
        self.num_threads = num_threads
        self._lanes: list[_Lane] = []
        self._submit_lock = threading.Lock()  # one hand-over at a time
        self._closed = False

    def submit(self, fns: Sequence[Callable[[], None]]) -> list["Future[None]"]:
        """Run ``fns[i]`` on thread ``i`` (at most ``num_threads``); return their futures
        once each has started (after the job before it on its thread)."""
        assert 0 < len(fns) <= self.num_threads, f"{len(fns)} jobs for {self.num_threads} fill threads"
        futs: list["Future[None]"] = [Future() for _ in fns]
        with self._submit_lock:
            if self._closed:
                raise RuntimeError("the fill threads are shut down")
            while len(self._lanes) < len(fns):
                self._lanes.append(_Lane(f"{self.name}-{len(self._lanes)}"))
            lanes = self._lanes[:len(fns)]
            for lane, fn, fut in zip(lanes, fns, futs):
                lane.job = (fn, fut)
                lane.go.release()
            for lane in lanes:
                try:
                    lane.taken.acquire()
                except BaseException:  # a signal's exception: let the hand-over finish first
                    lane.taken.acquire()
                    raise
        return futs

    def shutdown(self) -> None:
        """Stop the threads after the jobs they run, if any (idempotent)."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            for lane in self._lanes:
                lane.job = None
                lane.go.release()
                lane.taken.acquire()
        for lane in self._lanes:
            lane.thread.join()


# Fewer live rows than this are filled on the engine thread: handing the fill over costs
# more than a few rows do.
BACKGROUND_FILL_ROWS = 8
# Background fill threads, each filling a contiguous share of a step's rows (at least
# MIN_ROWS_PER_FILL_THREAD rows a share); ``EngineConfig.structured_outputs_fill_threads``
# sets the count. One by default: a served engine shares the host with its API servers, and
# on one (slow) H100 host 1, 2 and 4 threads served 100% constrained at 42.3k, 37.6k and
# 46.0k tok/s, within the run-to-run noise (``gpu_serve.py --fill-threads``, RESULTS.md):
# there the engine thread's own work, not the fill, bounds the step. On the 2-core CPU
# machine two threads fill 256 rows in 0.87 ms against 1.56 ms on one (the fill releases
# the GIL).
FILL_THREADS = 1
MIN_ROWS_PER_FILL_THREAD = 32


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer: str, vocab_size: int, stop_token_ids: list[int],
                 max_workers: Optional[int] = None, cache_size: int = 256, pin_bitmasks: bool = False,
                 background_fills: bool = True, fill_threads: int = FILL_THREADS) -> None:
        self.backend_name = backend
        self.tokenizer_path = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.bitmask_words = -(-vocab_size // 32)
        self.cache_size = cache_size
        workers = max_workers or max(1, min(4, (os.cpu_count() or 1) // 2))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tandem-grammar")
        self._backend: Optional[GrammarBackend] = None
        self._backend_lock = threading.Lock()
        self._cache: "OrderedDict[GrammarSpec, Future[CompiledGrammar]]" = OrderedDict()
        self.num_compiles = 0  # compilations started (cache misses)
        self._bitmask_bufs = BitmaskBuffers(self.bitmask_words, pin_bitmasks)
        # Page-locked bitmask buffers (a CUDA worker in this process): the worker copies a
        # step's rows to the device straight from them.
        self.pin_bitmasks = pin_bitmasks
        # Threads that fill step bitmasks in the background (``start_grammar_output``), each
        # a share of the rows; the fills of the step in flight, if any.
        self._fill_threads = FillThreads("tandem-fill", fill_threads)
        self._fills: Sequence["Future[None]"] = ()
        # Off (no row count qualifies) for an engine whose model runs on the CPU: there the
        # forward's OpenMP team needs every core, and a fill beside it stalls its parallel
        # regions (host_step.py on the 2-core machine: +0.2-0.9 ms a step with the fill thread).
        self.background_fill_rows = BACKGROUND_FILL_ROWS if background_fills else 1 << 62
        self.min_rows_per_fill_thread = MIN_ROWS_PER_FILL_THREAD
        self.num_background_fills = 0
        self.num_shared_fills = 0  # background fills spread over more than one thread
        # Gated sampling's fill thread (inline on the CPU), made on the first gated step.
        self._background_fills = background_fills
        self._gated: Optional[GatedFills] = None

    # -- compilation -------------------------------------------------------------------------
    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammarState:
        """The grammar state of a new request; its compilation is shared through the cache."""
        spec = GrammarSpec.of(params)
        fut = self._cache.get(spec)
        if fut is None:
            fut = self._pool.submit(self._compile, spec)
            self.num_compiles += 1
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return RequestGrammarState(fut, self.bitmask_words, self.stop_token_ids, self._wait_fills)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self._get_backend().compile(spec)

    def _get_backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from tandem.tokenizer import load_tokenizer

                try:
                    self._backend = create_backend(self.backend_name, load_tokenizer(self.tokenizer_path),
                                                   self.vocab_size, sorted(self.stop_token_ids))
                except Exception as e:
                    raise GrammarBackendError(f"the {self.backend_name} structured outputs backend could not start "
                                              f"for this model: {type(e).__name__}: {' '.join(str(e).split())}") \
                        from e
                logger.info("structured outputs: %s backend ready", self.backend_name)
            return self._backend

    @staticmethod
    def wait_for_any(grammars: Iterable[RequestGrammarState], timeout_s: Optional[float]) -> None:
        """Block until one of ``grammars`` has compiled (or ``timeout_s`` passed; None: no
        limit): what the engine does when nothing else can run, instead of spinning."""
        futures = {g.future for g in grammars}
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # -- matching ----------------------------------------------------------------------------
    def accept_tokens(self, grammars: list[RequestGrammarState], tokens: list[int]) -> list[bool]:
        """Advance each request's grammar by its received token (``accept_token``, for a
        step's batch at once: the backend may take it in one call); False where refused.
        (Hot: every step of a constrained batch; the common case, nothing refused and no
        stop token, runs no per-request Python after the list comprehensions.)"""
        ok = [True] * len(grammars)
        live = [g for g in grammars if not g.terminated]
        if not live:
            return ok
        if len(live) == len(grammars):
            where: range | list[int] = range(len(grammars))
            toks = tokens
        else:
            where = [i for i, g in enumerate(grammars) if not g.terminated]
            toks = [tokens[i] for i in where]
        matchers = [g.matcher for g in live]
        assert None not in matchers, "a token for a request whose grammar never compiled"
        assert self._backend is not None  # a matcher exists, so its backend does
        accepted = self._backend.accept_tokens(matchers, toks)  # type: ignore[arg-type]
        stop = self.stop_token_ids
        if False not in accepted and stop.isdisjoint(toks):
            return ok
        for i, g, acc, tok in zip(where, live, accepted, toks):
            if not acc:
                ok[i] = False
            elif tok in stop:
                g.terminated = g.matcher.is_terminated  # type: ignore[union-attr]
        return ok

    # -- bitmasks ----------------------------------------------------------------------------
    def grammar_output(self, step_id: int, req_ids: list[str], requests: list[Request],
                       num_drafts: Optional[list[int]] = None) -> GrammarOutput:
        """The bitmask of a step's constrained requests (``SchedulerOutput.grammar_req_ids``),
        each matcher having accepted every token its request received. A request that has
        finished meanwhile (its token in this step will be dropped) or whose grammar has
        ended gets no row (unconstrained). ``num_drafts``: requests verifying drafts (speculative
        decoding) get a row per position, see ``_draft_output``."""
        if num_drafts is not None and any(num_drafts):
            return self._draft_output(step_id, req_ids, requests, num_drafts)
        return self.start_grammar_output(step_id, req_ids, requests, background=False).result()

    def start_grammar_output(self, step_id: int, req_ids: list[str], requests: list[Request],
                             background: bool = True) -> PendingGrammarOutput:
        """``grammar_output`` (without drafts) whose fill runs on the fill thread when the
        step has ``background_fill_rows`` live rows or more (and ``background``): the caller
        goes on, and must not touch these requests' matchers before ``result()``."""
        # Only the rows that constrain anything travel: a request that finished meanwhile or
        # whose grammar has ended is left out, i.e. unconstrained (the worker masks listed
        # rows only). Every listed row is filled whole, so the buffer needs no initial value.
        live_ids, matchers = [], []
        finished = RequestStatus.FINISHED_STOPPED
        for rid, req in zip(req_ids, requests):  # (hot: 256 requests cost 21 us here, 58 with req.is_finished)
            g = req.grammar
            if req.status < finished and type(g) is RequestGrammarState and not g.terminated:
                m = g.matcher
                if m is not None:
                    live_ids.append(rid)
                    matchers.append(m)
        bitmask = self._bitmask_buffer(len(matchers))
        out = GrammarOutput(step_id, live_ids, bitmask)
        if not matchers:
            return PendingGrammarOutput(out)
        backend = self._backend
        assert backend is not None  # a matcher exists, so its backend does
        n = len(matchers)
        if not background or n < self.background_fill_rows:
            backend.fill_bitmasks(matchers, bitmask, list(range(n)))
            return PendingGrammarOutput(out)
        self.num_background_fills += 1
        # Contiguous shares of the rows, one per thread (each a native call of its own).
        shares = max(1, min(self._fill_threads.num_threads, n // self.min_rows_per_fill_thread))
        self.num_shared_fills += shares > 1
        bounds = [n * i // shares for i in range(shares + 1)]
        self._wait_fills()  # the previous step's: sampled before this one started, so done
        self._fills = self._fill_threads.submit(
            [partial(backend.fill_bitmasks, matchers[a:b], bitmask, list(range(a, b)))
             for a, b in zip(bounds, bounds[1:])])
        return PendingGrammarOutput(out, self._fills)

    # -- gated sampling (see tandem.structured_output.gated) ------------------------------------
    @property
    def gated(self) -> GatedFills:
        if self._gated is None:
            self._gated = GatedFills(self.bitmask_words, self.stop_token_ids, self._background_fills,
                                     self.pin_bitmasks, lambda: self._backend)
        return self._gated

    def set_gated_background(self, on: bool) -> None:
        """Run gated sampling's jobs on its thread (``on``) or inline from the next step on
        (tests run the thread on the CPU, where the engine runs them inline)."""
        if self._gated is not None:
            self._gated.shutdown()
            self._gated = None
        self._background_fills = on

    def set_fill_threads(self, threads: FillThreads) -> None:
        """Fill in the background on ``threads`` from now on (tests and benchmarks compare counts)."""
        self._wait_fills()
        self._fill_threads.shutdown()
        self._fill_threads = threads

    def _wait_fills(self) -> None:
        """Return once no background fill runs (errors are the step's, not the caller's)."""
        if self._fills:
            wait(self._fills)
            self._fills = ()

    def _bitmask_buffer(self, rows: int) -> "torch.Tensor":
        """``[rows, words]`` int32, from one of two buffers used in turn and kept (a fresh
        tensor a step would be fresh pages to fault in). A step's bitmask is read by its
        ``sample_tokens`` call (copied, serialized to the workers, or, pinned, copied to the
        device on the stream after the step's forward). The buffer comes round again for
        the fill two steps later, which starts only once the step in between has returned
        its tokens: its sampling, queued after that copy, has run, so the copy is done."""
        return self._bitmask_bufs.next(rows)

    def _draft_output(self, step_id: int, req_ids: list[str], requests: list[Request],
                      num_drafts: list[int]) -> GrammarOutput:
        """Rows ``1 + k`` per request: the mask after its received tokens, then after each
        of its drafts (``Request.spec_drafts``, from the worker) that the grammar accepts;
        drafts it refuses, and all after them, are cut."""
        import torch

        rows = [1 + k for k in num_drafts]
        bitmask = torch.full((sum(rows), self.bitmask_words), -1, dtype=torch.int32)
        valid = [0] * len(requests)
        first = 0
        for i, req in enumerate(requests):
            g = req.grammar
            if (not req.is_finished and isinstance(g, RequestGrammarState) and g.matcher is not None
                    and not g.terminated):
                drafts = (req.spec_drafts or [])[:num_drafts[i]]
                valid[i] = g.matcher.draft_masks(drafts, bitmask, first)
            first += rows[i]
        return GrammarOutput(step_id, req_ids, bitmask, rows, valid)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_threads.shutdown()
        if self._gated is not None:
            self._gated.shutdown()
