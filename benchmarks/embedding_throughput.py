"""Embedding throughput (issue 48's closing note): our offline `LLM.embed` against sentence-transformers'
`encode`, the same texts, in one run; sequences/s, tokens/s and how far apart the embeddings are.

    python benchmarks/embedding_throughput.py                          # Qwen3-Embedding-0.6B's shape, random weights
    python benchmarks/embedding_throughput.py --bge-small                 # bge-small-en-v1.5's shape (BertModel)
    python benchmarks/embedding_throughput.py --model /path/to/Qwen3-Embedding-0.6B
    python benchmarks/embedding_throughput.py --num-prompts 32 --input-len 64 --quick-shape   # a smoke run

Without --model, a Qwen3Model of Qwen3-Embedding-0.6B's shape (28 layers, hidden 1024, 16 query / 8 KV heads of
128, MLP 3072) with seeded random weights and the bundled SmolLM2 tokenizer is written to a temporary folder,
with the sentence-transformers files (last-token pooling, Normalize) both engines read. The prompts are random
token texts of exactly --input-len tokens (vllm_neuron/benchmarks/prompts.py, what `bench serve` sends).

sentence-transformers is never installed into our venv: like compare_peers.py's peers it lives in its own venv
under --cache-dir (default ~/.cache/vllm_neuron_peers/sentence-transformers), which sees our venv's packages
(torch, transformers) through a .pth file, so only what they lack is installed. Each engine runs in a process
of its own, one after the other, with the same thread count; a warm-up batch runs first and is not timed.
"""
from __future__ import annotations

import argparse
import json
from importlib import metadata
import os
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers.install import InstallContext, default_cache_dir, ensure_installed, run_logged  # noqa: E402

ST_VERSION = "6.0.1"
# (huggingface-hub is left to its own range: sentence-transformers 6 wants < 2.)
_SHARED_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy")
QWEN3_EMBEDDING_0_6B = dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=True)
# bge-small-en-v1.5's shape (BertModel, CLS pooling, normalized); the vocabulary is the bundled tokenizer's.
BGE_SMALL = dict(num_hidden_layers=12, hidden_size=384, intermediate_size=1536, num_attention_heads=12,
                 max_position_embeddings=512)
QUICK_SHAPE = dict(QWEN3_EMBEDDING_0_6B, num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)

# Runs inside the sentence-transformers venv: encode the texts, print timings and the embeddings' file.
_ST_WORKER = r"""
import json, sys, time, numpy as np, torch
from sentence_transformers import SentenceTransformer
cfg = json.load(open(sys.argv[1]))
torch.set_num_threads(cfg["threads"])
model = SentenceTransformer(cfg["model"], device="cpu", model_kwargs={"torch_dtype": getattr(torch, cfg["dtype"])})
texts = cfg["texts"]
model.encode(texts[:cfg["batch_size"]], batch_size=cfg["batch_size"])
t0 = time.perf_counter()
emb = model.encode(texts, batch_size=cfg["batch_size"], convert_to_numpy=True)
seconds = time.perf_counter() - t0
np.save(cfg["out"], emb.astype(np.float32))
print(json.dumps({"seconds": seconds}))
"""

# Runs in our venv: LLM.embed over the same texts.
_OURS_WORKER = r"""
import json, sys, time, numpy as np, torch
cfg = json.load(open(sys.argv[1]))
torch.set_num_threads(cfg["threads"])
from vllm_neuron import LLM
llm = LLM(cfg["model"], runner="pooling", dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
          max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
          enforce_eager=cfg["eager"])
texts = cfg["texts"]
llm.embed(texts[:cfg["max_num_seqs"]], use_tqdm=False)
t0 = time.perf_counter()
outs = llm.embed(texts, use_tqdm=False)
seconds = time.perf_counter() - t0
np.save(cfg["out"], np.array([o.outputs.embedding for o in outs], dtype=np.float32))
print(json.dumps({"seconds": seconds, "tokens": sum(len(o.prompt_token_ids) for o in outs)}))
"""


