"""Runs in OpenVINO GenAI's own venv (benchmarks/peers/openvino_peer.py): reads a job as JSON on stdin
({"model_dir", "requests": [[token ids, output length], ...], "max_num_seqs", "threads", "props"}), generates every
request greedily with EOS ignored through a ContinuousBatchingPipeline on the CPU, and prints one JSON line:
{"seconds", "output_tokens", "warmup_seconds"}. Imports nothing of vllm-neuron."""
import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as genai


def main() -> None:
    job = json.load(sys.stdin)
    sched = genai.SchedulerConfig()
    sched.max_num_seqs = job["max_num_seqs"]
    sched.enable_prefix_caching = False  # random prompts share nothing; keep the work the same as ours
    sched.cache_size = 2  # GB of KV
    props = {"INFERENCE_NUM_THREADS": job["threads"]} if job.get("threads") else {}
    props.update(job.get("props") or {})
    pipe = genai.ContinuousBatchingPipeline(job["model_dir"], sched, "CPU", props)

    def configs(lengths):
        out = []
        for n in lengths:
            c = genai.GenerationConfig()
            c.max_new_tokens = n
            c.ignore_eos = True
            c.do_sample = False
            out.append(c)
        return out

    def tensors(reqs):
        return [ov.Tensor(np.array([ids], dtype=np.int64)) for ids, _ in reqs]

    reqs = job["requests"]
    t0 = time.perf_counter()
    pipe.generate(tensors(reqs[:2]), configs([o for _, o in reqs[:2]]))  # compile + first touch
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = pipe.generate(tensors(reqs), configs([o for _, o in reqs]))
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.m_generation_ids[0]) for r in results)
    print(json.dumps({"seconds": seconds, "output_tokens": tokens, "warmup_seconds": warm}))


if __name__ == "__main__":
    main()
