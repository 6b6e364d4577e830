"""Each model family in plain PyTorch, short enough to read first: the real model's weights, the same outputs
(tests/model/test_minimal.py), none of the speed or the serving paths."""
