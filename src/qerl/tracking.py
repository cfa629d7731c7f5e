"""Experiment tracking in MLflow through kedro-mlflow: the optional extra ``pip install -e ".[mlflow]"``.

With the extra installed (and ``QERL_TRACKING`` not ``off``) every ``kedro run`` is one MLflow run
in the experiment ``qerl`` of the store configured in ``conf/base/mlflow.yml`` (shipped: the local
sqlite file ``data/09_tracking/mlflow.db`` with artifacts under ``data/09_tracking/artifacts``; no
server, no network; browse it with ``kedro mlflow ui``). Logged:

- params, once per run: the validated settings blocks the pipeline reads, flattened
  (``qerl.rl.lr``, ``qerl.quant.format``, ``data.eval_size``; lists and nulls as JSON);
- metrics: the metrics row of every RL step (``reward/mean``, ``rollout/entropy``, ``train/loss``,
  ...; :mod:`qerl.train.metrics`) with the RL step as MLflow's step, and the held-out evaluation
  (``eval/pass_at_1_greedy``, ...) at step 0 (before) and at the last step (after);
- tags: ``qerl.run`` (run name / fingerprint), ``qerl.run_dir``, ``qerl.start_step`` (> 0 after a resume);
- artifacts, once the run closes: ``tables/`` (evaluation, noise_metrics, training_metrics as CSV),
  ``plots/`` (the training plots), ``adapter/`` (the final LoRA adapter in peft's format:
  ``PeftModel.from_pretrained(base, <artifacts>/adapter)``) and ``run.json`` (the run's settings).

kedro-mlflow's own hook is used (its ``mlflow.yml``, run start and end, ``kedro mlflow ui``), wrapped
by :class:`MlflowTracking` without its per-node parameter logging: that would log each validated
block as a pydantic repr string, on every node of every step. So ``settings.py`` unregisters the
plugin's hook (``DISABLE_HOOKS_FOR_PLUGINS``) and registers :func:`tracking_hooks` instead.
``QERL_TRACKING=off`` (also ``0``, ``false``, ``no``) turns tracking off with the extra installed.
Without the extra this module imports neither mlflow nor kedro-mlflow and nothing changes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from kedro.framework.hooks import hook_impl

log = logging.getLogger(__name__)

TRACKING_ENV = "QERL_TRACKING"
#: kedro-mlflow's distribution name as Kedro matches it (2.0.3 writes ``kedro_mlflow``; older ``kedro-mlflow``).
PLUGIN_DISTS = ("kedro_mlflow", "kedro-mlflow")
UPDATE_NODE, START_NODE, CLOSE_NODE = "rl_loop.lora_rl_update", "start_training", "close_run"
MLFLOW_PATTERNS = ["mlflow*", "mlflow*/**", "**/mlflow*"]  # kedro-mlflow's own config patterns
MAX_PARAM_CHARS = 6000  # MLflow 3's limit on a parameter value
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")
_PLUGIN_IMPORT_WARNING = r".*Add type hints to the .predict. method"  # mlflow, on kedro-mlflow's model class


def tracking_requested() -> bool:
    """False when ``QERL_TRACKING`` is off / 0 / false / no (default: on)."""
    return os.environ.get(TRACKING_ENV, "on").strip().lower() not in {"off", "0", "false", "no"}


def tracking_available() -> bool:
    """kedro-mlflow is installed (the ``mlflow`` extra); nothing is imported to find out."""
    return importlib.util.find_spec("kedro_mlflow") is not None


def tracking_hooks() -> tuple[Any, ...]:
    """``(MlflowTracking(),)`` when the extra is installed and tracking is not switched off, else ``()``.

    With the extra installed, kedro-mlflow is imported here either way: Kedro imports it for every
    command (its CLI commands and hook entry points), and importing it first, here, drops the warning
    mlflow prints about kedro-mlflow's model class (mlflow's own ``once`` filter overrides ours)."""
    if not tracking_available():
        return ()
    with _hidden_warning(_PLUGIN_IMPORT_WARNING):
        import kedro_mlflow.framework.hooks.mlflow_hook  # noqa: F401
    return (MlflowTracking(),) if tracking_requested() and _is_rank_zero() else ()


def _is_rank_zero() -> bool:
    """Under ``torchrun`` only rank 0 tracks: the ranks train the same adapter, one MLflow run is the record."""
    try:
        return int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True


@contextmanager
def _hidden_warning(pattern: str) -> Iterator[None]:
    """Drop the warnings whose message matches ``pattern``, whatever filters the code inside sets."""
    original = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if not re.match(pattern, str(message)):
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


# ------------------------------------------------------------------------------ what is logged


def mlflow_name(name: str) -> str:
    """``name`` with the characters MLflow refuses in metric and param names replaced (``@`` -> ``_at_``)."""
    return _BAD_NAME_CHARS.sub("_", name.replace("@", "_at_"))


def flat_params(blocks: Mapping[str, Any]) -> dict[str, str]:
    """Validated settings blocks (pydantic models) as flat MLflow params: ``{"qerl.rl.lr": "0.001"}``.
    Nested settings are joined with ``.``; lists, numbers, booleans and nulls are written as JSON."""
    out: dict[str, str] = {}
    for name, model in blocks.items():
        out.update(_flatten(model.model_dump(mode="json"), name))
    return out


def _flatten(value: Any, prefix: str) -> dict[str, str]:
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}.{key}"))
        return out
    text = value if isinstance(value, str) else json.dumps(value)
    return {mlflow_name(prefix): text[:MAX_PARAM_CHARS]}


def used_blocks(pipeline_inputs: Iterable[str], parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The validated top-level blocks a pipeline reads (``params:qerl.rl`` -> ``qerl``), by name."""
    from qerl.validation import BLOCKS, validate_block

    inputs = set(pipeline_inputs)
    names = set(parameters) if "parameters" in inputs else {
        i.split(":", 1)[1].split(".", 1)[0] for i in inputs if i.startswith("params:")}
    return {n: validate_block(n, parameters[n]) for n in sorted(names) if n in BLOCKS and n in parameters}


