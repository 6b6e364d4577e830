"""Training and evaluation batches: padding, masking, the length curriculum, final-label counting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from training.data.batches import (
    IGNORE_INDEX,
    FinalLabelSet,
    LengthCurriculum,
    TrainingData,
    _final_logits_in_chunks,
    count_correct_final,
    encode_strings,
    label_batch,
)
from training.data.tasks import get_task


def test_label_batch_pads_right_and_masks_the_padding() -> None:
    batch = label_batch(get_task("parity_check"), ["0110", "1", "11"])
    assert batch.tokens.tolist() == [[0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert batch.targets.tolist() == [
        [0, 1, 0, 0],
        [1, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX],
        [1, 0, IGNORE_INDEX, IGNORE_INDEX],
    ]
    assert batch.lengths.tolist() == [4, 1, 2]


def test_uniform_curriculum_keeps_the_range() -> None:
    curriculum = LengthCurriculum(1, 40)
    assert curriculum.length_range(1) == curriculum.length_range(1000) == (1, 40)


def test_growing_curriculum_rises_linearly_to_the_maximum() -> None:
    curriculum = LengthCurriculum(1, 40, kind="growing", start=10, ramp_steps=31)
    longest = [curriculum.length_range(step)[1] for step in (1, 16, 31, 500)]
    assert longest == [10, 25, 40, 40]


def test_training_data_respects_the_curriculum_and_batch_size() -> None:
    data = TrainingData(get_task("sum_mod5"), 16, LengthCurriculum(3, 7))
    batch = data.batch(np.random.default_rng(0), step=1)
    assert batch.tokens.shape[0] == 16
    assert int(batch.lengths.min()) >= 3
    assert int(batch.lengths.max()) == batch.tokens.shape[1] <= 7


class ParityOracle(nn.Module):
    """final_logits computes parity exactly (inverted when ``wrong``): a model whose accuracy is known."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.wrong = wrong
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the module a device

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        real = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]  # (B, T)
        parity = ((tokens * real).sum(dim=1) + int(self.wrong)) % 2  # (B,)
        return nn.functional.one_hot(parity, 2).float()  # (B, 2)


@pytest.mark.parametrize("wrong, expected", [(False, 50), (True, 0)])
def test_count_correct_final_counts_argmax_hits(wrong: bool, expected: int) -> None:
    examples = FinalLabelSet.draw(get_task("parity_check"), np.random.default_rng(1), 50, (41, 90))
    assert [len(s) for s in examples.strings] == sorted(len(s) for s in examples.strings)
    assert count_correct_final(ParityOracle(wrong), examples, "01", batch_size=7) == expected


def test_final_labels_in_chunks_equal_final_logits() -> None:
    """Through the cache, a few symbols per call, rows of several lengths in one batch: the same logits."""
    from model.config import LRNNConfig
    from model.registry import build_model

    task = get_task("induction_heads")
    torch.manual_seed(0)
    model = build_model(
        "lrnn", LRNNConfig(vocab_size=17, num_labels=18, d_model=16, block_size=2, num_blocks=4, d_ff=16, n_layers=2)
    ).eval()
    examples = FinalLabelSet.draw(task, np.random.default_rng(3), 9, (3, 40))
    expected = count_correct_final(model, examples, task.alphabet, batch_size=4)
    for chunk_symbols in (1, 7, 1000):
        assert count_correct_final(model, examples, task.alphabet, 4, chunk_symbols) == expected
    strings = list(examples.strings)
    tokens, lengths = encode_strings(strings, task.alphabet)
    whole = model.final_logits(tokens, lengths)  # (9, 18)
    chunked = _final_logits_in_chunks(model, strings, task.alphabet, 7, torch.device("cpu"))  # (9, 18)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5)


def test_shards_partition_the_set() -> None:
    examples = FinalLabelSet.draw(get_task("parity_check"), np.random.default_rng(2), 11, (1, 9))
    shards = [examples.shard(rank, 3) for rank in range(3)]
    assert sorted(s for shard in shards for s in shard.strings) == sorted(examples.strings)
