"""RegularGPT in plain PyTorch, to read before model/regulargpt/model.py: the same outputs, none of the speed. Each
thick layer l runs the K shared blocks with attention masks of dilation C**l (a T x T mask, null keys as extra columns),
and position t is read after D(t) thick layers. ``regulargpt(tokens, model.state_dict(), ...)`` equals
``model(tokens)``."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

Params = dict[str, torch.Tensor]


def adaptive_depth(position: int, chunk_size: int) -> int:
    """D(t): the fewest thick layers whose dilated receptive field reaches position 0 from ``position``."""
    depth = 1
    while chunk_size**depth < position + 1:
        depth += 1
    return depth


def dilated_attention(x: torch.Tensor, p: Params, n_heads: int, chunk_size: int, dilation: int) -> torch.Tensor:
    """x: (B, T, d) after ln_1 -> (B, T, d). ``p``: one block's parameters, names after ``attention.``."""
    batch, length, d = x.shape
    q, k, v = F.linear(x, p["heads.c_attn.weight"], p["heads.c_attn.bias"]).split(d, dim=-1)  # (B, T, d) each
    q, k, v = (t.view(batch, length, n_heads, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
    bias = p["relative_bias"]  # (H, C)
    mask = x.new_full((n_heads, length, length + chunk_size), -math.inf)  # (H, T, T + C): keys, then C null slots
    for t in range(length):
        for j in range(chunk_size):
            key = t - j * dilation
            column = key if key >= 0 else length + j  # the key, or slot j's null column
            mask[:, t, column] = bias[:, j]
    if "null_key" in p:
        k = torch.cat([k, p["null_key"][None, :, None].expand(batch, -1, chunk_size, -1)], dim=2)  # (B, H, T + C, hd)
        v = torch.cat([v, p["null_value"][None, :, None].expand(batch, -1, chunk_size, -1)], dim=2)
    else:
        mask = mask[..., :length]  # out-of-range keys are simply masked
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask  # (B, H, T, T [+ C])
    out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, d)  # (B, T, d)
    return F.linear(out, p["heads.c_proj.weight"], p["heads.c_proj.bias"])


def block(
    x: torch.Tensor, p: Params, n_heads: int, chunk_size: int, dilation: int, eps: float, post_norm: bool
) -> torch.Tensor:
    """One block, pre- or post-norm: x (B, T, d) -> (B, T, d); ``p``: names after ``blocks.k.``."""
    d = x.shape[-1]
    attention = {name.removeprefix("attention."): value for name, value in p.items()}

    def mlp(u: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(F.linear(u, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"]))  # (B, T, d_ff)
        return F.linear(hidden, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])

    def ln(x: torch.Tensor, k: int) -> torch.Tensor:
        return F.layer_norm(x, (d,), p[f"ln_{k}.weight"], p[f"ln_{k}.bias"], eps)

    if post_norm:
        x = ln(x + dilated_attention(x, attention, n_heads, chunk_size, dilation), 1)
        return ln(x + mlp(x), 2)
    x = x + dilated_attention(ln(x, 1), attention, n_heads, chunk_size, dilation)
    return x + mlp(ln(x, 2))


def regulargpt(
    tokens: torch.Tensor,
    params: Params,
    n_heads: int,
    chunk_size: int,
    thickness: int,
    eps: float = 1e-5,
    post_norm: bool = False,
) -> torch.Tensor:
    """tokens: (B, T) -> logits (B, T, output_size). ``params``: a RegularGPT's state_dict."""
    blocks = [
        {name.removeprefix(f"blocks.{k}."): value for name, value in params.items() if name.startswith(f"blocks.{k}.")}
        for k in range(thickness)
    ]
    length = tokens.shape[1]
    depths = torch.tensor([adaptive_depth(t, chunk_size) for t in range(length)])  # (T,)
    x = F.embedding(tokens, params["embedding.embed.weight"])  # (B, T, d)
    out = torch.zeros_like(x)
    for layer in range(int(depths.max())):
        for p in blocks:  # the same K blocks at every thick layer
            x = block(x, p, n_heads, chunk_size, chunk_size**layer, eps, post_norm)
        if "level_codes" in params:  # each position becomes the code of the label read from it
            x = params["level_codes"][head(x, params, eps).argmax(dim=-1)]
        out[:, depths == layer + 1] = x[:, depths == layer + 1]  # the positions whose depth is layer + 1
    return head(out, params, eps)


def head(x: torch.Tensor, params: Params, eps: float) -> torch.Tensor:
    """Hidden states (..., d) -> logits (..., output_size): the final LayerNorm, then the head."""
    x = F.layer_norm(x, x.shape[-1:], params["ln_f.weight"], params["ln_f.bias"], eps)
    if "embedding.label_head.weight" in params:  # a transducer's labels
        return F.linear(x, params["embedding.label_head.weight"], params["embedding.label_head.bias"])
    return F.linear(x, params["embedding.embed.weight"])  # a language model's head, tied to the embedding
