"""Multiple-choice scoring through /v1/completions (issue 47), against a running server, printed as text:

    python benchmarks/scoring_throughput.py URL [--items 200] [--choices 4] [--tokens 100] [--concurrency 8]

lm-evaluation-harness's log-likelihood requests: one request per item with its `choices` prompts (question +
one answer, ~`tokens` tokens each), `echo: true, logprobs: 1, max_tokens: 0`. The same prompts are also sent
as plain prefills (`max_tokens: 1`, no logprobs), block by block, plain and scored back to back, so the prefill
slowdown of requests that ask for prompt logprobs is measured against those that do not, in the same run. Start the server
with `--no-enable-prefix-caching`: scoring requests never read the prefix cache (they need every position),
plain ones would, and the comparison would measure the cache instead.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

WORDS = ("the of and to in is was for on that with as by at from his her an which are were this be had not but "
         "river mountain city history science answer question energy planet music language market winter animal "
         "garden student teacher ocean forest machine letter number colour island kingdom").split()


def items(n: int, choices: int, tokens: int, seed: int = 0) -> list[list[str]]:
    """n items of `choices` prompts: a shared question of ~0.8 x tokens words, then each answer."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(int(tokens * 0.8)))
        out.append([f"Question {i}: {q}? Answer: " + " ".join(rng.choice(WORDS) for _ in range(tokens // 5))
                    for _ in range(choices)])
    return out


async def run_round(client: httpx.AsyncClient, url: str, work: list[list[str]], scored: bool,
                    concurrency: int) -> tuple[float, int]:
    """(seconds, prompt tokens) of sending every item once."""
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(prompts: list[str]) -> None:
        nonlocal tokens
        body = {"prompt": prompts, "temperature": 0.0}
        body.update({"echo": True, "logprobs": 1, "max_tokens": 0} if scored else {"max_tokens": 1})
        async with sem:
            r = await client.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        out = r.json()
        if scored:
            lp = out["choices"][0]["logprobs"]["token_logprobs"]
            assert lp[0] is None and all(v is not None for v in lp[1:])
        tokens += out["usage"]["prompt_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in work))
    return time.perf_counter() - t0, tokens


async def main(args: argparse.Namespace) -> None:
    work = items(args.items, args.choices, args.tokens)
    blocks = [work[i:i + args.block] for i in range(0, len(work), args.block)]
    secs: dict[bool, list[float]] = {False: [], True: []}  # per block
    tokens = {False: 0, True: 0}
    async with httpx.AsyncClient(timeout=3600) as client:
        await run_round(client, args.url, work[:4], True, args.concurrency)  # warm-up: both paths
        await run_round(client, args.url, work[:4], False, args.concurrency)
        # Block by block, plain and scored back to back (the first of the pair alternating): a loaded
        # machine's slow minutes fall on both kinds alike.
        for b, block in enumerate(blocks):
            for scored in ((False, True) if b % 2 == 0 else (True, False)):
                t, n = await run_round(client, args.url, block, scored, args.concurrency)
                secs[scored].append(t)
                tokens[scored] += n
    n_prompts = args.items * args.choices
    print(f"{args.items} items x {args.choices} choices ({n_prompts} prompts, {tokens[True] / n_prompts:.0f} prompt "
          f"tokens each), concurrency {args.concurrency}, {len(blocks)} blocks of {args.block} items, plain and "
          f"scored back to back:")
    for scored, name in ((False, "plain prefill (max_tokens 1)"), (True, "scored (echo, logprobs 1, max_tokens 0)")):
        total = sum(secs[scored])
        print(f"  {name}: {total:.1f} s: {args.items / total:.2f} items/s, {n_prompts / total:.1f} prompts/s, "
              f"{tokens[scored] / total:.0f} prompt tok/s")
    ratios = sorted(s / p for s, p in zip(secs[True], secs[False]))
    print(f"  prefill slowdown with prompt logprobs: {sum(secs[True]) / sum(secs[False]):.2f}x overall; per block "
          f"median {statistics.median(ratios):.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--tokens", type=int, default=100, help="about this many tokens per prompt")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--block", type=int, default=20, help="items per plain / scored pair")
    asyncio.run(main(p.parse_args()))
