"""transformers' `generate()` on a tensor-parallel model (`tp_plan="auto"`, 2 gloo ranks, a tiny Llama), compiled
with fxfuse the three ways a transformers user meets it (issue 41):

- `CompileConfig(backend="fxfuse")` left at its defaults: a static cache makes `generate` compile the forward
  with `mode="reduce-overhead"`, which fxfuse hands to its inner Inductor (it used to fail: `fxfuse_backend()
  got an unexpected keyword argument 'mode'`);
- the default dynamic cache, with the forward compiled by the user (`torch.compile(model.forward,
  backend="fxfuse")`);
- `fxfuse.post_grad_pass()` in Inductor's post-grad slot, with `CompileConfig(backend="inductor")`.

Each generates the tokens of the uncompiled model exactly (float32, greedy) and fuses every all-reduce site of
the graphs it compiled. On CPU `generate` compiles only when told it may (`CompileConfig._compile_all_devices`,
transformers' own switch; on GPUs it compiles by itself).
"""

from __future__ import annotations

import pytest
import torch

from fxfuse.runner.launch import run_on_ranks

pytestmark = pytest.mark.slow
NEW_TOKENS = 4


def _generate_three_ways(ctx) -> dict:
    import transformers as tf
    from test_third_party_tp import _apply_hf_tp_plan, _tiny_hf_model
    from torch._dynamo.utils import counters

    import fxfuse

    torch._inductor.config.compile_threads = 1  # no compile worker pool per rank on a small CPU
    model = _apply_hf_tp_plan(_tiny_hf_model("hf_llama_tp_plan", torch.float32), ctx.world_size)
    prompt = (torch.arange(10).view(2, 5) * 7) % 128
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    results = {}
    with torch.no_grad():
        results["eager"] = model.generate(prompt, **greedy)

        def fused_sites(run) -> tuple:
            torch._dynamo.reset()
            counters.clear()
            tokens = run()
            return tokens, counters["fxfuse"]["allreduces_before"], counters["fxfuse"]["fused_with_residual"] + \
                counters["fxfuse"]["fused_without_residual"]

        config = tf.CompileConfig(backend="fxfuse")
        config._compile_all_devices = True
        results["compile_config"] = fused_sites(lambda: model.generate(
            prompt, cache_implementation="static", compile_config=config, **greedy))

        forward = model.forward
        model.forward = torch.compile(forward, backend="fxfuse")
        results["dynamic_cache"] = fused_sites(lambda: model.generate(prompt, **greedy))
        model.forward = forward

        slot = torch._inductor.config.post_grad_custom_post_pass
        torch._inductor.config.post_grad_custom_post_pass = fxfuse.post_grad_pass(slot)
        config = tf.CompileConfig(backend="inductor")
        config._compile_all_devices = True
        try:
            results["post_grad_pass"] = fused_sites(lambda: model.generate(
                prompt, cache_implementation="static", compile_config=config, **greedy))
        finally:
            torch._inductor.config.post_grad_custom_post_pass = slot
    return results


def test_generate_compiled_with_fxfuse_three_ways_gives_eagers_tokens():
    for rank in run_on_ranks(_generate_three_ways, 2, timeout_s=900):
        for way in ("compile_config", "dynamic_cache", "post_grad_pass"):
            tokens, sites, fused = rank[way]
            assert torch.equal(tokens, rank["eager"]), way
            assert sites > 0 and fused == sites, (way, sites, fused)  # every all-reduce of every graph compiled
