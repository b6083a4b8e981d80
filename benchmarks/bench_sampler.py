"""Throughput of the temporal neighbour sampler: roots sampled per second.

A synthetic stream (skewed node popularity, time-sorted events) is indexed once; then
batches of B training events are walked at random offsets, each giving B * (2 + neg)
roots (src, dst, negatives) at the event times, as the trainer samples them.

Usage:
    python benchmarks/bench_sampler.py                     # CPU, 10^6 events, 10^4 nodes
    python benchmarks/bench_sampler.py --device cuda --iters 500
    python benchmarks/bench_sampler.py --fanouts 10 10     # two layers
    python benchmarks/bench_sampler.py --device cuda --cuda-graph   # one graph replay per batch

Numbers, not a test: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from sven.pipeline.sampler import TCSR, TemporalSampler


def synth_events(
    num_events: int, num_nodes: int, float_time: bool, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(E,) int32 src, dst and sorted times; node popularity ~ Zipf so degrees are skewed."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_nodes + 1) ** 0.8
    weights /= weights.sum()
    src = rng.choice(num_nodes, num_events, p=weights).astype(np.int32)
    dst = rng.choice(num_nodes, num_events, p=weights).astype(np.int32)
    t = np.sort(rng.integers(0, num_events // 2, num_events))  # many ties
    return src, dst, (t.astype(np.float64) if float_time else t)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(
    sampler: TemporalSampler, nodes: torch.Tensor, times: torch.Tensor, warmup: int, seed: int
) -> float:
    """Seconds for sampling batches ``warmup:`` of (n_batches, R) ``nodes``/``times``."""
    device = nodes.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for i in range(warmup):
        sampler.sample(nodes[i], times[i], gen)
    sync(device)
    start = time.perf_counter()
    for i in range(warmup, nodes.shape[0]):
        sampler.sample(nodes[i], times[i], gen)
    sync(device)
    return time.perf_counter() - start


def time_graph_replay(
    sampler: TemporalSampler, nodes: torch.Tensor, times: torch.Tensor, warmup: int
) -> float:
    """Like ``time_eager``, but sample() is captured once as a CUDA graph and replayed.

    Each batch is copied into the captured input buffers, as a captured training step
    would receive it.
    """
    static_nodes, static_times = nodes[0].clone(), times[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            sampler.sample(static_nodes, static_times)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sampler.sample(static_nodes, static_times)
    sync(nodes.device)
    start = time.perf_counter()
    for i in range(warmup, nodes.shape[0]):
        static_nodes.copy_(nodes[i])
        static_times.copy_(times[i])
        graph.replay()
    sync(nodes.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=600, help="events per batch")
    parser.add_argument("--neg", type=int, default=1, help="negatives per event")
    parser.add_argument("--fanouts", type=int, nargs="+", default=[10])
    parser.add_argument("--strategies", nargs="+", default=["recent", "uniform"])
    parser.add_argument("--iters", type=int, default=50, help="timed batches per strategy")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--float-time", action="store_true", help="float64 instead of int64 t")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="capture sample() once and replay it per batch (uniform then draws from the "
        "default CUDA generator, which capture registers itself)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON line per strategy")
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.cuda_graph and device.type != "cuda":
        parser.error("--cuda-graph needs --device cuda")
    src, dst, t = synth_events(args.events, args.nodes, args.float_time, args.seed)

    sync(device)
    start = time.perf_counter()
    tcsr = TCSR.from_events(src, dst, t, args.nodes, device)
    sync(device)
    build_s = time.perf_counter() - start

    # Pre-built batches on the device, so only sampling is timed.
    rng = np.random.default_rng(args.seed + 1)
    n_batches = args.warmup + args.iters
    starts = rng.integers(0, args.events - args.batch, n_batches)
    idx = starts[:, None] + np.arange(args.batch)
    neg = rng.integers(0, args.nodes, (n_batches, args.batch * args.neg))
    nodes = torch.tensor(np.concatenate([src[idx], dst[idx], neg], axis=1), device=device)
    times = torch.tensor(np.tile(t[idx], (1, 2 + args.neg)), device=device)
    roots_per_batch = nodes.shape[1]

    print(
        f"device={device} threads={torch.get_num_threads()} events={args.events} "
        f"nodes={args.nodes} max_degree={int(tcsr.degree().max())} t={tcsr.ts.dtype} "
        f"fanouts={args.fanouts} roots/batch={roots_per_batch} build={build_s:.2f}s"
    )
    for strategy in args.strategies:
        sampler_start = time.perf_counter()
        sampler = TemporalSampler(tcsr, args.fanouts, strategy)
        sync(device)
        init_s = time.perf_counter() - sampler_start
        if args.cuda_graph:
            elapsed = time_graph_replay(sampler, nodes, times, args.warmup)
        else:
            elapsed = time_eager(sampler, nodes, times, args.warmup, args.seed)
        result = {
            "strategy": strategy,
            "device": str(device),
            "cuda_graph": args.cuda_graph,
            "fanouts": args.fanouts,
            "roots_per_batch": roots_per_batch,
            "roots_per_s": roots_per_batch * args.iters / elapsed,
            "ms_per_batch": 1e3 * elapsed / args.iters,
            "sampler_init_s": init_s,
            "build_s": build_s,
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{strategy:8s} {result['roots_per_s'] / 1e6:8.2f} M roots/s  "
                f"{result['ms_per_batch']:7.3f} ms/batch  (sampler init {init_s:.2f}s)"
            )


if __name__ == "__main__":
    main()
