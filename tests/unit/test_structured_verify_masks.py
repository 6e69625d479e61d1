"""The masks of a verification step's positions for a grammar request (StructuredOutputManager.bitmasks):
row i + 1 is the grammar's mask after the first i + 1 drafts, and the matcher ends where it started."""
from __future__ import annotations

import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.model_factory import SMOLLM2_VOCAB_SIZE, smollm2_tokenizer_dir
from vllm_neuron.structured_output.manager import StructuredOutputManager


def _allowed(row: np.ndarray, tok: int) -> bool:
    return bool((int(row[tok >> 5]) >> (tok & 31)) & 1)


@pytest.fixture(scope="module")
def manager():
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    m = StructuredOutputManager(tok, SMOLLM2_VOCAB_SIZE)
    yield m, tok
    m.shutdown()


def _ready(m: StructuredOutputManager, rid: str, choices: list[str]) -> None:
    m.submit(rid, {"choice": choices})
    for _ in range(500):
        ready, err, _ = m.status(rid)
        assert err is None
        if ready:
            return
        time.sleep(0.01)
    raise AssertionError("grammar did not compile")


def test_masks_walk_the_drafts_and_roll_back(manager):
    m, tok = manager
    _ready(m, "r", ["alpha beta gamma", "delta"])
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    assert len(ids) >= 3
    before = m.bitmask("r")
    masks = m.bitmasks("r", ids[:3])
    assert masks.shape == (4, m.num_words)
    assert (masks[0] == before).all()
    for i in range(3):
        assert _allowed(masks[i], ids[i]) and masks[i].tolist() != masks[i + 1].tolist()
    assert (m.bitmask("r") == before).all()  # rolled back: the step's tokens are accepted as usual
    # A draft the grammar refuses: the row before it forbids it and later rows allow everything.
    junk = tok.encode(" zzz", add_special_tokens=False)[0]
    masks = m.bitmasks("r", [ids[0], junk, ids[1]])
    assert _allowed(masks[0], ids[0]) and not _allowed(masks[1], junk)
    assert (masks[2] == -1).all() and (masks[3] == -1).all()
    assert (m.bitmask("r") == before).all()
    # Through the end of the grammar: after the stop token only stop tokens are allowed.
    eos = tok.eos_token_id
    d = tok.encode("delta", add_special_tokens=False)
    masks = m.bitmasks("r", d + [eos, 7])
    assert _allowed(masks[len(d)], eos)
    assert (masks[len(d) + 1] == m._stop_only).all() and (masks[len(d) + 2] == m._stop_only).all()
    m.accept("r", ids)
    assert not (m.bitmask("r") == before).all()
