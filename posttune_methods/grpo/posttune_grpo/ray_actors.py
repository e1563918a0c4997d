"""GRPO's ``generation: ray``: rollouts made by Ray actors while the learner ranks train.

    learner rank r (posttune train; N ranks: FSDP2/TP)     Ray: rank r's own actors
      hands out prompt batches, FIFO  ──────────────────▶   engine actor: generate  ──▶  reward actor: score
      trains on the oldest handed out  ◀──────────────────  Rollouts (weight version, behaviour log-probs)
      every sync_every steps: weights  ─ ObjectRef ─────▶   an engine behind the version loads them first

**The three modes are one rule.** A batch handed out now, at queue position ``q``, will first be
trained by the update of weight version ``step + q * steps_per_batch``; it is generated with the
newest pushed version ``v``. It is handed out only if that gap is at most the bound ``k``
(``max_staleness``: 0 for ``mode: sync`` -- strict alternation, every batch of the current weights;
at most 1 for ``async`` -- the next batch generates while this one trains; ``k`` for
``off_policy``) and the queue holds fewer than ``queue_size``. Batches are trained in the order
handed out, so the bound holds for every batch (checked, not assumed), the prompt stream keeps its
order, and every learner rank takes the same steps. Nothing is dropped for staleness.

**The ratio.** On arrival the learner scores the batch with its own weights (``old_logps``: the
policy the batch's first update starts from, as sync mode does for ``num_iterations > 1``), and
the reference too when ``beta > 0``. The clip is against ``old_logps``; each token's surrogate is
weighted by the truncated importance weight ``min(pi_old / pi_behaviour, tis_cap)`` against the
engine's log-probs (verl's and AReaL's decoupled correction: the clip bounds the step, the weight
corrects for the stale or different sampler).

**Resume.** The method's checkpoint state holds every batch handed out and not yet trained on, in
order: its prompts, and its rollouts (with their version) if they had arrived. A resumed run
trains on those first, generating the missing ones again with the checkpoint's weights, then
continues the prompt stream: no prompt is lost or trained twice. A checkpoint taken after the hand-outs
drew the epoch's last batch has the loader already at the next epoch: that epoch begins after the
restored batches, as it would have (``epoch_handed_out``).

**Faults.** Actors are restarted by Ray (``max_restarts=-1``); a batch whose engine or reward actor
died is handed out again at its place in the queue (``dropped_rollouts``, ``actor_restarts``).
A learner rank that dies ends the job through torchrun; the actors, owned by the learner
processes, die with them. The method's close stops every actor and a Ray cluster this run started.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from posttune.plugin import ConfigError, PosttuneError, RunConfig, Session, plain_state_dict

from posttune_grpo.rollouts import Rollouts, micro_batches_per_generation
from posttune_grpo.state import count_rollouts

CLOSE_TIMEOUT_S = 10.0  # for the actors to close their engines and reward workers before they are killed


def staleness_bound(method: Any) -> int:
    from posttune_grpo import DEFAULT_STALENESS

    chosen = method.ray_options.max_staleness
    return DEFAULT_STALENESS[method.mode] if chosen is None else chosen


def validate(config: RunConfig, method: Any) -> None:
    options = method.ray_options
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # not imported: a learner rank must not read Ray's settings yet
        raise ConfigError("method.generation", "generation in Ray actors needs Ray: pip install "
                                               "'posttune-grpo[ray]'")
    for name in ("actors", "scorers", "sync_every", "queue_size", "threads_per_actor"):
        if getattr(options, name) < 1:
            raise ConfigError(f"method.ray_options.{name}", f"expected a positive integer, got "
                                                            f"{getattr(options, name)}")
    bound = staleness_bound(method)
    if bound < 0:
        raise ConfigError("method.ray_options.max_staleness", f"expected an integer >= 0, got {bound}")
    if method.mode == "sync" and bound != 0:
        raise ConfigError("method.ray_options.max_staleness", "mode sync trains only on rollouts of the current "
                                                              f"weights (0), got {bound}; use mode async or off_policy")
    if method.mode == "async" and bound > 1:
        raise ConfigError("method.ray_options.max_staleness", f"mode async overlaps one batch (at most 1), got "
                                                              f"{bound}; use mode off_policy for a longer lag")
    if options.sync_every - 1 > bound:
        raise ConfigError("method.ray_options.sync_every", f"weights pushed every {options.sync_every} steps lag "
                                                           f"up to {options.sync_every - 1} versions, more than "
                                                           f"max_staleness {bound}; use at most {bound + 1}")
    if options.gpus_per_actor < 0:
        raise ConfigError("method.ray_options.gpus_per_actor", f"expected a number >= 0, got "
                                                               f"{options.gpus_per_actor}")


def start(session: Session) -> RaySource:
    """The source, with no actor yet: they start on the first rollouts, with the (resumed) weights then."""
    method = session.method_config
    steps = micro_batches_per_generation(session) // session.config.train.grad_accum_steps
    return RaySource(method.ray_options, staleness_bound(method), steps)


# ---- the learner's side --------------------------------------------------------------------------

@dataclass
class Handout:
    """A prompt batch handed to the actors and not yet trained on (the queue's entry)."""

    prompts: dict[str, Any]  # as plain lists (``portable``)
    epoch: int
    scored: Any = None  # ObjectRef of the reward actor's result (on the engine actor's, which Ray keeps alive)
    result: dict[str, Any] | None = None  # once arrived (or restored from a checkpoint)


@dataclass
class RaySource:
    """The queue of handed-out batches, the actors, and what the step records say about them."""

    options: Any  # RayOptions
    bound: int  # max_staleness
    steps_per_batch: int  # optimizer steps each generation batch trains
    pool: ActorPool | None = None
    queue: deque[Handout] = field(default_factory=deque)
    restored: list[Handout] = field(default_factory=list)  # from a checkpoint, handed out first
    wait_s: float = 0.0  # the learner's wait for rollouts since the last step
    ready_when_asked: int = 0  # arrived batches in the queue when the learner last asked
    depth_when_asked: int = 0  # batches in the queue when the learner last asked
    engine_idle_s: float = 0.0  # the engines' idle time before the batches trained this step
    staleness: list[int] = field(default_factory=list)  # of each batch begun this step
    rows: list[int] = field(default_factory=list)  # dataset rows of the prompts begun this step

    def rollouts(self, session: Any) -> Iterator[Rollouts]:
        """One epoch: batches handed out as the bound allows, trained in order as they arrive."""
        if self.pool is None:
            self.pool = start_pool(session)
        restored = [h for h in self.restored if h.epoch == session.epoch]
        self.restored = [h for h in self.restored if h.epoch != session.epoch]
        prompts, exhausted = iter(session.train_data), epoch_handed_out(session)
        while True:
            while len(self.queue) < self.options.queue_size and self._may_hand_out(session):
                if restored:
                    handout = restored.pop(0)
                else:
                    batch = None if exhausted else next(prompts, None)
                    if batch is None:
                        exhausted = True
                        break
                    handout = Handout(portable(batch), session.epoch)
                if handout.result is None:
                    self.pool.submit(handout)
                self.queue.append(handout)
            if not self.queue:
                return
            self.depth_when_asked = len(self.queue)
            self.ready_when_asked = self.pool.ready(self.queue)
            started = time.perf_counter()
            result = self.pool.result(self.queue[0])
            self.wait_s += time.perf_counter() - started
            self.queue.popleft()
            yield self._arrived(session, result)

    def _may_hand_out(self, session: Any) -> bool:
        """Would a batch handed out now, at the queue's end, be at most ``bound`` versions stale when trained?"""
        first_update = session.step + len(self.queue) * self.steps_per_batch
        return first_update - self.pool.version <= self.bound

    def _arrived(self, session: Any, result: dict[str, Any]) -> Rollouts:
        """The learner's part: check the staleness, take pi_old (and the reference's) log-probs, the TIS weights."""
        from posttune_grpo.in_process import add_learner_logps

        rollouts = Rollouts.from_state(result["rollouts"])
        version = int(rollouts.versions.min())
        staleness = session.step - version
        if staleness > self.bound:  # the hand-out rule makes this impossible: a bug, not a run to go on with
            raise PosttuneError(f"generation: ray: a batch of version {version} arrived for step {session.step + 1}, "
                                f"{staleness} versions stale, over max_staleness {self.bound}")
        self.staleness.append(staleness)
        self.rows.extend(int(row) for row in rollouts.rows.unique().tolist() if row >= 0)
        self.engine_idle_s += float(result.get("engine_idle_s", 0.0))
        add_learner_logps(session, rollouts, old=True, tis=True)
        count_rollouts(session.method_state, rollouts)
        return rollouts

    def waited_s(self, session: Any) -> float:
        """The learner's time since the last step spent not training: waiting for rollouts."""
        return self.wait_s

    def after_step(self, session: Any, record: dict[str, Any]) -> None:
        """Push the weights every ``sync_every`` steps; log versions, staleness, the queue and the waits."""
        if self.pool is None:
            return
        if session.step % self.options.sync_every == 0:
            self.pool.push(plain_state_dict(session.model), session.step)
        if self.staleness:
            record["staleness_max"] = max(self.staleness)
            for value in sorted(set(self.staleness)):
                record[f"staleness/{value}"] = self.staleness.count(value)
            record["prompt_rows"] = sorted(all_ranks(session, self.rows))
        record["policy_version"] = self.pool.version
        record["rollout_wait_s"] = self.wait_s
        record["rollouts_ready"] = self.ready_when_asked
        record["buffer_depth"] = self.depth_when_asked
        record["engine_idle_s"] = self.engine_idle_s
        record["dropped_rollouts"] = self.pool.dropped
        record["actor_restarts"] = self.pool.dropped  # an actor death is noticed through the batch it lost
        self.staleness, self.rows, self.wait_s, self.engine_idle_s = [], [], 0.0, 0.0

    def state_dict(self) -> list[dict[str, Any]]:
        """Every batch handed out and not yet trained on, in order: prompts, and rollouts if arrived."""
        saved = []
        for handout in [*self.queue, *self.restored]:
            if handout.result is None and self.pool is not None and self.pool.ready([handout]):
                try:
                    handout.result = self.pool.result(handout)
                except PosttuneError:
                    raise
                except Exception:  # noqa: BLE001 - a lost result is generated again after the resume
                    handout.result = None
            saved.append({"prompts": handout.prompts, "epoch": handout.epoch, "result": handout.result})
        return saved

    def load_state_dict(self, saved: list[dict[str, Any]]) -> None:
        self.restored = [Handout(h["prompts"], int(h["epoch"]), result=h["result"]) for h in saved]

    def close(self) -> None:
        """Each actor closes its engine or reward workers, then is killed; a cluster this run started stops."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()


def epoch_handed_out(session: Any) -> bool:
    """Whether this epoch's prompt batches were all handed out already: resumed from a checkpoint taken after the
    hand-outs drew past the epoch's last batch, when the loader had moved itself on to the next epoch (its saved
    position: that epoch's start) while the trainer's ``epoch`` had not. What is left of this epoch is then the
    restored hand-outs alone; drawing from the loader would label the next epoch's prompts with this one (the step
    records' ``epoch``, the completions' seeds), and the trainer's ``set_epoch`` at this epoch's end would rewind
    the loader to them a second time (the epoch's end: docs/architecture.md, "The trainer loop")."""
    return getattr(session.train_data, "epoch", session.epoch) > session.epoch


def all_ranks(session: Any, rows: list[int]) -> list[int]:
    """``rows`` from every data-parallel rank (the record is written by rank 0); the ranks of one TP group
    hold the same prompts, so each data-parallel rank's rows count once."""
    import torch.distributed as dist
    from posttune.plugin import data_rank

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rows
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (data_rank(session)[0], rows))
    return [row for part in dict(gathered).values() for row in part]


