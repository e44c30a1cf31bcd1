"""The child process of `run.run_job`: one vLLM engine serving one job.

    python -m kvtier.vllm.engines.child JOB.json OUT.json

JOB.json is `EngineJob.to_json()`; OUT.json gets the engine's start time and, per round
and per request, the generated tokens, their logprobs, `num_cached_tokens` and timings.
vLLM spawns its engine processes, hence the `__main__` guard.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def serve(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(job["env"])  # before vLLM reads its environment
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    kwargs = dict(job["engine"])
    if "kv_transfer_config" in kwargs:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
    if "kv_events_config" in kwargs:
        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    try:
        # the first prefill pays one-time costs (~2 s: allocations, kernel set-up); a
        # prompt one token short of a block fills none, so the prefix cache stays empty
        warm = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, detokenize=False)
        warm_prompt = TokensPrompt(prompt_token_ids=[0] * (kwargs["block_size"] - 2))
        llm.generate([warm_prompt], warm, use_tqdm=False)
        rounds = [_serve_round(llm, rnd, SamplingParams, TokensPrompt) for rnd in job["rounds"]]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"start_s": start_s, "rounds": rounds}


def _inject(faults: list[list[str]]) -> None:
    """The round's faults (see `Round.before`), injected while the engine runs."""
    for action, arg in faults:
        if action == "kill":
            os.kill(int(arg), signal.SIGKILL)
        elif action == "corrupt":
            for path in glob.glob(arg):
                with open(path, "r+b") as file:
                    file.seek(-1, os.SEEK_END)
                    last = file.read(1)
                    file.seek(-1, os.SEEK_END)
                    file.write(bytes([last[0] ^ 0xFF]))
        else:
            raise ValueError(f"unknown fault {action!r}; known: kill, corrupt")


def _serve_round(llm: Any, rnd: dict[str, Any], params: Any, prompt: Any) -> list[dict[str, Any]]:
    _inject(rnd.get("before", []))
    sampling = params(
        max_tokens=rnd["max_tokens"],
        temperature=0.0,
        logprobs=rnd["logprobs"],
        detokenize=False,
        ignore_eos=True,
    )
    results = []
    time.sleep(rnd["settle_s"])
    for ids in rnd["prompts"]:
        submitted = time.perf_counter()
        (out,) = llm.generate([prompt(prompt_token_ids=list(ids))], sampling, use_tqdm=False)
        wall_s = time.perf_counter() - submitted
        completion = out.outputs[0]
        metrics = getattr(out, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        results.append(
            {
                "token_ids": list(completion.token_ids),
                "logprobs": [
                    {str(tok): lp.logprob for tok, lp in pos.items()}
                    for pos in completion.logprobs or []
                ],
                "num_cached_tokens": out.num_cached_tokens or 0,
                "wall_s": wall_s,
                "ttft_s": float(ttft) if ttft else None,
            }
        )
    return results


def main(argv: list[str]) -> int:
    job_path, out_path = (Path(a) for a in argv)
    result = serve(json.loads(job_path.read_text()))
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
