"""The wide tuner's search space (:mod:`qerl.kernels.tune`): humming tuning configs around a
heuristic choice -- its one-step neighbours, tiles of both MMA kinds, the variations of a tile and
their combination. Plain dicts in and out, no humming or GPU needed."""

from __future__ import annotations

from collections.abc import Iterable

BLOCK_N, BLOCK_K = (64, 128, 256, 512), (32, 64, 128, 256)  # the wide search's tiles
# the pipeline's unrolling (default: every stage) and the epilogue's shared memory and chunking
# were added after run 62 (humming's own sampler varies them too; its late A-scale load needs
# per-group input scales, which bf16 activations never have: humming refused it, run 63)
AROUND = {"num_stages": (3, 4, 6, 8), "num_ctas_per_sm": (1, 2, 3, 4),
          "use_stream_k": (True, False), "wgmma_split_issue_wait": (True,),
          "evict_weights_first": (True,), "producer_registers": (40,), "multi_cast_size_a": (2,),
          "producer_stage_unroll": (1, 2), "consumer_stage_unroll": (1, 2),
          "smem_reuse_mode": ("none", "last_stage"), "output_chunk_rows": (32, 64)}
WGMMA_ONLY = ("wgmma_split_issue_wait", "wgmma_use_late_as", "use_f16_accum")
WARP_SPEC_ONLY = ("producer_registers", "multi_cast_size_a")
TOP = 2


def neighbours(cfg: dict) -> list[dict]:
    """``cfg`` and its one-step variations (the near search's candidates around a heuristic
    choice)."""
    out = [cfg]
    for key, values in (("num_stages", (3, 4, 6)), ("num_ctas_per_sm", (1, 2)),
                        ("use_stream_k", (True, False))):
        out += [{**cfg, key: v} for v in values if cfg.get(key) != v]
    bs, ws = list(cfg["block_shape"]), list(cfg["warp_shape"])
    out += [{**cfg, "block_shape": [bs[0], bn, bs[2]]} for bn in (128, 256) if bn != bs[1]]
    out += [{**cfg, "block_shape": [bs[0], bs[1], bk],
             "warp_shape": [ws[0], ws[1], bk] if ws[2] == bs[2] else ws}
            for bk in (64, 128) if bk != bs[2]]
    return out


def m_tile(m: int) -> int:
    """The smallest M tile that holds ``m`` rows: a power of two, at least 8."""
    return max(8, 1 << (max(1, m) - 1).bit_length())


def _kind(cfg: dict, mma: str) -> dict:
    """``cfg`` as MMA kind ``mma``: ``wgmma`` with TMA and a producer warp group, ``mma`` with
    neither and without the wgmma-only and warp-specialisation-only fields."""
    wg = mma == "wgmma"
    drop = set(WARP_SPEC_ONLY) | (set() if wg else set(WGMMA_ONLY))
    return {**{k: v for k, v in cfg.items() if k not in drop}, "mma_type": mma, "use_tma": wg,
            "use_warp_spec": wg}


def tile_candidates(base: dict, m: int) -> list[dict]:
    """Stage 1 of the wide search: ``base`` (a heuristic choice) with every MMA kind, block N and
    block K; the M tile holds ``m`` rows; warps as humming lays them out (``mma``: 64 columns and
    32 K a warp; ``wgmma``: 32 columns and up to 64 K a warp)."""
    bm = m_tile(m)
    out = []
    for mma in ("mma", "wgmma"):
        wn, wk = (32, 64) if mma == "wgmma" else (64, 32)
        for bn in BLOCK_N:
            for bk in BLOCK_K:
                out.append({**_kind(base, mma), "block_shape": [bm, bn, bk],
                            "warp_shape": [bm, wn, min(bk, wk)]})
    return out


def around(cfg: dict) -> list[dict]:
    """Stage 2 of the wide search: ``cfg``'s one-step variations -- warp N (32, 64), two warps
    along M or one, warp K (32, 64, 128; the block K is kept), and each value of :data:`AROUND`
    that applies to its MMA kind (``wgmma_*``: wgmma; producer registers and multicast: with a
    producer warp group; a stage unroll only below the config's stages)."""
    bm, _, bk = cfg["block_shape"]
    wm, wn, wk = cfg["warp_shape"]
    warps = {(wm, v, wk) for v in (32, 64)} | {(wm, wn, v) for v in (32, 64, 128) if v <= bk}
    if bm >= 16:
        warps.add((bm // 2 if wm == bm else bm, wn, wk))
    out = [{**cfg, "warp_shape": list(w)} for w in sorted(warps) if w != (wm, wn, wk)]
    for key, values in AROUND.items():
        if (key in WGMMA_ONLY and cfg.get("mma_type") != "wgmma") or \
                (key in WARP_SPEC_ONLY and not cfg.get("use_warp_spec")):
            continue
        out += [{**cfg, key: v} for v in values if cfg.get(key) != v
                and not (key.endswith("_stage_unroll") and v >= cfg.get("num_stages", 2))]
    return out


def combine(cfg: dict, timed: Iterable[tuple[float, dict]], base_us: float) -> dict | None:
    """Stage 3 of the wide search: ``cfg`` with the change of every stage-2 variation of it that
    ran faster than ``base_us`` (its own time), the fastest variation's value where two changed
    the same field; ``None`` when fewer than two changes helped (stage 2 already timed that)."""
    merged, changed = dict(cfg), set()
    for us, var in sorted(timed, key=lambda t: t[0]):
        diff = {k: v for k, v in var.items() if cfg.get(k) != v}
        if us >= base_us or not diff or set(diff) & changed:
            continue
        merged.update(diff)
        changed |= set(diff)
    return merged if len(changed) >= 2 else None


def _tile(cfg: dict) -> tuple:  # what stage 1 varies
    return cfg.get("mma_type"), tuple(cfg["block_shape"]), tuple(cfg["warp_shape"])
