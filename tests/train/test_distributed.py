"""Data parallelism (``qerl.train.distributed``) on CPU with gloo, through the core loop
``qerl.train.loop.train``: 2 ranks under the real ``torchrun`` end with the adapter (and the metrics)
of 1 rank (a process group of one, as ``torchrun --nproc_per_node=1`` makes) on the same global batch
and seed; only rank 0 writes; an interrupted 2-rank run resumes to
the uninterrupted result from rank 0's checkpoint; ranks that would resume differently, or a step
with fewer prompts than ranks, are refused. Plus the helpers' single-process behaviour (identities).

This file is also the worker script: ``torchrun ... test_distributed.py <model_dir> <out_dir>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

#: Max |difference| of the adapters: float32 sums in another order (rows in other micro-batches, one
#: all-reduce), which Adam's per-component normalisation amplifies on small gradient components.
TOLERANCE = 1e-4


def _params(model_dir: str, **rl: object):
    from qerl.params import TrainParams

    return TrainParams(
        model={"path": model_dir, "device": "cpu"}, quant={"format": "nvfp4"}, lora={"r": 4, "alpha": 8},
        rollout={"group_size": 2, "max_new_tokens": 4, "engine": "hf"},
        # rewards that differ within a group (the completion's length), so the advantages are not zero
        rewards={"functions": [{"name": "length_penalty", "kwargs": {"target": 0, "per_unit": 0.01}}]},
        rl={"steps": 2, "prompts_per_step": 3, "minibatches": 2, "save_every": 1, "lr": 1e-2, "run_name": "ddp",
            **rl},
        noise={"schedule": "linear", "sigma_start": 1e-2, "sigma_end": 1e-3, "stages": 2},
    )


def _prompts() -> pd.DataFrame:
    return pd.DataFrame({"id": [f"p{i}" for i in range(7)], "prompt": [f"{i} + {i} =" for i in range(7)],
                         "answer": [str(2 * i) for i in range(7)], "task": "add", "metadata": "{}"})


# ------------------------------------------------------------------ the worker (run by torchrun)


class _Stop(Exception):
    """Raised by on_step to interrupt a run (as a kill would) after a checkpoint."""


def _worker(model_dir: str, out: Path, rank: int, world: int) -> None:
    from safetensors.torch import save_file

    from qerl.errors import QerlConfigError
    from qerl.train import distributed as dist
    from qerl.train.loop import train

    torch.set_num_threads(1)
    params, prompts = _params(model_dir), _prompts()
    report: dict[str, object] = {}

    def keep(name: str, policy, state) -> None:
        if rank == 0:  # the test's own files: rank 0 alone, like the project
            save_file({k: v.contiguous() for k, v in policy.adapter_state_dict().items()}, str(out / f"{name}.safetensors"))
            report[name] = {"first_step": state.first_step, "step": state.step,
                            "history": [{k: v for k, v in h.items() if k != "noise/state"} for h in state.history]}

    # 1. the whole run; rank 1 is given a checkpoint root of its own, which it must never create
    policy, state = train(params, prompts, checkpoint_root=str(out / "ckpt" if rank == 0 else out / f"rank{rank}_root"))
    keep("whole", policy, state)
    report["initialized"] = dist.initialized() and dist.world_size() == world
    if world > 1:
        # 2. interrupted after the checkpoint of step 1, rerun: every rank resumes from rank 0's checkpoint
        def stop_after_1(row: dict) -> None:
            if row["step"] == 1:
                raise _Stop
        try:
            train(params, prompts, checkpoint_root=str(out / "resume"), on_step=stop_after_1)
        except _Stop:
            pass
        policy, state = train(params, prompts, checkpoint_root=str(out / "resume"))
        keep("resumed", policy, state)
        # 3. refusals: ranks that would start from different steps, fewer prompts than ranks
        for name, p, root in (("mismatch", params, out / "resume" if rank == 0 else out / "empty_root"),
                              ("too_few_prompts", _params(model_dir, prompts_per_step=1), out / "unused_root")):
            try:
                train(p, prompts, checkpoint_root=str(root))
                report[name] = None
            except QerlConfigError as err:
                report[name] = {"field": err.field, "message": str(err)}
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report, default=float))
    dist.close()  # what a script that drives train() under torchrun ends with


def _torchrun(nproc: int, model_dir: Path, out: Path) -> subprocess.Popen:
    out.mkdir(parents=True)
    env = {**os.environ, "QERL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           __file__, str(model_dir), str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out)


def _one_rank(model_dir: Path, out: Path) -> None:
    """The reference in this process: a process group of one rank (what ``torchrun --nproc_per_node=1`` makes)."""
    import torch.distributed as tdist

    out.mkdir(parents=True)
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        _worker(str(model_dir), out, 0, 1)
        assert not tdist.is_initialized()  # the worker's dist.close() left the group
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """A 2-rank torchrun of the worker and, meanwhile, the 1-rank reference in this process."""
    model_dir = tiny_model_factory("qwen2")
    base = tmp_path_factory.mktemp("ddp")
    proc = _torchrun(2, model_dir, base / "world2")
    try:
        _one_rank(model_dir, base / "world1")
    finally:
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"torchrun --nproc_per_node=2 failed:\n{output[-4000:]}"
    return {1: base / "world1", 2: base / "world2"}


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _report(run: Path) -> dict:
    return json.loads((run / "report.json").read_text())


# ------------------------------------------------------------------ 2 ranks == 1 rank


def test_two_ranks_train_the_adapter_of_one_rank_on_the_same_global_batch(runs) -> None:
    one, two = _adapter(runs[1] / "whole.safetensors"), _adapter(runs[2] / "whole.safetensors")
    run = next((runs[1] / "ckpt" / "ddp").iterdir())
    start = _adapter(run / "adapters" / "step_000000" / "adapter_model.safetensors")
    assert _report(runs[1])["initialized"] and _report(runs[2])["initialized"]
    moved, diff = _max_diff(one, start), _max_diff(one, two)
    assert moved > 1e-2, "the adapter did not train: the comparison would prove nothing"
    assert diff < TOLERANCE, f"2 ranks differ from 1 rank by {diff:.2e} (the adapter moved {moved:.2e})"


def test_two_ranks_report_the_metrics_of_the_whole_step(runs) -> None:
    one, two = (_report(runs[n])["whole"]["history"] for n in (1, 2))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        # the same rollouts (per-prompt sampling streams) and rewards: equal exactly
        for key in ("rollout/tokens", "rollout/completion_len_max", "rollout/truncated_ratio", "reward/mean",
                    "reward/std", "reward/zero_std_group_frac", "reward/groups_kept", "noise/sigma",
                    "train/optimizer_steps"):
            assert a[key] == b[key], key
        assert a["reward/std"] > 0  # the rewards differ: the advantages are not all zero
        # the update's statistics, summed / token-weighted / maxed over the ranks
        for key in ("rollout/entropy", "train/loss", "train/pg_loss", "train/grad_norm", "train/entropy",
                    "train/clip_ratio", "train/ratio_mean", "train/kl_to_base", "mismatch/kl",
                    "mismatch/is_weight_mean", "mismatch/is_weight_max", "mismatch/logprob_gap_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # step 1 starts from the same adapter: its gradient is the same up to float32 summation order
    assert one[0]["train/grad_norm"] == pytest.approx(two[0]["train/grad_norm"], rel=1e-6)


def test_only_rank_0_writes(runs) -> None:
    out = runs[2]
    assert not (out / "rank1_root").exists() and not (out / "empty_root").exists()
    run = next((out / "ckpt" / "ddp").iterdir())
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == ["step_000001", "step_000002"]
    assert (run / "run.json").exists() and (run / "adapters" / "step_000002").is_dir()
    assert sorted(p.name for p in out.iterdir()) == ["ckpt", "report.json", "resume", "resumed.safetensors",
                                                      "whole.safetensors"]


def test_an_interrupted_two_rank_run_resumes_from_rank_0s_checkpoint(runs) -> None:
    report = _report(runs[2])
    assert report["resumed"]["first_step"] == 1 and report["resumed"]["step"] == 2
    assert [h["step"] for h in report["resumed"]["history"]] == [1, 2]
    diff = _max_diff(_adapter(runs[2] / "resumed.safetensors"), _adapter(runs[2] / "whole.safetensors"))
    assert diff < TOLERANCE


def test_ranks_that_would_start_differently_or_share_too_few_prompts_are_refused(runs) -> None:
    report = _report(runs[2])
    assert report["mismatch"]["field"] == "checkpoints"
    assert "different steps" in report["mismatch"]["message"]
    assert "filesystem every node sees" in report["mismatch"]["message"]
    assert report["too_few_prompts"]["field"] == "qerl.rl.prompts_per_step"
    assert "torchrun started 2 ranks" in report["too_few_prompts"]["message"]


# ------------------------------------------------------------------ the helpers in one process


def test_shards_cover_the_step_contiguously_in_rank_order() -> None:
    from qerl.train.distributed import shard_bounds

    for n, world in ((16, 2), (3, 2), (7, 3), (5, 5)):
        bounds = [shard_bounds(n, r, world) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        sizes = [hi - lo for lo, hi in bounds]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_with_a_stream_per_prompt_a_prompt_samples_the_same_in_any_batch(make_policy, engine: str) -> None:
    """What makes N ranks sample their shards as one rank samples the whole step."""
    from qerl.rollout import get_engine
    from qerl.rollout.base import SamplingParams
    from qerl.train.seeds import generator

    policy = make_policy("nvfp4", lora_seed=0)
    eng = get_engine(engine, policy.device)
    ids = [[5, 6, 7, 8], [10, 11], [12, 13, 14]]
    sp = SamplingParams(n=3, max_new_tokens=6, eos_token_ids=policy.eos_token_ids, pad_token_id=policy.pad_token_id)

    def rows(prompt_ids: list[list[int]], numbers: list[int]) -> list[list[int]]:
        batch = eng.generate(policy.model, prompt_ids, sp, [generator(0, 1, "sampling", index=i) for i in numbers])
        return [r[:n].tolist() for r, n in zip(batch.completion_ids, batch.completion_lengths, strict=True)]

    whole = rows(ids, [0, 1, 2])
    assert whole == rows(ids[:2], [0, 1]) + rows(ids[2:], [2])  # two "ranks"
    assert whole != rows(ids, [3, 4, 5])  # other streams, other samples


def test_without_a_process_group_every_helper_is_the_identity() -> None:
    from qerl.train import distributed as dist

    assert not dist.initialized() and dist.world_size() == 1 and dist.is_main()
    assert dist.shard(5) == (0, 5) and dist.local_indices([3, 0, 4], [5]) == [3, 0, 4]
    assert dist.all_sum({"a": 2.0}) == {"a": 2.0} and dist.all_max({"a": 2.0}) == {"a": 2.0}
    assert dist.all_gather_counts(4) == [4] and not dist.any_rank(False) and dist.any_rank(True)
    assert dist.reduce_stats({"x_mean": 0.5, "x_max": 3.0}, 10.0) == {"x_mean": 0.5, "x_max": 3.0}
    frame = pd.DataFrame({"a": [1, 2], "b": [[1], [2, 3]]})
    assert dist.gather_frames(frame) is frame
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    dist.all_reduce_grads([p])
    assert p.grad.tolist() == [3.0, 3.0]
    dist.check_same(1.0, "x", "never", "nothing")
    dist.check_world(1, "cuda:1")  # one process: any step size and device are fine
    assert not dist.init_from_env() or "WORLD_SIZE" in os.environ
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"



def test_close_waits_for_the_ranks_then_leaves_the_group_and_is_a_no_op_without_one() -> None:
    import torch.distributed as tdist

    from qerl.train import distributed as dist

    dist.close()  # no group: nothing to leave
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.initialized() and dist.world_size() == 1
        dist.close()
        assert not dist.initialized() and dist.world_size() == 1
        dist.close()  # again: a no-op
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


if __name__ == "__main__":  # a torchrun worker
    _worker(sys.argv[1], Path(sys.argv[2]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
