"""Bucket lists: defaults, the seeds' validation rules and error texts, selection, names."""

import pytest

from vllm_neuron.config import buckets as B


# --- defaults ---

@pytest.mark.parametrize(
    "max_tokens, expected",
    [
        (2048, [128, 256, 512, 1024, 2048]),
        (128, [128]),
        (3000, [128, 256, 512, 1024, 2048, 3000]),  # a non-power-of-two max is kept as largest
        (100, [100]),  # below the 128 floor: the max alone
        (129, [128, 129]),
    ],
)
def test_default_prefill_buckets(max_tokens, expected):
    assert B.default_prefill_buckets(max_tokens) == expected


@pytest.mark.parametrize(
    "max_seqs, expected",
    [(1, [1]), (8, [1, 2, 4, 8]), (6, [1, 2, 4, 6]), (256, [1, 2, 4, 8, 16, 32, 64, 128, 256])],
)
def test_default_decode_buckets(max_seqs, expected):
    assert B.default_decode_buckets(max_seqs) == expected


@pytest.mark.parametrize("bad", [0, -4, True, 2.0])
def test_defaults_reject_non_positive_limits(bad):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        B.default_prefill_buckets(bad)
    with pytest.raises(ValueError, match="max_num_seqs"):
        B.default_decode_buckets(bad)


def test_defaults_always_validate_against_their_max():
    for m in (1, 5, 127, 128, 500, 8192):
        assert B.validate_prefill_buckets(B.default_prefill_buckets(m), m)[-1] == m
        assert B.validate_decode_buckets(B.default_decode_buckets(m), m)[-1] == m


# --- prefill / decode validation ---

def test_prefill_largest_must_equal_max():
    with pytest.raises(ValueError) as e:
        B.validate_prefill_buckets([128, 256, 512], 1024)
    msg = str(e.value)
    assert "num_batched_tokens_buckets=[128, 256, 512]" in msg
    assert "must equal max_num_batched_tokens=1024" in msg
    # larger than the max is also wrong
    with pytest.raises(ValueError, match="max_num_batched_tokens=256"):
        B.validate_prefill_buckets([128, 512], 256)


def test_decode_largest_must_equal_max():
    with pytest.raises(ValueError) as e:
        B.validate_decode_buckets([1, 2, 4], 8)
    assert "num_seqs_buckets=[1, 2, 4]" in str(e.value)
    assert "must equal max_num_seqs=8" in str(e.value)
    assert B.validate_decode_buckets([1, 2, 4, 8], 8) == [1, 2, 4, 8]


@pytest.mark.parametrize("bad", [[256, 128, 512], [128, 128, 512]])
def test_unsorted_or_duplicate_lists_are_rejected_not_fixed(bad):
    with pytest.raises(ValueError, match="strictly ascending"):
        B.validate_prefill_buckets(bad, 512)


@pytest.mark.parametrize("bad", [[], [0, 8], [-1, 8], [1.5, 8], ["4", 8], [True, 8], None, "8"])
def test_malformed_lists_name_the_option(bad):
    with pytest.raises(ValueError, match="num_seqs_buckets"):
        B.validate_decode_buckets(bad, 8)


# --- decode context-length buckets ---

def test_context_buckets_rules():
    assert B.validate_context_buckets(None, 4096, 32) is None
    assert B.validate_context_buckets([512, 1024], 4096, 32) == [512, 1024]
    with pytest.raises(ValueError, match="strictly ascending"):
        B.validate_context_buckets([1024, 512], 4096, 32)
    with pytest.raises(ValueError, match="< max_model_len=4096"):
        B.validate_context_buckets([512, 4096], 4096, 32)
    with pytest.raises(ValueError, match="divisible by 128"):
        B.validate_context_buckets([500], 4096, 4)
    with pytest.raises(ValueError, match="divisible by block_size=256"):
        B.validate_context_buckets([384], 4096, 256)


def test_context_bucket_list_always_ends_with_max_model_len():
    assert B.context_buckets(None, 4096) == [4096]
    assert B.context_buckets([], 4096) == [4096]
    assert B.context_buckets([512, 1024], 4096) == [512, 1024, 4096]


