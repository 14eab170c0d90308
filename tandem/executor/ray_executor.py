"""One Ray actor per tensor-parallel rank, for serving across machines.

The driver (the engine process) either starts a private local Ray instance (when none is
running and ``RAY_ADDRESS`` is unset) or joins the cluster ``RAY_ADDRESS`` names (``ray start
--head`` on one machine, ``ray start --address=...`` on the others). It reserves one bundle
per rank in a placement group (``{"GPU": 1}`` on CUDA, ``{"CPU": 1}`` on the CPU, packed)
and places rank ``i``'s actor in bundle ``i``. Rank 0's actor picks the rendezvous address
(its node's IP and a free port) for the tensor-parallel group.

Every call goes to every rank. Actors run with ``max_concurrency=1``, so each executes its
calls one by one in submission order, and every call has exactly one reply (an object ref)
per rank. ``execute_model`` returns at once with a future over the step's refs; its
``result()`` waits on them with ``ray.wait`` (no polling), resolves exactly once, and
returns rank 0's output. (Like the uniproc executor's, the future is resolved by the
caller that needs it: ``done()`` stays False until ``result()`` is called.) Error semantics
follow the multiproc executor:

* an exception inside a worker comes back (as a tagged tuple, never a Ray task error) and
  is raised as ``WorkerError`` with the worker's own traceback. With one rank the worker
  stays usable; with tensor parallelism its peers are stuck in a collective, so the
  executor breaks at once (from the first rank that raised) instead of timing out;
* a dead actor (killed, OOM, segfault) surfaces as ``RayActorError`` on its refs, within
  about a second of the death: ``WorkerDiedError`` naming the rank;
* no answer within ``rpc_timeout_s``: ``WorkerTimeoutError``.

The last two (and the TP error) break the executor for good: every pending call fails with
the same error, later calls fail fast (``execute_model`` returns an already-failed future,
so the engine fails those requests), and every actor is killed so none stays blocked in a
collective. ``ray`` is imported only in this module, so the engine imports without it.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.executor.base import RemoteExecutor
from tandem.types.errors import ErrorPayload, ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError

logger = logging.getLogger(__name__)

_OK, _ERR = "ok", "err"




class RayWorkerWrapper:
    """The body of each rank's actor (wrapped with ``ray.remote`` by the executor).

    Every method answers ``(tag, payload)``: ``("ok", result)`` or ``("err", (exc_type,
    message, traceback_text))``, so a worker exception travels as data and the driver can
    tell it apart from the actor dying.
    """

    def __init__(self, num_threads: int = 0) -> None:
        import torch

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.worker: Any = None
        self.rank: Optional[int] = None

    def get_node_ip_and_free_port(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def init_worker(self, config: EngineConfig, model_config: ModelConfig, rank: int,
                    distributed_init_method: Optional[str], local_rank: Optional[int]) -> tuple[str, Any]:
        try:
            from tandem.worker.worker import resolve_worker_class

            self.rank = rank
            logging.getLogger("tandem").setLevel(model_config.env.log_level)
            self.worker = resolve_worker_class(config.worker_cls)(
                config, model_config, rank=rank,
                distributed_init_method=distributed_init_method, local_rank=local_rank)
            return _OK, os.getpid()
        except BaseException as e:
            return _ERR, ErrorPayload.from_exception(e)

    def execute_method(self, method: str, args: tuple, kwargs: dict) -> tuple[str, Any]:
        from tandem.worker.async_output import AsyncModelOutput

        try:
            result = getattr(self.worker, method)(*args, **kwargs)
            if isinstance(result, AsyncModelOutput):
                result = result.get()  # the host copy: the actor answers with plain data
            return _OK, result
        except BaseException as e:
            return _ERR, ErrorPayload.from_exception(e)


_remote_cls: Any = None


def _actor_class() -> Any:
    global _remote_cls
    if _remote_cls is None:
        import ray

        _remote_cls = ray.remote(max_concurrency=1, max_restarts=0, max_task_retries=0)(RayWorkerWrapper)
    return _remote_cls


def _short(exc: BaseException, limit: int = 400) -> str:
    """Ray's actor-death text, cut to what says why (exit type and detail), one line."""
    text = " ".join(str(exc).split())
    i = text.find("Worker exit type:")
    if i >= 0:
        text = text[i:]
        j = text.find(" Some common causes")
        text = text[:j] if j >= 0 else text
    return text if len(text) <= limit else text[:limit] + " ..."


