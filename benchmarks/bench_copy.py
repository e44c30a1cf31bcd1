"""kvtier's device <-> host copies against torch's own copy of the same bytes.

For 16-token blocks of 8B- and 70B-shaped models (bf16, 8 KV heads of 128), in each
engine layout (kvtier's per-layer and cross-layer, and vLLM's pages), runs of 1 to 512
blocks go device -> CPU tier (a store) and back (a load) through the CPU tier's handler
(`HostSlotHandler`: its copy streams, events and pinned slots on CUDA, and per job
one copy kernel or one DMA per segment and run, whichever it predicts faster), into
consecutive slots from device blocks that are consecutive too, or scattered over the
pool as an engine's blocks are after a while (`--patterns`),
and the same number of bytes goes through one `copy_` between a contiguous device
buffer and a pinned host one: on a GPU, the physical limit of the link. Each figure is
the median of `--repeats` timed copies, each side taking turns to go first; every
layout's stored and loaded bytes are compared with the device's afterwards.

    python -m benchmarks.bench_copy [--quick] [--device cuda|cpu] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_result
from kvtier.offload.mediums import CPULoadStoreSpec
from kvtier.store.layout import KVLayout
from kvtier.store.memory import MemoryStore
from kvtier.transfer.cuda_copy import prefer_kernel
from kvtier.transfer.device import DeviceKV, allocate_kv_caches
from kvtier.transfer.handlers import HostSlotHandler
from kvtier.transfer.pages import PagedDeviceKV, allocate_pages

MODELS = {
    "8b": KVLayout(num_layers=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16"),
    "70b": KVLayout(num_layers=80, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16"),
}
LAYOUTS = ("per_layer", "cross_layer", "pages")
PATTERNS = ("consecutive", "scattered")
TARGET_RATIO = 0.9  # of the raw copy's bytes per second ...
TARGET_MIN_BLOCKS = 32  # ... for runs of this many blocks or more


def engine_kv(model: KVLayout, layout: str, num_blocks: int, device: torch.device) -> DeviceKV:
    """A cache of `model` in `layout` on `device`, filled with random bytes."""
    if layout == "pages":
        plane = model.block_size * model.num_kv_heads * model.head_size * model.itemsize
        paged = KVLayout(model.num_layers, 1, plane // model.block_size, model.block_size, "uint8")
        kv: DeviceKV = PagedDeviceKV(paged, allocate_pages(paged, num_blocks, device))
    else:
        own = dataclasses.replace(model, per_layer=layout == "per_layer")
        kv = DeviceKV(own, allocate_kv_caches(own, num_blocks, device))
    for cache in kv.caches:
        cache.view(torch.uint8).random_(0, 256)
    return kv


class Clock:
    """Times a copy to its completion: on CUDA, its stream's event has completed."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]

    def raw(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        """torch's own copy of `src` into `dst` (pinned on the host side), on a side stream."""
        start = time.perf_counter()
        if self.stream is None:
            dst.copy_(src)
            return time.perf_counter() - start
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.stream)
        done.synchronize()
        return time.perf_counter() - start

    @staticmethod
    def call(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()  # kvtier's handler returns once its copy has completed
        return time.perf_counter() - start


def measure(
    model_name: str,
    layout: str,
    pattern: str,
    runs: list[int],
    repeats: int,
    device: torch.device,
    raw_device: torch.Tensor,
    raw_host: torch.Tensor,
) -> list[dict[str, Any]]:
    model = MODELS[model_name]
    max_n = max(runs)
    kv = engine_kv(model, layout, max_n, device)
    store = MemoryStore(kv.layout, max_n, pin_memory=device.type == "cuda")
    handler = HostSlotHandler(kv, store)
    clock = Clock(device)
    bpb = kv.layout.bytes_per_block
    rows = []
    pool = np.arange(max_n, dtype=np.int64)
    if pattern == "scattered":
        pool = np.random.default_rng(n_seed(model_name, layout)).permutation(max_n)
    for n in runs:
        ids = pool[:n].copy()
        spec = CPULoadStoreSpec(np.arange(n, dtype=np.int64))
        size = n * bpb
        dev, host = raw_device[:size], raw_host[:size]
        sides: dict[str, Callable[[], float]] = {
            # each job records its ordering event, as the worker does at submission
            "kvtier_d2h": lambda ids=ids, spec=spec: clock.call(
                lambda: handler.store(ids, spec, kv.record_compute())
            ),
            "raw_d2h": lambda dev=dev, host=host: clock.raw(host, dev),
            "kvtier_h2d": lambda ids=ids, spec=spec: clock.call(
                lambda: handler.load(spec, ids, kv.record_compute())
            ),
            "raw_h2d": lambda dev=dev, host=host: clock.raw(dev, host),
        }
        for side in sides.values():  # warm-up: the same for both
            side()
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(repeats):  # kvtier first on even repeats, torch first on odd ones
            order = (
                list(sides) if r % 2 == 0 else ["raw_d2h", "kvtier_d2h", "raw_h2d", "kvtier_h2d"]
            )
            for name in order:
                times[name].append(sides[name]())
        kernel = handler._kernel is not None and (
            handler._kernel_always or prefer_kernel(ids, np.arange(n), len(kv.segments), bpb)
        )
        row: dict[str, Any] = {
            "model": model_name,
            "layout": layout,
            "pattern": pattern,
            "blocks": n,
            "bytes": size,
            "path": "kernel" if kernel else ("dma" if device.type == "cuda" else "cpu"),
        }
        for direction in ("d2h", "h2d"):
            ours = size / statistics.median(times[f"kvtier_{direction}"])
            raw = size / statistics.median(times[f"raw_{direction}"])
            row[direction] = {"kvtier_gbps": ours / 1e9, "raw_gbps": raw / 1e9, "ratio": ours / raw}
        rows.append(row)
    wrong = wrong_bytes(kv, store, handler, pool)
    for row in rows:
        row["wrong_bytes"] = wrong
    handler.close()
    return rows


def n_seed(model_name: str, layout: str) -> int:
    """A fixed seed per configuration (the scattered ids are the same every run)."""
    return sum(map(ord, model_name + layout))


def wrong_bytes(
    kv: DeviceKV, store: MemoryStore, handler: HostSlotHandler, ids: np.ndarray[Any, Any]
) -> dict[str, int]:
    """Bytes that differ after a store of blocks `ids` into slots 0.., and after loading
    them back into a cleared cache (compared on the device, segment by segment)."""
    slots = np.arange(len(ids), dtype=np.int64)
    spec = CPULoadStoreSpec(slots)
    handler.store(ids, spec, kv.record_compute())
    index = torch.from_numpy(ids).to(kv.device)
    expected = [seg.index_select(0, index) for seg in kv.segments]
    host = [seg[: len(ids)] for seg in store.segments()]
    stored = sum(int((h.to(e.device) != e).sum()) for h, e in zip(host, expected, strict=True))
    for cache in kv.caches:
        cache.zero_()
    handler.load(spec, ids, kv.record_compute())  # after the zeroing above
    loaded = sum(
        int((seg.index_select(0, index) != e).sum())
        for seg, e in zip(kv.segments, expected, strict=True)
    )
    return {"store": stored, "load": loaded}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The target: >= 90% of the raw copy both ways for runs of 32 blocks or more."""
    judged = [r for r in rows if r["blocks"] >= TARGET_MIN_BLOCKS]
    worst = {d: min((r[d]["ratio"] for r in judged), default=float("nan")) for d in ("d2h", "h2d")}
    wrong = sum(r["wrong_bytes"]["store"] + r["wrong_bytes"]["load"] for r in rows)
    return {
        "worst_ratio_from_32_blocks": worst,
        "wrong_bytes": wrong,
        "target_met": bool(judged) and min(worst.values()) >= TARGET_RATIO and wrong == 0,
    }


def table(rows: list[dict[str, Any]]) -> str:
    side = f"{'GB/s':>7} {'raw':>6} {'ratio':>5}"
    lines = [
        f"{'model':5} {'layout':11} {'pattern':11} {'blocks':>6} {'MiB':>7} {'path':6}"
        f"  d2h {side}  h2d {side}"
    ]
    for r in rows:
        d, h = r["d2h"], r["h2d"]
        lines.append(
            f"{r['model']:5} {r['layout']:11} {r['pattern']:11} {r['blocks']:>6} "
            f"{r['bytes'] / 2**20:>7.1f} {r['path']:6}  "
            f"    {d['kvtier_gbps']:>7.2f} {d['raw_gbps']:>6.2f} {d['ratio']:>5.2f}  "
            f"    {h['kvtier_gbps']:>7.2f} {h['raw_gbps']:>6.2f} {h['ratio']:>5.2f}"
        )
    return "\n".join(lines)


def parse_list(text: str, known: tuple[str, ...] | None, what: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    if known is not None:
        bad = [t for t in items if t not in known]
        if bad:
            raise SystemExit(f"--{what}: unknown {bad}; known: {', '.join(known)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda if there is one"
    )
    parser.add_argument("--models", default="8b,70b", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}"
    )
    parser.add_argument(
        "--patterns", default=",".join(PATTERNS), help=f"comma list of {', '.join(PATTERNS)}"
    )
    parser.add_argument(
        "--runs", default=None, help="comma list of blocks per run (default 1..512, CPU 1..128)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed copies per figure (median)"
    )
    parser.add_argument("--quick", action="store_true", help="8b, runs up to 64, 3 repeats")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON path (default benchmarks/results/)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    models = parse_list("8b" if args.quick else args.models, tuple(MODELS), "models")
    layouts = parse_list(args.layouts, LAYOUTS, "layouts")
    patterns = parse_list(args.patterns, PATTERNS, "patterns")
    top = 64 if args.quick else (512 if device.type == "cuda" else 128)
    try:
        runs = [int(x) for x in parse_list(args.runs, None, "runs")] if args.runs else None
    except ValueError:
        parser.error(f"--runs {args.runs!r}: a comma list of whole numbers >= 1")
    runs = runs or [2**i for i in range(top.bit_length()) if 2**i <= top]
    if min(runs) < 1:
        parser.error(f"--runs {args.runs!r}: a comma list of whole numbers >= 1")
    repeats = args.repeats or (3 if args.quick else 7)
    if repeats < 1:
        parser.error(f"--repeats {repeats}: must be >= 1")
    rows: list[dict[str, Any]] = []
    for model_name in models:
        size = max(runs) * MODELS[model_name].bytes_per_block
        raw_device = torch.empty(size, dtype=torch.uint8, device=device).random_(0, 256)
        raw_host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        for layout in layouts:
            for pattern in patterns:
                new = measure(
                    model_name, layout, pattern, runs, repeats, device, raw_device, raw_host
                )
                print(table(new), flush=True)
                rows += new
        del raw_device, raw_host
    payload = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "repeats": repeats,
        "rows": rows,
        "summary": summarise(rows),
    }
    if args.out is None:
        path = write_result("bench_copy", payload)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        path = args.out
    print(json.dumps(payload["summary"]), f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
