"""`make run`: start `moeserve serve` on the demo model, ask it two things with the official openai client, stop it.

Uses the bundled demo model (moeserve/demo_model) when it is there; otherwise builds a tiny random-weight
checkpoint with a tokenizer (its answers are gibberish: it only shows the plumbing) and says so.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def pick_model(tmp: Path) -> tuple[Path, str]:
    from moeserve.engine.llm_engine import demo_model_path

    bundled = demo_model_path()
    if (bundled / "config.json").is_file():
        return bundled, "the bundled demo model"
    import json

    from tokenizers import Tokenizer

    from moeserve.bench.checkpoints import write_tiny_checkpoint, write_tiny_tokenizer

    folder = tmp / "tiny-random"
    write_tiny_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    write_tiny_checkpoint(folder, "qwen3_moe", vocab_size=tok.get_vocab_size(), eos_token_id=eos)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder, "a tiny RANDOM-weight Qwen3-MoE (no demo model bundled yet): expect gibberish"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the server did not become healthy within {timeout:.0f}s")


def main() -> int:
    import openai

    with tempfile.TemporaryDirectory() as tmp:
        model, what = pick_model(Path(tmp))
        print(f"demo: serving {what}: {model}", flush=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "moeserve", "serve", str(model), "--port", str(port),
                                 "--served-model-name", "demo"], env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            wait_healthy(url, proc)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none")
            completion = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=40,
                                                   temperature=0.7, seed=0)
            print(f"\n--- completion ---\nOnce upon a time{completion.choices[0].text}")
            print(f"({completion.usage.prompt_tokens} prompt + {completion.usage.completion_tokens} generated tokens)")
            chat = client.chat.completions.create(model="demo", max_tokens=40, temperature=0.7, seed=0,
                                                  messages=[{"role": "user", "content": "Tell me about the fox."}])
            print(f"\n--- chat ---\nuser: Tell me about the fox.\nassistant: {chat.choices[0].message.content}\n",
                  flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        print(f"demo: server stopped (exit status {code})")
        return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
