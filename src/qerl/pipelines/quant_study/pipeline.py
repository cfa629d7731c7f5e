"""``quant_study``: prompt prep -> one namespace per variant (``nvfp4_aqn.run_seed_0`` ...) ->
``summarize_study`` (versioned tables + plots). Variants and seeds come from
``quant_study`` in the conf, read when the pipeline is built."""

from __future__ import annotations

import warnings

from kedro.pipeline import Node, Pipeline

from qerl.pipelines.data_prep import create_pipeline as data_prep_pipeline
from qerl.pipelines.qerl_train.nodes import bind
from qerl.pipelines.registry_params import lookup

from .nodes import run_variant, summarize_study


def create_pipeline(**kwargs: object) -> Pipeline:
    variants = kwargs.get("variants") or [v["name"] for v in lookup("quant_study.variants", [])]
    seeds = kwargs.get("seeds") or lookup("quant_study.seeds", [0])
    arms, outputs = [], []
    for name in variants:
        nodes = []
        for s in seeds:
            nodes.append(
                Node(bind(run_variant, variant=name, seed=int(s)),
                     ["train_prompts", "eval_prompts", "params:qerl", "params:quant_study"],
                     [f"seed_{s}_metrics", f"seed_{s}_evaluation"], name=f"train_seed_{s}")
            )
            outputs += [f"{name}.seed_{s}_metrics", f"{name}.seed_{s}_evaluation"]
        arms.append(Pipeline(nodes, namespace=name, inputs={"train_prompts", "eval_prompts"},
                             parameters={"params:qerl", "params:quant_study"}))
    with warnings.catch_warnings():  # the arms' outputs are namespaced ("nvfp4.seed_0_metrics") by design
        warnings.filterwarnings("ignore", message=".*contain '.' characters.*")
        summary = Node(summarize_study, ["params:quant_study", *outputs],
                       ["quant_study_metrics", "quant_study_runs", "quant_study_summary", "quant_study_plots"],
                       name="summarize_study")
    return Pipeline([data_prep_pipeline(), *arms, summary], tags=["quant_study"])
