"""A tiny random gpt-oss with the real o200k_harmony tokenizer, for the harmony tests.

The tokenizer is built from the o200k_base vocabulary (vllm_neuron/harmony/vocab.py finds it offline) and
harmony's special tokens (ids 199998..201087, named by openai-harmony's own encoding), once per machine,
cached under $VLLM_NEURON_TEST_CACHE like the SmolLM2 tokenizer.
"""
from __future__ import annotations

import base64
import functools
import os
import shutil
import tempfile

from tests.model_factory import _cache_root, make_tiny_model

# tiktoken's o200k_base split pattern
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
HARMONY_VOCAB = 201088
START_OF_TEXT, END_OF_TEXT, RETURN = 199998, 199999, 200002


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges in rank order: each token is the merge of the two parts its own BPE ends with."""
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min(((ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        out.append((parts[0], parts[1]))
    return out


def _build(folder: str) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vllm_neuron.harmony.vocab import FILE_NAME, _bytes_to_unicode, load_encoding, vocab_dir

    with open(os.path.join(vocab_dir(), FILE_NAME), "rb") as f:
        ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f)}
    uni = _bytes_to_unicode()
    text = lambda b: "".join(uni[x] for x in b)  # noqa: E731
    bpe = models.BPE(vocab={text(t): r for t, r in ranks.items()},
                     merges=[(text(a), text(b)) for a, b in _merges(ranks)])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    enc = load_encoding()
    specials = [enc.decode([i]) for i in range(len(ranks), HARMONY_VOCAB)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>",
                            pad_token="<|endoftext|>").save_pretrained(folder)


@functools.lru_cache(maxsize=None)
def harmony_tokenizer_dir() -> str:
    final = os.path.join(_cache_root(), "o200k_harmony_tokenizer-v1")
    if os.path.isfile(os.path.join(final, "tokenizer.json")):
        return final
    tmp = tempfile.mkdtemp(dir=_cache_root(), prefix="o200k_harmony.tmp-")
    try:
        _build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, "tokenizer.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def make_tiny_gpt_oss(path: str) -> str:
    """A tiny random gpt-oss (bf16-free fp32 weights) with the o200k_harmony tokenizer and gpt-oss's stop ids."""
    make_tiny_model(path, "gpt_oss", vocab_size=HARMONY_VOCAB, bos_token_id=START_OF_TEXT, eos_token_id=RETURN,
                    pad_token_id=END_OF_TEXT, generation_config={"bos_token_id": START_OF_TEXT,
                                                                 "eos_token_id": [RETURN, END_OF_TEXT, 200012],
                                                                 "pad_token_id": END_OF_TEXT})
    for name in os.listdir(path):  # the SmolLM2 tokenizer files make_tiny_model copied
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            os.remove(os.path.join(path, name))
    src = harmony_tokenizer_dir()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), os.path.join(path, name))
    return path
