"""The child process of `run.run_job`: one vLLM engine serving one job.

    python -m kvtier.vllm.engines.child JOB.json OUT.json
    python -m kvtier.vllm.engines.child --stepwise JOB.json REPLY_FD  (see serve_stepwise)

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO


def serve(job: dict[str, Any]) -> dict[str, Any]:
    """Every round of the job in order; the engine's start time and every result."""
    engine = _Engine(job)
    try:
        rounds = [
            [engine.request(r, i) for i in range(len(rnd["prompts"]))]
            for r, rnd in enumerate(job["rounds"])
        ]
    finally:
        engine.shutdown()
    return {"start_s": engine.start_s, "rounds": rounds}


def serve_stepwise(job: dict[str, Any], commands: TextIO, replies: TextIO) -> None:
    """One request at a time, as the caller asks: a line `[round, index]` on `commands`
    serves that request and answers its result as a JSON line on `replies` (the first
    line answered is `{"start_s": ...}`, once the engine is up). A caller interleaves
    the requests of several engines this way, so that each pair shares the moment's
    load of the machine. Ends at the end of `commands`."""
    engine = _Engine(job)
    try:
        replies.write(json.dumps({"start_s": engine.start_s}) + "\n")
        replies.flush()
        for line in commands:
            r, i = json.loads(line)
            replies.write(json.dumps(engine.request(r, i)) + "\n")
            replies.flush()
    finally:
        engine.shutdown()


class _Engine:
    """A started, warmed-up engine that serves the job's requests by position."""

    def __init__(self, job: dict[str, Any]) -> None:
        os.environ.update(job["env"])  # before vLLM reads its environment
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.inputs import TokensPrompt

        from vllm import LLM, SamplingParams

        self.rounds: list[dict[str, Any]] = job["rounds"]
        self.prompt, self.params = TokensPrompt, SamplingParams
        kwargs = dict(job["engine"])
        if "kv_transfer_config" in kwargs:
            kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
        if "kv_events_config" in kwargs:
            kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
        started = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_s = time.perf_counter() - started
        try:
            # the first prefill pays one-time costs (~2 s: allocations, kernel set-up); a
            # prompt one token short of a block fills none, so the prefix cache stays empty
            warm = SamplingParams(max_tokens=2, temperature=0.0, logprobs=1, detokenize=False)
            warm_prompt = TokensPrompt(prompt_token_ids=[0] * (kwargs["block_size"] - 2))
            self.llm.generate([warm_prompt], warm, use_tqdm=False)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()

    def request(self, r: int, i: int) -> dict[str, Any]:
        """Request `i` of round `r`; a round's first request injects its faults and
        waits its settle first."""
        rnd = self.rounds[r]
        if i == 0:
            _inject(rnd.get("before", []))
            time.sleep(rnd["settle_s"])
        sampling = self.params(
            max_tokens=rnd["max_tokens"],
            temperature=0.0,
            logprobs=rnd["logprobs"],
            detokenize=False,
            ignore_eos=True,
        )
        prompt = self.prompt(prompt_token_ids=list(rnd["prompts"][i]))
        submitted = time.perf_counter()
        (out,) = self.llm.generate([prompt], sampling, use_tqdm=False)
        wall_s = time.perf_counter() - submitted
        completion = out.outputs[0]
        metrics = getattr(out, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        return {
            "token_ids": list(completion.token_ids),
            "logprobs": [
                {str(tok): lp.logprob for tok, lp in pos.items()}
                for pos in completion.logprobs or []
            ],
            "num_cached_tokens": out.num_cached_tokens or 0,
            "wall_s": wall_s,
            "ttft_s": float(ttft) if ttft else None,
        }


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
        elif action == "corrupt_redis":
            _corrupt_redis(*arg.split(" ", 1))
        elif action == "redis_resetstat":
            _redis_resetstat(arg)
        else:
            raise ValueError(
                f"unknown fault {action!r}; known: kill, corrupt, corrupt_redis, redis_resetstat"
            )


@contextmanager
def _redis(url: str) -> Iterator[Any]:
    """A client of the Redis at `url` for one fault (redis-py imported only here)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        yield client
    finally:
        client.close()


def _corrupt_redis(url: str, pattern: str) -> None:
    """Flip the last byte of every value whose key matches `pattern` (a KV head's values)."""
    with _redis(url) as client:
        # (string values only: the layout's set naming its groupings shares the prefix)
        for key in client.scan_iter(match=pattern, count=1000, _type="string"):
            value = client.get(key)
            if isinstance(value, bytes) and value:
                client.setrange(key, len(value) - 1, bytes([value[-1] ^ 0xFF]))


def _redis_resetstat(url: str) -> None:
    with _redis(url) as client:
        client.config_resetstat()


def main(argv: list[str]) -> int:
    if argv[0] == "--stepwise":  # --stepwise JOB.json REPLY_FD
        job = json.loads(Path(argv[1]).read_text())
        with os.fdopen(int(argv[2]), "w") as replies:
            serve_stepwise(job, sys.stdin, replies)
        return 0
    job_path, out_path = (Path(a) for a in argv)
    result = serve(json.loads(job_path.read_text()))
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
