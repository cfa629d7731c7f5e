"""The per-GPU cache of tuned humming FP4 GEMM configs (read by ``qerl.kernels.humming_gemm``);
the tuner that fills it is :mod:`qerl.kernels.tune`.

For one GEMM shape (format, N, K) and a few decode row counts M, the candidates are humming's
heuristic choice at each M and its neighbours (pipeline stages, CTAs per SM, stream-K on/off,
block N and K), with ``--search wide`` also tiles of both MMA kinds and the fastest tiles'
variations (:mod:`qerl.kernels.tune`), optionally plus a sample from humming's own tuner space
(``humming.testing.tuning.sample_test_tuning_configs``, ``--samples``; it costs one to two minutes
of CPU per shape); they are compiled in parallel, each is checked against the heuristic kernel's
output and timed with a cold L2 in a CUDA graph (:func:`qerl.kernels.tune.graph_us`: no CPU
launch time in the timing), and the fastest per M is kept; illegal candidates fail to compile and are skipped. Results go to one JSON file per GPU (``$QERL_HUMMING_TUNING``, else
``$XDG_CACHE_HOME/qerl/humming_tuning_<gpu>.json``, ``~/.cache`` by default), keyed by
``<kind>:<N>x<K>:<dtype>`` (kind: the format, ``nvfp4_bf16_scales`` for humming's layout of NVFP4
with bf16 group scales); entries from another humming version are ignored. Under a key, a row
count ``"M"`` holds the config for the whole GPU and ``"M@S"`` the one tuned for at most ``S``
multiprocessors (``python -m qerl.kernels.tune --sms S``: what humming's GEMM gets while the
rollout engine's fused LoRA runs beside it on the others, ``FastEngine(lora_sms=...)``).

The package ships the files tuned on the GPUs this project measures on
(``qerl/kernels/tuned/humming_tuning_<gpu>.json``, e.g. ``nvidia_h200``): :func:`lookup` reads
this GPU's shipped file first and the user's file over it (a row count tuned in both: the user's
config), so a fresh install runs the tuned kernels without running the tuner.
``QERL_HUMMING_SHIPPED=0`` leaves the shipped files out (humming's heuristic where the user's file
has nothing).

    python -m qerl.kernels.tune --models 7b,32b --formats nvfp4,mxfp4 --ms 1,32,64,128
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

__all__ = ["MODEL_SHAPES", "cache_path", "lookup", "model_gemm_shapes", "shipped_path"]

ENV_VAR = "QERL_HUMMING_TUNING"
SHIPPED_ENV_VAR = "QERL_HUMMING_SHIPPED"
SHIPPED_DIR = Path(__file__).parent / "tuned"

# Qwen2.5 sizes: hidden, intermediate, attention heads, kv heads (head dim 128).
MODEL_SHAPES = {"1.5b": (1536, 8960, 12, 2), "7b": (3584, 18944, 28, 4), "32b": (5120, 27648, 40, 8)}

_LOADED: dict[str, dict] = {}


def model_gemm_shapes(model: str) -> list[tuple[str, int, int]]:
    """The decode GEMMs of one decoder layer as the fast engine runs them: (name, N, K)."""
    h, i, hq, hkv = MODEL_SHAPES[model]
    d = h // hq
    return [("qkv", (hq + 2 * hkv) * d, h), ("o", h, h), ("gate_up", 2 * i, h), ("down", h, i)]


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _gpu(device: torch.device | None) -> str:
    return _slug(torch.cuda.get_device_name(device))


def cache_path(device: torch.device | None = None) -> Path:
    """The user's tuning file of this GPU (see the module docstring)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qerl"
    return root / f"humming_tuning_{_gpu(device)}.json"


def shipped_path(device: torch.device | None = None) -> Path | None:
    """The tuning file this package ships for this GPU, or ``None`` (a CPU device, or
    ``QERL_HUMMING_SHIPPED=0``); the file need not exist (a GPU nobody tuned on)."""
    if os.environ.get(SHIPPED_ENV_VAR, "1") == "0" or \
            (device is not None and torch.device(device).type != "cuda"):
        return None
    return SHIPPED_DIR / f"humming_tuning_{_gpu(device)}.json"


def _key(kind: str, n: int, k: int, dtype: torch.dtype) -> str:
    return f"{kind}:{n}x{k}:{str(dtype).removeprefix('torch.')}"


def _humming_version() -> str:
    import humming

    return str(humming.__version__)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("humming") != _humming_version():
        return {}
    return data.get("entries", {}) if isinstance(data.get("entries"), dict) else {}


def _row_key(key: str) -> tuple[int, int | None] | None:
    """``"M"`` -> ``(M, None)``, ``"M@S"`` -> ``(M, S)``, anything else -> ``None``."""
    m, _, sms = str(key).partition("@")
    if not m.isdigit() or (sms and not sms.isdigit()):
        return None
    return int(m), int(sms) if sms else None


def lookup(kind: str, n: int, k: int, dtype: torch.dtype, device: torch.device,
           sms: int | None = None) -> dict[int, dict]:
    """Tuned ``{M: tuning config}`` for this GEMM (``kind``: its format, or format and layout as
    ``HummingFp4.kind``) on this GPU: the shipped file's, then the user's over them (empty when
    neither has the GEMM). ``sms``: the GEMM gets at most that many multiprocessors; a row count
    tuned for exactly that many (``"M@sms"``, in either file) replaces its whole-GPU config."""
    out: dict[int, dict] = {}
    at_sms: dict[int, dict] = {}
    for path in (shipped_path(device), cache_path(device)):
        if path is None:
            continue
        if str(path) not in _LOADED:
            _LOADED[str(path)] = _read(path)
        entry = _LOADED[str(path)].get(_key(kind, n, k, dtype), {})
        rows = [(rk, cfg) for key, cfg in entry.items()
                if (rk := _row_key(key)) is not None and isinstance(cfg, dict)]
        out.update({m: cfg for (m, s), cfg in rows if s is None})
        at_sms.update({m: cfg for (m, s), cfg in rows if sms and s == sms})
    return {**out, **at_sms}


def _store(path: Path, key: str, best: dict[int | str, dict], meta: dict) -> None:
    """Write ``best`` (``{M or "M@S": config}``) for ``key``; row counts tuned before and not in
    ``best`` are kept."""
    entries = _read(path)
    merged = {**entries.get(key, {}), **{str(m): cfg for m, cfg in best.items()}}
    entries[key] = {m: cfg for m, cfg in merged.items() if _row_key(m) is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"humming": _humming_version(), **meta, "entries": entries},
                              indent=1, sort_keys=True))
    os.replace(tmp, path)  # never a half-written file
    _LOADED.pop(str(path), None)
