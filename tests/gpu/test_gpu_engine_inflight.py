"""In-flight weight updates (GeneratorConfig.weight_update = "inflight") on vLLM's multi-process engine
with CUDA graphs: the engine core keeps stepping while this process applies new weights, so the switch
point is wherever the update lands. Checked: the request survives the preemption with the tokens it had
(nothing lost or rewritten), its last token and logprob are what the new weights give for the whole
prefix computed afresh (the running request's KV cache was recomputed, not kept), and the old weights
give something else there. The exact per-token check on both sides of the switch runs on CPU
(tests/integration/test_generator_engine.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_inflight_update_on_a_multi_process_engine(tmp_path):
    from safetensors.torch import load_file
    from vllm.sampling_params import RequestOutputKind

    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine
    from generator.inputs import Request
    from policy.builder import build_checkpoint
    from tasks.prompt import render_prompt_ids

    ckpt = build_checkpoint("tiny-fullvocab", seed=0, out=tmp_path / "ckpt", device="cuda")
    torch.cuda.empty_cache()
    engine = Engine(
        ckpt,
        EngineConfig(
            enforce_eager=False, gpu_memory_utilization=0.2, max_model_len=1024, keep_rollback_copy=False
        ),
        SamplingConfig(max_tokens=16, eval_temperature=0.0),
        run_dir=tmp_path / "run",
    )
    try:
        assert not engine.in_process
        ids = render_prompt_ids(engine.tokenizer, "Count to ten.", 0)
        _, prompt, params = engine.admit(Request(ids, [], split="test"))
        params = params.clone()
        params.max_tokens, params.ignore_eos = 384, True
        params.output_kind = RequestOutputKind.CUMULATIVE
        engine.add_request("r0", prompt, params)
        before: list[int] = []
        while len(before) < 4:
            outs = [o for o in engine.step() if o.request_id == "r0"]
            if outs:
                assert not outs[-1].finished
                before = list(outs[-1].outputs[0].token_ids)
        original = load_file(str(ckpt / "model.safetensors"))
        engine.apply_weights([(k, -v) for k, v in original.items()], version=1, running=True)
        final = None
        while final is None:
            final = next((o.outputs[0] for o in engine.step() if o.request_id == "r0" and o.finished), None)
        tokens, logprobs = list(final.token_ids), engine.completion(final).logprobs
        assert len(tokens) == len(logprobs) == 384 and tokens[: len(before)] == before

        def last_token():  # greedy next token + logprob after prompt + tokens[:-1]
            (result,) = engine.generate([Request(ids + tokens[:-1], [], split="test")])
            return result.completions[0].token_ids[0], result.completions[0].logprobs[0]

        token, lp = last_token()
        assert token == tokens[-1] and abs(lp - logprobs[-1]) <= 0.05, (token, lp, tokens[-1], logprobs[-1])
        engine.apply_weights(original.items(), version=2)
        old_token, old_lp = last_token()
        assert old_token != tokens[-1] or abs(old_lp - logprobs[-1]) > 0.1
    finally:
        engine.close()
