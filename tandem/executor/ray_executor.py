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
caller that needs it: ``done()`` stays False until ``result()`` is called.)

Failures follow ``RemoteExecutor`` (``executor/base.py``), shared with the multiproc
executor; this module supplies how each is seen:

* an exception inside a worker comes back as a tagged tuple (never a Ray task error), so
  the driver can tell it from the actor dying, and is raised as ``WorkerError`` with the
  worker's own traceback;
* a dead actor (killed, OOM, segfault) surfaces as ``RayActorError`` on its refs, within
  about a second of the death; while idle, ``check_health`` finds it with a ping;
* no answer within ``rpc_timeout_s``: ``WorkerTimeoutError``.

Breaking the executor kills every actor, so none stays blocked in a collective. Ray is
reached through its public API only, and ``ray`` is imported only in this module, so the
engine imports without it.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.executor.base import RemoteExecutor, RemoteFuture
from tandem.types.errors import ErrorPayload, ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError
from tandem.worker.worker_process import MethodTable

logger = logging.getLogger(__name__)

_OK, _ERR = "ok", "err"
_PING_S = 1.0  # how long a health ping may take before the actor counts as busy, not dead


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
            if not MethodTable(type(self.worker)).allowed(method):
                raise AttributeError(f"{method!r} is not a method {type(self.worker).__qualname__} "
                                     "exposes to its driver")
            result = getattr(self.worker, method)(*args, **kwargs)
            if isinstance(result, AsyncModelOutput):
                result = result.get()  # the host copy: the actor answers with plain data
            return _OK, result
        except BaseException as e:
            return _ERR, ErrorPayload.from_exception(e)

    def ping(self) -> bool:
        """Answered in turn after the calls before it: a dead actor fails it at once."""
        return True


_remote_cls: Any = None


def _actor_class() -> Any:
    global _remote_cls
    if _remote_cls is None:
        import ray

        _remote_cls = ray.remote(max_concurrency=1, max_restarts=0,  # type: ignore[call-overload]
                                 max_task_retries=0)(RayWorkerWrapper)
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


class _RayFuture(RemoteFuture):
    """One call's reply: the refs of every rank, resolved once on first ``result()``.

    Without an explicit ``timeout`` it waits at most ``rpc_timeout_s`` and then breaks the
    executor with ``WorkerTimeoutError``; an explicit timeout just raises ``TimeoutError``.
    """

    def __init__(self, executor: "RayExecutor", seq: int, method: str, refs: list) -> None:
        super().__init__(seq, method)
        self._executor = weakref.ref(executor)
        self._refs = refs
        self._lock = threading.Lock()

    def result(self, timeout: Optional[float] = None) -> Any:  # type: ignore[override]
        with self._lock:
            if not self.done():
                ex = self._executor()
                if ex is None:
                    self.settle(exc=ExecutorError("the executor is gone"))
                else:
                    ex._resolve(self, timeout)
        return super().result(0)

    def settle(self, value: Any = None, exc: Optional[BaseException] = None) -> bool:
        """Resolve (first caller wins) and drop the refs: Ray may free the replies."""
        self._refs = []
        return super().settle(value, exc)