def numeric_metrics(row: Mapping[str, Any], prefix: str = "", skip: Iterable[str] = ("step",)) -> dict[str, float]:
    """The numeric entries of a metrics row (booleans, strings and dicts left out) under MLflow names."""
    import numbers

    return {mlflow_name(prefix + k): float(v) for k, v in row.items()
            if k not in skip and isinstance(v, numbers.Real) and not isinstance(v, bool)}


def write_run_outputs(inputs: Mapping[str, Any], out: Path) -> list[str]:
    """The artifacts of a finished run (the inputs of ``close_run``) under ``out``; returns their paths."""
    import pandas as pd

    from qerl.train.checkpoints import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RUN_FILE

    for name in ("evaluation", "noise_metrics", "training_metrics"):
        if isinstance(inputs.get(name), pd.DataFrame):
            (out / "tables").mkdir(parents=True, exist_ok=True)
            inputs[name].to_csv(out / "tables" / f"{name}.csv", index=False)
    for name, image in (inputs.get("training_plots") or {}).items():
        (out / "plots").mkdir(parents=True, exist_ok=True)
        (image.savefig if hasattr(image, "savefig") else image.save)(out / "plots" / name)  # Figure or PIL image
    state = inputs.get("trained_state")
    final = Path(state.checkpoint_dir) if getattr(state, "checkpoint_dir", None) else None
    if final is not None and (final / ADAPTER_WEIGHTS).exists():
        (out / "adapter").mkdir(parents=True, exist_ok=True)
        for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "README.md"):
            if (final / f).exists():
                shutil.copy2(final / f, out / "adapter" / f)
    if state is not None and (state.run.path / RUN_FILE).exists():
        shutil.copy2(state.run.path / RUN_FILE, out / RUN_FILE)
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def project_store(context: Any) -> None:
    """A relative ``sqlite:///`` store in mlflow.yml is taken from the project root (like kedro-mlflow
    does with relative file stores) and its folder created; the config loader then returns that."""
    from kedro.config import MissingConfigException

    loader = context.config_loader
    loader.config_patterns.setdefault("mlflow", MLFLOW_PATTERNS)
    try:
        conf = loader["mlflow"]
    except MissingConfigException:
        return
    server = dict(conf.get("server") or {})
    uri = server.get("mlflow_tracking_uri") or ""
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:////"):
        return
    db = Path(context.project_path) / uri[len("sqlite:///"):]
    db.parent.mkdir(parents=True, exist_ok=True)
    loader["mlflow"] = {**conf, "server": {**server, "mlflow_tracking_uri": f"sqlite:///{db}"}}


