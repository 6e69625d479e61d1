"""Block-packed vision attention (pure): attention segments (an image, or one video frame) packed
first-fit-decreasing into fixed-size blocks; each block is one batch row of the encoder graph and
attends only within itself, so the attention costs blocks x block_size^2 instead of patches^2.
"""
from __future__ import annotations


def pack_ffd(sizes: list[int], block_size: int) -> list[list[int]]:
    """Indices of `sizes` per block: largest first, each into the first block with room (ties keep
    their input order). Raises ValueError for a segment larger than a block."""
    for i, n in enumerate(sizes):
        if n > block_size:
            raise ValueError(f"an image or video frame of {n} patches does not fit encoder_attention_block_size="
                             f"{block_size}; lower max_pixels (--mm-processor-kwargs) or raise the block size")
    blocks: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for b, free in enumerate(room):
            if sizes[i] <= free:
                blocks[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            blocks.append([i])
            room.append(block_size - sizes[i])
    return blocks


def check_buckets(buckets: list[int], block_size: int) -> list[int]:
    """Encoder input buckets in patches must be whole blocks (encoder_neuron_config.input_buckets makes them)."""
    bad = [b for b in buckets if b < block_size or b % block_size]
    if bad:
        raise ValueError(f"num_encoder_input_buckets={list(buckets)} must be multiples of encoder_attention_block_size="
                         f"{block_size} (in patches); got {bad}")
    return sorted(set(buckets))
