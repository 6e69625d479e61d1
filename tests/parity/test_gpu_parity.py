"""The parity checks on CUDA (run with `pytest -m gpu` on a machine with a GPU; skipped elsewhere)."""
from __future__ import annotations

import pytest

from tests.parity.test_model_parity import (LLAMA_LENGTHS, _assert_tokens, _llama_engine,  # noqa: F401
                                            _llama_run, llama_dir, llama_reference)

pytestmark = pytest.mark.engine


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
def test_cuda_greedy_matches_transformers(llama_dir, llama_reference, eager, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    llm = _llama_engine(llama_dir, device="cuda", enforce_eager=eager, max_num_seqs=4,
                        additional_config={"neuron_config": {"num_batched_tokens_buckets": [64, 128],
                                                             "num_seqs_buckets": [2, 4]}})
    assert llm.llm_engine.core.device.type == "cuda"
    _assert_tokens(_llama_run(llm), llama_reference[0], LLAMA_LENGTHS)
