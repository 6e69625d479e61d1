"""The graph list warm-up compiles: names, kinds and the shapes each graph is warmed with."""
from __future__ import annotations

from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import ModelFacts, resolve
from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.worker.model_runner_v1 import ModelRunnerV1
from vllm_neuron.worker.runner_base import ModelRunnerBase
from vllm_neuron.worker.spec_decode import make_speculator


def _runner(use_kernels: bool = False, cls: type = ModelRunnerBase, **kw) -> ModelRunnerBase:
    cfg = resolve(EngineArgs.from_kwargs(**kw), ModelFacts(2048))
    r = cls.__new__(cls)  # graph planning needs no model
    r.config = cfg
    r.kernels = KernelConfig(attention=use_kernels)  # the torch path: cached context needs prefill context graphs
    r.kinds = []
    r.speculator = make_speculator(cfg.speculative, cfg.max_model_len)
    nc = cfg.neuron_config
    r.prefill_buckets, r.decode_buckets, r.context_buckets = (nc.num_batched_tokens_buckets, nc.num_seqs_buckets,
                                                              nc.context_buckets)
    return r


def test_single_context_decode_graphs_get_max_model_len():
    r = _runner(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256)
    graphs = r.graph_names()
    assert ("decode_b4", "decode", 4, 1024) in graphs
    assert ("prefill_s256_c1024", "prefill", 256, 1024) in graphs
    assert ("prefill_s128", "prefill", 128, 0) in graphs
    assert all(ctx > 0 for _, kind, _, ctx in graphs if kind == "decode")


def test_speculative_decoding_adds_one_verify_graph_per_decode_graph():
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    r = _runner(use_kernels=True, cls=ModelRunnerV1, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=128,
                speculative_config=spec, additional_config={"neuron_config": {"num_seqs_buckets": [1, 4]}})
    graphs = r.graph_names()
    assert ("verify_b1_k4", "verify", 1, 1024) in graphs and ("verify_b4_k4", "verify", 4, 1024) in graphs
    assert len([g for g in graphs if g[1] == "verify"]) == len([g for g in graphs if g[1] == "decode"]) == 2
    r = _runner(cls=ModelRunnerV1, max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=128,
                speculative_config=spec,
                additional_config={"neuron_config": {"decode_context_length_buckets": [256],
                                                     "num_seqs_buckets": [2]}})
    assert [g[0] for g in r.graph_names() if g[1] == "verify"] == ["verify_b2_k4_c256", "verify_b2_k4_c1024"]


def test_context_buckets_multiply_decode_graphs_only():
    r = _runner(max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=128, enable_prefix_caching=False,
                additional_config={"neuron_config": {"decode_context_length_buckets": [256],
                                                     "num_batched_tokens_buckets": [128]}})
    names = [g[0] for g in r.graph_names()]
    assert names == ["prefill_s128", "prefill_s128_c1024", "decode_b1_c256", "decode_b1_c1024",
                     "decode_b2_c256", "decode_b2_c1024"]


def test_no_context_prefill_graphs_without_caching_or_segments():
    r = _runner(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128, enable_prefix_caching=False)
    assert [g[0] for g in r.graph_names()] == ["prefill_s32", "prefill_s64", "prefill_s128", "decode_b1", "decode_b2"]


def test_kernel_path_has_no_prefill_context_graphs():
    # The paged-attention kernel reads cached context through block tables: one prefill graph per size.
    r = _runner(use_kernels=True, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256,
                additional_config={"neuron_config": {"num_batched_tokens_buckets": [128, 256]}})
    assert [g[0] for g in r.graph_names()] == ["prefill_s128", "prefill_s256", "decode_b1", "decode_b4"]
    assert r._prefill_context(300) == 0


def test_input_signature_names_every_shape_dtype_and_stride():
    import torch

    from vllm_neuron.worker.compilation import input_signature

    a = (torch.zeros(2, 3), None, [(torch.zeros(4, dtype=torch.int32), torch.zeros(1))])
    assert input_signature(a) == input_signature((torch.ones(2, 3), None, [(torch.ones(4, dtype=torch.int32),
                                                                            torch.ones(1))]))
    for other in [(torch.zeros(2, 4), None, a[2]), (torch.zeros(2, 3, dtype=torch.float16), None, a[2]),
                  (torch.zeros(3, 2).t(), None, a[2]), (torch.zeros(2, 3), None, [(torch.zeros(8, dtype=torch.int32),
                                                                                  torch.zeros(1))])]:
        assert input_signature(other) != input_signature(a)


def test_warmup_reports_each_graph_and_whether_it_was_compiled_or_loaded():
    class FakeCompiler:
        backend, dir = "native", "/cache"

        def __init__(self):
            self.warmed = []

        def missing(self, names):
            return [n for n in names if n.startswith("decode")]

        def warm(self, name, run):
            run()
            self.warmed.append(name)

        def finish(self):
            pass

    r = _runner(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    r.backend, r.compiler = "native", FakeCompiler()
    ran = []
    r.warm_graph = ran.append
    seen = []
    r.warmup(lambda done, total, how: seen.append((done, total, how)))
    names = [g.name for g in r.graph_names()]
    assert ran == r.graph_names() and r.compiler.warmed == names
    assert seen == [(i, len(names), "compiled" if n.startswith("decode") else "loaded")
                    for i, n in enumerate(names, 1)]
