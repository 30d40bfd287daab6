"""Two engine steps through turboquant (prefill, then decode on the packed cache): the README's
serving example. Runs on the CPU, or on the GPU when the CUDA ops are built."""

import os, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
import turboquant as tq  # noqa: E402
from turboquant.attention import PagedAttentionLayer, StepMetadata

device = "cuda" if torch.cuda.is_available() and tq.has_cuda_kernels() else "cpu"
preset, block_size, hkv, hq, d = "turboquant_4bit_nc", 16, 8, 32, 128
layer = PagedAttentionLayer(num_blocks=64, block_size=block_size, num_kv_heads=hkv, head_dim=d,
                            preset=preset, device=device, dtype=torch.bfloat16)
block_table = torch.arange(64, dtype=torch.int32, device=device).view(2, 32)  # 2 sequences

def slots(seq, positions):  # cache slot of each new token
    return block_table[seq, positions // block_size].long() * block_size + positions % block_size

# Step 1: prefill 100 + 37 tokens (first chunks: SDPA on the raw K/V, stored packed).
lens = [100, 37]
q = torch.randn(sum(lens), hq, d, device=device, dtype=torch.bfloat16)
k = torch.randn(sum(lens), hkv, d, device=device, dtype=torch.bfloat16)
v = torch.randn_like(k)
meta = StepMetadata(query_start_loc=torch.tensor([0, 100, 137], dtype=torch.int32, device=device),
                    seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_table=block_table,
                    slot_mapping=torch.cat([slots(0, torch.arange(100, device=device)),
                                            slots(1, torch.arange(37, device=device))]), num_decodes=0)
out = layer.forward(q, k, v, meta, scale=d ** -0.5)

# Step 2: one decode token per sequence, attention straight on the packed cache.
q = torch.randn(2, hq, d, device=device, dtype=torch.bfloat16)
k, v = (torch.randn(2, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2))
meta = StepMetadata(torch.tensor([0, 1, 2], dtype=torch.int32, device=device),
                    torch.tensor([101, 38], dtype=torch.int32, device=device), block_table,
                    torch.stack([slots(0, torch.tensor(100, device=device)), slots(1, torch.tensor(37, device=device))]),
                    num_decodes=2)
out = layer.forward(q, k, v, meta, scale=d ** -0.5)
print(out.shape, out.dtype)
