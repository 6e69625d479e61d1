"""Multiple-choice scoring through /v1/completions (issue 47), against a running server, printed as text:

    python benchmarks/scoring_throughput.py URL [--items 200] [--choices 4] [--tokens 100] [--concurrency 8]

lm-evaluation-harness's log-likelihood requests: one request per item with its `choices` prompts (question +
one answer, ~`tokens` tokens each), `echo: true, logprobs: 1, max_tokens: 0`. The same prompts are also sent
as plain prefills (`max_tokens: 1`, no logprobs), alternating plain / scored rounds, so the prefill slowdown of
requests that ask for prompt logprobs is measured against those that do not, in the same run. Start the server
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
    async with httpx.AsyncClient(timeout=3600) as client:
        await run_round(client, args.url, work[:4], True, args.concurrency)  # warm-up: both paths
        await run_round(client, args.url, work[:4], False, args.concurrency)
        results: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for scored in (False, True):
                results[scored].append(await run_round(client, args.url, work, scored, args.concurrency))
    n_prompts = args.items * args.choices
    print(f"{args.items} items x {args.choices} choices ({n_prompts} prompts, "
          f"{results[True][0][1] / n_prompts:.0f} prompt tokens each), concurrency {args.concurrency}, "
          f"{args.rounds} rounds each, alternating:")
    rates = {}
    for scored, name in ((False, "plain prefill (max_tokens 1)"), (True, "scored (echo, logprobs 1, max_tokens 0)")):
        secs = [s for s, _ in results[scored]]
        med = statistics.median(secs)
        rates[scored] = results[scored][0][1] / med
        print(f"  {name}: median {med:.1f} s per round ({', '.join(f'{s:.1f}' for s in secs)}): "
              f"{args.items / med:.2f} items/s, {n_prompts / med:.1f} prompts/s, {rates[scored]:.0f} prompt tok/s")
    print(f"  prefill slowdown with prompt logprobs: {rates[False] / rates[True]:.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--tokens", type=int, default=100, help="about this many tokens per prompt")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    asyncio.run(main(p.parse_args()))
