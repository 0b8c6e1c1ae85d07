"""The memory plan (`fxfuse plan`, fxfuse/runner/memory_plan.py) against bytes counted by hand for the
aligned tiny model at tp=2 in each weight format, the fused-op workspace it assumes (capped as the op caps
it, or the PCIe all-reduce's), the fit check's message and its "would fit" suggestions, what the plan
says it assumed, the command's exit codes, and the run refusing a model that does not fit before any rank
starts."""

from __future__ import annotations

import json

import pytest
import torch

from quant_helpers import TINY_ALIGNED
from fxfuse.cli import main
from fxfuse.runner.memory_plan import PlanError, PlanInputs, activation_bytes, kv_cache_bytes, plan_memory, weight_bytes

# One rank's parameters of TINY_ALIGNED at tp=2 (hidden 64, 4 heads -> 2 per rank, q_lora 32, kv_lora 32,
# rope 16, nope 16, v 16, dense FFN 64 -> 32, 4 experts of 32 -> 16, vocab 128 -> 64), counted by hand.
BF16 = 2
COMMON = (64 * 64 + 64 * 64 + 64) * BF16                 # embedding and lm_head slices, final norm
NORMS = 2 * 64 * BF16                                      # input and post-attention norms, per layer
LATENT_NORMS = (32 + 32) * BF16                            # q_a_layernorm, kv_a_layernorm
ROUTER = 4 * 64 * 4 + 4 * 4                                # float32 router weight and bias
BF16_ATTENTION = (32 * 64 + 64 * 32 + 48 * 64 + 64 * 32 + 64 * 32) * BF16 + LATENT_NORMS  # q_a q_b kv_a kv_b o_proj
BF16_DENSE = 3 * 32 * 64 * BF16
BF16_EXPERTS = 3 * 4 * 16 * 64 * BF16
BF16_SHARED = 3 * 16 * 64 * BF16


