"""``vllm serve`` with rotkv's backend answers OpenAI-style requests: starts the server on a model directory,
waits for ``/health``, sends ``/v1/completions`` (greedy) and ``/v1/chat/completions`` requests, checks each
answer (HTTP 200, a non-empty text, the token counts in ``usage``), and records the server's lines that show
which attention backend it chose. One JSON per run; the server is stopped at the end whatever happened.

    python benchmarks/vllm_serve_check.py --model-dir ~/vllm-models/smollm2 \\
        --rotkv-config '{"preset": "oscar-mix", "artifact": "artifacts/oscar-mix.safetensors"}' --out serve.json

``--method bf16`` serves the same model with vLLM's default backend, for a side-by-side answer.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
CHAT = [{"role": "user", "content": "Name three primary colours, one per line."}]
BACKEND_MARKS = ("rotkv", "CUSTOM", "Using AttentionBackend", "attention backend")


def serve_command(model_dir: str, method: str, port: int, rotkv_config: dict, max_model_len: int,
                  gpu_memory_utilization: float, python: str = sys.executable) -> list[str]:
    """The ``vllm serve`` command line (through ``python -m vllm.entrypoints.cli.main``, so that the vLLM on
    PYTHONPATH serves without a console script)."""
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", str(max_model_len), "--gpu-memory-utilization", str(gpu_memory_utilization),
           "--no-enable-prefix-caching", "--served-model-name", "model"]
    if method == "rotkv":
        cmd += ["--attention-backend", "CUSTOM", "--block-size", "16",
                "--additional-config", json.dumps({"rotkv": rotkv_config})]
    elif method != "bf16":
        raise ValueError(f"--method must be rotkv or bf16, got {method!r}")
    return cmd


def check_answer(kind: str, status: int, body: dict | None) -> list[str]:
    """What is wrong with one answer (empty when it is a good one)."""
    bad = []
    if status != 200:
        bad.append(f"HTTP {status}")
    if not isinstance(body, dict) or not body.get("choices"):
        return bad + ["no choices"]
    choice = body["choices"][0]
    text = choice.get("text") if kind == "completion" else (choice.get("message") or {}).get("content")
    if not isinstance(text, str) or not text.strip():
        bad.append("empty text")
    usage = body.get("usage") or {}
    if not usage.get("completion_tokens"):
        bad.append("no completion_tokens in usage")
    if not usage.get("prompt_tokens"):
        bad.append("no prompt_tokens in usage")
    return bad


def backend_lines(log_text: str, limit: int = 12) -> list[str]:
    """The server log's lines that name the attention backend (rotkv's or vLLM's choice)."""
    out = [ln.strip() for ln in log_text.splitlines() if any(m in ln for m in BACKEND_MARKS)]
    return out[:limit]


def _post(url: str, payload: dict, timeout: float) -> tuple[int, dict | None, float]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read())
        except Exception:
            body = None
        return e.code, body, time.perf_counter() - t0


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def run(args) -> dict:
    cfg = json.loads(args.rotkv_config or '{"preset": "quarot-int2"}')
    cmd = serve_command(args.model_dir, args.method, args.port, cfg, args.max_model_len, args.gpu_memory_utilization)
    base = f"http://127.0.0.1:{args.port}"
    log_path = args.out + ".server.log"
    res = {"schema": "rotkv-vllm-serve/1", "method": args.method, "rotkv_config": cfg if args.method == "rotkv" else None,
           "command": cmd, "model_dir": args.model_dir, "requests": [], "ok": False}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.perf_counter()
        try:
            while not _healthy(base):
                if proc.poll() is not None:
                    res["error"] = f"server exited with {proc.returncode} before /health answered"
                    break
                if time.perf_counter() - t0 > args.start_timeout:
                    res["error"] = f"/health did not answer within {args.start_timeout} s"
                    break
                time.sleep(2)
            else:
                res["startup_s"] = round(time.perf_counter() - t0, 1)
                for p in PROMPTS:
                    st, body, dt = _post(base + "/v1/completions", {"model": "model", "prompt": p, "max_tokens":
                                         args.max_tokens, "temperature": 0}, args.request_timeout)
                    res["requests"].append({"kind": "completion", "prompt": p, "status": st, "seconds": round(dt, 3),
                                            "problems": check_answer("completion", st, body), "answer": body})
                st, body, dt = _post(base + "/v1/chat/completions", {"model": "model", "messages": CHAT, "max_tokens":
                                     args.max_tokens, "temperature": 0}, args.request_timeout)
                res["requests"].append({"kind": "chat", "messages": CHAT, "status": st, "seconds": round(dt, 3),
                                        "problems": check_answer("chat", st, body), "answer": body})
                res["ok"] = all(not r["problems"] for r in res["requests"])
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except Exception:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except Exception:
                    pass
    with open(log_path) as f:
        text = f.read()
    res["backend_lines"] = backend_lines(text)
    res["server_log_tail"] = text.splitlines()[-30:]
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--method", default="rotkv", choices=["rotkv", "bf16"])
    ap.add_argument("--rotkv-config", default=None, help='additional_config["rotkv"] as JSON (default quarot-int2)')
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = run(args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for r in res["requests"]:
        ans = r["answer"] or {}
        ch = (ans.get("choices") or [{}])[0]
        text = ch.get("text") if r["kind"] == "completion" else (ch.get("message") or {}).get("content")
        print(f"{r['kind']}: HTTP {r['status']} {r['seconds']} s problems={r['problems']} text={text!r}")
    print("backend:", *res["backend_lines"][:4], sep="\n  ")
    print("ok" if res["ok"] else f"FAILED: {res.get('error', 'see problems')}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
