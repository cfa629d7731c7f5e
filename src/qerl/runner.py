"""``LoopRunner``: Kedro's sequential runner, plus the RL loop.

Kedro pipelines are acyclic, so ``qerl_train`` holds ONE copy of the RL step, the namespace
``rl_loop`` (``generate_rollouts -> score_rewards -> lora_rl_update``, tagged ``rl_loop``), and
this runner repeats it: nodes upstream of the loop run once, then the loop's nodes run in order
until the loop state (the resident ``train_state``) says ``done``, then the downstream nodes run
once. Every repetition is an ordinary Kedro node run (hooks, logging, catalog saves), the policy
and training state stay resident (no reload between steps), and kedro viz shows the six stages
with the step as one collapsible group.

A run whose configuration already finished is not repeated: after computing the training prompts
in memory (nothing saved) the runner checks the run's ``complete.json`` and, if it is there, skips
every node and says so. A partial run that leaves out the loop's producer (``--nodes=
rl_loop.generate_rollouts``, a *replay*) runs its nodes once, like the sequential runner.

The project's session class (``settings.SESSION_CLASS``) makes this the default runner of
``kedro run``; other runners refuse a pipeline that contains the loop.

Under ``torchrun`` (``torchrun --nproc_per_node=N -m qerl run --pipelines=qerl_train``, see
docs/distributed.md) the session joins the process group (``qerl.train.distributed``) and every rank
runs the pipeline; on the ranks other than 0 every dataset a node saves becomes an in-memory one
(except the step tables, which rank 0 writes whole), so only rank 0 writes data/; the finished-run
check and the loop condition are checked to agree on every rank.
"""

from __future__ import annotations

import logging
from collections import Counter
from itertools import chain
from typing import Any

from kedro.framework.session import KedroSession
from kedro.io import MemoryDataset
from kedro.pipeline import Pipeline
from kedro.runner import AbstractRunner, SequentialRunner
from kedro.runner.task import Task

from qerl.train import distributed as dist

LOOP_TAG = "rl_loop"
LOOP_STATE = "train_state"
LOOP_RESULT = "trained_state"
RUN_INPUTS = ("train_prompts", "checkpoints", "params:qerl")

log = logging.getLogger(__name__)


