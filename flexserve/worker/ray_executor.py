"""The `ray` executor: the ranks (tensor-parallel, of every pipeline stage) as Ray actors, on one
host or across a cluster.

Every rank is a `RankActor` in one placement group (one bundle per rank: a GPU and a CPU on
CUDA, a CPU otherwise), so Ray places the ranks on the cluster's nodes and restarts none of them
behind the engine's back. The ranks join one torch.distributed group (NCCL on CUDA, gloo on CPU)
whose rendezvous is rank 0's node. The engine process connects to the cluster named by
`RAY_ADDRESS` or started on this host with `ray start --head` (a local one when there is none),
sends each plan to every actor (pickled once, `plan_wire`; an actor runs its calls in the order
sent) and takes the driver rank's `StepResult` (`ParallelConfig.driver_rank`). It waits on all
ranks at once: a rank that dies or raises stops the others and fails the step at once, instead
of leaving the engine waiting on a collective that never ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flexserve.config import EngineConfig
from flexserve.distributed.parallel_state import free_port
from flexserve.engine.plan import BatchPlan
from flexserve.model.registry import ResolvedModel
from flexserve.worker.distributed_executor import DistributedExecutor, WorkerDiedError
from flexserve.worker.model_runner import resolve_device
from flexserve.worker.plan_wire import PlanSender, PromptCache
from flexserve.worker.tp_worker import RankCall, WorkerReady, rank_reply

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # how long the cluster gets to find room for every rank


class RankActor:
    """One tensor-parallel rank in a Ray actor (wrapped with `ray.remote` by the executor)."""

    def __init__(self) -> None:
        self.rank = -1
        self.driver = False
        self.runner = None
        self.prompts = PromptCache()  # the plans' prompts (`plan_wire`)

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it, for the group's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port("")

    def start(self, rank: int, world_size: int, init_method: str, config: EngineConfig,
              resolved: ResolvedModel, max_model_len: int, eos_token_id: int | None
              ) -> WorkerReady:
        from flexserve.worker.tp_worker import start_rank, worker_ready

        self.rank = rank
        self.driver = rank == config.parallel.driver_rank  # its results are the engine's
        # Ray shows the actor only its own GPU (CUDA_VISIBLE_DEVICES): it is device 0 here.
        self.runner = start_rank(rank, world_size, init_method, config, resolved, max_model_len,
                                 eos_token_id, local_device=0)
        return worker_ready(self.runner)

    def run(self, payload: bytes) -> Any:
        """Run a plan or a `RankCall` (`PlanSender.encode`d): `run_message`'s reply."""
        from flexserve.worker.tp_worker import run_message

        return run_message(self.runner, self.prompts.decode(payload), self.driver)

    def stop(self) -> None:
        from flexserve.distributed.parallel_state import destroy_tensor_parallel

        destroy_tensor_parallel()


class RayExecutor(DistributedExecutor):
    """Drives one Ray actor per rank (every pipeline stage's tensor-parallel ranks) as one
    executor (`engine.executor`)."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int,
                 tokenizer: Any | None, eos_token_id: int | None) -> None:
        super().__init__(config, resolved, tokenizer, eos_token_id)
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install "
                             "'flexserve[ray]'") from e
        self._ray = ray
        world_size = config.parallel.world_size
        self._driver = config.parallel.driver_rank
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)
        cuda = resolve_device(config.model.device).type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        self._group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        self._actors: list[Any] = []
        self._sender = PlanSender()
        self._error: WorkerDiedError | None = None
        try:
            ready, _ = ray.wait([self._group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(
                    f"the Ray cluster has no room for {world_size} ranks of {bundle} within "
                    f"{PLACEMENT_TIMEOUT_S:g} s (its resources: {ray.cluster_resources()})")
            actor = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0)(RankActor)
            self._actors = [actor.options(
                name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank)).remote()
                for rank in range(world_size)]
            host, port = ray.get(self._actors[0].rendezvous.remote())
            init_method = f"tcp://{host}:{port}"
            self.ready: WorkerReady = self._gather([
                a.start.remote(rank, world_size, init_method, config, resolved, max_model_len,
                               eos_token_id) for rank, a in enumerate(self._actors)])
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d tensor-parallel Ray actors ready (rendezvous %s)", world_size,
                    init_method)

    @property
    def actors(self) -> tuple[Any, ...]:
        """The ranks' actor handles, in rank order."""
        return tuple(self._actors)

    def _submit(self, message: BatchPlan | RankCall) -> Callable[[], Any]:
        if self._error is not None:
            raise self._error
        payload = self._ray.put(self._sender.encode(message))  # once for every actor
        refs = [a.run.remote(payload) for a in self._actors]

        def wait() -> Any:
            self._gather(refs)
            return rank_reply(self._ray.get(refs), self._driver)

        return wait

    def shutdown(self) -> None:
        """Stop the actors and free their placement group; idempotent."""
        ray = self._ray
        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - an actor that is gone already
                pass
        group, self._group = getattr(self, "_group", None), None
        if group is not None:
            try:
                ray.util.remove_placement_group(group)
            except Exception:  # noqa: BLE001 - the cluster is gone already
                pass

    def _gather(self, refs: list[Any]) -> Any:
        """Rank 0's reply once every rank replied; a rank that raised or died stops all of
        them and raises `WorkerDiedError` naming it, without waiting for the others."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"tensor-parallel rank {rank_of[ref]} (Ray actor) died: {e}")
                except ray.exceptions.RayTaskError as e:
                    self._fail(f"tensor-parallel rank {rank_of[ref]} failed:\n{e}")
        return ray.get(refs[0])

    def _fail(self, reason: str) -> None:
        self._error = WorkerDiedError(reason)
        logger.error("%s; stopping the tensor-parallel actors", reason)
        self.shutdown()
        raise self._error
