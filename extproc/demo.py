"""`make demo`: Envoy + the gateway + simulated engines on this machine, and requests through them.

No cluster, no Redis, no GPU: two simulated llama2-7b replicas (an A100 and a slower V100) stand in
for real engines. Run with --keep to leave the stack up and try curl yourself.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from extproc.localstack import LocalStack, Proc, free_port, http_get

MODEL = "llama2-7b"
REPLICAS = [("a100-0", "A100-80GB"), ("v100-0", "V100")]


def start_engine(name: str, gpu: str, log_dir: Path, time_scale: float) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(f"engine-{name}", [sys.executable, "-m", "extproc", "engine-sim", "--gpu", gpu,
                                   "--model", MODEL, "--port", str(port), "--name", name,
                                   "--time-scale", str(time_scale)], log_dir)
    proc.wait_ready(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200)
    return proc, port


def chat(url: str, content: str, max_tokens: int, strategy: str | None = None) -> tuple[dict, dict]:
    headers = {"Content-Type": "application/json"}
    if strategy:
        headers["routing-strategy"] = strategy
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as resp:
        return dict(resp.headers), json.loads(resp.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", action="store_true", help="leave the stack running until Ctrl-C")
    parser.add_argument("--time-scale", type=float, default=10.0,
                        help="simulated seconds per wall second for the engines")
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args(argv)

    log_dir = Path(tempfile.mkdtemp(prefix="extproc-demo-"))
    engines = []
    stack = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
    try:
        pods = []
        for name, gpu in REPLICAS:
            proc, port = start_engine(name, gpu, log_dir, args.time_scale)
            engines.append(proc)
            pods.append({"name": name, "address": f"127.0.0.1:{port}", "deployment": f"{MODEL}-{name[:4]}",
                         "labels": {"gpu": gpu}})
            print(f"engine  {name:8} simulated {gpu:10} at 127.0.0.1:{port}")
        stack.write_config({"models": {MODEL: {"pods": pods}},
                            "routing": {"default_strategy": "least-request"}})
        stack.start_gateway()
        stack.start_envoy()
        print(f"gateway ext_proc :{stack.extproc_port}, metrics {stack.admin_url}/metrics")
        print(f"envoy   {stack.url}  (logs in {log_dir})\n")

        headers, answer = chat(stack.url, "Say this is a test!", 16)
        print("one request through Envoy -> gateway -> pod:")
        print(f"  target-pod={headers['target-pod']} routing-strategy={headers['routing-strategy']} "
              f"request-id={headers['request-id']}")
        print(f"  usage={answer['usage']}\n")

        # least-request alone (AIBrix's auto-blend would add load-balance to it), then load-balance
        for strategy in ("round-robin", "least-request,load-balance:0", "load-balance"):
            start = time.monotonic()
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda i: chat(stack.url, "x" * 400, 128, strategy)[0]["target-pod"],
                                        range(args.requests)))
            split = {name: results.count(name) for name, _ in REPLICAS}
            print(f"{args.requests} requests, 16 at a time, {strategy:28}: {split} "
                  f"in {time.monotonic() - start:.1f}s wall")
        print("\nlearned capacity (output tokens/s), from the gateway's own token tally:")
        for name, gpu in REPLICAS:
            cap = stack.sample("extproc_pod_capacity_tokens_per_second", pod=name)
            print(f"  {name:8} {gpu:10} {cap:8.0f}")
        print("\nrequests per pod (extproc_requests_total):")
        for line in stack.metrics().splitlines():
            if line.startswith("extproc_requests_total"):
                print("  " + line)
        if args.keep:
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            print(f"\ntry:\n  curl {stack.url}/v1/chat/completions -H 'Content-Type: application/json' "
                  f"-d '{body}'\nCtrl-C to stop.")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 0
    finally:
        stack.stop()
        for proc in engines:
            proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
