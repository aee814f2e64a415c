"""A GPT-style decoder with a KV cache, exported from torch (`torch.onnx.export(...,
dynamo=False)`, opset 17) as gpt_kv.onnx: input `ids` [batch, seq] (int64) and, per layer, the
past keys and values `past_<2l>`, `past_<2l+1>` [batch, heads, past, head size] with the past
length symbolic (0 at the first step); outputs `logits` [batch, seq, vocab] and the presents
`present_<i>` (the past with this step's keys and values appended).

Pre-LayerNorm blocks (LayerNorm, fused QKV Linear, causal softmax attention over past + new
keys, projection, residual; LayerNorm, Linear, exact GELU, Linear, residual), learned
positions from the past length on, a final LayerNorm and an unbiased head. Small enough to
keep in the repository (d 32, 2 layers, vocab 96: ~140 KB), so that the tests need no torch;
rerun `python tests/data/make_gpt.py` (torch installed) to rewrite it. Used by
tests/test_decoder.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

VOCAB, D, HEADS, LAYERS, POSITIONS = 96, 32, 4, 2, 64


def export(path: Path) -> None:
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x, past_k, past_v):  # type: ignore[no-untyped-def]
            b, s, _ = x.shape
            heads = [t.view(b, s, HEADS, D // HEADS).transpose(1, 2)
                     for t in self.qkv(self.ln1(x)).split(D, dim=-1)]
            q, k, v = heads[0], torch.cat([past_k, heads[1]], 2), torch.cat([past_v, heads[2]], 2)
            total = k.shape[2]
            att = (q @ k.transpose(-1, -2)) / math.sqrt(D // HEADS)
            rows = torch.arange(s).unsqueeze(1) + (total - s)
            att = att.masked_fill(torch.arange(total).unsqueeze(0) > rows, float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, D))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x)))), k, v

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(POSITIONS, D)
            self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

        def forward(self, ids, *past):  # type: ignore[no-untyped-def]
            p, s = past[0].shape[2], ids.shape[1]
            x = self.wte(ids) + self.wpe(torch.arange(p, p + s).unsqueeze(0))
            present = []
            for n, block in enumerate(self.blocks):
                x, k, v = block(x, past[2 * n], past[2 * n + 1])
                present += [k, v]
            return (self.head(self.ln(x)), *present)

    ids = torch.randint(0, VOCAB, (1, 5))
    past = [torch.zeros(1, HEADS, 3, D // HEADS) for _ in range(2 * LAYERS)]
    names = [f"past_{i}" for i in range(2 * LAYERS)]
    axes = {"ids": {0: "batch", 1: "seq"}, **{n: {0: "batch", 2: "past"} for n in names}}
    torch.onnx.export(GPT().eval(), (ids, *past), str(path), input_names=["ids", *names],
                      output_names=["logits"] + [f"present_{i}" for i in range(2 * LAYERS)],
                      dynamic_axes=axes, opset_version=17, dynamo=False)


if __name__ == "__main__":
    export(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("gpt_kv.onnx"))