def fp8(rows: int, cols: int, experts: int = 1, block: int = 128) -> int:
    """An FP8 weight's bytes plus its float32 block scales."""
    return experts * (rows * cols + -(-rows // block) * -(-cols // block) * 4)


def int4(rows: int, cols: int, experts: int, group: int = 32) -> int:
    """Packed INT4 words (8 per int32) plus bf16 group scales."""
    return experts * (rows * cols // 8 * 4 + rows * cols // group * BF16)


HAND = {
    "bf16": COMMON + 2 * (NORMS + BF16_ATTENTION) + BF16_DENSE + ROUTER + BF16_EXPERTS + BF16_SHARED,
    "fp8": COMMON + 2 * (NORMS + LATENT_NORMS + fp8(32, 64, block=16) + fp8(64, 32, block=16) + fp8(48, 64, block=16)
                         + 64 * 32 * BF16 + fp8(64, 32, block=16))
           + 2 * fp8(32, 64, block=16) + fp8(64, 32, block=16)
           + ROUTER + 2 * fp8(16, 64, 4, block=16) + fp8(64, 16, 4, block=16) + 2 * fp8(16, 64, block=16) + fp8(64, 16, block=16),
    "int4": COMMON + 2 * (NORMS + BF16_ATTENTION) + BF16_DENSE + ROUTER + 2 * int4(16, 64, 4, 16) + int4(64, 16, 4, 16) + BF16_SHARED,
}


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_weight_bytes_match_hand_count(fmt):
    assert weight_bytes(TINY_ALIGNED, 2, fmt, torch.bfloat16, fp8_block=(16, 16), int4_group=16) == HAND[fmt]
    assert max(HAND["int4"], HAND["fp8"]) < HAND["bf16"]


def test_kv_cache_activations_and_total():
    inputs = PlanInputs(tp=2, weights="int4", dtype=torch.bfloat16, batch=3, context=40, step_tokens=5, graph_widths=(1, 4),
                        fused_workspace=True, int4_group=16)
    plan = plan_memory(TINY_ALIGNED, inputs, "tiny-aligned")
    # MLA cache: 2 layers x 3 sequences x 40 positions x (32 latent + 16 rope) bf16, plus float32 cos/sin tables
    assert plan.kv_cache_bytes == kv_cache_bytes(TINY_ALIGNED, 3, 40, torch.bfloat16) == 2 * 3 * 40 * 48 * 2 + 2 * 40 * 8 * 4
    # attention scores of the widest step: 3 x 2 local heads x 5 tokens x 40 positions x (3 bf16 + 1 float32)
    attention = 3 * 2 * 5 * 40 * (3 * 2 + 4)
    logits = 15 * 128 * (2 // 2 + 2 + 4)  # local slice, gathered (bf16), float32
    dense = 15 * 32 * 3 * 2  # gate, up, their product (bf16) of the dense layer's 32 local features
    experts = 15 * 2 * (16 * 3 * 2 + 64 * 8)  # per routed row: 16 local features x 3 (bf16), float32 output and sum
    assert activation_bytes(TINY_ALIGNED, 2, 3, 5, 40, 2) == max(attention, logits, dense, experts) + 4 * 15 * 64 * 4
    assert plan.activation_bytes == 18240 + 15360  # the experts' rows dominate this tiny step
    assert plan.graph_output_bytes == 3 * (1 + 4) * 128 * 4  # each captured width keeps its float32 logits
    from fxfuse.op.runtime.workspace import workspace_bytes

    assert plan.workspace_bytes == workspace_bytes(2, 15, 64, torch.bfloat16)
    assert plan.weight_bytes == weight_bytes(TINY_ALIGNED, 2, "int4", torch.bfloat16, int4_group=16)
    assert plan.total_bytes == sum(plan.parts.values())
    assert plan_memory(TINY_ALIGNED, PlanInputs(tp=1, weights="bf16", dtype=torch.bfloat16, batch=3, context=40,
                                                step_tokens=5, fused_workspace=True)).workspace_bytes == 0


def test_not_fitting_says_what_would():
    inputs = PlanInputs(tp=2, weights="bf16", dtype=torch.bfloat16, batch=64, context=64, step_tokens=8, fp8_block=(16, 16), int4_group=16)
    plan = plan_memory(TINY_ALIGNED, inputs, "tiny-aligned")
    available = plan.total_bytes - 1
    with pytest.raises(PlanError) as info:
        plan.check(available, TINY_ALIGNED)
    message = str(info.value)
    assert message.startswith(f"tiny-aligned needs {plan.total_bytes / 1e9:.1f} GB per rank")
    batch = int(message.split("--batch ")[1].split()[0])
    fits = lambda **change: plan_memory(TINY_ALIGNED, PlanInputs(**{**inputs.__dict__, **change})).total_bytes <= available
    assert batch < 64 and fits(batch=batch) and not fits(batch=batch + 1)
    assert "--weights fp8 or int4" in message and fits(weights="int4")
    plan.check(plan.total_bytes, TINY_ALIGNED)  # exactly enough: no error


def test_a_preset_is_offered_only_the_formats_its_checkpoints_come_in(capsys):
    """Issue 41: DeepSeek-V3 was offered `--weights int4`, the format of Kimi-K2.5's checkpoints, not of its own."""
    argv = ["plan", "--preset", "deepseek-v3", "--weights", "bf16", "--tp", "8", "--gpu-memory-gb", "96"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "would fit: " in err and "--weights fp8" in err and "int4" not in err, err


def test_plan_command_prints_and_exits_by_fit(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "kimi-k2.5", "--weights", "int4", "--tp", "8", "--gpu-memory-gb", "96", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "weights int4" in printed and "fits in 96.00 GB" in printed
    saved = json.loads(out.read_text())
    assert saved["total_bytes"] == sum(saved["parts_bytes"].values()) and saved["tp"] == 8
    assert main(["plan", "--preset", "kimi-k2.5", "--weights", "bf16", "--tp", "8", "--gpu-memory-gb", "96"]) == 2
    captured = capsys.readouterr()
    assert "does NOT fit" in captured.out and "would fit: " in captured.err and "--weights int4" in captured.err


def test_run_refuses_a_layout_tp_cannot_split_before_starting_ranks(capsys):
    assert main(["run", "--weights", "fp8", "--tp", "2"]) == 2
    assert "cannot keep FP8 weights split by num_attention_heads at tensor-parallel size 2: each rank's 48 rows" in capsys.readouterr().err


def test_the_workspace_is_the_tensorrt_llm_kernels_capped_as_the_op_caps_it_or_the_pcie_ones():
    from dataclasses import replace

    from fxfuse.op.decide.policy import trtllm_token_cap
    from fxfuse.op.runtime.pcie_kernels import pcie_workspace_bytes
    from fxfuse.op.runtime.one_kernel_pcie import ONE_KERNEL_MAX_TOKENS, one_kernel_workspace_bytes
    from fxfuse.op.runtime.workspace import workspace_bytes

    inputs = PlanInputs(tp=2, weights="bf16", dtype=torch.bfloat16, batch=40_000, context=128, step_tokens=128, fused_workspace=True)
    nvlink = plan_memory(TINY_ALIGNED, inputs, "tiny-aligned")
    cap = trtllm_token_cap(2, 64)
    assert cap < 40_000 * 128 and nvlink.workspace_tokens == cap  # larger calls run the op's NCCL fallback
    assert nvlink.workspace_bytes == workspace_bytes(2, cap, 64, torch.bfloat16)
    assert f"FlashInfer's TensorRT-LLM kernel (NVLink / NVSwitch GPUs) for {cap} tokens" in nvlink.table()
    pcie = plan_memory(TINY_ALIGNED, replace(inputs, interconnect="pcie"), "tiny-aligned")
    assert pcie.workspace_tokens == 40_000 * 128
    one_kernel = one_kernel_workspace_bytes(2, ONE_KERNEL_MAX_TOKENS, 64, torch.bfloat16)  # a tuning file may choose it
    assert pcie.workspace_bytes == pcie_workspace_bytes(2, 40_000 * 128, 64, torch.bfloat16) + one_kernel
    assert "fxfuse tune pcie --world-size 2 --hidden 64 --max-tokens 5120000" in pcie.table()
    assert plan_memory(TINY_ALIGNED, replace(inputs, device="cpu"), "tiny-aligned").workspace_bytes == 0


def test_plan_gives_its_advice_and_says_what_it_assumed(capsys):
    """Kimi-K2.5 INT4 at tp 8 and batch 64 does not fit 96 GB: the advice is printed, though trying tp 16
    meets a TensorRT-LLM workspace above the kernel's limit (the plan caps it as the op does), and the
    plan says which workspace and reserve it assumed and that the vision encoder is not counted."""
    argv = ["plan", "--preset", "kimi-k2.5", "--weights", "int4", "--tp", "8", "--gpu-memory-gb", "96", "--batch", "64",
            "--context", "4096"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "does NOT fit in 96.00 GB" in out
    assert "- fused-op workspace: FlashInfer's TensorRT-LLM kernel (NVLink / NVSwitch GPUs) for 8192 tokens" in out
    assert "(--interconnect pcie; tune it with `fxfuse tune pcie`)" in out
    assert "- reserve: a fixed 2.15 GB for the CUDA context, cuBLAS and NCCL workspaces and the compiler" in out
    assert "- kimi-k2.5 is the text model of a multimodal checkpoint: its vision encoder is neither loaded" in out
    assert err.startswith("fxfuse: error: kimi-k2.5 needs ") and err.count("\n") == 1
    assert "would fit: --batch " in err and "--tp 16" in err
    assert "GiB" not in out + err  # one unit: GB
    assert main([*argv, "--interconnect", "pcie"]) == 2
    assert "fxfuse tune pcie --world-size 8 --hidden 7168 --max-tokens 8192" in capsys.readouterr().out