class LoopRunner(SequentialRunner):
    """Run ``pipeline`` sequentially, repeating the nodes tagged ``rl_loop`` while the loop state
    is not done (see the module docstring)."""

    def _run(self, pipeline: Pipeline, catalog: Any, hook_manager: Any = None, run_id: str | None = None) -> None:
        nodes = pipeline.nodes
        body = [n for n in nodes if LOOP_TAG in n.tags]
        _only_rank0_writes(pipeline, catalog)
        if not body or not any(LOOP_STATE in n.outputs for n in nodes):
            super()._run(pipeline, catalog, hook_manager, run_id)  # no loop, or a replay of its nodes
            return
        finished, computed = self._finished_run(pipeline, catalog)
        fix = "put the checkpoint root on a filesystem every node sees"
        if dist.agreed(finished is not None, "checkpoints", fix):
            log.info("%s; skipped every node. To train again use --params qerl.rl.resume=never, or change the "
                     "configuration", finished)
            return
        body_names = {n.name for n in body}
        after = {n.name for n in pipeline.from_nodes(*body_names).nodes} - body_names
        pre = [n for n in nodes if n.name not in body_names and n.name not in after]
        post = [n for n in nodes if n.name in after]
        load_counts = Counter(chain.from_iterable(n.inputs for n in nodes))
        for node in pre:
            if node.name in computed:  # the prompts computed for the completion check: saved, not recomputed
                for name, value in computed[node.name].items():
                    catalog.save(name, value)
                self._release_datasets(node, catalog, load_counts, pipeline)
                continue
            self._execute(node, catalog, hook_manager, run_id, pipeline, load_counts)
        steps = 0
        while not dist.agreed(getattr(catalog.load(LOOP_STATE), "done", True), "train_state.done", fix):
            for node in body:
                self._execute(node, catalog, hook_manager, run_id, pipeline, None)
            steps += 1
        if steps == 0 and LOOP_RESULT in pipeline.datasets():  # resumed after the last step: forward the state
            catalog.save(LOOP_RESULT, catalog.load(LOOP_STATE))
        for node in body:  # the loop's inputs are released only once it is over
            self._release_datasets(node, catalog, load_counts, pipeline)
        for node in post:
            self._execute(node, catalog, hook_manager, run_id, pipeline, load_counts)
        log.info("ran %d loop step(s)", steps)

    def _execute(self, node: Any, catalog: Any, hook_manager: Any, run_id: str | None, pipeline: Pipeline,
                 load_counts: Counter | None) -> None:
        try:
            Task(node=node, catalog=catalog, hook_manager=hook_manager, is_async=self._is_async, run_id=run_id).execute()
        except Exception:
            log.warning("node %s failed; rerun the same command to resume from the newest checkpoint", node.name)
            raise
        log.debug("completed node %s", node.name)
        if load_counts is not None:
            self._release_datasets(node, catalog, load_counts, pipeline)

    @staticmethod
    def _finished_run(pipeline: Pipeline, catalog: Any) -> tuple[str | None, dict[str, dict[str, Any]]]:
        """('run <key> is complete (...)' or None, {producer node: its outputs}): the training prompts
        are computed in memory (their node's outputs are returned, so it need not run again)."""
        from qerl.validation import train_params

        producers = [n for n in pipeline.nodes if "train_prompts" in n.outputs]
        if len(producers) != 1 or any(name not in catalog for name in RUN_INPUTS[1:]):
            return None, {}
        node = producers[0]
        params = train_params(catalog.load("params:qerl"))
        dist.check_world(params.rl.prompts_per_step, params.model.device)  # before any work
        outputs = node.run({name: catalog.load(name) for name in node.inputs})
        run = catalog.load("checkpoints").run_for(params, outputs["train_prompts"])
        if params.rl.resume != "auto" or not run.is_complete():
            return None, {node.name: outputs}
        done = run.completion()
        return (f"run {run.key} is complete ({done.get('steps', '?')} steps, finished {done.get('finished', '?')}; "
                f"outputs: {done.get('outputs', 'data/08_reporting')})"), {}


def _only_rank0_writes(pipeline: Pipeline, catalog: Any) -> None:
    """On a rank other than 0, every dataset a node of ``pipeline`` saves is replaced by an in-memory
    one (the rank hands data from node to node as rank 0 does, and never writes data/), except those
    that handle ranks themselves (``rank_aware``: the step tables, which rank 0 writes whole)."""
    if dist.is_main():
        return
    catalog_log = logging.getLogger("kedro.io.data_catalog")
    level = catalog_log.level
    catalog_log.setLevel(logging.ERROR)  # no "Replacing dataset" line per entry
    try:
        for name in pipeline.all_outputs():
            dataset = catalog.get(name, fallback_to_runtime_pattern=True)
            if not isinstance(dataset, MemoryDataset) and not getattr(dataset, "rank_aware", False):
                catalog[name] = MemoryDataset(copy_mode="assign")
    finally:
        catalog_log.setLevel(level)


class QerlSession(KedroSession):
    """``KedroSession`` whose default runner is :class:`LoopRunner` (a plain ``SequentialRunner``,
    which is what ``kedro run`` passes when no ``--runner`` is given, is upgraded to it; it runs
    loop-free pipelines exactly like the sequential runner). Under ``torchrun`` it first joins the
    process group, and after a successful run leaves the group it joined."""

    def run(self, *args: Any, runner: AbstractRunner | None = None, **kwargs: Any) -> dict[str, Any]:
        joined_before = dist.initialized()
        opened = dist.init_from_env() and not joined_before
        if runner is None or type(runner) is SequentialRunner:
            runner = LoopRunner(is_async=getattr(runner, "_is_async", False))
        elif not isinstance(runner, LoopRunner):
            names = kwargs.get("pipeline_names") or (args[1] if len(args) > 1 else None) or ["__default__"]
            if any(p in ("qerl_train", "__default__") for p in names):
                from qerl.errors import QerlConfigError

                raise QerlConfigError("--runner", f"{type(runner).__name__} cannot run the RL loop of qerl_train",
                                      "leave --runner out (the project's LoopRunner is the default)")
        result = super().run(*args, runner=runner, **kwargs)
        if opened:
            dist.close()
        return result
