"""Train the small Mixture-of-Experts demo model that ships in ``moeserve/demo_model/``.

Corpus: Jane Austen's six novels (public domain), taken from the Debian package
``r-cran-janeaustenr`` 1.0.0-1 (MIT licence; the CRAN package *janeaustenr* 1.0.0 by Julia
Silge, texts from Project Gutenberg with its header/licence already removed). See
``scripts/demo_corpus.py`` for how the package is fetched (``apt-get download``) and read.
Five novels are used for training; *Persuasion* is held out entirely (not seen by the
tokenizer nor the model) and used for perplexity and routing statistics.

Pipeline (all seeded, CPU only, plain torch + transformers' model code):

1. byte-level BPE tokenizer (``tokenizers``) trained on the five training novels, with
   ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` as special tokens and a ChatML chat
   template;
2. ``Qwen3MoeForCausalLM`` from a small ``Qwen3MoeConfig`` (8 experts, top-2), trained with
   AdamW + warmup/cosine schedule, with the router load-balancing loss at a modest
   coefficient. A small share of paragraphs is wrapped in the chat template (user: first
   sentence, assistant: rest of the paragraph, then ``<|im_end|>``) so the model learns to
   answer inside the template and to stop;
3. held-out perplexity, expert-selection counts per layer on held-out text, a greedy sample;
4. saved in bfloat16 safetensors with tokenizer, chat template, generation config, a model
   card (README.md) and ``demo_stats.json``.

Usage (the shipped model was made with the first command)::

    nice -n 10 python scripts/train_demo_model.py --max-minutes 45
    python scripts/train_demo_model.py --steps 60 --out /tmp/smoke   # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shlex
import sys
import time
from pathlib import Path

import demo_corpus  # scripts/demo_corpus.py: a script's own folder is importable
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "moeserve" / "demo_model"

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PROMPT = "Once upon a time"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train the moeserve demo MoE model (CPU).")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--cache", type=Path, default=demo_corpus.DEFAULT_CACHE)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=384)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=650)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--chat-frac", type=float, default=0.08, help="share of paragraphs wrapped as chat")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for the training forward pass")
    ap.add_argument("--experts-impl", default="grouped_mm", help="transformers experts implementation")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="safety stop for a busy machine: end training early after this long (0: off); "
                         "a run that stops early is not reproducible and says so")
    ap.add_argument("--eval-tokens", type=int, default=0, help="cap on held-out tokens (0: whole book)")
    return ap.parse_args()


# ----------------------------------------------------------------------------- data


def split_first_sentence(paragraph: str) -> tuple[str, str] | None:
    m = re.match(r"(.{20,300}?[.!?][\"']?)\s+(\S.*)", paragraph, flags=re.S)
    if not m or len(m.group(2)) < 40:
        return None
    return m.group(1), m.group(2)


def build_training_text(books: dict[str, str], chat_frac: float, rng: random.Random) -> str:
    """Training stream: the books with <|endoftext|> between them; some paragraphs as chat turns."""
    parts = []
    for text in books.values():
        paragraphs = text.split("\n\n")
        out = []
        for p in paragraphs:
            pair = split_first_sentence(p) if rng.random() < chat_frac else None
            if pair:
                user, assistant = pair
                out.append(
                    f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}\n"
                )
            else:
                out.append(p + "\n\n")
        parts.append("".join(out).rstrip("\n") + "\n")
    return EOS.join(parts) + EOS


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# ----------------------------------------------------------------------------- model


def make_config(args: argparse.Namespace, tokenizer):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.moe_inter * 2,  # only used by dense layers; there are none
        moe_intermediate_size=args.moe_inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(EOS),
        use_cache=True,
    )


def cosine_lr(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.lr * args.min_lr_frac
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def heldout_eval(model, ids: torch.Tensor, seq_len: int, num_experts: int, top_k: int):
    """Perplexity over non-overlapping windows, and expert-selection counts per layer."""
    model.eval()
    nll, count = 0.0, 0
    counts = None
    for start in range(0, ids.numel() - 1, seq_len):
        window = ids[start : start + seq_len + 1]
        if window.numel() < 2:
            break
        x = window[:-1].unsqueeze(0)
        out = model(input_ids=x, output_router_logits=True)
        logits = out.logits[0].float()
        nll += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += window.numel() - 1
        layer_counts = []
        for rl in out.router_logits:
            sel = rl.float().topk(top_k, dim=-1).indices.flatten()
            layer_counts.append(torch.bincount(sel, minlength=num_experts))
        stacked = torch.stack(layer_counts)
        counts = stacked if counts is None else counts + stacked
    model.train()
    return math.exp(nll / count), count, counts


def routing_summary(counts: torch.Tensor) -> list[dict]:
    rows = []
    for layer, c in enumerate(counts.double()):
        share = c / c.sum()
        nz = share[share > 0]
        entropy = float(-(nz * nz.log()).sum())
        rows.append(
            {
                "layer": layer,
                "shares": [round(float(s), 4) for s in share],
                "max_share": round(float(share.max()), 4),
                "min_share": round(float(share.min()), 4),
                "max_over_min": round(float(share.max() / share.min()), 2) if share.min() > 0 else None,
                "entropy_bits": round(entropy / math.log(2), 3),
                "entropy_frac_of_uniform": round(entropy / math.log(len(share)), 4),
            }
        )
    return rows


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, new_tokens: int) -> str:
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    model.train()
    return tokenizer.decode(out[0], skip_special_tokens=False)


# ----------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/train_demo_model.py", *sys.argv[1:]])
    t_start = time.time()

    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    books = demo_corpus.load_books(args.cache)
    heldout_text = books.pop(demo_corpus.HELDOUT_BOOK)
    train_text = build_training_text(books, args.chat_frac, random.Random(args.seed))
    print(f"corpus: {len(books)} training books, {len(train_text):,} chars; held out "
          f"{demo_corpus.BOOKS[demo_corpus.HELDOUT_BOOK]!r}, {len(heldout_text):,} chars", flush=True)

    tokenizer = train_tokenizer(list(books.values()), args.vocab)
    train_ids = torch.tensor(tokenizer(train_text, verbose=False).input_ids, dtype=torch.long)
    heldout_ids = torch.tensor(tokenizer(heldout_text, verbose=False).input_ids, dtype=torch.long)
    chars_per_token = len(heldout_text) / heldout_ids.numel()
    if args.eval_tokens:
        heldout_ids = heldout_ids[: args.eval_tokens]
    print(f"tokenizer: vocab {len(tokenizer)}; train tokens {train_ids.numel():,}; "
          f"held-out tokens {heldout_ids.numel():,} ({chars_per_token:.2f} chars/token)",
          flush=True)

    config = make_config(args, tokenizer)
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config)
    model.set_experts_implementation(args.experts_impl)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_active = n_params - n_expert + n_expert * args.top_k // args.experts
    print(f"model: {n_params / 1e6:.2f}M parameters ({n_expert / 1e6:.2f}M in experts; "
          f"{n_active / 1e6:.2f}M active per token)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    n_windows = train_ids.numel() - args.seq_len - 1
    model.train()
    t_train = time.time()
    tokens_seen, log_lm, log_aux, log_n = 0, 0.0, 0.0, 0
    for step in range(args.steps):
        lr = cosine_lr(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, n_windows, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + args.seq_len] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            out = model(input_ids=x, labels=x, output_router_logits=True)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += x.numel()
        aux = float(out.aux_loss.detach())
        log_lm += float(loss.detach()) - args.aux_coef * aux
        log_aux += aux
        log_n += 1
        over_time = args.max_minutes and time.time() - t_train > 60 * args.max_minutes
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps or over_time:
            elapsed = time.time() - t_train
            print(f"step {step + 1:5d}/{args.steps}  lm_loss {log_lm / log_n:.3f}  aux {log_aux / log_n:.3f}  "
                  f"lr {lr:.2e}  {tokens_seen / elapsed:,.0f} tok/s  {elapsed / 60:.1f} min", flush=True)
            log_lm, log_aux, log_n = 0.0, 0.0, 0
        if over_time:
            print(f"STOPPED EARLY at step {step + 1} of {args.steps} (--max-minutes {args.max_minutes})")
            break
    steps_done = step + 1
    train_seconds = time.time() - t_train
    print(f"trained {steps_done} steps, {tokens_seen:,} tokens "
          f"({tokens_seen / train_ids.numel():.2f} epochs) in {train_seconds / 60:.1f} min", flush=True)

    # Evaluate the weights exactly as shipped: round-trip through bfloat16.
    model = model.to(torch.bfloat16).float()
    ppl, n_eval, counts = heldout_eval(model, heldout_ids, args.seq_len, args.experts, args.top_k)
    routing = routing_summary(counts)
    print(f"held-out perplexity ({demo_corpus.BOOKS[demo_corpus.HELDOUT_BOOK]}, {n_eval:,} tokens, "
          f"bf16 weights): {ppl:.2f}", flush=True)
    for row in routing:
        print(f"layer {row['layer']}: shares {row['shares']}  max/min {row['max_over_min']}  "
              f"entropy {row['entropy_bits']} bits ({row['entropy_frac_of_uniform']:.1%} of uniform)")
    sample = greedy(model, tokenizer, PROMPT, 40)
    chat_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about Mr. Darcy."}], tokenize=False, add_generation_prompt=True
    )
    chat_sample = greedy(model, tokenizer, chat_prompt, 60)
    print(f"greedy sample: {sample!r}\nchat sample: {chat_sample!r}", flush=True)

    # ------------------------------------------------------------------ save
    args.out.mkdir(parents=True, exist_ok=True)
    for old in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "special_tokens_map.json", "generation_config.json", "config.json"):
        (args.out / old).unlink(missing_ok=True)
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        eos_token_id=[tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.convert_tokens_to_ids(EOS),
        do_sample=False,
        max_new_tokens=128,
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    make_compatible(args.out)
    total_seconds = time.time() - t_start
    stats = {
        "command": f"nice -n 10 {command}",
        "corpus": {
            "debian_package": f"{demo_corpus.DEB_PACKAGE}={demo_corpus.DEB_VERSION}",
            "sha256": demo_corpus.DEB_SHA256,
            "train_books": [demo_corpus.BOOKS[b] for b in books],
            "heldout_book": demo_corpus.BOOKS[demo_corpus.HELDOUT_BOOK],
            "train_tokens": train_ids.numel(),
        },
        "parameters": n_params,
        "expert_parameters": n_expert,
        "active_parameters_per_token": n_active,
        "steps": steps_done,
        "steps_planned": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_seen": tokens_seen,
        "train_minutes": round(train_seconds / 60, 1),
        "total_minutes": round(total_seconds / 60, 1),
        "heldout_perplexity": round(ppl, 2),
        "heldout_tokens": n_eval,
        "routing": routing,
        "greedy_sample": sample,
        "chat_sample": chat_sample,
    }
    (args.out / "demo_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    (args.out / "README.md").write_text(model_card(stats, config))
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"saved to {args.out} ({size / 1e6:.1f} MB); total wall time {total_seconds / 60:.1f} min", flush=True)


def make_compatible(out: Path) -> None:
    """Write the config keys older readers expect next to transformers 5's own spelling.

    transformers 5 saves the expert count as ``num_local_experts``; Qwen3-MoE checkpoints (and
    transformers 4.x) use ``num_experts``. Its tokenizer class ``TokenizersBackend`` is spelled
    ``PreTrainedTokenizerFast`` in 4.x, which 5.x still accepts as an alias.
    """
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_path = out / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_path.write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")


def model_card(s: dict, config) -> str:
    routing_rows = "\n".join(
        f"| {r['layer']} | {r['max_share']:.3f} | {r['min_share']:.3f} | {r['max_over_min']} | "
        f"{r['entropy_bits']:.3f} | {r['entropy_frac_of_uniform']:.1%} |"
        for r in s["routing"]
    )
    return f"""# moeserve demo model

