"""A GGUF's tokenizer as the `tokenizers` library's tokenizer.json, and its tokenizer_config.json, from the metadata.

llama.cpp's byte-level BPE (tokenizer.ggml.model = "gpt2"): the vocabulary (`tokens`), the merges (`merges`,
"a b" each), the token types (`token_type`: 3 control tokens are special added tokens, 4 user-defined ones plain
added tokens, matched in text before the BPE as llama.cpp does), and the pre-tokenizer (`pre`) as the regexes
llama.cpp's llama-vocab.cpp splits with, in order, each splitting the pieces of the last (tokenizers' `Split`,
isolated); then bytes to the GPT-2 alphabet. No normalizer (llama.cpp applies none). `add_bos_token` /
`add_eos_token` add those around each encoded text. The chat template is `tokenizer.chat_template`.
A model or pre-tokenizer not listed here is refused in one line naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moeserve.checkpoint.gguf.header import read_header
from moeserve.errors import CheckpointError

CONTROL, USER_DEFINED = 3, 4
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (regexes, ignore_merges), as llama-vocab.cpp maps them
PRE_TOKENIZERS: Mapping[str, tuple[tuple[str, ...], bool]] = MappingProxyType({
    **{name: ((_GPT2,), False) for name in ("gpt-2", "gpt2", "phi-2", "olmo", "mpt")},
    **{name: ((_QWEN2,), False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
    "qwen35": ((_QWEN35,), False),
    **{name: ((_LLAMA3,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{name: ((_GPT4O,), False) for name in ("gpt-4o", "llama4")},
    "deepseek-v3": (_DEEPSEEK3, False),
    **{name: ((_LLAMA3,), True) for name in ("glm4", "glm5")},  # llama.cpp's CHATGLM4 regex is Llama 3's
    "chatglm-bpe": ((_LLAMA3,), False),
})
NO_BOS_PRE = frozenset({"glm4", "glm5", "chatglm-bpe"})  # llama.cpp clears their bos id: never added


def gguf_tokenizer(path: Path) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config) of the GGUF at `path` (module docstring)."""
    meta = read_header(path).metadata
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        hint = " (the file has no vocabulary: pass skip_tokenizer_init=True)" if model in (None, "no_vocab") else ""
        raise CheckpointError(f"{path}: tokenizer.ggml.model={model!r} is not read by moeserve (gpt2: byte-level "
                              f"BPE){hint}")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges", [])
    if not isinstance(tokens, list) or not tokens or not isinstance(merges, list):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens / merges missing or not lists of strings")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: tokenizer.ggml.pre={pre!r} is not read by moeserve; known: "
                              f"{', '.join(sorted(PRE_TOKENIZERS))}")
    regexes, ignore_merges = PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a token listed twice keeps its first id, as llama.cpp's token_to_id
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": t == CONTROL} for i, (tok, t) in enumerate(zip(tokens, types, strict=False))
             if t in (CONTROL, USER_DEFINED) and vocab[tok] == i]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            *({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in regexes),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": _post_processor(meta, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }
    return json.dumps(spec, ensure_ascii=False), _tokenizer_config(meta, tokens)


def _special(meta: Mapping[str, Any], tokens: list[str], key: str) -> tuple[int, str] | None:
    tid = meta.get(f"tokenizer.ggml.{key}_token_id")
    return (tid, tokens[tid]) if isinstance(tid, int) and 0 <= tid < len(tokens) else None


def _post_processor(meta: Mapping[str, Any], tokens: list[str]) -> dict[str, Any] | None:
    """BOS / EOS around each text when the file says to add them (llama.cpp's add_bos / add_eos)."""
    single: list[dict[str, Any]] = [{"Sequence": {"id": "A", "type_id": 0}}]
    specials = {}
    for key, first in (("bos", True), ("eos", False)):
        tok = _special(meta, tokens, key)
        if key == "bos" and meta.get("tokenizer.ggml.pre") in NO_BOS_PRE:
            continue
        if meta.get(f"tokenizer.ggml.add_{key}_token") and tok is not None:
            item = {"SpecialToken": {"id": tok[1], "type_id": 0}}
            single = [item, *single] if first else [*single, item]
            specials[tok[1]] = {"id": tok[1], "ids": [tok[0]], "tokens": [tok[1]]}
    if not specials:
        return None
    return {"type": "TemplateProcessing", "single": single, "pair": single, "special_tokens": specials}


def _tokenizer_config(meta: Mapping[str, Any], tokens: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for key in ("bos", "eos", "unk", "pad"):
        tok = _special(meta, tokens, key)
        if tok is not None:
            config[f"{key}_token"] = tok[1]
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config