def install_sentence_transformers(ctx: InstallContext) -> dict:
    venv = os.path.join(ctx.peer_dir, "venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        run_logged([sys.executable, "-m", "venv", venv], ctx.log_path)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Our venv's torch and transformers, seen (never changed) from the peer's venv: no second torch download.
    with open(os.path.join(site, "vllm_neuron_venv.pth"), "w", encoding="utf-8") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    # ... and kept at our versions, so both engines run the same torch and transformers.
    constraints = os.path.join(ctx.peer_dir, "constraints.txt")
    with open(constraints, "w", encoding="utf-8") as f:
        f.writelines(f"{name}=={metadata.version(name)}\n" for name in _SHARED_PACKAGES)
    run_logged([python, "-m", "pip", "install", "-c", constraints, f"sentence-transformers=={ST_VERSION}"],
               ctx.log_path)
    check = "import sentence_transformers as s, torch; print(s.__version__, torch.__version__)"
    run_logged([python, "-c", check], ctx.log_path)
    return {"python": python, "version": f"sentence-transformers {ST_VERSION}"}


def write_random_model(folder: str, shape: dict, bert: bool = False) -> str:
    """A Qwen3Model (or, with `bert`, a BertModel) of `shape` with seeded random weights, the bundled tokenizer
    and sentence-transformers files."""
    import torch
    import transformers

    from vllm_neuron.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    if tok.pad_token is None:  # sentence-transformers pads its batches
        tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    if bert:
        cfg = transformers.BertConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, architectures=["BertModel"],
                                      **shape)
        transformers.BertModel(cfg).save_pretrained(folder)
    else:
        cfg = transformers.Qwen3Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                       architectures=["Qwen3Model"], **shape)
        transformers.Qwen3Model(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    write_sentence_transformers_files(folder, shape["hidden_size"], "cls_token" if bert else "lasttoken")
    return folder


def write_sentence_transformers_files(folder: str, hidden: int, mode: str = "lasttoken") -> None:
    """`mode` pooling then Normalize (Qwen3-Embedding's modules: last token; bge's: CLS), unless the folder has
    its own."""
    if os.path.exists(os.path.join(folder, "modules.json")):
        return
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(folder, "2_Normalize"), exist_ok=True)
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": hidden, "pooling_mode_lasttoken": mode == "lasttoken",
                   "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": mode == "cls_token",
                   "include_prompt": True}, f)


def run_worker(python: str, source: str, cfg: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        out = subprocess.run([python, "-c", source, f.name], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise RuntimeError(f"worker exited {out.returncode}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="an HF folder of a decoder embedder (default: a random "
                   "Qwen3-Embedding-0.6B-shaped Qwen3Model)")
    p.add_argument("--quick-shape", action="store_true", help="a 2-layer model instead of the 0.6B shape (smoke)")
    p.add_argument("--bge-small", action="store_true", help="a random BertModel of bge-small-en-v1.5's shape (CLS "
                   "pooling) instead of the Qwen3 one")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--eager", action="store_true", help="our engine uncompiled")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--cache-dir", default=default_cache_dir())
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    st = ensure_installed("sentence-transformers", install_sentence_transformers, args.cache_dir)
    work = tempfile.mkdtemp(prefix="embed_bench_")
    shape_name = "bge-small shape (BertModel)" if args.bge_small else \
        "quick shape" if args.quick_shape else "Qwen3-Embedding-0.6B shape"
    model = args.model or write_random_model(
        os.path.join(work, "model"), BGE_SMALL if args.bge_small else QUICK_SHAPE if args.quick_shape
        else QWEN3_EMBEDDING_0_6B, bert=args.bge_small)
    if args.model:
        write_sentence_transformers_files(model, json.load(open(os.path.join(model, "config.json")))["hidden_size"])
    from transformers import AutoTokenizer

    from vllm_neuron.benchmarks.prompts import sample_random_requests

    tok = AutoTokenizer.from_pretrained(model)
    texts = [r.prompt for r in sample_random_requests(tok, args.num_prompts, args.input_len, 1, seed=0)]
    common = {"model": model, "texts": texts, "threads": args.threads, "dtype": args.dtype}
    rows = {}
    ours = run_worker(sys.executable, _OURS_WORKER, {
        **common, "out": os.path.join(work, "ours.npy"), "max_model_len": 512 if args.bge_small else max(512, args.input_len * 2),
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "eager": args.eager})
    rows["vllm-neuron LLM.embed"] = ours
    ref = run_worker(st.info["python"], _ST_WORKER, {**common, "out": os.path.join(work, "st.npy"),
                                                     "batch_size": args.batch_size})
    rows[f"{st.info['version']} encode"] = {**ref, "tokens": ours["tokens"]}
    import numpy as np

    diff = float(np.abs(np.load(os.path.join(work, "ours.npy")) - np.load(os.path.join(work, "st.npy"))).max())
    print(f"\n{args.num_prompts} inputs x {args.input_len} tokens, {args.dtype}, {args.threads} threads, model "
          f"{args.model or ('random ' + shape_name)}")
    print(f"{'engine':<40} {'seconds':>9} {'seq/s':>9} {'tok/s':>10}")
    result = {"max_abs_diff": diff, "engines": {}}
    for name, r in rows.items():
        seq_s, tok_s = args.num_prompts / r["seconds"], r["tokens"] / r["seconds"]
        result["engines"][name] = {"seconds": r["seconds"], "seq_per_s": seq_s, "tok_per_s": tok_s}
        print(f"{name:<40} {r['seconds']:>9.2f} {seq_s:>9.1f} {tok_s:>10.0f}")
    print(f"max |ours - sentence-transformers| over all embeddings: {diff:.2e}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