A tiny Mixture-of-Experts causal language model (`Qwen3MoeForCausalLM`, {s['parameters'] / 1e6:.1f}M
parameters, {config.num_experts} experts per layer, top-{config.num_experts_per_tok} routing,
{config.num_hidden_layers} layers, hidden size {config.hidden_size}, vocabulary {config.vocab_size}) trained
from scratch on a CPU, shipped with moeserve so that the engine, the server and the tests have a real,
trained MoE checkpoint that needs no download. It writes Austen-flavoured English; it knows nothing else.

- **Corpus**: Jane Austen's novels (public domain), from the Debian package
  `{s['corpus']['debian_package']}` (MIT licence; CRAN *janeaustenr* by Julia Silge).
  Trained on {', '.join(s['corpus']['train_books'])}; *{s['corpus']['heldout_book']}* held out.
- **Tokenizer**: byte-level BPE trained on the same text; special tokens `<|endoftext|>` (bos/eos/pad),
  `<|im_start|>`, `<|im_end|>`; ChatML chat template in `chat_template.jinja`.
- **Training**: `{s['command']}` — {s['steps']} steps of {s['batch']}x{s['seq_len']} tokens
  ({s['tokens_seen']:,} tokens), AdamW + cosine schedule, router load-balancing loss coefficient
  {config.router_aux_loss_coef}; {s['train_minutes']} min of training, {s['total_minutes']} min in all,
  on 2 shared CPU cores.
- **Held-out perplexity** ({s['corpus']['heldout_book']}, {s['heldout_tokens']:,} tokens, windows of {s['seq_len']},
  bfloat16 weights): **{s['heldout_perplexity']}**.
- **Weights**: bfloat16 safetensors.

Greedy completion of "Once upon a time":

> {s['greedy_sample']}

Expert selection on the held-out book (share of top-{config.num_experts_per_tok} slots per expert):

| layer | max share | min share | max/min | entropy (bits) | of uniform |
| --- | --- | --- | --- | --- | --- |
{routing_rows}

Full per-expert shares are in `demo_stats.json`. Rebuild with `scripts/train_demo_model.py`; see
`docs/demo-model.md`.
"""


if __name__ == "__main__":
    main()
