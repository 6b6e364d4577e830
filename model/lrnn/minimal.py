"""The block-diagonal LRNN (``transition_norm="column"``) in plain PyTorch, to read before model/lrnn/model.py: the same
outputs, none of the speed. Each layer is a pre-norm residual block around h_k = A(u_k) h_{k-1} + B u_k, run
sequentially from h_0 = 0. ``lrnn(tokens, model.state_dict(), ...)`` equals ``model(tokens)``."""

from __future__ import annotations

import torch
from torch.nn import functional as F

Params = dict[str, torch.Tensor]


def transitions(u: torch.Tensor, p: Params, num_blocks: int, block_size: int, p_norm: float) -> torch.Tensor:
    """u: (B, d) -> A(u): (B, H, b, b), every column's p-norm <= 1. ``p``: names after ``recurrence.``."""
    if "in_proj.weight" in p:  # rank r: the code U u from the first r rows of [U; B]
        rank = p["transition.weight"].shape[1]
        code = F.linear(u, p["in_proj.weight"][:rank], p["in_proj.bias"][:rank]) * (u.shape[-1] / rank)  # (B, r)
        generated = F.linear(code, p["transition.weight"], p["transition.bias"])  # (B, H b^2)
    else:
        generated = F.linear(u, p["transition.weight"], p["transition.bias"])  # (B, H b^2)
    blocks = generated.view(-1, num_blocks, block_size, block_size)  # (B, H, b, b)
    norms = blocks.abs().pow(p_norm).sum(dim=-2, keepdim=True).pow(1 / p_norm)  # (B, H, 1, b) column p-norms
    return blocks / norms.clamp(min=1.0)


def inputs(u: torch.Tensor, p: Params, num_blocks: int) -> torch.Tensor:
    """u: (B, d) -> B u: (B, H, b)."""
    if "in_proj.weight" in p:  # the rows of [U; B] after the first r
        rank = p["transition.weight"].shape[1]
        projected = F.linear(u, p["in_proj.weight"][rank:], p["in_proj.bias"][rank:])
    else:
        projected = F.linear(u, p["input_proj.weight"], p["input_proj.bias"])
    return projected.view(u.shape[0], num_blocks, -1)


def recurrent_block(
    x: torch.Tensor, p: Params, num_blocks: int, block_size: int, p_norm: float, eps: float
) -> torch.Tensor:
    """x: (B, T, d) -> (B, T, d). ``p``: names after ``blocks.i.``."""
    batch, length, d = x.shape
    recurrence = {name.removeprefix("recurrence."): value for name, value in p.items()}
    u = F.layer_norm(x, (d,), p["ln_1.weight"], p["ln_1.bias"], eps)  # (B, T, d)
    state = x.new_zeros(batch, num_blocks, block_size)  # h_0: (B, H, b)
    states = []
    for k in range(length):  # the sequential scan
        a = transitions(u[:, k], recurrence, num_blocks, block_size, p_norm)  # (B, H, b, b)
        state = (a @ state.unsqueeze(-1)).squeeze(-1) + inputs(u[:, k], recurrence, num_blocks)  # (B, H, b)
        states.append(state.flatten(-2))  # (B, H b)
    readout = F.linear(torch.stack(states, dim=1), p["recurrence.out_proj.weight"], p["recurrence.out_proj.bias"])
    x = x + readout  # (B, T, d)
    u = F.layer_norm(x, (d,), p["ln_2.weight"], p["ln_2.bias"], eps)
    hidden = F.gelu(F.linear(u, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"]))  # (B, T, d_ff)
    return x + F.linear(hidden, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])


def lrnn(
    tokens: torch.Tensor, params: Params, num_blocks: int, block_size: int, p_norm: float = 1.2, eps: float = 1e-5
) -> torch.Tensor:
    """tokens: (B, T) -> logits (B, T, output_size). ``params``: a BlockDiagonalLRNN's state_dict."""
    layers = 1 + max(int(name.split(".")[1]) for name in params if name.startswith("blocks."))
    x = F.embedding(tokens, params["embedding.embed.weight"])  # (B, T, d)
    for i in range(layers):
        prefix = f"blocks.{i}."
        p = {name.removeprefix(prefix): value for name, value in params.items() if name.startswith(prefix)}
        x = recurrent_block(x, p, num_blocks, block_size, p_norm, eps)
    x = F.layer_norm(x, x.shape[-1:], params["ln_f.weight"], params["ln_f.bias"], eps)
    if "embedding.label_head.weight" in params:  # a transducer's labels
        return F.linear(x, params["embedding.label_head.weight"], params["embedding.label_head.bias"])
    return F.linear(x, params["embedding.embed.weight"])  # a language model's head, tied to the embedding