# ------------------------------------------------------------------------------ the hook


class MlflowTracking:
    """kedro-mlflow's hook without its per-node parameter logging, plus the project's params, per-step
    metrics, tags and artifacts (see the module docstring). A failure to log is a warning: it never
    stops a training run."""

    def __init__(self) -> None:
        from kedro_mlflow.framework.hooks.mlflow_hook import MlflowHook

        self._plugin = MlflowHook()
        self._run_id: str | None = None

    @hook_impl(trylast=True)  # after the project's validation: a refused run creates no store
    def after_context_created(self, context: Any) -> None:
        project_store(context)
        self._plugin.after_context_created(context)

    @hook_impl
    def after_catalog_created(self, catalog: Any, conf_catalog: Any, conf_creds: Any, parameters: Any,
                              save_version: Any, load_versions: Any) -> None:
        self._plugin.after_catalog_created(catalog, conf_catalog, conf_creds, parameters, save_version, load_versions)

    @hook_impl
    def before_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        self._plugin.before_pipeline_run(run_params, pipeline, catalog)
        self._run_id = self._plugin.run_id if self._plugin._is_mlflow_enabled else None
        if self._run_id is None:
            return
        import mlflow

        self._safely("params", lambda: mlflow.log_params(
            flat_params(used_blocks(pipeline.inputs(), catalog.load("parameters"))), run_id=self._run_id))
        log.info("tracking: MLflow run %s in %s (browse with `kedro mlflow ui`; QERL_TRACKING=off disables it)",
                 self._run_id, mlflow.get_tracking_uri())

    @hook_impl
    def before_node_run(self, node: Any, catalog: Any, inputs: dict[str, Any], is_async: bool) -> None:
        self._plugin.before_node_run(node, catalog, {}, is_async)  # re-attaches the run; no per-node params

    @hook_impl
    def after_node_run(self, node: Any, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        if self._run_id is None or node.name not in (UPDATE_NODE, START_NODE, CLOSE_NODE):
            return
        import mlflow

        run_id = self._run_id
        if node.name == UPDATE_NODE:
            state = next(iter(outputs.values()))
            if getattr(state, "history", None):
                row = state.history[-1]
                self._safely("metrics", lambda: mlflow.log_metrics(numeric_metrics(row), step=int(row["step"]),
                                                                  run_id=run_id))
        elif node.name == START_NODE:
            state = next(iter(outputs.values()))
            self._safely("tags", lambda: mlflow.set_tags(
                {"qerl.run": state.run.key, "qerl.run_dir": str(state.run.path), "qerl.start_step": state.step}))
        else:
            self._safely("artifacts", lambda: self._log_close(inputs, run_id))

    @hook_impl
    def after_pipeline_run(self, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        self._plugin.after_pipeline_run(run_params, pipeline, catalog)

    @hook_impl
    def on_pipeline_error(self, error: Exception, run_params: dict[str, Any], pipeline: Any, catalog: Any) -> None:
        self._plugin.on_pipeline_error(error, run_params, pipeline, catalog)

    @staticmethod
    def _log_close(inputs: Mapping[str, Any], run_id: str) -> None:
        import mlflow

        for _, row in inputs["evaluation"].iterrows():
            mlflow.log_metrics(numeric_metrics(row.to_dict(), prefix="eval/"), step=int(row["step"]), run_id=run_id)
        with TemporaryDirectory() as tmp:
            written = write_run_outputs(inputs, Path(tmp))
            mlflow.log_artifacts(tmp, run_id=run_id)
        log.info("tracking: logged %d artifacts (tables, plots, adapter) to MLflow run %s", len(written), run_id)

    @staticmethod
    def _safely(what: str, action: Any) -> None:
        try:
            action()
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            log.warning("tracking: could not log the %s to MLflow (%s: %s); training goes on",
                        what, type(err).__name__, err)