class RayExecutor(RemoteExecutor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        import ray

        # Calls not yet answered, to fail them all when the executor breaks; weak, so a
        # future nobody holds any more costs nothing.
        super().__init__(config, pending=weakref.WeakValueDictionary())
        self._ray = ray
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

    # -- start-up ----------------------------------------------------------------------------
    def _start(self, config: EngineConfig, model_config: ModelConfig) -> None:
        """Ray, a placement group, one actor per bundle, then every rank's worker."""
        cuda = model_config.device == "cuda"
        bundle = {"GPU": 1} if cuda else {"CPU": 1}
        self._init_ray()
        self._check_capacity(bundle, model_config.env.ray_wait_for_resources)
        deadline = time.monotonic() + config.worker_start_timeout_s
        self._reserve_placement_group(bundle, deadline)
        self._create_actors(cuda)
        init_method = self._rendezvous_address(deadline) if self.world_size > 1 else None
        self._init_workers(config, model_config, init_method, 0 if cuda else None, deadline)

    def _init_ray(self) -> None:
        """Join the running Ray (or ``RAY_ADDRESS``'s cluster), else start a private one."""
        ray = self._ray
        if ray.is_initialized():
            return
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

    def _check_capacity(self, bundle: dict[str, int], wait_for_resources: bool) -> None:
        """A fixed cluster that can never place the group: say so now rather than after the
        start-up timeout. (An autoscaling cluster may grow: TANDEM_RAY_WAIT_FOR_RESOURCES=1.)"""
        (kind, need), = bundle.items()
        total = self._ray.cluster_resources().get(kind, 0)
        if total < need * self.world_size and not wait_for_resources:
            raise ExecutorError(
                f"the Ray cluster cannot place {self.world_size} bundle(s) of {bundle} for tensor_parallel_size="
                f"{self.world_size}: it has {total:g} {kind} in all")

    def _reserve_placement_group(self, bundle: dict[str, int], deadline: float) -> None:
        from ray.util.placement_group import placement_group

        ray = self._ray
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            pick = ("CPU", "GPU")
            raise ExecutorError(
                f"the Ray cluster cannot place {self.world_size} bundle(s) of {bundle} for tensor_parallel_size="
                f"{self.world_size} within {self.config.worker_start_timeout_s:.0f} s (worker_start_timeout_s); "
                f"cluster resources: { {k: v for k, v in ray.cluster_resources().items() if k in pick} }, "
                f"available: { {k: v for k, v in ray.available_resources().items() if k in pick} }")

    def _create_actors(self, cuda: bool) -> None:
        """Rank ``i``'s actor in bundle ``i`` of the placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = _actor_class()
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=rank)
            opts: dict[str, Any] = dict(scheduling_strategy=strategy)
            opts.update(num_gpus=1, num_cpus=0) if cuda else opts.update(num_cpus=1)
            self._actors.append(cls.options(**opts).remote(num_threads=0 if cuda else 1))

    def _rendezvous_address(self, deadline: float) -> str:
        """Rank 0's node IP and a free port there, for the tensor-parallel group."""
        ip, port = self._get_start(self._actors[0].get_node_ip_and_free_port.remote(), 0, deadline)
        return f"tcp://{ip}:{port}"

    def _init_workers(self, config: EngineConfig, model_config: ModelConfig, init_method: Optional[str],
                      local_rank: Optional[int], deadline: float) -> None:
        """With tensor parallelism construction is a collective: start every rank, then wait;
        the first rank to fail is reported at once."""
        ray = self._ray
        refs = [a.init_worker.remote(config, model_config, rank, init_method, local_rank)
                for rank, a in enumerate(self._actors)]
        ref_rank = {r: i for i, r in enumerate(refs)}
        remaining = list(refs)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(ref_rank[r] for r in remaining)
                raise WorkerTimeoutError(f"worker rank(s) {missing} not ready after "
                                         f"{config.worker_start_timeout_s:.0f} s (worker_start_timeout_s)")
            for r in ready:
                rank = ref_rank[r]
                tag, payload = self._get_start(r, rank, deadline)
                if tag != _OK:
                    raise WorkerError(rank, "start-up", payload)
                self._pids[rank] = payload

    def _get_start(self, ref: Any, rank: int, deadline: float) -> Any:
        ray = self._ray
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise WorkerTimeoutError(f"worker rank {rank} not ready after {self.config.worker_start_timeout_s:.0f} s "
                                     "(worker_start_timeout_s)") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"worker rank {rank} (Ray actor) died while starting: {_short(e)}") from None

    @property
    def worker_pids(self) -> list[Optional[int]]:
        return list(self._pids)

    # -- calls -------------------------------------------------------------------------------
    def _submit(self, seq: int, method: str, args: tuple, kwargs: dict) -> _RayFuture:
        refs = [a.execute_method.remote(method, args, kwargs) for a in self._actors]
        return _RayFuture(self, seq, method, refs)

    def check_health(self) -> None:
        super().check_health()
        for rank, why in self._dead_actors(_PING_S):
            self._fail(self._death(rank, f"is dead ({why})"))
            super().check_health()

    def _dead_actors(self, timeout_s: float) -> list[tuple[int, str]]:
        """Ranks whose actor is known dead, with Ray's reason: a ping each (public API
        only), answered at once by an idle actor and failed at once by a dead one; a busy
        actor that does not answer within ``timeout_s`` is not known dead."""
        ray = self._ray
        pings = [a.ping.remote() for a in self._actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s) if pings else ([], [])
        dead = []
        for rank, ref in enumerate(pings):
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                dead.append((rank, _short(e)))
        return dead

    # -- resolving a call --------------------------------------------------------------------
    def _resolve(self, fut: _RayFuture, timeout: Optional[float]) -> None:
        """Wait for every rank's reply to ``fut`` (called under the future's own lock)."""
        ray = self._ray
        deadline = time.monotonic() + (timeout if timeout is not None else self.rpc_timeout_s)
        ref_rank = {r: i for i, r in enumerate(fut._refs)}
        results: dict[int, Any] = {}
        remaining = list(fut._refs)
        while remaining and not fut.done():
            ready, remaining = ray.wait(remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                if timeout is not None:
                    raise FutureTimeout()
                self._on_timeout(fut, sorted(ref_rank[r] for r in remaining))
                return
            for r in ready:
                if not self._take_reply(fut, ref_rank[r], r, results):
                    return
        if not fut.done():
            self._complete(fut, [results[r] for r in range(self.world_size)])

    def _take_reply(self, fut: _RayFuture, rank: int, ref: Any, results: dict[int, Any]) -> bool:
        """Record rank ``rank``'s reply; False if it failed the call (already handled)."""
        ray = self._ray
        try:
            tag, payload = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._fail(self._death(rank, f"died during {fut.method} (call #{fut.seq}): {_short(e)}"))
            return False
        except Exception as e:  # e.g. the reply could not be deserialized
            self._on_worker_error(fut, rank, ErrorPayload.from_exception(e))
            return False
        if tag != _OK:
            self._on_worker_error(fut, rank, payload)
            return False
        results[rank] = payload
        return True

    def _find_dead_rank(self, fut: RemoteFuture) -> Optional[WorkerDiedError]:
        """A rank whose peer died usually fails in its collective (connection reset) a
        moment before Ray reports the death: look at the call's other replies, then ping."""
        assert isinstance(fut, _RayFuture)
        ray = self._ray
        refs = list(fut._refs)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_PING_S) if refs else ([], [])
        for rank, ref in enumerate(refs):
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return self._death(rank, f"died during {fut.method} (call #{fut.seq}): {_short(e)}")
            except Exception:  # that rank's own error: not a death
                pass
        for rank, why in self._dead_actors(_PING_S):
            return self._death(rank, f"died during {fut.method} (call #{fut.seq}): {why}")
        return None

    # -- failure and shutdown ----------------------------------------------------------------
    def _stop_workers(self) -> None:
        with self._lock:
            if self._killed:
                return
            self._killed = True
        for a in self._actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception as e:  # already gone
                logger.debug("ray.kill: %s", e)

    def _release(self, graceful: bool) -> None:
        """Kill the actors (``graceful``: they left their process group on the shutdown
        call first), free the placement group, and stop Ray if this executor started it."""
        self._stop_workers()
        self._wait_actors_dead(timeout_s=10)
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            except Exception as e:
                logger.debug("remove_placement_group: %s", e)
            self._pg = None
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns_ray = False

    def _wait_actors_dead(self, timeout_s: float) -> None:
        """``ray.kill`` is asynchronous: wait (briefly) until every actor is known dead."""
        deadline = time.monotonic() + timeout_s
        while self._actors and time.monotonic() < deadline:
            if len(self._dead_actors(_PING_S)) == len(self._actors):
                return
            time.sleep(0.05)

    def __del__(self) -> None:  # best effort: no actor outlives a forgotten executor
        try:
            if not self._closed and self._actors:
                self._stop_workers()
        except Exception:
            pass