# --- kv segment buckets (seeds' prefix caching constraints) ---

def test_kv_segment_rules():
    assert B.validate_kv_segment_buckets(None, [128, 256], 32) is None
    assert B.validate_kv_segment_buckets([2048], [2048], 32) == [2048]
    with pytest.raises(ValueError, match=r"values must be in \{512, 1024, 2048, 4096, 8192\}"):
        B.validate_kv_segment_buckets([1536], [1536], 32)
    with pytest.raises(ValueError, match="divisible by block_size=1024"):
        B.validate_kv_segment_buckets([512], [512], 1024)
    with pytest.raises(ValueError, match="only a single segment size"):
        B.validate_kv_segment_buckets([512, 1024], [512, 1024], 32)
    with pytest.raises(ValueError, match="must currently be identical") as e:
        B.validate_kv_segment_buckets([2048], [1024, 2048], 32)
    assert "num_batched_tokens_buckets=[1024, 2048]" in str(e.value)


# --- selection ---

@pytest.mark.parametrize(
    "n, expected", [(0, 128), (1, 128), (128, 128), (129, 256), (256, 256), (257, 1024), (1024, 1024)]
)
def test_select_bucket_smallest_fit(n, expected):
    assert B.select_bucket([128, 256, 1024], n) == expected


def test_select_bucket_beyond_largest():
    with pytest.raises(ValueError, match=r"^Request exceeds largest bucket: n=1025 > 1024$"):
        B.select_bucket([128, 256, 1024], 1025)
    with pytest.raises(ValueError, match="empty"):
        B.select_bucket([], 1)


# --- names and table ---

def test_bucket_names():
    assert B.bucket_name("prefill", 1024) == "prefill_s1024"
    assert B.bucket_name("prefill", 1024, 4096) == "prefill_s1024_c4096"
    assert B.bucket_name("decode", 8) == "decode_b8"
    assert B.bucket_name("decode", 8, 512) == "decode_b8_c512"
    with pytest.raises(ValueError, match="prefill, decode"):
        B.bucket_name("encode", 8)


def test_bucket_names_for_graph_set():
    assert B.bucket_names([128, 256], [1, 2], [4096]) == [
        "prefill_s128", "prefill_s256", "decode_b1", "decode_b2",
    ]
    names = B.bucket_names([128], [1, 2], [512, 4096])
    assert names == ["prefill_s128", "decode_b1_c512", "decode_b1_c4096", "decode_b2_c512", "decode_b2_c4096"]
    assert B.bucket_names([64, 128], [1], [4096], prefill_with_context=True) == [
        "prefill_s64", "prefill_s64_c4096", "prefill_s128", "prefill_s128_c4096", "decode_b1"]
    for n in names:
        kind, size, ctx = B.parse_bucket_name(n)
        assert B.bucket_name(kind, size, ctx or None) == n


def test_format_bucket_table():
    table = B.format_bucket_table([128, 256], [1, 2, 4], [512, 4096])
    lines = table.splitlines()
    assert lines[0] == "Buckets: 8 graphs"  # 2 prefill + 3 batch x 2 context
    assert any("num_batched_tokens_buckets" in l and l.endswith(": 128, 256") for l in lines)
    assert any("num_seqs_buckets" in l and l.endswith(": 1, 2, 4") for l in lines)
    assert any("context" in l and l.endswith(": 512, 4096") for l in lines)
    assert B.format_bucket_table([128], [1, 2], [4096]).splitlines()[0] == "Buckets: 3 graphs"


@pytest.mark.parametrize("max_seqs, expected", [(16, [1, 4, 16]), (1, [1]), (32, [1, 4, 16, 32]), (3, [1, 3])])
def test_default_decode_buckets_by_four(max_seqs, expected):
    assert B.default_decode_buckets(max_seqs, factor=4) == expected


def test_default_prefill_buckets_from_another_start():
    # The CPU default starts at 32 (compute-bound prefill: padding costs in full); the seeds' start is 128.
    assert B.default_prefill_buckets(512, start=32) == [32, 64, 128, 256, 512]
    assert B.default_prefill_buckets(100, start=32) == [32, 64, 100]
    assert B.default_prefill_buckets(16, start=32) == [16]