class _RayFuture(Future):
    """One call's reply: the refs of every rank, resolved once on first ``result()``.

    Without an explicit ``timeout`` it waits at most ``rpc_timeout_s`` and then breaks the
    executor with ``WorkerTimeoutError``; an explicit timeout just raises ``TimeoutError``.
    """

    def __init__(self, executor: "RayExecutor", seq: int, method: str, refs: list) -> None:
        super().__init__()
        self._executor = weakref.ref(executor)
        self.seq = seq
        self.method = method
        self._refs = refs
        self._lock = threading.Lock()
        self.all_results: Optional[list[Any]] = None

    def result(self, timeout: Optional[float] = None) -> Any:  # type: ignore[override]
        with self._lock:
            if not self.done():
                ex = self._executor()
                if ex is None:
                    self._settle(exc=ExecutorError("the executor is gone"))
                else:
                    ex._resolve(self, timeout)
        return super().result(0)

    def _settle(self, value: Any = None, exc: Optional[BaseException] = None) -> None:
        """Set the outcome unless someone (a failure elsewhere) already did; the caller
        holds the executor's lock. The refs are dropped: Ray may free the replies."""
        if not self.done():
            self._refs = []
            if exc is not None:
                self.set_exception(exc)
            else:
                self.set_result(value)


