"""KV block transfer between two processes: TcpConnector's transport against NixlConnector's, the same blocks.

    python benchmarks/kv_transport.py [--layers 28] [--kv-heads 8] [--head-dim 128] [--blocks 64] [--repeat 5]

A child process plays one prefill rank: its paged K/V pool (fp32, block size 16), a block server on a free port
holding blocks 0..N-1 of one request, and a NIXL agent over the pool (with the optional nixl package). The parent
plays the decode rank and reads all N blocks into its own pool, each way end to end as the connector does it: TCP
(header + one frame per tensor, then the scatter into the paged pool) and NIXL (`nixl_meta` under the secret, the
READ straight into the pool, the hold checked again); once with whole rows (same TP on both sides) and once
with half the heads (a TP=2 reader of a TP=1 source: per-slot descriptors). Prints the best and median bytes/s of
`--repeat` reads of each, and checks the bytes read equal the source's.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch

from vllm_neuron.distributed.kv_transfer.block_io import gather_blocks, scatter_blocks
from vllm_neuron.distributed.kv_transfer.head_split import HeadSlice
from vllm_neuron.distributed.kv_transfer.tcp import BlockClient, BlockServer

BS = 16


def _pool(args, heads: int, fill: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = ((args.blocks + 1) * BS, heads, args.head_dim)

    def make(seed: int) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) if fill else torch.zeros(shape)
    return [(make(2 * i), make(2 * i + 1)) for i in range(args.layers)]


def _source(args, port: int, ready, stop) -> None:
    kv = _pool(args, args.kv_heads, True)
    ops, agent = None, None
    if args.nixl:
        from vllm_neuron.distributed.kv_transfer.nixl import NixlAgent

        agent = NixlAgent(kv, BS, "src", 0)
        ops = {"nixl_meta": agent.meta_reply}
    server = BlockServer("127.0.0.1", port, kv, BS, "src", ops)
    server.hold("r", "sec", [list(range(args.blocks))])
    ready.set()
    stop.wait()
    server.close()
    if agent is not None:
        agent.close()


def _time(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from vllm_neuron.config.kv_transfer import nixl_installed

    args.nixl = nixl_installed()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_source, args=(args, port, ready, stop), daemon=True)
    child.start()
    ready.wait(120)
    addr, blocks = f"127.0.0.1:{port}", list(range(args.blocks))
    local_ids = [b + 1 for b in blocks]  # other block ids than the source's, as a reader's pool gives
    reference = _pool(args, args.kv_heads, True)
    client = BlockClient()
    rows = []
    try:
        for label, heads, start in [("whole rows", args.kv_heads, 0), ("half the heads", args.kv_heads // 2,
                                                                        args.kv_heads // 2)]:
            want = gather_blocks(reference, blocks, BS, start, heads)
            nbytes = sum(f.numel() * f.element_size() for f in want)
            tcp_kv = _pool(args, heads, False)

            def tcp() -> None:
                frames = client.read(addr, "r", "sec", "src", [blocks], (start, heads), 60)
                scatter_blocks(tcp_kv, local_ids, BS, 0, frames)

            times = {"TcpConnector": _time(tcp, args.repeat)}
            got = {"TcpConnector": gather_blocks(tcp_kv, local_ids, BS, 0, heads)}
            if args.nixl:
                from vllm_neuron.distributed.kv_transfer.nixl import NixlAgent

                nixl_kv = _pool(args, heads, False)
                reader = NixlAgent(nixl_kv, BS, "dst", 0)
                part = HeadSlice(0, start, 0, heads)
                times["NixlConnector"] = _time(lambda: reader.read(
                    client, addr, {"key": "r", "secret": "sec", "engine_id": "src"}, [(blocks, local_ids)], part, 60),
                    args.repeat)
                got["NixlConnector"] = gather_blocks(nixl_kv, local_ids, BS, 0, heads)
                reader.close()
            for name, ts in times.items():
                ok = all(torch.equal(a, b) for a, b in zip(got[name], want))
                rows.append((label, name, nbytes, min(ts), statistics.median(ts), ok))
    finally:
        client.close()
        stop.set()
        child.join(10)
    print(f"{args.layers} layers x K/V, {args.blocks} blocks of {BS} slots x {args.kv_heads} heads x "
          f"{args.head_dim} fp32; {args.repeat} reads each" + ("" if args.nixl else "; nixl not installed"))
    print(f"{'read':<16}{'connector':<15}{'MiB':>8}{'best ms':>10}{'median ms':>11}{'best GB/s':>11}"
          f"{'median GB/s':>13}  bytes equal")
    for label, name, nbytes, best, med, ok in rows:
        print(f"{label:<16}{name:<15}{nbytes / 2**20:>8.1f}{best * 1e3:>10.1f}{med * 1e3:>11.1f}"
              f"{nbytes / best / 1e9:>11.2f}{nbytes / med / 1e9:>13.2f}  {ok}")


if __name__ == "__main__":
    main()
