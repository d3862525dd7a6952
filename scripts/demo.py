"""`make run`: start `moeserve serve` on the demo model, ask it two things with the official openai client, stop it.

Uses the bundled demo model (moeserve/demo_model) when it is there; otherwise builds a tiny random-weight
checkpoint with a tokenizer (its answers are gibberish: it only shows the plumbing) and says so.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from moeserve.bench.server_process import ServerProcess


def pick_model(tmp: Path) -> tuple[Path, str]:
    from moeserve.engine.llm_engine import demo_model_path

    bundled = demo_model_path()
    if (bundled / "config.json").is_file():
        return bundled, "the bundled demo model"
    from moeserve.bench.checkpoints import write_tiny_text_model

    folder = write_tiny_text_model(tmp / "tiny-random")
    return folder, "a tiny RANDOM-weight Qwen3-MoE (no demo model bundled yet): expect gibberish"


def main() -> int:
    import openai

    with tempfile.TemporaryDirectory() as tmp:
        model, what = pick_model(Path(tmp))
        print(f"demo: serving {what}: {model}", flush=True)
        with ServerProcess(model, "demo", quiet=False) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
            completion = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=40,
                                                   temperature=0.7, seed=0)
            print(f"\n--- completion ---\nOnce upon a time{completion.choices[0].text}")
            print(f"({completion.usage.prompt_tokens} prompt + {completion.usage.completion_tokens} generated tokens)")
            chat = client.chat.completions.create(model="demo", max_tokens=40, temperature=0.7, seed=0,
                                                  messages=[{"role": "user", "content": "Tell me about the fox."}])
            print(f"\n--- chat ---\nuser: Tell me about the fox.\nassistant: {chat.choices[0].message.content}\n",
                  flush=True)
        print(f"demo: server stopped (exit status {server.exit_status})")
        return 0 if server.exit_status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