def portable(prompts: dict[str, Any]) -> dict[str, Any]:
    """A prompt batch as plain lists (what crosses to an actor and what a checkpoint keeps)."""
    return {"prompt_ids": [ids.tolist() for ids in prompts["prompt_ids"]], "prompts": list(prompts["prompts"]),
            "fields": {k: list(v) for k, v in prompts["fields"].items()}, "rows": prompts["rows"].tolist()}


@dataclass
class ActorPool:
    """This learner rank's engine and reward actors and the newest weights they should generate with."""

    engines: list[Any]
    scorers: list[Any]
    started_ray: bool  # this run connected to Ray (started a local cluster or joined one): it disconnects on close
    weights: Any = None  # ObjectRef of the newest weights
    version: int = -1
    dropped: int = 0  # batches lost with an actor that died (Ray restarts it), handed out again
    turn: int = 0

    def submit(self, handout: Handout) -> None:
        turn, self.turn = self.turn, self.turn + 1
        engine = self.engines[turn % len(self.engines)]
        scorer = self.scorers[turn % len(self.scorers)]
        generated = engine.generate.remote(handout.prompts, handout.epoch, self.version, [self.weights])
        handout.scored = scorer.score.remote(handout.prompts, generated)

    def ready(self, handouts: Any) -> int:
        import ray

        pending = [h.scored for h in handouts if h.result is None]
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        return len(done) + sum(h.result is not None for h in handouts)

    def result(self, handout: Handout) -> dict[str, Any]:
        """The batch's scored rollouts, waiting for them; a batch lost with a dead actor is handed out again."""
        import ray

        while handout.result is None:
            try:
                handout.result = ray.get(handout.scored)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                self.dropped += 1
                self.submit(handout)
            except ray.exceptions.RayTaskError as error:
                if isinstance(error.cause, PosttuneError):
                    raise error.cause from None
                raise
        return handout.result

    def push(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The newest weights: each engine loads them before its next batch (``EngineActor.generate``)."""
        import ray

        self.weights, self.version = ray.put(weights), version

    def close(self) -> None:
        import ray

        actors = [*self.engines, *self.scorers]
        try:
            ray.get([actor.close.remote() for actor in actors], timeout=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below all the same
            pass
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - the cluster (rank 0's) may be gone already
                pass
        if self.started_ray and ray.is_initialized():
            ray.shutdown()  # stops a local cluster this rank started; leaves one it joined


def start_pool(session: Session) -> ActorPool:
    """This rank's actors (its share of ``actors``, and ``scorers``), with the current weights pushed."""
    import ray

    options = session.method_config.ray_options
    rank, ranks = learner_rank()
    if options.actors % ranks:
        raise PosttuneError(f"method.ray_options.actors: {options.actors} engine actors do not split evenly over "
                            f"{ranks} learner ranks")
    started = connect_ray(options.ray_address, rank)
    spec = actor_spec(session)
    from posttune_grpo.ray_workers import EngineActor, RewardActor

    engine_options: dict[str, Any] = {"max_restarts": -1, "num_cpus": 0}
    if options.gpus_per_actor:
        engine_options["num_gpus"] = options.gpus_per_actor
    engines = [ray.remote(**engine_options)(EngineActor).remote(spec) for _ in range(options.actors // ranks)]
    scorers = [ray.remote(max_restarts=-1, num_cpus=0)(RewardActor).remote(spec) for _ in range(options.scorers)]
    pool = ActorPool(engines, scorers, started)
    pool.push(plain_state_dict(session.model), session.step)
    return pool


def learner_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def connect_ray(address: str | None, rank: int) -> bool:
    """Join ``address``, or (rank 0) start a local cluster that the other ranks join; False if this process
    was connected already (the caller's own ``ray.init``: left as it is on close)."""
    with sigterm_kept():
        return _connect_ray(address, rank)


@contextmanager
def sigterm_kept() -> Iterator[None]:
    """Keep this process's SIGTERM handler through ``ray.init``: Ray's core worker installs a C++ handler for
    it that prints a stack and aborts, which would replace posttune's (finish the step, save, exit 143)."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _connect_ray(address: str | None, rank: int) -> bool:
    import torch.distributed as dist

    auth: dict[str, str] = {}
    started = False
    if rank == 0:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            started = True
        address = ray.get_runtime_context().gcs_address
        # Ray >= 2.5x starts a local cluster with token authentication, announced in this process's
        # environment only: the other learner ranks (torchrun's children, not this one's) need it too
        auth = {key: value for key, value in os.environ.items() if key.startswith("RAY_AUTH")}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shared = [address, auth]
        dist.broadcast_object_list(shared, src=0)
        address, auth = shared
    if rank != 0:
        os.environ.update(auth)  # before Ray is imported here: it reads its settings once
        import ray

        if "RAY_AUTH_MODE" in auth:
            try:  # imported earlier all the same (a plugin, the user's code): make it read them again
                from ray._raylet import Config

                Config.initialize("")
            except (ImportError, AttributeError):
                pass
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            started = True
    return started


@torch.no_grad()
def actor_spec(session: Session) -> dict[str, Any]:
    """What an actor needs to rebuild the policy and generate and score as the learner would."""
    from posttune_grpo.rollouts import rollout_spec

    origin = session.model.posttune_origin
    config = session.method_config
    return {
        **rollout_spec(session),
        "family": origin.family, "build_kwargs": dict(origin.build_kwargs),
        "engine": config.engine, "engine_options": dict(config.engine_options), "source": origin.source,
        "tokenizer": _absolute(session.config.tokenizer.path or session.config.model.path),
        "rewards": [dict(name=r.name, weight=r.weight, options=dict(r.options), timeout_s=r.timeout_s,
                         budget_s=r.budget_s) for r in config.rewards],
        "threads": config.ray_options.threads_per_actor,
        "cwd": os.getcwd(),  # what the rewards' Python function references are read from (python_rewards.py)
    }


def _absolute(path: str) -> str:
    """A local path as an absolute one (a Ray worker may run in another directory); a hub id as it is."""
    from pathlib import Path

    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path