class RayExecutor(RemoteExecutor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        import ray

        self._ray = ray
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.rpc_timeout_s = config.rpc_timeout_s
        self._lock = threading.Lock()
        # Calls not yet answered, to fail them all when the executor breaks; weak, so a
        # future nobody holds any more costs nothing.
        self._pending: "weakref.WeakValueDictionary[int, _RayFuture]" = weakref.WeakValueDictionary()
        self._next_seq = 0
        self._failure: Optional[ExecutorError] = None
        self._closed = False
        self._actors: list[Any] = []
        self._pids: list[Optional[int]] = [None] * self.world_size
        self._pg: Any = None
        self._owns_ray = False
        self._killed = False
        try:
            self._start(config, model_config)
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d actor(s), pids %s", self.world_size, self._pids)

    # -- start-up ----------------------------------------------------------------------
    def _start(self, config: EngineConfig, model_config: ModelConfig) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            else:
                # Actors must import tandem (and worker_cls): hand them our import path.
                root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
                ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                         runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}})
            self._owns_ray = True
        cuda = model_config.device == "cuda"
        bundle = {"GPU": 1} if cuda else {"CPU": 1}
        (kind, need), = bundle.items()
        total = ray.cluster_resources().get(kind, 0)
        if total < need * self.world_size and not model_config.env.ray_wait_for_resources:
            # A fixed cluster can never place it: say so now rather than after the start-up
            # timeout. (An autoscaling cluster may grow: set TANDEM_RAY_WAIT_FOR_RESOURCES=1.)
            raise ExecutorError(
                f"the Ray cluster cannot place {self.world_size} bundle(s) of {bundle} for tensor_parallel_size="
                f"{self.world_size}: it has {total:g} {kind} in all")
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        timeout_s = config.worker_start_timeout_s
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout_s)
        if not ready:
            have = ray.cluster_resources()
            raise ExecutorError(
                f"the Ray cluster cannot place {self.world_size} bundle(s) of {bundle} for tensor_parallel_size="
                f"{self.world_size} within {timeout_s:.0f} s (worker_start_timeout_s); cluster resources: "
                f"{ {k: v for k, v in have.items() if k in ('CPU', 'GPU')} }, available: "
                f"{ {k: v for k, v in ray.available_resources().items() if k in ('CPU', 'GPU')} }")
        cls = _actor_class()
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                        placement_group_bundle_index=rank)
            opts: dict[str, Any] = dict(scheduling_strategy=strategy)
            opts.update(num_gpus=1, num_cpus=0) if cuda else opts.update(num_cpus=1)
            self._actors.append(cls.options(**opts).remote(num_threads=0 if cuda else int(bundle["CPU"])))
        deadline = time.monotonic() + timeout_s
        init_method = None
        if self.world_size > 1:
            ip, port = self._get_start(self._actors[0].get_node_ip_and_free_port.remote(), 0, "start-up", deadline)
            init_method = f"tcp://{ip}:{port}"
        # With tensor parallelism construction is a collective: start every rank, then wait.
        refs = [a.init_worker.remote(config, model_config, rank, init_method, 0 if cuda else None)
                for rank, a in enumerate(self._actors)]
        ref_rank = {r: i for i, r in enumerate(refs)}
        remaining = list(refs)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(ref_rank[r] for r in remaining)
                raise WorkerTimeoutError(f"worker rank(s) {missing} not ready after {timeout_s:.0f} s "
                                         "(worker_start_timeout_s)")
            for r in ready:
                rank = ref_rank[r]
                tag, payload = self._get_start(r, rank, "start-up", deadline)
                if tag != _OK:
                    raise WorkerError(rank, "start-up", payload)
                self._pids[rank] = payload

    def _get_start(self, ref: Any, rank: int, what: str, deadline: float) -> Any:
        ray = self._ray
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise WorkerTimeoutError(f"worker rank {rank} not ready after {self.config.worker_start_timeout_s:.0f} s "
                                     "(worker_start_timeout_s)") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"worker rank {rank} (Ray actor) died while starting: {_short(e)}") from None

    # -- calls -------------------------------------------------------------------------
    def _call(self, method: str, args: tuple, kwargs: dict) -> _RayFuture:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise ExecutorError("the executor is shut down")
            seq = self._next_seq
            self._next_seq += 1
            refs = [a.execute_method.remote(method, args, kwargs) for a in self._actors]
            fut = _RayFuture(self, seq, method, refs)
            self._pending[seq] = fut
        return fut

    def check_health(self) -> None:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise ExecutorError("the executor is shut down")
        for rank, actor in enumerate(self._actors):
            dead, why = self._actor_dead(actor)
            if dead:
                self._fail(WorkerDiedError(f"worker rank {rank} (pid {self._pids[rank]}) is dead{why}; "
                                           "the executor cannot run more steps"))
                raise self._failure  # type: ignore[misc]

    def _actor_dead(self, actor: Any) -> tuple[bool, str]:
        """Ask Ray's control store (GCS) whether the actor is dead: answers at once, even
        while the actor is busy running a step."""
        try:
            from ray._private import state

            info = state.actors(actor._actor_id.hex())
        except Exception as e:  # private API moved: fall back to a ping with a short deadline
            logger.debug("actor state lookup failed (%s); pinging instead", e)
            try:
                self._ray.get(actor.__ray_ready__.remote(), timeout=5)
                return False, ""
            except self._ray.exceptions.RayActorError as err:
                return True, f" ({_short(err)})"
            except self._ray.exceptions.GetTimeoutError:
                return False, ""  # busy, not known dead
        if not info or info.get("State") != "DEAD":
            return False, ""
        cause = " ".join(str(info.get("DeathCause", "")).split())
        return True, f" ({cause[:400]})" if cause else ""

    @property
    def worker_pids(self) -> list[Optional[int]]:
        return list(self._pids)

    # -- resolving a call --------------------------------------------------------------
    def _resolve(self, fut: _RayFuture, timeout: Optional[float]) -> None:
        """Wait for every rank's reply to ``fut`` (called under the future's own lock)."""
        ray = self._ray
        limit = timeout if timeout is not None else self.rpc_timeout_s
        deadline = time.monotonic() + limit
        ref_rank = {r: i for i, r in enumerate(fut._refs)}
        results: dict[int, Any] = {}
        remaining = list(fut._refs)
        while remaining and not fut.done():
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                if timeout is not None:
                    raise FutureTimeout()
                missing = sorted(ref_rank[r] for r in remaining)
                self._fail(WorkerTimeoutError(
                    f"worker rank(s) {missing} did not answer {fut.method} (call #{fut.seq}) within "
                    f"{self.rpc_timeout_s:g} s (rpc_timeout_s); treating them as hung"))
                return
            for r in ready:
                rank = ref_rank[r]
                try:
                    tag, payload = ray.get(r)
                except ray.exceptions.RayActorError as e:
                    self._fail(WorkerDiedError(
                        f"worker rank {rank} (pid {self._pids[rank]}) died during {fut.method} (call #{fut.seq}); "
                        f"the executor cannot run more steps: {_short(e)}"))
                    return
                except Exception as e:  # e.g. the reply could not be deserialized
                    err = WorkerError(rank, fut.method, ErrorPayload.from_exception(e))
                    self._on_worker_error(fut, rank, err, f"{type(e).__name__}: {e}")
                    return
                if tag != _OK:
                    if self.world_size > 1 and self._peer_died(fut, remaining, ref_rank):
                        return  # a peer's death made this rank's collective fail: report the death
                    err = WorkerError(rank, fut.method, payload)
                    self._on_worker_error(fut, rank, err, f"{payload.exc_type}: {payload.message}")
                    return
                results[rank] = payload
        if fut.done():
            return
        with self._lock:
            self._pending.pop(fut.seq, None)
            fut.all_results = [results[r] for r in range(self.world_size)]
            fut._settle(results[0])

    def _peer_died(self, fut: _RayFuture, remaining: list, ref_rank: dict) -> bool:
        """With TP, a rank whose peer died usually fails in its collective (connection
        reset) a moment before Ray reports the death: look briefly for a dead peer."""
        ray = self._ray
        ready, _ = ray.wait(remaining, num_returns=len(remaining), timeout=1.0) if remaining else ([], [])
        for r in ready:
            try:
                ray.get(r)
            except ray.exceptions.RayActorError as e:
                rank = ref_rank[r]
                self._fail(WorkerDiedError(
                    f"worker rank {rank} (pid {self._pids[rank]}) died during {fut.method} (call #{fut.seq}); "
                    f"the executor cannot run more steps: {_short(e)}"))
                return True
            except Exception:
                pass
        for rank, actor in enumerate(self._actors):
            dead, why = self._actor_dead(actor)
            if dead:
                self._fail(WorkerDiedError(f"worker rank {rank} (pid {self._pids[rank]}) died during {fut.method} "
                                           f"(call #{fut.seq}){why}; the executor cannot run more steps"))
                return True
        return False

    def _on_worker_error(self, fut: _RayFuture, rank: int, err: WorkerError, summary: str) -> None:
        with self._lock:
            self._pending.pop(fut.seq, None)
            fut._settle(exc=err)
        if self.world_size > 1:
            self._fail(ExecutorError(f"tensor-parallel rank {rank} failed in {fut.method}; its peers are out "
                                     f"of step, so the executor stops: {summary}"))

    # -- failure -----------------------------------------------------------------------
    def _fail(self, err: ExecutorError) -> None:
        """Break the executor: fail every pending call with ``err`` and kill the actors."""
        with self._lock:
            if self._failure is None:
                self._failure = err
                logger.error("%s", err)
            err = self._failure
            pending, self._pending = list(self._pending.values()), weakref.WeakValueDictionary()
            for f in pending:
                f._settle(exc=err)
        self._kill_actors()

    def _kill_actors(self) -> None:
        with self._lock:
            if self._killed:
                return
            self._killed = True
        for a in self._actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception as e:  # already gone
                logger.debug("ray.kill: %s", e)

    # -- shutdown ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Let workers leave their process group, kill the actors, free the placement
        group, and stop Ray if this executor started it. Idempotent."""
        if self._closed:
            return
        graceful = self._failure is None and self._actors and all(p is not None for p in self._pids)
        if graceful:
            try:
                fut = self._call("shutdown", (), {})
                fut.result(timeout=10)
            except Exception as e:  # a worker that cannot say goodbye is killed below
                logger.warning("workers did not acknowledge shutdown: %s", e)
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending.values()), weakref.WeakValueDictionary()
            for f in pending:
                f._settle(exc=ExecutorError("the executor was shut down"))
        ray = self._ray
        self._kill_actors()
        self._wait_actors_dead(timeout_s=10)
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            except Exception as e:
                logger.debug("remove_placement_group: %s", e)
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    def _wait_actors_dead(self, timeout_s: float) -> None:
        """``ray.kill`` is asynchronous: wait (briefly) until Ray reports each actor dead."""
        deadline = time.monotonic() + timeout_s
        for a in self._actors:
            while time.monotonic() < deadline:
                try:
                    dead, _ = self._actor_dead(a)
                except Exception:
                    return
                if dead:
                    break
                time.sleep(0.05)

    def __del__(self) -> None:  # best effort: no actor outlives a forgotten executor
        try:
            if not self._closed and self._actors:
                self._kill_actors()
        except Exception:
            pass
